//! Outbox rows → Kafka records.
//!
//! The [`OutboxMapper`] turns one `pgoutput` `Insert` into an outbox table into one
//! Kafka record ([`OutboxEvent`]), or says why it cannot ([`UnmappableRow`]). It is
//! pure: no I/O, no clock, no logging, so the sans-IO core and the benchmarks can
//! drive it directly. The polling relay and `replay` build the same record from
//! column text with [`OutboxMapper::map_row`], so `run`, `poll` and `replay` cannot
//! drift apart (`docs/architecture.md#the-kafka-record`).
//!
//! # Where things are
//!
//! | file | what | why it is separate |
//! |---|---|---|
//! | `record` | [`OutboxEvent`], [`Mapped`], [`PoisonFields`], header names, [`error_kind`]: the record contract | what every other stage sees |
//! | `columns` | the nine outbox fields, their configured names, Debezium aliases and accepted type OIDs | the table's side of the contract |
//! | `relation` | the relation cache: fields bound to the columns of each `Relation` message, tuples read by position | done once per `Relation`, not per row |
//! | `mapper` | [`OutboxMapper`]: `Insert` or row text → [`Mapped`] | the rules, in contract order |
//! | `topic` | `kafka.topic_template` and Kafka's topic-name rules | parsed at start-up, rendered per row |
//! | `headers` | the row's `headers` JSON object → Kafka headers | the only JSON parsed per event |
//! | `timestamp` | `created_at` text → Unix microseconds → RFC 3339 | strict grammar, no allocation |
//! | `envelope`, `json` | the optional JSON envelope; JSON string literals | the payload is spliced, never re-encoded |
//! | `bytea` | `bytea` text output → bytes | both of PostgreSQL's formats |
//! | [`checkpoint`] | which rows the CDC relay has delivered, from `xmin` alone | retention and `poll --after-cdc` |
//! | [`position`] | the relay's own saved confirmed LSN, with its server history | survives PostgreSQL restarts and lost slots |
//! | `checkpoint_error` | [`checkpoint::CheckpointError`], shared by `checkpoint` and `position`, and the LSNs they read | below both: `checkpoint` reads the position, so `position` imports nothing from it |
//! | [`enqueue`] | writing an event inside the caller's transaction | the writer's side |
//! | [`message`] | the message outbox's frame (`pg_logical_emit_message`) → an outbox row | events that never were rows |

mod bytea;
pub mod checkpoint;
mod checkpoint_error;
mod cloudevents;
mod columns;
pub mod enqueue;
mod envelope;
mod headers;
mod json;
mod mapper;
pub mod message;
pub mod position;
mod record;
mod relation;
mod timestamp;
mod topic;

pub use crate::config::EnvelopeConfig;
pub use mapper::OutboxMapper;
pub use record::{
    HEADER_AGGREGATE_TYPE, HEADER_EVENT_TYPE, HEADER_IDEMPOTENCY_KEY, HEADER_OCCURRED_AT,
    HEADER_REPUBLISH, HEADER_SOURCE_LSN, HeaderName, MapError, Mapped, OutboxEvent, OutboxRow,
    PayloadFormat, PoisonFields, RelationStatus, UnmappableRow, error_kind,
};
pub(crate) use relation::reads_binary;
pub use topic::{TopicNameError, validate_topic_name};
