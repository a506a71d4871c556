//! Which transactions a progress record names, so that a server restored in place
//! and written past the record is not taken for the one the record was written on.
//!
//! # Why
//!
//! Under `kafka.delivery = "exactly-once"` a new session resumes from the last
//! committed progress record (`cdc::exactly_once`): every event of a transaction
//! that committed below its watermark, and the resolved events of its partial
//! transactions, are resolved without a produce when the server sends them again.
//! Those transactions are named by LSN, and a data directory restored in place (a
//! storage snapshot rolled back: same system identifier and timeline) hands the
//! same LSNs out again to new commits. Two signs catch most restores: a session
//! that starts below the position the relay had saved when it wrote the record, and
//! a server whose WAL ends before the watermark. A restore that landed between the
//! saved position and the watermark and was then written past the watermark before
//! the relay came back shows neither: its new commits would be resolved as the
//! record's, without a produce, and lost.
//!
//! # How
//!
//! The record also names the transactions by what a restore cannot hand out again:
//! the xid and the commit time of the transaction that ends at the watermark and of
//! each partial transaction, from their `Begin` messages
//! ([`Begin`](https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html)).
//! A restored server reuses xids (its counter went back too), but the commit that
//! takes one again does so at another time. At a session start on the record's own
//! timeline, the relay asks the server for those xids' commit times
//! (`pg_xact_commit_timestamp`, which needs `track_commit_timestamp = on`): any that
//! differs, or that the server does not know, means the record is not this WAL's,
//! and it is not used (its events may be published again; none is lost). Without
//! `track_commit_timestamp` the server cannot say, and the record is used as before
//! (a warning says what that cannot catch).

use std::collections::VecDeque;

use tokio_postgres::Client;

use crate::lsn::Lsn;

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01 UTC), in which
/// `Begin.commit_time` counts.
const POSTGRES_EPOCH_US: i64 = 946_684_800_000_000;

/// Transactions remembered at most: past it the oldest are forgotten, and a record
/// whose watermark is one of them names none (it is used as before).
const MAX_REMEMBERED: usize = 1 << 16;

/// A transaction as its `Begin` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxIdentity {
    pub xid: u32,
    /// Its commit time, in microseconds since the Unix epoch.
    pub committed_us: i64,
}

impl TxIdentity {
    /// From a `Begin` message's xid and commit time (microseconds since 2000-01-01);
    /// `None` for a commit time of 0 (a transaction replayed with a replication
    /// origin but no origin timestamp: the stored commit time is another).
    #[must_use]
    pub fn from_begin(xid: u32, commit_time: i64) -> Option<TxIdentity> {
        (commit_time != 0).then(|| TxIdentity {
            xid,
            committed_us: commit_time.saturating_add(POSTGRES_EPOCH_US),
        })
    }
}

/// One transaction the stream delivered: its commit LSN (`Begin.final_lsn`), its
/// end LSN once its `Commit` came, and its identity.
#[derive(Debug, Clone, Copy)]
struct Seen {
    commit: Option<Lsn>,
    end: Option<Lsn>,
    identity: TxIdentity,
}

/// The identities of the transactions a progress record may name: those the
/// session delivered that end at or after the confirmed position (every later
/// record's watermark is at or above it), in stream order.
#[derive(Debug, Default)]
pub(crate) struct TxLog {
    seen: VecDeque<Seen>,
}

impl TxLog {
    /// A session starts: what the last one saw may be sent again, or be another
    /// WAL's (a restore, another history); the record read next is remembered.
    pub(crate) fn clear(&mut self) {
        self.seen.clear();
    }

    /// A `Begin` (`None`: a transaction that cannot be named).
    pub(crate) fn begin(&mut self, commit: Lsn, identity: Option<TxIdentity>) {
        let Some(identity) = identity else {
            return;
        };
        if self.seen.len() >= MAX_REMEMBERED {
            self.seen.pop_front();
        }
        self.seen.push_back(Seen {
            commit: Some(commit),
            end: None,
            identity,
        });
    }

    /// The `Commit` of the transaction committing at `commit`; forgets what ended
    /// before `confirmed` (the slot's confirmed position: no record names it).
    pub(crate) fn commit(&mut self, commit: Lsn, end: Lsn, confirmed: Lsn) {
        if let Some(seen) = self
            .seen
            .iter_mut()
            .rev()
            .find(|s| s.commit == Some(commit))
        {
            seen.end = Some(end);
        }
        while self.seen.front().is_some_and(|s| match s.end {
            Some(end) => end < confirmed,
            None => s.commit.is_some_and(|c| c < confirmed),
        }) {
            self.seen.pop_front();
        }
    }

    /// The transaction that ends at `end` (a watermark), if remembered.
    pub(crate) fn ending_at(&self, end: Lsn) -> Option<TxIdentity> {
        self.seen
            .iter()
            .rev()
            .find(|s| s.end == Some(end))
            .map(|s| s.identity)
    }

    /// The transaction that commits at `commit`, if remembered.
    pub(crate) fn committing_at(&self, commit: Lsn) -> Option<TxIdentity> {
        self.seen
            .iter()
            .rev()
            .find(|s| s.commit == Some(commit))
            .map(|s| s.identity)
    }

