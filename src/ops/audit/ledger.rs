//! The ledger: per-row state of an audit and the matching rules (pure, no I/O).
//!
//! # Definitions
//!
//! Rows and records are matched by **idempotency key**: the outbox row's
//! `idempotency_key` column (else its `id`, exactly as the mapper decides), and the
//! record's `idempotency_key` header.
//!
//! * **expected** — distinct idempotency keys among the outbox rows in the range
//!   (two rows sharing a key are one event to every deduplicating consumer).
//! * **delivered** — expected events found at least once on a topic read.
//! * **poisoned** — expected events *not* delivered that have a `poison_outbox` row
//!   (matched by its `idempotency_key`, else its `outbox_id`). A poisoned event that
//!   was replayed is delivered, and counted as such (the table also shows it as
//!   "replayed").
//! * **lost** — expected events neither delivered nor poisoned: a leak. So
//!   `expected = delivered + poisoned + lost`.
//! * **duplicates** — extra deliveries: for each expected event delivered *n* > 1
//!   times, *n* − 1. (The table also shows how many events had duplicates.)
//! * **out_of_order_keys** — entities (Kafka keys, per topic and partition) whose
//!   *first deliveries* are not in commit order. For each entity the records are
//!   taken in partition (offset) order, ignoring every delivery of an idempotency
//!   key after its first and ignoring poisoned events (a replay is out of order by
//!   design); each first delivery gets the position `(source_lsn, rank)`, where
//!   `source_lsn` is the record's `source_lsn` header (the commit LSN, CDC only) and
//!   `rank` is the row's place in `(created_at, id)` order. Consecutive positions
//!   must not go back: when both records carry a `source_lsn`, `(lsn, rank)` is
//!   compared lexicographically (a later transaction, or the same transaction with a
//!   later row); when either lacks one (polling relay, `replay`), only `rank` is
//!   compared. `created_at` is not commit order across concurrent transactions — it
//!   is the fallback, good for one entity whose writes are serialised by its own row
//!   lock, and it is why the commit LSN is preferred. An entity counts once however
//!   many violations it has.
//!
//! Records whose key is not in the range (older or newer rows, another producer)
//! and records without the header are counted in the table ("outside the range",
//! "without key") but in none of the six numbers — except where the message
//! outbox's ledger counted events: then such records are matched against it per
//! entity (`messages.rs`), and the messages add to the six numbers.
//!
//! # Whose record it is
//!
//! A message-outbox record carries nothing that tells it from a row's record (same
//! key, headers, `source_lsn`: `docs/architecture.md#the-message-outbox`), so the
//! messages of an entity are counted by elimination: records no row explains. With
//! several outboxes sharing a topic, a record of *another* table's row is explained
//! by no row of this one, and it counted as a delivery of this outbox's message of
//! the same entity: a lost message was hidden behind another table's event. So the
//! idempotency keys of the other outboxes' rows are given to the ledger too
//! ([`Ledger::push_other_row`], only when messages are audited): a record with one
//! of them is another outbox's, outside this audit's numbers. The keys are the
//! ones records carry (each table's `idempotency_key`, else its `id`), the same
//! key a record's header has. A table not in the config (another relay's) cannot
//! be told apart this way.
//!
//! # Bounded memory
//!
//! Nothing per record is kept, and no row text: each row is one 16-byte entry — a
//! 64-bit hash of its idempotency key, its rank (`u32`), a saturating delivery count
//! and flags — in a vector sized exactly from a `count(*)` of the range and sorted
//! by hash, so lookups are binary searches and the memory is **16 bytes per row**
//! (10 million rows: 160 MB). Per-entity order state (24 bytes plus hash-table
//! overhead per entity) exists only for the topic being read and is dropped after
//! it. The hash is SipHash-1-3 (std's `DefaultHasher`, fixed keys): for *n*
//! distinct keys the chance that any two collide is about n²/2⁶⁵ — 3·10⁻⁶ for 10
//! million rows, 3·10⁻⁴ for 100 million. Two rows whose hashes collide are counted
//! as one event ("shared keys" in the table); a record of an unrelated key colliding
//! with an expected one would count as its delivery. Per-row state is also what
//! limits a range to 2³² rows; audit larger tables in parts. The other outboxes'
//! rows cost 8 bytes each (their key hash), only when messages are audited.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use super::messages::{MessageCounts, MessageRecord, Messages};
use crate::error::Error;
use crate::lsn::Lsn;

