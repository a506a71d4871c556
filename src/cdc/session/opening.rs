//! The opening of a session: connects, reads the server's identity and history,
//! waits for the slot, decides where to start (`cdc::start`), and carries the
//! decision out: creates the slot (after a cutover from a poller when configured),
//! resumes and records the position, or heals a lost slot (`cdc::resync`).
//!
//! The decision is made on the facts as they are after any wait for the slot:
//! another relay may have streamed from it meanwhile, and an active slot is never
//! judged. What this process remembers of the last session (the server history, the
//! confirmed and saved positions, when the server started) is part of those facts:
//! a restarted server rewinds its slot to the last checkpoint, and a restored or
//! promoted one has another history.
//!
//! With `postgres.slot_url` the slot lives on a standby and the relay's writes go
//! to the primary (`postgres::servers`): the link holds a metadata connection to
//! each, and every step reads the slot where it lives and the position where it is
//! written.
//!
//! It owns that memory and nothing else: the core, the producer and the position
//! table are passed in by the loop, which applies the outcome to them.

use std::time::Duration;

use tokio_postgres::Client;

use super::replication_error;
use crate::cdc::metrics::{self as m, Health};
use crate::cdc::progress::Core;
use crate::cdc::start::{self, Remembered, ServerView, SlotLoss, SlotView, StartPlan};
use crate::config::{Config, SlotLossMode};
use crate::error::{Error, Result};
use crate::lsn::Lsn;
use crate::outbox::position::{PositionTable, ServerHistory};
use crate::poison::RecordedPoison;
use crate::postgres::conninfo::ConnInfo;
use crate::postgres::prerequisite::Prerequisite;
use crate::postgres::replication::{ReplicationConnection, TimelineSwitch};
use crate::postgres::servers::{ServerPair, StandbySnapshots};
use crate::postgres::slot::{self, SlotState};

/// A session's connections to the server, and the server as they found it.
pub(super) struct Link {
    /// The metadata connection to the slot's server (a fresh one per session: the
    /// previous one may have died with the server).
    pub(super) metadata: Client,
    /// The metadata connection to the server the writes go to, when the slot lives
    /// on another one (`postgres.slot_url`).
    primary: Option<Client>,
    /// When the server the writes go to started (the position saver refuses one
    /// that restarted meanwhile).
    pub(super) writes_started: Option<i64>,
    /// The replication connection, until it streams.
    pub(super) conn: ReplicationConnection,
    pub(super) server: ServerView,
}

impl Link {
    /// The server the relay's writes go to, and the reads of what it wrote.
    pub(super) fn writes(&mut self) -> &mut Client {
        self.primary.as_mut().unwrap_or(&mut self.metadata)
    }
}

/// Where a session starts, decided and carried out.
#[derive(Debug, Clone, Copy)]
pub(super) struct Start {
    pub(super) at: Lsn,
    /// Nothing of this process's positions carries over (a new slot, another
    /// history, a restarted server, a healed slot).
    pub(super) fresh_core: bool,
}

/// See the module documentation.
pub(super) struct Opening {
    /// The slot's server.
    conninfo: ConnInfo,
    /// The server the writes go to, when it is not the slot's
    /// (`postgres.slot_url`).
    primary: Option<ConnInfo>,
    /// The server history of the last session (`None` before the first).
    history: Option<ServerHistory>,
    /// When the server of the last session started (a restart forgets the
    /// remembered position, `cdc::start`).
    server_started: Option<i64>,
    /// After a lost connection the server keeps our old walsender (and so the slot)
    /// until it notices, at most this long.
    wal_sender_timeout: Duration,
}

impl Opening {
    pub(super) fn new(
        conninfo: ConnInfo,
        primary: Option<ConnInfo>,
        wal_sender_timeout: Duration,
    ) -> Opening {
        Opening {
            conninfo,
            primary,
            history: None,
            server_started: None,
            wal_sender_timeout,
        }
    }

