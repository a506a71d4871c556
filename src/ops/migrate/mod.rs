//! Schema migrations: `outbox`, `poison_outbox` (with its no-DELETE trigger), the
//! publication and the cutover marker table, applied in order by `outbox-relay migrate`.
//!
//! The SQL lives in `migrations/NNNN_name.sql` and is embedded in the binary. Table,
//! column and publication names come from the config, so users with an existing
//! outbox keep their names: the files use `{{placeholders}}` that are filled with
//! quoted identifiers before execution; index names are computed from the table
//! names so that PostgreSQL's 63-byte limit never cuts two of them alike
//! (`names.rs`). A hand-written runner (instead of a migration crate) is what
//! allows this templating; it is small: each migration runs in its own transaction
//! under an advisory lock and is recorded in `outbox_relay_migrations` with a
//! checksum of the SQL it ran.
//!
//! `0008` upgrades the poison table in place (de-duplication by occurrence, columns
//! for content jsonb refuses, see [`crate::poison`]) and keeps every existing row: an
//! applied migration is never edited, a later one changes what it created.
//! `0009` adds parked events and keys (`relay.on_poison = "park-key"`, see
//! `crate::poison`, `parking.rs`). `0010` keeps several candidate checkpoints in the
//! relay position (see [`crate::outbox::position`]). `0012` records which relay
//! wrote a poison row (its outbox table and slot) and puts it in the occurrence
//! key, so relays that share a poison table never take each other's rows for their
//! own (see `crate::poison`, `recorded.rs`). With `postgres.shards > 1`, the
//! shards' publications are made last (`crate::postgres::shard_publication`).
//!
//! Besides the tables, the migrations install the writer helper
//! `outbox_enqueue(…)` (`0004`, see [`crate::outbox::enqueue`]) and the checkpoint table
//! retention and the poller's fallback mode rely on (`0005`, see
//! [`crate::outbox::checkpoint`]). With `outbox.partitioned = true` the outbox is created
//! from `0001_outbox_partitioned.sql` instead (see [`crate::ops::retention`]); that choice
//! is made at the first `migrate` and is not converted later.
//!
//! An outbox table that exists already (a poller's, Debezium's) is adopted as it is:
//! the two migrations that concern its columns run their own SQL when the table has
//! what it needs, else an adapted version or nothing, with a note (see `adopt.rs`).

mod adopt;
pub mod names;

use tokio_postgres::Client;

use crate::config::{self, Config, quote_ident, quote_qualified};
use crate::error::{Error, Result};

/// One embedded migration.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    pub version: i32,
    pub name: &'static str,
    pub sql: &'static str,
    /// Used instead of `sql` when `outbox.partitioned` is set.
    pub partitioned_sql: Option<&'static str>,
}

impl Migration {
    /// The SQL this migration runs for this config (before templating).
    #[must_use]
    pub fn sql_for(&self, cfg: &Config) -> &'static str {
        match self.partitioned_sql {
            Some(sql) if cfg.outbox.partitioned => sql,
            _ => self.sql,
        }
    }
}

