//! The core's tuning, [`CoreConfig`], and why out-of-range values are normalised
//! rather than rejected here.
//!
//! The core must never deadlock or panic whatever it is given: a zero window would
//! never admit an event, a zero status interval would make the shell spin, and a timer
//! of years would overflow `Instant + Duration`. So [`CoreConfig::normalized`] clamps
//! every field into a safe range, and the clear error message for a bad setting is the
//! config loader's job (`crate::config`), which sees the setting's name.

use std::time::Duration;

/// Smallest status interval the core accepts; a zero interval would make the shell spin.
pub(super) const MIN_STATUS_INTERVAL: Duration = Duration::from_millis(1);

/// Longest timer the core arms, so `Instant + Duration` can never overflow.
pub(super) const MAX_TIMER: Duration = Duration::from_secs(24 * 60 * 60);

/// Tuning of the [`Core`](super::Core). Out-of-range values are normalised by [`Core::new`](super::Core::new) (see each
/// field); validation with a clear message belongs to the config loader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoreConfig {
    /// In-flight window, in events (admitted and not yet resolved). Zero is treated as 1.
    pub max_in_flight_events: usize,
    /// In-flight window, in record bytes. Zero is treated as 1. One event larger than this
    /// is still admitted when the window is empty.
    pub max_in_flight_bytes: usize,
    /// Produce attempts that end in a permanent failure before an event is poisoned.
    /// Transient failures do not count. Zero is treated as 1.
    pub max_attempts: u32,
    /// Keep-alive status period; keep it well below `wal_sender_timeout / 2`.
    /// Clamped to 1 ms ..= 24 h.
    pub status_interval: Duration,
    /// Minimum gap between two status updates sent because the confirmed LSN moved
    /// (capped by `status_interval`). Short, so the server's idea of the confirmed
    /// LSN trails the acks by little: after a crash everything acked but not yet
    /// reported is sent again, so this gap bounds duplicates beyond the window.
    pub progress_status_interval: Duration,
    /// First delay after a transient failure; doubles per failure of the same event.
    /// Clamped to at most 24 h.
    pub retry_backoff_initial: Duration,
    /// Upper bound of the retry delay. Clamped to at most 24 h.
    pub retry_backoff_max: Duration,
    /// `Some` when events go out in Kafka transactions (`kafka.delivery =
    /// "exactly-once"`): an event then counts as resolved only once the transaction
    /// it was written in committed (`transactions.rs`).
    pub transactions: Option<TransactionLimits>,
}

/// When the core closes a Kafka transaction: at `max_events` events written in it, or
/// `interval` after the first of them was written, whichever comes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransactionLimits {
    /// Events written before the transaction is committed. Zero is treated as 1.
    pub max_events: usize,
    /// Longest time an event waits in an open transaction. Clamped to 1 ms ..= 24 h.
    pub interval: Duration,
}

impl Default for CoreConfig {
    fn default() -> Self {
        Self {
            max_in_flight_events: 10_000,
            max_in_flight_bytes: 64 * 1024 * 1024,
            max_attempts: 5,
            status_interval: Duration::from_secs(10),
            progress_status_interval: Duration::from_millis(10),
            retry_backoff_initial: Duration::from_millis(100),
            retry_backoff_max: Duration::from_secs(30),
            transactions: None,
        }
    }
}

impl CoreConfig {
    pub(super) fn normalized(mut self) -> Self {
        self.max_in_flight_events = self.max_in_flight_events.max(1);
        self.max_in_flight_bytes = self.max_in_flight_bytes.max(1);
        self.max_attempts = self.max_attempts.max(1);
        self.status_interval = self.status_interval.clamp(MIN_STATUS_INTERVAL, MAX_TIMER);
        self.retry_backoff_initial = self.retry_backoff_initial.min(MAX_TIMER);
        self.retry_backoff_max = self.retry_backoff_max.min(MAX_TIMER);
        if let Some(limits) = self.transactions.as_mut() {
            limits.max_events = limits.max_events.max(1);
            limits.interval = limits.interval.clamp(MIN_STATUS_INTERVAL, MAX_TIMER);
        }
        self
    }
}
