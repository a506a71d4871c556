//! The opening of a session: what this process remembers of the last session, and
//! the start plan asked of the database port (`ports::database`): connect, read the
//! server's identity and history, wait for the slot, decide where to start
//! (`cdc::start`), and carry the decision out (create the slot after a cutover
//! from a poller when configured, resume and record the position, or heal a lost
//! slot with `cdc::resync`).
//!
//! The decision is made on the facts as they are after any wait for the slot:
//! another relay may have streamed from it meanwhile, and an active slot is never
//! judged. What this process remembers of the last session (the server history, the
//! confirmed and saved positions, when the server started) is part of those facts:
//! a restarted server rewinds its slot to the last checkpoint, and a restored or
//! promoted one has another history.
//!
//! It owns that memory and the port, nothing else: the core, the producer and the
//! saver are passed in by the loop, which applies the outcome to them.

use std::time::Duration;

use crate::cdc::metrics::Health;
use crate::cdc::ports::database::{Opened, SessionDatabase, Start};
use crate::cdc::progress::Core;
use crate::cdc::start::{Remembered, StartPlan};
use crate::config::Config;
use crate::error::Result;
use crate::outbox::position::ServerHistory;

/// See the module documentation.
pub(super) struct Opening {
    /// PostgreSQL, as the session sees it.
    pub(super) database: Box<dyn SessionDatabase>,
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
    pub(super) fn new(database: Box<dyn SessionDatabase>, wal_sender_timeout: Duration) -> Opening {
        Opening {
            database,
            history: None,
            server_started: None,
            wal_sender_timeout,
        }
    }

    /// The server history of the current session (`None` before the first).
    pub(super) fn history(&self) -> Option<ServerHistory> {
        self.history
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

    /// The start plan on the facts after waiting for the slot.
    ///
    /// # Errors
    ///
    /// A connection or a query failed, or the slot stayed busy past `busy_timeout`.
    pub(super) async fn decide(
        &mut self,
        remembered: Option<Remembered>,
        busy_timeout: Duration,
    ) -> Result<StartPlan> {
        self.database.plan(remembered, busy_timeout).await
    }

    /// Carries `plan` out (`SessionDatabase::carry_out`).
    ///
    /// # Errors
    ///
    /// The slot is busy, lost with `relay.on_slot_loss = "fail"`, healed by another
    /// relay meanwhile, or a step failed.
    pub(super) async fn carry_out(
        &mut self,
        plan: StartPlan,
        remembered: Option<Remembered>,
        busy_timeout: Duration,
        health: &Health,
    ) -> Result<(Start, Opened)> {
        let start = self
            .database
            .carry_out(plan, remembered, busy_timeout, health)
            .await?;
        Ok((start, self.database.opened()?))
    }

    /// The session streams on `history` of a server started at `started`.
    pub(super) fn opened(&mut self, history: ServerHistory, started: Option<i64>) {
        self.history = Some(history);
        self.server_started = started;
    }
}
