//! A fenced producer under exactly-once: another relay's takeover, or the
//! transaction coordinator's own abort on `transaction.timeout.ms`?
//!
//! # Why
//!
//! Kafka answers both the same way: the producer's epoch was bumped and its
//! calls fail with `ProducerFenced`/`InvalidProducerEpoch` (KIP-98; KIP-588 made
//! the coordinator bump the epoch when it aborts a transaction on its timeout). A
//! takeover must end the process (exit 3), or two relays fence each other in turn;
//! a timeout abort only ends the session (a broker stall, a coordinator that lost
//! the transaction), or a stall would stop the relay for good. The whole-relay
//! simulation found the relay exiting on a timeout abort three times: in the
//! stream, in a lost session's drain, and in the start-up probe.
//!
//! It is the coordinator's abort when both hold: the transaction had been open for
//! at least the timeout, and no walsender but this session's holds the slot (this
//! session's does, none does, or the server cannot be asked, as while it restarts).
//! Relays initialise the slot's `transactional.id` only once they hold the slot, so
//! a relay that fenced this one holds it, unless it lost it again; and this relay's
//! next producer is initialised only once its next session holds the slot, which
//! waits for any holder as every start does (`relay.slot_busy_timeout_secs`).
//!
//! One rule for every place a fence can surface (`session::TransactionDriver` in
//! the stream and the drain, `exactly_once`'s start-up probe), so they cannot drift
//! apart.

use std::time::Duration;

use crate::cdc::ports::database::SessionDatabase;
use crate::kafka::TransactionError;
use crate::lifecycle::millis;

/// Who holds the slot, as the server says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SlotHolder {
    /// This session's walsender.
    ThisSession,
    /// No walsender holds it.
    Free,
    /// Another backend (its pid), or the server could not say (`None`).
    Other(Option<i32>),
}

/// Whether the fence `e` of a transaction open for `age` (`None`: none was open)
/// is the coordinator's timeout abort: `age` reached `timeout`, and no walsender
/// but `ours` (this session's, if it has one) is known to hold the slot. Says why
/// when it is not.
pub(crate) async fn coordinator_timed_out(
    e: &TransactionError,
    age: Option<Duration>,
    timeout: Duration,
    ours: Option<i32>,
    database: &dyn SessionDatabase,
) -> bool {
    if age.is_none_or(|age| age < timeout) {
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

/// Who holds the slot according to the server (a failure to ask, or a slot that
/// is gone, answers `Other(None)`: not known to be another relay's).
pub(crate) async fn slot_holder(ours: Option<i32>, database: &dyn SessionDatabase) -> SlotHolder {
    match database.slot_active_pid().await {
        Some(active) if active.is_some() && active == ours => SlotHolder::ThisSession,
        Some(None) => SlotHolder::Free,
        Some(active) => SlotHolder::Other(active),
        None => SlotHolder::Other(None),
    }
}