/// All migrations, in the order they apply.
pub const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "outbox",
        sql: include_str!("../../../migrations/0001_outbox.sql"),
        partitioned_sql: Some(include_str!(
            "../../../migrations/0001_outbox_partitioned.sql"
        )),
    },
    Migration {
        version: 2,
        name: "poison_outbox",
        sql: include_str!("../../../migrations/0002_poison_outbox.sql"),
        partitioned_sql: None,
    },
    Migration {
        version: 3,
        name: "publication",
        sql: include_str!("../../../migrations/0003_publication.sql"),
        partitioned_sql: None,
    },
    Migration {
        version: 4,
        name: "enqueue",
        sql: include_str!("../../../migrations/0004_enqueue.sql"),
        partitioned_sql: None,
    },
    Migration {
        version: 5,
        name: "relay_checkpoint",
        sql: include_str!("../../../migrations/0005_relay_checkpoint.sql"),
        partitioned_sql: None,
    },
    Migration {
        version: 6,
        name: "cutover",
        sql: include_str!("../../../migrations/0006_cutover.sql"),
        partitioned_sql: None,
    },
    Migration {
        version: 7,
        name: "relay_position",
        sql: include_str!("../../../migrations/0007_relay_position.sql"),
        partitioned_sql: None,
    },
    Migration {
        version: 8,
        name: "poison_dedup",
        sql: include_str!("../../../migrations/0008_poison_dedup.sql"),
        partitioned_sql: None,
    },
    Migration {
        version: 9,
        name: "parked_keys",
        sql: include_str!("../../../migrations/0009_parked_keys.sql"),
        partitioned_sql: None,
    },
    Migration {
        version: 10,
        name: "position_checkpoints",
        sql: include_str!("../../../migrations/0010_position_checkpoints.sql"),
        partitioned_sql: None,
    },
    Migration {
        version: 11,
        name: "message_outbox",
        sql: include_str!("../../../migrations/0011_message_outbox.sql"),
        partitioned_sql: None,
    },
    Migration {
        version: 12,
        name: "poison_source",
        sql: include_str!("../../../migrations/0012_poison_source.sql"),
        partitioned_sql: None,
    },
];

/// The first server version whose pgoutput sends logical decoding messages
/// (`messages 'true'`): before it, `0011` is skipped, so no `outbox_emit` exists
/// whose events the relay would never see.
const MESSAGE_OUTBOX_SINCE: i32 = 140_000;

/// Arbitrary constant for `pg_advisory_xact_lock`, so two `migrate` runs serialise.
const MIGRATION_LOCK_KEY: i64 = 0x6f75_7462_6f78; // "outbox"

/// What `apply` did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    pub applied: Vec<i32>,
    pub already: Vec<i32>,
    /// Applied in a version adapted to an existing outbox table, with what differs.
    pub adapted: Vec<(String, String)>,
    /// Not applied (not recorded either), with the reason.
    pub skipped: Vec<(String, String)>,
    /// Shard publications created (`postgres.shards > 1`, see
    /// `crate::postgres::shard_publication`).
    pub shard_publications: Vec<String>,
    /// With several `[[outbox]]` entries: what was done for each table (the lists
    /// above are then empty).
    pub per_outbox: Vec<(String, Applied)>,
    /// Outbox tables added to an existing publication (every outbox after the
    /// first: the publication migration creates it for the first).
    pub published_tables: Vec<String>,
}

impl Applied {
    /// The lines `migrate` prints: the counts, then each adaptation and skip.
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        for (table, applied) in &self.per_outbox {
            for line in applied.render().lines() {
                out.push_str(&format!("outbox {table}: {line}\n"));
            }
        }
        for table in &self.published_tables {
            out.push_str(&format!("outbox {table} added to the publication\n"));
        }
        if !self.per_outbox.is_empty() {
            return out;
        }
        out.push_str(&format!(
            "migrations: {} applied, {} already present, {} skipped\n",
            self.applied.len(),
            self.already.len(),
            self.skipped.len()
        ));
        for (name, note) in &self.adapted {
            out.push_str(&format!("migration {name} adapted: {note}\n"));
        }
        for (name, why) in &self.skipped {
            out.push_str(&format!("migration {name} skipped: {why}\n"));
        }
        for name in &self.shard_publications {
            out.push_str(&format!("shard publication {name} created\n"));
        }
        out
    }
}

/// How [`render_as`] writes the index names into a migration (see `names.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IndexNames {
    /// As `migrate` names them: within 63 bytes, quoted unless plain.
    Current,
    /// `<table>_<suffix>`, bare, as versions before `names.rs` wrote them: only to
    /// recognise the checksums those versions recorded, never run.
    Legacy,
}