/// SipHash-1-3 with fixed keys: stable within a process, well distributed.
fn hasher() -> std::hash::DefaultHasher {
    std::hash::DefaultHasher::new()
}

/// 64-bit hash of an idempotency key.
fn key_hash(key: &[u8]) -> u64 {
    let mut h = hasher();
    h.write(key);
    h.finish()
}

/// Hash identifying one entity's sequence: topic, partition and Kafka key.
fn entity_hash(topic: &str, partition: i32, key: &[u8]) -> u64 {
    let mut h = hasher();
    h.write_usize(topic.len());
    h.write(topic.as_bytes());
    h.write_i32(partition);
    h.write_usize(key.len());
    h.write(key);
    h.finish()
}

/// Hash-table hasher for keys that already are good 64-bit hashes.
#[derive(Debug, Default, Clone, Copy)]
struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

const POISONED: u16 = 1;
/// Its poison row is a parked one (`relay.on_poison = "park-key"`): held back, in
/// order, behind a poisoned event of its key, so its delivery is order-checked.
const PARKED: u16 = 2;

/// One outbox row: 8 bytes, 16 with its hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowState {
    /// Place in `(created_at, id)` order within the range.
    rank: u32,
    /// Deliveries seen, saturating.
    deliveries: u16,
    flags: u16,
}

/// Position of a first delivery in commit order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Position {
    lsn: Option<Lsn>,
    rank: u32,
}

/// Whether `next` may follow `prev` in one entity's sequence (see the module doc).
fn in_commit_order(prev: Position, next: Position) -> bool {
    match (prev.lsn, next.lsn) {
        (Some(a), Some(b)) => (a, prev.rank) <= (b, next.rank),
        _ => prev.rank <= next.rank,
    }
}

/// Per-entity order state (for the topic being read).
#[derive(Debug, Clone, Copy)]
struct EntityState {
    last: Position,
    out_of_order: bool,
}

/// What one record told us.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Observed {
    /// First delivery of an expected event.
    First,
    /// A repeated delivery.
    Duplicate,
    /// First delivery, behind an earlier one of its entity in commit order.
    OutOfOrder,
    /// Not a row of the range.
    OutsideRange,
    /// No `idempotency_key` header.
    WithoutKey,
}

/// All per-row state of an audit and the counters.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    /// `(key hash, state)`; push order is rank order until [`Ledger::seal`] sorts by hash.
    rows: Vec<(u64, RowState)>,
    sealed: bool,
    entities: HashMap<u64, EntityState, BuildHasherDefault<PassThrough>>,
    /// Rows that share their idempotency key (or its hash) with an earlier row.
    pub(super) shared_keys: u64,
    /// Extra deliveries (n − 1 for an event delivered n times).
    pub(super) duplicates: u64,
    /// Events delivered more than once.
    pub(super) duplicated_events: u64,
    /// Entities whose first deliveries are not in commit order.
    pub(super) out_of_order_keys: u64,
    /// First deliveries that went back in commit order.
    pub(super) out_of_order_records: u64,
    /// Records observed.
    pub(super) records: u64,
    /// Records whose idempotency key is not a row of the range.
    pub(super) outside_range: u64,
    /// Records without an `idempotency_key` header.
    pub(super) without_key: u64,
    /// The message outbox's tally, when its ledger counted events: records no row
    /// explains go to it instead of `outside_range`.
    messages: Option<Messages>,
    /// Key hashes of the other outboxes' rows, sorted once sealed (see "Whose
    /// record it is" in the module doc).
    other_rows: Vec<u64>,
    other_rows_sealed: bool,
}

