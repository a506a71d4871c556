//! `outbox-relay status`: where the relay stands, read from PostgreSQL alone.
//!
//! Everything comes from `pg_replication_slots`, the poison table and the relay's
//! position table (`outbox_relay_position`: its saved position, and whether the slot
//! is lost and being resynced), so it works
//! whether or not a relay is running, and needs no connection to the relay itself.
//! *Lag* is how far the slot's confirmed LSN trails the server's current WAL
//! position: events committed but not yet confirmed as delivered. *Retained WAL*
//! is what the slot forces the server to keep (from `restart_lsn`): the number to
//! alert on, because a slot that stops advancing fills the disk.

use serde::Serialize;
use tokio_postgres::Client;

use crate::config::{Config, quote_qualified};
use crate::error::{Error, Result};
use crate::postgres::describe_error;

/// The slot and poison-table facts, as printed by `status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Status {
    pub slot: String,
    /// False when the slot does not exist yet (the relay creates it on start).
    pub slot_exists: bool,
    /// The process streaming from the slot, if any.
    pub active_pid: Option<i32>,
    pub confirmed_flush_lsn: Option<String>,
    pub restart_lsn: Option<String>,
    pub current_wal_lsn: String,
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`.
    pub lag_bytes: Option<i64>,
    /// `pg_current_wal_lsn() - restart_lsn`: WAL kept on disk for the slot.
    pub retained_wal_bytes: Option<i64>,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    /// Poison rows not replayed yet.
    pub poison_pending: i64,
    /// All poison rows.
    pub poison_total: i64,
    /// Keys parked behind a poisoned event (`relay.on_poison = "park-key"`).
    pub parked_keys: i64,
    /// Events parked behind them, waiting for `replay` (included in
    /// `poison_pending`).
    pub parked_events: i64,
    /// The relay's own saved position (`outbox_relay_position`): everything
    /// committed before it was delivered or poisoned. `None` before the first run.
    pub relay_position: Option<String>,
    /// Set while the slot is lost and a resync is pending or running: why.
    pub slot_lost: Option<String>,
    /// Lost slots the relay healed so far.
    pub resyncs: i64,
    /// With `postgres.shards > 1`, every shard's slot (the fields above are this
    /// config's shard, `postgres.shard`); empty, and left out of the JSON, when the
    /// outbox is not sharded.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<ShardStatus>,
    /// With several `[[outbox]]` entries, each one's poison rows (the counts above
    /// are their sums); empty, and left out of the JSON, with one outbox.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub outboxes: Vec<OutboxStatus>,
}

/// One outbox's poison rows, in `status` of a relay serving several.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OutboxStatus {
    pub table: String,
    pub poison_table: String,
    pub poison_pending: i64,
    pub poison_total: i64,
}

/// One shard's slot, in `status` of a sharded outbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ShardStatus {
    pub shard: u32,
    pub slot: String,
    pub slot_exists: bool,
    pub active_pid: Option<i32>,
    pub confirmed_flush_lsn: Option<String>,
    pub lag_bytes: Option<i64>,
}

impl Status {
    /// Human-readable lines.
    #[must_use]
    pub fn render(&self) -> String {
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        let bytes = |v: Option<i64>| v.map_or_else(|| "-".into(), |b| format!("{b} bytes"));
        let mut out = String::new();
        out.push_str(&format!(
            "slot              {}{}\n",
            self.slot,
            if self.slot_exists {
                ""
            } else {
                " (does not exist yet)"
            }
        ));
        out.push_str(&format!(
            "active pid        {}\n",
            self.active_pid
                .map_or_else(|| "- (no relay streaming)".into(), |p| p.to_string())
        ));
        out.push_str(&format!(
            "confirmed LSN     {}\n",
            opt(&self.confirmed_flush_lsn)
        ));
        out.push_str(&format!("restart LSN       {}\n", opt(&self.restart_lsn)));
        out.push_str(&format!("current WAL LSN   {}\n", self.current_wal_lsn));
        out.push_str(&format!("lag               {}\n", bytes(self.lag_bytes)));
        out.push_str(&format!(
            "retained WAL      {}\n",
            bytes(self.retained_wal_bytes)
        ));
        out.push_str(&format!("wal_status        {}\n", opt(&self.wal_status)));
        out.push_str(&format!(
            "poison rows       {} pending replay, {} in all\n",
            self.poison_pending, self.poison_total
        ));
        for outbox in &self.outboxes {
            out.push_str(&format!(
                "  {:<15} {} pending replay, {} in all ({})\n",
                outbox.table, outbox.poison_pending, outbox.poison_total, outbox.poison_table
            ));
        }
        if self.parked_keys > 0 || self.parked_events > 0 {
            out.push_str(&format!(
                "parked            {} keys, {} events (outbox-relay replay releases them)\n",
                self.parked_keys, self.parked_events
            ));
        }
        out.push_str(&format!(
            "relay position    {}{}\n",
            opt(&self.relay_position),
            if self.resyncs > 0 {
                format!(" ({} lost slots healed)", self.resyncs)
            } else {
                String::new()
            }
        ));
        if let Some(reason) = &self.slot_lost {
            out.push_str(&format!("SLOT LOST         {reason}; resync pending\n"));
        }
        for s in &self.shards {
            out.push_str(&format!(
                "shard {:<11} {}: {}, lag {}\n",
                s.shard,
                s.slot,
                match (s.slot_exists, s.active_pid) {
                    (false, _) => "does not exist yet".to_owned(),
                    (true, Some(pid)) => format!("streaming (pid {pid})"),
                    (true, None) => "no relay streaming".to_owned(),
                },
                bytes(s.lag_bytes)
            ));
        }
        out
    }
}

/// The WAL's end on the slot's server: a standby (`postgres.slot_url`) refuses
/// `pg_current_wal_lsn()`; its replay position is how far its slot can decode.
const WAL_HEAD: &str =
    "(CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END)";

/// Reads the status for the configured slot and poison table: the slot on
/// `slot_client` (the standby of `postgres.slot_url`, or `client`'s server), the
/// tables on `client`.
pub async fn read(client: &Client, slot_client: &Client, config: &Config) -> Result<Status> {
    let err = |what: &'static str, source: tokio_postgres::Error| Error::StatusQuery {
        what,
        detail: describe_error(&source),
        source,
    };
    let slot = &config.postgres.slot_name();
    let current: String = slot_client
        .query_one(&format!("SELECT {WAL_HEAD}::text"), &[])
        .await
        .map_err(|e| err("cannot read the WAL position", e))?
        .get(0);
    let row = slot_client
        .query_opt(
            &format!(
                "SELECT active_pid, confirmed_flush_lsn::text, restart_lsn::text,
                        ({WAL_HEAD} - confirmed_flush_lsn)::bigint,
                        ({WAL_HEAD} - restart_lsn)::bigint,
                        wal_status
                 FROM pg_replication_slots WHERE slot_name = $1"
            ),
            &[slot],
        )
        .await
        .map_err(|e| err("cannot read pg_replication_slots", e))?;
    let poison_table = quote_qualified(&config.outbox.poison_table);
    let mut outboxes = Vec::new();
    for outbox in config.outboxes() {
        let counts = client
            .query_one(
                &format!(
                    "SELECT count(*) FILTER (WHERE replayed_at IS NULL), count(*) FROM {}",
                    quote_qualified(&outbox.poison_table)
                ),
                &[],
            )
            .await
            .map_err(|e| err("cannot count poison rows (run `outbox-relay migrate`?)", e))?;
        outboxes.push(OutboxStatus {
            table: outbox.table.clone(),
            poison_table: outbox.poison_table.clone(),
            poison_pending: counts.get(0),
            poison_total: counts.get(1),
        });
    }
    let mut status = Status {
        slot: slot.clone(),
        slot_exists: row.is_some(),
        active_pid: None,
        confirmed_flush_lsn: None,
        restart_lsn: None,
        current_wal_lsn: current,
        lag_bytes: None,
        retained_wal_bytes: None,
        wal_status: None,
        poison_pending: outboxes.iter().map(|o| o.poison_pending).sum(),
        poison_total: outboxes.iter().map(|o| o.poison_total).sum(),
        parked_keys: 0,
        parked_events: 0,
        relay_position: None,
        slot_lost: None,
        resyncs: 0,
        shards: Vec::new(),
        outboxes: if config.has_several_outboxes() {
            outboxes
        } else {
            Vec::new()
        },
    };
    if config.postgres.shards > 1 {
        status.shards = shards(slot_client, config)
            .await
            .map_err(|e| err("cannot read the shards' slots", e))?;
    }
    let parked_table = crate::poison::parked_key_table(&config.outbox);
    if crate::postgres::table_exists(client, &parked_table)
        .await
        .map_err(|e| err("cannot look for the parked-key table", e))?
    {
        let parked = client
            .query_one(
                &format!(
                    "SELECT (SELECT count(*) FROM {parked_table} WHERE released_at IS NULL),
                            (SELECT count(*) FROM {poison_table}
                             WHERE parked AND replayed_at IS NULL)"
                ),
                &[],
            )
            .await
            .map_err(|e| err("cannot count parked keys", e))?;
        status.parked_keys = parked.get(0);
        status.parked_events = parked.get(1);
    }
    let positions = crate::outbox::position::PositionTable::new(config)?;
    if positions.exists(client).await?
        && let Some(p) = positions.load(client).await?
    {
        status.relay_position = Some(p.confirmed.to_string());
        status.slot_lost = p.slot_lost;
        status.resyncs = p.resyncs;
    }
    if let Some(row) = row {
        status.active_pid = row.get(0);
        status.confirmed_flush_lsn = row.get(1);
        status.restart_lsn = row.get(2);
        status.lag_bytes = row.get(3);
        status.retained_wal_bytes = row.get(4);
        status.wal_status = row.get(5);
    }
    Ok(status)
}

/// Every shard's slot, in shard order.
async fn shards(
    client: &Client,
    config: &Config,
) -> Result<Vec<ShardStatus>, tokio_postgres::Error> {
    let slots = config.postgres.all_slot_names();
    let rows = client
        .query(
            &format!(
                "SELECT slot_name::text, active_pid, confirmed_flush_lsn::text,
                        ({WAL_HEAD} - confirmed_flush_lsn)::bigint
                   FROM pg_replication_slots WHERE slot_name = ANY($1::text[])"
            ),
            &[&slots],
        )
        .await?;
    let mut out = Vec::with_capacity(slots.len());
    for (shard, slot) in (0..).zip(slots) {
        let row = rows.iter().find(|r| r.get::<_, String>(0) == slot);
        out.push(ShardStatus {
            shard,
            slot_exists: row.is_some(),
            active_pid: row.and_then(|r| r.get(1)),
            confirmed_flush_lsn: row.and_then(|r| r.get(2)),
            lag_bytes: row.and_then(|r| r.get(3)),
            slot,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn render_shows_a_missing_slot_and_no_password() {
        let s = Status {
            slot: "outbox_relay".into(),
            slot_exists: false,
            active_pid: None,
            confirmed_flush_lsn: None,
            restart_lsn: None,
            current_wal_lsn: "0/16B3748".into(),
            lag_bytes: None,
            retained_wal_bytes: None,
            wal_status: None,
            poison_pending: 2,
            poison_total: 3,
            parked_keys: 1,
            parked_events: 1,
            relay_position: Some("0/16B0000".into()),
            slot_lost: Some("replication slot outbox_relay is missing".into()),
            resyncs: 1,
            shards: vec![ShardStatus {
                shard: 1,
                slot: "outbox_relay_shard1".into(),
                slot_exists: true,
                active_pid: Some(42),
                confirmed_flush_lsn: Some("0/16B0000".into()),
                lag_bytes: Some(10),
            }],
            outboxes: vec![OutboxStatus {
                table: "billing.outbox".into(),
                poison_table: "billing.poison_outbox".into(),
                poison_pending: 2,
                poison_total: 3,
            }],
        };
        let text = s.render();
        assert!(
            text.contains("  billing.outbox  2 pending replay, 3 in all (billing.poison_outbox)"),
            "{text}"
        );
        assert!(text.contains("does not exist yet"), "{text}");
        assert!(text.contains("0/16B0000 (1 lost slots healed)"), "{text}");
        assert!(text.contains("SLOT LOST"), "{text}");
        assert!(
            text.contains("outbox_relay_shard1: streaming (pid 42), lag 10 bytes"),
            "{text}"
        );
        assert!(text.contains("2 pending replay, 3 in all"), "{text}");
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["poison_pending"], 2);
        assert_eq!(json["lag_bytes"], serde_json::Value::Null);
        assert_eq!(
            json["slot_lost"],
            "replication slot outbox_relay is missing"
        );
    }
}