/// Fills the `{{placeholders}}` of a migration from the config.
///
/// # Errors
///
/// [`Error::OpsTableName`] for a table name that is not `schema.table`,
/// [`Error::MigrationPlaceholder`] for a placeholder the config does not fill.
pub(crate) fn render(sql: &str, cfg: &Config) -> Result<String> {
    render_as(sql, cfg, IndexNames::Current)
}

/// [`render`], with the index names written as `index_names` says.
fn render_as(sql: &str, cfg: &Config, index_names: IndexNames) -> Result<String> {
    // Config validation already checked both names; a hand-built Config may not be.
    let (schema, _) = config::qualified_name(&cfg.outbox.table)?;
    let c = &cfg.outbox.columns;
    let publication = &cfg.postgres.publication;
    let literal = |s: &str| format!("'{}'", s.replace('\'', "''"));
    let publication_options = if cfg.outbox.partitioned {
        "publish = 'insert', publish_via_partition_root = true"
    } else {
        "publish = 'insert'"
    };
    let (_, table) = config::qualified_name(&cfg.outbox.table)?;
    let outbox_name = format!("{schema}.{table}");
    let vars: [(&str, String); 21] = [
        ("schema", quote_ident(&schema)),
        ("outbox_table", quote_qualified(&cfg.outbox.table)),
        (
            "poison_table_literal",
            literal(&quote_qualified(&cfg.outbox.poison_table)),
        ),
        ("poison_table", quote_qualified(&cfg.outbox.poison_table)),
        ("publication", quote_ident(publication)),
        (
            "publication_literal",
            format!("'{}'", publication.replace('\'', "''")),
        ),
        ("col_id", quote_ident(&c.id)),
        ("col_idempotency_key", quote_ident(&c.idempotency_key)),
        ("col_aggregate_type", quote_ident(&c.aggregate_type)),
        ("col_aggregate_id", quote_ident(&c.aggregate_id)),
        ("col_event_type", quote_ident(&c.event_type)),
        ("col_topic", quote_ident(&c.topic)),
        ("col_headers", quote_ident(&c.headers)),
        ("col_payload", quote_ident(&c.payload)),
        ("col_created_at", quote_ident(&c.created_at)),
        (
            "outbox_table_literal",
            literal(&quote_qualified(&cfg.outbox.table)),
        ),
        (
            "partition_interval_literal",
            literal(cfg.outbox.partition_interval.sql_unit()),
        ),
        ("partitions_ahead", cfg.outbox.partitions_ahead.to_string()),
        ("publication_options", publication_options.to_owned()),
        ("outbox_name_literal", literal(&outbox_name)),
        (
            "message_prefix_literal",
            literal(&crate::outbox::message::prefix_of(&outbox_name)),
        ),
    ];
    let mut out = sql.to_owned();
    for (name, value) in &vars {
        out = out.replace(&format!("{{{{{name}}}}}"), value);
    }
    for index in names::Index::ALL {
        let name = match index_names {
            IndexNames::Current => names::sql_name(&index.name(&cfg.outbox)?),
            IndexNames::Legacy => index.legacy_sql(&cfg.outbox)?,
        };
        out = out.replace(&format!("{{{{{}}}}}", index.placeholder()), &name);
    }
    if let Some(start) = out.find("{{") {
        let end = out[start..].find("}}").map_or(out.len(), |e| start + e + 2);
        return Err(Error::MigrationPlaceholder {
            placeholder: out[start..end].to_owned(),
        });
    }
    Ok(out)
}

/// FNV-1a of the rendered SQL: detects a migration that changed after it ran.
fn checksum(sql: &str) -> i64 {
    i64::from_ne_bytes(fnv1a(sql.as_bytes()).to_ne_bytes())
}

