//! The transaction coordinator (KIP-98) and the producer-id registry: which
//! producer ids this broker issued, their epochs, each transactional id's current
//! transaction, fencing, and the timeout that aborts a transaction its producer
//! abandoned.
//!
//! The rules, as Kafka applies them:
//! - InitProducerId without a transactional id issues a new producer id at epoch 0
//!   (or bumps the epoch of the id the producer names, KIP-360). An idempotent
//!   producer may also bump its epoch locally: a Produce with a newer epoch of an id
//!   issued here is accepted (its sequences restart at 0, see [`super::sequence`]).
//! - InitProducerId with a transactional id keeps that id's producer id and bumps
//!   its epoch; a transaction still open under the old epoch is aborted first
//!   (ABORT markers, written with the new epoch). Every later request under an
//!   older epoch is fenced.
//! - A transactional batch may only go to a partition added to the open
//!   transaction (AddPartitionsToTxn); EndTxn writes a COMMIT or ABORT marker to
//!   every partition of the transaction.
//! - A transaction open longer than its `transaction.timeout.ms` is aborted by the
//!   broker, which bumps the epoch so the abandoned producer is fenced if it ever
//!   comes back.
//!
//! Time is passed in (`now`), so all of this is tested without a clock. This module
//! decides; the caller writes the markers it returns into the partition logs.

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// Kafka's default `transaction.max.timeout.ms` (15 minutes).
pub(super) const MAX_TRANSACTION_TIMEOUT_MS: i32 = 900_000;

/// A topic partition named in a transaction.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(super) struct TopicPartition {
    pub(super) topic: String,
    pub(super) partition: i32,
}

/// A consumer offset committed inside a transaction (TxnOffsetCommit), applied to
/// the group's offsets when the transaction commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct PendingOffset {
    pub(super) group: String,
    pub(super) topic: String,
    pub(super) partition: i32,
    pub(super) offset: i64,
    pub(super) metadata: Option<String>,
}

/// The end of a transaction to write: one marker per partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Markers {
    pub(super) transactional_id: String,
    pub(super) producer_id: i64,
    pub(super) producer_epoch: i16,
    pub(super) commit: bool,
    pub(super) partitions: Vec<TopicPartition>,
}

/// What EndTxn decided.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Ended {
    pub(super) markers: Option<Markers>,
    /// Offsets to apply to the groups (a commit's only).
    pub(super) offsets: Vec<PendingOffset>,
}

/// A producer id and epoch handed out by InitProducerId.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ProducerIdAndEpoch {
    pub(super) producer_id: i64,
    pub(super) epoch: i16,
}

/// Why a producer or transaction request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum TxnError {
    #[error("producer id {0} was not issued by this broker")]
    UnknownProducerId(i64),
    #[error("producer {producer_id} epoch {got} is fenced (current epoch {current})")]
    Fenced {
        producer_id: i64,
        current: i16,
        got: i16,
    },
    #[error("producer id {producer_id} does not belong to transactional id {transactional_id:?}")]
    ProducerIdMapping {
        transactional_id: String,
        producer_id: i64,
    },
    #[error("transaction timeout {0} ms is not within 1..={1} (transaction.max.timeout.ms)")]
    InvalidTimeout(i32, i32),
    #[error("invalid transaction state: {0}")]
    InvalidState(&'static str),
    #[error("{}-{} was not added to the transaction", .0.topic, .0.partition)]
    NotInTransaction(TopicPartition),
}

#[derive(Debug)]
struct Producer {
    epoch: i16,
    transactional_id: Option<String>,
}

#[derive(Debug)]
enum State {
    /// No transaction open; `last` is how the previous one ended (a retried
    /// EndTxn with the same result succeeds).
    Empty { last: Option<bool> },
    Ongoing {
        partitions: BTreeSet<TopicPartition>,
        offsets: Vec<PendingOffset>,
        deadline: Instant,
    },
}

#[derive(Debug)]
struct Transaction {
    producer_id: i64,
    epoch: i16,
    timeout: Duration,
    state: State,
}

