//! The relay's metric handles, registered once so the hot path only touches atomics.
//!
//! The `metrics` macros look their metric up in the recorder's registry on every call
//! (a hash of name and labels); at tens of thousands of events a second that is
//! measurable. So the session registers every handle when it starts and keeps the
//! per-topic counters in a map by topic, created on the first event of each topic.
//! Names and meanings are in `crate::cdc::metrics`.
//!
//! The per-stage latencies cost a few clock reads and histogram records per event and
//! nothing else: the instants travel in the event's own in-flight entry, and the one
//! stage that is not per event (acked → confirmed: a status update confirms many
//! transactions at once) keeps a small ring of "resolved up to here at this instant"
//! marks, allocated once ([`ConfirmClock`]).
//!
//! The slot's lag in seconds (`SLOT_LAG_SECONDS`) needs the commit time of the oldest
//! event not yet confirmed: [`PendingCommits`] keeps one `(commit LSN, commit time)`
//! per transaction with a received event, in commit order, dropped from the front as
//! the confirmed watermark passes it. Per event that is one comparison with the
//! newest entry; per transaction one push and one pop. It holds at most the
//! transactions the core tracks (at most `max_in_flight_events + 1`), and its buffer
//! is reused.

use std::collections::VecDeque;

use crate::hashing::HashMap;
use std::time::{Instant, SystemTime};

use ::metrics::{Counter, Gauge, Histogram};

use crate::cdc::heartbeat;
use crate::cdc::metrics::{self as m, Health};
use crate::cdc::progress::Core;
use crate::lsn::Lsn;
use crate::outbox::message::MessageMapped;
use crate::postgres::pgoutput::LogicalDecodingMessage;
use crate::postgres::replication::frames::pg_epoch_micros;

