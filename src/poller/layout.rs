//! The outbox table as the poller finds it: which configured columns exist, the id's
//! SQL type, and how the payload is stored.
//!
//! The poller reads the configured `[outbox.columns]` names; missing optional columns
//! (`topic`, `headers`, `idempotency_key`, …) are read as NULL, as the CDC mapper
//! does. Missing required columns, missing poller columns (`sent_at`, `attempts`,
//! `last_error`) and missing tables are prerequisite errors (exit code 3: run
//! `outbox-relay migrate`), found at start-up rather than on the first poll.

use tokio_postgres::Client;

use crate::config::{OutboxConfig, quote_qualified};
use crate::error::Result;
use crate::outbox::PayloadFormat;
use crate::postgres::prerequisite::{POISON_TABLE_NEWEST_COLUMN, Prerequisite};

use super::pg_error::pg_error;

/// Columns of the outbox table as the poller reads them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout {
    /// The configured column of each [`OutboxRow`](crate::outbox::OutboxRow) field (in [`Columns::by_key`](crate::config::Columns::by_key)
    /// order), `None` when the table has no such column (read as NULL).
    pub(super) fields: [Option<String>; FIELDS],
    /// SQL type of the id column (`format_type`), for `text[]::type[]` casts.
    pub(super) id_type: String,
    pub(crate) payload_format: PayloadFormat,
    /// The table has the poller's own columns (`sent_at`, `attempts`,
    /// `last_error`): always for the poller; a table read only to publish again
    /// (`republish`, which also reads tables adopted from Debezium) may lack them.
    pub(crate) poller_columns: bool,
}

pub(super) const FIELDS: usize = 9;
pub(crate) const ID: usize = 0;
pub(super) const IDEMPOTENCY_KEY: usize = 1;
pub(crate) const AGGREGATE_TYPE: usize = 2;
pub(crate) const AGGREGATE_ID: usize = 3;
pub(crate) const EVENT_TYPE: usize = 4;
const PAYLOAD: usize = 7;
pub(crate) const CREATED_AT: usize = 8;

/// What the outbox table is read for: the poller and a backlog mark rows, so they
/// need the poller's columns; reading rows to publish them again does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reading {
    ToMark,
    Only,
}

impl Layout {
    /// The table's column for field `field` (`ID`, `AGGREGATE_TYPE`, …), when it has one.
    pub(crate) fn column(&self, field: usize) -> Option<&str> {
        self.fields.get(field).and_then(|c| c.as_deref())
    }

    /// SQL type of the id column (`format_type`).
    pub(crate) fn id_type(&self) -> &str {
        &self.id_type
    }
}

/// Fields without which the poller cannot work (or every row would be poisoned).
const REQUIRED_FIELDS: [&str; 4] = ["id", "aggregate_id", "payload", "created_at"];
/// The poller's own columns (migrations/0001_outbox.sql).
const POLLER_COLUMNS: [&str; 3] = ["sent_at", "attempts", "last_error"];

/// A column of the outbox table: name, `format_type` and `pg_type.typname`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct TableColumn {
    pub(super) name: String,
    pub(super) sql_type: String,
    pub(super) type_name: String,
}

#[cfg(test)]
pub(super) fn resolve_layout(
    table: &str,
    outbox: &OutboxConfig,
    columns: &[TableColumn],
) -> std::result::Result<Layout, Prerequisite> {
    resolve_layout_for(table, outbox, columns, Reading::ToMark)
}

