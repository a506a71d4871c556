//! The shell's clock: tokio's, so that a simulation with paused time moves it.
//!
//! `tokio::time::Instant::now()` is `std::time::Instant::now()` unless the runtime
//! pauses time (`tokio::time::pause`, tests only); then it moves only when the
//! runtime advances it, and the shell's deadlines, timeouts and ages follow the
//! simulated time instead of the machine's.

use std::time::{Duration, Instant};

/// Now, on tokio's clock, as a `std` instant (what the core takes).
#[must_use]
pub(crate) fn now() -> Instant {
    tokio::time::Instant::now().into_std()
}

/// How long ago `since` was, on tokio's clock (zero if it is in the future).
#[must_use]
pub(crate) fn elapsed(since: Instant) -> Duration {
    now().saturating_duration_since(since)
}
