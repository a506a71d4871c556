//! Publishing a backlog before streaming: the rows a slot will never stream, read in
//! the exported snapshot of its creation (`cdc::cutover` explains the snapshot).
//! Two callers: a cutover publishes the rows a poller left unsent, a resync
//! (`cdc::resync`) the rows committed while the slot was lost.
//!
//! # Order
//!
//! The rows are read in commit order as near as a table can tell
//! ([`poller::Sql`]'s backlog statements: commit timestamps when
//! `track_commit_timestamp = on`, else `created_at`), through a cursor, one
//! window at a time; every row of a window is resolved (acked, poisoned or parked)
//! before the next window is read, and every backlog row before the first streamed
//! one is produced.
//!
//! # The stream's rules, not the poller's
//!
//! Inside a window, per-key order and `relay.on_poison` are the stream's
//! ([`order`]): a failed row holds its key and is retried alone, `park-key` parks,
//! `halt` leaves the row (and its key's later rows) unpublished and the backlog
//! incomplete ([`Error::BacklogHalted`], retried like a lost connection, so the relay
//! keeps trying the row until its cause is fixed). Rows are marked as the poller
//! marks them (`poller::write_marks`: `sent_at`, a `poison_outbox` row), each round
//! in one transaction, once they are resolved. A failure that will be retried is
//! counted in memory only: writing `attempts` would give the row a new commit time,
//! and a backlog read again (a resync started over after a crash or a halt) would
//! order it after the later rows of its key when commit timestamps are on.
//!
//! # What the topic already holds
//!
//! A resync first looks up, for each window, which of its rows' records the topic
//! already holds (the stream delivered them before the slot was lost, after the
//! last delivered checkpoint) and marks those sent without producing them again
//! ([`delivered`]).
//!
//! # Exactly-once
//!
//! Under `kafka.delivery = "exactly-once"` each round is one Kafka transaction whose
//! progress record names its rows, and the marks follow the commit
//! ([`transactions`] explains why that publishes each row once across crashes).

mod delivered;
mod order;
mod transactions;

use std::time::Duration;

use tokio_postgres::{Client, IsolationLevel};

use crate::config::{Config, PoisonKeyMode};
use crate::error::{Error, Result};
use crate::kafka::{self, DeliveryReport, Publisher};
use crate::lifecycle::{Backoff, millis};
use crate::lsn::Lsn;
use crate::outbox::OutboxMapper;
use crate::outbox::position::ServerHistory;
use crate::poison::{Parked, PoisonRow, WriterStatements};
use crate::poller::{self, BatchRow, Polled, RowResult};
use crate::postgres::replication::quote_literal;

use delivered::DeliveredKeys;
use order::{KeyRules, Step, Unresolved, Verdict, reset_for_retry};
use transactions::BacklogTransactions;

/// Most rows read, published and marked as one window.
const MAX_WINDOW: usize = 10_000;

/// Backoff between rounds that had failures, doubling (see [`Backoff`]).
const RETRY_BACKOFF_INITIAL: Duration = Duration::from_millis(200);
const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// Broker check before the backlog is read (exit code 4 when it fails).
const BROKER_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// Which rows of the snapshot a [`Backlog`] publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BacklogQuery {
    /// The cutover's: rows the poller has not sent (`sent_at IS NULL`) and not
    /// poisoned, whatever their attempts.
    Unsent,
    /// A resync's: unsent, unpoisoned rows not known to be delivered, i.e. not below
    /// this checkpoint xmin (0: none known), whatever their attempts.
    Undelivered { delivered_xmin: i64 },
}

/// What a backlog did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct BacklogSummary {
    /// Rows read in the snapshot.
    pub(crate) rows: u64,
    /// Rows acked by the broker and marked sent.
    pub(crate) published: u64,
    /// Rows written to the poison table (parked ones included).
    pub(crate) poisoned: u64,
    /// A resync's rows whose record the topic already held (the lost slot had
    /// delivered them): marked sent, not published again.
    pub(crate) already_delivered: u64,
    /// The exported snapshot's xmin (64-bit): every transaction below it is visible
    /// in the snapshot, so its rows were read.
    pub(crate) snapshot_xmin: i64,
}

