//! When to send a standby status update, and what it says.
//!
//! # Why status updates ignore back-pressure
//!
//! A walsender drops a client that has not replied for `wal_sender_timeout` (default 60 s)
//! and sets "reply requested" in a keepalive at half that time. When the in-flight window
//! is full the shell stops reading the socket, so it may never see that keepalive. The core
//! therefore schedules a status update on its own timer ([`CoreConfig::status_interval`](super::CoreConfig::status_interval),
//! which must be well below `wal_sender_timeout / 2`) and the shell must drain and send it
//! whatever [`Core::can_read`] says. The timer is also checked on every input that carries
//! `now`, so a shell whose timer branch is starved by a stream of acks still sends on time.
//! A status is also sent promptly (but at most once per `progress_status_interval`) after the
//! confirmed LSN moved, never once per event. `flush` never goes backwards and `write` is
//! never below `flush`.

use std::time::Instant;

use super::config::MIN_STATUS_INTERVAL;
use super::core::{Core, StatusUpdate};
use super::saving::{SavePhase, means_shutdown};
use crate::lsn::Lsn;

impl Core {
    /// The final status update to send on graceful shutdown (typically once
    /// [`Core::is_idle`]), then close the stream with CopyDone.
    pub fn shutdown_status(&mut self) -> StatusUpdate {
        self.status_due = false;
        self.build_status()
    }

    pub(super) fn status_deadline(&self) -> Option<Instant> {
        // Progress is what a status may confirm now: the watermark capped at the
        // saved position (a watermark ahead of it waits for the save, not a timer).
        let progress = self.saving.limit(self.confirmed) > self.reported_flush;
        if progress && self.resolved_since_status >= self.cfg.max_in_flight_events {
            return Some(self.last_status_at);
        }
        let wait = if progress {
            self.cfg
                .progress_status_interval
                .clamp(MIN_STATUS_INTERVAL, self.cfg.status_interval)
        } else {
            self.cfg.status_interval
        };
        self.last_status_at.checked_add(wait)
    }

    pub(super) fn poll_status(&mut self, now: Instant) {
        self.plan_save(now);
        if !self.status_due
            && let Some(due) = self.status_deadline()
            && now >= due
        {
            self.schedule_status(now);
        }
    }

    pub(super) fn schedule_status(&mut self, now: Instant) {
        self.plan_save(now);
        self.status_due = true;
        self.last_status_at = self.last_status_at.max(now);
    }

    /// The status to send now: the watermark capped at the saved position
    /// (`saving.rs`).
    pub(super) fn build_status(&mut self) -> StatusUpdate {
        self.resolved_since_status = 0;
        let flush = self.status_flush();
        self.reported_flush = flush;
        StatusUpdate::at(self.written, flush)
    }
}

// The saved position (`saving.rs` explains the rule).
impl Core {
    /// The shell saved `lsn` in `outbox_relay_position`. The status confirming it
    /// follows the usual timing (at most one per `progress_status_interval`, at once
    /// when a window's worth of events waits), so saves completing one after another
    /// do not turn into a status each.
    pub fn saved(&mut self, lsn: Lsn, now: Instant) {
        if self.saving.saved(lsn) {
            self.poll_status(now);
        }
    }

    /// A save failed in `phase` with `sqlstate` (if the server sent one). The shell
    /// keeps retrying the newest request; a new connection refused during a shutdown
    /// means the session must end ([`Core::server_stopping`], module docs).
    pub fn save_failed(&mut self, phase: SavePhase, sqlstate: Option<&str>) {
        if means_shutdown(phase, sqlstate) {
            self.saving.stopping = true;
        }
    }

    /// The highest position known to be saved.
    #[must_use]
    pub fn saved_position(&self) -> Lsn {
        self.saving.saved
    }

    /// The server is shutting down: the shell must end the session (close the
    /// connection), so that the walsender, which waits for its client before it
    /// exits, lets the shutdown complete (`saving.rs`).
    #[must_use]
    pub fn server_stopping(&self) -> bool {
        self.saving.stopping
    }

    /// Resolved events the saved position may not cover yet.
    #[must_use]
    pub fn unsaved_events(&self) -> usize {
        self.saving.unsaved()
    }

    /// Whether the position a status would confirm waits for a save.
    pub(super) fn save_blocks_reading(&self) -> bool {
        self.open.is_none() && self.saving.unsaved() >= self.cfg.max_in_flight_events
    }

    /// When a save of keepalive progress alone falls due (once per status
    /// interval); `None` when none waits for the clock.
    pub(super) fn save_deadline(&self) -> Option<Instant> {
        let s = &self.saving;
        (self.confirmed > s.requested && !s.resolved_since_request)
            .then(|| s.requested_at.checked_add(self.cfg.status_interval))
            .flatten()
    }

    /// Asks for a save of the watermark when events were resolved since the last
    /// request (urgently once half a window waits), else — keepalive progress only —
    /// once per status interval, so the save's own WAL cannot keep an idle relay
    /// saving.
    pub(super) fn plan_save(&mut self, now: Instant) {
        let confirmed = self.confirmed;
        let s = &mut self.saving;
        if confirmed <= s.requested {
            return;
        }
        let idle_due = now.saturating_duration_since(s.requested_at) >= self.cfg.status_interval;
        if !s.resolved_since_request && !idle_due {
            return;
        }
        let urgent = s.unsaved() >= self.cfg.max_in_flight_events.div_ceil(2);
        s.request(confirmed, urgent, now);
    }

    /// `flush` of the next status: the watermark, capped at the saved position.
    pub(super) fn status_flush(&self) -> Lsn {
        self.saving.limit(self.confirmed).max(self.reported_flush)
    }
}

impl StatusUpdate {
    /// A status confirming `flush`, with `write` never below it.
    pub(super) fn at(write: Lsn, flush: Lsn) -> Self {
        StatusUpdate {
            write: write.max(flush),
            flush,
            apply: flush,
            reply_requested: false,
        }
    }
}