/// Producer ids and transactions.
#[derive(Debug)]
pub(super) struct Coordinator {
    /// `transaction.max.timeout.ms`: a longer producer timeout is refused.
    max_timeout_ms: i32,
    next_producer_id: i64,
    producers: HashMap<i64, Producer>,
    transactions: HashMap<String, Transaction>,
}

impl Default for Coordinator {
    fn default() -> Self {
        Self::with_max_timeout(MAX_TRANSACTION_TIMEOUT_MS)
    }
}

impl Coordinator {
    /// A coordinator whose `transaction.max.timeout.ms` is `max_timeout_ms`.
    pub(super) fn with_max_timeout(max_timeout_ms: i32) -> Self {
        Self {
            max_timeout_ms,
            next_producer_id: 0,
            producers: HashMap::new(),
            transactions: HashMap::new(),
        }
    }

    /// `transaction.max.timeout.ms`.
    pub(super) fn max_timeout_ms(&self) -> i32 {
        self.max_timeout_ms
    }
}

fn allocate(next: &mut i64) -> i64 {
    let id = *next;
    *next += 1;
    id
}

/// Bumps a transactional id's epoch (a new producer id at epoch 0 once the epoch is
/// exhausted; the old id stays registered at the last epoch, so it is fenced).
/// Returns the epoch the markers of the old producer id are written with.
fn bump(
    transactional_id: &str,
    txn: &mut Transaction,
    producers: &mut HashMap<i64, Producer>,
    next: &mut i64,
) -> i16 {
    if txn.epoch < i16::MAX - 1 {
        txn.epoch += 1;
        if let Some(p) = producers.get_mut(&txn.producer_id) {
            p.epoch = txn.epoch;
        }
        txn.epoch
    } else {
        if let Some(p) = producers.get_mut(&txn.producer_id) {
            p.epoch = i16::MAX;
        }
        txn.producer_id = allocate(next);
        txn.epoch = 0;
        producers.insert(
            txn.producer_id,
            Producer {
                epoch: 0,
                transactional_id: Some(transactional_id.to_owned()),
            },
        );
        i16::MAX
    }
}

impl Coordinator {
    /// InitProducerId. `producer_id`/`producer_epoch` are the request's (-1 when
    /// the producer has none yet). Returns the id and epoch to use, and the markers
    /// of a transaction the new epoch aborted.
    pub(super) fn init_producer_id(
        &mut self,
        transactional_id: Option<&str>,
        timeout_ms: i32,
        producer_id: i64,
        producer_epoch: i16,
    ) -> Result<(ProducerIdAndEpoch, Option<Markers>), TxnError> {
        let Some(tid) = transactional_id else {
            if let Some(p) = self.producers.get_mut(&producer_id)
                && p.transactional_id.is_none()
                && p.epoch == producer_epoch
                && p.epoch < i16::MAX - 1
            {
                p.epoch += 1;
                let epoch = p.epoch;
                return Ok((ProducerIdAndEpoch { producer_id, epoch }, None));
            }
            let producer_id = allocate(&mut self.next_producer_id);
            self.producers.insert(
                producer_id,
                Producer {
                    epoch: 0,
                    transactional_id: None,
                },
            );
            return Ok((
                ProducerIdAndEpoch {
                    producer_id,
                    epoch: 0,
                },
                None,
            ));
        };
        if !(1..=self.max_timeout_ms).contains(&timeout_ms) {
            return Err(TxnError::InvalidTimeout(timeout_ms, self.max_timeout_ms));
        }
        let timeout = Duration::from_millis(timeout_ms.unsigned_abs().into());
        let Some(txn) = self.transactions.get_mut(tid) else {
            let producer_id = allocate(&mut self.next_producer_id);
            self.producers.insert(
                producer_id,
                Producer {
                    epoch: 0,
                    transactional_id: Some(tid.to_owned()),
                },
            );
            self.transactions.insert(
                tid.to_owned(),
                Transaction {
                    producer_id,
                    epoch: 0,
                    timeout,
                    state: State::Empty { last: None },
                },
            );
            return Ok((
                ProducerIdAndEpoch {
                    producer_id,
                    epoch: 0,
                },
                None,
            ));
        };
        // KIP-360: a producer that names its current id and epoch asks for a bump;
        // naming an older one means it was fenced meanwhile.
        if producer_id >= 0 {
            if producer_id != txn.producer_id {
                return Err(TxnError::ProducerIdMapping {
                    transactional_id: tid.to_owned(),
                    producer_id,
                });
            }
            if producer_epoch != txn.epoch {
                return Err(TxnError::Fenced {
                    producer_id,
                    current: txn.epoch,
                    got: producer_epoch,
                });
            }
        }
        let old_producer_id = txn.producer_id;
        let marker_epoch = bump(tid, txn, &mut self.producers, &mut self.next_producer_id);
        txn.timeout = timeout;
        let previous = std::mem::replace(&mut txn.state, State::Empty { last: None });
        let markers = match previous {
            State::Ongoing { partitions, .. } => Some(Markers {
                transactional_id: tid.to_owned(),
                producer_id: old_producer_id,
                producer_epoch: marker_epoch,
                commit: false,
                partitions: partitions.into_iter().collect(),
            }),
            State::Empty { .. } => None,
        };
        Ok((
            ProducerIdAndEpoch {
                producer_id: txn.producer_id,
                epoch: txn.epoch,
            },
            markers,
        ))
    }

