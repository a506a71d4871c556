//! Prerequisites and the replication slot.
//!
//! Before streaming, the relay checks what would otherwise surface as an obscure
//! error deep in the stream: `wal_level = logical`, the publication exists and
//! covers the outbox table, the poison table exists. Each failure is one clear
//! message and exit code 3.
//!
//! The slot is created (`CREATE_REPLICATION_SLOT … LOGICAL pgoutput`) when missing.
//! When it exists but another process streams from it (`active_pid` set), the relay
//! waits up to `relay.slot_busy_timeout_secs`: right after a `kill -9` the old
//! walsender holds the slot until it notices the dead socket (at most
//! `wal_sender_timeout`), and a second relay on the same config is a standby, not
//! a competitor. A slot whose WAL was removed (`wal_status = 'lost'`) is invalidated
//! and cannot be streamed from: that is fatal, and the message says how to recover.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::config::{Config, qualified_name};
use crate::lifecycle::Backoff;
use crate::lsn::Lsn;
use crate::postgres::error::PgError;
use crate::postgres::prerequisite::{POISON_TABLE_NEWEST_COLUMN, Prerequisite};
use crate::postgres::replication::{CreatedSlot, ReplicationConnection, SnapshotAction};

/// Facts about the server the relay needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prerequisites {
    pub server_version: String,
    /// `server_version_num`, e.g. 150018.
    pub server_version_num: u32,
    /// `wal_sender_timeout`; zero means disabled.
    pub wal_sender_timeout: Duration,
}

impl Prerequisites {
    /// How often to send a standby status update: well inside `wal_sender_timeout`
    /// (a third of it, so a missed tick still leaves margin), at most 10 s.
    #[must_use]
    pub fn status_interval(&self) -> Duration {
        let ceiling = Duration::from_secs(10);
        if self.wal_sender_timeout.is_zero() {
            return ceiling;
        }
        (self.wal_sender_timeout / 3).clamp(Duration::from_millis(100), ceiling)
    }
}

/// Checks wal_level, the publication and the tables.
pub async fn check_prerequisites(
    client: &Client,
    config: &Config,
) -> Result<Prerequisites, PgError> {
    let row = client
        .query_one(
            "SELECT current_setting('wal_level'), current_setting('server_version'),
                    (SELECT setting::bigint FROM pg_settings WHERE name = 'wal_sender_timeout'),
                    current_setting('server_version_num')::int4",
            &[],
        )
        .await
        .map_err(|source| PgError::Query {
            context: "cannot read server settings: ",
            source,
        })?;
    let wal_level: String = row.get(0);
    let server_version: String = row.get(1);
    let timeout_ms: Option<i64> = row.get(2);
    let server_version_num = u32::try_from(row.get::<_, i32>(3)).unwrap_or(0);
    if wal_level != "logical" {
        return Err(Prerequisite::WalLevel { actual: wal_level }.into());
    }
    let publication = &config.postgres.publication_name();
    let slot_name = config.postgres.slot_name();
    let slot_exists = slot_info(client, &slot_name).await?.is_some();
    for outbox in config.outboxes() {
        let slot_under = slot_exists.then_some(slot_name.as_str());
        check_outbox_tables(client, publication, outbox, slot_under).await?;
    }
    super::shard_publication::verify(client, config).await?;
    let wal_sender_timeout =
        Duration::from_millis(u64::try_from(timeout_ms.unwrap_or(60_000)).unwrap_or(0));
    Ok(Prerequisites {
        server_version,
        server_version_num,
        wal_sender_timeout,
    })
}

/// The slot's server is one the relay can use: a standby only as `postgres.slot_url`
/// (the writes go to `postgres.url`), and then of PostgreSQL 16 or later. A standby
/// without `hot_standby_feedback` is allowed but said: the primary may then remove
/// catalog rows the slot still needs, which invalidates it (`relay.on_slot_loss`
/// decides what follows); `outbox-relay check` says it too.
///
/// # Errors
///
/// [`Prerequisite::WritesOnStandby`], [`Prerequisite::StandbyTooOld`], or the query's.
pub async fn check_slot_server(client: &Client, config: &Config) -> Result<(), PgError> {
    let row = client
        .query_one(
            "SELECT pg_is_in_recovery(), current_setting('server_version'),
                    current_setting('server_version_num')::int4,
                    current_setting('hot_standby_feedback')::bool",
            &[],
        )
        .await
        .map_err(|source| PgError::Query {
            context: "cannot read server settings: ",
            source,
        })?;
    let (in_recovery, server_version, version_num, feedback): (bool, String, i32, bool) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    if !in_recovery {
        return Ok(());
    }
    if !config.postgres.slot_elsewhere() {
        return Err(Prerequisite::WritesOnStandby.into());
    }
    if version_num < LOGICAL_ON_STANDBY_SINCE {
        return Err(Prerequisite::StandbyTooOld { server_version }.into());
    }
    if !feedback {
        tracing::warn!(
            "postgres.slot_url is a standby with hot_standby_feedback = off: the primary may remove \
             rows the slot still needs, and the slot is then invalidated (relay.on_slot_loss \
             decides what follows); set hot_standby_feedback = on on the standby"
        );
    }
    Ok(())
}

