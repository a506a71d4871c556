//! Poison rows a server may not have (a promoted standby, a restore): why an
//! exactly-once progress record names the events the relay poisoned, and how a
//! session uses the list.
//!
//! # Why
//!
//! Under `kafka.delivery = "exactly-once"` the progress record, in Kafka, says which
//! events are resolved, delivered or poisoned (`cdc::exactly_once`); a poisoned
//! event's row is in PostgreSQL (`poison_outbox`). A failover separates the two: an
//! asynchronous standby promoted after the primary died has the WAL it replayed, not
//! necessarily a poison row the relay committed shortly before the end. The record,
//! cut at the fork (`exactly_once::mark_on`), still named such an event resolved, and
//! the session on the new primary skipped it: neither published nor poisoned. The
//! whole-relay simulation found it once its world promoted lagging standbys
//! (`cdc::simulation`). At-least-once has no such gap: its position row is in the
//! same WAL as the poison rows.
//!
//! # Which events are at risk
//!
//! The relay saves a position only past resolved events, so an event's poison row
//! commits before any save past the event, earlier in the WAL. The position row a
//! promoted server replayed is therefore past no event whose poison row it lacks:
//! the events at risk have a commit LSN at or after it, and a session on the
//! promoted server starts at or below it (the start plan resumes from a synced slot
//! no further than the replayed position, `cdc::start`).
//!
//! # What the record carries, and what a session does with it
//!
//! The names (commit LSN and ordinal, [`Origin`](crate::cdc::progress::Origin)) of
//! the events the relay poisoned whose commit is at or after `since`: at most
//! [`MAX_LISTED`], the oldest dropped first (which raises `since`), carried from
//! record to record across sessions ([`PoisonedEvents::carried`]), with the names of
//! the server's poison rows from the record's watermark on added at each session
//! start (the record's writer may have poisoned events after its last record: a
//! record is written only with events in it). A session that resumes from a record
//! ([`guard`], at every start: a data directory restored from before a poison row
//! lacks it just as a promoted standby does):
//!
//! * with `since` at or below its start, every event at risk is listed: the first
//!   listed one the record resolves whose poison row this server does not have cuts
//!   the mark just below it. It and the events after it are sent again:
//!   duplicates, only after such a failover or restore, never a loss;
//! * with `since` above its start (the list overflowed, or a record of a relay that
//!   kept none), the mark is cut at the start: the events the record named past it
//!   are published again.
//!
//! A listed event counts as held when this server has a poison row of its name
//! (`RecordedPoison::holds`). A resync's or a cutover's rows carry the slot's
//! consistent point as their LSN and a backlog ordinal: a streamed event's name
//! matches one only if its transaction's commit record starts exactly at that
//! point, and such an event would be taken for held. That one case is not covered
//! (comparing the rows' occurrence keys would cover it, at the cost of carrying
//! them in the record).

use crate::cdc::progress::ProgressMark;
use crate::hashing::HashSet;
use crate::lsn::Lsn;

/// Most names a record carries (about 40 bytes each in its JSON).
pub const MAX_LISTED: usize = 1024;

/// The events the relay poisoned: every one whose commit is at or after `since`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoisonedEvents {
    /// `None`: not known (a record written before the list existed).
    pub since: Option<Lsn>,
    /// `(commit, ordinal)`, in the order they were poisoned.
    pub events: Vec<(Lsn, u32)>,
}

impl PoisonedEvents {
    /// Nothing poisoned at or after `start` yet: a session without a record it
    /// uses streams nothing below its start.
    #[must_use]
    pub fn from_start(start: Lsn) -> PoisonedEvents {
        PoisonedEvents {
            since: Some(start),
            events: Vec::new(),
        }
    }

    /// The event named `(commit, ordinal)` is poisoned (its row committed).
    pub fn push(&mut self, commit: Lsn, ordinal: u32) {
        if self.since.is_some_and(|since| commit < since) {
            return;
        }
        self.events.push((commit, ordinal));
        if self.events.len() > MAX_LISTED {
            let (oldest, _) = self.events.remove(0);
            let since = self.since.unwrap_or(Lsn::ZERO).max(Lsn(oldest.0 + 1));
            self.since = Some(since);
            self.events.retain(|(commit, _)| *commit >= since);
        }
    }

