//! Cutover from a polling relay: the first start of the CDC relay on an outbox a
//! poller was draining, without losing an event and without sending one twice.
//!
//! # The problem
//!
//! A replication slot streams only transactions that commit after its *consistent
//! point*. Rows the poller had not yet sent when the slot was created would be lost
//! if the relay only streamed; re-reading the whole outbox would re-send everything
//! the poller already delivered; and reading "unsent rows" at some other moment
//! would either miss the rows committed between that read and the slot, or publish
//! rows the stream publishes too. The split must be exact.
//!
//! # Why an exported snapshot
//!
//! `CREATE_REPLICATION_SLOT … LOGICAL pgoutput (SNAPSHOT 'export')` (before
//! PostgreSQL 15: `EXPORT_SNAPSHOT`) returns, with the consistent point, the name of
//! a snapshot that sees exactly the transactions committed before that point: every
//! transaction is either visible in the snapshot or streamed by the slot, never both
//! and never neither. This is how PostgreSQL's own logical replication copies a
//! table before streaming it. See
//! <https://www.postgresql.org/docs/current/protocol-replication.html> (`SNAPSHOT
//! 'export'`), <https://www.postgresql.org/docs/current/logicaldecoding-explanation.html#LOGICALDECODING-EXPLANATION-EXPORTED-SNAPSHOTS>
//! and <https://www.postgresql.org/docs/current/sql-set-transaction.html>.
//!
//! The exported snapshot lives only while the replication connection that created
//! it stays idle: the next command on it (`START_REPLICATION`) or its end destroys
//! it. So the backlog is read on a *second*, normal connection, in a transaction
//! that imports it first thing (`BEGIN ISOLATION LEVEL REPEATABLE READ;
//! SET TRANSACTION SNAPSHOT '…'`), and streaming starts only when the backlog is
//! resolved, which also keeps per-entity order: every backlog event is acked
//! before the first streamed one is produced.
//!
//! # The procedure
//!
//! 1. Record the cutover as started in `outbox_relay_cutover` (migration 0006).
//! 2. Create the slot with an exported snapshot; record its consistent point.
//! 3. In the snapshot, read every row the poller has not sent — `sent_at IS NULL`,
//!    no `poison_outbox` row, whatever its attempts (a row a poller gave up on
//!    without poisoning it is published once more, and poisoned if it fails) — in
//!    commit order as near as the table tells it, through a cursor (bounded memory,
//!    one window of rows at a time; `cdc::backlog`).
//! 4. Map each row with the poller's (and so the stream's) mapping and publish the
//!    window through a dedicated producer: every send is queued, then every ack
//!    awaited. The `source_lsn` header is the slot's consistent point: an upper
//!    bound of the row's commit LSN, and a lower bound of every streamed one (the
//!    slot streams transactions whose commit record starts at or after it), so
//!    ordering by `source_lsn` never puts a streamed event before a backlog event.
//! 5. Mark the window as the poller would (`poller::write_marks`): `sent_at` for
//!    acked rows, a `poison_outbox` row once `max_attempts` is reached (unmappable
//!    rows at once), and the progress counters of the marker row, in one
//!    transaction. Refused rows are retried (with backoff, their attempts counted in
//!    memory) until acked or poisoned before the next window, with the stream's
//!    per-key order and `relay.on_poison` (`cdc::backlog`).
//! 6. Set `completed_at`; the relay then streams from the consistent point.
//!
//! # Crashes
//!
//! The slot exists from step 2 on, so its existence does not mean the cutover is
//! done; the marker row does. `decide` reads both under an advisory lock (two
//! relays starting together do not cut over twice):
//!
//! * a slot with no marker row, or with `completed_at` set: stream from it;
//! * a marker row without `completed_at`: the cutover was interrupted. Nothing was
//!   ever streamed from that slot (streaming starts after step 6), so it is dropped
//!   and the cutover starts over with a new slot and snapshot. Rows marked sent in
//!   step 5 are not published again; at most the window in flight at the crash is
//!   (published, not yet marked): the same bound as the poller's. Rows committed
//!   between the two slots are in the new snapshot.
//!
//! What is not protected: a poller still running during the cutover can send a row
//! the cutover sends too. Stop the poller first (the README's runbook).
//!
//! # Costs
//!
//! The snapshot's transaction stays open while the backlog is published, which
//! holds back vacuum's horizon for that long, like any long transaction; the slot
//! retains WAL from its consistent point meanwhile. The marks are the poller's
//! `UPDATE`s, so the relay's role needs `UPDATE` on the outbox for a cutover (and
//! `INSERT`/`UPDATE` on the marker table). An outbox without the poller's
//! `sent_at`/`attempts` columns (e.g. Debezium's) has nothing "unsent": `auto`
//! then just streams from the new slot.

