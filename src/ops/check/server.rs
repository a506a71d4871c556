//! The server's side of a deploy: the connection and its encryption, `wal_level`,
//! a free replication slot and WAL sender, the slot's state and how much WAL it
//! may keep.
//!
//! Free slots and senders are counted as the server counts them
//! (`max_replication_slots` against `pg_replication_slots`, `max_wal_senders`
//! against `pg_stat_replication`); the relay needs one of each, except what its
//! own slot already holds: an existing slot takes no new slot, and a slot streamed
//! by another relay hands its sender over when that relay stops (the standby case).

use tokio_postgres::Client;

use super::Check;
use crate::config::{Config, SlotLossMode};
use crate::postgres::conninfo::{ConnInfo, SslMode};

const MB: i64 = 1024 * 1024;

/// `postgres.connection`: who we are connected as, and to what.
pub(super) async fn connection(client: &Client, info: &ConnInfo) -> Check {
    const NAME: &str = "postgres.connection";
    match client
        .query_one(
            "SELECT current_user::text, current_setting('server_version')",
            &[],
        )
        .await
    {
        Ok(row) => {
            let user: String = row.get(0);
            let version: String = row.get(1);
            Check::ok(NAME, format!("{info} as {user}, PostgreSQL {version}"))
        }
        Err(e) => Check::query_failed(NAME, "cannot read the server version", &e),
    }
}

/// `postgres.tls`: whether the connection is encrypted, and whether the server's
/// certificate was verified.
pub(super) async fn tls(client: &Client, info: &ConnInfo) -> Check {
    const NAME: &str = "postgres.tls";
    let row = match client
        .query_opt(
            "SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
    {
        Ok(row) => row,
        Err(e) => return Check::query_failed(NAME, "cannot read pg_stat_ssl", &e),
    };
    let (ssl, version): (bool, Option<String>) =
        row.map_or((false, None), |r| (r.get(0), r.get(1)));
    let mode = info.sslmode();
    let fix = "set sslmode=verify-full and sslrootcert=<the CA's file> in postgres.url \
               (docs/configuration.md#the-password)";
    match (ssl, mode) {
        (true, SslMode::VerifyCa | SslMode::VerifyFull) => Check::ok(
            NAME,
            format!(
                "encrypted ({}), sslmode={mode}: the server's certificate is verified",
                version.unwrap_or_default()
            ),
        ),
        (true, _) => Check::warn(
            NAME,
            format!(
                "encrypted ({}), but sslmode={mode} does not verify the server's certificate",
                version.unwrap_or_default()
            ),
            fix,
        ),
        (false, _) => Check::warn(
            NAME,
            format!(
                "not encrypted (sslmode={mode}): the password and every event cross the \
                 network in clear"
            ),
            fix,
        ),
    }
}

/// `postgres.wal_level`: logical decoding needs `logical`.
pub(super) async fn wal_level(client: &Client) -> Check {
    const NAME: &str = "postgres.wal_level";
    match client
        .query_one("SELECT current_setting('wal_level')", &[])
        .await
    {
        Ok(row) => {
            let level: String = row.get(0);
            if level == "logical" {
                Check::ok(NAME, "logical")
            } else {
                Check::problem(
                    NAME,
                    format!("wal_level is '{level}'; logical replication needs logical"),
                    "ALTER SYSTEM SET wal_level = logical (or set it in postgresql.conf), \
                     then restart PostgreSQL",
                )
            }
        }
        Err(e) => Check::query_failed(NAME, "cannot read wal_level", &e),
    }
}

/// `postgres.replication_slots`: a free slot, unless ours exists.
pub(super) async fn free_slots(client: &Client, config: &Config) -> Check {
    const NAME: &str = "postgres.replication_slots";
    let slot = &config.postgres.slot_name();
    let row = match client
        .query_one(
            "SELECT current_setting('max_replication_slots')::int8,
                    (SELECT count(*) FROM pg_replication_slots),
                    EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)",
            &[slot],
        )
        .await
    {
        Ok(row) => row,
        Err(e) => return Check::query_failed(NAME, "cannot count replication slots", &e),
    };
    let (max, used, ours): (i64, i64, bool) = (row.get(0), row.get(1), row.get(2));
    if ours {
        Check::ok(NAME, format!("slot {slot} exists ({used} of {max} in use)"))
    } else if used >= max {
        Check::problem(
            NAME,
            format!(
                "no free replication slot for {slot}: {used} of max_replication_slots = {max} in use"
            ),
            "raise max_replication_slots (restart needed), or drop a slot nobody uses \
             (SELECT slot_name, active, wal_status FROM pg_replication_slots)",
        )
    } else {
        Check::ok(
            NAME,
            format!("{used} of {max} in use; `run` creates slot {slot}"),
        )
    }
}

