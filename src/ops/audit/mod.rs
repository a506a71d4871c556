//! `outbox-relay audit`: a leak checker that compares the outbox with what the topics
//! hold.
//!
//! # Why
//!
//! The relay's promises (`docs/architecture.md#promises`) — no loss, at-least-once with a small duplicate
//! window, per-entity commit order — are tested in CI, but a user running it in
//! production wants to *see* them hold on their own data, after an incident, an
//! upgrade or a broker migration. `audit` reads the outbox rows of a range (and the
//! `poison_outbox` rows), reads the configured topics over the same range by the
//! `idempotency_key` header, and reports what is missing, repeated or reordered. It
//! only reads: no consumer-group offsets are committed, nothing is written to
//! PostgreSQL.
//!
//! # Definitions
//!
//! Rows and records are matched by **idempotency key**: the outbox row's
//! `idempotency_key` column (else its `id`, exactly as the mapper decides), and the
//! record's `idempotency_key` header.
//!
//! * **expected** — distinct idempotency keys among the outbox rows in the range
//!   (two rows sharing a key are one event to every deduplicating consumer).
//! * **delivered** — expected events found at least once on a topic read.
//! * **poisoned** — expected events *not* delivered that have a `poison_outbox` row
//!   (matched by its `idempotency_key`, else its `outbox_id`). A poisoned event that
//!   was replayed is delivered, and counted as such (the table also shows it as
//!   "replayed").
//! * **lost** — expected events neither delivered nor poisoned: a leak. So
//!   `expected = delivered + poisoned + lost`.
//! * **duplicates** — extra deliveries: for each expected event delivered *n* > 1
//!   times, *n* − 1. (The table also shows how many events had duplicates.)
//! * **out_of_order_keys** — entities (Kafka keys, per topic and partition) whose
//!   *first deliveries* are not in commit order. For each entity the records are
//!   taken in partition (offset) order, ignoring every delivery of an idempotency
//!   key after its first and ignoring poisoned events (a replay is out of order by
//!   design); each first delivery gets the position `(source_lsn, rank)`, where
//!   `source_lsn` is the record's `source_lsn` header (the commit LSN, CDC only) and
//!   `rank` is the row's place in `(created_at, id)` order. Consecutive positions
//!   must not go back: when both records carry a `source_lsn`, `(lsn, rank)` is
//!   compared lexicographically (a later transaction, or the same transaction with a
//!   later row); when either lacks one (polling relay, `replay`), only `rank` is
//!   compared. `created_at` is not commit order across concurrent transactions — it
//!   is the fallback, good for one entity whose writes are serialised by its own row
//!   lock, and it is why the commit LSN is preferred. An entity counts once however
//!   many violations it has.
//!
//! Records whose key is not in the range (older or newer rows, another producer)
//! and records without the header are counted in the table ("outside the range",
//! "without key") but in none of the six numbers.
//!
//! # Reading consistently
//!
//! The rows (and the poison rows) are read in one `REPEATABLE READ READ ONLY`
//! transaction; afterwards every partition of each topic is read from the beginning
//! or — with `--since` — from the first offset whose timestamp is at least `since`
//! (records carry `created_at` as CreateTime, so no record of the range is earlier)
//! to its end: the end of partition librdkafka reports when a fetch reaches the
//! high watermark. The high watermark captured at start (ListOffsets) bounds a
//! partition that producers keep ahead of the audit: once it is passed, the
//! partition is read for at most 5 more seconds. (It is not used as the exact end
//! because Tansu 0.6 under-reports it: the last *batch*'s base offset plus one.)
//! Reading also stops when nothing arrived for `--timeout-secs`; then the report
//! lists the partitions not read to the end. A row committed moments before the
//! audit may not be relayed yet and then shows as lost: audit a range that ends a
//! little in the past (`--until 1m`). The snapshot is held only while the rows are
//! read (`ORDER BY created_at, id`, which PostgreSQL sorts, on disk for large
//! ranges), not while the topics are.
//!
//! # Bounded memory
//!
//! Nothing per record is kept, and no row text: each row is one 16-byte entry — a
//! 64-bit hash of its idempotency key, its rank (`u32`), a saturating delivery count
//! and flags — in a vector sized exactly from a `count(*)` of the range and sorted
//! by hash, so lookups are binary searches and the memory is **16 bytes per row**
//! (10 million rows: 160 MB). Per-entity order state (24 bytes plus hash-table
//! overhead per entity) exists only for the topic being read and is dropped after
//! it. Rows are fetched from a portal in batches of [`BATCH_ROWS`], the poison table
//! is streamed the same way without being stored, and Kafka records are processed
//! one by one. The hash is SipHash-1-3 (std's `DefaultHasher`, fixed keys): for *n*
//! distinct keys the chance that any two collide is about n²/2⁶⁵ — 3·10⁻⁶ for 10
//! million rows, 3·10⁻⁴ for 100 million. Two rows whose hashes collide are counted
//! as one event ("shared keys" in the table); a record of an unrelated key colliding
//! with an expected one would count as its delivery. Per-row state is also what
//! limits a range to 2³² rows; audit larger tables in parts.
//!
//! When events are lost, the range is scanned a second time (without sorting) to
//! print up to [`LOST_SAMPLE`] of their idempotency keys.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::hash::{BuildHasherDefault, Hasher};
use std::str::FromStr;
use std::time::{Duration, Instant};

use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use tokio_postgres::{Client, IsolationLevel, Row};

use crate::config::ConfigError;
use crate::config::duration::parse_duration;
use crate::config::{Config, quote_ident, quote_qualified};
use crate::error::Error;
use crate::lsn::Lsn;
use crate::ops::meter::Meter;
use crate::outbox::{
    HEADER_IDEMPOTENCY_KEY, HEADER_SOURCE_LSN, OutboxMapper, OutboxRow, PayloadFormat,
};
use crate::postgres::prerequisite::Prerequisite;

/// Default for `--timeout-secs`.
pub const DEFAULT_TIMEOUT_SECS: u64 = 30;
/// Rows fetched per round trip from the outbox and poison portals.
pub const BATCH_ROWS: i32 = 10_000;
/// How many lost idempotency keys the report lists.
pub const LOST_SAMPLE: usize = 20;
/// How long a partition is still read after passing the end offset captured at
/// start without reaching its end (see `PartitionEnds`).
const PAST_END_GRACE: Duration = Duration::from_secs(5);
/// Timeout of one metadata / watermark / offset request to the broker.
const BROKER_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// `client.id` of the audit consumer.
const CONSUMER_CLIENT_ID: &str = "outbox-relay-audit";
/// `kafka.producer` settings copied to the consumer: how to reach and authenticate
/// to the brokers (names equal to, or starting with, one of these).
const CONSUMER_PASSTHROUGH: [&str; 9] = [
    "security.protocol",
    "sasl.",
    "ssl.",
    "ssl_",
    "enable.ssl.",
    "enable.sasl.",
    "client.dns.lookup",
    "broker.address.family",
    "socket.",
];

// ---------------------------------------------------------------------------
// Command-line arguments
// ---------------------------------------------------------------------------

