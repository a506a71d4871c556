//! The delivery path of a session: the producer and its delivery reports, the
//! producer that retries a record alone after a batch-size error, the topics' size
//! limits, the topics a configuration error blocks (`relay.on_config_error =
//! "block"`), the idle flush (`relay.flush_when_idle`), and the watchdog that
//! replaces a producer that stops reporting or fails fatally.
//!
//! What a report means for the event is the core's to decide: this part tells it
//! (delivered, failed transiently or permanently, refused before sending) and keeps
//! the event's record until the core resolves it, an ack included (in a Kafka
//! transaction an ack is only a write, and an abort asks for the event again).
//!
//! It owns that state and nothing else: the core, the event records and the
//! metric handles are passed in by the loop, which decides when each call is made.

use crate::hashing::HashMap;
use std::time::{Duration, Instant};

use rdkafka::error::RDKafkaErrorCode;
use tokio::sync::mpsc;

use super::ends::Lost;
use super::telemetry::Telemetry;
use crate::cdc::exactly_once::PROGRESS_RECORD_ID;
use crate::cdc::in_flight::InFlight;
use crate::cdc::metrics::{self as m, Health};
use crate::cdc::ports::clock;
use crate::cdc::ports::producer::librdkafka::KafkaProducers;
use crate::cdc::ports::producer::{Made, Producer, Producers};
use crate::cdc::progress::{Core, MissingRecord, Records};
use crate::config::RelayConfig;
use crate::delivery::{EventId, Failure};
use crate::error::Result;
use crate::kafka::{self, DeliveryReport, IdleGate, Publisher, TopicLimits};

/// The watchdog's broker check (a metadata request).
const WATCHDOG_BROKER_CHECK: Duration = Duration::from_secs(5);

/// What a delivery report came to, for the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reported {
    /// The broker acked an event: the core may have resolved events.
    Acked,
    /// Anything else (a failure, the progress record's report).
    Other,
}

/// See the module documentation.
pub(super) struct Delivery {
    publisher: Box<dyn Producer>,
    reports: mpsc::Receiver<DeliveryReport>,
    /// Makes a new producer when the current one is wedged or fenced.
    producers: Box<dyn Producers>,
    /// Sends records in batches of one, for retries after a size error (see
    /// [`Delivery::retry_alone`]); made on first use.
    alone: Option<Box<dyn Producer>>,
    /// Exactly-once mode: another producer cannot write into this one's
    /// transaction, so nothing is retried alone.
    transactional: bool,
    /// Last delivery report (or moment the producer had nothing in flight).
    last_report_at: Instant,
    /// A fatal delivery report: the session ends and the producer is replaced.
    fatal: Option<(RDKafkaErrorCode, String)>,
    /// The watchdog raised its alert; cleared by the next delivery.
    alerted: bool,
    /// Topics whose events a configuration error holds (`relay.on_config_error =
    /// "block"`), with the error kind; cleared by a delivery to the topic.
    blocked_topics: HashMap<String, &'static str>,
    /// The topics' `max.message.bytes` as far as known.
    topic_limits: TopicLimits,
    /// When the stream goes idle between transactions, whether the producer may be
    /// told to send without lingering (`relay.flush_when_idle`, `kafka::idle_flush`).
    idle_gate: IdleGate,
    /// `relay.*`: `on_config_error`, `producer_stall_secs`.
    settings: RelayConfig,
}

impl Delivery {
    /// The relay's delivery path on librdkafka's producers, starting with `first`
    /// (made by `producers`, already used by the start-up checks).
    pub(super) fn new(
        producers: KafkaProducers,
        first: (Publisher, mpsc::Receiver<DeliveryReport>),
        settings: &RelayConfig,
        transactional: bool,
    ) -> Delivery {
        let topic_limits = TopicLimits::new(producers.config());
        let idle_gate = IdleGate::new(kafka::linger(producers.config()));
        let (publisher, reports) = first;
        Delivery::with_producers(
            Box::new(producers),
            (Box::new(publisher), reports),
            topic_limits,
            idle_gate,
            settings,
            transactional,
        )
    }

