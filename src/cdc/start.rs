//! Where a replication session starts, decided from three witnesses that can each
//! be wrong: the slot, the relay's recorded position (`outbox_relay_position`), and
//! what this process confirmed before a reconnect.
//!
//! # The rules
//!
//! * **A position is meaningful only on its own WAL history** (system identifier and
//!   timeline). After a failover to another timeline or cluster, the recorded and
//!   in-memory positions may name WAL the new server never had; the session starts
//!   from the new server's slot and confirms nothing that slot has not streamed again
//!   (duplicates are possible, a gap is not).
//! * **After a promotion, only a slot synced from the old primary is trusted.** A slot
//!   synced to a standby (PostgreSQL 17's failover slots, or an HA manager's copy)
//!   carries what the old primary's slot had confirmed, so it is at or behind both
//!   the relay's recorded position (the relay never confirms past it) and the point
//!   where the new timeline forked off the recorded one (`TIMELINE_HISTORY`: a
//!   standby cannot have streamed past the WAL it replayed). A slot past either was
//!   created or advanced on the promoted server — by an operator or an HA manager
//!   re-creating "the slot the relay needs" — and the rows between the fork and it
//!   were never streamed: it is lost ([`SlotLoss::NotSynced`]). Positions of another
//!   cluster (another system identifier) cannot be compared; its slot is trusted.
//! * **On the same history, the highest position known to be fully delivered wins.**
//!   The slot rewinds after a PostgreSQL restart (before 17 its confirmed LSN is saved
//!   only at checkpoints); the recorded position does not. Starting above the slot's
//!   confirmed LSN makes the server skip every transaction that committed before it.
//! * **A slot ahead of every position this relay recorded was not moved by it**: the
//!   shell never confirms past the recorded position (`outbox::position`), so the slot
//!   was re-created or advanced by someone else, and the rows between are unknown.
//!   That, a missing slot and an invalidated one are the same condition: the slot is
//!   lost. It is never handled silently: with `relay.on_slot_loss = "resync"` the
//!   relay publishes the rows committed since its recorded position before streaming
//!   (`cdc::resync`); with `"fail"` it stops with exit code 3.
//! * **No recorded position** is a first start: the slot is created (with the cutover
//!   from a poller when configured), or an existing one adopted at its own position,
//!   exactly as before positions existed.
//! * **A slot another process streams from is never judged.** Its position moves while
//!   we look: the relay that streams from it saves a position, then confirms it, so a
//!   standby that read the saved position first and the slot second could see the slot
//!   "ahead" and call it lost (an exit 3, or a resync that marks the position row lost
//!   under the active relay's feet). So the shell reads the slot *first* and the saved
//!   position second (the slot can then only be behind), and an active slot is
//!   `StartPlan::Busy`: wait for it, then decide.
//! * **A position past the server's WAL end names WAL the server no longer has.** A
//!   data directory restored in place (a snapshot, a crash-recovered older copy) keeps
//!   its system identifier and timeline, but its WAL ends before what this process
//!   confirmed; new commits take LSNs below that and would be skipped. So what the
//!   process remembers counts only while it is at or below the server's current WAL
//!   flush position (`IDENTIFY_SYSTEM`'s `xlogpos`); past it, nothing the process
//!   remembers of positions is kept and the start is the recorded position, which was
//!   restored with the WAL. Not the server's WAL end either: commits made after the
//!   restore and before the relay reconnects lie below it, and the restored WAL is a
//!   prefix of what the relay read only up to the (unknown) restore point. A recorded
//!   position past the WAL end belongs to another history.
//! * **A saved position that went back names a restore too.** A restored server may
//!   have written past the remembered position before the relay reconnects (the
//!   relay was down a while, writers were not), so the WAL end alone cannot tell.
//!   The position row can: nothing on one history moves it back (saves take the
//!   greater value, a resync moves it forward), so a row below what this process
//!   itself saved there was restored with the data. Then, too, nothing the process
//!   remembers is kept. (A server that lost commits without a restore, with
//!   `synchronous_commit = off`, looks the same: the start is then earlier than
//!   needed, duplicates and no gap.)
//! * **What the process remembers holds for the server it streamed from only.** It
//!   may have confirmed past its last save (saves trail by a save interval); if the
//!   data directory was restored to a point inside that stretch, the row matches the
//!   last save and the WAL end may already be past it. Every restore restarts the
//!   server, so a server that started since (`pg_postmaster_start_time()`) gets the
//!   saved position, never the remembered one: after a plain restart that re-sends
//!   at most what was confirmed and not saved (the `kill -9` bound); a reconnect to
//!   a server that kept running (a cut connection) keeps the remembered position.

