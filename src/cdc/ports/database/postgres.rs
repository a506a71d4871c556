//! The real database port: PostgreSQL, the slot's server and, with
//! `postgres.slot_url`, the primary the writes go to (`ports::database`).

use std::time::Duration;

use tokio_postgres::Client;

use super::{Opened, PositionWrites, Refusal, SaveError, SessionDatabase, Start};
use crate::cdc::metrics::{self as m, Health};
use crate::cdc::ports::Boxed;
use crate::cdc::ports::stream::WalStream;
use crate::cdc::progress::SavePhase;
use crate::cdc::start::{
    self, Invalidation, Remembered, ServerView, SlotLoss, SlotView, StartPlan,
};
use crate::cdc::wal_identity::{self, TxNames, Verdict};
use crate::config::{Config, SlotLossMode};
use crate::error::{Error, Result};
use crate::hashing::HashSet;
use crate::lsn::Lsn;
use crate::outbox::position::{PositionTable, ServerHistory};
use crate::poison::{ParkedKey, RecordedPoison};
use crate::postgres::PgError;
use crate::postgres::conninfo::ConnInfo;
use crate::postgres::prerequisite::Prerequisite;
use crate::postgres::replication::{ReplicationConnection, ReplicationError, TimelineSwitch};
use crate::postgres::servers::{ServerPair, StandbySnapshots};
use crate::postgres::slot::{self, SlotState};

/// A session's connections to the server, and the server as they found it.
struct Link {
    /// The metadata connection to the slot's server (a fresh one per session: the
    /// previous one may have died with the server).
    metadata: Client,
    /// The metadata connection to the server the writes go to, when the slot lives
    /// on another one (`postgres.slot_url`).
    primary: Option<Client>,
    writes_started: Option<i64>,
    /// The replication connection, until it streams.
    conn: Option<ReplicationConnection>,
    server: ServerView,
}

impl Link {
    /// The server the relay's writes go to, and the reads of what it wrote.
    fn writes(&mut self) -> &mut Client {
        self.primary.as_mut().unwrap_or(&mut self.metadata)
    }
}

/// The real database: PostgreSQL, the slot's server and the primary.
pub(crate) struct Postgres {
    config: Config,
    /// The slot's server.
    conninfo: ConnInfo,
    /// The server the writes go to, when it is not the slot's
    /// (`postgres.slot_url`).
    primary: Option<ConnInfo>,
    positions: PositionTable,
    /// This session's connections (a fresh link per session).
    link: Option<Link>,
}

impl Postgres {
    pub(crate) fn new(
        config: Config,
        conninfo: ConnInfo,
        primary: Option<ConnInfo>,
        positions: PositionTable,
    ) -> Postgres {
        Postgres {
            config,
            conninfo,
            primary,
            positions,
            link: None,
        }
    }

    fn link(&mut self) -> Result<&mut Link> {
        self.link.as_mut().ok_or(Error::RelayNotPlanned)
    }

    /// Connects the metadata and replication connections to the slot's server (and
    /// a metadata connection to the primary when the slot is elsewhere), and reads
    /// the slot server's identity, timeline forks and start time.
    async fn connect(&self) -> Result<Link> {
        let metadata = crate::postgres::connect_info(&self.conninfo).await?;
        let mut conn = ReplicationConnection::connect(&self.conninfo)
            .await
            .map_err(replication_error)?;
        let identity = conn.identify_system().await.map_err(replication_error)?;
        let history = ServerHistory {
            system_identifier: identity.systemid,
            timeline: identity.timeline,
        };
        let server = ServerView {
            history,
            wal_end: identity.xlogpos,
            forks: timeline_forks(&mut conn, identity.timeline).await,
            started: crate::postgres::postmaster_started(&metadata).await?,
        };
        let (primary, writes_started) = match &self.primary {
            Some(info) => {
                let primary = crate::postgres::connect_info(info).await?;
                let started = crate::postgres::postmaster_started(&primary).await?;
                (Some(primary), started)
            }
            None => (None, server.started),
        };
        Ok(Link {
            metadata,
            primary,
            writes_started,
            conn: Some(conn),
            server,
        })
    }

