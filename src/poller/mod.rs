//! The polling relay (`outbox-relay poll`): the classic transactional-outbox
//! procedure, for databases where logical replication is not available, and the
//! baseline the CDC relay ([`crate::cdc::session`]) is measured against.
//!
//! # The procedure
//!
//! Each worker repeats, on its own connection:
//!
//! 1. `BEGIN`; `SELECT … FROM outbox WHERE sent_at IS NULL AND attempts < $max
//!    ORDER BY created_at, id LIMIT $batch FOR UPDATE SKIP LOCKED`;
//! 2. map every row with the CDC relay's own [`OutboxMapper`](crate::outbox::OutboxMapper) and hand the whole
//!    batch to the same [`Publisher`](crate::kafka::Publisher) (same producer settings, keys, headers, payload
//!    bytes) — no send is awaited on its own;
//! 3. wait until every record of the batch has its delivery report;
//! 4. in the same transaction: `UPDATE … SET sent_at = statement_timestamp() WHERE
//!    id = ANY($ids)` for the acked rows (one set-based statement), `attempts` and
//!    `last_error` for rows the broker refused, a `poison_outbox` row for those that
//!    reached `max_attempts`; `COMMIT`.
//!
//! When the next batch is polled, and how several workers keep (or lose) per-key
//! order, is told in `worker.rs` and `sql.rs` ("SKIP LOCKED and ordering"); what
//! happens to failed rows in `marks.rs` ("Failures").
//!
//! # Never mark before the ack
//!
//! A row is marked sent only in the transaction that commits *after* its broker ack
//! (`acks=all`). A crash anywhere before that `COMMIT` rolls the marks back (and the
//! server releases the row locks), so the next poll sends the batch again: at most one
//! batch per worker is duplicated, nothing is lost (promises 1 and 2, `docs/architecture.md#promises`).
//! Consumers drop the duplicates by the `idempotency_key` header. Marking first
//! ("send after commit") would turn the same crash into a silent loss.
//!
//! # What polling costs that CDC does not
//!
//! The CDC relay reads the WAL the application's `INSERT` already wrote and writes
//! nothing to the table. The poller's `UPDATE` writes a new version of every row:
//! `sent_at` is in the partial index's predicate, so the update can never be HOT —
//! each sent row costs a new heap tuple, an entry in every index of the table (primary
//! key, `idempotency_key`), WAL for all of it (full-page images after a checkpoint),
//! and a dead tuple for vacuum. Until vacuum runs, dead index entries make the poll's
//! index scan longer; tune autovacuum for the outbox (e.g. a low
//! `autovacuum_vacuum_scale_factor`) and delete delivered rows on a retention schedule.
//! The batch's transaction also stays open while acks are awaited, which holds back the
//! vacuum horizon for as long as a broker outage lasts.
//!
//! # Falling back from the CDC relay
//!
//! `--after-cdc` is the emergency switch from `run` to `poll` (logical replication
//! unavailable, the slot lost, …). The CDC relay never marks rows, so before
//! polling the poller marks `sent_at` on every row the relay's slot has confirmed,
//! by the newest [checkpoint](crate::outbox::checkpoint) the slot passed (set-based batches
//! of `--batch-size`). The rows between that checkpoint and the relay's true position
//! are sent again: duplicates with their original idempotency key, never losses. How
//! many is bounded by the traffic between two checkpoints (`retention.interval`),
//! plus the longest transaction open when the checkpoint was taken. Without any
//! confirmed checkpoint, every unsent row is sent again (with a warning).
//!
//!
//! # Where each part lives
//!
//! | file | what |
//! |---|---|
//! | `args.rs` | [`PollArgs`], resolved against the config |
//! | `worker.rs` | [`run`]: the workers, their loop, pauses and backoff, [`PollSummary`] |
//! | `batch.rs` | [`Poller`] (one worker's connection, statements, producer) and [`PublishedBatch`] |
//! | `publish.rs` | send a batch, await its reports (shared with a cutover) |
//! | `marks.rs` | step 4: sent, attempts, poison; and the failure classes |
//! | `row.rs` | one polled row and its record, as the CDC mapper builds it |
//! | `layout.rs` | the outbox table's columns, checked at start-up |
//! | `sql.rs` | the statements, SKIP LOCKED and ordering, the session settings |
//! | `pg_error.rs` | how a failed statement is classified |

mod args;
mod batch;
mod layout;
mod marks;
mod pg_error;
mod publish;
mod row;
mod sql;
mod worker;

pub use args::PollArgs;
pub use batch::{ATTEMPTS_EXHAUSTED, Poller, PublishedBatch};
#[cfg(test)]
pub(crate) use layout::migrated_layout_for_tests;
pub(crate) use layout::{
    AGGREGATE_ID, AGGREGATE_TYPE, CREATED_AT as CREATED_AT_FIELD, EVENT_TYPE, ID as ID_FIELD,
    Layout, Reading, inspect_tables, inspect_tables_for,
};
pub use marks::BatchOutcome;
pub(crate) use marks::{mark_unsent_sent, write_marks};
pub(crate) use pg_error::pg_error;
pub(crate) use publish::publish_holding;
pub(crate) use row::{
    BatchRow, CommitRank, Delivery, Polled, RowResult, read_ranked_row, read_row, read_row_before,
};
pub(crate) use sql::{Prepared, Sql, has_poison_row, select_list, session};
pub use worker::{PollSummary, run};