use crate::lsn::Lsn;
use crate::outbox::position::{Position, ServerHistory};
use crate::postgres::replication::TimelineSwitch;

/// Why PostgreSQL invalidated a slot: `pg_replication_slots.invalidation_reason`
/// (PostgreSQL 17+), or `conflicting` (16). A slot on a standby is invalidated by a
/// conflict with recovery: the primary removed catalog rows it needs
/// (`hot_standby_feedback` off, or no physical slot for the standby), or the
/// primary's `wal_level` went below `logical`. See the PostgreSQL docs,
/// "pg_replication_slots" and "Logical Decoding on a Standby".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Invalidation {
    /// `wal_removed`, or a server that does not say: the WAL it needed was removed.
    WalRemoved,
    /// `rows_removed`: catalog rows it needed were removed.
    RowsRemoved,
    /// `wal_level_insufficient`: the primary's `wal_level` is below `logical`.
    WalLevel,
    /// PostgreSQL 16's `conflicting`: one of the two conflicts above.
    Conflict,
    /// `idle_timeout` (PostgreSQL 18): unused longer than
    /// `idle_replication_slot_timeout`.
    IdleTimeout,
}

impl Invalidation {
    /// From `invalidation_reason` (`conflicting` reads as `"conflicting"`).
    #[must_use]
    pub fn from_reason(reason: Option<&str>) -> Invalidation {
        match reason {
            Some("rows_removed") => Invalidation::RowsRemoved,
            Some("wal_level_insufficient") => Invalidation::WalLevel,
            Some("conflicting") => Invalidation::Conflict,
            Some("idle_timeout") => Invalidation::IdleTimeout,
            _ => Invalidation::WalRemoved,
        }
    }
}

impl std::fmt::Display for Invalidation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Invalidation::WalRemoved => "the WAL it needed was removed, see max_slot_wal_keep_size",
            Invalidation::RowsRemoved => {
                "the catalog rows it needed were removed: on a standby, hot_standby_feedback \
                 is off or the standby has no physical slot on the primary"
            }
            Invalidation::WalLevel => "the primary's wal_level went below logical",
            Invalidation::Conflict => {
                "a conflict with recovery on the standby: the primary removed catalog rows it \
                 needed (hot_standby_feedback, a physical slot) or its wal_level went below logical"
            }
            Invalidation::IdleTimeout => "unused longer than idle_replication_slot_timeout",
        })
    }
}

/// What the slot looks like, as far as the start is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotView {
    /// Its `confirmed_flush_lsn`.
    pub(crate) confirmed: Lsn,
    /// `wal_status = 'lost'`: it can no longer be streamed from, and why.
    pub(crate) invalidated: Option<Invalidation>,
    /// The process streaming from it (`active_pid`), if any.
    pub(crate) active_pid: Option<i32>,
}

