//! A backlog in `kafka.delivery = "exactly-once"`: each round's records in one Kafka
//! transaction with a progress record that names their rows; the `sent_at` marks
//! after the commit.
//!
//! # Why the marks follow the commit
//!
//! An at-least-once backlog marks a row `sent_at` once the broker acked it: a crash
//! between the ack and the mark publishes the row again. Two commits (Kafka's and
//! PostgreSQL's) cannot be one, so exactly-once makes Kafka's the decision and the
//! mark its consequence. A round's records go into one Kafka transaction under the
//! slot's `transactional.id` (the stream's: the relay that streams next fences this
//! producer), together with a progress record that lists the rows
//! ([`BacklogSent`]); the marks are written after the commit. Then:
//!
//! * a crash before the commit leaves the records in a transaction the next
//!   producer's `init_transactions` aborts: a `read_committed` consumer never sees
//!   them, and the rows, unmarked, are published again;
//! * a crash after it leaves the rows committed and perhaps unmarked: the next
//!   backlog (the interrupted cutover or resync starts over) reads the record first
//!   and writes the marks, before the slot whose exported snapshot it reads the rows
//!   in is created, so the snapshot sees them marked and leaves them out.
//!
//! A round commits only if every record of it was delivered: one failure aborts the
//! transaction, the failed row follows the backlog's retry and poison rules, and the
//! rows delivered beside it are produced again without counting an attempt (the
//! stream does the same, `cdc::progress::transactions`). The record is the slot's
//! progress record, so it carries the latest record's streaming part (history, saved
//! position, mark) unchanged: the stream that follows resumes as it would have.
//!
//! # When the marks are not written
//!
//! Only on the record's own server history (system identifier and timeline), on the
//! same run of the server (its postmaster start time) and once the server's WAL
//! reaches the record's consistent point. A failover or a data directory restored in
//! place may have taken those rows away and given their ids to new rows (a sequence
//! hands out values again after a restore); marking those would lose them. A
//! restore restarts the server, and its WAL can pass the consistent point again
//! with new writes, so the start time is what tells it apart. The rows are then
//! published again: duplicates, never a loss (a warning says so); the same after an
//! ordinary restart, which cannot be told from a restore.
//!
//! # The record's size
//!
//! A round lists at most [`SENT_IDS_BUDGET`] bytes of ids. A progress topic whose
//! `max.message.bytes` is smaller refuses the record and the round aborts: the
//! budget is halved for the next round (down to one row), so the backlog goes on
//! in smaller transactions instead of retrying the same one forever.

use tokio_postgres::Client;

use crate::cdc::exactly_once::{MAX_RECORD_BYTES, probe, progress_reader_config, send_progress};
use crate::cdc::ports::producer::librdkafka::read_latest;
use crate::cdc::progress_record::{BacklogSent, ProgressRecord};
use crate::config::Config;
use crate::error::Result;
use crate::kafka::{self, Publisher, TransactionError};
use crate::lsn::Lsn;
use crate::outbox::position::ServerHistory;
use crate::poller;

/// `client.id` of the progress record's reader.
const READER_CLIENT_ID: &str = "outbox-relay-backlog-progress";

/// Bytes of row ids one record may list (a round stops short of it): half of the
/// record's limit, the rest is the carried streaming part.
const SENT_IDS_BUDGET: usize = MAX_RECORD_BYTES / 2;

/// The smallest budget a refused record halves it to (a round always lists a row).
const MIN_SENT_IDS_BUDGET: usize = 256;

/// See the module documentation.
pub(super) struct BacklogTransactions {
    id: String,
    topic: String,
    /// The server history the backlog reads on (its records' `backlog` part).
    history: ServerHistory,
    /// When the server's postmaster started (its records' `backlog` part).
    server_started: Option<i64>,
    /// The latest record's streaming part, written again with every round.
    carried: ProgressRecord,
    /// Bytes of ids a round may list ([`SENT_IDS_BUDGET`], halved by refusals).
    budget: usize,
    /// The outbox table of the rows, named in the record when it is not the first
    /// of several (`BacklogSent::outbox`).
    outbox: Option<String>,
}

