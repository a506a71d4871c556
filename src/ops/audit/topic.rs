//! The Kafka side of the audit: reading every partition of a topic to its end,
//! record by record, into the [`Ledger`].
//!
//! # Reading only
//!
//! The consumer is assigned partitions (no group membership) and commits nothing,
//! so an audit leaves no trace on the cluster (`crate::kafka::reader_config`). It
//! reads `read_uncommitted` unless `--isolation read_committed` asks to count what
//! the consumers of `kafka.delivery = "exactly-once"` see.
//!
//! # Where reading starts and ends
//!
//! Every partition of each topic is read from the beginning or — with `--since` —
//! from the first offset whose timestamp is at least `since` (records carry
//! `created_at` as CreateTime, so no record of the range is earlier) to its end: the
//! end of partition librdkafka reports when a fetch reaches the high watermark. The
//! high watermark captured at start (ListOffsets) bounds a partition that producers
//! keep ahead of the audit: once it is passed, the partition is read for at most 5
//! more seconds. (It is not used as the exact end because Tansu 0.6 under-reports
//! it: the last *batch*'s base offset plus one.) Reading also stops when nothing
//! arrived for `--timeout-secs`; then the report lists the partitions not read to
//! the end, whose events count as lost.
//!
//! Records are processed one by one (nothing per record is kept); per-entity order
//! state lives in the ledger only while its topic is read.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

use super::ledger::Ledger;
use crate::config::{Config, ConfigError};
use crate::error::Error;
use crate::kafka::{Isolation, ReaderContext, reader_config};
use crate::lsn::Lsn;
use crate::ops::meter::{self, Meter};
use crate::outbox::{HEADER_IDEMPOTENCY_KEY, HEADER_REPUBLISH, HEADER_SOURCE_LSN};

/// How long a partition is still read after passing the end offset captured at
/// start without reaching its end (see `PartitionEnds`).
const PAST_END_GRACE: Duration = Duration::from_secs(5);
/// Timeout of one metadata / watermark / offset request to the broker.
const BROKER_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// `client.id` of the audit consumer.
const CONSUMER_CLIENT_ID: &str = "outbox-relay-audit";
/// The audit consumer's client context.
const AUDIT_CONTEXT: ReaderContext = ReaderContext { reader: "audit" };

/// The audit consumer (`crate::kafka::reader_config`), reading at `isolation`.
pub(super) fn consumer_config(
    config: &Config,
    isolation: Isolation,
) -> Result<ClientConfig, ConfigError> {
    reader_config(&config.kafka, CONSUMER_CLIENT_ID, isolation)
        .map_err(|e| ConfigError::Invalid(format!("kafka.producer (audit consumer): {e}")))
}

/// How reading one topic went.
#[derive(Debug, Default)]
pub(super) struct TopicOutcome {
    /// What the report should say about this topic (missing, not read to the end).
    pub(super) notes: Vec<String>,
}

/// A request the broker did not answer (exit code 4).
fn broker_error(what: impl Into<String>, source: KafkaError) -> Error {
    Error::AuditBroker {
        what: what.into(),
        source,
    }
}

/// The record's `idempotency_key` and `source_lsn` headers.
fn audit_headers<M: Message>(m: &M) -> (Option<&[u8]>, Option<Lsn>) {
    let mut key = None;
    let mut lsn = None;
    if let Some(headers) = m.headers() {
        for h in headers.iter() {
            if key.is_none() && h.key == HEADER_IDEMPOTENCY_KEY {
                key = h.value;
            } else if lsn.is_none() && h.key == HEADER_SOURCE_LSN {
                lsn = h
                    .value
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|v| v.parse::<Lsn>().ok());
            }
        }
    }
    (key, lsn)
}

/// Whether `republish` sent the record (an operator's request, not a duplicate of
/// the relay's: the audit leaves it out and says how many it left out).
fn republished<M: Message>(m: &M) -> bool {
    m.headers()
        .is_some_and(|headers| headers.iter().any(|h| h.key == HEADER_REPUBLISH))
}