/// `postgres.wal_senders`: a free WAL sender for the relay's replication connection.
pub(super) async fn free_senders(client: &Client, config: &Config) -> Check {
    const NAME: &str = "postgres.wal_senders";
    let row = match client
        .query_one(
            "SELECT current_setting('max_wal_senders')::int8,
                    (SELECT count(*) FROM pg_stat_replication),
                    (SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1)",
            &[&config.postgres.slot_name()],
        )
        .await
    {
        Ok(row) => row,
        Err(e) => return Check::query_failed(NAME, "cannot count WAL senders", &e),
    };
    let (max, used, active): (i64, i64, Option<i32>) = (row.get(0), row.get(1), row.get(2));
    let fix = "raise max_wal_senders (restart needed), or stop a replication client \
               (SELECT pid, application_name, state FROM pg_stat_replication)";
    if max == 0 {
        return Check::problem(
            NAME,
            "max_wal_senders = 0: no replication connection is possible",
            fix,
        );
    }
    match active {
        Some(pid) => Check::ok(
            NAME,
            format!(
                "{used} of {max} in use; the slot's sender (pid {pid}) is handed over when \
                 the relay streaming now stops"
            ),
        ),
        None if used >= max => Check::problem(
            NAME,
            format!("no free WAL sender: {used} of max_wal_senders = {max} in use"),
            fix,
        ),
        None => Check::ok(NAME, format!("{used} of {max} in use")),
    }
}

