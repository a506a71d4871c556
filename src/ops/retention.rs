//! Retention (`outbox-relay retention`): keeps the outbox bounded without ever
//! removing a row the relay has not delivered.
//!
//! With CDC the outbox is append-only: the relay reads inserts from the WAL and
//! never updates a row, so nothing marks a row as done and the table only grows.
//! Two modes, chosen by `outbox.partitioned`:
//!
//! # Deleting confirmed rows (a plain outbox)
//!
//! Each cycle:
//!
//! 1. takes a [`checkpoint`] `(wal_lsn, snapshot_xmin)`;
//! 2. reads the newest checkpoint the slot's `confirmed_flush_lsn` has passed and
//!    prunes the older ones (it supersedes them);
//! 3. deletes, in statements of `retention.batch_size` rows (each its own short
//!    transaction, so locks and WAL bursts stay small), rows older than
//!    `retention.period` that are delivered: inserted by a transaction preceding that
//!    checkpoint, or marked `sent_at` by the poller:
//!
//!    ```sql
//!    DELETE FROM outbox WHERE ctid = ANY(ARRAY(
//!        SELECT o.ctid FROM outbox o
//!         WHERE o.created_at < now() - $period
//!           AND (o.sent_at IS NOT NULL OR <o.xmin precedes the checkpoint>)
//!         LIMIT $batch))
//!    ```
//!
//! A row whose poison copy is truncated and not yet replayed is kept too: `replay`
//! reads such a copy's original from the outbox (`crate::poison::table`), so deleting
//! it would leave only the cut copy of an event that was never delivered.
//!
//! A row that is not confirmed is never touched, whatever its age: a long transaction,
//! a relay that is stopped or behind, a broker outage — the checkpoint simply stays
//! behind and so does deletion. The first cycle after a start usually deletes nothing
//! new (its own checkpoint is not confirmed yet); the relay confirms within a status
//! interval, so a checkpoint is typically used one cycle after it was taken.
//! `created_at` is only the retention period's clock, never the safety rule.
//!
//! Deletes are never published as events: the publication is
//! `WITH (publish = 'insert')` (`0003_publication.sql`), so pgoutput does not send
//! them ([CREATE PUBLICATION][pub]). The relay also ignores any non-insert change.
//!
//! # Dropping partitions (a partitioned outbox)
//!
//! At high volume, deleting row by row costs a WAL record, a dead tuple and vacuum
//! work per event. With `outbox.partitioned = true`, `migrate` creates the outbox
//! `PARTITION BY RANGE (created_at)` with partitions of `outbox.partition_interval`
//! and the publication `WITH (publish_via_partition_root = true)`: pgoutput then sends
//! every insert as an insert into the root table, under the root's name and OID, so
//! the relay's mapper (which matches the configured table name) needs no change
//! ([CREATE PUBLICATION][pub]). Each retention cycle then:
//!
//! 1. creates the partitions for the next `outbox.partitions_ahead` intervals (an
//!    insert whose `created_at` has no partition fails);
//! 2. takes and reads checkpoints as above;
//! 3. for every partition whose upper bound is older than `retention.period`, locks
//!    it (`ACCESS EXCLUSIVE`, with a short `lock_timeout`: it waits for inserts in
//!    progress, which then become visible), checks that **every** row in it is
//!    delivered by the same rule, and drops it. A partition with one unconfirmed row
//!    is kept until a later cycle. The check reads the whole partition once; dropping
//!    it then costs no per-row WAL, no dead tuples and no vacuum.
//!
//! # Running it
//!
//! `outbox-relay retention [--once] [--dry-run]` runs cycles every
//! `retention.interval` until SIGTERM (or one cycle with `--once`, e.g. from cron).
//! `--dry-run` takes no checkpoint and changes nothing; it reports what a cycle would
//! delete or drop with the checkpoints already there. The checkpoints it takes are
//! also what `poll --after-cdc` uses to fall back from CDC to the poller.
//!
//! [pub]: https://www.postgresql.org/docs/15/sql-createpublication.html

use std::time::Duration;

use tokio_postgres::Client;
use tracing::{info, warn};

use crate::config::{Config, quote_ident, quote_qualified};
use crate::delivery::ErrorClass;
use crate::error::Result;
use crate::lifecycle::{Shutdown, sleep_or_shutdown};
use crate::outbox::checkpoint::{self, Checkpoint, precedes_sql};
use crate::postgres::prerequisite::Prerequisite;