    /// The transaction of `tid` if `producer_id`/`epoch` are its current ones.
    fn current(
        &mut self,
        tid: &str,
        producer_id: i64,
        epoch: i16,
    ) -> Result<&mut Transaction, TxnError> {
        let retired_of_tid = self
            .producers
            .get(&producer_id)
            .is_some_and(|p| p.transactional_id.as_deref() == Some(tid));
        let mapping = || TxnError::ProducerIdMapping {
            transactional_id: tid.to_owned(),
            producer_id,
        };
        let txn = self.transactions.get_mut(tid).ok_or_else(mapping)?;
        if producer_id != txn.producer_id {
            return Err(if retired_of_tid {
                TxnError::Fenced {
                    producer_id,
                    current: txn.epoch,
                    got: epoch,
                }
            } else {
                mapping()
            });
        }
        if epoch != txn.epoch {
            return Err(TxnError::Fenced {
                producer_id,
                current: txn.epoch,
                got: epoch,
            });
        }
        Ok(txn)
    }

    /// AddPartitionsToTxn (the caller has checked that the partitions exist).
    pub(super) fn add_partitions(
        &mut self,
        tid: &str,
        producer_id: i64,
        epoch: i16,
        partitions: impl IntoIterator<Item = TopicPartition>,
        now: Instant,
    ) -> Result<(), TxnError> {
        let txn = self.current(tid, producer_id, epoch)?;
        let deadline = now + txn.timeout;
        match &mut txn.state {
            State::Ongoing { partitions: p, .. } => p.extend(partitions),
            State::Empty { .. } => {
                txn.state = State::Ongoing {
                    partitions: partitions.into_iter().collect(),
                    offsets: Vec::new(),
                    deadline,
                };
            }
        }
        Ok(())
    }

    /// AddOffsetsToTxn: starts the transaction if needed (the offsets themselves
    /// come with TxnOffsetCommit).
    pub(super) fn add_offsets(
        &mut self,
        tid: &str,
        producer_id: i64,
        epoch: i16,
        now: Instant,
    ) -> Result<(), TxnError> {
        self.add_partitions(tid, producer_id, epoch, [], now)
    }

    /// TxnOffsetCommit: offsets applied when the transaction commits.
    pub(super) fn txn_offset_commit(
        &mut self,
        tid: &str,
        producer_id: i64,
        epoch: i16,
        pending: Vec<PendingOffset>,
    ) -> Result<(), TxnError> {
        match &mut self.current(tid, producer_id, epoch)?.state {
            State::Ongoing { offsets, .. } => {
                offsets.extend(pending);
                Ok(())
            }
            State::Empty { .. } => Err(TxnError::InvalidState(
                "TxnOffsetCommit without AddOffsetsToTxn",
            )),
        }
    }

