//! The simulated world's state: a PostgreSQL (its WAL of committed outbox rows, the
//! slot, the position row, the poison table, the walsenders) and a Kafka (one
//! topic's partitions, the progress topic, the records in flight, producers and
//! their transactions). Everything random is drawn from the world's seeded
//! generator, and only the schedule's driver and the ports' methods change it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::{Notify, mpsc};

use crate::cdc::progress::simulator::Rng;
use crate::delivery::EventId;
use crate::kafka::DeliveryReport;
use crate::lsn::Lsn;
use crate::outbox::position::ServerHistory;
use crate::poison::PoisonRow;
use crate::postgres::replication::TimelineSwitch;

/// The history a world's server starts on (a promotion moves to the next timeline).
const FIRST_HISTORY: ServerHistory = ServerHistory {
    system_identifier: 7,
    timeline: 1,
};

/// Partitions of the outbox topic.
pub(super) const PARTITIONS: usize = 3;

/// An outbox row: its transaction (`Tx::seq`, never handed out twice, though a
/// restore in place hands the transaction's LSNs out again) and its ordinal there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(super) struct RowId {
    pub(super) tx: usize,
    pub(super) ordinal: u32,
}

impl RowId {
    /// The row's idempotency key, as its records carry it.
    pub(super) fn key_text(self) -> String {
        format!("r{}-{}", self.tx, self.ordinal)
    }

    /// The row's `id` column (a UUID naming it).
    pub(super) fn uuid(self) -> String {
        format!("00000000-0000-4000-8{:03x}-{:012x}", self.ordinal, self.tx)
    }

    /// The row an idempotency key names.
    pub(super) fn parse(text: &str) -> Option<RowId> {
        let (tx, ordinal) = text.strip_prefix('r')?.split_once('-')?;
        Some(RowId {
            tx: tx.parse().ok()?,
            ordinal: ordinal.parse().ok()?,
        })
    }
}

/// One outbox row of a committed transaction.
#[derive(Debug, Clone)]
pub(super) struct Row {
    /// The entity (a few hot ones, so keys repeat within the window).
    pub(super) entity: u32,
    /// A NULL payload: the mapper refuses it and the relay poisons it.
    pub(super) unmappable: bool,
    /// The broker refuses its record every time (a policy violation): the relay
    /// poisons it after `relay.max_attempts`.
    pub(super) refused: bool,
    /// Its outbox table: 0, or 1 in a schedule with two (`[[outbox]]`).
    pub(super) table: u8,
    /// Larger than the producer's `message.max.bytes`: the relay must poison it
    /// without sending it.
    pub(super) oversize: bool,
    /// The broker refuses the batch it travels in for its size when other records
    /// of its partition travel with it; alone (or by a producer of its own) it fits.
    pub(super) big_batch: bool,
    /// Written with `outbox_emit`: a transactional logical decoding message of its
    /// table's prefix, not a row (the message outbox).
    pub(super) message: bool,
}

/// One committed transaction.
#[derive(Debug, Clone)]
pub(super) struct Tx {
    /// Its name in [`RowId`]s: the commit's number since the world began.
    pub(super) seq: usize,
    pub(super) xid: u32,
    /// `Begin.commit_time` (µs since 2000-01-01): never the same twice, so a
    /// transaction a restore hands the xid out to again commits at another time.
    pub(super) commit_time: i64,
    pub(super) final_lsn: Lsn,
    pub(super) end_lsn: Lsn,
    pub(super) rows: Vec<Row>,
}

/// The replication slot.
#[derive(Debug, Clone, Copy)]
pub(super) struct Slot {
    pub(super) confirmed: Lsn,
    /// What a crash rewinds it to (the last checkpoint's copy).
    pub(super) persisted: Lsn,
}

/// The relay's position row.
#[derive(Debug, Clone, Copy)]
pub(super) struct PositionRow {
    pub(super) history: ServerHistory,
    pub(super) confirmed: Lsn,
}