    /// The delivery path on `producers` (the real ones, or a simulation's),
    /// starting with `first`.
    pub(crate) fn with_producers(
        producers: Box<dyn Producers>,
        first: Made,
        topic_limits: TopicLimits,
        idle_gate: IdleGate,
        settings: &RelayConfig,
        transactional: bool,
    ) -> Delivery {
        let (publisher, reports) = first;
        Delivery {
            publisher,
            reports,
            topic_limits,
            idle_gate,
            producers,
            alone: None,
            transactional,
            last_report_at: clock::now(),
            fatal: None,
            alerted: false,
            blocked_topics: HashMap::default(),
            settings: settings.clone(),
        }
    }

    /// The producer (for the start-up checks and the Kafka transactions).
    pub(super) fn publisher(&self) -> &dyn Producer {
        self.publisher.as_ref()
    }

    /// Replaces a wedged or fatally failed producer. The old one is retired
    /// (`Producer::retire`); its late reports go nowhere.
    ///
    /// # Errors
    ///
    /// The new producer cannot be made.
    pub(super) fn replace(&mut self) -> Result<()> {
        let (publisher, reports) = self.producers.make()?;
        let old = std::mem::replace(&mut self.publisher, publisher);
        let old_alone = self.alone.take();
        self.reports = reports;
        self.fatal = None;
        self.last_report_at = clock::now();
        old.retire();
        if let Some(alone) = old_alone {
            alone.retire();
        }
        ::metrics::counter!(m::PRODUCER_RESTARTS).increment(1);
        Ok(())
    }

    /// A session starts: the watchdog's silence counts from now.
    pub(super) fn session_started(&mut self, now: Instant) {
        self.last_report_at = now;
    }

    /// The next delivery report (`None`: the channel closed).
    pub(super) async fn next_report(&mut self) -> Option<DeliveryReport> {
        self.reports.recv().await
    }

    /// A report already waiting, if any.
    pub(super) fn waiting_report(&mut self) -> Option<DeliveryReport> {
        self.reports.try_recv().ok()
    }

    /// Nothing in flight and no report waiting: a transaction's last reports are in.
    pub(super) fn drained(&self) -> bool {
        self.publisher.in_flight() == 0 && self.reports.is_empty()
    }

    /// The fatal error a report carried, taken: the session ends.
    pub(super) fn take_fatal(&mut self) -> Option<(RDKafkaErrorCode, String)> {
        self.fatal.take()
    }

    /// Whether a report failed fatally (the producer is replaced).
    pub(super) fn failed_fatally(&self) -> bool {
        self.fatal.is_some()
    }

    /// The producer is given up for `reason` unless a fatal report came first.
    pub(super) fn give_up(&mut self, reason: String) {
        self.fatal.get_or_insert((RDKafkaErrorCode::Fail, reason));
    }

