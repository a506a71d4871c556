//! The checks of a relay that decodes on a standby (`postgres.slot_url`): the
//! standby can hold a logical slot, keeps the catalog rows and WAL the slot needs,
//! is not far behind, and the relay's writes can go to the primary.
//!
//! **Why each.** A logical slot on a standby needs PostgreSQL 16+ and `wal_level =
//! logical` on both servers (the standby's own setting and the primary's WAL).
//! Without `hot_standby_feedback` the primary's vacuum may remove catalog rows the
//! slot still needs, and the standby then invalidates the slot (a "conflict with
//! recovery"); the feedback reaches the primary only while the standby is
//! connected, so a physical slot on the primary (`primary_slot_name`) keeps both
//! the catalog horizon and the WAL across a disconnection. The replay lag is how
//! far the relay's stream trails the primary's commits: events reach Kafka no
//! sooner than the standby replays them. Creating the slot on the standby waits
//! for a running-transactions record, which the relay asks the primary for with
//! `pg_log_standby_snapshot()` (superusers only unless granted). Reference:
//! PostgreSQL documentation, "Logical Decoding Concepts / Replication Slots" (a
//! logical slot on a standby) and "Hot Standby" (conflicts).
//!
//! The slot's own state, the free slots and senders and `max_slot_wal_keep_size`
//! are `server.rs`'s checks, made on the standby's connection by the caller.

use tokio_postgres::Client;

use super::Check;
use crate::postgres::slot::LOGICAL_ON_STANDBY_SINCE;

/// Replay lag above which `postgres.standby.replay_lag` warns.
const LAG_WARN_BYTES: i64 = 64 * 1024 * 1024;

const MB: i64 = 1024 * 1024;

/// Every standby check: `standby` is the slot's server, `primary` the writes'.
pub(super) async fn checks(primary: &Client, standby: &Client) -> Vec<Check> {
    let (server, feedback, physical, lag, writes) = tokio::join!(
        server(standby),
        feedback(standby),
        physical_slot(primary, standby),
        replay_lag(primary, standby),
        primary_writes(primary),
    );
    vec![server, feedback, physical, lag, writes]
}

/// `postgres.standby`: in recovery, PostgreSQL 16+, `wal_level = logical`.
async fn server(standby: &Client) -> Check {
    const NAME: &str = "postgres.standby";
    let row = match standby
        .query_one(
            "SELECT pg_is_in_recovery(), current_setting('server_version'),
                    current_setting('server_version_num')::int4, current_setting('wal_level')",
            &[],
        )
        .await
    {
        Ok(row) => row,
        Err(e) => return Check::query_failed(NAME, "cannot read the standby's settings", &e),
    };
    let (in_recovery, version, version_num, wal_level): (bool, String, i32, String) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    if !in_recovery {
        return Check::warn(
            NAME,
            format!(
                "postgres.slot_url is not in recovery (PostgreSQL {version}): a promoted standby, \
                 or not a standby at all; the relay decodes there and writes to postgres.url"
            ),
            "after a promotion, point postgres.url at the new primary (and remove \
             postgres.slot_url when the slot lives there)",
        );
    }
    if version_num < LOGICAL_ON_STANDBY_SINCE {
        return Check::problem(
            NAME,
            format!("a standby of PostgreSQL {version}: decoding on a standby needs 16 or later"),
            "upgrade the standby, or remove postgres.slot_url to decode on the primary",
        );
    }
    if wal_level != "logical" {
        return Check::problem(
            NAME,
            format!("the standby's wal_level is '{wal_level}'; a logical slot there needs logical"),
            "set wal_level = logical on the standby too (postgresql.conf), then restart it",
        );
    }
    Check::ok(
        NAME,
        format!("a standby of PostgreSQL {version} with wal_level = logical"),
    )
}

/// `postgres.standby.hot_standby_feedback`: on, or the slot can be invalidated.
async fn feedback(standby: &Client) -> Check {
    const NAME: &str = "postgres.standby.hot_standby_feedback";
    match standby
        .query_one("SELECT current_setting('hot_standby_feedback')::bool", &[])
        .await
    {
        Ok(row) if row.get::<_, bool>(0) => Check::ok(NAME, "on"),
        Ok(_) => Check::problem(
            NAME,
            "off: the primary may remove catalog rows the slot still needs, and the standby then \
             invalidates the slot (relay.on_slot_loss decides what follows)",
            "ALTER SYSTEM SET hot_standby_feedback = on on the standby; SELECT pg_reload_conf()",
        ),
        Err(e) => Check::query_failed(NAME, "cannot read hot_standby_feedback", &e),
    }
}