    /// Remembers what a record used at a session start names (its watermark is
    /// `confirmed`): the next record may name the same transactions before the
    /// stream reaches new ones.
    pub(crate) fn remember(&mut self, confirmed: Lsn, names: &TxNames) {
        if let Some(identity) = names.watermark {
            self.seen.push_back(Seen {
                commit: None,
                end: Some(confirmed),
                identity,
            });
        }
        for &(commit, identity) in &names.partial {
            self.seen.push_back(Seen {
                commit: Some(commit),
                end: None,
                identity,
            });
        }
    }
}

/// The identities of the transactions a progress record's mark names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TxNames {
    /// The transaction that ends at the mark's watermark (`confirmed`).
    pub watermark: Option<TxIdentity>,
    /// Partial transactions, by commit LSN.
    pub partial: Vec<(Lsn, TxIdentity)>,
}

impl TxNames {
    /// The identities a session starting at `start` is sent again: the watermark
    /// transaction when the watermark (`confirmed`) is past `start`, the partial
    /// ones committing at or after it. Those before were read before `start`, and
    /// their commit times may no longer be kept.
    fn past(&self, confirmed: Lsn, start: Lsn) -> Vec<TxIdentity> {
        self.watermark
            .filter(|_| confirmed > start)
            .into_iter()
            .chain(
                self.partial
                    .iter()
                    .filter(|(commit, _)| *commit >= start)
                    .map(|(_, id)| *id),
            )
            .collect()
    }
}

/// What the server says of the transactions a record names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Each committed at the recorded time: the record is this WAL's.
    Same,
    /// This xid did not commit at the recorded time (another time, or not at all
    /// as far as the server knows): the WAL is another, restored in place.
    Other { xid: u32 },
    /// The server cannot say: `track_commit_timestamp` is off, or an xid committed
    /// without a kept commit time (before the setting was turned on).
    Unknown,
}

/// Asks the server when each transaction `names` names past `start` committed (the
/// record's watermark is `confirmed`).
///
/// # Errors
///
/// A failed query other than the server refusing for lack of
/// `track_commit_timestamp` (that is [`Verdict::Unknown`]).
pub(crate) async fn check(
    metadata: &Client,
    names: &TxNames,
    confirmed: Lsn,
    start: Lsn,
) -> Result<Verdict, tokio_postgres::Error> {
    let expected = names.past(confirmed, start);
    if expected.is_empty() {
        return Ok(Verdict::Same);
    }
    // 0, 1 and 2 are no transaction's (the server refuses to be asked about 0): a
    // record naming one is not this server's WAL.
    if let Some(special) = expected.iter().find(|id| id.xid < 3) {
        return Ok(Verdict::Other { xid: special.xid });
    }
    let xids: Vec<String> = expected.iter().map(|id| id.xid.to_string()).collect();
    // A commit time the server does not keep is told from a transaction it never
    // committed by the xid's status, its 64-bit form taken in the epoch of the next
    // xid (one above the next is from the epoch before: too old to know, or never
    // assigned).
    let rows = metadata
        .query(
            "WITH next AS (SELECT pg_snapshot_xmax(pg_current_snapshot())::text::int8 AS n),
                  asked AS (SELECT t.x, t.i, (next.n & ~4294967295::int8) | t.x::int8 AS full_xid, next.n
                            FROM next, unnest($1::text[]) WITH ORDINALITY AS t(x, i))
             SELECT (extract(epoch FROM pg_xact_commit_timestamp(x::xid)) * 1000000)::int8,
                    pg_xact_status((CASE WHEN full_xid < n THEN full_xid
                                         WHEN full_xid >= 4294967296 THEN full_xid - 4294967296
                                    END)::text::xid8) = 'committed'
             FROM asked ORDER BY i",
            &[&xids],
        )
        .await;
    let rows = match rows {
        Ok(rows) => rows,
        // "could not get commit timestamp data": track_commit_timestamp is off.
        Err(e)
            if e.code()
                == Some(&tokio_postgres::error::SqlState::OBJECT_NOT_IN_PREREQUISITE_STATE) =>
        {
            return Ok(Verdict::Unknown);
        }
        Err(e) => return Err(e),
    };
    let mut answers = Vec::with_capacity(rows.len());
    for row in &rows {
        answers.push(Answer {
            committed_us: row.try_get(0)?,
            committed: row.try_get::<_, Option<bool>>(1)?.unwrap_or(false),
        });
    }
    Ok(judge(&expected, &answers))
}

/// [`check`]'s verdict from a server whose answers are known without asking it
/// (the whole-relay simulation's): `committed_at(xid)` is the commit time it keeps
/// (µs since the Unix epoch), `None` for an xid it never committed.
#[cfg(test)]
pub(crate) fn verdict_of(
    names: &TxNames,
    confirmed: Lsn,
    start: Lsn,
    committed_at: impl Fn(u32) -> Option<i64>,
) -> Verdict {
    let expected = names.past(confirmed, start);
    let answers: Vec<Answer> = expected
        .iter()
        .map(|id| Answer {
            committed_us: committed_at(id.xid),
            committed: committed_at(id.xid).is_some(),
        })
        .collect();
    judge(&expected, &answers)
}

