//! The metadata connection: an ordinary `tokio-postgres` client for the prerequisite
//! checks, slot state and poison inserts.
//!
//! It is opened from the same [`ConnInfo`] as the replication connection and secured
//! by the same [`TlsConnector`](super::tls::TlsConnector) (through
//! [`MakeRustlsConnect`]), because `tokio-postgres` alone knows only
//! `disable`/`prefer`/`require` and would silently skip the `verify-ca`/`verify-full`
//! checks. Its errors are converted to [`ReplicationError`] so that both connections
//! classify a failure the same way (see [`process_error`]).
//!
//! [`parse_url`] is where every command turns `postgres.url` into a [`ConnInfo`],
//! so it is also where the relay warns, once, when that URL lets the password cross
//! the network unencrypted ([`ConnInfo::may_send_password_in_clear`]): under
//! `sslmode=prefer`, the default, an active attacker refuses TLS and asks for the
//! password in clear, and the role holds the REPLICATION right. The default stays
//! `prefer`, as in libpq, so existing set-ups keep working; the warning says what
//! to change.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio_postgres::Client;

use crate::config::redact_url;
use crate::postgres::conninfo::{ConnInfo, SslMode};
use crate::postgres::error::{PgError, process_error};
use crate::postgres::replication::ReplicationError;
use crate::postgres::tls::MakeRustlsConnect;

/// Parses `postgres.url` (libpq URL semantics, see [`crate::postgres::conninfo`]); a
/// bad URL is a configuration error ([`PgError::InvalidUrl`], exit code 2). Warns
/// once per process when the password could be sent unencrypted.
///
/// # Errors
///
/// [`PgError::InvalidUrl`], naming the URL without its password.
pub fn parse_url(url: &str) -> Result<ConnInfo, PgError> {
    let info = ConnInfo::parse(url).map_err(|source| PgError::InvalidUrl {
        url: redact_url(url),
        source,
    })?;
    warn_once_if_password_in_clear(&info);
    Ok(info)
}

/// The start-up warning for a password that could travel in clear, at most once.
fn warn_once_if_password_in_clear(info: &ConnInfo) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if info.may_send_password_in_clear() && !WARNED.swap(true, Ordering::Relaxed) {
        let risk = match info.sslmode() {
            SslMode::Disable => "the connection is not encrypted",
            _ => "an attacker in the network path can refuse TLS and keep it in plain text",
        };
        tracing::warn!(
            target_db = %info,
            "postgres.url has a password and sslmode={}: {risk}, so the server, or an \
             attacker posing as it, can ask for the password in clear (or as an MD5 hash) \
             and take the relay's REPLICATION credential; set sslmode=verify-full with \
             sslrootcert, or at least sslmode=require",
            info.sslmode()
        );
    }
}

/// Opens a metadata connection from a URL (TLS per its `sslmode`).
///
/// # Errors
///
/// As [`parse_url`] and [`connect_info`].
pub async fn connect(url: &str) -> Result<Client, PgError> {
    connect_info(&parse_url(url)?).await
}

/// Opens a metadata connection from parsed connection info (TLS per `sslmode`).
///
/// # Errors
///
/// The connection error mapped by [`process_error`]: [`PgError::Unavailable`]
/// (transient), [`PgError::Prerequisite`] (refused: authentication, TLS, missing
/// database, …) or [`PgError::Failed`].
pub async fn connect_info(info: &ConnInfo) -> Result<Client, PgError> {
    connect_metadata(info)
        .await
        .map_err(|e| process_error(e, &format!("cannot connect to PostgreSQL at {info}: ")))
}