impl BacklogSummary {
    /// Adds the counts of another outbox's backlog read in the same snapshot.
    pub(crate) fn add(&mut self, other: &BacklogSummary) {
        self.rows += other.rows;
        self.published += other.published;
        self.poisoned += other.poisoned;
        self.already_delivered += other.already_delivered;
        self.snapshot_xmin = self.snapshot_xmin.max(other.snapshot_xmin);
    }
}

/// The outboxes after the first of a cutover or resync ([`Config::per_outbox`]):
/// their backlogs are opened before the slot exists only to refuse early (the
/// metadata connection serves one backlog at a time), and published once the first
/// is done, one after the other in the first one's snapshot.
pub(super) struct FurtherOutboxes<'v> {
    pub(super) views: &'v [Config],
    pub(super) marker_table: Option<&'v str>,
    pub(super) history: ServerHistory,
}

impl FurtherOutboxes<'_> {
    /// Opens (and drops) each backlog: what lacks a column, a connection or the
    /// broker refuses here, before anything is recorded.
    pub(super) async fn check(&self, metadata: &mut Client) -> Result<()> {
        for view in self.views {
            Backlog::open(view, metadata, self.marker_table, self.history).await?;
        }
        Ok(())
    }

    /// Publishes each backlog with `query` in `snapshot`; their counts added up.
    pub(super) async fn publish(
        &self,
        metadata: &mut Client,
        reader: &mut Client,
        snapshot: &str,
        consistent_point: Lsn,
        query: BacklogQuery,
    ) -> Result<BacklogSummary> {
        let mut summary = BacklogSummary::default();
        for view in self.views {
            let mut backlog =
                Backlog::open(view, metadata, self.marker_table, self.history).await?;
            let published = backlog
                .publish(reader, snapshot, consistent_point, query)
                .await?;
            summary.add(&published);
        }
        Ok(summary)
    }
}

/// A row halted under `relay.on_poison = "halt"`.
#[derive(Debug, Clone)]
struct HaltedRow {
    id: String,
    error: String,
}

/// The backlog publisher: mapper, producer, prepared marks, the per-key rules.
pub(super) struct Backlog<'a> {
    config: &'a Config,
    metadata: &'a mut Client,
    /// The cutover's marker table, whose progress counters each round updates.
    marker_table: Option<&'a str>,
    prepared: poller::Prepared,
    sql: poller::Sql,
    layout: poller::Layout,
    mapper: OutboxMapper,
    publisher: Publisher,
    reports: tokio::sync::mpsc::Receiver<DeliveryReport>,
    rules: KeyRules,
    parking: WriterStatements,
    max_attempts: i32,
    window: usize,
    /// Event id base of the next publish round (ids are per producer).
    next_id: u64,
    /// Rows read so far: a parked row's place in the backlog.
    ordinal: u64,
    halted: Vec<HaltedRow>,
    /// Exactly-once mode: each round in a Kafka transaction.
    transactions: Option<BacklogTransactions>,
    /// The consistent point of the slot the backlog is read for.
    consistent_point: Lsn,
}

impl<'a> Backlog<'a> {
    /// The metadata connection the marks are written on.
    pub(super) fn metadata(&self) -> &Client {
        self.metadata
    }