/// Why the slot cannot be streamed from as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotLoss {
    /// The slot does not exist.
    #[error("replication slot {slot} is missing (dropped, or not on this server after a failover)")]
    Missing { slot: String },
    /// `wal_status = 'lost'`.
    #[error("replication slot {slot} was invalidated ({cause})")]
    Invalidated { slot: String, cause: Invalidation },
    /// Ahead of anything the relay recorded.
    #[error(
        "replication slot {slot} confirms {slot_confirmed}, ahead of the relay's recorded position \
         {recorded}: it was re-created or advanced by someone else"
    )]
    Recreated {
        slot: String,
        slot_confirmed: Lsn,
        recorded: Lsn,
    },
    /// After a promotion: ahead of the recorded position or of the fork point.
    #[error(
        "replication slot {slot} confirms {slot_confirmed} on the promoted server, past the \
         relay's recorded position {recorded} on timeline {timeline} or the point {fork} where \
         this server's timeline forked off it: it was created or advanced on this server, not \
         synced from the old primary, and the rows after the fork were never streamed"
    )]
    NotSynced {
        slot: String,
        slot_confirmed: Lsn,
        recorded: Lsn,
        timeline: u32,
        /// `Lsn::MAX`-like when the server's history does not name the fork.
        fork: Lsn,
    },
    /// A previous resync did not finish.
    #[error("a resync of replication slot {slot} did not finish ({reason})")]
    ResyncInterrupted { slot: String, reason: String },
}

/// The decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum StartPlan {
    /// Nothing recorded and no slot: create it (cutover rules apply).
    Fresh,
    /// Stream from the existing slot at `from`.
    Resume {
        from: Lsn,
        /// The recorded position belongs to another history, or this process's memory
        /// names WAL the server no longer has (a restore in place): record this one,
        /// and keep nothing of what the process remembers of positions.
        history_changed: bool,
        /// On a changed history: the recorded `delivered_xmin` still holds (taken
        /// before the fork of this promoted timeline), keep it.
        keep_checkpoint: bool,
        /// The server restarted since this process last streamed: what it remembers
        /// of the old server's WAL (confirmed, resolved events) is not kept.
        server_restarted: bool,
    },
    /// Another process streams from the slot: wait for it, then decide again.
    Busy { pid: i32 },
    /// The slot is lost: resync (or fail). Rows with an xid below `delivered_xmin`
    /// were delivered; `None` means nothing is known (republish every unsent row).
    Lost {
        loss: SlotLoss,
        delivered_xmin: Option<i64>,
    },
}

/// What this process confirmed in its previous session, on which history.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Remembered {
    pub(crate) history: ServerHistory,
    pub(crate) confirmed: Lsn,
    /// The highest position it saved in the position row (committed).
    pub(crate) saved: Lsn,
    /// When the server it streamed from started (`pg_postmaster_start_time()`).
    pub(crate) server_started: Option<i64>,
}

/// What the server says of itself when the session starts (`IDENTIFY_SYSTEM`,
/// `TIMELINE_HISTORY`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServerView {
    pub(crate) history: ServerHistory,
    /// Its current WAL flush position.
    pub(crate) wal_end: Lsn,
    /// Where each ancestor of its timeline ended (empty on timeline 1, or when the
    /// recorded position is on the current timeline and nobody asked).
    pub(crate) forks: Vec<TimelineSwitch>,
    /// When it started (`pg_postmaster_start_time()`, µs), if known.
    pub(crate) started: Option<i64>,
}

impl ServerView {
    /// Where the server's history left `timeline`, if it is an ancestor.
    fn fork_of(&self, timeline: u32) -> Option<Lsn> {
        self.forks
            .iter()
            .find(|f| f.timeline == timeline)
            .map(|f| f.switchpoint)
    }

    /// How far a slot of this server can be synced from a primary on `recorded`'s
    /// history: `None` when the histories cannot be compared (another cluster).
    fn synced_limit(&self, recorded: &Position) -> Option<(Lsn, Lsn)> {
        let ours = self.history;
        let theirs = recorded.history;
        if theirs.system_identifier != ours.system_identifier || theirs.timeline >= ours.timeline {
            return None;
        }
        let fork = self.fork_of(theirs.timeline).unwrap_or(Lsn(u64::MAX));
        Some((recorded.confirmed.min(fork), fork))
    }

