//! The poller's statements, built once from the config and the table layout, and the
//! session they run on.
//!
//! # SKIP LOCKED and ordering
//!
//! `FOR UPDATE` locks the batch so that a second worker (or a second poller process)
//! cannot send the same rows; `SKIP LOCKED` lets it take the *next* rows instead of
//! queueing behind the lock. That is what makes several workers scale — and what
//! breaks per-key order: worker B may publish and commit rows `1001..2000` while worker
//! A still waits for the acks of `1..1000`, so a later event of an entity can reach
//! Kafka before an earlier one. Hence **one worker by default**: with one worker,
//! batches go out one after the other in `(created_at, id)` order, and within a batch
//! the idempotent producer keeps the order of every partition. Two caveats remain even
//! then, and the CDC relay does not share the first:
//!
//! * `created_at` is the *insert* time, not the commit time. A long transaction that
//!   inserted its row early and commits late becomes visible after younger rows were
//!   already sent. Writers that lock the entity's row *before* inserting the outbox
//!   row (the usual pattern: update the aggregate, then record its event) are not
//!   affected, because the second writer waits for the first to commit; unlocked
//!   writers of one entity are. The CDC relay reads in commit order.
//! * A row that failed and is retried later is published after rows of its key that
//!   succeeded meanwhile. The CDC relay has the same property for poisoned events.

use tokio_postgres::{Client, Statement};

use crate::config::{OutboxConfig, quote_ident, quote_qualified};
use crate::error::Result;
use crate::postgres::conninfo::ConnInfo;
use crate::postgres::replication::SESSION_OPTIONS;

use super::layout::{CREATED_AT, FIELDS, ID, IDEMPOTENCY_KEY, Layout};
use super::pg_error::pg_error;

/// A connection with the replication session's text-output settings.
pub(crate) async fn session(conninfo: &ConnInfo) -> Result<Client> {
    let client = crate::postgres::connect_info(conninfo).await?;
    client
        .batch_execute(&session_settings_sql(SESSION_OPTIONS))
        .await
        .map_err(pg_error)?;
    Ok(client)
}

/// `-c name=value …` startup options as `SET` statements, so a metadata session
/// formats values exactly like the replication session.
fn session_settings_sql(options: &str) -> String {
    options
        .split_whitespace()
        .filter_map(|token| token.split_once('='))
        .map(|(name, value)| format!("SET {name} = '{}';", value.replace('\'', "''")))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The poller's statements, built once from the config and the table layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sql {
    pub(super) select_batch: String,
    /// Every row the poller would still send, in its order, unlocked and unlimited,
    /// each ending with its rank (`read_ranked_row`),
    /// leaving out rows that have a poison row (poisoned by the CDC relay, or
    /// replayed): the backlog a cutover publishes, whatever the attempts a poller
    /// recorded (a row past `max_attempts` without a poison row is published once
    /// more, and poisoned if it fails again: never left behind for retention).
    pub(crate) backlog: String,
    /// Every unsent, unpoisoned row not below the checkpoint xmin `$1` (bigint), in
    /// the snapshot of a resync after a lost slot (`crate::cdc::resync`), each ending
    /// with its rank (`read_ranked_row`).
    pub(crate) undelivered: String,
    pub(super) sweep: String,
    /// One row by its id (`$1`, as text), whatever its state: `replay` reads the
    /// original of a poison row whose copy was truncated.
    pub(crate) by_id: String,
    pub(super) mark_sent: String,
    /// [`Sql::mark_sent`] for rows not marked yet (`$1`: ids as text): the marks an
    /// exactly-once backlog left to its successor (`cdc::backlog`), which must not
    /// move the `sent_at` of rows marked since.
    pub(crate) mark_sent_if_unsent: String,
    pub(super) record_failures: String,
    pub(super) insert_poison: String,
    /// `relay.poison_copy_limit_bytes`, for the poison rows.
    pub(super) poison_copy_limit: usize,
}

