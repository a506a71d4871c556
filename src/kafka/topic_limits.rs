//! Each topic's `max.message.bytes`, read from the broker, so the relay knows the
//! effective size limit of a record before it produces it.
//!
//! # Why
//!
//! A record above the topic's limit is refused by the broker, but not alone: the
//! broker refuses the whole batch it travels in, and librdkafka reports
//! `MessageSizeTooLarge` for every record of that batch. Knowing the limit, the
//! relay poisons an oversize event before producing it, with the limit in the
//! error, and small events never share its fate. (When the limit cannot be read —
//! no `DescribeConfigs` permission, an old broker — the relay still retries every
//! record of a refused batch alone before blaming it; see `cdc::session`.) The
//! limit bounds the batch as written, so it is used only when the producer does not
//! compress: a compressed batch can be far smaller than its records, and the
//! broker's own answer then decides.
//!
//! # How
//!
//! Lookups run on a task of their own (one `DescribeConfigs` request per topic, the
//! first time the topic is seen); until the answer is in, only the producer's
//! `message.max.bytes` applies. The answer is kept for [`REFRESH`], then asked
//! again, so a limit raised by an operator is noticed without a restart. The admin
//! client uses the producer's settings (brokers, TLS, SASL), so it reaches the
//! broker the same way.

use std::collections::HashMap;

use crate::hashing::HashMap as StateMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;
use tokio::sync::mpsc;

/// How long a topic's limit is trusted before it is read again.
pub(crate) const REFRESH: Duration = Duration::from_secs(300);

/// Most topics whose limit is kept: topic names can come from the data
/// (`outbox.topic` column, `{aggregate_type}` in the template), so the map must not
/// grow with them. Past it, limits older than [`REFRESH`] go first, then the oldest.
const MAX_KNOWN: usize = 4_096;

/// How long one lookup may take.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(10);

/// The topic config that limits a record batch's size.
const TOPIC_LIMIT: &str = "max.message.bytes";

/// What is known of one topic's limit.
#[derive(Debug, Clone, Copy)]
struct Known {
    /// `None`: the broker did not say (no permission, not set, an error).
    limit: Option<usize>,
    at: Instant,
}

/// The topics' limits as far as known; see the module doc.
pub(crate) struct TopicLimits {
    admin: Option<Arc<AdminClient<DefaultClientContext>>>,
    /// Looked up for every produced record, hence foldhash rather than SipHash
    /// (`crate::hashing`). The names are the outbox's own topics, written by the
    /// application, not by whoever could aim collisions at the relay.
    known: StateMap<String, Known>,
    asked: StateMap<String, Instant>,
    answers_tx: mpsc::UnboundedSender<(String, Option<usize>)>,
    answers: mpsc::UnboundedReceiver<(String, Option<usize>)>,
}

impl std::fmt::Debug for TopicLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TopicLimits")
            .field("known", &self.known)
            .finish_non_exhaustive()
    }
}

impl TopicLimits {
    /// Looks limits up with an admin client made from the producer's settings; when
    /// that client cannot be made, no topic limit is ever known (the producer's
    /// limit and the retry-alone rule still apply).
    #[must_use]
    pub(crate) fn new(producer: &ClientConfig) -> TopicLimits {
        let admin = match admin_config(producer).create::<AdminClient<DefaultClientContext>>() {
            Ok(admin) => Some(Arc::new(admin)),
            Err(e) => {
                tracing::warn!(error = %e, "cannot read topic size limits; the producer's applies");
                None
            }
        };
        TopicLimits::asking(admin)
    }

    /// Limits that are never asked for (the simulation's broker has none): the
    /// producer's own limit applies.
    #[cfg(test)]
    #[must_use]
    pub(crate) fn unasked() -> TopicLimits {
        TopicLimits::asking(None)
    }

    /// Nothing known yet; limits are asked of `admin` (never without one).
    fn asking(admin: Option<Arc<AdminClient<DefaultClientContext>>>) -> TopicLimits {
        let (answers_tx, answers) = mpsc::unbounded_channel();
        TopicLimits {
            admin,
            known: StateMap::default(),
            asked: StateMap::default(),
            answers_tx,
            answers,
        }
    }

    /// The topic's `max.message.bytes` when known; asks the broker (in the
    /// background) when it is not known yet or is older than [`REFRESH`].
    pub(crate) fn limit(&mut self, topic: &str, now: Instant) -> Option<usize> {
        while let Ok((name, limit)) = self.answers.try_recv() {
            self.asked.remove(&name);
            self.make_room(now);
            self.known.insert(name, Known { limit, at: now });
        }
        let known = self.known.get(topic).copied();
        if known.is_none_or(|k| now.duration_since(k.at) >= REFRESH)
            && !self.asked.contains_key(topic)
        {
            self.ask(topic, now);
        }
        known.and_then(|k| k.limit)
    }

    /// Keeps the map below [`MAX_KNOWN`] before an insert.
    fn make_room(&mut self, now: Instant) {
        if self.known.len() < MAX_KNOWN {
            return;
        }
        self.known
            .retain(|_, k| now.saturating_duration_since(k.at) < REFRESH);
        while self.known.len() >= MAX_KNOWN {
            let Some(oldest) = self
                .known
                .iter()
                .min_by_key(|(_, k)| k.at)
                .map(|(name, _)| name.clone())
            else {
                return;
            };
            self.known.remove(&oldest);
        }
    }