/// A walsender's place in the WAL.
#[derive(Debug, Clone)]
pub(super) struct Walsender {
    /// The next transaction to send and the next message of it (0: Begin).
    pub(super) next_tx: usize,
    pub(super) next_msg: usize,
    /// The Relation messages that went out in this stream (a bit per table).
    pub(super) relations_sent: u8,
    /// The connection is gone (a cut, a restart, the process killed).
    pub(super) broken: bool,
    /// The end of the last transaction sent (keepalives never pass what is unsent).
    pub(super) sent_end: Lsn,
    /// Frames left before a flaky walsender drops the connection (`World::flaky_until`).
    pub(super) cut_after: Option<u64>,
}

/// One Kafka record in a partition.
#[derive(Debug, Clone)]
pub(super) struct Record {
    pub(super) row: RowId,
    pub(super) entity: Vec<u8>,
    /// The Kafka transaction it was written in.
    pub(super) txn: Option<u64>,
    /// How many recorded-poison reads had been made when it was sent: the sending
    /// session's read is the last of them (`World::late_poison`).
    pub(super) read: u64,
}

/// One record of the progress topic.
#[derive(Debug, Clone)]
pub(super) struct ProgressEntry {
    pub(super) key: String,
    pub(super) value: Vec<u8>,
    pub(super) txn: Option<u64>,
}

/// What a record in flight is.
#[derive(Debug, Clone)]
pub(super) enum Payload {
    Outbox(Record),
    Progress(ProgressEntry),
}

/// A record sent and not yet reported.
#[derive(Debug, Clone)]
pub(super) struct InFlight {
    pub(super) producer: u64,
    pub(super) id: EventId,
    pub(super) partition: usize,
    pub(super) payload: Payload,
    pub(super) txn: Option<u64>,
}

/// A producer's broker-side state.
#[derive(Debug)]
pub(super) struct ProducerState {
    pub(super) reports: mpsc::Sender<DeliveryReport>,
    pub(super) transactional: bool,
    /// Another producer of the `transactional.id` was initialised after it.
    pub(super) fenced: bool,
    /// It called `init_transactions` (a resync's backlog fences only those).
    pub(super) initialised: bool,
    /// Dropped by the relay or killed with the process: no more reports.
    pub(super) gone: bool,
    pub(super) open_txn: Option<u64>,
    /// Made to retry a record alone (`Producer::alone`).
    pub(super) alone: bool,
}

/// A Kafka transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TxnStatus {
    Open,
    Committed,
    Aborted,
}

#[derive(Debug)]
pub(super) struct Txn {
    /// The producer that began it.
    pub(super) producer: u64,
    pub(super) status: TxnStatus,
    /// The relay asked for its commit (the coordinator may have it, whatever
    /// happens to the process next).
    pub(super) committing: bool,
    /// One of its records failed: its commit must fail (abortable).
    pub(super) failed: bool,
    /// When it began: the coordinator aborts it once it is older than
    /// `World::transaction_timeout`.
    pub(super) began: tokio::time::Instant,
}

/// Counts of what a schedule did, for the report.
#[derive(Debug, Default, Clone)]
pub(super) struct Stats {
    pub(super) transactions: u64,
    pub(super) rows: u64,
    pub(super) acks: u64,
    pub(super) failures: u64,
    pub(super) cuts: u64,
    pub(super) kills: u64,
    pub(super) stops: u64,
    pub(super) restarts: u64,
    pub(super) crashes: u64,
    pub(super) commits: u64,
    pub(super) aborts: u64,
    pub(super) poison_rows: u64,
    pub(super) landed_unreported: u64,
    /// Connections a flaky walsender dropped (counted in `cuts` too).
    pub(super) flaky_cuts: u64,
    /// Poison rows a killed process's backend committed after the kill.
    pub(super) late_poison_rows: u64,
    /// Kafka transactions the coordinator aborted for their age.
    pub(super) timeouts: u64,
    /// Records refused with their batch for its size, and records acked from a
    /// producer that retries them alone.
    pub(super) size_refusals: u64,
    pub(super) alone_acks: u64,
    /// Events written as logical decoding messages (`outbox_emit`), and schedules
    /// that halted on poison.
    pub(super) messages: u64,
    pub(super) halting: u64,
    /// Restores in place, and the events they and promotions took back (committed
    /// after the copy or past what the standby replayed: gone, no longer events).
    pub(super) restores: u64,
    pub(super) restored_away: u64,
    /// Standbys promoted (with the slot synced, or re-created there), slots dropped, and
    /// the resyncs that healed a lost slot with the rows they published.
    pub(super) promotions: u64,
    pub(super) synced_promotions: u64,
    pub(super) recreated_slots: u64,
    pub(super) slot_drops: u64,
    /// Exactly-once promotions after which a poison row the relay wrote was not
    /// on the new primary (`World::republished`).
    pub(super) unreplayed_poison: u64,
    pub(super) resyncs: u64,
    pub(super) resynced: u64,
}

