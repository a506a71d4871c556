//! The [`Core`]'s state and its outputs ([`Action`], [`StatusUpdate`]).
//!
//! All of the core's state is one struct, so that every input sees and leaves a
//! consistent whole (the tests check its invariants after every call). Its behaviour is
//! split by concern: the ack tracker and watermark in `tracker.rs`, each event's
//! produce / retry / poison life in `events.rs`, status-update timing in `status.rs`.
//! This file holds the state, its construction, and what the shell drains and asks.
//!
//! # Bounded memory
//!
//! Events: at most `max_in_flight_events` (admitting into a full window is an error, and
//! a single event of any size is admitted into an empty window, so there is no deadlock).
//! Transactions: an entry whose last event resolves after its `Commit` is merged into the
//! entry before it (or popped, at the front), and a transaction with no outbox event
//! (other tables only) resolves at its `Commit` the same way, so every queued entry except
//! the open one holds at least one in-flight event: at most `max_in_flight_events + 1`
//! entries, however many transactions are read. Actions: at most one live action per
//! in-flight event, and status updates are coalesced into one.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;

use super::config::CoreConfig;
use super::resend::{Origin, ProgressMark, ResendGuard};
use super::saving::Saving;
use crate::delivery::EventId;
use crate::hashing::HashMap;
use crate::lsn::Lsn;

/// A standby status update (`'r'`) as the shell must send it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusUpdate {
    /// Highest WAL position received (never below `flush`).
    pub write: Lsn,
    /// The confirmed watermark: everything before it is resolved.
    pub flush: Lsn,
    /// Same as `flush`.
    pub apply: Lsn,
    /// Always `false` from the core; the shell repeats the last status with `true`
    /// when the server has been silent for half the receive timeout
    /// (`relay.receive_timeout_secs`).
    pub reply_requested: bool,
}

/// Something the shell must do, drained with [`Core::next_action`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Produce (again) the record of `id`; report with [`Core::delivered`] or
    /// [`Core::delivery_failed`]. `attempt` counts produces of this event, from 1.
    Produce { id: EventId, attempt: u32 },
    /// Write the event to `poison_outbox`; call [`Core::poison_committed`] once that
    /// database transaction committed, or [`Core::poison_insert_failed`] if it did not.
    InsertPoison { id: EventId, attempts: u32 },
    /// Send this standby status update now, whether or not the reader is paused.
    SendStatus(StatusUpdate),
    /// Commit the open Kafka transaction, with the progress record
    /// [`Core::transaction_mark`] written in it; report with
    /// [`Core::transaction_committed`], or abort it and report
    /// [`Core::transaction_aborted`] (`transactions.rs`).
    CommitTransaction,
    /// Abort the open Kafka transaction (a record in it failed); report with
    /// [`Core::transaction_aborted`].
    AbortTransaction,
    /// Save `lsn` in the relay's position table (coalescing with earlier requests;
    /// `urgent`: without waiting for the saver's gap); report with [`Core::saved`] or
    /// [`Core::save_failed`]. Statuses never confirm past what is saved (`saving.rs`).
    Save { lsn: Lsn, urgent: bool },
}

