//! Kafka publishing: producer settings, the error classification table, and the
//! [`Publisher`] that turns librdkafka delivery callbacks into [`DeliveryReport`]s.
//!
//! This module only *publishes and reports*. Whether a failed event is retried,
//! backed off or poisoned is decided by the sans-IO core in [`crate::cdc::progress`]; the
//! publisher tells it, per event, "acked at partition/offset" or "failed with this
//! broker error, which is [`Failure::Permanent`] or [`Failure::Transient`]".
//!
//! # Why these producer settings ([`producer_config`])
//!
//! * **`enable.idempotence=true`, `acks=all`, `max.in.flight.requests.per.connection=5`.**
//!   `acks=all` is what "acked" means in promise 1: the record is on every in-sync
//!   replica. The idempotent producer gives every record a per-partition sequence number,
//!   so when librdkafka retries a batch after a timeout or a leader change the broker
//!   drops the duplicate and rejects anything out of sequence; with at most 5 requests in
//!   flight per connection (the limit for which brokers track sequences) a retry can
//!   never overtake a later batch. Together they keep per-partition — hence per-key —
//!   order across retries (promise 3) without the throughput cost of 1 in-flight request.
//!   Pass-through settings that would silently break this are rejected, not ignored.
//! * **`message.timeout.ms=0` (infinite).** A broker outage must never fail an event: the
//!   relay's window fills, it stops reading the WAL, and the slot holds the position
//!   until the broker is back (transient, retried forever: `docs/architecture.md#error-classes`). A finite local
//!   timeout would add nothing but risk: timed-out records come back as failures that
//!   the relay re-produces *after* later records of the same key that were still queued,
//!   which reorders them. So finite timeouts are rejected. What still fails fast, because
//!   librdkafka does not retry it: a record larger than `message.max.bytes` (rejected by
//!   `send` itself), broker-side record rejections (`MessageSizeTooLarge`,
//!   `InvalidRecord`, policy violations), an unauthorised topic, and a topic that does
//!   not exist (after `topic.metadata.propagation.max.ms`, 30 s by default;
//!   `allow.auto.create.topics` defaults to false here so a misspelt topic template
//!   fails instead of creating a topic with broker defaults).
//! * **`partitioner=murmur2_random`** (configurable as `kafka.partitioner`). librdkafka's
//!   own default is `consistent_random` (CRC32), which places keys on *different*
//!   partitions than the Java client; `murmur2_random` is the Java default partitioner,
//!   so a Java/Kotlin producer or a Kafka Streams join keyed by the same entity id agrees
//!   with us. Keys are always present (the entity id); `murmur2_random` hashes an empty
//!   key like Java does and only sends *null* keys to a random partition.
//! * **`queue.buffering.max.messages` / `.kbytes` well above the relay's window.** The
//!   relay bounds what is in flight (events and bytes); librdkafka's queue must never be
//!   the tighter bound, or back-pressure would surface as `QueueFull` errors instead of
//!   as a full window. `QueueFull` is still classified (transient) in case it happens.
//! * **`linger.ms=5`**: a few milliseconds of batching costs little latency and saves a
//!   produce request per event under load.
//!
//! # The classification table ([`error_class`], [`classify`], [`error_kind`])
//!
//! In the style of Vector's Kafka sink, one explicit `match` lists every error code we
//! have an opinion about; everything else is transient, because misclassifying a
//! transient error as permanent sends good events to `poison_outbox`, while the reverse
//! only keeps retrying (visible, and fixable without data surgery).
//!
//! | class | codes | why |
//! |---|---|---|
//! | poison ([`Failure::Permanent`]) | `MessageSizeTooLarge`, `InvalidMessageSize`, `MessageBatchTooLarge` (Java's `RECORD_LIST_TOO_LARGE`), `InvalidRecord`, `InvalidMessage` (`CORRUPT_MESSAGE`), `InvalidTimestamp`, `PolicyViolation`, `UnsupportedForMessageFormat`, `TopicAuthorizationFailed`, `UnknownTopicOrPartition`, `UnknownTopic`, `UnknownPartition`, `UnknownTopicId`, `InvalidTopic` (Java's `TopicException`) | the record or its topic is at fault: the same bytes to the same topic fail again. The core still retries up to `max_attempts`, which also covers a one-off corrupt batch on the wire and a topic created a moment later. |
//! | fatal ([`ErrorClass::Fatal`], reported as [`Failure::Transient`]) | `Fatal`, `ClusterAuthorizationFailed`, `Authentication`, `SaslAuthenticationFailed`, `UnsupportedSASLMechanism`, `IllegalSASLState`, `SSL`, `InvalidRequiredAcks`, `TransactionalIdAuthorizationFailed` | the *client* is broken, not the record. Poisoning would drain the whole outbox into the poison table, so the event is never poisoned; the shell should stop with a clear message (check [`Publisher::fatal_error`]) and a restart resumes from the slot. |
//! | transient | everything else: transport, `AllBrokersDown`, `NotLeaderForPartition`, `LeaderNotAvailable`, `RequestTimedOut`, `MessageTimedOut`, `QueueFull`, `NotEnoughReplicas(AfterAppend)`, `InvalidDifferentRecord` (*another* record in the batch was bad), `PurgeQueue`/`PurgeInflight` (shutdown), … | the broker or the network is at fault: retry forever, never poison. |
//!
//! # Why no `await` per send
//!
//! [`Publisher::send`] hands the record to librdkafka's queue and returns at once; the
//! outcome arrives later on the report channel. Awaiting each send (a `FutureProducer`
//! future per event, one at a time) caps throughput at one round trip per event and
//! allocates a oneshot per message. Here the opaque carried through librdkafka is the
//! [`EventId`] itself (a `usize`), nothing is allocated per successful message, and the
//! relay's select loop drains reports whenever they arrive, so thousands of events are in
//! flight while the WAL keeps being read.
//!
//! # Reports: exactly one per accepted send
//!
//! Every `send` either returns [`SendRejected`] (librdkafka did not take the record; no
//! report will follow) or is followed by exactly one [`DeliveryReport`] carrying its id.
//! Reports travel through a *bounded* channel whose capacity is at least the relay's
//! event window ([`report_capacity`]): at most window-many events are unresolved, each
//! has at most one outstanding send, so there are never more pending reports than slots
//! and librdkafka's delivery thread does not wait in practice. If a caller overruns the
//! window anyway, the delivery thread waits (`blocking_send`) — back-pressure, not loss.
//! At shutdown, records still queued are purged and reported as `PurgeQueue` /
//! `PurgeInflight` (transient), delivered to the channel if it has room.
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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::types::RDKafkaErrorCode;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tracing::{debug, error, info, warn};