/// Marks of [`ConfirmClock`] kept at most; when statuses lag further (a stuck
/// position save), the oldest marks are dropped unrecorded rather than grow.
const MAX_CONFIRM_MARKS: usize = 1024;

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
    commit_to_received: Histogram,
    received_to_produced: Histogram,
    produced_to_acked: Histogram,
    confirm: ConfirmClock,
    pending_commits: PendingCommits,
    transient_errors: Counter,
    reconnects: Counter,
    read_pauses: Counter,
    heartbeat_round_trip: Histogram,
    /// Messages ignored: another prefix, another relay's outbox, not transactional.
    messages_ignored: [Counter; 3],
    /// `(relayed, poisoned)` counters per topic, looked up once per event. foldhash,
    /// not SipHash (which was 1–2 % of a drain's CPU): the map holds at most
    /// [`MAX_TOPIC_SERIES`] + 1 keys, so colliding names cannot make it slow.
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
            commit_to_received: stage(m::STAGE_COMMIT_TO_RECEIVED),
            received_to_produced: stage(m::STAGE_RECEIVED_TO_PRODUCED),
            produced_to_acked: stage(m::STAGE_PRODUCED_TO_ACKED),
            confirm: ConfirmClock::new(stage(m::STAGE_ACKED_TO_CONFIRMED)),
            pending_commits: PendingCommits::default(),
            transient_errors: ::metrics::counter!(m::BROKER_TRANSIENT_ERRORS),
            reconnects: ::metrics::counter!(m::RECONNECTS),
            read_pauses: ::metrics::counter!(m::READ_PAUSES),
            heartbeat_round_trip: ::metrics::histogram!(m::HEARTBEAT_ROUND_TRIP),
            messages_ignored: ["foreign_prefix", "other_outbox", "not_transactional"]
                .map(|reason| ::metrics::counter!(m::MESSAGES_IGNORED, "reason" => reason)),
            per_topic: HashMap::default(),
            last_confirmed: Lsn::ZERO,
        }
    }

    /// Adds one to the counter `which` picks of `topic`'s pair: one hash lookup per
    /// event once the topic is known.
    fn count(&mut self, topic: &str, which: fn(&(Counter, Counter)) -> &Counter) {
        if let Some(counters) = self.per_topic.get(topic) {
            which(counters).increment(1);
        } else {
            which(self.new_topic(topic)).increment(1);
        }
    }

    /// The counters of a topic not seen before. Topics come from row data (a topic
    /// column, a template): past the cap, the rest share one series, so a bad row
    /// cannot grow the scrape without bound.
    #[cold]
    fn new_topic(&mut self, topic: &str) -> &(Counter, Counter) {
        let label = if self.per_topic.len() < MAX_TOPIC_SERIES {
            topic
        } else {
            OTHER_TOPICS
        };
        if !self.per_topic.contains_key(label) {
            let counters = (
                ::metrics::counter!(m::EVENTS_RELAYED, "topic" => label.to_owned()),
                ::metrics::counter!(m::EVENTS_POISONED, "topic" => label.to_owned()),
            );
            self.per_topic.insert(label.to_owned(), counters);
        }
        &self.per_topic[label]
    }

    /// An event's frame was taken off the stream; its transaction's commit record is
    /// at `commit` and it committed at `committed_at` (µs since 2000-01-01, the
    /// server's clock).
    pub(crate) fn received(&mut self, commit: Lsn, committed_at: i64) {
        self.commit_to_received.record(since_commit(committed_at));
        self.pending_commits.received(commit, committed_at);
    }

    /// An event received at `received_at` was handed to the producer at `now` for the
    /// first time.
    pub(crate) fn produced(&self, received_at: Instant, now: Instant) {
        self.received_to_produced
            .record(now.saturating_duration_since(received_at));
    }

    /// An event of `topic` was acked at `now`, last produced at `produced_at`; its
    /// transaction committed at `committed_at` (µs since 2000-01-01).
    pub(crate) fn delivered(
        &mut self,
        topic: &str,
        committed_at: i64,
        produced_at: Instant,
        reported_at: Instant,
        now: Instant,
    ) {
        // The broker's ack, not the moment the relay handled its report (`now`, which
        // may be a read pause later): that wait is counted in acked → confirmed.
        let handled_later = now.saturating_duration_since(reported_at);
        self.latency
            .record((since_commit(committed_at) - handled_later.as_secs_f64()).max(0.0));
        self.produced_to_acked
            .record(reported_at.saturating_duration_since(produced_at));
        self.confirm.acked(reported_at);
        self.count(topic, |(relayed, _)| relayed);
    }

    /// The commit watermark is `confirmed` at `now` (before any status says so).
    pub(crate) fn resolved_up_to(&mut self, confirmed: Lsn, now: Instant) {
        self.confirm.resolved_up_to(confirmed, now);
    }

    /// A standby status confirming `flush` was sent at `now`.
    pub(crate) fn status_sent(&mut self, flush: Lsn, now: Instant) {
        self.confirm.status_sent(flush, now);
    }

    /// A new session starts at `start`: marks of the old one will never be confirmed
    /// by a status of this one.
    pub(crate) fn session_started(&mut self, start: Lsn) {
        self.confirm.restart(start);
        self.pending_commits.restart();
    }

    /// An event of `topic` (`""` for a row that has none) was poisoned.
    pub(crate) fn poisoned(&mut self, topic: &str) {
        self.count(topic, |(_, poisoned)| poisoned);
    }

    /// A delivery report with a transient (retried) broker error.
    pub(crate) fn transient_error(&self) {
        self.transient_errors.increment(1);
    }

    /// A replication session was lost and is being re-established.
    pub(crate) fn reconnect(&self) {
        self.reconnects.increment(1);
    }

    /// The relay caught up with the walsender and pauses reading.
    pub(crate) fn read_pause(&self) {
        self.read_pauses.increment(1);
    }

    /// A logical-decoding message: our own heartbeat gives the round trip; any
    /// other message (other prefixes, other relays' heartbeats) is ignored.
    /// Counts a message that is not an event of this relay (the heartbeat's own
    /// prefix is not counted); one written with `transactional = false` is also
    /// logged, since its writer expects it relayed. Another relay's outbox messages
    /// are normal where several relays share a database, so they are only counted.
    pub(crate) fn ignored_message(
        &self,
        ignored: &MessageMapped,
        message: &LogicalDecodingMessage,
    ) {
        let index = match ignored {
            MessageMapped::Outbox(_) => return,
            MessageMapped::Foreign => {
                if message.prefix.as_bytes() == heartbeat::PREFIX.as_bytes() {
                    return;
                }
                0
            }
            MessageMapped::OtherOutbox => 1,
            MessageMapped::NotTransactional => 2,
        };
        if index == 2 {
            tracing::warn!(
                prefix = %message.prefix,
                lsn = %message.lsn,
                "outbox message written with transactional = false ignored: it is decoded \
                 outside commit order, even when its transaction rolls back"
            );
        }
        self.messages_ignored[index].increment(1);
    }

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
        health.set_oldest_pending_commit(self.pending_commits.confirmed_up_to(confirmed));
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

