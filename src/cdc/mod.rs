//! The `run` command: change data capture from the replication slot to Kafka.
//!
//! [`session`] is the I/O shell: it owns the replication connection, the producer and
//! the poison writer, and feeds what happens to the sans-IO [`progress`] core, which
//! alone decides which LSN may be confirmed. `heartbeat` keeps an idle slot moving,
//! [`metrics`] serves `/metrics`, `/healthz` and `/readyz`, and [`cutover`] takes over
//! from a polling relay when the slot is created.

pub mod cutover;
pub(crate) mod heartbeat;
mod in_flight;
mod instruments;
pub mod metrics;
pub mod progress;
pub mod session;

pub use session::{RunSummary, run, run_with_health};