use crate::config::ConfigError;
use crate::config::{KafkaConfig, RelayConfig};
use crate::delivery::ErrorClass;
use crate::delivery::{EventId, Failure};
use crate::error::Error;

// The delivery opaque is the EventId as a usize: lossless only where usize is 64 bits.
const _: () = assert!(usize::BITS >= u64::BITS, "EventId must fit in a usize");

/// `client.id` of the relay's producer (visible in broker logs and quotas).
pub const CLIENT_ID: &str = "outbox-relay";

/// Default `linger.ms`.
pub const DEFAULT_LINGER_MS: u32 = 5;

/// `max.in.flight.requests.per.connection`: the most for which the idempotent
/// producer still guarantees ordering.
pub const MAX_IN_FLIGHT_REQUESTS: u32 = 5;

/// The partitioners librdkafka knows (`partitioner` property).
pub const PARTITIONERS: [&str; 7] = [
    "random",
    "consistent",
    "consistent_random",
    "murmur2",
    "murmur2_random",
    "fnv1a",
    "fnv1a_random",
];

/// Slots in the report channel beyond the relay's event window.
pub const REPORT_CHANNEL_MARGIN: usize = 1024;

/// librdkafka's defaults for the producer queue, kept as floors.
const DEFAULT_QUEUE_MESSAGES: usize = 100_000;
const DEFAULT_QUEUE_KBYTES: usize = 1_048_576;
/// Allowance per queued message for key, headers and librdkafka's own overhead.
const PER_MESSAGE_OVERHEAD_BYTES: usize = 1024;
/// librdkafka's upper bound for both queue limits (`INT_MAX`).
const QUEUE_LIMIT_MAX: usize = i32::MAX as usize;

/// Capacity of the delivery-report channel for a relay window: the window plus
/// [`REPORT_CHANNEL_MARGIN`], so the delivery thread never waits for the relay.
#[must_use]
pub fn report_capacity(relay: &RelayConfig) -> usize {
    relay
        .max_in_flight_events
        .saturating_add(REPORT_CHANNEL_MARGIN)
}

/// `queue.buffering.max.messages`: twice the window, at least librdkafka's default.
fn queue_max_messages(relay: &RelayConfig) -> usize {
    relay
        .max_in_flight_events
        .saturating_mul(2)
        .saturating_add(REPORT_CHANNEL_MARGIN)
        .clamp(DEFAULT_QUEUE_MESSAGES, QUEUE_LIMIT_MAX)
}

/// `queue.buffering.max.kbytes`: twice the byte window plus a per-message allowance,
/// at least librdkafka's default (1 GiB).
fn queue_max_kbytes(relay: &RelayConfig) -> usize {
    let bytes = relay
        .max_in_flight_bytes
        .saturating_mul(2)
        .saturating_add(queue_max_messages(relay).saturating_mul(PER_MESSAGE_OVERHEAD_BYTES));
    (bytes / 1024).clamp(DEFAULT_QUEUE_KBYTES, QUEUE_LIMIT_MAX)
}

/// Builds the producer configuration: the guarantees first, then `kafka.producer`
/// pass-through settings (SASL, TLS, compression, …), which may not weaken them.
///
/// Rejected with [`ConfigError::Invalid`]: an unknown partitioner;
/// `bootstrap.servers` / `metadata.broker.list` (use `kafka.brokers`), `partitioner`
/// (use `kafka.partitioner`), `transactional.id`; `enable.idempotence` other than true;
/// `acks` other than `all`/`-1`; more than 5 in-flight requests; `retries=0`; a non-zero
/// `message.timeout.ms` / `delivery.timeout.ms` (see the module doc);
/// `delivery.report.only.error=true` (every send needs its report); queue limits below
/// the relay's window; and anything librdkafka itself refuses (unknown property, bad
/// value).
pub fn producer_config(
    kafka: &KafkaConfig,
    relay: &RelayConfig,
) -> Result<ClientConfig, ConfigError> {
    if !PARTITIONERS.contains(&kafka.partitioner.as_str()) {
        return Err(ConfigError::Invalid(format!(
            "kafka.partitioner = {:?}: expected one of {}",
            kafka.partitioner,
            PARTITIONERS.join(", ")
        )));
    }
    let min_messages = queue_max_messages(relay);
    let min_kbytes = queue_max_kbytes(relay);
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", &kafka.brokers)
        .set("client.id", CLIENT_ID)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set(
            "max.in.flight.requests.per.connection",
            MAX_IN_FLIGHT_REQUESTS.to_string(),
        )
        .set("message.timeout.ms", "0")
        .set("linger.ms", DEFAULT_LINGER_MS.to_string())
        .set("partitioner", &kafka.partitioner)
        .set("allow.auto.create.topics", "false")
        .set("queue.buffering.max.messages", min_messages.to_string())
        .set("queue.buffering.max.kbytes", min_kbytes.to_string());
    for (key, value) in &kafka.producer {
        check_override(key, value, min_messages, min_kbytes)?;
        cfg.set(key, value);
    }
    // Let librdkafka check property names and values now, so a typo is a config error
    // (exit code 2) before anything connects.
    cfg.create_native_config()
        .map_err(|e| ConfigError::Invalid(format!("kafka.producer: {e}")))?;
    Ok(cfg)
}