    fn ask(&mut self, topic: &str, now: Instant) {
        let Some(admin) = self.admin.clone() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        self.asked.insert(topic.to_owned(), now);
        let answers = self.answers_tx.clone();
        let topic = topic.to_owned();
        runtime.spawn(async move {
            let limit = describe(&admin, &topic).await;
            if let Some(limit) = limit {
                tracing::info!(topic, max_message_bytes = limit, "topic size limit");
            }
            let _ = answers.send((topic, limit));
        });
    }
}

/// An admin client's settings from the producer's. An admin client is a producer
/// handle inside librdkafka: the relay's producer settings are valid, but it must
/// not start an idempotent or transactional session, and it must not report
/// statistics: rust-rdkafka's admin client never serves its main queue, where
/// librdkafka puts each report (several kilobytes a second), so they would pile up
/// for as long as the client lives.
pub(super) fn admin_config(producer: &ClientConfig) -> ClientConfig {
    let mut cfg = producer.clone();
    cfg.remove("enable.idempotence");
    cfg.remove("transactional.id");
    cfg.set("statistics.interval.ms", "0");
    cfg
}

/// Each topic's `max.message.bytes` (`None` where the broker does not tell), read
/// once with an admin client made from the producer's settings: for the start-up
/// and `check` reports, which want an answer now rather than in the background.
pub(crate) async fn read_limits(
    producer: &ClientConfig,
    topics: &[String],
) -> HashMap<String, Option<usize>> {
    let Ok(admin) = admin_config(producer).create::<AdminClient<DefaultClientContext>>() else {
        return topics.iter().map(|t| (t.clone(), None)).collect();
    };
    let mut out = HashMap::with_capacity(topics.len());
    for topic in topics {
        out.insert(topic.clone(), describe(&admin, topic).await);
    }
    out
}

/// `max.message.bytes` of `topic`, or `None` when the broker does not tell.
async fn describe(admin: &AdminClient<DefaultClientContext>, topic: &str) -> Option<usize> {
    let opts = AdminOptions::new().request_timeout(Some(LOOKUP_TIMEOUT));
    let results = match admin
        .describe_configs([&ResourceSpecifier::Topic(topic)], &opts)
        .await
    {
        Ok(results) => results,
        Err(e) => {
            tracing::debug!(topic, error = %e, "cannot read the topic's size limit");
            return None;
        }
    };
    let resource = match results.into_iter().next() {
        Some(Ok(resource)) => resource,
        Some(Err(code)) => {
            tracing::debug!(topic, %code, "the broker refused to describe the topic");
            return None;
        }
        None => return None,
    };
    let Some(value) = resource.get(TOPIC_LIMIT).and_then(|e| e.value.as_deref()) else {
        tracing::debug!(
            topic,
            entries = resource.entries.len(),
            "the topic has no size limit set"
        );
        return None;
    };
    let limit = parse_limit(value);
    if limit.is_none() {
        tracing::debug!(topic, value, "the topic's size limit is not a number");
    }
    limit
}

/// A limit as the broker writes it: a positive integer.
fn parse_limit(value: &str) -> Option<usize> {
    value.trim().parse::<usize>().ok().filter(|n| *n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_parse_as_positive_integers() {
        assert_eq!(parse_limit("1048588"), Some(1_048_588));
        assert_eq!(parse_limit(" 2000 "), Some(2000));
        assert_eq!(parse_limit("0"), None);
        assert_eq!(parse_limit("-1"), None);
        assert_eq!(parse_limit("lots"), None);
    }

    #[test]
    fn the_admin_client_reports_no_statistics_and_starts_no_session() {
        let mut producer = ClientConfig::new();
        producer
            .set("bootstrap.servers", "k:9092")
            .set("enable.idempotence", "true")
            .set("transactional.id", "t")
            .set("statistics.interval.ms", "1000");
        let admin = admin_config(&producer);
        assert_eq!(admin.get("statistics.interval.ms"), Some("0"));
        assert_eq!(admin.get("enable.idempotence"), None);
        assert_eq!(admin.get("transactional.id"), None);
        assert_eq!(admin.get("bootstrap.servers"), Some("k:9092"));
    }

    #[test]
    fn nothing_is_known_before_an_answer() {
        let mut limits = TopicLimits::new(&ClientConfig::new());
        let now = Instant::now();
        assert_eq!(limits.limit("t", now), None);
        limits.answers_tx.send(("t".into(), Some(2000))).unwrap();
        assert_eq!(limits.limit("t", now), Some(2000));
        assert_eq!(limits.limit("other", now), None);
    }

    #[test]
    fn data_driven_topic_names_do_not_grow_the_map_without_bound() {
        let mut limits = TopicLimits::new(&ClientConfig::new());
        let now = Instant::now();
        for n in 0..MAX_KNOWN + 100 {
            limits
                .answers_tx
                .send((format!("topic-{n}"), Some(1_000)))
                .unwrap();
        }
        limits
            .answers_tx
            .send(("last".into(), Some(2_000)))
            .unwrap();
        assert_eq!(limits.limit("last", now), Some(2_000));
        assert!(limits.known.len() <= MAX_KNOWN, "{}", limits.known.len());
    }
}
