//! Not producing again what a lost session already delivered.
//!
//! When a replication session ends (PostgreSQL restarted, the connection was cut, a
//! frame could not be decoded), the server re-sends every transaction after the
//! position the relay confirmed, including the transaction that was being read and
//! those whose events were produced but not all acked. The shell first lets the
//! broker answer for what is in flight (bounded), so most of those transactions end
//! up confirmed; what is left is a few transactions with some events resolved and
//! some not. Producing them all again would repeat a failure loop's duplicates on
//! every reconnect (a walsender that fails mid-way through a huge transaction would
//! make the relay re-send its first part forever).
//!
//! pgoutput decodes a transaction the same way every time, so an event is named by
//! its transaction's commit LSN (`Begin.final_lsn`) and its position among the
//! transaction's outbox rows ([`Origin`]). When a session is lost ([`Core::restart`]),
//! the guard records, for each unconfirmed transaction, how many of its events any
//! session admitted and which of those are still unresolved; in the next session the
//! core resolves an event whose name is recorded as resolved at once, without asking
//! for a produce.
//!
//! # What a lost session re-read, and what it did not reach
//!
//! A session that is lost part-way through a re-sent transaction re-read only its
//! first `n` events. Those it re-read are resolved unless they are still in flight;
//! those at or past `n` keep what the earlier sessions knew of them. Clearing their
//! unresolved marks would make a third session skip events nobody ever delivered — a
//! silent loss ([`ResendGuard::session_lost`]; the simulator replays such schedules).
//!
//! # Memory
//!
//! One entry per unconfirmed transaction with events (at most the in-flight window
//! plus one: the core prunes them as its watermark moves) plus the unresolved
//! ordinals, in memory only: after a process restart the window bound applies, and
//! after a change of server history it is forgotten (positions on another history
//! name other transactions).
//!
//! [`Core::restart`]: super::Core::restart

use std::collections::VecDeque;

use crate::hashing::{HashMap, HashSet};
use crate::lsn::Lsn;

/// An event's name that survives a resend: its transaction's commit LSN and its
/// position among that transaction's outbox rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Origin {
    /// `Begin.final_lsn` of its transaction.
    pub commit: Lsn,
    /// Its position among the transaction's outbox rows, from 0.
    pub ordinal: u32,
}

/// What lost sessions knew of one unconfirmed transaction.
#[derive(Debug, Default, Clone)]
struct Known {
    /// Events `0..admitted` were admitted by some session.
    admitted: u32,
    /// Of those, the ones not known to be resolved.
    unresolved: HashSet<u32>,
}

/// What a committed Kafka transaction made durable, in the names of [`Origin`]: the
/// progress record of `kafka.delivery = "exactly-once"` (`transactions.rs`). Every
/// event of a transaction whose commit LSN is below `confirmed` is resolved; of the
/// transactions at or after it, `partial` lists those with events resolved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProgressMark {
    /// The watermark once the transaction commits: an end LSN of a PostgreSQL
    /// transaction (or the start position), never a commit LSN of one after it.
    pub confirmed: Lsn,
    /// Transactions at or after `confirmed` with events resolved, by commit LSN.
    pub partial: Vec<PartialTx>,
}

/// One transaction of a [`ProgressMark`]: events `0..admitted` are resolved except
/// the `unresolved` ordinals; events from `admitted` on were not reached.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PartialTx {
    /// `Begin.final_lsn`.
    pub commit: Lsn,
    pub admitted: u32,
    /// Sorted.
    pub unresolved: Vec<u32>,
}

/// See the module docs.
#[derive(Debug, Default, Clone)]
pub(super) struct ResendGuard {
    /// Every event of a transaction that committed below it is resolved: the
    /// `confirmed` of the progress mark this process resumed from (zero otherwise).
    floor: Lsn,
    /// The open transaction: commit LSN and events admitted so far.
    open: Option<(Lsn, u32)>,
    /// Committed transactions with events, not yet confirmed, in commit order.
    unconfirmed: VecDeque<(Lsn, u32)>,
    /// What lost sessions left resolved, by commit LSN.
    known: HashMap<Lsn, Known>,
}

