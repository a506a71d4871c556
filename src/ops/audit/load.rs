//! The PostgreSQL side of the audit: the outbox rows of the range and the
//! `poison_outbox` rows, read into the [`Ledger`].
//!
//! # Reading consistently
//!
//! The rows (and the poison rows) are read in one `REPEATABLE READ READ ONLY`
//! transaction, before the topics are read ([`super::topic`]), so every event
//! counted as expected had been committed — and, unless the relay is behind, relayed
//! — when the topics are read. A row committed moments before the audit may not be
//! relayed yet and then shows as lost: audit a range that ends a little in the past
//! (`--until 1m`). The snapshot is held only while the rows are read
//! (`ORDER BY created_at, id`, which PostgreSQL sorts, on disk for large ranges), not
//! while the topics are. A role's `statement_timeout` is lifted for the scan.
//!
//! # Bounded memory
//!
//! The ledger is sized exactly from a `count(*)` of the range. Rows are fetched from
//! a portal in batches of [`BATCH_ROWS`], and only the columns the mapper needs,
//! as text (the payload only as "is it NULL"); the poison table is streamed the same
//! way without being stored. No row text is kept: when events are lost, the range is
//! scanned a second time (without sorting) to print up to [`LOST_SAMPLE`] of their
//! idempotency keys.
//!
//! Each row goes through the relay's own mapper, so the audit knows the topics the
//! rows map to (the default topics to read) and how many rows the relay would
//! poison as unmappable.

use std::collections::{BTreeSet, HashMap};

use bytes::Bytes;
use chrono::{DateTime, Utc};
use tokio_postgres::{Client, IsolationLevel, Row};

use super::args::{Range, rfc3339, usage};
use super::ledger::Ledger;
use crate::config::{Config, quote_ident, quote_qualified};
use crate::error::Error;
use crate::ops::meter::{self, Meter};
use crate::outbox::message;
use crate::outbox::{OutboxMapper, OutboxRow, PayloadFormat};
use crate::postgres::prerequisite::Prerequisite;

/// Rows fetched per round trip from the outbox and poison portals.
pub(crate) const BATCH_ROWS: i32 = 10_000;
/// How many lost idempotency keys the report lists.
pub(crate) const LOST_SAMPLE: usize = 20;

/// The outbox columns present in the table (configured name, else the Debezium
/// alias the mapper also accepts).
#[derive(Debug, Clone, Default)]
pub(super) struct Columns {
    /// Name and SQL type (for casting `--from-id`/`--to-id`).
    id: Option<(String, String)>,
    idempotency_key: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    event_type: Option<String>,
    topic: Option<String>,
    headers: Option<String>,
    payload: Option<String>,
    created_at: Option<String>,
}

impl Columns {
    /// The range as SQL-ish text, with this table's column names.
    pub(super) fn describe(&self, range: &Range) -> String {
        let created = self.created_at.as_deref().unwrap_or("created_at");
        let id = self.id.as_ref().map_or("id", |(n, _)| n.as_str());
        let mut parts = Vec::new();
        if let Some(s) = range.since {
            parts.push(format!("{created} >= {}", rfc3339(s)));
        }
        if let Some(u) = range.until {
            parts.push(format!("{created} < {}", rfc3339(u)));
        }
        if let Some(f) = &range.from_id {
            parts.push(format!("{id} >= {f}"));
        }
        if let Some(t) = &range.to_id {
            parts.push(format!("{id} <= {t}"));
        }
        if parts.is_empty() {
            "all rows".into()
        } else {
            parts.join(" AND ")
        }
    }
}

async fn table_exists(client: &Client, table: &str) -> Result<bool, Error> {
    Ok(crate::postgres::table_exists(client, &quote_qualified(table)).await?)
}

