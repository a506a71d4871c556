//! The relay's own saved position, and the rule that no status confirms past it.
//!
//! # Why the position is saved before the server hears of it
//!
//! Before PostgreSQL 17 a slot's `confirmed_flush_lsn` is persisted only at
//! checkpoints, so a PostgreSQL restart rewinds it and the server re-sends what the
//! relay had delivered. The relay therefore keeps its own position in
//! `outbox_relay_position` (`crate::outbox::position`) and starts from the higher of
//! the two. That only works if the saved position is never *behind* the slot: a slot
//! ahead of every position the relay saved was moved by someone else, and the start
//! plan treats it as lost (`crate::cdc::start`). So a status may confirm only what is
//! saved: the core asks for saves ([`Action::Save`](super::Action::Save)), the shell
//! writes them and reports [`Core::saved`](super::Core::saved), and every status the
//! core builds caps `flush` at the saved position (`status.rs`).
//!
//! # A server that is shutting down: no exception, the session ends
//!
//! During a fast shutdown PostgreSQL ends every backend, refuses new connections, and
//! each walsender waits until its client confirms the very end of the WAL before it
//! exits; a position that cannot be saved would hold the shutdown forever. Confirming
//! without saving would let it complete, but the shutdown checkpoint of PostgreSQL 17
//! persists the slot, which would then be ahead of every saved position: a relay
//! process or a standby started afterwards takes it for lost. A walsender waiting for
//! its client also exits when the client goes away. So once a *new connection* of the
//! saver is refused with SQLSTATE `57P03` (`cannot_connect_now`: the server is
//! shutting down, starting up or recovering), the core says the session must end
//! ([`Core::server_stopping`](super::Core::server_stopping)); the shell closes the
//! connection, the shutdown completes, and the slot keeps the last saved status. What
//! was delivered and not saved is re-sent after the restart, within the bound below.
//!
//! The other codes of class 57P do not mean the server stops: `57P01`
//! (`admin_shutdown`) is also what `pg_terminate_backend` of the saver's backend
//! gives, and `57P02` (`crash_shutdown`) what a crash of *another* backend gives, on a
//! server that is back a moment later (the previous rule let statuses pass the saved
//! position on them, on a healthy server). See
//! <https://www.postgresql.org/docs/current/errcodes-appendix.html> (class 57) and
//! `ProcessStartupPacket` / `canAcceptConnections` in `postmaster.c`.
//!
//! # Bounding what a `kill -9` re-sends
//!
//! Every resolved event the saved position may not cover yet is re-sent after a
//! crash. Each save request notes how many events had been resolved when it was made
//! and a completed save covers the requests at or below it, so the core knows how many
//! resolved events wait for a save. From half a window on, the save is urgent (written
//! without waiting for the saver's gap); from a whole window on,
//! [`Core::can_read`](super::Core::can_read) stops reading between transactions (never inside one: its commit must be read
//! before any of it can be confirmed, let alone saved).

use std::collections::VecDeque;
use std::time::Instant;

use crate::lsn::Lsn;

/// SQLSTATE `cannot_connect_now`.
const CANNOT_CONNECT_NOW: &str = "57P03";

/// Where a save failed, as far as the shutdown rule is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SavePhase {
    /// Opening a new connection to PostgreSQL.
    Connecting,
    /// On an open connection (the statement, or the connection dying under it).
    Statement,
}

/// The save bookkeeping (see the module docs).
#[derive(Debug)]
pub(super) struct Saving {
    /// The highest position known to be saved.
    pub(super) saved: Lsn,
    /// The highest position asked for.
    pub(super) requested: Lsn,
    /// A save is to be asked for: its position and whether it is urgent.
    pub(super) due: Option<(Lsn, bool)>,
    /// When the last save was asked for.
    pub(super) requested_at: Instant,
    /// Events were resolved since the last request.
    pub(super) resolved_since_request: bool,
    /// PostgreSQL refused a new connection while shutting down: the session ends.
    pub(super) stopping: bool,
    /// Events resolved in this core, and how many a completed save covers.
    resolved: u64,
    covered: u64,
    /// Requests not yet saved: position, and events resolved when asked.
    requests: VecDeque<(Lsn, u64)>,
}

impl Saving {
    /// `start` is already saved (the shell saves a session's start before streaming).
    pub(super) fn new(start: Lsn, now: Instant) -> Self {
        Self {
            saved: start,
            requested: start,
            due: None,
            requested_at: now,
            resolved_since_request: false,
            stopping: false,
            resolved: 0,
            covered: 0,
            requests: VecDeque::new(),
        }
    }

    pub(super) fn resolved(&mut self) {
        self.resolved += 1;
        self.resolved_since_request = true;
    }

    /// Resolved events the saved position may not cover yet.
    pub(super) fn unsaved(&self) -> usize {
        usize::try_from(self.resolved - self.covered).unwrap_or(usize::MAX)
    }

    /// `lsn` is saved; returns whether it is news.
    pub(super) fn saved(&mut self, lsn: Lsn) -> bool {
        if lsn <= self.saved {
            return false;
        }
        self.saved = lsn;
        while let Some(&(at, count)) = self.requests.front() {
            if at > lsn {
                break;
            }
            self.covered = count;
            self.requests.pop_front();
        }
        true
    }

    /// A save of `lsn` is asked for now, `urgent` or not.
    pub(super) fn request(&mut self, lsn: Lsn, urgent: bool, now: Instant) {
        self.requested = lsn;
        self.requested_at = now;
        self.resolved_since_request = false;
        if self.requests.back().is_none_or(|&(last, _)| lsn > last) {
            self.requests.push_back((lsn, self.resolved));
        }
        let urgent = urgent || self.due.is_some_and(|(_, u)| u);
        self.due = Some((lsn, urgent));
    }

    /// How far a status may confirm.
    pub(super) fn limit(&self, confirmed: Lsn) -> Lsn {
        confirmed.min(self.saved)
    }
}

/// Whether a failed save means the server is shutting down (module docs).
#[must_use]
pub(super) fn means_shutdown(phase: SavePhase, sqlstate: Option<&str>) -> bool {
    phase == SavePhase::Connecting && sqlstate == Some(CANNOT_CONNECT_NOW)
}
