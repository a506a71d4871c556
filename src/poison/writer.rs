//! The CDC relay's poison writer: a task of its own, on a metadata connection of its
//! own, that commits `poison_outbox` rows and answers each request.
//!
//! A poisoned event counts as resolved only once its row is *committed* (see
//! `cdc::progress`), so the insert must not run on the replication loop: a slow or
//! failing insert would stall the WAL stream and its keepalives. Here it runs in
//! [`run_writer`], fed through a channel; a failed insert is reported back as a
//! [`PoisonInsertError`] so the core asks again after a backoff, and the broken
//! connection is dropped so the next request reconnects. The poller and a cutover do
//! not use this task: they write poison rows inside their own batch transactions.
//!
//! # Batches
//!
//! Under mass poisoning (a bad deploy that writes every row without an entity id)
//! one statement and one commit per event would make the relay drain poison several
//! times slower than it delivers. So the writer takes every request already queued,
//! up to [`MAX_BATCH_ROWS`] rows and about [`MAX_BATCH_BYTES`], and writes them with
//! one statement (one commit); each request is answered when it commits. Preparing
//! a batch (cutting, hashing, `row_data` as JSON) costs about as much CPU as the
//! server spends inserting it, so the two overlap: [`run_writer`] prepares the next
//! batch while a task of its own inserts the previous one. When the server refuses a
//! batch (never expected: the statement cannot fail on content, see `table.rs`) its
//! rows are written one by one, so one bad row cannot hold the others back; when the
//! connection fails, every request of the batch is asked again later.

use tokio::sync::mpsc;
use tokio_postgres::Client;

use crate::delivery::EventId;
use crate::lsn::Lsn;
use crate::postgres::connect_metadata;
use crate::postgres::conninfo::ConnInfo;
use crate::postgres::describe_error;
use crate::postgres::replication::ReplicationError;

use super::parking::{Parked, WriterStatements, insert_parking, needs_parking};
use super::table::{Parking, PoisonBatch, PoisonRow, insert_batch, insert_rows, insert_statement};
use crate::config::Config;

/// Most rows in one insert statement.
pub(crate) const MAX_BATCH_ROWS: usize = 1000;

/// A batch stops growing once its values reach this many bytes (a first row is
/// always taken, whatever its size).
pub(crate) const MAX_BATCH_BYTES: usize = 8 * 1024 * 1024;

/// A poison insert the relay asks for, and its answer.
#[derive(Debug)]
pub(crate) struct PoisonRequest {
    pub(crate) id: EventId,
    pub(crate) row: PoisonRow,
}

/// Outcome of a [`PoisonRequest`]: `Ok` once the row is committed, or once a
/// parked event's key turned out released (`parking.rs`).
#[derive(Debug)]
pub(crate) struct PoisonOutcome {
    pub(crate) id: EventId,
    pub(crate) result: Result<Parked, PoisonInsertError>,
}

/// Why a poison row could not be written; the request is asked again later.
#[derive(Debug, thiserror::Error)]
pub(crate) enum PoisonInsertError {
    /// The metadata connection could not be opened.
    #[error("{0}")]
    Connect(#[source] ReplicationError),
    /// The insert failed (the server's message and SQLSTATE when it sent one).
    #[error("{}", describe_error(.0))]
    Insert(#[source] tokio_postgres::Error),
    /// Another row's failure took the batch's statement with it (its message).
    #[error("{0}")]
    Batch(String),
}

/// A batch of poison rows is one statement (two with parking): longer means a lock
/// or a server that stopped answering (`crate::postgres::bound_statements`).
const STATEMENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);
const LOCK_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Inserts poison rows with a connection it re-opens when it breaks.
#[derive(Debug)]
pub(crate) struct PoisonWriter {
    conninfo: ConnInfo,
    /// The insert of each outbox's poison table, in the config's order
    /// ([`PoisonFields::outbox`](crate::outbox::PoisonFields::outbox) picks one).
    statements: Vec<String>,
    /// Parking is refused with several outboxes (config validation), so the
    /// statements are the first outbox's.
    parking: WriterStatements,
    copy_limit: usize,
    client: Option<Client>,
}

impl PoisonWriter {
    /// Writes to each outbox's `poison_table`, values cut to
    /// `relay.poison_copy_limit_bytes`, each row recorded as read through this
    /// relay's slot.
    #[must_use]
    pub(crate) fn new(conninfo: ConnInfo, config: &Config) -> PoisonWriter {
        let slot = config.postgres.slot_name();
        PoisonWriter {
            conninfo,
            statements: config
                .outboxes()
                .map(|outbox| insert_statement(outbox, Some(&slot)))
                .collect(),
            parking: WriterStatements::new(&config.outbox),
            copy_limit: config.relay.poison_copy_limit_bytes,
            client: None,
        }
    }

