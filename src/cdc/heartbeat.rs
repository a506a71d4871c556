//! The heartbeat: a logical-decoding message emitted on a normal (metadata)
//! connection every `relay.heartbeat_interval_secs`, and the slot's server-side
//! numbers sampled on the same tick.
//!
//! **Why a heartbeat.** The relay advances an idle slot from the walsender's
//! keepalive `wal_end` (see `crate::cdc::progress`), but keepalives only say where the
//! server's WAL ends, not that decoding reached it: when this database is idle and
//! others write heavily, the walsender may spend long stretches decoding WAL that
//! produces nothing for us, and some server versions send keepalives only when the
//! send buffer drains. A row-less `pg_logical_emit_message(false, 'outbox-relay', …)`
//! is WAL *of this database* that pgoutput forwards (with the `messages` option,
//! PostgreSQL 14+): it reaches the relay as an ordinary `XLogData`, moves the
//! received position, and lets the idle watermark follow. Debezium solves the same
//! problem with `heartbeat.action.query`; a logical message needs no table and
//! leaves no rows. Non-transactional, so it is decoded at once, outside any
//! transaction (the relay ignores it for the ack tracker).
//!
//! **Why it measures latency.** The message carries the emitting process id and
//! its wall-clock send time; when the relay sees its own heartbeat come back through
//! the replication stream it records the round trip (`crate::cdc::metrics::HEARTBEAT_ROUND_TRIP`):
//! an end-to-end probe of "WAL written → decoded → received", even with no events.
//!
//! **Slot sampling.** The same tick reads `pg_replication_slots` for the lag from
//! `pg_current_wal_lsn()` to `confirmed_flush_lsn`, the WAL retained since
//! `restart_lsn`, and the slot's `safe_wal_size` (how much more WAL the server may
//! write before `max_slot_wal_keep_size` invalidates the slot): the numbers an
//! operator alerts on (the disk fills from the slot, not from the relay). Failures are logged once per outage and counted; the task
//! reconnects on the next tick. References: PostgreSQL docs, "Logical Decoding
//! Output Plugins / Generic Message" and `pg_logical_emit_message` in
//! "Replication Management Functions".
//!
//! **On a standby** (`postgres.slot_url`) the message is emitted on the primary
//! (a standby cannot write WAL; it replays the message and its walsender decodes
//! it as any other), and the slot is sampled on the standby, with its replay
//! position standing in for `pg_current_wal_lsn()`, which a server in recovery
//! refuses.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio_postgres::Client;

use crate::postgres::conninfo::ConnInfo;

/// The message prefix; the relay recognises its heartbeats by it.
pub(crate) const PREFIX: &str = "outbox-relay";

/// The heartbeat task's settings.
#[derive(Debug, Clone)]
pub(crate) struct HeartbeatConfig {
    /// The slot's server: where the slot is sampled.
    pub(crate) conninfo: ConnInfo,
    /// Where the message is emitted when not on the slot's server: the primary of
    /// a standby that holds the slot.
    pub(crate) emit_on: Option<ConnInfo>,
    pub(crate) slot: String,
    /// Tick period.
    pub(crate) interval: Duration,
    /// Emit the logical message on each tick (else only sample the slot).
    pub(crate) emit: bool,
}

/// Encodes a heartbeat's content: `"<pid>:<unix micros>"`.
#[must_use]
pub(crate) fn encode(pid: u32, sent: SystemTime) -> String {
    format!("{pid}:{}", unix_micros(sent))
}

/// Decodes a heartbeat emitted by process `pid`; `None` for another process's
/// heartbeat or anything malformed.
#[must_use]
pub(crate) fn decode(content: &[u8], pid: u32) -> Option<i64> {
    let text = std::str::from_utf8(content).ok()?;
    let (from, micros) = text.split_once(':')?;
    if from.parse::<u32>().ok()? != pid {
        return None;
    }
    micros.parse().ok()
}

