//! The `poison_outbox` table's contract: what one row holds and the one statement
//! that writes it.
//!
//! Three writers share this contract and must agree byte for byte, because `replay`
//! and operators read the rows back whoever wrote them: the CDC relay's writer task
//! (`writer.rs`), the poller (inside its batch transaction) and a cutover (inside its
//! marking transaction). So the row type, the `INSERT` and the value conversions live
//! here, apart from any connection handling.
//!
//! The insert is idempotent per `(idempotency_key, lsn)`: after a crash between the
//! poison commit and the slot confirmation, the relay sees the event again, fails it
//! again, and must not record it twice. Rows are never deleted (a trigger refuses it).

use serde_json::{Map, Value};

use crate::config::quote_qualified;
use crate::lsn::Lsn;
use crate::outbox::PoisonFields;

/// One `poison_outbox` row: the outbox row as it was, and why it failed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PoisonRow {
    /// The original data (see [`PoisonFields`]).
    pub(crate) fields: PoisonFields,
    pub(crate) error: String,
    pub(crate) error_kind: String,
    pub(crate) attempts: i32,
    /// Commit LSN of the transaction that inserted the row (`None` outside CDC).
    pub(crate) lsn: Option<Lsn>,
}

/// The `INSERT` of one [`PoisonRow`] into `table` (parameters: see [`insert_row`]).
/// It inserts nothing when a row with the same idempotency key and LSN exists: the
/// relay may poison an event again after a crash between the poison commit and the
/// slot confirmation, and must not record it twice.
#[must_use]
pub(crate) fn insert_statement(table: &str) -> String {
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
pub(crate) async fn insert_row<C, T>(
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

/// The headers column is jsonb, but a poisoned row may carry headers that are not
/// valid JSON (that can be why it was poisoned): keep them as a JSON string.
#[must_use]
pub(crate) fn valid_json_or_string(text: &str) -> String {
    if serde_json::from_str::<Value>(text).is_ok() {
        text.to_owned()
    } else {
        Value::String(text.to_owned()).to_string()
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
}