/// Flags of `outbox-relay audit` (the CLI adds `--config`).
#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    /// Only rows with created_at at or after TIME: RFC 3339
    /// (2026-01-31T12:00:00Z) or a duration ago (90s, 15m, 1h, 2d, 1w, 1h30m).
    #[arg(long, value_name = "TIME")]
    pub since: Option<TimeSpec>,
    /// Only rows with created_at before TIME (same forms as --since). A little in
    /// the past (e.g. 1m) keeps events still in flight from counting as lost.
    #[arg(long, value_name = "TIME")]
    pub until: Option<TimeSpec>,
    /// Only rows with id at or after ID (compared in the id column's type).
    #[arg(long, value_name = "ID")]
    pub from_id: Option<String>,
    /// Only rows with id at or before ID.
    #[arg(long, value_name = "ID")]
    pub to_id: Option<String>,
    /// Topic to read (repeatable). Default: the topics the rows map to with the
    /// current config; give it when rows were published under another template.
    #[arg(long = "topic", value_name = "TOPIC")]
    pub topics: Vec<String>,
    /// Print the report as JSON:
    /// {"expected","delivered","lost","duplicates","out_of_order_keys","poisoned"}.
    #[arg(long)]
    pub json: bool,
    /// Stop reading a topic when no record arrived for this long before every
    /// partition reached the end offset captured at start.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_TIMEOUT_SECS)]
    pub timeout_secs: u64,
    /// No progress output on stderr.
    #[arg(long)]
    pub no_progress: bool,
}

impl Default for AuditArgs {
    fn default() -> Self {
        AuditArgs {
            since: None,
            until: None,
            from_id: None,
            to_id: None,
            topics: Vec::new(),
            json: false,
            timeout_secs: DEFAULT_TIMEOUT_SECS,
            no_progress: false,
        }
    }
}

/// A point in time on the command line: absolute, or a duration before now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeSpec {
    /// RFC 3339, e.g. `2026-01-31T12:00:00Z`.
    At(DateTime<Utc>),
    /// A duration ago, e.g. `1h` (resolved when the audit starts).
    Ago(Duration),
}

impl TimeSpec {
    /// The instant, relative to `now` for a duration.
    #[must_use]
    pub fn resolve(self, now: DateTime<Utc>) -> DateTime<Utc> {
        match self {
            TimeSpec::At(t) => t,
            TimeSpec::Ago(d) => chrono::Duration::from_std(d)
                .ok()
                .and_then(|d| now.checked_sub_signed(d))
                .unwrap_or(DateTime::<Utc>::MIN_UTC),
        }
    }
}

impl FromStr for TimeSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Ok(t) = DateTime::parse_from_rfc3339(s) {
            return Ok(TimeSpec::At(t.with_timezone(&Utc)));
        }
        parse_duration(s).map(TimeSpec::Ago).map_err(|why| {
            format!(
                "{s:?} is neither an RFC 3339 time (2026-01-31T12:00:00Z) nor a duration \
                 like 90s, 15m, 1h, 2d, 1w or 1h30m: {why}"
            )
        })
    }
}

// ---------------------------------------------------------------------------
// The report
// ---------------------------------------------------------------------------

/// What the audit found. The first six fields are the JSON contract
/// (`docs/architecture.md#json-output`);
/// the rest is detail for the human table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditReport {
    /// Distinct idempotency keys among the outbox rows in the range.
    pub expected: u64,
    /// Expected events found at least once on a topic.
    pub delivered: u64,
    /// Expected events neither delivered nor in the poison table.
    pub lost: u64,
    /// Extra deliveries (n − 1 for an event delivered n times).
    pub duplicates: u64,
    /// Entities whose first deliveries are not in commit order.
    pub out_of_order_keys: u64,
    /// Expected events not delivered but in the poison table.
    pub poisoned: u64,
    /// Events delivered more than once.
    pub duplicated_events: u64,
    /// Poisoned events that were delivered anyway (replayed); counted as delivered.
    pub replayed: u64,
    /// First deliveries that went back in commit order (an entity may have several).
    pub out_of_order_records: u64,
    /// Records read from the topics.
    pub records_read: u64,
    /// Records whose idempotency key is not a row of the range.
    pub outside_range: u64,
    /// Records without an `idempotency_key` header.
    pub without_key: u64,
    /// Rows that the current config cannot map to a record (the relay poisons them).
    pub unmappable_rows: u64,
    /// Rows that share their idempotency key (or its hash) with another row.
    pub shared_keys: u64,
    /// The range, as SQL-ish text.
    pub range: String,
    /// Topics read.
    pub topics: Vec<String>,
    /// Up to [`LOST_SAMPLE`] idempotency keys of lost events.
    pub lost_sample: Vec<String>,
    /// Things the reader should know (missing topic, partitions not read to the end).
    pub notes: Vec<String>,
    /// Bytes of per-row state held.
    pub state_bytes: u64,
    /// Wall-clock time of the audit.
    pub elapsed: Duration,
}

impl AuditReport {
    /// `{"expected","delivered","lost","duplicates","out_of_order_keys","poisoned"}`.
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "expected": self.expected,
            "delivered": self.delivered,
            "lost": self.lost,
            "duplicates": self.duplicates,
            "out_of_order_keys": self.out_of_order_keys,
            "poisoned": self.poisoned,
        })
    }

    /// Nothing lost and nothing out of order (duplicates and poison rows are within
    /// the promises: at-least-once, and visible poison).
    #[must_use]
    pub fn is_clean(&self) -> bool {
        self.lost == 0 && self.out_of_order_keys == 0
    }

    /// The human table.
    #[must_use]
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let topics = if self.topics.is_empty() {
            "(none)".to_owned()
        } else {
            self.topics.join(", ")
        };
        let _ = writeln!(out, "outbox audit: {}", self.range);
        let _ = writeln!(out, "topics:       {topics}");
        let _ = writeln!(out);
        let mut line = |label: &str, value: u64, note: String| {
            let _ = writeln!(out, "  {label:<18} {value:>12}  {note}");
        };
        line("expected", self.expected, String::new());
        line("delivered", self.delivered, {
            if self.replayed > 0 {
                format!("incl. {} replayed from poison", self.replayed)
            } else {
                String::new()
            }
        });
        line(
            "lost",
            self.lost,
            if self.lost > 0 {
                "LOST: in the outbox, on no topic, not poisoned".into()
            } else {
                String::new()
            },
        );
        line(
            "duplicates",
            self.duplicates,
            if self.duplicates > 0 {
                format!(
                    "extra deliveries of {} event(s); consumers dedupe by idempotency_key",
                    self.duplicated_events
                )
            } else {
                String::new()
            },
        );
        line(
            "out of order keys",
            self.out_of_order_keys,
            if self.out_of_order_keys > 0 {
                format!(
                    "OUT OF ORDER: {} first deliveries went back in commit order",
                    self.out_of_order_records
                )
            } else {
                String::new()
            },
        );
        line("poisoned", self.poisoned, {
            if self.poisoned > 0 {
                "in poison_outbox, not delivered (outbox-relay replay)".into()
            } else {
                String::new()
            }
        });
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "records read: {} ({} outside the range, {} without key)",
            self.records_read, self.outside_range, self.without_key
        );
        if self.unmappable_rows > 0 {
            let _ = writeln!(
                out,
                "unmappable rows: {} (the relay poisons them)",
                self.unmappable_rows
            );
        }
        if self.shared_keys > 0 {
            let _ = writeln!(
                out,
                "rows sharing an idempotency key with another row: {}",
                self.shared_keys
            );
        }
        if !self.lost_sample.is_empty() {
            let more = if self.lost > self.lost_sample.len() as u64 {
                format!(" (first {} of {})", self.lost_sample.len(), self.lost)
            } else {
                String::new()
            };
            let _ = writeln!(out, "lost idempotency keys{more}:");
            for key in &self.lost_sample {
                let _ = writeln!(out, "  {key}");
            }
        }
        for note in &self.notes {
            let _ = writeln!(out, "note: {note}");
        }
        let _ = writeln!(
            out,
            "state: {:.1} MiB, {:.1}s",
            self.state_bytes as f64 / (1024.0 * 1024.0),
            self.elapsed.as_secs_f64()
        );
        let verdict = match (self.lost > 0, self.out_of_order_keys > 0) {
            (false, false) => "result: clean",
            (true, false) => "result: EVENTS LOST",
            (false, true) => "result: OUT OF ORDER",
            (true, true) => "result: EVENTS LOST and OUT OF ORDER",
        };
        let _ = writeln!(out, "{verdict}");
        out
    }
}

