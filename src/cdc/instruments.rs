//! The relay's metric handles, registered once so the hot path only touches atomics.
//!
//! The `metrics` macros look their metric up in the recorder's registry on every call
//! (a hash of name and labels); at tens of thousands of events a second that is
//! measurable. So the session registers every handle when it starts and keeps the
//! per-topic counters in a map by topic, created on the first event of each topic.
//! Names and meanings are in `crate::cdc::metrics`.

use std::collections::HashMap;
use std::time::{Instant, SystemTime};

use ::metrics::{Counter, Gauge, Histogram};

use crate::cdc::heartbeat;
use crate::cdc::metrics::{self as m, Health};
use crate::cdc::progress::Core;
use crate::lsn::Lsn;
use crate::postgres::pgoutput::LogicalDecodingMessage;
use crate::postgres::replication::frames::pg_epoch_micros;

/// Topics counted under their own name; the others are counted together.
const MAX_TOPIC_SERIES: usize = 200;

/// The `topic` label of the topics past [`MAX_TOPIC_SERIES`].
const OTHER_TOPICS: &str = "_other";

/// Metric handles of one relay process.
pub(crate) struct Instruments {
    in_flight_events: Gauge,
    in_flight_bytes: Gauge,
    received: Gauge,
    confirmed: Gauge,
    latency: Histogram,
    transient_errors: Counter,
    reconnects: Counter,
    heartbeat_round_trip: Histogram,
    /// `(relayed, poisoned)` counters per topic.
    per_topic: HashMap<String, (Counter, Counter)>,
    /// The confirmed LSN at the last [`Instruments::observe`], to tell an advance.
    last_confirmed: Lsn,
}

impl Instruments {
    pub(crate) fn new() -> Self {
        Instruments {
            in_flight_events: ::metrics::gauge!(m::IN_FLIGHT_EVENTS),
            in_flight_bytes: ::metrics::gauge!(m::IN_FLIGHT_BYTES),
            received: ::metrics::gauge!(m::RECEIVED_LSN),
            confirmed: ::metrics::gauge!(m::CONFIRMED_LSN),
            latency: ::metrics::histogram!(m::DELIVERY_LATENCY),
            transient_errors: ::metrics::counter!(m::BROKER_TRANSIENT_ERRORS),
            reconnects: ::metrics::counter!(m::RECONNECTS),
            heartbeat_round_trip: ::metrics::histogram!(m::HEARTBEAT_ROUND_TRIP),
            per_topic: HashMap::new(),
            last_confirmed: Lsn::ZERO,
        }
    }

    fn topic(&mut self, topic: &str) -> &(Counter, Counter) {
        // Topics come from row data (a topic column, a template): past the cap, the
        // rest share one series, so a bad row cannot grow the scrape without bound.
        let topic = if self.per_topic.contains_key(topic) || self.per_topic.len() < MAX_TOPIC_SERIES
        {
            topic
        } else {
            OTHER_TOPICS
        };
        if !self.per_topic.contains_key(topic) {
            let label = topic.to_owned();
            let counters = (
                ::metrics::counter!(m::EVENTS_RELAYED, "topic" => label.clone()),
                ::metrics::counter!(m::EVENTS_POISONED, "topic" => label.clone()),
            );
            self.per_topic.insert(label, counters);
        }
        &self.per_topic[topic]
    }

    /// An event of `topic` was acked; its transaction committed at `committed_at`
    /// (µs since 2000-01-01).
    pub(crate) fn delivered(&mut self, topic: &str, committed_at: i64) {
        let now = pg_epoch_micros(SystemTime::now());
        let micros = now.saturating_sub(committed_at).max(0);
        // Lossless enough: latencies are far below 2^53 µs.
        #[allow(clippy::cast_precision_loss)]
        let seconds = micros as f64 / 1e6;
        self.latency.record(seconds);
        self.topic(topic).0.increment(1);
    }

    /// An event of `topic` (`""` for a row that has none) was poisoned.
    pub(crate) fn poisoned(&mut self, topic: &str) {
        self.topic(topic).1.increment(1);
    }

    /// A delivery report with a transient (retried) broker error.
    pub(crate) fn transient_error(&self) {
        self.transient_errors.increment(1);
    }

    /// A replication session was lost and is being re-established.
    pub(crate) fn reconnect(&self) {
        self.reconnects.increment(1);
    }

    /// A logical-decoding message: our own heartbeat gives the round trip; any
    /// other message (other prefixes, other relays' heartbeats) is ignored.
    pub(crate) fn logical_message(&self, message: &LogicalDecodingMessage) {
        if message.prefix.as_bytes() != heartbeat::PREFIX.as_bytes() {
            return;
        }
        if let Some(sent) = heartbeat::decode(&message.content, std::process::id()) {
            let rtt = heartbeat::round_trip(sent, SystemTime::now());
            tracing::trace!(rtt_ms = rtt.as_secs_f64() * 1000.0, "heartbeat");
            self.heartbeat_round_trip.record(rtt.as_secs_f64());
        }
    }

    /// Publishes the window and positions to the gauges and the health state.
    pub(crate) fn observe(&mut self, core: &Core, health: &Health) {
        let confirmed = core.confirmed();
        let in_flight = core.in_flight_events();
        let advanced = confirmed > self.last_confirmed;
        self.last_confirmed = confirmed;
        health.observe(in_flight, advanced, Instant::now());
        // Gauges are `f64`: exact below 2^53, i.e. for any window and for LSNs up to
        // 8 PiB of WAL; beyond that a gauge is off by a few bytes, never wrong in kind.
        #[allow(clippy::cast_precision_loss)]
        {
            self.in_flight_events.set(in_flight as f64);
            self.in_flight_bytes.set(core.in_flight_bytes() as f64);
            self.received.set(core.written().as_u64() as f64);
            self.confirmed.set(confirmed.as_u64() as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_labels_are_capped() {
        let mut instruments = Instruments::new();
        for i in 0..MAX_TOPIC_SERIES + 50 {
            instruments.poisoned(&format!("topic-{i}"));
        }
        assert_eq!(instruments.per_topic.len(), MAX_TOPIC_SERIES + 1);
        assert!(instruments.per_topic.contains_key(OTHER_TOPICS));
        // A topic seen before the cap keeps its own series.
        instruments.poisoned("topic-0");
        assert_eq!(instruments.per_topic.len(), MAX_TOPIC_SERIES + 1);
    }
}
