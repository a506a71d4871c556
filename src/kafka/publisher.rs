//! The relay's producer: [`Publisher`] turns librdkafka's delivery callbacks into one
//! [`DeliveryReport`] per accepted send, on a bounded channel the relay's select loop
//! drains.
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
//! event window ([`report_capacity`](super::report_capacity)): at most window-many events are unresolved, each
//! has at most one outstanding send, so there are never more pending reports than slots
//! and librdkafka's delivery thread does not wait in practice. If a caller overruns the
//! window anyway, the delivery thread waits (`blocking_send`) — back-pressure, not loss.
//! At shutdown, records still queued are purged and reported as `PurgeQueue` /
//! `PurgeInflight` (transient), delivered to the channel if it has room.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer, ProducerContext};
use rdkafka::types::RDKafkaErrorCode;
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tracing::{debug, error, info, warn};

use crate::delivery::{ErrorClass, EventId, Failure};
use crate::lifecycle::Backoff;

use super::classify::{classify, error_class};
use super::error::{BrokerError, BrokerUnavailable};
use super::idle_flush::IdleFlush;

// The delivery opaque is the EventId as a usize: lossless only where usize is 64 bits.
const _: () = assert!(usize::BITS >= u64::BITS, "EventId must fit in a usize");

/// One event's outcome, sent once per accepted [`Publisher::send`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryReport {
    pub id: EventId,
    /// `Ok((partition, offset))` once acked by all in-sync replicas, else the broker
    /// error code and librdkafka's message.
    pub result: Result<(i32, i64), (RDKafkaErrorCode, String)>,
    /// When librdkafka reported it (on its delivery-report thread): the broker's
    /// answer, which the relay may handle later (after a read pause,
    /// `relay.read_pause_ms`).
    pub reported_at: Instant,
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
    pub(crate) fn is_fatal(&self) -> bool {
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
pub(super) struct RelayContext {
    reports: mpsc::Sender<DeliveryReport>,
    /// Set when the publisher is dropped: from then on the delivery callback never waits.
    closing: AtomicBool,
    /// Set on `AllBrokersDown`, cleared by the next successful delivery.
    broker_down: AtomicBool,
    /// A fatal or authentication error was logged (once).
    fatal_logged: AtomicBool,
    /// The broker refused the connection's security (TLS or SASL): how often, and
    /// the latest code and reason, for [`Publisher::check_broker`].
    security_refusals: AtomicU64,
    last_security_refusal: Mutex<Option<(RDKafkaErrorCode, String)>>,
    transient_errors: AtomicU64,
    dropped_reports: AtomicU64,
    /// Totals of librdkafka's last statistics, to turn them into counter increments.
    traffic: Mutex<Traffic>,
}

/// Produce requests sent and records transmitted, from librdkafka's statistics
/// (`statistics.interval.ms`, set by [`producer_config`](super::producer_config)).
///
/// # Why from the statistics
///
/// How many records a produce request carries is what the broker's cost per event
/// follows: librdkafka sends one partition per request, so at a steady few thousand
/// events per second it easily sends one request per record, and the broker then
/// spends more per event than the relay does. Only librdkafka knows how many requests
/// it sent; its statistics count them per broker (`brokers.*.req.Produce`, counted
/// when a request is sent) next to the records written into requests (`txmsgs`).
///
/// What is exported is the growth since the previous report, per broker: a broker
/// librdkafka forgets (one missing from a metadata response, since librdkafka 2.10)
/// takes its count with it, which must not make the others' growth look negative,
/// and a replaced producer starts again from zero while the counters keep growing.
///
/// Only the fields used are parsed: the full report has a block per partition and
/// arrives on the delivery-report thread once a second.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Traffic {
    /// `Produce` requests per broker name.
    produce_requests: HashMap<String, u64>,
    records: u64,
}

/// The part of librdkafka's statistics JSON [`Traffic`] reads.
#[derive(Debug, Deserialize)]
struct StatisticsReport {
    #[serde(default)]
    txmsgs: u64,
    #[serde(default)]
    brokers: HashMap<String, BrokerReport>,
}

#[derive(Debug, Deserialize)]
struct BrokerReport {
    #[serde(default)]
    req: HashMap<String, u64>,
}

/// Requests sent and records transmitted between two reports.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct TrafficGrowth {
    produce_requests: u64,
    records: u64,
}