    /// Connects when there is no connection.
    async fn client(&mut self) -> Result<Client, PoisonInsertError> {
        match self.client.take() {
            Some(client) => Ok(client),
            None => {
                let client = connect_metadata(&self.conninfo)
                    .await
                    .map_err(PoisonInsertError::Connect)?;
                crate::postgres::bound_statements(&client, STATEMENT_TIMEOUT, LOCK_TIMEOUT)
                    .await
                    .map_err(PoisonInsertError::Insert)?;
                Ok(client)
            }
        }
    }

    /// The insert into the poison table of the outbox `rows` come from (a batch is
    /// always of one outbox, see [`run_writer`]).
    fn statement_for(&self, rows: &[&PoisonRow]) -> &str {
        let outbox = rows.first().map_or(0, |r| r.fields.outbox);
        self.statements
            .get(outbox)
            .or_else(|| self.statements.first())
            .map_or("", String::as_str)
    }

    /// Inserts (or finds already inserted) `rows`, all committed together; the
    /// connection is dropped on error so the next call reconnects. Rows that park
    /// keys or are parked go through the parking transaction (`parking.rs`).
    pub(crate) async fn insert(
        &mut self,
        rows: &[&PoisonRow],
    ) -> Result<Vec<Parked>, PoisonInsertError> {
        let mut client = self.client().await?;
        let statement = self.statement_for(rows).to_owned();
        let answers = if needs_parking(rows) {
            insert_parking(
                &mut client,
                &self.parking,
                &statement,
                rows,
                self.copy_limit,
            )
            .await
        } else {
            insert_rows(&client, &statement, rows, self.copy_limit)
                .await
                .map(|_| vec![Parked::Recorded; rows.len()])
        }
        .map_err(PoisonInsertError::Insert)?;
        self.client = Some(client);
        Ok(answers)
    }

    /// Inserts a batch: prepared, or through the parking transaction when it parks.
    async fn insert_prepared(&mut self, batch: &Batch) -> Result<Vec<Parked>, PoisonInsertError> {
        let rows: Vec<&PoisonRow> = batch.requests.iter().map(|r| &r.row).collect();
        if needs_parking(&rows) {
            return self.insert(&rows).await;
        }
        let client = self.client().await?;
        insert_batch(&client, self.statement_for(&rows), &batch.rows)
            .await
            .map_err(PoisonInsertError::Insert)?;
        self.client = Some(client);
        Ok(vec![Parked::Recorded; rows.len()])
    }

