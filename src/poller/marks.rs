//! Step 4 of the procedure, the marks: what becomes of each row of a published batch,
//! decided without I/O ([`plan_marks`]) and written in the batch's transaction
//! ([`write_marks`]).
//!
//! # Failures
//!
//! * **Permanent** (the record is at fault, [`Publisher::classify`](crate::kafka::Publisher::classify): too large, invalid,
//!   topic refused): `attempts = attempts + 1`, `last_error` set, in the batch's
//!   transaction; the row is tried again by the next poll. When `attempts` reaches
//!   `max_attempts` (default `relay.max_attempts`, 5) the row is copied to
//!   `poison_outbox` in that same transaction, with the same fields, error kind and
//!   attempt count as the CDC relay writes (`lsn` is NULL: the poller has none). A row
//!   the mapper refuses (NULL entity id, bad `headers`, …) can never succeed and is
//!   poisoned on its first attempt, with `attempts` set to `max_attempts`.
//! * **Transient** (broker or network; `QueueFull`, purges): never counted. Deliveries
//!   do not fail while the broker is down — the producer retries forever
//!   (`message.timeout.ms=0`) — so the worker simply waits for the acks with the batch
//!   locked; acked rows of a batch are marked, the others stay as they were and the
//!   worker backs off before polling again. PostgreSQL connection loss rolls the batch
//!   back (re-sent later, not lost) and the worker reconnects with backoff.
//! * **Fatal** (the producer is unusable, a missing table or column): the poller stops
//!   with the process error's exit code.
//!
//! **Poisoned rows keep `sent_at` NULL** — they were never delivered — and are
//! excluded by `attempts < max_attempts`, which is what poisoning sets. Consequences,
//! by design: they stay in the partial index (a few heap checks per poll, which is
//! negligible while poison is rare); *raising* `max_attempts` later makes them eligible
//! again (they are retried; if they fail again, the poison row they have stands: one
//! row per occurrence, and a poller's rows have no LSN to tell two apart); *lowering*
//! it would leave rows with `attempts` between the two limits excluded yet unpoisoned,
//! so at start-up the poller copies every such row without a poison row to
//! `poison_outbox` ([`Poller::poison_exhausted`](super::Poller::poison_exhausted)).
//! Rows are never deleted, by the poller or by poisoning.

use tokio_postgres::Transaction;
use tracing::warn;

use crate::delivery::Failure;
use crate::error::Result;
use crate::poison::{
    Parking, PoisonRow, WriterStatements, insert_parking_in, insert_rows, needs_parking,
};

use super::pg_error::pg_error;
use super::row::{BatchRow, Delivery, RowResult};
use super::sql::Prepared;

/// What one committed batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Rows the poll returned.
    pub fetched: usize,
    /// Rows acked and marked sent.
    pub delivered: usize,
    /// Rows whose `attempts` grew (permanent failures and unmappable rows).
    pub failed: usize,
    /// Rows copied to `poison_outbox`.
    pub poisoned: usize,
    /// Rows left untouched after a transient failure.
    pub transient: usize,
}

/// Marks the rows with these ids (as text) sent unless they are already, outside a
/// batch: the rows an exactly-once backlog committed to Kafka before it could mark
/// them (`cdc::backlog`). Returns how many rows were updated.
pub(crate) async fn mark_unsent_sent(
    client: &impl tokio_postgres::GenericClient,
    sql: &super::Sql,
    ids: &[String],
) -> Result<u64> {
    client
        .execute(sql.mark_sent_if_unsent.as_str(), &[&ids])
        .await
        .map_err(pg_error)
}

