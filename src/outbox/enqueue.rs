//! Writer helpers: put an event into the outbox *inside the caller's transaction*.
//!
//! The transactional outbox only works when the business change and its event
//! commit or roll back together. Both helpers make that the easy path:
//!
//! * in SQL, `outbox_enqueue(aggregate_type, aggregate_id, event_type, payload
//!   [, headers [, idempotency_key]])`, installed by `outbox-relay migrate`
//!   (`migrations/0004_enqueue.sql`, with the configured table and column names);
//! * in Rust, [`enqueue`] (or [`Enqueuer`] for an outbox outside `public`), which
//!   takes a [`tokio_postgres::Transaction`] — not a client — so the insert cannot
//!   silently run in a transaction of its own.
//!
//! * for the message outbox, `outbox_emit(…)` with the same arguments
//!   (`migrations/0011_message_outbox.sql`) and [`Enqueuer::messages`]: the event
//!   goes to the WAL only, never into a table (`crate::outbox::message`).
//!
//! Both return the event's idempotency key: the one given, else a UUID v7 made by
//! `outbox_relay_uuid_v7()` (RFC 9562: 48-bit Unix milliseconds then random bits,
//! built from `clock_timestamp()` and `gen_random_uuid()` since PostgreSQL before 18
//! has no `uuidv7()`). Time-ordered keys keep the unique index compact. The relay
//! sends the key as the `idempotency_key` header of the Kafka record.

use tokio_postgres::Transaction;

use crate::config::{OutboxConfig, quote_ident};

/// An event to enqueue.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    /// E.g. `order`; selects the topic through `kafka.topic_template`.
    pub aggregate_type: String,
    /// The entity id: the Kafka key, so one entity's events stay in order.
    pub aggregate_id: String,
    /// E.g. `order_created`.
    pub event_type: String,
    /// The record value (sent as PostgreSQL's text form of the jsonb).
    pub payload: serde_json::Value,
    /// Extra Kafka headers, a JSON object of strings.
    pub headers: Option<serde_json::Value>,
    /// A key chosen by the writer; `None` lets the database make a UUID v7.
    pub idempotency_key: Option<String>,
}

impl Event {
    /// An event with no extra headers and a generated idempotency key.
    pub fn new(
        aggregate_type: impl Into<String>,
        aggregate_id: impl Into<String>,
        event_type: impl Into<String>,
        payload: serde_json::Value,
    ) -> Event {
        Event {
            aggregate_type: aggregate_type.into(),
            aggregate_id: aggregate_id.into(),
            event_type: event_type.into(),
            payload,
            headers: None,
            idempotency_key: None,
        }
    }

    /// Sets the idempotency key.
    #[must_use]
    pub fn with_idempotency_key(mut self, key: impl Into<String>) -> Event {
        self.idempotency_key = Some(key.into());
        self
    }

    /// Sets the extra headers (a JSON object).
    #[must_use]
    pub fn with_headers(mut self, headers: serde_json::Value) -> Event {
        self.headers = Some(headers);
        self
    }
}