    /// Everything that can fail for lack of a column, a table, a connection or the
    /// broker, before anything is recorded. In exactly-once mode it also fences the
    /// slot's older producers and writes the marks the last backlog transaction left
    /// ([`transactions`]): before the slot whose snapshot the rows are read in exists.
    pub(super) async fn open(
        config: &'a Config,
        metadata: &'a mut Client,
        marker_table: Option<&'a str>,
        history: ServerHistory,
    ) -> Result<Backlog<'a>> {
        let layout = poller::inspect_tables(metadata, &config.outbox).await?;
        // A shard's cutover or resync publishes its shard's rows only.
        let shard_filter = crate::config::shard::row_filter(
            &config.outbox.columns.aggregate_id,
            config.postgres.shards,
            config.postgres.shard,
        );
        let sql = poller::Sql::new(
            &config.outbox,
            &layout,
            config.relay.poison_copy_limit_bytes,
            shard_filter.as_deref(),
            Some(&config.postgres.slot_name()),
        );
        let prepared = poller::Prepared::new(metadata, &sql).await?;
        let parked = crate::cdc::poison_policy::parked_keys(metadata, config).await?;
        let mapper =
            OutboxMapper::new(&config.outbox, &config.kafka, config.kafka.envelope.clone())?;
        let window = window_size(config.relay.max_in_flight_events);
        let capacity = kafka::report_capacity(&config.relay).max(window + 1);
        let mut producer_config = kafka::producer_config(&config.kafka, &config.relay)?;
        let transactional_id =
            crate::cdc::exactly_once::make_transactional(config, &mut producer_config);
        let (publisher, reports) = Publisher::new(producer_config, capacity)?;
        let publisher =
            publisher.with_configuration_errors_poisoned(config.relay.on_config_error.poisons());
        publisher.check_broker(BROKER_CHECK_TIMEOUT).await?;
        let transactions = match transactional_id {
            Some(id) => Some(
                BacklogTransactions::open(config, id, &publisher, metadata, &sql, history).await?,
            ),
            None => None,
        };
        let max_attempts = i32::try_from(config.relay.max_attempts).unwrap_or(i32::MAX);
        Ok(Backlog {
            config,
            metadata,
            marker_table,
            prepared,
            sql,
            layout,
            mapper,
            publisher,
            reports,
            rules: KeyRules::new(config.relay.on_poison, max_attempts, parked),
            parking: WriterStatements::new(&config.outbox),
            max_attempts,
            window,
            next_id: 0,
            ordinal: 0,
            halted: Vec::new(),
            transactions,
            consistent_point: Lsn::ZERO,
        })
    }

    /// Reads the backlog in the exported snapshot, window by window, and resolves
    /// every row (acked, poisoned or parked) before reading the next window.
    ///
    /// # Errors
    ///
    /// [`Error::BacklogHalted`] when a row was given up on under `halt`: everything
    /// else was resolved, the backlog is not complete.
    pub(super) async fn publish(
        &mut self,
        reader: &mut Client,
        snapshot: &str,
        consistent_point: Lsn,
        query: BacklogQuery,
    ) -> Result<BacklogSummary> {
        let mut summary = BacklogSummary::default();
        self.consistent_point = consistent_point;
        let tx = reader
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(poller::pg_error)?;
        // Must be the transaction's first statement.
        tx.batch_execute(&format!(
            "SET TRANSACTION SNAPSHOT {}",
            quote_literal(snapshot)
        ))
        .await
        .map_err(poller::pg_error)?;
        summary.snapshot_xmin = tx
            .query_one(
                "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint",
                &[],
            )
            .await
            .and_then(|row| row.try_get(0))
            .map_err(poller::pg_error)?;
        let (sql, params): (&str, Vec<&(dyn tokio_postgres::types::ToSql + Sync)>) = match &query {
            BacklogQuery::Unsent => (&self.sql.backlog, vec![]),
            BacklogQuery::Undelivered { delivered_xmin } => {
                (&self.sql.undelivered, vec![delivered_xmin])
            }
        };
        let statement = tx.prepare(sql).await.map_err(poller::pg_error)?;
        let portal = tx
            .bind(&statement, &params)
            .await
            .map_err(poller::pg_error)?;
        let window = i32::try_from(self.window).unwrap_or(i32::MAX);
        let mut delivered = match query {
            // Without a reader every row is published, as before.
            BacklogQuery::Undelivered { .. } => DeliveredKeys::new(self.config)
                .inspect_err(|e| tracing::warn!(error = %e, "resync: cannot read the topics; rows delivered before the loss are published again"))
                .ok(),
            BacklogQuery::Unsent => None,
        };
        loop {
            let chunk = tx
                .query_portal(&portal, window)
                .await
                .map_err(poller::pg_error)?;
            let fetched = chunk.len();
            let mut rows = Vec::with_capacity(fetched);
            for row in &chunk {
                let (polled, outbox_row) = poller::read_row(row, self.layout.payload_format)?;
                rows.push(BatchRow::map(
                    &self.mapper,
                    polled,
                    &outbox_row,
                    Some(consistent_point),
                ));
            }
            drop(chunk);
            summary.rows += fetched as u64;
            if let Some(delivered) = delivered.as_mut() {
                rows = self.mark_delivered(delivered, rows, &mut summary).await?;
            }
            if !rows.is_empty() {
                self.resolve(rows, &mut summary).await?;
                tracing::debug!(
                    rows = summary.rows,
                    published = summary.published,
                    "backlog window resolved"
                );
            }
            if fetched < self.window {
                break;
            }
        }
        tx.commit().await.map_err(poller::pg_error)?;
        match self.halted.first() {
            None => Ok(summary),
            Some(first) => Err(Error::BacklogHalted {
                count: self.halted.len(),
                id: first.id.clone(),
                error: first.error.clone(),
            }),
        }
    }

    /// Marks sent the rows of a resync's window whose record the topic already holds
    /// ([`delivered`]); returns the others, in order.
    async fn mark_delivered(
        &mut self,
        delivered: &mut DeliveredKeys,
        rows: Vec<BatchRow>,
        summary: &mut BacklogSummary,
    ) -> Result<Vec<BatchRow>> {
        let mut wants: std::collections::HashMap<String, i64> = std::collections::HashMap::new();
        for row in &rows {
            if let RowResult::Event { event, .. } = &row.result
                && let Some(ts) = event.timestamp_ms
            {
                let since = wants.entry(event.topic.clone()).or_insert(ts);
                *since = (*since).min(ts);
            }
        }
        delivered.learn(wants).await;
        // In order: a row not skipped makes its key's later rows published too.
        let (mut held, left): (Vec<BatchRow>, Vec<BatchRow>) =
            rows.into_iter().partition(|row| match &row.result {
                RowResult::Event { event, .. } => delivered.skips(event),
                RowResult::Unmappable { .. } => false,
            });
        if held.is_empty() {
            return Ok(left);
        }
        for row in &mut held {
            if let RowResult::Event { delivery, .. } = &mut row.result {
                *delivery = poller::Delivery::Acked;
            }
        }
        self.write(&held, &[], summary).await?;
        summary.already_delivered += held.len() as u64;
        tracing::info!(
            rows = held.len(),
            "resync: rows the topic already held (delivered before the slot was lost) marked sent, not published again"
        );
        Ok(left)
    }

    /// Publishes one window in rounds until every row is acked, poisoned, parked or
    /// halted; the marks of each round are committed with the marker row's counters.
    async fn resolve(&mut self, rows: Vec<BatchRow>, summary: &mut BacklogSummary) -> Result<()> {
        let mut window: Vec<(u64, Unresolved)> = rows
            .into_iter()
            .map(|row| {
                self.ordinal += 1;
                (self.ordinal, Unresolved::new(row))
            })
            .collect();
        let mut backoff = Backoff::new(RETRY_BACKOFF_INITIAL, RETRY_BACKOFF_MAX);
        while !window.is_empty() {
            let round = self.round(window, summary).await?;
            window = round.left;
            if round.stuck {
                // Only rows behind a halted row are left: they stay unpublished.
                break;
            }
            if round.failed > 0 && !window.is_empty() {
                let pause = backoff.next_pause();
                tracing::warn!(
                    rows = window.len(),
                    retry_in_ms = millis(pause),
                    "backlog: rows not acked yet; retrying before streaming starts"
                );
                // No shutdown here: the caller as a whole is raced against it.
                tokio::time::sleep(pause).await;
            }
        }
        Ok(())
    }

    /// One round: produce what may go, then mark everything decided in one
    /// transaction. Returns the rows left for the next round, in order.
    async fn round(
        &mut self,
        window: Vec<(u64, Unresolved)>,
        summary: &mut BacklogSummary,
    ) -> Result<Round> {
        let steps = self.rules.plan(window.iter().map(|(_, u)| u));
        let mut produce: Vec<(u64, Unresolved)> = Vec::new();
        let mut park: Vec<(u64, Unresolved)> = Vec::new();
        let mut marks: Vec<BatchRow> = Vec::new();
        let mut left: Vec<(u64, Unresolved)> = Vec::new();
        // Nothing to produce, park or poison: every row left waits behind a
        // halted row (the first unresolved row of any other key is produced).
        let stuck = steps.iter().all(|step| *step == Step::Wait);
        for ((ordinal, row), step) in window.into_iter().zip(steps) {
            match step {
                Step::Produce => produce.push((ordinal, row)),
                Step::Park => park.push((ordinal, row)),
                Step::Poison => {
                    marks.push(row.row);
                }
                Step::Halt => {
                    self.halt(&row.row);
                }
                Step::Wait => left.push((ordinal, row)),
            }
        }
        if let Some(transactions) = &self.transactions {
            // The round's progress record lists every row of it: the rest waits.
            let fit = transactions.fitting(produce.iter().map(|(_, u)| u.row.polled.id.as_str()));
            left.extend(produce.drain(fit..));
        }
        let mut published: Vec<BatchRow> = produce.iter_mut().map(|(_, u)| take(u)).collect();
        if let Some(transactions) = &self.transactions
            && !published.is_empty()
        {
            transactions.begin(&self.publisher)?;
        }
        let base = self.next_id;
        self.next_id = self.next_id.wrapping_add(published.len() as u64);
        let sent = poller::publish_holding(
            &self.publisher,
            &mut self.reports,
            base,
            &mut published,
            |i| produce.get(i).and_then(|(_, u)| u.key.as_ref()),
        )
        .await?;
        let committed = self.settle_transaction(&published, &sent).await?;
        let mut failed = usize::from(!committed);
        for (((ordinal, mut meta), row), sent) in produce.into_iter().zip(published).zip(sent) {
            meta.row = row;
            if !sent {
                // An earlier row of its key was refused at once: it waits.
                left.push((ordinal, meta));
                continue;
            }
            if !committed && is_acked(&meta.row) {
                // Delivered into an aborted transaction: produced again, and no
                // attempt counts (the row did not fail).
                reset_for_retry(&mut meta.row);
                left.push((ordinal, meta));
                continue;
            }
            match self.rules.judge(&mut meta) {
                Verdict::Acked => {
                    marks.push(meta.row);
                }
                Verdict::Poison(_) => {
                    failed += 1;
                    marks.push(meta.row);
                }
                Verdict::Halt => {
                    failed += 1;
                    self.halt(&meta.row);
                }
                Verdict::Retry => {
                    // Counted here, not written: an update would give the row a
                    // new commit time, moving it in a backlog read again.
                    failed += 1;
                    reset_for_retry(&mut meta.row);
                    left.push((ordinal, meta));
                }
            }
        }
        let parked_rows: Vec<PoisonRow> = park
            .iter()
            .filter_map(|(ordinal, u)| match &u.row.result {
                RowResult::Event { event, .. } => Some(crate::poison::parked_row(
                    event,
                    Some(u32::try_from(*ordinal).unwrap_or(u32::MAX)),
                )),
                RowResult::Unmappable { .. } => None,
            })
            .collect();
        let (outcome, answers) = self.write(&marks, &parked_rows, summary).await?;
        summary.published += outcome.delivered as u64;
        summary.poisoned += outcome.poisoned as u64;
        for ((ordinal, row), answer) in park.into_iter().zip(answers) {
            match answer {
                Parked::Recorded => summary.poisoned += 1,
                Parked::Released => {
                    // `replay` released the key meanwhile: produce the row.
                    if let Some(key) = &row.key {
                        self.rules.released(key);
                    }
                    left.push((ordinal, row));
                }
            }
        }
        left.sort_by_key(|(ordinal, _)| *ordinal);
        Ok(Round {
            left,
            stuck,
            failed,
        })
    }

    /// Exactly-once mode: commits the round's Kafka transaction when every record of
    /// it was delivered, else aborts it. `true` when the deliveries stand (committed,
    /// nothing produced, or at-least-once).
    async fn settle_transaction(&mut self, published: &[BatchRow], sent: &[bool]) -> Result<bool> {
        let Some(transactions) = self.transactions.as_mut() else {
            return Ok(true);
        };
        let produced: Vec<&BatchRow> = published
            .iter()
            .filter(|row| matches!(row.result, RowResult::Event { .. }))
            .collect();
        if produced.is_empty() {
            return Ok(true);
        }
        if !(sent.iter().all(|s| *s) && produced.iter().all(|row| is_acked(row))) {
            transactions.abort(&self.publisher).await?;
            return Ok(false);
        }
        let ids = produced.iter().map(|row| row.polled.id.clone()).collect();
        transactions
            .commit(&self.publisher, self.consistent_point, ids)
            .await
    }

    /// The marks of a round and its parked rows, in one transaction with the
    /// marker row's counters.
    async fn write(
        &mut self,
        marks: &[BatchRow],
        parked: &[PoisonRow],
        summary: &BacklogSummary,
    ) -> Result<(poller::BatchOutcome, Vec<Parked>)> {
        let holds_keys =
            (self.config.relay.on_poison == PoisonKeyMode::ParkKey).then_some(&self.parking);
        let tx = self
            .metadata
            .transaction()
            .await
            .map_err(poller::pg_error)?;
        let outcome =
            poller::write_marks(&tx, &self.prepared, self.max_attempts, marks, holds_keys).await?;
        let refs: Vec<&PoisonRow> = parked.iter().collect();
        let answers = if refs.is_empty() {
            Vec::new()
        } else {
            crate::poison::insert_parking_in(
                &tx,
                &self.parking,
                &self.prepared.insert_poison,
                &refs,
                self.prepared.poison_copy_limit,
            )
            .await
            .map_err(poller::pg_error)?
        };
        if let Some(marker_table) = self.marker_table {
            let recorded = answers.iter().filter(|a| **a == Parked::Recorded).count();
            let published = summary.published + outcome.delivered as u64;
            let poisoned = summary.poisoned + (outcome.poisoned + recorded) as u64;
            tx.execute(
                &format!(
                    "UPDATE {marker_table} SET published = $2, poisoned = $3 WHERE slot_name = $1"
                ),
                &[
                    &self.config.postgres.slot_name(),
                    &count(published),
                    &count(poisoned),
                ],
            )
            .await
            .map_err(poller::pg_error)?;
        }
        tx.commit().await.map_err(poller::pg_error)?;
        Ok((outcome, answers))
    }

    /// Records a row given up on under `halt`; nothing is written for it.
    fn halt(&mut self, row: &BatchRow) {
        let error = match &row.result {
            RowResult::Event {
                delivery: poller::Delivery::Failed { kind, message, .. },
                ..
            } => format!("{kind}: {message}"),
            RowResult::Unmappable {
                error_kind, reason, ..
            } => format!("{error_kind}: {reason}"),
            RowResult::Event { .. } => "delivery failed".to_owned(),
        };
        tracing::error!(
            outbox_id = %row.polled.id,
            %error,
            "a backlog row cannot be delivered and relay.on_poison = \"halt\": it and the \
             later rows of its key stay unpublished, and streaming does not start until it is"
        );
        self.halted.push(HaltedRow {
            id: row.polled.id.clone(),
            error,
        });
    }
}

