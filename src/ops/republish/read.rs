//! Reading the selected rows: in commit order, in one snapshot, each with whether
//! the relay has delivered it already ("reached") or not yet.
//!
//! # Reached, and why the others are refused
//!
//! A row the relay has not delivered yet is on its way: the stream (or the poller)
//! publishes it, and a re-publish now would send it *before* its first delivery,
//! ahead of earlier events of its key still in flight. So a row is published again
//! only when it is known delivered:
//!
//! * `sent_at` is set (the poller, a cutover or a resync marked it), or
//! * it precedes the relay's delivered checkpoint: the lowest `delivered_xmin` of
//!   the slots' saved positions (`crate::outbox::position`). Every outbox row of a
//!   transaction with an xid below it was delivered or poisoned
//!   (`crate::outbox::checkpoint` explains the rule and its wraparound-safe SQL).
//!   The checkpoint trails the stream by about two position saves
//!   (`relay.position_save_interval_ms`), so rows delivered in the last seconds are
//!   refused for that long.
//!
//! The others are refused (counted, the first ids listed) and so is every later row
//! of their key (topic and record key) in this run: a key's re-published events
//! stay in commit order with nothing of the key missing before them.
//!
//! Rows with a `poison_outbox` row (of this outbox) are not read, only counted:
//! they go through `replay`, which marks them.
//!
//! A position saved on another cluster (a logical copy of the tables carried it) is
//! not used: its xids say nothing here. A checkpoint ahead of this cluster's xid
//! horizon covers nothing either (`checkpoint::precedes_sql`).
//!
//! # One snapshot
//!
//! The delivered checkpoint is read first; the count and the rows then in one
//! `REPEATABLE READ READ ONLY` transaction, through a cursor one window at a time
//! (bounded memory). A checkpoint read before the snapshot is an older bound, so
//! the rule stays safe. Like a cutover's backlog, the open transaction holds back
//! vacuum's horizon while the run lasts.
//!
//! # Order
//!
//! `created_at`, then id (`order`): the backlog's commit timestamps would put a
//! row at the time it was marked `sent_at`.

use tokio_postgres::{Client, Portal, Row, Transaction};

use crate::config::{Config, quote_ident, quote_qualified};
use crate::error::{Error, Result};
use crate::outbox::OutboxRow;
use crate::outbox::checkpoint::precedes_sql;
use crate::outbox::position::PositionTable;
use crate::poller::{
    CREATED_AT_FIELD, ID_FIELD, Layout, Polled, has_poison_row, pg_error, read_row_before,
    select_list,
};

use super::args::Filter;

/// One selected row, as read.
#[derive(Debug)]
pub(super) struct SelectedRow {
    pub(super) polled: Polled,
    pub(super) row: OutboxRow,
    /// The relay has delivered it (see the module doc).
    pub(super) reached: bool,
}

/// The statements of one run (parameter `$1` is the delivered checkpoint's xmin,
/// NULL when there is none; the filter's follow).
pub(super) struct Statements {
    count: String,
    rows: String,
}

impl Statements {
    pub(super) fn new(config: &Config, layout: &Layout, filter: &Filter) -> Statements {
        let outbox = &config.outbox;
        let table = quote_qualified(&outbox.table);
        // The layout always has an id column.
        let id = format!("o.{}", quote_ident(layout.column(ID_FIELD).unwrap_or("id")));
        let poisoned = has_poison_row(outbox, layout);
        let sent = if layout.poller_columns {
            "o.sent_at IS NOT NULL OR "
        } else {
            ""
        };
        let reached = format!("({sent}COALESCE({}, false))", precedes_sql("o", 1));
        let selected = format!("FROM {table} o WHERE ({})", filter.sql);
        Statements {
            count: format!(
                "SELECT count(*) FILTER (WHERE NOT poisoned),
                        count(*) FILTER (WHERE NOT poisoned AND reached),
                        count(*) FILTER (WHERE poisoned)
                 FROM (SELECT {poisoned} AS poisoned, {reached} AS reached {selected}) s"
            ),
            rows: format!(
                "SELECT {}, {reached} {selected} AND NOT {poisoned} {}",
                select_list(outbox, layout),
                order(layout, &id)
            ),
        }
    }
}

