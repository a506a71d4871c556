//! Send at once when the stream goes idle; linger while it is busy.
//!
//! # Why
//!
//! librdkafka holds a record for up to `linger.ms` (5 ms by default here) so that
//! more records join its batch. In a backlog drain that is what makes the relay
//! cheap: few, large produce requests. At a steady few thousand events per second it
//! is pure delay: the relay reads a transaction, produces its events, and then has
//! nothing more to read, yet the records wait out the linger before they leave. The
//! per-stage histograms (`docs/benchmarks.md`, "Where the time goes") showed
//! produced → acked to be 80–90 % of commit → ack below saturation, and `linger.ms`
//! itself cannot adapt: librdkafka cannot change it on a live producer, and a lower
//! value makes the drain slower and costlier per event.
//!
//! So the relay's loop tells the producer when the replication stream has nothing
//! more to read right now ([`IdleFlush::nudge`]), and only then are the lingering
//! records sent at once. While frames keep arriving, no nudge is given and
//! `linger.ms` batches as configured.
//!
//! # How librdkafka is told
//!
//! `rd_kafka_flush` is the one public way to end a linger early: for as long as the
//! call lasts it raises the producer's `rk_flushing` counter and wakes the broker
//! threads, which then treat `linger.ms` as elapsed (`rdkafka.c`, `rd_kafka_flush`;
//! `rdkafka_broker.c`, `rd_kafka_broker_produce_toppars`). The call must last until
//! a broker thread has woken up — librdkafka's own comment: "if this flush() call
//! finishes before the broker wakes up then no flushing will be performed by that
//! broker thread" — so a zero timeout is unreliable, and a blocking one must not run
//! on the relay's task. It runs on a thread of its own that waits for nudges, with
//! a short timeout ([`HOLD`]). rust-rdkafka drives librdkafka through the event API,
//! where `rd_kafka_flush` only waits for the message count to reach zero and never
//! serves the delivery queue (`rk_drmode == RD_KAFKA_DR_MODE_EVENT`), so delivery
//! reports stay on the publisher's own delivery thread and keep their order.
//!
//! # When to nudge: when nothing else is in flight, at most once per linger
//!
//! A flush is not free. For as long as it holds (up to [`HOLD`]) every record goes out
//! without lingering, and in a backlog drain, where the relay often catches up with
//! the walsender for a moment, frequent nudges turned large batches into small ones:
//! measured, the drain fell by a third and its CPU per event rose by 40 %. And at
//! thousands of transactions a second, a produce request per transaction costs the
//! broker more than the linger saves. So three rules, Nagle's for TCP in spirit
//! (numbered as in `docs/benchmarks.md`, in the order measuring found them):
//!
//! 1. at most one nudge per `linger.ms`, so however the traffic looks, a nudge ends at
//!    most one linger early per linger period;
//! 2. a nudge only when every record the producer holds was produced since the last
//!    nudge (`in_flight <= pending`): nothing sent earlier still waits for its
//!    acknowledgement. A busy stream always has earlier records in flight, so it
//!    keeps its batches; a sparse one has none, so its records leave at once;
//! 3. a nudge only while few records linger ([`SMALL_BATCH`]): with more, the linger
//!    is filling batches, which is its job, and the stream is busy enough that the
//!    next frame is near anyway.
//!
//! [`IdleGate`] keeps all three, without I/O. What they bought is measured in
//! `docs/benchmarks.md`, "Where the time goes".
//!
//! Nudges that arrive while a flush is held are merged into one (a channel of one
//! slot): at most one flush call runs at a time, and a burst of idle moments costs
//! one wake-up of the broker threads, not one each.

