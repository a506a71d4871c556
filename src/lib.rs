//! # outbox-relay
//!
//! Relays transactional-outbox events from PostgreSQL to Kafka by streaming the WAL
//! (logical replication with the `pgoutput` plugin) instead of polling.
//!
//! The promises (DESIGN.md §1): no event is lost — the replication slot's confirmed
//! LSN only moves past a transaction once every one of its events was acknowledged
//! by the broker (`acks=all`) or committed to the `poison_outbox` table; events are
//! produced in commit order, keyed by entity, with an idempotency-key header so
//! consumers can drop the few duplicates a crash can cause.
//!
//! Modules follow the data flow: [`postgres`] (connections, replication stream,
//! `pgoutput` decoding) → [`outbox`] (row → Kafka record) → [`kafka`] (producer) →
//! [`progress`] (the sans-IO ack tracker deciding which LSN to confirm).
//!
//! Around it: [`enqueue`] (writer helpers: the event and the business change in one
//! transaction), [`retention`] (deleting delivered rows or dropping partitions) and
//! [`checkpoint`] (how both, and the poller's fallback mode, know what the relay
//! confirmed).
//! [`cutover`] takes over from a polling relay ([`poller`]) when the slot is created.

pub mod audit;
pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod cutover;
pub mod demo;
pub mod enqueue;
pub mod error;
pub mod heartbeat;
pub mod kafka;
pub mod lsn;
pub mod meter;
pub mod metrics;
pub mod migrate;
pub mod outbox;
pub mod poison;
pub mod poller;
pub mod postgres;
pub mod progress;
pub mod relay;
pub mod replay;
pub mod retention;
pub mod status;

pub use error::{Error, Result};
pub use lsn::Lsn;