/// The transactions with an event received and not yet confirmed, oldest first:
/// `(commit LSN, commit time)`, for `SLOT_LAG_SECONDS`. The watermark confirms a
/// transaction when it passes its commit record (it becomes that record's end, see
/// `crate::cdc::progress::tracker`), so an entry leaves once the confirmed LSN is
/// above its commit LSN. Entries are strictly increasing in commit LSN (a
/// transaction's later events add nothing). A new session forgets them all: it
/// starts at or before the confirmed LSN and the server sends every unconfirmed
/// transaction again (on a new timeline some may not exist any more), so only in
/// the moment before the first one is received again does the lag read 0.
#[derive(Debug, Default)]
struct PendingCommits {
    commits: VecDeque<(Lsn, i64)>,
}

impl PendingCommits {
    /// An event of the transaction committed at `commit` (LSN), `committed_at` (time).
    fn received(&mut self, commit: Lsn, committed_at: i64) {
        if self
            .commits
            .back()
            .is_none_or(|&(newest, _)| commit > newest)
        {
            self.commits.push_back((commit, committed_at));
        }
    }

    /// Drops the transactions `confirmed` covers; the commit time of the oldest
    /// left, if any.
    fn confirmed_up_to(&mut self, confirmed: Lsn) -> Option<i64> {
        while self
            .commits
            .front()
            .is_some_and(|&(commit, _)| commit < confirmed)
        {
            self.commits.pop_front();
        }
        self.commits.front().map(|&(_, committed_at)| committed_at)
    }

    /// A new session: what it receives is all that is pending.
    fn restart(&mut self) {
        self.commits.clear();
    }
}

/// The stage histogram labelled `stage`.
fn stage(stage: &'static str) -> Histogram {
    ::metrics::histogram!(m::STAGE_LATENCY, "stage" => stage)
}

/// Seconds from `committed_at` (µs since 2000-01-01) to now, 0 if the clocks disagree.
fn since_commit(committed_at: i64) -> f64 {
    let now = pg_epoch_micros(SystemTime::now());
    let micros = now.saturating_sub(committed_at).max(0);
    // Lossless enough: latencies are far below 2^53 µs.
    #[allow(clippy::cast_precision_loss)]
    let seconds = micros as f64 / 1e6;
    seconds
}

