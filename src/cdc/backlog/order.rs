//! Per-key order and `relay.on_poison` for a backlog, decided without I/O.
//!
//! A backlog (a cutover's unsent rows, a resync's undelivered ones) is published
//! window by window, in commit order (see the parent module). Inside a window the
//! rules are the stream's (`cdc::progress::events`, `cdc::poison_policy`), so that
//! a lost slot changes nothing about what consumers see:
//!
//! * **First produces go out together, in order**: the idempotent producer keeps
//!   them in order per partition.
//! * **A failed row holds its key.** From the moment a row fails, the later rows of
//!   its key wait; the failed one is retried alone (the oldest first) until it is
//!   acked or given up on, then the key's waiting rows are produced in order. What
//!   this cannot undo, as in the stream: rows of the key produced in the same round
//!   before the failure was reported.
//! * **Giving up follows `relay.on_poison`.** `skip` poisons the row and lets its key
//!   go on; `park-key` poisons it as holding its key, and every later row of the key
//!   is written to the poison table as parked instead of produced; `halt` writes
//!   nothing: the row and the later rows of its key stay unpublished, the backlog is
//!   not completed (so streaming does not start), and the relay says which row holds
//!   it. A row that cannot be mapped is given up on at once (it has no key: under
//!   `park-key` it parks nothing).
//! * **Parked keys stay parked**, whatever the mode: a row of a key parked before the
//!   backlog (or by an earlier row of it) is written as parked, never produced, until
//!   `replay` releases the key.

use crate::config::PoisonKeyMode;
use crate::delivery::Failure;
use crate::hashing::HashSet;
use crate::poison::{ParkedKey, Parking};
use crate::poller::{BatchRow, Delivery, RowResult};

/// One row of the window that is not resolved yet.
#[derive(Debug)]
pub(crate) struct Unresolved {
    pub(crate) row: BatchRow,
    /// Its record key within its topic (`None`: the row cannot be mapped).
    pub(crate) key: Option<ParkedKey>,
    /// It failed at least once in this backlog: it holds its key.
    pub(crate) retried: bool,
}

impl Unresolved {
    pub(crate) fn new(row: BatchRow) -> Unresolved {
        let key = match &row.result {
            RowResult::Event { event, .. } => Some(crate::cdc::poison_policy::key_of(event)),
            RowResult::Unmappable { .. } => None,
        };
        Unresolved {
            row,
            key,
            retried: false,
        }
    }
}

/// What one round does with a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Hand it to the producer.
    Produce,
    /// Its key is parked: write it to the poison table as parked.
    Park,
    /// Cannot be mapped: poison it now (`Parking::None`).
    Poison,
    /// Given up on under `halt`: it holds the backlog.
    Halt,
    /// An earlier row of its key is unresolved (or halted): not this round.
    Wait,
}

/// What became of a produced row in its round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Acked: mark it sent.
    Acked,
    /// Failed: record the failure (permanent ones count an attempt) and retry it.
    Retry,
    /// Failed for the last time: poison it, with this part in parking.
    Poison(Parking),
    /// Failed for the last time under `halt`: leave it as it is; it holds the backlog.
    Halt,
}

/// The policy and the keys it holds for one backlog.
#[derive(Debug)]
pub(crate) struct KeyRules {
    mode: PoisonKeyMode,
    max_attempts: i32,
    /// Keys parked now: loaded at start, added when a row parks its key.
    parked: HashSet<ParkedKey>,
    /// Keys a halted row holds.
    halted: HashSet<ParkedKey>,
}

impl KeyRules {
    pub(crate) fn new(
        mode: PoisonKeyMode,
        max_attempts: i32,
        parked: HashSet<ParkedKey>,
    ) -> KeyRules {
        KeyRules {
            mode,
            max_attempts: max_attempts.max(1),
            parked,
            halted: HashSet::default(),
        }
    }

    /// The keys parked now and those a halted row holds.
    pub(crate) fn held_keys(
        &self,
    ) -> (
        impl Iterator<Item = &ParkedKey>,
        impl Iterator<Item = &ParkedKey>,
    ) {
        (self.parked.iter(), self.halted.iter())
    }

    /// Holds keys another outbox's backlog parked or halted on: this backlog's rows
    /// of them are parked, or wait, as its own would.
    pub(crate) fn hold(
        &mut self,
        parked: impl IntoIterator<Item = ParkedKey>,
        halted: impl IntoIterator<Item = ParkedKey>,
    ) {
        self.parked.extend(parked);
        self.halted.extend(halted);
    }

