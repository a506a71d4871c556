//! The relay's sans-IO core: ack tracker, commit watermark, in-flight window and
//! standby-status timing.
//!
//! Nothing in this module touches a socket, a clock or a task. The async shell feeds it
//! inputs — decoded pgoutput `Begin` / outbox rows / `Commit`, broker delivery reports,
//! poison-insert commits, keepalives, and the current time as an
//! [`Instant`](std::time::Instant) — and drains [`Action`]s: produce this record, insert that poison row, send this standby status
//! update. This is the shape of the protocol cores of rustls and quinn: every decision is a
//! deterministic function of the inputs, so the seeded simulator in the tests can drive it
//! through thousands of crash / out-of-order-ack / broker-error schedules in a second.
//!
//! The core is split by concern, each file explaining its part of the protocol:
//!
//! * `core.rs`: the state, the in-flight window and its bounds, and the [`Action`]s the
//!   shell drains;
//! * `tracker.rs`: the ack tracker, the watermark rule, and idle advance from keepalives;
//! * `events.rs`: each event's produce / retry / poison life, and per-key order;
//! * `status.rs`: when a [`StatusUpdate`] is sent, whatever the back-pressure;
//! * `resend.rs`: what a lost session already resolved, so a resend does not produce
//!   it again;
//! * `saving.rs`: the relay's saved position, and why no status confirms past it;
//! * `transactions.rs`: Kafka transactions (`kafka.delivery = "exactly-once"`): an
//!   event resolves when its transaction commits, with the progress record that
//!   lets the next process skip what is durable;
//! * `records.rs`: the shell's copy of each in-flight event, dropped only when the core
//!   resolves it (an ack inside a Kafka transaction is not a resolution);
//! * `config.rs`: [`CoreConfig`] and its normalisation; `error.rs`: [`ProtocolError`].
//!
//! The seeded simulator (`simulator.rs`) drives the core against a model walsender,
//! broker and poison table through crashes, reconnects, slot reverts and broker errors,
//! and checks after every step that nothing is lost, reordered per key or confirmed
//! early.
//!
//! # Limits
//!
//! * Per-key order holds across application-level retries, but not against events of
//!   the key the producer had in flight when a failure was reported (`events.rs`).
//! * Streamed in-progress transactions (pgoutput protocol v2 `Stream*` messages) are not
//!   modelled: the core expects `Begin`, rows, `Commit`, one transaction at a time.
//!
//! References: <https://www.postgresql.org/docs/current/protocol-replication.html>
//! (XLogData, primary keepalive, standby status update),
//! <https://www.postgresql.org/docs/current/logicaldecoding-explanation.html> (slots),
//! <https://www.postgresql.org/docs/current/view-pg-replication-slots.html>
//! (`confirmed_flush_lsn`),
//! <https://www.postgresql.org/docs/current/runtime-config-replication.html>
//! (`wal_sender_timeout`).

mod config;
mod core;
mod error;
mod events;
mod records;
mod resend;
mod saving;
mod status;
mod tracker;
mod transactions;

#[cfg(test)]
mod invariants;
#[cfg(test)]
pub(crate) mod simulator;
#[cfg(test)]
mod tests;

pub use self::config::{CoreConfig, TransactionLimits};
pub use self::core::{Action, Core, StatusUpdate};
pub use self::error::ProtocolError;
pub use self::records::{MissingRecord, Records};
pub use self::resend::{Origin, PartialTx, ProgressMark};
pub use self::saving::SavePhase;
