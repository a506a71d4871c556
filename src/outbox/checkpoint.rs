//! Checkpoints: deciding from a row's `xmin` alone whether the CDC relay has
//! delivered it.
//!
//! The relay writes nothing to the outbox, so "delivered" is known only as a WAL
//! position: the slot's `confirmed_flush_lsn`, which the relay moves past a commit
//! once every event of that transaction was acked by the broker or poisoned. A row
//! does not carry its commit LSN. Retention ([`crate::ops::retention`]) and the poller's
//! fallback mode (`poll --after-cdc`) need the link, and a checkpoint provides it.
//!
//! # The rule
//!
//! A checkpoint is `(wal_lsn, snapshot_xmin)` taken in one statement:
//!
//! ```sql
//! INSERT INTO outbox_relay_checkpoint (slot, wal_lsn, snapshot_xmin)
//! SELECT $1::text, pg_current_wal_insert_lsn(), pg_snapshot_xmin(pg_current_snapshot())
//! ```
//!
//! `pg_current_snapshot()` is the statement's snapshot, taken *before* the statement
//! runs, so the LSN is read after it. Every transaction whose xid is below the
//! snapshot's `xmin` had ended when the snapshot was taken ([PostgreSQL: snapshot
//! information functions][snap]); a transaction is removed from the proc array only
//! after its commit record was inserted into the WAL, so each such commit record lies
//! before the *insert* position read afterwards. (The insert position, not
//! `pg_current_wal_lsn()`, which is the write position: with
//! `synchronous_commit = off` a transaction is visible before its commit record is
//! written.) Subtransactions get xids after their parent, so a row inserted in one
//! also has an xid below `xmin` only if its top-level transaction had ended.
//!
//! Hence: **once the slot's `confirmed_flush_lsn >= wal_lsn`, every outbox row whose
//! inserting xid is below `snapshot_xmin` has been delivered or poisoned.** Rows the
//! poller marked (`sent_at IS NOT NULL`) are delivered too. No relay change is
//! needed: `outbox-relay retention` takes a checkpoint each cycle and uses the newest
//! one the slot has passed; older ones are then pruned.
//!
//! # Comparing a 32-bit `xmin` with a 64-bit checkpoint
//!
//! A tuple's `xmin` is a 32-bit xid that wraps around; the checkpoint stores the
//! 64-bit `xid8` (epoch and xid). Casting the checkpoint down and comparing with
//! `age()` would work for recent rows; we compare *distances from now* instead:
//!
//! * `horizon` = `pg_snapshot_xmax(pg_current_snapshot())`, the next xid as seen by
//!   the statement's own snapshot (64-bit, nothing assigned), so every row the
//!   statement can see has an xid below it;
//! * a row's age is `(horizon - xmin) mod 2^32`, exact for rows younger than 2^32
//!   xids; the checkpoint's age is `horizon - snapshot_xmin`, exact;
//! * a row precedes the checkpoint iff its age is **greater** than the checkpoint's.
//!
//! Only a row *younger* than the checkpoint could be harmed by a wrong answer, and
//! for those the age is exact, so they are never taken as confirmed. The answer can
//! only be wrong for rows older than 2^32 xids, which are then taken as younger than
//! they are (kept, never wrongly deleted). The checkpoint is refused when its own age
//! reaches 2^31 (it would be ancient; a newer one is taken each cycle). Frozen tuples
//! keep their original `xmin` since PostgreSQL 9.4 (freezing sets infomask bits,
//! [routine vacuuming][freeze]), so freezing does not change the answer; a tuple
//! frozen by 9.3 or older shows `xmin = 2` and is treated as very old — correct, as it
//! predates any slot. The horizon must come from the same statement as the rows: an
//! xid read earlier would make rows committed in between look 4 billion xids old.
//!
//! # What the rule does not cover
//!
//! The slot only streams transactions that commit after it was created. Rows
//! committed before (an outbox that existed before the relay, or a dropped and
//! re-created slot) are not delivered by the relay, yet their xids are below any later
//! checkpoint: move them first (the cutover, or the poller, which sets `sent_at`), and
//! after re-creating a slot delete its old checkpoints
//! (`DELETE FROM outbox_relay_checkpoint WHERE slot = '…'`).
//!
//! [snap]: https://www.postgresql.org/docs/15/functions-info.html#FUNCTIONS-PG-SNAPSHOT
//! [freeze]: https://www.postgresql.org/docs/15/routine-vacuuming.html#VACUUM-FOR-WRAPAROUND

