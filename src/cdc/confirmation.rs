//! The session's confirmation part: the relay's saved position and the task that
//! writes it, owned apart from the deliveries.
//!
//! What may be confirmed is the sans-IO core's decision (`progress/saving.rs`): it
//! asks for saves, is told of each outcome, and never builds a status past the saved
//! position. This part only performs: it owns the saver of the
//! current session (`position_saver`), and the `/readyz` alert for saves that keep
//! failing, and it tells the session when a save outcome ends the session
//! ([`Verdict`]). One saver per session: the previous one is dropped before the next
//! session decides where to start, so a late save of an old session cannot land
//! after the new one's decision.

use std::time::{Duration, Instant};

use crate::cdc::metrics::Health;
use crate::cdc::ports::clock;
use crate::cdc::ports::database::PositionWrites;
use crate::cdc::position_saver::{PositionSaver, SaverEvent};
use crate::cdc::progress::Core;
use crate::lsn::Lsn;

/// Saves failing this long turn `/readyz` 503 (the `position` alert): nothing is
/// confirmed meanwhile.
const SAVE_FAILURE_ALERT: Duration = Duration::from_secs(5);

/// What a save outcome means for the session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Go on.
    Continue,
    /// The server refuses new connections while shutting down: end the session so
    /// its walsender can exit (the core decided, `Core::server_stopping`).
    ServerStopping(String),
    /// The position row is not this session's to write any more: decide again.
    Refused(String),
}

/// This session's saver and the failure alert.
#[derive(Default)]
pub(crate) struct Confirmation {
    saver: Option<PositionSaver>,
    /// Saves have failed since then, without one succeeding.
    failing_since: Option<Instant>,
}

impl Confirmation {
    /// The session ended: its saver stops before the next one is planned.
    pub(crate) fn end_session(&mut self) {
        self.saver = None;
    }

    /// A session starts at `start`: a saver of its own, with `writes` that go to
    /// the session's server and history only.
    pub(crate) fn start_session(
        &mut self,
        writes: Box<dyn PositionWrites>,
        start: Lsn,
        min_gap: Duration,
    ) {
        self.failing_since = None;
        self.saver = Some(PositionSaver::spawn(writes, start, min_gap));
    }

    /// Hands a save the core asked for to the saver.
    pub(crate) fn request(&self, lsn: Lsn, urgent: bool) {
        if let Some(saver) = &self.saver {
            saver.request(lsn, urgent);
        }
    }

    /// The saver's next event; never without a saver.
    pub(crate) async fn next_event(&mut self) -> SaverEvent {
        match &mut self.saver {
            Some(saver) => saver.next_event().await,
            None => std::future::pending().await,
        }
    }

    /// Tells the core what the saver did and says what it means for the session.
    /// Saves failing for [`SAVE_FAILURE_ALERT`] turn the relay not-ready (nothing is
    /// confirmed meanwhile, and reading stops once a window waits).
    pub(crate) fn on_event(
        &mut self,
        event: SaverEvent,
        core: &mut Core,
        health: &Health,
    ) -> Verdict {
        let now = clock::now();
        match event {
            SaverEvent::Saved(lsn) => {
                core.saved(lsn, now);
                if self.failing_since.take().is_some() {
                    health.set_alert("position", None);
                }
                Verdict::Continue
            }
            SaverEvent::Failed {
                phase,
                sqlstate,
                message,
            } => {
                core.save_failed(phase, sqlstate.as_deref());
                if core.server_stopping() {
                    return Verdict::ServerStopping(message);
                }
                let since = *self.failing_since.get_or_insert(now);
                if now.duration_since(since) >= SAVE_FAILURE_ALERT {
                    health.set_alert(
                        "position",
                        Some(format!(
                            "the relay position cannot be saved for {}s ({message}); nothing is confirmed meanwhile",
                            now.duration_since(since).as_secs()
                        )),
                    );
                }
                Verdict::Continue
            }
            SaverEvent::Refused { reason } => Verdict::Refused(reason),
        }
    }

    /// At shutdown: saves what the core confirmed (within `timeout`) and tells it
    /// what was saved, so the last status confirms no further.
    pub(crate) async fn final_save(&mut self, core: &mut Core, timeout: Duration) {
        if let Some(saver) = &mut self.saver {
            let saved = saver.flush(core.confirmed(), timeout).await;
            core.saved(saved, clock::now());
        }
    }
}