    /// Inserts a prepared batch; when the server refuses it, each row on its own.
    /// One result per request, in order.
    async fn insert_batch(&mut self, batch: &Batch) -> Vec<Result<Parked, PoisonInsertError>> {
        match self.insert_prepared(batch).await {
            Ok(answers) => answers.into_iter().map(Ok).collect(),
            Err(PoisonInsertError::Insert(e))
                if batch.requests.len() > 1 && e.as_db_error().is_some() =>
            {
                tracing::warn!(
                    error = %describe_error(&e),
                    rows = batch.requests.len(),
                    "poison batch refused; inserting its rows one by one"
                );
                let mut results = Vec::with_capacity(batch.requests.len());
                for request in &batch.requests {
                    let answer = self.insert(&[&request.row]).await;
                    results.push(answer.map(|a| a.first().copied().unwrap_or(Parked::Recorded)));
                }
                results
            }
            Err(e) => {
                let message = e.to_string();
                let mut results = vec![Err(e)];
                results.extend(
                    (1..batch.requests.len())
                        .map(|_| Err(PoisonInsertError::Batch(message.clone()))),
                );
                results
            }
        }
    }
}

/// Requests and their rows in the statement's form.
#[derive(Debug)]
struct Batch {
    requests: Vec<PoisonRequest>,
    /// Empty for a batch that parks: the parking transaction writes only the rows
    /// whose key is still parked, and prepares those itself.
    rows: PoisonBatch,
}

/// Runs the writer until `requests` closes, answering each request on `outcomes`:
/// collects and prepares batches here, inserts them on a task of its own (see the
/// module doc).
pub(crate) async fn run_writer(
    writer: PoisonWriter,
    mut requests: mpsc::Receiver<PoisonRequest>,
    outcomes: mpsc::Sender<PoisonOutcome>,
) {
    let copy_limit = writer.copy_limit;
    // One batch waits while another is inserted: enough to keep both sides busy.
    let (prepared, ready) = mpsc::channel(1);
    let inserter = tokio::spawn(insert_batches(writer, ready, outcomes));
    // A request of another outbox than the batch's starts the next batch.
    let mut held: Option<PoisonRequest> = None;
    loop {
        let first = match held.take() {
            Some(request) => request,
            None => match requests.recv().await {
                Some(request) => request,
                None => break,
            },
        };
        let outbox = first.row.fields.outbox;
        let mut bytes = first.row.approximate_size();
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH_ROWS && bytes < MAX_BATCH_BYTES {
            let Ok(next) = requests.try_recv() else { break };
            if next.row.fields.outbox != outbox {
                held = Some(next);
                break;
            }
            bytes += next.row.approximate_size();
            batch.push(next);
        }
        let refs: Vec<&PoisonRow> = batch.iter().map(|r| &r.row).collect();
        let rows = if needs_parking(&refs) {
            PoisonBatch::default()
        } else {
            PoisonBatch::new(refs, copy_limit)
        };
        let batch = Batch {
            requests: batch,
            rows,
        };
        if prepared.send(batch).await.is_err() {
            break;
        }
    }
    drop(prepared);
    let _ = inserter.await;
}

/// Inserts each prepared batch and answers its requests, until `ready` closes or
/// nobody listens for outcomes.
async fn insert_batches(
    mut writer: PoisonWriter,
    mut ready: mpsc::Receiver<Batch>,
    outcomes: mpsc::Sender<PoisonOutcome>,
) {
    while let Some(batch) = ready.recv().await {
        let results = writer.insert_batch(&batch).await;
        for (request, result) in batch.requests.into_iter().zip(results) {
            match &result {
                Ok(Parked::Released) => tracing::info!(
                    idempotency_key = request.row.fields.idempotency_key.as_deref().unwrap_or(""),
                    "key released by replay; the event is produced"
                ),
                Ok(_) if request.row.parking == Parking::Parked => tracing::debug!(
                    idempotency_key = request.row.fields.idempotency_key.as_deref().unwrap_or(""),
                    key = request.row.fields.aggregate_id.as_deref().unwrap_or(""),
                    "event parked behind a poisoned event of its key"
                ),
                Ok(_) => tracing::warn!(
                    idempotency_key = request.row.fields.idempotency_key.as_deref().unwrap_or(""),
                    error_kind = %request.row.error_kind,
                    error = %request.row.error,
                    attempts = request.row.attempts,
                    lsn = %request.row.lsn.unwrap_or(Lsn::ZERO),
                    "event poisoned"
                ),
                Err(e) => tracing::warn!(error = %e, "poison insert failed; will retry"),
            }
            let outcome = PoisonOutcome {
                id: request.id,
                result,
            };
            if outcomes.send(outcome).await.is_err() {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statement_targets_the_configured_table() {
        let info = ConnInfo::parse("postgresql://h/db").unwrap();
        let config = Config::from_sources(
            "t",
            "[postgres]\nurl = \"postgresql://h/db\"\n[kafka]\nbrokers = \"b\"\n\
             [outbox]\npoison_table = \"app.dead_letters\"\n\
             [relay]\npoison_copy_limit_bytes = 4096\n",
            Vec::new(),
        )
        .unwrap();
        let w = PoisonWriter::new(info.clone(), &config);
        assert!(w.statements[0].contains("\"app\".\"dead_letters\""));
        assert_eq!(w.copy_limit, 4096);

        // Several outboxes: a statement each, picked by the rows' outbox.
        let config = crate::config::test_config(
            "[[outbox]]\ntable = \"a.outbox\"\npoison_table = \"a.poison\"\n\
             [[outbox]]\ntable = \"b.outbox\"\npoison_table = \"b.poison\"\n",
        );
        let w = PoisonWriter::new(info, &config);
        let mut row = PoisonRow::default();
        row.fields.outbox = 1;
        assert!(
            w.statement_for(&[&row])
                .contains("INSERT INTO \"b\".\"poison\"")
        );
        assert!(
            w.statement_for(&[&row])
                .contains("\"b\".outbox_relay_try_jsonb")
        );
        row.fields.outbox = 0;
        assert!(
            w.statement_for(&[&row])
                .contains("INSERT INTO \"a\".\"poison\"")
        );
    }
}
