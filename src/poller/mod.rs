//! The polling relay (`outbox-relay poll`): the classic transactional-outbox
//! procedure, for databases where logical replication is not available, and the
//! baseline the CDC relay ([`crate::cdc::session`]) is measured against.
//!
//! # The procedure
//!
//! Each worker repeats, on its own connection:
//!
//! 1. `BEGIN`; `SELECT … FROM outbox WHERE sent_at IS NULL AND attempts < $max
//!    ORDER BY created_at, id LIMIT $batch FOR UPDATE SKIP LOCKED`;
//! 2. map every row with the CDC relay's own [`OutboxMapper`] and hand the whole
//!    batch to the same [`Publisher`] (same producer settings, keys, headers, payload
//!    bytes) — no send is awaited on its own;
//! 3. wait until every record of the batch has its delivery report;
//! 4. in the same transaction: `UPDATE … SET sent_at = statement_timestamp() WHERE
//!    id = ANY($ids)` for the acked rows (one set-based statement), `attempts` and
//!    `last_error` for rows the broker refused, a `poison_outbox` row for those that
//!    reached `max_attempts`; `COMMIT`.
//!
//! A batch that came back full is followed at once by the next one; only a short
//! batch sleeps `--poll-interval-ms`, so a backlog drains at full speed and an idle
//! outbox costs one cheap index probe per interval.
//!
//! # Never mark before the ack
//!
//! A row is marked sent only in the transaction that commits *after* its broker ack
//! (`acks=all`). A crash anywhere before that `COMMIT` rolls the marks back (and the
//! server releases the row locks), so the next poll sends the batch again: at most one
//! batch per worker is duplicated, nothing is lost (promises 1 and 2, `docs/architecture.md#promises`).
//! Consumers drop the duplicates by the `idempotency_key` header. Marking first
//! ("send after commit") would turn the same crash into a silent loss.
//!
//! # The record is the CDC relay's
//!
//! Columns are selected as `::text`, on a session with the replication connection's
//! settings ([`SESSION_OPTIONS`]: `DateStyle=ISO`, `TimeZone=UTC`,
//! `extra_float_digits=3`), so the mapper sees the very bytes `pgoutput` would send
//! and [`OutboxMapper::map_row`] builds the same record as the CDC path: key, topic,
//! payload bytes, headers, CreateTime. The one difference is the `source_lsn` header,
//! which only a WAL reader can know. The poller reads the configured
//! `[outbox.columns]` names; missing optional columns (`topic`, `headers`,
//! `idempotency_key`, …) are read as NULL, as the CDC mapper does.
//!
//! # Failures
//!
//! * **Permanent** (the record is at fault, [`kafka::classify`]: too large, invalid,
//!   topic refused): `attempts = attempts + 1`, `last_error` set, in the batch's
//!   transaction; the row is tried again by the next poll. When `attempts` reaches
//!   `max_attempts` (default `relay.max_attempts`, 5) the row is copied to
//!   `poison_outbox` in that same transaction, with the same fields, error kind and
//!   attempt count as the CDC relay writes (`lsn` is NULL: the poller has none). A row
//!   the mapper refuses (NULL entity id, bad `headers`, …) can never succeed and is
//!   poisoned on its first attempt, with `attempts` set to `max_attempts`.
//! * **Transient** (broker or network; `QueueFull`, purges): never counted. Deliveries
//!   do not fail while the broker is down — the producer retries forever
//!   (`message.timeout.ms=0`) — so the worker simply waits for the acks with the batch
//!   locked; acked rows of a batch are marked, the others stay as they were and the
//!   worker backs off before polling again. PostgreSQL connection loss rolls the batch
//!   back (re-sent later, not lost) and the worker reconnects with backoff.
//! * **Fatal** (the producer is unusable, a missing table or column): the poller stops
//!   with the process error's exit code.
//!
//! **Poisoned rows keep `sent_at` NULL** — they were never delivered — and are
//! excluded by `attempts < max_attempts`, which is what poisoning sets. Consequences,
//! by design: they stay in the partial index (a few heap checks per poll, which is
//! negligible while poison is rare); *raising* `max_attempts` later makes them eligible
//! again (they are retried; if they fail again they are poisoned again — evidence,
//! not loss); *lowering* it would leave rows with `attempts` between the two limits
//! excluded yet unpoisoned, so at start-up the poller copies every such row without a
//! poison row to `poison_outbox` ([`Poller::poison_exhausted`]). Rows are never
//! deleted, by the poller or by poisoning.
//!
//! # SKIP LOCKED and ordering
//!
//! `FOR UPDATE` locks the batch so that a second worker (or a second poller process)
//! cannot send the same rows; `SKIP LOCKED` lets it take the *next* rows instead of
//! queueing behind the lock. That is what makes several workers scale — and what
//! breaks per-key order: worker B may publish and commit rows `1001..2000` while worker
//! A still waits for the acks of `1..1000`, so a later event of an entity can reach
//! Kafka before an earlier one. Hence **one worker by default**: with one worker,
//! batches go out one after the other in `(created_at, id)` order, and within a batch
//! the idempotent producer keeps the order of every partition. Two caveats remain even
//! then, and the CDC relay does not share the first:
//!
//! * `created_at` is the *insert* time, not the commit time. A long transaction that
//!   inserted its row early and commits late becomes visible after younger rows were
//!   already sent. Writers that lock the entity's row *before* inserting the outbox
//!   row (the usual pattern: update the aggregate, then record its event) are not
//!   affected, because the second writer waits for the first to commit; unlocked
//!   writers of one entity are. The CDC relay reads in commit order.
//! * A row that failed and is retried later is published after rows of its key that
//!   succeeded meanwhile. The CDC relay has the same property for poisoned events.
//!
//! # What polling costs that CDC does not
//!
//! The CDC relay reads the WAL the application's `INSERT` already wrote and writes
//! nothing to the table. The poller's `UPDATE` writes a new version of every row:
//! `sent_at` is in the partial index's predicate, so the update can never be HOT —
//! each sent row costs a new heap tuple, an entry in every index of the table (primary
//! key, `idempotency_key`), WAL for all of it (full-page images after a checkpoint),
//! and a dead tuple for vacuum. Until vacuum runs, dead index entries make the poll's
//! index scan longer; tune autovacuum for the outbox (e.g. a low
//! `autovacuum_vacuum_scale_factor`) and delete delivered rows on a retention schedule.
//! The batch's transaction also stays open while acks are awaited, which holds back the
//! vacuum horizon for as long as a broker outage lasts.
//!
//! # Falling back from the CDC relay
//!
//! `--after-cdc` is the emergency switch from `run` to `poll` (logical replication
//! unavailable, the slot lost, …). The CDC relay never marks rows, so before
//! polling the poller marks `sent_at` on every row the relay's slot has confirmed,
//! by the newest [checkpoint](crate::outbox::checkpoint) the slot passed (set-based batches
//! of `--batch-size`). The rows between that checkpoint and the relay's true position
//! are sent again: duplicates with their original idempotency key, never losses. How
//! many is bounded by the traffic between two checkpoints (`retention.interval`),
//! plus the longest transaction open when the checkpoint was taken. Without any
//! confirmed checkpoint, every unsent row is sent again (with a warning).
//!
//! # Testing seam
//!
//! [`Poller::publish_batch`] (steps 1–3) and [`PublishedBatch::mark`] (step 4) are
//! separate calls, so a test can drop the batch between them — the crash between
//! publishing and marking — and watch the rows come back.

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use rdkafka::types::RDKafkaErrorCode;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio_postgres::{Client, Row, Statement, Transaction};
use tracing::{debug, info, warn};