/// Whether `recorded` is the checksum of this migration (`template` before,
/// `sql` after rendering) as `migrate` renders it now, or as versions before
/// `names.rs` rendered it (the two differ only for a table name that needs quoting
/// or is long). Anything else means the names in the config changed since.
fn recorded_matches(recorded: i64, sql: &str, template: &str, cfg: &Config) -> Result<bool> {
    Ok(recorded == checksum(sql)
        || recorded == checksum(&render_as(template, cfg, IndexNames::Legacy)?))
}

/// 64-bit FNV-1a: a hash that never changes across builds (checksums and index
/// names are stored in databases).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Where the migrations of one outbox are recorded: the first outbox's in
/// `outbox_relay_migrations` (as before there could be several), every other's in
/// `outbox_relay_outbox_migrations`, by table.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ledger {
    First,
    Other { table: String },
}

impl Ledger {
    fn of(cfg: &Config) -> Ledger {
        if cfg.is_first_outbox() {
            Ledger::First
        } else {
            Ledger::Other {
                table: cfg.outbox.table.clone(),
            }
        }
    }

    fn create_sql(&self) -> &'static str {
        match self {
            Ledger::First => {
                "CREATE TABLE IF NOT EXISTS outbox_relay_migrations (
                     version    integer PRIMARY KEY,
                     name       text NOT NULL,
                     checksum   bigint NOT NULL,
                     applied_at timestamptz NOT NULL DEFAULT now())"
            }
            Ledger::Other { .. } => {
                "CREATE TABLE IF NOT EXISTS outbox_relay_outbox_migrations (
                     outbox     text NOT NULL,
                     version    integer NOT NULL,
                     name       text NOT NULL,
                     checksum   bigint NOT NULL,
                     applied_at timestamptz NOT NULL DEFAULT now(),
                     PRIMARY KEY (outbox, version))"
            }
        }
    }

    /// `params`, then the outbox's table for an outbox after the first (the last
    /// parameter of its statements).
    fn params<'a>(
        &'a self,
        mut params: Vec<&'a (dyn tokio_postgres::types::ToSql + Sync)>,
    ) -> Vec<&'a (dyn tokio_postgres::types::ToSql + Sync)> {
        if let Ledger::Other { table } = self {
            params.push(table);
        }
        params
    }

    fn checksum_sql(&self) -> &'static str {
        match self {
            Ledger::First => "SELECT checksum FROM outbox_relay_migrations WHERE version = $1",
            Ledger::Other { .. } => {
                "SELECT checksum FROM outbox_relay_outbox_migrations
                  WHERE version = $1 AND outbox = $2"
            }
        }
    }

    fn insert_sql(&self) -> &'static str {
        match self {
            Ledger::First => {
                "INSERT INTO outbox_relay_migrations (version, name, checksum) VALUES ($1, $2, $3)"
            }
            Ledger::Other { .. } => {
                "INSERT INTO outbox_relay_outbox_migrations (version, name, checksum, outbox)
                 VALUES ($1, $2, $3, $4)"
            }
        }
    }

    fn versions_sql(&self) -> &'static str {
        match self {
            Ledger::First => "SELECT version FROM outbox_relay_migrations",
            Ledger::Other { .. } => {
                "SELECT version FROM outbox_relay_outbox_migrations WHERE outbox = $1"
            }
        }
    }
}

/// Applies every migration not yet recorded, for every outbox. Idempotent.
pub async fn apply(client: &mut Client, cfg: &Config) -> Result<Applied> {
    if !cfg.has_several_outboxes() {
        return apply_one(client, cfg).await;
    }
    let mut result = Applied::default();
    let views = cfg.per_outbox();
    for view in &views {
        let applied = Box::pin(apply_one(client, view)).await?;
        result.per_outbox.push((view.outbox.table.clone(), applied));
    }
    for view in views.iter().skip(1) {
        if add_to_publication(client, view).await? {
            result.published_tables.push(view.outbox.table.clone());
        }
    }
    Ok(result)
}

