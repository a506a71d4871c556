//! What can go wrong on a PostgreSQL connection, and whether retrying helps.
//!
//! Both connections report through [`ReplicationError`]: the hand-written replication
//! connection builds it from the wire (`ErrorResponse` fields, socket errors, TLS
//! alerts), and the metadata connection converts `tokio-postgres` errors into the same
//! variants (`From<tokio_postgres::Error>`), so a caller classifies either the same way.
//!
//! The class comes from the SQLSTATE where the server sent one
//! (<https://www.postgresql.org/docs/current/errcodes-appendix.html>): connection
//! loss, shutdown and resource exhaustion pass, an operator's mistake (authentication,
//! missing database, slot or privilege) does not. `tokio-postgres` exposes no error
//! kind for a failed TLS handshake or a timeout, only its message text, which is why
//! the conversion looks at the message prefixes of `tokio_postgres::error::Kind`.

use std::io;

use crate::delivery::ErrorClass;
use crate::postgres::conninfo::ConnInfoError;
use crate::postgres::tls::{TlsConfigError, rustls_error};

/// SQLSTATE codes the relay reacts to
/// (<https://www.postgresql.org/docs/current/errcodes-appendix.html>).
pub mod sqlstate {
    /// `invalid_authorization_specification`: no `pg_hba.conf` entry, login refused.
    pub const INVALID_AUTHORIZATION_SPECIFICATION: &str = "28000";
    /// `invalid_password`: wrong password.
    pub const INVALID_PASSWORD: &str = "28P01";
    /// `invalid_catalog_name`: the database does not exist.
    pub const INVALID_CATALOG_NAME: &str = "3D000";
    /// `undefined_object`: replication slot or publication does not exist.
    pub const UNDEFINED_OBJECT: &str = "42704";
    /// `duplicate_object`: the replication slot already exists.
    pub const DUPLICATE_OBJECT: &str = "42710";
    /// `insufficient_privilege`: the role lacks REPLICATION (or similar).
    pub const INSUFFICIENT_PRIVILEGE: &str = "42501";
    /// `object_not_in_prerequisite_state`: `wal_level` below `logical`, slot
    /// invalidated ("can no longer get changes from replication slot").
    pub const OBJECT_NOT_IN_PREREQUISITE_STATE: &str = "55000";
    /// `object_in_use`: the slot is active for another process.
    pub const OBJECT_IN_USE: &str = "55006";
    /// `admin_shutdown`: the server is shutting down or the backend was terminated.
    pub const ADMIN_SHUTDOWN: &str = "57P01";
    /// `crash_shutdown`: another backend crashed, the server is restarting.
    pub const CRASH_SHUTDOWN: &str = "57P02";
    /// `cannot_connect_now`: the server is starting up or shutting down.
    pub const CANNOT_CONNECT_NOW: &str = "57P03";
    /// `database_dropped`: the database was dropped under us.
    pub const DATABASE_DROPPED: &str = "57P04";
}