impl Sql {
    /// `shard_filter`: the row filter of the relay's shard
    /// ([`crate::config::shard::row_filter`]), which the cutover's and a resync's
    /// backlog keep to; the poller itself, a fallback for every shard, ignores it.
    /// `slot`: the slot a cutover or resync publishes for, recorded in the poison
    /// rows it writes (`None` for the poller, see `crate::poison`).
    pub(crate) fn new(
        outbox: &OutboxConfig,
        layout: &Layout,
        poison_copy_limit: usize,
        shard_filter: Option<&str>,
        slot: Option<&str>,
    ) -> Sql {
        let in_shard = shard_filter.map_or(String::new(), |f| format!(" AND ({f})"));
        let table = quote_qualified(&outbox.table);
        let poisoned = has_poison_row(outbox, layout);
        // Layout guarantees the required columns; the fallback only keeps this total.
        let name = |field: usize| quote_ident(layout.fields[field].as_deref().unwrap_or("id"));
        let (id, created_at) = (name(ID), name(CREATED_AT));
        let id_type = &layout.id_type;
        // `sent_at IS NULL` is the partial index's predicate and (created_at, id) its
        // key, so the scan walks the index in order and stops after the batch.
        let order = format!("ORDER BY o.{created_at}, o.{id} LIMIT $2 FOR UPDATE SKIP LOCKED");
        let columns = select_list(outbox, layout);
        let select = format!("SELECT {columns} FROM {table} o");
        // A backlog's rows end with their rank (`read_ranked_row`).
        let ranked = format!(
            "SELECT {columns}, {} FROM {table} o",
            commit_rank("o", &created_at)
        );
        let commit_order = commit_order("o", &id, &created_at);
        Sql {
            select_batch: format!("{select} WHERE o.sent_at IS NULL AND o.attempts < $1 {order}"),
            backlog: format!(
                "{ranked} WHERE o.sent_at IS NULL AND NOT {poisoned}{in_shard}
                 {commit_order}"
            ),
            undelivered: format!(
                "{ranked} WHERE o.sent_at IS NULL AND NOT {poisoned}
                   AND NOT ({}){in_shard}
                 {commit_order}",
                crate::outbox::checkpoint::precedes_sql("o", 1)
            ),
            sweep: format!(
                "{select} WHERE o.sent_at IS NULL AND o.attempts >= $1 AND NOT {poisoned} {order}"
            ),
            by_id: format!("{select} WHERE o.{id} = $1::text::{id_type}"),
            // statement_timestamp(): when the marks were written, after the acks
            // (now() would be the poll's start).
            mark_sent: format!(
                "UPDATE {table} SET sent_at = statement_timestamp()
                 WHERE {id} = ANY($1::text[]::{id_type}[])"
            ),
            mark_sent_if_unsent: format!(
                "UPDATE {table} SET sent_at = statement_timestamp()
                 WHERE {id} = ANY($1::text[]::{id_type}[]) AND sent_at IS NULL"
            ),
            record_failures: format!(
                "UPDATE {table} AS o SET attempts = f.attempts, last_error = f.error
                 FROM unnest($1::text[], $2::int4[], $3::text[]) AS f(id, attempts, error)
                 WHERE o.{id} = f.id::{id_type}"
            ),
            insert_poison: crate::poison::insert_statement(outbox, slot),
            poison_copy_limit,
        }
    }
}

/// Field `field` of the layout as the select list reads it: the column as text, or
/// NULL when the table has none.
fn field_text(layout: &Layout, field: usize) -> String {
    match &layout.fields[field] {
        Some(name) => format!("o.{}::text", quote_ident(name)),
        None => "NULL::text".to_owned(),
    }
}

