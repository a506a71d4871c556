//! Metrics and health over HTTP: Prometheus text at `/metrics`, liveness at
//! `/healthz`, readiness at `/readyz`.
//!
//! **Why these metrics.** An outbox relay fails quietly: the process stays up while
//! the slot stops advancing, and the first symptom is a full disk on the database
//! (the slot retains WAL) or a consumer asking where its events went. So besides
//! throughput the relay exports the two positions that matter — the LSN it has
//! *received* and the LSN it has *confirmed* to the server — plus the server's own
//! view of the slot (lag to `pg_current_wal_lsn()` and retained WAL, sampled by the
//! heartbeat task, see `crate::cdc::heartbeat`), the in-flight window, and the delivery
//! latency from the transaction's commit timestamp to the broker's ack. Names are
//! constants so dashboards, alerts and tests agree on them.
//!
//! **Why per-stage latencies.** Commit → ack alone says *that* an event was late, not
//! *where*: in the walsender, in the relay, in the producer's batching, or at the
//! broker. So the same way is cut into four stages (`STAGES`, one histogram with a
//! `stage` label): commit → frame received, received → produced, produced → acked,
//! acked → confirmed. The first compares the server's commit timestamp with the
//! relay's clock (one host, or clocks kept in sync); the others use the relay's
//! monotonic clock. The `bench` command reads them from this endpoint to print its
//! per-stage table.
//!
//! **Why readiness is about progress, not connections.** A relay whose broker is
//! gone keeps its replication connection and looks healthy to a TCP probe. `/readyz`
//! is 200 only while the relay streams from the slot *and* either nothing is
//! pending or the confirmed LSN advanced within `metrics.ready_stall_secs`; a stalled
//! relay turns not-ready, a standby (waiting for a slot another relay holds) is
//! not ready, and `/healthz` stays 200 as long as the process serves HTTP.
//! The same verdict is exported as `READY`, with `STREAMING` and `SLOT_LAG_SECONDS`
//! beside it, all three set on each scrape from [`Health`] (`Health::publish`):
//! they depend on the clock as much as on events, and exist from the first scrape.
//!
//! **Why these crates.** `metrics` is the de-facto facade (cheap handles, no global
//! lock on the hot path) and `metrics-exporter-prometheus` renders the exposition
//! format correctly (escaping, histogram buckets) — neither is worth re-writing.
//! The exporter's own listener cannot serve health endpoints, so a minimal `axum`
//! router (HTTP/1 only, no default features) serves all three paths.
//!
//! The endpoint is off by default (`metrics.listen = ""`): two relays on one host
//! (the usual HA setup) would otherwise collide on a port, and an operator enabling
//! it chooses the address (`127.0.0.1:9187` keeps it on loopback). It is read-only:
//! three `GET` routes (and `HEAD`), no other method, nothing that changes the relay,
//! so exposing it can leak lag and throughput figures but cannot steer the relay; it
//! has no authentication, hence loopback or a private interface.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::error::{Error, Result};
use crate::postgres::replication::frames::pg_epoch_micros;

/// `oldest_pending_commit` when no event is pending.
const NOTHING_PENDING: i64 = i64::MIN;

