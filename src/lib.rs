//! # outbox-relay
//!
//! Relays transactional-outbox events from PostgreSQL to Kafka by streaming the WAL
//! (logical replication with the `pgoutput` plugin) instead of polling.
//!
//! The promises (`docs/architecture.md`): no event is lost — the replication slot's
//! confirmed LSN only moves past a transaction once every one of its events was
//! acknowledged by the broker (`acks=all`) or committed to the `poison_outbox` table;
//! events are produced in commit order, keyed by entity, with an idempotency-key
//! header so consumers can drop the few duplicates a crash can cause.
//!
//! The folders follow the data flow, lowest layer first; a module only imports from
//! the layers below it:
//!
//! | stage | module |
//! |---|---|
//! | stream and decode the WAL | [`postgres`] (connections, replication protocol, `pgoutput`) |
//! | map a row to a record | [`outbox`] (mapper, topic, envelope, CloudEvents, headers, the message outbox; writer helpers, checkpoints, the saved position) |
//! | the consumer's half | [`inbox`] (each event applied once) |
//! | produce and collect acks | [`kafka`] (and Kafka transactions for exactly-once) |
//! | record what cannot be delivered | [`poison`] |
//! | the polling relay (fallback, baseline) | [`poller`] |
//! | confirm: the `run` command | [`cdc`] (session loop, the sans-IO progress core, heartbeat, metrics, cutover) |
//! | operator commands | [`ops`] (check, migrate, status, replay, retention, audit, health) |
//! | developer tools | [`tools`] (demo, bench, dev-broker; cargo feature `tools`) |
//!
//! Beneath them all: [`lsn`], [`lifecycle`] (shutdown and backoff), [`delivery`] (event
//! ids and failure classes) and [`config`]; [`error`], the commands' error, wraps the
//! errors of the layers below it and sits above [`kafka`] and [`poison`]; above them
//! all: [`cli`] (`scripts/check-layers` checks the order).

pub mod cdc;
pub mod cli;
pub mod config;
pub mod delivery;
pub mod error;
pub(crate) mod hashing;
pub mod inbox;
pub mod kafka;
pub mod lifecycle;
pub mod lsn;
pub mod ops;
pub mod outbox;
pub mod poison;
pub mod poller;
pub mod postgres;
#[cfg(feature = "tools")]
pub mod tools;

pub use error::{Error, Result};
pub use lsn::Lsn;