    /// EndTxn.
    pub(super) fn end_txn(
        &mut self,
        tid: &str,
        producer_id: i64,
        epoch: i16,
        commit: bool,
    ) -> Result<Ended, TxnError> {
        let txn = self.current(tid, producer_id, epoch)?;
        let previous = std::mem::replace(&mut txn.state, State::Empty { last: Some(commit) });
        match previous {
            State::Ongoing {
                partitions,
                offsets,
                ..
            } => Ok(Ended {
                markers: Some(Markers {
                    transactional_id: tid.to_owned(),
                    producer_id,
                    producer_epoch: epoch,
                    commit,
                    partitions: partitions.into_iter().collect(),
                }),
                offsets: if commit { offsets } else { Vec::new() },
            }),
            // A retry of the EndTxn that ended it.
            State::Empty { last } if last == Some(commit) => Ok(Ended::default()),
            State::Empty { last } => {
                txn.state = State::Empty { last };
                Err(TxnError::InvalidState("no transaction in progress"))
            }
        }
    }

    /// Checks a produced batch's producer id and epoch (and, for a transactional
    /// batch, that its partition is in the open transaction).
    pub(super) fn check_produce(
        &mut self,
        producer_id: i64,
        epoch: i16,
        transactional: bool,
        tp: &TopicPartition,
    ) -> Result<(), TxnError> {
        let p = self
            .producers
            .get_mut(&producer_id)
            .ok_or(TxnError::UnknownProducerId(producer_id))?;
        let Some(tid) = p.transactional_id.clone() else {
            if transactional {
                return Err(TxnError::InvalidState(
                    "transactional batch from an idempotent producer",
                ));
            }
            if epoch < p.epoch {
                return Err(TxnError::Fenced {
                    producer_id,
                    current: p.epoch,
                    got: epoch,
                });
            }
            // KIP-360: an idempotent producer may bump its epoch locally.
            p.epoch = epoch;
            return Ok(());
        };
        if !transactional {
            return Err(TxnError::InvalidState(
                "non-transactional batch from a transactional producer",
            ));
        }
        match &self.current(&tid, producer_id, epoch)?.state {
            State::Ongoing { partitions, .. } if partitions.contains(tp) => Ok(()),
            _ => Err(TxnError::NotInTransaction(tp.clone())),
        }
    }

    /// Aborts every transaction open past its timeout, bumping its epoch (the
    /// abandoned producer is fenced). Returns the markers to write.
    pub(super) fn expire(&mut self, now: Instant) -> Vec<Markers> {
        self.abort_open(|deadline| deadline <= now)
    }

    /// Aborts every open transaction as its timeout would (the control
    /// listener's `abort-transactions`). Returns the markers to write.
    pub(super) fn abort_all(&mut self) -> Vec<Markers> {
        self.abort_open(|_| true)
    }

