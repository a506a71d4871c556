//! Saves the relay's confirmed LSN in `outbox_relay_position` *before* the server
//! hears of it (see `crate::outbox::position` for why).
//!
//! The session hands over each save the core asks for ([`PositionSaver::request`])
//! and reports each completed one back to the core, which never builds a status
//! update past it. A background task owns its own PostgreSQL connection and
//! writes the newest requested LSN, at most once per `min_gap` (requests in between
//! coalesce into one write), so saving costs one single-row `UPDATE` per gap however
//! fast events flow, and never blocks the replication loop. While PostgreSQL is
//! unreachable the task retries with backoff.
//!
//! The task decides nothing about what a failure means: it reports each one with
//! where it happened and the server's SQLSTATE ([`SaverEvent::Failed`]), and the core
//! decides whether statuses may confirm past the saved position while PostgreSQL shuts
//! down (`crate::cdc::progress` `saving.rs`).

use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use crate::cdc::metrics as m;
use crate::cdc::ports::clock;
use crate::cdc::ports::database::{PositionWrites, Refusal, SaveError};
use crate::cdc::progress::SavePhase;
use crate::lifecycle::Backoff;
use crate::lsn::Lsn;

/// Backoff between failed saves.
const RETRY_INITIAL: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// What the saving task reports to the session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SaverEvent {
    /// This position is saved.
    Saved(Lsn),
    /// A save failed; it is retried after a backoff.
    Failed {
        phase: SavePhase,
        sqlstate: Option<String>,
        message: String,
    },
    /// The position row is no longer this session's to write: it was recorded on
    /// another server history, or another relay marked the slot lost to resync it.
    /// Retrying cannot help; the session must end and decide again where to start.
    Refused { reason: String },
}

/// The session's handle on the saving task (aborted when dropped).
pub(crate) struct PositionSaver {
    requests: watch::Sender<Request>,
    saved: watch::Receiver<Lsn>,
    /// Failures, newest last (bounded: a failure is reported only if there is room,
    /// and the task waits a backoff between two).
    failures: mpsc::Receiver<SaverEvent>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PositionSaver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PositionSaver {
    /// Starts saving positions of `history` on the server that started at
    /// `server_started`; `initial` is already saved.
    pub(crate) fn spawn(
        writes: Box<dyn PositionWrites>,
        initial: Lsn,
        min_gap: Duration,
    ) -> PositionSaver {
        let (requests, requested) = watch::channel(Request {
            lsn: initial,
            urgent: 0,
        });
        let (saved_tx, saved) = watch::channel(initial);
        let (failures_tx, failures) = mpsc::channel(FAILURES_QUEUED);
        let task = tokio::spawn(
            Task {
                writes,
                min_gap,
                failures: failures_tx,
            }
            .run(requested, saved_tx),
        );
        PositionSaver {
            requests,
            saved,
            failures,
            task,
        }
    }

    /// Asks for `lsn` to be saved (ignored unless it is ahead of the last request).
    /// An `urgent` request is written without waiting for the gap: the shell asks
    /// so when many events were resolved since the last save, which keeps what a
    /// crash of the relay re-sends within its documented bound.
    pub(crate) fn request(&self, lsn: Lsn, urgent: bool) {
        self.requests.send_if_modified(|current| {
            let ahead = lsn > current.lsn;
            if ahead {
                current.lsn = lsn;
                current.urgent += u64::from(urgent);
            }
            ahead
        });
    }

    /// Waits for the next save or failure. The task ends after a refusal (its last
    /// event, queued before it returns) or when this handle is dropped: once it has
    /// ended, what it left in the queue is still handed out, then this pends
    /// forever. (Waiting on the ended save channel alone would hide the refusal, and
    /// a session whose stream stays up, a standby's while the primary restarts,
    /// would wait forever for saves that never come.)
    pub(crate) async fn next_event(&mut self) -> SaverEvent {
        tokio::select! {
            biased;
            changed = self.saved.changed() => {
                if changed.is_ok() {
                    return SaverEvent::Saved(*self.saved.borrow_and_update());
                }
            }
            failure = self.failures.recv() => {
                if let Some(event) = failure {
                    return event;
                }
            }
        }
        // The task ended: its queued events, then nothing.
        match self.failures.recv().await {
            Some(event) => event,
            None => std::future::pending().await,
        }
    }

    /// Waits up to `timeout` for `target` to be saved; returns the highest position
    /// saved by then.
    pub(crate) async fn flush(&mut self, target: Lsn, timeout: Duration) -> Lsn {
        self.request(target, true);
        let _ = tokio::time::timeout(timeout, self.saved.wait_for(|saved| *saved >= target)).await;
        *self.saved.borrow()
    }
}

/// The newest position asked for; `urgent` counts urgent requests, so the task
/// can tell whether one came since its last write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Request {
    lsn: Lsn,
    urgent: u64,
}

/// Failures waiting for the session; more are dropped (the session needs only to
/// learn that saves fail, and how).
const FAILURES_QUEUED: usize = 4;

