//! The consumer's half of the outbox contract: an inbox that applies each event once.
//!
//! The relay delivers at least once: after a crash, a broker outage or a consumer
//! restart that had not committed its offsets, a consumer sees an event again. The
//! record's `idempotency_key` header names the event, so a consumer that records the
//! keys it has processed *in the same database transaction as the event's effects*
//! applies each event exactly once, however often it is delivered: either the
//! effects and the key commit together, or neither does and the redelivery applies
//! them. ("Idempotent consumer", microservices.io.)
//!
//! [`Inbox`] is that record: a table of `(consumer, idempotency_key)` in the
//! consumer's own database ([`Inbox::ensure_table`]), and [`Inbox::claim`], which
//! inserts the key inside the caller's transaction and says whether the event is
//! new:
//!
//! ```no_run
//! # async fn handle(client: &mut tokio_postgres::Client, key: &str) -> Result<(), tokio_postgres::Error> {
//! use outbox_relay::inbox::Inbox;
//! let inbox = Inbox::new("public.outbox_inbox", "billing-service");
//! let tx = client.transaction().await?;
//! if inbox.claim(&tx, key).await? {
//!     tx.execute("UPDATE accounts SET balance = balance - 10 WHERE id = 1", &[]).await?;
//! }
//! tx.commit().await?; // commit the Kafka offset only after this
//! # Ok(()) }
//! ```
//!
//! Two consumers that claim the same key at once serialise on the primary key: the
//! second waits for the first's transaction and then finds the key taken (or free,
//! when the first rolled back). The `consumer` column lets several services (or
//! several handlers of one service) share one table, each applying the event once.
//!
//! The table grows by one row per event; [`Inbox::prune`] deletes keys older than a
//! retention that must exceed the longest time an event can be redelivered (the
//! topic's retention, or the longest consumer outage that replays from an old
//! offset). `examples/inbox_consumer.rs` is a whole consumer.

use std::time::Duration;

use tokio_postgres::GenericClient;

use crate::config::{TableNameError, qualified_name, quote_ident, quote_qualified};

/// Rows [`Inbox::prune`] deletes per statement, so that it never holds long locks.
const PRUNE_BATCH: i64 = 10_000;

/// Processed idempotency keys of one consumer, in a table of the consumer's database.
#[derive(Debug, Clone)]
pub struct Inbox {
    /// As given (`schema.table` or `table`).
    name: String,
    /// Quoted and schema-qualified.
    table: String,
    consumer: String,
}

impl Inbox {
    /// The inbox of `consumer` in `table` (`schema.table`, or `table` in `public`).
    #[must_use]
    pub fn new(table: &str, consumer: &str) -> Inbox {
        Inbox {
            name: table.to_owned(),
            table: quote_qualified(table),
            consumer: consumer.to_owned(),
        }
    }

    /// Creates the table and its retention index when missing (idempotent).
    ///
    /// # Errors
    ///
    /// A malformed table name, or the server's error.
    pub async fn ensure_table(&self, client: &impl GenericClient) -> Result<(), InboxError> {
        let (schema, name) = qualified_name(&self.name)?;
        let index = quote_ident(&format!("{name}_processed_at_idx"));
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {t} (
                     consumer        text        NOT NULL,
                     idempotency_key text        NOT NULL,
                     processed_at    timestamptz NOT NULL DEFAULT now(),
                     PRIMARY KEY (consumer, idempotency_key));
                 CREATE INDEX IF NOT EXISTS {index} ON {t} (processed_at);",
                t = format_args!("{}.{}", quote_ident(&schema), quote_ident(&name)),
            ))
            .await?;
        Ok(())
    }

    /// Records `idempotency_key` as processed by this consumer inside `tx`, the
    /// transaction that applies the event's effects. `true`: the event is new, apply
    /// it; `false`: it was processed before (a redelivery), skip it. The record
    /// commits or rolls back with `tx`.
    ///
    /// # Errors
    ///
    /// The server's error (the transaction should then be rolled back).
    pub async fn claim(
        &self,
        tx: &impl GenericClient,
        idempotency_key: &str,
    ) -> Result<bool, InboxError> {
        let inserted = tx
            .execute(
                &format!(
                    "INSERT INTO {} (consumer, idempotency_key) VALUES ($1, $2)
                     ON CONFLICT DO NOTHING",
                    self.table
                ),
                &[&self.consumer, &idempotency_key],
            )
            .await?;
        Ok(inserted == 1)
    }

    /// Deletes this consumer's keys processed more than `retention` ago, in batches;
    /// returns how many. Keep `retention` above the longest redelivery window.
    ///
    /// # Errors
    ///
    /// The server's error.
    pub async fn prune(
        &self,
        client: &impl GenericClient,
        retention: Duration,
    ) -> Result<u64, InboxError> {
        let statement = format!(
            "DELETE FROM {t} WHERE (consumer, idempotency_key) IN (
                 SELECT consumer, idempotency_key FROM {t}
                  WHERE consumer = $1 AND processed_at < now() - make_interval(secs => $2)
                  LIMIT $3)",
            t = self.table
        );
        let secs = retention.as_secs_f64();
        let mut total = 0;
        loop {
            let deleted = client
                .execute(&statement, &[&self.consumer, &secs, &PRUNE_BATCH])
                .await?;
            total += deleted;
            if deleted < u64::try_from(PRUNE_BATCH).unwrap_or(u64::MAX) {
                return Ok(total);
            }
        }
    }
}

/// Why an inbox operation failed.
#[derive(Debug, thiserror::Error)]
pub enum InboxError {
    /// The table name is not `schema.table` or `table`.
    #[error(transparent)]
    TableName(#[from] TableNameError),
    /// The server refused a statement (its message and SQLSTATE).
    #[error("{}", crate::postgres::describe_error(.0))]
    Postgres(#[from] tokio_postgres::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_name_is_quoted() {
        let inbox = Inbox::new("app.Inbox", "svc");
        assert_eq!(inbox.table, "\"app\".\"Inbox\"");
        assert_eq!(Inbox::new("inbox", "svc").table, "\"public\".\"inbox\"");
    }
}