use crate::config::ConfigError;
use crate::config::{Columns, Config, OutboxConfig, quote_ident, quote_qualified};
use crate::delivery::ErrorClass;
use crate::delivery::{EventId, Failure};
use crate::error::{Error, Result};
use crate::kafka::{self, DeliveryReport, Publisher, SendRejected};
use crate::lifecycle::Shutdown;
use crate::lsn::Lsn;
use crate::outbox::{OutboxEvent, OutboxMapper, OutboxRow, PayloadFormat, PoisonFields};
use crate::poison::{PoisonRow, insert_row};
use crate::postgres::conninfo::ConnInfo;
use crate::postgres::prerequisite::Prerequisite;
use crate::postgres::replication::SESSION_OPTIONS;

/// Default `--batch-size`.
pub const DEFAULT_BATCH_SIZE: u32 = 1000;
/// Largest `--batch-size`: the producer queue (at least 100 000 records) holds a batch.
pub const MAX_BATCH_SIZE: u32 = 100_000;
/// Default `--workers`.
pub const DEFAULT_WORKERS: u32 = 1;
/// Default `--poll-interval-ms`.
pub const DEFAULT_POLL_INTERVAL_MS: u64 = 200;

/// Backoff after a transient failure (broker, connection), doubling per failure.
const BACKOFF_INITIAL: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// How long acks may be outstanding before a warning (repeated) says why we wait.
const ACK_WAIT_WARNING: Duration = Duration::from_secs(30);
/// Broker check at start-up (exit code 4 when it fails).
const BROKER_CHECK_TIMEOUT: Duration = Duration::from_secs(10);
/// `poison_outbox.error_kind` of rows poisoned by the start-up sweep.
pub const ATTEMPTS_EXHAUSTED: &str = "attempts_exhausted";

/// Flags of `outbox-relay poll` (besides `--config`).
#[derive(Debug, Clone, clap::Args)]
pub struct PollArgs {
    /// Rows per batch: one transaction, one round of produce and acks.
    #[arg(long, default_value_t = DEFAULT_BATCH_SIZE,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_BATCH_SIZE)))]
    pub batch_size: u32,
    /// Concurrent workers, each with its own PostgreSQL connection and producer.
    /// More than 1 breaks per-key order (SKIP LOCKED lets a later batch commit
    /// first); keep 1 unless consumers do not need order.
    #[arg(long, default_value_t = DEFAULT_WORKERS,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub workers: u32,
    /// Pause after a batch that came back short (never after a full one).
    #[arg(long, default_value_t = DEFAULT_POLL_INTERVAL_MS)]
    pub poll_interval_ms: u64,
    /// Permanent delivery failures before a row is poisoned [default: relay.max_attempts].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(i32::MAX)))]
    pub max_attempts: Option<u32>,
    /// Fall back from the CDC relay: first mark sent every row the relay confirmed
    /// (by the newest checkpoint its slot passed, see `retention`), then poll the
    /// rest. Rows after that checkpoint are sent again (duplicates, never losses).
    #[arg(long)]
    pub after_cdc: bool,
}

impl Default for PollArgs {
    fn default() -> Self {
        PollArgs {
            batch_size: DEFAULT_BATCH_SIZE,
            workers: DEFAULT_WORKERS,
            poll_interval_ms: DEFAULT_POLL_INTERVAL_MS,
            max_attempts: None,
            after_cdc: false,
        }
    }
}

/// The flags resolved against the config.
#[derive(Debug, Clone, Copy)]
struct Settings {
    batch_size: u32,
    workers: u32,
    poll_interval: Duration,
    /// At least 1, at most `i32::MAX` (the `attempts` column is `integer`).
    max_attempts: i32,
    shutdown_grace: Duration,
}

impl Settings {
    fn new(config: &Config, args: &PollArgs) -> Result<Settings, ConfigError> {
        let invalid = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        if !(1..=MAX_BATCH_SIZE).contains(&args.batch_size) {
            return invalid(&format!("--batch-size must be 1..={MAX_BATCH_SIZE}"));
        }
        if args.workers == 0 {
            return invalid("--workers must be at least 1");
        }
        let max_attempts = args.max_attempts.unwrap_or(config.relay.max_attempts);
        let Ok(max_attempts @ 1..) = i32::try_from(max_attempts) else {
            return invalid("--max-attempts (relay.max_attempts) must be 1..=2147483647");
        };
        Ok(Settings {
            batch_size: args.batch_size,
            workers: args.workers,
            poll_interval: Duration::from_millis(args.poll_interval_ms),
            max_attempts,
            shutdown_grace: Duration::from_secs(config.relay.shutdown_timeout_secs),
        })
    }
}

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

/// What one committed batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Rows the poll returned.
    pub fetched: usize,
    /// Rows acked and marked sent.
    pub delivered: usize,
    /// Rows whose `attempts` grew (permanent failures and unmappable rows).
    pub failed: usize,
    /// Rows copied to `poison_outbox`.
    pub poisoned: usize,
    /// Rows left untouched after a transient failure.
    pub transient: usize,
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
    for _ in 0..settings.workers {
        pollers.push(Poller::with_settings(&config, settings).await?);
    }
    let mut summary = PollSummary::default();
    if let Some(first) = pollers.first_mut() {
        if args.after_cdc {
            // Before any worker polls: rows the relay delivered are not sent again.
            let marked = crate::outbox::checkpoint::mark_confirmed_sent(
                &first.client,
                &config,
                settings.batch_size,
            )
            .await?;
            summary.marked_after_cdc = marked.rows;
        }
        // Before any worker polls, so no two sweeps race for the same row.
        summary.poisoned += first.poison_exhausted().await?;
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
        poll_interval_ms = settings.poll_interval.as_millis() as u64,
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
        let result = joined.map_err(|e| Error::Other(format!("poller worker failed: {e}")));
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
    let mut backoff = BACKOFF_INITIAL;
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
                warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "batch rolled back; retrying");
                next_backoff(&mut backoff)
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
    backoff: &mut Duration,
) -> Option<Duration> {
    if outcome.transient > 0 {
        return next_backoff(backoff);
    }
    *backoff = BACKOFF_INITIAL;
    let full = u32::try_from(outcome.fetched).is_ok_and(|n| n >= settings.batch_size);
    (!full).then_some(settings.poll_interval)
}

