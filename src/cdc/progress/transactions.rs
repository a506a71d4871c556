//! Kafka transactions: what "resolved" means when `kafka.delivery = "exactly-once"`.
//!
//! # Why an acked record is not enough
//!
//! With a transactional producer, a delivery report says the record is written in the
//! open Kafka transaction, not that a `read_committed` consumer will ever see it: if the
//! relay dies before the commit, the broker aborts the transaction (the next producer
//! with the same `transactional.id` fences the old one and aborts what it left open).
//! So an event delivered in a transaction is [`Written`](super::core::EventState), not
//! resolved; it is resolved when the transaction commits, together with every other
//! event written in it. The watermark, the saved position and the status updates only
//! ever move on resolved events, so **nothing is confirmed or saved past an uncommitted
//! Kafka transaction**.
//!
//! # The progress record
//!
//! Each transaction also carries a progress record, the [`ProgressMark`] the core
//! computes when it asks for the commit ([`Action::CommitTransaction`]): what is
//! durable once this transaction commits, in the names of the resend guard
//! ([`Origin`](super::Origin): commit LSN and ordinal), which pgoutput reproduces
//! identically on every resend. A process that starts reads the last committed mark
//! (after its `init_transactions` fenced and aborted whatever a predecessor left open)
//! and resumes with [`Core::resume_from`]: every event the mark names as resolved is
//! resolved at admission, without a produce. The record is written in the same Kafka
//! transaction as the events it covers, so they are durable together or not at all,
//! and a crash anywhere re-sends nothing a committed mark covers.
//!
//! The mark is the same reckoning a lost session makes ([`ResendGuard::session_lost`]),
//! made on a copy as if the session ended right after the commit: the watermark the
//! commit would produce (the first transaction with an event outside the Kafka
//! transaction stops it), and, for the transactions after it, which events were
//! admitted and which are still unresolved (retrying, poisoning, held, halted). Marks
//! never move backwards: the watermark only grows, and a resolved event stays resolved.
//!
//! # One transaction at a time, in order
//!
//! While a commit or an abort is outstanding nothing is produced (librdkafka refuses
//! produces in those states, and a record produced then would belong to no known
//! transaction); poison inserts go on, they are PostgreSQL's. A failed delivery makes
//! the Kafka transaction abortable: the core asks for an abort
//! ([`Action::AbortTransaction`]), and once it is done every event that was written (or
//! in flight) in it is produced again, in admission order and ahead of anything newer,
//! after `retry_backoff_initial` — except the events behind an earlier failure of their
//! key, which wait for it and retry one at a time, oldest first (`events.rs`). The
//! failed event itself follows the
//! normal retry and poison rules, so a record the broker always refuses ends up in
//! the poison table instead of aborting forever.
//!
//! # What the shell promises
//!
//! * [`Core::transaction_committed`] and [`Core::transaction_aborted`] are called only
//!   once every delivery report of that transaction was passed in (librdkafka has
//!   queued them all when the commit or abort returns; the shell waits for its
//!   in-flight count to reach zero).
//! * Before [`Core::restart`] the open transaction is committed or aborted.
//! * It begins a Kafka transaction before the first produce after a commit or an abort.
//!
//! [`ResendGuard::session_lost`]: super::resend::ResendGuard::session_lost
//! [`Action::CommitTransaction`]: super::Action::CommitTransaction
//! [`Action::AbortTransaction`]: super::Action::AbortTransaction

use std::collections::BTreeSet;

use crate::hashing::HashMap;
use std::time::Instant;

use super::core::{Action, Core, EventState, Pending, Phase};
use super::resend::ProgressMark;
use crate::delivery::EventId;
use crate::lsn::Lsn;

impl Core {
    /// Whether events go out in Kafka transactions.
    #[must_use]
    pub fn transactional(&self) -> bool {
        self.cfg.transactions.is_some()
    }

