//! The producer port: what the session shell asks of Kafka.
//!
//! A [`Producer`] takes a record with an event id and never waits for the broker;
//! exactly one [`DeliveryReport`] per accepted record follows on the report channel
//! made with it (`kafka::publisher` says why). In exactly-once mode the same
//! producer begins, commits and aborts Kafka transactions; a commit or an abort is
//! a [`TransactionCall`] the shell awaits while it keeps draining reports, because
//! a commit's outcome is only final once its last reports are in
//! (`session::transaction_driver`).
//!
//! [`Producers`] makes a new producer when the shell replaces a wedged or fenced
//! one, and [`ProgressReader`] reads exactly-once's progress record back.
//!
//! The real adapters are in `librdkafka.rs` beside this file ([`Publisher`],
//! librdkafka); the simulated ones are `cdc::simulation`'s Kafka.

pub(crate) mod librdkafka;

use std::time::Duration;

use rdkafka::error::RDKafkaErrorCode;
use tokio::sync::mpsc;

use super::Boxed;
use crate::cdc::progress_record::ProgressRecord;
use crate::delivery::{EventId, Failure};
use crate::error::Result;
use crate::kafka::{
    BrokerError, DeliveryReport, RecordRef, SendRejected, TransactionCall, TransactionError,
};
use crate::outbox::OutboxEvent;

/// See the module documentation.
pub(crate) trait Producer: Send + Sync {
    /// Queues one record for `id`; `Ok` means exactly one report for `id` follows.
    fn send(&self, id: EventId, record: RecordRef<'_>) -> std::result::Result<(), SendRejected>;

    /// Queues the record of an outbox event (`docs/architecture.md#the-kafka-record`).
    fn send_event(&self, id: EventId, event: &OutboxEvent)
    -> std::result::Result<(), SendRejected>;

    /// How the relay treats a failure with this code (`relay.on_config_error`
    /// applied).
    fn classify(&self, code: RDKafkaErrorCode) -> Failure;

    /// The producer's `message.max.bytes`.
    fn max_message_bytes(&self) -> usize;

    /// Whether batches are compressed (the topic's limit then applies to them).
    fn compresses(&self) -> bool;

    /// Records handed over and not yet reported.
    fn in_flight(&self) -> i32;

    /// [`Producer::in_flight`] as a count.
    fn queued(&self) -> u64 {
        u64::try_from(self.in_flight()).unwrap_or(0)
    }

    /// The stream has nothing to read: send what lingers (`relay.flush_when_idle`).
    fn stream_idle(&self);

    /// The error that made the producer unusable, if one did.
    fn fatal_error(&self) -> Option<(RDKafkaErrorCode, String)>;

    /// Whether the brokers answer a metadata request within `timeout`.
    fn check_broker(&self, timeout: Duration) -> Boxed<'_, std::result::Result<(), BrokerError>>;

    /// A producer that sends each record in a batch of its own, reporting on this
    /// one's channel (a retry after a batch-size error).
    ///
    /// # Errors
    ///
    /// It cannot be made.
    fn alone(&self) -> std::result::Result<Box<dyn Producer>, BrokerError>;

    /// `init_transactions`: fences older producers of `id`, aborts what they left.
    fn init_transactions(&self, id: &str) -> Boxed<'_, std::result::Result<(), TransactionError>>;

    /// `begin_transaction`.
    ///
    /// # Errors
    ///
    /// The producer refused (it is unusable or fenced).
    fn begin_transaction(&self, id: &str) -> std::result::Result<(), TransactionError>;

    /// Starts committing the open transaction.
    fn start_commit(&self, id: &str) -> TransactionCall;

    /// Starts aborting the open transaction.
    fn start_abort(&self, id: &str) -> TransactionCall;

    /// Lets the producer go (replaced); its late reports go nowhere.
    fn retire(self: Box<Self>);
}

/// A producer and the channel its reports arrive on.
pub(crate) type Made = (Box<dyn Producer>, mpsc::Receiver<DeliveryReport>);

/// Makes the relay's producers.
pub(crate) trait Producers: Send + Sync {
    /// A new producer with its report channel.
    ///
    /// # Errors
    ///
    /// It cannot be made.
    fn make(&self) -> Result<Made>;
}

/// Reads exactly-once's progress record back (`read_committed`).
pub(crate) trait ProgressReader: Send + Sync {
    /// The latest committed progress record of `slot` in `topic`.
    fn read_latest<'a>(
        &'a self,
        topic: &'a str,
        slot: &'a str,
    ) -> Boxed<'a, Result<Option<ProgressRecord>>>;
}