/// The order rows are read in: `created_at`, then id. Not the backlog's commit
/// timestamps: a row the poller, a cutover or a resync marked `sent_at` has the
/// commit time of its mark, not of its insert. A table without `created_at` is read
/// in id order.
fn order(layout: &Layout, id: &str) -> String {
    match layout.column(CREATED_AT_FIELD) {
        Some(created_at) => format!("ORDER BY o.{}, {id}", quote_ident(created_at)),
        None => format!("ORDER BY {id}"),
    }
}

/// The lowest delivered checkpoint of the relay's slots (every shard's): `None`
/// when one of them has none yet, when the position table does not exist, or when a
/// position was saved on another cluster (a logical copy of the tables brought it;
/// its xids say nothing here).
pub(super) async fn delivered_xmin(client: &Client, config: &Config) -> Result<Option<i64>> {
    if !PositionTable::new(config)?.exists(client).await? {
        return Ok(None);
    }
    let Some(system) = system_identifier(client).await else {
        return Ok(None);
    };
    let mut lowest: Option<i64> = None;
    for slot in config.postgres.all_slot_names() {
        let position = PositionTable::for_slot(config, slot.clone())?
            .load(client)
            .await?;
        let Some(position) = position else {
            return Ok(None);
        };
        if position.history.system_identifier != system {
            tracing::warn!(%slot, saved_on = position.history.system_identifier, here = system,
                "the relay's position was saved on another cluster: only rows marked sent count as delivered");
            return Ok(None);
        }
        let Some(xmin) = position.delivered_xmin else {
            return Ok(None);
        };
        lowest = Some(lowest.map_or(xmin, |l| l.min(xmin)));
    }
    Ok(lowest)
}

/// This cluster's system identifier, `None` when the role may not read it.
async fn system_identifier(client: &Client) -> Option<u64> {
    let row = client
        .query_one(
            "SELECT system_identifier::text FROM pg_control_system()",
            &[],
        )
        .await;
    match row.map(|r| r.try_get::<_, String>(0)) {
        Ok(Ok(text)) => text.parse().ok(),
        Ok(Err(e)) | Err(e) => {
            tracing::warn!(error = %e, "cannot read the system identifier: only rows marked sent count as delivered");
            None
        }
    }
}

/// The selection's size, before mapping (the topic selector is not applied yet).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Counted {
    /// Rows selected (poisoned ones left out).
    pub(super) rows: u64,
    /// Of those, the rows the relay has delivered.
    pub(super) reached: u64,
    /// Rows of the selection with a poison row (`replay`'s business).
    pub(super) poisoned: u64,
}

/// The rows of one run, read through a cursor.
pub(super) struct Reader<'t> {
    transaction: &'t Transaction<'t>,
    portal: Portal,
    payload_format: crate::outbox::PayloadFormat,
}

/// Parameters: the checkpoint, then the filter's texts.
fn params<'a>(
    xmin: &'a Option<i64>,
    filter: &'a Filter,
) -> Vec<&'a (dyn tokio_postgres::types::ToSql + Sync)> {
    let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![xmin];
    params.extend(
        filter
            .params
            .iter()
            .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync)),
    );
    params
}