/// The acked → confirmed stage. Each time the commit watermark moves, a mark (the
/// watermark, the earliest moment librdkafka reported one of its events, the events
/// acked since the previous mark) is queued; a
/// status update that confirms a mark records its age once per event it covers. The
/// events of a mark are those acked since the previous one, which may include events
/// of a later, not yet complete transaction: a close approximation, exact with one
/// transaction in flight.
#[derive(Debug)]
struct ConfirmClock {
    histogram: Histogram,
    marks: VecDeque<(Lsn, Instant, usize)>,
    /// The watermark of the newest mark (or the session start).
    noted: Lsn,
    /// Events acked since the newest mark.
    acked: usize,
    /// When librdkafka reported the first of them: the relay may handle a report a
    /// read pause later, and that wait belongs to this stage.
    first_reported: Option<Instant>,
}

impl ConfirmClock {
    fn new(histogram: Histogram) -> Self {
        ConfirmClock {
            histogram,
            marks: VecDeque::with_capacity(MAX_CONFIRM_MARKS),
            noted: Lsn::ZERO,
            acked: 0,
            first_reported: None,
        }
    }

    fn acked(&mut self, reported_at: Instant) {
        self.acked = self.acked.saturating_add(1);
        self.first_reported = Some(
            self.first_reported
                .map_or(reported_at, |t| t.min(reported_at)),
        );
    }

    fn resolved_up_to(&mut self, confirmed: Lsn, now: Instant) {
        if confirmed <= self.noted {
            return;
        }
        self.noted = confirmed;
        if self.acked == 0 {
            // Keepalive or idle advance: no event waits for this status.
            return;
        }
        if self.marks.len() == MAX_CONFIRM_MARKS {
            self.marks.pop_front();
        }
        let since = self.first_reported.take().map_or(now, |t| t.min(now));
        self.marks.push_back((confirmed, since, self.acked));
        self.acked = 0;
    }

    fn status_sent(&mut self, flush: Lsn, now: Instant) {
        while let Some(&(lsn, at, events)) = self.marks.front() {
            if lsn > flush {
                break;
            }
            self.histogram
                .record_many(now.saturating_duration_since(at), events);
            self.marks.pop_front();
        }
    }

