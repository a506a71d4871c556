//! The Kafka-transaction driver of a session (`kafka.delivery = "exactly-once"`):
//! starts the commits and aborts the core asks for, hands their outcomes back to the
//! core once the transaction's last reports are in, and tells a failed call that
//! ends the session from one that ends the process.
//!
//! The transactions themselves, the progress record and the fencing at session
//! start are `cdc::exactly_once`'s; this part only drives them from the loop. In
//! at-least-once mode it holds nothing and every call is a no-op, so the loop reads
//! the same in both modes.
//!
//! It owns that state and nothing else: the core, the producer and the replication
//! stream are passed in by the loop.

use std::time::Duration;

use super::ends::{Lost, SlotHolder, session_or_process};
use crate::cdc::exactly_once::ExactlyOnce;
use crate::cdc::metrics as m;
use crate::cdc::ports::clock;
use crate::cdc::ports::database::SessionDatabase;
use crate::cdc::ports::producer::Producer;
use crate::cdc::progress::Core;
use crate::error::Result;
use crate::kafka::TransactionError;
use crate::lifecycle::millis;
use crate::lsn::Lsn;
use crate::outbox::position::ServerHistory;

/// See the module documentation.
pub(super) struct TransactionDriver {
    /// The Kafka transactions; `None` in at-least-once mode.
    exactly_once: Option<ExactlyOnce>,
    /// `kafka.transaction_timeout_ms`: a fence after a transaction this old may be
    /// the coordinator's own abort ([`TransactionDriver::failure`]).
    timeout: Duration,
}

impl TransactionDriver {
    pub(super) fn new(exactly_once: Option<ExactlyOnce>, timeout: Duration) -> TransactionDriver {
        TransactionDriver {
            exactly_once,
            timeout,
        }
    }

    /// Whether the relay runs in exactly-once mode.
    pub(super) fn on(&self) -> bool {
        self.exactly_once.is_some()
    }

    /// The transactions, for the session start (`ExactlyOnce::start_session`).
    pub(super) fn exactly_once(&mut self) -> Option<&mut ExactlyOnce> {
        self.exactly_once.as_mut()
    }

    /// A transactional call failed at the start, or a session ended with its
    /// transaction in an unknown state: the next producer's `init_transactions`
    /// fences this one and settles what it left.
    pub(super) fn needs_new_producer(&self) -> bool {
        self.exactly_once
            .as_ref()
            .is_some_and(ExactlyOnce::needs_new_producer)
    }

    /// Whether the transactional producer was initialised (a backlog's producer,
    /// taking the same `transactional.id`, would fence it).
    pub(super) fn initialized(&self) -> bool {
        self.exactly_once
            .as_ref()
            .is_some_and(ExactlyOnce::initialized)
    }

    /// The producer was replaced: the next one initialises its transactions anew.
    pub(super) fn producer_replaced(&mut self) {
        if let Some(eo) = self.exactly_once.as_mut() {
            eo.producer_replaced();
        }
    }

    /// A transaction's `Begin`, for the progress record's names of transactions.
    pub(super) fn transaction_begun(&mut self, commit: Lsn, xid: u32, commit_time: i64) {
        if let Some(eo) = self.exactly_once.as_mut() {
            eo.transaction_begun(commit, xid, commit_time);
        }
    }

    /// A transaction's `Commit`.
    pub(super) fn transaction_ended(&mut self, commit: Lsn, end: Lsn, confirmed: Lsn) {
        if let Some(eo) = self.exactly_once.as_mut() {
            eo.transaction_ended(commit, end, confirmed);
        }
    }

    /// Before a record is produced: begins a transaction if none is open. `false`
    /// when the producer cannot begin one (the session then ends).
    pub(super) fn before_produce(&mut self, publisher: &dyn Producer) -> bool {
        self.exactly_once
            .as_mut()
            .is_none_or(|eo| eo.before_produce(publisher))
    }

    /// Writes the progress record and starts the commit (once the session knows its
    /// server history).
    pub(super) fn commit(
        &mut self,
        publisher: &dyn Producer,
        core: &Core,
        history: Option<ServerHistory>,
    ) {
        if let (Some(eo), Some(history)) = (self.exactly_once.as_mut(), history) {
            eo.commit(publisher, core, history);
        }
    }

    /// Starts the abort.
    pub(super) fn abort(&mut self, publisher: &dyn Producer, core: &Core) {
        if let Some(eo) = self.exactly_once.as_mut() {
            tracing::info!(
                events = core.transaction_events(),
                "aborting the Kafka transaction: a record in it failed; its events are produced again"
            );
            eo.abort(publisher);
        }
    }