// ---------------------------------------------------------------------------
// The ledger: per-row state and the matching rules (pure, no I/O)
// ---------------------------------------------------------------------------

/// SipHash-1-3 with fixed keys: stable within a process, well distributed.
fn hasher() -> std::hash::DefaultHasher {
    std::hash::DefaultHasher::new()
}

/// 64-bit hash of an idempotency key.
fn key_hash(key: &[u8]) -> u64 {
    let mut h = hasher();
    h.write(key);
    h.finish()
}

/// Hash identifying one entity's sequence: topic, partition and Kafka key.
fn entity_hash(topic: &str, partition: i32, key: &[u8]) -> u64 {
    let mut h = hasher();
    h.write_usize(topic.len());
    h.write(topic.as_bytes());
    h.write_i32(partition);
    h.write_usize(key.len());
    h.write(key);
    h.finish()
}

/// Hash-table hasher for keys that already are good 64-bit hashes.
#[derive(Debug, Default, Clone, Copy)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

const POISONED: u16 = 1;

/// One outbox row: 8 bytes, 16 with its hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowState {
    /// Place in `(created_at, id)` order within the range.
    rank: u32,
    /// Deliveries seen, saturating.
    deliveries: u16,
    flags: u16,
}

/// Position of a first delivery in commit order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Position {
    lsn: Option<Lsn>,
    rank: u32,
}

/// Whether `next` may follow `prev` in one entity's sequence (see the module doc).
fn in_commit_order(prev: Position, next: Position) -> bool {
    match (prev.lsn, next.lsn) {
        (Some(a), Some(b)) => (a, prev.rank) <= (b, next.rank),
        _ => prev.rank <= next.rank,
    }
}

/// Per-entity order state (for the topic being read).
#[derive(Debug, Clone, Copy)]
struct EntityState {
    last: Position,
    out_of_order: bool,
}

/// What one record told us.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Observed {
    /// First delivery of an expected event.
    First,
    /// A repeated delivery.
    Duplicate,
    /// First delivery, behind an earlier one of its entity in commit order.
    OutOfOrder,
    /// Not a row of the range.
    OutsideRange,
    /// No `idempotency_key` header.
    WithoutKey,
}

/// All per-row state of an audit and the counters.
#[derive(Debug, Default)]
struct Ledger {
    /// `(key hash, state)`; push order is rank order until [`Ledger::seal`] sorts by hash.
    rows: Vec<(u64, RowState)>,
    sealed: bool,
    entities: HashMap<u64, EntityState, BuildHasherDefault<PassThrough>>,
    shared_keys: u64,
    duplicates: u64,
    duplicated_events: u64,
    out_of_order_keys: u64,
    out_of_order_records: u64,
    records: u64,
    outside_range: u64,
    without_key: u64,
}

/// The final counts of a [`Ledger`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Counts {
    expected: u64,
    delivered: u64,
    lost: u64,
    poisoned: u64,
    replayed: u64,
}

impl Ledger {
    fn with_capacity(rows: usize) -> Ledger {
        Ledger {
            rows: Vec::with_capacity(rows),
            ..Ledger::default()
        }
    }

    /// Adds the next row in `(created_at, id)` order.
    fn push_row(&mut self, idempotency_key: &[u8]) -> Result<(), Error> {
        debug_assert!(!self.sealed);
        let rank = u32::try_from(self.rows.len()).map_err(|_| {
            Error::Other(
                "the range has more than 4294967295 rows: audit it in parts (--since/--until)"
                    .into(),
            )
        })?;
        self.rows.push((
            key_hash(idempotency_key),
            RowState {
                rank,
                deliveries: 0,
                flags: 0,
            },
        ));
        Ok(())
    }

    /// Sorts by hash for lookups; rows sharing a hash become one event (the
    /// earliest keeps its rank).
    fn seal(&mut self) {
        self.rows.sort_unstable_by_key(|(h, s)| (*h, s.rank));
        let before = self.rows.len();
        self.rows.dedup_by_key(|(h, _)| *h);
        self.shared_keys = (before - self.rows.len()) as u64;
        self.rows.shrink_to_fit();
        self.sealed = true;
    }

    fn find(&self, hash: u64) -> Option<usize> {
        debug_assert!(self.sealed);
        self.rows.binary_search_by_key(&hash, |(h, _)| *h).ok()
    }

    /// Marks the event with this key as having a poison row; false when it is not
    /// a row of the range.
    fn mark_poisoned(&mut self, idempotency_key: &[u8]) -> bool {
        match self.find(key_hash(idempotency_key)) {
            Some(i) => {
                self.rows[i].1.flags |= POISONED;
                true
            }
            None => false,
        }
    }

    /// One record, in partition order.
    fn observe(
        &mut self,
        topic: &str,
        partition: i32,
        key: Option<&[u8]>,
        idempotency_key: Option<&[u8]>,
        source_lsn: Option<Lsn>,
    ) -> Observed {
        self.records += 1;
        let Some(idempotency_key) = idempotency_key else {
            self.without_key += 1;
            return Observed::WithoutKey;
        };
        let Some(i) = self.find(key_hash(idempotency_key)) else {
            self.outside_range += 1;
            return Observed::OutsideRange;
        };
        let row = &mut self.rows[i].1;
        row.deliveries = row.deliveries.saturating_add(1);
        if row.deliveries > 1 {
            self.duplicates += 1;
            if row.deliveries == 2 {
                self.duplicated_events += 1;
            }
            return Observed::Duplicate;
        }
        if row.flags & POISONED != 0 {
            // Replayed after its successors: out of order by design, not a relay bug.
            return Observed::First;
        }
        let position = Position {
            lsn: source_lsn,
            rank: row.rank,
        };
        let entity = entity_hash(topic, partition, key.unwrap_or_default());
        match self.entities.entry(entity) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(EntityState {
                    last: position,
                    out_of_order: false,
                });
                Observed::First
            }
            std::collections::hash_map::Entry::Occupied(o) => {
                let state = o.into_mut();
                let ordered = in_commit_order(state.last, position);
                state.last = position;
                if ordered {
                    return Observed::First;
                }
                self.out_of_order_records += 1;
                if !state.out_of_order {
                    state.out_of_order = true;
                    self.out_of_order_keys += 1;
                }
                Observed::OutOfOrder
            }
        }
    }

    /// A topic was read to the end: its entities are done.
    fn end_topic(&mut self) {
        self.entities = HashMap::default();
    }

    /// Whether the row with this key is lost (in the range, not delivered, not poisoned).
    fn is_lost(&self, idempotency_key: &[u8]) -> bool {
        self.find(key_hash(idempotency_key)).is_some_and(|i| {
            let s = self.rows[i].1;
            s.deliveries == 0 && s.flags & POISONED == 0
        })
    }

    fn counts(&self) -> Counts {
        let mut c = Counts {
            expected: self.rows.len() as u64,
            ..Counts::default()
        };
        for (_, s) in &self.rows {
            let poisoned = s.flags & POISONED != 0;
            match (s.deliveries > 0, poisoned) {
                (true, false) => c.delivered += 1,
                (true, true) => {
                    c.delivered += 1;
                    c.replayed += 1;
                }
                (false, true) => c.poisoned += 1,
                (false, false) => c.lost += 1,
            }
        }
        c
    }

    /// Bytes held for rows (the entity map is per topic and not included).
    fn state_bytes(&self) -> u64 {
        (self.rows.capacity() * std::mem::size_of::<(u64, RowState)>()) as u64
    }
}