/// Rejects a pass-through producer setting that would break a guarantee.
fn check_override(
    key: &str,
    value: &str,
    min_messages: usize,
    min_kbytes: usize,
) -> Result<(), ConfigError> {
    let reject = |why: &str| {
        Err(ConfigError::Invalid(format!(
            "kafka.producer.\"{key}\" = {value:?}: {why}"
        )))
    };
    let v = value.trim();
    let int = v.parse::<i64>().ok();
    let int_in = |lo: i64, hi: i64| matches!(int, Some(n) if (lo..=hi).contains(&n));
    let at_least = |min: usize| int_in(i64::try_from(min).unwrap_or(i64::MAX), i64::MAX);
    let max_requests = i64::from(MAX_IN_FLIGHT_REQUESTS);
    match key {
        "bootstrap.servers" | "metadata.broker.list" => reject("set kafka.brokers instead"),
        "partitioner" => reject("set kafka.partitioner instead"),
        "transactional.id" => {
            reject("the relay is not transactional; idempotence already prevents duplicates")
        }
        "enable.idempotence" if !v.eq_ignore_ascii_case("true") => reject(
            "the idempotent producer is required: without it a retry can duplicate or reorder",
        ),
        "acks" | "request.required.acks" if !(v == "all" || v == "-1") => {
            reject("must be all (-1): an event counts as delivered only on every in-sync replica")
        }
        "max.in.flight.requests.per.connection" | "max.in.flight" if !int_in(1, max_requests) => {
            reject("must be 1..=5: more in-flight requests may reorder retried batches")
        }
        "retries" | "message.send.max.retries" if !int_in(1, i64::MAX) => {
            reject("must be > 0: transient broker errors are retried by the producer")
        }
        "message.timeout.ms" | "delivery.timeout.ms" if int != Some(0) => reject(
            "must be 0 (infinite): a broker outage must not fail events, and re-producing \
             timed-out events would reorder them",
        ),
        "delivery.report.only.error" if !v.eq_ignore_ascii_case("false") => {
            reject("every send needs a delivery report")
        }
        "queue.buffering.max.messages" if !(int == Some(0) || at_least(min_messages)) => reject(
            &format!("must be 0 (unlimited) or at least {min_messages}, above the relay's window"),
        ),
        "queue.buffering.max.kbytes" if !at_least(min_kbytes) => reject(&format!(
            "must be at least {min_kbytes}, above the relay's window"
        )),
        _ => Ok(()),
    }
}

/// The classification table: how the relay treats a broker error code. See the module
/// doc for the reasoning; the unit tests pin every row.
#[must_use]
pub fn error_class(code: RDKafkaErrorCode) -> ErrorClass {
    table(code).0
}

/// The outcome the core needs: [`Failure::Permanent`] for poison codes, else
/// [`Failure::Transient`] (fatal codes included: a broken client is not the event's fault).
#[must_use]
pub fn classify(code: RDKafkaErrorCode) -> Failure {
    match error_class(code) {
        ErrorClass::Poison => Failure::Permanent,
        ErrorClass::Transient | ErrorClass::Fatal => Failure::Transient,
    }
}

/// A stable `snake_case` name for the error, for the poison table's error column and
/// for metrics labels. Codes without an entry are `"broker_error"`.
#[must_use]
pub fn error_kind(code: RDKafkaErrorCode) -> &'static str {
    table(code).1
}

fn table(code: RDKafkaErrorCode) -> (ErrorClass, &'static str) {
    use ErrorClass::{Fatal, Poison, Transient};
    use RDKafkaErrorCode as C;
    match code {
        // --- poison: this record, or its topic, is at fault --------------------------
        C::MessageSizeTooLarge => (Poison, "message_size_too_large"),
        C::InvalidMessageSize => (Poison, "invalid_message_size"),
        C::MessageBatchTooLarge => (Poison, "record_list_too_large"),
        C::InvalidRecord => (Poison, "invalid_record"),
        C::InvalidMessage => (Poison, "corrupt_message"),
        C::InvalidTimestamp => (Poison, "invalid_timestamp"),
        C::PolicyViolation => (Poison, "policy_violation"),
        C::UnsupportedForMessageFormat => (Poison, "unsupported_for_message_format"),
        C::TopicAuthorizationFailed => (Poison, "topic_authorization_failed"),
        C::UnknownTopicOrPartition => (Poison, "unknown_topic_or_partition"),
        C::UnknownTopic => (Poison, "unknown_topic"),
        C::UnknownPartition => (Poison, "unknown_partition"),
        C::UnknownTopicId => (Poison, "unknown_topic_id"),
        C::InvalidTopic => (Poison, "invalid_topic"),
        // --- fatal: the client is broken; never poison, stop and restart -------------
        C::Fatal => (Fatal, "fatal"),
        C::ClusterAuthorizationFailed => (Fatal, "cluster_authorization_failed"),
        C::TransactionalIdAuthorizationFailed => (Fatal, "transactional_id_authorization_failed"),
        C::Authentication => (Fatal, "authentication"),
        C::SaslAuthenticationFailed => (Fatal, "sasl_authentication_failed"),
        C::UnsupportedSASLMechanism => (Fatal, "unsupported_sasl_mechanism"),
        C::IllegalSASLState => (Fatal, "illegal_sasl_state"),
        C::SSL => (Fatal, "ssl"),
        C::InvalidRequiredAcks => (Fatal, "invalid_required_acks"),
        // --- transient: the broker or the network; retried forever -------------------
        C::InvalidDifferentRecord => (Transient, "invalid_different_record"),
        C::QueueFull => (Transient, "queue_full"),
        C::MessageTimedOut => (Transient, "message_timed_out"),
        C::RequestTimedOut => (Transient, "request_timed_out"),
        C::OperationTimedOut => (Transient, "operation_timed_out"),
        C::TimedOutQueue => (Transient, "timed_out_queue"),
        C::AllBrokersDown => (Transient, "all_brokers_down"),
        C::BrokerTransportFailure => (Transient, "broker_transport_failure"),
        C::Resolve => (Transient, "resolve"),
        C::NetworkException => (Transient, "network_exception"),
        C::BrokerNotAvailable => (Transient, "broker_not_available"),
        C::LeaderNotAvailable => (Transient, "leader_not_available"),
        C::NotLeaderForPartition => (Transient, "not_leader_for_partition"),
        C::NotEnoughReplicas => (Transient, "not_enough_replicas"),
        C::NotEnoughReplicasAfterAppend => (Transient, "not_enough_replicas_after_append"),
        C::KafkaStorageError => (Transient, "kafka_storage_error"),
        C::ThrottlingQuotaExceeded => (Transient, "throttling_quota_exceeded"),
        C::OutOfOrderSequenceNumber => (Transient, "out_of_order_sequence_number"),
        C::UnknownProducerId => (Transient, "unknown_producer_id"),
        C::InvalidProducerEpoch => (Transient, "invalid_producer_epoch"),
        C::PurgeQueue => (Transient, "purge_queue"),
        C::PurgeInflight => (Transient, "purge_inflight"),
        _ => (Transient, "broker_error"),
    }
}