impl Stats {
    /// Adds another schedule's counts.
    pub(super) fn add(&mut self, other: &Stats) {
        self.transactions += other.transactions;
        self.rows += other.rows;
        self.acks += other.acks;
        self.failures += other.failures;
        self.cuts += other.cuts;
        self.kills += other.kills;
        self.stops += other.stops;
        self.restarts += other.restarts;
        self.crashes += other.crashes;
        self.commits += other.commits;
        self.aborts += other.aborts;
        self.poison_rows += other.poison_rows;
        self.landed_unreported += other.landed_unreported;
        self.flaky_cuts += other.flaky_cuts;
        self.late_poison_rows += other.late_poison_rows;
        self.timeouts += other.timeouts;
        self.size_refusals += other.size_refusals;
        self.alone_acks += other.alone_acks;
        self.messages += other.messages;
        self.halting += other.halting;
        self.restores += other.restores;
        self.restored_away += other.restored_away;
        self.promotions += other.promotions;
        self.synced_promotions += other.synced_promotions;
        self.recreated_slots += other.recreated_slots;
        self.slot_drops += other.slot_drops;
        self.unreplayed_poison += other.unreplayed_poison;
        self.resyncs += other.resyncs;
        self.resynced += other.resynced;
    }
}

/// A copy of the data directory taken at a checkpoint, to be put back in place:
/// how far the WAL, the slot (as on disk), the position row and the poison table
/// had come.
#[derive(Debug, Clone)]
pub(super) struct Snapshot {
    wal: usize,
    next_lsn: u64,
    next_xid: u32,
    slot: Option<Slot>,
    inherited_slot: bool,
    position: Option<PositionRow>,
    poison: usize,
    /// Resyncs done when it was taken.
    resyncs: u64,
}

/// What a promoted standby has of the relay's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum StandbySlot {
    /// A failover slot (PostgreSQL 17), as last synced.
    Synced,
    /// None: nothing synced it.
    Missing,
    /// Created on the promoted server at its WAL end, by an HA manager that
    /// re-creates "the slot the relay needs": the rows between the relay's last
    /// position and the fork were never streamed from it.
    Recreated,
}