impl Traffic {
    /// The totals a statistics report gives; `None` when it is not librdkafka's JSON.
    fn of(json: &[u8]) -> Option<Traffic> {
        let report: StatisticsReport = serde_json::from_slice(json).ok()?;
        Some(Traffic {
            produce_requests: report
                .brokers
                .into_iter()
                .map(|(name, b)| (name, b.req.get("Produce").copied().unwrap_or(0)))
                .collect(),
            records: report.txmsgs,
        })
    }

    /// What grew from `earlier` to `self`: per broker, and a broker new since then
    /// counts from zero.
    fn since(&self, earlier: &Traffic) -> TrafficGrowth {
        let produce_requests = self
            .produce_requests
            .iter()
            .map(|(name, &now)| {
                now.saturating_sub(earlier.produce_requests.get(name).copied().unwrap_or(0))
            })
            .sum();
        TrafficGrowth {
            produce_requests,
            records: self.records.saturating_sub(earlier.records),
        }
    }
}

/// Produce requests the relay's producers sent (librdkafka statistics).
pub(crate) const PRODUCE_REQUESTS: &str = "outbox_relay_kafka_produce_requests_total";
/// Records those requests carried (librdkafka's `txmsgs`).
pub(crate) const RECORDS_TRANSMITTED: &str = "outbox_relay_kafka_records_transmitted_total";

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
    fn stats_raw(&self, statistics: &[u8]) {
        let Some(now) = Traffic::of(statistics) else {
            debug!("librdkafka statistics that are not the expected JSON");
            return;
        };
        let Ok(mut last) = self.traffic.lock() else {
            return;
        };
        let grown = now.since(&last);
        *last = now;
        drop(last);
        metrics::counter!(PRODUCE_REQUESTS).increment(grown.produce_requests);
        metrics::counter!(RECORDS_TRANSMITTED).increment(grown.records);
    }

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
        if let Some(c) = code.filter(|c| is_security_refusal(*c)) {
            self.security_refusals.fetch_add(1, Ordering::AcqRel);
            if let Ok(mut last) = self.last_security_refusal.lock() {
                *last = Some((c, reason.to_owned()));
            }
        }
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
        let id = id_of_opaque(opaque);
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
        self.forward(DeliveryReport {
            id,
            result,
            reported_at: Instant::now(),
        });
    }
}

/// The relay's producer: non-blocking [`send`](Publisher::send), outcomes on the
/// report channel returned by [`Publisher::new`].
pub struct Publisher {
    producer: Arc<BaseProducer<RelayContext>>,
    stop: Arc<AtomicBool>,
    poller: Option<JoinHandle<()>>,
    brokers: String,
    /// `relay.on_config_error = "poison"`: configuration failures are permanent.
    poison_configuration_errors: bool,
    /// The producer's `message.max.bytes`: a larger record is refused at send.
    max_message_bytes: usize,
    /// Whether the producer compresses its batches ([`super::compresses`]).
    compresses: bool,
    /// Sends lingering records at once when the relay's stream goes idle
    /// (`relay.flush_when_idle`); see [`Publisher::stream_idle`].
    idle_flush: Option<IdleFlush>,
    /// The settings it was made with (for [`Publisher::alone`]).
    config: ClientConfig,
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

/// librdkafka's default `message.max.bytes`.
const LIBRDKAFKA_MESSAGE_MAX_BYTES: usize = 1_000_000;

/// How often the delivery thread wakes up to check for shutdown when idle (reports
/// are handled as soon as they arrive, not on this tick).
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// How often [`Publisher::flush`] looks at the queue: soon at first, then every 50 ms.
const FLUSH_CHECK_INITIAL: Duration = Duration::from_millis(1);
const FLUSH_CHECK_MAX: Duration = Duration::from_millis(50);

/// How long one metadata request of [`Publisher::check_broker`] may take before the
/// check looks again for a refused handshake.
const CHECK_SLICE: Duration = Duration::from_millis(250);

/// How long metadata may still come after the first refused handshake before the
/// check gives up: one refusal could be a connection that broke during the
/// handshake, and librdkafka reconnects within `reconnect.backoff.ms` (100 ms at
/// first). It reports identical errors only once per 30 s, so the check cannot
/// wait for a second one.
const REFUSAL_GRACE: Duration = Duration::from_secs(1);

/// Errors that mean the broker refused the connection's security — TLS
/// (`SSL`: handshake, certificate verification) or SASL (`Authentication`: a wrong
/// password, an unknown user, a mechanism the broker does not offer) — rather than
/// being down. Retrying does not help; the configuration must change.
fn is_security_refusal(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::SSL
            | C::Authentication
            | C::SaslAuthenticationFailed
            | C::UnsupportedSASLMechanism
            | C::IllegalSASLState
    )
}