    /// The list a session starting at `start` goes on from, out of a record it
    /// resumes from whose `mark` holds here (`fork`: where the record's timeline
    /// ended, on a promoted server), and the names of this server's poison rows
    /// from [`read_from`] on (`complete`: all of them). The record's writer may
    /// have poisoned events after its last record (a record is written only with
    /// events in it) and saved a position past them, which this session starts
    /// from and its records will name resolved: their rows are among those read.
    /// A record without a list says nothing below what it resolves; a read that
    /// was not complete lists nothing below `start`.
    #[must_use]
    pub fn carried(
        &self,
        mark: &ProgressMark,
        start: Lsn,
        fork: Option<Lsn>,
        rows: impl Iterator<Item = (Lsn, u32)>,
        complete: bool,
    ) -> PoisonedEvents {
        let fork = fork.unwrap_or(Lsn(u64::MAX));
        let mut since = self.since.unwrap_or_else(|| top(mark));
        if !complete {
            since = since.max(start);
        }
        let keep = |commit: Lsn| commit >= since && commit < fork;
        let listed: HashSet<(Lsn, u32)> = self.events.iter().copied().collect();
        let mut read: Vec<(Lsn, u32)> = rows
            .filter(|(commit, _)| keep(*commit))
            .filter(|name| !listed.contains(name))
            .collect();
        read.sort_unstable();
        let mut carried = PoisonedEvents {
            since: Some(since),
            events: Vec::new(),
        };
        let names = self
            .events
            .iter()
            .copied()
            .filter(|(commit, _)| keep(*commit));
        for (commit, ordinal) in names.chain(read) {
            carried.push(commit, ordinal);
        }
        carried
    }
}

/// Where a session starting at `start` reads this server's poison rows from, for a
/// record whose mark is `mark`: from the record's watermark (what the writer
/// resolved after the record is at or past it), or the start if lower.
#[must_use]
pub fn read_from(mark: &ProgressMark, start: Lsn) -> Lsn {
    mark.confirmed.min(start)
}

/// What a session starting at `start` may resume from, out of `mark` (the record's,
/// cut at the fork on a promoted server) and the record's `listed` events;
/// `holds(commit, ordinal)` says whether this server has the event's poison row.
/// Returns the mark and, when it was cut, where.
#[must_use]
pub fn guard(
    mark: ProgressMark,
    listed: &PoisonedEvents,
    start: Lsn,
    holds: impl Fn(Lsn, u32) -> bool,
) -> (ProgressMark, Option<Lsn>) {
    if listed.since.is_none_or(|since| since > start) {
        return (cut(mark, start), Some(start));
    }
    let first = listed
        .events
        .iter()
        .filter(|&&(commit, ordinal)| {
            commit >= start && resolves(&mark, commit, ordinal) && !holds(commit, ordinal)
        })
        .map(|&(commit, _)| commit)
        .min();
    match first {
        Some(commit) => (cut(mark, commit), Some(commit)),
        None => (mark, None),
    }
}

/// `mark` without what it says of transactions committing at or after `below`.
fn cut(mark: ProgressMark, below: Lsn) -> ProgressMark {
    ProgressMark {
        confirmed: mark.confirmed.min(below),
        partial: mark
            .partial
            .into_iter()
            .filter(|p| p.commit < below)
            .collect(),
    }
}

/// Whether `mark` names the event `(commit, ordinal)` resolved.
fn resolves(mark: &ProgressMark, commit: Lsn, ordinal: u32) -> bool {
    commit < mark.confirmed
        || mark
            .partial
            .iter()
            .any(|p| p.commit == commit && ordinal < p.admitted && !p.unresolved.contains(&ordinal))
}