// ---------------------------------------------------------------------------
// PostgreSQL side
// ---------------------------------------------------------------------------

/// The range after resolving durations against the start time.
#[derive(Debug, Clone, Default)]
struct Range {
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    from_id: Option<String>,
    to_id: Option<String>,
}

impl Range {
    fn resolve(args: &AuditArgs, now: DateTime<Utc>) -> Result<Range, Error> {
        let range = Range {
            since: args.since.map(|t| t.resolve(now)),
            until: args.until.map(|t| t.resolve(now)),
            from_id: args.from_id.clone(),
            to_id: args.to_id.clone(),
        };
        if let (Some(s), Some(u)) = (range.since, range.until)
            && s >= u
        {
            return Err(usage(format!(
                "--since ({}) must be before --until ({})",
                rfc3339(s),
                rfc3339(u)
            )));
        }
        Ok(range)
    }

    fn describe(&self, cols: &Columns) -> String {
        let created = cols.created_at.as_deref().unwrap_or("created_at");
        let id = cols.id.as_ref().map_or("id", |(n, _)| n.as_str());
        let mut parts = Vec::new();
        if let Some(s) = self.since {
            parts.push(format!("{created} >= {}", rfc3339(s)));
        }
        if let Some(u) = self.until {
            parts.push(format!("{created} < {}", rfc3339(u)));
        }
        if let Some(f) = &self.from_id {
            parts.push(format!("{id} >= {f}"));
        }
        if let Some(t) = &self.to_id {
            parts.push(format!("{id} <= {t}"));
        }
        if parts.is_empty() {
            "all rows".into()
        } else {
            parts.join(" AND ")
        }
    }
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

fn usage(message: String) -> Error {
    Error::Config(ConfigError::Invalid(message))
}

/// The outbox columns present in the table (configured name, else the Debezium
/// alias the mapper also accepts).
#[derive(Debug, Clone, Default)]
struct Columns {
    /// Name and SQL type (for casting `--from-id`/`--to-id`).
    id: Option<(String, String)>,
    idempotency_key: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    event_type: Option<String>,
    topic: Option<String>,
    headers: Option<String>,
    payload: Option<String>,
    created_at: Option<String>,
}

async fn table_exists(client: &Client, table: &str) -> Result<bool, Error> {
    let row = client
        .query_one(
            "SELECT to_regclass($1::text) IS NOT NULL",
            &[&quote_qualified(table)],
        )
        .await?;
    Ok(row.get(0))
}

async fn resolve_columns(client: &Client, config: &Config) -> Result<Columns, Error> {
    let table = &config.outbox.table;
    if !table_exists(client, table).await? {
        return Err(Prerequisite::OutboxTableMissing {
            table: table.clone(),
        }
        .into());
    }
    let rows = client
        .query(
            "SELECT attname::text, format_type(atttypid, atttypmod) FROM pg_attribute
             WHERE attrelid = $1::text::regclass AND attnum > 0 AND NOT attisdropped",
            &[&quote_qualified(table)],
        )
        .await?;
    let present: HashMap<String, String> = rows
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
        .collect();
    let pick = |configured: &str, alias: Option<&str>| -> Option<String> {
        if present.contains_key(configured) {
            return Some(configured.to_owned());
        }
        alias
            .filter(|a| present.contains_key(*a))
            .map(str::to_owned)
    };
    let c = &config.outbox.columns;
    let id = pick(&c.id, None).and_then(|n| present.get(&n).map(|t| (n, t.clone())));
    Ok(Columns {
        id,
        idempotency_key: pick(&c.idempotency_key, None),
        aggregate_type: pick(&c.aggregate_type, Some("aggregatetype")),
        aggregate_id: pick(&c.aggregate_id, Some("aggregateid")),
        event_type: pick(&c.event_type, Some("type")),
        topic: pick(&c.topic, None),
        headers: pick(&c.headers, None),
        payload: pick(&c.payload, None),
        created_at: pick(&c.created_at, None),
    })
}

/// Checks `--from-id`/`--to-id` against the id column's type, so a typo is a usage
/// error rather than a failed scan.
async fn check_id_bounds(client: &Client, cols: &Columns, range: &Range) -> Result<(), Error> {
    let Some((_, ty)) = &cols.id else {
        return Ok(());
    };
    for (flag, bound) in [("--from-id", &range.from_id), ("--to-id", &range.to_id)] {
        if let Some(value) = bound
            && let Err(e) = client
                .query_one(&format!("SELECT $1::text::{ty}"), &[value])
                .await
        {
            return Err(usage(format!(
                "{flag} {value:?} is not a valid {ty}: {}",
                crate::postgres::describe_error(&e)
            )));
        }
    }
    Ok(())
}

/// The range's `WHERE` clause and its text parameters.
fn where_clause(cols: &Columns, range: &Range) -> Result<(String, Vec<String>), Error> {
    let mut conds = Vec::new();
    let mut params = Vec::new();
    let mut time = |bound: Option<DateTime<Utc>>, op: &str| -> Result<(), Error> {
        if let Some(t) = bound {
            let Some(col) = &cols.created_at else {
                return Err(usage(
                    "--since/--until need the created_at column, which the outbox table lacks"
                        .into(),
                ));
            };
            params.push(rfc3339(t));
            conds.push(format!(
                "{} {op} ${}::text::timestamptz",
                quote_ident(col),
                params.len()
            ));
        }
        Ok(())
    };
    time(range.since, ">=")?;
    time(range.until, "<")?;
    for (bound, op) in [(&range.from_id, ">="), (&range.to_id, "<=")] {
        if let Some(value) = bound {
            let Some((col, ty)) = &cols.id else {
                return Err(usage(
                    "--from-id/--to-id need the id column, which the outbox table lacks".into(),
                ));
            };
            params.push(value.clone());
            conds.push(format!(
                "{} {op} ${}::text::{ty}",
                quote_ident(col),
                params.len()
            ));
        }
    }
    let clause = if conds.is_empty() {
        String::new()
    } else {
        format!(" WHERE {}", conds.join(" AND "))
    };
    Ok((clause, params))
}

fn text_expr(col: Option<&String>) -> String {
    col.map_or_else(
        || "NULL::text".to_owned(),
        |c| format!("{}::text", quote_ident(c)),
    )
}

/// `SELECT` of the outbox columns the mapper needs (the payload only as "is it
/// NULL": its value decides nothing the audit needs, and it can be large).
fn rows_query(config: &Config, cols: &Columns, clause: &str, ordered: bool) -> String {
    let id = cols.id.as_ref().map(|(n, _)| n);
    let payload_is_null = cols.payload.as_ref().map_or_else(
        || "true".to_owned(),
        |p| format!("({} IS NULL)", quote_ident(p)),
    );
    let order: Vec<String> = [cols.created_at.as_ref(), id]
        .into_iter()
        .flatten()
        .map(|c| quote_ident(c))
        .collect();
    let order = if ordered && !order.is_empty() {
        format!(" ORDER BY {}", order.join(", "))
    } else {
        String::new()
    };
    format!(
        "SELECT {}, {}, {}, {}, {}, {}, {}, {payload_is_null}, {} FROM {}{clause}{order}",
        text_expr(id),
        text_expr(cols.idempotency_key.as_ref()),
        text_expr(cols.aggregate_type.as_ref()),
        text_expr(cols.aggregate_id.as_ref()),
        text_expr(cols.event_type.as_ref()),
        text_expr(cols.topic.as_ref()),
        text_expr(cols.headers.as_ref()),
        text_expr(cols.created_at.as_ref()),
        quote_qualified(&config.outbox.table),
    )
}

fn bytes_at(row: &Row, i: usize) -> Result<Option<Bytes>, Error> {
    let v: Option<&str> = row.try_get(i)?;
    Ok(v.map(|s| Bytes::copy_from_slice(s.as_bytes())))
}

/// One row of [`rows_query`] as the mapper's input.
fn outbox_row(row: &Row) -> Result<OutboxRow, Error> {
    let payload_is_null: bool = row.try_get(7)?;
    Ok(OutboxRow {
        id: bytes_at(row, 0)?,
        idempotency_key: bytes_at(row, 1)?,
        aggregate_type: bytes_at(row, 2)?,
        aggregate_id: bytes_at(row, 3)?,
        event_type: bytes_at(row, 4)?,
        topic: bytes_at(row, 5)?,
        headers: bytes_at(row, 6)?,
        // A stand-in: only NULL vs. not NULL matters to the mapping decisions.
        payload: (!payload_is_null).then(Bytes::new),
        payload_format: PayloadFormat::Raw,
        created_at: bytes_at(row, 8)?,
    })
}

/// The dedupe key the relay puts in the header: `idempotency_key`, else `id`.
fn dedupe_key(row: &OutboxRow) -> Bytes {
    row.idempotency_key
        .clone()
        .or_else(|| row.id.clone())
        .unwrap_or_default()
}

fn params_ref(params: &[String]) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
    params
        .iter()
        .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect()
}

