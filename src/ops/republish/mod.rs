//! `outbox-relay republish`: send chosen outbox rows to Kafka again, on demand.
//!
//! # Why
//!
//! A consumer lost its state, a topic was recreated, a consumer bug makes a team want
//! "everything for order 42 since Tuesday" again. A poller's users reset `sent_at`;
//! here the relay writes nothing to the outbox, so the outbox itself is the archive:
//! `republish` reads the chosen rows and publishes their records again, as the
//! stream built them. `replay` stays the way back for poison rows; a cutover and a
//! resync publish whole backlogs.
//!
//! # The record
//!
//! Each row is mapped by [`OutboxMapper::map_row`], the function the poller and
//! `replay` use, on a session with the replication connection's settings, so key,
//! value, timestamp, partition and every header equal the stream's record
//! (`docs/architecture.md#the-kafka-record`), the original `idempotency_key` first
//! (consumers dedupe on it), with two differences: no `source_lsn` (a row does not
//! carry its commit LSN; the poller's records have none either), and a last header
//! `outbox_relay_republish` whose value is the run's id (a UUID v7, in the report),
//! so a consumer can tell a re-publish from a first delivery and which run sent it.
//!
//! # Order and keys
//!
//! Rows are read in `created_at` order, then id (`read.rs` says why not the
//! backlog's commit timestamps), and published one window at a time; a window is
//! resolved (every report in) before the next is read. Within a key (topic and
//! record key):
//!
//! * a row the relay has not delivered yet is refused together with the later rows
//!   of its key (`read.rs` explains "reached");
//! * a row that fails holds the later rows of its key in the later windows
//!   (reported `held`). At-least-once, rows of its key already in flight in its own
//!   window may have been acked: the failed one is then missing between them, as a
//!   poisoned event is in the stream. Exactly-once aborts the window, so nothing of
//!   the key after it is published (`send.rs`);
//! * a failure every later window would meet too (a timeout: the broker is down)
//!   stops the run (`aborted` in the report) instead of waiting out each window.
//!
//! # Concurrency, dry run, exit codes
//!
//! One run per outbox at a time: a PostgreSQL advisory lock named after the table
//! ([`Error::RepublishLocked`], exit code 1, for the second). The relay may stream
//! beside a run, and may be killed and restarted meanwhile: the run reads the table,
//! not the slot, and refuses what the relay has not delivered. `--dry-run` takes no
//! lock, connects to no broker and publishes nothing: it counts and lists a sample.
//! Exit codes: 2 for a bad selection (or a selector on a column the table lacks),
//! 3 when the outbox or poison table is missing, 4 when the broker does not answer,
//! else the report's: 0, or 1 when a row failed or was held behind a failure or
//! the run stopped early. Refused rows are not a failure: they are on their way.
//!
//! The message outbox (`outbox_emit`) writes no rows: its events are in the WAL
//! only, and the report says so when it is installed.

mod args;
mod read;
mod report;
mod send;

use std::borrow::Cow;

use bytes::Bytes;
use tokio_postgres::Client;

use crate::config::{Config, DeliveryMode, quote_qualified};
use crate::delivery::Failure;
use crate::error::{Error, Result};
use crate::hashing::HashSet;
use crate::ops::meter::Meter;
use crate::ops::replay::PROGRESS_MIN_ROWS;
use crate::outbox::{OutboxEvent, OutboxMapper};
use crate::poller::{self, BatchRow, Delivery, Layout, Reading, RowResult};

pub use args::RepublishArgs;
pub use report::{RepublishReport, RepublishedRow, RowOutcome};

use args::{Filter, Selection};
use read::{Reader, SelectedRow, Statements};
use send::{KeyOf, Sender};

/// The header that marks a re-published record; its value is the run's id.
pub const REPUBLISH_HEADER: &str = crate::outbox::HEADER_REPUBLISH;

/// Most rows read and in flight per window.
const WINDOW_ROWS: usize = 1000;