    async fn plan_session(
        &mut self,
        remembered: Option<Remembered>,
        busy_timeout: Duration,
    ) -> Result<StartPlan> {
        self.link = None;
        let link = self.connect().await?;
        let link = self.link.insert(link);
        let slot_name = self.config.postgres.slot_name();
        let mut waited = false;
        let mut replanned = false;
        loop {
            match plan(link, &self.config, &self.positions, remembered).await? {
                StartPlan::Busy { .. } => {}
                StartPlan::Resume { .. } if !waited => {}
                plan => return Ok(plan),
            }
            let conn = link.conn.as_mut().ok_or(Error::RelayNotPlanned)?;
            match slot::wait_for_slot(conn, &link.metadata, &slot_name, busy_timeout).await {
                // Invalidated since the plan read it (a standby replaying the
                // primary's lowered wal_level, say): plan again, which finds it lost
                // and lets `relay.on_slot_loss` decide, instead of exiting here.
                Err(PgError::Prerequisite(Prerequisite::SlotInvalidated { .. })) if !replanned => {
                    replanned = true;
                    continue;
                }
                outcome => {
                    outcome?;
                }
            }
            waited = true;
        }
    }

    async fn carry_out_plan(
        &mut self,
        plan: StartPlan,
        remembered: Option<Remembered>,
        busy_timeout: Duration,
        health: &Health,
    ) -> Result<Start> {
        let slot_name = self.config.postgres.slot_name();
        let link = self.link()?;
        let history = link.server.history;
        let wal_end = link.server.wal_end;
        match plan {
            // `plan` does not let it through; were it to, it means what a wait that
            // timed out means.
            StartPlan::Busy { pid } => Err(Prerequisite::SlotBusy {
                slot: slot_name,
                pid,
                waited_secs: busy_timeout.as_secs(),
            }
            .into()),
            // The core starts at exactly what was recorded, nothing remembered.
            StartPlan::Fresh => Ok(Start {
                at: self.create_slot(busy_timeout).await?,
                fresh_core: true,
            }),
            StartPlan::Resume {
                from,
                history_changed,
                keep_checkpoint,
                server_restarted,
            } => {
                // A restarted server keeps nothing of its old WAL (a restore
                // restarts it).
                let mut fresh_core = server_restarted;
                let positions = &self.positions;
                let link = self.link.as_mut().ok_or(Error::RelayNotPlanned)?;
                if history_changed {
                    tracing::warn!(slot = %slot_name, %history, from = %from, server_wal_end = %wal_end,
                        remembered = ?remembered.map(|r| (r.history, r.confirmed)),
                        "recording the position on this server history (failover, or WAL restored in place)");
                    positions
                        .adopt(link.writes(), history, from, keep_checkpoint)
                        .await?;
                    fresh_core = true;
                } else if !positions.save(link.writes(), history, from).await? {
                    // The start may come from this process's memory: saved before
                    // any status can confirm it. A row that refuses it (marked lost
                    // by a relay resyncing, or of another history meanwhile): decide
                    // again.
                    return Err(Error::RelaySlotHealedElsewhere { slot: slot_name });
                }
                Ok(Start {
                    at: from,
                    fresh_core,
                })
            }
            StartPlan::Lost { loss, .. } => Ok(Start {
                at: self.heal(remembered, &loss, health).await?,
                fresh_core: true,
            }),
        }
    }

    /// First start: the slot is created (after a cutover from a poller when
    /// configured) and its position recorded.
    async fn create_slot(&mut self, busy_timeout: Duration) -> Result<Lsn> {
        let slot_name = self.config.postgres.slot_name();
        let (config, conninfo, primary) = (&self.config, &self.conninfo, &self.primary);
        let link = self.link.as_mut().ok_or(Error::RelayNotPlanned)?;
        let history = link.server.history;
        let conn = link.conn.as_mut().ok_or(Error::RelayNotPlanned)?;
        // On a standby, the primary is asked for the snapshot records the
        // creation waits for.
        let _snapshots = StandbySnapshots::start(conn.on_standby(), primary.as_ref());
        // A missing slot (or an interrupted cutover) first gets the backlog the
        // poller had not sent; then the slot exists and streaming starts at its
        // consistent point.
        crate::cdc::cutover::prepare(
            config,
            conninfo,
            conn,
            &mut ServerPair::of(&mut link.metadata, link.primary.as_mut()),
            history,
            crate::cdc::cutover::Trigger::Run(config.relay.cutover),
        )
        .await?;
        let state = slot::wait_for_slot(conn, &link.metadata, &slot_name, busy_timeout).await?;
        let start = match state {
            SlotState::Created(created) => {
                tracing::info!(slot = %slot_name, consistent_point = %created.consistent_point, "replication slot created");
                created.consistent_point
            }
            SlotState::Existing { confirmed_flush } => confirmed_flush,
        };
        self.positions
            .adopt(link.writes(), history, start, false)
            .await?;
        Ok(start)
    }