    /// The step of each row of `rows` (in commit order) for the next round.
    pub(crate) fn plan<'r>(&self, rows: impl IntoIterator<Item = &'r Unresolved>) -> Vec<Step> {
        let mut held: HashSet<&ParkedKey> = HashSet::default();
        rows.into_iter()
            .map(|r| {
                let Some(key) = &r.key else {
                    return if self.mode == PoisonKeyMode::Halt {
                        Step::Halt
                    } else {
                        Step::Poison
                    };
                };
                if self.parked.contains(key) {
                    Step::Park
                } else if self.halted.contains(key) || held.contains(key) {
                    held.insert(key);
                    Step::Wait
                } else {
                    if r.retried {
                        // Retried alone: the key's later rows wait for its answer.
                        held.insert(key);
                    }
                    Step::Produce
                }
            })
            .collect()
    }

    /// What a produced row's delivery means; under `park-key` a row given up on parks
    /// its key, under `halt` it holds it.
    pub(crate) fn judge(&mut self, row: &mut Unresolved) -> Verdict {
        let RowResult::Event { delivery, .. } = &row.row.result else {
            return Verdict::Poison(Parking::None);
        };
        let exhausted = match delivery {
            Delivery::Acked => return Verdict::Acked,
            Delivery::Pending
            | Delivery::Failed {
                failure: Failure::Transient | Failure::Configuration,
                ..
            } => false,
            Delivery::Failed {
                failure: Failure::Permanent,
                ..
            } => row.row.polled.attempts.saturating_add(1) >= self.max_attempts,
        };
        row.retried = true;
        if !exhausted {
            return Verdict::Retry;
        }
        let key = row.key.clone();
        match (self.mode, key) {
            (PoisonKeyMode::Halt, key) => {
                self.halted.extend(key);
                Verdict::Halt
            }
            (PoisonKeyMode::ParkKey, Some(key)) => {
                self.parked.insert(key);
                Verdict::Poison(Parking::HoldsKey)
            }
            _ => Verdict::Poison(Parking::None),
        }
    }

    /// `replay` released `key` while its row waited to be parked: produce it.
    pub(crate) fn released(&mut self, key: &ParkedKey) {
        self.parked.remove(key);
    }
}