/// One event's outcome, sent once per accepted [`Publisher::send`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryReport {
    pub id: EventId,
    /// `Ok((partition, offset))` once acked by all in-sync replicas, else the broker
    /// error code and librdkafka's message.
    pub result: Result<(i32, i64), (RDKafkaErrorCode, String)>,
}

impl DeliveryReport {
    /// `None` when delivered, else how the core should treat the failure.
    #[must_use]
    pub fn failure(&self) -> Option<Failure> {
        self.result.as_ref().err().map(|(code, _)| classify(*code))
    }

    /// Whether the failure means the producer itself is unusable (see
    /// [`Publisher::fatal_error`]); the event is then *not* to be poisoned.
    #[must_use]
    pub fn is_fatal(&self) -> bool {
        matches!(&self.result, Err((code, _)) if error_class(*code) == ErrorClass::Fatal)
    }
}

/// A borrowed view of one Kafka record, so the caller keeps its own event struct.
#[derive(Debug, Clone, Copy)]
pub struct RecordRef<'a> {
    pub topic: &'a str,
    /// The entity id; sent as given (an empty slice is an empty key, not a null key).
    pub key: &'a [u8],
    pub payload: &'a [u8],
    /// In order; `idempotency_key` first by convention (`docs/architecture.md#the-kafka-record`).
    pub headers: &'a [(&'a str, &'a [u8])],
    /// CreateTime in milliseconds since the epoch; `None` lets librdkafka use now.
    pub timestamp_ms: Option<i64>,
}

/// librdkafka refused a record at `send` time; no delivery report will follow. Feed it
/// to the core as a delivery failure of that event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("producer rejected the record: {message}")]
pub struct SendRejected {
    pub code: RDKafkaErrorCode,
    pub failure: Failure,
    pub message: String,
}

/// State shared between the relay and librdkafka's delivery thread.
#[derive(Debug)]
struct RelayContext {
    reports: mpsc::Sender<DeliveryReport>,
    /// Set when the publisher is dropped: from then on the delivery callback never waits.
    closing: AtomicBool,
    /// Set on `AllBrokersDown`, cleared by the next successful delivery.
    broker_down: AtomicBool,
    /// A fatal or authentication error was logged (once).
    fatal_logged: AtomicBool,
    transient_errors: AtomicU64,
    dropped_reports: AtomicU64,
}

impl RelayContext {
    fn forward(&self, report: DeliveryReport) {
        let report = match self.reports.try_send(report) {
            Ok(()) => return,
            Err(TrySendError::Closed(report)) => {
                // The relay dropped its receiver: it is shutting down and will re-read
                // everything unconfirmed from the slot on the next start.
                debug!(id = %report.id, "delivery report after the receiver was dropped");
                return;
            }
            Err(TrySendError::Full(report)) => report,
        };
        // More unread reports than the channel holds: the caller sent more than the
        // window it sized the channel for. Wait for room (back-pressure, not loss) —
        // but only on librdkafka's own thread: blocking a runtime thread panics, and
        // during drop nobody may drain the channel any more.
        let may_block =
            !self.closing.load(Ordering::Acquire) && tokio::runtime::Handle::try_current().is_err();
        if may_block {
            warn!("delivery report channel full: the relay sent more than its window");
            // Fails only when the receiver is dropped meanwhile (see above).
            let _ = self.reports.blocking_send(report);
        } else {
            error!(
                id = %report.id,
                "delivery report dropped: report channel full and this thread may not wait"
            );
            self.dropped_reports.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl ClientContext for RelayContext {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        // Lifecycle events are logged by `error` below; librdkafka's own lines go one
        // level down so a broker outage is not an error storm.
        match level {
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical => {
                error!(target: "librdkafka", facility = fac, "{message}");
            }
            RDKafkaLogLevel::Error | RDKafkaLogLevel::Warning => {
                warn!(target: "librdkafka", facility = fac, "{message}");
            }
            RDKafkaLogLevel::Notice => info!(target: "librdkafka", facility = fac, "{message}"),
            RDKafkaLogLevel::Info | RDKafkaLogLevel::Debug => {
                debug!(target: "librdkafka", facility = fac, "{message}");
            }
        }
    }

    fn error(&self, err: KafkaError, reason: &str) {
        self.transient_errors.fetch_add(1, Ordering::Relaxed);
        let code = err.rdkafka_error_code();
        match code {
            Some(RDKafkaErrorCode::AllBrokersDown) => {
                if !self.broker_down.swap(true, Ordering::AcqRel) {
                    warn!(
                        reason,
                        "broker unavailable: all broker connections are down; \
                         deliveries wait (nothing is failed) until it is back"
                    );
                }
            }
            Some(c) if error_class(c) == ErrorClass::Fatal => {
                if !self.fatal_logged.swap(true, Ordering::AcqRel) {
                    error!(code = ?c, reason, "Kafka producer cannot continue");
                }
            }
            _ => debug!(code = ?code, reason, "Kafka client error (retried by librdkafka)"),
        }
    }
}

impl ProducerContext for RelayContext {
    type DeliveryOpaque = usize;

    fn delivery(&self, result: &DeliveryResult<'_>, opaque: usize) {
        let id = EventId::from_raw(opaque as u64);
        let result = match result {
            Ok(message) => {
                if self.broker_down.load(Ordering::Relaxed)
                    && self.broker_down.swap(false, Ordering::AcqRel)
                {
                    info!("broker recovered: deliveries resumed");
                }
                Ok((message.partition(), message.offset()))
            }
            Err((err, _message)) => {
                let code = err.rdkafka_error_code().unwrap_or(RDKafkaErrorCode::Fail);
                if classify(code) == Failure::Transient {
                    self.transient_errors.fetch_add(1, Ordering::Relaxed);
                }
                Err((code, err.to_string()))
            }
        };
        self.forward(DeliveryReport { id, result });
    }
}

/// The relay's producer: non-blocking [`send`](Publisher::send), outcomes on the
/// report channel returned by [`Publisher::new`].
pub struct Publisher {
    producer: Arc<BaseProducer<RelayContext>>,
    stop: Arc<AtomicBool>,
    poller: Option<JoinHandle<()>>,
    brokers: String,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("brokers", &self.brokers)
            .field("in_flight", &self.in_flight())
            .field("transient_errors", &self.transient_errors())
            .finish_non_exhaustive()
    }
}

/// How often the delivery thread wakes up to check for shutdown when idle (reports
/// are handled as soon as they arrive, not on this tick).
const POLL_INTERVAL: Duration = Duration::from_millis(100);

impl Publisher {
    /// Creates the producer and its delivery thread. `report_capacity` sizes the
    /// bounded report channel; use [`report_capacity`] (the window plus a margin).
    ///
    /// Fails with [`Error::Config`] when librdkafka refuses the configuration.
    pub fn new(
        cfg: ClientConfig,
        report_capacity: usize,
    ) -> Result<(Publisher, mpsc::Receiver<DeliveryReport>), Error> {
        let (tx, rx) = mpsc::channel(report_capacity.max(1));
        let context = RelayContext {
            reports: tx,
            closing: AtomicBool::new(false),
            broker_down: AtomicBool::new(false),
            fatal_logged: AtomicBool::new(false),
            transient_errors: AtomicU64::new(0),
            dropped_reports: AtomicU64::new(0),
        };
        let producer: BaseProducer<RelayContext> =
            cfg.create_with_context(context).map_err(|e| match e {
                KafkaError::ClientCreation(message) => Error::Config(ConfigError::Invalid(
                    format!("Kafka producer configuration: {message}"),
                )),
                other => Error::Kafka(other),
            })?;
        let producer = Arc::new(producer);
        let stop = Arc::new(AtomicBool::new(false));
        let poller = {
            let producer = Arc::clone(&producer);
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("kafka-delivery".into())
                .spawn(move || {
                    while !stop.load(Ordering::Acquire) {
                        producer.poll(POLL_INTERVAL);
                    }
                })?
        };
        let brokers = cfg.get("bootstrap.servers").unwrap_or_default().to_owned();
        Ok((
            Publisher {
                producer,
                stop,
                poller: Some(poller),
                brokers,
            },
            rx,
        ))
    }