/// What a round left.
struct Round {
    /// Rows for the next round, in backlog order.
    left: Vec<(u64, Unresolved)>,
    /// Every row left waits behind a halted row: no round can change that.
    stuck: bool,
    /// Produced rows that were not acked.
    failed: usize,
}

/// Whether the broker acked the row's record.
fn is_acked(row: &BatchRow) -> bool {
    matches!(
        row.result,
        RowResult::Event {
            delivery: poller::Delivery::Acked,
            ..
        }
    )
}

/// Moves the row out of `u` to publish it (it is put back after).
fn take(u: &mut Unresolved) -> BatchRow {
    std::mem::replace(&mut u.row, placeholder())
}

/// What stands in a row's place while the row is lent out; never published or
/// marked.
fn placeholder() -> BatchRow {
    BatchRow {
        polled: Polled {
            id: String::new(),
            attempts: 0,
            last_error: None,
        },
        result: RowResult::Unmappable {
            fields: Box::default(),
            error_kind: "moved",
            reason: String::new(),
        },
    }
}

/// Rows per window: the relay's in-flight window, at most [`MAX_WINDOW`].
fn window_size(max_in_flight_events: usize) -> usize {
    max_in_flight_events.clamp(1, MAX_WINDOW)
}

fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_is_the_in_flight_window_bounded() {
        assert_eq!(window_size(0), 1);
        assert_eq!(window_size(500), 500);
        assert_eq!(window_size(1_000_000), MAX_WINDOW);
    }
}