    /// Aborts the open transactions whose deadline is `due`, bumping the epoch.
    fn abort_open(&mut self, due: impl Fn(Instant) -> bool) -> Vec<Markers> {
        let mut out = Vec::new();
        for (tid, txn) in &mut self.transactions {
            let State::Ongoing { deadline, .. } = &txn.state else {
                continue;
            };
            if !due(*deadline) {
                continue;
            }
            let old_producer_id = txn.producer_id;
            let marker_epoch = bump(tid, txn, &mut self.producers, &mut self.next_producer_id);
            if let State::Ongoing { partitions, .. } =
                std::mem::replace(&mut txn.state, State::Empty { last: Some(false) })
            {
                out.push(Markers {
                    transactional_id: tid.clone(),
                    producer_id: old_producer_id,
                    producer_epoch: marker_epoch,
                    commit: false,
                    partitions: partitions.into_iter().collect(),
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp(partition: i32) -> TopicPartition {
        TopicPartition {
            topic: "t".into(),
            partition,
        }
    }

    fn init(c: &mut Coordinator, tid: &str) -> ProducerIdAndEpoch {
        c.init_producer_id(Some(tid), 60_000, -1, -1)
            .expect("init")
            .0
    }

    #[test]
    fn same_transactional_id_keeps_its_producer_id_and_bumps_the_epoch() {
        let mut c = Coordinator::default();
        let a = init(&mut c, "x");
        let b = init(&mut c, "x");
        let other = init(&mut c, "y");
        assert_eq!(a.producer_id, b.producer_id);
        assert_eq!((a.epoch, b.epoch), (0, 1));
        assert_ne!(other.producer_id, a.producer_id);
    }

    #[test]
    fn init_aborts_the_open_transaction_and_fences_the_old_epoch() {
        let mut c = Coordinator::default();
        let now = Instant::now();
        let p1 = init(&mut c, "x");
        c.add_partitions("x", p1.producer_id, p1.epoch, [tp(0), tp(1)], now)
            .expect("add");
        c.check_produce(p1.producer_id, p1.epoch, true, &tp(0))
            .expect("produce");
        let (p2, markers) = c.init_producer_id(Some("x"), 60_000, -1, -1).expect("init");
        let markers = markers.expect("the open transaction is aborted");
        assert!(!markers.commit);
        assert_eq!(markers.partitions, vec![tp(0), tp(1)]);
        assert_eq!(
            (markers.producer_id, markers.producer_epoch),
            (p1.producer_id, p2.epoch)
        );
        let fenced = |r| matches!(r, Err(TxnError::Fenced { .. }));
        assert!(fenced(c.check_produce(
            p1.producer_id,
            p1.epoch,
            true,
            &tp(0)
        )));
        assert!(fenced(c.add_partitions(
            "x",
            p1.producer_id,
            p1.epoch,
            [tp(0)],
            now
        )));
        assert!(fenced(
            c.end_txn("x", p1.producer_id, p1.epoch, true).map(|_| ())
        ));
        assert!(fenced(c.add_offsets("x", p1.producer_id, p1.epoch, now)));
        // The new epoch works.
        c.add_partitions("x", p2.producer_id, p2.epoch, [tp(0)], now)
            .expect("add");
        let ended = c
            .end_txn("x", p2.producer_id, p2.epoch, true)
            .expect("commit");
        assert_eq!(ended.markers.map(|m| m.partitions), Some(vec![tp(0)]));
    }

    #[test]
    fn produce_needs_an_issued_id_and_an_added_partition() {
        let mut c = Coordinator::default();
        let now = Instant::now();
        assert_eq!(
            c.check_produce(42, 0, false, &tp(0)),
            Err(TxnError::UnknownProducerId(42))
        );
        let p = init(&mut c, "x");
        assert_eq!(
            c.check_produce(p.producer_id, p.epoch, true, &tp(0)),
            Err(TxnError::NotInTransaction(tp(0)))
        );
        c.add_partitions("x", p.producer_id, p.epoch, [tp(1)], now)
            .expect("add");
        assert_eq!(
            c.check_produce(p.producer_id, p.epoch, true, &tp(0)),
            Err(TxnError::NotInTransaction(tp(0)))
        );
        assert!(
            c.check_produce(p.producer_id, p.epoch, true, &tp(1))
                .is_ok()
        );
        assert!(matches!(
            c.check_produce(p.producer_id, p.epoch, false, &tp(1)),
            Err(TxnError::InvalidState(_))
        ));
    }

    #[test]
    fn idempotent_producers_bump_locally_but_not_backwards() {
        let mut c = Coordinator::default();
        let (p, _) = c.init_producer_id(None, 0, -1, -1).expect("init");
        assert!(c.check_produce(p.producer_id, 0, false, &tp(0)).is_ok());
        assert!(c.check_produce(p.producer_id, 1, false, &tp(0)).is_ok());
        assert!(matches!(
            c.check_produce(p.producer_id, 0, false, &tp(0)),
            Err(TxnError::Fenced { .. })
        ));
        // KIP-360 bump through InitProducerId keeps the id.
        let (q, _) = c.init_producer_id(None, 0, p.producer_id, 1).expect("bump");
        assert_eq!((q.producer_id, q.epoch), (p.producer_id, 2));
    }

    #[test]
    fn end_txn_commits_offsets_only_on_commit_and_accepts_a_retry() {
        let mut c = Coordinator::default();
        let now = Instant::now();
        let p = init(&mut c, "x");
        assert!(matches!(
            c.end_txn("x", p.producer_id, p.epoch, true),
            Err(TxnError::InvalidState(_))
        ));
        c.add_offsets("x", p.producer_id, p.epoch, now)
            .expect("add");
        let offset = PendingOffset {
            group: "g".into(),
            topic: "t".into(),
            partition: 0,
            offset: 5,
            metadata: None,
        };
        c.txn_offset_commit("x", p.producer_id, p.epoch, vec![offset.clone()])
            .expect("offsets");
        let ended = c
            .end_txn("x", p.producer_id, p.epoch, true)
            .expect("commit");
        assert_eq!(ended.offsets, vec![offset]);
        assert_eq!(
            c.end_txn("x", p.producer_id, p.epoch, true),
            Ok(Ended::default())
        );
        assert!(c.end_txn("x", p.producer_id, p.epoch, false).is_err());
    }

    #[test]
    fn timeout_aborts_and_fences() {
        let mut c = Coordinator::default();
        let now = Instant::now();
        let p = c
            .init_producer_id(Some("x"), 2_000, -1, -1)
            .expect("init")
            .0;
        c.add_partitions("x", p.producer_id, p.epoch, [tp(0)], now)
            .expect("add");
        assert!(c.expire(now + Duration::from_millis(1_999)).is_empty());
        let expired = c.expire(now + Duration::from_millis(2_000));
        assert_eq!(expired.len(), 1);
        assert!(!expired[0].commit);
        assert_eq!(expired[0].producer_epoch, p.epoch + 1);
        assert!(c.expire(now + Duration::from_secs(10)).is_empty());
        assert!(matches!(
            c.end_txn("x", p.producer_id, p.epoch, true),
            Err(TxnError::Fenced { .. })
        ));
    }

    #[test]
    fn abort_all_aborts_only_open_transactions_and_fences() {
        let mut c = Coordinator::default();
        let now = Instant::now();
        let open = init(&mut c, "open");
        let idle = init(&mut c, "idle");
        c.add_partitions("open", open.producer_id, open.epoch, [tp(0)], now)
            .expect("add");
        let aborted = c.abort_all();
        assert_eq!(aborted.len(), 1);
        assert_eq!(aborted[0].transactional_id, "open");
        assert!(!aborted[0].commit);
        assert_eq!(aborted[0].producer_epoch, open.epoch + 1);
        assert!(c.abort_all().is_empty());
        assert!(matches!(
            c.end_txn("open", open.producer_id, open.epoch, true),
            Err(TxnError::Fenced { .. })
        ));
        // The idle one was not touched.
        c.add_partitions("idle", idle.producer_id, idle.epoch, [tp(0)], now)
            .expect("the idle producer keeps its epoch");
    }

    #[test]
    fn timeout_must_be_in_range_and_ids_must_match() {
        let mut c = Coordinator::default();
        assert_eq!(
            c.init_producer_id(Some("x"), 0, -1, -1).err(),
            Some(TxnError::InvalidTimeout(0, MAX_TRANSACTION_TIMEOUT_MS))
        );
        let p = init(&mut c, "x");
        let q = init(&mut c, "y");
        assert!(matches!(
            c.end_txn("x", q.producer_id, q.epoch, true),
            Err(TxnError::ProducerIdMapping { .. })
        ));
        assert!(matches!(
            c.end_txn("nope", p.producer_id, p.epoch, true),
            Err(TxnError::ProducerIdMapping { .. })
        ));
        // KIP-360 bump with a stale epoch is fenced.
        assert!(matches!(
            c.init_producer_id(Some("x"), 60_000, p.producer_id, p.epoch + 5),
            Err(TxnError::Fenced { .. })
        ));
    }

    #[test]
    fn epoch_exhaustion_moves_to_a_new_producer_id() {
        let mut c = Coordinator::default();
        let first = init(&mut c, "x");
        if let Some(t) = c.transactions.get_mut("x") {
            t.epoch = i16::MAX - 1;
        }
        let next = init(&mut c, "x");
        assert_ne!(next.producer_id, first.producer_id);
        assert_eq!(next.epoch, 0);
        assert!(matches!(
            c.check_produce(first.producer_id, i16::MAX - 1, true, &tp(0)),
            Err(TxnError::Fenced { .. })
        ));
    }
}
