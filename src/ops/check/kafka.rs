//! The broker's side: it answers and accepts our security settings (the
//! publisher's own start-up check, so a refused certificate or password shows
//! librdkafka's reason), and the topics the relay will produce to exist, with
//! their `max.message.bytes`.
//!
//! # Which topics
//!
//! A record's topic is the row's `topic` column, else `kafka.topic_template` with
//! `{aggregate_type}` and `{event_type}` replaced by the row's values. What can be
//! known before the rows exist is only a template without placeholders, so:
//!
//! - a static template is always checked;
//! - `check` also renders the topics of the most recent [`SAMPLE_ROWS`] outbox rows
//!   (newest first by the id column, the topic column first, as the mapper does) and
//!   checks at most [`MAX_TOPICS`] distinct ones: the topics in use now, including
//!   the unsent backlog's. Topics of aggregate types never written yet cannot be
//!   known, and the detail says so;
//! - `run` checks the static template only (reading rows would slow its start on
//!   a large outbox), and a missing topic does not stop it: its events wait under
//!   `relay.on_config_error = "block"` until the topic is created.
//!
//! Existence is read from a metadata request for all topics: naming a topic would
//! let a broker with `auto.create.topics.enable` create it.
//!
//! # Delivery
//!
//! `kafka.delivery` says what the topics' consumers see after a crash. Exactly-once
//! needs the progress topic (`migrate` creates it) and a broker that commits Kafka
//! transactions, which only a transaction shows: `run` makes one at start and
//! refuses a broker that cannot (exit 3); `check` says so.

use std::time::Duration;

use tokio_postgres::Client;

use super::Check;
use crate::config::{Config, DeliveryMode, quote_ident, quote_qualified};
use crate::kafka::{BrokerError, BrokerUnavailable, Publisher};

/// How many recent outbox rows `check` renders topics from.
pub(super) const SAMPLE_ROWS: i64 = 1000;

/// How many distinct topics `check` looks up at most.
pub(super) const MAX_TOPICS: usize = 20;

/// How long the broker may take to answer.
const TIMEOUT: Duration = Duration::from_secs(10);

/// Where the topics to check come from.
#[derive(Clone, Copy)]
pub(super) enum Sample<'a> {
    /// The static template, and the recent rows when a connection is given.
    Recent(Option<&'a Client>),
    /// The static template only (`run`).
    TemplateOnly,
}

/// `kafka.broker`: [`Publisher::check_broker`].
pub(super) async fn broker(publisher: &Publisher, config: &Config) -> Check {
    const NAME: &str = "kafka.broker";
    let protocol = config
        .kafka
        .producer
        .get("security.protocol")
        .map_or("plaintext", String::as_str);
    match publisher.check_broker(TIMEOUT).await {
        Ok(()) => Check::ok(
            NAME,
            format!(
                "{} answered (security.protocol = {protocol})",
                config.kafka.brokers
            ),
        ),
        Err(e) => {
            let unavailable = match &e {
                BrokerError::Unavailable(u) => Some(u.as_ref()),
                _ => None,
            };
            let fix = match unavailable {
                Some(BrokerUnavailable::SecurityRefused { .. }) => {
                    "fix kafka.producer's security.protocol, ssl.* (ssl.ca.location for the \
                     broker's CA) and sasl.* (mechanism, username, password) settings"
                }
                Some(BrokerUnavailable::ProducerFailed { .. }) => {
                    "grant the relay's principal what the message says (an idempotent \
                     producer needs IDEMPOTENT_WRITE on the cluster, or WRITE on the topics)"
                }
                _ => {
                    "check kafka.brokers, that the brokers run and are reachable from here, \
                     and that the addresses they advertise are reachable too"
                }
            };
            Check::problem(NAME, e.to_string(), fix)
        }
    }
}

