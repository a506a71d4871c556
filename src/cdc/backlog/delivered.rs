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
//! `ListOffsets` gives for that timestamp, to the end), and a row whose record is
//! among them is marked sent without being produced again. A record stands for a
//! row when its idempotency key, its record key and its value are the row's: after
//! a restore or a failover a sequence may hand a delivered row's id (the default
//! idempotency key) to a new row, which must not be taken for the old one. A record's timestamp
//! is its row's `created_at` (`outbox::record`), so every record of the window's
//! rows lies at or after that offset. Nothing else writes the slot's deliveries to its
//! topics during its resync, so what was read stays the truth while the window is
//! published. Records `republish` sent (header `outbox_relay_republish`) are not
//! deliveries of the relay: a copy of a row sent again by an operator says nothing
//! of whether the stream delivered it, and they are not read.
//!
//! # Order: a key published again publishes the rest of its rows
//!
//! Once a row of a key is published by the resync (its record was not found), the
//! later rows of that key are published too, even those the topic holds. Otherwise
//! the topic would end with the older row: its earlier record may be gone (the
//! log cleaner of a compacted topic removed it once the later record superseded
//! it, or retention deleted it), or was not read (a read cut short), while the
//! later record is still there. Skipping the later one would leave the key's
//! latest record older than its latest row, so a compacted topic's state for the
//! key goes back (and any reader sees the key out of order). Publishing the later
//! rows again costs duplicates (with their idempotency keys) only for such keys;
//! in the usual resync the held rows of a key come before its unheld ones (the
//! stream delivered a prefix of the backlog before the slot was lost) and nothing
//! more is published.
//!
//! What one resync published is in memory only, and a resync that stops part-way
//! starts over: the rows it published are marked sent and not read again. So the
//! topic is asked too: a held row is skipped only if every record of its key after
//! its own is newer (a later record timestamp, which is a row's `created_at`: one
//! entity's rows come in commit order by it under the same assumption the
//! backlog's order makes, see `poller::Sql`), or as old and the record of a later
//! row of the same window. A record of an older row after it (published by the
//! resync that stopped) makes the row, and its key's later rows, published again.
//! Where the topic cannot say, the row is published: a key whose records sit in
//! several partitions, or whose record is not in the partition the producer's
//! partitioner puts the key in now (partitions were added: a record published
//! since sits in another one, perhaps before the window's oldest timestamp and
//! unread), a partitioner that does not place keys by a hash this reader can
//! compute (only `murmur2` and `murmur2_random`, the relay's default, are), a
//! partition not read to its end, a record timestamp that is the broker's append
//! time.
//!
//! # What it cannot lose
//!
//! A record found in the topic is a delivery: skipping its row loses nothing. What
//! is not found (a read cut short by [`READ_LIMIT`], [`MAX_KEYS`] or [`BUDGET`], a
//! broker that cannot look offsets up by time, a row without a timestamp) is
//! published as before: a possible duplicate, never a gap. Two rows with the same
//! idempotency key, record key and value are one event to the relay's consumers,
//! who drop the second by its key; here the second is not published either.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

use crate::config::Config;
use crate::kafka::ReaderContext;
use crate::outbox::{HEADER_IDEMPOTENCY_KEY, HEADER_REPUBLISH, OutboxEvent};
use crate::poison::ParkedKey;

/// `client.id` of the reader.
const READER_CLIENT_ID: &str = "outbox-relay-resync";

/// How long one topic is read before what was read is taken as it is.
const READ_LIMIT: Duration = Duration::from_secs(60);

/// Records kept per topic at most: the read stops there.
const MAX_KEYS: usize = 2_000_000;

/// Time all the reads of one resync may take: past it, the rows of topics not read
/// yet are published (duplicates possible) rather than holding the stream back.
const BUDGET: Duration = Duration::from_secs(300);

/// Timeout of one metadata, watermark or offset lookup.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

const CONTEXT: ReaderContext = ReaderContext {
    reader: "resync delivered keys",
};

/// What the topics hold, read once per topic from the oldest timestamp asked for.
pub(super) struct DeliveredKeys {
    reader: ClientConfig,
    /// The producer places keys by murmur2 (the Java client's hash).
    murmur2: bool,
    topics: HashMap<String, Tail>,
    /// Time spent reading so far (see [`BUDGET`]).
    spent: Duration,
    /// Keys a row of which this resync publishes (its record was not found): their
    /// later rows are published too (module docs, "Order").
    published: HashSet<ParkedKey>,
}

