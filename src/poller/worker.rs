//! The worker loop: [`run`] starts the workers, each polls, publishes and marks
//! until stopped, and decides how long to pause between batches.
//!
//! A batch that came back full is followed at once by the next one; only a short
//! batch sleeps `--poll-interval-ms`, so a backlog drains at full speed and an idle
//! outbox costs one cheap index probe per interval. Transient failures (a broker
//! error left rows unsent, PostgreSQL went away) back off with the shared
//! [`Backoff`], reset by the next clean batch.
//!
//! Stopping uses a `watch` channel rather than the [`Shutdown`] future itself: every
//! worker, and each worker at two points of its loop (the batch in hand, the pause),
//! must see the same stop, and one worker's fatal error stops the others gracefully.
//! A worker that is stopped mid-batch finishes it (its acks, then its marks) within
//! `relay.shutdown_timeout_secs`, else the batch rolls back and is re-sent on the next
//! start.

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use crate::config::Config;
use crate::delivery::ErrorClass;
use crate::error::{Error, Result};
use crate::lifecycle::{Backoff, Shutdown, millis};

use super::args::{PollArgs, Settings};
use super::batch::Poller;
use super::marks::BatchOutcome;

/// Backoff after a transient failure (broker, connection), doubling per failure.
const BACKOFF_INITIAL: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// What a finished [`run`] reports (summed over workers).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PollSummary {
    /// Rows acked by the broker and marked sent.
    pub delivered: u64,
    /// Rows copied to `poison_outbox` (including the start-up sweep).
    pub poisoned: u64,
    /// Permanent delivery failures recorded in `attempts` (poisoned ones included).
    pub failed_attempts: u64,
    /// Transient delivery failures (rows left for the next poll, not counted).
    pub transient_failures: u64,
    /// Non-empty batches committed.
    pub batches: u64,
    /// Transient errors that made a worker roll back and reconnect or back off.
    pub retries: u64,
    /// Rows marked sent at start-up by `--after-cdc` (delivered by the CDC relay).
    pub marked_after_cdc: u64,
}

impl PollSummary {
    fn add_batch(&mut self, b: &BatchOutcome) {
        if b.fetched == 0 {
            return;
        }
        self.delivered += b.delivered as u64;
        self.poisoned += b.poisoned as u64;
        self.failed_attempts += b.failed as u64;
        self.transient_failures += b.transient as u64;
        self.batches += 1;
    }

    fn add(&mut self, other: &PollSummary) {
        self.delivered += other.delivered;
        self.poisoned += other.poisoned;
        self.failed_attempts += other.failed_attempts;
        self.transient_failures += other.transient_failures;
        self.batches += other.batches;
        self.retries += other.retries;
    }
}

/// Runs the polling relay until `shutdown` completes or a fatal error occurs.
///
/// Start-up failures keep the CDC relay's exit codes: bad flags or config (2), missing
/// outbox/poison table or poller columns (3, run `outbox-relay migrate`), broker
/// unreachable (4). On shutdown every worker finishes its batch — waiting at most
/// `relay.shutdown_timeout_secs` for its acks, else rolling it back to be re-sent on
/// the next start — and commits.
pub async fn run(config: Config, args: &PollArgs, shutdown: Shutdown) -> Result<PollSummary> {
    let settings = Settings::new(&config, args)?;
    let mut pollers = Vec::new();
    let mut summary = PollSummary::default();
    // Each outbox table has its own workers (`[[outbox]]`).
    for view in config.per_outbox() {
        let mut group = Vec::new();
        for _ in 0..settings.workers {
            group.push(Poller::with_settings(&view, settings).await?);
        }
        if let Some(first) = group.first_mut() {
            if args.after_cdc {
                // Before any worker polls: rows the relay delivered are not sent again.
                let marked = crate::outbox::checkpoint::mark_confirmed_sent(
                    &first.client,
                    &view,
                    settings.batch_size,
                )
                .await?;
                summary.marked_after_cdc += marked.rows;
            }
            // Before any worker polls, so no two sweeps race for the same row.
            summary.poisoned += first.poison_exhausted().await?;
        }
        pollers.extend(group);
    }
    if settings.workers > 1 {
        warn!(
            workers = settings.workers,
            "several workers: events of one key may be published out of order"
        );
    }
    info!(
        workers = settings.workers,
        batch_size = settings.batch_size,
        poll_interval_ms = millis(settings.poll_interval),
        max_attempts = settings.max_attempts,
        "polling the outbox"
    );

    let (stop_tx, stop_rx) = watch::channel(false);
    let signal = {
        let stop_tx = stop_tx.clone();
        tokio::spawn(async move {
            shutdown.await;
            stop_tx.send_replace(true);
        })
    };
    let mut workers = JoinSet::new();
    for poller in pollers {
        workers.spawn(work(poller, stop_rx.clone()));
    }
    let mut first_error = None;
    while let Some(joined) = workers.join_next().await {
        let result = joined.map_err(Error::PollerWorker);
        match result.and_then(|r| r) {
            Ok(worker) => summary.add(&worker),
            Err(e) => {
                // One worker cannot go on: stop the others gracefully, report the first.
                stop_tx.send_replace(true);
                first_error.get_or_insert(e);
            }
        }
    }
    signal.abort();
    if let Some(e) = first_error {
        return Err(e);
    }
    info!(
        delivered = summary.delivered,
        poisoned = summary.poisoned,
        batches = summary.batches,
        "poller stopped"
    );
    Ok(summary)
}