/// Returns the current backoff and doubles it for next time.
fn next_backoff(backoff: &mut Duration) -> Option<Duration> {
    let pause = *backoff;
    *backoff = (*backoff * 2).min(BACKOFF_MAX);
    Some(pause)
}

// ---------------------------------------------------------------------------
// The poller
// ---------------------------------------------------------------------------

/// One worker's resources: a PostgreSQL connection with its prepared statements, a
/// producer, and the mapper.
pub struct Poller {
    conninfo: ConnInfo,
    client: Client,
    sql: Sql,
    prepared: Prepared,
    layout: Layout,
    mapper: OutboxMapper,
    publisher: Publisher,
    reports: mpsc::Receiver<DeliveryReport>,
    settings: Settings,
    /// Event id of the next row sent (ids only have to be unique per producer).
    next_id: u64,
}

impl fmt::Debug for Poller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Poller")
            .field("conninfo", &self.conninfo.to_string())
            .field("settings", &self.settings)
            .field("publisher", &self.publisher)
            .finish_non_exhaustive()
    }
}

impl Poller {
    /// Connects to PostgreSQL and the broker and checks the tables, as one worker of
    /// `outbox-relay poll` with these flags would.
    ///
    /// # Errors
    ///
    /// As [`run`] at start-up.
    pub async fn connect(config: &Config, args: &PollArgs) -> Result<Poller> {
        Poller::with_settings(config, Settings::new(config, args)?).await
    }

    async fn with_settings(config: &Config, settings: Settings) -> Result<Poller> {
        let conninfo = crate::postgres::parse_url(&config.postgres.url)?;
        let mapper =
            OutboxMapper::new(&config.outbox, &config.kafka, config.kafka.envelope.clone())?;
        let client = session(&conninfo).await?;
        let layout = inspect_tables(&client, &config.outbox).await?;
        let sql = Sql::new(&config.outbox, &layout);
        let prepared = Prepared::new(&client, &sql).await?;

        let producer_config = kafka::producer_config(&config.kafka, &config.relay)?;
        // Room for a whole batch of reports, so the delivery thread never waits.
        let capacity = kafka::report_capacity(&config.relay).max(settings.batch_size as usize + 1);
        let (publisher, reports) = Publisher::new(producer_config, capacity)?;
        publisher.check_broker(BROKER_CHECK_TIMEOUT).await?;
        Ok(Poller {
            conninfo,
            client,
            sql,
            prepared,
            layout,
            mapper,
            publisher,
            reports,
            settings,
            next_id: 0,
        })
    }

    /// The batch query, e.g. for `EXPLAIN`: `$1` is `max_attempts`, `$2` the batch size.
    #[must_use]
    pub fn poll_sql(&self) -> &str {
        &self.sql.select_batch
    }

    /// One full round: [`Poller::publish_batch`], then [`PublishedBatch::mark`].
    ///
    /// # Errors
    ///
    /// PostgreSQL errors (transient ones as [`Error::Transient`]; the batch is rolled
    /// back and re-sent later) and a fatal producer error ([`Error::BrokerUnavailable`]).
    pub async fn poll_once(&mut self) -> Result<BatchOutcome> {
        self.publish_batch().await?.mark().await
    }

    /// Steps 1–3 of the procedure: opens the transaction, locks the next batch, sends
    /// every row and waits for every delivery report. Nothing is marked yet: dropping
    /// the returned batch rolls back, and its rows are polled (and sent) again.
    ///
    /// # Errors
    ///
    /// As [`Poller::poll_once`].
    pub async fn publish_batch(&mut self) -> Result<PublishedBatch<'_>> {
        let Poller {
            client,
            prepared,
            layout,
            mapper,
            publisher,
            reports,
            settings,
            next_id,
            ..
        } = self;
        let tx = client.transaction().await.map_err(pg_error)?;
        let polled = tx
            .query(
                &prepared.select_batch,
                &[&settings.max_attempts, &i64::from(settings.batch_size)],
            )
            .await
            .map_err(pg_error)?;
        let base = *next_id;
        *next_id = next_id.wrapping_add(polled.len() as u64);
        let mut rows = Vec::with_capacity(polled.len());
        for row in &polled {
            let (polled, outbox_row) = read_row(row, layout.payload_format)?;
            rows.push(BatchRow::map(mapper, polled, &outbox_row, None));
        }
        drop(polled);
        publish(publisher, reports, base, &mut rows).await?;
        Ok(PublishedBatch {
            tx,
            prepared,
            max_attempts: settings.max_attempts,
            rows,
        })
    }

    /// The start-up sweep: copies to `poison_outbox` every unsent row whose `attempts`
    /// already reached `max_attempts` but has no poison row (`max_attempts` was
    /// lowered, or `attempts` was set by hand), since polling excludes such rows.
    /// Returns how many rows it poisoned.
    ///
    /// # Errors
    ///
    /// PostgreSQL errors.
    pub async fn poison_exhausted(&mut self) -> Result<u64> {
        let mut poisoned = 0;
        loop {
            let tx = self.client.transaction().await.map_err(pg_error)?;
            let rows = tx
                .query(
                    &self.prepared.sweep,
                    &[
                        &self.settings.max_attempts,
                        &i64::from(self.settings.batch_size),
                    ],
                )
                .await
                .map_err(pg_error)?;
            for row in &rows {
                let (polled, outbox_row) = read_row(row, self.layout.payload_format)?;
                let fields = match self.mapper.map_row(&outbox_row, None) {
                    Ok(event) => event.poison_fields(),
                    Err(unmappable) => unmappable.fields,
                };
                let error = format!(
                    "attempts ({}) reached max_attempts ({}) without a poison row; last error: {}",
                    polled.attempts,
                    self.settings.max_attempts,
                    polled.last_error.as_deref().unwrap_or("none recorded")
                );
                let poison = PoisonRow {
                    fields,
                    error,
                    error_kind: ATTEMPTS_EXHAUSTED.to_owned(),
                    attempts: polled.attempts,
                    lsn: None,
                };
                insert_row(&tx, &self.prepared.insert_poison, &poison)
                    .await
                    .map_err(pg_error)?;
                warn!(outbox_id = %polled.id, attempts = polled.attempts, "row poisoned at start-up: attempts exhausted");
            }
            tx.commit().await.map_err(pg_error)?;
            poisoned += rows.len() as u64;
            if rows.len() < self.settings.batch_size as usize {
                return Ok(poisoned);
            }
        }
    }

    /// Opens a new session when the old one died (server restart, network).
    async fn reconnect_if_closed(&mut self) -> Result<()> {
        if !self.client.is_closed() {
            return Ok(());
        }
        let client = session(&self.conninfo).await?;
        self.prepared = Prepared::new(&client, &self.sql).await?;
        self.client = client;
        info!("reconnected to PostgreSQL");
        Ok(())
    }
}