/// One topic's records from `since_ms` on.
#[derive(Default)]
struct Tail {
    since_ms: Option<i64>,
    /// Where each record is (its last copy).
    records: HashMap<Fingerprint, Placed>,
    /// Each record key's records, by partition and offset.
    by_key: HashMap<Bytes, BTreeMap<(i32, i64), Placed>>,
    /// Partitions a read did not finish: what follows a record there is unknown.
    unfinished: HashSet<i32>,
    /// The topic's partition count when last read.
    partitions: usize,
}

impl Tail {
    fn add(&mut self, read: Vec<KeyedRecord>) {
        for (key, placed) in read {
            let at = (placed.partition, placed.offset);
            let newer = self
                .records
                .get(&placed.fingerprint)
                .is_none_or(|p| (p.partition, p.offset) <= at);
            if newer {
                self.records
                    .insert(placed.fingerprint.clone(), placed.clone());
            }
            if let Some(key) = key {
                self.by_key.entry(key).or_default().insert(at, placed);
            }
        }
    }
}

/// A record read, with its record key.
type KeyedRecord = (Option<Bytes>, Placed);

/// What one read of a topic found.
struct Read {
    records: Vec<KeyedRecord>,
    /// Partitions not read to their end.
    unfinished: HashSet<i32>,
    /// The topic's partition count.
    partitions: usize,
}

/// The partition librdkafka's `murmur2` partitioner (the Java client's) puts `key`
/// in among `partitions`: the positive 32-bit murmur2 hash (seed `0x9747b28c`)
/// modulo the count.
fn murmur2_partition(key: &[u8], partitions: usize) -> Option<i32> {
    let n = u32::try_from(partitions).ok().filter(|n| *n > 0)?;
    i32::try_from((murmur2(key) & 0x7fff_ffff) % n).ok()
}

/// Kafka's murmur2 (`org.apache.kafka.common.utils.Utils.murmur2`), as unsigned.
fn murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    // Kafka hashes the length as an int: keys above 4 GiB do not exist.
    let mut h: u32 = 0x9747_b28c ^ u32::try_from(data.len()).unwrap_or(u32::MAX);
    let mut chunks = data.chunks_exact(4);
    for chunk in &mut chunks {
        let mut k = u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if tail.len() >= 3 {
        h ^= u32::from(tail[2]) << 16;
    }
    if tail.len() >= 2 {
        h ^= u32::from(tail[1]) << 8;
    }
    if let Some(&first) = tail.first() {
        h ^= u32::from(first);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

/// A record read: where it is, its timestamp, what it stands for.
#[derive(Debug, Clone)]
struct Placed {
    partition: i32,
    offset: i64,
    timestamp_ms: Option<i64>,
    fingerprint: Fingerprint,
}

/// A record as a row would make it: its idempotency key, and a hash of its record
/// key and value.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Fingerprint {
    idempotency_key: Bytes,
    content: u64,
}

impl Fingerprint {
    /// The record `event` makes (a tombstone's has no value).
    fn of_event(event: &OutboxEvent) -> Fingerprint {
        Fingerprint::of(
            &event.idempotency_key,
            Some(&event.key),
            (!event.tombstone).then_some(&event.payload[..]),
        )
    }

    fn of(idempotency_key: &[u8], key: Option<&[u8]>, value: Option<&[u8]>) -> Fingerprint {
        // SipHash with fixed keys: the same in the reader and the resync.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut h);
        value.hash(&mut h);
        Fingerprint {
            idempotency_key: Bytes::copy_from_slice(idempotency_key),
            content: h.finish(),
        }
    }
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
            murmur2: matches!(
                config.kafka.partitioner.as_str(),
                "murmur2" | "murmur2_random"
            ),
            topics: HashMap::new(),
            spent: Duration::ZERO,
            published: HashSet::new(),
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
            if self.spent >= BUDGET {
                tracing::warn!(topic = %topic, spent_secs = self.spent.as_secs(),
                    "resync: the time for reading the topics is spent; this topic's rows are published again");
                continue;
            }
            tail.since_ms = Some(since_ms);
            let started = Instant::now();
            let reader = self.reader.clone();
            let read_topic = topic.clone();
            let read =
                tokio::task::spawn_blocking(move || read_keys(&reader, &read_topic, since_ms))
                    .await;
            match read {
                Ok(Ok(Read {
                    records,
                    unfinished,
                    partitions,
                })) => {
                    if !unfinished.is_empty() {
                        tracing::warn!(topic = %topic, records = records.len(),
                            "resync: the topic could not be read to its end; rows not found in what was read are published again");
                    }
                    let tail = self.topics.entry(topic).or_default();
                    tail.add(records);
                    tail.unfinished.extend(unfinished);
                    tail.partitions = partitions;
                }
                Ok(Err(e)) => tracing::warn!(topic = %topic, error = %e,
                    "resync: cannot read what the topic holds; its rows are published again (duplicates possible)"),
                Err(e) => tracing::warn!(topic = %topic, error = %e,
                    "resync: the topic reader failed; its rows are published again"),
            }
            self.spent += started.elapsed();
        }
    }

    /// Whether the resync skips `event`'s row as delivered (module docs): the topic
    /// holds its record, no earlier row of its key is published by this resync, and
    /// no record of its key after its own is older, unless it is the record of a
    /// row after this one in the window (`later`, which this takes it out of). Asked of
    /// a backlog's rows in their order; a row not skipped makes its key's later rows
    /// published too.
    pub(super) fn skips(&mut self, event: &OutboxEvent, later: &mut Later) -> bool {
        let placed_by_hash = self.murmur2;
        skips(
            &self.topics,
            &mut self.published,
            event,
            later.after(event),
            placed_by_hash,
        )
    }
}