/// How long dropping a partition may wait for its lock before trying next cycle.
const PARTITION_LOCK_TIMEOUT: &str = "5s";
/// Pause of the cycle loop before retrying after a transient error (constant).
const RETRY_PAUSE: Duration = Duration::from_secs(5);

/// Flags of `outbox-relay retention` (besides `--config`).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RetentionArgs {
    /// Run one cycle and exit (e.g. from cron).
    #[arg(long)]
    pub once: bool,
    /// Take no checkpoint and change nothing; report what one cycle would delete.
    #[arg(long)]
    pub dry_run: bool,
    /// Print one JSON object per cycle.
    #[arg(long)]
    pub json: bool,
}

/// What one cycle did (or, with `--dry-run`, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct CycleReport {
    /// LSN of the checkpoint taken this cycle.
    pub checkpoint_taken: Option<String>,
    /// LSN of the newest checkpoint the slot has passed (the one used).
    pub checkpoint_used: Option<String>,
    /// The slot's `confirmed_flush_lsn`; `None` when there is no slot.
    pub confirmed_flush: Option<String>,
    /// Rows deleted (or deletable, with `--dry-run`).
    pub deleted_rows: u64,
    /// Partitions dropped (or droppable).
    pub dropped_partitions: Vec<String>,
    /// Old partitions kept because a row in them is not confirmed yet.
    pub kept_partitions: Vec<String>,
    /// Partitions created ahead.
    pub created_partitions: i32,
    pub dry_run: bool,
    /// The outbox table, with several `[[outbox]]` entries (one report each).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub table: Option<String>,
}

impl CycleReport {
    /// One line for humans.
    #[must_use]
    pub fn render(&self) -> String {
        let verb = if self.dry_run {
            "would delete"
        } else {
            "deleted"
        };
        let table = self
            .table
            .as_deref()
            .map_or_else(String::new, |t| format!(" {t}"));
        format!(
            "retention{table}: {verb} {} rows, {} partitions ({} kept, {} created); checkpoint used {}, slot confirmed {}",
            self.deleted_rows,
            self.dropped_partitions.len(),
            self.kept_partitions.len(),
            self.created_partitions,
            self.checkpoint_used.as_deref().unwrap_or("none"),
            self.confirmed_flush.as_deref().unwrap_or("(no slot)"),
        )
    }
}

/// SQL statements of a cycle, built once from the config.
#[derive(Debug, Clone)]
struct RetentionSql {
    /// `$1` period in seconds (float8), `$2` checkpoint xmin (bigint, may be NULL),
    /// `$3` batch size.
    delete_batch: String,
    /// Same condition, counted (for `--dry-run`; `$3` unused).
    count: String,
    /// `$1` period in seconds: partitions whose upper bound is older.
    old_partitions: String,
    /// `$1` root table, `$2` interval unit, `$3` partitions ahead.
    ensure_partitions: String,
    /// No truncated, unreplayed poison copy needs outbox row `o` (module docs).
    not_needed_by_replay: String,
}