/// Counter, label `topic`: events acknowledged by the broker.
pub(crate) const EVENTS_RELAYED: &str = "outbox_relay_events_relayed_total";
/// Counter, label `topic`: events whose `poison_outbox` insert committed.
pub(crate) const EVENTS_POISONED: &str = "outbox_relay_events_poisoned_total";
/// Histogram (seconds): commit timestamp of the event's transaction to broker ack.
pub(crate) const DELIVERY_LATENCY: &str = "outbox_relay_delivery_latency_seconds";
/// Histogram (seconds), label `stage` (one of [`STAGES`]): the time an event spends in
/// one stage of its way through the relay. The stages add up to commit → confirmed.
pub(crate) const STAGE_LATENCY: &str = "outbox_relay_stage_latency_seconds";
/// Transaction commit (its timestamp in pgoutput's `Begin`) → the relay took the
/// event's XLogData frame off the stream: the walsender's decoding and send cadence,
/// the network, and any wait of the frame in the socket while the window was full.
pub(crate) const STAGE_COMMIT_TO_RECEIVED: &str = "commit_to_received";
/// Frame taken → record handed to librdkafka (first attempt): the relay's own work,
/// plus waits behind a full window or a held key.
pub(crate) const STAGE_RECEIVED_TO_PRODUCED: &str = "received_to_produced";
/// Handed to librdkafka (last attempt) → its delivery report reached the relay's loop:
/// `linger.ms`, the produce request's round trip with `acks=all`, the report channel.
pub(crate) const STAGE_PRODUCED_TO_ACKED: &str = "produced_to_acked";
/// The event's transaction resolved (the commit watermark passed it) → a standby
/// status confirming it was sent: the status cadence and the position save before it.
pub(crate) const STAGE_ACKED_TO_CONFIRMED: &str = "acked_to_confirmed";
/// The `stage` labels of `STAGE_LATENCY`, in the order an event passes them.
pub(crate) const STAGES: [&str; 4] = [
    STAGE_COMMIT_TO_RECEIVED,
    STAGE_RECEIVED_TO_PRODUCED,
    STAGE_PRODUCED_TO_ACKED,
    STAGE_ACKED_TO_CONFIRMED,
];
/// Gauge: events produced (or being poisoned) and not yet resolved.
pub(crate) const IN_FLIGHT_EVENTS: &str = "outbox_relay_in_flight_events";
/// Gauge: payload bytes of the in-flight events.
pub(crate) const IN_FLIGHT_BYTES: &str = "outbox_relay_in_flight_bytes";
/// Gauge: highest WAL position received from the server (as a number).
pub(crate) const RECEIVED_LSN: &str = "outbox_relay_received_lsn";
/// Gauge: the confirmed (flush) LSN last sent to the server (as a number).
pub(crate) const CONFIRMED_LSN: &str = "outbox_relay_confirmed_lsn";
/// Gauge: `pg_current_wal_lsn() - confirmed_flush_lsn` of the slot, bytes.
pub(crate) const SLOT_LAG_BYTES: &str = "outbox_relay_slot_lag_bytes";
/// Gauge: `pg_current_wal_lsn() - restart_lsn` of the slot: WAL the slot retains.
pub(crate) const SLOT_RETAINED_WAL_BYTES: &str = "outbox_relay_slot_retained_wal_bytes";
/// Gauge: `safe_wal_size` of the slot (bytes of WAL the server may still write before
/// the slot is invalidated by `max_slot_wal_keep_size`), 0 at or past the limit,
/// `+Inf` when the server has no limit (`-1`, or before PostgreSQL 13).
pub(crate) const SLOT_SAFE_WAL_BYTES: &str = "outbox_relay_slot_safe_wal_bytes";
/// Gauge (seconds): age of the oldest event received and not yet confirmed (now minus
/// its transaction's commit timestamp), 0 when nothing is pending.
pub(crate) const SLOT_LAG_SECONDS: &str = "outbox_relay_slot_lag_seconds";
/// Counter: delivery reports with a transient (retried) broker error.
pub(crate) const BROKER_TRANSIENT_ERRORS: &str = "outbox_relay_broker_transient_errors_total";
/// Counter: replication sessions lost and re-established.
pub(crate) const RECONNECTS: &str = "outbox_relay_reconnects_total";
/// Counter: pauses in reading the replication stream (`relay.read_pause_ms`).
pub(crate) const READ_PAUSES: &str = "outbox_relay_read_pauses_total";
/// Counter: logical decoding messages that are not events of this relay, by
/// `reason` (`foreign_prefix`, `other_outbox`, `not_transactional`).
pub(crate) const MESSAGES_IGNORED: &str = "outbox_relay_messages_ignored_total";
/// Gauge: 1 while the relay streams from its slot, else 0 (from the start).
pub(crate) const STREAMING: &str = "outbox_relay_streaming";
/// Gauge: 1 while `/readyz` would answer 200, else 0 (from the start).
pub(crate) const READY: &str = "outbox_relay_ready";
/// Histogram (seconds): heartbeat message emitted on the metadata connection until
/// it came back through the replication stream.
pub(crate) const HEARTBEAT_ROUND_TRIP: &str = "outbox_relay_heartbeat_round_trip_seconds";
/// Counter: heartbeats that could not be emitted (metadata connection problems).
pub(crate) const HEARTBEAT_FAILURES: &str = "outbox_relay_heartbeat_failures_total";