impl ResendGuard {
    /// A transaction begins (`Begin.final_lsn`).
    pub(super) fn begin(&mut self, commit: Lsn) {
        self.open = Some((commit, 0));
    }

    /// Names the next outbox row of the open transaction.
    pub(super) fn next(&mut self) -> Origin {
        let (commit, count) = self.open.get_or_insert((Lsn::ZERO, 0));
        let origin = Origin {
            commit: *commit,
            ordinal: *count,
        };
        *count = count.saturating_add(1);
        origin
    }

    /// The open transaction committed: every event of it was read in this session,
    /// so what the session resolves of it is known to the core from here on.
    pub(super) fn commit(&mut self) {
        if let Some((commit, count)) = self.open.take() {
            self.known.remove(&commit);
            if count > 0 {
                self.unconfirmed.push_back((commit, count));
            }
        }
    }

    /// Everything that committed before `confirmed` is resolved for good.
    pub(super) fn confirmed(&mut self, confirmed: Lsn) {
        while self
            .unconfirmed
            .front()
            .is_some_and(|&(commit, _)| commit < confirmed)
        {
            self.unconfirmed.pop_front();
        }
        if !self.known.is_empty() {
            self.known.retain(|&commit, _| commit >= confirmed);
        }
    }

    /// Whether a lost session (or a committed Kafka transaction of an earlier
    /// process) already resolved this event.
    pub(super) fn already_resolved(&self, origin: Origin) -> bool {
        origin.commit < self.floor
            || self.known.get(&origin.commit).is_some_and(|k| {
                origin.ordinal < k.admitted && !k.unresolved.contains(&origin.ordinal)
            })
    }

    /// What would be durable if the session ended now with `confirmed` as the
    /// watermark and only `unresolved` events in flight: the same reckoning as
    /// [`ResendGuard::session_lost`], on a copy.
    pub(super) fn mark(
        &self,
        confirmed: Lsn,
        unresolved: impl IntoIterator<Item = Origin>,
    ) -> ProgressMark {
        let mut guard = self.clone();
        let confirmed = confirmed.max(self.floor);
        guard.confirmed(confirmed);
        guard.session_lost(unresolved);
        let mut partial: Vec<PartialTx> = guard
            .known
            .into_iter()
            .filter(|(commit, k)| *commit >= confirmed && k.admitted > 0)
            .map(|(commit, k)| {
                let mut unresolved: Vec<u32> = k.unresolved.into_iter().collect();
                unresolved.sort_unstable();
                PartialTx {
                    commit,
                    admitted: k.admitted,
                    unresolved,
                }
            })
            .collect();
        partial.sort_unstable_by_key(|p| p.commit);
        ProgressMark { confirmed, partial }
    }

    /// Adds what `mark` (a committed progress record) says is durable to what this
    /// guard knows: an event is resolved when either says so. Both are facts, so
    /// merging never forgets a resolution (events poisoned after the record was
    /// written stay resolved).
    pub(super) fn merge(&mut self, mark: &ProgressMark) {
        self.floor = self.floor.max(mark.confirmed);
        for p in mark.partial.iter().filter(|p| p.commit >= self.floor) {
            let theirs = Known {
                admitted: p.admitted,
                unresolved: p.unresolved.iter().copied().collect(),
            };
            let merged = match self.known.remove(&p.commit) {
                None => theirs,
                Some(ours) => {
                    let open = |k: &Known, o: u32| o >= k.admitted || k.unresolved.contains(&o);
                    let admitted = ours.admitted.max(theirs.admitted);
                    Known {
                        admitted,
                        unresolved: (0..admitted)
                            .filter(|&o| open(&ours, o) && open(&theirs, o))
                            .collect(),
                    }
                }
            };
            self.known.insert(p.commit, merged);
        }
        let floor = self.floor;
        self.known.retain(|&commit, _| commit >= floor);
    }

    /// The session ended with `unresolved` events still in flight: remember what
    /// the unconfirmed transactions had resolved. An event this session re-read is
    /// resolved unless it is listed; one it did not reach keeps its earlier state.
    pub(super) fn session_lost(&mut self, unresolved: impl IntoIterator<Item = Origin>) {
        let mut reread: Vec<(Lsn, u32)> = self.unconfirmed.drain(..).collect();
        reread.extend(self.open.take().filter(|&(_, count)| count > 0));
        for (commit, count) in reread {
            let known = self.known.entry(commit).or_default();
            known.admitted = known.admitted.max(count);
            known.unresolved.retain(|&ordinal| ordinal >= count);
        }
        for origin in unresolved {
            if let Some(known) = self.known.get_mut(&origin.commit) {
                known.unresolved.insert(origin.ordinal);
            }
        }
    }