/// A failure on the replication (or metadata) connection.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplicationError {
    /// The socket failed (refused, reset, timed out).
    #[error("I/O error on the PostgreSQL connection: {0}")]
    Io(#[from] io::Error),
    /// TLS could not be established: the server refused it although `sslmode`
    /// requires it, or the certificate failed verification.
    #[error("TLS: {0}")]
    Tls(String),
    /// Authentication failed, on the server's side (`code` is its SQLSTATE, class
    /// 28) or ours (unsupported method, missing password, bad server signature).
    #[error("authentication failed (method {method}): {message}{}", sqlstate_suffix(.code.as_deref()))]
    Auth {
        /// The method the server asked for: `trust`, `password`, `md5`,
        /// `scram-sha-256`, `gss`, … (`none` when refused before any).
        method: String,
        /// The server's SQLSTATE, `None` when the client gave up.
        code: Option<String>,
        /// What went wrong.
        message: String,
    },
    /// The server reported an error (`ErrorResponse`).
    #[error("{message} (SQLSTATE {code}){}{}", detail_suffix(.detail.as_deref()), hint_suffix(.hint.as_deref()))]
    Server {
        /// SQLSTATE, e.g. `55006`.
        code: String,
        /// Primary message.
        message: String,
        /// `DETAIL`, if any.
        detail: Option<String>,
        /// `HINT`, if any.
        hint: Option<String>,
    },
    /// The server sent something the protocol does not allow here.
    #[error("PostgreSQL protocol violation: {0}")]
    Protocol(String),
    /// The server closed the connection (EOF).
    #[error("the server closed the connection")]
    ConnectionClosed,
    /// The request cannot be made as configured (bad name, bad option).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The connection URL was rejected.
    #[error("invalid configuration: {0}")]
    ConnInfo(#[from] ConnInfoError),
    /// The TLS settings cannot be used (e.g. `sslrootcert` names a missing file).
    #[error("invalid configuration: {0}")]
    TlsConfig(#[from] TlsConfigError),
}

fn sqlstate_suffix(code: Option<&str>) -> String {
    code.map(|c| format!(" (SQLSTATE {c})")).unwrap_or_default()
}

fn detail_suffix(detail: Option<&str>) -> String {
    detail.map(|d| format!("; detail: {d}")).unwrap_or_default()
}

fn hint_suffix(hint: Option<&str>) -> String {
    hint.map(|h| format!("; hint: {h}")).unwrap_or_default()
}

impl ReplicationError {
    /// The server's SQLSTATE, for [`Self::Server`] and server-side [`Self::Auth`].
    #[must_use]
    pub fn code(&self) -> Option<&str> {
        match self {
            ReplicationError::Server { code, .. } => Some(code),
            ReplicationError::Auth { code, .. } => code.as_deref(),
            _ => None,
        }
    }

    /// The slot is active for another process (SQLSTATE 55006 `object_in_use`).
    #[must_use]
    pub fn is_slot_in_use(&self) -> bool {
        self.code() == Some(sqlstate::OBJECT_IN_USE)
    }

    /// A slot or publication does not exist (SQLSTATE 42704 `undefined_object`).
    #[must_use]
    pub fn is_undefined_object(&self) -> bool {
        self.code() == Some(sqlstate::UNDEFINED_OBJECT)
    }

    /// The slot already exists (SQLSTATE 42710 `duplicate_object`).
    #[must_use]
    pub fn is_duplicate_object(&self) -> bool {
        self.code() == Some(sqlstate::DUPLICATE_OBJECT)
    }

    /// Transient or fatal (`docs/architecture.md#error-classes`); never [`ErrorClass::Poison`], since a
    /// connection error concerns no single event.
    ///
    /// - transient: I/O errors, EOF, and server errors of classes 08 (connection),
    ///   40 (rollback), 53 (resources), 57 (operator intervention: shutdown, crash
    ///   restart, starting up — except 57P04 database dropped), 58 (system) and XX
    ///   (internal);
    /// - fatal: authentication (28xxx), TLS, configuration, protocol violations, a
    ///   missing database (3D000), slot or publication (42704), privileges (42501),
    ///   `wal_level` not logical or slot invalidated (55000), and a slot in use by
    ///   another process (55006). The last is fatal so that two relays do not fight
    ///   over one slot; right after a crash, the old walsender can hold the slot until
    ///   `wal_sender_timeout` notices, so a reconnect loop may retry
    ///   [`Self::is_slot_in_use`] for that long before giving up.
    #[must_use]
    pub fn classify(&self) -> ErrorClass {
        match self {
            ReplicationError::Io(_) | ReplicationError::ConnectionClosed => ErrorClass::Transient,
            ReplicationError::Server { code, .. } => classify_sqlstate(code),
            ReplicationError::Tls(_)
            | ReplicationError::Auth { .. }
            | ReplicationError::Protocol(_)
            | ReplicationError::Config(_)
            | ReplicationError::ConnInfo(_)
            | ReplicationError::TlsConfig(_) => ErrorClass::Fatal,
        }
    }

    /// `classify() == Transient`.
    #[must_use]
    pub fn is_transient(&self) -> bool {
        self.classify() == ErrorClass::Transient
    }
}

/// The class of a server error by its SQLSTATE (see [`ReplicationError::classify`]).
#[must_use]
pub fn classify_sqlstate(code: &str) -> ErrorClass {
    if code == sqlstate::DATABASE_DROPPED {
        return ErrorClass::Fatal;
    }
    match code.get(..2) {
        Some("08" | "40" | "53" | "57" | "58" | "XX") => ErrorClass::Transient,
        _ => ErrorClass::Fatal,
    }
}

/// Maps a `tokio-postgres` error (the metadata connection) onto the same variants,
/// so both connections classify alike.
impl From<tokio_postgres::Error> for ReplicationError {
    fn from(e: tokio_postgres::Error) -> Self {
        if let Some(db) = e.as_db_error() {
            let code = db.code().code().to_owned();
            if code.starts_with("28") {
                return ReplicationError::Auth {
                    method: "unknown".to_owned(),
                    code: Some(code),
                    message: db.message().to_owned(),
                };
            }
            return ReplicationError::Server {
                code,
                message: db.message().to_owned(),
                detail: db.detail().map(str::to_owned),
                hint: db.hint().map(str::to_owned),
            };
        }
        if e.is_closed() {
            return ReplicationError::ConnectionClosed;
        }
        let text = e.to_string();
        let source = std::error::Error::source(&e);
        if let Some(cfg) = source.and_then(|s| s.downcast_ref::<TlsConfigError>()) {
            return ReplicationError::TlsConfig(cfg.clone());
        }
        let io_source = source.and_then(|s| s.downcast_ref::<io::Error>());
        let described = match source {
            Some(s) => format!("{text}: {s}"),
            None => text.clone(),
        };
        if text.starts_with("error performing TLS handshake") {
            return match io_source {
                Some(io_err) if rustls_error(io_err).is_none() => {
                    ReplicationError::Io(io::Error::new(io_err.kind(), described))
                }
                _ => ReplicationError::Tls(described),
            };
        }
        if text.starts_with("authentication error") {
            return ReplicationError::Auth {
                method: "unknown".to_owned(),
                code: None,
                message: described,
            };
        }
        if text.starts_with("timeout waiting for server") {
            return ReplicationError::Io(io::Error::new(io::ErrorKind::TimedOut, described));
        }
        if text.starts_with("invalid configuration") {
            return ReplicationError::Config(described);
        }
        match io_source {
            Some(io_err) => ReplicationError::Io(io::Error::new(io_err.kind(), described)),
            None => ReplicationError::Protocol(described),
        }
    }
}