impl RetentionSql {
    /// Builds the statements for the configured outbox.
    fn new(cfg: &Config) -> Result<RetentionSql> {
        let t = quote_qualified(&cfg.outbox.table);
        let created_at = quote_ident(&cfg.outbox.columns.created_at);
        // Config validation already checked the name; a hand-built Config may not be.
        let (schema, _) = crate::config::qualified_name(&cfg.outbox.table)?;
        let not_needed_by_replay = format!(
            "NOT EXISTS (SELECT 1 FROM {} p
                          WHERE p.truncated AND p.replayed_at IS NULL
                            AND p.outbox_id = o.{}::text)",
            quote_qualified(&cfg.outbox.poison_table),
            quote_ident(&cfg.outbox.columns.id)
        );
        let eligible = format!(
            "o.{created_at} < now() - make_interval(secs => $1::float8)
               AND (o.sent_at IS NOT NULL OR {})
               AND {not_needed_by_replay}",
            precedes_sql("o", 2)
        );
        Ok(RetentionSql {
            delete_batch: format!(
                "DELETE FROM {t} WHERE ctid = ANY(ARRAY(
                     SELECT o.ctid FROM {t} o WHERE {eligible} LIMIT $3))"
            ),
            count: format!(
                "SELECT count(*) FROM {t} o WHERE {eligible} AND $3::bigint IS NOT NULL"
            ),
            old_partitions: format!(
                "SELECT format('%I.%I', n.nspname, c.relname), b.upper_bound::text
                   FROM pg_inherits i
                   JOIN pg_class c ON c.oid = i.inhrelid
                   JOIN pg_namespace n ON n.oid = c.relnamespace
                   CROSS JOIN LATERAL (SELECT (regexp_match(pg_get_expr(c.relpartbound, c.oid),
                                        'TO \\(''([^'']+)''\\)'))[1]::timestamptz AS upper_bound) b
                  WHERE i.inhparent = '{}'::regclass
                    AND b.upper_bound <= now() - make_interval(secs => $1::float8)
                  ORDER BY b.upper_bound",
                t.replace('\'', "''")
            ),
            ensure_partitions: format!(
                "SELECT {}.outbox_relay_ensure_partitions($1::text::regclass, $2, $3)",
                quote_ident(&schema)
            ),
            not_needed_by_replay,
        })
    }

    /// Whether any row of partition `part` (quoted name) is not delivered by
    /// checkpoint `$1`, or is the original of a truncated poison copy not replayed.
    #[must_use]
    fn partition_has_unconfirmed(&self, part: &str) -> String {
        format!(
            "SELECT EXISTS (SELECT 1 FROM {part} o
                             WHERE (o.sent_at IS NULL AND NOT COALESCE({}, false))
                                OR NOT {})",
            precedes_sql("o", 1),
            self.not_needed_by_replay
        )
    }
}

/// Runs retention cycles until `shutdown` (or once with `--once`).
pub async fn run(config: &Config, args: &RetentionArgs, mut shutdown: Shutdown) -> Result<()> {
    let interval = config.retention.interval()?;
    let mut client = crate::postgres::connect(&config.postgres.url).await?;
    loop {
        match cycle_all(&mut client, config, args.dry_run).await {
            Ok(reports) => {
                for report in reports {
                    if args.json {
                        println!(
                            "{}",
                            serde_json::to_string(&report)
                                .map_err(crate::Error::RetentionReportJson)?
                        );
                    } else {
                        info!("{}", report.render());
                        if args.once {
                            println!("{}", report.render());
                        }
                    }
                }
            }
            Err(e) if e.class() == ErrorClass::Transient && !args.once => {
                warn!(error = %e, "retention cycle failed; retrying");
                if sleep_or_shutdown(&mut shutdown, RETRY_PAUSE).await {
                    return Ok(());
                }
                if client.is_closed() {
                    client = crate::postgres::connect(&config.postgres.url).await?;
                }
                continue;
            }
            Err(e) => return Err(e),
        }
        if args.once {
            return Ok(());
        }
        if sleep_or_shutdown(&mut shutdown, interval).await {
            return Ok(());
        }
    }
}

/// One cycle of every outbox, one after the other (each report names its table
/// when there are several).
///
/// # Errors
///
/// The first outbox's cycle that failed.
pub async fn cycle_all(
    client: &mut Client,
    config: &Config,
    dry_run: bool,
) -> Result<Vec<CycleReport>> {
    if !config.has_several_outboxes() {
        return Ok(vec![cycle(client, config, dry_run).await?]);
    }
    let mut reports = Vec::new();
    for view in config.per_outbox() {
        if view.outbox.columns.created_at.is_empty() {
            warn!(
                table = %view.outbox.table,
                "no created_at column: retention leaves this outbox alone"
            );
            continue;
        }
        let mut report = cycle(client, &view, dry_run).await?;
        report.table = Some(view.outbox.table.clone());
        reports.push(report);
    }
    Ok(reports)
}