/// `postgres.standby.physical_slot`: the standby streams through a physical slot
/// of the primary's, active now.
async fn physical_slot(primary: &Client, standby: &Client) -> Check {
    const NAME: &str = "postgres.standby.physical_slot";
    let name: String = match standby
        .query_one("SELECT current_setting('primary_slot_name')", &[])
        .await
    {
        Ok(row) => row.get(0),
        Err(e) => return Check::query_failed(NAME, "cannot read primary_slot_name", &e),
    };
    let fix = "create one on the primary (SELECT pg_create_physical_replication_slot('<name>', \
               true)) and set primary_slot_name = '<name>' on the standby";
    if name.is_empty() {
        return Check::problem(
            NAME,
            "the standby has no primary_slot_name: while it is disconnected the primary may \
             remove WAL and catalog rows its logical slot needs",
            fix,
        );
    }
    match primary
        .query_opt(
            "SELECT slot_type::text, active FROM pg_replication_slots WHERE slot_name = $1",
            &[&name],
        )
        .await
    {
        Ok(Some(row)) => {
            let (kind, active): (String, bool) = (row.get(0), row.get(1));
            if kind != "physical" {
                Check::problem(
                    NAME,
                    format!("the primary's slot {name} is a {kind} slot"),
                    fix,
                )
            } else if active {
                Check::ok(NAME, format!("{name} on the primary, active"))
            } else {
                Check::warn(
                    NAME,
                    format!("{name} on the primary is not active: the standby is not streaming"),
                    "check the standby's primary_conninfo and its log",
                )
            }
        }
        Ok(None) => Check::problem(
            NAME,
            format!("the standby's primary_slot_name {name} does not exist on postgres.url"),
            fix,
        ),
        Err(e) => Check::query_failed(NAME, "cannot read the primary's slots", &e),
    }
}

/// `postgres.standby.replay_lag`: how far the standby's replay trails the
/// primary's WAL now, in bytes and (while the primary commits) seconds.
async fn replay_lag(primary: &Client, standby: &Client) -> Check {
    const NAME: &str = "postgres.standby.replay_lag";
    let (head, replayed) = tokio::join!(
        primary.query_one(
            "SELECT pg_current_wal_lsn()::text, pg_is_in_recovery()",
            &[]
        ),
        standby.query_one(
            "SELECT pg_last_wal_replay_lsn()::text,
                    extract(epoch FROM now() - pg_last_xact_replay_timestamp())::float8",
            &[]
        ),
    );
    let (head, replayed) = match (head, replayed) {
        (Ok(h), Ok(r)) => (h, r),
        (Err(e), _) | (_, Err(e)) => {
            return Check::query_failed(NAME, "cannot read the WAL positions", &e);
        }
    };
    if head.get::<_, bool>(1) {
        return Check::warn(
            NAME,
            "postgres.url is in recovery too: no lag to measure",
            "point postgres.url at the primary",
        );
    }
    // Seconds since the last replayed commit: the lag in time while the primary
    // commits (NULL before the first).
    let seconds: Option<f64> = replayed.get(1);
    let lsn = |text: Option<String>| text.and_then(|t| t.parse::<crate::lsn::Lsn>().ok());
    let (Some(head), Some(replayed)) = (lsn(head.get(0)), lsn(replayed.get(0))) else {
        return Check::warn(
            NAME,
            "the standby has replayed nothing yet",
            "check that it streams from the primary",
        );
    };
    let bytes = i64::try_from(head.0.saturating_sub(replayed.0)).unwrap_or(i64::MAX);
    let detail = match seconds {
        Some(s) => format!(
            "{} MB behind the primary; its last replayed commit was {s:.1} s ago",
            bytes / MB
        ),
        None => format!("{} MB behind the primary", bytes / MB),
    };
    if bytes > LAG_WARN_BYTES {
        Check::warn(
            NAME,
            detail,
            "events reach Kafka only once the standby replays them: look at the standby's \
             replay (CPU, disk, network)",
        )
    } else {
        Check::ok(NAME, detail)
    }
}

/// `postgres.standby.primary_writes`: `postgres.url` is a primary (the relay's
/// writes go there), and the relay may ask it for standby snapshots.
async fn primary_writes(primary: &Client) -> Check {
    const NAME: &str = "postgres.standby.primary_writes";
    let row = match primary
        .query_one(
            "SELECT pg_is_in_recovery(),
                    has_function_privilege('pg_log_standby_snapshot()', 'EXECUTE')",
            &[],
        )
        .await
    {
        Ok(row) => row,
        Err(e) => return Check::query_failed(NAME, "cannot read the primary's state", &e),
    };
    let (in_recovery, may_snapshot): (bool, bool) = (row.get(0), row.get(1));
    if in_recovery {
        return Check::problem(
            NAME,
            "postgres.url is in recovery: the relay's position, poison rows and heartbeats \
             cannot be written there",
            "point postgres.url at the primary",
        );
    }
    if !may_snapshot {
        return Check::warn(
            NAME,
            "the relay's role may not execute pg_log_standby_snapshot() on the primary: creating \
             the slot on the standby waits for the primary's own snapshot records (every 15 s \
             while it writes, none while idle)",
            "GRANT EXECUTE ON FUNCTION pg_log_standby_snapshot() TO <the relay's role> \
             (config/least-privilege.sql)",
        );
    }
    Check::ok(
        NAME,
        "postgres.url is the primary; the relay may ask it for standby snapshots",
    )
}