/// Step 4 without the commit: marks acked rows sent, records failures and poisons
/// exhausted rows inside `tx` (the poller's batch, or a cutover's marks).
///
/// `holds_keys` (a backlog under `relay.on_poison = "park-key"`): every poisoned row
/// that has a record key parks it, in this transaction (`crate::poison` explains
/// parking). The poller passes `None`: it keeps no per-key state.
pub(crate) async fn write_marks(
    tx: &Transaction<'_>,
    prepared: &Prepared,
    max_attempts: i32,
    rows: &[BatchRow],
    holds_keys: Option<&WriterStatements>,
) -> Result<BatchOutcome> {
    let plan = plan_marks(rows, max_attempts);
    if !plan.sent.is_empty() {
        let updated = tx
            .execute(&prepared.mark_sent, &[&plan.sent])
            .await
            .map_err(pg_error)?;
        if updated != plan.sent.len() as u64 {
            warn!(
                expected = plan.sent.len(),
                updated, "marking sent rows updated an unexpected number of rows"
            );
        }
    }
    if !plan.failed.ids.is_empty() {
        tx.execute(
            &prepared.record_failures,
            &[&plan.failed.ids, &plan.failed.attempts, &plan.failed.errors],
        )
        .await
        .map_err(pg_error)?;
    }
    let mut poisoned = Vec::with_capacity(plan.poison.len());
    for &(index, attempts) in &plan.poison {
        let Some(row) = rows.get(index) else { continue };
        let (fields, error_kind, error) = match &row.result {
            RowResult::Event { event, delivery } => {
                let (kind, message) = match delivery {
                    Delivery::Failed { kind, message, .. } => (*kind, message.as_str()),
                    _ => ("unknown", "delivery failed"),
                };
                (event.poison_fields(), kind, message.to_owned())
            }
            RowResult::Unmappable {
                fields,
                error_kind,
                reason,
            } => ((**fields).clone(), *error_kind, reason.clone()),
        };
        poisoned.push((
            row,
            PoisonRow {
                fields,
                error,
                error_kind: error_kind.to_owned(),
                attempts,
                lsn: None,
                parking: match (&row.result, holds_keys) {
                    (RowResult::Event { .. }, Some(_)) => Parking::HoldsKey,
                    _ => Parking::None,
                },
                ..PoisonRow::default()
            },
        ));
    }
    // One statement for all of the batch's poison rows.
    let batch: Vec<&PoisonRow> = poisoned.iter().map(|(_, poison)| poison).collect();
    match holds_keys {
        Some(statements) if needs_parking(&batch) => {
            insert_parking_in(
                tx,
                statements,
                &prepared.insert_poison,
                &batch,
                prepared.poison_copy_limit,
            )
            .await
            .map_err(pg_error)?;
        }
        _ => {
            insert_rows(
                tx,
                &prepared.insert_poison,
                &batch,
                prepared.poison_copy_limit,
            )
            .await
            .map_err(pg_error)?;
        }
    }
    for (row, poison) in &poisoned {
        warn!(
            outbox_id = %row.polled.id,
            idempotency_key = poison.fields.idempotency_key.as_deref().unwrap_or(""),
            error_kind = %poison.error_kind,
            error = %poison.error,
            attempts = poison.attempts,
            "event poisoned"
        );
    }
    Ok(BatchOutcome {
        fetched: rows.len(),
        delivered: plan.sent.len(),
        failed: plan.failed.ids.len(),
        poisoned: plan.poison.len(),
        transient: plan.transient,
    })
}

/// What [`PublishedBatch::mark`](super::PublishedBatch::mark) writes, decided without I/O.
#[derive(Debug, Default, PartialEq, Eq)]
struct MarkPlan {
    /// Ids of acked rows: `sent_at` is set.
    sent: Vec<String>,
    /// Rows whose `attempts` / `last_error` change.
    failed: FailedRows,
    /// `(row index, attempts recorded in poison_outbox)` of rows to poison.
    poison: Vec<(usize, i32)>,
    /// Rows left as they were (transient failure, or no report).
    transient: usize,
}

/// Parallel arrays for `unnest` in the failure statement.
#[derive(Debug, Default, PartialEq, Eq)]
struct FailedRows {
    ids: Vec<String>,
    attempts: Vec<i32>,
    errors: Vec<String>,
}

