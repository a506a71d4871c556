//! The simulated heal of a lost slot: what `cdc::resync` does to the world, as the
//! database port's `carry_out` of a `StartPlan::Lost`.
//!
//! # Why a model here
//!
//! The real resync reads the outbox table in an exported snapshot (`cdc::backlog`),
//! which this world has no port for: it keeps the WAL, not the table. What the
//! shell does around it is real and is what this checks: the plan that calls the
//! slot lost (missing after a drop or a promotion without a failover slot, or a
//! synced slot ahead of what holds on the new timeline), the transactional producer
//! replaced before the backlog takes its `transactional.id`, a fresh core at the new
//! slot's consistent point, the recorded poison read from there, and the saves of
//! the new position.
//!
//! # What it does
//!
//! As `docs/architecture.md` ("Healing a lost slot") says of the real one, with the
//! delivered rows found in the topic by what the topic holds: the backlog's
//! producer fences the initialised transactional producers (their open
//! transactions abort); every event not delivered (exactly-once: not in a committed
//! Kafka transaction) and not poisoned is published in commit order, in one
//! committed transaction under exactly-once, or poisoned when it can never be
//! delivered (unmappable, refused, too large); the slot is created at the WAL end
//! and the position saved there. Messages (`outbox_emit`) have no row to read
//! again and are lost with the slot (documented): schedules that lose slots write
//! none.

use super::kafka::{fence, partition_of};
use super::world::{Record, RowId, Slot, Txn, TxnStatus, World};
use crate::lsn::Lsn;
use crate::outbox::PoisonFields;
use crate::poison::{Parking, PoisonRow};

/// Heals the lost slot; returns the new slot's consistent point.
pub(super) fn resync(world: &mut World, transactional: bool) -> Lsn {
    // The backlog's producer takes the `transactional.id`: the initialised
    // producers of it are fenced (a replacement not initialised yet is not).
    fence(world, |_, producer| producer.initialised);
    // The backlog reads the poison table in its snapshot: a killed process's
    // poison insert that commits later is one it could not know of, as a
    // session's recorded-poison read could not (`World::sent_unaware_of_poison`).
    world.recorded_reads += 1;
    let txn = transactional.then(|| committed_txn(world));
    let mut published = 0;
    for index in 0..world.wal.len() {
        let (seq, final_lsn) = (world.wal[index].seq, world.wal[index].final_lsn);
        for ordinal in 0..world.wal[index].rows.len() {
            let written = world.wal[index].rows[ordinal].clone();
            let row = RowId {
                tx: seq,
                ordinal: u32::try_from(ordinal).unwrap_or(u32::MAX),
            };
            if written.message || world.resolved.contains(&row) {
                continue;
            }
            if written.unmappable || written.refused || written.oversize {
                let poison = poison_row(row, final_lsn);
                world.poison_committed(row, poison, None);
                continue;
            }
            let entity = format!("e{}", written.entity).into_bytes();
            let partition = partition_of(&entity);
            world.partitions[partition].push(Record {
                row,
                entity,
                txn,
                read: world.recorded_reads,
            });
            world.resolved.insert(row);
            published += 1;
        }
    }
    let at = world.wal_end();
    world.inherited_slot = false;
    world.slot = Some(Slot {
        confirmed: at,
        persisted: at,
    });
    world.position = Some(super::world::PositionRow {
        history: world.history,
        confirmed: at,
    });
    world.stats.resyncs += 1;
    world.stats.resynced += published;
    tracing::debug!(target: "sim", %at, published, "resync: the slot is created again");
    at
}

/// The backlog's Kafka transaction, committed (the resync completes only once its
/// rounds committed).
fn committed_txn(world: &mut World) -> u64 {
    let id = world.next_txn;
    world.next_txn += 1;
    world.txns.insert(
        id,
        Txn {
            producer: 0,
            status: TxnStatus::Committed,
            committing: false,
            failed: false,
            began: tokio::time::Instant::now(),
        },
    );
    world.stats.commits += 1;
    id
}

/// The poison row the backlog writes for an event it can never deliver.
fn poison_row(row: RowId, lsn: Lsn) -> PoisonRow {
    PoisonRow {
        fields: PoisonFields {
            idempotency_key: Some(row.key_text()),
            outbox_id: Some(row.uuid()),
            ..PoisonFields::default()
        },
        error: "simulated: the resync's backlog gave the row up".to_owned(),
        error_kind: "permanent".to_owned(),
        attempts: 1,
        lsn: Some(lsn),
        tx_position: Some(row.ordinal),
        parking: Parking::None,
    }
}