/// Counter: slots found lost (missing, invalidated, re-created) with progress recorded.
pub(crate) const SLOT_LOSSES: &str = "outbox_relay_slot_losses_total";
/// Counter: outbox rows published (or poisoned) by resyncs after a lost slot.
pub(crate) const RESYNCED_ROWS: &str = "outbox_relay_resynced_rows_total";
/// Counter: producers replaced because they stopped reporting (or failed fatally).
pub(crate) const PRODUCER_RESTARTS: &str = "outbox_relay_producer_restarts_total";
/// Kafka transactions ended (`kafka.delivery = "exactly-once"`), by `outcome`:
/// `committed`, `aborted`, or `timed_out` (the coordinator aborted it on its timeout
/// and fenced the producer while this relay held the slot).
pub(crate) const KAFKA_TRANSACTIONS: &str = "outbox_relay_kafka_transactions_total";
/// Gauge: sessions in a row that ended at the same confirmed position (0 when the
/// last session made progress).
pub(crate) const REPEATED_FAILURES: &str = "outbox_relay_repeated_session_failures";
/// Counter, label `kind`: delivery failures about a topic's or the cluster's setup
/// (missing topic, no authorization…), whether they block or poison.
pub(crate) const CONFIGURATION_ERRORS: &str = "outbox_relay_configuration_errors_total";
/// Gauge: topics whose events are held by a configuration error (`block` mode).
pub(crate) const BLOCKED_TOPICS: &str = "outbox_relay_blocked_topics";
/// Gauge: the position last saved in the relay's position table (as a number).
pub(crate) const SAVED_LSN: &str = "outbox_relay_saved_lsn";
/// Counter: saves of the position table that failed (retried).
pub(crate) const POSITION_SAVE_FAILURES: &str = "outbox_relay_position_save_failures_total";
/// Gauge: keys this relay knows to be parked (`relay.on_poison = "park-key"`).
pub(crate) const PARKED_KEYS: &str = "outbox_relay_parked_keys";
/// Counter: events written to the poison table as parked behind a poisoned one.
pub(crate) const EVENTS_PARKED: &str = "outbox_relay_events_parked_total";
/// Gauge: events that would have been poisoned and hold the relay
/// (`relay.on_poison = "halt"`).
pub(crate) const HALTED_EVENTS: &str = "outbox_relay_halted_events";

/// Latency buckets (seconds): 100 µs to 2 min, dense between 1 and 100 ms, where
/// live traffic lands and where a percentile read from the buckets (linear within a
/// bucket, as `histogram_quantile` does) must be good to a millisecond or two.
const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Installs the Prometheus recorder as the process-wide `metrics` recorder.
///
/// # Errors
///
/// [`Error::MetricsRecorder`] when a recorder is already installed.
pub fn install_recorder() -> Result<PrometheusHandle> {
    let builder = [DELIVERY_LATENCY, STAGE_LATENCY, HEARTBEAT_ROUND_TRIP]
        .into_iter()
        .try_fold(PrometheusBuilder::new(), |b, name| {
            b.set_buckets_for_metric(Matcher::Full(name.to_owned()), LATENCY_BUCKETS)
        })
        .map_err(Error::MetricsBuckets)?;
    let handle = builder.install_recorder().map_err(Error::MetricsRecorder)?;
    describe();
    Ok(handle)
}

