//! Undeliverable events: the `poison_outbox` side table.
//!
//! The concerns, a file each, because they have different users:
//!
//! * `table.rs`, the table's contract (`PoisonRow`, `insert_statement`,
//!   `insert_rows`): shared by every writer (the CDC relay, the poller, a cutover),
//!   which must record the same fields in the same way, once per occurrence of an
//!   event (`(outbox_id, lsn)` and the source: the outbox table and the slot, so that
//!   relays sharing a poison table keep apart), and whatever the content (casts that
//!   cannot fail, values cut to `relay.poison_copy_limit_bytes`);
//! * `writer.rs`, the CDC relay's writer task (`PoisonWriter`, `run_writer`): the
//!   relay must not wait for an insert on its replication loop, so its inserts run on a
//!   connection and a task of their own, a batch of queued requests per statement,
//!   and report back;
//! * `parking.rs`, parked keys (`relay.on_poison = "park-key"`): how the writer
//!   parks the later events of a poisoned event's key and how `replay` releases
//!   them, without the two interleaving badly;
//! * `recorded.rs`, what a new session must not produce again because a previous
//!   process of the same relay (same slot, same outbox) already poisoned it.
//!
//! Rows are never deleted (a trigger refuses it); `replay` re-publishes them.

mod parking;
mod recorded;
mod table;
mod writer;

pub(crate) use parking::{
    KEY_ORDER, Parked, ParkedKey, WriterStatements, insert_parking_in, load_parked_keys,
    needs_parking, parked_key_table, parked_row, release_key, unreplayed_key_rows,
};
pub(crate) use recorded::RecordedPoison;
pub(crate) use table::{Parking, PoisonRow, insert_rows, insert_statement, source_table};
#[cfg(test)]
pub(crate) use writer::PoisonInsertError;
pub(crate) use writer::{PoisonOutcome, PoisonRequest, PoisonWriter, run_writer};