/// The server the writes go to, when the slot lives elsewhere (`postgres.slot_url`),
/// is not in recovery: the relay's position, poison rows and heartbeats are written
/// there.
///
/// # Errors
///
/// [`Prerequisite::WritesOnStandby`], or the query's.
pub async fn check_writes_server(client: &Client) -> Result<(), PgError> {
    let in_recovery: bool = client
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await
        .map_err(|source| PgError::Query {
            context: "cannot read the primary's state: ",
            source,
        })?
        .get(0);
    if in_recovery {
        return Err(Prerequisite::WritesOnStandby.into());
    }
    Ok(())
}

/// Logical decoding on a standby exists since PostgreSQL 16.
pub const LOGICAL_ON_STANDBY_SINCE: i32 = 160_000;

/// One outbox's tables: the outbox exists and is in the publication, its poison
/// table exists and is upgraded. `slot_under`: the relay's slot, when it exists.
async fn check_outbox_tables(
    client: &Client,
    publication: &str,
    outbox: &crate::config::OutboxConfig,
    slot_under: Option<&str>,
) -> Result<(), PgError> {
    let publication = &publication.to_owned();
    let (schema, table) = qualified_name(&outbox.table)?;
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1),
                    EXISTS (SELECT 1 FROM pg_publication_tables
                            WHERE pubname = $1 AND schemaname = $2 AND tablename = $3),
                    to_regclass($4) IS NOT NULL,
                    to_regclass($5) IS NOT NULL,
                    EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($5)
                            AND attname = $6 AND NOT attisdropped)",
            &[
                publication,
                &schema,
                &table,
                &crate::config::quote_qualified(&outbox.table),
                &crate::config::quote_qualified(&outbox.poison_table),
                &POISON_TABLE_NEWEST_COLUMN,
            ],
        )
        .await
        .map_err(|source| PgError::Query {
            context: "cannot check the publication: ",
            source,
        })?;
    let (has_publication, covers_outbox, has_outbox, has_poison, poison_upgraded): (
        bool,
        bool,
        bool,
        bool,
        bool,
    ) = (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    if !has_outbox {
        return Err(Prerequisite::OutboxTableMissing {
            table: outbox.table.clone(),
        }
        .into());
    }
    if !has_publication {
        return Err(Prerequisite::PublicationMissing {
            publication: publication.clone(),
            table: outbox.table.clone(),
        }
        .into());
    }
    if !covers_outbox {
        if let Some(slot) = slot_under.map(str::to_owned) {
            return Err(Prerequisite::PublicationLacksTableUnderSlot {
                publication: publication.clone(),
                table: outbox.table.clone(),
                slot,
            }
            .into());
        }
        return Err(Prerequisite::PublicationLacksTable {
            publication: publication.clone(),
            table: outbox.table.clone(),
        }
        .into());
    }
    if !has_poison {
        return Err(Prerequisite::PoisonTableMissing {
            table: outbox.poison_table.clone(),
        }
        .into());
    }
    if !poison_upgraded {
        return Err(Prerequisite::PoisonTableOutdated {
            table: outbox.poison_table.clone(),
            column: POISON_TABLE_NEWEST_COLUMN.to_owned(),
        }
        .into());
    }
    Ok(())
}

/// The slot, ready to stream from.
#[derive(Debug)]
pub enum SlotState {
    /// Created now; stream from its consistent point.
    Created(CreatedSlot),
    /// Existed and is free; stream from its confirmed LSN.
    Existing { confirmed_flush: Lsn },
}

/// One row of `pg_replication_slots`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    pub plugin: Option<String>,
    pub database: Option<String>,
    pub active_pid: Option<i32>,
    pub confirmed_flush: Option<Lsn>,
    pub wal_status: Option<String>,
    /// `invalidation_reason` (PostgreSQL 17+), or `"conflicting"` when PostgreSQL 16
    /// says the slot conflicted with recovery; `None` when valid or not said.
    pub invalidation_reason: Option<String>,
}

