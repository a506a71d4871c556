//! The publication: it exists, covers the outbox, publishes inserts and, for a
//! partitioned outbox, publishes through the partition root.
//!
//! Without `publish_via_partition_root` the stream names each partition, not the
//! outbox, and the relay would see no outbox rows at all; without `insert` it
//! would see none either. Updates and deletes are ignored by the relay, but each
//! one is still decoded and sent (a `retention` run deletes many rows): a warning.
//!
//! # Tables the config does not name
//!
//! The relay relays the inserts of the tables its config names and skips the rest
//! of the stream, while the slot moves past it. A table still in the publication
//! but no longer in the config (an `[[outbox]]` entry removed, a relay pointed at
//! another table) therefore loses every row written to it, silently: the rows are
//! decoded, sent, skipped and confirmed. Nothing at run time can tell such a table
//! from one that was never meant to be relayed, so the check refuses the
//! combination ([`unserved`]): the operator either drops the table from the
//! publication (its rows are not events) or names it in the config again. It is a
//! problem, so `run` refuses to start on it (exit code 3), as for the other
//! publication problems: loss is never the default.

use tokio_postgres::Client;

use super::{Check, Status};
use crate::config::{Config, quote_ident, quote_qualified};

const NAME: &str = "postgres.publication";

/// Tables named in an [`unserved`] problem before the rest are only counted.
const NAMED_TABLES: usize = 10;

/// `check`, the publication check of every outbox (`checks`, one line), extended
/// with the tables the relay's publication publishes that no outbox of `config` is
/// (module doc): then a problem, whatever `checks` said.
pub(super) async fn unserved(client: &Client, config: &Config, checks: Check) -> Check {
    let publication = config.postgres.publication_name();
    let outboxes: Vec<String> = config
        .outboxes()
        .map(|o| quote_qualified(&o.table))
        .collect();
    let rows = match client
        .query(
            "SELECT t.schemaname || '.' || t.tablename, p.puballtables
               FROM pg_publication p JOIN pg_publication_tables t ON t.pubname = p.pubname
              WHERE p.pubname = $1
                AND NOT EXISTS (
                    SELECT 1 FROM unnest($2::text[]) AS o(name)
                     WHERE to_regclass(format('%I.%I', t.schemaname, t.tablename))
                               = to_regclass(o.name)
                        OR to_regclass(format('%I.%I', t.schemaname, t.tablename))
                           IN (SELECT relid FROM pg_partition_tree(to_regclass(o.name))))
              ORDER BY 1",
            &[&publication, &outboxes],
        )
        .await
    {
        Ok(rows) => rows,
        Err(e) => return Check::query_failed(NAME, "cannot read pg_publication_tables", &e),
    };
    let mut tables = Vec::with_capacity(rows.len());
    let mut all_tables = false;
    for row in &rows {
        match (row.try_get::<_, String>(0), row.try_get::<_, bool>(1)) {
            (Ok(table), Ok(all)) => {
                tables.push(table);
                all_tables |= all;
            }
            (Err(e), _) | (_, Err(e)) => {
                return Check::query_failed(NAME, "cannot read pg_publication_tables", &e);
            }
        }
    }
    if tables.is_empty() {
        return checks;
    }
    let quoted = quote_ident(&publication);
    let mut named = tables
        .iter()
        .take(NAMED_TABLES)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");
    if tables.len() > NAMED_TABLES {
        named.push_str(&format!(" and {} more", tables.len() - NAMED_TABLES));
    }
    let detail = format!(
        "publication {publication} also publishes {named}, which no outbox of this config \
         names: the relay would skip their rows while the slot moves past them (lost)"
    );
    let drop = if all_tables {
        format!(
            "publication {publication} is FOR ALL TABLES: replace it by one FOR TABLE the \
             outbox tables (WITH (publish = 'insert'))"
        )
    } else {
        let list: Vec<String> = tables.iter().map(|t| quote_qualified(t)).collect();
        format!(
            "ALTER PUBLICATION {quoted} DROP TABLE {} (a table published through FOR \
             TABLES IN SCHEMA cannot be dropped alone: list the outbox tables instead)",
            list.join(", ")
        )
    };
    let fix = format!(
        "if their rows are not events, take them out of the publication: {drop}; if they \
         are outboxes, name them in the config again ([[outbox]] entries, \
         docs/configuration.md#several-outbox-tables-outbox)"
    );
    let (detail, fix) = match checks.status {
        Status::Ok => (detail, fix),
        _ => (
            format!("{}; {detail}", checks.detail),
            match checks.fix {
                Some(other) => format!("{other}; {fix}"),
                None => fix,
            },
        ),
    };
    Check::problem(NAME, detail, fix)
}