/// Adds an outbox after the first to the publication the first one's migration
/// created, unless it is there already; whether it added it.
async fn add_to_publication(client: &Client, view: &Config) -> Result<bool> {
    let (schema, table) = config::qualified_name(&view.outbox.table)?;
    let publication = &view.postgres.publication;
    let member = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_tables
                             WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)",
            &[publication, &schema, &table],
        )
        .await?
        .try_get::<_, bool>(0)?;
    if member {
        return Ok(false);
    }
    // The publication decides what a change is decoded as when it is decoded, so a
    // table added under an existing slot has its earlier rows outside the stream, and
    // a relay streaming without it skips its new rows while confirming past them.
    let slots = view.postgres.all_slot_names();
    let existing: Vec<String> = client
        .query(
            "SELECT slot_name::text FROM pg_replication_slots
              WHERE slot_name = ANY($1::text[]) AND database = current_database()",
            &[&slots],
        )
        .await?
        .iter()
        .map(|row| row.try_get(0))
        .collect::<std::result::Result<_, _>>()?;
    if !existing.is_empty() {
        return Err(crate::config::ConfigError::Invalid(format!(
            "outbox {} is not in publication {publication}, whose slot {} exists: its rows \
             committed so far would never be streamed, and a relay running now would skip \
             its new ones. Serve it with a relay of its own (its own postgres.slot and \
             postgres.publication), or add it when the relay's slot is created \
             (docs/configuration.md#adding-an-outbox-later)",
            view.outbox.table,
            existing.join(", ")
        ))
        .into());
    }
    if view.outbox.partitioned {
        // Inserts into its partitions are then published under the outbox's name,
        // as the first outbox's migration does for a partitioned first outbox.
        client
            .batch_execute(&format!(
                "ALTER PUBLICATION {} SET (publish = 'insert', publish_via_partition_root = true)",
                quote_ident(publication)
            ))
            .await?;
    }
    client
        .batch_execute(&format!(
            "ALTER PUBLICATION {} ADD TABLE {}",
            quote_ident(publication),
            quote_qualified(&view.outbox.table)
        ))
        .await?;
    tracing::info!(publication = %publication, table = %view.outbox.table, "outbox added to the publication");
    Ok(true)
}

/// The earlier outbox in the same schema, if any: its migrations made the schema's
/// `outbox_enqueue`, which writes to that outbox, so this one's must not replace it.
fn shares_enqueue_schema(cfg: &Config) -> Option<String> {
    let (schema, _) = config::qualified_name(&cfg.outbox.table).ok()?;
    cfg.earlier_outboxes()
        .iter()
        .find(|earlier| config::qualified_name(earlier).is_ok_and(|(s, _)| s == schema))
        .cloned()
}

async fn server_version(client: &Client) -> Result<i32> {
    Ok(client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await?
        .try_get(0)?)
}

/// How migration `m` applies to this outbox: as written, adapted to an existing
/// table, or not at all (with why).
fn step_for(
    m: &Migration,
    cfg: &Config,
    existing: Option<&adopt::Existing>,
    server_version: i32,
) -> Result<adopt::Step> {
    Ok(match m.version {
        1 => adopt::outbox_table(cfg, existing, m.sql_for(cfg))?,
        4 => match shares_enqueue_schema(cfg) {
            Some(first) => adopt::Step::Skipped(format!(
                "outbox_enqueue in this schema writes to {first}; write events to {} \
                 with INSERT",
                cfg.outbox.table
            )),
            None => adopt::enqueue(cfg, existing),
        },
        11 if server_version < MESSAGE_OUTBOX_SINCE => adopt::Step::Skipped(
            "the message outbox needs PostgreSQL 14 (pgoutput's messages option)".to_owned(),
        ),
        11 if cfg.postgres.shards > 1 => adopt::Step::Skipped(
            "the message outbox is not sharded: a message is not filtered by the shards' \
             publications, so every shard would relay it"
                .to_owned(),
        ),
        11 => match shares_enqueue_schema(cfg) {
            Some(first) => adopt::Step::Skipped(format!(
                "outbox_emit in this schema emits events of {first}; emit events of {} \
                 with pg_logical_emit_message and the frame of \
                 docs/architecture.md#the-message-outbox",
                cfg.outbox.table
            )),
            None => adopt::message_outbox(cfg, existing),
        },
        _ => adopt::Step::Standard,
    })
}