impl<'t> Reader<'t> {
    /// Counts the selected rows (all, and those reached) and opens the cursor over
    /// them.
    pub(super) async fn open(
        transaction: &'t Transaction<'t>,
        statements: &Statements,
        layout: &Layout,
        xmin: Option<i64>,
        filter: &Filter,
    ) -> Result<(Reader<'t>, Counted)> {
        let params = params(&xmin, filter);
        let counts = transaction
            .query_one(&statements.count, &params)
            .await
            .map_err(pg_error)?;
        let count = |i: usize| -> Result<u64> {
            let n: i64 = counts.try_get(i).map_err(pg_error)?;
            Ok(u64::try_from(n).unwrap_or(0))
        };
        let counted = Counted {
            rows: count(0)?,
            reached: count(1)?,
            poisoned: count(2)?,
        };
        let portal = transaction
            .bind(&statements.rows, &params)
            .await
            .map_err(pg_error)?;
        Ok((
            Reader {
                transaction,
                portal,
                payload_format: layout.payload_format,
            },
            counted,
        ))
    }

    /// The next window of at most `n` rows (empty at the end).
    pub(super) async fn next(&mut self, n: usize) -> Result<Vec<SelectedRow>> {
        let max = i32::try_from(n).unwrap_or(i32::MAX);
        let rows = self
            .transaction
            .query_portal(&self.portal, max)
            .await
            .map_err(pg_error)?;
        rows.iter().map(|r| self.selected(r)).collect()
    }

    fn selected(&self, row: &Row) -> Result<SelectedRow> {
        let (polled, outbox_row) = read_row_before(row, self.payload_format, 1)?;
        let reached: bool = row.try_get(row.len() - 1).map_err(pg_error)?;
        Ok(SelectedRow {
            polled,
            row: outbox_row,
            reached,
        })
    }
}

/// Starts the run's snapshot.
pub(super) async fn snapshot(client: &mut Client) -> Result<Transaction<'_>> {
    client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .map_err(Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::republish::args::{RepublishArgs, Selection};

    fn config() -> Config {
        Config::from_sources(
            "test",
            "[postgres]\nurl = \"postgresql://h/db\"\n[kafka]\nbrokers = \"k:9092\"\n",
            [],
        )
        .unwrap()
    }

    #[test]
    fn the_rows_statement_reads_the_selection_in_creation_order_with_its_reach() {
        let layout = crate::poller::migrated_layout_for_tests();
        let args = RepublishArgs {
            aggregate_id: Some("a".into()),
            ..RepublishArgs::default()
        };
        let filter = Selection::from_args(&args, chrono::Utc::now())
            .unwrap()
            .filter(&layout, 2)
            .unwrap();
        let s = Statements::new(&config(), &layout, &filter);
        assert!(s.rows.contains("o.sent_at IS NOT NULL OR COALESCE("));
        assert!(s.rows.contains("o.\"aggregate_id\"::text = $2"));
        assert!(
            s.rows
                .contains("p.idempotency_key = COALESCE(o.\"idempotency_key\"::text")
        );
        assert!(s.rows.ends_with("ORDER BY o.\"created_at\", o.\"id\""));
        assert!(
            s.rows
                .contains("AND NOT EXISTS (SELECT 1 FROM \"public\".\"poison_outbox\"")
        );
        assert!(s.count.contains("count(*) FILTER (WHERE poisoned)"));
        let mut no_time = layout.clone();
        no_time.forget_column_for_tests(CREATED_AT_FIELD);
        let by_id = Statements::new(&config(), &no_time, &filter);
        assert!(by_id.rows.ends_with("ORDER BY o.\"id\""));
    }

    #[test]
    fn a_table_without_the_pollers_columns_is_reached_by_the_checkpoint_alone() {
        let mut layout = crate::poller::migrated_layout_for_tests();
        layout.poller_columns = false;
        let filter = Selection::from_args(
            &RepublishArgs {
                all: true,
                ..RepublishArgs::default()
            },
            chrono::Utc::now(),
        )
        .unwrap()
        .filter(&layout, 2)
        .unwrap();
        let s = Statements::new(&config(), &layout, &filter);
        assert!(!s.rows.contains("sent_at"));
        assert!(s.rows.contains("0::int4, NULL::text"));
    }
}
