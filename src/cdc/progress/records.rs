//! The shell's copy of each in-flight event, kept exactly as long as the core may ask
//! for it again.
//!
//! # Why the core decides when a record goes
//!
//! The core holds ids, sizes and states; the record itself (key, headers, payload, the
//! row for `poison_outbox`) stays with the shell, because a retry, the produce after
//! an aborted Kafka transaction, or a poison insert needs it again. The one rule that
//! keeps this safe: **a record is dropped when the core says its event is resolved**
//! ([`Core::drain_resolved`]), never on the shell's own reading of an outcome.
//!
//! The rule is not a formality. With `kafka.delivery = "exactly-once"` a delivery
//! report only says that the record is written in the open Kafka transaction; if the
//! transaction is then aborted (a missing topic, a record the broker refuses, a
//! message timeout in a broker stall, a commit that must be aborted) the core hands out
//! a `Produce` for it again. A shell that had dropped the record at its ack had nothing
//! to send, and the next commit resolved the event without it: events lost with the
//! slot confirmed past them. So the ack only marks the record ([`Records::acked`]),
//! and a `Produce` for an id without a record is an error the caller must end the
//! session with ([`MissingRecord`]), never a silent return.
//!
//! The simulators keep their records in this same type, so the rule they check is the
//! one the relay runs.

use crate::hashing::HashMap;
use std::time::Instant;

use super::core::Core;
use crate::delivery::EventId;

/// The core asked for something the shell holds no record of: a broken invariant. The
/// session must end (its unconfirmed transactions are re-sent by the server) rather
/// than resolve the event without sending it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the core asked to produce event {id} (attempt {attempt}), but the relay holds no record \
     of it: a broken invariant; ending the session so that the server sends its transaction \
     again"
)]
pub struct MissingRecord {
    pub id: EventId,
    pub attempt: u32,
}

/// One kept record, and when the broker last acked it.
#[derive(Debug)]
struct Kept<T> {
    record: T,
    acked_at: Option<Instant>,
}

/// The records of the core's in-flight events (see the module documentation).
#[derive(Debug)]
pub struct Records<T> {
    kept: HashMap<EventId, Kept<T>>,
}

impl<T> Default for Records<T> {
    fn default() -> Self {
        Self {
            kept: HashMap::default(),
        }
    }
}

impl<T> Records<T> {
    /// Keeps `record` for `id`, just admitted, if the core has anything to do for it
    /// (an event a lost session already resolved is resolved at admission).
    pub fn admitted(&mut self, core: &Core, id: EventId, record: T) {
        if core.is_in_flight(id) {
            self.kept.insert(
                id,
                Kept {
                    record,
                    acked_at: None,
                },
            );
        }
    }

    /// The record of `id`, if kept.
    #[must_use]
    pub fn get(&self, id: EventId) -> Option<&T> {
        self.kept.get(&id).map(|k| &k.record)
    }

    /// The record of `id`, if kept, to change.
    pub fn get_mut(&mut self, id: EventId) -> Option<&mut T> {
        self.kept.get_mut(&id).map(|k| &mut k.record)
    }

    /// The record to send for a `Produce` of `id`; [`MissingRecord`] when there is
    /// none, which the caller must not swallow.
    ///
    /// # Errors
    ///
    /// No record is kept for `id`.
    pub fn to_produce(&mut self, id: EventId, attempt: u32) -> Result<&mut T, MissingRecord> {
        let kept = self
            .kept
            .get_mut(&id)
            .ok_or(MissingRecord { id, attempt })?;
        kept.acked_at = None;
        Ok(&mut kept.record)
    }

    /// The broker acked the record of `id` at `at`. The record stays: in a Kafka
    /// transaction the ack is not a resolution, and only the core knows.
    pub fn acked(&mut self, id: EventId, at: Instant) -> Option<&mut T> {
        let kept = self.kept.get_mut(&id)?;
        kept.acked_at = Some(at);
        Some(&mut kept.record)
    }

    /// Drops the record of `id` now, for a resolution the caller handles itself (a
    /// committed poison row); returns it.
    pub fn remove(&mut self, id: EventId) -> Option<T> {
        self.kept.remove(&id).map(|k| k.record)
    }

    /// Drops the records of every event the core resolved since the last call, and
    /// hands each to `resolved` with the time of the ack of its last produce (`None`:
    /// resolved without one, e.g. by a Kafka commit that flushed it). Records the
    /// caller removed itself ([`Records::remove`]) are not handed again.
    pub fn forget_resolved(
        &mut self,
        core: &mut Core,
        mut resolved: impl FnMut(T, Option<Instant>),
    ) {
        for id in core.drain_resolved() {
            if let Some(kept) = self.kept.remove(&id) {
                resolved(kept.record, kept.acked_at);
            }
        }
    }

    /// Records kept.
    #[must_use]
    pub fn len(&self) -> usize {
        self.kept.len()
    }

    /// Whether no record is kept.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }

    /// Drops every record (a new core: the server sends the transactions again).
    pub fn clear(&mut self) {
        self.kept.clear();
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::cdc::progress::{Action, CoreConfig, TransactionLimits};
    use crate::delivery::Failure;
    use crate::lsn::Lsn;

    fn transactional() -> CoreConfig {
        CoreConfig {
            max_in_flight_events: 8,
            retry_backoff_initial: Duration::from_millis(100),
            transactions: Some(TransactionLimits {
                max_events: 100,
                interval: Duration::from_millis(50),
            }),
            ..CoreConfig::default()
        }
    }

    /// One committed transaction of `keys.len()` events; their records kept.
    fn admit(core: &mut Core, records: &mut Records<usize>, keys: &[u64]) -> Vec<EventId> {
        let now = Instant::now();
        core.begin(Lsn(100), 7).unwrap();
        let ids: Vec<EventId> = keys
            .iter()
            .map(|&k| core.admit_keyed(10, Some(k), now).unwrap())
            .collect();
        core.commit(Lsn(100), Lsn(110), now).unwrap();
        for (n, &id) in ids.iter().enumerate() {
            records.admitted(core, id, n);
        }
        ids
    }

    /// Executes the core's actions as the shell does: every produce needs its record.
    fn execute(core: &mut Core, records: &mut Records<usize>) -> Vec<Action> {
        let mut out = Vec::new();
        while let Some(action) = core.next_action() {
            match action {
                Action::Save { lsn, .. } => core.saved(lsn, Instant::now()),
                Action::SendStatus(_) => {}
                Action::Produce { id, attempt } => {
                    records
                        .to_produce(id, attempt)
                        .expect("a record for every produce");
                    core.produce_sent(id);
                    out.push(action);
                }
                action => out.push(action),
            }
        }
        out
    }

    #[test]
    fn an_acked_record_survives_the_abort_of_its_transaction() {
        let now = Instant::now();
        let mut core = Core::new(transactional(), Lsn(50), now);
        let mut records = Records::default();
        let ids = admit(&mut core, &mut records, &[1, 2]);
        execute(&mut core, &mut records);
        // The first is written in the open transaction; its record stays.
        core.delivered(ids[0], now);
        records.acked(ids[0], now);
        records.forget_resolved(&mut core, |_, _| {
            panic!("an ack in a transaction resolves nothing")
        });
        assert_eq!(records.len(), 2);
        // The second fails: the transaction is aborted and both go out again.
        core.delivery_failed(ids[1], Failure::Transient, now);
        assert_eq!(
            execute(&mut core, &mut records),
            vec![Action::AbortTransaction]
        );
        core.transaction_aborted(now);
        core.tick(now + Duration::from_millis(200));
        let again = execute(&mut core, &mut records);
        assert!(again.contains(&Action::Produce {
            id: ids[0],
            attempt: 2
        }));
        // Both written and committed: only now are the records dropped, each once.
        for &id in &ids {
            core.delivered(id, now);
            records.acked(id, now);
        }
        core.commit_now();
        assert_eq!(
            execute(&mut core, &mut records),
            vec![Action::CommitTransaction]
        );
        core.transaction_committed(now);
        let mut dropped = Vec::new();
        records.forget_resolved(&mut core, |n, acked| {
            assert!(acked.is_some());
            dropped.push(n);
        });
        dropped.sort_unstable();
        assert_eq!(dropped, vec![0, 1]);
        assert!(records.is_empty());
        assert_eq!(core.confirmed(), Lsn(110));
    }

    #[test]
    fn a_commit_resolves_only_members_handed_to_the_producer() {
        let now = Instant::now();
        let mut core = Core::new(transactional(), Lsn(50), now);
        let mut records = Records::default();
        let ids = admit(&mut core, &mut records, &[1, 2]);
        let mut handed = Vec::new();
        while let Some(action) = core.next_action() {
            if let Action::Produce { id, .. } = action {
                handed.push(id);
            }
        }
        assert_eq!(handed, ids);
        // The shell sent the first only.
        core.produce_sent(ids[0]);
        core.delivered(ids[0], now);
        core.commit_now();
        assert_eq!(
            execute(&mut core, &mut records),
            vec![Action::CommitTransaction]
        );
        let mark = core.transaction_mark().expect("a mark");
        assert_eq!(mark.confirmed, Lsn(50), "the unsent event is not durable");
        core.transaction_committed(now);
        assert!(!core.is_in_flight(ids[0]));
        assert!(core.is_in_flight(ids[1]), "resolved without being sent");
        assert_eq!(core.confirmed(), Lsn(50));
        assert_eq!(
            execute(&mut core, &mut records),
            vec![Action::Produce {
                id: ids[1],
                attempt: 1
            }]
        );
    }

    #[test]
    fn a_produce_without_a_record_is_an_error() {
        let mut records: Records<usize> = Records::default();
        let id = EventId::from_raw(3);
        assert_eq!(
            records.to_produce(id, 2).err(),
            Some(MissingRecord { id, attempt: 2 })
        );
    }
}
