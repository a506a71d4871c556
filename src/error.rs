//! Error types and their classification.
//!
//! Every error is classified where it appears (`docs/architecture.md#error-classes`): *transient* errors are
//! retried forever with backoff and never poison an event, *poison* errors concern one
//! event and end in `poison_outbox` after `max_attempts`, *fatal* errors stop the
//! process with one clear message and a distinct exit code. The exit codes are part of
//! the CLI contract: 0 ok, 2 usage/config, 3 PostgreSQL prerequisite, 4 broker
//! unreachable at start-up, 1 anything else.

use std::process::ExitCode;

use crate::config::ConfigError;
use crate::delivery::ErrorClass;
use crate::postgres::PgError;
use crate::postgres::prerequisite::Prerequisite;

/// Top-level error of a CLI command; decides the exit code.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A PostgreSQL prerequisite is missing: wal_level, publication, slot (exit code 3).
    #[error("PostgreSQL prerequisite not met: {0}")]
    Prerequisite(#[from] Prerequisite),
    /// The broker cannot be reached or refuses us at start-up (exit code 4).
    #[error("Kafka broker unavailable: {0}")]
    BrokerUnavailable(String),
    #[error("PostgreSQL error: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("Kafka error: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Bench(#[from] crate::tools::bench::BenchError),
    /// A transient failure (connection lost, server restarting): retried.
    #[error("{0}")]
    Transient(String),
    #[error("{0}")]
    Other(String),
    // --- postgres ---
    /// A failure of the PostgreSQL layer (connection, start-up checks, `postgres.url`);
    /// its exit code and class come from [`PgError`]. A [`PgError::Prerequisite`]
    /// becomes [`Error::Prerequisite`] instead (see the `From` impl), so that every
    /// exit-3 error is matched the same way.
    #[error(transparent)]
    Pg(PgError),
}

// --- postgres ---
impl From<PgError> for Error {
    fn from(e: PgError) -> Self {
        match e {
            PgError::Prerequisite(p) => Error::Prerequisite(p),
            other => Error::Pg(other),
        }
    }
}

impl Error {
    /// The process exit code for this error (the CLI contract in `docs/architecture.md#exit-codes`).
    #[must_use]
    pub fn exit_code(&self) -> ExitCode {
        ExitCode::from(match self {
            Error::Config(_) => 2,
            Error::Prerequisite(_) => 3,
            Error::BrokerUnavailable(_) => 4,
            Error::Postgres(_)
            | Error::Kafka(_)
            | Error::Io(_)
            | Error::Bench(_)
            | Error::Transient(_)
            | Error::Other(_) => 1,
            // --- postgres ---
            Error::Pg(e) => e.exit_code(),
        })
    }

    /// Whether retrying can help (`docs/architecture.md#error-classes`).
    #[must_use]
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::Transient(_) | Error::Io(_) => ErrorClass::Transient,
            // No server error attached: the connection itself failed.
            Error::Postgres(e) if e.as_db_error().is_none() => ErrorClass::Transient,
            // --- postgres ---
            Error::Pg(e) => e.class(),
            _ => ErrorClass::Fatal,
        }
    }
}

/// Result alias for CLI-level operations.
pub type Result<T, E = Error> = std::result::Result<T, E>;