use tokio_postgres::Client;

use crate::cdc::backlog::{BacklogQuery, BacklogSummary, Backlogs};
use crate::config::{Config, ConfigError, CutoverMode, quote_ident};
use crate::error::{Error, Result};
use crate::lifecycle::Shutdown;
use crate::lsn::Lsn;
use crate::outbox::position::ServerHistory;
use crate::poller;
use crate::postgres::conninfo::ConnInfo;
use crate::postgres::prerequisite::Prerequisite;
use crate::postgres::replication::{ReplicationConnection, SnapshotAction};
use crate::postgres::servers::{ServerPair, StandbySnapshots};
use crate::postgres::slot::{self, SlotInfo};

/// The marker table (migrations/0006_cutover.sql), in the outbox's schema.
const MARKER_TABLE: &str = "outbox_relay_cutover";

/// The slot of an interrupted cutover is being streamed by someone: right after a
/// crash during `CREATE_REPLICATION_SLOT` the old walsender may still hold the slot
/// until it notices, so `run` retries this with backoff.
fn unfinished_slot_active(slot: &str, pid: i32) -> Error {
    Error::CutoverSlotActive {
        slot: slot.to_owned(),
        pid,
    }
}

/// Who asks for the slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Trigger {
    /// `outbox-relay run`, with its `relay.cutover` setting.
    Run(CutoverMode),
    /// `outbox-relay cutover`.
    Command,
}

/// The slot's row in the marker table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Marker {
    /// No row: the slot (if any) was not created by a cutover.
    Absent,
    /// Started, never completed: interrupted.
    Unfinished,
    /// Completed.
    Completed,
}

/// What to do before streaming.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Nothing: stream from the slot (or let the relay create it without snapshot).
    Stream,
    /// Create the slot with an exported snapshot and publish the backlog.
    CutOver,
    /// Drop the slot of an interrupted cutover, then cut over again.
    Restart,
    /// `cutover` command: it was done already.
    AlreadyDone,
    /// `cutover` command: the slot exists and was not made by a cutover.
    Refuse,
}

/// The decision table (see the module docs, "Crashes").
#[must_use]
pub(crate) fn decide(trigger: Trigger, slot_exists: bool, marker: Marker) -> Decision {
    match (marker, slot_exists, trigger) {
        // An interrupted cutover is finished whatever the mode: its backlog is unsent.
        (Marker::Unfinished, true, _) => Decision::Restart,
        (Marker::Unfinished, false, _) => Decision::CutOver,
        (_, true, Trigger::Run(_)) => Decision::Stream,
        (Marker::Completed, true, Trigger::Command) => Decision::AlreadyDone,
        (Marker::Absent, true, Trigger::Command) => Decision::Refuse,
        (_, false, Trigger::Run(CutoverMode::Off)) => Decision::Stream,
        (_, false, Trigger::Run(CutoverMode::Auto) | Trigger::Command) => Decision::CutOver,
    }
}

/// What a cutover did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CutoverSummary {
    /// The slot's consistent point: the stream starts here.
    pub consistent_point: Lsn,
    /// Backlog rows read in the snapshot.
    pub rows: u64,
    /// Rows acked by the broker and marked sent.
    pub published: u64,
    /// Rows written to the poison table.
    pub poisoned: u64,
    /// Whether an interrupted cutover's slot was dropped first.
    pub restarted: bool,
    /// The exported snapshot's xmin (64-bit): every transaction below it is visible
    /// in the snapshot, so its rows were read.
    pub snapshot_xmin: i64,
}

impl CutoverSummary {
    /// The summary of a backlog published from the slot created at `consistent_point`.
    pub(super) fn of(consistent_point: Lsn, backlog: BacklogSummary) -> CutoverSummary {
        CutoverSummary {
            consistent_point,
            rows: backlog.rows,
            published: backlog.published,
            poisoned: backlog.poisoned,
            restarted: false,
            snapshot_xmin: backlog.snapshot_xmin,
        }
    }
}

/// What `prepare` found or did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// No cutover needed: stream.
    Stream,
    /// A cutover ran; the slot is ready to stream from its consistent point.
    CutOver(CutoverSummary),
    /// `cutover` command: done before.
    AlreadyDone,
}