    /// Whether `recorded`'s checkpoint, taken on an ancestor timeline, lies at or
    /// before the point where this server's history forked off it: the transactions
    /// below it are then the same on both, and so is what it says was delivered.
    fn checkpoint_before_fork(&self, recorded: &Position) -> bool {
        let ours = self.history;
        let theirs = recorded.history;
        if theirs.system_identifier != ours.system_identifier || theirs.timeline >= ours.timeline {
            return false;
        }
        match (recorded.delivered_lsn, self.fork_of(theirs.timeline)) {
            (Some(taken), Some(fork)) => taken <= fork,
            _ => false,
        }
    }
}

/// The rules of the module docs. `slot` must have been read before `position`.
pub(crate) fn plan(
    slot_name: &str,
    server: &ServerView,
    position: Option<&Position>,
    slot: Option<SlotView>,
    remembered: Option<Remembered>,
) -> StartPlan {
    let history = server.history;
    if let Some(pid) = slot.and_then(|s| s.active_pid) {
        return StartPlan::Busy { pid };
    }
    let remembered = remembered.filter(|r| r.history == history);
    let Some(position) = position else {
        // The slot, if any, is adopted by the first-start path (which also finishes
        // an interrupted cutover); an invalidated one is reported there (exit 3).
        return StartPlan::Fresh;
    };
    // This process confirmed WAL the server no longer has, or saved a position the
    // row no longer holds: restored in place.
    let rewound = remembered.is_some_and(|r| {
        r.confirmed > server.wal_end
            || (position.history == history && r.saved > position.confirmed)
    });
    // A restarted server may be a restored one that wrote past all of that already.
    let restarted = remembered.is_some_and(|r| {
        r.server_started.is_some() && server.started.is_some() && r.server_started != server.started
    });
    let remembered = remembered
        .filter(|_| !rewound && !restarted)
        .map(|r| r.confirmed);
    // A recorded position past the server's WAL end is of another history too.
    let same_history = position.history == history && position.confirmed <= server.wal_end;
    // xids past a fork are not comparable either, unless the checkpoint was taken
    // before it.
    let checkpoint_holds = same_history || server.checkpoint_before_fork(position);
    let delivered_xmin = position.delivered_xmin.filter(|_| checkpoint_holds);
    let lost = |loss| StartPlan::Lost {
        loss,
        delivered_xmin,
    };
    if let Some(reason) = &position.slot_lost {
        return lost(SlotLoss::ResyncInterrupted {
            slot: slot_name.to_owned(),
            reason: reason.clone(),
        });
    }
    let Some(slot) = slot else {
        return lost(SlotLoss::Missing {
            slot: slot_name.to_owned(),
        });
    };
    if let Some(cause) = slot.invalidated {
        return lost(SlotLoss::Invalidated {
            slot: slot_name.to_owned(),
            cause,
        });
    }
    if !same_history {
        if let Some((limit, fork)) = server.synced_limit(position)
            && slot.confirmed > limit
        {
            return lost(SlotLoss::NotSynced {
                slot: slot_name.to_owned(),
                slot_confirmed: slot.confirmed,
                recorded: position.confirmed,
                timeline: position.history.timeline,
                fork,
            });
        }
        return StartPlan::Resume {
            from: slot.confirmed,
            history_changed: true,
            keep_checkpoint: checkpoint_holds,
            server_restarted: restarted,
        };
    }
    let recorded = position.confirmed.max(remembered.unwrap_or(Lsn::ZERO));
    if slot.confirmed > recorded {
        return lost(SlotLoss::Recreated {
            slot: slot_name.to_owned(),
            slot_confirmed: slot.confirmed,
            recorded,
        });
    }
    StartPlan::Resume {
        from: recorded,
        history_changed: rewound,
        keep_checkpoint: true,
        server_restarted: restarted,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: ServerHistory = ServerHistory {
        system_identifier: 7,
        timeline: 1,
    };
    const PROMOTED: ServerHistory = ServerHistory {
        system_identifier: 7,
        timeline: 2,
    };

    fn lsn(n: u64) -> Lsn {
        Lsn(n)
    }

    /// The server on `history`, its WAL ending well past every position below.
    fn on(history: ServerHistory) -> ServerView {
        ServerView {
            history,
            wal_end: lsn(1_000_000),
            forks: Vec::new(),
            started: None,
        }
    }

    fn position(history: ServerHistory, confirmed: u64) -> Position {
        Position {
            history,
            confirmed: lsn(confirmed),
            delivered_xmin: Some(500),
            delivered_lsn: None,
            slot_lost: None,
            resyncs: 0,
        }
    }

    fn slot(confirmed: u64) -> Option<SlotView> {
        Some(SlotView {
            confirmed: lsn(confirmed),
            invalidated: None,
            active_pid: None,
        })
    }

    #[test]
    fn first_start_creates_the_slot() {
        assert_eq!(plan("s", &on(H), None, None, None), StartPlan::Fresh);
    }

    #[test]
    fn a_slot_without_a_record_takes_the_first_start_path() {
        assert_eq!(plan("s", &on(H), None, slot(100), None), StartPlan::Fresh);
    }

    #[test]
    fn a_rewound_slot_resumes_from_the_recorded_position() {
        let p = position(H, 900);
        assert_eq!(
            plan("s", &on(H), Some(&p), slot(300), None),
            StartPlan::Resume {
                from: lsn(900),
                history_changed: false,
                keep_checkpoint: true,
                server_restarted: false
            }
        );
    }

    #[test]
    fn what_this_process_confirmed_counts_on_the_same_history_only() {
        let p = position(H, 900);
        let mem = |history| {
            Some(Remembered {
                history,
                confirmed: lsn(950),
                saved: lsn(900),
                server_started: None,
            })
        };
        assert_eq!(
            plan("s", &on(H), Some(&p), slot(300), mem(H)),
            StartPlan::Resume {
                from: lsn(950),
                history_changed: false,
                keep_checkpoint: true,
                server_restarted: false
            }
        );
        assert_eq!(
            plan("s", &on(PROMOTED), Some(&p), slot(300), mem(H)),
            StartPlan::Resume {
                from: lsn(300),
                history_changed: true,
                keep_checkpoint: false,
                server_restarted: false
            },
            "after a promotion only the new server's slot is trusted"
        );
    }

    #[test]
    fn a_missing_or_invalidated_slot_is_lost_never_recreated_silently() {
        let p = position(H, 900);
        assert_eq!(
            plan("s", &on(H), Some(&p), None, None),
            StartPlan::Lost {
                loss: SlotLoss::Missing { slot: "s".into() },
                delivered_xmin: Some(500)
            }
        );
        let invalid = Some(SlotView {
            confirmed: lsn(900),
            invalidated: Some(Invalidation::RowsRemoved),
            active_pid: None,
        });
        let planned = plan("s", &on(H), Some(&p), invalid, None);
        assert!(matches!(
            planned,
            StartPlan::Lost {
                loss: SlotLoss::Invalidated {
                    cause: Invalidation::RowsRemoved,
                    ..
                },
                ..
            }
        ));
        let StartPlan::Lost { loss, .. } = planned else {
            unreachable!()
        };
        assert!(loss.to_string().contains("hot_standby_feedback"), "{loss}");
        assert_eq!(
            Invalidation::from_reason(Some("wal_level_insufficient")),
            Invalidation::WalLevel
        );
        assert_eq!(Invalidation::from_reason(None), Invalidation::WalRemoved);
    }

    #[test]
    fn a_slot_ahead_of_the_record_was_recreated_by_someone_else() {
        let p = position(H, 900);
        assert_eq!(
            plan("s", &on(H), Some(&p), slot(901), None),
            StartPlan::Lost {
                loss: SlotLoss::Recreated {
                    slot: "s".into(),
                    slot_confirmed: lsn(901),
                    recorded: lsn(900)
                },
                delivered_xmin: Some(500)
            }
        );
    }

    #[test]
    fn a_lost_slot_on_another_history_knows_no_delivered_rows() {
        let p = position(H, 900);
        assert_eq!(
            plan("s", &on(PROMOTED), Some(&p), None, None),
            StartPlan::Lost {
                loss: SlotLoss::Missing { slot: "s".into() },
                delivered_xmin: None
            }
        );
    }

    #[test]
    fn an_interrupted_resync_is_resumed_whatever_the_slot() {
        let mut p = position(H, 900);
        p.slot_lost = Some("missing".into());
        assert!(matches!(
            plan("s", &on(H), Some(&p), slot(5000), None),
            StartPlan::Lost {
                loss: SlotLoss::ResyncInterrupted { .. },
                delivered_xmin: Some(500)
            }
        ));
    }

    #[test]
    fn a_slot_another_process_streams_from_is_busy_never_lost() {
        // A standby that started while the active relay saved 900 and confirmed 950:
        // whatever it read, an active slot is not judged.
        let p = position(H, 900);
        let active = Some(SlotView {
            confirmed: lsn(950),
            invalidated: None,
            active_pid: Some(4242),
        });
        assert_eq!(
            plan("s", &on(H), Some(&p), active, None),
            StartPlan::Busy { pid: 4242 }
        );
    }

    #[test]
    fn what_this_process_confirmed_past_the_servers_wal_end_is_forgotten() {
        // Restored in place: same history, but the WAL ends at 1000 and this process
        // had confirmed 1500. New commits land below 1500 and must be streamed.
        let p = position(H, 900);
        let restored = ServerView {
            history: H,
            wal_end: lsn(1_000),
            forks: Vec::new(),
            started: None,
        };
        let mem = Some(Remembered {
            history: H,
            confirmed: lsn(1_500),
            saved: lsn(1_400),
            server_started: None,
        });
        assert_eq!(
            plan("s", &restored, Some(&p), slot(300), mem),
            StartPlan::Resume {
                from: lsn(900),
                history_changed: true,
                keep_checkpoint: true,
                server_restarted: false
            },
            "the recorded position, restored with the WAL; not the WAL end: commits made \
             since the restore lie below it"
        );
        // The restored server wrote past 1500 before the relay came back: the WAL end
        // cannot tell, the position row below what the process saved there can.
        let written_past = ServerView {
            wal_end: lsn(2_000),
            ..restored
        };
        assert_eq!(
            plan("s", &written_past, Some(&p), slot(300), mem),
            StartPlan::Resume {
                from: lsn(900),
                history_changed: true,
                keep_checkpoint: true,
                server_restarted: false
            },
            "commits between 1000 and 1500 were made after the restore"
        );
    }

    #[test]
    fn a_row_behind_a_remembered_save_is_a_restore_a_row_behind_a_remembered_confirm_is_not() {
        let p = position(H, 900);
        let mem = |confirmed, saved| {
            Some(Remembered {
                history: H,
                confirmed: lsn(confirmed),
                saved: lsn(saved),
                server_started: None,
            })
        };
        // Saves lag confirmations: what was confirmed and not saved yet is kept.
        assert_eq!(
            plan("s", &on(H), Some(&p), slot(300), mem(950, 900)),
            StartPlan::Resume {
                from: lsn(950),
                history_changed: false,
                keep_checkpoint: true,
                server_restarted: false
            }
        );
        assert_eq!(
            plan("s", &on(H), Some(&p), slot(300), mem(950, 920)),
            StartPlan::Resume {
                from: lsn(900),
                history_changed: true,
                keep_checkpoint: true,
                server_restarted: false
            }
        );
    }

    #[test]
    fn a_recorded_position_past_the_servers_wal_end_is_of_another_history() {
        let p = position(H, 1_500);
        let restored = ServerView {
            history: H,
            wal_end: lsn(1_000),
            forks: Vec::new(),
            started: None,
        };
        assert_eq!(
            plan("s", &restored, Some(&p), slot(300), None),
            StartPlan::Resume {
                from: lsn(300),
                history_changed: true,
                keep_checkpoint: false,
                server_restarted: false
            }
        );
    }

    /// The promoted server: timeline 2, forked off timeline 1 at 950.
    fn promoted() -> ServerView {
        ServerView {
            forks: vec![TimelineSwitch {
                timeline: 1,
                switchpoint: lsn(950),
            }],
            ..on(PROMOTED)
        }
    }

    #[test]
    fn after_a_promotion_a_synced_slot_is_trusted() {
        let p = position(H, 900);
        assert_eq!(
            plan("s", &promoted(), Some(&p), slot(800), None),
            StartPlan::Resume {
                from: lsn(800),
                history_changed: true,
                keep_checkpoint: false,
                server_restarted: false
            }
        );
    }

    #[test]
    fn after_a_promotion_a_slot_created_on_the_new_primary_is_lost() {
        let p = position(H, 900);
        // Created by hand after the promotion: past the fork.
        assert!(matches!(
            plan("s", &promoted(), Some(&p), slot(1_200), None),
            StartPlan::Lost {
                loss: SlotLoss::NotSynced { .. },
                delivered_xmin: None
            }
        ));
        // Past what the relay recorded, even if before the fork.
        assert!(matches!(
            plan("s", &promoted(), Some(&p), slot(920), None),
            StartPlan::Lost {
                loss: SlotLoss::NotSynced { .. },
                ..
            }
        ));
        // A standby that was behind: the fork is before the recorded position.
        let behind = ServerView {
            forks: vec![TimelineSwitch {
                timeline: 1,
                switchpoint: lsn(700),
            }],
            ..on(PROMOTED)
        };
        assert!(matches!(
            plan("s", &behind, Some(&p), slot(800), None),
            StartPlan::Lost {
                loss: SlotLoss::NotSynced { .. },
                ..
            }
        ));
    }

    #[test]
    fn a_checkpoint_taken_before_the_fork_holds_on_the_promoted_timeline() {
        let before = Position {
            delivered_lsn: Some(lsn(940)),
            ..position(H, 900)
        };
        assert_eq!(
            plan("s", &promoted(), Some(&before), slot(800), None),
            StartPlan::Resume {
                from: lsn(800),
                history_changed: true,
                keep_checkpoint: true,
                server_restarted: false
            }
        );
        assert!(matches!(
            plan("s", &promoted(), Some(&before), slot(1_200), None),
            StartPlan::Lost {
                loss: SlotLoss::NotSynced { .. },
                delivered_xmin: Some(500)
            }
        ));
        // Taken past the fork: its xids may name other transactions there.
        let after = Position {
            delivered_lsn: Some(lsn(960)),
            ..position(H, 900)
        };
        assert!(matches!(
            plan("s", &promoted(), Some(&after), None, None),
            StartPlan::Lost {
                loss: SlotLoss::Missing { .. },
                delivered_xmin: None
            }
        ));
        // Another cluster: never.
        let other = ServerView {
            history: ServerHistory {
                system_identifier: 8,
                timeline: 2,
            },
            ..promoted()
        };
        assert!(matches!(
            plan("s", &other, Some(&before), None, None),
            StartPlan::Lost {
                delivered_xmin: None,
                ..
            }
        ));
    }

    #[test]
    fn another_clusters_slot_cannot_be_compared_and_is_trusted() {
        let p = position(H, 900);
        let other = ServerView {
            history: ServerHistory {
                system_identifier: 8,
                timeline: 1,
            },
            ..on(H)
        };
        assert_eq!(
            plan("s", &other, Some(&p), slot(5_000), None),
            StartPlan::Resume {
                from: lsn(5_000),
                history_changed: true,
                keep_checkpoint: false,
                server_restarted: false
            }
        );
    }
}