use chrono::{DateTime, Utc};
use tokio_postgres::GenericClient;

pub use super::checkpoint_error::CheckpointError;
use super::checkpoint_error::parse_lsn;
use super::position::PositionTable;
use crate::config::{self, Config, quote_ident};
use crate::lsn::Lsn;

/// Result of the checkpoint operations.
type Result<T, E = CheckpointError> = std::result::Result<T, E>;

/// Name of the checkpoint table (in the outbox's schema).
const TABLE_NAME: &str = "outbox_relay_checkpoint";

/// Checkpoints the slot has not passed yet, beyond which no new one is taken: while
/// the relay is stopped a cycle would otherwise add one row per interval forever.
const MAX_PENDING: i64 = 64;

/// 2^32: 32-bit xids wrap at this.
const XID_MODULUS: i64 = 1 << 32;
/// A checkpoint whose age (in xids) reaches this is not used.
const MAX_CHECKPOINT_AGE: i64 = 1 << 31;

/// The horizon of the statement's own snapshot, as a bigint SQL expression.
const HORIZON: &str = "pg_snapshot_xmax(pg_current_snapshot())::text::bigint";

/// One row of the checkpoint table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// WAL insert position right after the snapshot.
    pub wal_lsn: Lsn,
    /// 64-bit xid: every transaction below it had ended.
    pub snapshot_xmin: i64,
    /// When it was taken.
    pub taken_at: DateTime<Utc>,
}

/// The slot as far as checkpoints are concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotProgress {
    /// `confirmed_flush_lsn` of the slot; when the slot no longer exists, the newest
    /// one recorded with a checkpoint (`slot_missing` is then set).
    pub confirmed_flush: Option<Lsn>,
    /// The slot does not exist (dropped, or never created).
    pub slot_missing: bool,
    /// The newest checkpoint at or below it.
    pub confirmed: Option<Checkpoint>,
}

/// `"schema".outbox_relay_checkpoint` for the configured outbox.
fn table(cfg: &Config) -> Result<String> {
    let schema = cfg.relay_schema()?;
    Ok(format!(
        "{}.{}",
        quote_ident(&schema),
        quote_ident(TABLE_NAME)
    ))
}

/// SQL condition: the row aliased `alias` was inserted by a transaction that precedes
/// the checkpoint whose 64-bit `snapshot_xmin` is parameter `$n` (a bigint; NULL
/// makes the condition NULL, i.e. false). See the module doc. A checkpoint *ahead*
/// of the horizon cannot be this cluster's (a logical copy of the tables carried it
/// over): nothing precedes it.
#[must_use]
pub fn precedes_sql(alias: &str, param: usize) -> String {
    format!(
        "(({HORIZON} - {alias}.xmin::text::bigint) % {XID_MODULUS} + {XID_MODULUS}) % {XID_MODULUS} \
         > {HORIZON} - ${param} AND {HORIZON} - ${param} BETWEEN 0 AND {MAX_CHECKPOINT_AGE} - 1"
    )
}

/// The rule of [`precedes_sql`] in Rust (documentation and unit tests): whether a row
/// with 32-bit `row_xmin` precedes the checkpoint, seen from `horizon`.
#[must_use]
pub fn precedes(row_xmin: u32, horizon: i64, checkpoint_xmin: i64) -> bool {
    let row_age = (horizon - i64::from(row_xmin)).rem_euclid(XID_MODULUS);
    let checkpoint_age = horizon - checkpoint_xmin;
    row_age > checkpoint_age && (0..MAX_CHECKPOINT_AGE).contains(&checkpoint_age)
}

