//! The publication: it exists, covers the outbox, publishes inserts and, for a
//! partitioned outbox, publishes through the partition root.
//!
//! Without `publish_via_partition_root` the stream names each partition, not the
//! outbox, and the relay would see no outbox rows at all; without `insert` it
//! would see none either. Updates and deletes are ignored by the relay, but each
//! one is still decoded and sent (a `retention` run deletes many rows): a warning.

use tokio_postgres::Client;

use super::Check;
use crate::config::{Config, quote_ident, quote_qualified};

const NAME: &str = "postgres.publication";

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