/// A connection with the replication session's text-output settings.
pub(crate) async fn session(conninfo: &ConnInfo) -> Result<Client> {
    let client = crate::postgres::connect_info(conninfo).await?;
    client
        .batch_execute(&session_settings_sql(SESSION_OPTIONS))
        .await
        .map_err(pg_error)?;
    Ok(client)
}

/// `-c name=value …` startup options as `SET` statements, so a metadata session
/// formats values exactly like the replication session.
fn session_settings_sql(options: &str) -> String {
    options
        .split_whitespace()
        .filter_map(|token| token.split_once('='))
        .map(|(name, value)| format!("SET {name} = '{}';", value.replace('\'', "''")))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Sends every row of the batch, then waits for all reports (never one at a time).
pub(crate) async fn publish(
    publisher: &Publisher,
    reports: &mut mpsc::Receiver<DeliveryReport>,
    base: u64,
    rows: &mut [BatchRow],
) -> Result<()> {
    let mut pending = 0usize;
    for index in 0..rows.len() {
        let id = EventId::from_raw(base.wrapping_add(index as u64));
        let mut sent = send_row(publisher, id, &rows[index]);
        while let Some(Err(rejected)) = &sent
            && rejected.code == RDKafkaErrorCode::QueueFull
            && pending > 0
        {
            // The local queue is full: let some of the batch drain, then retry.
            if apply_report(next_report(reports, pending).await?, base, rows)? {
                pending -= 1;
            }
            sent = send_row(publisher, id, &rows[index]);
        }
        match (sent, &mut rows[index].result) {
            (Some(Ok(())), _) => pending += 1,
            (Some(Err(rejected)), RowResult::Event { delivery, .. }) => {
                *delivery = Delivery::Failed {
                    failure: rejected.failure,
                    kind: kafka::error_kind(rejected.code),
                    message: rejected.message,
                };
            }
            _ => {}
        }
    }
    while pending > 0 {
        let report = next_report(reports, pending).await?;
        if apply_report(report, base, rows)? {
            pending -= 1;
        }
    }
    Ok(())
}

/// Hands one row's record to the producer; `None` for a row that has no record.
fn send_row(
    publisher: &Publisher,
    id: EventId,
    row: &BatchRow,
) -> Option<std::result::Result<(), SendRejected>> {
    let RowResult::Event { event, .. } = &row.result else {
        return None;
    };
    Some(publisher.send_event(id, event))
}

/// The next delivery report, warning now and then while the broker keeps us waiting.
async fn next_report(
    reports: &mut mpsc::Receiver<DeliveryReport>,
    pending: usize,
) -> Result<DeliveryReport> {
    loop {
        match tokio::time::timeout(ACK_WAIT_WARNING, reports.recv()).await {
            Ok(Some(report)) => return Ok(report),
            Ok(None) => {
                return Err(Error::Other(
                    "the producer's delivery channel closed".into(),
                ));
            }
            Err(_) => warn!(
                pending,
                "still waiting for broker acks (broker down?); the batch stays locked and unmarked"
            ),
        }
    }
}

/// Records a report against its row; `false` for a report of an earlier batch.
fn apply_report(report: DeliveryReport, base: u64, rows: &mut [BatchRow]) -> Result<bool> {
    if report.is_fatal() {
        let message = report.result.err().map(|(_, m)| m).unwrap_or_default();
        return Err(Error::BrokerUnavailable(format!(
            "the producer hit a fatal error: {message}"
        )));
    }
    let index = report.id.get().wrapping_sub(base);
    let row = usize::try_from(index).ok().and_then(|i| rows.get_mut(i));
    let Some(BatchRow {
        result: RowResult::Event { delivery, .. },
        ..
    }) = row
    else {
        return Ok(false);
    };
    if !matches!(delivery, Delivery::Pending) {
        return Ok(false);
    }
    *delivery = match report.result {
        Ok(_) => Delivery::Acked,
        Err((code, message)) => Delivery::Failed {
            failure: kafka::classify(code),
            kind: kafka::error_kind(code),
            message,
        },
    };
    Ok(true)
}

// ---------------------------------------------------------------------------
// A published batch and its marks
// ---------------------------------------------------------------------------

/// A batch whose records were all sent and reported, inside its still-open
/// transaction. [`mark`](PublishedBatch::mark) records the outcomes and commits;
/// dropping it instead rolls back (as a crash would), so its rows are sent again.
#[must_use = "dropping a published batch rolls it back: its rows are sent again"]
pub struct PublishedBatch<'a> {
    tx: Transaction<'a>,
    prepared: &'a Prepared,
    max_attempts: i32,
    rows: Vec<BatchRow>,
}

impl fmt::Debug for PublishedBatch<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PublishedBatch")
            .field("rows", &self.rows.len())
            .field("acked", &self.acked())
            .finish_non_exhaustive()
    }
}

impl PublishedBatch<'_> {
    /// Rows in the batch.
    #[must_use]
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the poll found nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Rows the broker acked (not yet marked).
    #[must_use]
    pub fn acked(&self) -> usize {
        self.rows
            .iter()
            .filter(|r| {
                matches!(
                    r.result,
                    RowResult::Event {
                        delivery: Delivery::Acked,
                        ..
                    }
                )
            })
            .count()
    }

    /// Step 4: marks acked rows sent, records failures, poisons exhausted rows, and
    /// commits — all or nothing.
    ///
    /// # Errors
    ///
    /// PostgreSQL errors; nothing is marked then, and the rows are sent again.
    pub async fn mark(self) -> Result<BatchOutcome> {
        let PublishedBatch {
            tx,
            prepared,
            max_attempts,
            rows,
        } = self;
        let outcome = write_marks(&tx, prepared, max_attempts, &rows).await?;
        tx.commit().await.map_err(pg_error)?;
        Ok(outcome)
    }
}