    /// Hands a finished commit's or abort's outcome to the core once the
    /// transaction's last reports are in (`drained`: nothing in flight, no report
    /// waiting; asked only while an outcome waits).
    pub(super) fn settle(
        &mut self,
        publisher: &dyn Producer,
        core: &mut Core,
        drained: impl FnOnce() -> bool,
    ) {
        if let Some(eo) = self.exactly_once.as_mut()
            && eo.settling()
        {
            eo.settle(publisher, core, drained());
        }
    }

    /// Whether a commit or abort call is under way, and whether its outcome waits
    /// for the last reports (both `false` in at-least-once mode).
    pub(super) fn waits(&self) -> (bool, bool) {
        self.exactly_once
            .as_ref()
            .map_or((false, false), |eo| (eo.calling(), eo.settling()))
    }

    /// Whether a Kafka transaction still has to end (a call or its outcome pending,
    /// events written or produced in it).
    pub(super) fn unfinished(&self, core: &Core) -> bool {
        self.exactly_once
            .as_ref()
            .is_some_and(|eo| eo.calling() || eo.settling())
            || core.transaction_events() > 0
    }

    /// Waits for the call under way (pending forever without one).
    pub(super) async fn finished(&mut self) {
        match self.exactly_once.as_mut() {
            Some(eo) => eo.finished().await,
            None => std::future::pending().await,
        }
    }

    /// A transactional failure ends the session (the producer is replaced) or,
    /// fenced or unsupported, the process. `walsender` is the session's (streaming,
    /// or lost and draining); the slot's holder is asked of `database`, so that a
    /// fence is told apart from a takeover. The coordinator fences a producer itself
    /// when it aborts its transaction on `transaction.timeout.ms` (a broker stall, a
    /// coordinator that lost the transaction): the epoch is bumped as for a new
    /// producer. It is that, and no takeover, when both hold: the transaction had
    /// been open for at least the timeout, and no other walsender holds the slot
    /// (this session's does, none does, or the server cannot be asked, as while it
    /// restarts). Relays initialise the slot's `transactional.id` only once they hold
    /// the slot, so a relay that fenced this one holds it, unless it lost it again;
    /// and this relay's next producer is initialised only once its next session
    /// holds the slot, which waits for a holder as any start does
    /// (`relay.slot_busy_timeout_secs`). The producer is then replaced and the events
    /// are sent again; anything else, a producer of another process with the same id
    /// included, ends the process (exit 3) as before, so two processes never fence
    /// each other in turn.
    ///
    /// # Errors
    ///
    /// A failure that needs the operator.
    pub(super) async fn failure(
        &mut self,
        walsender: Option<i32>,
        database: &dyn SessionDatabase,
    ) -> Result<Option<Lost>> {
        let Some(e) = self
            .exactly_once
            .as_mut()
            .and_then(ExactlyOnce::take_failure)
        else {
            return Ok(None);
        };
        if e.is_fenced() && self.fenced_by_timeout(&e, walsender, database).await {
            tracing::warn!(error = %e, "the transaction coordinator fenced this producer while this relay holds the slot: it aborted the transaction itself (kafka.transaction_timeout_ms passed, e.g. in a broker stall), no other relay took over");
            ::metrics::counter!(m::KAFKA_TRANSACTIONS, "outcome" => "timed_out").increment(1);
            return Ok(Some(Lost::CoordinatorAborted(e)));
        }
        session_or_process(e).map(Some)
    }

    /// Whether the fence `e` is the coordinator's timeout abort (see
    /// [`TransactionDriver::failure`]): the transaction was that old, and no
    /// walsender but this session's (`ours`) is known to hold the slot. Says why
    /// when it is not.
    async fn fenced_by_timeout(
        &self,
        e: &TransactionError,
        ours: Option<i32>,
        database: &dyn SessionDatabase,
    ) -> bool {
        let age = self
            .exactly_once
            .as_ref()
            .and_then(|eo| eo.transaction_age(clock::now()));
        if age.is_none_or(|age| age < self.timeout) {
            tracing::error!(error = %e, transaction_age_ms = age.map(millis), "fenced before the transaction could time out: another producer took this transactional.id");
            return false;
        }
        // Boxed: the connection's future is large, and this path is rare.
        match Box::pin(slot_holder(ours, database)).await {
            SlotHolder::Other(Some(pid)) => {
                tracing::error!(error = %e, slot_pid = pid, "fenced, and another walsender holds the slot: another relay took over");
                false
            }
            SlotHolder::ThisSession | SlotHolder::Free | SlotHolder::Other(None) => true,
        }
    }
}

/// Who holds the slot according to the server (a failure to ask, or a slot that
/// is gone, answers `Other(None)`: not known to be another relay's).
async fn slot_holder(ours: Option<i32>, database: &dyn SessionDatabase) -> SlotHolder {
    match database.slot_active_pid().await {
        Some(active) if active.is_some() && active == ours => SlotHolder::ThisSession,
        Some(None) => SlotHolder::Free,
        Some(active) => SlotHolder::Other(active),
        None => SlotHolder::Other(None),
    }
}