/// One worker: poll, publish, mark, until stopped.
async fn work(mut poller: Poller, mut stop: watch::Receiver<bool>) -> Result<PollSummary> {
    let mut summary = PollSummary::default();
    let mut backoff = Backoff::new(BACKOFF_INITIAL, BACKOFF_MAX);
    let grace = poller.settings.shutdown_grace;
    while !*stop.borrow() {
        let result = {
            let batch = poller.poll_once();
            tokio::pin!(batch);
            tokio::select! {
                biased;
                result = &mut batch => Some(result),
                () = stopped(&mut stop) => {
                    // Finish the batch in hand (its acks, then the marks), bounded.
                    tokio::time::timeout(grace, &mut batch).await.ok()
                }
            }
        };
        let pause = match result {
            None => {
                warn!(
                    timeout_secs = grace.as_secs(),
                    "shutdown timeout: the batch in flight was rolled back and is re-sent on the next start"
                );
                break;
            }
            Some(Ok(outcome)) => {
                summary.add_batch(&outcome);
                debug!(?outcome, "batch committed");
                pause_after(&outcome, &poller.settings, &mut backoff)
            }
            Some(Err(e)) if e.class() == ErrorClass::Transient => {
                summary.retries += 1;
                warn!(error = %e, retry_in_ms = millis(backoff.peek()), "batch rolled back; retrying");
                Some(backoff.next_pause())
            }
            Some(Err(e)) => return Err(e),
        };
        if let Some(pause) = pause {
            tokio::select! {
                biased;
                () = stopped(&mut stop) => break,
                () = tokio::time::sleep(pause) => {}
            }
        }
        if let Err(e) = poller.reconnect_if_closed().await {
            if e.class() != ErrorClass::Transient {
                return Err(e);
            }
            summary.retries += 1;
            warn!(error = %e, "cannot reconnect to PostgreSQL; retrying");
        }
    }
    Ok(summary)
}

/// Completes once the stop flag is set (or its senders are gone).
async fn stopped(stop: &mut watch::Receiver<bool>) {
    // The guard `wait_for` returns is not `Send`: drop it here, not in the caller.
    let _ = stop.wait_for(|stop| *stop).await;
}

/// How long to wait before the next poll: no wait after a full, clean batch; the
/// poll interval after a short one; a growing backoff after transient failures.
fn pause_after(
    outcome: &BatchOutcome,
    settings: &Settings,
    backoff: &mut Backoff,
) -> Option<Duration> {
    if outcome.transient > 0 {
        return Some(backoff.next_pause());
    }
    backoff.reset();
    let full = u32::try_from(outcome.fetched).is_ok_and(|n| n >= settings.batch_size);
    (!full).then_some(settings.poll_interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(batch_size: u32) -> Settings {
        Settings {
            batch_size,
            workers: 1,
            poll_interval: Duration::from_millis(200),
            max_attempts: 5,
            shutdown_grace: Duration::from_secs(1),
        }
    }

    #[test]
    fn full_batches_do_not_sleep_short_ones_do_transient_ones_back_off() {
        let s = settings(10);
        let mut backoff = Backoff::new(BACKOFF_INITIAL, BACKOFF_MAX);
        let full = BatchOutcome {
            fetched: 10,
            delivered: 10,
            ..BatchOutcome::default()
        };
        assert_eq!(pause_after(&full, &s, &mut backoff), None);
        let short = BatchOutcome {
            fetched: 3,
            ..BatchOutcome::default()
        };
        assert_eq!(pause_after(&short, &s, &mut backoff), Some(s.poll_interval));
        let transient = BatchOutcome {
            fetched: 10,
            transient: 1,
            ..BatchOutcome::default()
        };
        let first = pause_after(&transient, &s, &mut backoff);
        let second = pause_after(&transient, &s, &mut backoff);
        assert_eq!(first, Some(BACKOFF_INITIAL));
        assert_eq!(second, Some(BACKOFF_INITIAL * 2));
        for _ in 0..20 {
            pause_after(&transient, &s, &mut backoff);
        }
        assert_eq!(backoff.peek(), BACKOFF_MAX, "bounded");
        assert_eq!(pause_after(&full, &s, &mut backoff), None);
        assert_eq!(backoff.peek(), BACKOFF_INITIAL, "reset by a clean batch");
    }
}