    /// The progress record of the commit handed out with
    /// [`Action::CommitTransaction`], until [`Core::transaction_committed`] or
    /// [`Core::transaction_aborted`].
    #[must_use]
    pub fn transaction_mark(&self) -> Option<&ProgressMark> {
        self.kafka.mark.as_ref()
    }

    /// Events produced in the open Kafka transaction.
    #[must_use]
    pub fn transaction_events(&self) -> usize {
        self.kafka.members.len()
    }

    /// Adds a committed progress record (read after `init_transactions`) to what
    /// the core knows is resolved: every event it names is resolved at admission.
    /// Call before the first message of the stream.
    pub fn resume_from(&mut self, mark: &ProgressMark) {
        self.resend.merge(mark);
        self.resend.confirmed(self.confirmed);
    }

    /// The Kafka transaction of the last [`Action::CommitTransaction`] committed: its
    /// events are resolved (those whose report has not arrived too: a commit succeeds
    /// only once every record in it is written).
    pub fn transaction_committed(&mut self, now: Instant) {
        if self.kafka.phase != Phase::Committing {
            return;
        }
        let members = std::mem::take(&mut self.kafka.members);
        let sent = std::mem::take(&mut self.kafka.sent);
        self.end_transaction();
        // Resolving a member changes no other member's state (it may release a
        // waiting event of its key, which is no member): one pass decides.
        let mut unsent = Vec::new();
        for id in members {
            if self.commits_with(id, &sent) {
                self.resolve(id);
            } else if self.producing(id) {
                unsent.push(id);
            }
        }
        // A member whose produce was handed out but never sent is not in the
        // committed transaction: it goes out (first) in the next one.
        for &id in unsent.iter().rev() {
            self.actions
                .retain(|p| !matches!(p, Pending::Produce { id: queued, .. } if *queued == id));
            self.produce_again(id, false);
        }
        self.poll_status(now);
    }

    /// The shell handed the produce of member `id` to the producer: if the open
    /// transaction commits, the record is in it. Ignored unless `id` is a member
    /// whose produce is outstanding.
    pub fn produce_sent(&mut self, id: EventId) {
        if self.kafka.members.contains(&id) && self.producing(id) {
            self.kafka.sent.insert(id);
        }
    }

    /// Whether member `id` is in the open transaction if it commits: written, or
    /// handed to the producer (a commit flushes it, or fails).
    fn commits_with_transaction(&self, id: EventId) -> bool {
        self.kafka.members.contains(&id) && self.commits_with(id, &self.kafka.sent)
    }

    /// Whether `id`, a member, is committed with its transaction when the members
    /// handed to the producer are `sent`.
    fn commits_with(&self, id: EventId, sent: &BTreeSet<EventId>) -> bool {
        self.events.get(&id).is_some_and(|e| match e.state {
            EventState::Written => true,
            EventState::Producing { .. } => sent.contains(&id),
            _ => false,
        })
    }

    /// Asks for the open Kafka transaction to be committed now if anything was
    /// written in it (a session that ends commits what it can before the core is
    /// restarted); the commit is the next [`Core::next_action`].
    pub fn commit_now(&mut self) {
        if self.kafka.phase == Phase::Open && self.kafka.written > 0 {
            self.kafka.commit_due = true;
        }
    }

    /// The open Kafka transaction was aborted (after [`Action::AbortTransaction`],
    /// after a commit that failed, or by the shell itself before a restart): what was
    /// written in it is produced again, first, in admission order, after
    /// `retry_backoff_initial`.
    pub fn transaction_aborted(&mut self, now: Instant) {
        if self.kafka.members.is_empty()
            && !matches!(self.kafka.phase, Phase::Committing | Phase::Aborting)
        {
            return;
        }
        let members = std::mem::take(&mut self.kafka.members);
        self.end_transaction();
        let until = now
            .checked_add(self.cfg.retry_backoff_initial)
            .unwrap_or(now);
        self.kafka.phase = Phase::Paused { until };
        // Produces queued while the transaction was ending (retries that came due)
        // are sorted in with the members: a retry queued before an older event of
        // its key failed must not leave ahead of it.
        let again: BTreeSet<EventId> = self
            .events
            .iter()
            .filter(|(_, e)| matches!(e.state, EventState::Producing { .. }))
            .map(|(&id, _)| id)
            .chain(members.iter().copied())
            .collect();
        self.actions
            .retain(|p| !matches!(p, Pending::Produce { id, .. } if again.contains(id)));
        // Pushed to the front in reverse, so they leave in admission order, before
        // every produce queued meanwhile.
        for &id in again.iter().rev() {
            self.produce_again(id, members.contains(&id));
        }
        self.poll_status(now);
    }