pub(super) async fn resolve_columns(client: &Client, config: &Config) -> Result<Columns, Error> {
    let table = &config.outbox.table;
    if !table_exists(client, table).await? {
        return Err(Prerequisite::OutboxTableMissing {
            table: table.clone(),
        }
        .into());
    }
    let rows = client
        .query(
            "SELECT attname::text, format_type(atttypid, atttypmod) FROM pg_attribute
             WHERE attrelid = $1::text::regclass AND attnum > 0 AND NOT attisdropped",
            &[&quote_qualified(table)],
        )
        .await?;
    let present: HashMap<String, String> = rows
        .iter()
        .map(|r| (r.get::<_, String>(0), r.get::<_, String>(1)))
        .collect();
    let pick = |configured: &str, alias: Option<&str>| -> Option<String> {
        if present.contains_key(configured) {
            return Some(configured.to_owned());
        }
        alias
            .filter(|a| present.contains_key(*a))
            .map(str::to_owned)
    };
    let c = &config.outbox.columns;
    let id = pick(&c.id, None).and_then(|n| present.get(&n).map(|t| (n, t.clone())));
    Ok(Columns {
        id,
        idempotency_key: pick(&c.idempotency_key, None),
        aggregate_type: pick(&c.aggregate_type, Some("aggregatetype")),
        aggregate_id: pick(&c.aggregate_id, Some("aggregateid")),
        event_type: pick(&c.event_type, Some("type")),
        topic: pick(&c.topic, None),
        headers: pick(&c.headers, None),
        payload: pick(&c.payload, None),
        created_at: pick(&c.created_at, None),
    })
}

/// Checks `--from-id`/`--to-id` against the id column's type, so a typo is a usage
/// error rather than a failed scan.
pub(super) async fn check_id_bounds(
    client: &Client,
    cols: &Columns,
    range: &Range,
) -> Result<(), Error> {
    let Some((_, ty)) = &cols.id else {
        return Ok(());
    };
    for (flag, bound) in [("--from-id", &range.from_id), ("--to-id", &range.to_id)] {
        if let Some(value) = bound
            && let Err(e) = client
                .query_one(&format!("SELECT $1::text::{ty}"), &[value])
                .await
        {
            return Err(usage(format!(
                "{flag} {value:?} is not a valid {ty}: {}",
                crate::postgres::describe_error(&e)
            )));
        }
    }
    Ok(())
}

/// The range's `WHERE` clause and its text parameters.
fn where_clause(cols: &Columns, range: &Range) -> Result<(String, Vec<String>), Error> {
    let mut conds = Vec::new();
    let mut params = Vec::new();
    let mut time = |bound: Option<DateTime<Utc>>, op: &str| -> Result<(), Error> {
        if let Some(t) = bound {
            let Some(col) = &cols.created_at else {
                return Err(usage(
                    "--since/--until need the created_at column, which the outbox table lacks"
                        .into(),
                ));
            };
            params.push(rfc3339(t));
            conds.push(format!(
                "{} {op} ${}::text::timestamptz",
                quote_ident(col),
                params.len()
            ));
        }
        Ok(())
    };
    time(range.since, ">=")?;
    time(range.until, "<")?;
    for (bound, op) in [(&range.from_id, ">="), (&range.to_id, "<=")] {
        if let Some(value) = bound {
            let Some((col, ty)) = &cols.id else {
                return Err(usage(
                    "--from-id/--to-id need the id column, which the outbox table lacks".into(),
                ));
            };
            params.push(value.clone());
            conds.push(format!(
                "{} {op} ${}::text::{ty}",
                quote_ident(col),
                params.len()
            ));
        }
    }
    let clause = if conds.is_empty() {
        String::new()
    } else {
        format!(" WHERE {}", conds.join(" AND "))
    };
    Ok((clause, params))
}

fn text_expr(col: Option<&String>) -> String {
    col.map_or_else(
        || "NULL::text".to_owned(),
        |c| format!("{}::text", quote_ident(c)),
    )
}

