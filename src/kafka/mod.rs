//! Kafka publishing: producer settings, the error classification table, and the
//! [`Publisher`] that turns librdkafka delivery callbacks into [`DeliveryReport`]s.
//!
//! This module only *publishes and reports*. Whether a failed event is retried,
//! backed off or poisoned is decided by the sans-IO core in [`crate::cdc::progress`]; the
//! publisher tells it, per event, "acked at partition/offset" or "failed with this
//! broker error, which is [`Failure::Permanent`](crate::delivery::Failure::Permanent),
//! [`Failure::Transient`](crate::delivery::Failure::Transient), or a setup error that
//! `relay.on_config_error` makes one of the two
//! ([`Failure::Configuration`](crate::delivery::Failure::Configuration))".
//!
//! | file | what | why it is apart |
//! |---|---|---|
//! | `config.rs` | [`producer_config`]: the guarantees every producer carries, refused pass-through settings | one producer contract for `run`, `poll`, `cutover`, `replay` and the bench |
//! | `classify.rs` | broker error code → transient / configuration / poison / fatal, and its stable name | read by the publisher, the core's caller, the poison table and metrics |
//! | `publisher.rs` | [`Publisher`], [`DeliveryReport`], [`SendRejected`] | the librdkafka callback plumbing |
//! | `transactions.rs` | [`transactional_config`], [`transactional_id`], the transaction calls and their errors | `kafka.delivery = "exactly-once"` only |
//! | `consumer.rs` | [`reader_config`], [`Isolation`]: the readers of `audit` and of the progress record | what a reader copies from `kafka.producer` |
//! | `topic_limits.rs` | the topics' `max.message.bytes`, read from the broker | without compression, a record above it is poisoned before it is produced |
//! | `idle_flush.rs` | ends `linger.ms` early when the relay's stream goes idle | a blocking librdkafka call on a thread of its own |
//! | `admin.rs` | `create_topic`, `create_progress_topic` | for the tools, and `migrate`'s progress topic: the relay never creates event topics |
//! | `progress_topic.rs` | [`ProgressTopicLayout`], [`judge_progress_topic`] | what exactly-once needs of the progress topic and the coordinator, for `check` and `run` |
//! | `error.rs` | [`BrokerError`]: set-up failures with their exit codes | this layer sits below [`crate::error`] |
//!
//! # Driving it
//!
//! ```ignore
//! let cfg = kafka::producer_config(&config.kafka, &config.relay)?;
//! let (publisher, mut reports) = Publisher::new(cfg, kafka::report_capacity(&config.relay))?;
//! publisher.check_broker(Duration::from_secs(10)).await?; // exit code 4 if down
//! loop {
//!     tokio::select! {
//!         biased;
//!         _ = shutdown.changed() => break,
//!         Some(report) = reports.recv() => {
//!             if report.is_fatal() { /* stop: see Publisher::fatal_error */ }
//!             match report.failure() {
//!                 None => core.delivered(report.id, Instant::now()),
//!                 Some(failure) => core.delivery_failed(report.id, failure, Instant::now()),
//!             }
//!             // then drain what else is ready with `reports.try_recv()`
//!         }
//!         // … WAL messages only while `core.can_read()`; on Action::Produce:
//!         //   if let Err(r) = publisher.send(id, record) { core.delivery_failed(id, r.failure, now) }
//!     }
//! }
//! ```

// Topic creation: the demo and the bench create their topics, `migrate` the
// exactly-once progress topic.
mod admin;
mod classify;
mod config;
mod consumer;
mod error;
mod idle_flush;
mod progress_topic;
mod publisher;
mod topic_limits;
mod transactions;

pub use admin::create_progress_topic;
#[cfg(feature = "tools")]
pub(crate) use admin::create_topic;
#[cfg(test)]
pub(crate) use classify::classify;
pub(crate) use classify::{configuration_fix, error_kind, is_configuration, is_size_error};
pub use config::{compresses, linger, producer_config, report_capacity};
pub use consumer::{Isolation, ReaderContext, reader_config};
pub use error::{BrokerError, BrokerUnavailable};
pub use idle_flush::IdleGate;
pub(crate) use progress_topic::describe as describe_progress_topic;
pub use progress_topic::{LayoutProblem, ProgressTopicLayout, judge as judge_progress_topic};
#[cfg(test)]
pub(crate) use publisher::with_event_record;
pub use publisher::{DeliveryReport, Publisher, RecordRef, SendRejected};
pub(crate) use publisher::{PRODUCE_REQUESTS, RECORDS_TRANSMITTED};
pub(crate) use topic_limits::{TopicLimits, read_limits};
pub use transactions::{
    TRANSACTION_CALL_TIMEOUT, TRANSACTION_TIMEOUT, TransactionCall, TransactionError, joined,
    retrying, transactional_config, transactional_id,
};
