//! `postgres.migrations`: every migration `migrate` would apply to this database
//! is recorded in `outbox_relay_migrations` (an adopted outbox skips what does not
//! fit it, see `ops::migrate`). This covers the tables `run` needs: the outbox, an
//! upgraded poison table, the position, cutover and parked-key tables.
//!
//! A role that may not read `outbox_relay_migrations` (the least-privilege role
//! needs no right on it) gets a warning, not a problem: `run` then still checks
//! that each table it uses exists.
//!
//! With every migration recorded, the poison table's unique occurrence index must
//! exist too: without it poisoned events are recorded once per attempt instead of
//! once, and nothing else says so. Before index names were kept within 63 bytes
//! (`ops::migrate::names`), a long poison table name made PostgreSQL cut the name
//! to one that already existed, and `0008` skipped the index without an error. The
//! index must also key on the row's source (`0012`): without it, relays sharing the
//! poison table take each other's rows for repeats of their own and drop them.

use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

use super::Check;
use crate::config::{Config, quote_qualified};
use crate::error::Error;
use crate::ops::migrate;
use crate::ops::migrate::names::Index;

const NAME: &str = "postgres.migrations";

/// `postgres.migrations`.
pub(super) async fn check(client: &Client, config: &Config) -> Check {
    match migrate::pending(client, config).await {
        Ok(pending) if pending.is_empty() => occurrence_index(client, config).await,
        Ok(pending) => Check::problem(
            NAME,
            format!("not applied: {}", pending.join(", ")),
            "run `outbox-relay migrate` as the tables' owner (idempotent)",
        ),
        Err(Error::Postgres(e)) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            Check::warn(
                NAME,
                format!(
                    "cannot read outbox_relay_migrations: {}",
                    crate::postgres::describe_error(&e)
                ),
                "run `outbox-relay check` as the tables' owner to see pending migrations, or \
                 GRANT SELECT ON outbox_relay_migrations to this role",
            )
        }
        Err(Error::Postgres(e)) => Check::query_failed(NAME, "cannot read the migrations", &e),
        Err(e) => Check::problem(
            NAME,
            e.to_string(),
            "fix [outbox] / [outbox.columns] to describe the existing outbox (docs/configuration.md)",
        ),
    }
}

/// `postgres.migrations` once every migration is recorded: whether the poison
/// table has its unique occurrence index, valid, under the name `migrate` gives it
/// or the one earlier versions gave it (module doc).
async fn occurrence_index(client: &Client, config: &Config) -> Check {
    let index = Index::PoisonOccurrence;
    let names = match (
        index.name(&config.outbox),
        index.legacy_name(&config.outbox),
    ) {
        (Ok(name), Ok(legacy)) => vec![name, legacy],
        (Err(e), _) | (_, Err(e)) => {
            return Check::problem(NAME, e.to_string(), "fix outbox.poison_table");
        }
    };
    let found = client
        .query_one(
            "SELECT bool_or(pg_get_indexdef(i.indexrelid) LIKE '%source_table%')
               FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
              WHERE i.indrelid = to_regclass($1) AND i.indisunique
                AND i.indisvalid AND c.relname = ANY($2::text[])",
            &[&quote_qualified(&config.outbox.poison_table), &names],
        )
        .await
        .and_then(|row| row.try_get::<_, Option<bool>>(0));
    match found {
        Ok(Some(true)) => Check::ok(NAME, "every migration is applied"),
        Ok(Some(false)) => Check::problem(
            NAME,
            format!(
                "every migration is recorded, but the unique index {:?} of {} does not key \
                 on the rows' source: relays sharing the poison table drop each other's rows",
                names[0], config.outbox.poison_table
            ),
            "as the tables' owner, DELETE FROM outbox_relay_migrations WHERE version = 12, \
             then run `outbox-relay migrate`: migration 0012 runs again and replaces the index",
        ),
        Ok(None) => Check::problem(
            NAME,
            format!(
                "every migration is recorded, but {} has no unique index {:?}: poisoned \
                 events are not de-duplicated",
                config.outbox.poison_table, names[0]
            ),
            "as the tables' owner, DELETE FROM outbox_relay_migrations WHERE version IN (8, 12), \
             then run `outbox-relay migrate`: migrations 0008 and 0012 run again, label \
             repeated rows with duplicate_of and create the index",
        ),
        Err(e) => Check::query_failed(NAME, "cannot look up the poison table's indexes", &e),
    }
}