/// Reads the slot's row, `None` when it does not exist.
pub async fn slot_info(client: &Client, slot: &str) -> Result<Option<SlotInfo>, PgError> {
    let row = client
        .query_opt(
            // Columns of some versions only, read through jsonb (NULL when absent).
            "SELECT plugin::text, database::text, active_pid, confirmed_flush_lsn::text, wal_status,
                    COALESCE(to_jsonb(s) ->> 'invalidation_reason',
                             CASE WHEN (to_jsonb(s) ->> 'conflicting')::bool THEN 'conflicting' END)
             FROM pg_replication_slots s WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|source| PgError::SlotQuery {
            context: "cannot read pg_replication_slots: ",
            source,
        })?;
    let Some(row) = row else { return Ok(None) };
    let confirmed: Option<String> = row.get(3);
    Ok(Some(SlotInfo {
        plugin: row.get(0),
        database: row.get(1),
        active_pid: row.get(2),
        confirmed_flush: confirmed.and_then(|s| s.parse().ok()),
        wal_status: row.get(4),
        invalidation_reason: row.get(5),
    }))
}

/// Makes sure `slot` exists, is a pgoutput slot of this database, is not
/// invalidated, and is not streamed by another process (waiting up to `busy_timeout`
/// for that one).
pub async fn wait_for_slot(
    conn: &mut ReplicationConnection,
    client: &Client,
    slot: &str,
    busy_timeout: Duration,
) -> Result<SlotState, PgError> {
    let started = Instant::now();
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    let mut logged = false;
    loop {
        let Some(info) = slot_info(client, slot).await? else {
            match conn
                .create_logical_slot(slot, false, SnapshotAction::NoExport)
                .await
            {
                Ok(created) => return Ok(SlotState::Created(created)),
                // Someone else created it between our look and our create.
                Err(e) if e.is_duplicate_object() => continue,
                Err(e) => {
                    return Err(Prerequisite::SlotNotCreated {
                        slot: slot.to_owned(),
                        reason: e.to_string(),
                    }
                    .into());
                }
            }
        };
        check_slot(slot, &info, client).await?;
        match info.active_pid {
            None => {
                let confirmed_flush = info.confirmed_flush.unwrap_or(Lsn::ZERO);
                return Ok(SlotState::Existing { confirmed_flush });
            }
            Some(pid) if started.elapsed() < busy_timeout => {
                if !logged {
                    tracing::warn!(
                        slot,
                        active_pid = pid,
                        wait_secs = busy_timeout.as_secs(),
                        "replication slot is active in another process; waiting for it"
                    );
                    logged = true;
                }
                tokio::time::sleep(backoff.next_pause()).await;
            }
            Some(pid) => {
                return Err(Prerequisite::SlotBusy {
                    slot: slot.to_owned(),
                    pid,
                    waited_secs: busy_timeout.as_secs(),
                }
                .into());
            }
        }
    }
}

async fn check_slot(slot: &str, info: &SlotInfo, client: &Client) -> Result<(), PgError> {
    if info.plugin.as_deref() != Some("pgoutput") {
        return Err(Prerequisite::SlotPlugin {
            slot: slot.to_owned(),
            plugin: info.plugin.clone().unwrap_or_else(|| "none".to_owned()),
        }
        .into());
    }
    let current: String = client
        .query_one("SELECT current_database()::text", &[])
        .await
        .map_err(|source| PgError::SlotQuery {
            context: "",
            source,
        })?
        .get(0);
    if info.database.as_deref() != Some(current.as_str()) {
        return Err(Prerequisite::SlotDatabase {
            slot: slot.to_owned(),
            database: info.database.clone().unwrap_or_default(),
            current,
        }
        .into());
    }
    if info.wal_status.as_deref() == Some("lost") {
        return Err(Prerequisite::SlotInvalidated {
            slot: slot.to_owned(),
        }
        .into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_interval_is_well_inside_the_sender_timeout() {
        let p = |ms| Prerequisites {
            server_version: "15".into(),
            server_version_num: 150_000,
            wal_sender_timeout: Duration::from_millis(ms),
        };
        assert_eq!(p(10_000).status_interval(), Duration::from_secs(10) / 3);
        assert_eq!(p(60_000).status_interval(), Duration::from_secs(10));
        assert_eq!(p(0).status_interval(), Duration::from_secs(10));
        assert_eq!(p(30).status_interval(), Duration::from_millis(100));
    }
}