/// What the server said of one xid.
#[derive(Debug, Clone, Copy)]
struct Answer {
    /// Its commit time, if kept.
    committed_us: Option<i64>,
    /// `pg_xact_status` says it committed.
    committed: bool,
}

/// [`check`]'s verdict from the server's answers, in the same order: a commit time
/// that differs, or none for an xid that did not commit, is another WAL's; none for
/// a committed xid cannot be told.
fn judge(expected: &[TxIdentity], answers: &[Answer]) -> Verdict {
    let mut unknown = false;
    for (i, identity) in expected.iter().enumerate() {
        match answers.get(i) {
            Some(Answer {
                committed_us: Some(at),
                ..
            }) if *at == identity.committed_us => {}
            Some(Answer {
                committed_us: None,
                committed: true,
            }) => unknown = true,
            _ => return Verdict::Other { xid: identity.xid },
        }
    }
    if unknown {
        Verdict::Unknown
    } else {
        Verdict::Same
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(xid: u32, committed_us: i64) -> TxIdentity {
        TxIdentity { xid, committed_us }
    }

    #[test]
    fn a_begin_counts_from_postgres_epoch() {
        // 2000-01-01 00:00:01 UTC.
        assert_eq!(
            TxIdentity::from_begin(7, 1_000_000).map(|id| id.committed_us),
            Some(946_684_801_000_000)
        );
        // A transaction replayed with an origin but no origin timestamp.
        assert_eq!(TxIdentity::from_begin(7, 0), None);
    }

    #[test]
    fn the_log_names_the_watermark_and_the_partial_transactions() {
        let mut log = TxLog::default();
        log.begin(Lsn(100), Some(id(1, 10)));
        log.commit(Lsn(100), Lsn(120), Lsn(0));
        log.begin(Lsn(200), Some(id(2, 20)));
        log.commit(Lsn(200), Lsn(220), Lsn(0));
        log.begin(Lsn(300), Some(id(3, 30)));
        assert_eq!(log.ending_at(Lsn(220)), Some(id(2, 20)));
        assert_eq!(log.ending_at(Lsn(200)), None, "a commit LSN is no end");
        assert_eq!(log.committing_at(Lsn(300)), Some(id(3, 30)));
        // The slot confirmed 220: what ended before it is forgotten.
        log.commit(Lsn(300), Lsn(320), Lsn(220));
        assert_eq!(log.ending_at(Lsn(120)), None);
        assert_eq!(log.ending_at(Lsn(220)), Some(id(2, 20)));
        assert_eq!(log.ending_at(Lsn(320)), Some(id(3, 30)));
        log.clear();
        assert_eq!(log.ending_at(Lsn(320)), None);
    }

    #[test]
    fn a_remembered_record_names_the_same_transactions_again() {
        let names = TxNames {
            watermark: Some(id(2, 20)),
            partial: vec![(Lsn(300), id(3, 30))],
        };
        let mut log = TxLog::default();
        log.remember(Lsn(220), &names);
        assert_eq!(log.ending_at(Lsn(220)), Some(id(2, 20)));
        assert_eq!(log.committing_at(Lsn(300)), Some(id(3, 30)));
        assert_eq!(log.committing_at(Lsn(220)), None);
    }

    #[test]
    fn a_restored_server_is_told_by_its_commit_times() {
        let at = |us| Answer {
            committed_us: Some(us),
            committed: true,
        };
        let none = |committed| Answer {
            committed_us: None,
            committed,
        };
        let expected = [id(1000, 5_000), id(1001, 6_000)];
        assert_eq!(judge(&expected, &[at(5_000), at(6_000)]), Verdict::Same);
        // The xid went to a new commit after the restore, at another time.
        assert_eq!(
            judge(&expected, &[at(5_000), at(9_999)]),
            Verdict::Other { xid: 1001 }
        );
        // Not (yet) committed on this server.
        assert_eq!(
            judge(&expected, &[none(false), at(6_000)]),
            Verdict::Other { xid: 1000 }
        );
        // Committed, its time not kept (before the setting was turned on).
        assert_eq!(judge(&expected, &[none(true), at(6_000)]), Verdict::Unknown);
        assert_eq!(
            judge(&expected, &[none(true), at(1)]),
            Verdict::Other { xid: 1001 }
        );
        assert_eq!(judge(&[], &[]), Verdict::Same);
    }

    #[test]
    fn only_what_the_session_is_sent_again_is_asked() {
        let names = TxNames {
            watermark: Some(id(2, 20)),
            partial: vec![(Lsn(150), id(1, 15)), (Lsn(300), id(3, 30))],
        };
        assert_eq!(names.past(Lsn(220), Lsn(200)), [id(2, 20), id(3, 30)]);
        assert_eq!(names.past(Lsn(220), Lsn(220)), [id(3, 30)]);
        assert_eq!(
            names.past(Lsn(220), Lsn(100)),
            [id(2, 20), id(1, 15), id(3, 30)]
        );
    }
}
