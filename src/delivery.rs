//! The vocabulary every delivering stage shares: which event ([`EventId`]) and how an
//! attempt to deliver it failed ([`Failure`]), and how any error is handled
//! ([`ErrorClass`]: retried, poisoned or fatal).
//!
//! The progress core (`crate::cdc::progress`) issues the ids; the Kafka publisher
//! carries them through the producer's delivery opaque and reports them back, and the
//! poison writer and the polling relay use the same ids and failure classes. Keeping
//! the two types here, below all of them, lets the publisher and the poison writer
//! stay ignorant of the core.

use std::fmt;

/// How the relay reacts to an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Retry with backoff, forever; never poison; the confirmed LSN stays put.
    Transient,
    /// Concerns one event: retry up to `max_attempts`, then write it to `poison_outbox`.
    Poison,
    /// Log one clear message and exit with a distinct code.
    Fatal,
}

/// Identity of one admitted outbox event, assigned by the core in admission order.
///
/// The shell keeps the record bytes keyed by it and hands it back in delivery reports.
/// Ids are unique for a progress core and for every core derived from it by a restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(u64);

impl EventId {
    /// The raw value, e.g. to carry through a producer's delivery opaque.
    #[must_use]
    pub const fn get(self) -> u64 {
        self.0
    }

    /// Rebuilds an id from [`EventId::get`]. An id the core did not issue is ignored by it.
    #[must_use]
    pub const fn from_raw(raw: u64) -> Self {
        Self(raw)
    }
}

impl fmt::Display for EventId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "event#{}", self.0)
    }
}

/// How a failed delivery is to be treated; the shell classifies the broker error
/// (`docs/architecture.md#the-delivery-failure-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The record itself is at fault (`MessageSizeTooLarge`, `InvalidRecord`): retried
    /// with backoff up to `max_attempts`, then poisoned.
    Permanent,
    /// The broker or the network is at fault: retried with backoff forever, never poisoned.
    Transient,
    /// The topic or the cluster is set up so that the event cannot go yet (missing
    /// topic or partition, no authorization, a timestamp outside the topic's window):
    /// not the event's fault. [`Failure::under`] decides, by `relay.on_config_error`,
    /// whether it blocks (retried like a transient failure, and alerted) or poisons.
    Configuration,
}

impl Failure {
    /// The failure as the relay treats it: a configuration failure is transient
    /// (held and retried until someone fixes the topic) unless
    /// `poison_configuration_errors`, then permanent.
    #[must_use]
    pub fn under(self, poison_configuration_errors: bool) -> Failure {
        match self {
            Failure::Configuration if poison_configuration_errors => Failure::Permanent,
            Failure::Configuration => Failure::Transient,
            other => other,
        }
    }
}