/// Takes a checkpoint for the configured slot, unless `MAX_PENDING` (64) checkpoints
/// are already waiting for the slot. Returns it when taken.
///
/// # Errors
///
/// [`CheckpointError`]: a statement failed or the server sent an invalid LSN.
pub async fn take(client: &impl GenericClient, cfg: &Config) -> Result<Option<Checkpoint>> {
    let table = table(cfg)?;
    let slot = &cfg.postgres.slot;
    let slots = cfg.postgres.all_slot_names();
    let confirmed = confirmed_sql(2);
    let pending: i64 = client
        .query_one(
            &format!(
                "SELECT count(*) FROM {table} c WHERE c.slot = $1 AND c.wal_lsn > COALESCE(
                     {confirmed}, '0/0')"
            ),
            &[slot, &slots],
        )
        .await?
        .try_get(0)?;
    if pending >= MAX_PENDING {
        tracing::warn!(
            pending,
            slot,
            "the slot has not passed the last checkpoints (relay stopped?); not taking more"
        );
        return Ok(None);
    }
    // One statement: the snapshot is taken before the LSN is read (module doc).
    let row = client
        .query_opt(
            &format!(
                "INSERT INTO {table} (slot, wal_lsn, snapshot_xmin, slot_confirmed_lsn)
                 SELECT $1::text, pg_current_wal_insert_lsn(), pg_snapshot_xmin(pg_current_snapshot()),
                        {confirmed}
                 ON CONFLICT DO NOTHING
                 RETURNING wal_lsn::text, snapshot_xmin::text::bigint, taken_at"
            ),
            &[slot, &slots],
        )
        .await?;
    row.map(|r| checkpoint_from_row(&r)).transpose()
}

/// The slot's confirmed position and the newest checkpoint it has passed.
///
/// When the slot is gone (dropped after an emergency, say), the newest
/// `slot_confirmed_lsn` recorded with a checkpoint stands in for it: a slot's
/// confirmed position never goes back, so what it had confirmed then stays
/// confirmed.
///
/// When the CDC relay records its own position ([`super::position`]), the lower of
/// the two is used: a slot re-created or advanced by someone else is ahead of what
/// was delivered, and a lost slot being resynced keeps the recorded position until
/// the resync published the rows in between. Retention therefore never deletes a
/// row the relay has not delivered, whatever happened to the slot.
pub async fn progress(client: &impl GenericClient, cfg: &Config) -> Result<SlotProgress> {
    let table = table(cfg)?;
    let slot = &cfg.postgres.slot;
    let slots = cfg.postgres.all_slot_names();
    let confirmed = confirmed_sql(2);
    let row = client
        .query_one(
            &format!(
                "SELECT ({confirmed})::text,
                        (SELECT count(*) FROM pg_replication_slots
                          WHERE slot_name = ANY($2::text[]) AND database = current_database())
                          = cardinality($2::text[]),
                        (SELECT max(slot_confirmed_lsn)::text FROM {table} WHERE slot = $1)"
            ),
            &[slot, &slots],
        )
        .await?;
    let (live, exists, recorded): (Option<String>, bool, Option<String>) =
        (row.try_get(0)?, row.try_get(1)?, row.try_get(2)?);
    let confirmed_flush = if exists { live } else { recorded };
    let relay_position = relay_position(client, cfg).await?;
    let confirmed_flush = match (
        confirmed_flush.as_deref().map(parse_lsn).transpose()?,
        relay_position,
    ) {
        (Some(slot), Some(relay)) => Some(slot.min(relay)),
        (slot, relay) => slot.or(relay),
    };
    let Some(confirmed_flush) = confirmed_flush else {
        return Ok(SlotProgress {
            confirmed_flush: None,
            slot_missing: !exists,
            confirmed: None,
        });
    };
    let row = client
        .query_opt(
            &format!(
                "SELECT wal_lsn::text, snapshot_xmin::text::bigint, taken_at FROM {table}
                  WHERE slot = $1 AND wal_lsn <= $2::text::pg_lsn
                  ORDER BY wal_lsn DESC LIMIT 1"
            ),
            &[slot, &confirmed_flush.to_string()],
        )
        .await?;
    Ok(SlotProgress {
        confirmed_flush: Some(confirmed_flush),
        slot_missing: !exists,
        confirmed: row.map(|r| checkpoint_from_row(&r)).transpose()?,
    })
}

/// The confirmed position of every slot named in parameter `$n` (a `text[]`: the
/// shards' slots, or the one slot), as one `pg_lsn`: the lowest, or NULL unless every
/// one of them exists. A row is delivered when its own shard confirmed it, so the
/// lowest is a safe stand-in for all of them.
fn confirmed_sql(n: u8) -> String {
    format!(
        "(SELECT CASE WHEN count(*) = cardinality(${n}::text[]) THEN min(confirmed_flush_lsn) END
            FROM pg_replication_slots
           WHERE slot_name = ANY(${n}::text[]) AND database = current_database())"
    )
}