/// Start offset per partition for `created_at >= since`, or `None` when the broker
/// cannot say (then the partition is read from its low watermark).
fn start_offsets(
    consumer: &BaseConsumer<ReaderContext>,
    topic: &str,
    partitions: &[(i32, i64, i64)],
    since_ms: i64,
) -> Result<HashMap<i32, i64>, KafkaError> {
    let mut query = TopicPartitionList::new();
    for (p, _, _) in partitions {
        query.add_partition_offset(topic, *p, Offset::Offset(since_ms))?;
    }
    let answer = consumer.offsets_for_times(query, BROKER_REQUEST_TIMEOUT)?;
    let mut out = HashMap::new();
    for e in answer.elements() {
        if e.error().is_err() {
            continue;
        }
        let Some((_, low, high)) = partitions.iter().find(|(p, _, _)| *p == e.partition()) else {
            continue;
        };
        match e.offset() {
            Offset::Offset(o) => {
                out.insert(e.partition(), o.clamp(*low, *high));
            }
            // No record at or after `since`.
            Offset::End => {
                out.insert(e.partition(), *high);
            }
            _ => {}
        }
    }
    Ok(out)
}

/// When to stop reading each partition of a topic.
///
/// A partition is done at *end of partition* (librdkafka's `PartitionEOF`: a fetch
/// reached the broker's high watermark, which is at or past the one captured at
/// start). The captured watermark only bounds a partition that producers keep
/// ahead of us: once a record at or past it was read, the partition is read for
/// at most [`PAST_END_GRACE`] more. It is not trusted as the exact end because some
/// Kafka-protocol brokers answer ListOffsets(latest) with less: Tansu 0.6 returns
/// the base offset of the last *batch* plus one.
#[derive(Debug, Default)]
struct PartitionEnds {
    /// Partition → (captured high watermark, when a record at or past it was read).
    pending: HashMap<i32, (i64, Option<Instant>)>,
}

impl PartitionEnds {
    fn expect(&mut self, partition: i32, high: i64) {
        self.pending.insert(partition, (high, None));
    }

    fn on_record(&mut self, partition: i32, offset: i64, now: Instant) {
        if let Some((high, passed)) = self.pending.get_mut(&partition)
            && offset + 1 >= *high
            && passed.is_none()
        {
            *passed = Some(now);
        }
    }

    fn on_eof(&mut self, partition: i32) {
        self.pending.remove(&partition);
    }

    fn expire(&mut self, now: Instant, grace: Duration) {
        self.pending.retain(|_, (_, passed)| {
            passed.is_none_or(|at| now.saturating_duration_since(at) < grace)
        });
    }

    fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// `(partition, captured high watermark)` not finished, sorted.
    fn remaining(&self) -> Vec<(i32, i64)> {
        let mut left: Vec<(i32, i64)> = self.pending.iter().map(|(p, (h, _))| (*p, *h)).collect();
        left.sort_unstable();
        left
    }
}