/// Past every transaction `mark` says anything of.
fn top(mark: &ProgressMark) -> Lsn {
    mark.partial
        .iter()
        .map(|p| Lsn(p.commit.0 + 1))
        .fold(mark.confirmed, Lsn::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdc::progress::PartialTx;

    fn mark() -> ProgressMark {
        ProgressMark {
            confirmed: Lsn(500),
            partial: vec![PartialTx {
                commit: Lsn(520),
                admitted: 3,
                unresolved: vec![1],
            }],
        }
    }

    fn listed(since: u64, events: &[(u64, u32)]) -> PoisonedEvents {
        PoisonedEvents {
            since: Some(Lsn(since)),
            events: events.iter().map(|&(c, o)| (Lsn(c), o)).collect(),
        }
    }

    #[test]
    fn a_listed_event_whose_row_the_server_lacks_cuts_the_mark_below_it() {
        let events = listed(100, &[(300, 0), (450, 2), (520, 0)]);
        // The row of 300/0 was replayed, that of 450/2 was not.
        let (cut, at) = guard(mark(), &events, Lsn(200), |c, o| (c, o) == (Lsn(300), 0));
        assert_eq!(at, Some(Lsn(450)));
        assert_eq!(cut.confirmed, Lsn(450));
        assert!(cut.partial.is_empty());
    }

    #[test]
    fn rows_the_server_has_keep_the_mark_whole() {
        // 520/2 is resolved by the mark (1 is its transaction's unresolved one); the
        // server has both rows.
        let events = listed(100, &[(300, 0), (520, 2)]);
        let (kept, at) = guard(mark(), &events, Lsn(200), |_, _| true);
        assert_eq!(at, None);
        assert_eq!(kept, mark());
        // An event the mark does not resolve, or one below the start, cuts nothing.
        let events = listed(100, &[(150, 0), (520, 1), (600, 0)]);
        let (kept, at) = guard(mark(), &events, Lsn(200), |_, _| false);
        assert_eq!((kept, at), (mark(), None));
    }

    #[test]
    fn a_list_that_does_not_reach_down_to_the_start_cuts_at_the_start() {
        let (cut, at) = guard(mark(), &listed(250, &[]), Lsn(200), |_, _| true);
        assert_eq!(at, Some(Lsn(200)));
        assert_eq!(cut.confirmed, Lsn(200));
        let unknown = PoisonedEvents::default();
        assert_eq!(
            guard(mark(), &unknown, Lsn(200), |_, _| true).1,
            Some(Lsn(200))
        );
    }

    #[test]
    fn the_list_keeps_the_newest_and_says_from_where() {
        let mut events = PoisonedEvents::from_start(Lsn(10));
        events.push(Lsn(5), 0);
        assert!(events.events.is_empty(), "below since: never at risk");
        for i in 0..=MAX_LISTED as u64 {
            events.push(Lsn(100 + i), 0);
        }
        assert_eq!(events.events.len(), MAX_LISTED);
        assert_eq!(events.since, Some(Lsn(101)));
        assert_eq!(events.events.first(), Some(&(Lsn(101), 0)));
    }

    #[test]
    fn carried_across_a_fork_and_from_a_record_without_a_list() {
        let events = listed(100, &[(150, 0), (300, 0), (700, 1)]);
        // The server's rows add what the record's writer poisoned after it (560/0);
        // past the fork nothing is kept.
        let rows = [(Lsn(560), 0), (Lsn(300), 0), (Lsn(650), 2)];
        let carried = events.carried(&mark(), Lsn(200), Some(Lsn(600)), rows.into_iter(), true);
        assert_eq!(carried, listed(100, &[(150, 0), (300, 0), (560, 0)]));
        // A read that did not find everything: nothing below the start.
        let carried = events.carried(&mark(), Lsn(200), None, std::iter::empty(), false);
        assert_eq!(carried, listed(200, &[(300, 0), (700, 1)]));
        // No list: nothing is known below what the record resolves.
        let carried =
            PoisonedEvents::default().carried(&mark(), Lsn(200), None, std::iter::empty(), true);
        assert_eq!(carried, listed(521, &[]));
        assert_eq!(read_from(&mark(), Lsn(200)), Lsn(200));
        assert_eq!(read_from(&mark(), Lsn(800)), Lsn(500));
    }
}