/// Makes the slot ready to stream: runs (or resumes) a cutover when [`decide`]
/// says so. The replication connection is left idle (its next command may be
/// `START_REPLICATION`); the writes' server holds the advisory lock while this
/// runs. The slot is created on `conn`'s server, whose exported snapshot the
/// unsent rows are read in (through `conninfo`, the same server); marks are
/// written on the writes' server (`postgres::servers`).
/// `history` is the server's (`IDENTIFY_SYSTEM` on `conn`), which an exactly-once
/// backlog records with its rows.
///
/// # Errors
///
/// [`Prerequisite`] errors (exit code 3), PostgreSQL errors (transient ones can be
/// retried: the cutover then resumes), broker errors.
pub(crate) async fn prepare(
    config: &Config,
    conninfo: &ConnInfo,
    conn: &mut ReplicationConnection,
    servers: &mut ServerPair<'_>,
    history: ServerHistory,
    trigger: Trigger,
) -> Result<Outcome> {
    let marker_table = marker_table(config)?;
    let has_marker_table = table_exists(servers.writes(), &marker_table).await?;
    if !has_marker_table {
        // Without the table nothing can be pending: only a new slot needs it.
        let exists = slot::slot_info(servers.slot(), &config.postgres.slot_name())
            .await?
            .is_some();
        return match decide(trigger, exists, Marker::Absent) {
            Decision::Stream => Ok(Outcome::Stream),
            Decision::Refuse => Err(Prerequisite::SlotExistsWithoutCutover {
                slot: config.postgres.slot_name(),
            }
            .into()),
            _ => Err(Prerequisite::CutoverTableMissing {
                table: marker_table,
            }
            .into()),
        };
    }
    let lock = lock_key(&config.postgres.slot_name());
    servers
        .writes()
        .execute("SELECT pg_advisory_lock(hashtext($1))", &[&lock])
        .await
        .map_err(poller::pg_error)?;
    let result = prepare_locked(
        config,
        conninfo,
        conn,
        servers,
        history,
        trigger,
        &marker_table,
    )
    .await;
    // On error the session ends and the server releases the lock with it.
    if result.is_ok() {
        servers
            .writes()
            .execute("SELECT pg_advisory_unlock(hashtext($1))", &[&lock])
            .await
            .map_err(poller::pg_error)?;
    }
    result
}

async fn prepare_locked(
    config: &Config,
    conninfo: &ConnInfo,
    conn: &mut ReplicationConnection,
    servers: &mut ServerPair<'_>,
    history: ServerHistory,
    trigger: Trigger,
    marker_table: &str,
) -> Result<Outcome> {
    let slot_name = &config.postgres.slot_name();
    let info = slot::slot_info(servers.slot(), slot_name).await?;
    let marker = read_marker(servers.writes(), marker_table, slot_name).await?;
    let decision = decide(trigger, info.is_some(), marker);
    tracing::debug!(slot = %slot_name, ?marker, ?decision, "cutover decision");
    let restarted = match decision {
        Decision::Stream => return Ok(Outcome::Stream),
        Decision::AlreadyDone => return Ok(Outcome::AlreadyDone),
        Decision::Refuse => {
            return Err(Prerequisite::SlotExistsWithoutCutover {
                slot: slot_name.clone(),
            }
            .into());
        }
        Decision::Restart => {
            drop_unfinished_slot(conn, slot_name, info.as_ref()).await?;
            true
        }
        Decision::CutOver => false,
    };
    let mut views = config.per_outbox();
    let streams_without = !restarted && trigger == Trigger::Run(CutoverMode::Auto);
    // With several outboxes, those no poller drained have nothing unsent, however the
    // cutover was started; one such outbox alone is refused by `Backlog::open`
    // (naming its missing columns) unless `run` just streams.
    if streams_without || config.has_several_outboxes() {
        let mut drained = Vec::with_capacity(views.len());
        for view in &views {
            if has_poller_columns(servers.writes(), view).await? {
                drained.push(view.clone());
            } else {
                // Not an outbox a poller drained (e.g. Debezium's): nothing is "unsent".
                tracing::warn!(
                    table = %view.outbox.table,
                    "the outbox has no sent_at/attempts columns, so no polling relay to cut over \
                     from: the new slot streams what commits after it"
                );
            }
        }
        if drained.is_empty() && streams_without {
            return Ok(Outcome::Stream);
        }
        if !drained.is_empty() {
            views = drained;
        }
    }
    let mut summary = cut_over(&views, conninfo, conn, servers, marker_table, history).await?;
    summary.restarted = restarted;
    Ok(Outcome::CutOver(summary))
}

