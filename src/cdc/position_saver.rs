//! Saves the relay's confirmed LSN in `outbox_relay_position` *before* the server
//! hears of it (see `crate::outbox::position` for why).
//!
//! The session asks for a save whenever the core wants to confirm further
//! ([`PositionSaver::request`]) and never sends a status update past
//! [`PositionSaver::saved`]. A background task owns its own PostgreSQL connection and
//! writes the newest requested LSN, at most once per `min_gap` (requests in between
//! coalesce into one write), so saving costs one single-row `UPDATE` per gap however
//! fast events flow, and never blocks the replication loop. While PostgreSQL is
//! unreachable the task retries with backoff.
//!
//! One exception keeps PostgreSQL able to shut down: during a fast shutdown the
//! server refuses new connections and ends ours, then each walsender waits until its
//! client confirms the very end of the WAL (the shutdown checkpoint) before it exits.
//! A position that cannot be saved would hold the shutdown forever. So while the
//! server says it is shutting down (SQLSTATE class 57P), the session confirms what it
//! delivered without saving it; it saves again as soon as the server is back, and
//! after the restart the process resumes from what it remembers. Nothing can be lost
//! that way (only delivered events are confirmed). Before PostgreSQL 17 the slot's
//! position does not survive the restart anyway; from 17 on it does, and a relay
//! *process* restarted in that window would find its slot ahead of its saved
//! position and treat it as lost: a resync, with duplicates, never a loss.

use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::cdc::metrics as m;
use crate::lifecycle::Backoff;
use crate::lsn::Lsn;
use crate::outbox::position::{PositionTable, ServerHistory};
use crate::postgres::conninfo::ConnInfo;

/// Backoff between failed saves.
const RETRY_INITIAL: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// The session's handle on the saving task (aborted when dropped).
pub(crate) struct PositionSaver {
    requests: watch::Sender<Request>,
    saved: watch::Receiver<Lsn>,
    /// The last save failed because PostgreSQL is shutting down.
    stopping: std::sync::Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PositionSaver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PositionSaver {
    /// Starts saving positions of `history`; `initial` is already saved.
    pub(crate) fn spawn(
        conninfo: ConnInfo,
        table: PositionTable,
        history: ServerHistory,
        initial: Lsn,
        min_gap: Duration,
    ) -> PositionSaver {
        let (requests, requested) = watch::channel(Request {
            lsn: initial,
            urgent: 0,
        });
        let (saved_tx, saved) = watch::channel(initial);
        let stopping = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let task = tokio::spawn(
            Task {
                conninfo,
                table,
                history,
                min_gap,
                stopping: stopping.clone(),
            }
            .run(requested, saved_tx),
        );
        PositionSaver {
            requests,
            saved,
            stopping,
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

    /// Whether the last save failed because PostgreSQL is shutting down.
    pub(crate) fn server_stopping(&self) -> bool {
        self.stopping.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The highest position saved so far.
    pub(crate) fn saved(&self) -> Lsn {
        *self.saved.borrow()
    }

    /// Waits for the next save; returns the new saved position (pends forever if the
    /// task ended, which only happens when this handle is dropped).
    pub(crate) async fn changed(&mut self) -> Lsn {
        if self.saved.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
        *self.saved.borrow_and_update()
    }

    /// Waits up to `timeout` for `target` to be saved.
    pub(crate) async fn flush(&mut self, target: Lsn, timeout: Duration) {
        self.request(target, true);
        let _ = tokio::time::timeout(timeout, self.saved.wait_for(|saved| *saved >= target)).await;
    }
}

/// The newest position asked for; `urgent` counts urgent requests, so the task
/// can tell whether one came since its last write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Request {
    lsn: Lsn,
    urgent: u64,
}

struct Task {
    conninfo: ConnInfo,
    table: PositionTable,
    history: ServerHistory,
    min_gap: Duration,
    stopping: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// Why a save did not happen.
struct SaveError {
    message: String,
    /// PostgreSQL said it is shutting down.
    stopping: bool,
}

impl From<crate::postgres::PgError> for SaveError {
    fn from(e: crate::postgres::PgError) -> Self {
        SaveError {
            stopping: e.is_server_stopping(),
            message: e.to_string(),
        }
    }
}

impl From<crate::outbox::checkpoint::CheckpointError> for SaveError {
    fn from(e: crate::outbox::checkpoint::CheckpointError) -> Self {
        SaveError {
            stopping: e.is_server_stopping(),
            message: e.to_string(),
        }
    }
}

impl Task {
    async fn run(self, mut requested: watch::Receiver<Request>, saved: watch::Sender<Lsn>) {
        let mut client: Option<tokio_postgres::Client> = None;
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
                tokio::time::sleep(self.min_gap.saturating_sub(at.elapsed())).await;
            }
            let target = requested.borrow_and_update().lsn;
            if target <= *saved.borrow() {
                continue;
            }
            urgent_seen = requested.borrow().urgent;
            last_write = Some(Instant::now());
            match self.save(&mut client, target).await {
                Ok(()) => {
                    self.stopping
                        .store(false, std::sync::atomic::Ordering::Relaxed);
                    backoff.reset();
                    saved.send_replace(target);
                    // Exact below 2^53 bytes of WAL (8 PiB).
                    #[allow(clippy::cast_precision_loss)]
                    saved_gauge.set(target.as_u64() as f64);
                }
                Err(SaveError { message, stopping }) => {
                    self.stopping
                        .store(stopping, std::sync::atomic::Ordering::Relaxed);
                    failures.increment(1);
                    let pause = backoff.next_pause();
                    tracing::warn!(reason = %message, server_stopping = stopping, position = %target, retry_in_ms = crate::lifecycle::millis(pause),
                        "cannot save the relay position; the server is not told of it until it is saved");
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }

    /// One save, reconnecting first if needed. A missing row (deleted by an
    /// operator) is re-created; a row of another history or with a resync pending
    /// is not overwritten.
    async fn save(
        &self,
        client: &mut Option<tokio_postgres::Client>,
        target: Lsn,
    ) -> Result<(), SaveError> {
        if client
            .as_ref()
            .is_none_or(tokio_postgres::Client::is_closed)
        {
            *client = Some(crate::postgres::connect_info(&self.conninfo).await?);
        }
        let Some(c) = client.as_ref() else {
            return Err(SaveError {
                message: "no connection".to_owned(),
                stopping: false,
            });
        };
        if self.table.save(c, self.history, target).await? {
            return Ok(());
        }
        match self.table.load(c).await? {
            None => {
                tracing::warn!(table = %self.table.name(), "the relay position row was deleted; recording it again");
                Ok(self.table.adopt(c, self.history, target).await?)
            }
            Some(p) => Err(SaveError {
                message: format!(
                    "the position row belongs to {} (expected {}) or a resync is pending ({:?})",
                    p.history, self.history, p.slot_lost
                ),
                stopping: false,
            }),
        }
    }
}