/// SQL condition: row `o` has a poison row of its own outbox, found by its
/// idempotency key (the id when the table has no such column). A poison row of
/// another outbox sharing the poison table (whose ids or keys may equal this one's)
/// says nothing about this outbox's rows; rows written before sources were recorded
/// (migration 0012) are taken as before.
pub(crate) fn has_poison_row(outbox: &OutboxConfig, layout: &Layout) -> String {
    let poison = quote_qualified(&outbox.poison_table);
    // Layout guarantees the id column; the fallback only keeps this total.
    let id = quote_ident(layout.fields[ID].as_deref().unwrap_or("id"));
    format!(
        "EXISTS (SELECT 1 FROM {poison} p WHERE p.idempotency_key = COALESCE({}, o.{id}::text) \
         AND (p.source_table IS NULL OR p.source_table = '{}'))",
        field_text(layout, IDEMPOTENCY_KEY),
        crate::poison::source_table(outbox).replace('\'', "''")
    )
}

/// The columns `read_row` reads, from table alias `o`: the fields as text, the
/// poller's `attempts` and `last_error` (0 and NULL for a table without them, read
/// only to publish again), then the `outbox.additional_placement` columns, which
/// `read_row` takes in order after the bookkeeping ones.
pub(crate) fn select_list(outbox: &OutboxConfig, layout: &Layout) -> String {
    let list = (0..FIELDS)
        .map(|f| field_text(layout, f))
        .collect::<Vec<_>>()
        .join(", ");
    let placed: String = outbox
        .placements()
        .unwrap_or_default()
        .iter()
        // The type's output function, as pgoutput sends it (`::text` differs for
        // a few types: bool, char(n), inet); format('%s', NULL) would be ''.
        .map(|p| {
            let c = quote_ident(&p.column);
            format!(", CASE WHEN o.{c} IS NULL THEN NULL ELSE format('%s', o.{c}) END")
        })
        .collect();
    let bookkeeping = if layout.poller_columns {
        "o.attempts::int4, o.last_error::text"
    } else {
        "0::int4, NULL::text"
    };
    format!("{list}, {bookkeeping}{placed}")
}

/// The `ORDER BY` of a backlog (a cutover's, a resync's): the order the stream would
/// have read the rows in, as near as a table can tell.
///
/// A row does not carry its commit LSN. With `track_commit_timestamp = on` the
/// commit time of the transaction that wrote the row orders transactions as they
/// committed (rows committed before the setting was turned on have none and come
/// first). Without it, and between rows of one commit time, `created_at`, then the
/// id: a writer that locks its entity before it records the event (the usual
/// pattern, which serialises the writers of one entity) inserts after the previous
/// writer committed, so with `created_at` filled at the insert (`clock_timestamp()`,
/// the migration's default) one entity's rows come in commit order. The limits: a
/// `created_at` filled with `now()` (the transaction's *start*) or by the
/// application, writers of one entity that do not lock it, and a commit time that is
/// the row's *last* write's (a row a poller recorded a failure on, or an operator
/// updated). `created_at` does not move when a row is marked, so a backlog read again
/// (a resync started over) reads in the same order, and it is the rank `audit`
/// compares rows of one `source_lsn` by.
fn commit_order(alias: &str, id: &str, created_at: &str) -> String {
    format!(
        "ORDER BY CASE WHEN current_setting('track_commit_timestamp')::bool \
             THEN pg_xact_commit_timestamp({alias}.xmin) END NULLS FIRST, \
         {alias}.{created_at}, {alias}.{id}"
    )
}

/// The two columns of a backlog row's rank ([`crate::poller::CommitRank`]): the
/// [`commit_order`] keys as microseconds since the Unix epoch, comparable between
/// tables (a `timestamp` `created_at` is taken as UTC, as the mapper does). A
/// `created_at` of `±infinity` or beyond `bigint` microseconds is clamped (in the
/// order SQL sorts it, below NULL) rather than failing the statement: the row is
/// poisoned by the mapper as before.
fn commit_rank(alias: &str, created_at: &str) -> String {
    let micros = |ts: &str| {
        format!(
            "CASE WHEN {ts} IS NULL THEN NULL ELSE least(greatest(extract(epoch FROM {ts}) * 1000000, \
             -9000000000000000000), 9000000000000000000)::int8 END"
        )
    };
    format!(
        "CASE WHEN current_setting('track_commit_timestamp')::bool THEN {} END, {}",
        micros(&format!("pg_xact_commit_timestamp({alias}.xmin)")),
        micros(&format!("{alias}.{created_at}"))
    )
}