    /// Clears the transaction's bookkeeping (members are taken by the caller).
    fn end_transaction(&mut self) {
        self.kafka.sent.clear();
        self.kafka.written = 0;
        self.kafka.first_write = None;
        self.kafka.abort_due = false;
        self.kafka.commit_due = false;
        self.kafka.mark = None;
        self.kafka.phase = Phase::Open;
    }

    /// An event of an aborted transaction (`sent`), or one whose produce was queued
    /// but not handed out (an aborted transaction's member, or a first produce
    /// queued before an earlier event of its key failed, `Core::next_action`):
    /// produced (again), or left waiting behind an earlier failure of its key.
    pub(super) fn produce_again(&mut self, id: EventId, sent: bool) {
        let blocked = self
            .events
            .get(&id)
            .and_then(|e| e.key)
            .is_some_and(|k| self.earlier_failure(k, id));
        let Some(event) = self.events.get_mut(&id) else {
            return;
        };
        if !matches!(
            event.state,
            EventState::Producing { .. } | EventState::Written
        ) {
            return;
        }
        match event.key {
            // Behind an older failure of its key: it waits for it and then retries
            // oldest first, like a failed event. (Held, it could be overtaken by a
            // newer failed event of its key, which retries as soon as the older
            // failure resolves.)
            Some(k) if blocked => {
                if !event.failed {
                    event.failed = true;
                    *self.blocked_keys.entry(k).or_default() += 1;
                }
                event.state = EventState::Waiting;
            }
            _ => {
                if sent {
                    event.attempts = event.attempts.saturating_add(1);
                }
                let attempt = event.attempts;
                event.state = EventState::Producing { attempt };
                self.actions.push_front(Pending::Produce { id, attempt });
            }
        }
    }

    /// `delivered` in transactional mode: the member is written, not resolved.
    pub(super) fn written_in_transaction(&mut self, id: EventId, now: Instant) {
        if self.kafka.phase == Phase::Aborting || !self.kafka.members.contains(&id) {
            // Written in a transaction being aborted: it is produced again anyway.
            return;
        }
        if let Some(event) = self.events.get_mut(&id)
            && matches!(event.state, EventState::Producing { .. })
        {
            event.state = EventState::Written;
            self.kafka.written = self.kafka.written.saturating_add(1);
            self.kafka.first_write.get_or_insert(now);
            if let Some(limits) = self.cfg.transactions
                && self.kafka.written >= limits.max_events
            {
                self.kafka.commit_due = true;
            }
        }
    }

    /// A member left the transaction without being written (failed, refused,
    /// parked): the transaction must be aborted if the member was sent.
    pub(super) fn left_transaction(&mut self, id: EventId, sent: bool) {
        self.kafka.sent.remove(&id);
        if self.kafka.members.remove(&id) && sent {
            self.kafka.abort_due = true;
        }
    }

    /// The transaction action due, if any; also whether produces must wait.
    pub(super) fn transaction_action(&mut self) -> Option<Action> {
        self.cfg.transactions?;
        if self.kafka.phase != Phase::Open {
            return None;
        }
        if self.kafka.abort_due {
            self.kafka.phase = Phase::Aborting;
            return Some(Action::AbortTransaction);
        }
        if self.kafka.commit_due && self.kafka.written > 0 {
            self.kafka.mark = Some(self.mark_if_committed());
            self.kafka.phase = Phase::Committing;
            return Some(Action::CommitTransaction);
        }
        None
    }