/// The rows of a window after each one, as [`DeliveredKeys::skips`] asks for them:
/// counts of fingerprints, from which each row takes its own out in turn.
pub(super) struct Later(HashMap<Fingerprint, usize>);

impl Later {
    /// Every event of the window.
    pub(super) fn of<'e>(events: impl IntoIterator<Item = &'e OutboxEvent>) -> Later {
        let mut counts = HashMap::new();
        for event in events {
            *counts.entry(Fingerprint::of_event(event)).or_insert(0) += 1;
        }
        Later(counts)
    }

    /// Takes `event` out: what is left is after it.
    fn after(&mut self, event: &OutboxEvent) -> &HashMap<Fingerprint, usize> {
        let fingerprint = Fingerprint::of_event(event);
        if let Some(n) = self.0.get_mut(&fingerprint) {
            *n -= 1;
            if *n == 0 {
                self.0.remove(&fingerprint);
            }
        }
        &self.0
    }
}

/// [`DeliveredKeys::skips`] over what was read.
fn skips(
    topics: &HashMap<String, Tail>,
    published: &mut HashSet<ParkedKey>,
    event: &OutboxEvent,
    later: &HashMap<Fingerprint, usize>,
    murmur2: bool,
) -> bool {
    let key = crate::cdc::poison_policy::key_of(event);
    if published.contains(&key) {
        return false;
    }
    let tail = topics.get(&event.topic);
    let own = tail.and_then(|t| t.records.get(&Fingerprint::of_event(event)));
    let held = match (tail, own, event.timestamp_ms) {
        (Some(tail), Some(own), Some(_))
            if !tail.unfinished.contains(&own.partition)
                && (tail.partitions == 1
                    || (murmur2
                        && murmur2_partition(&event.key, tail.partitions)
                            == Some(own.partition))) =>
        {
            tail.by_key.get(&event.key).is_none_or(|records| {
                // A key in several partitions (a random partitioner, partitions
                // added) has no one order to read.
                records.keys().all(|(p, _)| *p == own.partition) && newer_after(records, own, later)
            })
        }
        _ => false,
    };
    if !held {
        published.insert(key);
    }
    held
}

/// Whether every record of a key after `own` (its partition) is newer than it, or
/// as old and a later row's of the window (`later`).
fn newer_after(
    records: &BTreeMap<(i32, i64), Placed>,
    own: &Placed,
    later: &HashMap<Fingerprint, usize>,
) -> bool {
    let after = records.range((own.partition, own.offset + 1)..(own.partition, i64::MAX));
    after
        .into_iter()
        .all(|(_, x)| match (x.timestamp_ms, own.timestamp_ms) {
            (Some(theirs), Some(ours)) if theirs > ours => true,
            (Some(theirs), Some(ours)) if theirs == ours => later.contains_key(&x.fingerprint),
            _ => false,
        })
}