struct Task {
    /// The session's writes (`ports::database`): to the server the writes go to,
    /// refused on another history or a restarted server.
    writes: Box<dyn PositionWrites>,
    min_gap: Duration,
    failures: mpsc::Sender<SaverEvent>,
}

impl Task {
    async fn run(mut self, mut requested: watch::Receiver<Request>, saved: watch::Sender<Lsn>) {
        let mut backoff = Backoff::new(RETRY_INITIAL, RETRY_MAX);
        let mut last_write: Option<Instant> = None;
        let mut urgent_seen = 0;
        let saved_gauge = ::metrics::gauge!(m::SAVED_LSN);
        let failures = ::metrics::counter!(m::POSITION_SAVE_FAILURES);
        loop {
            if requested.borrow_and_update().lsn <= *saved.borrow()
                && requested.changed().await.is_err()
            {
                return;
            }
            let urgent = requested.borrow().urgent;
            if let (Some(at), true) = (last_write, urgent == urgent_seen) {
                tokio::time::sleep(self.min_gap.saturating_sub(clock::elapsed(at))).await;
            }
            let target = requested.borrow_and_update().lsn;
            if target <= *saved.borrow() {
                continue;
            }
            urgent_seen = requested.borrow().urgent;
            last_write = Some(clock::now());
            match self.writes.save(target).await {
                Ok(()) => {
                    backoff.reset();
                    saved.send_replace(target);
                    // Exact below 2^53 bytes of WAL (8 PiB).
                    #[allow(clippy::cast_precision_loss)]
                    saved_gauge.set(target.as_u64() as f64);
                }
                Err(SaveError {
                    message,
                    refused: Some(refusal),
                    ..
                }) => {
                    failures.increment(1);
                    log_refusal(refusal, &message, target);
                    // The session ends on it; a full queue means it is ending anyway.
                    let _ = self
                        .failures
                        .send(SaverEvent::Refused { reason: message })
                        .await;
                    return;
                }
                Err(SaveError {
                    message,
                    phase,
                    sqlstate,
                    refused: None,
                }) => {
                    failures.increment(1);
                    let pause = backoff.next_pause();
                    tracing::warn!(reason = %message, ?phase, sqlstate = sqlstate.as_deref().unwrap_or(""), position = %target, retry_in_ms = crate::lifecycle::millis(pause),
                        "cannot save the relay position; the server is not told of it until it is saved");
                    // Full: the session has not caught up with earlier ones yet.
                    let _ = self.failures.try_send(SaverEvent::Failed {
                        phase,
                        sqlstate,
                        message,
                    });
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }
}

/// Says why a save was refused. A restarted server is a warning: routine for a
/// primary under a session decoding on a standby, and for a copy restored in place
/// the next session's start plan says what it found. A row of another history or
/// with a resync pending is an error.
fn log_refusal(refusal: Refusal, message: &str, target: Lsn) {
    match refusal {
        Refusal::ServerRestarted => tracing::warn!(reason = %message, position = %target,
            "the server the relay writes to restarted; the session ends and starts again there"),
        Refusal::NotOurs => tracing::error!(reason = %message, position = %target,
            "the relay position row is not this session's to write; the session ends"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A handle on channels the test drives instead of a task.
    fn handle() -> (PositionSaver, watch::Sender<Lsn>, mpsc::Sender<SaverEvent>) {
        let (requests, _requested) = watch::channel(Request {
            lsn: Lsn::ZERO,
            urgent: 0,
        });
        let (saved_tx, saved) = watch::channel(Lsn::ZERO);
        let (failures_tx, failures) = mpsc::channel(FAILURES_QUEUED);
        let saver = PositionSaver {
            requests,
            saved,
            failures,
            task: tokio::spawn(async {}),
        };
        (saver, saved_tx, failures_tx)
    }

    #[tokio::test]
    async fn a_refusal_is_handed_out_after_the_task_ended() {
        // The task queues its refusal, then returns: both of its channels close.
        let (mut saver, saved_tx, failures_tx) = handle();
        let refusal = SaverEvent::Refused {
            reason: "restarted".to_owned(),
        };
        failures_tx.send(refusal.clone()).await.expect("queued");
        drop((saved_tx, failures_tx));
        let event = tokio::time::timeout(Duration::from_secs(5), saver.next_event()).await;
        assert_eq!(event.ok(), Some(refusal));
        // Then nothing, for ever.
        let after = tokio::time::timeout(Duration::from_millis(50), saver.next_event()).await;
        assert!(after.is_err(), "an event after the last: {after:?}");
    }

    #[tokio::test]
    async fn saves_and_failures_are_handed_out_while_the_task_runs() {
        let (mut saver, saved_tx, failures_tx) = handle();
        saved_tx.send_replace(Lsn(42));
        assert_eq!(saver.next_event().await, SaverEvent::Saved(Lsn(42)));
        let failure = SaverEvent::Failed {
            phase: SavePhase::Statement,
            sqlstate: None,
            message: "connection closed".to_owned(),
        };
        failures_tx.send(failure.clone()).await.expect("queued");
        assert_eq!(saver.next_event().await, failure);
    }
}