/// One cycle: partitions ahead, checkpoint, delete or drop. See the module doc.
pub async fn cycle(client: &mut Client, config: &Config, dry_run: bool) -> Result<CycleReport> {
    if config.outbox.columns.created_at.is_empty() {
        return Err(crate::config::ConfigError::Invalid(format!(
            "outbox {} has no created_at column (outbox.columns.created_at is empty): retention \
             tells old rows by it",
            config.outbox.table
        ))
        .into());
    }
    let sql = RetentionSql::new(config)?;
    let period = config.retention.period()?.as_secs_f64();
    check_table_kind(client, config).await?;
    let mut report = CycleReport {
        dry_run,
        ..CycleReport::default()
    };
    if config.outbox.partitioned && !dry_run {
        report.created_partitions = client
            .query_one(
                &sql.ensure_partitions,
                &[
                    &quote_qualified(&config.outbox.table),
                    &config.outbox.partition_interval.sql_unit(),
                    &i32::try_from(config.outbox.partitions_ahead).unwrap_or(i32::MAX),
                ],
            )
            .await?
            .try_get(0)?;
    }
    // With shards, a row is delivered once its own shard's slot passed it; the
    // checkpoints compare with the lowest of them (`checkpoint::progress`).
    let slots = config.postgres.all_slot_names();
    // The slot lives where it is decoded: a standby with `postgres.slot_url`. The
    // checkpoints are still taken on the primary, and judged against the relay's
    // saved position there (`checkpoint::progress`).
    let standby = match &config.postgres.slot_url {
        Some(url) => Some(crate::postgres::connect(url).await?),
        None => None,
    };
    let has_slot = standby
        .as_ref()
        .unwrap_or(&*client)
        .query_opt(
            "SELECT 1 FROM pg_replication_slots
              WHERE slot_name = ANY($1::text[]) AND database = current_database() LIMIT 1",
            &[&slots],
        )
        .await?
        .is_some();
    if has_slot && !dry_run {
        report.checkpoint_taken = checkpoint::take(&*client, config)
            .await?
            .map(|c| c.wal_lsn.to_string());
    }
    let progress = checkpoint::progress(&*client, config).await?;
    if progress.slot_missing && !(config.postgres.slot_elsewhere() && has_slot) {
        warn!(
            slots = %slots.join(","),
            recorded_confirmed = ?progress.confirmed_flush.map(|l| l.to_string()),
            "no replication slot: using the last confirmed position recorded with a \
             checkpoint, and rows the poller marked sent"
        );
    }
    report.confirmed_flush = progress.confirmed_flush.map(|l| l.to_string());
    report.checkpoint_used = progress.confirmed.as_ref().map(|c| c.wal_lsn.to_string());
    if let (Some(newest), false) = (&progress.confirmed, dry_run) {
        checkpoint::prune(&*client, config, newest).await?;
    }
    let ckpt = progress.confirmed.as_ref();
    if config.outbox.partitioned {
        drop_partitions(client, &sql, period, ckpt, dry_run, &mut report).await?;
    } else {
        report.deleted_rows = delete_rows(client, config, &sql, period, ckpt, dry_run).await?;
    }
    Ok(report)
}

/// Refuses a config that does not match the table: deleting by `ctid` from a
/// partitioned table would hit rows of several partitions.
async fn check_table_kind(client: &Client, config: &Config) -> Result<()> {
    let row = client
        .query_opt(
            "SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)",
            &[&quote_qualified(&config.outbox.table)],
        )
        .await?;
    let Some(row) = row else {
        return Err(Prerequisite::OutboxTableMissing {
            table: config.outbox.table.clone(),
        }
        .into());
    };
    let partitioned: bool = row.try_get(0)?;
    if partitioned != config.outbox.partitioned {
        return Err(crate::Error::Config(crate::config::ConfigError::Invalid(
            format!(
                "outbox.partitioned = {} but table {} is {}partitioned",
                config.outbox.partitioned,
                config.outbox.table,
                if partitioned { "" } else { "not " }
            ),
        )));
    }
    Ok(())
}

/// Deletes eligible rows in batches until a batch comes back short.
async fn delete_rows(
    client: &Client,
    config: &Config,
    sql: &RetentionSql,
    period: f64,
    ckpt: Option<&Checkpoint>,
    dry_run: bool,
) -> Result<u64> {
    let xmin = ckpt.map(|c| c.snapshot_xmin);
    let batch = i64::from(config.retention.batch_size);
    if dry_run {
        let n: i64 = client
            .query_one(&sql.count, &[&period, &xmin, &batch])
            .await?
            .try_get(0)?;
        return Ok(u64::try_from(n).unwrap_or(0));
    }
    let mut deleted = 0;
    loop {
        let n = client
            .execute(&sql.delete_batch, &[&period, &xmin, &batch])
            .await?;
        deleted += n;
        if n < u64::from(config.retention.batch_size) {
            return Ok(deleted);
        }
    }
}