/// See the module documentation.
pub(super) struct World {
    pub(super) rng: Rng,
    /// The committed transactions the server has, in commit (and LSN) order.
    pub(super) wal: Vec<Tx>,
    /// The next [`Tx::seq`].
    pub(super) next_seq: usize,
    pub(super) next_lsn: u64,
    pub(super) next_xid: u32,
    /// `pg_postmaster_start_time()`: a restart changes it.
    pub(super) server_started: i64,
    /// The server's system identifier and timeline, and where each ancestor
    /// timeline ended (`TIMELINE_HISTORY`).
    pub(super) history: ServerHistory,
    pub(super) forks: Vec<TimelineSwitch>,
    /// PostgreSQL answers (false while it restarts).
    pub(super) up: bool,
    pub(super) slot: Option<Slot>,
    /// The slot came with a promotion (synced, or created by someone else) and the
    /// relay has not streamed from it yet: its position is not a confirm of the
    /// relay's (a synced one may be past an event whose poison row the standby had
    /// not replayed; the start plan calls such a slot lost).
    pub(super) inherited_slot: bool,
    pub(super) position: Option<PositionRow>,
    pub(super) poison: Vec<(RowId, PoisonRow)>,
    pub(super) walsenders: BTreeMap<i32, Walsender>,
    /// The walsender that holds the slot.
    pub(super) active: Option<i32>,
    pub(super) next_pid: i32,
    pub(super) partitions: Vec<Vec<Record>>,
    pub(super) progress: Vec<ProgressEntry>,
    pub(super) in_flight: Vec<InFlight>,
    pub(super) producers: BTreeMap<u64, ProducerState>,
    pub(super) next_producer: u64,
    pub(super) txns: BTreeMap<u64, Txn>,
    pub(super) next_txn: u64,
    /// The outbox topic does not exist yet (records to it fail as configuration
    /// errors, as when a topic is created late).
    pub(super) topic_missing: bool,
    /// Rows delivered (outside a transaction, or in a committed one) or poisoned,
    /// kept as they happen so that the checks after every step need not read the
    /// whole log.
    pub(super) resolved: std::collections::HashSet<RowId>,
    /// The rows written in each open Kafka transaction.
    pub(super) txn_rows: BTreeMap<u64, Vec<RowId>>,
    /// Until then, every new walsender drops its connection after a few frames, as
    /// one that fails part-way through a large transaction on every reconnect.
    pub(super) flaky_until: Option<tokio::time::Instant>,
    /// The producers' `transaction.timeout.ms` (`kafka.transaction_timeout_ms`).
    pub(super) transaction_timeout: std::time::Duration,
    /// Recorded-poison reads made so far (one per session start).
    pub(super) recorded_reads: u64,
    /// Poison inserts a writer had sent when it was stopped (by token).
    pub(super) poison_pending: BTreeMap<u64, (RowId, PoisonRow)>,
    pub(super) next_poison_token: u64,
    /// Inserts of a killed process's writer that its backend commits after the
    /// kill: when, the recorded-poison reads made when the process went, the row.
    pub(super) late_commits: Vec<(tokio::time::Instant, u64, RowId, PoisonRow)>,
    /// Events whose only poison rows are such late commits: the reads made when
    /// the poisoning process went, and by the commit. A later process's session
    /// whose read came before the commit could not see the row and may publish the
    /// event (documented in `poison::recorded`: a duplicate, not a broken promise).
    pub(super) late_poison: BTreeMap<RowId, (u64, u64)>,
    /// Events whose poison row a restore in place took back: read again, they are
    /// delivered after later events of their key, as a replayed poisoned event is
    /// under `relay.on_poison = "skip"` (not a first delivery out of order).
    pub(super) unpoisoned: std::collections::HashSet<RowId>,
    /// Transactions a restore took back, by [`Tx::seq`]: the broker still judges
    /// their records (in flight, or sent again from a session's memory) by them.
    pub(super) gone: BTreeMap<usize, Tx>,
    /// Exactly-once: the events a session may publish again, as documented, not
    /// held to "once in the read_committed view": on a promoted server that lacks
    /// a poison row the relay wrote, from that event to the fork
    /// (`cdc::unreplayed_poison`); on one that had not replayed a resync, from its
    /// position on; after a restore in place, from the restored position on (the
    /// progress record is not used).
    pub(super) republished: std::collections::HashSet<RowId>,
    /// The schedule runs `kafka.delivery = "exactly-once"`.
    pub(super) exactly_once: bool,
    pub(super) stats: Stats,
}

impl World {
    pub(super) fn new(seed: u64) -> World {
        World {
            rng: Rng(seed),
            wal: Vec::new(),
            next_seq: 0,
            next_lsn: 0x0100_0000,
            next_xid: 1_000,
            server_started: 1,
            history: FIRST_HISTORY,
            forks: Vec::new(),
            up: true,
            slot: None,
            inherited_slot: false,
            position: None,
            poison: Vec::new(),
            walsenders: BTreeMap::new(),
            active: None,
            next_pid: 100,
            partitions: vec![Vec::new(); PARTITIONS],
            progress: Vec::new(),
            in_flight: Vec::new(),
            producers: BTreeMap::new(),
            next_producer: 1,
            txns: BTreeMap::new(),
            next_txn: 1,
            topic_missing: false,
            resolved: std::collections::HashSet::new(),
            txn_rows: BTreeMap::new(),
            flaky_until: None,
            transaction_timeout: std::time::Duration::from_secs(60),
            recorded_reads: 0,
            poison_pending: BTreeMap::new(),
            next_poison_token: 0,
            late_commits: Vec::new(),
            late_poison: BTreeMap::new(),
            unpoisoned: std::collections::HashSet::new(),
            gone: BTreeMap::new(),
            republished: std::collections::HashSet::new(),
            exactly_once: false,
            stats: Stats::default(),
        }
    }

    /// The WAL end: past every commit.
    pub(super) fn wal_end(&self) -> Lsn {
        Lsn(self.next_lsn)
    }