    /// A lost slot: fail (exit 3) or resync, under the cutover's advisory lock so
    /// two relays do not heal it twice. Returns the new slot's consistent point.
    async fn heal(
        &mut self,
        remembered: Option<Remembered>,
        loss: &SlotLoss,
        health: &Health,
    ) -> Result<Lsn> {
        let (config, conninfo, primary) = (&self.config, &self.conninfo, &self.primary);
        let link = self.link.as_mut().ok_or(Error::RelayNotPlanned)?;
        let history = link.server.history;
        let slot_name = config.postgres.slot_name();
        ::metrics::counter!(m::SLOT_LOSSES).increment(1);
        tracing::error!(slot = %slot_name, %loss, on_slot_loss = ?config.relay.on_slot_loss, "replication slot lost");
        if config.relay.on_slot_loss == SlotLossMode::Fail {
            return Err(Prerequisite::SlotLost {
                detail: loss.to_string(),
            }
            .into());
        }
        health.set_alert("slot", Some(format!("{loss}; resyncing before streaming")));
        let lock = crate::cdc::cutover::lock_key(&slot_name);
        link.writes()
            .execute("SELECT pg_advisory_lock(hashtext($1))", &[&lock])
            .await?;
        let replanned = plan(link, config, &self.positions, remembered).await?;
        let StartPlan::Lost {
            loss,
            delivered_xmin,
        } = replanned
        else {
            // Healed by another relay while we waited for the lock; the session
            // ends with the connection, which releases the lock.
            return Err(Error::RelaySlotHealedElsewhere { slot: slot_name });
        };
        let conn = link.conn.as_mut().ok_or(Error::RelayNotPlanned)?;
        let snapshots = StandbySnapshots::start(conn.on_standby(), primary.as_ref());
        let summary = crate::cdc::resync::resync(
            config,
            conninfo,
            conn,
            &mut ServerPair::of(&mut link.metadata, link.primary.as_mut()),
            history,
            &loss,
            delivered_xmin,
        )
        .await?;
        drop(snapshots);
        link.writes()
            .execute("SELECT pg_advisory_unlock(hashtext($1))", &[&lock])
            .await?;
        health.set_alert("slot", None);
        Ok(summary.consistent_point)
    }

    async fn read_recorded_poison(&mut self, start: Lsn) -> Result<RecordedPoison> {
        let copy_limit = self.config.relay.poison_copy_limit_bytes;
        let outboxes: Vec<_> = self.config.outboxes().collect();
        let slot = self.config.postgres.slot_name();
        let link = self.link.as_mut().ok_or(Error::RelayNotPlanned)?;
        // The WAL end of the slot's server; the rows where they are written.
        let wal_end = crate::postgres::wal_end(&link.metadata).await?;
        Ok(
            RecordedPoison::read(link.writes(), &outboxes, &slot, copy_limit, start, wal_end)
                .await?,
        )
    }
}