#[derive(Debug, Clone, Copy)]
pub(super) struct OpenTx {
    pub(super) xid: u32,
    pub(super) final_lsn: Lsn,
    pub(super) seq: u64,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct TxEntry {
    /// `None` while the transaction is open.
    pub(super) end_lsn: Option<Lsn>,
    /// Events of this entry not yet resolved.
    pub(super) pending: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Then {
    Produce,
    InsertPoison,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum EventState {
    /// A produce of this attempt is requested or outstanding.
    Producing { attempt: u32 },
    /// Waiting for a retry deadline.
    Backoff { until: Instant, then: Then },
    /// A poison insert is requested or outstanding.
    Poisoning,
    /// Not produced yet: an earlier event of the same key is being retried (see
    /// "Per-key order" in `events.rs`). Released in admission order.
    Held,
    /// Delivered into the open Kafka transaction (transactional mode): resolved when
    /// it commits, produced again if it is aborted (`transactions.rs`).
    Written,
    /// Would have been poisoned, but `relay.on_poison = "halt"`: never resolved by
    /// this core, so the watermark stops before its transaction.
    Halted,
    /// Failed, and due for a retry, but an earlier failed event of its key is not
    /// resolved yet: retried when that one is (see "Per-key order" in `events.rs`).
    Waiting,
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Event {
    pub(super) tx: u64,
    pub(super) bytes: usize,
    /// Produces issued (1 for an unmappable row: its one mapping attempt).
    pub(super) attempts: u32,
    pub(super) permanent_failures: u32,
    /// Transient failures (produce or poison insert), for the backoff exponent.
    pub(super) transient_failures: u32,
    pub(super) state: EventState,
    /// The record key's hash, when per-key order is to be kept.
    pub(super) key: Option<u64>,
    /// A delivery of it failed at least once (it then blocks its key until resolved).
    pub(super) failed: bool,
    /// Its name across resends of its transaction.
    pub(super) origin: Origin,
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Pending {
    Produce { id: EventId, attempt: u32 },
    InsertPoison { id: EventId },
}

/// Where the open Kafka transaction is in its life.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Produces go into it (librdkafka's transaction is begun by the shell lazily).
    #[default]
    Open,
    /// [`Action::CommitTransaction`] was handed out; waiting for its outcome.
    Committing,
    /// [`Action::AbortTransaction`] was handed out; waiting for its outcome.
    Aborting,
    /// After an abort, nothing is produced before `until` (no hot abort loop).
    Paused { until: Instant },
}

/// The core's view of the open Kafka transaction (`transactions.rs`).
#[derive(Debug, Default, Clone)]
pub(super) struct KafkaTransaction {
    /// Events produced in it (state `Producing` or `Written`), by id (admission order).
    pub(super) members: BTreeSet<EventId>,
    /// Members the shell said it handed to the producer ([`Core::produce_sent`]): a
    /// commit resolves only these and the written ones, never a produce that was
    /// handed out and not sent.
    pub(super) sent: BTreeSet<EventId>,
    /// Members in state `Written`.
    pub(super) written: usize,
    /// When the first member was written (the commit interval runs from there).
    pub(super) first_write: Option<Instant>,
    pub(super) phase: Phase,
    /// A member failed: the transaction must be aborted.
    pub(super) abort_due: bool,
    /// Full, or its interval passed: the transaction is to be committed.
    pub(super) commit_due: bool,
    /// The mark of the commit handed out, until its outcome.
    pub(super) mark: Option<ProgressMark>,
}

/// The sans-IO relay core. See the module documentation of `crate::cdc::progress`.
#[derive(Debug)]
pub struct Core {
    pub(super) cfg: CoreConfig,
    /// The watermark: every transaction committed before it is resolved.
    pub(super) confirmed: Lsn,
    /// Highest WAL position received (status `write`).
    pub(super) written: Lsn,
    /// `flush` of the last status built; statuses never go below it.
    pub(super) reported_flush: Lsn,
    pub(super) last_status_at: Instant,
    pub(super) status_due: bool,
    /// Events resolved since the last status was built: a status is due at once when
    /// a window's worth piled up, which bounds what a crash can make the server
    /// re-send to the window plus this count.
    pub(super) resolved_since_status: usize,
    pub(super) open: Option<OpenTx>,
    pub(super) last_commit_end: Option<Lsn>,
    /// Transactions in commit order, keyed by a sequence number.
    pub(super) txs: BTreeMap<u64, TxEntry>,
    pub(super) next_tx_seq: u64,
    pub(super) events: BTreeMap<EventId, Event>,
    pub(super) next_event_id: u64,
    pub(super) in_flight_bytes: usize,
    pub(super) retries: BTreeSet<(Instant, EventId)>,
    pub(super) actions: VecDeque<Pending>,
    /// Keys with events that failed and are not resolved yet, and how many.
    pub(super) blocked_keys: HashMap<u64, u32>,
    /// Events of a blocked key admitted after the block, in admission order.
    pub(super) held: HashMap<u64, VecDeque<EventId>>,
    /// Events in [`EventState::Halted`] (they never leave it).
    pub(super) halted: usize,
    /// What lost sessions of this process already resolved (`resend.rs`).
    pub(super) resend: ResendGuard,
    /// The saved position and the save requests (`saving.rs`).
    pub(super) saving: Saving,
    /// The open Kafka transaction, in transactional mode (`transactions.rs`).
    pub(super) kafka: KafkaTransaction,
    /// Events resolved since the shell last drained them ([`Core::drain_resolved`]):
    /// the shell keeps each event's record until its id comes out here.
    pub(super) resolved_log: Vec<EventId>,
}

impl Core {
    /// A core for a replication stream started from `confirmed`, the slot's
    /// `confirmed_flush_lsn` (what the server will resume from), which the shell has
    /// saved in the relay's position table before streaming.
    #[must_use]
    pub fn new(cfg: CoreConfig, confirmed: Lsn, now: Instant) -> Self {
        Self {
            cfg: cfg.normalized(),
            confirmed,
            written: confirmed,
            reported_flush: confirmed,
            last_status_at: now,
            status_due: false,
            resolved_since_status: 0,
            open: None,
            last_commit_end: None,
            txs: BTreeMap::new(),
            next_tx_seq: 0,
            events: BTreeMap::new(),
            next_event_id: 1,
            in_flight_bytes: 0,
            retries: BTreeSet::new(),
            actions: VecDeque::new(),
            blocked_keys: HashMap::default(),
            held: HashMap::default(),
            halted: 0,
            resend: ResendGuard::default(),
            saving: Saving::new(confirmed, now),
            kafka: KafkaTransaction::default(),
            resolved_log: Vec::new(),
        }
    }

    /// A fresh core for a new replication connection in the same process (after the
    /// previous connection was lost). In-flight events are forgotten — the server re-sends
    /// their transactions — but event ids continue, so late delivery reports for the old
    /// core's events are recognised as unknown and ignored instead of resolving a new event
    /// that happened to get the same id. The watermark is the higher of `slot_confirmed`
    /// and what this core had already confirmed (both are durable facts), and the shell
    /// saves it before streaming (the start plan does: `crate::cdc::start`). What the lost
    /// session resolved of its unconfirmed transactions is remembered, so that their
    /// resend produces only the events still unresolved (`resend.rs`).
    #[must_use]
    pub fn restart(mut self, slot_confirmed: Lsn, now: Instant) -> Self {
        let mut resend = std::mem::take(&mut self.resend);
        resend.confirmed(self.confirmed);
        resend.session_lost(self.events.values().map(|e| e.origin));
        let mut next = Self::new(self.cfg, slot_confirmed.max(self.confirmed), now);
        next.reported_flush = next.reported_flush.max(self.reported_flush);
        next.written = next.written.max(self.written);
        next.next_event_id = self.next_event_id;
        next.resend = resend;
        next.resend.confirmed(next.confirmed);
        next
    }

    /// A fresh core for a new replication connection to a server on another WAL
    /// history (failover): unlike [`Core::restart`] nothing of the old positions is
    /// kept, because they may name WAL the new server never had (nor what the lost
    /// session resolved: its names are positions too); event ids continue.
    #[must_use]
    pub fn restart_on_new_history(self, start: Lsn, now: Instant) -> Self {
        let mut next = Self::new(self.cfg, start, now);
        next.next_event_id = self.next_event_id;
        next
    }

    /// Whether `id` is admitted and not yet resolved.
    #[must_use]
    pub fn is_in_flight(&self, id: EventId) -> bool {
        self.events.contains_key(&id)
    }

    /// The events resolved since the last call, in the order they resolved (acked,
    /// committed in a Kafka transaction, poisoned, or resolved at admission). The
    /// shell keeps an event's record until its id comes out here, and only then:
    /// an acked record inside an open Kafka transaction is not resolved, and the
    /// core asks for it again if that transaction is aborted (`transactions.rs`).
    pub fn drain_resolved(&mut self) -> std::vec::Drain<'_, EventId> {
        self.resolved_log.drain(..)
    }

    /// The name of in-flight event `id` across resends of its transaction; `None`
    /// once it is resolved (also at admission, for an event a lost session of this
    /// process had already resolved: the shell has nothing to do for it).
    #[must_use]
    pub fn origin(&self, id: EventId) -> Option<Origin> {
        self.events.get(&id).map(|e| e.origin)
    }

    /// The normalised configuration in use.
    #[must_use]
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// The next thing to do, saves and status updates first. Requests made stale by
    /// later reports are skipped.
    pub fn next_action(&mut self) -> Option<Action> {
        // A save first: a status confirms only what is saved already (`saving.rs`).
        if let Some((lsn, urgent)) = self.saving.due.take() {
            return Some(Action::Save { lsn, urgent });
        }
        if self.status_due {
            self.status_due = false;
            return Some(Action::SendStatus(self.build_status()));
        }
        if let Some(action) = self.transaction_action() {
            return Some(action);
        }
        if !self.may_produce() {
            return self.next_poison_action();
        }
        while let Some(pending) = self.actions.pop_front() {
            match pending {
                Pending::Produce { id, attempt } => {
                    if let Some(event) = self.events.get(&id)
                        && event.state == (EventState::Producing { attempt })
                    {
                        if attempt == 1 && self.would_overtake_failure(id) {
                            // Waits behind it and retries oldest first, as an
                            // aborted transaction's queued member does
                            // (`produce_again`).
                            self.produce_again(id, false);
                            continue;
                        }
                        if self.transactional() {
                            self.kafka.members.insert(id);
                        }
                        return Some(Action::Produce { id, attempt });
                    }
                }
                Pending::InsertPoison { id } => {
                    if let Some(action) = self.poison_action(id) {
                        return Some(action);
                    }
                }
            }
        }
        None
    }

    /// Whether the first produce of `id`, queued before an earlier event of its key
    /// failed (a send the producer refused at once fails within the same batch of
    /// actions), would overtake that event's retry.
    fn would_overtake_failure(&self, id: EventId) -> bool {
        let Some(event) = self.events.get(&id) else {
            return false;
        };
        match event.key {
            Some(k) if !event.failed && self.blocked_keys.contains_key(&k) => {
                self.earlier_failure(k, id)
            }
            _ => false,
        }
    }

    /// A poison insert from the queue, skipping (and keeping) the produces: for while
    /// a Kafka transaction is being committed or aborted.
    fn next_poison_action(&mut self) -> Option<Action> {
        while let Some(at) = self
            .actions
            .iter()
            .position(|p| matches!(p, Pending::InsertPoison { .. }))
        {
            let Some(Pending::InsertPoison { id }) = self.actions.remove(at) else {
                continue;
            };
            if let Some(action) = self.poison_action(id) {
                return Some(action);
            }
        }
        None
    }

    /// The poison insert of `id`, unless a later report made the request stale.
    fn poison_action(&self, id: EventId) -> Option<Action> {
        let event = self.events.get(&id)?;
        (event.state == EventState::Poisoning).then_some(Action::InsertPoison {
            id,
            attempts: event.attempts,
        })
    }

    /// The earliest instant at which [`Core::tick`] has work. `None` only if a status is
    /// already due (drain [`Core::next_action`]) and no retry is waiting.
    #[must_use]
    pub fn next_deadline(&self) -> Option<Instant> {
        let status = if self.status_due {
            None
        } else {
            self.status_deadline()
        };
        let retry = self.retries.first().map(|&(at, _)| at);
        [
            status,
            retry,
            self.save_deadline(),
            self.transaction_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Whether the shell may read the next replication message: false while the in-flight
    /// window is full (events or bytes), and between transactions while a window's
    /// worth of resolved events waits for a save (`saving.rs`). Status updates do not
    /// depend on it.
    #[must_use]
    pub fn can_read(&self) -> bool {
        self.window_has_room() && !self.save_blocks_reading()
    }

    /// The in-flight window is not full (events and bytes).
    pub(super) fn window_has_room(&self) -> bool {
        self.events.len() < self.cfg.max_in_flight_events
            && self.in_flight_bytes < self.cfg.max_in_flight_bytes
    }

    /// The watermark: every transaction committed before it is acked or poisoned.
    #[must_use]
    pub fn confirmed(&self) -> Lsn {
        self.confirmed
    }

    /// Highest WAL position received.
    #[must_use]
    pub fn written(&self) -> Lsn {
        self.written.max(self.confirmed)
    }

    /// Events admitted and not yet resolved.
    #[must_use]
    pub fn in_flight_events(&self) -> usize {
        self.events.len()
    }

    /// Bytes of the events admitted and not yet resolved.
    #[must_use]
    pub fn in_flight_bytes(&self) -> usize {
        self.in_flight_bytes
    }

    /// Transactions held by the ack tracker (at most `max_in_flight_events + 1`).
    #[must_use]
    pub fn pending_transactions(&self) -> usize {
        self.txs.len()
    }

    /// Whether a transaction is open (`Begin` read, `Commit` not yet).
    #[must_use]
    pub fn in_transaction(&self) -> bool {
        self.open.is_some()
    }

    /// Nothing open, nothing in flight: everything received is resolved.
    #[must_use]
    pub fn is_idle(&self) -> bool {
        self.open.is_none() && self.txs.is_empty() && self.events.is_empty()
    }
}