/// Applies every migration of one outbox not yet recorded. Idempotent.
async fn apply_one(client: &mut Client, cfg: &Config) -> Result<Applied> {
    let ledger = Ledger::of(cfg);
    client.batch_execute(ledger.create_sql()).await?;
    let mut result = Applied::default();
    let existing = adopt::inspect(client, cfg).await?;
    let server_version = server_version(client).await?;
    for m in MIGRATIONS {
        let label = format!("{:04}_{}", m.version, m.name);
        let standard = m.sql_for(cfg);
        let step = step_for(m, cfg, existing.as_ref(), server_version)?;
        let (template, adapted) = match step {
            adopt::Step::Standard => (standard.to_owned(), None),
            adopt::Step::Adapted { sql, note } => (sql, Some(note)),
            adopt::Step::Skipped(why) => {
                tracing::warn!(migration = %label, reason = %why, "migration skipped");
                result.skipped.push((label, why));
                continue;
            }
        };
        let sql = render(&template, cfg)?;
        let tx = client.transaction().await?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK_KEY])
            .await?;
        let done = tx
            .query_opt(ledger.checksum_sql(), &ledger.params(vec![&m.version]))
            .await?;
        if let Some(row) = done {
            let recorded: i64 = row.try_get(0)?;
            if !recorded_matches(recorded, &sql, &template, cfg)? {
                tracing::warn!(
                    version = m.version,
                    name = m.name,
                    "migration already applied with different SQL (names in config changed?); not re-running"
                );
            }
            result.already.push(m.version);
            continue;
        }
        tx.batch_execute(&sql)
            .await
            .map_err(|source| Error::MigrationFailed {
                version: m.version,
                name: m.name,
                detail: crate::postgres::describe_error(&source),
                source,
            })?;
        tx.execute(
            ledger.insert_sql(),
            &ledger.params(vec![&m.version, &m.name, &checksum(&sql)]),
        )
        .await?;
        tx.commit().await?;
        tracing::info!(version = m.version, name = m.name, "migration applied");
        result.applied.push(m.version);
        if let Some(note) = adapted {
            result.adapted.push((label, note));
        }
    }
    // After the outbox and its base publication: not numbered, because what it
    // creates depends on `postgres.shards`.
    result.shard_publications = crate::postgres::shard_publication::ensure(client, cfg).await?;
    Ok(result)
}