    /// Handles one delivery report: tells the core, unblocks or blocks the event's
    /// topic, retries a record alone after a batch-size error.
    pub(super) fn on_report(
        &mut self,
        report: DeliveryReport,
        core: &mut Core,
        records: &mut Records<InFlight>,
        telemetry: &Telemetry,
    ) -> Reported {
        let (health, instruments) = (&telemetry.health, &telemetry.instruments);
        let now = clock::now();
        self.last_report_at = now;
        if report.id == PROGRESS_RECORD_ID {
            // Its failure fails the commit, which is then aborted.
            if let Err((code, message)) = &report.result {
                tracing::warn!(?code, %message, "the progress record was not written");
            }
            return Reported::Other;
        }
        let fatal = report.is_fatal();
        match report.result {
            Ok((partition, offset)) => {
                tracing::trace!(id = %report.id, partition, offset, "delivered");
                // The record stays until the core resolves the event: in a Kafka
                // transaction an ack is a write, and an abort asks for it again.
                if let Some(InFlight::Event {
                    event, delivered, ..
                }) = records.acked(report.id, report.reported_at)
                {
                    *delivered = Some((partition, offset));
                    if self.blocked_topics.contains_key(&event.topic) {
                        let topic = event.topic.clone();
                        self.topic_accepts(&topic, health);
                    }
                }
                if self.alerted {
                    self.alerted = false;
                    health.set_alert("producer", None);
                }
                core.delivered(report.id, now);
                Reported::Acked
            }
            Err((code, message)) => {
                if fatal {
                    // Not the event's fault: the producer is replaced and the event
                    // produced again by the next session.
                    self.fatal = Some((code, message));
                    return Reported::Other;
                }
                if self.retry_alone(report.id, code, &message, records) {
                    record_failure(
                        records,
                        report.id,
                        kafka::error_kind(code),
                        &message,
                        Failure::Transient,
                    );
                    core.delivery_failed(report.id, Failure::Transient, now);
                    return Reported::Other;
                }
                let failure = self.publisher.classify(code);
                if kafka::is_configuration(code) {
                    self.topic_refuses(report.id, code, &message, records, health);
                } else if failure == Failure::Transient {
                    instruments.transient_error();
                }
                record_failure(
                    records,
                    report.id,
                    kafka::error_kind(code),
                    &message,
                    failure,
                );
                core.delivery_failed(report.id, failure, now);
                Reported::Other
            }
        }
    }

    /// Hands the record of `id` to the producer, or refuses it (too large for any
    /// retry) or fails it (the send was refused, or `begin` could not begin a Kafka
    /// transaction), and tells the core so.
    ///
    /// # Errors
    ///
    /// The core asked for a produce without a record kept ([`MissingRecord`]).
    pub(super) fn send(
        &mut self,
        id: EventId,
        attempt: u32,
        core: &mut Core,
        records: &mut Records<InFlight>,
        telemetry: &Telemetry,
        begin: impl FnOnce(&dyn Producer) -> bool,
    ) -> std::result::Result<(), MissingRecord> {
        let (health, instruments) = (&telemetry.health, &telemetry.instruments);
        let Some(InFlight::Event { event, .. }) = records.get(id) else {
            return Err(missing_record(core, id, attempt));
        };
        tracing::trace!(%id, topic = %event.topic, "produce");
        let now = clock::now();
        let topic_limit = self.topic_limits.limit(&event.topic, now);
        let producer_limit = self.publisher.max_message_bytes();
        let compressed = self.publisher.compresses();
        if let Some(why) = too_large(event, producer_limit, topic_limit, compressed) {
            // No retry can make it fit: poisoned now, with the limit in the error.
            let message = format!("{why}; topic {:?}", event.topic);
            record_failure(
                records,
                id,
                kafka::error_kind(RDKafkaErrorCode::MessageSizeTooLarge),
                &message,
                Failure::Permanent,
            );
            core.refuse(id, clock::now());
            return Ok(());
        }
        if !begin(self.publisher.as_ref()) {
            // The producer cannot begin a transaction: the session ends and the
            // event goes out with the next producer.
            core.delivery_failed(id, Failure::Transient, now);
            return Ok(());
        }
        let publisher = if self.make_alone_publisher(id, records) {
            self.alone.as_ref().unwrap_or(&self.publisher)
        } else {
            &self.publisher
        };
        let Some(InFlight::Event {
            event,
            received_at,
            produced_at,
            delivered,
            ..
        }) = records.get_mut(id)
        else {
            return Err(missing_record(core, id, attempt));
        };
        let sent = publisher.send_event(id, event);
        if sent.is_ok() {
            // An earlier attempt's ack (in a Kafka transaction since aborted) is
            // not this record's place.
            *delivered = None;
            core.produce_sent(id);
            self.idle_gate.produced();
            // The instant before the send: a clock read less per event, for a
            // microsecond of the produced → acked stage.
            *produced_at = now;
            if attempt == 1 {
                instruments.produced(*received_at, *produced_at);
            }
        }
        if let Err(rejected) = sent {
            if kafka::is_configuration(rejected.code) {
                self.topic_refuses(id, rejected.code, &rejected.message, records, health);
            }
            let kind = kafka::error_kind(rejected.code);
            record_failure(records, id, kind, &rejected.message, rejected.failure);
            core.delivery_failed(id, rejected.failure, clock::now());
        }
        Ok(())
    }

