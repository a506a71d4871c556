//! The relay's sans-IO core: ack tracker, commit watermark, in-flight window and
//! standby-status timing.
//!
//! Nothing in this module touches a socket, a clock or a task. The async shell feeds it
//! inputs — decoded pgoutput `Begin` / outbox rows / `Commit`, broker delivery reports,
//! poison-insert commits, keepalives, and the current time as an [`Instant`] — and drains
//! [`Action`]s: produce this record, insert that poison row, send this standby status
//! update. This is the shape of the protocol cores of rustls and quinn: every decision is a
//! deterministic function of the inputs, so the seeded simulator in the tests can drive it
//! through thousands of crash / out-of-order-ack / broker-error schedules in a second.
//!
//! # The watermark rule
//!
//! The slot's `confirmed_flush_lsn` is the only durable progress the relay has. When a
//! walsender (re)starts logical decoding it begins at that LSN and *skips every transaction
//! whose commit record starts before it* (`DecodeTXNNeedSkip` → `SnapBuildXactNeedsSkip(
//! buf->origptr < start_decoding_at)` in `src/backend/replication/logical/decode.c`);
//! everything committed at or after it is sent again. So reporting `flush = X` means "never
//! send me a transaction that committed before X", and the core may only report the
//! `end_lsn` of transaction T once T **and every transaction before it** is resolved.
//!
//! The ack tracker is a queue of transactions in commit order, each `{end_lsn, pending}`:
//! `end_lsn` is unknown while the transaction is open (its `Commit` not read yet), `pending`
//! counts its unresolved events. Acks may arrive in any order; each only decrements a count.
//! The front is popped while it is committed and has nothing pending, and the confirmed LSN
//! becomes its `end_lsn`. A transaction can be larger than the in-flight window: its first
//! events are acked (and leave the window) before its `Commit` is read, but its entry
//! cannot be popped until the `Commit` gives it an `end_lsn`.
//!
//! # Why a poisoned event counts only once its insert committed
//!
//! "Resolved" means durable somewhere: acked by the broker with `acks=all`, or a committed
//! row in `poison_outbox`. Emitting [`Action::InsertPoison`] is only a request; if the
//! relay crashed after confirming past the event but before the poison transaction
//! committed, the row would be in neither place and the slot would never send it again —
//! a silent loss. For the same reason a produce counts when it is *acked*, not when it is
//! sent.
//!
//! # Idle advance, and why only when nothing is open or pending
//!
//! If the outbox is quiet but the rest of the cluster writes WAL, the slot would pin all of
//! it (promise 4, `docs/architecture.md#promises`). A primary keepalive carries `wal_end`, for a logical
//! walsender its `sentPtr`: the end of the last WAL record it has decoded (`WalSndKeepalive`
//! in `walsender.c`). The stream is ordered, so every transaction whose commit record lies
//! before that point has already been sent to us ahead of the keepalive, and any
//! transaction not yet sent commits at or after it and would be re-sent after a restart.
//! Hence, when **every** transaction received so far is resolved and none is open, the
//! keepalive's `wal_end` (or an XLogData's `wal_end`, see [`Core::received`]) may become the
//! confirmed LSN. Never otherwise:
//!
//! * with an unresolved event pending, `wal_end` may be past that event's commit, and
//!   confirming it would skip the transaction on restart;
//! * with a transaction open, even one whose rows so far are all acked. An XLogData's
//!   `wal_end` is the position logical decoding wrote the message at (`WalSndPrepareWrite`;
//!   `0/0` when it is not the callback's last write), and for a `Commit` that is the
//!   transaction's `end_lsn`, fed by the shell before `commit()`. The pending check alone
//!   covers the orderings a correct shell produces; refusing while open as well keeps the
//!   rule independent of whether the shell feeds `received()` before or after a payload and
//!   of what a server version puts in `wal_end` mid-transaction, and costs nothing (the
//!   `Commit` itself, or the next keepalive, moves the watermark).
//!
//! # Why status updates ignore back-pressure
//!
//! A walsender drops a client that has not replied for `wal_sender_timeout` (default 60 s)
//! and sets "reply requested" in a keepalive at half that time. When the in-flight window
//! is full the shell stops reading the socket, so it may never see that keepalive. The core
//! therefore schedules a status update on its own timer ([`CoreConfig::status_interval`],
//! which must be well below `wal_sender_timeout / 2`) and the shell must drain and send it
//! whatever [`Core::can_read`] says. The timer is also checked on every input that carries
//! `now`, so a shell whose timer branch is starved by a stream of acks still sends on time.
//! A status is also sent promptly (but at most once per `progress_status_interval`) after the
//! confirmed LSN moved, never once per event. `flush` never goes backwards and `write` is
//! never below `flush`.
//!
//! # Reports that match nothing are ignored
//!
//! A delivery report or poison commit for an id the core does not know, or for an event
//! that is not waiting for that kind of report (a duplicate report, a report for a
//! previous core's event after a reconnect, a late report after a retry was scheduled),
//! is ignored. Counting it would decrement the `pending` count of a transaction whose
//! event is still unresolved, and the watermark could pass that event. Ignoring a report can only *delay* a confirmation: the
//! event stays pending until the report it is actually waiting for arrives.
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
//!
//! # Limits
//!
//! * Per-key order and application-level retries. First produces are issued in commit
//!   order, and the idempotent producer keeps them in order per partition through its own
//!   retries. A delivery the producer gives up on (a per-record error such as
//!   `MessageSizeTooLarge`) is retried here, and a retry could overtake nothing only if
//!   no later event of the key were produced meanwhile. So from the moment an event
//!   fails, later events of its key (`admit_keyed`) are *held* — admitted, counted in the
//!   window, not produced — until it is delivered or poisoned; then they are produced in
//!   order. What this cannot undo: events of the key produced *before* the failure was
//!   reported (at most the producer's in-flight requests for that partition) may land
//!   before the retried event. A poisoned event is out of order by nature when replayed.
//! * Streamed in-progress transactions (pgoutput protocol v2 `Stream*` messages) are not
//!   modelled: the core expects `Begin`, rows, `Commit`, one transaction at a time.
//!
//! References: <https://www.postgresql.org/docs/current/protocol-replication.html>
//! (XLogData, primary keepalive, standby status update),
//! <https://www.postgresql.org/docs/current/logicaldecoding-explanation.html> (slots),
//! <https://www.postgresql.org/docs/current/view-pg-replication-slots.html>
//! (`confirmed_flush_lsn`),
//! <https://www.postgresql.org/docs/current/runtime-config-replication.html>
//! (`wal_sender_timeout`).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

use crate::delivery::{EventId, Failure};
use crate::lsn::Lsn;

/// Smallest status interval the core accepts; a zero interval would make the shell spin.
const MIN_STATUS_INTERVAL: Duration = Duration::from_millis(1);

/// Longest timer the core arms, so `Instant + Duration` can never overflow.
const MAX_TIMER: Duration = Duration::from_secs(24 * 60 * 60);

/// Tuning of the [`Core`]. Out-of-range values are normalised by [`Core::new`] (see each
/// field); validation with a clear message belongs to the config loader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoreConfig {
    /// In-flight window, in events (admitted and not yet resolved). Zero is treated as 1.
    pub max_in_flight_events: usize,
    /// In-flight window, in record bytes. Zero is treated as 1. One event larger than this
    /// is still admitted when the window is empty.
    pub max_in_flight_bytes: usize,
    /// Produce attempts that end in a permanent failure before an event is poisoned.
    /// Transient failures do not count. Zero is treated as 1.
    pub max_attempts: u32,
    /// Keep-alive status period; keep it well below `wal_sender_timeout / 2`.
    /// Clamped to 1 ms ..= 24 h.
    pub status_interval: Duration,
    /// Minimum gap between two status updates sent because the confirmed LSN moved
    /// (capped by `status_interval`). Short, so the server's idea of the confirmed
    /// LSN trails the acks by little: after a crash everything acked but not yet
    /// reported is sent again, so this gap bounds duplicates beyond the window.
    pub progress_status_interval: Duration,
    /// First delay after a transient failure; doubles per failure of the same event.
    /// Clamped to at most 24 h.
    pub retry_backoff_initial: Duration,
    /// Upper bound of the retry delay. Clamped to at most 24 h.
    pub retry_backoff_max: Duration,
}

impl Default for CoreConfig {
    fn default() -> Self {
        Self {
            max_in_flight_events: 10_000,
            max_in_flight_bytes: 64 * 1024 * 1024,
            max_attempts: 5,
            status_interval: Duration::from_secs(10),
            progress_status_interval: Duration::from_millis(10),
            retry_backoff_initial: Duration::from_millis(100),
            retry_backoff_max: Duration::from_secs(30),
        }
    }
}

impl CoreConfig {
    fn normalized(mut self) -> Self {
        self.max_in_flight_events = self.max_in_flight_events.max(1);
        self.max_in_flight_bytes = self.max_in_flight_bytes.max(1);
        self.max_attempts = self.max_attempts.max(1);
        self.status_interval = self.status_interval.clamp(MIN_STATUS_INTERVAL, MAX_TIMER);
        self.retry_backoff_initial = self.retry_backoff_initial.min(MAX_TIMER);
        self.retry_backoff_max = self.retry_backoff_max.min(MAX_TIMER);
        self
    }
}

/// A standby status update (`'r'`) as the shell must send it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatusUpdate {
    /// Highest WAL position received (never below `flush`).
    pub write: Lsn,
    /// The confirmed watermark: everything before it is resolved.
    pub flush: Lsn,
    /// Same as `flush`.
    pub apply: Lsn,
    /// Always `false`: the relay never asks the server for an immediate keepalive.
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
}

/// A violation of the pgoutput transaction framing (or of the window contract by the
/// shell). The stream cannot be trusted past it: the shell should drop the connection and
/// restart from the slot, which is always safe.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// `Begin` while another transaction is still open.
    #[error(
        "Begin of transaction {xid} (final LSN {final_lsn}) while transaction {open_xid} (final LSN {open_final_lsn}) is still open"
    )]
    BeginInsideTransaction {
        open_xid: u32,
        open_final_lsn: Lsn,
        xid: u32,
        final_lsn: Lsn,
    },
    /// `Commit` with no open transaction.
    #[error("Commit (commit LSN {commit_lsn}, end LSN {end_lsn}) without a Begin")]
    CommitWithoutBegin { commit_lsn: Lsn, end_lsn: Lsn },
    /// A row change with no open transaction.
    #[error("row change outside a transaction (no Begin)")]
    ChangeOutsideTransaction,
    /// `Commit`'s commit LSN differs from the open transaction's `Begin` final LSN.
    #[error(
        "Commit LSN {commit_lsn} does not match the final LSN {final_lsn} announced by Begin of transaction {xid}"
    )]
    CommitLsnMismatch {
        xid: u32,
        final_lsn: Lsn,
        commit_lsn: Lsn,
    },
    /// `Commit`'s end LSN is not after its commit LSN.
    #[error("transaction {xid} ends at {end_lsn}, not after its commit LSN {commit_lsn}")]
    CommitEndNotAfterCommit {
        xid: u32,
        commit_lsn: Lsn,
        end_lsn: Lsn,
    },
    /// A transaction commits before the end of the previous one: commit order went back.
    #[error(
        "transaction {xid} commits at {final_lsn}, before the end {previous_end} of the previous commit"
    )]
    CommitLsnWentBackwards {
        xid: u32,
        final_lsn: Lsn,
        previous_end: Lsn,
    },
    /// The shell admitted an event while [`Core::can_read`] was false.
    #[error(
        "in-flight window is full ({events} events, {bytes} bytes): the shell must not read while can_read() is false"
    )]
    WindowFull { events: usize, bytes: usize },
}

