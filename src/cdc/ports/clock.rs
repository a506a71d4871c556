//! The shell's clock and its randomness: tokio's clock, so that a simulation with
//! paused time moves it, and a jitter that a simulation seeds.
//!
//! `tokio::time::Instant::now()` is `std::time::Instant::now()` unless the runtime
//! pauses time (`tokio::time::pause`, tests only); then it moves only when the
//! runtime advances it, and the shell's deadlines, timeouts and ages follow the
//! simulated time instead of the machine's. The reconnect jitter is the only
//! randomness of the shell; in tests, a simulation fixes it with its seed
//! ([`seed_jitter`]), so that a schedule replays.

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

/// `pause` scaled by a random factor in [0.5, 1.0] (`lifecycle::jittered`); in a
/// seeded simulation, the factor comes from the seed.
#[must_use]
pub(crate) fn jittered(pause: Duration) -> Duration {
    #[cfg(test)]
    if let Some(per_mille) = seeded::per_mille() {
        return pause.saturating_mul(per_mille) / 1000;
    }
    crate::lifecycle::jittered(pause)
}

/// Seeds the jitter of this thread (a simulation's runtime runs on one).
#[cfg(test)]
pub(crate) fn seed_jitter(seed: u64) {
    seeded::SEED.set(Some(seed));
}

#[cfg(test)]
mod seeded {
    use std::cell::Cell;

    thread_local! {
        pub(super) static SEED: Cell<Option<u64>> = const { Cell::new(None) };
    }

    /// The next factor in per mille, from the seeded state (splitmix64).
    pub(super) fn per_mille() -> Option<u32> {
        let state = SEED.get()?;
        let next = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        SEED.set(Some(next));
        let mut z = next;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        u32::try_from(500 + z % 501).ok()
    }
}