/// The final counts of a [`Ledger`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Counts {
    pub(super) expected: u64,
    pub(super) delivered: u64,
    pub(super) lost: u64,
    pub(super) poisoned: u64,
    /// Of `poisoned`: parked behind a poisoned event of their key.
    pub(super) parked: u64,
    pub(super) replayed: u64,
    /// Records no row and no message of the ledger explains, beyond
    /// [`Ledger::outside_range`] (see `messages.rs`).
    pub(super) beyond_messages: u64,
    /// The message outbox's share of the counts above.
    pub(super) messages: Option<MessageCounts>,
}

impl Ledger {
    pub(super) fn with_capacity(rows: usize) -> Ledger {
        Ledger {
            rows: Vec::with_capacity(rows),
            ..Ledger::default()
        }
    }

    /// Adds the next row in `(created_at, id)` order.
    pub(super) fn push_row(&mut self, idempotency_key: &[u8]) -> Result<(), Error> {
        debug_assert!(!self.sealed);
        let rank = u32::try_from(self.rows.len()).map_err(|_| Error::AuditRangeTooLarge)?;
        self.rows.push((
            key_hash(idempotency_key),
            RowState {
                rank,
                deliveries: 0,
                flags: 0,
            },
        ));
        Ok(())
    }

    /// Sorts by hash for lookups; rows sharing a hash become one event (the
    /// earliest keeps its rank).
    pub(super) fn seal(&mut self) {
        self.rows.sort_unstable_by_key(|(h, s)| (*h, s.rank));
        let before = self.rows.len();
        self.rows.dedup_by_key(|(h, _)| *h);
        self.shared_keys = (before - self.rows.len()) as u64;
        self.rows.shrink_to_fit();
        self.sealed = true;
    }

    fn find(&self, hash: u64) -> Option<usize> {
        debug_assert!(self.sealed);
        self.rows.binary_search_by_key(&hash, |(h, _)| *h).ok()
    }

    /// Marks the event with this key as having a poison row; false when it is not
    /// a row of the range.
    pub(super) fn mark_poisoned(&mut self, idempotency_key: &[u8]) -> bool {
        self.mark(idempotency_key, POISONED)
    }

    /// Marks the event with this key as parked (`relay.on_poison = "park-key"`);
    /// false when it is not a row of the range.
    pub(super) fn mark_parked(&mut self, idempotency_key: &[u8]) -> bool {
        self.mark(idempotency_key, POISONED | PARKED)
    }

    fn mark(&mut self, idempotency_key: &[u8], flags: u16) -> bool {
        match self.find(key_hash(idempotency_key)) {
            Some(i) => {
                self.rows[i].1.flags |= flags;
                true
            }
            None => false,
        }
    }