/// Drops the slot an interrupted cutover created (never streamed from).
async fn drop_unfinished_slot(
    conn: &mut ReplicationConnection,
    slot_name: &str,
    info: Option<&SlotInfo>,
) -> Result<()> {
    if let Some(pid) = info.and_then(|i| i.active_pid) {
        return Err(unfinished_slot_active(slot_name, pid));
    }
    tracing::warn!(
        slot = slot_name,
        "a cutover was interrupted: dropping its slot and starting over (rows already marked sent are not re-sent)"
    );
    conn.drop_slot(slot_name, false)
        .await
        .map_err(|e| crate::postgres::process_error(e, "cannot drop the unfinished slot: ").into())
}

/// Steps 1–6 of the module docs.
///
/// `views` are the outboxes to publish the unsent rows of ([`Config::per_outbox`]),
/// merged in commit order in the same snapshot (`cdc::backlog`).
async fn cut_over(
    views: &[Config],
    conninfo: &ConnInfo,
    conn: &mut ReplicationConnection,
    servers: &mut ServerPair<'_>,
    marker_table: &str,
    history: ServerHistory,
) -> Result<CutoverSummary> {
    let Some(config) = views.first() else {
        return Err(ConfigError::Invalid("no outbox to cut over".into()).into());
    };
    let slot_name = &config.postgres.slot_name();
    // Everything that can fail for lack of a column, a connection or the broker is
    // set up before the slot exists, so such a failure leaves nothing behind. The
    // reader session formats values as the replication session does, so records
    // are byte-identical to the stream's.
    let mut backlog = Backlogs::open(views, servers.writes(), Some(marker_table), history).await?;
    let mut reader = poller::session(conninfo).await?;
    begin_marker(servers.writes(), marker_table, slot_name).await?;
    // On a standby, the snapshot must see the marks just written on the primary
    // (an interrupted backlog's, the poller's last): their rows are not unsent.
    servers.wait_replayed().await?;
    let (consistent_point, snapshot) = create_exported_slot(conn, slot_name).await?;
    let metadata = servers.writes();
    metadata
        .execute(
            &format!(
                "UPDATE {marker_table} SET consistent_point = $2::text::pg_lsn WHERE slot_name = $1"
            ),
            &[slot_name, &consistent_point.to_string()],
        )
        .await
        .map_err(poller::pg_error)?;
    tracing::info!(
        slot = %slot_name,
        %consistent_point,
        snapshot = %snapshot,
        "cutover: replication slot created with an exported snapshot; publishing the unsent rows"
    );
    let published = backlog
        .publish(
            metadata,
            &mut reader,
            &snapshot,
            consistent_point,
            BacklogQuery::Unsent,
        )
        .await?;
    drop(backlog);
    let summary = CutoverSummary::of(consistent_point, published);
    metadata
        .execute(
            &format!(
                "UPDATE {marker_table} SET completed_at = clock_timestamp(), published = $2, poisoned = $3
                 WHERE slot_name = $1"
            ),
            &[slot_name, &count(summary.published), &count(summary.poisoned)],
        )
        .await
        .map_err(poller::pg_error)?;
    tracing::info!(
        slot = %slot_name,
        %consistent_point,
        rows = summary.rows,
        published = summary.published,
        poisoned = summary.poisoned,
        "cutover complete: streaming starts at the consistent point"
    );
    Ok(summary)
}

/// Creates the slot with an exported snapshot (valid until the next command on
/// `conn`); returns its consistent point and the snapshot's name.
pub(super) async fn create_exported_slot(
    conn: &mut ReplicationConnection,
    slot_name: &str,
) -> Result<(Lsn, String)> {
    let created = conn
        .create_logical_slot(slot_name, false, SnapshotAction::Export)
        .await
        .map_err(|e| {
            crate::postgres::process_error(
                e,
                &format!("cannot create replication slot {slot_name}: "),
            )
        })?;
    let snapshot = created
        .snapshot_name
        .ok_or_else(|| Prerequisite::NoExportedSnapshot {
            slot: slot_name.to_owned(),
        })?;
    Ok((created.consistent_point, snapshot))
}

/// The marker table, qualified with the outbox's schema and quoted.
fn marker_table(config: &Config) -> Result<String> {
    // Validated when the configuration was loaded; the same message if not.
    let schema = config
        .relay_schema()
        .map_err(|m| ConfigError::Invalid(format!("outbox.table: {m}")))?;
    Ok(format!(
        "{}.{}",
        quote_ident(&schema),
        quote_ident(MARKER_TABLE)
    ))
}

