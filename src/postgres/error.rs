//! The errors of the PostgreSQL layer as a whole, and what they mean for the process.
//!
//! The layer sits below `crate::error`, so it cannot return the top-level error
//! itself; it returns [`PgError`], which says everything the top level needs to
//! decide: the exit code (2 for a bad `postgres.url`, 3 for a missing prerequisite,
//! 1 otherwise) and the class (`docs/architecture.md#error-classes`). A connection
//! error is transient when a retry can mend it (connection lost, server starting or
//! shutting down, see [`ReplicationError::classify`]); when the server refuses us
//! for a reason only an operator can fix (authentication, TLS, missing database,
//! privileges, an object missing or in use) it is a [`Prerequisite::Refused`]; the
//! rest is fatal. Each variant keeps the error it came from as its `source`.
//!
//! The messages are the ones operators and the integration tests know: `context`
//! (what was being done, ending in `": "`) followed by the cause.

use crate::delivery::ErrorClass;
use crate::postgres::conninfo::ConnInfoError;
use crate::postgres::prerequisite::Prerequisite;
use crate::postgres::replication::ReplicationError;

/// A failure of the PostgreSQL layer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgError {
    /// A PostgreSQL prerequisite is missing: wal_level, publication, slot, or the
    /// server refused us for a reason only an operator can fix (exit code 3).
    #[error("PostgreSQL prerequisite not met: {0}")]
    Prerequisite(#[from] Prerequisite),
    /// `postgres.url` cannot be parsed (a configuration error, exit code 2). `url`
    /// is redacted: it never holds the password.
    #[error("invalid configuration: postgres.url {url}: {}", .source.message())]
    InvalidUrl {
        /// The URL without its password.
        url: String,
        /// What is wrong with it.
        source: ConnInfoError,
    },
    /// The connection failed or was lost in a way a retry can mend (connection
    /// refused or reset, server starting up or shutting down): transient.
    #[error("{context}{source}")]
    Unavailable {
        /// What was being done, e.g. "cannot connect to PostgreSQL at …: ".
        context: String,
        /// The connection's error (boxed: it is large, and rare).
        source: Box<ReplicationError>,
    },
    /// The connection or a command failed for good, for a reason that is no missing
    /// prerequisite (a protocol violation, an unexpected server error): fatal.
    #[error("{context}{source}")]
    Failed {
        /// What was being done.
        context: String,
        /// The connection's error (boxed: it is large, and rare).
        source: Box<ReplicationError>,
    },
    /// A query the start-up checks depend on failed: fatal.
    #[error("{context}{}", describe_error(.source))]
    Query {
        /// What was being done, e.g. "cannot read server settings: ".
        context: &'static str,
        /// The metadata connection's error.
        source: tokio_postgres::Error,
    },
    /// A query about the replication slot failed while waiting for it: transient
    /// (the session reconnects and looks again).
    #[error("{context}{}", describe_error(.source))]
    SlotQuery {
        /// What was being done, e.g. "cannot read pg_replication_slots: ", or empty.
        context: &'static str,
        /// The metadata connection's error.
        source: tokio_postgres::Error,
    },
    /// `outbox.table` is not a table name the checks can look up.
    #[error(transparent)]
    TableName(#[from] crate::config::TableNameError),
    /// The standby the slot lives on (`postgres.slot_url`) has not replayed the
    /// primary's WAL up to a position the relay needs before it judges or creates
    /// the slot: transient (the session starts again, and waits again).
    #[error(
        "the standby (postgres.slot_url) has replayed the primary's WAL up to {replayed} only, \
         not yet to {needed}, after {waited_secs} s: the relay judges its slot only once the \
         standby has what the primary holds of the relay's own writes"
    )]
    StandbyBehind {
        needed: crate::lsn::Lsn,
        replayed: crate::lsn::Lsn,
        waited_secs: u64,
    },
}

impl PgError {
    /// The server's SQLSTATE, when it sent one.
    #[must_use]
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            PgError::Unavailable { source, .. } | PgError::Failed { source, .. } => source.code(),
            PgError::Query { source, .. } | PgError::SlotQuery { source, .. } => {
                source.code().map(tokio_postgres::error::SqlState::code)
            }
            PgError::Prerequisite(Prerequisite::Refused { sqlstate, .. }) => sqlstate.as_deref(),
            _ => None,
        }
    }

    /// The process exit code for this error (`docs/architecture.md#exit-codes`).
    #[must_use]
    pub fn exit_code(&self) -> u8 {
        match self {
            PgError::InvalidUrl { .. } => 2,
            PgError::Prerequisite(_) => 3,
            PgError::Unavailable { .. }
            | PgError::Failed { .. }
            | PgError::Query { .. }
            | PgError::SlotQuery { .. }
            | PgError::StandbyBehind { .. }
            | PgError::TableName(_) => 1,
        }
    }

    /// Whether retrying can help (`docs/architecture.md#error-classes`); never
    /// [`ErrorClass::Poison`], since none of these concerns a single event.
    #[must_use]
    pub fn class(&self) -> ErrorClass {
        match self {
            PgError::Unavailable { .. }
            | PgError::SlotQuery { .. }
            | PgError::StandbyBehind { .. } => ErrorClass::Transient,
            PgError::Prerequisite(_)
            | PgError::InvalidUrl { .. }
            | PgError::Failed { .. }
            | PgError::Query { .. }
            | PgError::TableName(_) => ErrorClass::Fatal,
        }
    }
}

