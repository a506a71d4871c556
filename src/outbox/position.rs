//! The relay's own record of how far it has delivered: one row per slot in
//! `outbox_relay_position` (migration 0007).
//!
//! # Why the slot's position is not enough
//!
//! The server keeps a logical slot's `confirmed_flush_lsn` in memory and writes it to
//! disk only at checkpoints before PostgreSQL 17, so a restart or crash rewinds the
//! slot to its last checkpointed position and the server re-sends everything
//! delivered since (thousands of events per restart were measured). And a slot that is
//! dropped, invalidated (`max_slot_wal_keep_size`) or missing on a promoted standby
//! takes its position with it: nothing then says which rows were delivered.
//!
//! So the relay writes its confirmed LSN here, *before* it reports it to the server:
//! the CDC shell never sends a status update past the last value saved here. Hence
//! the invariant **slot `confirmed_flush_lsn` ≤ `confirmed_lsn`** for a slot this relay
//! streams, and:
//!
//! * on every start the relay streams from `confirmed_lsn` when it is ahead of the
//!   slot: PostgreSQL skips every transaction that commits before the start position
//!   given to `START_REPLICATION` when that position is above the slot's own
//!   ([`CreateDecodingContext`][cdc]), so a rewound slot re-sends nothing;
//! * a slot *ahead* of this row was not moved by this relay: it was re-created or
//!   advanced by someone else, and the relay treats it as lost (`cdc::start`).
//!
//! # Which server history a position belongs to
//!
//! An LSN means something only on one WAL history: `system_identifier` and `timeline`
//! (from `IDENTIFY_SYSTEM`) are saved with it. After a failover to another timeline or
//! cluster, positions past the fork may name other transactions, so the relay ignores
//! this row's LSN and starts from the new server's slot (duplicates, never a gap).
//!
//! # From a position to rows
//!
//! `delivered_xmin` is a checkpoint (see [`crate::outbox::checkpoint`]) that
//! `confirmed_lsn` has passed: every outbox row inserted by a transaction with an xid
//! below it was delivered or poisoned. Each save takes a new candidate checkpoint in
//! the same statement (`pg_current_snapshot()` is taken before the insert LSN is read)
//! and promotes the previous candidate once the confirmed LSN reaches it. When a slot
//! is lost, the rows to publish again are those not below `delivered_xmin` that the
//! new slot's exported snapshot sees; `retention` never deletes past the position
//! recorded here.
//!
//! [cdc]: https://github.com/postgres/postgres/blob/REL_15_STABLE/src/backend/replication/logical/logical.c

use tokio_postgres::GenericClient;

use super::checkpoint_error::{CheckpointError, parse_lsn};
use crate::config::{Config, quote_ident};
use crate::lsn::Lsn;

/// Name of the position table (in the outbox's schema).
const TABLE_NAME: &str = "outbox_relay_position";

/// Candidate checkpoints a position keeps (migration 0010): enough for a lag of 16
/// save intervals at full freshness; past that the newest is replaced.
const MAX_CANDIDATES: usize = 16;

/// Which WAL history an LSN belongs to (`IDENTIFY_SYSTEM`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerHistory {
    /// The cluster's system identifier (`pg_control`): differs after a restore into
    /// a new cluster.
    pub system_identifier: u64,
    /// The timeline: increases at every promotion.
    pub timeline: u32,
}

impl std::fmt::Display for ServerHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "system {} timeline {}",
            self.system_identifier, self.timeline
        )
    }
}

/// One row of the position table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Position {
    /// The history `confirmed` belongs to.
    pub history: ServerHistory,
    /// Every transaction committed before this LSN was delivered or poisoned.
    pub confirmed: Lsn,
    /// Every outbox row with an xid below this (64-bit) was delivered or poisoned.
    pub delivered_xmin: Option<i64>,
    /// Where that checkpoint was taken in the WAL (`None` before migration 0010's
    /// first promotion): it still holds on a timeline that forked off at or after it.
    pub delivered_lsn: Option<Lsn>,
    /// Set while a lost slot is being healed: why it was lost.
    pub slot_lost: Option<String>,
    /// Lost slots healed so far.
    pub resyncs: i64,
}