/// Why an event could not be enqueued.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnqueueError {
    /// The key given already exists (SQLSTATE 23505): this event was enqueued before.
    #[error("idempotency key {0:?} was already enqueued")]
    DuplicateKey(String),
    /// `outbox_enqueue` / `outbox_emit` (or its schema) does not exist: run
    /// `outbox-relay migrate`.
    #[error(
        "the writer function is missing: run `outbox-relay migrate` ({})",
        crate::postgres::describe_error(.0)
    )]
    NotInstalled(#[source] tokio_postgres::Error),
    /// Any other failure of the statement.
    #[error("enqueue failed: {0}")]
    Postgres(#[from] tokio_postgres::Error),
}

/// Calls `outbox_enqueue` in the outbox's schema.
#[derive(Debug, Clone)]
pub struct Enqueuer {
    sql: String,
}

impl Default for Enqueuer {
    fn default() -> Self {
        Enqueuer::for_schema("public")
    }
}

impl Enqueuer {
    /// For the outbox of this config (the function lives in the table's schema).
    #[must_use]
    pub fn new(outbox: &OutboxConfig) -> Enqueuer {
        let schema = crate::config::qualified_name(&outbox.table)
            .map_or_else(|_| "public".to_owned(), |(schema, _)| schema);
        Enqueuer::for_schema(&schema)
    }

    /// For the message outbox of this config: `outbox_emit`, which writes the
    /// event to the WAL only, as a transactional logical decoding message
    /// (`crate::outbox::message`). Same arguments, same commit-or-roll-back rule; a
    /// key given twice is not refused.
    #[must_use]
    pub fn messages(outbox: &OutboxConfig) -> Enqueuer {
        let schema = crate::config::qualified_name(&outbox.table)
            .map_or_else(|_| "public".to_owned(), |(schema, _)| schema);
        Enqueuer::calling(&schema, "outbox_emit")
    }

    fn for_schema(schema: &str) -> Enqueuer {
        Enqueuer::calling(schema, "outbox_enqueue")
    }

    fn calling(schema: &str, function: &str) -> Enqueuer {
        Enqueuer {
            sql: format!(
                "SELECT {}.{function}($1, $2, $3, $4::text::jsonb, $5::text::jsonb, $6)",
                quote_ident(schema)
            ),
        }
    }

    /// The statement it runs.
    #[must_use]
    pub fn sql(&self) -> &str {
        &self.sql
    }

    /// Inserts `event` into the outbox within `tx`; returns its idempotency key.
    /// Nothing is visible to the relay until `tx` commits; a rollback leaves no event.
    ///
    /// # Errors
    ///
    /// [`EnqueueError`]; a failed statement also aborts `tx`, as any other would.
    pub async fn enqueue(
        &self,
        tx: &Transaction<'_>,
        event: &Event,
    ) -> Result<String, EnqueueError> {
        let payload = event.payload.to_string();
        let headers = event.headers.as_ref().map(ToString::to_string);
        let row = tx
            .query_one(
                &self.sql,
                &[
                    &event.aggregate_type,
                    &event.aggregate_id,
                    &event.event_type,
                    &payload,
                    &headers,
                    &event.idempotency_key,
                ],
            )
            .await
            .map_err(|e| classify(e, event))?;
        Ok(row.try_get(0)?)
    }
}

/// Inserts `event` into `public.outbox` within `tx` (see [`Enqueuer`] for another
/// schema); returns its idempotency key.
///
/// ```no_run
/// # async fn example(client: &mut tokio_postgres::Client) -> Result<(), Box<dyn std::error::Error>> {
/// use outbox_relay::outbox::enqueue::{Event, enqueue};
/// let tx = client.transaction().await?;
/// tx.execute("UPDATE orders SET status = 'paid' WHERE id = $1", &[&42_i64]).await?;
/// let key = enqueue(&tx, &Event::new("order", "42", "order_paid", serde_json::json!({"id": 42}))).await?;
/// tx.commit().await?;
/// # let _ = key; Ok(()) }
/// ```
///
/// # Errors
///
/// As [`Enqueuer::enqueue`].
pub async fn enqueue(tx: &Transaction<'_>, event: &Event) -> Result<String, EnqueueError> {
    Enqueuer::default().enqueue(tx, event).await
}

fn classify(e: tokio_postgres::Error, event: &Event) -> EnqueueError {
    use tokio_postgres::error::SqlState;
    match e.code() {
        Some(c) if *c == SqlState::UNIQUE_VIOLATION => {
            EnqueueError::DuplicateKey(event.idempotency_key.clone().unwrap_or_default())
        }
        Some(c) if *c == SqlState::UNDEFINED_FUNCTION || *c == SqlState::INVALID_SCHEMA_NAME => {
            EnqueueError::NotInstalled(e)
        }
        _ => EnqueueError::Postgres(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_the_function_of_the_outbox_schema() {
        assert_eq!(
            Enqueuer::default().sql(),
            "SELECT \"public\".outbox_enqueue($1, $2, $3, $4::text::jsonb, $5::text::jsonb, $6)"
        );
        let outbox = OutboxConfig {
            table: "app.events".into(),
            ..OutboxConfig::default()
        };
        assert!(
            Enqueuer::new(&outbox)
                .sql()
                .starts_with("SELECT \"app\".outbox_enqueue(")
        );
        assert!(
            Enqueuer::messages(&outbox)
                .sql()
                .starts_with("SELECT \"app\".outbox_emit($1, $2, $3, $4::text::jsonb")
        );
    }

    #[test]
    fn builder_sets_key_and_headers() {
        let e = Event::new("order", "1", "created", serde_json::json!({"a": 1}))
            .with_idempotency_key("k1")
            .with_headers(serde_json::json!({"trace": "t"}));
        assert_eq!(e.idempotency_key.as_deref(), Some("k1"));
        assert_eq!(e.headers.unwrap()["trace"], "t");
    }
}
