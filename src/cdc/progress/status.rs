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

impl Core {
    /// The final status update to send on graceful shutdown (typically once
    /// [`Core::is_idle`]), then close the stream with CopyDone.
    pub fn shutdown_status(&mut self) -> StatusUpdate {
        self.status_due = false;
        self.build_status()
    }

    pub(super) fn status_deadline(&self) -> Option<Instant> {
        if self.confirmed > self.reported_flush
            && self.resolved_since_status >= self.cfg.max_in_flight_events
        {
            return Some(self.last_status_at);
        }
        let wait = if self.confirmed > self.reported_flush {
            self.cfg
                .progress_status_interval
                .clamp(MIN_STATUS_INTERVAL, self.cfg.status_interval)
        } else {
            self.cfg.status_interval
        };
        self.last_status_at.checked_add(wait)
    }

    pub(super) fn poll_status(&mut self, now: Instant) {
        if !self.status_due
            && let Some(due) = self.status_deadline()
            && now >= due
        {
            self.schedule_status(now);
        }
    }

    pub(super) fn schedule_status(&mut self, now: Instant) {
        self.status_due = true;
        self.last_status_at = self.last_status_at.max(now);
    }

    pub(super) fn build_status(&mut self) -> StatusUpdate {
        self.resolved_since_status = 0;
        let flush = self.confirmed.max(self.reported_flush);
        self.reported_flush = flush;
        StatusUpdate {
            write: self.written.max(flush),
            flush,
            apply: flush,
            reply_requested: false,
        }
    }
}