/// Reads one topic up to the high watermarks captured now.
pub(super) fn read_topic(
    cfg: &ClientConfig,
    topic: &str,
    since_ms: Option<i64>,
    idle_timeout: Duration,
    ledger: &mut Ledger,
    progress: bool,
) -> Result<TopicOutcome, Error> {
    let mut outcome = TopicOutcome::default();
    let consumer: BaseConsumer<ReaderContext> =
        cfg.create_with_context(AUDIT_CONTEXT).map_err(|e| {
            Error::Config(ConfigError::Invalid(format!(
                "cannot create the audit consumer: {e}"
            )))
        })?;
    let metadata = consumer
        .fetch_metadata(Some(topic), BROKER_REQUEST_TIMEOUT)
        .map_err(|e| broker_error(format!("metadata of topic {topic}"), e))?;
    let Some(meta) = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
    else {
        outcome.notes.push(format!(
            "topic {topic} does not exist: nothing delivered there"
        ));
        return Ok(outcome);
    };
    let mut partitions = Vec::new();
    for p in meta.partitions() {
        let (low, high) = consumer
            .fetch_watermarks(topic, p.id(), BROKER_REQUEST_TIMEOUT)
            .map_err(|e| broker_error(format!("watermarks of {topic}/{}", p.id()), e))?;
        partitions.push((p.id(), low, high));
    }
    let starts = match since_ms {
        None => HashMap::new(),
        Some(ms) => start_offsets(&consumer, topic, &partitions, ms).unwrap_or_else(|e| {
            outcome.notes.push(format!(
                "topic {topic}: offsets by time unavailable ({e}); read from the beginning"
            ));
            HashMap::new()
        }),
    };
    let mut assignment = TopicPartitionList::new();
    let mut ends = PartitionEnds::default();
    let mut total = 0u64;
    for (p, low, high) in &partitions {
        let start = starts.get(p).copied().unwrap_or(*low).max(*low);
        if start < *high {
            assignment
                .add_partition_offset(topic, *p, Offset::Offset(start))
                .map_err(|e| broker_error("assignment", e))?;
            ends.expect(*p, *high);
            total += u64::try_from(high - start).unwrap_or(0);
        }
    }
    if ends.is_empty() {
        ledger.end_topic();
        return Ok(outcome);
    }
    consumer
        .assign(&assignment)
        .map_err(|e| broker_error(format!("assigning {topic}"), e))?;
    let mut bar = Meter::new(
        "audit",
        format!("topic {topic}"),
        total,
        progress && total >= meter::MIN_TOTAL,
    );
    let mut last_activity = Instant::now();
    let mut last_error: Option<KafkaError> = None;
    let mut read = 0u64;
    let mut republished_records = 0u64;
    while !ends.is_empty() {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                if republished(&m) {
                    republished_records += 1;
                } else {
                    let (idempotency_key, lsn) = audit_headers(&m);
                    ledger.observe(topic, m.partition(), m.key(), idempotency_key, lsn);
                }
                read += 1;
                bar.inc(1);
                last_activity = Instant::now();
                ends.on_record(m.partition(), m.offset(), last_activity);
            }
            Some(Err(KafkaError::PartitionEOF(p))) => {
                ends.on_eof(p);
                last_activity = Instant::now();
            }
            Some(Err(e)) => {
                tracing::debug!(topic, error = %e, "audit consumer error");
                last_error = Some(e);
            }
            None => {}
        }
        ends.expire(Instant::now(), PAST_END_GRACE);
        if !ends.is_empty() && last_activity.elapsed() >= idle_timeout {
            if read == 0
                && let Some(e) = last_error
            {
                return Err(broker_error(format!("reading {topic}"), e));
            }
            let left: Vec<String> = ends
                .remaining()
                .iter()
                .map(|(p, high)| format!("{topic}/{p} (end offset {high})"))
                .collect();
            outcome.notes.push(format!(
                "no record for {}s before reaching the end of {}; events there count as lost{}",
                idle_timeout.as_secs(),
                left.join(", "),
                last_error
                    .map(|e| format!(" (last broker error: {e})"))
                    .unwrap_or_default()
            ));
            break;
        }
    }
    bar.finish();
    if republished_records > 0 {
        outcome.notes.push(format!(
            "{republished_records} record(s) of {topic} were sent again by `republish` \
             (header {HEADER_REPUBLISH}): not counted as deliveries or duplicates"
        ));
    }
    ledger.end_topic();
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_end_at_eof_or_a_grace_after_the_captured_end() {
        let t0 = Instant::now();
        let grace = Duration::from_secs(5);
        let mut ends = PartitionEnds::default();
        ends.expect(0, 10);
        ends.expect(1, 10);
        ends.expect(2, 3);
        // Reaching the captured end does not end a partition by itself (the
        // broker may have under-reported it) ...
        ends.on_record(0, 9, t0);
        ends.expire(t0 + Duration::from_secs(1), grace);
        assert_eq!(ends.remaining(), vec![(0, 10), (1, 10), (2, 3)]);
        // ... end of partition does.
        ends.on_eof(0);
        ends.on_eof(7);
        assert_eq!(ends.remaining(), vec![(1, 10), (2, 3)]);
        // A partition kept ahead of us stops a grace period after passing the end.
        ends.on_record(2, 5, t0);
        ends.on_record(2, 6, t0 + Duration::from_secs(4));
        ends.on_record(1, 3, t0);
        ends.expire(t0 + Duration::from_secs(5), grace);
        assert_eq!(ends.remaining(), vec![(1, 10)]);
        ends.on_eof(1);
        assert!(ends.is_empty());
    }

    #[test]
    fn consumer_config_passes_security_settings() {
        let toml = r#"
            [postgres]
            url = "postgresql://h/db"
            [kafka]
            brokers = "b:9092"
            [kafka.producer]
            "security.protocol" = "SASL_PLAINTEXT"
            "sasl.mechanism" = "PLAIN"
            "linger.ms" = "7"
        "#;
        let config = Config::from_sources("test", toml, Vec::new()).unwrap();
        let cfg = consumer_config(&config, Isolation::ReadCommitted).unwrap();
        assert_eq!(cfg.get("isolation.level"), Some("read_committed"));
        assert_eq!(cfg.get("security.protocol"), Some("SASL_PLAINTEXT"));
        assert_eq!(cfg.get("sasl.mechanism"), Some("PLAIN"));
        assert_eq!(cfg.get("linger.ms"), None);
        assert_eq!(cfg.get("enable.auto.commit"), Some("false"));
    }
}
