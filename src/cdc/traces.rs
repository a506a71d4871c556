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
//! * it starts at the row's `created_at` (microseconds) and ends at the broker's
//!   ack of its last produce (or, when a Kafka commit resolved it before that ack
//!   was reported, at its resolution): its duration is the event's whole wait;
//! * its events are `committed` (the transaction's commit time), `decoded` (its
//!   frame read off the replication stream), `produced` (handed to the producer) and
//!   `acked` (when an ack was reported);
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
//! scan of its headers for `traceparent`, the SDK's ids and the sampler's call,
//! nothing else. The sampler is `ParentBased(TraceIdRatioBased(traces.sample_ratio))`
//! unless `OTEL_TRACES_SAMPLER` names another: an event whose writer's trace is
//! sampled is traced, one whose `traceparent` says not sampled is not, one without
//! at the configured ratio. So the writers' own sampling bounds the share of traced
//! events. Sampled spans go to the SDK's batch processor, which exports from its own
//! thread and drops spans when its queue (`OTEL_BSP_MAX_QUEUE_SIZE`, 2,048) is full,
//! so a slow collector never slows the relay; the gRPC exporter's connection runs on
//! a runtime thread of its own, not on the relay's. `bench --modes cdc,cdc-traced`
//! measures the cost per event with every event traced.
//!
//! # Export
//!
//! OTLP, configured by the standard variables: `OTEL_EXPORTER_OTLP_ENDPOINT`,
//! `OTEL_EXPORTER_OTLP_PROTOCOL` (or `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`:
//! `http/protobuf` by default, `http/json`, `grpc`), `OTEL_EXPORTER_OTLP_HEADERS`,
//! `OTEL_SERVICE_NAME` (`outbox-relay` when neither it nor
//! `OTEL_RESOURCE_ATTRIBUTES` names the service). References: the OpenTelemetry specification's
//! "Semantic conventions for messaging spans" and "OTLP Exporter Configuration".

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Span, SpanBuilder, SpanKind, TracerProvider};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};

use crate::config::TracesConfig;
use crate::outbox::OutboxEvent;

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
    /// The ack of its last produce, when it was reported before the resolution.
    pub(crate) acked_at: Option<Instant>,
    /// When the core resolved it.
    pub(crate) resolved_at: Instant,
    /// Partition and offset of that ack.
    pub(crate) delivered: Option<(i32, i64)>,
}

/// The OTLP transport, from `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` or
/// `OTEL_EXPORTER_OTLP_PROTOCOL` (the first one set and not empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transport {
    HttpProtobuf,
    HttpJson,
    Grpc,
}

impl Transport {
    fn from_env() -> Result<Transport, TracesError> {
        let named = [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ]
        .into_iter()
        .find_map(|v| std::env::var(v).ok().filter(|p| !p.trim().is_empty()));
        Transport::parse(named.as_deref())
    }

    fn parse(named: Option<&str>) -> Result<Transport, TracesError> {
        match named.map(|p| p.trim().to_ascii_lowercase()).as_deref() {
            None | Some("http/protobuf") => Ok(Transport::HttpProtobuf),
            Some("http/json") => Ok(Transport::HttpJson),
            Some("grpc") => Ok(Transport::Grpc),
            Some(other) => Err(TracesError(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL {other:?}: use http/protobuf, http/json or grpc"
            ))),
        }
    }
}

/// The tracer of a running relay.
pub(crate) struct EventTraces {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
    /// The gRPC exporter's runtime (its connection's tasks), off the relay's thread.
    grpc_runtime: Option<tokio::runtime::Runtime>,
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
        let transport = Transport::from_env()?;
        let (exporter, grpc_runtime) = exporter(transport)?;
        let mut resource = Resource::builder();
        let named_in_attributes = std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|a| {
            a.split(',')
                .any(|kv| kv.trim().starts_with("service.name="))
        });
        if std::env::var_os("OTEL_SERVICE_NAME").is_none() && !named_in_attributes {
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
            ?transport,
            sample_ratio = config.sample_ratio,
            "exporting a trace span per sampled event over OTLP"
        );
        Ok(Some(EventTraces {
            provider,
            tracer,
            propagator: TraceContextPropagator::new(),
            grpc_runtime,
        }))
    }

    /// Makes the span of one delivered event (module doc), if it is sampled.
    pub(crate) fn delivered(&self, trip: &Trip<'_>) {
        let event = trip.event;
        let parent = self
            .propagator
            .extract_with_context(&Context::new(), &RowHeaders(&event.headers));
        let created = event.created_at_micros().and_then(unix_time);
        let clock = created.is_none().then(WallClock::now);
        let start = match (created, &clock) {
            (Some(t), _) => t,
            (None, Some(clock)) => clock.at(trip.received_at),
            (None, None) => SystemTime::now(),
        };
        let mut span = SpanBuilder::from_name("send")
            .with_kind(SpanKind::Producer)
            .with_start_time(start)
            .start_with_context(&self.tracer, &parent);
        if !span.is_recording() {
            return;
        }
        let clock = clock.unwrap_or_else(WallClock::now);
        span.update_name(format!("send {}", event.topic));
        span.set_attributes(attributes(trip));
        if let Some(committed) = pg_time(trip.committed_at) {
            span.add_event_with_timestamp("committed", committed, Vec::new());
        }
        span.add_event_with_timestamp("decoded", clock.at(trip.received_at), Vec::new());
        span.add_event_with_timestamp("produced", clock.at(trip.produced_at), Vec::new());
        if let Some(acked_at) = trip.acked_at {
            span.add_event_with_timestamp("acked", clock.at(acked_at), Vec::new());
        }
        // The start is the database's clock, the end the relay's: never before it.
        let end = clock
            .at(trip.acked_at.unwrap_or(trip.resolved_at))
            .max(start);
        span.end_with_timestamp(end);
    }
}