fn plan_marks(rows: &[BatchRow], max_attempts: i32) -> MarkPlan {
    let mut plan = MarkPlan::default();
    for (index, row) in rows.iter().enumerate() {
        let tries = row.polled.attempts.saturating_add(1);
        let (recorded, error) = match &row.result {
            RowResult::Event { delivery, .. } => match delivery {
                Delivery::Acked => {
                    plan.sent.push(row.polled.id.clone());
                    continue;
                }
                // A configuration failure reaches here only when it blocks
                // (`Publisher::classify` applied `relay.on_config_error`).
                Delivery::Pending
                | Delivery::Failed {
                    failure: Failure::Transient | Failure::Configuration,
                    ..
                } => {
                    plan.transient += 1;
                    continue;
                }
                Delivery::Failed {
                    failure: Failure::Permanent,
                    kind,
                    message,
                } => (tries, format!("{kind}: {message}")),
            },
            // Retrying cannot help: poison now, and let attempts exclude the row.
            RowResult::Unmappable {
                error_kind, reason, ..
            } => (tries.max(max_attempts), format!("{error_kind}: {reason}")),
        };
        plan.failed.ids.push(row.polled.id.clone());
        plan.failed.attempts.push(recorded);
        plan.failed.errors.push(error);
        if recorded >= max_attempts {
            plan.poison.push((index, tries));
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::super::row::Polled;
    use super::*;
    use crate::config::OutboxConfig;
    use crate::outbox::{OutboxMapper, OutboxRow};
    use bytes::Bytes;

    fn mapper() -> OutboxMapper {
        OutboxMapper::with_template(&OutboxConfig::default(), "events", None).unwrap()
    }

    fn row(id: &str, attempts: i32, aggregate_id: Option<&str>, delivery: Delivery) -> BatchRow {
        let outbox = OutboxRow {
            id: Some(Bytes::copy_from_slice(id.as_bytes())),
            aggregate_id: aggregate_id.map(|a| Bytes::copy_from_slice(a.as_bytes())),
            payload: Some(Bytes::from_static(b"{}")),
            ..OutboxRow::default()
        };
        let result = match mapper().map_row(&outbox, None) {
            Ok(event) => RowResult::Event { event, delivery },
            Err(u) => RowResult::Unmappable {
                fields: Box::new(u.fields),
                error_kind: u.error_kind,
                reason: u.reason,
            },
        };
        BatchRow {
            polled: Polled {
                id: id.to_owned(),
                attempts,
                last_error: None,
            },
            result,
        }
    }

    fn failed(failure: Failure) -> Delivery {
        Delivery::Failed {
            failure,
            kind: "message_size_too_large",
            message: "too big".into(),
        }
    }

    #[test]
    fn marks_acked_counts_permanent_ignores_transient_poisons_at_max() {
        let rows = [
            row("a", 0, Some("k"), Delivery::Acked),
            row("b", 0, Some("k"), failed(Failure::Permanent)),
            row("c", 3, Some("k"), failed(Failure::Permanent)),
            row("d", 4, Some("k"), failed(Failure::Transient)),
            row("e", 0, Some("k"), Delivery::Pending),
            row("f", 4, Some("k"), failed(Failure::Permanent)),
            row("g", 0, Some("k"), Delivery::Acked),
        ];
        let plan = plan_marks(&rows, 5);
        assert_eq!(plan.sent, ["a", "g"]);
        assert_eq!(plan.failed.ids, ["b", "c", "f"]);
        assert_eq!(plan.failed.attempts, [1, 4, 5]);
        assert_eq!(plan.failed.errors[0], "message_size_too_large: too big");
        assert_eq!(plan.poison, [(5, 5)], "only the row reaching max_attempts");
        assert_eq!(plan.transient, 2, "transient failures and missing reports");
    }

    #[test]
    fn unmappable_rows_are_poisoned_at_once_and_excluded() {
        let rows = [row("n", 0, None, Delivery::Pending)];
        assert!(matches!(rows[0].result, RowResult::Unmappable { .. }));
        let plan = plan_marks(&rows, 5);
        assert!(plan.sent.is_empty());
        assert_eq!(plan.failed.ids, ["n"]);
        assert_eq!(
            plan.failed.attempts,
            [5],
            "attempts = max excludes it from polling"
        );
        assert!(plan.failed.errors[0].starts_with("null_key: "));
        assert_eq!(plan.poison, [(0, 1)], "poison row records one real attempt");
        // With max_attempts 1 every permanent failure poisons at once.
        let rows = [row("p", 0, Some("k"), failed(Failure::Permanent))];
        assert_eq!(plan_marks(&rows, 1).poison, [(0, 1)]);
    }
}