/// The relay's recorded position, when its table exists and has a row for the slot:
/// with shards, the lowest of those recorded.
async fn relay_position(client: &impl GenericClient, cfg: &Config) -> Result<Option<Lsn>> {
    if !PositionTable::new(cfg)?.exists(client).await? {
        return Ok(None);
    }
    let mut lowest: Option<Lsn> = None;
    for slot in cfg.postgres.all_slot_names() {
        let positions = PositionTable::for_slot(cfg, slot)?;
        if let Some(p) = positions.load(client).await? {
            lowest = Some(lowest.map_or(p.confirmed, |l| l.min(p.confirmed)));
        }
    }
    Ok(lowest)
}

/// Deletes the checkpoints older than `newest` (the newest confirmed one suffices).
pub async fn prune(client: &impl GenericClient, cfg: &Config, newest: &Checkpoint) -> Result<u64> {
    let table = table(cfg)?;
    Ok(client
        .execute(
            &format!("DELETE FROM {table} WHERE slot = $1 AND wal_lsn < $2::text::pg_lsn"),
            &[&cfg.postgres.slot, &newest.wal_lsn.to_string()],
        )
        .await?)
}

/// What [`mark_confirmed_sent`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Marked {
    /// The checkpoint used (none: nothing could be marked).
    pub checkpoint: Option<Checkpoint>,
    /// Rows marked sent.
    pub rows: u64,
}

/// SQL marking up to `$2` unsent rows that precede checkpoint `$1` as sent (by id,
/// so it is right for a partitioned outbox too).
#[must_use]
fn mark_sent_sql(cfg: &Config) -> String {
    let t = config::quote_qualified(&cfg.outbox.table);
    let id = quote_ident(&cfg.outbox.columns.id);
    let created_at = quote_ident(&cfg.outbox.columns.created_at);
    // ORDER BY follows the poller's partial index (created_at, id) WHERE sent_at IS
    // NULL: marked rows leave it, so each batch starts where the last one ended.
    format!(
        "UPDATE {t} SET sent_at = statement_timestamp() WHERE {id} = ANY(ARRAY(
             SELECT o.{id} FROM {t} o WHERE o.sent_at IS NULL AND {}
              ORDER BY o.{created_at}, o.{id} LIMIT $2))",
        precedes_sql("o", 1)
    )
}

/// `poll --after-cdc`: before polling, marks `sent_at` on every row the relay
/// confirmed according to the newest checkpoint the slot passed (one more is taken
/// first, in case the relay had caught up), in set-based batches of `batch_size`.
/// Rows after the checkpoint stay unsent and are re-sent by the poller: duplicates
/// (same idempotency key), never losses.
pub async fn mark_confirmed_sent(
    client: &impl GenericClient,
    cfg: &Config,
    batch_size: u32,
) -> Result<Marked> {
    if client
        .query_opt(
            "SELECT 1 FROM pg_replication_slots
              WHERE slot_name = ANY($1::text[]) AND database = current_database() LIMIT 1",
            &[&cfg.postgres.all_slot_names()],
        )
        .await?
        .is_some()
    {
        take(client, cfg).await?;
    }
    let progress = progress(client, cfg).await?;
    let Some(checkpoint) = progress.confirmed else {
        tracing::warn!(
            slot = %cfg.postgres.slot,
            "no checkpoint confirmed by the slot (was `outbox-relay retention` running?): \
             every unsent row will be published again"
        );
        return Ok(Marked::default());
    };
    let sql = mark_sent_sql(cfg);
    let mut rows = 0;
    loop {
        let n = client
            .execute(&sql, &[&checkpoint.snapshot_xmin, &i64::from(batch_size)])
            .await?;
        rows += n;
        if n < u64::from(batch_size) {
            break;
        }
    }
    tracing::info!(
        rows,
        checkpoint_lsn = %checkpoint.wal_lsn,
        checkpoint_taken_at = %checkpoint.taken_at,
        "rows the CDC relay had confirmed marked sent"
    );
    Ok(Marked {
        checkpoint: Some(checkpoint),
        rows,
    })
}

