//! A resync's rows that the topic already holds.
//!
//! # Why
//!
//! A resync after a lost slot publishes every unsent, unpoisoned row not below the
//! position's delivered checkpoint (`cdc::resync`). The checkpoint trails what the
//! lost slot had delivered by about the relay's lag and a save interval, because a
//! row carries no commit LSN to compare with the confirmed position: the rows the
//! stream delivered in between were published a second time. With
//! `kafka.delivery = "exactly-once"` that broke the promise that a `read_committed`
//! consumer sees each event once; at-least-once, it was a duplicate per row.
//!
//! # How
//!
//! The topic itself says what was delivered. Before a window of the resync is
//! published, the idempotency keys of the records each of its topics holds from the
//! window's oldest record timestamp on are read (`read_committed`, from the offset
//! `ListOffsets` gives for that timestamp, to the end), and a row whose record's key
//! is among them is marked sent without being produced again. A record's timestamp
//! is its row's `created_at` (`outbox::record`), so every record of the window's
//! rows lies at or after that offset. Nothing else writes to the topics of a slot
//! during its resync, so what was read stays the truth while the window is published.
//!
//! # What it cannot lose
//!
//! A key found in the topic is a delivery: skipping its row loses nothing. What is
//! not found (a read cut short by [`READ_LIMIT`] or [`MAX_KEYS`], a broker that
//! cannot look offsets up by time, a row without a timestamp) is published as
//! before: a possible duplicate, never a gap. Two rows sharing an idempotency key are
//! one event to the relay's consumers, who drop the second by its key; here the
//! second is not published either.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::config::Config;
use crate::kafka::ReaderContext;
use crate::outbox::HEADER_IDEMPOTENCY_KEY;

/// `client.id` of the reader.
const READER_CLIENT_ID: &str = "outbox-relay-resync";

/// How long one topic is read before what was read is taken as it is.
const READ_LIMIT: Duration = Duration::from_secs(60);

/// Keys kept per topic at most: the read stops there.
const MAX_KEYS: usize = 2_000_000;

/// Timeout of one metadata, watermark or offset lookup.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

const CONTEXT: ReaderContext = ReaderContext {
    reader: "resync delivered keys",
};

/// What the topics hold, read once per topic from the oldest timestamp asked for.
pub(super) struct DeliveredKeys {
    reader: ClientConfig,
    topics: HashMap<String, Tail>,
}

/// One topic's keys from `since_ms` on.
#[derive(Default)]
struct Tail {
    since_ms: Option<i64>,
    keys: HashSet<Bytes>,
}

impl DeliveredKeys {
    /// A reader with the relay's connection settings.
    ///
    /// # Errors
    ///
    /// librdkafka refused the reader's configuration.
    pub(super) fn new(config: &Config) -> crate::error::Result<DeliveredKeys> {
        let reader = crate::cdc::exactly_once::progress_reader_config(config, READER_CLIENT_ID)?;
        Ok(DeliveredKeys {
            reader,
            topics: HashMap::new(),
        })
    }

    /// Reads whatever `wants` (topic → oldest record timestamp, ms) needs that was
    /// not read yet. A failure only leaves keys unread (rows published again).
    pub(super) async fn learn(&mut self, wants: HashMap<String, i64>) {
        for (topic, since_ms) in wants {
            let tail = self.topics.entry(topic.clone()).or_default();
            if tail.since_ms.is_some_and(|s| s <= since_ms) {
                continue;
            }
            tail.since_ms = Some(since_ms);
            let reader = self.reader.clone();
            let read_topic = topic.clone();
            let read =
                tokio::task::spawn_blocking(move || read_keys(&reader, &read_topic, since_ms))
                    .await;
            match read {
                Ok(Ok((keys, complete))) => {
                    if !complete {
                        tracing::warn!(topic = %topic, keys = keys.len(),
                            "resync: the topic could not be read to its end; rows not found in what was read are published again");
                    }
                    let tail = self.topics.entry(topic).or_default();
                    tail.keys.extend(keys);
                }
                Ok(Err(e)) => tracing::warn!(topic = %topic, error = %e,
                    "resync: cannot read what the topic holds; its rows are published again (duplicates possible)"),
                Err(e) => tracing::warn!(topic = %topic, error = %e,
                    "resync: the topic reader failed; its rows are published again"),
            }
        }
    }

    /// Whether `topic` holds a record with idempotency key `key`.
    pub(super) fn holds(&self, topic: &str, key: &[u8]) -> bool {
        self.topics
            .get(topic)
            .is_some_and(|tail| tail.keys.contains(key))
    }
}

/// The idempotency keys of `topic`'s committed records with a timestamp at or after
/// `since_ms` (from the offset `ListOffsets` gives for it, to the high watermark),
/// and whether every partition was read to its end. Blocking.
fn read_keys(
    reader: &ClientConfig,
    topic: &str,
    since_ms: i64,
) -> Result<(HashSet<Bytes>, bool), KafkaError> {
    let consumer: BaseConsumer<ReaderContext> = reader.create_with_context(CONTEXT)?;
    let metadata = consumer.fetch_metadata(Some(topic), REQUEST_TIMEOUT)?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    let mut wanted = TopicPartitionList::new();
    for &p in &partitions {
        wanted.add_partition_offset(topic, p, Offset::Offset(since_ms))?;
    }
    let starts = consumer.offsets_for_times(wanted, REQUEST_TIMEOUT)?;
    let mut assignment = TopicPartitionList::new();
    let mut ends: HashMap<i32, i64> = HashMap::new();
    for element in starts.elements() {
        // No record at or after the timestamp: nothing to read there.
        let Offset::Offset(start) = element.offset() else {
            continue;
        };
        let (_, high) = consumer.fetch_watermarks(topic, element.partition(), REQUEST_TIMEOUT)?;
        if start < high {
            assignment.add_partition_offset(topic, element.partition(), Offset::Offset(start))?;
            ends.insert(element.partition(), high);
        }
    }
    let mut keys = HashSet::new();
    if ends.is_empty() {
        return Ok((keys, true));
    }
    consumer.assign(&assignment)?;
    let deadline = Instant::now() + READ_LIMIT;
    while !ends.is_empty() && Instant::now() < deadline && keys.len() < MAX_KEYS {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                if let Some(key) = m.headers().and_then(|h| {
                    h.iter()
                        .find(|h| h.key == HEADER_IDEMPOTENCY_KEY)
                        .and_then(|h| h.value)
                }) {
                    keys.insert(Bytes::copy_from_slice(key));
                }
                if ends
                    .get(&m.partition())
                    .is_some_and(|&end| m.offset() + 1 >= end)
                {
                    ends.remove(&m.partition());
                }
            }
            // Control records (commit markers) may end a partition: its position
            // says whether the end is reached.
            Some(Err(KafkaError::PartitionEOF(_))) | None => {
                let position = consumer.position()?;
                ends.retain(|&p, end| {
                    position
                        .find_partition(topic, p)
                        .is_none_or(|e| !matches!(e.offset(), Offset::Offset(o) if o >= *end))
                });
            }
            Some(Err(e)) => return Err(e),
        }
    }
    Ok((keys, ends.is_empty()))
}
