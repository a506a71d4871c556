//! Reading in pauses: when to wait before reading the replication stream again.
//!
//! # Why
//!
//! At a steady thousand single-row commits a second, the walsender sends every
//! transaction as it commits, and each of its messages (Begin, Insert, Commit) as a
//! TCP segment of its own (`WalSndWriteData` flushes after every message,
//! `src/backend/replication/walsender.c`). A relay that reads as soon as bytes
//! arrive wakes up once or twice per transaction, and each wake-up costs a few tens
//! of microseconds of its runtime thread (epoll, a socket read that also sends the
//! TCP acknowledgement, cold caches for decode and produce), far more than the
//! event's own work (`docs/benchmarks.md`, "Steady cost per event: where it goes").
//! A backlog drain pays it too: the walsender decodes more slowly than the relay
//! maps and produces, so the relay keeps catching up with it and waiting for its next
//! segment.
//!
//! `relay.read_pause_ms` (2 ms by default) trades a little latency for those
//! wake-ups: once the relay has read everything the walsender has sent and no
//! transaction is open, it waits that long before reading again, with the socket's
//! low-water mark raised so that the segments arriving meanwhile wake nobody
//! (`ReplicationStream::hold_readiness`). The transactions committed meanwhile arrive
//! in one read, are produced together and their delivery reports are handled
//! together. The first transaction after a quiet spell is read at once (nothing was
//! read since the last pause, so there is no pause to take); one committed during a
//! pause waits for its end, at most the pause. Measured in `docs/benchmarks.md`,
//! "Reading in pauses".
//!
//! # What it never changes
//!
//! Only *when* the socket is read. Every frame is still read, in order, and handed to
//! the core; no decision of the core's depends on the pause. A pause is not taken
//! while the window is full (the relay waits for reports then, not for the
//! walsender), inside a transaction (its rest is on the way, and a Kafka transaction
//! may be waiting for it) or while a Kafka transaction call is in progress, and it
//! ends early at shutdown. Status updates and the watchdog wait for at most one
//! pause.
//!
//! [`ReadPacing`] holds the rule, without I/O; the session loop asks it and does the
//! waiting.

use std::time::Duration;

/// Whether the session loop should wait before reading again.
#[derive(Debug, Clone)]
pub(crate) struct ReadPacing {
    /// `None`: read as soon as bytes arrive.
    pause: Option<Duration>,
    /// A frame was read since the last pause (or since the session started).
    read_since_pause: bool,
}

impl ReadPacing {
    /// `relay.read_pause_ms`; 0 turns pausing off.
    pub(crate) fn new(pause_ms: u64) -> Self {
        ReadPacing {
            pause: (pause_ms > 0).then(|| Duration::from_millis(pause_ms)),
            read_since_pause: false,
        }
    }

    /// A frame of WAL data was read (not a keepalive: the walsender sends one after
    /// each transaction when it waits for more WAL, and a pause for it would only
    /// delay the next transaction).
    pub(crate) fn frame_read(&mut self) {
        self.read_since_pause = true;
    }

    /// The pause to take if the stream has nothing more to read right now, when the
    /// loop may read (`may_read`: window room, no open transaction, no Kafka
    /// transaction call in progress). `None` means read (or wait for bytes) as usual;
    /// then the caller need not look at the stream at all.
    pub(crate) fn pause_if_caught_up(&self, may_read: bool) -> Option<Duration> {
        self.pause.filter(|_| may_read && self.read_since_pause)
    }

    /// The pause starts: the next one needs a frame read first, so a quiet stream is
    /// waited on as usual instead of in pauses.
    pub(crate) fn pausing(&mut self) {
        self.read_since_pause = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_never_pauses() {
        let mut pacing = ReadPacing::new(0);
        pacing.frame_read();
        assert_eq!(pacing.pause_if_caught_up(true), None);
    }

    #[test]
    fn pauses_only_after_a_frame_and_once_per_frame_read() {
        let mut pacing = ReadPacing::new(2);
        assert_eq!(pacing.pause_if_caught_up(true), None, "nothing read yet");
        pacing.frame_read();
        assert_eq!(
            pacing.pause_if_caught_up(true),
            Some(Duration::from_millis(2))
        );
        pacing.pausing();
        assert_eq!(
            pacing.pause_if_caught_up(true),
            None,
            "a quiet stream is waited on, not polled in pauses"
        );
        pacing.frame_read();
        pacing.frame_read();
        assert_eq!(
            pacing.pause_if_caught_up(true),
            Some(Duration::from_millis(2))
        );
    }

    #[test]
    fn never_pauses_when_the_loop_may_not_read() {
        let mut pacing = ReadPacing::new(5);
        pacing.frame_read();
        assert_eq!(pacing.pause_if_caught_up(false), None);
        assert_eq!(
            pacing.pause_if_caught_up(true),
            Some(Duration::from_millis(5)),
            "the frame read still counts once reading is allowed again"
        );
    }
}