/// Fences every older producer of the slot (`init_transactions` settles what it
/// left open) and makes sure the broker commits transactions (the stream's probe,
/// `cdc::exactly_once`): once per producer, before any outbox's
/// [`BacklogTransactions::open`].
///
/// # Errors
///
/// A transactional failure (fenced or a broker without transactions: exit 3), a
/// missing progress topic (exit 3).
pub(super) async fn fence(config: &Config, id: &str, publisher: &Publisher) -> Result<()> {
    kafka::retrying(|| publisher.init_transactions(id)).await?;
    probe(
        publisher,
        id,
        &config.kafka.progress_topic,
        &config.postgres.slot_name(),
    )
    .await
    .map_err(|failed| failed.error)?;
    Ok(())
}

impl BacklogTransactions {
    /// Reads the slot's latest committed progress record and writes the marks of
    /// this outbox's backlog rows it names (see the module docs for when it does
    /// not). The producer is [`fence`]d first.
    ///
    /// # Errors
    ///
    /// A record that cannot be read, a failed mark.
    pub(super) async fn open(
        config: &Config,
        id: String,
        metadata: &Client,
        sql: &poller::Sql,
        history: ServerHistory,
    ) -> Result<BacklogTransactions> {
        let slot = config.postgres.slot_name();
        let topic = config.kafka.progress_topic.clone();
        let reader = progress_reader_config(config, READER_CLIENT_ID)?;
        let latest = read_latest(&reader, &topic, &slot).await?;
        let mut carried = latest.unwrap_or_else(|| ProgressRecord {
            slot,
            history,
            saved: Lsn::ZERO,
            mark: Default::default(),
            names: Default::default(),
            backlog: None,
            poisoned: Default::default(),
        });
        let server_started = crate::postgres::postmaster_started(metadata).await?;
        // Several outboxes: the record names its table, and a record that names none
        // is from a single-outbox run (its marks are left: rows published again).
        let outbox = config
            .serves_several_outboxes()
            .then(|| config.outbox.table.clone());
        if let Some(sent) = carried.backlog.take() {
            let ours = match (&sent.outbox, &outbox) {
                (Some(theirs), Some(ours)) => crate::config::same_table(theirs, ours),
                (None, None) => true,
                _ => false,
            };
            if ours {
                finish_marks(metadata, sql, history, server_started, &sent).await?;
            } else {
                // Another outbox's rows: its own backlog writes their marks (or,
                // when it ran before this one, wrote them already).
                tracing::debug!(rows = sent.sent.len(), outbox = ?sent.outbox,
                    "the last backlog transaction's rows are another outbox's");
                carried.backlog = Some(sent);
            }
        }
        Ok(BacklogTransactions {
            id,
            topic,
            history,
            server_started,
            carried,
            budget: SENT_IDS_BUDGET,
            outbox,
        })
    }