    /// Checks that the brokers answer a metadata request within `timeout` (at start-up,
    /// before reading the WAL). Runs on a blocking thread.
    ///
    /// Fails with [`Error::BrokerUnavailable`] (exit code 4) when no broker answers, when
    /// authentication fails, or when the producer hit a fatal error (e.g. missing
    /// `IDEMPOTENT_WRITE` permission).
    pub async fn check_broker(&self, timeout: Duration) -> Result<(), Error> {
        let producer = Arc::clone(&self.producer);
        let brokers = self.brokers.clone();
        tokio::task::spawn_blocking(move || {
            let metadata = producer
                .client()
                .fetch_metadata(None, timeout)
                .map_err(|e| {
                    Error::BrokerUnavailable(format!(
                        "no metadata from {brokers} within {timeout:?}: {e}"
                    ))
                })?;
            if metadata.brokers().is_empty() {
                return Err(Error::BrokerUnavailable(format!(
                    "{brokers} answered with no brokers"
                )));
            }
            if let Some((code, message)) = producer.client().fatal_error() {
                return Err(Error::BrokerUnavailable(format!(
                    "producer failed ({code:?}): {message}"
                )));
            }
            Ok(())
        })
        .await
        .map_err(|e| Error::Other(format!("broker check task failed: {e}")))?
    }

    /// Queues the record of an outbox event (the record contract of `docs/architecture.md#the-kafka-record`,
    /// shared by the relay, the poller and `replay`); see [`Publisher::send`].
    pub fn send_event(
        &self,
        id: EventId,
        event: &crate::outbox::OutboxEvent,
    ) -> Result<(), SendRejected> {
        let headers: Vec<(&str, &[u8])> = event
            .headers
            .iter()
            .map(|(name, value)| (name.as_ref(), value.as_ref()))
            .collect();
        self.send(
            id,
            RecordRef {
                topic: &event.topic,
                key: &event.key,
                payload: &event.payload,
                headers: &headers,
                timestamp_ms: event.timestamp_ms,
            },
        )
    }

    /// Queues one record for `id`; never waits for the broker. `Ok` means exactly one
    /// [`DeliveryReport`] for `id` will follow; `Err` means none will.
    pub fn send(&self, id: EventId, rec: RecordRef<'_>) -> Result<(), SendRejected> {
        let mut headers = OwnedHeaders::new_with_capacity(rec.headers.len());
        for &(key, value) in rec.headers {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        let mut record: BaseRecord<'_, [u8], [u8], usize> =
            BaseRecord::with_opaque_to(rec.topic, id.get() as usize)
                .key(rec.key)
                .payload(rec.payload)
                .headers(headers);
        if let Some(ts) = rec.timestamp_ms {
            record = record.timestamp(ts);
        }
        self.producer.send(record).map_err(|(err, _record)| {
            let code = match &err {
                // A NUL byte in the topic name never reaches librdkafka.
                KafkaError::Nul(_) => RDKafkaErrorCode::InvalidTopic,
                other => other.rdkafka_error_code().unwrap_or(RDKafkaErrorCode::Fail),
            };
            let failure = classify(code);
            if failure == Failure::Transient {
                self.producer
                    .context()
                    .transient_errors
                    .fetch_add(1, Ordering::Relaxed);
            }
            SendRejected {
                code,
                failure,
                message: format!("{err} (topic {:?})", rec.topic),
            }
        })
    }

    /// Waits until every queued record has been reported, for a graceful shutdown.
    /// Never polls librdkafka on the calling task; the reports land on the channel
    /// (which has room for all of them when the window was respected).
    ///
    /// Fails with a `Flush` error when records are still in flight after `timeout`.
    pub async fn flush(&self, timeout: Duration) -> Result<(), Error> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(1);
        loop {
            // A zero timeout makes librdkafka send lingering batches now and return.
            match self.producer.flush(Duration::ZERO) {
                Ok(()) => return Ok(()),
                Err(KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut)) => {}
                Err(other) => return Err(Error::Kafka(other)),
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Kafka(KafkaError::Flush(
                    RDKafkaErrorCode::OperationTimedOut,
                )));
            }
            tokio::time::sleep(pause.min(deadline - now)).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Records handed to librdkafka and not yet reported (its queue length).
    #[must_use]
    pub fn in_flight(&self) -> i32 {
        self.producer.in_flight_count()
    }