/// `SELECT` of the outbox columns the mapper needs (the payload only as "is it
/// NULL": its value decides nothing the audit needs, and it can be large).
fn rows_query(config: &Config, cols: &Columns, clause: &str, ordered: bool) -> String {
    let id = cols.id.as_ref().map(|(n, _)| n);
    let payload_is_null = cols.payload.as_ref().map_or_else(
        || "true".to_owned(),
        |p| format!("({} IS NULL)", quote_ident(p)),
    );
    let order: Vec<String> = [cols.created_at.as_ref(), id]
        .into_iter()
        .flatten()
        .map(|c| quote_ident(c))
        .collect();
    let order = if ordered && !order.is_empty() {
        format!(" ORDER BY {}", order.join(", "))
    } else {
        String::new()
    };
    format!(
        "SELECT {}, {}, {}, {}, {}, {}, {}, {payload_is_null}, {} FROM {}{clause}{order}",
        text_expr(id),
        text_expr(cols.idempotency_key.as_ref()),
        text_expr(cols.aggregate_type.as_ref()),
        text_expr(cols.aggregate_id.as_ref()),
        text_expr(cols.event_type.as_ref()),
        text_expr(cols.topic.as_ref()),
        text_expr(cols.headers.as_ref()),
        text_expr(cols.created_at.as_ref()),
        quote_qualified(&config.outbox.table),
    )
}

fn bytes_at(row: &Row, i: usize) -> Result<Option<Bytes>, Error> {
    let v: Option<&str> = row.try_get(i)?;
    Ok(v.map(|s| Bytes::copy_from_slice(s.as_bytes())))
}

/// One row of [`rows_query`] as the mapper's input.
fn outbox_row(row: &Row) -> Result<OutboxRow, Error> {
    let payload_is_null: bool = row.try_get(7)?;
    Ok(OutboxRow {
        id: bytes_at(row, 0)?,
        idempotency_key: bytes_at(row, 1)?,
        aggregate_type: bytes_at(row, 2)?,
        aggregate_id: bytes_at(row, 3)?,
        event_type: bytes_at(row, 4)?,
        topic: bytes_at(row, 5)?,
        headers: bytes_at(row, 6)?,
        // A stand-in: only NULL vs. not NULL matters to the mapping decisions.
        payload: (!payload_is_null).then(Bytes::new),
        payload_format: PayloadFormat::Raw,
        created_at: bytes_at(row, 8)?,
        extra: Vec::new(),
    })
}

/// The dedupe key the relay puts in the header: `idempotency_key`, else `id`.
fn dedupe_key(row: &OutboxRow) -> Bytes {
    row.idempotency_key
        .clone()
        .or_else(|| row.id.clone())
        .unwrap_or_default()
}

fn params_ref(params: &[String]) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
    params
        .iter()
        .map(|p| p as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect()
}

/// What reading PostgreSQL produced.
#[derive(Debug)]
pub(super) struct Loaded {
    pub(super) ledger: Ledger,
    /// The topics the rows map to with the current config.
    pub(super) topics: BTreeSet<String>,
    /// Rows the mapper refuses (the relay poisons them).
    pub(super) unmappable: u64,
    pub(super) notes: Vec<String>,
}

/// Another outbox of the config: its table and the key its records carry.
#[derive(Debug, Clone)]
pub(super) struct OtherOutbox {
    /// Quoted, qualified.
    table: String,
    /// The record's `idempotency_key` as SQL: the `idempotency_key` column, else
    /// the `id` (as [`dedupe_key`]).
    key: String,
}

/// The other outboxes of the config (`others`: one view each), whose rows' records
/// a shared topic may hold beside this outbox's (`ledger.rs`, "Whose record it is").
pub(super) async fn other_outboxes(
    client: &Client,
    others: &[Config],
) -> Result<Vec<OtherOutbox>, Error> {
    let mut out = Vec::with_capacity(others.len());
    for view in others {
        let cols = resolve_columns(client, view).await?;
        out.push(OtherOutbox {
            table: quote_qualified(&view.outbox.table),
            key: format!(
                "COALESCE({}, {}, '')",
                text_expr(cols.idempotency_key.as_ref()),
                text_expr(cols.id.as_ref().map(|(n, _)| n))
            ),
        });
    }
    Ok(out)
}