fn checkpoint_from_row(row: &tokio_postgres::Row) -> Result<Checkpoint> {
    let lsn: String = row.try_get(0)?;
    Ok(Checkpoint {
        wal_lsn: parse_lsn(&lsn)?,
        snapshot_xmin: row.try_get(1)?,
        taken_at: row.try_get(2)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const EPOCH: i64 = 1 << 32;

    #[test]
    fn rows_before_the_checkpoint_precede_it_others_do_not() {
        let ckpt = 1_000_000;
        let horizon = 1_000_500;
        assert!(precedes(999_999, horizon, ckpt));
        assert!(
            !precedes(1_000_000, horizon, ckpt),
            "xmin itself may be running"
        );
        assert!(!precedes(1_000_001, horizon, ckpt));
        assert!(!precedes(1_000_499, horizon, ckpt));
    }

    #[test]
    fn comparison_survives_the_32_bit_wraparound() {
        // Checkpoint just before an epoch boundary, rows on both sides of it.
        let ckpt = 5 * EPOCH - 10;
        let horizon = 5 * EPOCH + 100;
        let xid32 = |full: i64| u32::try_from(full.rem_euclid(EPOCH)).unwrap();
        assert!(precedes(xid32(ckpt - 1), horizon, ckpt));
        assert!(!precedes(xid32(ckpt), horizon, ckpt));
        assert!(
            !precedes(xid32(5 * EPOCH + 5), horizon, ckpt),
            "after the wrap"
        );
        assert!(!precedes(xid32(horizon - 1), horizon, ckpt));
    }

    #[test]
    fn a_checkpoint_ahead_of_the_horizon_is_another_clusters_and_covers_nothing() {
        // A logical copy of the tables carried a position from a cluster whose xids
        // ran ahead of this one's.
        let horizon = 2_000;
        let ckpt = 9_000_000;
        for xmin in [3u32, 1_000, 1_999] {
            assert!(!precedes(xmin, horizon, ckpt));
        }
        assert!(precedes(1_000, horizon, horizon));
        assert!(!precedes(1_000, horizon, horizon + 1));
    }

    #[test]
    fn very_old_rows_are_never_taken_for_young_ones_the_other_way_round() {
        let ckpt = 10 * EPOCH;
        let horizon = ckpt + 1000;
        // Any row younger than the checkpoint, whatever its 32-bit value: never.
        for full in ckpt..horizon {
            let x = u32::try_from(full.rem_euclid(EPOCH)).unwrap();
            assert!(!precedes(x, horizon, ckpt));
        }
        // Rows between 2^31 and 2^32 xids old are still seen as old.
        let old = u32::try_from((horizon - 3 * (EPOCH / 4)).rem_euclid(EPOCH)).unwrap();
        assert!(precedes(old, horizon, ckpt));
    }

    #[test]
    fn an_ancient_checkpoint_is_not_used() {
        let ckpt = EPOCH;
        let horizon = ckpt + MAX_CHECKPOINT_AGE;
        assert!(!precedes(0, horizon, ckpt));
    }

    #[test]
    fn sql_uses_the_statement_horizon_and_the_parameter() {
        let sql = precedes_sql("o", 3);
        assert!(
            sql.contains("pg_snapshot_xmax(pg_current_snapshot())"),
            "{sql}"
        );
        assert!(sql.contains("o.xmin::text::bigint"), "{sql}");
        assert!(sql.contains("- $3 BETWEEN 0 AND 2147483648 - 1"), "{sql}");
        assert!(sql.contains("% 4294967296"), "{sql}");
    }

    #[test]
    fn mark_sent_is_set_based_and_by_id() {
        let cfg = Config::from_sources(
            "t",
            "[postgres]\nurl = \"postgresql://h/db\"\n[kafka]\nbrokers = \"b\"\n[outbox]\ntable = \"app.events\"\n",
            [],
        )
        .unwrap();
        let sql = mark_sent_sql(&cfg);
        assert!(
            sql.starts_with("UPDATE \"app\".\"events\" SET sent_at"),
            "{sql}"
        );
        assert!(sql.contains("\"id\" = ANY(ARRAY("), "{sql}");
        assert!(sql.contains("o.sent_at IS NULL AND"), "{sql}");
        assert!(sql.ends_with("LIMIT $2))"), "{sql}");
        assert_eq!(table(&cfg).unwrap(), "\"app\".\"outbox_relay_checkpoint\"");
    }
}