    /// Transient errors seen so far (client errors and transient delivery failures).
    #[must_use]
    pub fn transient_errors(&self) -> u64 {
        self.producer
            .context()
            .transient_errors
            .load(Ordering::Relaxed)
    }

    /// Reports dropped because the channel was full where waiting was not allowed
    /// (at shutdown, or on a runtime thread): zero unless the window was overrun.
    #[must_use]
    pub fn dropped_reports(&self) -> u64 {
        self.producer
            .context()
            .dropped_reports
            .load(Ordering::Relaxed)
    }

    /// The producer's fatal error, if it hit one (e.g. an idempotence sequence that
    /// cannot be recovered, or `ClusterAuthorizationFailed`). After that every send
    /// and report fails with [`RDKafkaErrorCode::Fatal`]: the shell should exit and
    /// let a restart resume from the slot.
    #[must_use]
    pub fn fatal_error(&self) -> Option<(RDKafkaErrorCode, String)> {
        self.producer.client().fatal_error()
    }
}

impl Drop for Publisher {
    /// Purges what is still queued (reported as `PurgeQueue` / `PurgeInflight` if the
    /// channel has room) and stops the delivery thread. Call [`Publisher::flush`] first
    /// for a graceful shutdown.
    fn drop(&mut self) {
        let context = self.producer.context();
        context.closing.store(true, Ordering::Release);
        self.stop.store(true, Ordering::Release);
        if let Some(poller) = self.poller.take() {
            // A delivery thread waiting in `blocking_send` has a full channel; it ends
            // when the receiver is drained or dropped, so do not wait for it then.
            if context.reports.capacity() > 0 || context.reports.is_closed() {
                let _ = poller.join();
            }
        }
        // The producer itself is dropped with the last `Arc` (here, or on the delivery
        // thread if it was still waiting): librdkafka's drop purges queued and in-flight
        // records and serves their reports; with `closing` set, the callback never waits.
    }
}

/// Creates a topic (Tansu and many production brokers never auto-create); an
/// existing topic is fine. Used by `demo --brokers` and `bench`.
pub async fn create_topic(brokers: &str, name: &str, partitions: i32) -> Result<(), Error> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::types::RDKafkaErrorCode;
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results = admin.create_topics([&topic], &opts).await.map_err(|e| {
        Error::BrokerUnavailable(format!("cannot create topic {name} on {brokers}: {e}"))
    })?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(Error::BrokerUnavailable(format!(
                    "cannot create topic {topic} on {brokers}: {code}"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

    fn kafka(producer: &[(&str, &str)]) -> KafkaConfig {
        // Through serde, so fields added to `KafkaConfig` later keep their defaults.
        let mut table = toml::Table::new();
        table.insert("brokers".into(), "k1:9092,k2:9092".into());
        let producer: toml::Table = producer
            .iter()
            .map(|(k, v)| ((*k).to_owned(), toml::Value::from(*v)))
            .collect();
        table.insert("producer".into(), producer.into());
        table.try_into().unwrap()
    }

    fn build(producer: &[(&str, &str)]) -> Result<ClientConfig, ConfigError> {
        producer_config(&kafka(producer), &RelayConfig::default())
    }

    fn rejected(producer: &[(&str, &str)]) -> String {
        match build(producer) {
            Ok(_) => panic!("{producer:?} was accepted"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn defaults_carry_the_guarantees() {
        let cfg = build(&[]).unwrap();
        let expect = [
            ("bootstrap.servers", "k1:9092,k2:9092"),
            ("client.id", "outbox-relay"),
            ("enable.idempotence", "true"),
            ("acks", "all"),
            ("max.in.flight.requests.per.connection", "5"),
            ("message.timeout.ms", "0"),
            ("linger.ms", "5"),
            ("partitioner", "murmur2_random"),
            ("allow.auto.create.topics", "false"),
        ];
        for (key, value) in expect {
            assert_eq!(cfg.get(key), Some(value), "{key}");
        }
    }

    #[test]
    fn queue_limits_exceed_the_window() {
        let relay = RelayConfig {
            max_in_flight_events: 400_000,
            max_in_flight_bytes: 4 << 30,
            ..RelayConfig::default()
        };
        let cfg = producer_config(&kafka(&[]), &relay).unwrap();
        let messages: usize = cfg
            .get("queue.buffering.max.messages")
            .unwrap()
            .parse()
            .unwrap();
        let kbytes: usize = cfg
            .get("queue.buffering.max.kbytes")
            .unwrap()
            .parse()
            .unwrap();
        assert!(messages >= 2 * relay.max_in_flight_events, "{messages}");
        assert!(kbytes * 1024 >= 2 * relay.max_in_flight_bytes, "{kbytes}");
        assert!(report_capacity(&relay) > relay.max_in_flight_events);
        // Defaults keep librdkafka's own (larger) floors.
        let cfg = build(&[]).unwrap();
        assert_eq!(cfg.get("queue.buffering.max.messages"), Some("100000"));
        assert_eq!(cfg.get("queue.buffering.max.kbytes"), Some("1048576"));
        // Huge windows are clamped to what librdkafka accepts.
        let huge = RelayConfig {
            max_in_flight_events: usize::MAX / 2,
            max_in_flight_bytes: usize::MAX / 2,
            ..RelayConfig::default()
        };
        producer_config(&kafka(&[]), &huge).unwrap();
    }

    #[test]
    fn pass_through_settings_apply_after_defaults() {
        let cfg = build(&[
            ("linger.ms", "20"),
            ("compression.type", "lz4"),
            ("client.id", "relay-eu-1"),
            ("acks", "-1"),
            ("enable.idempotence", "true"),
            ("max.in.flight.requests.per.connection", "1"),
            ("retries", "10"),
            ("message.timeout.ms", "0"),
            ("allow.auto.create.topics", "true"),
            ("queue.buffering.max.messages", "0"),
            ("topic.metadata.propagation.max.ms", "100"),
        ])
        .unwrap();
        assert_eq!(cfg.get("linger.ms"), Some("20"));
        assert_eq!(cfg.get("compression.type"), Some("lz4"));
        assert_eq!(cfg.get("client.id"), Some("relay-eu-1"));
        assert_eq!(cfg.get("max.in.flight.requests.per.connection"), Some("1"));
    }

    #[test]
    fn settings_that_break_guarantees_are_rejected() {
        let cases: &[(&str, &str, &str)] = &[
            ("enable.idempotence", "false", "idempotent"),
            ("acks", "1", "all"),
            ("request.required.acks", "0", "all"),
            ("max.in.flight.requests.per.connection", "6", "1..=5"),
            ("max.in.flight", "0", "1..=5"),
            ("retries", "0", "> 0"),
            ("message.send.max.retries", "0", "> 0"),
            ("bootstrap.servers", "other:9092", "kafka.brokers"),
            ("metadata.broker.list", "other:9092", "kafka.brokers"),
            ("transactional.id", "relay", "not transactional"),
            ("partitioner", "random", "kafka.partitioner"),
            ("message.timeout.ms", "30000", "infinite"),
            ("delivery.timeout.ms", "120000", "infinite"),
            ("delivery.report.only.error", "true", "report"),
            ("queue.buffering.max.messages", "1000", "window"),
            ("queue.buffering.max.kbytes", "1024", "window"),
        ];
        for (key, value, hint) in cases {
            let message = rejected(&[(key, value)]);
            assert!(message.contains(key), "{message}");
            assert!(message.contains(hint), "{key}: {message}");
        }
    }

    #[test]
    fn librdkafka_checks_names_and_values() {
        assert!(rejected(&[("linger.msec", "5")]).contains("linger.msec"));
        assert!(rejected(&[("compression.type", "brotli")]).contains("compression.type"));
    }

    #[test]
    fn partitioner_is_validated() {
        for p in PARTITIONERS {
            let mut k = kafka(&[]);
            k.partitioner = p.into();
            let cfg = producer_config(&k, &RelayConfig::default()).unwrap();
            assert_eq!(cfg.get("partitioner"), Some(p));
        }
        let mut k = kafka(&[]);
        k.partitioner = "murmur3".into();
        let err = producer_config(&k, &RelayConfig::default()).unwrap_err();
        assert!(err.to_string().contains("murmur2_random"), "{err}");
    }

    #[test]
    fn classification_table() {
        use RDKafkaErrorCode as C;
        let poison = [
            C::MessageSizeTooLarge,
            C::InvalidMessageSize,
            C::MessageBatchTooLarge,
            C::InvalidRecord,
            C::InvalidMessage,
            C::InvalidTimestamp,
            C::PolicyViolation,
            C::UnsupportedForMessageFormat,
            C::TopicAuthorizationFailed,
            C::UnknownTopicOrPartition,
            C::UnknownTopic,
            C::UnknownPartition,
            C::UnknownTopicId,
            C::InvalidTopic,
        ];
        let fatal = [
            C::Fatal,
            C::ClusterAuthorizationFailed,
            C::TransactionalIdAuthorizationFailed,
            C::Authentication,
            C::SaslAuthenticationFailed,
            C::UnsupportedSASLMechanism,
            C::IllegalSASLState,
            C::SSL,
            C::InvalidRequiredAcks,
        ];
        let transient = [
            C::InvalidDifferentRecord,
            C::QueueFull,
            C::MessageTimedOut,
            C::RequestTimedOut,
            C::OperationTimedOut,
            C::TimedOutQueue,
            C::AllBrokersDown,
            C::BrokerTransportFailure,
            C::Resolve,
            C::NetworkException,
            C::BrokerNotAvailable,
            C::LeaderNotAvailable,
            C::NotLeaderForPartition,
            C::NotEnoughReplicas,
            C::NotEnoughReplicasAfterAppend,
            C::KafkaStorageError,
            C::ThrottlingQuotaExceeded,
            C::OutOfOrderSequenceNumber,
            C::UnknownProducerId,
            C::InvalidProducerEpoch,
            C::PurgeQueue,
            C::PurgeInflight,
        ];
        for code in poison {
            assert_eq!(error_class(code), ErrorClass::Poison, "{code:?}");
            assert_eq!(classify(code), Failure::Permanent, "{code:?}");
        }
        for code in fatal {
            assert_eq!(error_class(code), ErrorClass::Fatal, "{code:?}");
            assert_eq!(
                classify(code),
                Failure::Transient,
                "{code:?} is never poisoned"
            );
        }
        for code in transient {
            assert_eq!(error_class(code), ErrorClass::Transient, "{code:?}");
            assert_eq!(classify(code), Failure::Transient, "{code:?}");
        }
        // Every listed code has its own stable name; the rest share one.
        let mut names = std::collections::BTreeSet::new();
        for code in poison.iter().chain(&fatal).chain(&transient) {
            let kind = error_kind(*code);
            assert_ne!(kind, "broker_error", "{code:?}");
            assert!(
                kind.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{kind}"
            );
            assert!(names.insert(kind), "duplicate kind {kind}");
        }
        assert_eq!(error_kind(C::OffsetOutOfRange), "broker_error");
        assert_eq!(classify(C::Unknown), Failure::Transient);
        assert_eq!(classify(C::Fail), Failure::Transient);
    }

    #[test]
    fn report_helpers() {
        let ok = DeliveryReport {
            id: EventId::from_raw(1),
            result: Ok((0, 7)),
        };
        assert_eq!(ok.failure(), None);
        assert!(!ok.is_fatal());
        let big = DeliveryReport {
            id: EventId::from_raw(2),
            result: Err((RDKafkaErrorCode::MessageSizeTooLarge, "too large".into())),
        };
        assert_eq!(big.failure(), Some(Failure::Permanent));
        let fatal = DeliveryReport {
            id: EventId::from_raw(3),
            result: Err((RDKafkaErrorCode::Fatal, "fatal".into())),
        };
        assert_eq!(fatal.failure(), Some(Failure::Transient));
        assert!(fatal.is_fatal());
    }

    // --- against librdkafka's in-process mock cluster --------------------------------

    fn mock_publisher(
        cluster: &MockCluster<'_, rdkafka::producer::DefaultProducerContext>,
        extra: &[(&str, &str)],
    ) -> (Publisher, mpsc::Receiver<DeliveryReport>) {
        let mut k = kafka(extra);
        k.brokers = cluster.bootstrap_servers();
        let cfg = producer_config(&k, &RelayConfig::default()).unwrap();
        Publisher::new(cfg, 64).unwrap()
    }

    fn record<'a>(topic: &'a str, key: &'a [u8], payload: &'a [u8]) -> RecordRef<'a> {
        RecordRef {
            topic,
            key,
            payload,
            headers: &[("idempotency_key", b"k-1"), ("event_type", b"Created")],
            timestamp_ms: Some(1_700_000_000_000),
        }
    }

    async fn next(rx: &mut mpsc::Receiver<DeliveryReport>) -> DeliveryReport {
        tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .expect("a delivery report in time")
            .expect("channel open")
    }

    #[tokio::test]
    async fn mock_sends_report_each_id_once() {
        let cluster = MockCluster::new(3).unwrap();
        cluster.create_topic("orders", 3, 1).unwrap();
        let (publisher, mut rx) = mock_publisher(&cluster, &[]);
        publisher
            .check_broker(Duration::from_secs(10))
            .await
            .unwrap();
        // Ids near the top of the range survive the trip through the opaque pointer.
        let first = u64::MAX - 199;
        for i in 0..200u64 {
            let key = format!("order-{}", i % 7);
            publisher
                .send(
                    EventId::from_raw(first + i),
                    record("orders", key.as_bytes(), b"{}"),
                )
                .unwrap();
        }
        let mut seen = std::collections::BTreeSet::new();
        let mut offsets = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let report = next(&mut rx).await;
            let (partition, offset) = report.result.clone().unwrap();
            assert!(report.id.get() >= first, "{report:?}");
            assert!(seen.insert(report.id), "{report:?} twice");
            assert!(offsets.insert((partition, offset)), "{report:?}");
        }
        publisher.flush(Duration::from_secs(5)).await.unwrap();
        assert_eq!(publisher.in_flight(), 0);
        assert!(rx.try_recv().is_err(), "no extra reports");
    }

    #[tokio::test]
    async fn mock_broker_rejection_is_permanent() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("big", 1, 1).unwrap();
        let (publisher, mut rx) = mock_publisher(&cluster, &[]);
        cluster.request_errors(
            RDKafkaApiKey::Produce,
            &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
        );
        publisher
            .send(EventId::from_raw(42), record("big", b"k", b"payload"))
            .unwrap();
        let report = next(&mut rx).await;
        assert_eq!(report.id, EventId::from_raw(42));
        let (code, _) = report.result.clone().unwrap_err();
        assert_eq!(code, RDKafkaErrorCode::MessageSizeTooLarge);
        assert_eq!(report.failure(), Some(Failure::Permanent));
    }

    #[tokio::test]
    async fn mock_oversized_record_is_rejected_at_send() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("big", 1, 1).unwrap();
        let (publisher, mut rx) = mock_publisher(&cluster, &[]);
        let payload = vec![b'x'; 2 * 1024 * 1024];
        let err = publisher
            .send(EventId::from_raw(1), record("big", b"k", &payload))
            .unwrap_err();
        assert_eq!(err.code, RDKafkaErrorCode::MessageSizeTooLarge);
        assert_eq!(err.failure, Failure::Permanent);
        publisher.flush(Duration::from_secs(1)).await.unwrap();
        assert!(rx.try_recv().is_err(), "a rejected send has no report");
    }

    #[tokio::test]
    async fn mock_outage_delays_but_does_not_fail() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("orders", 1, 1).unwrap();
        let (publisher, mut rx) = mock_publisher(&cluster, &[]);
        publisher
            .send(EventId::from_raw(1), record("orders", b"a", b"1"))
            .unwrap();
        assert!(next(&mut rx).await.result.is_ok());
        cluster.broker_down(1).unwrap();
        publisher
            .send(EventId::from_raw(2), record("orders", b"a", b"2"))
            .unwrap();
        let waited = tokio::time::timeout(Duration::from_secs(2), rx.recv()).await;
        assert!(
            waited.is_err(),
            "no report while the broker is down: {waited:?}"
        );
        cluster.broker_up(1).unwrap();
        let report = next(&mut rx).await;
        assert_eq!(report.id, EventId::from_raw(2));
        assert!(report.result.is_ok(), "{report:?}");
        assert!(publisher.transient_errors() > 0, "the outage was counted");
    }