impl SessionDatabase for Postgres {
    fn plan(
        &mut self,
        remembered: Option<Remembered>,
        busy_timeout: Duration,
    ) -> Boxed<'_, Result<StartPlan>> {
        Box::pin(self.plan_session(remembered, busy_timeout))
    }

    fn carry_out<'a>(
        &'a mut self,
        plan: StartPlan,
        remembered: Option<Remembered>,
        busy_timeout: Duration,
        health: &'a Health,
    ) -> Boxed<'a, Result<Start>> {
        Box::pin(self.carry_out_plan(plan, remembered, busy_timeout, health))
    }

    fn opened(&self) -> Result<Opened> {
        let link = self.link.as_ref().ok_or(Error::RelayNotPlanned)?;
        Ok(Opened {
            server: link.server.clone(),
            writes_started: link.writes_started,
        })
    }

    fn parked_keys(&mut self) -> Boxed<'_, Result<HashSet<ParkedKey>>> {
        Box::pin(async move {
            let config = &self.config;
            let link = self.link.as_mut().ok_or(Error::RelayNotPlanned)?;
            crate::cdc::poison_policy::parked_keys(link.writes(), config).await
        })
    }

    fn recorded_poison(&mut self, start: Lsn) -> Boxed<'_, RecordedPoison> {
        Box::pin(async move {
            self.read_recorded_poison(start).await.unwrap_or_else(|e| {
                tracing::warn!(error = %e, "cannot read the poison rows of this session's stretch of WAL: events an earlier process poisoned may be produced again");
                RecordedPoison::default()
            })
        })
    }

    fn position_writes(
        &self,
        history: ServerHistory,
        server_started: Option<i64>,
    ) -> Box<dyn PositionWrites> {
        Box::new(PostgresPositionWrites {
            conninfo: self.primary.as_ref().unwrap_or(&self.conninfo).clone(),
            table: self.positions.clone(),
            history,
            server_started,
            client: None,
        })
    }

    fn start_streaming<'a>(
        &'a mut self,
        slot: &'a str,
        start: Lsn,
        options: &'a [(&'a str, &'a str)],
    ) -> Boxed<'a, std::result::Result<Box<dyn WalStream>, ReplicationError>> {
        Box::pin(async move {
            let Some(conn) = self.link.as_mut().and_then(|link| link.conn.take()) else {
                return Err(ReplicationError::Protocol(
                    "no replication connection to stream on".to_owned(),
                ));
            };
            let stream = conn
                .start_replication_with_options(slot, start, options)
                .await?;
            Ok(Box::new(stream) as Box<dyn WalStream>)
        })
    }

    fn release(&mut self) {
        self.link = None;
    }

    fn wal_end(&mut self) -> Boxed<'_, Result<Lsn>> {
        Box::pin(async move {
            let link = self.link()?;
            crate::postgres::wal_end(&link.metadata)
                .await
                .map_err(crate::poller::pg_error)
        })
    }

    fn slot_active_pid(&self) -> Boxed<'_, Option<Option<i32>>> {
        const ASK_TIMEOUT: Duration = Duration::from_secs(5);
        Box::pin(async move {
            let slot = self.config.postgres.slot_name();
            let ask = async {
                let client = crate::postgres::connect_info(&self.conninfo).await.ok()?;
                let row = client
                    .query_opt(
                        "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                        &[&slot],
                    )
                    .await
                    .ok()??;
                row.try_get::<_, Option<i32>>(0).ok()
            };
            tokio::time::timeout(ASK_TIMEOUT, ask).await.ok().flatten()
        })
    }

    fn wal_identity<'a>(
        &'a mut self,
        names: &'a TxNames,
        confirmed: Lsn,
        start: Lsn,
    ) -> Boxed<'a, Result<Verdict>> {
        Box::pin(async move {
            let link = self.link()?;
            wal_identity::check(&link.metadata, names, confirmed, start)
                .await
                .map_err(crate::poller::pg_error)
        })
    }
}

/// The start plan from the slot and the recorded position as they are now. The
/// slot is read first: a relay streaming from it saves before it confirms, so read
/// in this order the slot can only look behind the record, never ahead
/// (`cdc::start`).
async fn plan(
    link: &Link,
    config: &Config,
    positions: &PositionTable,
    remembered: Option<Remembered>,
) -> Result<StartPlan> {
    let slot_name = &config.postgres.slot_name();
    let (metadata, server) = (&link.metadata, &link.server);
    let slot = slot::slot_info(metadata, slot_name)
        .await?
        .map(|info| SlotView {
            confirmed: info.confirmed_flush.unwrap_or(Lsn::ZERO),
            invalidated: (info.wal_status.as_deref() == Some("lost"))
                .then(|| Invalidation::from_reason(info.invalidation_reason.as_deref())),
            active_pid: info.active_pid,
        });
    // Where it is written: a standby's replay lag must not show an older one.
    let recorded = positions
        .load(link.primary.as_ref().unwrap_or(metadata))
        .await?;
    // A standby that just restarted may not have replayed up to it yet: judged
    // now, it would look restored in place (`postgres::servers::wait_replayed`).
    if let (Some(_), Some(recorded)) = (&link.primary, &recorded) {
        crate::postgres::servers::wait_replayed(metadata, recorded.confirmed).await?;
    }
    // The WAL end last, and now: a session that waited for its slot must not judge
    // a position saved meanwhile by the WAL end it saw before the wait.
    let server = ServerView {
        wal_end: server
            .wal_end
            .max(crate::postgres::wal_end(metadata).await?),
        ..server.clone()
    };
    Ok(start::plan(
        slot_name,
        &server,
        recorded.as_ref(),
        slot,
        remembered,
    ))
}

