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

use tokio::sync::mpsc;
use tokio_postgres::Client;

use crate::delivery::EventId;
use crate::lsn::Lsn;
use crate::postgres::connect_metadata;
use crate::postgres::conninfo::ConnInfo;
use crate::postgres::describe_error;
use crate::postgres::replication::ReplicationError;

use super::table::{PoisonRow, insert_row, insert_statement};

/// A poison insert the relay asks for, and its answer.
#[derive(Debug)]
pub(crate) struct PoisonRequest {
    pub(crate) id: EventId,
    pub(crate) row: PoisonRow,
}

/// Outcome of a [`PoisonRequest`]: `Ok` once the row is committed.
#[derive(Debug)]
pub(crate) struct PoisonOutcome {
    pub(crate) id: EventId,
    pub(crate) result: Result<(), PoisonInsertError>,
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
}

/// Inserts poison rows with a connection it re-opens when it breaks.
#[derive(Debug)]
pub(crate) struct PoisonWriter {
    conninfo: ConnInfo,
    statement: String,
    client: Option<Client>,
}

impl PoisonWriter {
    /// `table` is the configured `outbox.poison_table`.
    #[must_use]
    pub(crate) fn new(conninfo: ConnInfo, table: &str) -> PoisonWriter {
        let statement = insert_statement(table);
        PoisonWriter {
            conninfo,
            statement,
            client: None,
        }
    }

    /// Inserts (or finds already inserted) one row; the connection is dropped on
    /// error so the next call reconnects.
    pub(crate) async fn insert(&mut self, row: &PoisonRow) -> Result<(), PoisonInsertError> {
        let client = match self.client.take() {
            Some(client) => client,
            None => connect_metadata(&self.conninfo)
                .await
                .map_err(PoisonInsertError::Connect)?,
        };
        insert_row(&client, self.statement.as_str(), row)
            .await
            .map_err(PoisonInsertError::Insert)?;
        self.client = Some(client);
        Ok(())
    }
}

/// Runs the writer until `requests` closes, answering each request on `outcomes`.
pub(crate) async fn run_writer(
    mut writer: PoisonWriter,
    mut requests: mpsc::Receiver<PoisonRequest>,
    outcomes: mpsc::Sender<PoisonOutcome>,
) {
    while let Some(request) = requests.recv().await {
        let result = writer.insert(&request.row).await;
        match &result {
            Ok(()) => tracing::warn!(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statement_targets_the_configured_table() {
        let info = ConnInfo::parse("postgresql://h/db").unwrap();
        let w = PoisonWriter::new(info, "app.dead_letters");
        assert!(w.statement.contains("\"app\".\"dead_letters\""));
    }
}
