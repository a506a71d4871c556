//! OpenTelemetry traces of each event's trip: how long it sat in the outbox, in the
//! relay and in the producer (`[traces]`, off by default).
//!
//! # One span per event, made when the event is resolved
//!
//! The relay makes no span while an event is on its way: the times it needs are in
//! the event's in-flight record already (`cdc::in_flight`: commit time, when its
//! frame was read, when it was last produced, when the broker acked it), so a span
//! costs nothing until the event is resolved, and an event produced again after an
//! aborted Kafka transaction gets one span, not one per attempt. The span is a
//! `PRODUCER` span named `send <topic>`:
//!
//! * it starts at the row's `created_at` (its `occurred_at` header, microseconds)
//!   and ends at the broker's ack: its duration is the event's whole wait;
//! * its events are `committed` (the transaction's commit time), `decoded` (its
//!   frame read off the replication stream), `produced` (handed to the producer) and
//!   `acked`;
//! * its parent is the row's W3C `traceparent` (with `tracestate`), when its
//!   `headers` object has one: the span joins the trace of the request that wrote
//!   the event;
//! * its attributes follow the OpenTelemetry messaging conventions:
//!   `messaging.system = kafka`, `messaging.operation.type = send`,
//!   `messaging.destination.name`, `messaging.destination.partition.id`,
//!   `messaging.kafka.offset`, `messaging.kafka.message.key`, `messaging.message.id`
//!   (the idempotency key).
//!
//! # Bounded cost
//!
//! Sampling is decided first, on a bare span: an event that is not sampled costs a
//! scan of its headers for `traceparent` and the sampler's call, nothing else. The
//! sampler is `ParentBased(TraceIdRatioBased(traces.sample_ratio))` unless
//! `OTEL_TRACES_SAMPLER` names another: an event whose writer's trace is sampled is
//! traced, others at the configured ratio. Sampled spans go to the SDK's batch
//! processor, which exports from its own thread and drops spans when its queue
//! (`OTEL_BSP_MAX_QUEUE_SIZE`, 2,048) is full, so a slow collector never slows the
//! relay. `bench --modes cdc,cdc-traced` measures the cost per event.
//!
//! # Export
//!
//! OTLP, configured by the standard variables: `OTEL_EXPORTER_OTLP_ENDPOINT`,
//! `OTEL_EXPORTER_OTLP_PROTOCOL` (`http/protobuf` by default, `http/json`, `grpc`),
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_SERVICE_NAME` (`outbox-relay` when unset),
//! `OTEL_RESOURCE_ATTRIBUTES`. References: the OpenTelemetry specification's
//! "Semantic conventions for messaging spans" and "OTLP Exporter Configuration".

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Span, SpanBuilder, SpanKind, TracerProvider};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};

use crate::config::TracesConfig;
use crate::outbox::{HEADER_OCCURRED_AT, OutboxEvent};

/// Seconds from the Unix epoch to PostgreSQL's (2000-01-01), for commit times.
const PG_EPOCH_UNIX_SECS: u64 = 946_684_800;

/// How long the exit waits for the last spans to be exported.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// The exporter could not be built.
#[derive(Debug, thiserror::Error)]
#[error("traces: the OTLP exporter could not be set up: {0}")]
pub(crate) struct TracesError(String);

/// What one event's span is made of (module doc).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Trip<'a> {
    pub(crate) event: &'a OutboxEvent,
    /// Commit time of its transaction, microseconds since 2000-01-01.
    pub(crate) committed_at: i64,
    pub(crate) received_at: Instant,
    pub(crate) produced_at: Instant,
    pub(crate) acked_at: Instant,
    /// Partition and offset of the ack.
    pub(crate) delivered: Option<(i32, i64)>,
}

/// The tracer of a running relay.
pub(crate) struct EventTraces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
}

impl std::fmt::Debug for EventTraces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventTraces").finish_non_exhaustive()
    }
}

impl EventTraces {
    /// Sets up the exporter when `[traces] enabled`; `None` otherwise. Must run
    /// inside the Tokio runtime (the gRPC exporter's connection lives there).
    ///
    /// # Errors
    ///
    /// [`TracesError`] when the exporter refuses its `OTEL_*` settings.
    pub(crate) fn start(config: &TracesConfig) -> Result<Option<EventTraces>, TracesError> {
        if !config.enabled {
            return Ok(None);
        }
        let grpc = std::env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL"))
            .is_ok_and(|p| p.trim().eq_ignore_ascii_case("grpc"));
        let builder = opentelemetry_otlp::SpanExporter::builder();
        let exporter = if grpc {
            builder.with_tonic().build()
        } else {
            builder.with_http().build()
        }
        .map_err(|e| TracesError(e.to_string()))?;
        let mut resource = Resource::builder();
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
            resource = resource.with_service_name("outbox-relay");
        }
        let mut provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build());
        if std::env::var_os("OTEL_TRACES_SAMPLER").is_none() {
            provider = provider.with_sampler(Sampler::ParentBased(Box::new(
                Sampler::TraceIdRatioBased(config.sample_ratio),
            )));
        }
        let provider = provider.build();
        let tracer = provider.tracer("outbox-relay");
        tracing::info!(
            protocol = if grpc { "grpc" } else { "http" },
            sample_ratio = config.sample_ratio,
            "exporting a trace span per sampled event over OTLP"
        );
        Ok(Some(EventTraces {
            provider,
            tracer,
            propagator: TraceContextPropagator::new(),
        }))
    }

    /// Makes the span of one delivered event (module doc), if it is sampled.
    pub(crate) fn delivered(&self, trip: &Trip<'_>) {
        let parent = self
            .propagator
            .extract_with_context(&Context::new(), &RowHeaders(&trip.event.headers));
        let clock = WallClock::now();
        let start = created_at(trip.event).unwrap_or_else(|| clock.at(trip.received_at));
        let mut span = SpanBuilder::from_name("send")
            .with_kind(SpanKind::Producer)
            .with_start_time(start)
            .start_with_context(&self.tracer, &parent);
        if !span.is_recording() {
            return;
        }
        let event = trip.event;
        span.update_name(format!("send {}", event.topic));
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let mut attributes = vec![
            KeyValue::new("messaging.system", "kafka"),
            KeyValue::new("messaging.operation.type", "send"),
            KeyValue::new("messaging.operation.name", "send"),
            KeyValue::new("messaging.destination.name", event.topic.clone()),
            KeyValue::new("messaging.kafka.message.key", text(&event.key)),
            KeyValue::new("messaging.message.id", text(&event.idempotency_key)),
            KeyValue::new(
                "messaging.message.body.size",
                i64::try_from(event.payload.len()).unwrap_or(i64::MAX),
            ),
        ];
        if let Some((partition, offset)) = trip.delivered {
            attributes.push(KeyValue::new(
                "messaging.destination.partition.id",
                partition.to_string(),
            ));
            attributes.push(KeyValue::new("messaging.kafka.offset", offset));
        }
        span.set_attributes(attributes);
        if let Some(committed) = pg_time(trip.committed_at) {
            span.add_event_with_timestamp("committed", committed, Vec::new());
        }
        span.add_event_with_timestamp("decoded", clock.at(trip.received_at), Vec::new());
        span.add_event_with_timestamp("produced", clock.at(trip.produced_at), Vec::new());
        let acked = clock.at(trip.acked_at);
        span.add_event_with_timestamp("acked", acked, Vec::new());
        span.end_with_timestamp(acked);
    }
}

impl Drop for EventTraces {
    /// Exports what is queued (bounded by [`SHUTDOWN_TIMEOUT`]) when the relay stops.
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
            tracing::warn!(error = %e, "traces: the last spans may not have been exported");
        }
    }
}

/// `Instant`s as wall-clock times, read once per span.
struct WallClock {
    system: SystemTime,
    instant: Instant,
}

impl WallClock {
    fn now() -> WallClock {
        WallClock {
            system: SystemTime::now(),
            instant: Instant::now(),
        }
    }

    fn at(&self, then: Instant) -> SystemTime {
        let ago = self.instant.saturating_duration_since(then);
        self.system.checked_sub(ago).unwrap_or(self.system)
    }
}

/// The row's `created_at`, from the `occurred_at` header (microseconds), else the
/// record's timestamp (milliseconds).
fn created_at(event: &OutboxEvent) -> Option<SystemTime> {
    let header = event
        .headers
        .iter()
        .find(|(name, _)| name == HEADER_OCCURRED_AT)
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
        .and_then(|v| chrono::DateTime::parse_from_rfc3339(v).ok());
    if let Some(t) = header {
        let micros = u64::try_from(t.timestamp_micros()).ok()?;
        return UNIX_EPOCH.checked_add(Duration::from_micros(micros));
    }
    let millis = u64::try_from(event.timestamp_ms?).ok()?;
    UNIX_EPOCH.checked_add(Duration::from_millis(millis))
}

/// A PostgreSQL timestamp (microseconds since 2000-01-01) as a `SystemTime`.
fn pg_time(micros: i64) -> Option<SystemTime> {
    let since_2000 = Duration::from_micros(u64::try_from(micros).ok()?);
    UNIX_EPOCH
        .checked_add(Duration::from_secs(PG_EPOCH_UNIX_SECS))?
        .checked_add(since_2000)
}

/// The record's headers as a propagator reads them (`traceparent`, `tracestate`).
struct RowHeaders<'a>(&'a [(crate::outbox::HeaderName, bytes::Bytes)]);

impl Extractor for RowHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(key))
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| name.as_ref()).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;
    use bytes::Bytes;
    use opentelemetry::trace::TraceContextExt;

    fn headers(pairs: &[(&'static str, &str)]) -> Vec<(crate::outbox::HeaderName, Bytes)> {
        pairs
            .iter()
            .map(|(n, v)| (Cow::Borrowed(*n), Bytes::copy_from_slice(v.as_bytes())))
            .collect()
    }

    #[test]
    fn the_parent_comes_from_the_rows_traceparent() {
        let h = headers(&[
            ("idempotency_key", "k"),
            (
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
        ]);
        let cx =
            TraceContextPropagator::new().extract_with_context(&Context::new(), &RowHeaders(&h));
        let parent = cx.span().span_context().clone();
        assert!(parent.is_valid() && parent.is_sampled() && parent.is_remote());
        assert_eq!(
            parent.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(parent.span_id().to_string(), "b7ad6b7169203331");
        let none = headers(&[("traceparent", "not a traceparent")]);
        let cx =
            TraceContextPropagator::new().extract_with_context(&Context::new(), &RowHeaders(&none));
        assert!(!cx.span().span_context().is_valid());
    }

    #[test]
    fn times_convert_from_postgres_and_from_the_occurred_at_header() {
        // 2000-01-01T00:00:01Z
        assert_eq!(
            pg_time(1_000_000),
            Some(UNIX_EPOCH + Duration::from_secs(PG_EPOCH_UNIX_SECS + 1))
        );
        assert_eq!(pg_time(-1), None);
        let clock = WallClock::now();
        let earlier = clock
            .instant
            .checked_sub(Duration::from_millis(250))
            .unwrap();
        assert_eq!(
            clock.system.duration_since(clock.at(earlier)).unwrap(),
            Duration::from_millis(250)
        );
    }
}