/// `topic`'s committed records with a timestamp at or after `since_ms` (from the
/// offset `ListOffsets` gives for it, to the end a `read_committed` reader sees),
/// each with its record key, and the partitions not read to their end.
/// Blocking.
fn read_keys(reader: &ClientConfig, topic: &str, since_ms: i64) -> Result<Read, KafkaError> {
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
    let mut keys = Vec::new();
    let count = partitions.len();
    let read = |records, unfinished: HashMap<i32, i64>| Read {
        records,
        unfinished: unfinished.into_keys().collect(),
        partitions: count,
    };
    if ends.is_empty() {
        return Ok(read(keys, ends));
    }
    consumer.assign(&assignment)?;
    let deadline = Instant::now() + READ_LIMIT;
    while !ends.is_empty() && Instant::now() < deadline && keys.len() < MAX_KEYS {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                let republished = m
                    .headers()
                    .is_some_and(|h| h.iter().any(|h| h.key == HEADER_REPUBLISH));
                if !republished
                    && let Some(idempotency_key) = m.headers().and_then(|h| {
                        h.iter()
                            .find(|h| h.key == HEADER_IDEMPOTENCY_KEY)
                            .and_then(|h| h.value)
                    })
                {
                    keys.push((
                        m.key().map(Bytes::copy_from_slice),
                        Placed {
                            partition: m.partition(),
                            offset: m.offset(),
                            // A broker's append time says nothing of the row.
                            timestamp_ms: match m.timestamp() {
                                rdkafka::Timestamp::CreateTime(ms) => Some(ms),
                                _ => None,
                            },
                            fingerprint: Fingerprint::of(idempotency_key, m.key(), m.payload()),
                        },
                    ));
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
            // What was read stays true: the rest is published again.
            Some(Err(e)) => {
                tracing::debug!(topic, error = %e, "resync: reading the topic stopped");
                return Ok(read(keys, ends));
            }
        }
    }
    Ok(read(keys, ends))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OutboxConfig;
    use crate::outbox::{OutboxMapper, OutboxRow};

    /// Row `id` of `entity`, created `created_s` seconds into the minute, whose
    /// payload is `seq`.
    fn event(id: &str, entity: &str, seq: u32, created_s: u32) -> OutboxEvent {
        let mapper = OutboxMapper::with_template(&OutboxConfig::default(), "events", None)
            .expect("a valid template");
        let row = OutboxRow {
            id: Some(Bytes::from(id.to_owned())),
            aggregate_id: Some(Bytes::from(entity.to_owned())),
            payload: Some(Bytes::from(format!("{{\"seq\":{seq}}}"))),
            created_at: Some(Bytes::from(format!(
                "2026-12-06 10:00:{created_s:02}.000000+00"
            ))),
            ..OutboxRow::default()
        };
        mapper.map_row(&row, None).expect("a mappable row")
    }

    /// The topic holding the records of `events`, in this order (record timestamp:
    /// the row's).
    fn holding(events: &[&OutboxEvent]) -> HashMap<String, Tail> {
        let mut tail = Tail::default();
        let read = events
            .iter()
            .enumerate()
            .map(|(offset, e)| {
                (
                    Some(e.key.clone()),
                    Placed {
                        partition: 0,
                        offset: i64::try_from(offset).unwrap_or(i64::MAX),
                        timestamp_ms: e.timestamp_ms,
                        fingerprint: Fingerprint::of_event(e),
                    },
                )
            })
            .collect();
        tail.add(read);
        tail.partitions = 1;
        HashMap::from([("events".to_owned(), tail)])
    }

    /// Which of `window` (in order) a resync skips, given what `topics` holds.
    fn skipped(topics: &HashMap<String, Tail>, window: &[&OutboxEvent]) -> Vec<bool> {
        let mut published = HashSet::new();
        let mut later = Later::of(window.iter().copied());
        window
            .iter()
            .map(|e| skips(topics, &mut published, e, later.after(e), true))
            .collect()
    }

    #[test]
    fn a_key_published_again_publishes_its_later_held_rows_too() {
        let (a0, a1, a2) = (
            event("1", "a", 0, 0),
            event("2", "a", 1, 1),
            event("4", "a", 2, 2),
        );
        let (b0, b1) = (event("3", "b", 0, 1), event("5", "b", 1, 3));
        // a:0's record is gone (compacted away, or not read); a:1, a:2 and b:0 are
        // held. Skipping a:1 and a:2 would leave a:0 as the key's latest record.
        let topics = holding(&[&a1, &b0, &a2]);
        assert_eq!(
            skipped(&topics, &[&a0, &b0, &a1, &b1, &a2]),
            [false, true, false, false, false]
        );
        // The usual resync: a held prefix of each key, then rows never delivered.
        let topics = holding(&[&a0, &a1]);
        assert_eq!(skipped(&topics, &[&a0, &a1, &a2]), [true, true, false]);
    }

    #[test]
    fn an_older_row_published_after_a_held_one_publishes_it_again() {
        // The stream delivered a:0 and a:1; a:0 was compacted away. A resync
        // published a:0 again and stopped before a:1: a:0 is marked sent, so the
        // resync that starts over reads a:1 alone, and must not skip it.
        let (a0, a1) = (event("1", "a", 0, 0), event("2", "a", 1, 1));
        let topics = holding(&[&a1, &a0]);
        assert_eq!(skipped(&topics, &[&a1]), [false]);
        // Rows of one millisecond: a later row's record after a held one is in
        // order when the later row is in the window.
        let (c0, c1) = (event("6", "c", 0, 5), event("7", "c", 1, 5));
        let topics = holding(&[&c0, &c1]);
        assert_eq!(skipped(&topics, &[&c0, &c1]), [true, true]);
        // Without it, the same-time record after c:0 may be an older row's.
        assert_eq!(skipped(&topics, &[&c0]), [false]);
    }

    #[test]
    fn where_the_topic_cannot_say_the_row_is_published() {
        let (a0, a1) = (event("1", "a", 0, 0), event("2", "a", 1, 1));
        let mut topics = holding(&[&a0]);
        assert_eq!(skipped(&topics, &[&a0]), [true]);
        // A partition not read to its end: a record of an older row may follow.
        if let Some(tail) = topics.get_mut("events") {
            tail.unfinished.insert(0);
        }
        assert_eq!(skipped(&topics, &[&a0]), [false]);
        // The key's records in two partitions: no one order to read.
        let mut topics = holding(&[&a0]);
        if let Some(tail) = topics.get_mut("events") {
            tail.add(vec![(
                Some(a1.key.clone()),
                Placed {
                    partition: 1,
                    offset: 0,
                    timestamp_ms: a1.timestamp_ms,
                    fingerprint: Fingerprint::of_event(&a1),
                },
            )]);
        }
        assert_eq!(skipped(&topics, &[&a0, &a1]), [false, false]);
    }

    #[test]
    fn keys_are_placed_as_the_java_client_places_them() {
        // Kafka's own test vectors (UtilsTest.testMurmur2), as signed ints.
        for (key, hash) in [
            ("21", -973_932_308_i32),
            ("foobar", -790_332_482),
            ("a-little-bit-long-string", -985_981_536),
            ("a-little-bit-longer-string", -1_486_304_829),
            (
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            ("abc", 479_470_107),
        ] {
            assert_eq!(murmur2(key.as_bytes()).cast_signed(), hash, "{key}");
        }
        assert_eq!(murmur2_partition(b"21", 1), Some(0));
        assert_eq!(murmur2_partition(b"21", 0), None);
    }

    #[test]
    fn a_key_whose_partition_moved_is_published() {
        let a0 = event("1", "a", 0, 0);
        let mut topics = holding(&[&a0]);
        let expected = murmur2_partition(&a0.key, 4);
        if let Some(tail) = topics.get_mut("events") {
            tail.partitions = 4;
        }
        // The record sits in partition 0; with 4 partitions the key goes to
        // `expected` now.
        let mut published = HashSet::new();
        let mut later = Later::of([&a0]);
        let held = skips(&topics, &mut published, &a0, later.after(&a0), true);
        assert_eq!(held, expected == Some(0));
        // A partitioner whose placement this reader cannot compute.
        let mut published = HashSet::new();
        let mut later = Later::of([&a0]);
        assert!(!skips(
            &topics,
            &mut published,
            &a0,
            later.after(&a0),
            false
        ));
    }

    #[test]
    fn a_record_stands_for_a_row_only_with_its_key_and_value() {
        let record = Fingerprint::of(b"1001", Some(b"order-7"), Some(b"{\"seq\":1}"));
        assert_eq!(
            record,
            Fingerprint::of(b"1001", Some(b"order-7"), Some(b"{\"seq\":1}"))
        );
        // A new row that got a delivered row's id after a restore: same key, other
        // content.
        assert_ne!(
            record,
            Fingerprint::of(b"1001", Some(b"order-9"), Some(b"{\"seq\":1}"))
        );
        assert_ne!(
            record,
            Fingerprint::of(b"1001", Some(b"order-7"), Some(b"{\"seq\":2}"))
        );
        assert_ne!(record, Fingerprint::of(b"1001", None, Some(b"{\"seq\":1}")));
    }
}