/// The migrations [`apply`] would run now, as `NNNN_name` labels: those not
/// recorded in `outbox_relay_migrations` (all of them when it does not exist) and
/// not skipped for the outbox table as it is (`check` and `run` ask this).
///
/// # Errors
///
/// A failed query (a role without `SELECT` on `outbox_relay_migrations` gets
/// SQLSTATE 42501), or an existing outbox the config cannot describe.
pub async fn pending(client: &Client, cfg: &Config) -> Result<Vec<String>> {
    if cfg.has_several_outboxes() {
        let mut out = Vec::new();
        for view in cfg.per_outbox() {
            for label in Box::pin(pending(client, &view)).await? {
                out.push(format!("{label} ({})", view.outbox.table));
            }
        }
        return Ok(out);
    }
    let ledger = Ledger::of(cfg);
    let recorded: Vec<i32> = match client
        .query(ledger.versions_sql(), &ledger.params(Vec::new()))
        .await
    {
        Ok(rows) => rows
            .iter()
            .map(|r| r.try_get(0))
            .collect::<std::result::Result<_, _>>()?,
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => Vec::new(),
        Err(e) => return Err(e.into()),
    };
    let existing = adopt::inspect(client, cfg).await?;
    let server_version = server_version(client).await?;
    let mut out = Vec::new();
    for m in MIGRATIONS.iter().filter(|m| !recorded.contains(&m.version)) {
        let step = step_for(m, cfg, existing.as_ref(), server_version)?;
        if !matches!(step, adopt::Step::Skipped(_)) {
            out.push(format!("{:04}_{}", m.version, m.name));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::test_config as cfg;

    #[test]
    fn every_placeholder_is_known() {
        let c = cfg("");
        let p = cfg("[outbox]\npartitioned = true\n");
        for m in MIGRATIONS {
            let sql = render(m.sql, &c).unwrap();
            assert!(!sql.contains("{{"), "{}", m.name);
            let sql = render(m.sql_for(&p), &p).unwrap();
            assert!(!sql.contains("{{"), "{}", m.name);
        }
    }

    #[test]
    fn plain_outbox_sql_is_unchanged_by_the_partitioning_option() {
        // Databases migrated before the option existed keep their checksums.
        let c = cfg("");
        let publication = render(MIGRATIONS[2].sql, &c).unwrap();
        assert!(
            publication.contains("WITH (publish = 'insert');"),
            "{publication}"
        );
        assert_eq!(MIGRATIONS[0].sql_for(&c), MIGRATIONS[0].sql);
    }

    #[test]
    fn partitioned_outbox_is_range_partitioned_and_published_via_root() {
        let c = cfg(
            "[outbox]\ntable = \"app.events\"\npartitioned = true\npartition_interval = \"hour\"\n",
        );
        let table = render(MIGRATIONS[0].sql_for(&c), &c).unwrap();
        assert!(
            table.contains("PARTITION BY RANGE (\"created_at\")"),
            "{table}"
        );
        assert!(
            table.contains("PRIMARY KEY (\"id\", \"created_at\")"),
            "{table}"
        );
        assert!(
            table.contains(
                "outbox_relay_ensure_partitions(\n    '\"app\".\"events\"'::regclass, 'hour', 3)"
            ),
            "{table}"
        );
        let publication = render(MIGRATIONS[2].sql, &c).unwrap();
        assert!(publication.contains("publish_via_partition_root = true"));
    }

    #[test]
    fn enqueue_function_uses_configured_names() {
        let c = cfg(
            "[outbox]\ntable = \"app.events\"\n[outbox.columns]\nidempotency_key = \"dedupe\"\n",
        );
        let sql = render(MIGRATIONS[3].sql, &c).unwrap();
        assert!(sql.contains("FUNCTION \"app\".outbox_enqueue("), "{sql}");
        assert!(sql.contains("INSERT INTO \"app\".\"events\" AS o"), "{sql}");
        assert!(sql.contains("RETURNING o.\"dedupe\""), "{sql}");
    }

    #[test]
    fn names_come_from_config() {
        let c = cfg(
            "[outbox]\ntable = \"app.events\"\n[outbox.columns]\naggregate_id = \"aggregateid\"\n",
        );
        let sql = render(MIGRATIONS[0].sql, &c).unwrap();
        assert!(sql.contains("\"app\".\"events\""));
        assert!(sql.contains("\"aggregateid\""));
        // Bare, as before index names were computed: the same SQL, the same checksum.
        assert!(
            sql.contains("CREATE INDEX IF NOT EXISTS events_unsent_idx\n"),
            "{sql}"
        );
    }

    #[test]
    fn default_names_render_the_sql_earlier_versions_recorded() {
        // Checksums recorded by `migrate` before index names were computed: an
        // installation with plain names must see the same SQL, or `migrate` warns.
        let recorded: [(usize, i64); 4] = [
            (0, 7_896_810_129_725_535_395),
            (1, 8_357_278_350_221_042_888),
            (7, 2_881_431_604_909_798_034),
            (8, 4_604_766_812_397_827_512),
        ];
        let c = cfg("");
        for (m, sum) in recorded {
            assert_eq!(
                checksum(&render(MIGRATIONS[m].sql, &c).unwrap()),
                sum,
                "{m}"
            );
        }
        let p = cfg("[outbox]\npartitioned = true\n");
        let sql = render(MIGRATIONS[0].sql_for(&p), &p).unwrap();
        assert_eq!(checksum(&sql), -2_990_221_139_848_938_183);
    }

    #[test]
    fn checksums_of_names_written_bare_before_are_recognised() {
        // Capitals worked before (folded, unquoted); the SQL is quoted now.
        let c = cfg("[outbox]\ntable = \"app.Events\"\n");
        let template = MIGRATIONS[0].sql;
        let sql = render(template, &c).unwrap();
        let before = render_as(template, &c, IndexNames::Legacy).unwrap();
        assert!(
            before.contains("CREATE INDEX IF NOT EXISTS Events_unsent_idx\n"),
            "{before}"
        );
        assert_ne!(checksum(&sql), checksum(&before));
        assert!(recorded_matches(checksum(&before), &sql, template, &c).unwrap());
        assert!(recorded_matches(checksum(&sql), &sql, template, &c).unwrap());
        let other = render(template, &cfg("[outbox]\ntable = \"app.other\"\n")).unwrap();
        assert!(!recorded_matches(checksum(&other), &sql, template, &c).unwrap());
    }

    #[test]
    fn index_names_are_quoted_unless_plain() {
        let c = cfg(
            "[outbox]\ntable = \"app.Order-Events\"\npoison_table = \"app.x; DROP TABLE t; --\"\n",
        );
        let sql = render(MIGRATIONS[0].sql, &c).unwrap();
        assert!(
            sql.contains("CREATE INDEX IF NOT EXISTS \"Order-Events_unsent_idx\"\n"),
            "{sql}"
        );
        for (m, suffix) in [(1, "key_idx"), (7, "occurrence_key"), (8, "key_order_idx")] {
            let sql = render(MIGRATIONS[m].sql, &c).unwrap();
            let quoted = format!("IF NOT EXISTS \"x; DROP TABLE t; --_{suffix}\"");
            assert!(sql.contains(&quoted), "{sql}");
        }
    }

    #[test]
    fn long_table_names_get_index_names_postgresql_keeps() {
        let table = "e".repeat(63);
        let c = cfg(&format!(
            "[outbox]\ntable = \"{table}\"\npoison_table = \"{table}\"\n"
        ));
        for index in names::Index::ALL {
            let name = index.name(&c.outbox).unwrap();
            assert_eq!(name.len(), names::MAX_IDENTIFIER_BYTES, "{name}");
            let m = match index {
                names::Index::OutboxUnsent => 0,
                names::Index::PoisonKey => 1,
                names::Index::PoisonOccurrence => 7,
                names::Index::PoisonKeyOrder => 8,
            };
            let sql = render(MIGRATIONS[m].sql, &c).unwrap();
            assert!(sql.contains(&format!("IF NOT EXISTS {name}")), "{sql}");
        }
    }

    #[test]
    fn versions_are_increasing() {
        assert!(MIGRATIONS.windows(2).all(|w| w[0].version < w[1].version));
    }

    #[test]
    fn unknown_placeholder_is_an_error() {
        let err = render("SELECT {{nope}}", &cfg("")).unwrap_err();
        assert!(
            matches!(&err, Error::MigrationPlaceholder { placeholder } if placeholder == "{{nope}}"),
            "{err}"
        );
        assert_eq!(
            err.to_string(),
            "migration has an unknown placeholder {{nope}}"
        );
    }
}
