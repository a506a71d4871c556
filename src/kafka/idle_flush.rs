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
//! # When to nudge: at most once per linger
//!
//! Flushing at every idle moment makes one produce request per transaction, which at
//! thousands of transactions a second costs the broker more than the linger saves
//! (a broker stores and serves every produce request as a batch of its own). So a
//! nudge is given at most once per `linger.ms`: when transactions come further apart
//! than the linger, each leaves as soon as it is read; when they come closer, a
//! nudge ends at most one linger early per `linger.ms`, so the produce requests stay
//! within twice what `linger.ms` alone makes, however busy the stream. Measured
//! (`docs/benchmarks.md`, "Where the time goes"): at 1,000 events/s commit → ack fell
//! from 6.7 to 1.6 ms at the median in transactions of 10 rows, and from 5.7 to
//! 3.6 ms in transactions of 1; at 5,000 events/s the difference was within the
//! run-to-run spread. [`IdleGate`] keeps the rule, without I/O.
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

/// When a nudge may be given (see the module doc): something was produced since the
/// last one, and the last one is at least `min_interval` (the producer's
/// `linger.ms`) old.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleGate {
    min_interval: Duration,
    /// A record was produced since the last nudge.
    pending: bool,
    last_nudge: Option<Instant>,
}

impl IdleGate {
    /// A gate allowing one nudge per `min_interval`.
    #[must_use]
    pub fn new(min_interval: Duration) -> IdleGate {
        IdleGate {
            min_interval,
            pending: false,
            last_nudge: None,
        }
    }

    /// A record was handed to the producer.
    pub fn produced(&mut self) {
        self.pending = true;
    }

    /// Whether a nudge at `now` would send something and is not too soon.
    #[must_use]
    pub fn may_nudge(&self, now: Instant) -> bool {
        self.pending
            && self
                .last_nudge
                .is_none_or(|last| now.saturating_duration_since(last) >= self.min_interval)
    }

    /// The nudge was given at `now`: what was produced so far has left.
    pub fn nudged(&mut self, now: Instant) {
        self.pending = false;
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
    fn at_most_one_nudge_per_linger_and_only_with_something_to_send() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut gate = IdleGate::new(Duration::from_millis(5));
        assert!(!gate.may_nudge(t0), "nothing produced");
        gate.produced();
        assert!(gate.may_nudge(t0), "the first one at once");
        gate.nudged(t0);
        assert!(!gate.may_nudge(ms(10)), "nothing new since the nudge");
        gate.produced();
        assert!(!gate.may_nudge(ms(4)), "too soon: linger.ms batches these");
        assert!(gate.may_nudge(ms(5)));
        gate.nudged(ms(5));
        gate.produced();
        assert!(gate.may_nudge(ms(60)), "idle for long: at once again");
        // linger.ms = 0 never holds one back.
        let mut eager = IdleGate::new(Duration::ZERO);
        eager.produced();
        eager.nudged(t0);
        eager.produced();
        assert!(eager.may_nudge(t0));
    }
}