/// Reads the range's rows and the poison rows in one snapshot (and, when messages
/// are audited, the keys of the `others`' rows).
pub(super) async fn load(
    client: &mut Client,
    config: &Config,
    others: &[OtherOutbox],
    cols: &Columns,
    range: &Range,
    progress: bool,
) -> Result<Loaded, Error> {
    let mapper = OutboxMapper::new(&config.outbox, &config.kafka, config.kafka.envelope.clone())?;
    let (clause, params) = where_clause(cols, range)?;
    let poison_exists = table_exists(client, &config.outbox.poison_table).await?;
    let tx = client
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    // A role's statement_timeout must not kill a long scan of a read-only audit.
    tx.batch_execute("SET LOCAL statement_timeout = 0").await?;

    let count_sql = format!(
        "SELECT count(*) FROM {}{clause}",
        quote_qualified(&config.outbox.table)
    );
    let total: i64 = tx.query_one(&count_sql, &params_ref(&params)).await?.get(0);
    let total = u64::try_from(total).unwrap_or(0);
    let capacity = usize::try_from(total).map_err(|_| Error::AuditRowsDoNotFit { rows: total })?;
    let mut ledger = Ledger::with_capacity(capacity);
    let mut topics = BTreeSet::new();
    let mut unmappable = 0u64;

    let statement = tx.prepare(&rows_query(config, cols, &clause, true)).await?;
    let portal = tx.bind(&statement, &params_ref(&params)).await?;
    let mut bar = Meter::new(
        "audit",
        "outbox rows",
        total,
        progress && total >= meter::MIN_TOTAL,
    );
    loop {
        let batch = tx.query_portal(&portal, BATCH_ROWS).await?;
        for row in &batch {
            let row = outbox_row(row)?;
            ledger.push_row(&dedupe_key(&row))?;
            match mapper.map_row(&row, None) {
                Ok(event) => {
                    if !topics.contains(&event.topic) {
                        topics.insert(event.topic);
                    }
                }
                Err(_) => unmappable += 1,
            }
        }
        bar.inc(batch.len() as u64);
        if batch.len() < usize::try_from(BATCH_ROWS).unwrap_or(usize::MAX) {
            break;
        }
    }
    bar.finish();
    ledger.seal();

    let mut notes = Vec::new();
    if poison_exists {
        let table = quote_qualified(&config.outbox.poison_table);
        // Parked rows (migration 0009) are told apart; before it there are none.
        let parked_column: bool = tx
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1)
                                  AND attname = 'parked' AND NOT attisdropped)",
                &[&table],
            )
            .await?
            .try_get(0)?;
        let parked = if parked_column { "parked" } else { "false" };
        // Another outbox's rows in a shared poison table (migration 0012 records
        // whose a row is) are not this outbox's poisoned events.
        let source_column: bool = tx
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1)
                                  AND attname = 'source_table' AND NOT attisdropped)",
                &[&table],
            )
            .await?
            .try_get(0)?;
        let own = if source_column {
            " WHERE source_table IS NULL OR source_table = $2"
        } else {
            " WHERE $2::text IS NOT NULL"
        };
        let sql = format!(
            "SELECT idempotency_key, outbox_id, {parked}, aggregate_id, row_data ? $1 FROM {table}{own}"
        );
        let statement = tx.prepare(&sql).await?;
        let source = crate::poison::source_table(&config.outbox);
        let portal = tx
            .bind(&statement, &[&message::POISON_MARKER, &source])
            .await?;
        loop {
            let batch = tx.query_portal(&portal, BATCH_ROWS).await?;
            for row in &batch {
                let key: Option<&str> = row.try_get(0)?;
                let outbox_id: Option<&str> = row.try_get(1)?;
                let parked: bool = row.try_get(2)?;
                if row.try_get::<_, Option<bool>>(4)?.unwrap_or(false) {
                    let entity: Option<&str> = row.try_get(3)?;
                    ledger.mark_message_poisoned(
                        entity.unwrap_or_default().as_bytes(),
                        key.unwrap_or_default().as_bytes(),
                    );
                    continue;
                }
                let mut mark = |k: &str| {
                    if parked {
                        ledger.mark_parked(k.as_bytes())
                    } else {
                        ledger.mark_poisoned(k.as_bytes())
                    }
                };
                let matched = key.is_some_and(&mut mark);
                if !matched && let Some(id) = outbox_id {
                    mark(id);
                }
            }
            if batch.len() < usize::try_from(BATCH_ROWS).unwrap_or(usize::MAX) {
                break;
            }
        }
    } else {
        notes.push(format!(
            "poison table {} does not exist: no event counts as poisoned",
            config.outbox.poison_table
        ));
    }
    load_message_ledger(
        &tx,
        config,
        range,
        &mapper,
        &mut ledger,
        &mut topics,
        &mut notes,
    )
    .await?;
    if ledger.audits_messages() && !others.is_empty() {
        for other in others {
            let statement = tx
                .prepare(&format!("SELECT {} FROM {}", other.key, other.table))
                .await?;
            let portal = tx.bind(&statement, &[]).await?;
            loop {
                let batch = tx.query_portal(&portal, BATCH_ROWS).await?;
                for row in &batch {
                    let key: &str = row.try_get(0)?;
                    ledger.push_other_row(key.as_bytes());
                }
                if batch.len() < usize::try_from(BATCH_ROWS).unwrap_or(usize::MAX) {
                    break;
                }
            }
        }
        ledger.seal_other_rows();
    }
    tx.commit().await?;
    Ok(Loaded {
        ledger,
        topics,
        unmappable,
        notes,
    })
}