/// The advisory-lock name of a slot's cutover (and resync).
pub(super) fn lock_key(slot: &str) -> String {
    format!("outbox-relay cutover {slot}")
}

fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

async fn table_exists(client: &Client, quoted: &str) -> Result<bool> {
    crate::postgres::table_exists(client, quoted)
        .await
        .map_err(poller::pg_error)
}

/// Whether the outbox has the poller's bookkeeping columns.
async fn has_poller_columns(client: &Client, config: &Config) -> Result<bool> {
    let table = crate::config::quote_qualified(&config.outbox.table);
    let found: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_attribute
             WHERE attrelid = to_regclass($1) AND attname IN ('sent_at', 'attempts')
               AND attnum > 0 AND NOT attisdropped",
            &[&table],
        )
        .await
        .map_err(poller::pg_error)?
        .try_get(0)
        .map_err(poller::pg_error)?;
    Ok(found == 2)
}

async fn read_marker(client: &Client, table: &str, slot: &str) -> Result<Marker> {
    let row = client
        .query_opt(
            &format!("SELECT completed_at IS NOT NULL FROM {table} WHERE slot_name = $1"),
            &[&slot],
        )
        .await
        .map_err(poller::pg_error)?;
    Ok(match row {
        None => Marker::Absent,
        Some(row) => {
            if row.try_get::<_, bool>(0).map_err(poller::pg_error)? {
                Marker::Completed
            } else {
                Marker::Unfinished
            }
        }
    })
}

async fn begin_marker(client: &Client, table: &str, slot: &str) -> Result<()> {
    client
        .execute(
            &format!(
                "INSERT INTO {table} (slot_name) VALUES ($1)
                 ON CONFLICT (slot_name) DO UPDATE SET started_at = clock_timestamp(),
                     consistent_point = NULL, published = 0, poisoned = 0, completed_at = NULL"
            ),
            &[&slot],
        )
        .await
        .map_err(poller::pg_error)?;
    Ok(())
}

/// `outbox-relay cutover`: checks the prerequisites, then runs (or resumes) the
/// cutover and leaves the slot ready for `run`, which streams from its consistent
/// point. A slot that exists without a pending cutover is refused.
///
/// # Errors
///
/// As `prepare`; interrupted by `shutdown`, an error saying how to resume.
pub async fn run_command(config: &Config, shutdown: Shutdown) -> Result<Outcome> {
    let conninfo = crate::postgres::parse_url(config.postgres.slot_server_url())?;
    let mut metadata = crate::postgres::connect_info(&conninfo).await?;
    slot::check_prerequisites(&metadata, config).await?;
    slot::check_slot_server(&metadata, config).await?;
    let primary_info = config
        .postgres
        .slot_elsewhere()
        .then(|| crate::postgres::parse_url(&config.postgres.url))
        .transpose()?;
    let mut primary = match &primary_info {
        Some(info) => Some(crate::postgres::connect_info(info).await?),
        None => None,
    };
    if let Some(primary) = &primary {
        slot::check_writes_server(primary).await?;
    }
    let mut conn = ReplicationConnection::connect(&conninfo)
        .await
        .map_err(|e| crate::postgres::process_error(e, ""))?;
    let identity = conn
        .identify_system()
        .await
        .map_err(|e| crate::postgres::process_error(e, "IDENTIFY_SYSTEM failed: "))?;
    let history = ServerHistory {
        system_identifier: identity.systemid,
        timeline: identity.timeline,
    };
    let outcome = tokio::select! {
        biased;
        () = shutdown => {
            return Err(Error::CutoverInterrupted);
        }
        outcome = async {
            let _snapshots = StandbySnapshots::start(conn.on_standby(), primary_info.as_ref());
            let mut servers = ServerPair::of(&mut metadata, primary.as_mut());
            prepare(config, &conninfo, &mut conn, &mut servers, history, Trigger::Command).await
        } => outcome?,
    };
    if let Err(e) = conn.close().await {
        tracing::debug!(error = %e, "closing the replication connection");
    }
    Ok(outcome)
}