fn resolve_layout_for(
    table: &str,
    outbox: &OutboxConfig,
    columns: &[TableColumn],
    reading: Reading,
) -> std::result::Result<Layout, Prerequisite> {
    let find = |name: &str| columns.iter().find(|c| c.name == name);
    let mut missing = Vec::new();
    let mut fields: [Option<String>; FIELDS] = Default::default();
    for (slot, (key, name)) in fields.iter_mut().zip(outbox.columns.by_key()) {
        match find(name) {
            Some(column) => *slot = Some(column.name.clone()),
            // Read only to publish again, rows without a creation time are ordered
            // by id (Debezium's layout has none).
            None if reading == Reading::Only && key == "created_at" => {}
            None if REQUIRED_FIELDS.contains(&key) && name.is_empty() => {
                missing.push(format!("for outbox.columns.{key} (configured as none)"));
            }
            None if REQUIRED_FIELDS.contains(&key) => {
                missing.push(format!("{name:?} (outbox.columns.{key})"));
            }
            None => {}
        }
    }
    let poller_columns = POLLER_COLUMNS.iter().all(|name| find(name).is_some());
    if reading == Reading::ToMark {
        for name in POLLER_COLUMNS {
            if find(name).is_none() {
                missing.push(format!("{name:?}"));
            }
        }
    }
    for placement in outbox.placements().unwrap_or_default() {
        if find(&placement.column).is_none() {
            missing.push(format!(
                "{:?} (outbox.additional_placement)",
                placement.column
            ));
        }
    }
    if !missing.is_empty() {
        return Err(Prerequisite::PollerColumnsMissing {
            table: table.to_owned(),
            columns: missing.join(", "),
        });
    }
    let column = |field: usize| fields[field].as_deref().and_then(find);
    let id_type = column(ID).map(|c| c.sql_type.clone()).unwrap_or_default();
    let payload_format = match column(PAYLOAD).map(|c| c.type_name.as_str()) {
        Some("json" | "jsonb") => PayloadFormat::Json,
        Some("bytea") => PayloadFormat::ByteaText,
        _ => PayloadFormat::Text,
    };
    Ok(Layout {
        fields,
        id_type,
        payload_format,
        poller_columns,
    })
}

/// Reads the outbox table's columns; a missing table or column is a prerequisite
/// error (exit code 3).
pub(crate) async fn inspect_tables(client: &Client, outbox: &OutboxConfig) -> Result<Layout> {
    inspect_tables_for(client, outbox, Reading::ToMark).await
}

/// [`inspect_tables`], for a reader that may not need the poller's columns.
pub(crate) async fn inspect_tables_for(
    client: &Client,
    outbox: &OutboxConfig,
    reading: Reading,
) -> Result<Layout> {
    let table = quote_qualified(&outbox.table);
    let poison = quote_qualified(&outbox.poison_table);
    let exists = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL,
                    EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($2)
                            AND attname = $3 AND NOT attisdropped)",
            &[&table, &poison, &POISON_TABLE_NEWEST_COLUMN],
        )
        .await
        .map_err(pg_error)?;
    for (i, name) in [&outbox.table, &outbox.poison_table]
        .into_iter()
        .enumerate()
    {
        if !exists.try_get::<_, bool>(i).map_err(pg_error)? {
            let table = name.clone();
            return Err(if i == 0 {
                Prerequisite::OutboxTableMissing { table }
            } else {
                Prerequisite::PoisonTableMissing { table }
            }
            .into());
        }
    }
    if !exists.try_get::<_, bool>(2).map_err(pg_error)? {
        return Err(Prerequisite::PoisonTableOutdated {
            table: outbox.poison_table.clone(),
            column: POISON_TABLE_NEWEST_COLUMN.to_owned(),
        }
        .into());
    }
    let rows = client
        .query(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod), t.typname::text
             FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
            &[&table],
        )
        .await
        .map_err(pg_error)?;
    let columns = rows
        .iter()
        .map(|r| {
            Ok(TableColumn {
                name: r.try_get(0)?,
                sql_type: r.try_get(1)?,
                type_name: r.try_get(2)?,
            })
        })
        .collect::<std::result::Result<Vec<_>, tokio_postgres::Error>>()
        .map_err(pg_error)?;
    Ok(resolve_layout_for(
        &outbox.table,
        outbox,
        &columns,
        reading,
    )?)
}