/// The message outbox's ledger (`migrations/0011_message_outbox.sql`), into the
/// ledger and the topics to read (see `messages.rs`). Only for an audit of the whole
/// history: the ledger counts per entity since the first event, not by time.
async fn load_message_ledger(
    tx: &tokio_postgres::Transaction<'_>,
    config: &Config,
    range: &Range,
    mapper: &OutboxMapper,
    ledger: &mut Ledger,
    topics: &mut BTreeSet<String>,
    notes: &mut Vec<String>,
) -> Result<(), Error> {
    let (schema, table) = crate::config::qualified_name(&config.outbox.table)?;
    let ledger_table = format!("{}.outbox_relay_message_ledger", quote_ident(&schema));
    let exists: bool = tx
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&ledger_table])
        .await?
        .try_get(0)?;
    if !exists {
        return Ok(());
    }
    let rows = tx
        .query(
            &format!(
                "SELECT aggregate_id, aggregate_type, topic, events FROM {ledger_table}
                  WHERE outbox = $1"
            ),
            &[&format!("{schema}.{table}")],
        )
        .await?;
    if rows.is_empty() {
        return Ok(());
    }
    if range.since.is_some()
        || range.until.is_some()
        || range.from_id.is_some()
        || range.to_id.is_some()
    {
        notes.push(
            "message outbox not audited: its ledger counts events per entity over all time, \
             so audit it without --since/--until/--from-id/--to-id"
                .to_owned(),
        );
        return Ok(());
    }
    // Records of rows deleted since (retention) are explained by no row, so they
    // count for the message ledger of their entity and could hide a lost message.
    let deleted: i64 = tx
        .query_one(
            "SELECT coalesce((SELECT n_tup_del FROM pg_stat_user_tables
                               WHERE relid = to_regclass($1)), 0)",
            &[&quote_qualified(&config.outbox.table)],
        )
        .await?
        .try_get(0)?;
    // A partitioned outbox loses rows by dropped partitions, which no counter keeps.
    if deleted > 0 || config.outbox.partitioned {
        notes.push(format!(
            "rows were deleted from {} (retention; {deleted} counted since the statistics \
             were reset, dropped partitions not counted): their records count as deliveries \
             of the message outbox's entity, so a lost message of an entity that also had \
             such rows can go unseen",
            config.outbox.table
        ));
    }
    let template_needs_event_type = config
        .topic_template_of(&config.outbox)
        .contains("{event_type}");
    let mut unknown_topics = false;
    for row in &rows {
        let aggregate_id: &str = row.try_get(0)?;
        let aggregate_type: &str = row.try_get(1)?;
        let topic: &str = row.try_get(2)?;
        let events: i64 = row.try_get(3)?;
        ledger.count_emitted(aggregate_id.as_bytes(), u64::try_from(events).unwrap_or(0));
        if !topic.is_empty() {
            topics.insert(topic.to_owned());
        } else if template_needs_event_type {
            unknown_topics = true;
        } else if let Ok(event) = mapper.map_row(&message_topic_row(aggregate_type), None) {
            topics.insert(event.topic);
        }
    }
    if unknown_topics {
        notes.push(
            "the topic template uses {event_type}, which the message ledger does not keep: \
             name the message outbox's topics with --topic"
                .to_owned(),
        );
    }
    Ok(())
}

