//! What can go wrong while setting up or talking to the broker, typed so that the
//! exit code comes from the variant and not from a message.
//!
//! The kafka layer sits below [`crate::error`] (`docs/architecture.md#exit-codes`): it
//! cannot build the process error itself, so it returns [`BrokerError`] and the
//! top-level error wraps it (`#[from]`), asking [`BrokerError::exit_code`] and
//! [`BrokerError::class`]. Three groups matter to an operator:
//!
//! * a producer setting the relay or librdkafka refuses: a *configuration* error,
//!   exit code 2, raised before anything connects (see [`super::config`]);
//! * the broker cannot be reached or refuses us at start-up, or the producer hit a
//!   fatal error: [`BrokerUnavailable`], exit code 4;
//! * anything else librdkafka reports ([`BrokerError::Client`], keeping its
//!   [`KafkaError`] as the source): exit code 1.
//!
//! Per-event delivery failures are *not* errors of this kind: they travel as
//! [`DeliveryReport`](super::DeliveryReport)s and [`SendRejected`](super::SendRejected)
//! and are classified by [`super::classify`].
//!
//! The Display texts are those the relay always printed (operators and the integration
//! tests read them): configuration errors start with `invalid configuration: ` like
//! [`crate::config::ConfigError::Invalid`], unavailability with
//! `Kafka broker unavailable: `.

use std::time::Duration;

use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

use crate::delivery::ErrorClass;

/// A failure of the kafka layer: producer set-up, start-up check, topic creation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// `kafka.partitioner` is not one librdkafka knows (exit code 2).
    #[error(
        "invalid configuration: kafka.partitioner = {value:?}: expected one of {}",
        .known.join(", ")
    )]
    UnknownPartitioner {
        value: String,
        /// The partitioners librdkafka knows.
        known: &'static [&'static str],
    },
    /// A `kafka.producer` pass-through setting that would weaken a guarantee, or that
    /// belongs elsewhere in the config (exit code 2).
    #[error("invalid configuration: kafka.producer.\"{key}\" = {value:?}: {why}")]
    RefusedSetting {
        key: String,
        value: String,
        /// Why the relay refuses it.
        why: String,
    },
    /// librdkafka refuses a property name or value of `kafka.producer` (exit code 2).
    #[error("invalid configuration: kafka.producer: {0}")]
    InvalidSetting(#[source] KafkaError),
    /// librdkafka cannot create the producer from the configuration (exit code 2).
    #[error("invalid configuration: Kafka producer configuration: {0}")]
    ProducerCreation(String),
    /// The broker cannot be reached or refuses us (exit code 4). Boxed: it is the
    /// largest variant, and errors travel by value through every `?`.
    #[error("Kafka broker unavailable: {0}")]
    Unavailable(#[source] Box<BrokerUnavailable>),
    /// The producer's delivery thread could not be started.
    #[error("I/O error: {0}")]
    DeliveryThread(#[source] std::io::Error),
    /// The blocking task of the start-up check panicked or was cancelled.
    #[error("broker check task failed: {0}")]
    CheckTask(#[source] tokio::task::JoinError),
    /// Any other librdkafka error (exit code 1).
    #[error("Kafka error: {0}")]
    Client(#[from] KafkaError),
}

/// Why the broker counts as unavailable (exit code 4).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerUnavailable {
    /// No broker answered a metadata request in time.
    #[error("no metadata from {brokers} within {timeout:?}: {source}")]
    NoMetadata {
        brokers: String,
        timeout: Duration,
        #[source]
        source: KafkaError,
    },
    /// The broker refused the connection's TLS or SASL handshake (an untrusted
    /// certificate, a wrong password, a mechanism it does not offer): retrying
    /// cannot help, the `kafka.producer` security settings must change.
    #[error(
        "{brokers} refused the connection's security ({code:?}): {reason}. Check the \
         security.protocol, ssl.* and sasl.* settings under kafka.producer; nothing was \
         produced"
    )]
    SecurityRefused {
        brokers: String,
        code: RDKafkaErrorCode,
        reason: String,
    },
    /// The cluster answered, but listed no broker.
    #[error("{brokers} answered with no brokers")]
    NoBrokers { brokers: String },
    /// The producer hit a fatal error during the start-up check (e.g. a missing
    /// `IDEMPOTENT_WRITE` permission).
    #[error("producer failed ({code:?}): {message}")]
    ProducerFailed {
        code: RDKafkaErrorCode,
        message: String,
    },
    /// A delivery report said the producer cannot continue (see
    /// `Publisher::fatal_error`).
    #[error("the producer hit a fatal error: {message}")]
    FatalReport {
        code: RDKafkaErrorCode,
        message: String,
    },
    /// The topic-creation request failed as a whole.
    #[error("cannot create topic {topic} on {brokers}: {source}")]
    CreateTopic {
        topic: String,
        brokers: String,
        #[source]
        source: KafkaError,
    },
    /// The broker refused to create the topic.
    #[error("cannot create topic {topic} on {brokers}: {code}")]
    TopicRefused {
        topic: String,
        brokers: String,
        code: RDKafkaErrorCode,
    },
}

impl From<BrokerUnavailable> for BrokerError {
    fn from(e: BrokerUnavailable) -> Self {
        BrokerError::Unavailable(Box::new(e))
    }
}

impl BrokerError {
    /// The process exit code (`docs/architecture.md#exit-codes`): 2 for a refused
    /// setting, 4 when the broker is unavailable, else 1.
    #[must_use]
    pub fn exit_code(&self) -> u8 {
        match self {
            BrokerError::UnknownPartitioner { .. }
            | BrokerError::RefusedSetting { .. }
            | BrokerError::InvalidSetting(_)
            | BrokerError::ProducerCreation(_) => 2,
            BrokerError::Unavailable(_) => 4,
            BrokerError::DeliveryThread(_) | BrokerError::CheckTask(_) | BrokerError::Client(_) => {
                1
            }
        }
    }

    /// Whether retrying can help: only a failed thread start (an I/O error, like
    /// every I/O error of the process); everything else stops the command.
    #[must_use]
    pub fn class(&self) -> ErrorClass {
        match self {
            BrokerError::DeliveryThread(_) => ErrorClass::Transient,
            _ => ErrorClass::Fatal,
        }
    }
}
