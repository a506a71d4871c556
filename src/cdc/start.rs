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

use crate::lsn::Lsn;
use crate::outbox::position::{Position, ServerHistory};

/// What the slot looks like, as far as the start is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SlotView {
    /// Its `confirmed_flush_lsn`.
    pub(crate) confirmed: Lsn,
    /// `wal_status = 'lost'`: the WAL it needs is gone.
    pub(crate) invalidated: bool,
}

/// Why the slot cannot be streamed from as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SlotLoss {
    /// The slot does not exist.
    #[error("replication slot {slot} is missing (dropped, or not on this server after a failover)")]
    Missing { slot: String },
    /// `wal_status = 'lost'`.
    #[error(
        "replication slot {slot} was invalidated (the WAL it needed was removed, see max_slot_wal_keep_size)"
    )]
    Invalidated { slot: String },
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
        /// The recorded position belongs to another history: record this one.
        history_changed: bool,
    },
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
}

/// The rules of the module docs.
pub(crate) fn plan(
    slot_name: &str,
    history: ServerHistory,
    position: Option<&Position>,
    slot: Option<SlotView>,
    remembered: Option<Remembered>,
) -> StartPlan {
    let remembered = remembered
        .filter(|r| r.history == history)
        .map(|r| r.confirmed);
    let Some(position) = position else {
        // The slot, if any, is adopted by the first-start path (which also finishes
        // an interrupted cutover); an invalidated one is reported there (exit 3).
        return StartPlan::Fresh;
    };
    let same_history = position.history == history;
    // xids past a fork are not comparable either.
    let delivered_xmin = position.delivered_xmin.filter(|_| same_history);
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
    if slot.invalidated {
        return lost(SlotLoss::Invalidated {
            slot: slot_name.to_owned(),
        });
    }
    if !same_history {
        return StartPlan::Resume {
            from: slot.confirmed,
            history_changed: true,
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
        history_changed: false,
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

    fn position(history: ServerHistory, confirmed: u64) -> Position {
        Position {
            history,
            confirmed: lsn(confirmed),
            delivered_xmin: Some(500),
            slot_lost: None,
            resyncs: 0,
        }
    }

    fn slot(confirmed: u64) -> Option<SlotView> {
        Some(SlotView {
            confirmed: lsn(confirmed),
            invalidated: false,
        })
    }

    #[test]
    fn first_start_creates_the_slot() {
        assert_eq!(plan("s", H, None, None, None), StartPlan::Fresh);
    }

    #[test]
    fn a_slot_without_a_record_takes_the_first_start_path() {
        assert_eq!(plan("s", H, None, slot(100), None), StartPlan::Fresh);
    }

    #[test]
    fn a_rewound_slot_resumes_from_the_recorded_position() {
        let p = position(H, 900);
        assert_eq!(
            plan("s", H, Some(&p), slot(300), None),
            StartPlan::Resume {
                from: lsn(900),
                history_changed: false
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
            })
        };
        assert_eq!(
            plan("s", H, Some(&p), slot(300), mem(H)),
            StartPlan::Resume {
                from: lsn(950),
                history_changed: false
            }
        );
        assert_eq!(
            plan("s", PROMOTED, Some(&p), slot(300), mem(H)),
            StartPlan::Resume {
                from: lsn(300),
                history_changed: true
            },
            "after a promotion only the new server's slot is trusted"
        );
    }

    #[test]
    fn a_missing_or_invalidated_slot_is_lost_never_recreated_silently() {
        let p = position(H, 900);
        assert_eq!(
            plan("s", H, Some(&p), None, None),
            StartPlan::Lost {
                loss: SlotLoss::Missing { slot: "s".into() },
                delivered_xmin: Some(500)
            }
        );
        let invalid = Some(SlotView {
            confirmed: lsn(900),
            invalidated: true,
        });
        assert!(matches!(
            plan("s", H, Some(&p), invalid, None),
            StartPlan::Lost {
                loss: SlotLoss::Invalidated { .. },
                ..
            }
        ));
    }

    #[test]
    fn a_slot_ahead_of_the_record_was_recreated_by_someone_else() {
        let p = position(H, 900);
        assert_eq!(
            plan("s", H, Some(&p), slot(901), None),
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
            plan("s", PROMOTED, Some(&p), None, None),
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
            plan("s", H, Some(&p), slot(5000), None),
            StartPlan::Lost {
                loss: SlotLoss::ResyncInterrupted { .. },
                delivered_xmin: Some(500)
            }
        ));
    }
}