/// Maps a connection error to the layer's error of its class: transient errors
/// are retried; a missing or misconfigured PostgreSQL prerequisite (wal_level,
/// slot, publication, database, privileges, authentication, TLS) is exit code 3.
/// `context` says what was being done and ends in `": "` (or is empty).
#[must_use]
pub fn process_error(e: ReplicationError, context: &str) -> PgError {
    use ReplicationError as R;
    if e.is_transient() || waits_for_the_primary(&e) {
        return PgError::Unavailable {
            context: context.to_owned(),
            source: Box::new(e),
        };
    }
    let refused = |sqlstate: Option<&str>| {
        PgError::Prerequisite(Prerequisite::Refused {
            context: context.to_owned(),
            message: e.to_string(),
            sqlstate: sqlstate.map(str::to_owned),
        })
    };
    match (&e, e.code()) {
        (R::Auth { .. } | R::Tls(_), code) => refused(code),
        (_, Some(code))
            if code.starts_with("28")
                || matches!(code, "55000" | "42704" | "55006" | "3D000" | "42501") =>
        {
            refused(Some(code))
        }
        _ => PgError::Failed {
            context: context.to_owned(),
            source: Box::new(e),
        },
    }
}

/// A standby refusing logical decoding because its primary's `wal_level` is below
/// `logical` (SQLSTATE 55000, "logical decoding on standby requires wal_level >=
/// logical on the primary"): a state of the primary an operator puts back, not a
/// setting of this relay's. It is waited out like an unavailable server, so that a
/// relay decoding on the standby heals its invalidated slot once the primary is
/// back at `logical`, instead of exiting.
fn waits_for_the_primary(e: &ReplicationError) -> bool {
    let message = e.to_string();
    e.code() == Some("55000") && message.contains("wal_level") && message.contains("primary")
}

/// The server's message (with its SQLSTATE) when there is one, else the error text.
#[must_use]
pub fn describe_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => match std::error::Error::source(e) {
            Some(source) => format!("{e}: {source}"),
            None => e.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn server(code: &str) -> ReplicationError {
        ReplicationError::Server {
            code: code.to_owned(),
            message: "boom".to_owned(),
            detail: None,
            hint: None,
        }
    }

    #[test]
    fn process_error_classifies_by_sqlstate() {
        let e = process_error(server("57P03"), "cannot connect: ");
        assert!(matches!(e, PgError::Unavailable { .. }), "{e:?}");
        assert_eq!(e.class(), ErrorClass::Transient);
        assert_eq!(e.exit_code(), 1);
        assert_eq!(e.to_string(), "cannot connect: boom (SQLSTATE 57P03)");

        for code in ["28P01", "3D000", "42501", "42704", "55000", "55006"] {
            let e = process_error(server(code), "ctx: ");
            let refused = match &e {
                PgError::Prerequisite(Prerequisite::Refused {
                    sqlstate: Some(c),
                    context,
                    ..
                }) => c == code && context == "ctx: ",
                _ => false,
            };
            assert!(refused, "{code}: {e:?}");
            assert_eq!(e.exit_code(), 3);
            assert_eq!(e.class(), ErrorClass::Fatal);
        }

        let e = process_error(server("22P02"), "");
        assert!(matches!(e, PgError::Failed { .. }), "{e:?}");
        assert_eq!(e.class(), ErrorClass::Fatal);
        assert_eq!(e.exit_code(), 1);
        assert_eq!(e.to_string(), "boom (SQLSTATE 22P02)");
    }

    #[test]
    fn stays_small_enough_to_return_by_value() {
        // clippy::result_large_err: crate::Error wraps this, and is returned everywhere.
        assert!(
            std::mem::size_of::<PgError>() <= 96,
            "{}",
            std::mem::size_of::<PgError>()
        );
    }

    #[test]
    fn authentication_and_tls_failures_are_prerequisites() {
        let auth = ReplicationError::Auth {
            method: "md5".into(),
            code: None,
            message: "no password".into(),
        };
        assert!(matches!(
            process_error(auth, ""),
            PgError::Prerequisite(Prerequisite::Refused { sqlstate: None, .. })
        ));
        let tls = ReplicationError::Tls("handshake failed".into());
        assert_eq!(process_error(tls, "").exit_code(), 3);
    }
}
