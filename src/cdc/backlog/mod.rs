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
//! # Several outboxes
//!
//! The stream delivers the rows of every outbox in one commit order, and outboxes
//! may share topics and keys. Their backlogs are read together ([`Backlogs`]), each
//! through its own cursor in the one snapshot, and merged by [`CommitRank`] (the
//! same keys their `ORDER BY` sorts by, comparable between tables) into windows.
//! A window is resolved in segments: a segment ends before a row whose key (topic
//! and record key) an earlier row of the segment from another outbox has, and every
//! row of a segment is resolved before the next segment is published. Inside a
//! segment no key is in two outboxes, so each outbox resolves its rows by its own
//! rules; the keys one outbox parks or halts on are held by every outbox. All
//! outboxes publish through one producer (under exactly-once the slot's
//! transactional id, fenced once); where they interleave rows of one key, the
//! rounds are smaller.
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

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use tokio_postgres::{Client, IsolationLevel, Portal, Transaction};

use crate::config::{Config, ConfigError, PoisonKeyMode};
use crate::error::{Error, Result};
use crate::kafka::{self, DeliveryReport, Publisher};
use crate::lifecycle::{Backoff, millis};
use crate::lsn::Lsn;
use crate::outbox::OutboxMapper;
use crate::outbox::position::ServerHistory;
use crate::poison::{Parked, ParkedKey, PoisonRow, WriterStatements};
use crate::poller::{self, BatchRow, CommitRank, Polled, RowResult};
use crate::postgres::replication::quote_literal;

use delivered::{DeliveredKeys, Later};
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

/// The backlogs of a cutover or resync, one per outbox ([`Config::per_outbox`]),
/// published together in one snapshot, merged in commit order (module docs).
pub(super) struct Backlogs<'a> {
    parts: Vec<Backlog<'a>>,
    producer: Producer,
    /// The cutover's marker table, whose progress counters each round updates.
    marker_table: Option<&'a str>,
    /// Rows per merged window.
    window: usize,
}

/// The producer every outbox's backlog publishes through, and its reports.
struct Producer {
    publisher: Publisher,
    reports: tokio::sync::mpsc::Receiver<DeliveryReport>,
    /// Event id base of the next publish round (ids are per producer).
    next_id: u64,
}

/// One outbox's cursor in the snapshot, and the rows read from it not yet merged.
struct Cursor {
    portal: Portal,
    read: VecDeque<(CommitRank, BatchRow)>,
    done: bool,
}