    /// Whether the producer may be told that the stream went idle between
    /// transactions (`kafka::idle_flush`): asked when the stream has nothing to read.
    pub(super) fn may_nudge(&self, in_transaction: bool) -> bool {
        self.idle_gate.pending()
            && !in_transaction
            && self
                .idle_gate
                .may_nudge(clock::now(), self.publisher.queued())
    }

    /// Before a pause in reading: whether what lingers should be sent first.
    pub(super) fn may_nudge_before_pause(&self) -> bool {
        self.idle_gate
            .may_nudge_before_pause(self.publisher.queued())
    }

    /// Sends what lingers in the producer at once.
    pub(super) fn nudge(&mut self) {
        self.idle_gate.nudged(clock::now());
        self.publisher.stream_idle();
    }

    /// The producer watchdog: a fatal error, or messages in flight with no report
    /// for `relay.producer_stall_secs` while the broker answers a metadata request,
    /// ends the session so that the producer is replaced (both producers: the main
    /// one and the retry-alone one).
    pub(super) async fn watch(&mut self, health: &Health) -> Option<Lost> {
        let producers = std::iter::once(&self.publisher).chain(self.alone.as_ref());
        let mut in_flight = 0_i32;
        for producer in producers {
            if let Some((code, message)) = producer.fatal_error() {
                return Some(Lost::ProducerFatal { code, message });
            }
            // The retry-alone producer reports into the same channel: its silence
            // counts as the main one's does.
            in_flight = in_flight.saturating_add(producer.in_flight().max(0));
        }
        if in_flight == 0 {
            self.last_report_at = clock::now();
            return None;
        }
        let stall = Duration::from_secs(self.settings.producer_stall_secs);
        let silent = clock::elapsed(self.last_report_at);
        if stall.is_zero() || silent < stall {
            return None;
        }
        // A broker that is down explains the silence: waiting is right then, and the
        // producer gets a full stall period once it is back.
        if let Err(e) = self.publisher.check_broker(WATCHDOG_BROKER_CHECK).await {
            tracing::debug!(error = %e, in_flight, "no delivery reports; the broker is unreachable");
            self.last_report_at = clock::now();
            return None;
        }
        // Reports that arrived during the check (the loop waited for it).
        if !self.reports.is_empty() {
            return None;
        }
        self.alerted = true;
        health.set_alert(
            "producer",
            Some(format!(
                "the Kafka producer sent no delivery report for {}s with {in_flight} messages in flight; replacing it",
                silent.as_secs()
            )),
        );
        Some(Lost::ProducerStalled {
            silent_secs: silent.as_secs(),
            in_flight,
        })
    }

    /// A configuration error (missing topic, no authorization…) for the event `id`:
    /// counted; in `block` mode its topic is recorded as blocked, said once at error
    /// with the fix, and `/readyz` turns 503 until a delivery to the topic succeeds.
    fn topic_refuses(
        &mut self,
        id: EventId,
        code: RDKafkaErrorCode,
        message: &str,
        records: &Records<InFlight>,
        health: &Health,
    ) {
        let kind = kafka::error_kind(code);
        ::metrics::counter!(m::CONFIGURATION_ERRORS, "kind" => kind).increment(1);
        if self.settings.on_config_error.poisons() {
            return;
        }
        let Some(InFlight::Event { event, .. }) = records.get(id) else {
            return;
        };
        if self.blocked_topics.contains_key(&event.topic) {
            return;
        }
        tracing::error!(
            topic = %event.topic,
            kind,
            error = message,
            fix = kafka::configuration_fix(code),
            "the broker refuses this topic's events: they are held and retried until the setup is \
             fixed (relay.on_config_error = \"block\"; \"poison\" would poison them instead)"
        );
        self.blocked_topics.insert(event.topic.clone(), kind);
        self.publish_blocked_topics(health);
    }