#[derive(Debug, Clone, Copy)]
struct OpenTx {
    xid: u32,
    final_lsn: Lsn,
    seq: u64,
}

#[derive(Debug, Clone, Copy)]
struct TxEntry {
    /// `None` while the transaction is open.
    end_lsn: Option<Lsn>,
    /// Events of this entry not yet resolved.
    pending: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    Produce,
    InsertPoison,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EventState {
    /// A produce of this attempt is requested or outstanding.
    Producing { attempt: u32 },
    /// Waiting for a retry deadline.
    Backoff { until: Instant, then: Then },
    /// A poison insert is requested or outstanding.
    Poisoning,
    /// Not produced yet: an earlier event of the same key is being retried (see
    /// "Per-key order" in the module docs). Released in admission order.
    Held,
}

#[derive(Debug, Clone, Copy)]
struct Event {
    tx: u64,
    bytes: usize,
    /// Produces issued (1 for an unmappable row: its one mapping attempt).
    attempts: u32,
    permanent_failures: u32,
    /// Transient failures (produce or poison insert), for the backoff exponent.
    transient_failures: u32,
    state: EventState,
    /// The record key's hash, when per-key order is to be kept.
    key: Option<u64>,
    /// A delivery of it failed at least once (it then blocks its key until resolved).
    failed: bool,
}

#[derive(Debug, Clone, Copy)]
enum Pending {
    Produce { id: EventId, attempt: u32 },
    InsertPoison { id: EventId },
}

/// The sans-IO relay core. See the module documentation.
#[derive(Debug)]
pub struct Core {
    cfg: CoreConfig,
    /// The watermark: every transaction committed before it is resolved.
    confirmed: Lsn,
    /// Highest WAL position received (status `write`).
    written: Lsn,
    /// `flush` of the last status built; statuses never go below it.
    reported_flush: Lsn,
    last_status_at: Instant,
    status_due: bool,
    /// Events resolved since the last status was built: a status is due at once when
    /// a window's worth piled up, which bounds what a crash can make the server
    /// re-send to the window plus this count.
    resolved_since_status: usize,
    open: Option<OpenTx>,
    last_commit_end: Option<Lsn>,
    /// Transactions in commit order, keyed by a sequence number.
    txs: BTreeMap<u64, TxEntry>,
    next_tx_seq: u64,
    events: BTreeMap<EventId, Event>,
    next_event_id: u64,
    in_flight_bytes: usize,
    retries: BTreeSet<(Instant, EventId)>,
    actions: VecDeque<Pending>,
    /// Keys with events that failed and are not resolved yet, and how many.
    blocked_keys: HashMap<u64, u32>,
    /// Events of a blocked key admitted after the block, in admission order.
    held: HashMap<u64, VecDeque<EventId>>,
}

impl Core {
    /// A core for a replication stream started from `confirmed`, the slot's
    /// `confirmed_flush_lsn` (what the server will resume from).
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
            blocked_keys: HashMap::new(),
            held: HashMap::new(),
        }
    }

    /// A fresh core for a new replication connection in the same process (after the
    /// previous connection was lost). In-flight events are forgotten — the server re-sends
    /// their transactions — but event ids continue, so late delivery reports for the old
    /// core's events are recognised as unknown and ignored instead of resolving a new event
    /// that happened to get the same id. The watermark is the higher of `slot_confirmed`
    /// and what this core had already confirmed (both are durable facts).
    #[must_use]
    pub fn restart(self, slot_confirmed: Lsn, now: Instant) -> Self {
        let mut next = Self::new(self.cfg, slot_confirmed.max(self.confirmed), now);
        next.reported_flush = next.reported_flush.max(self.reported_flush);
        next.written = next.written.max(self.written);
        next.next_event_id = self.next_event_id;
        next
    }

    /// The normalised configuration in use.
    #[must_use]
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// pgoutput `Begin`.
    pub fn begin(&mut self, final_lsn: Lsn, xid: u32) -> Result<(), ProtocolError> {
        if let Some(open) = self.open {
            return Err(ProtocolError::BeginInsideTransaction {
                open_xid: open.xid,
                open_final_lsn: open.final_lsn,
                xid,
                final_lsn,
            });
        }
        if let Some(previous_end) = self.last_commit_end
            && final_lsn < previous_end
        {
            return Err(ProtocolError::CommitLsnWentBackwards {
                xid,
                final_lsn,
                previous_end,
            });
        }
        let seq = self.next_tx_seq;
        // 2^64 transactions cannot be read; wrapping keeps this panic-free regardless.
        self.next_tx_seq = self.next_tx_seq.wrapping_add(1);
        self.txs.insert(
            seq,
            TxEntry {
                end_lsn: None,
                pending: 0,
            },
        );
        self.open = Some(OpenTx {
            xid,
            final_lsn,
            seq,
        });
        Ok(())
    }

    /// One outbox event of the open transaction, `bytes` long (key + value + headers).
    /// Queues [`Action::Produce`] with attempt 1.
    ///
    /// Errors: [`ProtocolError::ChangeOutsideTransaction`] without a `Begin`;
    /// [`ProtocolError::WindowFull`] if called while [`Core::can_read`] is false.
    pub fn admit(&mut self, bytes: usize, now: Instant) -> Result<EventId, ProtocolError> {
        self.admit_keyed(bytes, None, now)
    }

    /// [`Core::admit`] for a record whose key hashes to `key`: while an earlier event
    /// of that key is being retried, this one is held (no produce) until the earlier
    /// one is delivered or poisoned, so it cannot overtake it.
    pub fn admit_keyed(
        &mut self,
        bytes: usize,
        key: Option<u64>,
        now: Instant,
    ) -> Result<EventId, ProtocolError> {
        let blocked = key.is_some_and(|k| self.blocked_keys.contains_key(&k));
        let state = if blocked {
            EventState::Held
        } else {
            EventState::Producing { attempt: 1 }
        };
        let id = self.admit_event(bytes, state)?;
        if let Some(event) = self.events.get_mut(&id) {
            event.key = key;
        }
        match key {
            Some(k) if blocked => self.held.entry(k).or_default().push_back(id),
            _ => self.actions.push_back(Pending::Produce { id, attempt: 1 }),
        }
        self.poll_status(now);
        Ok(id)
    }

    /// A row of the open transaction that cannot be mapped to a record (null key, bad
    /// column type): queues [`Action::InsertPoison`] straight away, with `attempts` 1.
    /// It occupies the window until [`Core::poison_committed`]. Errors as for
    /// [`Core::admit`].
    pub fn admit_unmappable(&mut self, bytes: usize) -> Result<EventId, ProtocolError> {
        let id = self.admit_event(bytes, EventState::Poisoning)?;
        self.actions.push_back(Pending::InsertPoison { id });
        Ok(id)
    }

    fn admit_event(&mut self, bytes: usize, state: EventState) -> Result<EventId, ProtocolError> {
        let Some(open) = self.open else {
            return Err(ProtocolError::ChangeOutsideTransaction);
        };
        if !self.can_read() {
            return Err(ProtocolError::WindowFull {
                events: self.events.len(),
                bytes: self.in_flight_bytes,
            });
        }
        let id = EventId::from_raw(self.next_event_id);
        self.next_event_id = self.next_event_id.wrapping_add(1);
        self.txs
            .entry(open.seq)
            .or_insert(TxEntry {
                end_lsn: None,
                pending: 0,
            })
            .pending += 1;
        self.events.insert(
            id,
            Event {
                tx: open.seq,
                bytes,
                attempts: 1,
                permanent_failures: 0,
                transient_failures: 0,
                state,
                key: None,
                failed: false,
            },
        );
        self.in_flight_bytes = self.in_flight_bytes.saturating_add(bytes);
        Ok(id)
    }

    /// pgoutput `Commit`: `commit_lsn` must equal `Begin`'s final LSN; `end_lsn` is what
    /// the watermark becomes once this transaction and all before it are resolved.
    pub fn commit(
        &mut self,
        commit_lsn: Lsn,
        end_lsn: Lsn,
        now: Instant,
    ) -> Result<(), ProtocolError> {
        let Some(open) = self.open else {
            return Err(ProtocolError::CommitWithoutBegin {
                commit_lsn,
                end_lsn,
            });
        };
        if commit_lsn != open.final_lsn {
            return Err(ProtocolError::CommitLsnMismatch {
                xid: open.xid,
                final_lsn: open.final_lsn,
                commit_lsn,
            });
        }
        if end_lsn <= commit_lsn {
            return Err(ProtocolError::CommitEndNotAfterCommit {
                xid: open.xid,
                commit_lsn,
                end_lsn,
            });
        }
        self.open = None;
        self.last_commit_end = Some(end_lsn);
        self.written = self.written.max(end_lsn);
        self.txs
            .entry(open.seq)
            .or_insert(TxEntry {
                end_lsn: None,
                pending: 0,
            })
            .end_lsn = Some(end_lsn);
        self.settle(open.seq);
        self.poll_status(now);
        Ok(())
    }

    /// The broker acked the record of `id`. Ignored unless a produce of `id` is outstanding.
    pub fn delivered(&mut self, id: EventId, now: Instant) {
        if let Some(event) = self.events.get(&id)
            && matches!(event.state, EventState::Producing { .. })
        {
            self.resolve(id);
        }
        self.poll_status(now);
    }

    /// The broker gave up on the record of `id`. Ignored unless a produce of `id` is
    /// outstanding.
    ///
    /// Permanent: produced again at once, until `max_attempts` permanent failures, then
    /// poisoned. Transient: produced again after an exponential backoff, never poisoned.
    pub fn delivery_failed(&mut self, id: EventId, failure: Failure, now: Instant) {
        let max_attempts = self.cfg.max_attempts;
        let delay_base = (self.cfg.retry_backoff_initial, self.cfg.retry_backoff_max);
        if let Some(event) = self.events.get_mut(&id)
            && matches!(event.state, EventState::Producing { .. })
        {
            if !event.failed {
                event.failed = true;
                if let Some(k) = event.key {
                    *self.blocked_keys.entry(k).or_default() += 1;
                }
            }
            match failure {
                Failure::Permanent => {
                    event.permanent_failures = event.permanent_failures.saturating_add(1);
                    if event.permanent_failures >= max_attempts {
                        event.state = EventState::Poisoning;
                        self.actions.push_back(Pending::InsertPoison { id });
                    } else {
                        event.attempts = event.attempts.saturating_add(1);
                        let attempt = event.attempts;
                        event.state = EventState::Producing { attempt };
                        self.actions.push_back(Pending::Produce { id, attempt });
                    }
                }
                Failure::Transient => {
                    event.transient_failures = event.transient_failures.saturating_add(1);
                    let until = deadline(now, backoff(delay_base, event.transient_failures));
                    event.state = EventState::Backoff {
                        until,
                        then: Then::Produce,
                    };
                    self.retries.insert((until, id));
                }
            }
        }
        self.poll_status(now);
    }

    /// The `poison_outbox` insert for `id` committed: the event is resolved. Ignored
    /// unless a poison insert of `id` is outstanding.
    pub fn poison_committed(&mut self, id: EventId, now: Instant) {
        if let Some(event) = self.events.get(&id)
            && event.state == EventState::Poisoning
        {
            self.resolve(id);
        }
        self.poll_status(now);
    }

    /// The `poison_outbox` insert for `id` failed (database unreachable…): requested
    /// again after a backoff. Ignored unless a poison insert of `id` is outstanding.
    pub fn poison_insert_failed(&mut self, id: EventId, now: Instant) {
        let delay_base = (self.cfg.retry_backoff_initial, self.cfg.retry_backoff_max);
        if let Some(event) = self.events.get_mut(&id)
            && event.state == EventState::Poisoning
        {
            event.transient_failures = event.transient_failures.saturating_add(1);
            let until = deadline(now, backoff(delay_base, event.transient_failures));
            event.state = EventState::Backoff {
                until,
                then: Then::InsertPoison,
            };
            self.retries.insert((until, id));
        }
        self.poll_status(now);
    }

    /// A primary keepalive. `wal_end` may become the watermark when nothing is open or
    /// pending (idle advance); `reply_requested` schedules a status update at once.
    pub fn keepalive(&mut self, wal_end: Lsn, reply_requested: bool, now: Instant) {
        self.written = self.written.max(wal_end);
        self.idle_advance(wal_end);
        if reply_requested {
            self.schedule_status(now);
        } else {
            self.poll_status(now);
        }
    }

    /// The `wal_end` of an XLogData message. Call it before processing the message's
    /// payload; it feeds the status `write` field and, when idle, the watermark.
    pub fn received(&mut self, wal_end: Lsn) {
        self.written = self.written.max(wal_end);
        self.idle_advance(wal_end);
    }

    /// Runs the timers due at `now`: retry backoffs and the status interval.
    pub fn tick(&mut self, now: Instant) {
        while let Some(&(at, id)) = self.retries.first() {
            if at > now {
                break;
            }
            self.retries.pop_first();
            if let Some(event) = self.events.get_mut(&id)
                && let EventState::Backoff { until, then } = event.state
                && until == at
            {
                match then {
                    Then::Produce => {
                        event.attempts = event.attempts.saturating_add(1);
                        let attempt = event.attempts;
                        event.state = EventState::Producing { attempt };
                        self.actions.push_back(Pending::Produce { id, attempt });
                    }
                    Then::InsertPoison => {
                        event.state = EventState::Poisoning;
                        self.actions.push_back(Pending::InsertPoison { id });
                    }
                }
            }
        }
        self.poll_status(now);
    }

    /// The next thing to do, status updates first. Requests made stale by later reports
    /// are skipped.
    pub fn next_action(&mut self) -> Option<Action> {
        if self.status_due {
            self.status_due = false;
            return Some(Action::SendStatus(self.build_status()));
        }
        while let Some(pending) = self.actions.pop_front() {
            match pending {
                Pending::Produce { id, attempt } => {
                    if let Some(event) = self.events.get(&id)
                        && event.state == (EventState::Producing { attempt })
                    {
                        return Some(Action::Produce { id, attempt });
                    }
                }
                Pending::InsertPoison { id } => {
                    if let Some(event) = self.events.get(&id)
                        && event.state == EventState::Poisoning
                    {
                        return Some(Action::InsertPoison {
                            id,
                            attempts: event.attempts,
                        });
                    }
                }
            }
        }
        None
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
        match (status, retry) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Whether the shell may read the next replication message: false while the in-flight
    /// window is full (events or bytes). Status updates do not depend on it.
    #[must_use]
    pub fn can_read(&self) -> bool {
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

    /// The final status update to send on graceful shutdown (typically once
    /// [`Core::is_idle`]), then close the stream with CopyDone.
    pub fn shutdown_status(&mut self) -> StatusUpdate {
        self.status_due = false;
        self.build_status()
    }

    /// Removes a resolved event and settles its transaction.
    fn resolve(&mut self, id: EventId) {
        let Some(event) = self.events.remove(&id) else {
            return;
        };
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(event.bytes);
        self.resolved_since_status = self.resolved_since_status.saturating_add(1);
        if event.failed
            && let Some(k) = event.key
        {
            self.unblock(k);
        }
        if let Some(entry) = self.txs.get_mut(&event.tx) {
            entry.pending = entry.pending.saturating_sub(1);
        }
        self.settle(event.tx);
    }

    /// One failed event of key `k` resolved; when it was the last, the held events of
    /// `k` are produced, in admission order.
    fn unblock(&mut self, k: u64) {
        let Some(count) = self.blocked_keys.get_mut(&k) else {
            return;
        };
        *count = count.saturating_sub(1);
        if *count > 0 {
            return;
        }
        self.blocked_keys.remove(&k);
        for id in self.held.remove(&k).unwrap_or_default() {
            if let Some(event) = self.events.get_mut(&id)
                && event.state == EventState::Held
            {
                event.state = EventState::Producing { attempt: 1 };
                self.actions.push_back(Pending::Produce { id, attempt: 1 });
            }
        }
    }

    /// If the entry `seq` is committed with nothing pending, folds it away: at the front
    /// the watermark becomes its end; elsewhere the entry before it takes over its end
    /// (that entry is committed, since only the last entry can be open), which keeps every
    /// remaining entry but the open one holding an unresolved event.
    fn settle(&mut self, seq: u64) {
        let Some(&TxEntry {
            end_lsn: Some(end),
            pending: 0,
        }) = self.txs.get(&seq)
        else {
            return;
        };
        self.txs.remove(&seq);
        match self.txs.range_mut(..seq).next_back() {
            None => self.confirmed = self.confirmed.max(end),
            Some((_, before)) => {
                // Unreachable `None` (an open entry before a committed one) would keep the
                // smaller end: a late confirmation, never an early one.
                if let Some(before_end) = before.end_lsn.as_mut() {
                    *before_end = (*before_end).max(end);
                }
            }
        }
    }

    fn idle_advance(&mut self, wal_end: Lsn) {
        if self.open.is_none() && self.txs.is_empty() && self.events.is_empty() {
            self.confirmed = self.confirmed.max(wal_end);
        }
    }

    fn status_deadline(&self) -> Option<Instant> {
        if self.confirmed > self.reported_flush
            && self.resolved_since_status >= self.cfg.max_in_flight_events
        {
            return Some(self.last_status_at);
        }
        let wait = if self.confirmed > self.reported_flush {
            self.cfg
                .progress_status_interval
                .clamp(MIN_STATUS_INTERVAL, self.cfg.status_interval)
        } else {
            self.cfg.status_interval
        };
        self.last_status_at.checked_add(wait)
    }

    fn poll_status(&mut self, now: Instant) {
        if !self.status_due
            && let Some(due) = self.status_deadline()
            && now >= due
        {
            self.schedule_status(now);
        }
    }

    fn schedule_status(&mut self, now: Instant) {
        self.status_due = true;
        self.last_status_at = self.last_status_at.max(now);
    }

    fn build_status(&mut self) -> StatusUpdate {
        self.resolved_since_status = 0;
        let flush = self.confirmed.max(self.reported_flush);
        self.reported_flush = flush;
        StatusUpdate {
            write: self.written.max(flush),
            flush,
            apply: flush,
            reply_requested: false,
        }
    }
}

/// `initial * 2^(failures-1)`, capped at `max`.
fn backoff((initial, max): (Duration, Duration), failures: u32) -> Duration {
    let shift = failures.saturating_sub(1).min(31);
    initial.saturating_mul(1_u32 << shift).min(max)
}

/// `now + delay`; if that is not representable, `now` (retry at once rather than never).
fn deadline(now: Instant, delay: Duration) -> Instant {
    now.checked_add(delay).unwrap_or(now)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{HashMap, HashSet};

    fn cfg() -> CoreConfig {
        CoreConfig {
            max_in_flight_events: 4,
            max_in_flight_bytes: 1_000,
            max_attempts: 3,
            status_interval: Duration::from_secs(10),
            progress_status_interval: Duration::from_secs(1),
            retry_backoff_initial: Duration::from_millis(100),
            retry_backoff_max: Duration::from_secs(1),
        }
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn core_at(confirmed: u64) -> (Core, Instant) {
        let now = Instant::now();
        (Core::new(cfg(), Lsn(confirmed), now), now)
    }

    fn drain(core: &mut Core) -> Vec<Action> {
        let mut out = Vec::new();
        while let Some(a) = core.next_action() {
            out.push(a);
        }
        core.check_invariants();
        out
    }

    /// Drained actions without status updates.
    fn work(core: &mut Core) -> Vec<Action> {
        drain(core)
            .into_iter()
            .filter(|a| !matches!(a, Action::SendStatus(_)))
            .collect()
    }

    fn statuses(actions: &[Action]) -> Vec<StatusUpdate> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::SendStatus(s) => Some(*s),
                _ => None,
            })
            .collect()
    }

    /// One committed transaction `[final, final + 10)` with `n` events, all acked or not.
    fn tx(core: &mut Core, final_lsn: u64, n: usize, now: Instant) -> Vec<EventId> {
        core.begin(Lsn(final_lsn), 7).unwrap();
        let ids = (0..n).map(|_| core.admit(10, now).unwrap()).collect();
        core.commit(Lsn(final_lsn), Lsn(final_lsn + 10), now)
            .unwrap();
        core.check_invariants();
        ids
    }

    impl Core {
        /// Structural invariants of the tracker; every test and the simulator call it.
        fn check_invariants(&self) {
            let pending: usize = self.txs.values().map(|t| t.pending).sum();
            assert_eq!(pending, self.events.len(), "pending counts vs events");
            let bytes: usize = self.events.values().map(|e| e.bytes).sum();
            assert_eq!(bytes, self.in_flight_bytes, "in-flight bytes");
            for (id, e) in &self.events {
                assert!(self.txs.contains_key(&e.tx), "{id} has no transaction");
                if let EventState::Backoff { until, .. } = e.state {
                    assert!(self.retries.contains(&(until, *id)), "{id} has no timer");
                }
            }
            for &(at, id) in &self.retries {
                let e = self.events.get(&id).expect("timer of a gone event");
                assert!(matches!(e.state, EventState::Backoff { until, .. } if until == at));
            }
            // Per-key holds: a key is blocked exactly by its failed events, and
            // exactly the held events of blocked keys wait in `held`, in order.
            let mut failed_per_key: HashMap<u64, u32> = HashMap::new();
            for e in self.events.values() {
                if e.failed
                    && let Some(k) = e.key
                {
                    *failed_per_key.entry(k).or_default() += 1;
                }
            }
            assert_eq!(failed_per_key, self.blocked_keys, "blocked keys");
            let held: usize = self.held.values().map(VecDeque::len).sum();
            let held_states = self
                .events
                .values()
                .filter(|e| e.state == EventState::Held)
                .count();
            assert_eq!(held, held_states, "held events");
            for (k, ids) in &self.held {
                assert!(self.blocked_keys.contains_key(k), "held under a free key");
                assert!(ids.iter().is_sorted(), "held out of admission order");
            }
            let open_seq = self.open.map(|o| o.seq);
            let last_seq = self.txs.keys().next_back().copied();
            if open_seq.is_some() {
                assert_eq!(open_seq, last_seq, "only the last entry may be open");
            }
            for (seq, t) in &self.txs {
                if Some(*seq) != open_seq {
                    assert!(t.end_lsn.is_some(), "closed entry without end");
                    assert!(t.pending > 0, "resolved entry left in the queue");
                }
            }
            assert!(
                self.txs.len() <= self.cfg.max_in_flight_events + 1,
                "tx queue"
            );
            assert!(self.events.len() <= self.cfg.max_in_flight_events, "window");
            assert!(
                self.reported_flush <= self.confirmed,
                "reported past confirmed"
            );
            if let Some((_, front)) = self.txs.first_key_value()
                && let Some(end) = front.end_lsn
            {
                assert!(self.confirmed < end || front.pending > 0);
            }
        }
    }

    #[test]
    fn in_order_acks_confirm_each_transaction_end() {
        let (mut core, now) = core_at(50);
        let t1 = tx(&mut core, 100, 2, now);
        let t2 = tx(&mut core, 200, 1, now);
        assert_eq!(
            work(&mut core),
            vec![
                Action::Produce {
                    id: t1[0],
                    attempt: 1
                },
                Action::Produce {
                    id: t1[1],
                    attempt: 1
                },
                Action::Produce {
                    id: t2[0],
                    attempt: 1
                },
            ]
        );
        core.delivered(t1[0], now);
        assert_eq!(core.confirmed(), Lsn(50), "half of tx 1 acked");
        core.delivered(t1[1], now);
        assert_eq!(core.confirmed(), Lsn(110));
        core.delivered(t2[0], now);
        assert_eq!(core.confirmed(), Lsn(210));
        assert!(core.is_idle());
        core.check_invariants();
    }

    #[test]
    fn out_of_order_acks_wait_for_the_oldest_transaction() {
        let (mut core, now) = core_at(50);
        let a = tx(&mut core, 100, 1, now)[0];
        let b = tx(&mut core, 200, 1, now)[0];
        let c = tx(&mut core, 300, 1, now)[0];
        core.delivered(c, now);
        core.delivered(b, now);
        assert_eq!(core.confirmed(), Lsn(50), "tx 1 still pending");
        assert_eq!(
            core.pending_transactions(),
            1,
            "resolved txs merged into tx 1"
        );
        core.check_invariants();
        core.delivered(a, now);
        assert_eq!(core.confirmed(), Lsn(310));
        assert!(core.is_idle());
    }

    #[test]
    fn acks_for_an_open_transaction_count_before_its_commit() {
        let (mut core, now) = core_at(50);
        core.begin(Lsn(1_000), 9).unwrap();
        let a = core.admit(10, now).unwrap();
        let b = core.admit(10, now).unwrap();
        let c = core.admit(10, now).unwrap();
        let d = core.admit(10, now).unwrap();
        assert!(!core.can_read(), "window of 4 is full mid-transaction");
        for id in [a, b, c, d] {
            core.delivered(id, now);
        }
        assert!(
            core.can_read(),
            "acks of the open transaction free the window"
        );
        assert_eq!(
            core.confirmed(),
            Lsn(50),
            "but nothing is confirmed before Commit"
        );
        core.keepalive(Lsn(999), false, now);
        assert_eq!(
            core.confirmed(),
            Lsn(50),
            "no idle advance inside a transaction"
        );
        let e = core.admit(10, now).unwrap();
        core.delivered(e, now);
        core.check_invariants();
        core.commit(Lsn(1_000), Lsn(1_010), now).unwrap();
        assert_eq!(core.confirmed(), Lsn(1_010));
        assert!(core.is_idle());
    }

    #[test]
    fn empty_transactions_resolve_at_commit_and_do_not_pile_up() {
        let (mut core, now) = core_at(50);
        tx(&mut core, 100, 0, now);
        assert_eq!(
            core.confirmed(),
            Lsn(110),
            "nothing before it: resolved at Commit"
        );
        let a = tx(&mut core, 200, 1, now)[0];
        for i in 0..1_000 {
            tx(&mut core, 300 + i * 20, 0, now);
        }
        assert_eq!(
            core.pending_transactions(),
            1,
            "empty txs folded into the pending one"
        );
        assert_eq!(core.confirmed(), Lsn(110));
        core.delivered(a, now);
        assert_eq!(core.confirmed(), Lsn(300 + 999 * 20 + 10));
    }

    #[test]
    fn acked_transactions_behind_a_stuck_one_keep_the_queue_bounded() {
        let (mut core, now) = core_at(50);
        let stuck = tx(&mut core, 100, 1, now)[0];
        core.delivery_failed(stuck, Failure::Transient, now);
        for i in 0..500 {
            let id = tx(&mut core, 200 + i * 20, 1, now)[0];
            core.delivered(id, now);
            assert!(core.pending_transactions() <= 2);
        }
        assert_eq!(core.confirmed(), Lsn(50));
        core.tick(now + ms(100));
        assert_eq!(
            work(&mut core),
            vec![Action::Produce {
                id: stuck,
                attempt: 2
            }]
        );
        core.delivered(stuck, now + ms(100));
        assert_eq!(core.confirmed(), Lsn(200 + 499 * 20 + 10));
    }

    #[test]
    fn permanent_failures_poison_after_max_attempts_and_only_the_insert_commit_resolves() {
        let (mut core, now) = core_at(50);
        let a = tx(&mut core, 100, 1, now)[0];
        assert_eq!(work(&mut core), vec![Action::Produce { id: a, attempt: 1 }]);
        core.delivery_failed(a, Failure::Permanent, now);
        assert_eq!(work(&mut core), vec![Action::Produce { id: a, attempt: 2 }]);
        core.delivery_failed(a, Failure::Permanent, now);
        assert_eq!(work(&mut core), vec![Action::Produce { id: a, attempt: 3 }]);
        core.delivery_failed(a, Failure::Permanent, now);
        assert_eq!(
            work(&mut core),
            vec![Action::InsertPoison { id: a, attempts: 3 }]
        );
        assert_eq!(
            core.confirmed(),
            Lsn(50),
            "InsertPoison emitted is not resolved"
        );
        assert_eq!(core.in_flight_events(), 1);
        core.delivered(a, now);
        core.delivery_failed(a, Failure::Permanent, now);
        assert_eq!(
            core.confirmed(),
            Lsn(50),
            "stale broker reports do not resolve it"
        );
        assert!(work(&mut core).is_empty());
        core.poison_committed(a, now);
        assert_eq!(core.confirmed(), Lsn(110));
        assert_eq!(core.in_flight_events(), 0);
    }

    #[test]
    fn unmappable_rows_go_straight_to_poison() {
        let (mut core, now) = core_at(50);
        core.begin(Lsn(100), 1).unwrap();
        let a = core.admit_unmappable(30).unwrap();
        core.commit(Lsn(100), Lsn(110), now).unwrap();
        assert_eq!(
            work(&mut core),
            vec![Action::InsertPoison { id: a, attempts: 1 }]
        );
        assert_eq!((core.in_flight_events(), core.in_flight_bytes()), (1, 30));
        core.delivered(a, now);
        assert_eq!(core.confirmed(), Lsn(50));
        core.poison_committed(a, now);
        assert_eq!(core.confirmed(), Lsn(110));
    }

    #[test]
    fn transient_failures_back_off_exponentially_and_never_poison() {
        let mut c = cfg();
        c.max_attempts = 2;
        c.status_interval = Duration::from_secs(3_600);
        let mut now = Instant::now();
        let mut core = Core::new(c, Lsn(50), now);
        let a = tx(&mut core, 100, 1, now)[0];
        assert_eq!(work(&mut core).len(), 1);
        core.delivery_failed(a, Failure::Permanent, now);
        assert_eq!(work(&mut core), vec![Action::Produce { id: a, attempt: 2 }]);
        let expected = [100, 200, 400, 800, 1_000, 1_000, 1_000, 1_000];
        for (n, delay) in expected.into_iter().enumerate() {
            core.delivery_failed(a, Failure::Transient, now);
            assert!(work(&mut core).is_empty(), "no immediate retry");
            assert_eq!(core.next_deadline(), Some(now + ms(delay)));
            core.tick(now + ms(delay - 1));
            assert!(work(&mut core).is_empty(), "not before the deadline");
            now += ms(delay);
            core.tick(now);
            let attempt = 3 + u32::try_from(n).unwrap();
            assert_eq!(work(&mut core), vec![Action::Produce { id: a, attempt }]);
        }
        assert_eq!(core.confirmed(), Lsn(50), "still pending, never poisoned");
        core.delivery_failed(a, Failure::Permanent, now);
        assert_eq!(
            work(&mut core),
            vec![Action::InsertPoison {
                id: a,
                attempts: 10
            }],
            "the second permanent failure poisons; transient ones did not count"
        );
    }

    #[test]
    fn a_failed_poison_insert_is_requested_again_after_backoff() {
        let (mut core, now) = core_at(50);
        core.begin(Lsn(100), 1).unwrap();
        let a = core.admit_unmappable(30).unwrap();
        core.commit(Lsn(100), Lsn(110), now).unwrap();
        assert_eq!(work(&mut core).len(), 1);
        core.poison_insert_failed(a, now);
        core.poison_committed(a, now);
        assert_eq!(core.confirmed(), Lsn(50), "not outstanding: ignored");
        core.tick(now + ms(100));
        assert_eq!(
            work(&mut core),
            vec![Action::InsertPoison { id: a, attempts: 1 }]
        );
        core.poison_committed(a, now + ms(100));
        assert_eq!(core.confirmed(), Lsn(110));
    }

    #[test]
    fn idle_advance_from_keepalive_and_xlogdata() {
        let (mut core, now) = core_at(50);
        core.keepalive(Lsn(500), false, now);
        assert_eq!(core.confirmed(), Lsn(500));
        core.received(Lsn(600));
        assert_eq!(core.confirmed(), Lsn(600));
        core.keepalive(Lsn(400), false, now);
        assert_eq!(core.confirmed(), Lsn(600), "never backwards");
        core.keepalive(Lsn(700), true, now);
        let s = statuses(&drain(&mut core));
        assert_eq!(s.len(), 1);
        assert_eq!((s[0].flush, s[0].write), (Lsn(700), Lsn(700)));
        let a = tx(&mut core, 800, 1, now)[0];
        core.delivered(a, now);
        core.keepalive(Lsn(900), false, now);
        assert_eq!(
            core.confirmed(),
            Lsn(900),
            "idle again once everything resolved"
        );
    }

    #[test]
    fn no_idle_advance_while_a_transaction_is_open_or_an_event_is_pending() {
        let (mut core, now) = core_at(50);
        core.begin(Lsn(1_000), 1).unwrap();
        core.keepalive(Lsn(900), false, now);
        assert_eq!(core.confirmed(), Lsn(50), "empty open transaction");
        let a = core.admit(10, now).unwrap();
        // The XLogData carrying this Commit has wal_end = end_lsn, fed before commit().
        core.received(Lsn(1_010));
        assert_eq!(core.confirmed(), Lsn(50), "open transaction");
        core.commit(Lsn(1_000), Lsn(1_010), now).unwrap();
        core.keepalive(Lsn(2_000), false, now);
        core.received(Lsn(2_100));
        assert_eq!(core.confirmed(), Lsn(50), "pending event");
        core.delivered(a, now);
        assert_eq!(core.confirmed(), Lsn(1_010));
        core.keepalive(Lsn(2_000), false, now);
        assert_eq!(core.confirmed(), Lsn(2_000));
        assert_eq!(core.written(), Lsn(2_100));
    }

    #[test]
    fn reply_requested_gets_a_status_even_when_the_window_is_full() {
        let mut c = cfg();
        c.max_in_flight_events = 1;
        let mut now = Instant::now();
        let mut core = Core::new(c, Lsn(50), now);
        core.begin(Lsn(100), 1).unwrap();
        let a = core.admit(10, now).unwrap();
        assert!(!core.can_read());
        core.keepalive(Lsn(120), true, now);
        let actions = drain(&mut core);
        assert!(
            matches!(actions[0], Action::SendStatus(s) if s.flush == Lsn(50) && s.write == Lsn(120)),
            "status first: {actions:?}"
        );
        assert_eq!(actions[1], Action::Produce { id: a, attempt: 1 });
        // The interval timer fires while the reader stays paused.
        now += Duration::from_secs(10);
        assert_eq!(core.next_deadline(), Some(now));
        core.tick(now);
        assert!(!core.can_read());
        assert_eq!(statuses(&drain(&mut core)).len(), 1);
    }

    #[test]
    fn a_window_of_resolved_events_forces_a_status_at_once() {
        // cfg(): window 4, progress interval 1 s. Four single-event transactions
        // acked within a millisecond: the fourth forces a status without waiting,
        // so the server never trails the acks by more than a window.
        let (mut core, t0) = core_at(50);
        let mut sent = Vec::new();
        for i in 0..4_u64 {
            let now = t0 + Duration::from_micros(i + 1);
            let id = tx(&mut core, 100 + i * 20, 1, now)[0];
            core.delivered(id, now);
            if core.next_deadline().is_some_and(|d| d <= now) {
                core.tick(now);
            }
            sent.extend(statuses(&drain(&mut core)));
        }
        assert_eq!(sent.len(), 1, "{sent:?}");
        assert_eq!(sent[0].flush, core.confirmed());
    }

    #[test]
    fn status_interval_and_progress_statuses_are_rate_limited() {
        let t0 = Instant::now();
        // A window larger than the run, so only the time rule applies.
        let c = CoreConfig {
            max_in_flight_events: 100_000,
            ..cfg()
        };
        let mut core = Core::new(c, Lsn(50), t0);
        core.tick(t0 + ms(9_999));
        assert!(drain(&mut core).is_empty(), "nothing before the interval");
        core.tick(t0 + ms(10_000));
        assert_eq!(statuses(&drain(&mut core)).len(), 1);
        let start = t0 + ms(10_000);
        // 1,500 transactions confirmed one per millisecond: one status per
        // interval/10 (1 s), never one per event.
        let mut sent = Vec::new();
        for i in 0..1_500_u64 {
            let now = start + ms(i + 1);
            let id = tx(&mut core, 100 + i * 20, 1, now)[0];
            core.delivered(id, now);
            if core.next_deadline().is_some_and(|d| d <= now) {
                core.tick(now);
            }
            sent.extend(statuses(&drain(&mut core)));
        }
        assert_eq!(sent.len(), 1, "one progress status at +1 s: {sent:?}");
        assert!(sent[0].flush > Lsn(50));
        // The remaining progress is reported interval/10 after that one.
        let last = start + ms(1_000);
        assert_eq!(core.next_deadline(), Some(last + ms(1_000)));
        core.tick(last + ms(1_000));
        let s = statuses(&drain(&mut core));
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].flush, core.confirmed());
        assert_eq!(core.confirmed(), Lsn(100 + 1_499 * 20 + 10));
        // Nothing new: back to the full interval.
        assert_eq!(core.next_deadline(), Some(last + ms(11_000)));
    }

    #[test]
    fn status_flush_is_monotonic_and_write_never_below_flush() {
        let (mut core, now) = core_at(500);
        let first = core.shutdown_status();
        assert_eq!(
            first,
            StatusUpdate {
                write: Lsn(500),
                flush: Lsn(500),
                apply: Lsn(500),
                reply_requested: false
            }
        );
        core.keepalive(Lsn(900), true, now);
        let s = statuses(&drain(&mut core))[0];
        assert_eq!((s.write, s.flush, s.apply), (Lsn(900), Lsn(900), Lsn(900)));
        // A reconnect whose slot is behind (its position was not yet persisted) does not
        // make the statuses go back: what this process confirmed stays confirmed.
        let mut core = core.restart(Lsn(600), now);
        assert_eq!(core.confirmed(), Lsn(900));
        let again = core.shutdown_status();
        assert!(again.flush >= s.flush && again.write >= again.flush);
    }

    #[test]
    fn window_counts_events_and_bytes() {
        let mut c = cfg();
        c.max_in_flight_events = 3;
        c.max_in_flight_bytes = 100;
        let now = Instant::now();
        let mut core = Core::new(c, Lsn(50), now);
        core.begin(Lsn(100), 1).unwrap();
        let a = core.admit(50, now).unwrap();
        assert!(core.can_read());
        core.admit(50, now).unwrap();
        assert!(!core.can_read(), "bytes full");
        assert_eq!(
            core.admit(1, now),
            Err(ProtocolError::WindowFull {
                events: 2,
                bytes: 100
            })
        );
        assert_eq!(
            core.admit_unmappable(1).map(|_| ()),
            core.admit(1, now).map(|_| ())
        );
        core.delivered(a, now);
        assert!(core.can_read());
        core.admit(1, now).unwrap();
        assert!(core.can_read());
        core.admit_unmappable(1).unwrap();
        assert!(!core.can_read(), "events full");
        assert_eq!((core.in_flight_events(), core.in_flight_bytes()), (3, 52));
        core.check_invariants();
    }

    #[test]
    fn an_event_larger_than_the_byte_window_is_admitted_into_an_empty_window() {
        let (mut core, now) = core_at(50);
        core.begin(Lsn(100), 1).unwrap();
        let big = core.admit(1_000_000, now).unwrap();
        assert!(!core.can_read());
        core.delivered(big, now);
        assert!(core.can_read());
        core.commit(Lsn(100), Lsn(110), now).unwrap();
        assert_eq!(core.confirmed(), Lsn(110));
    }

    #[test]
    fn protocol_errors_are_typed_and_leave_the_state_usable() {
        let (mut core, now) = core_at(50);
        assert_eq!(
            core.commit(Lsn(100), Lsn(110), now),
            Err(ProtocolError::CommitWithoutBegin {
                commit_lsn: Lsn(100),
                end_lsn: Lsn(110)
            })
        );
        assert_eq!(
            core.admit(1, now),
            Err(ProtocolError::ChangeOutsideTransaction)
        );
        assert_eq!(
            core.admit_unmappable(1),
            Err(ProtocolError::ChangeOutsideTransaction)
        );
        core.begin(Lsn(100), 1).unwrap();
        assert_eq!(
            core.begin(Lsn(200), 2),
            Err(ProtocolError::BeginInsideTransaction {
                open_xid: 1,
                open_final_lsn: Lsn(100),
                xid: 2,
                final_lsn: Lsn(200)
            })
        );
        let a = core.admit(1, now).unwrap();
        assert_eq!(
            core.commit(Lsn(101), Lsn(110), now),
            Err(ProtocolError::CommitLsnMismatch {
                xid: 1,
                final_lsn: Lsn(100),
                commit_lsn: Lsn(101)
            })
        );
        assert_eq!(
            core.commit(Lsn(100), Lsn(100), now),
            Err(ProtocolError::CommitEndNotAfterCommit {
                xid: 1,
                commit_lsn: Lsn(100),
                end_lsn: Lsn(100)
            })
        );
        core.check_invariants();
        core.commit(Lsn(100), Lsn(110), now).unwrap();
        assert_eq!(
            core.begin(Lsn(105), 3),
            Err(ProtocolError::CommitLsnWentBackwards {
                xid: 3,
                final_lsn: Lsn(105),
                previous_end: Lsn(110)
            })
        );
        assert!(!core.in_transaction());
        core.delivered(a, now);
        assert_eq!(core.confirmed(), Lsn(110));
        // Messages are readable.
        let msg = ProtocolError::CommitLsnMismatch {
            xid: 1,
            final_lsn: Lsn(0x16_B374_D848),
            commit_lsn: Lsn(1),
        }
        .to_string();
        assert!(msg.contains("16/B374D848"), "{msg}");
    }

    #[test]
    fn unknown_and_duplicate_reports_are_ignored() {
        let (mut core, now) = core_at(50);
        let ids = tx(&mut core, 100, 2, now);
        let (a, b) = (ids[0], ids[1]);
        core.delivered(a, now);
        // A duplicate ack for `a` must not resolve `b`'s slot in the count.
        core.delivered(a, now);
        core.delivery_failed(a, Failure::Permanent, now);
        core.poison_committed(a, now);
        core.poison_insert_failed(a, now);
        for bogus in [EventId::from_raw(0), EventId::from_raw(u64::MAX)] {
            core.delivered(bogus, now);
            core.delivery_failed(bogus, Failure::Transient, now);
            core.poison_committed(bogus, now);
        }
        assert_eq!(core.confirmed(), Lsn(50));
        assert_eq!(core.in_flight_events(), 1);
        // `b` waits for a retry: a report now matches no outstanding produce.
        core.delivery_failed(b, Failure::Transient, now);
        core.delivered(b, now);
        core.delivery_failed(b, Failure::Transient, now);
        assert_eq!(core.confirmed(), Lsn(50));
        core.check_invariants();
        core.tick(now + ms(100));
        assert_eq!(
            work(&mut core),
            vec![Action::Produce { id: b, attempt: 2 }],
            "requests made stale by later reports are skipped"
        );
        core.delivered(b, now + ms(100));
        assert_eq!(core.confirmed(), Lsn(110));
    }

    #[test]
    fn restart_continues_event_ids_so_late_reports_are_ignored() {
        let (mut core, now) = core_at(50);
        let done = tx(&mut core, 100, 1, now)[0];
        core.delivered(done, now);
        core.begin(Lsn(200), 2).unwrap();
        let old = core.admit(10, now).unwrap();
        let mut core = core.restart(Lsn(50), now);
        assert_eq!(
            core.confirmed(),
            Lsn(110),
            "what was confirmed stays confirmed"
        );
        assert!(core.is_idle());
        core.begin(Lsn(200), 2).unwrap();
        let new = core.admit(10, now).unwrap();
        assert!(new > old);
        core.commit(Lsn(200), Lsn(210), now).unwrap();
        core.delivered(old, now);
        assert_eq!(
            core.confirmed(),
            Lsn(110),
            "the old core's ack is not the new event's"
        );
        core.delivered(new, now);
        assert_eq!(core.confirmed(), Lsn(210));
    }

    #[test]
    fn next_deadline_is_the_earliest_timer() {
        let (mut core, t0) = core_at(50);
        assert_eq!(core.next_deadline(), Some(t0 + Duration::from_secs(10)));
        let a = tx(&mut core, 100, 1, t0)[0];
        core.delivery_failed(a, Failure::Transient, t0 + ms(5));
        assert_eq!(core.next_deadline(), Some(t0 + ms(105)));
        core.tick(t0 + ms(105));
        assert_eq!(core.next_deadline(), Some(t0 + Duration::from_secs(10)));
        core.keepalive(Lsn(60), true, t0 + ms(200));
        assert_eq!(core.next_deadline(), None, "a status is due: drain first");
        drain(&mut core);
        assert_eq!(core.next_deadline(), Some(t0 + ms(10_200)));
    }

    #[test]
    fn degenerate_config_is_normalised_without_deadlock() {
        let now = Instant::now();
        let zero = CoreConfig {
            max_in_flight_events: 0,
            max_in_flight_bytes: 0,
            max_attempts: 0,
            status_interval: Duration::ZERO,
            progress_status_interval: Duration::ZERO,
            retry_backoff_initial: Duration::MAX,
            retry_backoff_max: Duration::MAX,
        };
        let mut core = Core::new(zero, Lsn(50), now);
        assert!(core.can_read());
        assert!(core.next_deadline().is_some_and(|d| d > now));
        core.begin(Lsn(100), 1).unwrap();
        let a = core.admit(5, now).unwrap();
        assert!(!core.can_read());
        core.delivery_failed(a, Failure::Transient, now);
        assert_eq!(
            core.next_deadline(),
            Some(now + ms(1)),
            "status timer first"
        );
        core.delivery_failed(a, Failure::Permanent, now);
        core.tick(now + MAX_TIMER);
        let w = work(&mut core);
        assert_eq!(w, vec![Action::Produce { id: a, attempt: 2 }]);
        core.delivery_failed(a, Failure::Permanent, now);
        assert_eq!(
            work(&mut core),
            vec![Action::InsertPoison { id: a, attempts: 2 }]
        );
        assert_eq!(
            Core::new(CoreConfig::default(), Lsn(1), now)
                .config()
                .max_attempts,
            5
        );
    }

    // ---------------------------------------------------------------------------------
    // Seeded deterministic simulator.
    // ---------------------------------------------------------------------------------

    /// splitmix64: tiny, good enough, no dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn below(&mut self, n: u64) -> u64 {
            if n == 0 { 0 } else { self.next() % n }
        }
        fn index(&mut self, len: usize) -> usize {
            usize::try_from(self.below(len as u64)).unwrap()
        }
        fn percent(&mut self, p: u64) -> bool {
            self.below(100) < p
        }
    }

    #[derive(Debug, Clone)]
    struct SimTx {
        xid: u32,
        first_lsn: Lsn,
        final_lsn: Lsn,
        end_lsn: Lsn,
        events: Vec<SimEvent>,
    }

    #[derive(Debug, Clone, Copy)]
    struct SimEvent {
        lsn: Lsn,
        bytes: usize,
        unmappable: bool,
        /// The record key (a few hot entities, so keys repeat within the window).
        key: u64,
    }

    /// A walsender: sends every transaction whose commit starts at or after the slot's
    /// confirmed LSN, in commit order, with keepalives whose `wal_end` never passes a
    /// commit it has not sent yet.
    struct Server {
        next_tx: usize,
        next_msg: usize,
        sent_end: Lsn,
        last_keepalive: Lsn,
    }

    enum Msg {
        Begin(usize),
        Row(usize, usize),
        Commit(usize),
        Keepalive(Lsn, bool),
    }

    impl Server {
        fn connect(wal: &[SimTx], from: Lsn) -> Self {
            Self {
                next_tx: wal.partition_point(|t| t.final_lsn < from),
                next_msg: 0,
                sent_end: from,
                last_keepalive: from,
            }
        }

        fn done(&self, wal: &[SimTx]) -> bool {
            self.next_tx >= wal.len()
        }

        fn next(&mut self, wal: &[SimTx], rng: &mut Rng) -> Msg {
            if self.done(wal) || rng.percent(12) {
                let ceil = match wal.get(self.next_tx) {
                    Some(t) => t.final_lsn,
                    None => Lsn(wal.last().map_or(0, |t| t.end_lsn.0) + 4_096),
                };
                let floor = self.sent_end.max(self.last_keepalive);
                let wal_end = Lsn(floor.0 + rng.below(ceil.0 - floor.0 + 1));
                self.last_keepalive = wal_end;
                return Msg::Keepalive(wal_end, rng.percent(20));
            }
            let i = self.next_tx;
            let k = self.next_msg;
            self.next_msg += 1;
            if k == 0 {
                Msg::Begin(i)
            } else if k <= wal[i].events.len() {
                Msg::Row(i, k - 1)
            } else {
                self.sent_end = self.sent_end.max(wal[i].end_lsn);
                self.next_tx += 1;
                self.next_msg = 0;
                Msg::Commit(i)
            }
        }
    }

    #[derive(Debug, Default)]
    struct Stats {
        crashes: u64,
        reconnects: u64,
        slot_reverts: u64,
        duplicates: u64,
        poisoned_after_retries: u64,
        transient_retries: u64,
        window_full: u64,
        idle_advances: u64,
        statuses: u64,
        big_transactions: u64,
        /// Events admitted while an earlier event of their key was being retried.
        held: u64,
    }

    struct Sim {
        seed: u64,
        rng: Rng,
        cfg: CoreConfig,
        wal: Vec<SimTx>,
        now: Instant,
        core: Core,
        server: Server,
        // The shell.
        ids: HashMap<EventId, (usize, usize)>,
        broker: Vec<EventId>,
        poison_db: Vec<EventId>,
        done_ids: Vec<EventId>,
        permanent: HashMap<EventId, u32>,
        transient_at: HashMap<EventId, Instant>,
        // PostgreSQL's view.
        slot_confirmed: Lsn,
        slot_persisted: Lsn,
        restart_from: Lsn,
        // Ground truth and checks.
        resolved: Vec<Vec<bool>>,
        unresolved: Vec<usize>,
        first_unresolved: usize,
        produced_ever: Vec<Vec<bool>>,
        /// Per key, the last event first-produced ever / by the current core.
        last_first_ever: HashMap<u64, (usize, usize)>,
        produced_this_core: HashSet<(usize, usize)>,
        last_first_this_core: HashMap<u64, (usize, usize)>,
        /// Events of the current core whose delivery failed and that are unresolved.
        failed_now: BTreeSet<(usize, usize)>,
        last_sent_flush: Lsn,
        last_status_at: Instant,
        prev_confirmed: Lsn,
        last_commit_fed: Option<Lsn>,
        stats: Stats,
    }

    impl Sim {
        fn new(seed: u64) -> Self {
            let mut rng = Rng(seed);
            let initial = 1_u64 << 32 | rng.below(1_000);
            let backoff_initial = ms(1 + rng.below(50));
            let status_interval = ms(50 + rng.below(1_000));
            let cfg = CoreConfig {
                max_in_flight_events: 1 + rng.index(24),
                max_in_flight_bytes: 64 + rng.index(4_000),
                max_attempts: 1 + u32::try_from(rng.below(4)).unwrap(),
                status_interval,
                progress_status_interval: status_interval / 10,
                retry_backoff_initial: backoff_initial,
                retry_backoff_max: backoff_initial * (1 + u32::try_from(rng.below(8)).unwrap()),
            };
            let mut wal = Vec::new();
            let mut cursor = initial;
            for i in 0..3 + rng.below(8) {
                let final_lsn = cursor + rng.below(200);
                let end_lsn = final_lsn + 1 + rng.below(100);
                let first_lsn = final_lsn.saturating_sub(rng.below(3_000)).max(1);
                let n = if rng.percent(25) {
                    rng.below(50)
                } else {
                    rng.below(6)
                };
                let mut lsns: Vec<u64> = (0..n)
                    .map(|_| first_lsn + rng.below(final_lsn - first_lsn + 1))
                    .collect();
                lsns.sort_unstable();
                let events = lsns
                    .into_iter()
                    .map(|lsn| SimEvent {
                        lsn: Lsn(lsn),
                        bytes: if rng.percent(3) {
                            5_000
                        } else {
                            1 + rng.index(400)
                        },
                        unmappable: rng.percent(4),
                        key: rng.below(4),
                    })
                    .collect();
                wal.push(SimTx {
                    xid: 1_000 + u32::try_from(i).unwrap(),
                    first_lsn: Lsn(first_lsn),
                    final_lsn: Lsn(final_lsn),
                    end_lsn: Lsn(end_lsn),
                    events,
                });
                cursor = end_lsn;
            }
            let now = Instant::now();
            let slot = Lsn(initial);
            let stats = Stats {
                big_transactions: wal
                    .iter()
                    .filter(|t| t.events.len() > cfg.max_in_flight_events)
                    .count() as u64,
                ..Stats::default()
            };
            Self {
                seed,
                rng,
                core: Core::new(cfg.clone(), slot, now),
                server: Server::connect(&wal, slot),
                ids: HashMap::new(),
                broker: Vec::new(),
                poison_db: Vec::new(),
                done_ids: Vec::new(),
                permanent: HashMap::new(),
                transient_at: HashMap::new(),
                slot_confirmed: slot,
                slot_persisted: slot,
                restart_from: slot,
                resolved: wal.iter().map(|t| vec![false; t.events.len()]).collect(),
                unresolved: wal.iter().map(|t| t.events.len()).collect(),
                first_unresolved: 0,
                produced_ever: wal.iter().map(|t| vec![false; t.events.len()]).collect(),
                last_first_ever: HashMap::new(),
                produced_this_core: HashSet::new(),
                last_first_this_core: HashMap::new(),
                failed_now: BTreeSet::new(),
                last_sent_flush: slot,
                last_status_at: now,
                prev_confirmed: slot,
                last_commit_fed: None,
                stats,
                cfg: cfg.normalized(),
                wal,
                now,
            }
        }

        fn fail(&self, what: &str) -> ! {
            panic!("simulation seed {}: {what}", self.seed)
        }

        fn mark_resolved(&mut self, id: EventId) {
            let Some(&(i, k)) = self.ids.get(&id) else {
                self.fail(&format!("report for {id} the shell never saw"))
            };
            if !self.resolved[i][k] {
                self.resolved[i][k] = true;
                self.unresolved[i] -= 1;
            }
            while self.unresolved.get(self.first_unresolved) == Some(&0) {
                self.first_unresolved += 1;
            }
        }

        /// The earliest LSN that must still be re-sent: a commit with an unresolved event.
        fn must_resend_from(&self) -> Option<Lsn> {
            let mut i = self.first_unresolved;
            while self.unresolved.get(i) == Some(&0) {
                i += 1;
            }
            self.wal.get(i).map(|t| t.final_lsn)
        }

        fn step(&mut self, draining: bool) {
            self.now += ms(self.rng.below(40));
            // The shell's timer branch.
            if self.core.next_deadline().is_some_and(|d| self.now >= d) {
                self.core.tick(self.now);
            }
            self.drain_actions();
            if self.core.next_deadline().is_none_or(|d| d <= self.now) {
                self.fail("a due timer was not consumed by tick()");
            }
            if self.now.duration_since(self.last_status_at) >= self.cfg.status_interval {
                self.fail("no status update for a whole status_interval");
            }
            let roll = self.rng.below(1_000);
            match roll {
                0..400 => self.read(),
                400..750 => self.broker_step(draining),
                750..870 => self.poison_step(draining),
                870..900 => self.stale_report(),
                900..903 if !draining => self.crash(false),
                903..906 if !draining => self.reconnect(),
                906..908 if !draining => self.crash(true),
                908..920 => self.slot_persisted = self.slot_confirmed,
                _ => self.read(),
            }
            self.drain_actions();
            self.check();
        }

        fn read(&mut self) {
            if !self.core.can_read() {
                self.stats.window_full += 1;
                return;
            }
            let before = self.core.confirmed();
            let msg = self.server.next(&self.wal, &mut self.rng);
            let zero_wal_end = self.rng.percent(10);
            let wal_end = |lsn: Lsn| if zero_wal_end { Lsn::ZERO } else { lsn };
            let now = self.now;
            let result = match msg {
                Msg::Keepalive(lsn, reply) => {
                    self.core.keepalive(lsn, reply, now);
                    if reply && !matches!(self.core.next_action(), Some(Action::SendStatus(_))) {
                        // Re-check with the status the core produced (it was consumed).
                        self.fail("reply_requested did not produce a status first");
                    }
                    if reply {
                        self.last_status_at = now;
                        self.last_sent_flush = self.last_sent_flush.max(self.core.confirmed());
                        self.slot_confirmed = self.slot_confirmed.max(self.core.confirmed());
                        self.stats.statuses += 1;
                    }
                    if self.core.confirmed() > before {
                        self.stats.idle_advances += 1;
                    }
                    Ok(())
                }
                Msg::Begin(i) => {
                    let t = &self.wal[i];
                    self.core.received(wal_end(t.first_lsn));
                    self.core.begin(t.final_lsn, t.xid)
                }
                Msg::Row(i, k) => {
                    let e = self.wal[i].events[k];
                    self.core.received(wal_end(e.lsn));
                    let id = if e.unmappable {
                        self.core.admit_unmappable(e.bytes)
                    } else {
                        self.core.admit_keyed(e.bytes, Some(e.key), now)
                    };
                    id.map(|id| {
                        if self.ids.insert(id, (i, k)).is_some() {
                            self.fail(&format!("{id} issued twice"));
                        }
                        if self
                            .core
                            .events
                            .get(&id)
                            .is_some_and(|e| e.state == EventState::Held)
                        {
                            self.stats.held += 1;
                        }
                    })
                }
                Msg::Commit(i) => {
                    let t = &self.wal[i];
                    let (final_lsn, end_lsn) = (t.final_lsn, t.end_lsn);
                    self.core.received(wal_end(end_lsn));
                    self.last_commit_fed = Some(end_lsn);
                    self.core.commit(final_lsn, end_lsn, now)
                }
            };
            if let Err(e) = result {
                self.fail(&format!("protocol error on a valid stream: {e}"));
            }
        }

        fn drain_actions(&mut self) {
            while let Some(action) = self.core.next_action() {
                match action {
                    Action::Produce { id, attempt } => self.on_produce(id, attempt),
                    Action::InsertPoison { id, attempts } => {
                        let Some(&(i, k)) = self.ids.get(&id) else {
                            self.fail("poison of an unknown id")
                        };
                        if !self.wal[i].events[k].unmappable {
                            let p = self.permanent.get(&id).copied().unwrap_or(0);
                            if p < self.cfg.max_attempts || attempts < self.cfg.max_attempts {
                                self.fail(&format!("{id} poisoned after {p} permanent failures"));
                            }
                            self.stats.poisoned_after_retries += 1;
                        }
                        self.poison_db.push(id);
                    }
                    Action::SendStatus(s) => self.on_status(s),
                }
            }
        }

        fn on_produce(&mut self, id: EventId, attempt: u32) {
            let Some(&(i, k)) = self.ids.get(&id) else {
                self.fail("produce of an unknown id")
            };
            if self.wal[i].events[k].unmappable {
                self.fail("an unmappable row was produced");
            }
            if attempt == 1 {
                let key = self.wal[i].events[k].key;
                if !self.produced_this_core.insert((i, k)) {
                    self.fail("an event was first-produced twice by one core");
                }
                if self
                    .last_first_this_core
                    .get(&key)
                    .is_some_and(|&p| p >= (i, k))
                {
                    self.fail("first produces of a key out of commit order");
                }
                self.last_first_this_core.insert(key, (i, k));
                if self
                    .failed_now
                    .range(..(i, k))
                    .any(|&(fi, fk)| self.wal[fi].events[fk].key == key)
                {
                    self.fail("produced while an earlier event of its key was being retried");
                }
                if self.produced_ever[i][k] {
                    self.stats.duplicates += 1;
                    if self.wal[i].final_lsn < self.restart_from {
                        self.fail("duplicate from a transaction confirmed before the restart");
                    }
                } else {
                    if self.last_first_ever.get(&key).is_some_and(|&p| p >= (i, k)) {
                        self.fail("events of a key first produced out of commit order");
                    }
                    self.last_first_ever.insert(key, (i, k));
                    self.produced_ever[i][k] = true;
                }
            } else if let Some(at) = self.transient_at.remove(&id) {
                self.stats.transient_retries += 1;
                if self.now < at + self.cfg.retry_backoff_initial {
                    self.fail("transient retry before its backoff");
                }
            }
            self.broker.push(id);
        }

        fn on_status(&mut self, s: StatusUpdate) {
            self.stats.statuses += 1;
            if s.flush < self.last_sent_flush {
                self.fail("status flush went backwards");
            }
            if s.write < s.flush || s.apply != s.flush || s.reply_requested {
                self.fail(&format!("malformed status {s:?}"));
            }
            if self.must_resend_from().is_some_and(|lsn| s.flush > lsn) {
                self.fail("status confirms past an unresolved event");
            }
            self.last_sent_flush = s.flush;
            self.slot_confirmed = self.slot_confirmed.max(s.flush);
            self.last_status_at = self.now;
        }

        fn broker_step(&mut self, draining: bool) {
            if self.broker.is_empty() {
                return;
            }
            let id = self.broker.swap_remove(self.rng.index(self.broker.len()));
            let roll = if draining { 0 } else { self.rng.below(100) };
            let now = self.now;
            // Reports for the current core's produces (not an old session's).
            let current = self
                .core
                .events
                .get(&id)
                .is_some_and(|e| matches!(e.state, EventState::Producing { .. }));
            let event = self.ids.get(&id).copied();
            match roll {
                0..80 => {
                    self.mark_resolved(id);
                    self.core.delivered(id, now);
                    self.done_ids.push(id);
                    if let (true, Some(ik)) = (current, event) {
                        self.failed_now.remove(&ik);
                    }
                }
                80..87 => {
                    *self.permanent.entry(id).or_default() += 1;
                    self.core.delivery_failed(id, Failure::Permanent, now);
                    if let (true, Some(ik)) = (current, event) {
                        self.failed_now.insert(ik);
                    }
                }
                _ => {
                    self.transient_at.insert(id, now);
                    self.core.delivery_failed(id, Failure::Transient, now);
                    if let (true, Some(ik)) = (current, event) {
                        self.failed_now.insert(ik);
                    }
                }
            }
        }

        fn poison_step(&mut self, draining: bool) {
            if self.poison_db.is_empty() {
                return;
            }
            let id = self
                .poison_db
                .swap_remove(self.rng.index(self.poison_db.len()));
            if draining || self.rng.percent(85) {
                let current = self
                    .core
                    .events
                    .get(&id)
                    .is_some_and(|e| e.state == EventState::Poisoning);
                if let (true, Some(&ik)) = (current, self.ids.get(&id)) {
                    self.failed_now.remove(&ik);
                }
                self.mark_resolved(id);
                self.core.poison_committed(id, self.now);
                self.done_ids.push(id);
            } else {
                self.core.poison_insert_failed(id, self.now);
            }
        }

        /// Duplicate or unknown reports: the core must not change.
        fn stale_report(&mut self) {
            let id = if !self.done_ids.is_empty() && self.rng.percent(80) {
                self.done_ids[self.rng.index(self.done_ids.len())]
            } else {
                EventId::from_raw(u64::MAX - self.rng.below(4))
            };
            let before = (
                self.core.confirmed(),
                self.core.in_flight_events(),
                self.core.in_flight_bytes(),
                self.core.pending_transactions(),
                self.core.actions.len(),
            );
            let now = self.now;
            match self.rng.below(5) {
                0 => self.core.delivered(id, now),
                1 => self.core.delivery_failed(id, Failure::Permanent, now),
                2 => self.core.delivery_failed(id, Failure::Transient, now),
                3 => self.core.poison_committed(id, now),
                _ => self.core.poison_insert_failed(id, now),
            }
            let after = (
                self.core.confirmed(),
                self.core.in_flight_events(),
                self.core.in_flight_bytes(),
                self.core.pending_transactions(),
                self.core.actions.len(),
            );
            if before != after {
                self.fail(&format!("a stale report for {id} changed the core"));
            }
        }

        /// PostgreSQL may lose the slot position it had not checkpointed.
        fn maybe_revert_slot(&mut self) {
            if self.rng.percent(30) {
                self.stats.slot_reverts += 1;
                self.slot_confirmed = self.slot_persisted;
                self.last_sent_flush = self.slot_confirmed;
            }
        }

        /// `kill -9` (or a graceful stop first): in-flight produces and poison inserts
        /// may or may not have landed; their reports are lost.
        fn crash(&mut self, graceful: bool) {
            self.stats.crashes += 1;
            if graceful {
                let s = self.core.shutdown_status();
                self.on_status(s);
            }
            for id in std::mem::take(&mut self.broker) {
                if self.rng.percent(50) {
                    self.mark_resolved(id);
                }
            }
            for id in std::mem::take(&mut self.poison_db) {
                if self.rng.percent(50) {
                    self.mark_resolved(id);
                }
            }
            self.maybe_revert_slot();
            self.core = Core::new(self.cfg.clone(), self.slot_confirmed, self.now);
            self.ids.clear();
            self.done_ids.clear();
            self.permanent.clear();
            self.transient_at.clear();
            self.after_restart();
        }

        /// The replication connection dropped; the process (and its producer) lives on,
        /// so reports for the old core's events keep arriving at the new one.
        fn reconnect(&mut self) {
            self.stats.reconnects += 1;
            self.maybe_revert_slot();
            let placeholder = Core::new(self.cfg.clone(), Lsn::ZERO, self.now);
            let old = std::mem::replace(&mut self.core, placeholder);
            self.core = old.restart(self.slot_confirmed, self.now);
            self.after_restart();
        }

        fn after_restart(&mut self) {
            self.server = Server::connect(&self.wal, self.slot_confirmed);
            self.restart_from = self.slot_confirmed;
            self.produced_this_core.clear();
            self.last_first_this_core.clear();
            self.failed_now.clear();
            self.last_status_at = self.now;
            self.prev_confirmed = self.core.confirmed();
            self.last_commit_fed = None;
        }

        fn check(&mut self) {
            self.core.check_invariants();
            let confirmed = self.core.confirmed();
            if confirmed < self.prev_confirmed {
                self.fail("confirmed LSN went backwards");
            }
            self.prev_confirmed = confirmed;
            if let Some(lsn) = self.must_resend_from() {
                if confirmed > lsn {
                    self.fail(&format!(
                        "confirmed {confirmed} passes unresolved commit {lsn}"
                    ));
                }
                if self.slot_confirmed > lsn {
                    self.fail("the slot was confirmed past an unresolved commit");
                }
            }
            if self.core.is_idle() && self.last_commit_fed.is_some_and(|end| confirmed < end) {
                self.fail("idle but the last commit is not confirmed");
            }
        }

        fn finished(&self) -> bool {
            self.server.done(&self.wal)
                && self.core.is_idle()
                && self.broker.is_empty()
                && self.poison_db.is_empty()
        }

        fn run(mut self, random_steps: usize) -> Stats {
            for _ in 0..random_steps {
                self.step(false);
            }
            let mut steps = 0;
            while !self.finished() {
                self.step(true);
                steps += 1;
                if steps > 100_000 {
                    self.fail("no progress: the schedule did not drain");
                }
            }
            if let Some((i, _)) = self.unresolved.iter().enumerate().find(|(_, n)| **n > 0) {
                self.fail(&format!("lost events in transaction {i}"));
            }
            let last_end = self.wal.last().map_or(Lsn::ZERO, |t| t.end_lsn);
            self.now += self.cfg.status_interval;
            self.core.tick(self.now);
            self.drain_actions();
            if self.last_sent_flush < last_end {
                self.fail("the final status does not confirm the last transaction");
            }
            self.stats
        }
    }

    #[test]
    fn simulated_schedules_never_lose_reorder_or_over_confirm() {
        // OUTBOX_RELAY_SIM_SCHEDULES=1000000 for the long run (use --release);
        // OUTBOX_RELAY_SIM_SEED=N replays the one schedule a failure names.
        let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
        let steps = env("OUTBOX_RELAY_SIM_STEPS").unwrap_or(300);
        if let Some(seed) = env("OUTBOX_RELAY_SIM_SEED") {
            Sim::new(seed).run(usize::try_from(steps).unwrap());
            return;
        }
        let schedules = env("OUTBOX_RELAY_SIM_SCHEDULES").unwrap_or(2_000);
        let started = std::time::Instant::now();
        let mut total = Stats::default();
        for n in 0..schedules {
            let seed = n.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ n;
            let s = Sim::new(seed).run(usize::try_from(steps).unwrap());
            total.crashes += s.crashes;
            total.reconnects += s.reconnects;
            total.slot_reverts += s.slot_reverts;
            total.duplicates += s.duplicates;
            total.poisoned_after_retries += s.poisoned_after_retries;
            total.transient_retries += s.transient_retries;
            total.window_full += s.window_full;
            total.idle_advances += s.idle_advances;
            total.statuses += s.statuses;
            total.big_transactions += s.big_transactions;
            total.held += s.held;
        }
        // The schedules must actually exercise every path.
        let Stats {
            crashes,
            reconnects,
            slot_reverts,
            duplicates,
            poisoned_after_retries,
            transient_retries,
            window_full,
            idle_advances,
            statuses,
            big_transactions,
            held,
        } = total;
        for (name, n) in [
            ("crashes", crashes),
            ("reconnects", reconnects),
            ("slot reverts", slot_reverts),
            ("duplicates", duplicates),
            ("poisoned after retries", poisoned_after_retries),
            ("transient retries", transient_retries),
            ("window full", window_full),
            ("idle advances", idle_advances),
            ("statuses", statuses),
            ("transactions larger than the window", big_transactions),
            ("events held behind a retried event of their key", held),
        ] {
            assert!(n > 10, "simulation never exercised {name} ({n})");
        }
        eprintln!(
            "simulation: {schedules} schedules x {steps} steps, 0 violations, {:.1?}; \
             {crashes} crashes, {reconnects} reconnects, {duplicates} duplicates, \
             {held} events held behind a retry of their key",
            started.elapsed()
        );
    }

    // ---------------------------------------------------------------------------------
    // Arbitrary (mostly invalid) call sequences: never a panic, invariants hold.
    // ---------------------------------------------------------------------------------

    mod arbitrary {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Begin(u64, u32),
            Admit(usize, Option<u64>),
            Unmappable(usize),
            Commit(u64, u64),
            CommitOpen(u64),
            Delivered(u64),
            Failed(u64, bool),
            PoisonCommitted(u64),
            PoisonFailed(u64),
            Keepalive(u64, bool),
            Received(u64),
            Tick(u64),
            Drain,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0..10_000_u64, any::<u32>()).prop_map(|(l, x)| Op::Begin(l, x)),
                (0..300_usize, proptest::option::of(0..3_u64)).prop_map(|(b, k)| Op::Admit(b, k)),
                (0..300_usize).prop_map(Op::Unmappable),
                (0..10_000_u64, 0..10_000_u64).prop_map(|(a, b)| Op::Commit(a, b)),
                (1..100_u64).prop_map(Op::CommitOpen),
                (0..24_u64).prop_map(Op::Delivered),
                (0..24_u64, any::<bool>()).prop_map(|(i, p)| Op::Failed(i, p)),
                (0..24_u64).prop_map(Op::PoisonCommitted),
                (0..24_u64).prop_map(Op::PoisonFailed),
                (0..20_000_u64, any::<bool>()).prop_map(|(l, r)| Op::Keepalive(l, r)),
                (0..20_000_u64).prop_map(Op::Received),
                (0..2_000_u64).prop_map(Op::Tick),
                Just(Op::Drain),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(128))]

            #[test]
            fn arbitrary_calls_never_panic_and_keep_invariants(
                ops in proptest::collection::vec(op(), 0..200)
            ) {
                let t0 = Instant::now();
                let mut now = t0;
                let c = CoreConfig {
                    max_in_flight_events: 3,
                    max_in_flight_bytes: 500,
                    max_attempts: 2,
                    status_interval: Duration::from_millis(500),
                    progress_status_interval: Duration::from_millis(50),
                    retry_backoff_initial: Duration::from_millis(10),
                    retry_backoff_max: Duration::from_millis(80),
                };
                let mut core = Core::new(c, Lsn(100), now);
                let mut open_final: Option<u64> = None;
                let mut last_flush = Lsn(100);
                let mut last_confirmed = core.confirmed();
                for op in ops {
                    match op {
                        Op::Begin(l, x) => {
                            if core.begin(Lsn(l), x).is_ok() {
                                open_final = Some(l);
                            }
                        }
                        Op::Admit(b, k) => { let _ = core.admit_keyed(b, k, now); }
                        Op::Unmappable(b) => { let _ = core.admit_unmappable(b); }
                        Op::Commit(a, b) => {
                            if core.commit(Lsn(a), Lsn(b), now).is_ok() {
                                open_final = None;
                            }
                        }
                        Op::CommitOpen(d) => {
                            if let Some(f) = open_final.take() {
                                prop_assert!(core.commit(Lsn(f), Lsn(f + d), now).is_ok());
                            }
                        }
                        Op::Delivered(i) => core.delivered(EventId::from_raw(i), now),
                        Op::Failed(i, p) => {
                            let f = if p { Failure::Permanent } else { Failure::Transient };
                            core.delivery_failed(EventId::from_raw(i), f, now);
                        }
                        Op::PoisonCommitted(i) => core.poison_committed(EventId::from_raw(i), now),
                        Op::PoisonFailed(i) => core.poison_insert_failed(EventId::from_raw(i), now),
                        Op::Keepalive(l, r) => core.keepalive(Lsn(l), r, now),
                        Op::Received(l) => core.received(Lsn(l)),
                        Op::Tick(d) => {
                            now += Duration::from_millis(d);
                            core.tick(now);
                            prop_assert!(core.next_deadline().is_none_or(|d| d > now));
                        }
                        Op::Drain => {
                            while let Some(a) = core.next_action() {
                                if let Action::SendStatus(s) = a {
                                    prop_assert!(s.flush >= last_flush);
                                    prop_assert!(s.write >= s.flush && s.apply == s.flush);
                                    last_flush = s.flush;
                                }
                            }
                        }
                    }
                    core.check_invariants();
                    prop_assert!(core.confirmed() >= last_confirmed);
                    last_confirmed = core.confirmed();
                    prop_assert_eq!(core.in_transaction(), open_final.is_some());
                }
            }
        }
    }
}
