//! The hash maps of the relay's state: fast, keyed at random in the binary, and
//! seeded in tests so that a simulated schedule replays.
//!
//! # Why
//!
//! The whole-relay simulation (`cdc::simulation`) runs the real shell and core on
//! one thread with paused time, and a schedule is meant to be a function of its
//! seed. A hash map's iteration order is not: `std`'s `RandomState` takes its keys
//! from the operating system once per thread and then counts up one per map, and
//! foldhash's mixes in a per-process seed and a per-thread counter. So where the
//! relay walks a map (the events it drains, the keys it releases) the order would
//! come from the process and from how many maps earlier schedules had built on the
//! thread, and a seed would not name one schedule.
//!
//! The maps of the state the simulation drives are therefore [`HashMap`] and
//! [`HashSet`] of this module. In the binary they hash with
//! `foldhash::fast::RandomState`: fast, and keyed at random per process and map.
//! foldhash claims little resistance to collisions chosen on purpose; the keys
//! here are the application's own (topics, record keys, LSNs), and every map but
//! the parked keys (the operator's `replay` table) is bounded by the in-flight
//! window. In tests each new map takes
//! the next seed of a per-thread sequence that [`seed`] restarts, so a schedule
//! walks its maps in an order that depends on its seed and nothing else, and two
//! schedules walk them in different orders.

/// The maps' hasher: random per map in the binary (module docs).
#[cfg(not(test))]
pub(crate) type Hashing = foldhash::fast::RandomState;

/// The maps' hasher: seeded per thread in tests (module docs).
#[cfg(test)]
pub(crate) type Hashing = seeded::SeededState;

/// A `HashMap` of the relay's state (module docs).
pub(crate) type HashMap<K, V> = std::collections::HashMap<K, V, Hashing>;

/// A `HashSet` of the relay's state (module docs).
pub(crate) type HashSet<T> = std::collections::HashSet<T, Hashing>;

/// Restarts this thread's sequence of map seeds at `seed` (a simulated schedule
/// calls it before it builds anything).
#[cfg(test)]
pub(crate) fn seed(seed: u64) {
    seeded::NEXT.set(seed);
}

#[cfg(test)]
mod seeded {
    use std::cell::Cell;
    use std::hash::BuildHasher;

    use foldhash::fast::{FixedState, FoldHasher};

    thread_local! {
        pub(super) static NEXT: Cell<u64> = const { Cell::new(0) };
    }

    /// A fixed-seed foldhash whose seed is the next of this thread's sequence.
    #[derive(Clone, Debug)]
    pub(crate) struct SeededState(FixedState);

    impl Default for SeededState {
        fn default() -> SeededState {
            // splitmix64: successive states are far apart.
            let state = NEXT.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
            NEXT.set(state);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            SeededState(FixedState::with_seed(z ^ (z >> 31)))
        }
    }

    impl BuildHasher for SeededState {
        type Hasher = FoldHasher<'static>;

        fn build_hasher(&self) -> FoldHasher<'static> {
            self.0.build_hasher()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(seed_value: u64) -> Vec<u32> {
        seed(seed_value);
        let set: HashSet<u32> = (0..64).collect();
        set.into_iter().collect()
    }

    #[test]
    fn a_seed_gives_one_order_and_another_seed_another() {
        assert_eq!(order(7), order(7));
        assert_ne!(order(7), order(8));
    }
}