/// Asks for metadata in short slices until `timeout`; between slices, a broker
/// that keeps refusing the handshake ends the wait with its reason.
fn fetch_metadata_or_refusal(
    producer: &BaseProducer<RelayContext>,
    brokers: &str,
    timeout: Duration,
) -> Result<rdkafka::metadata::Metadata, BrokerError> {
    let context = producer.context();
    let refused = || {
        let (code, reason) = context.last_security_refusal.lock().ok()?.clone()?;
        Some(BrokerUnavailable::SecurityRefused {
            brokers: brokers.to_owned(),
            code,
            reason,
        })
    };
    let deadline = Instant::now() + timeout;
    let mut first_refusal: Option<Instant> = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match producer
            .client()
            .fetch_metadata(None, left.min(CHECK_SLICE))
        {
            Ok(metadata) => return Ok(metadata),
            Err(source) => {
                if context.security_refusals.load(Ordering::Acquire) > 0 {
                    first_refusal.get_or_insert_with(Instant::now);
                }
                let out_of_time = Instant::now() >= deadline;
                let refused_for_real =
                    first_refusal.is_some_and(|at| out_of_time || at.elapsed() >= REFUSAL_GRACE);
                if refused_for_real && let Some(refusal) = refused() {
                    return Err(refusal.into());
                }
                if out_of_time {
                    return Err(BrokerUnavailable::NoMetadata {
                        brokers: brokers.to_owned(),
                        timeout,
                        source,
                    }
                    .into());
                }
            }
        }
    }
}

