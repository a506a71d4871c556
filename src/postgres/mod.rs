//! Everything that talks to PostgreSQL.
//!
//! Two kinds of connection are used. The *metadata* connection is an ordinary
//! `tokio-postgres` client: prerequisites (`wal_level`, publication, slot state,
//! `wal_sender_timeout`) and poison inserts. The *replication* connection speaks the
//! streaming-replication sub-protocol, which `tokio-postgres` does not support; it is
//! hand-written on `postgres-protocol`.

pub mod conninfo;
pub mod pgoutput;
pub mod prerequisite;
pub mod replication;
pub mod slot;
pub mod tls;

use tokio_postgres::Client;

use crate::config::redact_url;
use crate::error::{Error, Result};
use prerequisite::Prerequisite;

/// Parses `postgres.url` (libpq URL semantics, see [`conninfo`]); a bad URL is a
/// configuration error (exit code 2).
pub fn parse_url(url: &str) -> Result<conninfo::ConnInfo> {
    conninfo::ConnInfo::parse(url).map_err(|e| {
        Error::Config(crate::config::ConfigError::Invalid(format!(
            "postgres.url {}: {}",
            redact_url(url),
            e.message()
        )))
    })
}

/// Opens a metadata connection from a URL (TLS per its `sslmode`).
pub async fn connect(url: &str) -> Result<Client> {
    connect_info(&parse_url(url)?).await
}

/// Opens a metadata connection from parsed connection info (TLS per `sslmode`).
pub async fn connect_info(info: &conninfo::ConnInfo) -> Result<Client> {
    conninfo::connect_metadata(info)
        .await
        .map_err(|e| process_error(e, &format!("cannot connect to PostgreSQL at {info}: ")))
}

/// Maps a connection error to the process error of its class: transient errors
/// are retried; a missing or misconfigured PostgreSQL prerequisite (wal_level,
/// slot, publication, database, privileges, authentication, TLS) is exit code 3.
#[must_use]
pub fn process_error(e: replication::ReplicationError, context: &str) -> Error {
    use replication::ReplicationError as R;
    let message = format!("{context}{e}");
    if e.is_transient() {
        return Error::Transient(message);
    }
    let refused = |sqlstate: Option<&str>| {
        Error::Prerequisite(Prerequisite::Refused {
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
        _ => Error::Other(message),
    }
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
