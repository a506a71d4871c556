//! The `run` command: change data capture from the replication slot to Kafka.
//!
//! [`session`] is the I/O shell: it owns the replication connection, the producer and
//! the poison writer, and feeds what happens to the sans-IO [`progress`] core, which
//! alone decides which LSN may be confirmed. `heartbeat` keeps an idle slot moving,
//! [`metrics`] serves `/metrics`, `/healthz` and `/readyz`, and [`cutover`] takes over
//! from a polling relay when the slot is created.
//!
//! Where each session starts is [`start`]'s decision, from the slot, the relay's own
//! saved position (`position_saver` writes it before the server hears of it) and what
//! the process remembers; a lost slot is healed by `resync`. The core also keeps a
//! reconnect from producing again what the lost session had delivered. With
//! `kafka.delivery = "exactly-once"`, `exactly_once` runs the Kafka transactions the
//! core asks for and resumes it from the last committed progress record.

mod backlog;
mod binary;
mod confirmation;
pub mod cutover;
mod exactly_once;
mod fence;
pub(crate) mod heartbeat;
mod in_flight;
mod instruments;
pub mod metrics;
mod poison_policy;
pub(crate) mod ports;
mod position_saver;
pub mod progress;
pub mod progress_record;
mod read_pacing;
mod resync;
pub mod session;
#[cfg(test)]
mod simulation;
pub mod start;
pub mod start_checks;
pub(crate) mod traces;
pub mod unreplayed_poison;
pub mod wal_identity;

pub use session::{RunSummary, run, run_checked, run_with_health};
pub use start_checks::StartChecks;
