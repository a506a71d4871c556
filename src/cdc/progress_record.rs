//! The progress record of `kafka.delivery = "exactly-once"`: what a committed Kafka
//! transaction made durable, written in that transaction, read back at start.
//!
//! # Where it lives
//!
//! In `kafka.progress_topic` (compacted; `migrate` creates it with one partition),
//! keyed by the slot's name, so that each relay (each shard) keeps its own latest
//! record and compaction keeps only that one. The value is JSON (contract in
//! `docs/architecture.md#the-progress-record`):
//!
//! ```json
//! {"version":1,"slot":"outbox_relay","system_identifier":"7715066301594421149",
//!  "timeline":1,"saved":"0/AFDD0000","confirmed":"0/AFDDBCA8",
//!  "partial":[{"commit":"0/AFDDBD00","admitted":3,"unresolved":[1]}]}
//! ```
//!
//! The system identifier is a string: it does not fit the integers JSON readers
//! agree on. `saved` is the relay's saved position when the record was written: a
//! session that starts below it is on a database that went back (a data directory
//! restored in place keeps its identifier and timeline), and the record is not used. `confirmed` and `partial` are the [`ProgressMark`]: every event of a
//! PostgreSQL transaction committed (`Begin.final_lsn`) below `confirmed` is durable,
//! and of each `partial` transaction the events `0..admitted` except the `unresolved`
//! ordinals.
//!
//! A record written by a backlog (a cutover, or the resync after a lost slot) also
//! names the rows it published in its transaction, whose `sent_at` marks are written
//! in PostgreSQL only after the Kafka commit (`cdc::backlog`):
//! `"backlog":{"system_identifier":"…","timeline":1,"server_started":…,
//! "consistent_point":"0/B0000060","sent":["17","18"]}`. The next backlog writes those marks first, so that a crash
//! between the two commits does not make it publish the rows again.
//!
//! # Reading the latest
//!
//! Only after `init_transactions` (which aborted whatever a predecessor left open)
//! and `read_committed`: a record of an aborted transaction names events that were
//! never committed. The partition is read backwards in growing windows from its end,
//! so a start costs one fetch while the topic is not compacted yet.

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::{Deserialize, Serialize};

use crate::cdc::progress::{PartialTx, ProgressMark};
use crate::cdc::unreplayed_poison::PoisonedEvents;
pub use crate::cdc::wal_identity::{TxIdentity, TxNames};
use crate::kafka::ReaderContext;
use crate::lsn::Lsn;
use crate::outbox::position::ServerHistory;

/// Version of the record's JSON.
const VERSION: u32 = 1;

/// Windows read back from a partition's end before reading it whole.
const WINDOWS: [i64; 3] = [1_000, 10_000, 100_000];

/// Timeout of one metadata or watermark request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// `fetch.wait.max.ms` of the reader: how long the broker may hold a fetch that has
/// nothing to return (see [`read_latest`]).
const FETCH_WAIT_MS: &str = "10";

/// How long a read may find nothing new before it gives up on a partition's end:
/// longer than a transaction may stay open (`kafka::TRANSACTION_TIMEOUT`), after
/// which the broker aborts it and the last stable offset moves.
const IDLE_LIMIT: Duration = Duration::from_secs(75);

/// One relay's progress: the slot it streams, the server history its positions
/// name, and the mark.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgressRecord {
    pub slot: String,
    pub history: ServerHistory,
    /// The relay's saved position when the record was written: a database whose
    /// session starts below it went back (restored in place), and the record does
    /// not hold for it.
    pub saved: Lsn,
    pub mark: ProgressMark,
    /// The transactions the mark names, by what a restore cannot hand out again
    /// (`cdc::wal_identity`): the one ending at the watermark and the partial ones,
    /// where known.
    pub names: TxNames,
    /// The rows a backlog published in the transaction of this record.
    pub backlog: Option<BacklogSent>,
    /// The events the relay poisoned, for a session on a promoted server that may
    /// lack their poison rows (`cdc::unreplayed_poison`).
    pub poisoned: PoisonedEvents,
}