/// Step 4 without the commit: marks acked rows sent, records failures and poisons
/// exhausted rows inside `tx` (the poller's batch, or a cutover's marks).
pub(crate) async fn write_marks(
    tx: &Transaction<'_>,
    prepared: &Prepared,
    max_attempts: i32,
    rows: &[BatchRow],
) -> Result<BatchOutcome> {
    let plan = plan_marks(rows, max_attempts);
    if !plan.sent.is_empty() {
        let updated = tx
            .execute(&prepared.mark_sent, &[&plan.sent])
            .await
            .map_err(pg_error)?;
        if updated != plan.sent.len() as u64 {
            warn!(
                expected = plan.sent.len(),
                updated, "marking sent rows updated an unexpected number of rows"
            );
        }
    }
    if !plan.failed.ids.is_empty() {
        tx.execute(
            &prepared.record_failures,
            &[&plan.failed.ids, &plan.failed.attempts, &plan.failed.errors],
        )
        .await
        .map_err(pg_error)?;
    }
    for &(index, attempts) in &plan.poison {
        let Some(row) = rows.get(index) else { continue };
        let (fields, error_kind, error) = match &row.result {
            RowResult::Event { event, delivery } => {
                let (kind, message) = match delivery {
                    Delivery::Failed { kind, message, .. } => (*kind, message.as_str()),
                    _ => ("unknown", "delivery failed"),
                };
                (event.poison_fields(), kind, message.to_owned())
            }
            RowResult::Unmappable {
                fields,
                error_kind,
                reason,
            } => ((**fields).clone(), *error_kind, reason.clone()),
        };
        let poison = PoisonRow {
            fields,
            error,
            error_kind: error_kind.to_owned(),
            attempts,
            lsn: None,
        };
        insert_row(tx, &prepared.insert_poison, &poison)
            .await
            .map_err(pg_error)?;
        warn!(
            outbox_id = %row.polled.id,
            idempotency_key = poison.fields.idempotency_key.as_deref().unwrap_or(""),
            error_kind,
            error = %poison.error,
            attempts,
            "event poisoned"
        );
    }
    Ok(BatchOutcome {
        fetched: rows.len(),
        delivered: plan.sent.len(),
        failed: plan.failed.ids.len(),
        poisoned: plan.poison.len(),
        transient: plan.transient,
    })
}

/// One polled row: what the marks need, and what became of it.
#[derive(Debug)]
pub(crate) struct BatchRow {
    pub(crate) polled: Polled,
    pub(crate) result: RowResult,
}

impl BatchRow {
    /// Maps `row` to its record (with `source_lsn` when given), or keeps it as
    /// unmappable; nothing is delivered yet.
    pub(crate) fn map(
        mapper: &OutboxMapper,
        polled: Polled,
        row: &OutboxRow,
        source_lsn: Option<Lsn>,
    ) -> BatchRow {
        let result = match mapper.map_row(row, source_lsn) {
            Ok(event) => RowResult::Event {
                event,
                delivery: Delivery::Pending,
            },
            Err(unmappable) => RowResult::Unmappable {
                fields: Box::new(unmappable.fields),
                error_kind: unmappable.error_kind,
                reason: unmappable.reason,
            },
        };
        BatchRow { polled, result }
    }
}

/// The bookkeeping columns of a polled row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Polled {
    /// The `id` column as text, to address the row in the marking statements.
    pub(crate) id: String,
    /// `attempts` before this batch.
    pub(crate) attempts: i32,
    pub(crate) last_error: Option<String>,
}