    /// Transactions remembered (unconfirmed in this session, or left by a lost one).
    #[cfg(test)]
    pub(super) fn remembered(&self) -> usize {
        self.unconfirmed.len() + self.known.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tx(guard: &mut ResendGuard, commit: u64, events: u32) -> Vec<Origin> {
        guard.begin(Lsn(commit));
        (0..events).map(|_| guard.next()).collect()
    }

    fn skipped(guard: &ResendGuard, origins: &[Origin]) -> Vec<bool> {
        origins.iter().map(|&o| guard.already_resolved(o)).collect()
    }

    #[test]
    fn only_the_unresolved_events_of_a_lost_session_are_produced_again() {
        let mut g = ResendGuard::default();
        let a = tx(&mut g, 100, 3);
        g.commit();
        let b = tx(&mut g, 200, 4); // open when the session is lost
        g.session_lost([a[1], b[3]]);
        // The server re-sends both transactions.
        let a2 = tx(&mut g, 100, 3);
        assert_eq!(a2, a, "the same names");
        assert_eq!(skipped(&g, &a2), [true, false, true]);
        g.commit();
        let b2 = tx(&mut g, 200, 5);
        assert_eq!(
            skipped(&g, &b2),
            [true, true, true, false, false],
            "events past what was read are new"
        );
    }

    #[test]
    fn a_second_loss_keeps_what_the_first_left_resolved() {
        let mut g = ResendGuard::default();
        tx(&mut g, 100, 4);
        g.session_lost([]);
        // Second session: reads two events (both skipped), then is lost again.
        let again = tx(&mut g, 100, 2);
        assert!(again.iter().all(|&o| g.already_resolved(o)));
        g.session_lost([]);
        let third = tx(&mut g, 100, 4);
        assert!(third.iter().all(|&o| g.already_resolved(o)));
    }

    #[test]
    fn a_session_lost_before_reaching_unresolved_events_keeps_them_unresolved() {
        let mut g = ResendGuard::default();
        // Session 1 admits four events; 2 and 3 are still unresolved when it is lost.
        let first = tx(&mut g, 100, 4);
        g.session_lost([first[2], first[3]]);
        // Session 2 re-reads two events (resolved: skipped) and is lost before 2 and 3.
        let second = tx(&mut g, 100, 2);
        assert!(second.iter().all(|&o| g.already_resolved(o)));
        g.session_lost([]);
        // Session 3 must produce 2 and 3: nobody ever delivered them.
        let third = tx(&mut g, 100, 4);
        assert_eq!(skipped(&g, &third), [true, true, false, false]);
    }

    #[test]
    fn an_event_resolved_by_a_later_session_is_skipped_after_the_next_loss() {
        let mut g = ResendGuard::default();
        let first = tx(&mut g, 100, 3);
        g.session_lost([first[1], first[2]]);
        // Session 2 re-reads all three: 1 is delivered this time, 2 is not.
        let second = tx(&mut g, 100, 3);
        assert_eq!(skipped(&g, &second), [true, false, false]);
        g.session_lost([second[2]]);
        let third = tx(&mut g, 100, 3);
        assert_eq!(skipped(&g, &third), [true, true, false]);
    }

    #[test]
    fn confirmed_transactions_are_forgotten() {
        let mut g = ResendGuard::default();
        let a = tx(&mut g, 100, 1);
        g.commit();
        tx(&mut g, 200, 1);
        g.commit();
        g.confirmed(Lsn(150));
        g.session_lost([]);
        assert!(!g.already_resolved(a[0]), "confirmed: never re-sent");
        let b = Origin {
            commit: Lsn(200),
            ordinal: 0,
        };
        assert!(g.already_resolved(b));
        g.confirmed(Lsn(300));
        assert!(!g.already_resolved(b));
        assert_eq!(g.remembered(), 0);
    }
}