/// Registers help texts (the `# HELP` lines).
fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(EVENTS_RELAYED, "Events acknowledged by the broker");
    describe_counter!(EVENTS_POISONED, "Events written to the poison table");
    describe_histogram!(
        DELIVERY_LATENCY,
        Unit::Seconds,
        "Transaction commit to broker acknowledgement"
    );
    describe_histogram!(
        STAGE_LATENCY,
        Unit::Seconds,
        format!("Time an event spends in one stage: {}", STAGES.join(", "))
    );
    describe_gauge!(IN_FLIGHT_EVENTS, "Events produced and not yet resolved");
    describe_gauge!(IN_FLIGHT_BYTES, Unit::Bytes, "Payload bytes in flight");
    describe_gauge!(RECEIVED_LSN, "Highest WAL position received");
    describe_gauge!(CONFIRMED_LSN, "Confirmed flush LSN sent to the server");
    describe_gauge!(
        SLOT_LAG_BYTES,
        Unit::Bytes,
        "Current WAL LSN minus the slot's confirmed LSN"
    );
    describe_gauge!(
        SLOT_RETAINED_WAL_BYTES,
        Unit::Bytes,
        "WAL retained by the slot"
    );
    describe_gauge!(
        SLOT_SAFE_WAL_BYTES,
        Unit::Bytes,
        "WAL the server may still write before it invalidates the slot (+Inf without max_slot_wal_keep_size)"
    );
    describe_gauge!(
        SLOT_LAG_SECONDS,
        Unit::Seconds,
        "Age of the oldest event received and not yet confirmed (now minus its commit time), 0 when none"
    );
    describe_counter!(BROKER_TRANSIENT_ERRORS, "Transient broker errors (retried)");
    describe_counter!(
        crate::kafka::PRODUCE_REQUESTS,
        "Produce requests sent to the brokers (librdkafka statistics, once a second)"
    );
    describe_counter!(
        crate::kafka::RECORDS_TRANSMITTED,
        "Records carried by those produce requests (librdkafka statistics)"
    );
    describe_counter!(RECONNECTS, "Replication sessions re-established");
    describe_counter!(
        READ_PAUSES,
        "Pauses in reading the replication stream once caught up (relay.read_pause_ms)"
    );
    describe_counter!(
        MESSAGES_IGNORED,
        "Logical decoding messages that are not events of this relay, by reason"
    );
    describe_gauge!(STREAMING, "1 while streaming from the slot");
    describe_gauge!(
        READY,
        "1 while /readyz answers 200 (streaming, progressing, no alert)"
    );
    describe_histogram!(
        HEARTBEAT_ROUND_TRIP,
        Unit::Seconds,
        "Heartbeat emit to receipt"
    );
    describe_counter!(HEARTBEAT_FAILURES, "Heartbeats that could not be emitted");
    describe_counter!(
        SLOT_LOSSES,
        "Replication slots found missing, invalidated or re-created after progress was recorded"
    );
    describe_counter!(
        RESYNCED_ROWS,
        "Outbox rows published or poisoned by resyncs after a lost slot"
    );
    describe_counter!(
        KAFKA_TRANSACTIONS,
        "Kafka transactions ended in exactly-once mode, by outcome (committed, aborted)"
    );
    describe_counter!(
        PRODUCER_RESTARTS,
        "Kafka producers replaced because they stopped reporting or failed fatally"
    );
    describe_gauge!(
        REPEATED_FAILURES,
        "Replication sessions in a row that ended without progress at the same position"
    );
    describe_gauge!(
        SAVED_LSN,
        "Position last saved in the relay's position table"
    );
    describe_counter!(
        POSITION_SAVE_FAILURES,
        "Failed writes of the relay's position table (retried)"
    );
    describe_gauge!(
        PARKED_KEYS,
        "Keys parked behind a poisoned event until replay releases them"
    );
    describe_counter!(
        EVENTS_PARKED,
        "Events written to the poison table as parked behind a poisoned event of their key"
    );
    describe_gauge!(
        HALTED_EVENTS,
        "Events the relay would have poisoned and that hold it (relay.on_poison = halt)"
    );
}

/// What the relay tells the health endpoints; cheap to update from the hot loop.
#[derive(Debug, Clone)]
pub struct Health(Arc<HealthState>);

#[derive(Debug)]
struct HealthState {
    origin: Instant,
    streaming: AtomicBool,
    pending: AtomicU64,
    /// Milliseconds since `origin` of the last confirmed-LSN advance (or of the
    /// moment the pending count went from zero to non-zero).
    last_progress_ms: AtomicU64,
    /// Commit timestamp (µs since 2000-01-01, the server's clock) of the oldest event
    /// received and not yet confirmed; [`NOTHING_PENDING`] when there is none.
    oldest_pending_commit: AtomicI64,
    /// Conditions an operator must know about, by source (slot lost and resyncing,
    /// producer wedged, sessions failing again and again at one position, topics
    /// refusing events): not ready while any is raised.
    alerts: std::sync::Mutex<std::collections::BTreeMap<&'static str, String>>,
}