/// Opens an ordinary `tokio-postgres` connection (for metadata queries and poison
/// inserts) with the same TLS semantics, TCP keepalives and `connect_timeout` (over
/// TCP, TLS and authentication) as the replication connection, and spawns its
/// connection task, which ends when the returned client is dropped.
///
/// # Errors
///
/// [`ReplicationError::Io`] (`TimedOut`) when `connect_timeout` elapses,
/// [`ReplicationError::TlsConfig`] when the TLS roots cannot be loaded, otherwise the
/// connection error converted to [`ReplicationError`] (a server error keeps its
/// SQLSTATE), so both connections classify failures the same way.
pub async fn connect_metadata(info: &ConnInfo) -> Result<tokio_postgres::Client, ReplicationError> {
    let config = info.tokio_postgres_config();
    let tls = MakeRustlsConnect::from_conninfo(info)?;
    // tokio-postgres bounds only the TCP connect with it; libpq (and the
    // replication connection) bound TLS and authentication too.
    let connecting = config.connect(tls);
    let connected = match info.connect_timeout() {
        Some(limit) => tokio::time::timeout(limit, connecting).await.map_err(|_| {
            ReplicationError::Io(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("connecting to {info} timed out after {limit:?} (connect_timeout)"),
            ))
        })?,
        None => connecting.await,
    };
    let (client, connection) = connected.map_err(ReplicationError::from)?;
    let target = info.to_string();
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!(target_db = %target, error = %e, "metadata connection closed");
        }
    });
    Ok(client)
}

/// Whether the table `quoted` (a quoted, qualified name, as
/// [`quote_qualified`](crate::config::quote_qualified) writes it) exists: the one
/// catalog question many commands ask before they use a table a migration creates.
///
/// # Errors
///
/// The query's error.
pub async fn table_exists(
    client: &impl tokio_postgres::GenericClient,
    quoted: &str,
) -> Result<bool, tokio_postgres::Error> {
    client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&quoted])
        .await?
        .try_get(0)
}

/// The server's WAL flush position now (its replay position on a standby); zero
/// when the server gives none.
///
/// # Errors
///
/// The query's error.
pub async fn wal_end(
    client: &impl tokio_postgres::GenericClient,
) -> Result<crate::lsn::Lsn, tokio_postgres::Error> {
    let row = client
        .query_one(
            "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                          ELSE pg_current_wal_flush_lsn() END)::text",
            &[],
        )
        .await?;
    let text: Option<String> = row.try_get(0)?;
    Ok(text
        .and_then(|t| t.parse().ok())
        .unwrap_or(crate::lsn::Lsn::ZERO))
}

/// When the server started (`pg_postmaster_start_time()`, µs since the epoch): a
/// data directory restored in place restarts the server, so a session that
/// remembers positions of the server it streamed from checks this first.
///
/// # Errors
///
/// The query's error.
pub async fn postmaster_started(
    client: &impl tokio_postgres::GenericClient,
) -> Result<Option<i64>, tokio_postgres::Error> {
    client
        .query_one(
            "SELECT (extract(epoch FROM pg_postmaster_start_time()) * 1000000)::bigint",
            &[],
        )
        .await?
        .try_get(0)
}

/// Bounds every statement of a long-lived writer connection (the position saver,
/// the poison writer): a statement blocked on a lock held by a stuck transaction,
/// or on a server that stopped answering without closing the socket, fails with
/// SQLSTATE `57014` / `55P03` after `statement` / `lock`, and the writer retries it
/// on a new connection instead of waiting forever while nothing is confirmed.
///
/// # Errors
///
/// The `SET` failed (the connection is then as good as broken).
pub async fn bound_statements(
    client: &tokio_postgres::Client,
    statement: std::time::Duration,
    lock: std::time::Duration,
) -> Result<(), tokio_postgres::Error> {
    client
        .batch_execute(&format!(
            "SET statement_timeout = {}; SET lock_timeout = {}",
            statement.as_millis(),
            lock.as_millis()
        ))
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// tokio-postgres alone would wait for the startup answer for ever.
    #[tokio::test]
    async fn connect_timeout_bounds_a_silent_server() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("address").port();
        let info = ConnInfo::parse(&format!(
            "postgresql://u@127.0.0.1:{port}/db?sslmode=disable&connect_timeout=1"
        ))
        .expect("parse");
        let started = std::time::Instant::now();
        let err = connect_metadata(&info).await.expect_err("times out");
        assert!(
            matches!(&err, ReplicationError::Io(e) if e.kind() == io::ErrorKind::TimedOut),
            "{err:?}"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(10));
        assert!(err.is_transient(), "{err:?}");
    }
}