#[derive(Debug)]
// The large variant is the common one (one per row); boxing it would cost an
// allocation per event to save memory on the rare unmappable row.
#[allow(clippy::large_enum_variant)]
pub(crate) enum RowResult {
    Event {
        event: OutboxEvent,
        delivery: Delivery,
    },
    /// The mapper refused the row; it is poisoned without being sent.
    Unmappable {
        fields: Box<PoisonFields>,
        error_kind: &'static str,
        reason: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Delivery {
    Pending,
    Acked,
    Failed {
        failure: Failure,
        kind: &'static str,
        message: String,
    },
}

/// What [`PublishedBatch::mark`] writes, decided without I/O.
#[derive(Debug, Default, PartialEq, Eq)]
struct MarkPlan {
    /// Ids of acked rows: `sent_at` is set.
    sent: Vec<String>,
    /// Rows whose `attempts` / `last_error` change.
    failed: FailedRows,
    /// `(row index, attempts recorded in poison_outbox)` of rows to poison.
    poison: Vec<(usize, i32)>,
    /// Rows left as they were (transient failure, or no report).
    transient: usize,
}

/// Parallel arrays for `unnest` in the failure statement.
#[derive(Debug, Default, PartialEq, Eq)]
struct FailedRows {
    ids: Vec<String>,
    attempts: Vec<i32>,
    errors: Vec<String>,
}

fn plan_marks(rows: &[BatchRow], max_attempts: i32) -> MarkPlan {
    let mut plan = MarkPlan::default();
    for (index, row) in rows.iter().enumerate() {
        let tries = row.polled.attempts.saturating_add(1);
        let (recorded, error) = match &row.result {
            RowResult::Event { delivery, .. } => match delivery {
                Delivery::Acked => {
                    plan.sent.push(row.polled.id.clone());
                    continue;
                }
                Delivery::Pending
                | Delivery::Failed {
                    failure: Failure::Transient,
                    ..
                } => {
                    plan.transient += 1;
                    continue;
                }
                Delivery::Failed {
                    failure: Failure::Permanent,
                    kind,
                    message,
                } => (tries, format!("{kind}: {message}")),
            },
            // Retrying cannot help: poison now, and let attempts exclude the row.
            RowResult::Unmappable {
                error_kind, reason, ..
            } => (tries.max(max_attempts), format!("{error_kind}: {reason}")),
        };
        plan.failed.ids.push(row.polled.id.clone());
        plan.failed.attempts.push(recorded);
        plan.failed.errors.push(error);
        if recorded >= max_attempts {
            plan.poison.push((index, tries));
        }
    }
    plan
}

// ---------------------------------------------------------------------------
// Table layout and SQL
// ---------------------------------------------------------------------------

/// Columns of the outbox table as the poller reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    /// The configured column of each [`OutboxRow`] field (in [`field_columns`]
    /// order), `None` when the table has no such column (read as NULL).
    fields: [Option<String>; FIELDS],
    /// SQL type of the id column (`format_type`), for `text[]::type[]` casts.
    id_type: String,
    pub(crate) payload_format: PayloadFormat,
}

const FIELDS: usize = 9;
const ID: usize = 0;
const IDEMPOTENCY_KEY: usize = 1;
const PAYLOAD: usize = 7;
const CREATED_AT: usize = 8;

/// `(config key, configured column)` in [`OutboxRow`] field order.
fn field_columns(c: &Columns) -> [(&'static str, &str); FIELDS] {
    [
        ("id", &c.id),
        ("idempotency_key", &c.idempotency_key),
        ("aggregate_type", &c.aggregate_type),
        ("aggregate_id", &c.aggregate_id),
        ("event_type", &c.event_type),
        ("topic", &c.topic),
        ("headers", &c.headers),
        ("payload", &c.payload),
        ("created_at", &c.created_at),
    ]
}

/// Fields without which the poller cannot work (or every row would be poisoned).
const REQUIRED_FIELDS: [&str; 4] = ["id", "aggregate_id", "payload", "created_at"];
/// The poller's own columns (migrations/0001_outbox.sql).
const POLLER_COLUMNS: [&str; 3] = ["sent_at", "attempts", "last_error"];

/// A column of the outbox table: name, `format_type` and `pg_type.typname`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct TableColumn {
    name: String,
    sql_type: String,
    type_name: String,
}

fn resolve_layout(
    table: &str,
    outbox: &OutboxConfig,
    columns: &[TableColumn],
) -> std::result::Result<Layout, Prerequisite> {
    let find = |name: &str| columns.iter().find(|c| c.name == name);
    let mut missing = Vec::new();
    let mut fields: [Option<String>; FIELDS] = Default::default();
    for (slot, (key, name)) in fields.iter_mut().zip(field_columns(&outbox.columns)) {
        match find(name) {
            Some(column) => *slot = Some(column.name.clone()),
            None if REQUIRED_FIELDS.contains(&key) => {
                missing.push(format!("{name:?} (outbox.columns.{key})"));
            }
            None => {}
        }
    }
    for name in POLLER_COLUMNS {
        if find(name).is_none() {
            missing.push(format!("{name:?}"));
        }
    }
    if !missing.is_empty() {
        return Err(Prerequisite::PollerColumnsMissing {
            table: table.to_owned(),
            columns: missing.join(", "),
        });
    }
    let column = |field: usize| fields[field].as_deref().and_then(find);
    let id_type = column(ID).map(|c| c.sql_type.clone()).unwrap_or_default();
    let payload_format = match column(PAYLOAD).map(|c| c.type_name.as_str()) {
        Some("json" | "jsonb") => PayloadFormat::Json,
        Some("bytea") => PayloadFormat::ByteaText,
        _ => PayloadFormat::Text,
    };
    Ok(Layout {
        fields,
        id_type,
        payload_format,
    })
}

/// Reads the outbox table's columns; a missing table or column is a prerequisite
/// error (exit code 3).
pub(crate) async fn inspect_tables(client: &Client, outbox: &OutboxConfig) -> Result<Layout> {
    let table = quote_qualified(&outbox.table);
    let poison = quote_qualified(&outbox.poison_table);
    let exists = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL",
            &[&table, &poison],
        )
        .await
        .map_err(pg_error)?;
    for (i, name) in [&outbox.table, &outbox.poison_table]
        .into_iter()
        .enumerate()
    {
        if !exists.try_get::<_, bool>(i).map_err(pg_error)? {
            let table = name.clone();
            return Err(if i == 0 {
                Prerequisite::OutboxTableMissing { table }
            } else {
                Prerequisite::PoisonTableMissing { table }
            }
            .into());
        }
    }
    let rows = client
        .query(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), t.typname::text
             FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
            &[&table],
        )
        .await
        .map_err(pg_error)?;
    let columns = rows
        .iter()
        .map(|r| {
            Ok(TableColumn {
                name: r.try_get(0)?,
                sql_type: r.try_get(1)?,
                type_name: r.try_get(2)?,
            })
        })
        .collect::<std::result::Result<Vec<_>, tokio_postgres::Error>>()
        .map_err(pg_error)?;
    Ok(resolve_layout(&outbox.table, outbox, &columns)?)
}

/// The poller's statements, built once from the config and the table layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sql {
    select_batch: String,
    /// Every row the poller would still send, in its order, unlocked and unlimited,
    /// leaving out rows that have a poison row (poisoned by the CDC relay, or
    /// replayed): the backlog a cutover publishes (`$1` is `max_attempts`).
    pub(crate) backlog: String,
    sweep: String,
    mark_sent: String,
    record_failures: String,
    insert_poison: String,
}

impl Sql {
    pub(crate) fn new(outbox: &OutboxConfig, layout: &Layout) -> Sql {
        let table = quote_qualified(&outbox.table);
        let poison = quote_qualified(&outbox.poison_table);
        let col = |field: usize| match &layout.fields[field] {
            Some(name) => format!("o.{}::text", quote_ident(name)),
            None => "NULL::text".to_owned(),
        };
        // Layout guarantees the required columns; the fallback only keeps this total.
        let name = |field: usize| quote_ident(layout.fields[field].as_deref().unwrap_or("id"));
        let (id, created_at) = (name(ID), name(CREATED_AT));
        let id_type = &layout.id_type;
        let list = (0..FIELDS).map(col).collect::<Vec<_>>().join(", ");
        // `sent_at IS NULL` is the partial index's predicate and (created_at, id) its
        // key, so the scan walks the index in order and stops after the batch.
        let order = format!("ORDER BY o.{created_at}, o.{id} LIMIT $2 FOR UPDATE SKIP LOCKED");
        let select = format!("SELECT {list}, o.attempts::int4, o.last_error::text FROM {table} o");
        Sql {
            select_batch: format!("{select} WHERE o.sent_at IS NULL AND o.attempts < $1 {order}"),
            backlog: format!(
                "{select} WHERE o.sent_at IS NULL AND o.attempts < $1 AND NOT EXISTS (
                     SELECT 1 FROM {poison} p
                     WHERE p.idempotency_key = COALESCE({}, o.{id}::text))
                 ORDER BY o.{created_at}, o.{id}",
                col(IDEMPOTENCY_KEY)
            ),
            sweep: format!(
                "{select} WHERE o.sent_at IS NULL AND o.attempts >= $1 AND NOT EXISTS (
                     SELECT 1 FROM {poison} p
                     WHERE p.idempotency_key = COALESCE({}, o.{id}::text)) {order}",
                col(IDEMPOTENCY_KEY)
            ),
            // statement_timestamp(): when the marks were written, after the acks
            // (now() would be the poll's start).
            mark_sent: format!(
                "UPDATE {table} SET sent_at = statement_timestamp()
                 WHERE {id} = ANY($1::text[]::{id_type}[])"
            ),
            record_failures: format!(
                "UPDATE {table} AS o SET attempts = f.attempts, last_error = f.error
                 FROM unnest($1::text[], $2::int4[], $3::text[]) AS f(id, attempts, error)
                 WHERE o.{id} = f.id::{id_type}"
            ),
            insert_poison: crate::poison::insert_statement(&outbox.poison_table),
        }
    }
}