impl Default for Health {
    fn default() -> Self {
        Health(Arc::new(HealthState {
            origin: Instant::now(),
            streaming: AtomicBool::new(false),
            pending: AtomicU64::new(0),
            last_progress_ms: AtomicU64::new(0),
            oldest_pending_commit: AtomicI64::new(NOTHING_PENDING),
            alerts: std::sync::Mutex::new(std::collections::BTreeMap::new()),
        }))
    }
}

impl Health {
    fn millis(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.0.origin).as_millis()).unwrap_or(u64::MAX)
    }

    /// The relay started or stopped streaming from its slot.
    pub(crate) fn set_streaming(&self, streaming: bool, now: Instant) {
        if streaming && !self.0.streaming.load(Ordering::Relaxed) {
            self.0
                .last_progress_ms
                .store(self.millis(now), Ordering::Relaxed);
        }
        self.0.streaming.store(streaming, Ordering::Relaxed);
    }

    /// The commit timestamp (µs since 2000-01-01) of the oldest event received and
    /// not yet confirmed, `None` when nothing is pending.
    pub(crate) fn set_oldest_pending_commit(&self, committed_at: Option<i64>) {
        self.0
            .oldest_pending_commit
            .store(committed_at.unwrap_or(NOTHING_PENDING), Ordering::Relaxed);
    }

    /// Seconds from the oldest pending event's commit to `now` (0 when none).
    #[must_use]
    pub(crate) fn slot_lag(&self, now: SystemTime) -> f64 {
        lag_seconds(
            self.0.oldest_pending_commit.load(Ordering::Relaxed),
            pg_epoch_micros(now),
        )
    }

    /// Sets the gauges that follow from this state — `STREAMING`, `READY` and
    /// `SLOT_LAG_SECONDS` — as they are at `now` (the relay's endpoint calls it on
    /// each scrape, before rendering).
    ///
    /// Why at the scrape: readiness and the lag depend on the time as much as on
    /// events (a stall is "no advance for `stall`", the lag grows while nothing
    /// happens), so a gauge set when events happen would go stale exactly when the
    /// relay is stuck. Computed when read, with the clock `/readyz` uses, they give
    /// the same verdict, cost nothing per event, and exist from the first scrape.
    pub(crate) fn publish(&self, now: Instant, wall: SystemTime, stall: Duration) {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        let ready = self.readiness(now, stall) == Readiness::Ready;
        metrics::gauge!(STREAMING).set(flag(self.0.streaming.load(Ordering::Relaxed)));
        metrics::gauge!(READY).set(flag(ready));
        metrics::gauge!(SLOT_LAG_SECONDS).set(self.slot_lag(wall));
    }

    /// Records the in-flight count and whether the confirmed LSN just advanced.
    pub(crate) fn observe(&self, pending: usize, advanced: bool, now: Instant) {
        let pending = u64::try_from(pending).unwrap_or(u64::MAX);
        let was_idle = self.0.pending.swap(pending, Ordering::Relaxed) == 0;
        // Becoming busy starts the stall clock; so does every advance.
        if advanced || (was_idle && pending > 0) {
            self.0
                .last_progress_ms
                .store(self.millis(now), Ordering::Relaxed);
        }
    }

    /// Raises (`Some`) or clears (`None`) the alert of `source` that `/readyz`
    /// reports.
    pub(crate) fn set_alert(&self, source: &'static str, alert: Option<String>) {
        // A poisoned lock only means a panic elsewhere; the value is still usable.
        let mut alerts = self
            .0
            .alerts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match alert {
            Some(text) => alerts.insert(source, text),
            None => alerts.remove(source),
        };
    }

    /// The alerts raised, joined, if any.
    #[must_use]
    pub(crate) fn alert(&self) -> Option<String> {
        let alerts = self
            .0
            .alerts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (!alerts.is_empty()).then(|| alerts.values().cloned().collect::<Vec<_>>().join("; "))
    }

    /// The readiness verdict at `now`.
    #[must_use]
    pub(crate) fn readiness(&self, now: Instant, stall: Duration) -> Readiness {
        if let Some(alert) = self.alert() {
            return Readiness::Alert(alert);
        }
        let since = self
            .millis(now)
            .saturating_sub(self.0.last_progress_ms.load(Ordering::Relaxed));
        judge(
            self.0.streaming.load(Ordering::Relaxed),
            self.0.pending.load(Ordering::Relaxed),
            Duration::from_millis(since),
            stall,
        )
    }
}