use std::sync::Arc;
use std::sync::mpsc::{self, SyncSender, TrySendError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdkafka::bindings;
use rdkafka::producer::{BaseProducer, Producer, ProducerContext};

/// How long one flush holds librdkafka's "flushing" state: long enough for a broker
/// thread woken by it to build its produce request, short enough that records
/// produced just after an idle moment are batched normally again soon. It ends
/// earlier when every record was acked.
pub(crate) const HOLD: Duration = Duration::from_millis(2);

/// The nudge thread and the sending half of its one-slot channel.
pub(crate) struct IdleFlush {
    nudges: Option<SyncSender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl IdleFlush {
    /// Starts the thread that flushes `producer` for [`HOLD`] on every nudge.
    ///
    /// # Errors
    ///
    /// The thread could not be spawned.
    pub(crate) fn start<C>(producer: Arc<BaseProducer<C>>) -> std::io::Result<IdleFlush>
    where
        C: ProducerContext + 'static,
    {
        let (nudges, wanted) = mpsc::sync_channel::<()>(1);
        let hold_ms = i32::try_from(HOLD.as_millis()).unwrap_or(i32::MAX);
        let thread = std::thread::Builder::new()
            .name("kafka-idle-flush".into())
            .spawn(move || {
                // Ends when the publisher drops the sender.
                while wanted.recv().is_ok() {
                    // rust-rdkafka's `flush` polls the event queue between zero-timeout
                    // calls instead (see the module doc), hence the direct call.
                    // SAFETY: the pointer is the live producer's handle (this thread
                    // holds an `Arc` to it), and `rd_kafka_flush` is thread-safe. Its
                    // result only says whether records were still in flight when the
                    // hold ended, which is expected and needs no handling.
                    #[allow(unsafe_code)]
                    unsafe {
                        bindings::rd_kafka_flush(producer.client().native_ptr(), hold_ms);
                    }
                }
            })?;
        Ok(IdleFlush {
            nudges: Some(nudges),
            thread: Some(thread),
        })
    }

    /// Asks for what librdkafka holds to be sent now. Never blocks: a nudge already
    /// waiting covers this one too.
    pub(crate) fn nudge(&self) {
        if let Some(nudges) = &self.nudges {
            match nudges.try_send(()) {
                Ok(()) | Err(TrySendError::Full(())) => {}
                // The thread ended (it only does when the sender is dropped): nothing
                // to nudge.
                Err(TrySendError::Disconnected(())) => {}
            }
        }
    }
}

impl Drop for IdleFlush {
    /// Stops the thread (within one [`HOLD`]) so that it releases the producer
    /// before the publisher's own drop purges it.
    fn drop(&mut self) {
        drop(self.nudges.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Most records lingering for a nudge to be given (rule 3 of the module doc): at
/// 5,000 events/s about 25 linger per `linger.ms`, in a backlog drain hundreds.
pub(crate) const SMALL_BATCH: u64 = 64;

/// When a nudge may be given (see the module doc): something was produced since the
/// last one, nothing older is still in flight, and the last one is at least
/// `min_interval` (the producer's `linger.ms`) old.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleGate {
    min_interval: Duration,
    /// Records produced since the last nudge.
    pending: u64,
    last_nudge: Option<Instant>,
}

impl IdleGate {
    /// A gate allowing one nudge per `min_interval`.
    #[must_use]
    pub fn new(min_interval: Duration) -> IdleGate {
        IdleGate {
            min_interval,
            pending: 0,
            last_nudge: None,
        }
    }

    /// A record was handed to the producer.
    pub fn produced(&mut self) {
        self.pending += 1;
    }

    /// Whether something was produced since the last nudge (the cheap test, before
    /// asking the producer for `in_flight`).
    #[must_use]
    pub fn pending(&self) -> bool {
        self.pending > 0
    }

    /// Whether a nudge at `now` may be given, the producer holding `in_flight`
    /// records not yet reported.
    #[must_use]
    pub fn may_nudge(&self, now: Instant, in_flight: u64) -> bool {
        self.pending > 0
            && self.lingering(in_flight) <= SMALL_BATCH
            && in_flight <= self.pending
            && self
                .last_nudge
                .is_none_or(|last| now.saturating_duration_since(last) >= self.min_interval)
    }

    /// Whether a nudge may be given as the relay starts a read pause
    /// (`relay.read_pause_ms`): something was produced since the last one and few
    /// records linger. The pause is then the batching window: it ends with a read of
    /// everything committed meanwhile, whose records leave together as the next
    /// pause starts, so rules 1 and 2 (which keep a stream read as it arrives from
    /// sending a request per transaction) would only add a linger to each batch.
    /// Pauses are taken only when the relay caught up, so a backlog drain, whose
    /// records pile up beyond a small batch (64), keeps its batches.
    #[must_use]
    pub fn may_nudge_before_pause(&self, in_flight: u64) -> bool {
        self.pending > 0 && self.lingering(in_flight) <= SMALL_BATCH
    }

    /// Records that may still linger: produced since the last nudge and not yet
    /// reported. Not `pending` alone, which only a nudge resets: after a burst of
    /// more than [`SMALL_BATCH`] (a backlog at start) it would forbid every later
    /// nudge, and so its own reset, for the rest of the process.
    fn lingering(&self, in_flight: u64) -> u64 {
        self.pending.min(in_flight)
    }

    /// The nudge was given at `now`: what was produced so far has left.
    pub fn nudged(&mut self, now: Instant) {
        self.pending = 0;
        self.last_nudge = Some(now);
    }
}

impl std::fmt::Debug for IdleFlush {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdleFlush")
            .field("hold", &HOLD)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nudges_a_sparse_stream_at_once_and_leaves_a_busy_one_to_linger() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut gate = IdleGate::new(Duration::from_millis(5));
        assert!(
            !gate.pending() && !gate.may_nudge(t0, 0),
            "nothing produced"
        );
        gate.produced();
        gate.produced();
        assert!(gate.pending());
        assert!(
            gate.may_nudge(t0, 2),
            "a sparse stream: its two records at once"
        );
        assert!(!gate.may_nudge(t0, 3), "an older record still in flight");
        gate.nudged(t0);
        assert!(!gate.may_nudge(ms(10), 0), "nothing new since the nudge");
        gate.produced();
        assert!(!gate.may_nudge(ms(4), 1), "too soon: linger.ms batches it");
        assert!(gate.may_nudge(ms(5), 1));
        // A busy stream: more in flight besides the new ones, never a nudge.
        gate.nudged(ms(5));
        for _ in 0..SMALL_BATCH {
            gate.produced();
        }
        assert!(!gate.may_nudge(ms(60), 900));
        assert!(
            gate.may_nudge(ms(60), SMALL_BATCH),
            "once the earlier ones are acked"
        );
        // Hundreds lingering: the linger is filling a batch.
        gate.produced();
        assert!(!gate.may_nudge(ms(60), SMALL_BATCH + 1));
        // linger.ms = 0 never holds one back for time.
        let mut eager = IdleGate::new(Duration::ZERO);
        eager.produced();
        eager.nudged(t0);
        eager.produced();
        assert!(eager.may_nudge(t0, 1));
    }

    #[test]
    fn a_read_pause_sends_what_its_read_produced_unless_a_batch_is_filling() {
        let t0 = Instant::now();
        let mut gate = IdleGate::new(Duration::from_millis(5));
        assert!(!gate.may_nudge_before_pause(0), "nothing produced");
        gate.produced();
        gate.nudged(t0);
        gate.produced();
        assert!(
            gate.may_nudge_before_pause(5),
            "neither the last nudge's age nor earlier records in flight hold a pause's batch"
        );
        assert!(!gate.may_nudge(t0, 5), "where the linger rule would");
        for _ in 0..SMALL_BATCH {
            gate.produced();
        }
        assert!(
            !gate.may_nudge_before_pause(SMALL_BATCH + 1),
            "more than a small batch lingers: a backlog, left to the linger"
        );
    }

    #[test]
    fn a_burst_acked_in_full_does_not_shut_the_gate_for_good() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut gate = IdleGate::new(Duration::from_millis(5));
        // A backlog at start: hundreds produced without a nudge, all acked since.
        for _ in 0..500 {
            gate.produced();
        }
        gate.produced();
        assert!(
            gate.may_nudge(ms(10), 1),
            "one record lingers, none older in flight"
        );
        assert!(gate.may_nudge_before_pause(1));
        assert!(
            !gate.may_nudge(ms(10), 300),
            "while the burst is in flight, no nudge"
        );
    }
}
