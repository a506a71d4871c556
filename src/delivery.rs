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

/// How a failed delivery is to be treated; the shell classifies the broker error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The record itself is at fault (`MessageSizeTooLarge`, `InvalidRecord`, topic
    /// invalid or unauthorised): retried up to `max_attempts`, then poisoned.
    Permanent,
    /// The broker or the network is at fault: retried with backoff forever, never poisoned.
    Transient,
}