/// Seconds from `committed_at` to `now` (both µs since 2000-01-01), 0 when nothing
/// is pending ([`NOTHING_PENDING`]) or the clocks disagree.
fn lag_seconds(committed_at: i64, now: i64) -> f64 {
    if committed_at == NOTHING_PENDING {
        return 0.0;
    }
    // Exact enough: lags are far below 2^53 µs.
    #[allow(clippy::cast_precision_loss)]
    let seconds = now.saturating_sub(committed_at).max(0) as f64 / 1e6;
    seconds
}

/// `/readyz`'s answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Readiness {
    Ready,
    /// Not streaming: starting, reconnecting, or a standby waiting for the slot.
    NotStreaming,
    /// Events pending and the confirmed LSN has not moved for this long.
    Stalled {
        pending: u64,
        since: Duration,
    },
    /// A condition the relay raised (see [`Health::set_alert`]).
    Alert(String),
}

impl Readiness {
    /// The HTTP status and body for it.
    #[must_use]
    pub(crate) fn response(&self) -> (StatusCode, String) {
        match self {
            Readiness::Ready => (StatusCode::OK, "ready\n".to_owned()),
            Readiness::NotStreaming => (
                StatusCode::SERVICE_UNAVAILABLE,
                "not ready: not streaming from the replication slot\n".to_owned(),
            ),
            Readiness::Stalled { pending, since } => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "not ready: {pending} events pending and the confirmed LSN has not advanced for {}s\n",
                    since.as_secs()
                ),
            ),
            Readiness::Alert(alert) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: {alert}\n"),
            ),
        }
    }
}

/// Pure readiness rule (see the module doc).
#[must_use]
pub(crate) fn judge(
    streaming: bool,
    pending: u64,
    since_progress: Duration,
    stall: Duration,
) -> Readiness {
    if !streaming {
        Readiness::NotStreaming
    } else if pending > 0 && since_progress >= stall {
        Readiness::Stalled {
            pending,
            since: since_progress,
        }
    } else {
        Readiness::Ready
    }
}

#[derive(Clone)]
struct ServerState {
    handle: PrometheusHandle,
    health: Health,
    stall: Duration,
}

/// Binds `listen` and serves `/metrics`, `/healthz` and `/readyz` until the process
/// ends. Returns the bound address (useful with port 0).
///
/// # Errors
///
/// [`Error::MetricsBind`] when the address is invalid or cannot be bound.
pub async fn serve(
    listen: &str,
    handle: PrometheusHandle,
    health: Health,
    stall: Duration,
) -> Result<SocketAddr> {
    let app = liveness()
        .route("/metrics", get(relay_metrics_page))
        .route("/readyz", get(readyz))
        .with_state(ServerState {
            handle: handle.clone(),
            health,
            stall,
        });
    serve_app(listen, handle, app).await
}

/// The poller's endpoint: `/metrics` (its producer's `outbox_relay_kafka_*`
/// counters) and `/healthz`. No `/readyz`: readiness as `serve` judges it (streaming
/// from a slot, confirmed position moving) means nothing for a poller.
///
/// # Errors
///
/// [`Error::MetricsBind`] when the address is invalid or cannot be bound.
pub async fn serve_poller(listen: &str, handle: PrometheusHandle) -> Result<SocketAddr> {
    let app = liveness()
        .route("/metrics", get(metrics_page))
        .with_state(ServerState {
            handle: handle.clone(),
            health: Health::default(),
            stall: Duration::ZERO,
        });
    serve_app(listen, handle, app).await
}

/// The route the relay and the poller both serve; each adds its `/metrics`.
fn liveness() -> Router<ServerState> {
    Router::new().route("/healthz", get(|| async { "ok\n" }))
}

