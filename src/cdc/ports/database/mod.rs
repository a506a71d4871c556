//! The database port: what a session asks of PostgreSQL, apart from the stream.
//!
//! - **The start plan** ([`SessionDatabase::plan`]): connect to the slot's server
//!   (and the primary, when the slot lives on a standby), read its identity,
//!   timeline forks and start time, wait for the slot, read the slot, the recorded
//!   position and the WAL end, and decide (`cdc::start`, pure). The slot is read
//!   before the position: a relay streaming from it saves before it confirms, so
//!   read in this order the slot can only look behind the record, never ahead.
//! - **Carrying it out** ([`SessionDatabase::carry_out`]): create the slot (after a
//!   cutover from a poller when configured), record or save the position, or heal
//!   a lost slot (`cdc::resync`) under the cutover's advisory lock.
//! - **The session's reads and writes**: the parked keys, the poison rows an
//!   earlier process wrote for this stretch of WAL, the position saves
//!   ([`PositionWrites`], used by `cdc::position_saver`'s task), the stream itself,
//!   and exactly-once's reads of the WAL end and of transaction identities
//!   (`cdc::wal_identity`).
//!
//! With `postgres.slot_url` the slot lives on a standby and the relay's writes go
//! to the primary (`postgres::servers`): the link holds a metadata connection to
//! each, and every step reads the slot where it lives and the position where it is
//! written.
//!
//! The real adapter is `postgres::Postgres` (beside this file); the simulated one
//! is `cdc::simulation`'s.

pub(crate) mod postgres;

use std::time::Duration;

use super::Boxed;
use super::stream::WalStream;
use crate::cdc::metrics::Health;
use crate::cdc::progress::SavePhase;
use crate::cdc::start::{Remembered, ServerView, StartPlan};
use crate::cdc::wal_identity::{TxNames, Verdict};
use crate::error::Result;
use crate::hashing::HashSet;
use crate::lsn::Lsn;
use crate::outbox::position::ServerHistory;
use crate::poison::{ParkedKey, RecordedPoison};
use crate::postgres::replication::ReplicationError;

/// Where a session starts, decided and carried out.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Start {
    pub(crate) at: Lsn,
    /// Nothing of this process's positions carries over (a new slot, another
    /// history, a restarted server, a healed slot).
    pub(crate) fresh_core: bool,
}

/// The server a session opened on.
#[derive(Debug, Clone)]
pub(crate) struct Opened {
    /// The slot's server as the session found it.
    pub(crate) server: ServerView,
    /// When the server the writes go to started (the position saver refuses one
    /// that restarted meanwhile).
    pub(crate) writes_started: Option<i64>,
}

/// Why a position save did not happen (`cdc::position_saver` reports it).
#[derive(Debug, Clone)]
pub(crate) struct SaveError {
    pub(crate) message: String,
    pub(crate) phase: SavePhase,
    /// The server's SQLSTATE, when it sent one.
    pub(crate) sqlstate: Option<String>,
    /// Why the row is not this session's to write, when it is not: retrying
    /// cannot help.
    pub(crate) refused: Option<Refusal>,
}

/// Why a position save is refused: the session ends, and the next one's start plan
/// decides on what it finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The server restarted since the session began: it may be a copy restored in
    /// place, which the next session's start plan judges. Routine when the slot
    /// lives on a standby (`postgres.slot_url`) and the primary restarts under a
    /// streaming session.
    ServerRestarted,
    /// The row belongs to another history, or a resync is pending on it.
    NotOurs,
}

impl SaveError {
    pub(crate) fn connecting(e: &crate::postgres::PgError) -> Self {
        SaveError {
            message: e.to_string(),
            phase: SavePhase::Connecting,
            sqlstate: e.sqlstate().map(str::to_owned),
            refused: None,
        }
    }
}

impl From<crate::outbox::checkpoint::CheckpointError> for SaveError {
    fn from(e: crate::outbox::checkpoint::CheckpointError) -> Self {
        let sqlstate = match &e {
            crate::outbox::checkpoint::CheckpointError::Postgres(pg) => {
                pg.code().map(|code| code.code().to_owned())
            }
            _ => None,
        };
        SaveError {
            message: e.to_string(),
            phase: SavePhase::Statement,
            sqlstate,
            refused: None,
        }
    }
}

/// The writes of one session's position saver.
pub(crate) trait PositionWrites: Send {
    /// Saves `target` as the session's position (reconnecting first if needed).
    fn save(&mut self, target: Lsn) -> Boxed<'_, std::result::Result<(), SaveError>>;
}

/// See the module documentation.
pub(crate) trait SessionDatabase: Send + Sync {
    /// Connects and decides where to start, on the facts after any wait for the
    /// slot (a resume is decided only after one wait: another relay may have
    /// streamed meanwhile).
    fn plan(
        &mut self,
        remembered: Option<Remembered>,
        busy_timeout: Duration,
    ) -> Boxed<'_, Result<StartPlan>>;

    /// Carries `plan` out. A cutover's or a resync's backlog is published here: the
    /// caller readies the producer for it first.
    fn carry_out<'a>(
        &'a mut self,
        plan: StartPlan,
        remembered: Option<Remembered>,
        busy_timeout: Duration,
        health: &'a Health,
    ) -> Boxed<'a, Result<Start>>;

    /// The server the planned session opened on.
    ///
    /// # Errors
    ///
    /// No session was planned.
    fn opened(&self) -> Result<Opened>;

    /// The keys parked behind poison rows (`relay.on_poison = "park-key"`).
    fn parked_keys(&mut self) -> Boxed<'_, Result<HashSet<ParkedKey>>>;

    /// The poison rows of events this session may stream again (from `start` to
    /// the WAL end now): a failed read costs duplicates, never a loss.
    fn recorded_poison(&mut self, start: Lsn) -> Boxed<'_, RecordedPoison>;

    /// The position writes of a session on `history`, to the server the writes go
    /// to, which started at `server_started`.
    fn position_writes(
        &self,
        history: ServerHistory,
        server_started: Option<i64>,
    ) -> Box<dyn PositionWrites>;

    /// Starts streaming from `slot` at `start` with the pgoutput `options`.
    fn start_streaming<'a>(
        &'a mut self,
        slot: &'a str,
        start: Lsn,
        options: &'a [(&'a str, &'a str)],
    ) -> Boxed<'a, std::result::Result<Box<dyn WalStream>, ReplicationError>>;

    /// The session's start is over (streaming, or failed): its connections go,
    /// the stream keeps its own. An advisory lock a failed cutover or heal held is
    /// released with them, and nothing stays idle while the session streams.
    fn release(&mut self);

    /// The slot server's WAL end now.
    fn wal_end(&mut self) -> Boxed<'_, Result<Lsn>>;

    /// The pid of the walsender that holds the slot now, asked on a short
    /// connection of its own (`Some(None)`: nobody holds it); `None` when the
    /// server could not be asked.
    fn slot_active_pid(&self) -> Boxed<'_, Option<Option<i32>>>;

    /// Whether the transactions `names` names past `confirmed` (from `start`)
    /// committed on this server at the recorded times (`cdc::wal_identity`).
    fn wal_identity<'a>(
        &'a mut self,
        names: &'a TxNames,
        confirmed: Lsn,
        start: Lsn,
    ) -> Boxed<'a, Result<Verdict>>;
}
