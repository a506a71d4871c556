//! The poison path of a session: what `relay.on_poison` makes of an event the core
//! gives up on (a poison row, a parked key, or a halt), the poison rows an earlier
//! process already wrote for this session's stretch of WAL, and the channels to the
//! poison writer (`crate::poison::PoisonWriter`), whose outcomes the loop hands back
//! here.
//!
//! It owns that state and nothing else: the core and the event records are passed
//! in by the loop, which decides when each call is made.

use tokio::sync::mpsc;

use super::RunSummary;
use crate::cdc::in_flight::InFlight;
use crate::cdc::instruments::Instruments;
use crate::cdc::metrics::{self as m, Health};
use crate::cdc::poison_policy::{Disposal, PoisonPolicy};
use crate::cdc::ports::clock;
use crate::cdc::progress::{Core, Origin, Records};
use crate::delivery::EventId;
use crate::lsn::Lsn;
use crate::outbox::OutboxEvent;
use crate::poison::{Parked, Parking, PoisonOutcome, PoisonRequest, RecordedPoison};

/// See the module documentation.
pub(super) struct PoisonPath {
    /// `relay.on_poison` and the keys it parked.
    policy: PoisonPolicy,
    /// Events of this session's stretch of WAL that an earlier process poisoned:
    /// resolved as poisoned instead of produced again.
    recorded: RecordedPoison,
    /// Requests to the poison writer.
    requests: mpsc::Sender<PoisonRequest>,
    /// Its outcomes.
    outcomes: mpsc::Receiver<PoisonOutcome>,
}

impl PoisonPath {
    pub(super) fn new(
        policy: PoisonPolicy,
        requests: mpsc::Sender<PoisonRequest>,
        outcomes: mpsc::Receiver<PoisonOutcome>,
    ) -> PoisonPath {
        PoisonPath {
            policy,
            recorded: RecordedPoison::default(),
            requests,
            outcomes,
        }
    }

    /// The policy a session starts with (a backlog, or another relay, may have
    /// parked keys meanwhile).
    pub(super) fn set_policy(&mut self, policy: PoisonPolicy) {
        self.policy = policy;
    }

    /// The poison rows an earlier process wrote for the session's stretch of WAL.
    pub(super) fn set_recorded(&mut self, recorded: RecordedPoison) {
        self.recorded = recorded;
    }

    /// Whether `event`'s key is parked (`relay.on_poison = "park-key"`): it waits
    /// for `replay`.
    pub(super) fn parks(&self, event: &OutboxEvent) -> bool {
        self.policy.parks(event)
    }

    /// The poison writer's next outcome (`None`: the writer stopped).
    pub(super) async fn next_outcome(&mut self) -> Option<PoisonOutcome> {
        self.outcomes.recv().await
    }

    /// A poison insert finished: the event is resolved as poisoned (or parked), its
    /// key released by `replay` meanwhile, or the insert is retried by the core.
    /// Returns the name of an event whose poison row committed.
    pub(super) fn on_outcome(
        &mut self,
        outcome: PoisonOutcome,
        core: &mut Core,
        records: &mut Records<InFlight>,
        summary: &mut RunSummary,
        instruments: &mut Instruments,
    ) -> Option<Origin> {
        let now = clock::now();
        let origin = core.origin(outcome.id);
        match outcome.result {
            Ok(Parked::Recorded) => {
                if let Some(pending) = records.remove(outcome.id) {
                    if let InFlight::Event { parked: true, .. } = pending {
                        summary.parked += 1;
                        ::metrics::counter!(m::EVENTS_PARKED).increment(1);
                    } else {
                        summary.poisoned += 1;
                        instruments.poisoned(pending.topic());
                    }
                }
                core.poison_committed(outcome.id, now);
                return origin;
            }
            Ok(Parked::Released) => {
                if let Some(InFlight::Event { event, parked, .. }) = records.get_mut(outcome.id) {
                    *parked = false;
                    self.policy.released(event);
                }
                core.unpark(outcome.id, now);
            }
            Err(_) => core.poison_insert_failed(outcome.id, now),
        }
        None
    }