async fn serve_app(listen: &str, handle: PrometheusHandle, app: Router) -> Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| Error::MetricsBind {
            listen: listen.to_owned(),
            source,
        })?;
    let addr = listener.local_addr().map_err(Error::MetricsListener)?;
    // Histograms are summarised lazily; upkeep keeps their memory bounded when
    // nobody scrapes.
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(5));
        loop {
            tick.tick().await;
            handle.run_upkeep();
        }
    });
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics endpoint stopped");
        }
    });
    tracing::info!(%addr, "metrics and health endpoints listening");
    Ok(addr)
}

async fn metrics_page(State(state): State<ServerState>) -> String {
    state.handle.render()
}

/// The relay's page: the gauges that follow from [`Health`] are set first.
async fn relay_metrics_page(State(state): State<ServerState>) -> String {
    state
        .health
        .publish(Instant::now(), SystemTime::now(), state.stall);
    state.handle.render()
}

async fn readyz(State(state): State<ServerState>) -> (StatusCode, String) {
    state
        .health
        .readiness(Instant::now(), state.stall)
        .response()
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALL: Duration = Duration::from_secs(60);

    /// The status line of one HTTP/1.1 request to `addr`.
    async fn status_line(addr: SocketAddr, method: &str, path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: relay\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(request.as_bytes()).await.expect("send");
        let mut response = Vec::new();
        stream.read_to_end(&mut response).await.expect("read");
        let text = String::from_utf8_lossy(&response);
        text.lines().next().unwrap_or_default().to_owned()
    }

    #[tokio::test]
    async fn the_endpoint_is_read_only() {
        let handle = PrometheusBuilder::new().build_recorder().handle();
        let addr = serve("127.0.0.1:0", handle, Health::default(), STALL)
            .await
            .expect("serve");
        for path in ["/metrics", "/healthz", "/readyz"] {
            assert!(
                !status_line(addr, "GET", path).await.contains(" 405 "),
                "GET {path}"
            );
            for method in ["POST", "PUT", "PATCH", "DELETE"] {
                assert_eq!(
                    status_line(addr, method, path).await,
                    "HTTP/1.1 405 Method Not Allowed",
                    "{method} {path}"
                );
            }
        }
        assert_eq!(
            status_line(addr, "POST", "/admin").await,
            "HTTP/1.1 404 Not Found"
        );
    }

    #[tokio::test]
    async fn the_pollers_endpoint_serves_metrics_and_liveness_only() {
        let handle = PrometheusBuilder::new().build_recorder().handle();
        let addr = serve_poller("127.0.0.1:0", handle).await.expect("serve");
        for path in ["/metrics", "/healthz"] {
            assert_eq!(
                status_line(addr, "GET", path).await,
                "HTTP/1.1 200 OK",
                "GET {path}"
            );
        }
        assert_eq!(
            status_line(addr, "GET", "/readyz").await,
            "HTTP/1.1 404 Not Found"
        );
        assert_eq!(
            status_line(addr, "POST", "/metrics").await,
            "HTTP/1.1 405 Method Not Allowed"
        );
    }

    #[test]
    fn not_streaming_is_not_ready() {
        assert_eq!(
            judge(false, 0, Duration::ZERO, STALL),
            Readiness::NotStreaming
        );
    }

    #[test]
    fn idle_is_ready_however_long() {
        assert_eq!(
            judge(true, 0, Duration::from_secs(3600), STALL),
            Readiness::Ready
        );
    }

    #[test]
    fn pending_without_progress_turns_stalled_at_the_window() {
        assert_eq!(
            judge(true, 5, Duration::from_secs(59), STALL),
            Readiness::Ready
        );
        assert_eq!(
            judge(true, 5, STALL, STALL),
            Readiness::Stalled {
                pending: 5,
                since: STALL
            }
        );
    }

    #[test]
    fn an_alert_is_not_ready_until_cleared() {
        let health = Health::default();
        let t0 = Instant::now();
        health.set_streaming(true, t0);
        health.set_alert(
            "slot",
            Some("replication slot s is missing; resyncing".into()),
        );
        health.set_alert("topics", Some("topic t does not exist".into()));
        let answer = health.readiness(t0, STALL);
        assert_eq!(
            answer.response().1,
            "not ready: replication slot s is missing; resyncing; topic t does not exist\n"
        );
        health.set_alert("slot", None);
        assert!(matches!(health.readiness(t0, STALL), Readiness::Alert(_)));
        health.set_alert("topics", None);
        assert_eq!(health.readiness(t0, STALL), Readiness::Ready);
    }

    #[test]
    fn health_tracks_progress() {
        let health = Health::default();
        let t0 = Instant::now();
        assert_eq!(health.readiness(t0, STALL), Readiness::NotStreaming);
        health.set_streaming(true, t0);
        assert_eq!(health.readiness(t0, STALL), Readiness::Ready);
        // Busy from t0 + 10 s, no advance: stalled 60 s later, not before.
        health.observe(3, false, t0 + Duration::from_secs(10));
        assert_eq!(
            health.readiness(t0 + Duration::from_secs(69), STALL),
            Readiness::Ready
        );
        assert!(matches!(
            health.readiness(t0 + Duration::from_secs(70), STALL),
            Readiness::Stalled { pending: 3, .. }
        ));
        // An advance makes it ready again; so does draining.
        health.observe(3, true, t0 + Duration::from_secs(71));
        assert_eq!(
            health.readiness(t0 + Duration::from_secs(72), STALL),
            Readiness::Ready
        );
        health.observe(0, false, t0 + Duration::from_secs(500));
        assert_eq!(
            health.readiness(t0 + Duration::from_secs(900), STALL),
            Readiness::Ready
        );
        health.set_streaming(false, t0 + Duration::from_secs(901));
        assert_eq!(
            health.readiness(t0 + Duration::from_secs(901), STALL),
            Readiness::NotStreaming
        );
    }

    /// The value of the unlabelled series `name` on a rendered page.
    fn value(page: &str, name: &str) -> Option<f64> {
        page.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    }

    /// Publishes `health` at `now` into a fresh recorder and renders it.
    fn published(health: &Health, now: Instant, wall: SystemTime) -> String {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || health.publish(now, wall, STALL));
        handle.render()
    }

    #[test]
    fn published_gauges_follow_readiness_and_exist_from_the_start() {
        let health = Health::default();
        let t0 = Instant::now();
        let wall = SystemTime::now();
        let page = published(&health, t0, wall);
        assert_eq!(value(&page, STREAMING), Some(0.0), "{page}");
        assert_eq!(value(&page, READY), Some(0.0), "{page}");
        assert_eq!(value(&page, SLOT_LAG_SECONDS), Some(0.0), "{page}");
        health.set_streaming(true, t0);
        let page = published(&health, t0, wall);
        assert_eq!(value(&page, STREAMING), Some(1.0), "{page}");
        assert_eq!(value(&page, READY), Some(1.0), "{page}");
        // Busy and no advance: the gauge turns 0 with time alone, as /readyz does.
        health.observe(2, false, t0);
        let later = t0 + STALL;
        assert!(matches!(
            health.readiness(later, STALL),
            Readiness::Stalled { .. }
        ));
        assert_eq!(value(&published(&health, later, wall), READY), Some(0.0));
        health.observe(2, true, later);
        assert_eq!(value(&published(&health, later, wall), READY), Some(1.0));
        health.set_alert("topics", Some("topic t does not exist".into()));
        assert_eq!(value(&published(&health, later, wall), READY), Some(0.0));
    }

    #[test]
    fn slot_lag_is_the_oldest_pending_commits_age() {
        let health = Health::default();
        let wall = SystemTime::now();
        let now = pg_epoch_micros(wall);
        assert!(health.slot_lag(wall).abs() < f64::EPSILON);
        health.set_oldest_pending_commit(Some(now - 90_500_000));
        assert!((health.slot_lag(wall) - 90.5).abs() < 1e-9);
        assert_eq!(
            value(&published(&health, Instant::now(), wall), SLOT_LAG_SECONDS),
            Some(90.5)
        );
        // A commit "in the future" (clocks apart) is no lag, not a negative one.
        health.set_oldest_pending_commit(Some(now + 1_000_000));
        assert!(health.slot_lag(wall).abs() < f64::EPSILON);
        health.set_oldest_pending_commit(None);
        assert!(health.slot_lag(wall).abs() < f64::EPSILON);
    }

    #[test]
    fn stalled_response_names_the_cause() {
        let (code, body) = Readiness::Stalled {
            pending: 7,
            since: Duration::from_secs(61),
        }
        .response();
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("7 events pending"), "{body}");
    }
}