impl<'a> Backlogs<'a> {
    /// Opens the producer and every outbox's backlog: everything that can fail for
    /// lack of a column, a table, a connection or the broker, before anything is
    /// recorded. In exactly-once mode it also fences the slot's older producers and
    /// writes the marks the last backlog transaction left ([`transactions`]): before
    /// the slot whose snapshot the rows are read in exists.
    pub(super) async fn open(
        views: &'a [Config],
        metadata: &Client,
        marker_table: Option<&'a str>,
        history: ServerHistory,
    ) -> Result<Backlogs<'a>> {
        let Some(first) = views.first() else {
            return Err(ConfigError::Invalid("no outbox to publish the backlog of".into()).into());
        };
        let window = window_size(first.relay.max_in_flight_events);
        let capacity = kafka::report_capacity(&first.relay).max(window + 1);
        let mut producer_config = kafka::producer_config(&first.kafka, &first.relay)?;
        let transactional_id =
            crate::cdc::exactly_once::make_transactional(first, &mut producer_config);
        let (publisher, reports) = Publisher::new(producer_config, capacity)?;
        let publisher =
            publisher.with_configuration_errors_poisoned(first.relay.on_config_error.poisons());
        publisher.check_broker(BROKER_CHECK_TIMEOUT).await?;
        if let Some(id) = &transactional_id {
            transactions::fence(first, id, &publisher).await?;
        }
        let mut parts = Vec::with_capacity(views.len());
        for view in views {
            parts.push(Backlog::open(view, metadata, history, transactional_id.clone()).await?);
        }
        Ok(Backlogs {
            parts,
            producer: Producer {
                publisher,
                reports,
                next_id: 0,
            },
            marker_table,
            window,
        })
    }

    /// Reads every outbox's backlog in the exported snapshot, merged in commit
    /// order window by window, and resolves every row (acked, poisoned or parked)
    /// segment by segment before reading on (module docs).
    ///
    /// # Errors
    ///
    /// [`Error::BacklogHalted`] when a row was given up on under `halt`: everything
    /// else was resolved, the backlog is not complete.
    pub(super) async fn publish(
        &mut self,
        metadata: &mut Client,
        reader: &mut Client,
        snapshot: &str,
        consistent_point: Lsn,
        query: BacklogQuery,
    ) -> Result<BacklogSummary> {
        let mut summary = BacklogSummary::default();
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
        let mut cursors = Vec::with_capacity(self.parts.len());
        for part in &mut self.parts {
            part.consistent_point = consistent_point;
            cursors.push(part.cursor(&tx, query).await?);
        }
        let mut delivered = match (query, self.parts.first()) {
            // Without a reader every row is published, as before.
            (BacklogQuery::Undelivered { .. }, Some(first)) => DeliveredKeys::new(first.config)
                .inspect_err(|e| tracing::warn!(error = %e, "resync: cannot read the topics; rows delivered before the loss are published again"))
                .ok(),
            _ => None,
        };
        loop {
            let window = self.next_window(&tx, &mut cursors).await?;
            if window.is_empty() {
                break;
            }
            summary.rows += window.len() as u64;
            for segment in segments(window) {
                self.resolve_segment(metadata, segment, delivered.as_mut(), &mut summary)
                    .await?;
            }
            tracing::debug!(
                rows = summary.rows,
                published = summary.published,
                "backlog window resolved"
            );
        }
        tx.commit().await.map_err(poller::pg_error)?;
        let halted: Vec<&HaltedRow> = self.parts.iter().flat_map(|p| &p.halted).collect();
        match halted.first() {
            None => Ok(summary),
            Some(first) => Err(Error::BacklogHalted {
                count: halted.len(),
                id: first.id.clone(),
                error: first.error.clone(),
            }),
        }
    }

    /// The next rows of every cursor, merged by rank (ties in outbox order), at
    /// most a window of them; each with its outbox's index.
    async fn next_window(
        &self,
        tx: &Transaction<'_>,
        cursors: &mut [Cursor],
    ) -> Result<Vec<(usize, BatchRow)>> {
        let mut window = Vec::with_capacity(self.window);
        while window.len() < self.window {
            for (part, cursor) in self.parts.iter().zip(cursors.iter_mut()) {
                if cursor.read.is_empty() && !cursor.done {
                    part.read(tx, cursor, self.window).await?;
                }
            }
            let next = cursors
                .iter()
                .enumerate()
                .filter_map(|(i, c)| c.read.front().map(|(rank, _)| (*rank, i)))
                .min();
            let Some((_, i)) = next else {
                break;
            };
            if let Some((_, row)) = cursors[i].read.pop_front() {
                window.push((i, row));
            }
        }
        Ok(window)
    }

    /// Resolves one segment: each outbox's rows of it in turn (no key is in two).
    async fn resolve_segment(
        &mut self,
        metadata: &mut Client,
        segment: Vec<(usize, BatchRow)>,
        mut delivered: Option<&mut DeliveredKeys>,
        summary: &mut BacklogSummary,
    ) -> Result<()> {
        let mut by_part: Vec<Vec<BatchRow>> = self.parts.iter().map(|_| Vec::new()).collect();
        for (i, row) in segment {
            by_part[i].push(row);
        }
        for (i, rows) in by_part.into_iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            self.share_held_keys(i);
            let part = &mut self.parts[i];
            let rows = match delivered.as_deref_mut() {
                Some(delivered) => {
                    part.mark_delivered(delivered, rows, metadata, self.marker_table, summary)
                        .await?
                }
                None => rows,
            };
            if !rows.is_empty() {
                part.resolve(
                    rows,
                    &mut self.producer,
                    metadata,
                    self.marker_table,
                    summary,
                )
                .await?;
            }
        }
        Ok(())
    }

    /// Gives outbox `to` the keys every other outbox parked or halted on.
    fn share_held_keys(&mut self, to: usize) {
        let (parked, halted) = self
            .parts
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != to)
            .fold((Vec::new(), Vec::new()), |(mut p, mut h), (_, part)| {
                let (parked, halted) = part.rules.held_keys();
                p.extend(parked.cloned());
                h.extend(halted.cloned());
                (p, h)
            });
        if let Some(part) = self.parts.get_mut(to) {
            part.rules.hold(parked, halted);
        }
    }
}