    /// A delivery to `topic` succeeded: it is no longer blocked.
    fn topic_accepts(&mut self, topic: &str, health: &Health) {
        if self.blocked_topics.remove(topic).is_some() {
            tracing::info!(topic, "the broker accepts this topic's events again");
            self.publish_blocked_topics(health);
        }
    }

    /// The blocked topics to the gauge and `/readyz`.
    fn publish_blocked_topics(&self, health: &Health) {
        // Exact: far fewer topics than 2^53.
        #[allow(clippy::cast_precision_loss)]
        ::metrics::gauge!(m::BLOCKED_TOPICS).set(self.blocked_topics.len() as f64);
        let alert = (!self.blocked_topics.is_empty()).then(|| {
            let mut topics: Vec<String> = self
                .blocked_topics
                .iter()
                .map(|(topic, kind)| format!("{topic} ({kind})"))
                .collect();
            topics.sort();
            let shown = topics.len().min(5);
            format!(
                "events held for {} topic(s) the broker refuses: {}{}",
                topics.len(),
                topics[..shown].join(", "),
                if topics.len() > shown { ", …" } else { "" }
            )
        });
        health.set_alert("topics", alert);
    }

    /// Whether `id` is to be retried alone; makes the producer that sends records
    /// alone on first use (when it cannot be made, the shared producer is used).
    fn make_alone_publisher(&mut self, id: EventId, records: &Records<InFlight>) -> bool {
        if self.transactional {
            // Another producer cannot write into this one's transaction.
            return false;
        }
        if !matches!(records.get(id), Some(InFlight::Event { alone: true, .. })) {
            return false;
        }
        if self.alone.is_none() {
            match self.publisher.alone() {
                Ok(p) => self.alone = Some(p),
                Err(e) => tracing::warn!(error = %e, "cannot make the retry-alone producer"),
            }
        }
        true
    }

    /// A size error for `id` that may belong to another record of its batch: when
    /// `id` fits every known limit and was not retried alone yet, it is retried
    /// alone, and the failure does not count against it. `true` when so.
    fn retry_alone(
        &mut self,
        id: EventId,
        code: RDKafkaErrorCode,
        message: &str,
        records: &mut Records<InFlight>,
    ) -> bool {
        if !kafka::is_size_error(code) {
            return false;
        }
        let producer_limit = self.publisher.max_message_bytes();
        let compressed = self.publisher.compresses();
        let Some(InFlight::Event { event, alone, .. }) = records.get_mut(id) else {
            return false;
        };
        let topic_limit = self.topic_limits.limit(&event.topic, clock::now());
        if *alone || too_large(event, producer_limit, topic_limit, compressed).is_some() {
            return false;
        }
        *alone = true;
        tracing::info!(
            %id,
            topic = %event.topic,
            bytes = event.byte_size(),
            error = message,
            "the broker refused a batch for its size; retrying this record alone"
        );
        true
    }
}

/// A produce without a record: the core counts it failed, which blocks its key
/// (no later event of the key leaves ahead of it while the lost session drains)
/// and aborts the open Kafka transaction it joined; the caller ends the session.
pub(super) fn missing_record(core: &mut Core, id: EventId, attempt: u32) -> MissingRecord {
    core.delivery_failed(id, Failure::Transient, clock::now());
    MissingRecord { id, attempt }
}

/// Keeps the last error of `id` (for its poison row).
fn record_failure(
    records: &mut Records<InFlight>,
    id: EventId,
    kind: &'static str,
    message: &str,
    failure: Failure,
) {
    if let Some(InFlight::Event {
        last_error, event, ..
    }) = records.get_mut(id)
    {
        if failure == Failure::Permanent {
            tracing::debug!(%id, topic = %event.topic, kind, message, "delivery failed");
        }
        *last_error = Some((kind, message.to_owned()));
    }
}