/// A row that maps to the topic the template gives `aggregate_type`.
fn message_topic_row(aggregate_type: &str) -> OutboxRow {
    let text = |s: &str| Some(Bytes::copy_from_slice(s.as_bytes()));
    OutboxRow {
        idempotency_key: text("k"),
        aggregate_type: text(aggregate_type),
        aggregate_id: text("k"),
        event_type: text("e"),
        payload: text("{}"),
        ..OutboxRow::default()
    }
}

/// Second pass when events are lost: up to [`LOST_SAMPLE`] of their keys.
pub(super) async fn lost_sample(
    client: &mut Client,
    config: &Config,
    cols: &Columns,
    range: &Range,
    ledger: &Ledger,
    lost: u64,
) -> Result<Vec<String>, Error> {
    let want = usize::try_from(lost).unwrap_or(usize::MAX).min(LOST_SAMPLE);
    let (clause, params) = where_clause(cols, range)?;
    let tx = client
        .build_transaction()
        .isolation_level(IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await?;
    tx.batch_execute("SET LOCAL statement_timeout = 0").await?;
    let statement = tx
        .prepare(&rows_query(config, cols, &clause, false))
        .await?;
    let portal = tx.bind(&statement, &params_ref(&params)).await?;
    let mut out = Vec::new();
    'scan: loop {
        let batch = tx.query_portal(&portal, BATCH_ROWS).await?;
        for row in &batch {
            let key = dedupe_key(&outbox_row(row)?);
            if ledger.is_lost(&key) {
                out.push(String::from_utf8_lossy(&key).into_owned());
                if out.len() >= want {
                    break 'scan;
                }
            }
        }
        if batch.len() < usize::try_from(BATCH_ROWS).unwrap_or(usize::MAX) {
            break;
        }
    }
    tx.commit().await?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_query_selects_text_and_orders_by_created_at_then_id() {
        let config = Config::from_sources(
            "test",
            "[postgres]\nurl = \"postgresql://h/db\"\n[kafka]\nbrokers = \"b\"\n",
            Vec::new(),
        )
        .unwrap();
        let cols = Columns {
            id: Some(("id".into(), "uuid".into())),
            idempotency_key: Some("idempotency_key".into()),
            aggregate_id: Some("aggregateid".into()),
            payload: Some("payload".into()),
            created_at: Some("created_at".into()),
            ..Columns::default()
        };
        let q = rows_query(&config, &cols, " WHERE x", true);
        assert_eq!(
            q,
            "SELECT \"id\"::text, \"idempotency_key\"::text, NULL::text, \"aggregateid\"::text, \
             NULL::text, NULL::text, NULL::text, (\"payload\" IS NULL), \"created_at\"::text \
             FROM \"public\".\"outbox\" WHERE x ORDER BY \"created_at\", \"id\""
        );
        assert!(!rows_query(&config, &cols, "", false).contains("ORDER BY"));
    }

    #[test]
    fn where_clause_casts_bounds() {
        let cols = Columns {
            id: Some(("id".into(), "uuid".into())),
            created_at: Some("created_at".into()),
            ..Columns::default()
        };
        let range = Range {
            since: Some(DateTime::<Utc>::MIN_UTC),
            until: None,
            from_id: Some("0190".into()),
            to_id: Some("0191".into()),
        };
        let (clause, params) = where_clause(&cols, &range).unwrap();
        assert_eq!(
            clause,
            " WHERE \"created_at\" >= $1::text::timestamptz AND \"id\" >= $2::text::uuid AND \"id\" <= $3::text::uuid"
        );
        assert_eq!(params.len(), 3);
        assert_eq!(where_clause(&cols, &Range::default()).unwrap().0, "");
        let no_time = Columns::default();
        assert!(where_clause(&no_time, &range).is_err());
    }
}