/// Runs `republish` (module doc).
///
/// # Errors
///
/// [`Error::Config`] (exit 2) for a bad selection or several outboxes without
/// `--outbox`; [`Error::Prerequisite`] (exit 3) when a table is missing;
/// [`Error::Broker`] (exit 4) when the broker does not answer;
/// [`Error::RepublishLocked`] (exit 1) while another run holds the outbox;
/// PostgreSQL and Kafka transaction errors (exit 1). Row failures are in the report.
pub async fn run(config: &Config, args: &RepublishArgs) -> Result<RepublishReport> {
    let config = &crate::ops::chosen_outbox(config, args.outbox.as_deref(), "rows to republish")?;
    let selection = Selection::from_args(args, chrono::Utc::now())?;
    let mapper = OutboxMapper::new(&config.outbox, &config.kafka, config.kafka.envelope.clone())?;
    // The relay's session settings (UTC, ISO dates), so that columns read as text
    // are the bytes pgoutput sent.
    let conninfo = crate::postgres::parse_url(&config.postgres.url)?;
    let mut client = poller::session(&conninfo).await?;
    let layout = poller::inspect_tables_for(&client, &config.outbox, Reading::Only).await?;
    // $1 is the delivered checkpoint (`read.rs`).
    let filter = selection.filter(&layout, 2)?;
    check_ids(&client, &layout, args).await?;
    let lock = format!(
        "outbox-relay republish {}",
        quote_qualified(&config.outbox.table)
    );
    if !args.dry_run && !crate::ops::try_advisory_lock(&client, &lock).await? {
        return Err(Error::RepublishLocked {
            table: config.outbox.table.clone(),
        });
    }
    let run = Run {
        config,
        database: conninfo.dbname(),
        args,
        selection: &selection,
        mapper: &mapper,
        layout: &layout,
        filter: &filter,
    };
    let result = run.republish(&mut client).await;
    if !args.dry_run {
        crate::ops::advisory_unlock(&client, &lock).await;
    }
    result
}

/// `--from-id` and `--to-id` must be values of the id column's type (exit code 2,
/// not a failed statement later).
async fn check_ids(client: &Client, layout: &Layout, args: &RepublishArgs) -> Result<()> {
    for (flag, value) in [("--from-id", &args.from_id), ("--to-id", &args.to_id)] {
        let Some(value) = value else { continue };
        let sql = format!("SELECT $1::text::{}", layout.id_type());
        if let Err(e) = client.query_one(&sql, &[value]).await {
            let reason = e
                .as_db_error()
                .map_or_else(|| e.to_string(), |d| d.message().to_owned());
            return Err(crate::config::ConfigError::Invalid(format!(
                "{flag} {value:?} is not a value of the id column's type {}: {reason}",
                layout.id_type()
            ))
            .into());
        }
    }
    Ok(())
}

/// One run's inputs.
struct Run<'a> {
    config: &'a Config,
    /// The database's name (in the exactly-once `transactional.id`).
    database: &'a str,
    args: &'a RepublishArgs,
    selection: &'a Selection,
    mapper: &'a OutboxMapper,
    layout: &'a Layout,
    filter: &'a Filter,
}

/// The keys a run no longer publishes: behind a refused row, or a failed one.
#[derive(Default)]
struct Holds {
    refused: HashSet<KeyOf>,
    failed: HashSet<KeyOf>,
}