/// The cutover command's one-line report.
#[must_use]
pub fn render(config: &Config, outcome: &Outcome) -> String {
    let slot = &config.postgres.slot_name();
    match outcome {
        Outcome::Stream => format!("cutover: nothing to do for slot {slot}"),
        Outcome::AlreadyDone => {
            format!(
                "cutover: already completed for slot {slot}; `outbox-relay run` streams from it"
            )
        }
        Outcome::CutOver(s) => format!(
            "cutover: slot {slot} created at consistent point {}{}; backlog {} rows: {} published, \
             {} poisoned. Start `outbox-relay run` to stream from the consistent point.",
            s.consistent_point,
            if s.restarted {
                " (an interrupted cutover was started over)"
            } else {
                ""
            },
            s.rows,
            s.published,
            s.poisoned
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AUTO: Trigger = Trigger::Run(CutoverMode::Auto);
    const OFF: Trigger = Trigger::Run(CutoverMode::Off);

    #[test]
    fn a_missing_slot_is_cut_over_unless_off() {
        assert_eq!(decide(AUTO, false, Marker::Absent), Decision::CutOver);
        assert_eq!(
            decide(Trigger::Command, false, Marker::Absent),
            Decision::CutOver
        );
        assert_eq!(decide(OFF, false, Marker::Absent), Decision::Stream);
        // Dropped after a completed cutover: a new one (the slot's position is gone).
        assert_eq!(decide(AUTO, false, Marker::Completed), Decision::CutOver);
    }

    #[test]
    fn an_existing_slot_streams_unless_its_cutover_was_interrupted() {
        for trigger in [AUTO, OFF] {
            assert_eq!(decide(trigger, true, Marker::Absent), Decision::Stream);
            assert_eq!(decide(trigger, true, Marker::Completed), Decision::Stream);
        }
        for trigger in [AUTO, OFF, Trigger::Command] {
            assert_eq!(decide(trigger, true, Marker::Unfinished), Decision::Restart);
            assert_eq!(
                decide(trigger, false, Marker::Unfinished),
                Decision::CutOver
            );
        }
    }

    #[test]
    fn the_command_never_cuts_over_an_existing_slot_twice() {
        assert_eq!(
            decide(Trigger::Command, true, Marker::Completed),
            Decision::AlreadyDone
        );
        assert_eq!(
            decide(Trigger::Command, true, Marker::Absent),
            Decision::Refuse
        );
    }

    fn config() -> Config {
        Config::from_sources(
            "test",
            "[postgres]\nurl = \"postgresql://h/db\"\n[kafka]\nbrokers = \"k:9092\"\n\
             [outbox]\ntable = \"app.events\"\n",
            [],
        )
        .unwrap()
    }

    #[test]
    fn a_busy_unfinished_slot_is_retried_other_errors_are_prerequisites() {
        let busy = unfinished_slot_active("s", 7);
        assert!(matches!(&busy, Error::CutoverSlotActive { slot, pid: 7 } if slot == "s"));
        assert_eq!(busy.class(), crate::delivery::ErrorClass::Transient);
        assert_eq!(busy.exit_code(), std::process::ExitCode::from(1));
        let missing = Error::from(Prerequisite::CutoverTableMissing { table: "t".into() });
        assert_eq!(missing.exit_code(), std::process::ExitCode::from(3));
    }

    #[test]
    fn the_snapshot_is_exported_with_each_servers_syntax() {
        use crate::postgres::replication::create_slot_command;
        assert_eq!(
            create_slot_command("s", false, SnapshotAction::Export, Some(15), false),
            "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'export')"
        );
        assert_eq!(
            create_slot_command("s", false, SnapshotAction::Export, Some(14), false),
            "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput EXPORT_SNAPSHOT"
        );
    }

    #[test]
    fn the_command_reports_what_it_did() {
        let c = config();
        let done = render(
            &c,
            &Outcome::CutOver(CutoverSummary {
                consistent_point: Lsn::from(0x16_0000),
                rows: 6,
                published: 5,
                poisoned: 1,
                restarted: true,
                snapshot_xmin: 700,
            }),
        );
        assert!(done.contains("consistent point 0/160000"), "{done}");
        assert!(
            done.contains("backlog 6 rows: 5 published, 1 poisoned"),
            "{done}"
        );
        assert!(
            done.contains("interrupted cutover was started over"),
            "{done}"
        );
        assert!(render(&c, &Outcome::AlreadyDone).contains("already completed"));
    }

    #[test]
    fn marker_table_lives_in_the_outbox_schema() {
        assert_eq!(
            marker_table(&config()).unwrap(),
            "\"app\".\"outbox_relay_cutover\""
        );
        assert_eq!(lock_key("s"), "outbox-relay cutover s");
    }
}