/// Drops old partitions whose rows are all delivered.
async fn drop_partitions(
    client: &mut Client,
    sql: &RetentionSql,
    period: f64,
    ckpt: Option<&Checkpoint>,
    dry_run: bool,
    report: &mut CycleReport,
) -> Result<()> {
    let xmin = ckpt.map(|c| c.snapshot_xmin);
    let old = client.query(&sql.old_partitions, &[&period]).await?;
    for row in old {
        let part: String = row.try_get(0)?;
        let tx = client.transaction().await?;
        if !dry_run {
            let locked = tx
                .batch_execute(&format!(
                    "SET LOCAL lock_timeout = '{PARTITION_LOCK_TIMEOUT}'; LOCK TABLE {part} IN ACCESS EXCLUSIVE MODE"
                ))
                .await;
            if let Err(e) = locked {
                if !is_lock_conflict(&e) {
                    return Err(e.into());
                }
                warn!(partition = %part, "partition busy; trying again next cycle");
                report.kept_partitions.push(part);
                continue;
            }
        }
        let unconfirmed: bool = tx
            .query_one(&sql.partition_has_unconfirmed(&part), &[&xmin])
            .await?
            .try_get(0)?;
        if unconfirmed {
            report.kept_partitions.push(part);
            continue;
        }
        if !dry_run {
            tx.batch_execute(&format!("DROP TABLE {part}")).await?;
            tx.commit().await?;
            info!(partition = %part, "partition dropped: every row delivered and older than the retention period");
        }
        report.dropped_partitions.push(part);
    }
    Ok(())
}

/// Lock timeout or deadlock: the writers won, the partition waits for next cycle.
fn is_lock_conflict(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    e.code().is_some_and(|c| {
        *c == SqlState::LOCK_NOT_AVAILABLE || *c == SqlState::T_R_DEADLOCK_DETECTED
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::test_config as cfg;

    #[test]
    fn deletes_are_batched_by_ctid_and_guarded_by_the_checkpoint() {
        let sql = RetentionSql::new(&cfg("[outbox.columns]\ncreated_at = \"ts\"\n")).unwrap();
        let d = &sql.delete_batch;
        assert!(
            d.starts_with("DELETE FROM \"public\".\"outbox\" WHERE ctid = ANY(ARRAY("),
            "{d}"
        );
        assert!(
            d.contains("o.\"ts\" < now() - make_interval(secs => $1::float8)"),
            "{d}"
        );
        assert!(d.contains("o.sent_at IS NOT NULL OR"), "{d}");
        assert!(d.contains("o.xmin::text::bigint"), "{d}");
        assert!(d.contains("LIMIT $3))"), "{d}");
        assert!(sql.count.starts_with("SELECT count(*)"));
    }

    #[test]
    fn partitions_are_listed_by_upper_bound_and_checked_row_by_row() {
        let sql = RetentionSql::new(&cfg("[outbox]\ntable = \"app.events\"\n")).unwrap();
        assert!(
            sql.old_partitions
                .contains("i.inhparent = '\"app\".\"events\"'::regclass")
        );
        assert!(sql.old_partitions.contains("ORDER BY b.upper_bound"));
        assert!(
            sql.ensure_partitions
                .starts_with("SELECT \"app\".outbox_relay_ensure_partitions(")
        );
        let check = sql.partition_has_unconfirmed("app.events_p1");
        assert!(check.contains("FROM app.events_p1 o"), "{check}");
        assert!(
            check.contains("o.sent_at IS NULL AND NOT COALESCE("),
            "{check}"
        );
        assert!(
            check.contains("p.truncated AND p.replayed_at IS NULL"),
            "{check}"
        );
    }

    #[test]
    fn report_renders_one_line() {
        let r = CycleReport {
            deleted_rows: 5,
            checkpoint_used: Some("0/16B3748".into()),
            dry_run: true,
            ..CycleReport::default()
        };
        let line = r.render();
        assert!(line.starts_with("retention: would delete 5 rows"), "{line}");
        assert!(line.contains("checkpoint used 0/16B3748"), "{line}");
        assert!(line.contains("(no slot)"), "{line}");
    }
}
