//! The shards' publications: created by `migrate`, checked by `run` and `check`.
//!
//! With `postgres.shards = N` (see [`crate::config::shard`]) every shard has a
//! publication of its own, `FOR TABLE <outbox> WHERE (<hash filter>)`. `migrate`
//! creates the missing ones, each with a comment that says what it was made for
//! (`outbox-relay shard 2 of 4 by "aggregate_id"`). The comment, not the filter's
//! text, is what is compared later: PostgreSQL stores the filter deparsed (casts and
//! parentheses rewritten, differently for each column type), while the comment is
//! ours, so comparing it is exact.
//!
//! A publication whose comment says something else was made for another sharding:
//! another shard count, or another id column. Changing either moves rows between
//! shards, and a row moved to a shard whose slot has already passed it would be
//! lost, so `migrate` and `run` refuse ([`Prerequisite::ShardPublicationMismatch`])
//! instead of altering the filter. How to change the number of shards is in
//! `docs/operations.md`.

use tokio_postgres::Client;

use crate::config::{self, Config, shard};

use super::error::PgError;
use super::prerequisite::Prerequisite;

/// The first server version with publication row filters.
const ROW_FILTERS_SINCE: i32 = 150_000;

/// What shard `shard`'s publication's comment says.
fn marker(cfg: &Config, shard: u32) -> String {
    format!(
        "outbox-relay shard {shard} of {} by {}",
        cfg.postgres.shards,
        config::quote_ident(&cfg.outbox.columns.aggregate_id)
    )
}

/// Creates the shards' publications that do not exist yet and checks the others;
/// returns the names of those it created. Nothing to do when not sharded.
///
/// # Errors
///
/// [`Prerequisite::ShardingUnsupported`] before PostgreSQL 15,
/// [`Prerequisite::ShardPublicationMismatch`] for a publication made for another
/// sharding, or a failed statement.
pub async fn ensure(client: &Client, cfg: &Config) -> Result<Vec<String>, PgError> {
    if cfg.postgres.shards <= 1 {
        return Ok(Vec::new());
    }
    require_row_filters(client).await?;
    let table = config::quote_qualified(&cfg.outbox.table);
    let options = if cfg.outbox.partitioned {
        "publish = 'insert', publish_via_partition_root = true"
    } else {
        "publish = 'insert'"
    };
    let mut created = Vec::new();
    for (i, name) in (0..).zip(cfg.postgres.all_publication_names()) {
        let wanted = marker(cfg, i);
        match comment_of(client, &name).await? {
            Some(found) => same_sharding(&name, found, &wanted)?,
            None => {
                let filter =
                    shard::row_filter(&cfg.outbox.columns.aggregate_id, cfg.postgres.shards, i)
                        .unwrap_or_else(|| "true".to_owned());
                let quoted = config::quote_ident(&name);
                // One simple-query message: both statements commit together.
                client
                    .batch_execute(&format!(
                        "CREATE PUBLICATION {quoted} FOR TABLE {table} WHERE ({filter}) WITH ({options});
                         COMMENT ON PUBLICATION {quoted} IS {};",
                        literal(&wanted)
                    ))
                    .await
                    .map_err(query("cannot create a shard's publication: "))?;
                tracing::info!(publication = %name, filter = %filter, "shard publication created");
                created.push(name);
            }
        }
    }
    Ok(created)
}

/// Checks that this relay's shard publication (which must exist) was made for this
/// config's sharding. Nothing to check when not sharded.
///
/// # Errors
///
/// As for [`ensure`]; a missing publication is left to the caller's own check.
pub async fn verify(client: &Client, cfg: &Config) -> Result<(), PgError> {
    if cfg.postgres.shards <= 1 {
        return Ok(());
    }
    require_row_filters(client).await?;
    let name = cfg.postgres.publication_name();
    match comment_of(client, &name).await? {
        Some(found) => same_sharding(&name, found, &marker(cfg, cfg.postgres.shard)),
        None => Ok(()),
    }
}

/// `Some(comment)` (empty when it has none) when the publication exists.
async fn comment_of(client: &Client, publication: &str) -> Result<Option<String>, PgError> {
    let row = client
        .query_opt(
            "SELECT coalesce(obj_description(oid, 'pg_publication'), '')
               FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await
        .map_err(query("cannot read a shard's publication: "))?;
    row.map(|r| r.try_get(0))
        .transpose()
        .map_err(query("cannot read a shard's publication: "))
}

fn same_sharding(publication: &str, found: String, wanted: &str) -> Result<(), PgError> {
    if found == wanted {
        return Ok(());
    }
    Err(Prerequisite::ShardPublicationMismatch {
        publication: publication.to_owned(),
        found,
        wanted: wanted.to_owned(),
    }
    .into())
}

async fn require_row_filters(client: &Client) -> Result<(), PgError> {
    let row = client
        .query_one(
            "SELECT current_setting('server_version_num')::int, current_setting('server_version')",
            &[],
        )
        .await
        .map_err(query("cannot read the server version: "))?;
    let (num, version): (i32, String) = (row.get(0), row.get(1));
    if num < ROW_FILTERS_SINCE {
        return Err(Prerequisite::ShardingUnsupported {
            server_version: version,
        }
        .into());
    }
    Ok(())
}

fn literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

fn query(context: &'static str) -> impl Fn(tokio_postgres::Error) -> PgError {
    move |source| PgError::Query { context, source }
}