/// Why `event` can never be produced: larger than the producer's
/// `message.max.bytes`, or than the topic's `max.message.bytes` (which bounds a
/// record batch: the record plus [`BATCH_OVERHEAD`] and the framing of its headers)
/// when the producer does not compress.
///
/// The two limits are measured on different bytes. librdkafka checks
/// `message.max.bytes` against the record as given, key, value and headers plus
/// framing, before anything is compressed (`rd_kafka_msg_new0`), so that check holds
/// whatever the codec. The broker checks the topic's limit against the record batch
/// as written, which is compressed when `compression.type` is set: a 3 MB JSON event
/// may travel as 300 KB. The uncompressed size then says nothing about the topic's
/// limit, and poisoning by it would poison events the broker accepts, so with
/// `compressed` the topic's limit is not checked here. The event is produced; a
/// broker that refuses it answers `MessageSizeTooLarge` (or `RecordBatchTooLarge`),
/// which is permanent (`kafka::classify`): the record is retried alone, then up to
/// `relay.max_attempts`, then poisoned with the broker's error.
fn too_large(
    event: &crate::outbox::OutboxEvent,
    producer_limit: usize,
    topic_limit: Option<usize>,
    compressed: bool,
) -> Option<String> {
    let size = event.byte_size();
    if size > producer_limit {
        return Some(format!(
            "record of {size} bytes (key, value and headers) is larger than the producer's \
             message.max.bytes = {producer_limit} (kafka.producer)"
        ));
    }
    if compressed {
        return None;
    }
    let limit = topic_limit?;
    let batch = size + BATCH_OVERHEAD + HEADER_OVERHEAD * event.headers.len();
    (batch > limit).then(|| {
        format!(
            "record of {size} bytes (key, value and headers; about {batch} as a record batch) \
             is larger than the topic's max.message.bytes = {limit}"
        )
    })
}

/// Bytes a record batch of one record adds to the record's key, value and header
/// bytes, at most: the batch header (61), and the record's attributes, timestamp
/// and offset deltas, lengths and header count as varints.
const BATCH_OVERHEAD: usize = 61 + 1 + 10 + 5 + 5 + 5 + 5 + 5;

/// Bytes each header adds at most (its name and value lengths as varints).
const HEADER_OVERHEAD: usize = 10;

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::config::OutboxConfig;
    use crate::outbox::{OutboxEvent, OutboxMapper, OutboxRow};

    /// An event whose payload is `bytes` bytes of one repeated letter: what
    /// compresses to almost nothing.
    fn event_of(bytes: usize) -> OutboxEvent {
        let mapper = OutboxMapper::with_template(&OutboxConfig::default(), "events", None)
            .expect("a valid template");
        let row = OutboxRow {
            id: Some(Bytes::from_static(b"1")),
            aggregate_id: Some(Bytes::from_static(b"order-1")),
            payload: Some(Bytes::from(format!("\"{}\"", "x".repeat(bytes - 2)))),
            ..OutboxRow::default()
        };
        mapper.map_row(&row, None).expect("a mappable row")
    }

    #[test]
    fn the_topic_limit_applies_only_to_uncompressed_batches() {
        let event = event_of(12_000);
        assert!(event.byte_size() > 12_000);
        let why = too_large(&event, 1_000_000, Some(4_000), false).expect("above the topic limit");
        assert!(
            why.contains("topic's max.message.bytes = 4000"),
            "the limit is in the error: {why}"
        );
        // Compressed, the batch the broker measures may be far smaller than the
        // record: the broker decides, the relay does not poison in advance.
        assert_eq!(too_large(&event, 1_000_000, Some(4_000), true), None);
        // Within every limit either way.
        for compressed in [false, true] {
            assert_eq!(
                too_large(&event, 1_000_000, Some(1_000_000), compressed),
                None
            );
            assert_eq!(too_large(&event, 1_000_000, None, compressed), None);
        }
    }

    #[test]
    fn the_producer_limit_applies_whether_compressed_or_not() {
        // librdkafka compares message.max.bytes with the uncompressed record.
        let event = event_of(12_000);
        for compressed in [false, true] {
            let why = too_large(&event, 10_000, None, compressed).expect("above the producer's");
            assert!(
                why.contains("message.max.bytes = 10000"),
                "compressed {compressed}: {why}"
            );
        }
    }
}