/// `postgres.publication`.
pub(super) async fn check(client: &Client, config: &Config) -> Check {
    let publication = &config.postgres.publication_name();
    let outbox = quote_qualified(&config.outbox.table);
    let row = match client
        .query_one(
            "SELECT p.oid IS NOT NULL, coalesce(p.pubinsert, false),
                    coalesce(p.pubupdate, false), coalesce(p.pubdelete, false),
                    coalesce(p.pubviaroot, false),
                    EXISTS (SELECT 1 FROM pg_publication_tables t
                            WHERE t.pubname = $1
                              AND (to_regclass(format('%I.%I', t.schemaname, t.tablename))
                                       = to_regclass($2)
                                   OR to_regclass(format('%I.%I', t.schemaname, t.tablename))
                                       IN (SELECT relid FROM pg_partition_tree(to_regclass($2))))),
                    (SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($2)),
                    EXISTS (SELECT 1 FROM pg_replication_slots
                            WHERE slot_name = $3 AND database = current_database())
             FROM (SELECT 1) one LEFT JOIN pg_publication p ON p.pubname = $1",
            &[publication, &outbox, &config.postgres.slot_name()],
        )
        .await
    {
        Ok(row) => row,
        Err(e) => return Check::query_failed(NAME, "cannot read pg_publication", &e),
    };
    let (exists, insert, update, delete, via_root, covers): (bool, bool, bool, bool, bool, bool) = (
        row.get(0),
        row.get(1),
        row.get(2),
        row.get(3),
        row.get(4),
        row.get(5),
    );
    let partitioned: Option<bool> = row.get(6);
    let slot_exists: bool = row.get(7);
    let quoted = quote_ident(publication);
    if partitioned.is_none() {
        return Check::problem(
            NAME,
            format!(
                "outbox table {} does not exist, so publication {publication} cannot cover it",
                config.outbox.table
            ),
            "run `outbox-relay migrate` (or set outbox.table)",
        );
    }
    if !exists {
        return Check::problem(
            NAME,
            format!("publication {publication} does not exist"),
            format!(
                "run `outbox-relay migrate`, or CREATE PUBLICATION {quoted} FOR TABLE {outbox} \
                 WITH (publish = 'insert')"
            ),
        );
    }
    let mut problems = Vec::new();
    let mut fixes = Vec::new();
    if !covers && slot_exists {
        // Added now, the table's rows committed so far would never be streamed.
        problems.push(format!(
            "does not include {}, and slot {} exists",
            config.outbox.table,
            config.postgres.slot_name()
        ));
        fixes.push(format!(
            "serve {} with a relay of its own (its own postgres.slot and \
             postgres.publication), or list it when the slot is created \
             (docs/configuration.md#adding-an-outbox-later); ALTER PUBLICATION would leave \
             its earlier rows out of the stream",
            config.outbox.table
        ));
    } else if !covers {
        problems.push(format!("does not include {}", config.outbox.table));
        fixes.push(format!("ALTER PUBLICATION {quoted} ADD TABLE {outbox}"));
    }
    let publish: Vec<&str> = [(insert, "insert"), (update, "update"), (delete, "delete")]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, name)| *name)
        .collect();
    let publish = format!("publish = '{}'", publish.join(", "));
    if !insert {
        problems.push(format!(
            "{publish} leaves out insert: no outbox row would reach the relay"
        ));
        fixes.push(format!(
            "ALTER PUBLICATION {quoted} SET (publish = 'insert')"
        ));
    }
    if partitioned == Some(true) && !via_root {
        problems.push(
            "the outbox is partitioned and publish_via_partition_root is off: the stream \
             would name the partitions, not the outbox"
                .to_owned(),
        );
        fixes.push(format!(
            "ALTER PUBLICATION {quoted} SET (publish_via_partition_root = true)"
        ));
    }
    if !problems.is_empty() {
        return Check::problem(
            NAME,
            format!("publication {publication} {}", problems.join("; ")),
            fixes.join("; "),
        );
    }
    if update || delete {
        return Check::warn(
            NAME,
            format!(
                "publication {publication} covers {} with {publish}: updates and deletes are \
                 ignored by the relay but decoded and sent all the same",
                config.outbox.table
            ),
            format!("ALTER PUBLICATION {quoted} SET (publish = 'insert')"),
        );
    }
    Check::ok(
        NAME,
        format!(
            "publication {publication} covers {} with {publish}{}",
            config.outbox.table,
            if via_root {
                ", publish_via_partition_root"
            } else {
                ""
            }
        ),
    )
}