/// Splits a merged window into segments, in order: a segment ends before a row
/// whose key an earlier row of the segment from another outbox has (module docs).
fn segments(window: Vec<(usize, BatchRow)>) -> Vec<Vec<(usize, BatchRow)>> {
    let mut segments = Vec::new();
    let mut segment: Vec<(usize, BatchRow)> = Vec::new();
    let mut owners: HashMap<ParkedKey, usize> = HashMap::new();
    for (part, row) in window {
        if let RowResult::Event { event, .. } = &row.result {
            let key = crate::cdc::poison_policy::key_of(event);
            if owners.get(&key).is_some_and(|owner| *owner != part) {
                segments.push(std::mem::take(&mut segment));
                owners.clear();
            }
            owners.insert(key, part);
        }
        segment.push((part, row));
    }
    if !segment.is_empty() {
        segments.push(segment);
    }
    segments
}

/// A row halted under `relay.on_poison = "halt"`.
#[derive(Debug, Clone)]
struct HaltedRow {
    id: String,
    error: String,
}

/// One outbox's backlog: mapper, prepared marks, the per-key rules.
pub(super) struct Backlog<'a> {
    config: &'a Config,
    prepared: poller::Prepared,
    sql: poller::Sql,
    layout: poller::Layout,
    mapper: OutboxMapper,
    rules: KeyRules,
    parking: WriterStatements,
    max_attempts: i32,
    /// Rows read so far: a parked row's place in the backlog.
    ordinal: u64,
    halted: Vec<HaltedRow>,
    /// Exactly-once mode: each round in a Kafka transaction.
    transactions: Option<BacklogTransactions>,
    /// The consistent point of the slot the backlog is read for.
    consistent_point: Lsn,
}

impl<'a> Backlog<'a> {
    /// What can fail for lack of a column or a table; in exactly-once mode (the
    /// producer's `transactional_id`) the marks the last backlog transaction left
    /// for this outbox are written ([`transactions`]).
    async fn open(
        config: &'a Config,
        metadata: &Client,
        history: ServerHistory,
        transactional_id: Option<String>,
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
        let transactions = match transactional_id {
            Some(id) => Some(BacklogTransactions::open(config, id, metadata, &sql, history).await?),
            None => None,
        };
        let max_attempts = i32::try_from(config.relay.max_attempts).unwrap_or(i32::MAX);
        Ok(Backlog {
            config,
            prepared,
            sql,
            layout,
            mapper,
            rules: KeyRules::new(config.relay.on_poison, max_attempts, parked),
            parking: WriterStatements::new(&config.outbox),
            max_attempts,
            ordinal: 0,
            halted: Vec::new(),
            transactions,
            consistent_point: Lsn::ZERO,
        })
    }

    /// Opens this outbox's cursor over `query` in the snapshot's transaction.
    async fn cursor(&self, tx: &Transaction<'_>, query: BacklogQuery) -> Result<Cursor> {
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
        Ok(Cursor {
            portal,
            read: VecDeque::new(),
            done: false,
        })
    }

    /// Reads up to `limit` more rows from `cursor`, mapped, with their ranks.
    async fn read(&self, tx: &Transaction<'_>, cursor: &mut Cursor, limit: usize) -> Result<()> {
        let chunk = tx
            .query_portal(&cursor.portal, i32::try_from(limit).unwrap_or(i32::MAX))
            .await
            .map_err(poller::pg_error)?;
        cursor.done = chunk.len() < limit;
        for row in &chunk {
            let (polled, outbox_row, rank) =
                poller::read_ranked_row(row, self.layout.payload_format)?;
            let row = BatchRow::map(
                &self.mapper,
                polled,
                &outbox_row,
                Some(self.consistent_point),
            );
            cursor.read.push_back((rank, row));
        }
        Ok(())
    }

