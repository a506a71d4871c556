//! Everything that talks to PostgreSQL.
//!
//! Two kinds of connection are used. The *metadata* connection is an ordinary
//! `tokio-postgres` client: prerequisites (`wal_level`, publication, slot state,
//! `wal_sender_timeout`) and poison inserts. The *replication* connection speaks the
//! streaming-replication sub-protocol, which `tokio-postgres` does not support; it is
//! hand-written on `postgres-protocol`.

pub mod conninfo;
pub mod frames;
pub mod pgoutput;
pub mod replication;
pub mod slot;
pub mod tls;

use tokio_postgres::{Client, NoTls};

use crate::config::redact_url;
use crate::error::{Error, Result};

/// Opens a metadata connection; the connection task runs until the client drops.
pub async fn connect(url: &str) -> Result<Client> {
    let config: tokio_postgres::Config = url.parse().map_err(|e| {
        Error::Config(crate::error::ConfigError::Invalid(format!(
            "postgres.url {}: {e}",
            redact_url(url)
        )))
    })?;
    let (client, connection) = config.connect(NoTls).await.map_err(|e| {
        Error::Other(format!(
            "cannot connect to PostgreSQL at {}: {}",
            redact_url(url),
            describe_error(&e)
        ))
    })?;
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(error = %e, "metadata connection closed");
        }
    });
    Ok(client)
}

/// Opens a metadata connection from parsed connection info (TLS per `sslmode`).
pub async fn connect_info(info: &conninfo::ConnInfo) -> Result<Client> {
    conninfo::connect_metadata(info).await.map_err(|e| {
        let message = format!("cannot connect to PostgreSQL at {info}: {e}");
        if e.is_transient() {
            Error::Transient(message)
        } else {
            Error::Other(message)
        }
    })
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