    /// Whether an earlier process recorded `id` in the poison table (found among
    /// the session's recorded poison rows, or found before): then it is resolved
    /// as poisoned, never produced again.
    pub(super) fn recorded_before(
        &mut self,
        id: EventId,
        core: &Core,
        records: &mut Records<InFlight>,
    ) -> bool {
        if self.recorded.is_empty() {
            return false;
        }
        let (Some(pending), Some(origin)) = (records.get_mut(id), core.origin(id)) else {
            return false;
        };
        match pending {
            InFlight::Event {
                recorded_before: true,
                ..
            } => return true,
            InFlight::Event { .. } => {}
            InFlight::Unmappable { .. } => return false,
        }
        let row = || pending.poison_row(1, Parking::None, origin);
        if !self.recorded.take(origin.commit, origin.ordinal, row) {
            return false;
        }
        if let InFlight::Event {
            event,
            recorded_before,
            ..
        } = pending
        {
            tracing::info!(%id, commit = %origin.commit, ordinal = origin.ordinal,
                idempotency_key = %String::from_utf8_lossy(&event.idempotency_key),
                "an earlier process recorded this event in the poison table: not produced again");
            *recorded_before = true;
        }
        true
    }

    /// The core gave up on `id` after `attempts`: its poison row goes to the writer
    /// (as `relay.on_poison` disposes of it), or, under `halt`, it holds the relay.
    /// Returns the event's name when its poison row was committed already.
    pub(super) fn request(
        &mut self,
        id: EventId,
        attempts: u32,
        core: &mut Core,
        records: &mut Records<InFlight>,
        health: &Health,
    ) -> Option<Origin> {
        let (Some(pending), Some(origin)) = (records.get(id), core.origin(id)) else {
            return None;
        };
        if let InFlight::Event {
            recorded_before: true,
            ..
        } = pending
        {
            // Its row is committed already.
            records.remove(id);
            core.poison_committed(id, clock::now());
            return Some(origin);
        }
        let parking = match self.policy.dispose(pending) {
            Disposal::Insert(parking) => parking,
            Disposal::Halt => {
                halt(id, attempts, core, records, health);
                return None;
            }
        };
        let row = pending.poison_row(attempts, parking, origin);
        // The channel holds one request per in-flight event at most, so it is never
        // full; if it were, the core retries after a backoff.
        if self.requests.try_send(PoisonRequest { id, row }).is_err() {
            core.poison_insert_failed(id, clock::now());
        }
        None
    }
}

/// `relay.on_poison = "halt"`: `id` is not poisoned; it holds the relay, with an
/// error log and an alert that say which event and why.
fn halt(id: EventId, attempts: u32, core: &mut Core, records: &Records<InFlight>, health: &Health) {
    let (Some(pending), Some(origin)) = (records.get(id), core.origin(id)) else {
        return;
    };
    let row = pending.poison_row(attempts, Parking::None, origin);
    tracing::error!(
        idempotency_key = row.fields.idempotency_key.as_deref().unwrap_or(""),
        topic = row.fields.topic.as_deref().unwrap_or(""),
        key = row.fields.aggregate_id.as_deref().unwrap_or(""),
        lsn = %row.lsn.unwrap_or(Lsn::ZERO),
        error_kind = %row.error_kind,
        error = %row.error,
        "an event cannot be delivered and relay.on_poison = \"halt\": the relay stops \
         confirming past it. Fix the cause and restart the relay, or set relay.on_poison \
         to \"park-key\" or \"skip\" to record it in the poison table"
    );
    core.halt(id, clock::now());
    let halted = core.halted_events();
    // Exact: at most a window of events.
    #[allow(clippy::cast_precision_loss)]
    ::metrics::gauge!(m::HALTED_EVENTS).set(halted as f64);
    health.set_alert(
        "poison",
        Some(format!(
            "{halted} event(s) cannot be delivered and relay.on_poison = \"halt\"; first: \
             idempotency key {:?}, {}: {}",
            row.fields.idempotency_key.as_deref().unwrap_or(""),
            row.error_kind,
            row.error
        )),
    );
}
