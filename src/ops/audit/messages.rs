//! The message outbox's side of the audit (pure, no I/O).
//!
//! # Why a ledger
//!
//! A message-outbox event (`outbox_emit`, `crate::outbox::message`) is in the WAL
//! and nowhere else, so there is no row to look for on the topic. What can be
//! counted without giving back what the message outbox saves is how many events
//! each entity got: `outbox_emit` adds one to its entity's row of
//! `outbox_relay_message_ledger` in the same transaction (so a rolled-back event is
//! never counted), one small row per entity updated in place. Reading the WAL back
//! instead is impossible: a new slot starts at the current position, and the old
//! WAL is recycled.
//!
//! # Definitions
//!
//! Per entity (the record key, i.e. the aggregate id): **emitted** from the ledger;
//! **accounted** the distinct idempotency keys of the entity among the topic
//! records that no row of the outbox explains, plus the poison rows marked as
//! messages. Then `delivered + poisoned + lost = emitted`, where `delivered =
//! min(records' keys, emitted)`, `poisoned` takes what is left of the poison rows,
//! and anything beyond `emitted` (records of rows outside an audit range, or another
//! producer's) is reported as "outside the range". A second record of one
//! `(entity, idempotency key)` is a duplicate. First deliveries of one entity (per
//! topic and partition) must not go back in `source_lsn`; messages of one
//! transaction share it, so their order within it is not checked.
//!
//! Memory: a 16-byte pair plus hash-table overhead per message record, and one
//! entry per entity.

use std::collections::{HashMap, HashSet};

use crate::lsn::Lsn;

/// The message tally of one audit.
#[derive(Debug, Default)]
pub(super) struct Messages {
    /// Events emitted per entity (hash of the aggregate id).
    emitted: HashMap<u64, u64>,
    /// `(entity, idempotency key)` → deliveries seen.
    delivered: HashMap<(u64, u64), u32>,
    /// `(entity, idempotency key)` of message poison rows.
    poisoned: HashSet<(u64, u64)>,
    /// Last first-delivery LSN per (topic, partition, key), for the topic being read.
    last_lsn: HashMap<u64, (Lsn, bool)>,
}

/// What [`Messages::observe`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MessageRecord {
    First,
    Duplicate {
        second: bool,
    },
    /// A first delivery behind an earlier one of its entity; `first_of_entity` is
    /// true for the entity's first violation.
    OutOfOrder {
        first_of_entity: bool,
    },
}

/// The message outbox's share of the counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct MessageCounts {
    pub(super) emitted: u64,
    pub(super) delivered: u64,
    pub(super) poisoned: u64,
    pub(super) lost: u64,
    /// Record keys beyond what the ledger counts for their entity.
    pub(super) beyond: u64,
}

impl Messages {
    /// Adds `events` emitted for the entity with this key hash.
    pub(super) fn emitted(&mut self, entity: u64, events: u64) {
        *self.emitted.entry(entity).or_default() += events;
    }

    /// A message poison row of this entity and idempotency key.
    pub(super) fn poisoned(&mut self, entity: u64, key: u64) {
        self.poisoned.insert((entity, key));
    }

    /// One record no row explains, in partition order; `order_entity` is the
    /// (topic, partition, key) hash.
    pub(super) fn observe(
        &mut self,
        entity: u64,
        key: u64,
        order_entity: u64,
        lsn: Option<Lsn>,
    ) -> MessageRecord {
        let seen = self.delivered.entry((entity, key)).or_default();
        *seen = seen.saturating_add(1);
        if *seen > 1 {
            return MessageRecord::Duplicate { second: *seen == 2 };
        }
        let Some(lsn) = lsn else {
            return MessageRecord::First;
        };
        match self.last_lsn.get_mut(&order_entity) {
            None => {
                self.last_lsn.insert(order_entity, (lsn, false));
                MessageRecord::First
            }
            Some((last, flagged)) if lsn < *last => {
                let first_of_entity = !*flagged;
                *flagged = true;
                MessageRecord::OutOfOrder { first_of_entity }
            }
            Some((last, _)) => {
                *last = lsn;
                MessageRecord::First
            }
        }
    }

    /// A topic was read to the end.
    pub(super) fn end_topic(&mut self) {
        self.last_lsn = HashMap::new();
    }

    pub(super) fn counts(&self) -> MessageCounts {
        let mut keys_of: HashMap<u64, (u64, u64)> = HashMap::new();
        for &(entity, _) in self.delivered.keys() {
            keys_of.entry(entity).or_default().0 += 1;
        }
        for pair in &self.poisoned {
            if !self.delivered.contains_key(pair) {
                keys_of.entry(pair.0).or_default().1 += 1;
            }
        }
        let mut c = MessageCounts::default();
        for (entity, &emitted) in &self.emitted {
            let (delivered, poisoned) = keys_of.remove(entity).unwrap_or_default();
            let d = delivered.min(emitted);
            let p = poisoned.min(emitted - d);
            c.emitted += emitted;
            c.delivered += d;
            c.poisoned += p;
            c.lost += emitted - d - p;
            c.beyond += delivered + poisoned - d - p;
        }
        c.beyond += keys_of.values().map(|(d, p)| d + p).sum::<u64>();
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lsn(n: u64) -> Option<Lsn> {
        Some(Lsn::from(n))
    }

    #[test]
    fn emitted_is_delivered_poisoned_or_lost() {
        let mut m = Messages::default();
        m.emitted(1, 3);
        m.emitted(2, 2);
        assert_eq!(m.observe(1, 10, 100, lsn(5)), MessageRecord::First);
        assert_eq!(m.observe(1, 11, 100, lsn(6)), MessageRecord::First);
        assert_eq!(
            m.observe(1, 11, 100, lsn(6)),
            MessageRecord::Duplicate { second: true }
        );
        m.poisoned(1, 12);
        m.poisoned(2, 20);
        let c = m.counts();
        assert_eq!(
            c,
            MessageCounts {
                emitted: 5,
                delivered: 2,
                poisoned: 2,
                lost: 1,
                beyond: 0
            }
        );
    }

    #[test]
    fn records_beyond_the_ledger_are_not_deliveries() {
        let mut m = Messages::default();
        m.emitted(1, 1);
        m.observe(1, 10, 100, None);
        m.observe(1, 11, 100, None);
        m.observe(3, 30, 300, None);
        let c = m.counts();
        assert_eq!((c.delivered, c.lost, c.beyond), (1, 0, 2));
    }

    #[test]
    fn a_first_delivery_going_back_in_lsn_is_out_of_order_once_per_entity() {
        let mut m = Messages::default();
        m.observe(1, 10, 100, lsn(9));
        assert_eq!(
            m.observe(1, 11, 100, lsn(4)),
            MessageRecord::OutOfOrder {
                first_of_entity: true
            }
        );
        assert_eq!(
            m.observe(1, 12, 100, lsn(3)),
            MessageRecord::OutOfOrder {
                first_of_entity: false
            }
        );
        assert_eq!(m.observe(1, 13, 100, lsn(9)), MessageRecord::First);
        m.end_topic();
        assert_eq!(m.observe(1, 14, 100, lsn(1)), MessageRecord::First);
    }
}