    /// One record, in partition order.
    pub(super) fn observe(
        &mut self,
        topic: &str,
        partition: i32,
        key: Option<&[u8]>,
        idempotency_key: Option<&[u8]>,
        source_lsn: Option<Lsn>,
    ) -> Observed {
        self.records += 1;
        let Some(idempotency_key) = idempotency_key else {
            self.without_key += 1;
            return Observed::WithoutKey;
        };
        let Some(i) = self.find(key_hash(idempotency_key)) else {
            let Some(messages) = self.messages.as_mut() else {
                self.outside_range += 1;
                return Observed::OutsideRange;
            };
            // Another outbox's row on a shared topic: not a message of this one.
            debug_assert!(self.other_rows_sealed || self.other_rows.is_empty());
            if self
                .other_rows
                .binary_search(&key_hash(idempotency_key))
                .is_ok()
            {
                self.outside_range += 1;
                return Observed::OutsideRange;
            }
            let key = key.unwrap_or_default();
            let order_entity = entity_hash(topic, partition, key);
            return match messages.observe(
                key_hash(key),
                key_hash(idempotency_key),
                order_entity,
                source_lsn,
            ) {
                MessageRecord::First => Observed::First,
                MessageRecord::Duplicate { second } => {
                    self.duplicates += 1;
                    self.duplicated_events += u64::from(second);
                    Observed::Duplicate
                }
                MessageRecord::OutOfOrder { first_of_entity } => {
                    self.out_of_order_records += 1;
                    self.out_of_order_keys += u64::from(first_of_entity);
                    Observed::OutOfOrder
                }
            };
        };
        let row = &mut self.rows[i].1;
        row.deliveries = row.deliveries.saturating_add(1);
        if row.deliveries > 1 {
            self.duplicates += 1;
            if row.deliveries == 2 {
                self.duplicated_events += 1;
            }
            return Observed::Duplicate;
        }
        if row.flags & (POISONED | PARKED) == POISONED {
            // Replayed after its successors: out of order by design, not a relay bug
            // (unless it was parked: then it waited in order, and is checked).
            return Observed::First;
        }
        let position = Position {
            lsn: source_lsn,
            rank: row.rank,
        };
        let entity = entity_hash(topic, partition, key.unwrap_or_default());
        match self.entities.entry(entity) {
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(EntityState {
                    last: position,
                    out_of_order: false,
                });
                Observed::First
            }
            std::collections::hash_map::Entry::Occupied(o) => {
                let state = o.into_mut();
                let ordered = in_commit_order(state.last, position);
                state.last = position;
                if ordered {
                    return Observed::First;
                }
                self.out_of_order_records += 1;
                if !state.out_of_order {
                    state.out_of_order = true;
                    self.out_of_order_keys += 1;
                }
                Observed::OutOfOrder
            }
        }
    }

    /// A topic was read to the end: its entities are done.
    pub(super) fn end_topic(&mut self) {
        self.entities = HashMap::default();
        if let Some(messages) = self.messages.as_mut() {
            messages.end_topic();
        }
    }

    /// Whether the row with this key is lost (in the range, not delivered, not poisoned).
    pub(super) fn is_lost(&self, idempotency_key: &[u8]) -> bool {
        self.find(key_hash(idempotency_key)).is_some_and(|i| {
            let s = self.rows[i].1;
            s.deliveries == 0 && s.flags & POISONED == 0
        })
    }

    pub(super) fn counts(&self) -> Counts {
        let mut c = Counts {
            expected: self.rows.len() as u64,
            ..Counts::default()
        };
        for (_, s) in &self.rows {
            let poisoned = s.flags & POISONED != 0;
            match (s.deliveries > 0, poisoned) {
                (true, false) => c.delivered += 1,
                (true, true) => {
                    c.delivered += 1;
                    c.replayed += 1;
                }
                (false, true) => {
                    c.poisoned += 1;
                    c.parked += u64::from(s.flags & PARKED != 0);
                }
                (false, false) => c.lost += 1,
            }
        }
        if let Some(messages) = &self.messages {
            let m = messages.counts();
            c.expected += m.emitted;
            c.delivered += m.delivered;
            c.poisoned += m.poisoned;
            c.lost += m.lost;
            c.beyond_messages = m.beyond;
            c.messages = Some(m);
        }
        c
    }

    /// Audits the message outbox too, with its ledger (`messages.rs`): `events`
    /// emitted for the entity `aggregate_id`.
    pub(super) fn count_emitted(&mut self, aggregate_id: &[u8], events: u64) {
        self.messages
            .get_or_insert_with(Messages::default)
            .emitted(key_hash(aggregate_id), events);
    }

    /// Whether the message outbox is audited (its ledger counted events): only then
    /// do the other outboxes' rows matter ([`Ledger::push_other_row`]).
    pub(super) fn audits_messages(&self) -> bool {
        self.messages.is_some()
    }

    /// A row of another outbox of the config, by the key its records carry: a
    /// record with it is that outbox's, never a message of this one (module doc).
    /// Call [`Ledger::seal_other_rows`] once they are all in.
    pub(super) fn push_other_row(&mut self, idempotency_key: &[u8]) {
        debug_assert!(!self.other_rows_sealed);
        self.other_rows.push(key_hash(idempotency_key));
    }

    /// Sorts the other outboxes' rows for lookups.
    pub(super) fn seal_other_rows(&mut self) {
        self.other_rows.sort_unstable();
        self.other_rows.dedup();
        self.other_rows.shrink_to_fit();
        self.other_rows_sealed = true;
    }

    /// A poison row of a message (its `row_data` carries the marker).
    pub(super) fn mark_message_poisoned(&mut self, aggregate_id: &[u8], idempotency_key: &[u8]) {
        self.messages
            .get_or_insert_with(Messages::default)
            .poisoned(key_hash(aggregate_id), key_hash(idempotency_key));
    }

    /// Bytes held for rows (the entity map is per topic and not included).
    pub(super) fn state_bytes(&self) -> u64 {
        (self.rows.capacity() * std::mem::size_of::<(u64, RowState)>()
            + self.other_rows.capacity() * std::mem::size_of::<u64>()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lsn(s: &str) -> Option<Lsn> {
        Some(s.parse().unwrap())
    }

    /// A sealed ledger with rows `k0..kn` in that rank order.
    fn ledger(n: usize) -> Ledger {
        let mut l = Ledger::with_capacity(n);
        for i in 0..n {
            l.push_row(format!("k{i}").as_bytes()).unwrap();
        }
        l.seal();
        l
    }

    fn see(l: &mut Ledger, entity: &str, key: &str, lsn_: Option<Lsn>) -> Observed {
        l.observe("t", 0, Some(entity.as_bytes()), Some(key.as_bytes()), lsn_)
    }

    #[test]
    fn row_state_is_sixteen_bytes_with_its_hash() {
        assert_eq!(std::mem::size_of::<(u64, RowState)>(), 16);
        let l = ledger(1000);
        assert_eq!(l.state_bytes(), 16_000);
    }

    #[test]
    fn all_delivered_once_in_order_is_clean() {
        let mut l = ledger(4);
        for (i, e) in ["a", "b", "a", "b"].iter().enumerate() {
            assert_eq!(see(&mut l, e, &format!("k{i}"), None), Observed::First);
        }
        let c = l.counts();
        assert_eq!(
            c,
            Counts {
                expected: 4,
                delivered: 4,
                ..Counts::default()
            }
        );
        assert_eq!(l.duplicates, 0);
        assert_eq!(l.out_of_order_keys, 0);
    }

    #[test]
    fn repeated_deliveries_are_duplicates_and_do_not_break_order() {
        let mut l = ledger(3);
        see(&mut l, "a", "k0", lsn("0/10"));
        see(&mut l, "a", "k1", lsn("0/20"));
        // A crash re-sends the in-flight window: k0 again, k1 again, then k2.
        assert_eq!(see(&mut l, "a", "k0", lsn("0/10")), Observed::Duplicate);
        assert_eq!(see(&mut l, "a", "k1", lsn("0/20")), Observed::Duplicate);
        assert_eq!(see(&mut l, "a", "k1", lsn("0/20")), Observed::Duplicate);
        assert_eq!(see(&mut l, "a", "k2", lsn("0/30")), Observed::First);
        assert_eq!(l.duplicates, 3);
        assert_eq!(l.duplicated_events, 2);
        assert_eq!(l.out_of_order_keys, 0);
        assert_eq!(l.counts().delivered, 3);
    }

    #[test]
    fn undelivered_rows_are_lost_unless_poisoned() {
        let mut l = ledger(3);
        assert!(l.mark_poisoned(b"k1"));
        assert!(!l.mark_poisoned(b"unknown"));
        see(&mut l, "a", "k0", None);
        let c = l.counts();
        assert_eq!((c.delivered, c.poisoned, c.lost), (1, 1, 1));
        assert!(l.is_lost(b"k2"));
        assert!(!l.is_lost(b"k1"));
        assert!(!l.is_lost(b"k0"));
        assert!(!l.is_lost(b"nope"));
    }

    #[test]
    fn parked_events_count_as_poisoned_until_delivered() {
        let mut l = ledger(3);
        assert!(l.mark_poisoned(b"k0"));
        assert!(l.mark_parked(b"k1"));
        assert!(l.mark_parked(b"k2"));
        let c = l.counts();
        assert_eq!((c.poisoned, c.parked, c.lost), (3, 2, 0));
        // Released in order after the replayed k0: checked, and in order.
        assert_eq!(see(&mut l, "a", "k0", lsn("0/10")), Observed::First);
        assert_eq!(see(&mut l, "a", "k1", lsn("0/20")), Observed::First);
        assert_eq!(see(&mut l, "a", "k2", lsn("0/30")), Observed::First);
        assert_eq!(l.out_of_order_keys, 0);
        // A parked event delivered before an earlier one of its entity is caught.
        let mut l = ledger(3);
        l.mark_parked(b"k1");
        assert_eq!(see(&mut l, "a", "k2", lsn("0/30")), Observed::First);
        assert_eq!(see(&mut l, "a", "k1", lsn("0/20")), Observed::OutOfOrder);
    }

    #[test]
    fn replayed_poison_is_delivered_and_exempt_from_order() {
        let mut l = ledger(2);
        l.mark_poisoned(b"k0");
        see(&mut l, "a", "k1", lsn("0/20"));
        // Replay publishes k0 later, without a source_lsn.
        assert_eq!(see(&mut l, "a", "k0", None), Observed::First);
        let c = l.counts();
        assert_eq!((c.delivered, c.poisoned, c.replayed, c.lost), (2, 0, 1, 0));
        assert_eq!(l.out_of_order_keys, 0);
    }

    #[test]
    fn commit_lsn_decides_order_then_rank() {
        let mut l = ledger(4);
        // k1 committed (0/20) before k0 (0/30) although created later: in order.
        assert_eq!(see(&mut l, "a", "k1", lsn("0/20")), Observed::First);
        assert_eq!(see(&mut l, "a", "k0", lsn("0/30")), Observed::First);
        // Same transaction: rank decides; k3 before k2 goes back.
        assert_eq!(see(&mut l, "a", "k3", lsn("0/40")), Observed::First);
        assert_eq!(see(&mut l, "a", "k2", lsn("0/40")), Observed::OutOfOrder);
        assert_eq!(l.out_of_order_keys, 1);
    }

    #[test]
    fn lsn_going_back_is_out_of_order_once_per_entity() {
        let mut l = ledger(4);
        see(&mut l, "a", "k0", lsn("0/30"));
        assert_eq!(see(&mut l, "a", "k1", lsn("0/20")), Observed::OutOfOrder);
        assert_eq!(see(&mut l, "a", "k2", lsn("0/10")), Observed::OutOfOrder);
        assert_eq!(see(&mut l, "b", "k3", lsn("0/5")), Observed::First);
        assert_eq!(l.out_of_order_keys, 1);
        assert_eq!(l.out_of_order_records, 2);
    }

    #[test]
    fn without_lsn_rank_decides() {
        let mut l = ledger(3);
        see(&mut l, "a", "k2", None);
        assert_eq!(see(&mut l, "a", "k0", None), Observed::OutOfOrder);
        // Mixed: one side without LSN compares ranks only.
        let mut l = ledger(3);
        see(&mut l, "a", "k0", None);
        assert_eq!(see(&mut l, "a", "k1", lsn("0/1")), Observed::First);
        assert_eq!(see(&mut l, "a", "k2", None), Observed::First);
        assert_eq!(l.out_of_order_keys, 0);
    }

    #[test]
    fn entities_are_per_topic_and_partition() {
        let mut l = ledger(2);
        l.observe("t", 0, Some(b"a"), Some(b"k1"), None);
        // Same key on another partition (repartitioned topic): not compared.
        assert_eq!(
            l.observe("t", 1, Some(b"a"), Some(b"k0"), None),
            Observed::First
        );
        let mut l = ledger(2);
        l.observe("t1", 0, Some(b"a"), Some(b"k1"), None);
        assert_eq!(
            l.observe("t2", 0, Some(b"a"), Some(b"k0"), None),
            Observed::First
        );
        // After end_topic the state is gone too.
        let mut l = ledger(2);
        l.observe("t", 0, Some(b"a"), Some(b"k1"), None);
        l.end_topic();
        assert_eq!(
            l.observe("t", 0, Some(b"a"), Some(b"k0"), None),
            Observed::First
        );
    }

    #[test]
    fn foreign_records_are_counted_apart() {
        let mut l = ledger(1);
        assert_eq!(
            l.observe("t", 0, Some(b"a"), None, None),
            Observed::WithoutKey
        );
        assert_eq!(see(&mut l, "a", "other", None), Observed::OutsideRange);
        assert_eq!((l.records, l.without_key, l.outside_range), (2, 1, 1));
        assert_eq!(l.counts().lost, 1);
    }

    #[test]
    fn records_of_another_outboxs_rows_deliver_no_message() {
        // This outbox emitted one message for entity order-7; it was lost. Another
        // outbox of the config wrote a row for the same entity, relayed to the same
        // topic: its record is explained by no row of this outbox.
        let mut l = ledger(0);
        l.count_emitted(b"order-7", 1);
        l.push_other_row(b"billing-row-1");
        l.seal_other_rows();
        let observed = l.observe(
            "shared",
            0,
            Some(b"order-7"),
            Some(b"billing-row-1"),
            lsn("0/10"),
        );
        let c = l.counts();
        let m = c.messages.unwrap();
        assert_eq!(
            (m.emitted, m.delivered, m.lost),
            (1, 0, 1),
            "the lost message is hidden by another outbox's record: {m:?}"
        );
        assert_eq!((c.expected, c.delivered, c.lost), (1, 0, 1));
        assert_eq!(observed, Observed::OutsideRange);
        assert_eq!(l.outside_range, 1);
        // The message's own record, once it arrives, is its delivery.
        assert_eq!(
            l.observe(
                "shared",
                0,
                Some(b"order-7"),
                Some(b"message-1"),
                lsn("0/20")
            ),
            Observed::First
        );
        assert_eq!(l.counts().lost, 0);
    }

    #[test]
    fn shared_keys_are_one_event_with_the_first_rank() {
        let mut l = Ledger::with_capacity(3);
        l.push_row(b"x").unwrap();
        l.push_row(b"y").unwrap();
        l.push_row(b"x").unwrap();
        l.seal();
        assert_eq!(l.shared_keys, 1);
        assert_eq!(l.counts().expected, 2);
        let i = l.find(key_hash(b"x")).unwrap();
        assert_eq!(l.rows[i].1.rank, 0);
    }

    proptest! {
        #[test]
        fn counts_always_add_up(
            n in 0usize..60,
            poisoned in proptest::collection::vec(0usize..80, 0..20),
            records in proptest::collection::vec((0usize..80, 0u8..4, proptest::option::of(0u64..50)), 0..200),
        ) {
            let mut l = ledger(n);
            for p in &poisoned {
                l.mark_poisoned(format!("k{p}").as_bytes());
            }
            for (k, entity, lsn_) in &records {
                let key = format!("k{k}");
                l.observe("t", 0, Some(&[*entity]), Some(key.as_bytes()), lsn_.map(Lsn));
            }
            let c = l.counts();
            prop_assert_eq!(c.expected, n as u64);
            prop_assert_eq!(c.delivered + c.poisoned + c.lost, c.expected);
            prop_assert!(c.replayed <= c.delivered);
            prop_assert_eq!(l.records, records.len() as u64);
            prop_assert_eq!(c.delivered + l.duplicates + l.outside_range + l.without_key, l.records);
            prop_assert!(l.out_of_order_keys <= l.out_of_order_records);
            prop_assert!(l.out_of_order_keys <= 4);
        }

        #[test]
        fn in_order_first_deliveries_never_flag(
            n in 1usize..80,
            lsns in proptest::bool::ANY,
        ) {
            // Delivering in rank order (with LSNs non-decreasing) is always clean.
            let mut l = ledger(n);
            for i in 0..n {
                let key = format!("k{i}");
                let lsn_ = lsns.then_some(Lsn(i as u64 / 3));
                l.observe("t", 0, Some(b"e"), Some(key.as_bytes()), lsn_);
            }
            prop_assert_eq!(l.out_of_order_keys, 0);
        }
    }
}