/// Rows a backlog published in one Kafka transaction, before their `sent_at` marks
/// were written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BacklogSent {
    /// The server history the rows were read on (the record's own `history` is the
    /// carried streaming part's, which may be older).
    pub history: ServerHistory,
    /// When that server's postmaster started (microseconds since the Unix epoch): a
    /// server started since may have been restored from a copy.
    pub server_started: Option<i64>,
    /// The consistent point of the slot the backlog was read for: a server whose WAL
    /// ends below it went back (restored in place) and may have given the ids to
    /// other rows.
    pub consistent_point: Lsn,
    /// The outbox ids (as text) of the rows, in the order they were published.
    pub sent: Vec<String>,
    /// The outbox table the rows are from, with several `[[outbox]]` entries (ids
    /// of one table say nothing about another's); `None`: a single-outbox relay's.
    pub outbox: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct Json {
    version: u32,
    slot: String,
    system_identifier: String,
    timeline: u32,
    #[serde(default = "zero_lsn")]
    saved: String,
    confirmed: String,
    #[serde(default)]
    partial: Vec<JsonPartial>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    watermark_tx: Option<JsonTx>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    backlog: Option<JsonBacklog>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    poisoned_since: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    poisoned: Vec<JsonPoisoned>,
}

/// A poisoned event's name: its transaction's commit LSN and its ordinal there.
#[derive(Serialize, Deserialize)]
struct JsonPoisoned {
    commit: String,
    ordinal: u32,
}

/// A transaction's identity: its xid and commit time (µs since the Unix epoch).
#[derive(Serialize, Deserialize)]
struct JsonTx {
    xid: u32,
    committed_at_us: i64,
}

impl From<TxIdentity> for JsonTx {
    fn from(id: TxIdentity) -> JsonTx {
        JsonTx {
            xid: id.xid,
            committed_at_us: id.committed_us,
        }
    }
}

impl From<&JsonTx> for TxIdentity {
    fn from(j: &JsonTx) -> TxIdentity {
        TxIdentity {
            xid: j.xid,
            committed_us: j.committed_at_us,
        }
    }
}

#[derive(Serialize, Deserialize)]
struct JsonBacklog {
    system_identifier: String,
    timeline: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    server_started: Option<i64>,
    consistent_point: String,
    sent: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    outbox: Option<String>,
}

fn zero_lsn() -> String {
    Lsn::ZERO.to_string()
}

#[derive(Serialize, Deserialize)]
struct JsonPartial {
    commit: String,
    admitted: u32,
    #[serde(default)]
    unresolved: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tx: Option<JsonTx>,
}

/// A record that could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ProgressRecordError {
    #[error("the progress record is not valid JSON of version {VERSION}: {0}")]
    Json(#[from] serde_json::Error),
    #[error("the progress record's {field} is not valid: {value:?}")]
    Field { field: &'static str, value: String },
    #[error("the progress record is version {0}; this relay reads version {VERSION}")]
    Version(u32),
    #[error("the progress record reader's thread failed: {0}")]
    Task(String),
    #[error("the progress topic {topic:?} does not exist")]
    TopicMissing { topic: String },
    #[error("reading the progress topic {topic:?} failed: {source}")]
    Kafka { topic: String, source: KafkaError },
    #[error(
        "the progress topic {topic:?} could not be read to its end within {secs}s \
         (partition {partition} stopped at offset {at} of {end})"
    )]
    Incomplete {
        topic: String,
        partition: i32,
        at: i64,
        end: i64,
        secs: u64,
    },
}

impl From<ProgressRecordError> for crate::error::Error {
    /// A missing topic needs an operator (exit code 3); anything else is retried.
    fn from(e: ProgressRecordError) -> Self {
        match e {
            ProgressRecordError::TopicMissing { topic } => {
                crate::error::Error::ProgressTopicMissing { topic }
            }
            other => crate::error::Error::ProgressRecord(other.to_string()),
        }
    }
}

