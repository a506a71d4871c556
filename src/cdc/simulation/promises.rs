//! The promises the whole-relay simulation checks (the module docs of
//! `simulation` list them): after every step, and at the end of a schedule.

use std::collections::{BTreeMap, HashMap};

use super::world::{self, RowId, committed};
use super::{Mode, Outcome, Schedule};
use crate::lsn::Lsn;

impl Schedule {
    /// Neither the slot nor the saved position is past an unresolved event. A
    /// transaction found resolved stays so (deliveries, commits and poison rows are
    /// never taken back): the check goes on from the first one not found so.
    pub(super) fn check_confirmed(&mut self) {
        let world = self.shared.lock();
        let marks = [
            (
                "the slot",
                world
                    .slot
                    .filter(|_| !world.inherited_slot)
                    .map(|s| s.confirmed),
            ),
            ("the saved position", world.position.map(|p| p.confirmed)),
        ];
        let mut verified = self.verified;
        for (what, mark) in marks {
            let Some(mark) = mark else { continue };
            let mut tx = self.verified;
            while let Some(t) = world.wal.get(tx) {
                if t.final_lsn >= mark {
                    break;
                }
                if let Some(row) = unresolved_row(&world, tx) {
                    self.fail(&format!(
                        "{what} is at {mark}, past event {} (transaction committing at {}) which is neither delivered nor poisoned",
                        row.key_text(),
                        t.final_lsn
                    ));
                }
                tx += 1;
            }
            verified = verified.max(tx);
        }
        drop(world);
        self.verified = verified;
    }

    /// How often each row is in the topic (exactly-once: committed), in log order.
    fn delivered(&self, world: &world::World) -> HashMap<RowId, u64> {
        let mut counts = HashMap::new();
        for partition in &world.partitions {
            for record in partition {
                if self.mode == Mode::ExactlyOnce && !committed(world, record.txn) {
                    continue;
                }
                *counts.entry(record.row).or_insert(0) += 1;
            }
        }
        counts
    }

    /// The transactions the relay must resolve: all, or with `halt` those before
    /// the first with an event that may never be delivered (the slot stops there):
    /// unmappable, refused, too large, or, exactly-once, too large with others (it
    /// cannot send one record alone inside a Kafka transaction; at-least-once does).
    /// The relay resolved every event it must and the slot confirmed the last
    /// transaction holding one.
    pub(super) fn caught_up(&self) -> bool {
        let world = self.shared.lock();
        let horizon = self.horizon(&world);
        let end = horizon
            .checked_sub(1)
            .and_then(|tx| world.wal.get(tx))
            .map_or(Lsn::ZERO, |t| t.end_lsn);
        let every = (self.verified..horizon).all(|tx| unresolved_row(&world, tx).is_none());
        every && world.slot.is_some_and(|s| s.confirmed >= end)
    }

    pub(super) fn horizon(&self, world: &world::World) -> usize {
        let alone = self.mode == Mode::AtLeastOnce;
        let halts = |t: &world::Tx| {
            t.rows
                .iter()
                .any(|r| r.unmappable || r.refused || r.oversize || (r.big_batch && !alone))
        };
        let first = self
            .halt
            .then(|| world.wal.iter().position(halts))
            .flatten();
        first.unwrap_or(world.wal.len())
    }