/// The exporter for `transport`; for gRPC also the runtime its connection lives on
/// (a thread of its own: the relay's runtime has one thread, which must not encode
/// spans, nor be blocked waiting for an export that needs it at shutdown).
fn exporter(
    transport: Transport,
) -> Result<(SpanExporter, Option<tokio::runtime::Runtime>), TracesError> {
    let builder = SpanExporter::builder();
    let failed = |e: opentelemetry_otlp::ExporterBuildError| TracesError(e.to_string());
    match transport {
        Transport::HttpProtobuf => Ok((
            builder
                .with_http()
                .with_protocol(Protocol::HttpBinary)
                .build()
                .map_err(failed)?,
            None,
        )),
        Transport::HttpJson => Ok((
            builder
                .with_http()
                .with_protocol(Protocol::HttpJson)
                .build()
                .map_err(failed)?,
            None,
        )),
        Transport::Grpc => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name("otlp-grpc")
                .enable_all()
                .build()
                .map_err(|e| TracesError(format!("the gRPC exporter's runtime: {e}")))?;
            let exporter = {
                let _inside = runtime.enter();
                builder.with_tonic().build().map_err(failed)?
            };
            Ok((exporter, Some(runtime)))
        }
    }
}

/// The span's attributes (the messaging conventions, module doc).
fn attributes(trip: &Trip<'_>) -> Vec<KeyValue> {
    let event = trip.event;
    let mut attributes = vec![
        KeyValue::new("messaging.system", "kafka"),
        KeyValue::new("messaging.operation.type", "send"),
        KeyValue::new("messaging.operation.name", "send"),
        KeyValue::new("messaging.destination.name", event.topic.clone()),
        KeyValue::new(
            "messaging.message.id",
            String::from_utf8_lossy(&event.idempotency_key).into_owned(),
        ),
        KeyValue::new(
            "messaging.message.body.size",
            i64::try_from(event.payload.len()).unwrap_or(i64::MAX),
        ),
    ];
    // A key without a text form is left out, as the conventions ask.
    if let Ok(key) = std::str::from_utf8(&event.key) {
        attributes.push(KeyValue::new("messaging.kafka.message.key", key.to_owned()));
    }
    if event.tombstone {
        attributes.push(KeyValue::new("messaging.kafka.message.tombstone", true));
    }
    if let Some((partition, offset)) = trip.delivered {
        attributes.push(KeyValue::new(
            "messaging.destination.partition.id",
            partition.to_string(),
        ));
        attributes.push(KeyValue::new("messaging.kafka.offset", offset));
    }
    attributes
}

impl Drop for EventTraces {
    /// Exports what is queued (bounded by [`SHUTDOWN_TIMEOUT`]) when the relay
    /// stops; the export runs on the processor's thread (and the gRPC runtime), so
    /// waiting for it here cannot wait for this thread.
    fn drop(&mut self) {
        if let Err(e) = self.provider.shutdown_with_timeout(SHUTDOWN_TIMEOUT) {
            tracing::warn!(error = %e, "traces: the last spans may not have been exported");
        }
        if let Some(runtime) = self.grpc_runtime.take() {
            runtime.shutdown_background();
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

/// Unix microseconds as a `SystemTime` (`None` before 1970).
fn unix_time(micros: i64) -> Option<SystemTime> {
    UNIX_EPOCH.checked_add(Duration::from_micros(u64::try_from(micros).ok()?))
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
    fn the_transport_follows_the_standard_variable_and_defaults_to_protobuf() {
        assert_eq!(Transport::parse(None).unwrap(), Transport::HttpProtobuf);
        assert_eq!(Transport::parse(Some(" GRPC ")).unwrap(), Transport::Grpc);
        assert_eq!(
            Transport::parse(Some("http/json")).unwrap(),
            Transport::HttpJson
        );
        let err = Transport::parse(Some("udp")).unwrap_err();
        assert!(err.to_string().contains("http/protobuf, http/json or grpc"));
    }

    #[test]
    fn times_convert_from_postgres_and_from_unix_microseconds() {
        // 2000-01-01T00:00:01Z
        assert_eq!(
            pg_time(1_000_000),
            Some(UNIX_EPOCH + Duration::from_secs(PG_EPOCH_UNIX_SECS + 1))
        );
        assert_eq!(pg_time(-1), None);
        assert_eq!(
            unix_time(1_500_000),
            Some(UNIX_EPOCH + Duration::from_millis(1_500))
        );
        assert_eq!(unix_time(-1), None);
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