    /// How many of `ids` (in order) one round may publish: the record must list
    /// them all. At least one.
    pub(super) fn fitting<'i>(&self, ids: impl IntoIterator<Item = &'i str>) -> usize {
        fitting(ids, self.budget)
    }

    /// Begins the round's transaction, before its first produce.
    pub(super) fn begin(&self, publisher: &Publisher) -> Result<()> {
        Ok(publisher.begin_transaction(&self.id)?)
    }

    /// Writes the record naming `sent` (the round's delivered rows) and commits.
    /// `Ok(false)`: the transaction was aborted instead (nothing of it is visible;
    /// the rows are published again).
    ///
    /// # Errors
    ///
    /// A fenced or otherwise unusable producer; the backlog fails and starts over
    /// (the next producer's `init_transactions` settles this one's transaction).
    pub(super) async fn commit(
        &mut self,
        publisher: &Publisher,
        consistent_point: Lsn,
        sent: Vec<String>,
    ) -> Result<bool> {
        let mut record = self.carried.clone();
        record.backlog = Some(BacklogSent {
            history: self.history,
            server_started: self.server_started,
            consistent_point,
            sent,
            outbox: self.outbox.clone(),
        });
        let value = record.encode_within(MAX_RECORD_BYTES);
        let queued = send_progress(publisher, &self.topic, &record.slot, &value);
        if let Err(rejected) = queued {
            tracing::warn!(error = %rejected, topic = %self.topic, record_bytes = value.len(),
                "backlog: the progress record was refused; aborting the round's transaction");
            self.smaller_rounds();
            self.abort(publisher).await?;
            return Ok(false);
        }
        match kafka::retrying(|| async { kafka::joined(publisher.start_commit(&self.id).await) })
            .await
        {
            Ok(()) => Ok(true),
            Err(TransactionError::Abortable { code, message }) => {
                tracing::warn!(?code, %message, record_bytes = value.len(),
                    "backlog: the Kafka transaction cannot commit; aborting it (its rows are published again)");
                self.smaller_rounds();
                self.abort(publisher).await?;
                Ok(false)
            }
            Err(e) => Err(e.into()),
        }
    }

    /// After a round whose delivered records could not be committed (the progress
    /// record refused, by its size or otherwise): the next rounds list half as many
    /// bytes of ids.
    fn smaller_rounds(&mut self) {
        self.budget = (self.budget / 2).max(MIN_SENT_IDS_BUDGET);
    }

    /// Aborts the round's transaction (a record of it failed).
    pub(super) async fn abort(&self, publisher: &Publisher) -> Result<()> {
        kafka::retrying(|| async { kafka::joined(publisher.start_abort(&self.id).await) }).await?;
        Ok(())
    }
}

/// Writes the marks a backlog could not write before its process ended, when they
/// still name the same rows (module docs).
async fn finish_marks(
    metadata: &Client,
    sql: &poller::Sql,
    history: ServerHistory,
    server_started: Option<i64>,
    sent: &BacklogSent,
) -> Result<()> {
    if sent.sent.is_empty() {
        return Ok(());
    }
    let wal_end = crate::postgres::wal_end(metadata)
        .await
        .map_err(poller::pg_error)?;
    let reached = wal_end >= sent.consistent_point;
    let same_run = server_started.is_some() && sent.server_started == server_started;
    if sent.history != history || !same_run || !reached {
        tracing::warn!(rows = sent.sent.len(), recorded = %sent.history, %history,
            consistent_point = %sent.consistent_point, %wal_end, same_run,
            "the last backlog transaction's rows were committed to Kafka on another server history or before the server restarted (it may have been restored): not marking them; rows still in the outbox are published again");
        return Ok(());
    }
    let updated = poller::mark_unsent_sent(metadata, sql, &sent.sent).await?;
    tracing::info!(
        rows = sent.sent.len(),
        updated,
        "marked the rows of the last committed backlog transaction sent"
    );
    Ok(())
}

/// How many of `ids` (in order) fit `budget` bytes as the record lists them; at
/// least one.
fn fitting<'i>(ids: impl IntoIterator<Item = &'i str>, budget: usize) -> usize {
    let mut bytes = 0usize;
    let mut n = 0usize;
    for id in ids {
        // The id as a JSON string, and a comma.
        bytes += serde_json::to_string(id).map_or(6 * id.len() + 2, |s| s.len()) + 1;
        if n > 0 && bytes > budget {
            break;
        }
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_lists_at_most_its_budget_of_ids_and_at_least_one() {
        let ids: Vec<String> = (0..100_000).map(|i| format!("{i:020}")).collect();
        let n = fitting(ids.iter().map(String::as_str), SENT_IDS_BUDGET);
        assert!(n > 1_000 && n < ids.len(), "{n}");
        let listed: usize = ids[..n].iter().map(|id| id.len() + 3).sum();
        assert!(listed <= SENT_IDS_BUDGET);
        assert!(fitting(ids.iter().map(String::as_str), MIN_SENT_IDS_BUDGET) >= 1);
        let huge = "x".repeat(SENT_IDS_BUDGET * 2);
        assert_eq!(fitting([huge.as_str(), "1"], SENT_IDS_BUDGET), 1);
        assert_eq!(fitting(std::iter::empty(), SENT_IDS_BUDGET), 0);
    }
}
