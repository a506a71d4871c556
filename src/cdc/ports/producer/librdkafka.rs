//! The real producer port: librdkafka's producer ([`Publisher`]), how the relay
//! makes one, and the progress record read back with a `read_committed` consumer.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::RDKafkaErrorCode;
use tokio::sync::mpsc;

use super::{Made, Producer, Producers, ProgressReader};
use crate::cdc::ports::Boxed;
use crate::cdc::progress_record::{self, ProgressRecord};
use crate::config::RelayConfig;
use crate::delivery::{EventId, Failure};
use crate::error::Result;
use crate::kafka::{
    self, BrokerError, DeliveryReport, Publisher, RecordRef, SendRejected, TransactionCall,
    TransactionError,
};
use crate::outbox::OutboxEvent;

impl Producer for Publisher {
    fn send(&self, id: EventId, record: RecordRef<'_>) -> std::result::Result<(), SendRejected> {
        Publisher::send(self, id, record)
    }

    fn send_event(
        &self,
        id: EventId,
        event: &OutboxEvent,
    ) -> std::result::Result<(), SendRejected> {
        Publisher::send_event(self, id, event)
    }

    fn classify(&self, code: RDKafkaErrorCode) -> Failure {
        Publisher::classify(self, code)
    }

    fn max_message_bytes(&self) -> usize {
        Publisher::max_message_bytes(self)
    }

    fn compresses(&self) -> bool {
        Publisher::compresses(self)
    }

    fn in_flight(&self) -> i32 {
        Publisher::in_flight(self)
    }

    fn stream_idle(&self) {
        Publisher::stream_idle(self);
    }

    fn fatal_error(&self) -> Option<(RDKafkaErrorCode, String)> {
        Publisher::fatal_error(self)
    }

    fn check_broker(&self, timeout: Duration) -> Boxed<'_, std::result::Result<(), BrokerError>> {
        Box::pin(Publisher::check_broker(self, timeout))
    }

    fn alone(&self) -> std::result::Result<Box<dyn Producer>, BrokerError> {
        Ok(Box::new(Publisher::alone(self)?))
    }

    fn init_transactions(&self, id: &str) -> Boxed<'_, std::result::Result<(), TransactionError>> {
        let id = id.to_owned();
        Box::pin(async move { Publisher::init_transactions(self, &id).await })
    }

    fn begin_transaction(&self, id: &str) -> std::result::Result<(), TransactionError> {
        Publisher::begin_transaction(self, id)
    }

    fn start_commit(&self, id: &str) -> TransactionCall {
        Publisher::start_commit(self, id)
    }

    fn start_abort(&self, id: &str) -> TransactionCall {
        Publisher::start_abort(self, id)
    }

    /// Dropped on a blocking thread: librdkafka's destroy may wait for its broker
    /// connections.
    fn retire(self: Box<Self>) {
        tokio::task::spawn_blocking(move || drop(self));
    }
}

/// The real producers: librdkafka's, with the relay's settings.
pub(crate) struct KafkaProducers {
    config: ClientConfig,
    settings: RelayConfig,
}

impl KafkaProducers {
    pub(crate) fn new(config: ClientConfig, settings: &RelayConfig) -> KafkaProducers {
        KafkaProducers {
            config,
            settings: settings.clone(),
        }
    }

    /// The producer settings (for the topic-limit lookups and the linger).
    pub(crate) fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// A producer as [`Producers::make`] makes it, not boxed (the start-up checks
    /// ask it more than the port does).
    ///
    /// # Errors
    ///
    /// It cannot be made.
    pub(crate) fn publisher(&self) -> Result<(Publisher, mpsc::Receiver<DeliveryReport>)> {
        let (publisher, reports) =
            Publisher::new(self.config.clone(), kafka::report_capacity(&self.settings))?;
        let publisher =
            publisher.with_configuration_errors_poisoned(self.settings.on_config_error.poisons());
        let publisher = if self.settings.flush_when_idle {
            publisher.with_idle_flush()?
        } else {
            publisher
        };
        Ok((publisher, reports))
    }
}

impl Producers for KafkaProducers {
    fn make(&self) -> Result<Made> {
        let (publisher, reports) = self.publisher()?;
        Ok((Box::new(publisher), reports))
    }
}

/// The real progress reader: a `read_committed` consumer with these settings.
pub(crate) struct KafkaProgressReader(pub(crate) ClientConfig);

impl ProgressReader for KafkaProgressReader {
    fn read_latest<'a>(
        &'a self,
        topic: &'a str,
        slot: &'a str,
    ) -> Boxed<'a, Result<Option<ProgressRecord>>> {
        Box::pin(read_latest(&self.0, topic, slot))
    }
}

/// The latest committed record of `slot` ([`progress_record::read_latest`], on a
/// blocking thread).
///
/// # Errors
///
/// See [`progress_record::read_latest`].
pub(crate) async fn read_latest(
    reader: &ClientConfig,
    topic: &str,
    slot: &str,
) -> Result<Option<ProgressRecord>> {
    let (reader, topic, slot) = (reader.clone(), topic.to_owned(), slot.to_owned());
    Ok(
        tokio::task::spawn_blocking(move || progress_record::read_latest(&reader, &topic, &slot))
            .await
            .map_err(|e| progress_record::ProgressRecordError::Task(e.to_string()))??,
    )
}