/// Where each ancestor of `timeline` ended (`TIMELINE_HISTORY`), for the start plan's
/// check of a slot after a promotion. Without it (a history file removed by hand) the
/// check falls back to the recorded position alone, so a failure is only logged.
async fn timeline_forks(conn: &mut ReplicationConnection, timeline: u32) -> Vec<TimelineSwitch> {
    match conn.timeline_history(timeline).await {
        Ok(forks) => forks,
        Err(e) => {
            tracing::warn!(error = %e, timeline, "cannot read the timeline history; a slot after a promotion is checked against the recorded position only");
            Vec::new()
        }
    }
}

/// A replication error as the relay's error, classified (`postgres::process_error`).
fn replication_error(e: ReplicationError) -> Error {
    crate::postgres::process_error(e, "").into()
}

/// A statement of the saver is one single-row `UPDATE`: anything longer is a lock
/// or a server that stopped answering (`crate::postgres::bound_statements`).
const SAVE_STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);
const SAVE_LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// The real position writes: a connection of the saver's own to the server the
/// writes go to.
struct PostgresPositionWrites {
    conninfo: ConnInfo,
    table: PositionTable,
    history: ServerHistory,
    /// The session's server (`pg_postmaster_start_time()`); a restarted one may be
    /// a restored copy, whose row must not get this session's positions.
    server_started: Option<i64>,
    client: Option<Client>,
}

impl PositionWrites for PostgresPositionWrites {
    fn save(&mut self, target: Lsn) -> Boxed<'_, std::result::Result<(), SaveError>> {
        Box::pin(self.save_position(target))
    }
}

impl PostgresPositionWrites {
    /// A new connection must reach the server this session streamed from: a server
    /// that restarted meanwhile may be a data directory restored in place, where a
    /// position of the lost WAL would make the next session skip new commits. That
    /// is a refusal (the session ends and the start plan decides on the new server).
    async fn same_server(&self, client: &Client) -> std::result::Result<(), SaveError> {
        let Some(expected) = self.server_started else {
            return Ok(());
        };
        let started = crate::postgres::postmaster_started(client)
            .await
            .map_err(|e| SaveError::from(crate::outbox::checkpoint::CheckpointError::from(e)))?;
        if started == Some(expected) {
            return Ok(());
        }
        Err(SaveError {
            message: "the server restarted since this session started (it may be a restored \
                      copy): nothing of this session is saved there"
                .to_owned(),
            phase: SavePhase::Connecting,
            sqlstate: None,
            refused: Some(Refusal::ServerRestarted),
        })
    }

    /// One save, reconnecting first if needed. A missing row (deleted by an
    /// operator) is re-created; a row of another history or with a resync pending
    /// is not overwritten.
    async fn save_position(&mut self, target: Lsn) -> std::result::Result<(), SaveError> {
        if self.client.as_ref().is_none_or(Client::is_closed) {
            let connected = crate::postgres::connect_info(&self.conninfo)
                .await
                .map_err(|e| SaveError::connecting(&e))?;
            crate::postgres::bound_statements(
                &connected,
                SAVE_STATEMENT_TIMEOUT,
                SAVE_LOCK_TIMEOUT,
            )
            .await
            .map_err(|e| SaveError::from(crate::outbox::checkpoint::CheckpointError::from(e)))?;
            self.same_server(&connected).await?;
            self.client = Some(connected);
        }
        let Some(c) = self.client.as_ref() else {
            return Err(SaveError {
                message: "no connection".to_owned(),
                phase: SavePhase::Connecting,
                sqlstate: None,
                refused: None,
            });
        };
        if self.table.save(c, self.history, target).await? {
            return Ok(());
        }
        match self.table.load(c).await? {
            None => {
                tracing::warn!(table = %self.table.name(), "the relay position row was deleted; recording it again");
                Ok(self.table.adopt(c, self.history, target, false).await?)
            }
            Some(p) => Err(SaveError {
                message: format!(
                    "the position row belongs to {} (expected {}) or a resync is pending ({:?})",
                    p.history, self.history, p.slot_lost
                ),
                phase: SavePhase::Statement,
                sqlstate: None,
                refused: Some(Refusal::NotOurs),
            }),
        }
    }
}