/// What reading PostgreSQL produced.
#[derive(Debug)]
struct Loaded {
    ledger: Ledger,
    topics: BTreeSet<String>,
    unmappable: u64,
    notes: Vec<String>,
}

/// Reads the range's rows and the poison rows in one snapshot.
async fn load(
    client: &mut Client,
    config: &Config,
    cols: &Columns,
    range: &Range,
    progress: bool,
) -> Result<Loaded, Error> {
    let mapper = OutboxMapper::new(&config.outbox, &config.kafka, config.kafka.envelope.clone())?;
    let (clause, params) = where_clause(cols, range)?;
    let poison_exists = table_exists(client, &config.outbox.poison_table).await?;
    let tx = client
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    // A role's statement_timeout must not kill a long scan of a read-only audit.
    tx.batch_execute("SET LOCAL statement_timeout = 0").await?;

    let count_sql = format!(
        "SELECT count(*) FROM {}{clause}",
        quote_qualified(&config.outbox.table)
    );
    let total: i64 = tx.query_one(&count_sql, &params_ref(&params)).await?.get(0);
    let total = u64::try_from(total).unwrap_or(0);
    let capacity = usize::try_from(total)
        .map_err(|_| Error::Other(format!("{total} rows do not fit in memory")))?;
    let mut ledger = Ledger::with_capacity(capacity);
    let mut topics = BTreeSet::new();
    let mut unmappable = 0u64;

    let statement = tx.prepare(&rows_query(config, cols, &clause, true)).await?;
    let portal = tx.bind(&statement, &params_ref(&params)).await?;
    let mut bar = Meter::new(
        "audit",
        "outbox rows",
        total,
        progress && total >= crate::ops::meter::MIN_TOTAL,
    );
    loop {
        let batch = tx.query_portal(&portal, BATCH_ROWS).await?;
        for row in &batch {
            let row = outbox_row(row)?;
            ledger.push_row(&dedupe_key(&row))?;
            match mapper.map_row(&row, None) {
                Ok(event) => {
                    if !topics.contains(&event.topic) {
                        topics.insert(event.topic);
                    }
                }
                Err(_) => unmappable += 1,
            }
        }
        bar.inc(batch.len() as u64);
        if batch.len() < usize::try_from(BATCH_ROWS).unwrap_or(usize::MAX) {
            break;
        }
    }
    bar.finish();
    ledger.seal();

    let mut notes = Vec::new();
    if poison_exists {
        let sql = format!(
            "SELECT idempotency_key, outbox_id FROM {}",
            quote_qualified(&config.outbox.poison_table)
        );
        let statement = tx.prepare(&sql).await?;
        let portal = tx.bind(&statement, &[]).await?;
        loop {
            let batch = tx.query_portal(&portal, BATCH_ROWS).await?;
            for row in &batch {
                let key: Option<&str> = row.try_get(0)?;
                let outbox_id: Option<&str> = row.try_get(1)?;
                let matched = key.is_some_and(|k| ledger.mark_poisoned(k.as_bytes()));
                if !matched && let Some(id) = outbox_id {
                    ledger.mark_poisoned(id.as_bytes());
                }
            }
            if batch.len() < usize::try_from(BATCH_ROWS).unwrap_or(usize::MAX) {
                break;
            }
        }
    } else {
        notes.push(format!(
            "poison table {} does not exist: no event counts as poisoned",
            config.outbox.poison_table
        ));
    }
    tx.commit().await?;
    Ok(Loaded {
        ledger,
        topics,
        unmappable,
        notes,
    })
}

/// Second pass when events are lost: up to [`LOST_SAMPLE`] of their keys.
async fn lost_sample(
    client: &mut Client,
    config: &Config,
    cols: &Columns,
    range: &Range,
    ledger: &Ledger,
    lost: u64,
) -> Result<Vec<String>, Error> {
    let want = usize::try_from(lost).unwrap_or(usize::MAX).min(LOST_SAMPLE);
    let (clause, params) = where_clause(cols, range)?;
    let tx = client
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    tx.batch_execute("SET LOCAL statement_timeout = 0").await?;
    let statement = tx
        .prepare(&rows_query(config, cols, &clause, false))
        .await?;
    let portal = tx.bind(&statement, &params_ref(&params)).await?;
    let mut out = Vec::new();
    'scan: loop {
        let batch = tx.query_portal(&portal, BATCH_ROWS).await?;
        for row in &batch {
            let key = dedupe_key(&outbox_row(row)?);
            if ledger.is_lost(&key) {
                out.push(String::from_utf8_lossy(&key).into_owned());
                if out.len() >= want {
                    break 'scan;
                }
            }
        }
        if batch.len() < usize::try_from(BATCH_ROWS).unwrap_or(usize::MAX) {
            break;
        }
    }
    tx.commit().await?;
    Ok(out)
}

// ---------------------------------------------------------------------------
// Kafka side
// ---------------------------------------------------------------------------

/// Whether a `kafka.producer` setting is about reaching or authenticating to the
/// brokers, and so applies to the audit consumer too.
fn is_passthrough(key: &str) -> bool {
    CONSUMER_PASSTHROUGH
        .iter()
        .any(|p| key == *p || (p.ends_with(['.', '_']) && key.starts_with(p)))
}

/// Client context of the audit consumer: end-of-partition is how the audit knows it
/// read everything, not an error worth a log line (rdkafka's default context logs
/// every client error at ERROR level).
#[derive(Debug, Clone, Copy)]
struct AuditContext;

impl rdkafka::ClientContext for AuditContext {
    fn error(&self, error: KafkaError, reason: &str) {
        let eof = matches!(error, KafkaError::PartitionEOF(_))
            || error.rdkafka_error_code() == Some(rdkafka::types::RDKafkaErrorCode::PartitionEOF);
        if eof {
            tracing::debug!(%error, reason, "audit consumer reached a partition end");
        } else {
            tracing::warn!(%error, reason, "audit consumer error");
        }
    }
}

