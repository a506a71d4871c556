//! The core's structural invariants, checked after every call by the unit tests, the
//! simulator and the arbitrary-call property test.
//!
//! They restate the bookkeeping the watermark depends on, so that a slip in one
//! counter shows up at the call that caused it rather than as a wrong confirmed LSN
//! many steps later: every in-flight event is counted by exactly one transaction entry
//! and by the byte window, every backoff has its timer, a key is blocked exactly by its
//! failed events and holds exactly its held events, only the last entry may be open,
//! and no entry but the open one is left with nothing pending.

use std::collections::VecDeque;

use crate::hashing::HashMap;

use super::core::{Core, EventState};

impl Core {
    /// Structural invariants of the tracker; every test and the simulator call it.
    pub(super) fn check_invariants(&self) {
        let pending: usize = self.txs.values().map(|t| t.pending).sum();
        assert_eq!(pending, self.events.len(), "pending counts vs events");
        let bytes: usize = self.events.values().map(|e| e.bytes).sum();
        assert_eq!(bytes, self.in_flight_bytes, "in-flight bytes");
        for (id, e) in &self.events {
            assert!(self.txs.contains_key(&e.tx), "{id} has no transaction");
            if e.state == EventState::Waiting {
                let k = e.key.expect("only keyed events wait");
                assert!(e.failed, "{id} waits without having failed");
                assert!(
                    self.events
                        .range(..*id)
                        .any(|(_, o)| o.failed && o.key == Some(k)),
                    "{id} waits for no earlier failure of its key"
                );
            }
            if let EventState::Backoff { until, .. } = e.state {
                assert!(self.retries.contains(&(until, *id)), "{id} has no timer");
            }
        }
        for &(at, id) in &self.retries {
            let e = self.events.get(&id).expect("timer of a gone event");
            assert!(matches!(e.state, EventState::Backoff { until, .. } if until == at));
        }
        // Per-key holds: a key is blocked exactly by its failed events, and
        // exactly the held events of blocked keys wait in `held`, in order.
        let mut failed_per_key: HashMap<u64, u32> = HashMap::default();
        for e in self.events.values() {
            if e.failed
                && let Some(k) = e.key
            {
                *failed_per_key.entry(k).or_default() += 1;
            }
        }
        assert_eq!(failed_per_key, self.blocked_keys, "blocked keys");
        let held: usize = self.held.values().map(VecDeque::len).sum();
        let held_states = self
            .events
            .values()
            .filter(|e| e.state == EventState::Held)
            .count();
        assert_eq!(held, held_states, "held events");
        let halted = self
            .events
            .values()
            .filter(|e| e.state == EventState::Halted)
            .count();
        assert_eq!(halted, self.halted, "halted events");
        for (k, ids) in &self.held {
            assert!(self.blocked_keys.contains_key(k), "held under a free key");
            assert!(ids.iter().is_sorted(), "held out of admission order");
        }
        // Kafka transactions: members are produced or written, every written event is
        // a member, and the written count matches.
        let written = self
            .events
            .iter()
            .filter(|(_, e)| e.state == EventState::Written)
            .inspect(|(id, _)| assert!(self.kafka.members.contains(id), "{id} written outside"))
            .count();
        assert_eq!(written, self.kafka.written, "written events");
        for id in &self.kafka.members {
            let e = self
                .events
                .get(id)
                .expect("member resolved without its commit");
            assert!(
                matches!(e.state, EventState::Producing { .. } | EventState::Written),
                "{id} is a member in state {:?}",
                e.state
            );
        }
        for id in &self.kafka.sent {
            assert!(
                self.kafka.members.contains(id),
                "{id} sent outside the transaction"
            );
        }
        if !self.transactional() {
            assert!(
                self.kafka.members.is_empty(),
                "members without transactions"
            );
        }
        let open_seq = self.open.map(|o| o.seq);
        let last_seq = self.txs.keys().next_back().copied();
        if open_seq.is_some() {
            assert_eq!(open_seq, last_seq, "only the last entry may be open");
        }
        for (seq, t) in &self.txs {
            if Some(*seq) != open_seq {
                assert!(t.end_lsn.is_some(), "closed entry without end");
                assert!(t.pending > 0, "resolved entry left in the queue");
            }
        }
        assert!(
            self.txs.len() <= self.cfg.max_in_flight_events + 1,
            "tx queue"
        );
        assert!(self.events.len() <= self.cfg.max_in_flight_events, "window");
        assert!(
            self.reported_flush <= self.confirmed,
            "reported past confirmed"
        );
        assert!(
            self.reported_flush <= self.saving.saved,
            "reported past the saved position"
        );
        if let Some((_, front)) = self.txs.first_key_value()
            && let Some(end) = front.end_lsn
        {
            assert!(self.confirmed < end || front.pending > 0);
        }
    }
}
