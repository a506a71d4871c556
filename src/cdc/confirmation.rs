//! The session's confirmation part: the relay's saved position and the task that
//! writes it, owned apart from the deliveries.
//!
//! What may be confirmed is the sans-IO core's decision (`progress/saving.rs`): it
//! asks for saves, is told of each outcome, and never builds a status past the saved
//! position. This part only performs: it owns the position table, the saver of the
//! current session (`position_saver`), and the `/readyz` alert for saves that keep
//! failing, and it tells the session when a save outcome ends the session
//! ([`Verdict`]). One saver per session: the previous one is dropped before the next
//! session decides where to start, so a late save of an old session cannot land
//! after the new one's decision.

use std::time::{Duration, Instant};

use crate::cdc::metrics::Health;
use crate::cdc::position_saver::{PositionSaver, SaverEvent};
use crate::cdc::progress::Core;
use crate::lsn::Lsn;
use crate::outbox::position::{PositionTable, ServerHistory};
use crate::postgres::conninfo::ConnInfo;

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

/// The position table, this session's saver and the failure alert.
pub(crate) struct Confirmation {
    positions: PositionTable,
    saver: Option<PositionSaver>,
    /// Saves have failed since then, without one succeeding.
    failing_since: Option<Instant>,
}

impl Confirmation {
    pub(crate) fn new(positions: PositionTable) -> Confirmation {
        Confirmation {
            positions,
            saver: None,
            failing_since: None,
        }
    }

    /// The relay's position table.
    pub(crate) fn positions(&self) -> &PositionTable {
        &self.positions
    }

    /// The session ended: its saver stops before the next one is planned.
    pub(crate) fn end_session(&mut self) {
        self.saver = None;
    }

    /// A session starts at `start` on `history`, on the server that started at
    /// `server_started`: a saver of its own, which writes to that server only.
    pub(crate) fn start_session(
        &mut self,
        conninfo: &ConnInfo,
        history: ServerHistory,
        server_started: Option<i64>,
        start: Lsn,
        min_gap: Duration,
    ) {
        self.failing_since = None;
        self.saver = Some(PositionSaver::spawn(
            conninfo.clone(),
            self.positions.clone(),
            history,
            server_started,
            start,
            min_gap,
        ));
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
        let now = Instant::now();
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
            core.saved(saved, Instant::now());
        }
    }
}