    /// Marks sent the rows of a resync's window whose record the topic already holds
    /// ([`delivered`]); returns the others, in order.
    async fn mark_delivered(
        &mut self,
        delivered: &mut DeliveredKeys,
        rows: Vec<BatchRow>,
        metadata: &mut Client,
        marker_table: Option<&str>,
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
        let mut later = Later::of(rows.iter().filter_map(|row| match &row.result {
            RowResult::Event { event, .. } => Some(event),
            RowResult::Unmappable { .. } => None,
        }));
        let (mut held, left): (Vec<BatchRow>, Vec<BatchRow>) =
            rows.into_iter().partition(|row| match &row.result {
                RowResult::Event { event, .. } => delivered.skips(event, &mut later),
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
        self.write(metadata, marker_table, &held, &[], summary)
            .await?;
        summary.already_delivered += held.len() as u64;
        tracing::info!(
            rows = held.len(),
            "resync: rows the topic already held (delivered before the slot was lost) marked sent, not published again"
        );
        Ok(left)
    }

    /// Publishes one window in rounds until every row is acked, poisoned, parked or
    /// halted; the marks of each round are committed with the marker row's counters.
    async fn resolve(
        &mut self,
        rows: Vec<BatchRow>,
        producer: &mut Producer,
        metadata: &mut Client,
        marker_table: Option<&str>,
        summary: &mut BacklogSummary,
    ) -> Result<()> {
        let mut window: Vec<(u64, Unresolved)> = rows
            .into_iter()
            .map(|row| {
                self.ordinal += 1;
                (self.ordinal, Unresolved::new(row))
            })
            .collect();
        let mut backoff = Backoff::new(RETRY_BACKOFF_INITIAL, RETRY_BACKOFF_MAX);
        while !window.is_empty() {
            let round = self
                .round(window, producer, metadata, marker_table, summary)
                .await?;
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
        producer: &mut Producer,
        metadata: &mut Client,
        marker_table: Option<&str>,
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
            transactions.begin(&producer.publisher)?;
        }
        let base = producer.next_id;
        producer.next_id = producer.next_id.wrapping_add(published.len() as u64);
        let sent = poller::publish_holding(
            &producer.publisher,
            &mut producer.reports,
            base,
            &mut published,
            |i| produce.get(i).and_then(|(_, u)| u.key.as_ref()),
        )
        .await?;
        let committed = self
            .settle_transaction(&producer.publisher, &published, &sent)
            .await?;
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
        let (outcome, answers) = self
            .write(metadata, marker_table, &marks, &parked_rows, summary)
            .await?;
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
    async fn settle_transaction(
        &mut self,
        publisher: &Publisher,
        published: &[BatchRow],
        sent: &[bool],
    ) -> Result<bool> {
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
            transactions.abort(publisher).await?;
            return Ok(false);
        }
        let ids = produced.iter().map(|row| row.polled.id.clone()).collect();
        transactions
            .commit(publisher, self.consistent_point, ids)
            .await
    }

    /// The marks of a round and its parked rows, in one transaction with the
    /// marker row's counters.
    async fn write(
        &mut self,
        metadata: &mut Client,
        marker_table: Option<&str>,
        marks: &[BatchRow],
        parked: &[PoisonRow],
        summary: &BacklogSummary,
    ) -> Result<(poller::BatchOutcome, Vec<Parked>)> {
        let holds_keys =
            (self.config.relay.on_poison == PoisonKeyMode::ParkKey).then_some(&self.parking);
        let tx = metadata.transaction().await.map_err(poller::pg_error)?;
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
        if let Some(marker_table) = marker_table {
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

    /// Row `id` of `entity` in the topic `events`.
    fn row(id: &str, entity: &str) -> BatchRow {
        let mapper =
            OutboxMapper::with_template(&crate::config::OutboxConfig::default(), "events", None)
                .expect("a valid template");
        let row = crate::outbox::OutboxRow {
            id: Some(bytes::Bytes::from(id.to_owned())),
            aggregate_id: Some(bytes::Bytes::from(entity.to_owned())),
            payload: Some(bytes::Bytes::from_static(b"{}")),
            ..Default::default()
        };
        let polled = Polled {
            id: id.to_owned(),
            attempts: 0,
            last_error: None,
        };
        BatchRow::map(&mapper, polled, &row, None)
    }

    #[test]
    fn a_segment_ends_before_a_key_another_outbox_has_in_it() {
        // Outbox 0: a, b, a; outbox 1: c, a, b (merged in commit order).
        let window = vec![
            (0, row("1", "a")),
            (1, row("2", "c")),
            (0, row("3", "b")),
            (0, row("4", "a")),
            (1, row("5", "a")),
            (1, row("6", "b")),
            (0, row("7", "c")),
        ];
        let ids: Vec<Vec<(usize, String)>> = segments(window)
            .into_iter()
            .map(|s| s.into_iter().map(|(p, r)| (p, r.polled.id)).collect())
            .collect();
        let seg = |rows: &[(usize, &str)]| -> Vec<(usize, String)> {
            rows.iter().map(|(p, id)| (*p, (*id).to_owned())).collect()
        };
        assert_eq!(
            ids,
            [
                // a and b of outbox 0 and c of outbox 1: no key in both.
                seg(&[(0, "1"), (1, "2"), (0, "3"), (0, "4")]),
                // Outbox 1's a waits for outbox 0's; in the new segment c is
                // outbox 0's alone (outbox 1's c was in the first).
                seg(&[(1, "5"), (1, "6"), (0, "7")]),
            ]
        );
    }

    #[test]
    fn window_is_the_in_flight_window_bounded() {
        assert_eq!(window_size(0), 1);
        assert_eq!(window_size(500), 500);
        assert_eq!(window_size(1_000_000), MAX_WINDOW);
    }
}