/// [`Sql`] prepared on one connection.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub(super) select_batch: Statement,
    pub(super) sweep: Statement,
    pub(super) mark_sent: Statement,
    pub(super) record_failures: Statement,
    pub(crate) insert_poison: Statement,
    pub(crate) poison_copy_limit: usize,
}

impl Prepared {
    pub(crate) async fn new(client: &Client, sql: &Sql) -> Result<Prepared> {
        let prepare = |text: &str| {
            let text = text.to_owned();
            async move { client.prepare(&text).await.map_err(pg_error) }
        };
        Ok(Prepared {
            select_batch: prepare(&sql.select_batch).await?,
            sweep: prepare(&sql.sweep).await?,
            mark_sent: prepare(&sql.mark_sent).await?,
            record_failures: prepare(&sql.record_failures).await?,
            insert_poison: prepare(&sql.insert_poison).await?,
            poison_copy_limit: sql.poison_copy_limit,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::poller::layout::resolve_layout;
    use crate::poller::layout::tests::{column, migrated_columns, set};

    #[test]
    fn session_matches_the_replication_options() {
        assert_eq!(
            session_settings_sql(SESSION_OPTIONS),
            "SET DateStyle = 'ISO'; SET TimeZone = 'UTC'; SET extra_float_digits = '3';"
        );
        assert_eq!(session_settings_sql("-c a=it's"), "SET a = 'it''s';");
    }

    #[test]
    fn statements_use_the_partial_index_and_configured_names() {
        let mut outbox = OutboxConfig {
            table: "app.Events".into(),
            poison_table: "app.dead".into(),
            ..OutboxConfig::default()
        };
        outbox.columns.created_at = "ts".into();
        let mut columns = migrated_columns();
        columns.retain(|c| c.name != "topic");
        set(
            &mut columns,
            "created_at",
            column("ts", "timestamp with time zone", "timestamptz"),
        );
        set(&mut columns, "id", column("id", "bigint", "int8"));
        let layout = resolve_layout("app.Events", &outbox, &columns).unwrap();
        let sql = Sql::new(&outbox, &layout, 1024, None, None);
        let select = &sql.select_batch;
        assert!(select.contains("FROM \"app\".\"Events\" o"), "{select}");
        assert!(
            select.contains("WHERE o.sent_at IS NULL AND o.attempts < $1"),
            "{select}"
        );
        assert!(
            select.contains("ORDER BY o.\"ts\", o.\"id\" LIMIT $2 FOR UPDATE SKIP LOCKED"),
            "{select}"
        );
        assert!(
            select.contains("NULL::text, o.\"headers\"::text"),
            "{select}"
        );
        assert!(
            sql.mark_sent.contains("= ANY($1::text[]::bigint[])"),
            "{}",
            sql.mark_sent
        );
        assert!(sql.record_failures.contains("f.id::bigint"));
        assert!(
            sql.insert_poison
                .starts_with("INSERT INTO \"app\".\"dead\"")
        );
        assert!(sql.sweep.contains("o.attempts >= $1 AND NOT EXISTS"));
        assert!(sql.sweep.contains("FROM \"app\".\"dead\" p"));
        // Another outbox's poison rows in a shared table do not count.
        for statement in [&sql.sweep, &sql.backlog, &sql.undelivered] {
            assert!(
                statement.contains("p.source_table = 'app.Events'"),
                "{statement}"
            );
        }
    }
}
