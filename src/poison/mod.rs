//! Writes undeliverable events to the `poison_outbox` side table.
//!
//! A poisoned event counts as resolved only once its row is *committed* here (see
//! `progress`), so the insert runs on its own metadata connection in a task of its
//! own: a slow or failing insert never blocks the replication loop, and a failed
//! insert is reported back so the core asks again after a backoff. Rows are never
//! deleted (a trigger refuses it); `replay` re-publishes them.
//!
//! The insert is idempotent per `(idempotency_key, lsn)`: after a crash between the
//! poison commit and the slot confirmation, the relay sees the event again, fails it
//! again, and must not record it twice.

use serde_json::{Map, Value};

use crate::outbox::PoisonFields;
use crate::postgres::connect_metadata;
use crate::postgres::conninfo::ConnInfo;
use tokio::sync::mpsc;
use tokio_postgres::Client;

use crate::config::quote_qualified;
use crate::delivery::EventId;
use crate::lsn::Lsn;

/// One `poison_outbox` row: the outbox row as it was, and why it failed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoisonRow {
    /// The original data (see [`PoisonFields`]).
    pub fields: PoisonFields,
    pub error: String,
    pub error_kind: String,
    pub attempts: i32,
    /// Commit LSN of the transaction that inserted the row (`None` outside CDC).
    pub lsn: Option<Lsn>,
}

/// The `INSERT` of one [`PoisonRow`] into `table` (parameters: see [`insert_row`]).
/// It inserts nothing when a row with the same idempotency key and LSN exists: the
/// relay may poison an event again after a crash between the poison commit and the
/// slot confirmation, and must not record it twice.
#[must_use]
pub fn insert_statement(table: &str) -> String {
    let table = quote_qualified(table);
    format!(
        "INSERT INTO {table} (outbox_id, idempotency_key, aggregate_type, aggregate_id,
             event_type, topic, headers, payload, created_at, row_data, error, error_kind,
             attempts, lsn)
         SELECT $1, $2, $3, $4, $5, $6, $7::text::jsonb, $8, $9::text::timestamptz,
                $10::text::jsonb, $11, $12, $13, $14::text::pg_lsn
         WHERE NOT EXISTS (
             SELECT 1 FROM {table}
             WHERE idempotency_key IS NOT DISTINCT FROM $2
               AND lsn IS NOT DISTINCT FROM $14::text::pg_lsn)"
    )
}

/// Runs [`insert_statement`] (text or prepared) for `row` on a client or inside a
/// transaction; returns the rows inserted (0 when it was already recorded).
pub async fn insert_row<C, T>(
    client: &C,
    statement: &T,
    row: &PoisonRow,
) -> Result<u64, tokio_postgres::Error>
where
    C: tokio_postgres::GenericClient + Sync,
    T: ?Sized + tokio_postgres::ToStatement + Sync + Send,
{
    let f = &row.fields;
    let headers = f.headers.as_deref().map(valid_json_or_string);
    let row_data: Map<String, Value> = f
        .columns
        .iter()
        .map(|(name, value)| {
            (
                name.clone(),
                value.clone().map_or(Value::Null, Value::String),
            )
        })
        .collect();
    let row_data = Value::Object(row_data).to_string();
    let lsn = row.lsn.map(|l| l.to_string());
    client
        .execute(
            statement,
            &[
                &f.outbox_id,
                &f.idempotency_key,
                &f.aggregate_type,
                &f.aggregate_id,
                &f.event_type,
                &f.topic,
                &headers,
                &f.payload,
                &f.created_at,
                &row_data,
                &row.error,
                &row.error_kind,
                &row.attempts,
                &lsn,
            ],
        )
        .await
}

/// A poison insert the relay asks for, and its answer.
#[derive(Debug)]
pub struct PoisonRequest {
    pub id: EventId,
    pub row: PoisonRow,
}

/// Outcome of a [`PoisonRequest`]: `Ok` once the row is committed.
#[derive(Debug)]
pub struct PoisonOutcome {
    pub id: EventId,
    pub result: Result<(), String>,
}

/// Inserts poison rows with a connection it re-opens when it breaks.
#[derive(Debug)]
pub struct PoisonWriter {
    conninfo: ConnInfo,
    statement: String,
    client: Option<Client>,
}

impl PoisonWriter {
    /// `table` is the configured `outbox.poison_table`.
    #[must_use]
    pub fn new(conninfo: ConnInfo, table: &str) -> PoisonWriter {
        let statement = insert_statement(table);
        PoisonWriter {
            conninfo,
            statement,
            client: None,
        }
    }

    /// Inserts (or finds already inserted) one row; the connection is dropped on
    /// error so the next call reconnects.
    pub async fn insert(&mut self, row: &PoisonRow) -> Result<(), String> {
        let result = self.try_insert(row).await;
        if result.is_err() {
            self.client = None;
        }
        result
    }

    async fn try_insert(&mut self, row: &PoisonRow) -> Result<(), String> {
        if self.client.is_none() {
            let client = connect_metadata(&self.conninfo)
                .await
                .map_err(|e| e.to_string())?;
            self.client = Some(client);
        }
        let Some(client) = self.client.as_ref() else {
            return Err("no connection".into());
        };
        insert_row(client, self.statement.as_str(), row)
            .await
            .map_err(|e| crate::postgres::describe_error(&e))?;
        Ok(())
    }
}

/// The headers column is jsonb, but a poisoned row may carry headers that are not
/// valid JSON (that can be why it was poisoned): keep them as a JSON string.
#[must_use]
pub fn valid_json_or_string(text: &str) -> String {
    if serde_json::from_str::<Value>(text).is_ok() {
        text.to_owned()
    } else {
        Value::String(text.to_owned()).to_string()
    }
}

/// Runs the writer until `requests` closes, answering each request on `outcomes`.
pub async fn run_writer(
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
    fn headers_that_are_not_json_are_kept_as_a_string() {
        assert_eq!(valid_json_or_string(r#"{"a":1}"#), r#"{"a":1}"#);
        assert_eq!(valid_json_or_string("not json"), r#""not json""#);
    }

    #[test]
    fn statement_targets_the_configured_table() {
        let info = ConnInfo::parse("postgresql://h/db").unwrap();
        let w = PoisonWriter::new(info, "app.dead_letters");
        assert!(w.statement.contains("\"app\".\"dead_letters\""));
    }
}
