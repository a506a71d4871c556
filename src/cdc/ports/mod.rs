//! The ports of the CDC session shell: everything `cdc::session` does to the world
//! goes through one of these, so that the same shell runs against the real
//! PostgreSQL and Kafka (the adapters beside each trait, today's code) and against
//! the deterministic simulation of `cdc::simulation` (tests only).
//!
//! - [`clock`]: time. The shell reads tokio's clock, which a simulation pauses and
//!   advances; the real clock is the same instant as `std::time::Instant::now()`.
//! - [`producer`]: the Kafka producer (produce with an id, delivery reports on a
//!   channel, the transactional calls) and how a new one is made.
//! - [`stream`]: the replication stream of one session (frames in, status updates
//!   out, a lost connection).
//! - [`database`]: what a session asks of PostgreSQL: the start plan's queries and
//!   its slot work, the saved position, the poison rows of earlier processes, the
//!   parked keys, and exactly-once's checks of the WAL.
//!
//! The ports are trait objects: the relay makes one call through them per frame or
//! per event at most, where a virtual call costs nothing measurable (the bench),
//! and the shell's types stay free of type parameters.
//!
//! Why ports at all: the losses found so far were at the seam between the
//! model-checked core (`cdc::progress`) and this shell, which a simulator of the
//! core alone cannot see. With the shell's world behind these traits, the
//! simulation runs the real shell (FoundationDB's and TigerBeetle's way: the real
//! code, with the network, disks and clocks replaced).

pub(crate) mod clock;
pub(crate) mod database;
pub(crate) mod producer;
pub(crate) mod stream;

use std::future::Future;
use std::pin::Pin;

/// A boxed future, as the ports' async methods return (trait objects cannot
/// return `impl Future`).
pub(crate) type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;
