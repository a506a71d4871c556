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

use super::ends::{Lost, session_or_process};
use crate::cdc::exactly_once::ExactlyOnce;
use crate::cdc::fence;
use crate::cdc::metrics as m;
use crate::cdc::ports::clock;
use crate::cdc::ports::database::SessionDatabase;
use crate::cdc::ports::producer::Producer;
use crate::cdc::progress::{Core, Origin};
use crate::error::Result;
use crate::kafka::TransactionError;
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

    /// An event's poison row committed (`ExactlyOnce::poisoned`).
    pub(super) fn poisoned(&mut self, origin: Option<Origin>) {
        if let (Some(eo), Some(origin)) = (self.exactly_once.as_mut(), origin) {
            eo.poisoned(origin);
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
    /// or lost and draining); the slot's holder is asked of `database`, so that the
    /// coordinator's abort on its timeout is told from another relay's takeover
    /// ([`fence`]). The producer is then replaced and the events are sent again;
    /// anything else, a producer of another process with the same id included, ends
    /// the process (exit 3), so two processes never fence each other in turn.
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

    /// Whether the fence `e` is the coordinator's timeout abort ([`fence`]), for
    /// the transaction open now.
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
        fence::coordinator_timed_out(e, age, self.timeout, ours, database).await
    }
}