    /// Commits a transaction of `rows`.
    pub(super) fn commit(&mut self, rows: Vec<Row>) {
        let begin = self.next_lsn + 1 + self.rng.below(64);
        let final_lsn = begin + 24 * (rows.len() as u64 + 1) + self.rng.below(64);
        let end_lsn = final_lsn + 1 + self.rng.below(40);
        self.next_lsn = end_lsn;
        self.stats.transactions += 1;
        self.stats.rows += rows.len() as u64;
        self.stats.messages += rows.iter().filter(|r| r.message).count() as u64;
        tracing::debug!(target: "sim", tx = self.next_seq, rows = rows.len(), final_lsn, end_lsn, "commit");
        // By the commit's number (never handed out twice): a millisecond apart.
        let commit_time =
            1_000_000 + 1_000 * i64::try_from(self.next_seq).unwrap_or(i64::MAX / 2_000);
        self.wal.push(Tx {
            seq: self.next_seq,
            xid: self.next_xid,
            commit_time,
            final_lsn: Lsn(final_lsn),
            end_lsn: Lsn(end_lsn),
            rows,
        });
        self.next_xid += 1;
        self.next_seq += 1;
    }

    /// The transaction named `seq`, unless a restore took it back.
    pub(super) fn tx(&self, seq: usize) -> Option<&Tx> {
        self.wal
            .binary_search_by_key(&seq, |t| t.seq)
            .ok()
            .and_then(|i| self.wal.get(i))
    }

    /// The transaction named `seq`, even if a restore took it back.
    pub(super) fn any_tx(&self, seq: usize) -> Option<&Tx> {
        self.tx(seq).or_else(|| self.gone.get(&seq))
    }

    /// The event `row` is one: its transaction was not taken back by a restore.
    pub(super) fn is_event(&self, row: RowId) -> bool {
        self.tx(row.tx).is_some()
    }

    /// A copy of the data directory now, at a checkpoint (the slot as on disk).
    pub(super) fn snapshot(&self) -> Snapshot {
        Snapshot {
            wal: self.wal.len(),
            next_lsn: self.next_lsn,
            next_xid: self.next_xid,
            slot: self.slot.map(|s| Slot {
                confirmed: s.persisted,
                persisted: s.persisted,
            }),
            inherited_slot: self.inherited_slot,
            position: self.position,
            poison: self.poison.len(),
            resyncs: self.stats.resyncs,
        }
    }

    /// What a streaming standby has replayed now, with the slot as its last sync
    /// (PostgreSQL 17's failover slots) copied it from the primary: its confirmed
    /// position, which the standby has replayed.
    pub(super) fn replica(&self) -> Snapshot {
        Snapshot {
            slot: self.slot,
            ..self.snapshot()
        }
    }

    /// `copy` put back in place: see [`World::roll_back`]. The caller restarts the
    /// server.
    pub(super) fn restore(&mut self, copy: &Snapshot) {
        self.stats.restores += 1;
        self.roll_back(copy);
        if self.exactly_once {
            // The relay tells the restored WAL by its progress record's commit
            // times and does not use the record (documented): the events from the
            // restored position on that it had delivered go out again.
            let from = copy.position.map_or(Lsn::ZERO, |p| p.confirmed);
            let again = self.events_from(from);
            self.republished.extend(again);
        }
    }

    /// The events of the transactions committing at or after `from`.
    fn events_from(&self, from: Lsn) -> Vec<RowId> {
        self.wal
            .iter()
            .filter(|t| t.final_lsn >= from)
            .flat_map(|t| {
                (0..t.rows.len()).map(|o| RowId {
                    tx: t.seq,
                    ordinal: u32::try_from(o).unwrap_or(u32::MAX),
                })
            })
            .collect()
    }

    /// When the transaction that took `xid` committed, as the server keeps it
    /// (`pg_xact_commit_timestamp`, µs since the Unix epoch).
    pub(super) fn committed_at(&self, xid: u32) -> Option<i64> {
        const POSTGRES_EPOCH_US: i64 = 946_684_800_000_000;
        self.wal
            .iter()
            .rev()
            .find(|t| t.xid == xid)
            .map(|t| t.commit_time + POSTGRES_EPOCH_US)
    }