/// `postgres.slot`: the slot's state when it exists (plugin, database, `wal_status`,
/// `safe_wal_size`, who streams from it).
pub(super) async fn slot(client: &Client, config: &Config) -> Check {
    const NAME: &str = "postgres.slot";
    let slot = &config.postgres.slot_name();
    let row = match client
        .query_opt(
            "SELECT plugin::text, database::text, current_database()::text, active_pid,
                    wal_status, safe_wal_size,
                    CASE WHEN pg_is_in_recovery() THEN NULL
                         ELSE (pg_current_wal_lsn() - restart_lsn)::int8 END
             FROM pg_replication_slots WHERE slot_name = $1",
            &[slot],
        )
        .await
    {
        Ok(row) => row,
        Err(e) => return Check::query_failed(NAME, "cannot read pg_replication_slots", &e),
    };
    let Some(row) = row else {
        return Check::ok(
            NAME,
            format!("{slot} does not exist yet; `run` creates it (pgoutput)"),
        );
    };
    let plugin: Option<String> = row.get(0);
    let database: Option<String> = row.get(1);
    let current: String = row.get(2);
    let active: Option<i32> = row.get(3);
    let wal_status: Option<String> = row.get(4);
    let safe: Option<i64> = row.get(5);
    let retained: Option<i64> = row.get(6);
    let other_slot = "set postgres.slot to a name of its own, or drop that slot if nothing uses it";
    if plugin.as_deref() != Some("pgoutput") {
        return Check::problem(
            NAME,
            format!(
                "{slot} uses plugin {}, not pgoutput",
                plugin.as_deref().unwrap_or("none (a physical slot)")
            ),
            other_slot,
        );
    }
    if database.as_deref() != Some(current.as_str()) {
        return Check::problem(
            NAME,
            format!(
                "{slot} belongs to database {}, not {current}",
                database.unwrap_or_default()
            ),
            other_slot,
        );
    }
    let status = wal_status.unwrap_or_else(|| "unknown".to_owned());
    let sizes = format!(
        "retains {}, safe_wal_size {}",
        retained.map_or_else(|| "?".to_owned(), |b| format!("{} MB", b / MB)),
        safe.map_or_else(|| "unlimited".to_owned(), |b| format!("{} MB", b / MB)),
    );
    match status.as_str() {
        "lost" => {
            let fix = match config.relay.on_slot_loss {
                SlotLossMode::Resync => {
                    "`run` heals it from its saved position (relay.on_slot_loss = \"resync\", \
                     docs/operations.md#a-lost-slot); without one, drop the slot and cut over"
                }
                SlotLossMode::Fail => {
                    "relay.on_slot_loss = \"fail\": `run` stops; set it to \"resync\", or drop \
                     the slot and cut over (docs/operations.md#a-lost-slot)"
                }
            };
            Check::problem(
                NAME,
                format!(
                    "{slot} was invalidated (wal_status = lost): the WAL it needed is gone, \
                     see max_slot_wal_keep_size"
                ),
                fix,
            )
        }
        "unreserved" => Check::warn(
            NAME,
            format!(
                "{slot} is about to be invalidated (wal_status = unreserved): it retains more \
                 than max_slot_wal_keep_size; {sizes}"
            ),
            "start the relay now, or raise max_slot_wal_keep_size",
        ),
        _ => {
            let who = active.map_or_else(
                || "not streamed now".to_owned(),
                |pid| format!("streamed by pid {pid} (this relay would wait as a standby)"),
            );
            Check::ok(NAME, format!("{slot}: wal_status {status}, {sizes}, {who}"))
        }
    }
}

/// `postgres.max_slot_wal_keep_size`: `-1` lets a stopped relay's slot keep WAL
/// until the disk is full.
pub(super) async fn max_slot_wal_keep_size(client: &Client, config: &Config) -> Check {
    const NAME: &str = "postgres.max_slot_wal_keep_size";
    let row = match client
        .query_opt(
            "SELECT setting::int8 FROM pg_settings WHERE name = 'max_slot_wal_keep_size'",
            &[],
        )
        .await
    {
        Ok(row) => row,
        Err(e) => return Check::query_failed(NAME, "cannot read max_slot_wal_keep_size", &e),
    };
    // pg_settings reports it in MB; the setting does not exist before PostgreSQL 13.
    match row.map(|r| r.get::<_, i64>(0)) {
        None => Check::warn(
            NAME,
            "this server has no max_slot_wal_keep_size (before PostgreSQL 13): a stopped \
             relay's slot keeps WAL until the disk is full",
            "watch the slot's retained WAL (`outbox-relay status`, the metrics)",
        ),
        Some(-1) => Check::warn(
            NAME,
            "-1 (unlimited): a relay that stays down keeps its slot's WAL until the disk \
             is full",
            "ALTER SYSTEM SET max_slot_wal_keep_size = '<a size the disk can spare>'; \
             SELECT pg_reload_conf(); a slot further behind is then invalidated instead, \
             and `run` heals it from its saved position (relay.on_slot_loss = \"resync\")",
        ),
        Some(mb) => Check::ok(
            NAME,
            format!(
                "{mb} MB: a slot further behind is invalidated; relay.on_slot_loss = {}",
                match config.relay.on_slot_loss {
                    SlotLossMode::Resync => "\"resync\" heals it",
                    SlotLossMode::Fail => "\"fail\" stops the relay",
                }
            ),
        ),
    }
}