    /// Whether a produce may be handed out now.
    pub(super) fn may_produce(&self) -> bool {
        self.cfg.transactions.is_none() || self.kafka.phase == Phase::Open
    }

    /// Runs the transaction timers due at `now`.
    pub(super) fn transaction_tick(&mut self, now: Instant) {
        if let Phase::Paused { until } = self.kafka.phase
            && now >= until
        {
            self.kafka.phase = Phase::Open;
        }
        if self.kafka.phase == Phase::Open
            && let Some(deadline) = self.transaction_deadline()
            && now >= deadline
        {
            self.kafka.commit_due = true;
        }
    }

    /// The next instant a transaction timer fires.
    pub(super) fn transaction_deadline(&self) -> Option<Instant> {
        let limits = self.cfg.transactions?;
        match self.kafka.phase {
            Phase::Paused { until } => Some(until),
            Phase::Open if self.kafka.commit_due => None,
            Phase::Open => self
                .kafka
                .first_write
                .filter(|_| self.kafka.written > 0)
                .map(|at| at.checked_add(limits.interval).unwrap_or(at)),
            Phase::Committing | Phase::Aborting => None,
        }
    }

    /// The progress record if the open transaction commits: every member resolved.
    fn mark_if_committed(&self) -> ProgressMark {
        let mut members_per_tx: HashMap<u64, usize> = HashMap::default();
        for id in &self.kafka.members {
            if let Some(e) = self.events.get(id)
                && self.commits_with_transaction(*id)
            {
                *members_per_tx.entry(e.tx).or_default() += 1;
            }
        }
        let mut watermark: Lsn = self.confirmed;
        for (seq, entry) in &self.txs {
            let in_transaction = members_per_tx.get(seq).copied().unwrap_or(0);
            match entry.end_lsn {
                Some(end) if entry.pending == in_transaction => watermark = watermark.max(end),
                _ => break,
            }
        }
        let unresolved = self
            .events
            .iter()
            .filter(|(id, _)| !self.commits_with_transaction(**id))
            .map(|(_, e)| e.origin);
        self.resend.mark(watermark, unresolved)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::super::*;
    use crate::delivery::{EventId, Failure};
    use crate::lsn::Lsn;

    fn cfg(max_events: usize) -> CoreConfig {
        CoreConfig {
            max_in_flight_events: 8,
            retry_backoff_initial: Duration::from_millis(100),
            transactions: Some(TransactionLimits {
                max_events,
                interval: Duration::from_millis(50),
            }),
            ..CoreConfig::default()
        }
    }

    /// Drains actions: saves are taken at once, statuses left out, produces sent.
    fn work(core: &mut Core) -> Vec<Action> {
        let mut out = Vec::new();
        while let Some(a) = core.next_action() {
            match a {
                Action::Save { lsn, .. } => core.saved(lsn, core.last_status_at),
                Action::SendStatus(_) => {}
                Action::Produce { id, .. } => {
                    core.produce_sent(id);
                    out.push(a);
                }
                a => out.push(a),
            }
        }
        core.check_invariants();
        out
    }

    fn produced(actions: &[Action]) -> Vec<EventId> {
        actions
            .iter()
            .filter_map(|a| match a {
                Action::Produce { id, .. } => Some(*id),
                _ => None,
            })
            .collect()
    }

    /// One committed PostgreSQL transaction `[final, final + 10)` with events of `keys`.
    fn tx(core: &mut Core, final_lsn: u64, keys: &[u64], now: Instant) -> Vec<EventId> {
        core.begin(Lsn(final_lsn), 7).unwrap();
        let ids = keys
            .iter()
            .map(|&k| core.admit_keyed(10, Some(k), now).unwrap())
            .collect();
        core.commit(Lsn(final_lsn), Lsn(final_lsn + 10), now)
            .unwrap();
        core.check_invariants();
        ids
    }

    #[test]
    fn acked_events_confirm_nothing_before_their_transaction_commits() {
        let now = Instant::now();
        let mut core = Core::new(cfg(100), Lsn(50), now);
        let ids = tx(&mut core, 100, &[1, 2], now);
        assert_eq!(produced(&work(&mut core)), ids);
        for &id in &ids {
            core.delivered(id, now);
        }
        assert_eq!(work(&mut core), vec![]);
        assert_eq!(core.confirmed(), Lsn(50), "acked, not committed");
        // The interval passes: the commit is asked for, with the mark it makes durable.
        core.tick(now + Duration::from_millis(50));
        assert_eq!(work(&mut core), vec![Action::CommitTransaction]);
        assert_eq!(
            core.transaction_mark(),
            Some(&ProgressMark {
                confirmed: Lsn(110),
                partial: vec![],
            })
        );
        assert_eq!(core.confirmed(), Lsn(50));
        core.transaction_committed(now);
        assert_eq!(core.confirmed(), Lsn(110));
        assert_eq!(core.transaction_mark(), None);
        core.check_invariants();
    }

    #[test]
    fn a_full_transaction_commits_without_waiting_for_the_interval() {
        let now = Instant::now();
        let mut core = Core::new(cfg(2), Lsn(50), now);
        let ids = tx(&mut core, 100, &[1, 2, 3], now);
        assert_eq!(produced(&work(&mut core)), ids);
        core.delivered(ids[0], now);
        assert_eq!(work(&mut core), vec![]);
        core.delivered(ids[1], now);
        assert_eq!(work(&mut core), vec![Action::CommitTransaction]);
        // The third event is in flight in the transaction: the commit covers it, and
        // the mark says the whole PostgreSQL transaction is durable.
        assert_eq!(core.transaction_mark().unwrap().confirmed, Lsn(110));
        core.transaction_committed(now);
        assert_eq!(core.confirmed(), Lsn(110));
        // Its late report changes nothing.
        core.delivered(ids[2], now);
        assert_eq!(core.in_flight_events(), 0);
        core.check_invariants();
    }

    #[test]
    fn nothing_is_produced_while_a_commit_is_outstanding() {
        let now = Instant::now();
        let mut core = Core::new(cfg(1), Lsn(50), now);
        let first = tx(&mut core, 100, &[1], now);
        assert_eq!(produced(&work(&mut core)), first);
        core.delivered(first[0], now);
        assert_eq!(work(&mut core), vec![Action::CommitTransaction]);
        let second = tx(&mut core, 200, &[2], now);
        assert_eq!(work(&mut core), vec![], "held until the commit's outcome");
        core.transaction_committed(now);
        assert_eq!(produced(&work(&mut core)), second);
    }

    #[test]
    fn a_mark_names_what_is_durable_past_an_unresolved_event() {
        let now = Instant::now();
        let mut core = Core::new(cfg(100), Lsn(50), now);
        let a = tx(&mut core, 100, &[1, 2], now);
        let b = tx(&mut core, 200, &[3], now);
        work(&mut core);
        // a[1] fails: it leaves the transaction, which must be aborted.
        core.delivered(a[0], now);
        core.delivery_failed(a[1], Failure::Transient, now + Duration::from_millis(50));
        core.delivered(b[0], now);
        assert_eq!(work(&mut core), vec![Action::AbortTransaction]);
        core.transaction_aborted(now);
        // a[0] and b[0] are produced again first, after the pause, in order.
        assert_eq!(work(&mut core), vec![]);
        core.tick(now + Duration::from_millis(100));
        let again = produced(&work(&mut core));
        assert_eq!(again, vec![a[0], b[0]]);
        core.delivered(a[0], now);
        core.delivered(b[0], now);
        core.tick(now + Duration::from_millis(150));
        assert_eq!(work(&mut core), vec![Action::CommitTransaction]);
        // a[1] is still retrying: the watermark stays before its transaction, and the
        // mark names a[0] and b[0] as durable.
        assert_eq!(
            core.transaction_mark(),
            Some(&ProgressMark {
                confirmed: Lsn(50),
                partial: vec![
                    PartialTx {
                        commit: Lsn(100),
                        admitted: 2,
                        unresolved: vec![1],
                    },
                    PartialTx {
                        commit: Lsn(200),
                        admitted: 1,
                        unresolved: vec![],
                    },
                ],
            })
        );
        core.transaction_committed(now);
        assert_eq!(core.confirmed(), Lsn(50));
        assert_eq!(core.in_flight_events(), 1);
    }

    #[test]
    fn after_an_abort_a_key_behind_a_failure_waits_for_it() {
        let now = Instant::now();
        let mut core = Core::new(cfg(100), Lsn(50), now);
        // Key 1: e0 then e1; key 2: e2. e0 fails after e1 was produced.
        let ids = tx(&mut core, 100, &[1, 1, 2], now);
        work(&mut core);
        core.delivered(ids[1], now);
        core.delivery_failed(ids[0], Failure::Transient, now);
        core.delivered(ids[2], now);
        assert_eq!(work(&mut core), vec![Action::AbortTransaction]);
        core.transaction_aborted(now);
        core.tick(now + Duration::from_millis(100));
        // e0's retry comes due with the pause: it goes first, e1 waits for it.
        let mut again = produced(&work(&mut core));
        again.sort_unstable();
        assert_eq!(again, vec![ids[0], ids[2]], "e1 held behind e0");
        core.delivered(ids[0], now);
        core.delivered(ids[2], now);
        core.tick(now + Duration::from_millis(200));
        assert_eq!(work(&mut core), vec![Action::CommitTransaction]);
        core.transaction_committed(now);
        core.tick(now + Duration::from_millis(200));
        assert_eq!(
            produced(&work(&mut core)),
            vec![ids[1]],
            "released by e0's commit"
        );
    }

    #[test]
    fn a_resumed_core_produces_only_what_the_mark_left_unresolved() {
        let now = Instant::now();
        let mark = ProgressMark {
            confirmed: Lsn(110),
            partial: vec![PartialTx {
                commit: Lsn(200),
                admitted: 2,
                unresolved: vec![0],
            }],
        };
        // The slot was confirmed only to 50: the server re-sends everything.
        let mut core = Core::new(cfg(100), Lsn(50), now);
        core.resume_from(&mark);
        let before = tx(&mut core, 100, &[1], now);
        let partial = tx(&mut core, 200, &[2, 3, 4], now);
        let after = tx(&mut core, 300, &[5], now);
        let sent = produced(&work(&mut core));
        assert_eq!(sent, vec![partial[0], partial[2], after[0]]);
        assert!(!core.is_in_flight(before[0]));
        assert!(!core.is_in_flight(partial[1]));
        // The watermark moved through what the mark covered.
        assert_eq!(core.confirmed(), Lsn(110));
    }

    #[test]
    fn a_permanently_refused_record_is_poisoned_not_aborted_forever() {
        let now = Instant::now();
        let mut core = Core::new(
            CoreConfig {
                max_attempts: 2,
                ..cfg(100)
            },
            Lsn(50),
            now,
        );
        let ids = tx(&mut core, 100, &[1], now);
        let mut at = now;
        work(&mut core);
        for _ in 0..2 {
            core.delivery_failed(ids[0], Failure::Permanent, at);
            let actions = work(&mut core);
            assert!(actions.contains(&Action::AbortTransaction), "{actions:?}");
            core.transaction_aborted(at);
            at += Duration::from_secs(5);
            core.tick(at);
            work(&mut core);
        }
        // Poisoned on the second permanent failure; resolved once the insert commits.
        core.poison_committed(ids[0], at);
        assert_eq!(core.confirmed(), Lsn(110));
        core.check_invariants();
    }
}