    /// The standby that replayed `replica` is promoted: the primary's transactions
    /// after it are gone, and the new primary goes on from there on the next
    /// timeline with `slot`. The caller restarts the server (the relay connects to
    /// the new primary at the old address).
    pub(super) fn promote(&mut self, replica: &Snapshot, slot: StandbySlot) {
        self.stats.promotions += 1;
        self.stats.synced_promotions += u64::from(slot == StandbySlot::Synced);
        self.stats.recreated_slots += u64::from(slot == StandbySlot::Recreated);
        let primary = self.slot.map(|s| s.confirmed);
        let fork = Lsn(replica.next_lsn);
        let unreplayed: Vec<RowId> = self.poison[replica.poison.min(self.poison.len())..]
            .iter()
            .map(|(row, _)| *row)
            .collect();
        self.roll_back(replica);
        let first = unreplayed
            .iter()
            .filter(|row| self.is_event(**row) && !self.resolved.contains(row))
            .filter_map(|row| self.tx(row.tx).map(|t| t.final_lsn))
            .min();
        if self.exactly_once && self.stats.resyncs > replica.resyncs {
            // The standby had not replayed a resync (its marks, its slot, the
            // position it saved): the relay streams again from before it, and the
            // events the resync published go out again (the progress record names
            // no backlog's events).
            let replayed = [
                replica.slot.map(|s| s.confirmed),
                replica.position.map(|p| p.confirmed),
            ];
            let from = replayed.into_iter().flatten().min().unwrap_or(Lsn::ZERO);
            let again = self.events_from(from);
            self.republished.extend(again);
        }
        if let Some(first) = first.filter(|_| self.exactly_once) {
            let again = self.events_from(first);
            self.stats.unreplayed_poison += 1;
            self.republished.extend(again);
        }
        self.forks.push(TimelineSwitch {
            timeline: self.history.timeline,
            switchpoint: fork,
        });
        self.history.timeline += 1;
        match slot {
            StandbySlot::Missing => {
                self.inherited_slot = false;
                self.slot = None;
            }
            StandbySlot::Recreated => {
                self.inherited_slot = true;
                self.slot = Some(Slot {
                    confirmed: fork,
                    persisted: fork,
                });
            }
            StandbySlot::Synced => {
                self.inherited_slot = self.slot.is_some();
                if let (Some(synced), Some(primary)) = (&mut self.slot, primary)
                    && self.rng.percent(75)
                {
                    // Synced after the copy was replayed: as far as the primary had
                    // confirmed, never past what the standby replayed. The position
                    // row the standby replayed may be behind it (its save was not
                    // replayed yet).
                    synced.confirmed = synced.confirmed.max(primary.min(fork));
                    synced.persisted = synced.confirmed;
                }
            }
        }
        tracing::debug!(target: "sim", history = %self.history, ?slot, synced = ?self.slot, "a standby is promoted");
    }

    /// The slot is dropped (its walsender terminated first, as
    /// `pg_drop_replication_slot` of an active slot needs).
    pub(super) fn drop_slot(&mut self) {
        if let Some(pid) = self.active.take()
            && let Some(walsender) = self.walsenders.get_mut(&pid)
        {
            walsender.broken = true;
        }
        self.slot = None;
        self.inherited_slot = false;
        self.stats.slot_drops += 1;
        tracing::debug!(target: "sim", "the slot is dropped");
    }

    /// The server's state goes back to `copy`: the transactions committed since
    /// are gone (their LSNs and xids are handed out again), and so are the poison
    /// rows; the slot and the position row are as they were. Rows resolved only by
    /// a poison row that is gone are unresolved again.
    fn roll_back(&mut self, copy: &Snapshot) {
        let gone = self.wal.split_off(copy.wal.min(self.wal.len()));
        self.stats.restored_away += gone.iter().map(|t| t.rows.len() as u64).sum::<u64>();
        self.next_lsn = copy.next_lsn;
        self.next_xid = copy.next_xid;
        self.slot = copy.slot;
        self.inherited_slot = copy.inherited_slot;
        self.position = copy.position;
        let taken_back = self.poison.split_off(copy.poison.min(self.poison.len()));
        self.unpoisoned
            .extend(taken_back.into_iter().map(|(row, _)| row));
        self.late_poison
            .retain(|row, _| self.poison.iter().any(|(r, _)| r == row));
        let mut resolved: std::collections::HashSet<RowId> =
            self.poison.iter().map(|(r, _)| *r).collect();
        resolved.extend(
            self.partitions
                .iter()
                .flatten()
                .filter(|r| committed(self, r.txn))
                .map(|r| r.row),
        );
        self.resolved = resolved;
        tracing::debug!(target: "sim", transactions = gone.len(), slot = ?self.slot, position = ?self.position, "rolled back");
        self.gone.extend(gone.into_iter().map(|t| (t.seq, t)));
    }