/// Wall-clock microseconds since the Unix epoch (0 before it).
#[must_use]
pub(crate) fn unix_micros(at: SystemTime) -> i64 {
    at.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// The round trip of a heartbeat sent at `sent_micros`, seen at `now`.
#[must_use]
pub(crate) fn round_trip(sent_micros: i64, now: SystemTime) -> Duration {
    let micros = unix_micros(now).saturating_sub(sent_micros).max(0);
    Duration::from_micros(u64::try_from(micros).unwrap_or(0))
}

/// Runs until the task is aborted (the relay aborts it when it stops).
pub(crate) async fn run(config: HeartbeatConfig) {
    // The first tick soon after start (the slot may be created by then), not at
    // once (it is not) nor a whole interval later (the gauges would stay empty).
    let first = tokio::time::Instant::now() + config.interval.min(Duration::from_secs(1));
    let mut tick = tokio::time::interval_at(first, config.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut client: Option<Client> = None;
    let mut primary: Option<Client> = None;
    let mut failing = false;
    loop {
        tick.tick().await;
        if client.as_ref().is_none_or(Client::is_closed) {
            client = crate::postgres::connect_info(&config.conninfo).await.ok();
        }
        if let Some(info) = &config.emit_on
            && primary.as_ref().is_none_or(Client::is_closed)
        {
            primary = crate::postgres::connect_info(info).await.ok();
        }
        let emitter = match &config.emit_on {
            Some(_) => primary.as_ref(),
            None => client.as_ref(),
        };
        let outcome = match (&client, emitter) {
            (Some(c), Some(e)) => beat(c, e, &config).await.map_err(BeatError::Postgres),
            _ => Err(BeatError::Unreachable),
        };
        match outcome {
            Ok(()) if failing => {
                tracing::info!("heartbeat recovered");
                failing = false;
            }
            Ok(()) => {}
            Err(error) => {
                metrics::counter!(crate::cdc::metrics::HEARTBEAT_FAILURES).increment(1);
                if !failing {
                    tracing::warn!(%error, "heartbeat failed; retrying on the next tick");
                    failing = true;
                }
                client = None;
                primary = None;
            }
        }
    }
}

/// Why a tick failed (logged once per outage).
#[derive(Debug, thiserror::Error)]
enum BeatError {
    /// No metadata connection could be opened.
    #[error("cannot connect to PostgreSQL")]
    Unreachable,
    /// The emit or the slot query failed.
    #[error(transparent)]
    Postgres(tokio_postgres::Error),
}

/// One tick: emit on `emitter` (when enabled), then sample the slot on `client`.
async fn beat(
    client: &Client,
    emitter: &Client,
    config: &HeartbeatConfig,
) -> Result<(), tokio_postgres::Error> {
    if config.emit {
        let content = encode(std::process::id(), SystemTime::now());
        emitter
            .execute(
                "SELECT pg_logical_emit_message(false, $1, $2)",
                &[&PREFIX, &content],
            )
            .await?;
    }
    // `safe_wal_size` through `to_jsonb`: NULL, not an error, before PostgreSQL 13
    // (no such column, no limit either).
    // A standby refuses `pg_current_wal_lsn()`: its replay position is its WAL end.
    let row = client
        .query_opt(
            "WITH w(lsn) AS (SELECT CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                                         ELSE pg_current_wal_lsn() END)
             SELECT (w.lsn - confirmed_flush_lsn)::float8,
                    (w.lsn - restart_lsn)::float8,
                    (to_jsonb(s) ->> 'safe_wal_size')::float8,
                    coalesce(current_setting('max_slot_wal_keep_size', true), '-1') = '-1'
               FROM pg_replication_slots s, w WHERE slot_name = $1",
            &[&config.slot],
        )
        .await?;
    if let Some(row) = row {
        if let Some(lag) = row.try_get::<_, Option<f64>>(0)? {
            metrics::gauge!(crate::cdc::metrics::SLOT_LAG_BYTES).set(lag.max(0.0));
        }
        if let Some(retained) = row.try_get::<_, Option<f64>>(1)? {
            metrics::gauge!(crate::cdc::metrics::SLOT_RETAINED_WAL_BYTES).set(retained.max(0.0));
        }
        let unlimited = row.try_get::<_, Option<bool>>(3)?.unwrap_or(true);
        if let Some(safe) = safe_wal_bytes(row.try_get::<_, Option<f64>>(2)?, unlimited) {
            metrics::gauge!(crate::cdc::metrics::SLOT_SAFE_WAL_BYTES).set(safe);
        }
    }
    Ok(())
}

/// The `SLOT_SAFE_WAL_BYTES` sample for the slot's `safe_wal_size` and whether the
/// server has no `max_slot_wal_keep_size`: `+Inf` without a limit (the slot is never
/// invalidated for its WAL), the size (0 at or past the limit, where PostgreSQL
/// reports it negative) with one, and no sample when it is NULL under a limit (the
/// slot has lost its WAL or reserves none; `restart_lsn` is NULL then too, and the
/// retained-WAL gauge is not sampled either).
fn safe_wal_bytes(safe_wal_size: Option<f64>, unlimited: bool) -> Option<f64> {
    if unlimited {
        Some(f64::INFINITY)
    } else {
        safe_wal_size.map(|bytes| bytes.max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn safe_wal_is_infinite_without_a_limit_and_never_negative() {
        assert_eq!(safe_wal_bytes(None, true), Some(f64::INFINITY));
        assert_eq!(safe_wal_bytes(Some(5.0), true), Some(f64::INFINITY));
        assert_eq!(safe_wal_bytes(Some(5.0), false), Some(5.0));
        assert_eq!(safe_wal_bytes(Some(-16.0), false), Some(0.0));
        assert_eq!(safe_wal_bytes(None, false), None);
    }

    #[test]
    fn own_heartbeat_round_trips() {
        let sent = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let content = encode(42, sent);
        let micros = decode(content.as_bytes(), 42).expect("own heartbeat");
        assert_eq!(
            round_trip(micros, sent + Duration::from_millis(15)),
            Duration::from_millis(15)
        );
    }

    #[test]
    fn other_processes_and_garbage_are_ignored() {
        let content = encode(42, SystemTime::now());
        assert_eq!(decode(content.as_bytes(), 43), None);
        for bad in [&b""[..], b"42", b"42:", b"x:1", b"42:abc", b"\xff\xfe:1"] {
            assert_eq!(decode(bad, 42), None, "{bad:?}");
        }
    }

    #[test]
    fn clock_going_backwards_is_zero_not_a_panic() {
        let now = SystemTime::now();
        let micros = unix_micros(now) + 5_000_000;
        assert_eq!(round_trip(micros, now), Duration::ZERO);
    }
}