/// The position table of one slot.
#[derive(Debug, Clone)]
pub struct PositionTable {
    table: String,
    slot: String,
}

/// Result of the position operations.
type Result<T, E = CheckpointError> = std::result::Result<T, E>;

impl PositionTable {
    /// The table in the outbox's schema, for the configured slot.
    ///
    /// # Errors
    ///
    /// [`CheckpointError::TableName`] for an outbox table that is not `schema.table`.
    pub fn new(cfg: &Config) -> Result<PositionTable> {
        PositionTable::for_slot(cfg, cfg.postgres.slot_name())
    }

    /// The table's row for `slot`: another shard's (see `postgres.shards`).
    ///
    /// # Errors
    ///
    /// As for [`PositionTable::new`].
    pub fn for_slot(cfg: &Config, slot: String) -> Result<PositionTable> {
        let schema = cfg.relay_schema()?;
        Ok(PositionTable {
            table: format!("{}.{}", quote_ident(&schema), quote_ident(TABLE_NAME)),
            slot,
        })
    }

    /// The quoted, schema-qualified table name.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.table
    }

    /// Whether the table exists as this version writes it (migrations 0007 and
    /// 0010 ran).
    ///
    /// # Errors
    ///
    /// The query failed.
    pub async fn exists(&self, client: &impl GenericClient) -> Result<bool> {
        let row = client
            .query_one(
                "SELECT count(*) FROM pg_attribute
                 WHERE attrelid = to_regclass($1) AND attname = 'candidate_lsns'
                   AND attnum > 0 AND NOT attisdropped",
                &[&self.table],
            )
            .await?;
        Ok(row.try_get::<_, i64>(0)? == 1)
    }

    /// The slot's row, `None` before the relay first streamed from it.
    ///
    /// # Errors
    ///
    /// The query failed or returned an invalid value.
    pub async fn load(&self, client: &impl GenericClient) -> Result<Option<Position>> {
        let row = client
            .query_opt(
                &format!(
                    "SELECT system_identifier, timeline, confirmed_lsn::text,
                            delivered_xmin::text::bigint, slot_lost_reason,
                            slot_lost_at IS NOT NULL, resyncs, delivered_lsn::text
                     FROM {} WHERE slot_name = $1",
                    self.table
                ),
                &[&self.slot],
            )
            .await?;
        let Some(row) = row else { return Ok(None) };
        let system: String = row.try_get(0)?;
        let timeline: i32 = row.try_get(1)?;
        let confirmed: String = row.try_get(2)?;
        let lost_reason: Option<String> = row.try_get(4)?;
        let lost: bool = row.try_get(5)?;
        Ok(Some(Position {
            history: ServerHistory {
                system_identifier: system.parse().map_err(|_| CheckpointError::InvalidValue {
                    column: "system_identifier",
                    text: system.clone(),
                })?,
                timeline: u32::try_from(timeline).map_err(|_| CheckpointError::InvalidValue {
                    column: "timeline",
                    text: timeline.to_string(),
                })?,
            },
            confirmed: parse_lsn(&confirmed)?,
            delivered_xmin: row.try_get(3)?,
            delivered_lsn: row
                .try_get::<_, Option<String>>(7)?
                .as_deref()
                .map(parse_lsn)
                .transpose()?,
            slot_lost: lost.then(|| lost_reason.unwrap_or_default()),
            resyncs: row.try_get(6)?,
        }))
    }

    /// Records `confirmed` as the position on `history`, creating the row. On the
    /// same history the checkpoints are kept; on another one the candidates are
    /// cleared, and `delivered_xmin` too unless `keep_checkpoint` (the start plan
    /// found it before the fork of a promoted timeline): xids past a fork are not
    /// comparable.
    ///
    /// # Errors
    ///
    /// The statement failed.
    pub async fn adopt(
        &self,
        client: &impl GenericClient,
        history: ServerHistory,
        confirmed: Lsn,
        keep_checkpoint: bool,
    ) -> Result<()> {
        let same = format!(
            "{t}.system_identifier = EXCLUDED.system_identifier AND {t}.timeline = EXCLUDED.timeline",
            t = self.table
        );
        client
            .execute(
                &format!(
                    "INSERT INTO {t} (slot_name, system_identifier, timeline, confirmed_lsn)
                     VALUES ($1, $2, $3, $4::text::pg_lsn)
                     ON CONFLICT (slot_name) DO UPDATE SET
                         delivered_xmin = CASE WHEN {same} OR $5 THEN {t}.delivered_xmin END,
                         delivered_lsn = CASE WHEN {same} OR $5 THEN {t}.delivered_lsn END,
                         candidate_lsns = CASE WHEN {same} THEN {t}.candidate_lsns ELSE '{{}}' END,
                         candidate_xmins = CASE WHEN {same} THEN {t}.candidate_xmins ELSE '{{}}' END,
                         system_identifier = EXCLUDED.system_identifier,
                         timeline = EXCLUDED.timeline,
                         confirmed_lsn = EXCLUDED.confirmed_lsn,
                         updated_at = clock_timestamp()",
                    t = self.table
                ),
                &[
                    &self.slot,
                    &history.system_identifier.to_string(),
                    &timeline_param(history.timeline),
                    &confirmed.to_string(),
                    &keep_checkpoint,
                ],
            )
            .await?;
        Ok(())
    }

    /// Saves `confirmed` (taking a new candidate checkpoint, promoting the newest one
    /// `confirmed` passed: the new one itself when nothing was written since the
    /// last delivered commit, the usual state of an idle outbox). The saved position
    /// never moves back: a late save of an older session cannot undo a newer one. Returns `false` when the row is missing, belongs to
    /// another history, or a resync is pending: the save did not happen.
    ///
    /// # Errors
    ///
    /// The statement failed.
    pub async fn save(
        &self,
        client: &impl GenericClient,
        history: ServerHistory,
        confirmed: Lsn,
    ) -> Result<bool> {
        // Every right-hand side reads the row as it was before the update. One
        // statement: the snapshot is taken before the insert LSN is read, and the
        // new candidate `n` is computed once. Candidates are kept in LSN order with
        // distinct LSNs, so the two arrays stay parallel. `n` is the newest of all
        // (the insert position only grows): when `confirmed` already reaches it
        // (nothing was written since the last delivered commit, as after a burst
        // on an idle database) it is promoted at once and not kept; otherwise an
        // idle relay would never pass it and a resync would resend the burst.
        let candidates = "unnest(p.candidate_lsns, p.candidate_xmins) AS c(l, x)";
        let newest_passed = format!(
            "FROM (SELECT n.l, n.x UNION ALL SELECT * FROM {candidates}) AS c(l, x)
             WHERE c.l <= $2::text::pg_lsn ORDER BY c.l DESC LIMIT 1"
        );
        let kept = format!(
            "(SELECT c.l, c.x FROM {candidates} WHERE c.l > $2::text::pg_lsn
              ORDER BY c.l LIMIT {keep})
             UNION ALL SELECT n.l, n.x WHERE n.l > ALL(p.candidate_lsns)
                                         AND n.l > $2::text::pg_lsn",
            keep = MAX_CANDIDATES - 1
        );
        let n = client
            .execute(
                &format!(
                    "UPDATE {t} AS p SET
                         confirmed_lsn = GREATEST(p.confirmed_lsn, $2::text::pg_lsn),
                         delivered_lsn = COALESCE((SELECT c.l {newest_passed}), p.delivered_lsn),
                         delivered_xmin = COALESCE((SELECT c.x {newest_passed}), p.delivered_xmin),
                         candidate_lsns = ARRAY(SELECT k.l FROM ({kept}) AS k(l, x) ORDER BY k.l),
                         candidate_xmins = ARRAY(SELECT k.x FROM ({kept}) AS k(l, x) ORDER BY k.l),
                         updated_at = clock_timestamp()
                     FROM (SELECT pg_current_wal_insert_lsn() AS l,
                                  pg_snapshot_xmin(pg_current_snapshot()) AS x) AS n
                     WHERE p.slot_name = $1 AND p.system_identifier = $3 AND p.timeline = $4
                       AND p.slot_lost_at IS NULL",
                    t = self.table
                ),
                &[
                    &self.slot,
                    &confirmed.to_string(),
                    &history.system_identifier.to_string(),
                    &timeline_param(history.timeline),
                ],
            )
            .await?;
        Ok(n == 1)
    }

    /// Records that the slot was lost and a resync is due (kept until [`resynced`]).
    /// Nothing else changes: the resync needs the old `delivered_xmin`; the first
    /// reason is kept while resyncs that do not finish follow each other.
    ///
    /// [`resynced`]: PositionTable::resynced
    ///
    /// # Errors
    ///
    /// The statement failed.
    pub async fn mark_lost(&self, client: &impl GenericClient, reason: &str) -> Result<()> {
        client
            .execute(
                &format!(
                    "UPDATE {} SET slot_lost_at = COALESCE(slot_lost_at, clock_timestamp()),
                                   slot_lost_reason = COALESCE(slot_lost_reason, $2),
                                   updated_at = clock_timestamp()
                     WHERE slot_name = $1",
                    self.table
                ),
                &[&self.slot, &reason],
            )
            .await?;
        Ok(())
    }

    /// A resync finished: every row the new slot's snapshot sees was delivered or
    /// poisoned, so the position is the new slot's consistent point and
    /// `delivered_xmin` the snapshot's xmin.
    ///
    /// # Errors
    ///
    /// The statement failed.
    pub async fn resynced(
        &self,
        client: &impl GenericClient,
        history: ServerHistory,
        consistent_point: Lsn,
        snapshot_xmin: i64,
    ) -> Result<()> {
        client
            .execute(
                &format!(
                    "UPDATE {} SET system_identifier = $2, timeline = $3,
                         confirmed_lsn = $4::text::pg_lsn,
                         delivered_xmin = $5::text::xid8, delivered_lsn = $4::text::pg_lsn,
                         candidate_lsns = '{{}}', candidate_xmins = '{{}}',
                         slot_lost_at = NULL, slot_lost_reason = NULL, resyncs = resyncs + 1,
                         updated_at = clock_timestamp()
                     WHERE slot_name = $1",
                    self.table
                ),
                &[
                    &self.slot,
                    &history.system_identifier.to_string(),
                    &timeline_param(history.timeline),
                    &consistent_point.to_string(),
                    &snapshot_xmin.to_string(),
                ],
            )
            .await?;
        Ok(())
    }
}

/// Timelines are 32-bit unsigned on the wire, `integer` here; PostgreSQL never gets
/// near 2^31 of them.
fn timeline_param(timeline: u32) -> i32 {
    i32::try_from(timeline).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_lives_in_the_outbox_schema() {
        let cfg = Config::from_sources(
            "t",
            "[postgres]\nurl = \"postgresql://h/db\"\nslot = \"s1\"\n[kafka]\nbrokers = \"b\"\n\
             [outbox]\ntable = \"app.events\"\n",
            [],
        )
        .unwrap();
        let table = PositionTable::new(&cfg).unwrap();
        assert_eq!(table.name(), "\"app\".\"outbox_relay_position\"");
    }

    #[test]
    fn history_prints_both_parts() {
        let h = ServerHistory {
            system_identifier: 7,
            timeline: 2,
        };
        assert_eq!(h.to_string(), "system 7 timeline 2");
    }
}
