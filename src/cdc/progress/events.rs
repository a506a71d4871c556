//! Each event's life in the window: produced, retried after a failure, poisoned, and
//! resolved; and the per-key hold that keeps retries in order.
//!
//! # Why a poisoned event counts only once its insert committed
//!
//! "Resolved" means durable somewhere: acked by the broker with `acks=all`, or a committed
//! row in `poison_outbox`. Emitting [`Action::InsertPoison`](super::Action::InsertPoison) is only a
//! request; if the relay crashed after confirming past the event but before the poison transaction
//! committed, the row would be in neither place and the slot would never send it again —
//! a silent loss. For the same reason a produce counts when it is *acked*, not when it is
//! sent.
//!
//! # Reports that match nothing are ignored
//!
//! A delivery report or poison commit for an id the core does not know, or for an event
//! that is not waiting for that kind of report (a duplicate report, a report for a
//! previous core's event after a reconnect, a late report after a retry was scheduled),
//! is ignored. Counting it would decrement the `pending` count of a transaction whose
//! event is still unresolved, and the watermark could pass that event. Ignoring a report
//! can only *delay* a confirmation: the event stays pending until the report it is
//! actually waiting for arrives.
//!
//! # Per-key order and application-level retries
//!
//! First produces are issued in commit order, and the idempotent producer keeps them in
//! order per partition through its own retries. A delivery the producer gives up on (a
//! per-record error such as `MessageSizeTooLarge`) is retried here, and a retry could
//! overtake nothing only if no later event of the key were produced meanwhile. So from
//! the moment an event fails, later events of its key ([`Core::admit_keyed`]) are
//! *held* — admitted, counted in the window, not produced — until it is delivered or
//! poisoned; then they are produced in order. Failed events of one key are retried one
//! at a time, oldest first: a retry due while an earlier failed event of its key is
//! unresolved waits for it ([`EventState::Waiting`](super::core::EventState)), so a
//! successor is never delivered ahead of a predecessor's retry (nor at all while the
//! predecessor is halted under `relay.on_poison = "halt"`). What this cannot undo:
//! events of the key produced *before* the failure was reported (at most the
//! producer's in-flight requests for that partition) may land before the retried
//! event. A poisoned event is out of order by nature when replayed.

use std::time::{Duration, Instant};

use super::core::{Core, Event, EventState, Pending, Then, TxEntry};
use super::error::ProtocolError;
use crate::delivery::{EventId, Failure};

impl Core {
    /// One outbox event of the open transaction, `bytes` long (key + value + headers).
    /// Queues [`Action::Produce`](super::Action::Produce) with attempt 1.
    ///
    /// Errors: [`ProtocolError::ChangeOutsideTransaction`] without a `Begin`;
    /// [`ProtocolError::WindowFull`] if called while [`Core::can_read`] is false.
    pub fn admit(&mut self, bytes: usize, now: Instant) -> Result<EventId, ProtocolError> {
        self.admit_keyed(bytes, None, now)
    }

    /// [`Core::admit`] for a record whose key hashes to `key`: while an earlier event
    /// of that key is being retried, this one is held (no produce) until the earlier
    /// one is delivered or poisoned, so it cannot overtake it.
    ///
    /// An event that a lost session of this process already resolved (`resend.rs`) is
    /// resolved at once and nothing is queued for it: [`Core::origin`] is `None` then.
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
        let id = match self.admit_event(bytes, state)? {
            Admission::New(id) => id,
            Admission::AlreadyResolved(id) => {
                self.poll_status(now);
                return Ok(id);
            }
        };
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
    /// column type): queues [`Action::InsertPoison`](super::Action::InsertPoison) straight away, with `attempts` 1.
    /// It occupies the window until [`Core::poison_committed`]. Errors as for
    /// [`Core::admit`].
    pub fn admit_unmappable(&mut self, bytes: usize) -> Result<EventId, ProtocolError> {
        match self.admit_event(bytes, EventState::Poisoning)? {
            Admission::New(id) => {
                self.actions.push_back(Pending::InsertPoison { id });
                Ok(id)
            }
            Admission::AlreadyResolved(id) => Ok(id),
        }
    }