impl ProgressRecord {
    /// The record's JSON value.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let json = Json {
            version: VERSION,
            slot: self.slot.clone(),
            system_identifier: self.history.system_identifier.to_string(),
            timeline: self.history.timeline,
            saved: self.saved.to_string(),
            confirmed: self.mark.confirmed.to_string(),
            partial: self
                .mark
                .partial
                .iter()
                .map(|p| JsonPartial {
                    commit: p.commit.to_string(),
                    admitted: p.admitted,
                    unresolved: p.unresolved.clone(),
                    tx: self
                        .names
                        .partial
                        .iter()
                        .find(|(commit, _)| *commit == p.commit)
                        .map(|(_, id)| JsonTx::from(*id)),
                })
                .collect(),
            watermark_tx: self.names.watermark.map(JsonTx::from),
            backlog: self.backlog.as_ref().map(|b| JsonBacklog {
                system_identifier: b.history.system_identifier.to_string(),
                timeline: b.history.timeline,
                server_started: b.server_started,
                consistent_point: b.consistent_point.to_string(),
                sent: b.sent.clone(),
                outbox: b.outbox.clone(),
            }),
            poisoned_since: self.poisoned.since.map(|since| since.to_string()),
            poisoned: self
                .poisoned
                .events
                .iter()
                .map(|(commit, ordinal)| JsonPoisoned {
                    commit: commit.to_string(),
                    ordinal: *ordinal,
                })
                .collect(),
        };
        // Serializing these plain fields cannot fail.
        serde_json::to_vec(&json).unwrap_or_default()
    }

    /// [`ProgressRecord::encode`], leaving out the latest `partial` entries while the
    /// value is longer than `max` bytes: fewer entries only make a restart send
    /// their events again, never skip one.
    #[must_use]
    pub fn encode_within(&self, max: usize) -> Vec<u8> {
        let mut value = self.encode();
        if value.len() <= max {
            return value;
        }
        let mut record = self.clone();
        while value.len() > max && !record.mark.partial.is_empty() {
            let keep = record.mark.partial.len() / 2;
            record.mark.partial.truncate(keep);
            value = record.encode();
        }
        value
    }

    /// Parses a record's value.
    ///
    /// # Errors
    ///
    /// [`ProgressRecordError`] for invalid JSON, an unknown version, or a field that
    /// is not an LSN or a number.
    pub fn decode(value: &[u8]) -> Result<ProgressRecord, ProgressRecordError> {
        let json: Json = serde_json::from_slice(value)?;
        if json.version != VERSION {
            return Err(ProgressRecordError::Version(json.version));
        }
        let lsn = |field: &'static str, value: &str| {
            value
                .parse::<Lsn>()
                .map_err(|_| ProgressRecordError::Field {
                    field,
                    value: value.to_owned(),
                })
        };
        let system_identifier = |field: &'static str, value: &str| {
            value.parse().map_err(|_| ProgressRecordError::Field {
                field,
                value: value.to_owned(),
            })
        };
        let mut partial = Vec::with_capacity(json.partial.len());
        let mut names = TxNames {
            watermark: json.watermark_tx.as_ref().map(TxIdentity::from),
            partial: Vec::new(),
        };
        for p in &json.partial {
            let mut unresolved = p.unresolved.clone();
            unresolved.sort_unstable();
            let commit = lsn("partial.commit", &p.commit)?;
            if let Some(tx) = &p.tx {
                names.partial.push((commit, TxIdentity::from(tx)));
            }
            partial.push(PartialTx {
                commit,
                admitted: p.admitted,
                unresolved,
            });
        }
        let poisoned = PoisonedEvents {
            since: json
                .poisoned_since
                .as_deref()
                .map(|since| lsn("poisoned_since", since))
                .transpose()?,
            events: json
                .poisoned
                .iter()
                .map(|p| Ok((lsn("poisoned.commit", &p.commit)?, p.ordinal)))
                .collect::<Result<_, ProgressRecordError>>()?,
        };
        Ok(ProgressRecord {
            slot: json.slot,
            history: ServerHistory {
                system_identifier: system_identifier("system_identifier", &json.system_identifier)?,
                timeline: json.timeline,
            },
            saved: lsn("saved", &json.saved)?,
            mark: ProgressMark {
                confirmed: lsn("confirmed", &json.confirmed)?,
                partial,
            },
            names,
            backlog: match json.backlog {
                Some(b) => Some(BacklogSent {
                    history: ServerHistory {
                        system_identifier: system_identifier(
                            "backlog.system_identifier",
                            &b.system_identifier,
                        )?,
                        timeline: b.timeline,
                    },
                    server_started: b.server_started,
                    consistent_point: lsn("backlog.consistent_point", &b.consistent_point)?,
                    sent: b.sent,
                    outbox: b.outbox,
                }),
                None => None,
            },
            poisoned,
        })
    }
}

