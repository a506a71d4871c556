//! What a session tells the operator: `/readyz` and its alerts, the metric
//! handles, the run's summary, and the streak of sessions that end without
//! progress at one position (said loudly from [`REPEATED_FAILURE_ALERT`] on,
//! instead of looping quietly).
//!
//! It owns that state and nothing else; every other part reports through it.

use std::time::Instant;

use super::RunSummary;
use super::ends::{FailureStreak, Lost};
use crate::cdc::in_flight::InFlight;
use crate::cdc::instruments::Instruments;
use crate::cdc::metrics::{self as m, Health};
use crate::cdc::progress::{Core, Records};
use crate::cdc::traces::{EventTraces, Trip};
use crate::lsn::Lsn;

/// Sessions in a row ending at one confirmed position before it is reported.
const REPEATED_FAILURE_ALERT: u32 = 3;

/// See the module documentation.
pub(super) struct Telemetry {
    pub(super) health: Health,
    pub(super) instruments: Instruments,
    pub(super) summary: RunSummary,
    streak: FailureStreak,
    /// A span per sampled delivered event (`[traces]`), when on.
    traces: Option<EventTraces>,
}

impl Telemetry {
    pub(super) fn new(health: Health, traces: Option<EventTraces>) -> Telemetry {
        Telemetry {
            health,
            instruments: Instruments::new(),
            summary: RunSummary::default(),
            streak: FailureStreak::default(),
            traces,
        }
    }

    /// Counts sessions ending without progress at `confirmed`; from
    /// [`REPEATED_FAILURE_ALERT`] on, says so loudly and turns not-ready.
    pub(super) fn session_ended(&mut self, reason: &Lost, confirmed: Lsn, progressed: bool) {
        let count = self.streak.ended(confirmed, progressed);
        ::metrics::gauge!(m::REPEATED_FAILURES).set(f64::from(count));
        if count >= REPEATED_FAILURE_ALERT {
            tracing::error!(
                %reason,
                %confirmed,
                sessions = count,
                "replication keeps failing at the same position without progress; backing off"
            );
            self.health.set_alert(
                "sessions",
                Some(format!(
                    "{count} replication sessions in a row ended at {confirmed} without progress: {reason}"
                )),
            );
        }
    }

    /// Clears the alert of a failure streak (or a replaced producer) once the
    /// confirmed position moves past where the streak was.
    pub(super) fn clear_streak_alert(&mut self, confirmed: Lsn) {
        if self.streak.count > 0 && confirmed > self.streak.at {
            self.streak.count = 0;
            ::metrics::gauge!(m::REPEATED_FAILURES).set(0.0);
            self.health.set_alert("sessions", None);
        }
    }

    /// Drops the records of the events the core resolved, counting the delivered ones
    /// (the poisoned ones were counted and dropped when their row committed).
    pub(super) fn forget_resolved(
        &mut self,
        records: &mut Records<InFlight>,
        core: &mut Core,
        now: Instant,
    ) {
        let (instruments, summary) = (&mut self.instruments, &mut self.summary);
        let traces = self.traces.as_ref();
        records.forget_resolved(core, |record, acked_at| {
            if let InFlight::Event {
                event,
                committed_at,
                received_at,
                produced_at,
                delivered,
                ..
            } = record
            {
                summary.delivered += 1;
                instruments.delivered(
                    &event.topic,
                    committed_at,
                    produced_at,
                    acked_at.unwrap_or(now),
                    now,
                );
                if let Some(traces) = traces {
                    traces.delivered(&Trip {
                        event: &event,
                        committed_at,
                        received_at,
                        produced_at,
                        acked_at,
                        resolved_at: now,
                        delivered,
                    });
                }
            }
        });
    }
}
