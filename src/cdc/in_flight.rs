//! What the relay keeps of each in-flight event besides the core's bookkeeping.
//!
//! The sans-IO core (`crate::cdc::progress`) tracks ids, sizes and states only. The
//! record itself stays with the shell until the event is resolved, because the core may
//! ask for it again: a retry produces the very same record (same key, headers and
//! payload, so consumers can deduplicate on the idempotency key), and an event that
//! exhausts its attempts is written to `poison_outbox` with the last broker error, so
//! an operator can see why and replay it. A row that cannot be mapped at all keeps its
//! raw columns and the mapping error for the same reason.

use std::time::Instant;

use crate::cdc::progress::Origin;
use crate::lsn::Lsn;
use crate::outbox::{OutboxEvent, PoisonFields};
use crate::poison::{Parking, PoisonRow};

/// One in-flight event: what to produce, and what to write to `poison_outbox` if it
/// never can be.
#[derive(Debug)]
// The large variant is the hot path (one per event); boxing it would add an
// allocation per event to save memory on the rare unmappable row.
#[allow(clippy::large_enum_variant)]
pub(crate) enum InFlight {
    Event {
        event: OutboxEvent,
        /// Commit time of its transaction (µs since 2000-01-01), for the latency.
        committed_at: i64,
        /// When its frame was taken off the stream, and when it was last handed to
        /// the producer (the received time until then): the per-stage latencies.
        received_at: Instant,
        produced_at: Instant,
        /// The last delivery failure: librdkafka's error kind and message.
        last_error: Option<(&'static str, String)>,
        /// Its key is parked (`relay.on_poison = "park-key"`): it is written to the
        /// poison table as parked instead of being produced.
        parked: bool,
        /// A previous process already recorded it in the poison table
        /// (`poison::RecordedPoison`): it is resolved as poisoned, not produced.
        recorded_before: bool,
        /// A size error may have been another record's: the next produce sends it
        /// in a batch of its own.
        alone: bool,
        /// Partition and offset of its last ack (its trace span's attributes).
        delivered: Option<(i32, i64)>,
    },
    Unmappable {
        fields: Box<PoisonFields>,
        error_kind: &'static str,
        reason: String,
        lsn: Lsn,
    },
}

impl InFlight {
    /// The topic the event is counted under; unmappable rows have none (that may be
    /// why they are poison).
    pub(crate) fn topic(&self) -> &str {
        match self {
            InFlight::Event { event, .. } => event.topic.as_str(),
            InFlight::Unmappable { .. } => "",
        }
    }

    /// The `poison_outbox` row for this event after `attempts` produces; `parking`
    /// says whether it parks its key (a parked event's row says so by itself).
    /// `origin` is the event's name in its transaction (the core's
    /// [`Core::origin`](crate::cdc::progress::Core::origin)): its ordinal is the row's
    /// `tx_position`.
    pub(crate) fn poison_row(&self, attempts: u32, parking: Parking, origin: Origin) -> PoisonRow {
        let attempts = i32::try_from(attempts).unwrap_or(i32::MAX);
        match self {
            InFlight::Event {
                event,
                parked: true,
                ..
            } => crate::poison::parked_row(event, Some(origin.ordinal)),
            InFlight::Event {
                event, last_error, ..
            } => {
                let (kind, error) = last_error
                    .clone()
                    .unwrap_or(("unknown", "delivery failed".to_owned()));
                PoisonRow {
                    fields: event.poison_fields(),
                    error,
                    error_kind: kind.to_owned(),
                    attempts,
                    lsn: event.source_lsn,
                    tx_position: Some(origin.ordinal),
                    parking,
                }
            }
            InFlight::Unmappable {
                fields,
                error_kind,
                reason,
                lsn,
            } => PoisonRow {
                fields: (**fields).clone(),
                error: reason.clone(),
                error_kind: (*error_kind).to_owned(),
                attempts,
                lsn: Some(*lsn),
                tx_position: Some(origin.ordinal),
                // No record key to park: the row could not be mapped.
                parking: Parking::None,
            },
        }
    }
}

/// What per-key order is kept for: the record key within its topic. A hash
/// collision only holds an unrelated event a little longer (see `Core::admit_keyed`).
pub(crate) fn order_key(event: &OutboxEvent) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    event.topic.hash(&mut h);
    event.key.hash(&mut h);
    h.finish()
}
