//! How the long-running loops stop and wait: the shutdown signal, exponential
//! backoff, and a sleep that ends early on shutdown.
//!
//! Every command that runs until told to stop (`run`, `poll`, `cutover`, `retention`)
//! receives a [`Shutdown`] future and must never sleep past it: a SIGTERM during a
//! retry pause has to stop the process at once, not after the pause. The retry loops
//! share one [`Backoff`] so they grow and reset the same way.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// A shutdown signal: a future that completes when the command should stop.
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Exponential backoff: starts at `initial`, doubles after each failure, capped at
/// `max`; [`Backoff::reset`] after a success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    current: Duration,
}

impl Backoff {
    /// A backoff from `initial` up to `max` (a `max` below `initial` is raised to it).
    #[must_use]
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        Backoff {
            initial,
            max: max.max(initial),
            current: initial,
        }
    }

    /// The pause to take now; the next one is twice as long, up to the cap.
    pub fn next_pause(&mut self) -> Duration {
        let pause = self.current;
        self.current = self.current.saturating_mul(2).min(self.max);
        pause
    }

    /// The pause [`Backoff::next_pause`] would return, without advancing.
    #[must_use]
    pub fn peek(&self) -> Duration {
        self.current
    }

    /// Back to the initial pause (after a success).
    pub fn reset(&mut self) {
        self.current = self.initial;
    }
}

/// Sleeps for `pause` unless `shutdown` fires first. Returns `true` when the sleep
/// ended because of the shutdown, so the caller returns at once.
pub async fn sleep_or_shutdown(shutdown: &mut Shutdown, pause: Duration) -> bool {
    tokio::select! {
        biased;
        () = shutdown => true,
        () = tokio::time::sleep(pause) => false,
    }
}

/// `pause` scaled by a random factor in [0.5, 1.0]: processes that lost their
/// connection at the same moment (a database restart) do not all come back at once.
#[must_use]
pub fn jittered(pause: Duration) -> Duration {
    use std::hash::{BuildHasher, Hasher};
    // Each `RandomState` is seeded afresh: a dependency-free source of noise, which
    // is all jitter needs.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(0);
    let per_mille = 500 + hasher.finish() % 501;
    pause.saturating_mul(u32::try_from(per_mille).unwrap_or(1000)) / 1000
}

/// A pause in whole milliseconds, for log fields such as `retry_in_ms`
/// (saturating: the pauses logged are seconds long).
#[must_use]
pub(crate) fn millis(pause: Duration) -> u64 {
    u64::try_from(pause.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn jitter_stays_between_half_and_the_whole_pause() {
        let pause = MS * 1000;
        let seen: std::collections::HashSet<Duration> = (0..200).map(|_| jittered(pause)).collect();
        assert!(seen.iter().all(|p| *p >= MS * 500 && *p <= pause));
        assert!(seen.len() > 10, "not random: {seen:?}");
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets() {
        let mut b = Backoff::new(MS * 200, MS * 1000);
        let pauses: Vec<_> = (0..5).map(|_| b.next_pause()).collect();
        assert_eq!(pauses, [MS * 200, MS * 400, MS * 800, MS * 1000, MS * 1000]);
        b.reset();
        assert_eq!(b.next_pause(), MS * 200);
    }

    #[test]
    fn a_cap_below_the_start_is_raised_to_it() {
        let mut b = Backoff::new(MS * 50, MS * 10);
        assert_eq!(b.next_pause(), MS * 50);
        assert_eq!(b.peek(), MS * 50);
    }

    #[tokio::test]
    async fn shutdown_cuts_the_sleep_short() {
        let mut fired: Shutdown = Box::pin(async {});
        assert!(sleep_or_shutdown(&mut fired, Duration::from_secs(3600)).await);
        let mut idle: Shutdown = Box::pin(std::future::pending());
        assert!(!sleep_or_shutdown(&mut idle, MS).await);
    }
}
