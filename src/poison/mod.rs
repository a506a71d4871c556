//! Undeliverable events: the `poison_outbox` side table.
//!
//! Two concerns, two files, because they have different users:
//!
//! * `table.rs`, the table's contract (`PoisonRow`, `insert_statement`,
//!   `insert_row`): shared by every writer (the CDC relay, the poller, a cutover),
//!   which must record the same fields in the same way, and idempotently per
//!   `(idempotency_key, lsn)`;
//! * `writer.rs`, the CDC relay's writer task (`PoisonWriter`, `run_writer`): the
//!   relay must not wait for an insert on its replication loop, so its inserts run on a
//!   connection and a task of their own and report back.
//!
//! Rows are never deleted (a trigger refuses it); `replay` re-publishes them.

mod table;
mod writer;

pub(crate) use table::{PoisonRow, insert_row, insert_statement};
pub(crate) use writer::{PoisonOutcome, PoisonRequest, PoisonWriter, run_writer};

#[cfg(test)]
pub(crate) use table::valid_json_or_string;