/// The progress record reader's client context.
const READER_CONTEXT: ReaderContext = ReaderContext {
    reader: "progress record",
};

/// The latest committed record of `slot` in `topic`, `None` if there is none.
/// Blocking: call it on a blocking thread.
///
/// # Errors
///
/// [`ProgressRecordError`] when the topic cannot be read to its end or the latest
/// record of `slot` is not valid.
pub fn read_latest(
    cfg: &ClientConfig,
    topic: &str,
    slot: &str,
) -> Result<Option<ProgressRecord>, ProgressRecordError> {
    let kafka = |source| ProgressRecordError::Kafka {
        topic: topic.to_owned(),
        source,
    };
    // The read ends with an empty fetch at the end of the partition (the commit
    // marker after the last record moves the position there), which the broker holds
    // for `fetch.wait.max.ms` (500 ms by default) waiting for new records: every start
    // of the relay paid it. Nothing new is awaited here.
    let mut cfg = cfg.clone();
    cfg.set("fetch.wait.max.ms", FETCH_WAIT_MS);
    let cfg = &cfg;
    let consumer: BaseConsumer<ReaderContext> =
        cfg.create_with_context(READER_CONTEXT).map_err(kafka)?;
    // The end to read to is the high watermark, which a read_committed consumer's
    // ListOffsets does not give (it answers the last stable offset): another relay's
    // open transaction on this partition would hide our latest record behind it.
    let mut ends = cfg.clone();
    ends.set("isolation.level", "read_uncommitted");
    let ends: BaseConsumer<ReaderContext> =
        ends.create_with_context(READER_CONTEXT).map_err(kafka)?;
    let metadata = consumer
        .fetch_metadata(Some(topic), REQUEST_TIMEOUT)
        .map_err(kafka)?;
    let Some(partitions) = metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map(|t| t.partitions().iter().map(|p| p.id()).collect::<Vec<_>>())
        .filter(|partitions| !partitions.is_empty())
    else {
        return Err(ProgressRecordError::TopicMissing {
            topic: topic.to_owned(),
        });
    };
    let mut latest = None;
    for partition in partitions {
        if let Some(value) = latest_in_partition(&consumer, &ends, topic, partition, slot)? {
            latest = Some(ProgressRecord::decode(&value)?);
        }
    }
    Ok(latest)
}

/// The value of the last record keyed `slot` in one partition.
fn latest_in_partition(
    consumer: &BaseConsumer<ReaderContext>,
    ends: &BaseConsumer<ReaderContext>,
    topic: &str,
    partition: i32,
    slot: &str,
) -> Result<Option<Vec<u8>>, ProgressRecordError> {
    let (low, high) = ends
        .fetch_watermarks(topic, partition, REQUEST_TIMEOUT)
        .map_err(|source| ProgressRecordError::Kafka {
            topic: topic.to_owned(),
            source,
        })?;
    for window in WINDOWS.iter().copied().map(Some).chain([None]) {
        let from = window.map_or(low, |w| (high - w).max(low));
        let found = read_range(consumer, topic, partition, from, high, slot)?;
        if found.is_some() || from <= low {
            return Ok(found);
        }
    }
    Ok(None)
}