impl rdkafka::consumer::ConsumerContext for AuditContext {}

/// The audit consumer: assigned partitions only, no group membership, no commits.
fn consumer_config(config: &Config) -> Result<ClientConfig, ConfigError> {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", &config.kafka.brokers)
        .set("client.id", CONSUMER_CLIENT_ID)
        // Required by librdkafka for a consumer; never joined (assign, not subscribe).
        .set("group.id", CONSUMER_CLIENT_ID)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .set("auto.offset.reset", "earliest");
    for (key, value) in &config.kafka.producer {
        if is_passthrough(key) {
            cfg.set(key, value);
        }
    }
    cfg.create_native_config()
        .map_err(|e| ConfigError::Invalid(format!("kafka.producer (audit consumer): {e}")))?;
    Ok(cfg)
}

/// How reading one topic went.
#[derive(Debug, Default)]
struct TopicOutcome {
    notes: Vec<String>,
}

fn broker_error(what: &str, e: &KafkaError) -> Error {
    Error::BrokerUnavailable(format!("{what}: {e}"))
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

/// Start offset per partition for `created_at >= since`, or `None` when the broker
/// cannot say (then the partition is read from its low watermark).
fn start_offsets(
    consumer: &BaseConsumer<AuditContext>,
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
fn read_topic(
    cfg: &ClientConfig,
    topic: &str,
    since_ms: Option<i64>,
    idle_timeout: Duration,
    ledger: &mut Ledger,
    progress: bool,
) -> Result<TopicOutcome, Error> {
    let mut outcome = TopicOutcome::default();
    let consumer: BaseConsumer<AuditContext> = cfg
        .create_with_context(AuditContext)
        .map_err(|e| usage(format!("cannot create the audit consumer: {e}")))?;
    let metadata = consumer
        .fetch_metadata(Some(topic), BROKER_REQUEST_TIMEOUT)
        .map_err(|e| broker_error(&format!("metadata of topic {topic}"), &e))?;
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
            .map_err(|e| broker_error(&format!("watermarks of {topic}/{}", p.id()), &e))?;
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
                .map_err(|e| broker_error("assignment", &e))?;
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
        .map_err(|e| broker_error(&format!("assigning {topic}"), &e))?;
    let mut bar = Meter::new(
        "audit",
        format!("topic {topic}"),
        total,
        progress && total >= crate::ops::meter::MIN_TOTAL,
    );
    let mut last_activity = Instant::now();
    let mut last_error: Option<String> = None;
    let mut read = 0u64;
    while !ends.is_empty() {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let (idempotency_key, lsn) = audit_headers(&m);
                ledger.observe(topic, m.partition(), m.key(), idempotency_key, lsn);
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
                last_error = Some(e.to_string());
            }
            None => {}
        }
        ends.expire(Instant::now(), PAST_END_GRACE);
        if !ends.is_empty() && last_activity.elapsed() >= idle_timeout {
            if read == 0
                && let Some(e) = last_error
            {
                return Err(Error::BrokerUnavailable(format!("reading {topic}: {e}")));
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
    ledger.end_topic();
    Ok(outcome)
}

// ---------------------------------------------------------------------------
// The command
// ---------------------------------------------------------------------------

/// Runs the audit and returns the report (printing it is the caller's job; only
/// progress goes to stderr). A non-clean report ([`AuditReport::is_clean`]) is not
/// an error.
///
/// # Errors
///
/// Bad flags or config ([`Error::Config`], exit code 2); missing outbox table
/// ([`Error::Prerequisite`], 3); broker unreachable ([`Error::BrokerUnavailable`], 4);
/// PostgreSQL errors.
pub async fn run(config: &Config, args: &AuditArgs) -> Result<AuditReport, Error> {
    let started = Instant::now();
    let range = Range::resolve(args, Utc::now())?;
    let consumer_cfg = consumer_config(config)?;
    let progress = !args.no_progress;

    let mut client = crate::postgres::connect(&config.postgres.url).await?;
    // The mapper reads created_at as PostgreSQL's ISO output; a `timestamp`
    // column (and the range bounds) are taken as UTC, as the relay does.
    client
        .batch_execute("SET DateStyle = 'ISO, MDY'; SET TimeZone = 'UTC'")
        .await?;
    let cols = resolve_columns(&client, config).await?;
    check_id_bounds(&client, &cols, &range).await?;
    let Loaded {
        mut ledger,
        topics: mapped_topics,
        unmappable,
        mut notes,
    } = load(&mut client, config, &cols, &range, progress).await?;

    let topics: Vec<String> = if args.topics.is_empty() {
        mapped_topics.into_iter().collect()
    } else {
        let mut t = args.topics.clone();
        t.sort();
        t.dedup();
        t
    };
    let since_ms = range.since.map(|s| s.timestamp_millis());
    let idle = Duration::from_secs(args.timeout_secs.max(1));
    let topics_for_task = topics.clone();
    let (ledger, kafka_notes) = tokio::task::spawn_blocking(move || {
        let mut notes = Vec::new();
        for topic in &topics_for_task {
            let outcome = read_topic(&consumer_cfg, topic, since_ms, idle, &mut ledger, progress)?;
            notes.extend(outcome.notes);
        }
        Ok::<_, Error>((ledger, notes))
    })
    .await
    .map_err(|e| Error::Other(format!("audit consumer task failed: {e}")))??;
    notes.extend(kafka_notes);

    let counts = ledger.counts();
    let lost_keys = if counts.lost > 0 {
        lost_sample(&mut client, config, &cols, &range, &ledger, counts.lost).await?
    } else {
        Vec::new()
    };
    Ok(AuditReport {
        expected: counts.expected,
        delivered: counts.delivered,
        lost: counts.lost,
        duplicates: ledger.duplicates,
        out_of_order_keys: ledger.out_of_order_keys,
        poisoned: counts.poisoned,
        duplicated_events: ledger.duplicated_events,
        replayed: counts.replayed,
        out_of_order_records: ledger.out_of_order_records,
        records_read: ledger.records,
        outside_range: ledger.outside_range,
        without_key: ledger.without_key,
        unmappable_rows: unmappable,
        shared_keys: ledger.shared_keys,
        range: range.describe(&cols),
        topics,
        lost_sample: lost_keys,
        notes,
        state_bytes: ledger.state_bytes(),
        elapsed: started.elapsed(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lsn(s: &str) -> Option<Lsn> {
        Some(s.parse().unwrap())
    }

    /// A sealed ledger with rows `k0..kn` in that rank order.
    fn ledger(n: usize) -> Ledger {
        let mut l = Ledger::with_capacity(n);
        for i in 0..n {
            l.push_row(format!("k{i}").as_bytes()).unwrap();
        }
        l.seal();
        l
    }

    fn see(l: &mut Ledger, entity: &str, key: &str, lsn_: Option<Lsn>) -> Observed {
        l.observe("t", 0, Some(entity.as_bytes()), Some(key.as_bytes()), lsn_)
    }

    #[test]
    fn run_future_is_send() {
        fn assert_send<T: Send>(_: &T) {}
        let toml = "[postgres]\nurl = \"postgresql://h/db\"\n[kafka]\nbrokers = \"b:9092\"\n";
        let config = Config::from_sources("test", toml, Vec::new()).unwrap();
        let args = AuditArgs::default();
        let fut = run(&config, &args);
        assert_send(&fut);
    }

    #[test]
    fn row_state_is_sixteen_bytes_with_its_hash() {
        assert_eq!(std::mem::size_of::<(u64, RowState)>(), 16);
        let l = ledger(1000);
        assert_eq!(l.state_bytes(), 16_000);
    }

    #[test]
    fn all_delivered_once_in_order_is_clean() {
        let mut l = ledger(4);
        for (i, e) in ["a", "b", "a", "b"].iter().enumerate() {
            assert_eq!(see(&mut l, e, &format!("k{i}"), None), Observed::First);
        }
        let c = l.counts();
        assert_eq!(
            c,
            Counts {
                expected: 4,
                delivered: 4,
                ..Counts::default()
            }
        );
        assert_eq!(l.duplicates, 0);
        assert_eq!(l.out_of_order_keys, 0);
    }

    #[test]
    fn repeated_deliveries_are_duplicates_and_do_not_break_order() {
        let mut l = ledger(3);
        see(&mut l, "a", "k0", lsn("0/10"));
        see(&mut l, "a", "k1", lsn("0/20"));
        // A crash re-sends the in-flight window: k0 again, k1 again, then k2.
        assert_eq!(see(&mut l, "a", "k0", lsn("0/10")), Observed::Duplicate);
        assert_eq!(see(&mut l, "a", "k1", lsn("0/20")), Observed::Duplicate);
        assert_eq!(see(&mut l, "a", "k1", lsn("0/20")), Observed::Duplicate);
        assert_eq!(see(&mut l, "a", "k2", lsn("0/30")), Observed::First);
        assert_eq!(l.duplicates, 3);
        assert_eq!(l.duplicated_events, 2);
        assert_eq!(l.out_of_order_keys, 0);
        assert_eq!(l.counts().delivered, 3);
    }

    #[test]
    fn undelivered_rows_are_lost_unless_poisoned() {
        let mut l = ledger(3);
        assert!(l.mark_poisoned(b"k1"));
        assert!(!l.mark_poisoned(b"unknown"));
        see(&mut l, "a", "k0", None);
        let c = l.counts();
        assert_eq!((c.delivered, c.poisoned, c.lost), (1, 1, 1));
        assert!(l.is_lost(b"k2"));
        assert!(!l.is_lost(b"k1"));
        assert!(!l.is_lost(b"k0"));
        assert!(!l.is_lost(b"nope"));
    }

    #[test]
    fn replayed_poison_is_delivered_and_exempt_from_order() {
        let mut l = ledger(2);
        l.mark_poisoned(b"k0");
        see(&mut l, "a", "k1", lsn("0/20"));
        // Replay publishes k0 later, without a source_lsn.
        assert_eq!(see(&mut l, "a", "k0", None), Observed::First);
        let c = l.counts();
        assert_eq!((c.delivered, c.poisoned, c.replayed, c.lost), (2, 0, 1, 0));
        assert_eq!(l.out_of_order_keys, 0);
    }

    #[test]
    fn commit_lsn_decides_order_then_rank() {
        let mut l = ledger(4);
        // k1 committed (0/20) before k0 (0/30) although created later: in order.
        assert_eq!(see(&mut l, "a", "k1", lsn("0/20")), Observed::First);
        assert_eq!(see(&mut l, "a", "k0", lsn("0/30")), Observed::First);
        // Same transaction: rank decides; k3 before k2 goes back.
        assert_eq!(see(&mut l, "a", "k3", lsn("0/40")), Observed::First);
        assert_eq!(see(&mut l, "a", "k2", lsn("0/40")), Observed::OutOfOrder);
        assert_eq!(l.out_of_order_keys, 1);
    }

    #[test]
    fn lsn_going_back_is_out_of_order_once_per_entity() {
        let mut l = ledger(4);
        see(&mut l, "a", "k0", lsn("0/30"));
        assert_eq!(see(&mut l, "a", "k1", lsn("0/20")), Observed::OutOfOrder);
        assert_eq!(see(&mut l, "a", "k2", lsn("0/10")), Observed::OutOfOrder);
        assert_eq!(see(&mut l, "b", "k3", lsn("0/5")), Observed::First);
        assert_eq!(l.out_of_order_keys, 1);
        assert_eq!(l.out_of_order_records, 2);
    }

    #[test]
    fn without_lsn_rank_decides() {
        let mut l = ledger(3);
        see(&mut l, "a", "k2", None);
        assert_eq!(see(&mut l, "a", "k0", None), Observed::OutOfOrder);
        // Mixed: one side without LSN compares ranks only.
        let mut l = ledger(3);
        see(&mut l, "a", "k0", None);
        assert_eq!(see(&mut l, "a", "k1", lsn("0/1")), Observed::First);
        assert_eq!(see(&mut l, "a", "k2", None), Observed::First);
        assert_eq!(l.out_of_order_keys, 0);
    }

    #[test]
    fn entities_are_per_topic_and_partition() {
        let mut l = ledger(2);
        l.observe("t", 0, Some(b"a"), Some(b"k1"), None);
        // Same key on another partition (repartitioned topic): not compared.
        assert_eq!(
            l.observe("t", 1, Some(b"a"), Some(b"k0"), None),
            Observed::First
        );
        let mut l = ledger(2);
        l.observe("t1", 0, Some(b"a"), Some(b"k1"), None);
        assert_eq!(
            l.observe("t2", 0, Some(b"a"), Some(b"k0"), None),
            Observed::First
        );
        // After end_topic the state is gone too.
        let mut l = ledger(2);
        l.observe("t", 0, Some(b"a"), Some(b"k1"), None);
        l.end_topic();
        assert_eq!(
            l.observe("t", 0, Some(b"a"), Some(b"k0"), None),
            Observed::First
        );
    }

    #[test]
    fn foreign_records_are_counted_apart() {
        let mut l = ledger(1);
        assert_eq!(
            l.observe("t", 0, Some(b"a"), None, None),
            Observed::WithoutKey
        );
        assert_eq!(see(&mut l, "a", "other", None), Observed::OutsideRange);
        assert_eq!((l.records, l.without_key, l.outside_range), (2, 1, 1));
        assert_eq!(l.counts().lost, 1);
    }

    #[test]
    fn shared_keys_are_one_event_with_the_first_rank() {
        let mut l = Ledger::with_capacity(3);
        l.push_row(b"x").unwrap();
        l.push_row(b"y").unwrap();
        l.push_row(b"x").unwrap();
        l.seal();
        assert_eq!(l.shared_keys, 1);
        assert_eq!(l.counts().expected, 2);
        let i = l.find(key_hash(b"x")).unwrap();
        assert_eq!(l.rows[i].1.rank, 0);
    }

    #[test]
    fn report_json_has_exactly_the_contract_keys() {
        let r = AuditReport {
            expected: 5,
            delivered: 3,
            lost: 1,
            duplicates: 2,
            out_of_order_keys: 1,
            poisoned: 1,
            ..AuditReport::default()
        };
        let v = r.to_json();
        let keys: BTreeSet<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            BTreeSet::from([
                "expected",
                "delivered",
                "lost",
                "duplicates",
                "out_of_order_keys",
                "poisoned"
            ])
        );
        assert_eq!(v["lost"], 1);
        assert_eq!(v["duplicates"], 2);
        assert!(!r.is_clean());
    }

    #[test]
    fn clean_means_nothing_lost_nor_out_of_order() {
        let mut r = AuditReport {
            expected: 3,
            delivered: 2,
            poisoned: 1,
            duplicates: 7,
            ..AuditReport::default()
        };
        assert!(r.is_clean());
        r.out_of_order_keys = 1;
        assert!(!r.is_clean());
        r.out_of_order_keys = 0;
        r.lost = 1;
        assert!(!r.is_clean());
    }

    #[test]
    fn table_names_problems() {
        let r = AuditReport {
            expected: 3,
            delivered: 1,
            lost: 1,
            poisoned: 1,
            lost_sample: vec!["abc".into()],
            notes: vec!["topic x does not exist".into()],
            topics: vec!["t".into()],
            range: "all rows".into(),
            ..AuditReport::default()
        };
        let t = r.render_table();
        assert!(t.contains("expected"), "{t}");
        assert!(t.contains("EVENTS LOST"), "{t}");
        assert!(t.contains("abc"), "{t}");
        assert!(t.contains("note: topic x does not exist"), "{t}");
        let clean = AuditReport::default().render_table();
        assert!(clean.contains("result: clean"), "{clean}");
    }

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
    fn flags_parse_with_clap() {
        use clap::Parser;
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            audit: AuditArgs,
        }
        let cli = Cli::try_parse_from([
            "audit",
            "--since",
            "2026-01-31T12:00:00Z",
            "--until",
            "5m",
            "--from-id",
            "10",
            "--topic",
            "a",
            "--topic",
            "b",
            "--json",
            "--timeout-secs",
            "7",
        ])
        .unwrap();
        let a = cli.audit;
        assert!(matches!(a.since, Some(TimeSpec::At(_))));
        assert_eq!(a.until, Some(TimeSpec::Ago(Duration::from_secs(300))));
        assert_eq!(a.from_id.as_deref(), Some("10"));
        assert_eq!(a.topics, vec!["a", "b"]);
        assert!(a.json);
        assert_eq!(a.timeout_secs, 7);
        let defaults = Cli::try_parse_from(["audit"]).unwrap().audit;
        assert_eq!(defaults.timeout_secs, DEFAULT_TIMEOUT_SECS);
        assert!(!defaults.json && defaults.topics.is_empty() && defaults.since.is_none());
        let err = Cli::try_parse_from(["audit", "--since", "yesterday"]).unwrap_err();
        assert!(err.to_string().contains("RFC 3339"), "{err}");
    }

    #[test]
    fn rows_query_selects_text_and_orders_by_created_at_then_id() {
        let config = Config::from_sources(
            "test",
            "[postgres]\nurl = \"postgresql://h/db\"\n[kafka]\nbrokers = \"b\"\n",
            Vec::new(),
        )
        .unwrap();
        let cols = Columns {
            id: Some(("id".into(), "uuid".into())),
            idempotency_key: Some("idempotency_key".into()),
            aggregate_id: Some("aggregateid".into()),
            payload: Some("payload".into()),
            created_at: Some("created_at".into()),
            ..Columns::default()
        };
        let q = rows_query(&config, &cols, " WHERE x", true);
        assert_eq!(
            q,
            "SELECT \"id\"::text, \"idempotency_key\"::text, NULL::text, \"aggregateid\"::text, \
             NULL::text, NULL::text, NULL::text, (\"payload\" IS NULL), \"created_at\"::text \
             FROM \"public\".\"outbox\" WHERE x ORDER BY \"created_at\", \"id\""
        );
        assert!(!rows_query(&config, &cols, "", false).contains("ORDER BY"));
    }

    #[test]
    fn time_specs_parse_and_resolve() {
        let now = DateTime::parse_from_rfc3339("2026-01-31T12:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let at: TimeSpec = "2026-01-01T00:00:00+01:00".parse().unwrap();
        assert_eq!(rfc3339(at.resolve(now)), "2025-12-31T23:00:00.000000Z");
        let ago: TimeSpec = "1h".parse().unwrap();
        assert_eq!(rfc3339(ago.resolve(now)), "2026-01-31T11:00:00.000000Z");
        assert!("yesterday".parse::<TimeSpec>().is_err());
        let huge = TimeSpec::Ago(Duration::from_secs(u64::MAX));
        assert_eq!(huge.resolve(now), DateTime::<Utc>::MIN_UTC);
    }

    #[test]
    fn since_must_precede_until() {
        let args = AuditArgs {
            since: Some("1h".parse().unwrap()),
            until: Some("2h".parse().unwrap()),
            ..AuditArgs::default()
        };
        let err = Range::resolve(&args, Utc::now()).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
    }

    #[test]
    fn where_clause_casts_bounds() {
        let cols = Columns {
            id: Some(("id".into(), "uuid".into())),
            created_at: Some("created_at".into()),
            ..Columns::default()
        };
        let range = Range {
            since: Some(DateTime::<Utc>::MIN_UTC),
            until: None,
            from_id: Some("0190".into()),
            to_id: Some("0191".into()),
        };
        let (clause, params) = where_clause(&cols, &range).unwrap();
        assert_eq!(
            clause,
            " WHERE \"created_at\" >= $1::text::timestamptz AND \"id\" >= $2::text::uuid AND \"id\" <= $3::text::uuid"
        );
        assert_eq!(params.len(), 3);
        assert_eq!(where_clause(&cols, &Range::default()).unwrap().0, "");
        let no_time = Columns::default();
        assert!(where_clause(&no_time, &range).is_err());
    }

    #[test]
    fn only_connection_settings_reach_the_consumer() {
        for yes in [
            "security.protocol",
            "sasl.mechanism",
            "sasl.username",
            "ssl.ca.location",
            "enable.ssl.certificate.verification",
            "socket.timeout.ms",
        ] {
            assert!(is_passthrough(yes), "{yes}");
        }
        for no in ["linger.ms", "acks", "security", "compression.type", "sasl"] {
            assert!(!is_passthrough(no), "{no}");
        }
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
        let cfg = consumer_config(&config).unwrap();
        assert_eq!(cfg.get("security.protocol"), Some("SASL_PLAINTEXT"));
        assert_eq!(cfg.get("sasl.mechanism"), Some("PLAIN"));
        assert_eq!(cfg.get("linger.ms"), None);
        assert_eq!(cfg.get("enable.auto.commit"), Some("false"));
    }

    proptest! {
        #[test]
        fn counts_always_add_up(
            n in 0usize..60,
            poisoned in proptest::collection::vec(0usize..80, 0..20),
            records in proptest::collection::vec((0usize..80, 0u8..4, proptest::option::of(0u64..50)), 0..200),
        ) {
            let mut l = ledger(n);
            for p in &poisoned {
                l.mark_poisoned(format!("k{p}").as_bytes());
            }
            for (k, entity, lsn_) in &records {
                let key = format!("k{k}");
                l.observe("t", 0, Some(&[*entity]), Some(key.as_bytes()), lsn_.map(Lsn));
            }
            let c = l.counts();
            prop_assert_eq!(c.expected, n as u64);
            prop_assert_eq!(c.delivered + c.poisoned + c.lost, c.expected);
            prop_assert!(c.replayed <= c.delivered);
            prop_assert_eq!(l.records, records.len() as u64);
            prop_assert_eq!(c.delivered + l.duplicates + l.outside_range + l.without_key, l.records);
            prop_assert!(l.out_of_order_keys <= l.out_of_order_records);
            prop_assert!(l.out_of_order_keys <= 4);
        }

        #[test]
        fn in_order_first_deliveries_never_flag(
            n in 1usize..80,
            lsns in proptest::bool::ANY,
        ) {
            // Delivering in rank order (with LSNs non-decreasing) is always clean.
            let mut l = ledger(n);
            for i in 0..n {
                let key = format!("k{i}");
                let lsn_ = lsns.then_some(Lsn(i as u64 / 3));
                l.observe("t", 0, Some(b"e"), Some(key.as_bytes()), lsn_);
            }
            prop_assert_eq!(l.out_of_order_keys, 0);
        }

        #[test]
        fn time_spec_parse_never_panics(s in ".{0,24}") {
            let _ = s.parse::<TimeSpec>();
        }
    }
}