/// [`Sql`] prepared on one connection.
#[derive(Debug)]
pub(crate) struct Prepared {
    select_batch: Statement,
    sweep: Statement,
    mark_sent: Statement,
    record_failures: Statement,
    insert_poison: Statement,
}

impl Prepared {
    pub(crate) async fn new(client: &Client, sql: &Sql) -> Result<Prepared> {
        let prepare = |text: &str| {
            let text = text.to_owned();
            async move { client.prepare(&text).await.map_err(pg_error) }
        };
        Ok(Prepared {
            select_batch: prepare(&sql.select_batch).await?,
            sweep: prepare(&sql.sweep).await?,
            mark_sent: prepare(&sql.mark_sent).await?,
            record_failures: prepare(&sql.record_failures).await?,
            insert_poison: prepare(&sql.insert_poison).await?,
        })
    }
}

/// One row of the batch (or sweep) query.
pub(crate) fn read_row(row: &Row, payload_format: PayloadFormat) -> Result<(Polled, OutboxRow)> {
    let text = |i: usize| -> Result<Option<Bytes>> {
        let value: Option<&str> = row.try_get(i).map_err(pg_error)?;
        Ok(value.map(|v| Bytes::copy_from_slice(v.as_bytes())))
    };
    let id = text(ID)?;
    let outbox = OutboxRow {
        id: id.clone(),
        idempotency_key: text(1)?,
        aggregate_type: text(2)?,
        aggregate_id: text(3)?,
        event_type: text(4)?,
        topic: text(5)?,
        headers: text(6)?,
        payload: text(7)?,
        payload_format,
        created_at: text(8)?,
    };
    // The id is the primary key; NULL would be a broken table.
    let id = id.ok_or_else(|| Error::Other("outbox row with a NULL id".into()))?;
    let polled = Polled {
        id: String::from_utf8_lossy(&id).into_owned(),
        attempts: row.try_get(FIELDS).map_err(pg_error)?,
        last_error: row.try_get(FIELDS + 1).map_err(pg_error)?,
    };
    Ok((polled, outbox))
}