    fn restart(&mut self, start: Lsn) {
        self.marks.clear();
        self.noted = start;
        self.acked = 0;
        self.first_reported = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `_count` of the `acked_to_confirmed` series in a rendered page.
    fn confirmed_count(page: &str) -> Option<u64> {
        let prefix = format!(
            "{}_count{{stage=\"{}\"}} ",
            m::STAGE_LATENCY,
            m::STAGE_ACKED_TO_CONFIRMED
        );
        page.lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
    }

    /// A clock whose histogram a local Prometheus recorder renders.
    fn recorded_clock() -> (ConfirmClock, metrics_exporter_prometheus::PrometheusHandle) {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let clock = ::metrics::with_local_recorder(&recorder, || {
            ConfirmClock::new(stage(m::STAGE_ACKED_TO_CONFIRMED))
        });
        (clock, recorder.handle())
    }

    #[test]
    fn a_status_records_the_events_of_the_marks_it_confirms() {
        let (mut clock, handle) = recorded_clock();
        let t0 = Instant::now();
        clock.restart(Lsn(100));
        // Two events acked, the watermark moves to 200; one more, then 300.
        clock.acked(t0);
        clock.acked(t0);
        clock.resolved_up_to(Lsn(200), t0);
        clock.acked(t0);
        clock.resolved_up_to(Lsn(300), t0);
        // A keepalive advance with nothing acked makes no mark.
        clock.resolved_up_to(Lsn(400), t0);
        assert_eq!(clock.marks.len(), 2);
        // A status short of 200 confirms nothing; one at 250 the first mark (2
        // events); one at 400 the second (1 event).
        clock.status_sent(Lsn(150), t0);
        assert_eq!(confirmed_count(&handle.render()).unwrap_or(0), 0);
        clock.status_sent(Lsn(250), t0);
        assert_eq!(confirmed_count(&handle.render()), Some(2));
        clock.status_sent(Lsn(400), t0);
        assert_eq!(confirmed_count(&handle.render()), Some(3));
        assert!(clock.marks.is_empty());
        // A new session forgets what the old one did not confirm.
        clock.acked(t0);
        clock.resolved_up_to(Lsn(500), t0);
        clock.restart(Lsn(450));
        assert!(clock.marks.is_empty());
    }

    #[test]
    fn a_report_handled_late_is_counted_from_when_it_was_reported() {
        let (mut clock, handle) = recorded_clock();
        let reported = Instant::now();
        let handled = reported + std::time::Duration::from_millis(40);
        clock.restart(Lsn(100));
        clock.acked(handled);
        clock.acked(reported);
        clock.resolved_up_to(Lsn(200), handled);
        clock.status_sent(Lsn(200), handled + std::time::Duration::from_millis(10));
        let sum_prefix = format!(
            "{}_sum{{stage=\"{}\"}} ",
            m::STAGE_LATENCY,
            m::STAGE_ACKED_TO_CONFIRMED
        );
        let sum: f64 = handle
            .render()
            .lines()
            .find_map(|l| l.strip_prefix(&sum_prefix)?.trim().parse().ok())
            .expect("the stage's sum");
        // Two events, each 50 ms from the earliest report to the status.
        assert!((sum - 0.1).abs() < 1e-6, "{sum}");
    }

    #[test]
    fn pending_commits_give_the_oldest_unconfirmed_transaction() {
        let mut pending = PendingCommits::default();
        assert_eq!(pending.confirmed_up_to(Lsn(0)), None);
        // Two events of the transaction committing at 100, one of 200, one of 300.
        pending.received(Lsn(100), 10);
        pending.received(Lsn(100), 10);
        pending.received(Lsn(200), 20);
        pending.received(Lsn(300), 30);
        assert_eq!(pending.commits.len(), 3);
        // Confirmed at 100 (the start) covers nothing; the end of 100's commit
        // record (say 150) covers it.
        assert_eq!(pending.confirmed_up_to(Lsn(100)), Some(10));
        assert_eq!(pending.confirmed_up_to(Lsn(150)), Some(20));
        // More events of transactions already here add nothing.
        pending.received(Lsn(200), 20);
        pending.received(Lsn(300), 30);
        assert_eq!(pending.commits.len(), 2);
        assert_eq!(pending.confirmed_up_to(Lsn(250)), Some(30));
        assert_eq!(pending.confirmed_up_to(Lsn(350)), None);
        assert!(pending.commits.is_empty());
        // A new session sends the unconfirmed transactions again, from its start.
        pending.received(Lsn(400), 40);
        pending.received(Lsn(500), 50);
        pending.restart();
        assert_eq!(pending.confirmed_up_to(Lsn(350)), None);
        pending.received(Lsn(400), 40);
        pending.received(Lsn(500), 50);
        assert_eq!(pending.confirmed_up_to(Lsn(350)), Some(40));
    }

    #[test]
    fn observe_publishes_the_oldest_pending_commit() {
        let mut instruments = Instruments::new();
        let health = Health::default();
        let core = Core::new(
            crate::cdc::progress::CoreConfig::default(),
            Lsn(100),
            Instant::now(),
        );
        let committed_at = pg_epoch_micros(SystemTime::now()) - 42_000_000;
        instruments.received(Lsn(120), committed_at);
        instruments.observe(&core, &health);
        let lag = health.slot_lag(SystemTime::now());
        assert!((42.0..43.0).contains(&lag), "{lag}");
    }

    #[test]
    fn confirm_marks_are_bounded() {
        let mut clock = ConfirmClock::new(Histogram::noop());
        let t0 = Instant::now();
        for i in 1..=MAX_CONFIRM_MARKS as u64 + 10 {
            clock.acked(t0);
            clock.resolved_up_to(Lsn(i), t0);
        }
        assert_eq!(clock.marks.len(), MAX_CONFIRM_MARKS);
        assert_eq!(clock.marks.front().map(|m| m.0), Some(Lsn(11)));
    }

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