/// Prepares a row that failed for its next produce: a permanent failure counts one
/// attempt (as the marks recorded it), others count none.
pub(crate) fn reset_for_retry(row: &mut BatchRow) {
    if let RowResult::Event { delivery, .. } = &mut row.result {
        if matches!(
            delivery,
            Delivery::Failed {
                failure: Failure::Permanent,
                ..
            }
        ) {
            row.polled.attempts = row.polled.attempts.saturating_add(1);
        }
        *delivery = Delivery::Pending;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::OutboxConfig;
    use crate::outbox::{OutboxMapper, OutboxRow};
    use crate::poller::Polled;
    use bytes::Bytes;

    fn row(id: &str, entity: Option<&str>) -> Unresolved {
        let mapper = OutboxMapper::with_template(&OutboxConfig::default(), "t", None).unwrap();
        let outbox = OutboxRow {
            id: Some(Bytes::copy_from_slice(id.as_bytes())),
            aggregate_id: entity.map(|e| Bytes::copy_from_slice(e.as_bytes())),
            payload: Some(Bytes::from_static(b"{}")),
            ..OutboxRow::default()
        };
        let polled = Polled {
            id: id.to_owned(),
            attempts: 0,
            last_error: None,
        };
        Unresolved::new(BatchRow::map(&mapper, polled, &outbox, None))
    }

    fn deliver(r: &mut Unresolved, delivery: Delivery) {
        if let RowResult::Event { delivery: d, .. } = &mut r.row.result {
            *d = delivery;
        }
    }

    fn permanent() -> Delivery {
        Delivery::Failed {
            failure: Failure::Permanent,
            kind: "message_size_too_large",
            message: "too big".into(),
        }
    }

    fn transient() -> Delivery {
        Delivery::Failed {
            failure: Failure::Transient,
            kind: "msg_timed_out",
            message: "timed out".into(),
        }
    }

    fn key(entity: &str) -> ParkedKey {
        ParkedKey {
            topic: "t".into(),
            key: entity.into(),
        }
    }

    #[test]
    fn first_produces_go_out_together() {
        let rules = KeyRules::new(PoisonKeyMode::Skip, 5, HashSet::default());
        let rows = vec![
            row("1", Some("a")),
            row("2", Some("a")),
            row("3", Some("b")),
        ];
        assert_eq!(rules.plan(&rows), vec![Step::Produce; 3]);
    }

    #[test]
    fn a_failed_row_is_retried_alone_and_its_successors_wait() {
        let mut rules = KeyRules::new(PoisonKeyMode::Skip, 5, HashSet::default());
        let mut rows = vec![
            row("1", Some("a")),
            row("2", Some("a")),
            row("3", Some("b")),
        ];
        deliver(&mut rows[0], transient());
        assert_eq!(rules.judge(&mut rows[0]), Verdict::Retry);
        // Round 2: row 2 was not produced yet in this model (it waits), b flows.
        assert_eq!(
            rules.plan(&rows),
            vec![Step::Produce, Step::Wait, Step::Produce]
        );
        // Two failed rows of one key: only the oldest is retried.
        deliver(&mut rows[1], transient());
        assert_eq!(rules.judge(&mut rows[1]), Verdict::Retry);
        assert_eq!(rules.plan(&rows)[..2], [Step::Produce, Step::Wait]);
    }

    #[test]
    fn skip_poisons_the_exhausted_row_and_lets_its_key_go_on() {
        let mut rules = KeyRules::new(PoisonKeyMode::Skip, 2, HashSet::default());
        let mut r = row("1", Some("a"));
        deliver(&mut r, permanent());
        assert_eq!(rules.judge(&mut r), Verdict::Retry);
        reset_for_retry(&mut r.row);
        assert_eq!(r.row.polled.attempts, 1);
        deliver(&mut r, permanent());
        assert_eq!(rules.judge(&mut r), Verdict::Poison(Parking::None));
        let rest = vec![row("2", Some("a"))];
        assert_eq!(rules.plan(&rest), vec![Step::Produce]);
    }

    #[test]
    fn park_key_parks_every_later_row_of_the_key() {
        let mut rules = KeyRules::new(PoisonKeyMode::ParkKey, 1, HashSet::default());
        let mut r = row("1", Some("a"));
        deliver(&mut r, permanent());
        assert_eq!(rules.judge(&mut r), Verdict::Poison(Parking::HoldsKey));
        let rest = vec![row("2", Some("a")), row("3", Some("b"))];
        assert_eq!(rules.plan(&rest), vec![Step::Park, Step::Produce]);
        rules.released(&key("a"));
        assert_eq!(rules.plan(&rest), vec![Step::Produce, Step::Produce]);
    }

    #[test]
    fn keys_parked_before_the_backlog_stay_parked_in_any_mode() {
        for mode in [
            PoisonKeyMode::Skip,
            PoisonKeyMode::Halt,
            PoisonKeyMode::ParkKey,
        ] {
            let rules = KeyRules::new(mode, 5, HashSet::from_iter([key("a")]));
            let rows = vec![row("1", Some("a")), row("2", Some("b"))];
            assert_eq!(
                rules.plan(&rows),
                vec![Step::Park, Step::Produce],
                "{mode:?}"
            );
        }
    }

    #[test]
    fn halt_holds_the_key_and_the_backlog() {
        let mut rules = KeyRules::new(PoisonKeyMode::Halt, 1, HashSet::default());
        let mut r = row("1", Some("a"));
        deliver(&mut r, permanent());
        assert_eq!(rules.judge(&mut r), Verdict::Halt);
        let rest = vec![row("2", Some("a")), row("3", Some("b"))];
        assert_eq!(rules.plan(&rest), vec![Step::Wait, Step::Produce]);
    }

    #[test]
    fn unmappable_rows_are_poisoned_or_halt() {
        let rows = vec![row("1", None)];
        let skip = KeyRules::new(PoisonKeyMode::Skip, 5, HashSet::default());
        assert_eq!(skip.plan(&rows), vec![Step::Poison]);
        let park = KeyRules::new(PoisonKeyMode::ParkKey, 5, HashSet::default());
        assert_eq!(park.plan(&rows), vec![Step::Poison]);
        let halt = KeyRules::new(PoisonKeyMode::Halt, 5, HashSet::default());
        assert_eq!(halt.plan(&rows), vec![Step::Halt]);
    }

    #[test]
    fn transient_failures_never_exhaust_a_row() {
        let mut rules = KeyRules::new(PoisonKeyMode::Halt, 1, HashSet::default());
        let mut r = row("1", Some("a"));
        for _ in 0..10 {
            deliver(&mut r, transient());
            assert_eq!(rules.judge(&mut r), Verdict::Retry);
            reset_for_retry(&mut r.row);
        }
        assert_eq!(r.row.polled.attempts, 0);
        assert_eq!(rules.plan(&[r]), vec![Step::Produce]);
    }
}