    #[tokio::test]
    async fn mock_missing_topic_is_permanent() {
        let cluster = MockCluster::new(1).unwrap();
        let (publisher, mut rx) =
            mock_publisher(&cluster, &[("topic.metadata.propagation.max.ms", "500")]);
        publisher
            .send(EventId::from_raw(5), record("no_such_topic", b"k", b"{}"))
            .unwrap();
        let report = next(&mut rx).await;
        assert_eq!(report.id, EventId::from_raw(5));
        let (code, _) = report.result.clone().unwrap_err();
        assert!(
            matches!(
                code,
                RDKafkaErrorCode::UnknownTopic | RDKafkaErrorCode::UnknownTopicOrPartition
            ),
            "{code:?}"
        );
        assert_eq!(report.failure(), Some(Failure::Permanent));
    }

    #[tokio::test]
    async fn mock_drop_purges_with_transient_reports() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("orders", 1, 1).unwrap();
        let (publisher, mut rx) = mock_publisher(&cluster, &[]);
        cluster.broker_down(1).unwrap();
        publisher
            .send(EventId::from_raw(9), record("orders", b"a", b"1"))
            .unwrap();
        drop(publisher);
        let report = next(&mut rx).await;
        assert_eq!(report.id, EventId::from_raw(9));
        let (code, _) = report.result.clone().unwrap_err();
        assert!(
            matches!(
                code,
                RDKafkaErrorCode::PurgeQueue | RDKafkaErrorCode::PurgeInflight
            ),
            "{code:?}"
        );
        assert_eq!(report.failure(), Some(Failure::Transient));
    }
}