impl Run<'_> {
    async fn republish(&self, client: &mut Client) -> Result<RepublishReport> {
        let xmin = read::delivered_xmin(client, self.config).await?;
        let (schema, _) =
            crate::config::qualified_name(&self.config.outbox.table).unwrap_or_default();
        let message_outbox = crate::outbox::message::emit_installed(&*client, &schema).await?;
        let statements = Statements::new(self.config, self.layout, self.filter);
        let transaction = read::snapshot(client).await?;
        let (mut reader, counted) =
            Reader::open(&transaction, &statements, self.layout, xmin, self.filter).await?;
        let mut report = RepublishReport {
            outbox: self.config.outbox.table.clone(),
            run_id: uuid::Uuid::now_v7().to_string(),
            dry_run: self.args.dry_run,
            exactly_once: self.config.kafka.delivery == DeliveryMode::ExactlyOnce,
            selected: counted.rows,
            poisoned: counted.poisoned,
            message_outbox,
            ..RepublishReport::default()
        };
        tracing::info!(rows = counted.rows, reached = counted.reached, outbox = %report.outbox,
            run = %report.run_id, dry_run = self.args.dry_run, "republishing outbox rows");
        let window = WINDOW_ROWS.min(self.config.relay.max_in_flight_events.max(1));
        let mut sender = if self.args.dry_run || counted.reached == 0 {
            None
        } else {
            Some(Sender::connect(self.config, self.database, window).await?)
        };
        let what = if self.args.dry_run {
            "rows (dry run)"
        } else {
            "rows"
        };
        let mut meter = Meter::new(
            "republish",
            what,
            counted.rows,
            !self.args.no_progress && counted.rows >= PROGRESS_MIN_ROWS,
        );
        let mut holds = Holds::default();
        let windows = self
            .windows(
                &mut reader,
                window,
                sender.as_mut(),
                &mut holds,
                &mut meter,
                &mut report,
            )
            .await;
        meter.finish();
        if let Err(e) = windows {
            // What was published stays reported: the run stops, exit code 1.
            report.aborted = Some(e.to_string());
        }
        transaction.commit().await?;
        report.transactions = sender.as_ref().map_or(0, |s| s.transactions);
        tracing::info!(
            published = report.published,
            failed = report.failed,
            held = report.held,
            refused = report.refused,
            "republish finished"
        );
        Ok(report)
    }

    /// Reads, admits, publishes and settles one window after the other.
    async fn windows(
        &self,
        reader: &mut Reader<'_>,
        window: usize,
        mut sender: Option<&mut Sender>,
        holds: &mut Holds,
        meter: &mut Meter,
        report: &mut RepublishReport,
    ) -> Result<()> {
        let run_id = report.run_id.clone();
        loop {
            let rows = reader.next(window).await?;
            if rows.is_empty() {
                return Ok(());
            }
            meter.inc(rows.len() as u64);
            let batch = self.admit(rows, &run_id, holds, report);
            let batch = match sender.as_deref_mut() {
                Some(sender) => sender.publish(batch).await?,
                None => batch,
            };
            if let Some(stalled) = self.settle(batch, holds, report) {
                return Err(Error::RepublishStalled { reason: stalled });
            }
        }
    }

    /// Maps a window's rows; returns the ones to publish, with the run's header.
    /// Refused, unmappable, held and other topics' rows go to the report.
    fn admit(
        &self,
        rows: Vec<SelectedRow>,
        run_id: &str,
        holds: &mut Holds,
        report: &mut RepublishReport,
    ) -> Vec<BatchRow> {
        let mut batch = Vec::with_capacity(rows.len());
        for selected in rows {
            let id = selected.polled.id.clone();
            let mut event = match self.mapper.map_row(&selected.row, None) {
                Ok(event) => event,
                // The stream poisons such a row (and `replay` is its way back); one
                // without its poison row is reported, not published.
                Err(_) if !selected.reached => {
                    report.refuse(&id);
                    continue;
                }
                Err(unmappable) => {
                    report.add(
                        RepublishedRow::unmappable(&id, unmappable.error_kind, unmappable.reason),
                        self.args.sample,
                    );
                    continue;
                }
            };
            if self
                .selection
                .topic
                .as_ref()
                .is_some_and(|t| *t != event.topic)
            {
                report.other_topic += 1;
                continue;
            }
            let key = (event.topic.clone(), event.key.clone());
            if !selected.reached || holds.refused.contains(&key) {
                holds.refused.insert(key);
                report.refuse(&id);
                continue;
            }
            if holds.failed.contains(&key) {
                report.add(
                    RepublishedRow::of_event(&id, RowOutcome::Held, &event),
                    self.args.sample,
                );
                continue;
            }
            mark(&mut event, run_id);
            batch.push(BatchRow {
                polled: selected.polled,
                result: RowResult::Event {
                    event,
                    delivery: Delivery::Pending,
                },
            });
        }
        batch
    }

    /// Reports a published (or dry-run) window's rows; a failed or held row holds
    /// its key for the rest of the run. Returns why the run should stop: a transient
    /// failure (a timeout: the broker is down or too slow), which every later window
    /// would wait for too.
    fn settle(
        &self,
        batch: Vec<BatchRow>,
        holds: &mut Holds,
        report: &mut RepublishReport,
    ) -> Option<String> {
        let mut stalled = None;
        for row in batch {
            let RowResult::Event { event, delivery } = row.result else {
                continue;
            };
            let id = &row.polled.id;
            let listed = match delivery {
                Delivery::Pending if self.args.dry_run => {
                    RepublishedRow::of_event(id, RowOutcome::WouldPublish, &event)
                }
                Delivery::Acked => RepublishedRow::of_event(id, RowOutcome::Published, &event),
                Delivery::Pending => RepublishedRow::of_event(id, RowOutcome::Held, &event),
                Delivery::Failed {
                    failure,
                    kind,
                    message,
                } => {
                    if failure == Failure::Transient && stalled.is_none() {
                        stalled = Some(format!("{kind}: {message}"));
                    }
                    RepublishedRow::of_event(id, RowOutcome::Published, &event)
                        .failed(kind, message)
                }
            };
            if matches!(listed.outcome, RowOutcome::Failed | RowOutcome::Held) {
                holds
                    .failed
                    .insert((event.topic.clone(), event.key.clone()));
            }
            report.add(listed, self.args.sample);
        }
        stalled
    }
}

/// Adds the run's header, last (after the row's own headers).
fn mark(event: &mut OutboxEvent, run_id: &str) {
    event.headers.push((
        Cow::Borrowed(REPUBLISH_HEADER),
        Bytes::copy_from_slice(run_id.as_bytes()),
    ));
}