/// Classifies a PostgreSQL error as the CDC relay's connections do
/// ([`classify_sqlstate`](crate::postgres::replication::classify_sqlstate)): connection
/// loss, server shutdown, serialization failures and resource exhaustion are transient
/// (the batch is rolled back and retried); missing privileges are a prerequisite error;
/// anything else stops the poller.
pub(crate) fn pg_error(e: tokio_postgres::Error) -> Error {
    crate::postgres::process_error(e.into(), "PostgreSQL: ").into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::poison::valid_json_or_string;
    use clap::Parser;

    /// `poll` as the CLI declares it: `--config` and `--set` beside the poller's flags.
    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        config: crate::cli::ConfigArg,
        #[command(flatten)]
        args: PollArgs,
    }

    fn parse(args: &[&str]) -> std::result::Result<PollArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("poll").chain(args.iter().copied())).map(|c| c.args)
    }

    fn config() -> Config {
        Config::from_sources(
            "test",
            "[postgres]\nurl = \"postgresql://h/db\"\n[kafka]\nbrokers = \"k:9092\"\n",
            [],
        )
        .unwrap()
    }

    #[test]
    fn flags_default_as_documented() {
        let args = parse(&[]).unwrap();
        let d = PollArgs::default();
        assert_eq!(
            (
                args.batch_size,
                args.workers,
                args.poll_interval_ms,
                args.max_attempts
            ),
            (d.batch_size, d.workers, d.poll_interval_ms, d.max_attempts)
        );
        assert_eq!(
            (d.batch_size, d.workers, d.poll_interval_ms),
            (1000, 1, 200)
        );
        let s = Settings::new(&config(), &args).unwrap();
        assert_eq!(s.max_attempts, 5, "relay.max_attempts by default");
        assert_eq!(s.poll_interval, Duration::from_millis(200));

        let args = parse(&[
            "--batch-size",
            "10",
            "--workers",
            "3",
            "--poll-interval-ms",
            "50",
            "--max-attempts",
            "2",
        ])
        .unwrap();
        let s = Settings::new(&config(), &args).unwrap();
        assert_eq!((s.batch_size, s.workers, s.max_attempts), (10, 3, 2));
    }

    #[test]
    fn out_of_range_flags_are_refused() {
        for bad in [
            &["--batch-size", "0"][..],
            &["--batch-size", "100001"],
            &["--workers", "0"],
            &["--max-attempts", "0"],
            &["--poll-interval-ms", "-1"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
        // Built by hand (not through clap), the same limits hold.
        let args = PollArgs {
            max_attempts: Some(u32::MAX),
            ..PollArgs::default()
        };
        assert!(Settings::new(&config(), &args).is_err());
        let args = PollArgs {
            batch_size: 0,
            ..PollArgs::default()
        };
        assert!(Settings::new(&config(), &args).is_err());
    }

    #[test]
    fn session_matches_the_replication_options() {
        assert_eq!(
            session_settings_sql(SESSION_OPTIONS),
            "SET DateStyle = 'ISO'; SET TimeZone = 'UTC'; SET extra_float_digits = '3';"
        );
        assert_eq!(session_settings_sql("-c a=it's"), "SET a = 'it''s';");
    }

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
        let mut backoff = BACKOFF_INITIAL;
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
        assert_eq!(backoff, BACKOFF_MAX, "bounded");
        assert_eq!(pause_after(&full, &s, &mut backoff), None);
        assert_eq!(backoff, BACKOFF_INITIAL, "reset by a clean batch");
    }

    fn mapper() -> OutboxMapper {
        OutboxMapper::with_template(&OutboxConfig::default(), "events", None).unwrap()
    }

    fn row(id: &str, attempts: i32, aggregate_id: Option<&str>, delivery: Delivery) -> BatchRow {
        let outbox = OutboxRow {
            id: Some(Bytes::copy_from_slice(id.as_bytes())),
            aggregate_id: aggregate_id.map(|a| Bytes::copy_from_slice(a.as_bytes())),
            payload: Some(Bytes::from_static(b"{}")),
            ..OutboxRow::default()
        };
        let result = match mapper().map_row(&outbox, None) {
            Ok(event) => RowResult::Event { event, delivery },
            Err(u) => RowResult::Unmappable {
                fields: Box::new(u.fields),
                error_kind: u.error_kind,
                reason: u.reason,
            },
        };
        BatchRow {
            polled: Polled {
                id: id.to_owned(),
                attempts,
                last_error: None,
            },
            result,
        }
    }

    fn failed(failure: Failure) -> Delivery {
        Delivery::Failed {
            failure,
            kind: "message_size_too_large",
            message: "too big".into(),
        }
    }

    #[test]
    fn marks_acked_counts_permanent_ignores_transient_poisons_at_max() {
        let rows = [
            row("a", 0, Some("k"), Delivery::Acked),
            row("b", 0, Some("k"), failed(Failure::Permanent)),
            row("c", 3, Some("k"), failed(Failure::Permanent)),
            row("d", 4, Some("k"), failed(Failure::Transient)),
            row("e", 0, Some("k"), Delivery::Pending),
            row("f", 4, Some("k"), failed(Failure::Permanent)),
            row("g", 0, Some("k"), Delivery::Acked),
        ];
        let plan = plan_marks(&rows, 5);
        assert_eq!(plan.sent, ["a", "g"]);
        assert_eq!(plan.failed.ids, ["b", "c", "f"]);
        assert_eq!(plan.failed.attempts, [1, 4, 5]);
        assert_eq!(plan.failed.errors[0], "message_size_too_large: too big");
        assert_eq!(plan.poison, [(5, 5)], "only the row reaching max_attempts");
        assert_eq!(plan.transient, 2, "transient failures and missing reports");
    }

    #[test]
    fn unmappable_rows_are_poisoned_at_once_and_excluded() {
        let rows = [row("n", 0, None, Delivery::Pending)];
        assert!(matches!(rows[0].result, RowResult::Unmappable { .. }));
        let plan = plan_marks(&rows, 5);
        assert!(plan.sent.is_empty());
        assert_eq!(plan.failed.ids, ["n"]);
        assert_eq!(
            plan.failed.attempts,
            [5],
            "attempts = max excludes it from polling"
        );
        assert!(plan.failed.errors[0].starts_with("null_key: "));
        assert_eq!(plan.poison, [(0, 1)], "poison row records one real attempt");
        // With max_attempts 1 every permanent failure poisons at once.
        let rows = [row("p", 0, Some("k"), failed(Failure::Permanent))];
        assert_eq!(plan_marks(&rows, 1).poison, [(0, 1)]);
    }

    fn column(name: &str, sql_type: &str, type_name: &str) -> TableColumn {
        TableColumn {
            name: name.into(),
            sql_type: sql_type.into(),
            type_name: type_name.into(),
        }
    }

    /// Replaces the column named `name`.
    fn set(columns: &mut [TableColumn], name: &str, new: TableColumn) {
        let c = columns.iter_mut().find(|c| c.name == name).unwrap();
        *c = new;
    }

    fn migrated_columns() -> Vec<TableColumn> {
        vec![
            column("id", "uuid", "uuid"),
            column("idempotency_key", "text", "text"),
            column("aggregate_type", "text", "text"),
            column("aggregate_id", "text", "text"),
            column("event_type", "text", "text"),
            column("topic", "text", "text"),
            column("headers", "jsonb", "jsonb"),
            column("payload", "jsonb", "jsonb"),
            column("created_at", "timestamp with time zone", "timestamptz"),
            column("sent_at", "timestamp with time zone", "timestamptz"),
            column("attempts", "integer", "int4"),
            column("last_error", "text", "text"),
        ]
    }

    #[test]
    fn layout_of_the_migrated_table() {
        let layout =
            resolve_layout("outbox", &OutboxConfig::default(), &migrated_columns()).unwrap();
        assert!(layout.fields.iter().all(Option::is_some));
        assert_eq!(layout.id_type, "uuid");
        assert_eq!(layout.payload_format, PayloadFormat::Json);
    }

    #[test]
    fn optional_columns_may_be_missing_required_ones_may_not() {
        let mut columns = migrated_columns();
        columns.retain(|c| !matches!(c.name.as_str(), "topic" | "headers" | "idempotency_key"));
        set(&mut columns, "payload", column("payload", "bytea", "bytea"));
        let layout = resolve_layout("outbox", &OutboxConfig::default(), &columns).unwrap();
        assert_eq!(layout.fields[5], None);
        assert_eq!(layout.payload_format, PayloadFormat::ByteaText);

        let mut columns = migrated_columns();
        columns.retain(|c| !matches!(c.name.as_str(), "aggregate_id" | "sent_at"));
        let err = resolve_layout("app.events", &OutboxConfig::default(), &columns).unwrap_err();
        assert_eq!(
            err,
            Prerequisite::PollerColumnsMissing {
                table: "app.events".into(),
                columns: "\"aggregate_id\" (outbox.columns.aggregate_id), \"sent_at\"".into(),
            }
        );
    }

    #[test]
    fn statements_use_the_partial_index_and_configured_names() {
        let mut outbox = OutboxConfig {
            table: "app.Events".into(),
            poison_table: "app.dead".into(),
            ..OutboxConfig::default()
        };
        outbox.columns.created_at = "ts".into();
        let mut columns = migrated_columns();
        columns.retain(|c| c.name != "topic");
        set(
            &mut columns,
            "created_at",
            column("ts", "timestamp with time zone", "timestamptz"),
        );
        set(&mut columns, "id", column("id", "bigint", "int8"));
        let layout = resolve_layout("app.Events", &outbox, &columns).unwrap();
        let sql = Sql::new(&outbox, &layout);
        let select = &sql.select_batch;
        assert!(select.contains("FROM \"app\".\"Events\" o"), "{select}");
        assert!(
            select.contains("WHERE o.sent_at IS NULL AND o.attempts < $1"),
            "{select}"
        );
        assert!(
            select.contains("ORDER BY o.\"ts\", o.\"id\" LIMIT $2 FOR UPDATE SKIP LOCKED"),
            "{select}"
        );
        assert!(
            select.contains("NULL::text, o.\"headers\"::text"),
            "{select}"
        );
        assert!(
            sql.mark_sent.contains("= ANY($1::text[]::bigint[])"),
            "{}",
            sql.mark_sent
        );
        assert!(sql.record_failures.contains("f.id::bigint"));
        assert!(
            sql.insert_poison
                .starts_with("INSERT INTO \"app\".\"dead\"")
        );
        assert!(sql.sweep.contains("o.attempts >= $1 AND NOT EXISTS"));
        assert!(sql.sweep.contains("FROM \"app\".\"dead\" p"));
    }

    #[test]
    fn headers_that_are_not_json_are_kept_as_a_string() {
        assert_eq!(valid_json_or_string(r#"{"a":1}"#), r#"{"a":1}"#);
        assert_eq!(valid_json_or_string("not json"), r#""not json""#);
    }
}
