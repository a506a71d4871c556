//! One worker's resources ([`Poller`]) and one batch's round trip: lock and publish
//! ([`Poller::publish_batch`], steps 1–3 of the procedure), then mark and commit
//! ([`PublishedBatch::mark`], step 4).
//!
//! # Testing seam
//!
//! [`Poller::publish_batch`] (steps 1–3) and [`PublishedBatch::mark`] (step 4) are
//! separate calls, so a test can drop the batch between them — the crash between
//! publishing and marking — and watch the rows come back.
//!
//! # The start-up sweep
//!
//! Polling excludes rows whose `attempts` reached `max_attempts`; poisoning is what
//! sets that. A row can also get there without a poison row (`max_attempts` was
//! lowered, or `attempts` was set by hand): [`Poller::poison_exhausted`] copies those
//! to `poison_outbox` before any worker polls, so none is silently stranded.

use std::fmt;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_postgres::{Client, Transaction};
use tracing::{info, warn};

use crate::config::Config;
use crate::error::Result;
use crate::kafka::{self, DeliveryReport, Publisher};
use crate::outbox::OutboxMapper;
use crate::poison::{PoisonRow, insert_rows};
use crate::postgres::conninfo::ConnInfo;

use super::args::{PollArgs, Settings};
use super::layout::{Layout, inspect_tables};
use super::marks::{BatchOutcome, write_marks};
use super::pg_error::pg_error;
use super::publish::publish;
use super::row::{BatchRow, Delivery, RowResult, read_row};
use super::sql::{Prepared, Sql, session};

/// Broker check at start-up (exit code 4 when it fails).
const BROKER_CHECK_TIMEOUT: Duration = Duration::from_secs(10);
/// `poison_outbox.error_kind` of rows poisoned by the start-up sweep.
pub const ATTEMPTS_EXHAUSTED: &str = "attempts_exhausted";

/// One worker's resources: a PostgreSQL connection with its prepared statements, a
/// producer, and the mapper.
pub struct Poller {
    conninfo: ConnInfo,
    pub(super) client: Client,
    sql: Sql,
    prepared: Prepared,
    layout: Layout,
    mapper: OutboxMapper,
    publisher: Publisher,
    reports: mpsc::Receiver<DeliveryReport>,
    pub(super) settings: Settings,
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
    /// As [`run`](super::run) at start-up.
    pub async fn connect(config: &Config, args: &PollArgs) -> Result<Poller> {
        Poller::with_settings(config, Settings::new(config, args)?).await
    }

    pub(super) async fn with_settings(config: &Config, settings: Settings) -> Result<Poller> {
        let conninfo = crate::postgres::parse_url(&config.postgres.url)?;
        let mapper =
            OutboxMapper::new(&config.outbox, &config.kafka, config.kafka.envelope.clone())?;
        let client = session(&conninfo).await?;
        let layout = inspect_tables(&client, &config.outbox).await?;
        let sql = Sql::new(
            &config.outbox,
            &layout,
            config.relay.poison_copy_limit_bytes,
            None,
            None,
        );
        let prepared = Prepared::new(&client, &sql).await?;

        let producer_config = kafka::producer_config(&config.kafka, &config.relay)?;
        // Room for a whole batch of reports, so the delivery thread never waits.
        let capacity = kafka::report_capacity(&config.relay).max(settings.batch_size as usize + 1);
        let (publisher, reports) = Publisher::new(producer_config, capacity)?;
        let publisher =
            publisher.with_configuration_errors_poisoned(config.relay.on_config_error.poisons());
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
    /// PostgreSQL errors (classified by [`crate::postgres::process_error`]; transient
    /// ones retried: the batch is rolled back and re-sent later) and a fatal producer
    /// error ([`BrokerUnavailable::FatalReport`](crate::kafka::BrokerUnavailable::FatalReport),
    /// exit code 4).
    pub(crate) async fn poll_once(&mut self) -> Result<BatchOutcome> {
        self.publish_batch().await?.mark().await
    }

    /// Steps 1–3 of the procedure: opens the transaction, locks the next batch, sends
    /// every row and waits for every delivery report. Nothing is marked yet: dropping
    /// the returned batch rolls back, and its rows are polled (and sent) again.
    ///
    /// # Errors
    ///
    /// As `Poller::poll_once`.
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
    pub(crate) async fn poison_exhausted(&mut self) -> Result<u64> {
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
            let mut poison = Vec::with_capacity(rows.len());
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
                warn!(outbox_id = %polled.id, attempts = polled.attempts, "row poisoned at start-up: attempts exhausted");
                poison.push(PoisonRow {
                    fields,
                    error,
                    error_kind: ATTEMPTS_EXHAUSTED.to_owned(),
                    attempts: polled.attempts,
                    lsn: None,
                    ..PoisonRow::default()
                });
            }
            let batch: Vec<&PoisonRow> = poison.iter().collect();
            insert_rows(
                &tx,
                &self.prepared.insert_poison,
                &batch,
                self.prepared.poison_copy_limit,
            )
            .await
            .map_err(pg_error)?;
            tx.commit().await.map_err(pg_error)?;
            poisoned += rows.len() as u64;
            if rows.len() < self.settings.batch_size as usize {
                return Ok(poisoned);
            }
        }
    }

    /// Opens a new session when the old one died (server restart, network).
    pub(super) async fn reconnect_if_closed(&mut self) -> Result<()> {
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

/// A batch whose records were all sent and reported, inside its still-open
/// transaction. `mark` records the outcomes and commits;
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
    pub(crate) async fn mark(self) -> Result<BatchOutcome> {
        let PublishedBatch {
            tx,
            prepared,
            max_attempts,
            rows,
        } = self;
        let outcome = write_marks(&tx, prepared, max_attempts, &rows, None).await?;
        tx.commit().await.map_err(pg_error)?;
        Ok(outcome)
    }
}