/// Reads `[from, end)` of a partition; the value of the last record keyed `slot`.
fn read_range(
    consumer: &BaseConsumer<ReaderContext>,
    topic: &str,
    partition: i32,
    from: i64,
    end: i64,
    slot: &str,
) -> Result<Option<Vec<u8>>, ProgressRecordError> {
    let kafka = |source| ProgressRecordError::Kafka {
        topic: topic.to_owned(),
        source,
    };
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset(topic, partition, Offset::Offset(from))
        .map_err(kafka)?;
    consumer.assign(&assignment).map_err(kafka)?;
    let mut found = None;
    let mut at = from;
    let mut last_progress = Instant::now();
    while at < end {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                at = m.offset() + 1;
                last_progress = Instant::now();
                if m.key() == Some(slot.as_bytes()) {
                    found = m.payload().map(<[u8]>::to_vec);
                }
            }
            Some(Err(KafkaError::PartitionEOF(_))) => {
                // Control records (commit markers) may follow the last record: the
                // consumer's position says where it is. Short of the end, an open
                // transaction holds the last stable offset: wait for it to end.
                let position = consumer
                    .position()
                    .map_err(kafka)?
                    .find_partition(topic, partition)
                    .and_then(|e| match e.offset() {
                        Offset::Offset(o) => Some(o),
                        _ => None,
                    });
                if position.is_some_and(|p| p >= end) {
                    at = end;
                }
            }
            Some(Err(e)) => return Err(kafka(e)),
            None if last_progress.elapsed() > IDLE_LIMIT => {
                return Err(ProgressRecordError::Incomplete {
                    topic: topic.to_owned(),
                    partition,
                    at,
                    end,
                    secs: IDLE_LIMIT.as_secs(),
                });
            }
            None => {}
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> ProgressRecord {
        ProgressRecord {
            slot: "outbox_relay".into(),
            history: ServerHistory {
                system_identifier: 7_715_066_301_594_421_149,
                timeline: 3,
            },
            saved: Lsn(0xAFDD_0000),
            mark: ProgressMark {
                confirmed: Lsn(0xAFDD_BCA8),
                partial: vec![PartialTx {
                    commit: Lsn(0xAFDD_BD00),
                    admitted: 3,
                    unresolved: vec![1],
                }],
            },
            names: TxNames::default(),
            backlog: None,
            poisoned: PoisonedEvents::default(),
        }
    }

    #[test]
    fn a_record_names_its_transactions_by_xid_and_commit_time() {
        let mut named = record();
        named.names = TxNames {
            watermark: Some(TxIdentity {
                xid: 4_000_000_001,
                committed_us: 1_796_371_200_123_456,
            }),
            partial: vec![(
                Lsn(0xAFDD_BD00),
                TxIdentity {
                    xid: 4_000_000_002,
                    committed_us: 1_796_371_200_223_456,
                },
            )],
        };
        let value = named.encode();
        let text = String::from_utf8(value.clone()).unwrap();
        assert!(
            text.contains(r#""unresolved":[1],"tx":{"xid":4000000002,"committed_at_us":1796371200223456}}],"watermark_tx":{"xid":4000000001,"committed_at_us":1796371200123456}"#),
            "{text}"
        );
        assert_eq!(ProgressRecord::decode(&value).unwrap(), named);
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let value = record().encode();
        let text = String::from_utf8(value.clone()).unwrap();
        assert_eq!(
            text,
            r#"{"version":1,"slot":"outbox_relay","system_identifier":"7715066301594421149","timeline":3,"saved":"0/AFDD0000","confirmed":"0/AFDDBCA8","partial":[{"commit":"0/AFDDBD00","admitted":3,"unresolved":[1]}]}"#
        );
        assert_eq!(ProgressRecord::decode(&value).unwrap(), record());
    }

    #[test]
    fn a_record_names_the_events_it_poisoned() {
        let mut poisoned = record();
        poisoned.poisoned = PoisonedEvents {
            since: Some(Lsn(0xAF00_0028)),
            events: vec![(Lsn(0xAFDD_9F10), 0), (Lsn(0xAFDD_BD00), 2)],
        };
        let value = poisoned.encode();
        let text = String::from_utf8(value.clone()).unwrap();
        assert!(
            text.ends_with(
                r#""poisoned_since":"0/AF000028","poisoned":[{"commit":"0/AFDD9F10","ordinal":0},{"commit":"0/AFDDBD00","ordinal":2}]}"#
            ),
            "{text}"
        );
        assert_eq!(ProgressRecord::decode(&value).unwrap(), poisoned);
        // A record written before the list existed says nothing of it.
        assert_eq!(
            ProgressRecord::decode(&record().encode()).unwrap().poisoned,
            PoisonedEvents::default()
        );
        let bad = text.replace("0/AFDD9F10", "nope");
        assert!(ProgressRecord::decode(bad.as_bytes()).is_err());
    }

    #[test]
    fn a_backlog_record_names_its_rows() {
        let mut with_rows = record();
        with_rows.backlog = Some(BacklogSent {
            history: ServerHistory {
                system_identifier: 7_715_066_301_594_421_149,
                timeline: 4,
            },
            server_started: Some(1_796_371_200_000_000),
            consistent_point: Lsn(0xB000_0060),
            sent: vec!["17".into(), "3f2c".into()],
            outbox: None,
        });
        let value = with_rows.encode();
        let text = String::from_utf8(value.clone()).unwrap();
        assert!(
            text.ends_with(
                r#","backlog":{"system_identifier":"7715066301594421149","timeline":4,"server_started":1796371200000000,"consistent_point":"0/B0000060","sent":["17","3f2c"]}}"#
            ),
            "{text}"
        );
        assert_eq!(ProgressRecord::decode(&value).unwrap(), with_rows);
        let bad = text.replace("0/B0000060", "nope");
        assert!(ProgressRecord::decode(bad.as_bytes()).is_err());

        // With several outboxes the rows' table is named, and read back.
        if let Some(backlog) = with_rows.backlog.as_mut() {
            backlog.outbox = Some("billing.outbox".into());
        }
        let value = with_rows.encode();
        let text = String::from_utf8(value.clone()).unwrap();
        assert!(
            text.ends_with(r#""sent":["17","3f2c"],"outbox":"billing.outbox"}}"#),
            "{text}"
        );
        assert_eq!(ProgressRecord::decode(&value).unwrap(), with_rows);
    }

    #[test]
    fn a_record_too_large_leaves_out_its_latest_partial_entries() {
        let mut big = record();
        big.mark.partial = (0..10_000)
            .map(|i| PartialTx {
                commit: Lsn(0xB000_0000 + i),
                admitted: 100,
                unresolved: (0..50).collect(),
            })
            .collect();
        let value = big.encode_within(64 * 1024);
        assert!(value.len() <= 64 * 1024);
        let back = ProgressRecord::decode(&value).unwrap();
        assert!(!back.mark.partial.is_empty());
        assert_eq!(
            back.mark.partial[..],
            big.mark.partial[..back.mark.partial.len()]
        );
        assert_eq!(back.mark.confirmed, big.mark.confirmed);
    }

    #[test]
    fn invalid_records_are_errors_not_panics() {
        for bad in [
            &b"not json"[..],
            br#"{"version":2,"slot":"s","system_identifier":"1","timeline":1,"confirmed":"0/1"}"#,
            br#"{"version":1,"slot":"s","system_identifier":"x","timeline":1,"confirmed":"0/1"}"#,
            br#"{"version":1,"slot":"s","system_identifier":"1","timeline":1,"confirmed":"zz"}"#,
        ] {
            assert!(ProgressRecord::decode(bad).is_err());
        }
    }

    proptest::proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let _ = ProgressRecord::decode(&bytes);
        }
    }
}