    /// Counts the next row of the open transaction in the window, or resolves it at
    /// once when a lost session already did.
    fn admit_event(&mut self, bytes: usize, state: EventState) -> Result<Admission, ProtocolError> {
        let Some(open) = self.open else {
            return Err(ProtocolError::ChangeOutsideTransaction);
        };
        if !self.window_has_room() {
            return Err(ProtocolError::WindowFull {
                events: self.events.len(),
                bytes: self.in_flight_bytes,
            });
        }
        let id = EventId::from_raw(self.next_event_id);
        self.next_event_id = self.next_event_id.wrapping_add(1);
        let origin = self.resend.next();
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
                origin,
            },
        );
        self.in_flight_bytes = self.in_flight_bytes.saturating_add(bytes);
        if self.resend.already_resolved(origin) {
            self.resolve(id);
            return Ok(Admission::AlreadyResolved(id));
        }
        Ok(Admission::New(id))
    }

    /// The broker acked the record of `id`. Ignored unless a produce of `id` is outstanding.
    ///
    /// In transactional mode the event is written, not resolved: it resolves when its
    /// Kafka transaction commits (`transactions.rs`).
    pub fn delivered(&mut self, id: EventId, now: Instant) {
        if self.transactional() {
            self.written_in_transaction(id, now);
        } else if let Some(event) = self.events.get(&id)
            && matches!(event.state, EventState::Producing { .. })
        {
            self.resolve(id);
        }
        self.poll_status(now);
    }

    /// Whether a produce of `id` is requested or outstanding.
    pub(super) fn producing(&self, id: EventId) -> bool {
        self.events
            .get(&id)
            .is_some_and(|e| matches!(e.state, EventState::Producing { .. }))
    }

    /// The broker gave up on the record of `id`. Ignored unless a produce of `id` is
    /// outstanding.
    ///
    /// Every failure is produced again after an exponential backoff (a broker that
    /// refuses a record at once would otherwise be asked again in a hot loop).
    /// Permanent: until `max_attempts` permanent failures, then poisoned. Transient
    /// (and a configuration failure, which the shell passes on as transient unless
    /// `relay.on_config_error = "poison"`): forever, never poisoned.
    pub fn delivery_failed(&mut self, id: EventId, failure: Failure, now: Instant) {
        let max_attempts = self.cfg.max_attempts;
        let delay_base = (self.cfg.retry_backoff_initial, self.cfg.retry_backoff_max);
        if self.producing(id) {
            self.left_transaction(id, true);
        }
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
                        let until = deadline(now, backoff(delay_base, event.permanent_failures));
                        event.state = EventState::Backoff {
                            until,
                            then: Then::Produce,
                        };
                        self.retries.insert((until, id));
                    }
                }
                Failure::Transient | Failure::Configuration => {
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

    /// The shell refuses to produce `id` at all (a record larger than the producer
    /// accepts, which no retry can change, or an event an earlier process already
    /// recorded in the poison table): it is poisoned at once. Ignored unless a
    /// produce of `id` is requested or outstanding.
    pub fn refuse(&mut self, id: EventId, now: Instant) {
        if self.producing(id) {
            self.left_transaction(id, false);
        }
        if let Some(event) = self.events.get_mut(&id)
            && matches!(event.state, EventState::Producing { .. })
        {
            if !event.failed {
                event.failed = true;
                if let Some(k) = event.key {
                    *self.blocked_keys.entry(k).or_default() += 1;
                }
            }
            event.state = EventState::Poisoning;
            self.actions.push_back(Pending::InsertPoison { id });
        }
        self.poll_status(now);
    }

    /// The shell parks `id` instead of producing it (its key is parked,
    /// `relay.on_poison = "park-key"`): it is written to the poison table as parked,
    /// which resolves it like a poisoned event. Ignored unless the first produce of
    /// `id` is requested (an event produced before cannot be taken back).
    pub fn park(&mut self, id: EventId, now: Instant) {
        if let Some(event) = self.events.get_mut(&id)
            && event.state == (EventState::Producing { attempt: 1 })
            && event.attempts == 1
            && !event.failed
        {
            self.kafka.members.remove(&id);
            self.kafka.sent.remove(&id);
            let Some(event) = self.events.get_mut(&id) else {
                return;
            };
            event.state = EventState::Poisoning;
            self.actions.push_back(Pending::InsertPoison { id });
        }
        self.poll_status(now);
    }

    /// The parked event `id` was not written because `replay` released its key
    /// meanwhile: it is produced after all (its first produce). Ignored unless a
    /// poison insert of `id` is outstanding.
    pub fn unpark(&mut self, id: EventId, now: Instant) {
        if let Some(event) = self.events.get_mut(&id)
            && event.state == EventState::Poisoning
        {
            event.state = EventState::Producing { attempt: 1 };
            self.actions.push_back(Pending::Produce { id, attempt: 1 });
        }
        self.poll_status(now);
    }

    /// The shell will not poison `id` (`relay.on_poison = "halt"`): it stays
    /// unresolved, so its transaction is never confirmed by this core, and later
    /// events of its key stay held. Other keys keep flowing until the window is
    /// full. Ignored unless a poison insert of `id` is requested.
    pub fn halt(&mut self, id: EventId, now: Instant) {
        if let Some(event) = self.events.get_mut(&id)
            && event.state == EventState::Poisoning
        {
            event.state = EventState::Halted;
            self.halted += 1;
        }
        self.poll_status(now);
    }

    /// Events halted (`relay.on_poison = "halt"`); they stay until the core is
    /// replaced.
    #[must_use]
    pub fn halted_events(&self) -> usize {
        self.halted
    }

    /// In-flight events that can still resolve: not halted, and not held behind a
    /// halted event of their key. A drain (shutdown, a lost session) waits for
    /// these only.
    #[must_use]
    pub fn resolvable_events(&self) -> usize {
        if self.halted == 0 {
            return self.events.len();
        }
        let halted_keys: crate::hashing::HashSet<u64> = self
            .events
            .values()
            .filter(|e| e.state == EventState::Halted)
            .filter_map(|e| e.key)
            .collect();
        self.events
            .values()
            .filter(|e| match e.state {
                EventState::Halted => false,
                EventState::Held | EventState::Waiting => {
                    e.key.is_none_or(|k| !halted_keys.contains(&k))
                }
                _ => true,
            })
            .count()
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

    /// Runs the timers due at `now`: retry backoffs and the status interval.
    pub fn tick(&mut self, now: Instant) {
        self.transaction_tick(now);
        while let Some(&(at, id)) = self.retries.first() {
            if at > now {
                break;
            }
            self.retries.pop_first();
            let wait = self
                .events
                .get(&id)
                .and_then(|e| e.key)
                .is_some_and(|k| self.earlier_failure(k, id));
            if let Some(event) = self.events.get_mut(&id)
                && let EventState::Backoff { until, then } = event.state
                && until == at
            {
                match then {
                    Then::Produce if wait => event.state = EventState::Waiting,
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

    /// Removes a resolved event and settles its transaction.
    pub(super) fn resolve(&mut self, id: EventId) {
        let Some(event) = self.events.remove(&id) else {
            return;
        };
        self.resolved_log.push(id);
        self.in_flight_bytes = self.in_flight_bytes.saturating_sub(event.bytes);
        self.resolved_since_status = self.resolved_since_status.saturating_add(1);
        self.saving.resolved();
        if event.failed
            && let Some(k) = event.key
        {
            self.unblock(k);
            self.retry_next_waiting(k);
        }
        if let Some(entry) = self.txs.get_mut(&event.tx) {
            entry.pending = entry.pending.saturating_sub(1);
        }
        self.settle(event.tx);
    }

    /// Whether an event of key `k` admitted before `id` failed and is unresolved.
    pub(super) fn earlier_failure(&self, k: u64, id: EventId) -> bool {
        self.events
            .range(..id)
            .any(|(_, e)| e.failed && e.key == Some(k))
    }

    /// A failed event of key `k` resolved: the oldest failed event of `k` waiting for
    /// it is retried now (it waited its backoff already), unless another earlier
    /// failure of `k` is still unresolved.
    fn retry_next_waiting(&mut self, k: u64) {
        let Some(id) = self
            .events
            .iter()
            .find(|(_, e)| e.state == EventState::Waiting && e.key == Some(k))
            .map(|(&id, _)| id)
        else {
            return;
        };
        if self.earlier_failure(k, id) {
            return;
        }
        if let Some(event) = self.events.get_mut(&id) {
            event.attempts = event.attempts.saturating_add(1);
            let attempt = event.attempts;
            event.state = EventState::Producing { attempt };
            self.actions.push_back(Pending::Produce { id, attempt });
        }
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
}

/// What [`Core::admit_event`] did with a row.
enum Admission {
    /// Counted in the window; the caller queues its first action.
    New(EventId),
    /// Resolved at once: a lost session of this process already delivered or
    /// poisoned it.
    AlreadyResolved(EventId),
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