/// `kafka.topics`: the topics of the module doc exist; their size limits.
pub(super) async fn topics(publisher: &Publisher, config: &Config, sample: Sample<'_>) -> Check {
    const NAME: &str = "kafka.topics";
    let template = config.topic_template_of(&config.outbox);
    let is_static = !template.contains('{');
    let mut wanted: Vec<String> = Vec::new();
    if is_static {
        wanted.push(template.to_owned());
    }
    let mut notes = Vec::new();
    match sample {
        Sample::Recent(Some(client)) => match recent_topics(client, config).await {
            Ok((topics, more)) => {
                for t in topics {
                    if !wanted.contains(&t) {
                        wanted.push(t);
                    }
                }
                if more {
                    notes.push(format!(
                        "the recent rows name more than {MAX_TOPICS} topics; the first \
                         {MAX_TOPICS} were checked"
                    ));
                }
            }
            Err(e) => notes.push(format!(
                "cannot read recent outbox rows: {}",
                crate::postgres::describe_error(&e)
            )),
        },
        Sample::Recent(None) => notes.push("no PostgreSQL connection to read rows".to_owned()),
        Sample::TemplateOnly if !is_static => {
            return Check::ok(
                NAME,
                format!(
                    "topics derive from each row ({template}); `outbox-relay check` samples them"
                ),
            );
        }
        Sample::TemplateOnly => {}
    }
    wanted.truncate(MAX_TOPICS);
    let notes = if notes.is_empty() {
        String::new()
    } else {
        format!(" ({})", notes.join("; "))
    };
    if wanted.is_empty() {
        return Check::warn(
            NAME,
            format!(
                "the template {template} has placeholders and the outbox has no rows yet: \
                 its topics cannot be known before events are written{notes}"
            ),
            "create the topic of each aggregate (and event) type before writing events: the \
             relay never creates topics",
        );
    }
    let known = match publisher.topic_partitions(TIMEOUT).await {
        Ok(known) => known,
        Err(e) => {
            return Check::problem(
                NAME,
                format!("cannot list the topics: {e}"),
                "see kafka.broker",
            );
        }
    };
    let (present, missing): (Vec<String>, Vec<String>) =
        wanted.into_iter().partition(|t| known.contains_key(t));
    // `run` reads each topic's limit in the background when it first produces to it
    // (`kafka::TopicLimits`); waiting for it here would slow its start (an admin
    // client and a DescribeConfigs round trip: ~0.1 s measured against Tansu).
    let limits = match (
        &sample,
        crate::kafka::producer_config(&config.kafka, &config.relay),
    ) {
        (Sample::Recent(_), Ok(producer)) => crate::kafka::read_limits(&producer, &present).await,
        _ => std::collections::HashMap::new(),
    };
    let unknown_limit = match sample {
        Sample::Recent(_) => "max.message.bytes not told by the broker",
        Sample::TemplateOnly => "max.message.bytes read when first produced to",
    };
    let described: Vec<String> = present
        .iter()
        .map(|t| {
            let limit = limits.get(t).copied().flatten().map_or_else(
                || unknown_limit.to_owned(),
                |l| format!("max.message.bytes {l}"),
            );
            format!(
                "{t} ({} partitions, {limit})",
                known.get(t).copied().unwrap_or(0)
            )
        })
        .collect();
    let producer_limit = format!(
        "the producer's message.max.bytes is {}",
        publisher.max_message_bytes()
    );
    if missing.is_empty() {
        Check::ok(
            NAME,
            format!("{}; {producer_limit}{notes}", described.join("; ")),
        )
    } else {
        let exist = if described.is_empty() {
            String::new()
        } else {
            format!("; present: {}", described.join("; "))
        };
        Check::problem(
            NAME,
            format!("missing: {}{exist}{notes}", missing.join(", ")),
            format!(
                "create {} on the broker (the relay never creates topics; until then their \
                 events wait, under relay.on_config_error = \"block\")",
                missing.join(", ")
            ),
        )
    }
}