/// Hands `send` the record of an outbox event (the record contract of
/// `docs/architecture.md#the-kafka-record`): its topic, key, payload, headers and
/// timestamp, borrowed.
pub(crate) fn with_event_record<R>(
    event: &crate::outbox::OutboxEvent,
    send: impl FnOnce(RecordRef<'_>) -> R,
) -> R {
    let headers: Vec<(&str, &[u8])> = event
        .headers
        .iter()
        .map(|(name, value)| (name.as_ref(), value.as_ref()))
        .collect();
    send(RecordRef {
        topic: &event.topic,
        key: &event.key,
        payload: &event.payload,
        headers: &headers,
        timestamp_ms: event.timestamp_ms,
    })
}

/// The delivery opaque of an event: its id as a `usize`.
// Lossless: the assertion at the top of this file rejects targets where usize is
// narrower than the u64 an EventId holds.
#[allow(clippy::cast_possible_truncation)]
fn opaque_of(id: EventId) -> usize {
    id.get() as usize
}

/// The event id a delivery opaque carries (see [`opaque_of`]).
fn id_of_opaque(opaque: usize) -> EventId {
    EventId::from_raw(opaque as u64)
}

impl Publisher {
    /// Creates the producer and its delivery thread. `report_capacity` sizes the
    /// bounded report channel; use [`report_capacity`](super::report_capacity) (the window plus a margin).
    ///
    /// Fails with [`BrokerError::ProducerCreation`] (exit code 2) when librdkafka
    /// refuses the configuration.
    pub fn new(
        cfg: ClientConfig,
        report_capacity: usize,
    ) -> Result<(Publisher, mpsc::Receiver<DeliveryReport>), BrokerError> {
        let (tx, rx) = mpsc::channel(report_capacity.max(1));
        Ok((Self::reporting_to(&cfg, tx)?, rx))
    }

    /// A second producer with the same settings that sends each record in a batch
    /// of its own, reporting on this publisher's channel: for retrying a record
    /// alone after the broker refused the batch it was in for its size (the broker
    /// refuses a whole batch above the topic's `max.message.bytes`, and librdkafka
    /// reports every record of it; see `crate::kafka::is_size_error`).
    ///
    /// # Errors
    ///
    /// As for [`Publisher::new`].
    pub(crate) fn alone(&self) -> Result<Publisher, BrokerError> {
        let mut cfg = self.config.clone();
        cfg.set("batch.num.messages", "1").set("linger.ms", "0");
        let publisher = Self::reporting_to(&cfg, self.producer.context().reports.clone())?;
        Ok(publisher.with_configuration_errors_poisoned(self.poison_configuration_errors))
    }

    fn reporting_to(
        cfg: &ClientConfig,
        tx: mpsc::Sender<DeliveryReport>,
    ) -> Result<Publisher, BrokerError> {
        let context = RelayContext {
            reports: tx,
            closing: AtomicBool::new(false),
            broker_down: AtomicBool::new(false),
            fatal_logged: AtomicBool::new(false),
            security_refusals: AtomicU64::new(0),
            last_security_refusal: Mutex::new(None),
            transient_errors: AtomicU64::new(0),
            dropped_reports: AtomicU64::new(0),
            traffic: Mutex::new(Traffic::default()),
        };
        let producer: BaseProducer<RelayContext> =
            cfg.create_with_context(context).map_err(|e| match e {
                KafkaError::ClientCreation(message) => BrokerError::ProducerCreation(message),
                other => BrokerError::Client(other),
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
                })
                .map_err(BrokerError::DeliveryThread)?
        };
        let brokers = cfg.get("bootstrap.servers").unwrap_or_default().to_owned();
        let max_message_bytes = cfg
            .get("message.max.bytes")
            .and_then(|v| v.parse().ok())
            .unwrap_or(LIBRDKAFKA_MESSAGE_MAX_BYTES);
        Ok(Publisher {
            producer,
            stop,
            poller: Some(poller),
            brokers,
            poison_configuration_errors: false,
            max_message_bytes,
            compresses: super::compresses(cfg),
            idle_flush: None,
            config: cfg.clone(),
        })
    }

    /// The librdkafka producer (for the transactional calls of `transactions.rs`).
    pub(super) fn producer(&self) -> &Arc<BaseProducer<RelayContext>> {
        &self.producer
    }

    /// Applies `relay.on_config_error`: with `poison`, a configuration failure
    /// (missing topic, no authorization…) counts as permanent; by default it is
    /// transient (the event waits until the setup is fixed).
    #[must_use]
    pub fn with_configuration_errors_poisoned(mut self, poison: bool) -> Publisher {
        self.poison_configuration_errors = poison;
        self
    }

    /// The producer's `message.max.bytes` (librdkafka's default unless configured):
    /// a record whose key, value and headers add up to more is refused at send.
    #[must_use]
    pub fn max_message_bytes(&self) -> usize {
        self.max_message_bytes
    }

    /// Whether the producer compresses its batches (`compression.type`): the
    /// broker then applies the topic's `max.message.bytes` to the compressed batch.
    #[must_use]
    pub fn compresses(&self) -> bool {
        self.compresses
    }

    /// How the relay treats a failure with this code (`relay.on_config_error` applied).
    #[must_use]
    pub fn classify(&self, code: RDKafkaErrorCode) -> Failure {
        classify(code).under(self.poison_configuration_errors)
    }

    /// Checks that the brokers answer a metadata request within `timeout` (at start-up,
    /// before reading the WAL). Runs on a blocking thread.
    ///
    /// Fails with [`BrokerError::Unavailable`] (exit code 4) when no broker answers, when
    /// the producer hit a fatal error (e.g. missing `IDEMPOTENT_WRITE` permission), and
    /// — without waiting for `timeout` — when the broker refuses the connection's
    /// security: an untrusted certificate, a wrong password, a SASL mechanism it does
    /// not offer ([`BrokerUnavailable::SecurityRefused`], naming librdkafka's reason).
    /// librdkafka itself would retry those for ever, and the events would wait
    /// (never poisoned) without a word about why.
    pub async fn check_broker(&self, timeout: Duration) -> Result<(), BrokerError> {
        let producer = Arc::clone(&self.producer);
        let brokers = self.brokers.clone();
        self.read_metadata(timeout, move |metadata| {
            if metadata.brokers().is_empty() {
                return Err(BrokerUnavailable::NoBrokers { brokers }.into());
            }
            if let Some((code, message)) = producer.client().fatal_error() {
                return Err(BrokerUnavailable::ProducerFailed { code, message }.into());
            }
            Ok(())
        })
        .await
    }

    /// One metadata request for all topics on a blocking thread (security refusals
    /// said at once, [`fetch_metadata_or_refusal`]), read by `read`.
    async fn read_metadata<T: Send + 'static>(
        &self,
        timeout: Duration,
        read: impl FnOnce(&rdkafka::metadata::Metadata) -> Result<T, BrokerError> + Send + 'static,
    ) -> Result<T, BrokerError> {
        let producer = Arc::clone(&self.producer);
        let brokers = self.brokers.clone();
        tokio::task::spawn_blocking(move || {
            read(&fetch_metadata_or_refusal(&producer, &brokers, timeout)?)
        })
        .await
        .map_err(BrokerError::CheckTask)?
    }

    /// The topics the brokers know, with their partition counts, from one metadata
    /// request for *all* topics (as [`Publisher::check_broker`] makes): asking for a
    /// named topic instead would let a broker with `auto.create.topics.enable`
    /// create it, and a check must not change what it checks.
    ///
    /// # Errors
    ///
    /// As [`Publisher::check_broker`].
    pub async fn topic_partitions(
        &self,
        timeout: Duration,
    ) -> Result<std::collections::HashMap<String, usize>, BrokerError> {
        self.read_metadata(timeout, |metadata| {
            Ok(metadata
                .topics()
                .iter()
                .filter(|t| t.error().is_none())
                .map(|t| (t.name().to_owned(), t.partitions().len()))
                .collect())
        })
        .await
    }

    /// `topic`'s partitions and fewest replicas, the cluster's broker count and one
    /// broker's id, from one metadata request for all topics (see
    /// [`Publisher::topic_partitions`]); `None` when the topic does not exist.
    ///
    /// # Errors
    ///
    /// As [`Publisher::check_broker`].
    pub async fn topic_layout(
        &self,
        topic: &str,
        timeout: Duration,
    ) -> Result<Option<(super::ProgressTopicLayout, Option<i32>)>, BrokerError> {
        let topic = topic.to_owned();
        self.read_metadata(timeout, move |metadata| {
            let Some(t) = metadata
                .topics()
                .iter()
                .find(|t| t.name() == topic && t.error().is_none())
            else {
                return Ok(None);
            };
            let layout = super::ProgressTopicLayout {
                partitions: t.partitions().len(),
                replicas: t
                    .partitions()
                    .iter()
                    .map(|p| p.replicas().len())
                    .min()
                    .unwrap_or(0),
                brokers: metadata.brokers().len(),
                ..super::ProgressTopicLayout::default()
            };
            let broker_id = metadata.brokers().first().map(|b| b.id());
            Ok(Some((layout, broker_id)))
        })
        .await
    }

    /// Queues the record of an outbox event (the record contract of `docs/architecture.md#the-kafka-record`,
    /// shared by the relay, the poller and `replay`); see [`Publisher::send`].
    pub(crate) fn send_event(
        &self,
        id: EventId,
        event: &crate::outbox::OutboxEvent,
    ) -> Result<(), SendRejected> {
        with_event_record(event, |record| {
            self.send_value(id, record, !event.tombstone)
        })
    }

    /// Queues one record for `id`; never waits for the broker. `Ok` means exactly one
    /// [`DeliveryReport`] for `id` will follow; `Err` means none will.
    pub fn send(&self, id: EventId, rec: RecordRef<'_>) -> Result<(), SendRejected> {
        self.send_value(id, rec, true)
    }

    /// [`Publisher::send`]; without `has_value` the record's value is null (a
    /// tombstone), whatever `rec.payload` holds.
    fn send_value(
        &self,
        id: EventId,
        rec: RecordRef<'_>,
        has_value: bool,
    ) -> Result<(), SendRejected> {
        let mut headers = OwnedHeaders::new_with_capacity(rec.headers.len());
        for &(key, value) in rec.headers {
            headers = headers.insert(Header {
                key,
                value: Some(value),
            });
        }
        let mut record: BaseRecord<'_, [u8], [u8], usize> =
            BaseRecord::with_opaque_to(rec.topic, opaque_of(id))
                .key(rec.key)
                .headers(headers);
        if has_value {
            record = record.payload(rec.payload);
        }
        if let Some(ts) = rec.timestamp_ms {
            record = record.timestamp(ts);
        }
        self.producer.send(record).map_err(|(err, _record)| {
            let code = match &err {
                // A NUL byte in the topic name never reaches librdkafka.
                KafkaError::Nul(_) => RDKafkaErrorCode::InvalidTopic,
                other => other.rdkafka_error_code().unwrap_or(RDKafkaErrorCode::Fail),
            };
            let failure = self.classify(code);
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
    /// Fails with a `Flush` error ([`BrokerError::Client`]) when records are still in
    /// flight after `timeout`.
    pub async fn flush(&self, timeout: Duration) -> Result<(), BrokerError> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::new(FLUSH_CHECK_INITIAL, FLUSH_CHECK_MAX);
        loop {
            // A zero timeout makes librdkafka send lingering batches now and return.
            match self.producer.flush(Duration::ZERO) {
                Ok(()) => return Ok(()),
                Err(KafkaError::Flush(RDKafkaErrorCode::OperationTimedOut)) => {}
                Err(other) => return Err(BrokerError::Client(other)),
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(BrokerError::Client(KafkaError::Flush(
                    RDKafkaErrorCode::OperationTimedOut,
                )));
            }
            tokio::time::sleep(backoff.next_pause().min(deadline - now)).await;
        }
    }

    /// Turns on sending at once when the relay's stream goes idle (see
    /// [`Publisher::stream_idle`] and `kafka::idle_flush`).
    ///
    /// # Errors
    ///
    /// [`BrokerError::DeliveryThread`] when its thread cannot be spawned.
    pub fn with_idle_flush(mut self) -> Result<Publisher, BrokerError> {
        self.idle_flush = Some(
            IdleFlush::start(Arc::clone(&self.producer)).map_err(BrokerError::DeliveryThread)?,
        );
        Ok(self)
    }

    /// The caller has nothing more to produce right now: records lingering in
    /// librdkafka's queue are sent without waiting out `linger.ms`. Never blocks; a
    /// no-op unless [`Publisher::with_idle_flush`] turned it on.
    pub fn stream_idle(&self) {
        if let Some(idle_flush) = &self.idle_flush {
            idle_flush.nudge();
        }
    }

    /// Records handed to librdkafka and not yet reported (its queue length).
    #[must_use]
    pub fn in_flight(&self) -> i32 {
        self.producer.in_flight_count()
    }

    /// [`Publisher::in_flight`] as a count (0 if librdkafka ever said less).
    #[must_use]
    pub fn queued(&self) -> u64 {
        u64::try_from(self.in_flight()).unwrap_or(0)
    }

    /// Transient errors seen so far (client errors and transient delivery failures).
    #[must_use]
    pub(crate) fn transient_errors(&self) -> u64 {
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
    pub(crate) fn fatal_error(&self) -> Option<(RDKafkaErrorCode, String)> {
        self.producer.client().fatal_error()
    }
}

impl Drop for Publisher {
    /// Purges what is still queued (reported as `PurgeQueue` / `PurgeInflight` if the
    /// channel has room) and stops the delivery thread. Call [`Publisher::flush`] first
    /// for a graceful shutdown.
    fn drop(&mut self) {
        // First, so that its thread lets go of the producer.
        drop(self.idle_flush.take());
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RelayConfig;
    use crate::kafka::config::tests::kafka;
    use crate::kafka::producer_config;
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

    #[test]
    fn report_helpers() {
        let ok = DeliveryReport {
            id: EventId::from_raw(1),
            result: Ok((0, 7)),
            reported_at: Instant::now(),
        };
        assert_eq!(ok.failure(), None);
        assert!(!ok.is_fatal());
        let big = DeliveryReport {
            id: EventId::from_raw(2),
            result: Err((RDKafkaErrorCode::MessageSizeTooLarge, "too large".into())),
            reported_at: Instant::now(),
        };
        assert_eq!(big.failure(), Some(Failure::Permanent));
        let fatal = DeliveryReport {
            id: EventId::from_raw(3),
            result: Err((RDKafkaErrorCode::Fatal, "fatal".into())),
            reported_at: Instant::now(),
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
    async fn mock_idle_nudge_sends_without_waiting_out_the_linger() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("orders", 1, 1).unwrap();
        // A linger far beyond the test's patience: only a nudge can send the record.
        let (publisher, mut rx) = mock_publisher(&cluster, &[("linger.ms", "600000")]);
        let publisher = publisher.with_idle_flush().unwrap();
        publisher
            .check_broker(Duration::from_secs(10))
            .await
            .unwrap();
        for raw in 1..=3u64 {
            let id = EventId::from_raw(raw);
            publisher.send(id, record("orders", b"k", b"{}")).unwrap();
            let early = tokio::time::timeout(Duration::from_secs(1), rx.recv()).await;
            assert!(early.is_err(), "sent without a nudge: {early:?}");
            // A flush holds for `HOLD`; on a loaded machine the broker thread may wake
            // after it, and that nudge sends nothing. Nudge again until it does.
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            let report = loop {
                publisher.stream_idle();
                match tokio::time::timeout(Duration::from_millis(200), rx.recv()).await {
                    Ok(report) => break report.expect("channel open"),
                    Err(_) => assert!(
                        tokio::time::Instant::now() < deadline,
                        "no delivery report after 30 s of nudges"
                    ),
                }
            };
            assert_eq!(report.id, id);
            assert!(report.result.is_ok(), "{report:?}");
            // The flush holds librdkafka's flushing state until the record is gone,
            // which is just after its report: a record produced in that moment would
            // leave at once too. Let it end before the next one.
            tokio::time::sleep(crate::kafka::idle_flush::HOLD * 50).await;
        }
        // Without idle flushing, a nudge is a no-op and the record keeps lingering.
        let (plain, mut plain_rx) = mock_publisher(&cluster, &[("linger.ms", "600000")]);
        plain
            .send(EventId::from_raw(9), record("orders", b"k", b"{}"))
            .unwrap();
        plain.stream_idle();
        let lingering = tokio::time::timeout(Duration::from_secs(2), plain_rx.recv()).await;
        assert!(lingering.is_err(), "{lingering:?}");
    }

    #[tokio::test]
    async fn mock_statistics_count_produce_requests_and_records() {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic("orders", 1, 1).unwrap();
        let (publisher, mut rx) = mock_publisher(
            &cluster,
            &[("linger.ms", "200"), ("statistics.interval.ms", "100")],
        );
        publisher
            .check_broker(Duration::from_secs(10))
            .await
            .unwrap();
        for raw in 1..=20u64 {
            publisher
                .send(EventId::from_raw(raw), record("orders", b"k", b"{}"))
                .unwrap();
        }
        for _ in 0..20 {
            assert!(next(&mut rx).await.result.is_ok());
        }
        // One producer, one broker: its last report's totals are what it sent.
        let totals = || {
            let last = publisher.producer().context().traffic.lock().unwrap();
            last.since(&Traffic::default())
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while totals().records < 20 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(totals().records, 20);
        // Twenty records sent together within one linger share their requests.
        let requests = totals().produce_requests;
        assert!((1..20).contains(&requests), "{requests} requests");
    }

    #[test]
    fn traffic_grows_per_broker_and_survives_a_forgotten_one() {
        let report = |b1: u64, b2: Option<u64>, txmsgs: u64| {
            let second = b2.map_or(String::new(), |n| {
                format!(r#","b:2/2":{{"req":{{"Produce":{n},"Metadata":9}}}}"#)
            });
            let json = format!(
                r#"{{"name":"p","txmsgs":{txmsgs},"brokers":{{"b:1/1":{{"req":{{"Produce":{b1}}}}}{second}}},"topics":{{}}}}"#
            );
            Traffic::of(json.as_bytes()).expect("parses")
        };
        let first = report(10, Some(5), 40);
        assert_eq!(
            first.since(&Traffic::default()),
            TrafficGrowth {
                produce_requests: 15,
                records: 40
            }
        );
        // Broker 2 is forgotten: broker 1's growth still counts.
        let second = report(13, None, 46);
        assert_eq!(
            second.since(&first),
            TrafficGrowth {
                produce_requests: 3,
                records: 6
            }
        );
        // It comes back with a fresh count.
        assert_eq!(report(14, Some(2), 50).since(&second).produce_requests, 3);
        assert!(Traffic::of(b"not json").is_none());
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
    async fn mock_missing_topic_is_a_configuration_failure() {
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
        assert_eq!(report.failure(), Some(Failure::Configuration));
        assert_eq!(publisher.classify(code), Failure::Transient, "blocks");
        let publisher = publisher.with_configuration_errors_poisoned(true);
        assert_eq!(
            publisher.classify(code),
            Failure::Permanent,
            "opt-in poison"
        );
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
