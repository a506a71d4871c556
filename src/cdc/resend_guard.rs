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
//! transaction's outbox rows. At a session loss this guard records, for each
//! unconfirmed transaction, how many events had been admitted and which of them were
//! still unresolved; in the next session an event whose name is recorded as resolved
//! is confirmed at once instead of produced. The memory is one entry per unconfirmed
//! transaction with events (at most the in-flight window) plus the unresolved
//! positions, and it is only in memory: after a process restart the window bound
//! applies, and after a change of server history it is forgotten (positions on another
//! history name other transactions).

use std::collections::{HashMap, HashSet, VecDeque};

use crate::lsn::Lsn;

/// An event's name that survives a resend: its transaction's commit LSN and its
/// position among that transaction's outbox rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Origin {
    pub(crate) commit: Lsn,
    pub(crate) ordinal: u32,
}

#[derive(Debug, Default)]
struct Resolved {
    admitted: u32,
    unresolved: HashSet<u32>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct ResendGuard {
    /// The open transaction: commit LSN and events admitted so far.
    open: Option<(Lsn, u32)>,
    /// Committed transactions with events, not yet confirmed, in commit order.
    unconfirmed: VecDeque<(Lsn, u32)>,
    /// What lost sessions left resolved, by commit LSN.
    resolved: HashMap<Lsn, Resolved>,
}

impl ResendGuard {
    /// A transaction begins (`Begin.final_lsn`).
    pub(crate) fn begin(&mut self, commit: Lsn) {
        self.open = Some((commit, 0));
    }

    /// Names the next outbox row of the open transaction.
    pub(crate) fn next(&mut self) -> Origin {
        let (commit, count) = self.open.get_or_insert((Lsn::ZERO, 0));
        let origin = Origin {
            commit: *commit,
            ordinal: *count,
        };
        *count = count.saturating_add(1);
        origin
    }

    /// The open transaction committed: its resend (if it was one) is complete.
    pub(crate) fn commit(&mut self) {
        if let Some((commit, count)) = self.open.take() {
            self.resolved.remove(&commit);
            if count > 0 {
                self.unconfirmed.push_back((commit, count));
            }
        }
    }

    /// Everything that committed before `confirmed` is resolved for good.
    pub(crate) fn confirmed(&mut self, confirmed: Lsn) {
        while self
            .unconfirmed
            .front()
            .is_some_and(|&(commit, _)| commit < confirmed)
        {
            self.unconfirmed.pop_front();
        }
        if !self.resolved.is_empty() {
            self.resolved.retain(|&commit, _| commit >= confirmed);
        }
    }

    /// Whether a lost session already resolved this event.
    pub(crate) fn already_resolved(&self, origin: Origin) -> bool {
        self.resolved
            .get(&origin.commit)
            .is_some_and(|r| origin.ordinal < r.admitted && !r.unresolved.contains(&origin.ordinal))
    }

    /// The session ended with `unresolved` events still in flight: remember what
    /// the unconfirmed transactions had resolved.
    pub(crate) fn session_lost(&mut self, unresolved: impl IntoIterator<Item = Origin>) {
        let mut txs: Vec<(Lsn, u32)> = self.unconfirmed.drain(..).collect();
        txs.extend(self.open.take().filter(|&(_, count)| count > 0));
        for (commit, count) in txs {
            let entry = self.resolved.entry(commit).or_default();
            entry.admitted = entry.admitted.max(count);
            // Resolved by an earlier session and skipped in this one: still resolved.
            entry.unresolved.clear();
        }
        for origin in unresolved {
            if let Some(entry) = self.resolved.get_mut(&origin.commit) {
                entry.unresolved.insert(origin.ordinal);
            }
        }
    }

    /// The server history changed: positions name other transactions now.
    pub(crate) fn forget(&mut self) {
        *self = ResendGuard::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tx(guard: &mut ResendGuard, commit: u64, events: u32) -> Vec<Origin> {
        guard.begin(Lsn(commit));
        (0..events).map(|_| guard.next()).collect()
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
        let skipped: Vec<bool> = a2.iter().map(|&o| g.already_resolved(o)).collect();
        assert_eq!(skipped, [true, false, true]);
        g.commit();
        let b2 = tx(&mut g, 200, 5);
        let skipped: Vec<bool> = b2.iter().map(|&o| g.already_resolved(o)).collect();
        assert_eq!(
            skipped,
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
    fn confirmed_transactions_are_forgotten() {
        let mut g = ResendGuard::default();
        let a = tx(&mut g, 100, 1);
        g.commit();
        tx(&mut g, 200, 1);
        g.commit();
        g.confirmed(Lsn(150));
        g.session_lost([]);
        assert!(!g.already_resolved(a[0]), "confirmed: never re-sent");
        assert!(g.already_resolved(Origin {
            commit: Lsn(200),
            ordinal: 0
        }));
        g.confirmed(Lsn(300));
        assert!(!g.already_resolved(Origin {
            commit: Lsn(200),
            ordinal: 0
        }));
        g.forget();
        assert!(g.resolved.is_empty() && g.unconfirmed.is_empty());
    }
}