    /// Every walsender's connection is cut (a restart, a crash).
    pub(super) fn cut_all(&mut self) {
        for walsender in self.walsenders.values_mut() {
            walsender.broken = true;
        }
        self.active = None;
    }

    /// A poison row commits (`late`: the insert of a process gone when the reads
    /// made were `late`, committed after it went).
    pub(super) fn poison_committed(&mut self, named: RowId, row: PoisonRow, late: Option<u64>) {
        match late {
            Some(gone) => {
                if !self.poison.iter().any(|(r, _)| *r == named) {
                    self.late_poison.insert(named, (gone, self.recorded_reads));
                }
                self.stats.late_poison_rows += 1;
            }
            // A row a live session wrote: nothing is excused any more.
            None => {
                self.late_poison.remove(&named);
            }
        }
        self.poison.push((named, row));
        self.resolved.insert(named);
        self.stats.poison_rows += 1;
    }

    /// `record` was sent by a session of a later process than the one that
    /// poisoned its event, whose recorded-poison read came before the poison row
    /// committed late: it could not know (`late_poison`).
    pub(super) fn sent_unaware_of_poison(&self, record: &Record) -> bool {
        self.late_poison
            .get(&record.row)
            .is_some_and(|&(gone, committed)| gone < record.read && record.read <= committed)
    }

    /// The index in `wal` of the first transaction committing at or after `lsn`
    /// (what a walsender starting there sends first).
    pub(super) fn first_tx_from(&self, lsn: Lsn) -> usize {
        self.wal.partition_point(|t| t.final_lsn < lsn)
    }

    /// A Kafka transaction committed: its rows are delivered.
    pub(super) fn committed(&mut self, txn: u64) {
        if let Some(t) = self.txns.get_mut(&txn) {
            t.status = TxnStatus::Committed;
        }
        for row in self.txn_rows.remove(&txn).unwrap_or_default() {
            self.resolved.insert(row);
        }
        self.stats.commits += 1;
    }

    /// A Kafka transaction aborted: its rows are not delivered.
    pub(super) fn aborted(&mut self, txn: u64) {
        if let Some(t) = self.txns.get_mut(&txn) {
            t.status = TxnStatus::Aborted;
        }
        self.txn_rows.remove(&txn);
        self.stats.aborts += 1;
    }

    /// Whether the producer `id` may still report.
    pub(super) fn reports_to(&self, producer: u64) -> Option<&mpsc::Sender<DeliveryReport>> {
        self.producers
            .get(&producer)
            .filter(|p| !p.gone)
            .map(|p| &p.reports)
    }
}

/// The world, shared by the schedule's driver and the relay's ports, and a
/// notification for whoever waits on it (a walsender with nothing to send, a
/// commit waiting for its last records).
#[derive(Clone)]
pub(super) struct Shared {
    world: Arc<Mutex<World>>,
    pub(super) notify: Arc<Notify>,
}

impl Shared {
    pub(super) fn new(seed: u64) -> Shared {
        Shared {
            world: Arc::new(Mutex::new(World::new(seed))),
            notify: Arc::new(Notify::new()),
        }
    }

    /// The world, locked (never across an await).
    pub(super) fn lock(&self) -> MutexGuard<'_, World> {
        self.world
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Wakes every waiter: the world changed.
    pub(super) fn changed(&self) {
        self.notify.notify_waiters();
    }
}

/// Whether a record written in `txn` is visible to a read_committed reader.
pub(super) fn committed(world: &World, txn: Option<u64>) -> bool {
    txn.is_none_or(|t| {
        world
            .txns
            .get(&t)
            .is_some_and(|t| t.status == TxnStatus::Committed)
    })
}