/// The layout of the table `migrate` creates (tests of the statements built on it).
#[cfg(test)]
pub(crate) fn migrated_layout_for_tests() -> Layout {
    let layout = resolve_layout(
        "outbox",
        &OutboxConfig::default(),
        &tests::migrated_columns(),
    );
    layout.expect("the migrated table has every column")
}

#[cfg(test)]
impl Layout {
    /// As if the table had no column for `field`.
    pub(crate) fn forget_column_for_tests(&mut self, field: usize) {
        self.fields[field] = None;
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    pub(crate) fn column(name: &str, sql_type: &str, type_name: &str) -> TableColumn {
        TableColumn {
            name: name.into(),
            sql_type: sql_type.into(),
            type_name: type_name.into(),
        }
    }

    /// Replaces the column named `name`.
    pub(crate) fn set(columns: &mut [TableColumn], name: &str, new: TableColumn) {
        let c = columns.iter_mut().find(|c| c.name == name).unwrap();
        *c = new;
    }

    pub(crate) fn migrated_columns() -> Vec<TableColumn> {
        vec![
            column("id", "uuid", "uuid"),
            column("idempotency_key", "text", "text"),
            column("aggregate_type", "text", "text"),
            column("aggregate_id", "text", "text"),
            column("event_type", "text", "text"),
            column("topic", "text", "text"),
            column("headers", "jsonb", "jsonb"),
            column("payload", "jsonb", "jsonb"),
            column("created_at", "timestamp with time zone", "timestamptz"),
            column("sent_at", "timestamp with time zone", "timestamptz"),
            column("attempts", "integer", "int4"),
            column("last_error", "text", "text"),
        ]
    }

    #[test]
    fn a_table_read_only_to_publish_again_needs_no_poller_columns() {
        let columns: Vec<TableColumn> = migrated_columns()
            .into_iter()
            .filter(|c| !POLLER_COLUMNS.contains(&c.name.as_str()))
            .collect();
        let outbox = OutboxConfig::default();
        assert!(resolve_layout("outbox", &outbox, &columns).is_err());
        let layout = resolve_layout_for("outbox", &outbox, &columns, Reading::Only).unwrap();
        assert!(!layout.poller_columns);
        assert_eq!(layout.column(AGGREGATE_ID), Some("aggregate_id"));
        assert!(
            resolve_layout("outbox", &outbox, &migrated_columns())
                .unwrap()
                .poller_columns
        );
    }

    #[test]
    fn layout_of_the_migrated_table() {
        let layout =
            resolve_layout("outbox", &OutboxConfig::default(), &migrated_columns()).unwrap();
        assert!(layout.fields.iter().all(Option::is_some));
        assert_eq!(layout.id_type, "uuid");
        assert_eq!(layout.payload_format, PayloadFormat::Json);
    }

    #[test]
    fn optional_columns_may_be_missing_required_ones_may_not() {
        let mut columns = migrated_columns();
        columns.retain(|c| !matches!(c.name.as_str(), "topic" | "headers" | "idempotency_key"));
        set(&mut columns, "payload", column("payload", "bytea", "bytea"));
        let layout = resolve_layout("outbox", &OutboxConfig::default(), &columns).unwrap();
        assert_eq!(layout.fields[5], None);
        assert_eq!(layout.payload_format, PayloadFormat::ByteaText);

        let mut columns = migrated_columns();
        columns.retain(|c| !matches!(c.name.as_str(), "aggregate_id" | "sent_at"));
        let err = resolve_layout("app.events", &OutboxConfig::default(), &columns).unwrap_err();
        assert_eq!(
            err,
            Prerequisite::PollerColumnsMissing {
                table: "app.events".into(),
                columns: "\"aggregate_id\" (outbox.columns.aggregate_id), \"sent_at\"".into(),
            }
        );
    }
}
