//! One polled row: its bookkeeping columns ([`Polled`]), its record or the reason it
//! has none ([`RowResult`]), and what the broker said ([`Delivery`]). A cutover maps
//! its backlog into the same [`BatchRow`]s, so both write the same marks.
//!
//! # The record is the CDC relay's
//!
//! Columns are selected as `::text`, on a session with the replication connection's
//! settings ([`SESSION_OPTIONS`](crate::postgres::replication::SESSION_OPTIONS): `DateStyle=ISO`, `TimeZone=UTC`,
//! `extra_float_digits=3`), so the mapper sees the very bytes `pgoutput` would send
//! and [`OutboxMapper::map_row`] builds the same record as the CDC path: key, topic,
//! payload bytes, headers, CreateTime. The one difference is the `source_lsn` header,
//! which only a WAL reader can know. Which columns exist is the layout's business
//! (`layout.rs`).

use bytes::Bytes;
use tokio_postgres::Row;

use crate::delivery::Failure;
use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::outbox::{OutboxEvent, OutboxMapper, OutboxRow, PayloadFormat, PoisonFields};

use super::layout::{FIELDS, ID};
use super::pg_error::pg_error;

/// One polled row: what the marks need, and what became of it.
#[derive(Debug)]
pub(crate) struct BatchRow {
    pub(crate) polled: Polled,
    pub(crate) result: RowResult,
}

impl BatchRow {
    /// Maps `row` to its record (with `source_lsn` when given), or keeps it as
    /// unmappable; nothing is delivered yet.
    pub(crate) fn map(
        mapper: &OutboxMapper,
        polled: Polled,
        row: &OutboxRow,
        source_lsn: Option<Lsn>,
    ) -> BatchRow {
        let result = match mapper.map_row(row, source_lsn) {
            Ok(event) => RowResult::Event {
                event,
                delivery: Delivery::Pending,
            },
            Err(unmappable) => RowResult::Unmappable {
                fields: Box::new(unmappable.fields),
                error_kind: unmappable.error_kind,
                reason: unmappable.reason,
            },
        };
        BatchRow { polled, result }
    }
}

/// The bookkeeping columns of a polled row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Polled {
    /// The `id` column as text, to address the row in the marking statements.
    pub(crate) id: String,
    /// `attempts` before this batch.
    pub(crate) attempts: i32,
    pub(crate) last_error: Option<String>,
}

#[derive(Debug)]
// The large variant is the common one (one per row); boxing it would cost an
// allocation per event to save memory on the rare unmappable row.
#[allow(clippy::large_enum_variant)]
pub(crate) enum RowResult {
    Event {
        event: OutboxEvent,
        delivery: Delivery,
    },
    /// The mapper refused the row; it is poisoned without being sent.
    Unmappable {
        fields: Box<PoisonFields>,
        error_kind: &'static str,
        reason: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Delivery {
    Pending,
    Acked,
    Failed {
        failure: Failure,
        kind: &'static str,
        message: String,
    },
}

/// Where a backlog row stands in commit order, as near as its table can tell
/// (`Sql::backlog`'s `ORDER BY`): its transaction's commit time when
/// `track_commit_timestamp` is on (none first), then `created_at` (microseconds
/// since the Unix epoch). Comparable between outbox tables: a backlog of several
/// merges their rows by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct CommitRank {
    pub(crate) committed_us: Option<i64>,
    pub(crate) created_us: i64,
}

/// One row of a backlog statement (`Sql::backlog`, `Sql::undelivered`): the row, and
/// its rank in the two last columns.
pub(crate) fn read_ranked_row(
    row: &Row,
    payload_format: PayloadFormat,
) -> Result<(Polled, OutboxRow, CommitRank)> {
    let rank_at = row.len().saturating_sub(2);
    let (polled, outbox) = read_columns(row, payload_format, rank_at)?;
    let rank = CommitRank {
        committed_us: row.try_get(rank_at).map_err(pg_error)?,
        // SQL orders a NULL `created_at` last.
        created_us: row
            .try_get::<_, Option<i64>>(rank_at + 1)
            .map_err(pg_error)?
            .unwrap_or(i64::MAX),
    };
    Ok((polled, outbox, rank))
}

/// One row of the batch (or sweep) query.
pub(crate) fn read_row(row: &Row, payload_format: PayloadFormat) -> Result<(Polled, OutboxRow)> {
    read_columns(row, payload_format, row.len())
}

/// A row of [`crate::poller::select_list`] followed by `trailing` columns of the
/// caller's own (read by the caller).
pub(crate) fn read_row_before(
    row: &Row,
    payload_format: PayloadFormat,
    trailing: usize,
) -> Result<(Polled, OutboxRow)> {
    read_columns(row, payload_format, row.len().saturating_sub(trailing))
}

/// A row whose columns before `end` are the poller's select list.
fn read_columns(
    row: &Row,
    payload_format: PayloadFormat,
    end: usize,
) -> Result<(Polled, OutboxRow)> {
    let text = |i: usize| -> Result<Option<Bytes>> {
        let value: Option<&str> = row.try_get(i).map_err(pg_error)?;
        Ok(value.map(|v| Bytes::copy_from_slice(v.as_bytes())))
    };
    let id = text(ID)?;
    let outbox = OutboxRow {
        id: id.clone(),
        idempotency_key: text(1)?,
        aggregate_type: text(2)?,
        aggregate_id: text(3)?,
        event_type: text(4)?,
        topic: text(5)?,
        headers: text(6)?,
        payload: text(7)?,
        payload_format,
        created_at: text(8)?,
        // The `outbox.additional_placement` columns follow the bookkeeping ones.
        extra: (FIELDS + 2..end).map(text).collect::<Result<Vec<_>>>()?,
    };
    // The id is the primary key; NULL would be a broken table.
    let id = id.ok_or(Error::NullOutboxId)?;
    let polled = Polled {
        id: String::from_utf8_lossy(&id).into_owned(),
        attempts: row.try_get(FIELDS).map_err(pg_error)?,
        last_error: row.try_get(FIELDS + 1).map_err(pg_error)?,
    };
    Ok((polled, outbox))
}