    /// The end: every event resolved, per-key order, and (exactly-once) no event
    /// twice in the read_committed view. A halting relay resolved every event
    /// before the first it cannot deliver, and poisoned none.
    pub(super) fn check_end(&self) -> Outcome {
        let world = self.shared.lock();
        let delivered = self.delivered(&world);
        let poisoned = poisoned(&world);
        let horizon = self.horizon(&world);
        if self.halt && !world.poison.is_empty() {
            self.fail(&format!(
                "on_poison = \"halt\" wrote {} poison rows",
                world.poison.len()
            ));
        }
        let mut outcome = Outcome {
            stats: world.stats.clone(),
            digest: digest(&world),
            ..Outcome::default()
        };
        for (tx, t) in world.wal.iter().enumerate() {
            for (o, r) in t.rows.iter().enumerate() {
                let row = RowId {
                    tx: t.seq,
                    ordinal: u32::try_from(o).unwrap_or(u32::MAX),
                };
                outcome.events += 1;
                let times = delivered.get(&row).copied().unwrap_or(0);
                if poisoned.contains_key(&row) {
                    outcome.poisoned += 1;
                }
                if (r.unmappable || r.refused || r.oversize) && times > 0 {
                    self.fail(&format!(
                        "event {}, unmappable, refused by the broker or too large, was published",
                        row.key_text()
                    ));
                }
                if times == 0 && !poisoned.contains_key(&row) && tx < horizon {
                    self.fail(&format!("event {} was lost", row.key_text()));
                }
                // All or nothing, but for a poison insert of a killed process that
                // committed after the publishing session read the poison rows
                // (documented, `poison::recorded`), and for an event that went
                // through the relay again as documented (`World::republished`):
                // delivered once, refused the next time.
                if self.mode == Mode::ExactlyOnce
                    && times > 0
                    && poisoned.contains_key(&row)
                    && !world.republished.contains(&row)
                    && world.partitions.iter().flatten().any(|r| {
                        r.row == row && committed(&world, r.txn) && !world.sent_unaware_of_poison(r)
                    })
                {
                    self.fail(&format!(
                        "event {} is committed in Kafka and poisoned",
                        row.key_text()
                    ));
                }
                if self.mode == Mode::ExactlyOnce && times > 1 && !world.republished.contains(&row)
                {
                    let txns: Vec<Option<u64>> = world
                        .partitions
                        .iter()
                        .flatten()
                        .filter(|r| r.row == row && committed(&world, r.txn))
                        .map(|r| r.txn)
                        .collect();
                    self.fail(&format!(
                        "event {} is {times} times in the read_committed view (Kafka transactions {txns:?})",
                        row.key_text()
                    ));
                }
                outcome.duplicates += times.saturating_sub(1);
            }
        }
        // Per key, the first delivery of each event in commit order.
        for partition in &world.partitions {
            let mut last: BTreeMap<&[u8], RowId> = BTreeMap::new();
            let mut seen = std::collections::HashSet::new();
            for record in partition {
                if self.mode == Mode::ExactlyOnce && !committed(&world, record.txn) {
                    continue;
                }
                // A duplicate, an event published by a session that could not know
                // of its poison row (above), or a row a restore took back: not a
                // first delivery of an event. An event whose poison row a restore
                // took back (`World::unpoisoned`) may come after later events of
                // its key, not before earlier ones.
                if world.sent_unaware_of_poison(record)
                    || !world.is_event(record.row)
                    || !seen.insert(record.row)
                {
                    continue;
                }
                let late = world.unpoisoned.contains(&record.row);
                if let Some(previous) = last.get(record.entity.as_slice())
                    && *previous > record.row
                {
                    if late {
                        // It arrives after later events of its key, and must not
                        // come before an earlier one still to come: `last` stays.
                        continue;
                    }
                    self.fail(&format!(
                        "key {} out of order: {} delivered first after {}",
                        String::from_utf8_lossy(&record.entity),
                        record.row.key_text(),
                        previous.key_text()
                    ));
                }
                last.insert(record.entity.as_slice(), record.row);
            }
        }
        outcome
    }
}

/// An event of transaction `tx` (its index in the WAL) neither delivered nor
/// poisoned, if any.
fn unresolved_row(world: &world::World, tx: usize) -> Option<RowId> {
    let t = world.wal.get(tx)?;
    (0..t.rows.len())
        .map(|ordinal| RowId {
            tx: t.seq,
            ordinal: u32::try_from(ordinal).unwrap_or(u32::MAX),
        })
        .find(|row| !world.resolved.contains(row))
}

/// How many poison rows each row has.
fn poisoned(world: &world::World) -> HashMap<RowId, u64> {
    let mut counts = HashMap::new();
    for (row, _) in &world.poison {
        *counts.entry(*row).or_insert(0) += 1;
    }
    counts
}

/// What [`Outcome::digest`] covers, hashed with fixed keys.
fn digest(world: &world::World) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::hash::DefaultHasher::new();
    for partition in &world.partitions {
        partition.len().hash(&mut hasher);
        for record in partition {
            (record.row, record.txn).hash(&mut hasher);
        }
    }
    for (row, _) in &world.poison {
        row.hash(&mut hasher);
    }
    world.slot.as_ref().map(|s| s.confirmed).hash(&mut hasher);
    world
        .position
        .as_ref()
        .map(|p| p.confirmed)
        .hash(&mut hasher);
    hasher.finish()
}