    /// The slot's server.
    pub(super) fn conninfo(&self) -> &ConnInfo {
        &self.conninfo
    }

    /// The server the writes go to.
    pub(super) fn writes_conninfo(&self) -> &ConnInfo {
        self.primary.as_ref().unwrap_or(&self.conninfo)
    }

    /// The server history of the current session (`None` before the first).
    pub(super) fn history(&self) -> Option<ServerHistory> {
        self.history
    }

    /// Connects the metadata and replication connections to the slot's server (and
    /// a metadata connection to the primary when the slot is elsewhere), and reads
    /// the slot server's identity, timeline forks and start time.
    ///
    /// # Errors
    ///
    /// A connection or a query failed.
    pub(super) async fn connect(&self) -> Result<Link> {
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
            conn,
            server,
        })
    }

    /// How long to wait for a busy slot: `relay.slot_busy_timeout_secs`, and on a
    /// reconnect at least twice `wal_sender_timeout` (the slot may still be held by
    /// our own previous walsender, e.g. after a network cut).
    pub(super) fn busy_timeout(&self, config: &Config, first: bool) -> Duration {
        let configured = Duration::from_secs(config.relay.slot_busy_timeout_secs);
        if first {
            configured
        } else {
            configured.max(self.wal_sender_timeout * 2)
        }
    }

    /// What this process remembers of the last session, with `core`'s positions.
    pub(super) fn remembered(&self, core: &Core) -> Option<Remembered> {
        self.history.map(|history| Remembered {
            history,
            confirmed: core.confirmed(),
            saved: core.saved_position(),
            server_started: self.server_started,
        })
    }

    /// The start plan on the facts after waiting for the slot (a resume is decided
    /// only after one wait, since another relay may have streamed meanwhile).
    ///
    /// # Errors
    ///
    /// A query failed, or the slot stayed busy past `busy_timeout`.
    pub(super) async fn decide(
        &self,
        link: &mut Link,
        config: &Config,
        positions: &PositionTable,
        remembered: Option<Remembered>,
        busy_timeout: Duration,
    ) -> Result<StartPlan> {
        let slot_name = config.postgres.slot_name();
        let mut waited = false;
        loop {
            match plan(link, config, positions, remembered).await? {
                StartPlan::Busy { .. } => {}
                StartPlan::Resume { .. } if !waited => {}
                plan => return Ok(plan),
            }
            slot::wait_for_slot(&mut link.conn, &link.metadata, &slot_name, busy_timeout).await?;
            waited = true;
        }
    }

    /// Carries `plan` out: the slot created, the position resumed and recorded, or
    /// the slot healed. A cutover's or a resync's backlog is published here: the
    /// caller readies the producer for it first.
    ///
    /// # Errors
    ///
    /// The slot is busy, lost with `relay.on_slot_loss = "fail"`, healed by another
    /// relay meanwhile, or a step failed.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn carry_out(
        &mut self,
        plan: StartPlan,
        link: &mut Link,
        config: &Config,
        positions: &PositionTable,
        remembered: Option<Remembered>,
        busy_timeout: Duration,
        health: &Health,
    ) -> Result<Start> {
        let slot_name = config.postgres.slot_name();
        let history = link.server.history;
        match plan {
            // `decide` does not let it through; were it to, it means what a wait
            // that timed out means.
            StartPlan::Busy { pid } => Err(Prerequisite::SlotBusy {
                slot: slot_name,
                pid,
                waited_secs: busy_timeout.as_secs(),
            }
            .into()),
            // The core starts at exactly what was recorded, nothing remembered.
            StartPlan::Fresh => Ok(Start {
                at: self
                    .create_slot(link, config, positions, busy_timeout)
                    .await?,
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
                if history_changed {
                    tracing::warn!(slot = %slot_name, %history, from = %from, server_wal_end = %link.server.wal_end,
                        previous = ?self.history, remembered = ?remembered.map(|r| r.confirmed),
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
                at: self
                    .heal(link, config, positions, remembered, &loss, health)
                    .await?,
                fresh_core: true,
            }),
        }
    }

    /// The session streams on `history` of a server started at `started`.
    pub(super) fn opened(&mut self, history: ServerHistory, started: Option<i64>) {
        self.history = Some(history);
        self.server_started = started;
    }

    /// The poison rows of events this session may stream again (from `start` to the
    /// WAL end now, after any wait for the slot): a failed read costs duplicates,
    /// never a loss, so it does not stop the start.
    pub(super) async fn recorded_poison(
        link: &mut Link,
        config: &Config,
        start: Lsn,
    ) -> RecordedPoison {
        let copy_limit = config.relay.poison_copy_limit_bytes;
        let read = async {
            // The WAL end of the slot's server; the rows where they are written.
            let wal_end = crate::postgres::wal_end(&link.metadata).await?;
            let outboxes: Vec<_> = config.outboxes().collect();
            let slot = config.postgres.slot_name();
            RecordedPoison::read(link.writes(), &outboxes, &slot, copy_limit, start, wal_end).await
        };
        read.await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "cannot read the poison rows of this session's stretch of WAL: events an earlier process poisoned may be produced again");
                RecordedPoison::default()
            })
    }

    /// First start: the slot is created (after a cutover from a poller when
    /// configured) and its position recorded.
    async fn create_slot(
        &self,
        link: &mut Link,
        config: &Config,
        positions: &PositionTable,
        busy_timeout: Duration,
    ) -> Result<Lsn> {
        let slot_name = config.postgres.slot_name();
        let history = link.server.history;
        // On a standby, the primary is asked for the snapshot records the
        // creation waits for.
        let _snapshots = StandbySnapshots::start(link.conn.on_standby(), self.primary.as_ref());
        // A missing slot (or an interrupted cutover) first gets the backlog the
        // poller had not sent; then the slot exists and streaming starts at its
        // consistent point.
        crate::cdc::cutover::prepare(
            config,
            &self.conninfo,
            &mut link.conn,
            &mut ServerPair::of(&mut link.metadata, link.primary.as_mut()),
            history,
            crate::cdc::cutover::Trigger::Run(config.relay.cutover),
        )
        .await?;
        let state =
            slot::wait_for_slot(&mut link.conn, &link.metadata, &slot_name, busy_timeout).await?;
        let start = match state {
            SlotState::Created(created) => {
                tracing::info!(slot = %slot_name, consistent_point = %created.consistent_point, "replication slot created");
                created.consistent_point
            }
            SlotState::Existing { confirmed_flush } => confirmed_flush,
        };
        positions
            .adopt(link.writes(), history, start, false)
            .await?;
        Ok(start)
    }

    /// A lost slot: fail (exit 3) or resync, under the cutover's advisory lock so
    /// two relays do not heal it twice. Returns the new slot's consistent point.
    async fn heal(
        &self,
        link: &mut Link,
        config: &Config,
        positions: &PositionTable,
        remembered: Option<Remembered>,
        loss: &SlotLoss,
        health: &Health,
    ) -> Result<Lsn> {
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
        let replanned = plan(link, config, positions, remembered).await?;
        let StartPlan::Lost {
            loss,
            delivered_xmin,
        } = replanned
        else {
            // Healed by another relay while we waited for the lock; the session
            // ends with the connection, which releases the lock.
            return Err(Error::RelaySlotHealedElsewhere { slot: slot_name });
        };
        let snapshots = StandbySnapshots::start(link.conn.on_standby(), self.primary.as_ref());
        let summary = crate::cdc::resync::resync(
            config,
            &self.conninfo,
            &mut link.conn,
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
            invalidated: info.wal_status.as_deref() == Some("lost"),
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