/// The distinct topics of the newest [`SAMPLE_ROWS`] rows, at most
/// [`MAX_TOPICS`], and whether there were more.
async fn recent_topics(
    client: &Client,
    config: &Config,
) -> Result<(Vec<String>, bool), tokio_postgres::Error> {
    let c = &config.outbox.columns;
    let column = |name: &str| {
        if name.is_empty() {
            "NULL::text".to_owned()
        } else {
            format!("{}::text", quote_ident(name))
        }
    };
    let rendered = format!(
        "replace(replace($1, '{{aggregate_type}}', {}), '{{event_type}}', {})",
        column(&c.aggregate_type),
        column(&c.event_type)
    );
    let topic = if c.topic.is_empty() {
        rendered
    } else {
        format!("coalesce(nullif({}, ''), {rendered})", column(&c.topic))
    };
    let order = if c.id.is_empty() {
        String::new()
    } else {
        format!("ORDER BY {} DESC", quote_ident(&c.id))
    };
    let sql = format!(
        "SELECT DISTINCT t FROM (SELECT {topic} AS t FROM {} {order} LIMIT {SAMPLE_ROWS}) s
         WHERE t IS NOT NULL AND t <> '' ORDER BY t LIMIT {}",
        quote_qualified(&config.outbox.table),
        MAX_TOPICS + 1
    );
    let template = config.topic_template_of(&config.outbox);
    let rows = client.query(&sql, &[&template]).await?;
    let mut topics: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    let more = topics.len() > MAX_TOPICS;
    topics.truncate(MAX_TOPICS);
    Ok((topics, more))
}

/// `kafka.delivery`: the mode and what it promises; in exactly-once mode, that the
/// progress topic exists.
pub(super) async fn delivery(publisher: &Publisher, config: &Config) -> Check {
    const NAME: &str = "kafka.delivery";
    if config.kafka.delivery == DeliveryMode::AtLeastOnce {
        return Check::ok(
            NAME,
            "at-least-once: a crash may send a window of events again; consumers \
             de-duplicate by the idempotency_key header",
        );
    }
    let topic = &config.kafka.progress_topic;
    match publisher.topic_layout(topic, TIMEOUT).await {
        Ok(Some((layout, broker_id))) => progress_topic(config, topic, layout, broker_id).await,
        Ok(None) => Check::problem(
            NAME,
            format!("exactly-once, but the progress topic {topic:?} does not exist"),
            "run `outbox-relay migrate` (it creates it, compacted), or create it with \
             cleanup.policy=compact",
        ),
        Err(e) => Check::problem(
            NAME,
            format!("exactly-once, but the progress topic could not be looked up: {e}"),
            "see kafka.broker",
        ),
    }
}

/// `kafka.delivery` in exactly-once mode once the progress topic exists: its shape
/// and the coordinator's timeout limit (`kafka::progress_topic`).
async fn progress_topic(
    config: &Config,
    topic: &str,
    layout: crate::kafka::ProgressTopicLayout,
    broker_id: Option<i32>,
) -> Check {
    const NAME: &str = "kafka.delivery";
    let layout = match crate::kafka::producer_config(&config.kafka, &config.relay) {
        Ok(producer) => {
            crate::kafka::describe_progress_topic(&producer, topic, broker_id, layout).await
        }
        Err(_) => layout,
    };
    let (problems, warning) =
        crate::kafka::judge_progress_topic(&layout, config.kafka.transaction_timeout_ms);
    if !problems.is_empty() {
        let detail = problems
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        let fix = problems
            .iter()
            .map(|p| p.fix(topic))
            .collect::<Vec<_>>()
            .join("; ");
        return Check::problem(NAME, format!("exactly-once, but {detail}"), fix);
    }
    let detail = format!(
        "exactly-once: read_committed consumers see each event once; progress in {topic:?} \
         ({} partition, {} replica(s), cleanup.policy {}; transactions are tried by `run` at \
         start; a resync after a lost slot marks sent, without publishing them again, the \
         rows whose records the topic already holds)",
        layout.partitions,
        layout.replicas,
        layout.cleanup_policy.as_deref().unwrap_or("not told"),
    );
    match warning {
        Some(warning) => Check::warn(
            NAME,
            format!("{detail}; {warning}"),
            format!(
                "raise {topic:?}'s replication factor (kafka.progress_topic_replication_factor \
                 for a new one)"
            ),
        ),
        None => Check::ok(NAME, detail),
    }
}
