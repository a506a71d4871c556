//! The streaming-replication connection: startup, authentication, replication
//! commands and the `CopyBoth` stream, written on `postgres-protocol`.
//!
//! `tokio-postgres` cannot open a replication connection (it has no
//! `replication=database` startup parameter and no `CopyBoth` support), so this module
//! speaks the wire protocol itself; `postgres-protocol` supplies the frontend message
//! encoders and the MD5/SCRAM computations, and a small checked cursor parses what the
//! server sends (it never panics and never trusts a length).
//!
//! # Why `replication=database`
//!
//! A startup packet with `replication=database` makes the backend a *walsender*
//! connected to one database: it accepts the replication commands (`IDENTIFY_SYSTEM`,
//! `CREATE_REPLICATION_SLOT … LOGICAL`, `START_REPLICATION SLOT … LOGICAL`) as well as
//! ordinary SQL through the simple-query protocol. Logical decoding needs the database
//! (the catalog is per database); `replication=true` would be a physical walsender.
//! See <https://www.postgresql.org/docs/current/protocol-replication.html>.
//!
//! The walsender runs `pgoutput`'s output functions in *this* session, so the session
//! settings decide how column values are rendered as text. We therefore start with
//! `client_encoding=UTF8` and `options=-c DateStyle=ISO -c TimeZone=UTC -c
//! extra_float_digits=3`: timestamps come out as ISO 8601 in UTC and floats round-trip,
//! whatever the server's or the role's defaults are.
//!
//! # The `CopyBoth` phase
//!
//! `START_REPLICATION` answers `CopyBothResponse`; from then on both directions carry
//! `CopyData` messages (<https://www.postgresql.org/docs/current/protocol-flow.html#PROTOCOL-COPY>).
//! The walsender sends XLogData (`'w'`, one `pgoutput` message each) and primary
//! keepalives (`'k'`); we send standby status updates (`'r'`). Both are parsed and
//! encoded in [`frames`]. The server ends the stream with `CopyDone` (seen as
//! `Ok(None)` from [`ReplicationStream::next_frame`]) or an `ErrorResponse` (for
//! example when the publication does not exist, which is only noticed when the first
//! change is decoded); [`ReplicationStream::finish`] ends it from our side.
//!
//! Errors before `CopyBothResponse` (slot in use, slot missing, `wal_level` too low)
//! come back from [`ReplicationConnection::start_logical_replication`]: PostgreSQL
//! sends `CopyBothResponse` only once the walsender is fully set up.
//!
//! # Keepalives and status updates
//!
//! A keepalive's `wal_end` is how far the walsender has read the WAL. Its
//! `reply_requested` flag means half of `wal_sender_timeout` has passed without a
//! status update from us; at the full timeout the walsender disconnects. A status
//! update's `flush` is what the slot may forget: `confirmed_flush_lsn` moves to it
//! (`0/0` is ignored). Do not rely on the server to refuse a smaller value than
//! before: the relay never reports less than it already reported.
//!
//! The relay answers every `reply_requested` at once and also sends updates on a
//! timer well inside `wal_sender_timeout`, whether or not it is reading: the timeout
//! counts from our last *reply*, not our last read, so a relay that stops reading
//! (backpressure) must keep replying. Sending never waits for the reader:
//! [`ReplicationStream::send_status`] only writes. Materialize's Postgres source
//! explains the same semantics at length
//! (<https://github.com/MaterializeInc/materialize/blob/main/src/storage/src/source/postgres/replication.rs>);
//! the walsender's side is `ProcessStandbyReplyMessage`,
//! `WalSndKeepaliveIfNecessary` and `WalSndCheckTimeOut` in
//! `src/backend/replication/walsender.c`.
//!
//! # Cancel safety
//!
//! The stream is driven from one `tokio::select!` loop, which drops whichever branch
//! future did not finish. [`ReplicationStream::next_frame`] is cancel-safe: bytes are
//! read into a buffer owned by the stream (`read_buf` itself is cancel-safe) and a
//! message is taken out of it only when it is complete, in the same poll that returns
//! it, so dropping the future never loses or splits a message.
//! [`ReplicationStream::send_status`] keeps its unsent bytes in the stream too: if it
//! is cancelled mid-write the rest goes out before the next message, so the byte
//! stream is never corrupted (the cancelled update itself is still delivered, later).
//!
//! Reading is batched: one `read` fills up to 64 KiB (more for a larger message) and
//! every complete message in it is handed out without another system call; XLogData
//! payloads are zero-copy slices of that buffer.
//!
//! # TLS
//!
//! `sslmode` follows libpq (see [`crate::postgres::tls`]): an `SSLRequest` first, then a rustls
//! handshake on `S`, plain on `N` only under `prefer`. SCRAM uses channel binding
//! (`SCRAM-SHA-256-PLUS`) when the session is encrypted and the server offers it.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{
    ChannelBinding, SCRAM_SHA_256, SCRAM_SHA_256_PLUS, ScramSha256,
};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;

use crate::config::quote_ident;
use crate::delivery::ErrorClass;
use crate::lsn::Lsn;
use crate::postgres::conninfo::{ChannelBindingMode, ConnInfo, ConnInfoError, Host, SslMode};
use crate::postgres::tls::{TlsConfigError, TlsConnector, rustls_error, session_channel_binding};
use frames::{ServerFrame, StandbyStatus};

/// The output plugin the relay decodes.
pub const OUTPUT_PLUGIN: &str = "pgoutput";

/// Session settings sent at startup so `pgoutput`'s text output is stable.
pub const SESSION_OPTIONS: &str = "-c DateStyle=ISO -c TimeZone=UTC -c extra_float_digits=3";

/// Bytes asked of the socket per read (more when a message is larger).
const READ_CHUNK: usize = 64 * 1024;

/// Largest message accepted from the server. PostgreSQL builds messages in buffers
/// of at most 1 GiB (`MaxAllocSize`); anything longer is a broken stream.
const MAX_MESSAGE_LEN: usize = 1 << 30;

/// How long [`ReplicationStream::finish`] waits for the server to close.
const FINISH_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// SQLSTATE codes the relay reacts to
/// (<https://www.postgresql.org/docs/current/errcodes-appendix.html>).
pub mod frames;

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
    /// The request cannot be made as configured (bad URL, bad name, TLS roots).
    #[error("invalid configuration: {0}")]
    Config(String),
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
            | ReplicationError::Config(_) => ErrorClass::Fatal,
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

impl From<ConnInfoError> for ReplicationError {
    fn from(e: ConnInfoError) -> Self {
        ReplicationError::Config(e.to_string())
    }
}

impl From<TlsConfigError> for ReplicationError {
    fn from(e: TlsConfigError) -> Self {
        ReplicationError::Config(e.to_string())
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
            return ReplicationError::Config(cfg.to_string());
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

/// The answer to `IDENTIFY_SYSTEM`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemIdentity {
    /// The cluster's unique system identifier.
    pub systemid: u64,
    /// The current timeline.
    pub timeline: u32,
    /// The current WAL flush position.
    pub xlogpos: Lsn,
    /// The database this walsender is connected to.
    pub dbname: Option<String>,
}

/// What `CREATE_REPLICATION_SLOT` does with the snapshot at the slot's consistent point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SnapshotAction {
    /// Export it (valid until the next command on this connection); its name is
    /// returned in [`CreatedSlot::snapshot_name`].
    Export,
    /// Do not export it: the relay only needs changes from the consistent point on.
    NoExport,
    /// Use it in the current transaction of this connection (which must have run
    /// `BEGIN ISOLATION LEVEL REPEATABLE READ` first).
    Use,
}

/// The answer to `CREATE_REPLICATION_SLOT … LOGICAL`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreatedSlot {
    /// The slot's name.
    pub slot_name: String,
    /// Decoding starts here: the first transaction streamed commits after it.
    pub consistent_point: Lsn,
    /// The exported snapshot, with [`SnapshotAction::Export`].
    pub snapshot_name: Option<String>,
    /// The output plugin.
    pub output_plugin: Option<String>,
}

/// A rows-as-text result of the simple query protocol.
pub type TextRows = Vec<Vec<Option<String>>>;

/// A walsender connection in command mode (before `START_REPLICATION`).
pub struct ReplicationConnection {
    conn: Conn,
}

impl fmt::Debug for ReplicationConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplicationConnection")
            .field("target", &self.conn.target)
            .field("backend_pid", &self.conn.backend_pid)
            .field(
                "server_version",
                &self.conn.server_parameter("server_version"),
            )
            .field("tls", &self.conn.io.is_tls())
            .finish_non_exhaustive()
    }
}

impl ReplicationConnection {
    /// Connects and authenticates a `replication=database` session.
    ///
    /// Opens TCP (or the Unix socket), negotiates TLS per `sslmode`, sends the
    /// startup packet and answers the authentication request (trust, `password`,
    /// `md5`, `scram-sha-256` with channel binding when possible), then waits for
    /// `ReadyForQuery`. `connect_timeout` bounds all of it.
    ///
    /// # Errors
    ///
    /// [`ReplicationError::Io`] when the server cannot be reached or the timeout
    /// elapses, [`ReplicationError::Tls`], [`ReplicationError::Auth`] (wrong password:
    /// code `28P01`; no `pg_hba.conf` entry: `28000`; unsupported method or missing
    /// password: no code), [`ReplicationError::Server`] (e.g. the database does not
    /// exist), [`ReplicationError::Config`].
    pub async fn connect(info: &ConnInfo) -> Result<ReplicationConnection, ReplicationError> {
        let attempt = Self::connect_without_timeout(info);
        match info.connect_timeout() {
            Some(limit) => tokio::time::timeout(limit, attempt).await.map_err(|_| {
                ReplicationError::Io(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("connecting to {info} timed out after {limit:?} (connect_timeout)"),
                ))
            })?,
            None => attempt.await,
        }
    }

    async fn connect_without_timeout(
        info: &ConnInfo,
    ) -> Result<ReplicationConnection, ReplicationError> {
        let (io, binding) = open_transport(info).await?;
        let mut conn = Conn::new(io, info.to_string());
        conn.startup(info, binding).await?;
        tracing::debug!(
            target_db = %conn.target,
            backend_pid = ?conn.backend_pid,
            server_version = conn.server_parameter("server_version").unwrap_or("?"),
            tls = conn.io.is_tls(),
            auth = conn.auth_method,
            "replication connection established"
        );
        Ok(ReplicationConnection { conn })
    }

    /// A run-time parameter the server reported (`server_version`,
    /// `server_encoding`, `DateStyle`, `TimeZone`, `integer_datetimes`, …).
    #[must_use]
    pub fn server_parameter(&self, name: &str) -> Option<&str> {
        self.conn.server_parameter(name)
    }

    /// The server's major version (`15` for 15.4, `9` for 9.6), from `server_version`.
    #[must_use]
    pub fn server_major_version(&self) -> Option<u32> {
        self.server_parameter("server_version")
            .and_then(parse_major_version)
    }

    /// The walsender's process id (`pg_stat_replication.pid`).
    #[must_use]
    pub fn backend_pid(&self) -> Option<i32> {
        self.conn.backend_pid
    }

    /// True when the session is encrypted.
    #[must_use]
    pub fn is_tls(&self) -> bool {
        self.conn.io.is_tls()
    }

    /// How the server authenticated us: `trust`, `password`, `md5`,
    /// `scram-sha-256`, or `scram-sha-256-plus` (with TLS channel binding).
    #[must_use]
    pub fn authentication_method(&self) -> &'static str {
        self.conn.auth_method
    }

    /// Runs `sql` (one or more statements, or a replication command) with the
    /// simple query protocol and returns every row of every statement as text.
    ///
    /// # Errors
    ///
    /// [`ReplicationError::Server`] when a statement fails (the connection stays
    /// usable), I/O and protocol errors otherwise.
    pub async fn simple_query(&mut self, sql: &str) -> Result<TextRows, ReplicationError> {
        self.conn.simple_query(sql).await
    }

    /// `IDENTIFY_SYSTEM`: cluster id, timeline, current WAL position, database.
    ///
    /// # Errors
    ///
    /// As [`Self::simple_query`]; [`ReplicationError::Protocol`] for a malformed answer.
    pub async fn identify_system(&mut self) -> Result<SystemIdentity, ReplicationError> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let row = single_row(&rows, "IDENTIFY_SYSTEM", 4)?;
        Ok(SystemIdentity {
            systemid: parse_field(row, 0, "IDENTIFY_SYSTEM systemid")?,
            timeline: parse_field(row, 1, "IDENTIFY_SYSTEM timeline")?,
            xlogpos: parse_lsn_field(row, 2, "IDENTIFY_SYSTEM xlogpos")?,
            dbname: row.get(3).cloned().flatten(),
        })
    }

    /// `CREATE_REPLICATION_SLOT "name" [TEMPORARY] LOGICAL pgoutput …`.
    ///
    /// Uses the option-list syntax on PostgreSQL 15+ and the keyword syntax
    /// (`NOEXPORT_SNAPSHOT`, …) before. A temporary slot is dropped when this
    /// connection ends (including after streaming from it).
    ///
    /// # Errors
    ///
    /// [`ReplicationError::Server`]: `42710` when the slot exists
    /// ([`ReplicationError::is_duplicate_object`]), `55000` when `wal_level` is not
    /// `logical`, `53400` when all slots are in use; [`ReplicationError::Config`] for a
    /// name with a NUL byte.
    pub async fn create_logical_slot(
        &mut self,
        name: &str,
        temporary: bool,
        snapshot: SnapshotAction,
    ) -> Result<CreatedSlot, ReplicationError> {
        check_no_nul("slot name", name)?;
        let command = create_slot_command(name, temporary, snapshot, self.server_major_version());
        let rows = self.simple_query(&command).await?;
        let row = single_row(&rows, "CREATE_REPLICATION_SLOT", 4)?;
        Ok(CreatedSlot {
            slot_name: required_field(row, 0, "CREATE_REPLICATION_SLOT slot_name")?.to_owned(),
            consistent_point: parse_lsn_field(row, 1, "CREATE_REPLICATION_SLOT consistent_point")?,
            snapshot_name: row.get(2).cloned().flatten(),
            output_plugin: row.get(3).cloned().flatten(),
        })
    }

    /// `DROP_REPLICATION_SLOT "name" [WAIT]`: with `wait`, waits until the slot is
    /// no longer active instead of failing with `55006`.
    ///
    /// # Errors
    ///
    /// [`ReplicationError::Server`]: `42704` when it does not exist, `55006` when it
    /// is active and `wait` is false.
    pub async fn drop_slot(&mut self, name: &str, wait: bool) -> Result<(), ReplicationError> {
        check_no_nul("slot name", name)?;
        let mut command = format!("DROP_REPLICATION_SLOT {}", quote_ident(name));
        if wait {
            command.push_str(" WAIT");
        }
        self.simple_query(&command).await.map(drop)
    }

    /// Starts streaming `pgoutput` changes of `publication_names` from `slot`:
    /// `START_REPLICATION SLOT "slot" LOGICAL X/Y (proto_version '1',
    /// publication_names '"pub"')`.
    ///
    /// `start` is where to resume; the server starts at the slot's
    /// `confirmed_flush_lsn` when `start` is older (`0/0` means "wherever the slot
    /// is"). Transactions are sent whole, in commit order, from there on.
    ///
    /// # Errors
    ///
    /// [`ReplicationError::Server`]: `55006` when another process streams from the
    /// slot ([`ReplicationError::is_slot_in_use`]), `42704` when the slot does not
    /// exist ([`ReplicationError::is_undefined_object`]), `55000` when it was
    /// invalidated; [`ReplicationError::Config`] for empty publication names or a bad
    /// protocol version.
    pub async fn start_logical_replication(
        self,
        slot: &str,
        start: Lsn,
        publication_names: &[&str],
        proto_version: u8,
    ) -> Result<ReplicationStream, ReplicationError> {
        if publication_names.is_empty() {
            return Err(ReplicationError::Config(
                "at least one publication name is needed".to_owned(),
            ));
        }
        if proto_version == 0 {
            return Err(ReplicationError::Config(
                "pgoutput proto_version starts at 1".to_owned(),
            ));
        }
        for name in publication_names {
            check_no_nul("publication name", name)?;
        }
        let version = proto_version.to_string();
        let publications = publication_names_option(publication_names);
        self.start_replication_with_options(
            slot,
            start,
            &[
                ("proto_version", version.as_str()),
                ("publication_names", publications.as_str()),
            ],
        )
        .await
    }

    /// `START_REPLICATION SLOT … LOGICAL` with arbitrary output-plugin options
    /// (name, unquoted value), e.g. `("messages", "true")` or `("streaming", "on")`.
    ///
    /// # Errors
    ///
    /// As [`Self::start_logical_replication`].
    pub async fn start_replication_with_options(
        mut self,
        slot: &str,
        start: Lsn,
        options: &[(&str, &str)],
    ) -> Result<ReplicationStream, ReplicationError> {
        check_no_nul("slot name", slot)?;
        for (name, value) in options {
            check_no_nul("plugin option name", name)?;
            check_no_nul("plugin option value", value)?;
        }
        let command = start_replication_command(slot, start, options);
        self.conn.send_query(&command).await?;
        loop {
            let msg = self.conn.read_message().await?;
            match msg.tag {
                COPY_BOTH_RESPONSE => break,
                ERROR_RESPONSE => {
                    // The server follows with ReadyForQuery; the connection is
                    // consumed either way, so there is no need to wait for it.
                    return Err(server_error(&msg.body));
                }
                NOTICE_RESPONSE => log_notice(&msg.body),
                PARAMETER_STATUS => self.conn.record_parameter(&msg.body)?,
                other => {
                    return Err(unexpected(other, "START_REPLICATION"));
                }
            }
        }
        tracing::debug!(target_db = %self.conn.target, slot, %start, "logical replication started");
        Ok(ReplicationStream {
            conn: self.conn,
            done: false,
        })
    }

    /// Sends `Terminate` and closes the connection.
    ///
    /// # Errors
    ///
    /// I/O errors while writing.
    pub async fn close(mut self) -> Result<(), ReplicationError> {
        frontend::terminate(&mut self.conn.wbuf);
        self.conn.flush_writes().await?;
        let _ = self.conn.io.shutdown().await;
        Ok(())
    }
}

/// The `CopyBoth` phase of a logical replication connection.
///
/// Drive it from one task (see the module docs for cancel safety):
///
/// ```ignore
/// loop {
///     tokio::select! {
///         biased;
///         _ = shutdown.changed() => break,
///         _ = status_timer.tick() => stream.send_status(&core.status_now()).await?,
///         frame = stream.next_frame(), if core.window_has_room() => match frame? {
///             Some(ServerFrame::Keepalive { reply_requested: true, .. }) => {
///                 stream.send_status(&core.status_now()).await?
///             }
///             Some(frame) => core.on_frame(frame),
///             None => break, // the server ended the stream
///         },
///     }
/// }
/// stream.finish().await?;
/// ```
pub struct ReplicationStream {
    conn: Conn,
    done: bool,
}

impl fmt::Debug for ReplicationStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplicationStream")
            .field("target", &self.conn.target)
            .field("backend_pid", &self.conn.backend_pid)
            .field("tls", &self.conn.io.is_tls())
            .field("buffered", &self.conn.rbuf.len())
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

impl ReplicationStream {
    /// The next XLogData or keepalive. `Ok(None)` once the server ended the stream
    /// with `CopyDone` (and on every call after that).
    ///
    /// Cancel-safe: if the future is dropped before it completes, no data is lost.
    /// `NoticeResponse` and `ParameterStatus` messages are handled in passing.
    ///
    /// # Errors
    ///
    /// [`ReplicationError::Server`] for an `ErrorResponse` (e.g. `42704` for a
    /// publication that does not exist, `57P01` at server shutdown);
    /// [`ReplicationError::ConnectionClosed`] at EOF; [`ReplicationError::Io`];
    /// [`ReplicationError::Protocol`] for a malformed frame or unexpected message.
    pub async fn next_frame(&mut self) -> Result<Option<ServerFrame>, ReplicationError> {
        loop {
            if self.done {
                return Ok(None);
            }
            while let Some(msg) = self.conn.take_message()? {
                match msg.tag {
                    COPY_DATA => {
                        return ServerFrame::parse(msg.body).map(Some).map_err(|e| {
                            ReplicationError::Protocol(format!("bad replication frame: {e}"))
                        });
                    }
                    // A walsender ending the stream sends CopyDone; one that exits at
                    // a server shutdown (`pg_ctl stop -m fast`) once the client caught
                    // up ends the COPY with CommandComplete ("COPY 0") and no CopyDone
                    // (WalSndDone → EndCommand in walsender.c). Both end the stream:
                    // the caller reconnects.
                    COPY_DONE | COMMAND_COMPLETE | READY_FOR_QUERY => {
                        self.done = true;
                        return Ok(None);
                    }
                    ERROR_RESPONSE => return Err(server_error(&msg.body)),
                    NOTICE_RESPONSE => log_notice(&msg.body),
                    PARAMETER_STATUS => self.conn.record_parameter(&msg.body)?,
                    other => return Err(unexpected(other, "logical replication")),
                }
            }
            self.conn.fill().await?;
        }
    }

    /// Sends a standby status update and flushes it.
    ///
    /// Only writes, so it works while the relay is not reading (backpressure). If the
    /// future is cancelled mid-write, the remaining bytes are sent first by the next
    /// call (or by [`Self::finish`]), so the stream stays well-formed.
    ///
    /// # Errors
    ///
    /// [`ReplicationError::Io`] when the socket fails.
    pub async fn send_status(&mut self, status: &StandbyStatus) -> Result<(), ReplicationError> {
        let len = i32::try_from(4 + StandbyStatus::ENCODED_LEN).unwrap_or(i32::MAX);
        self.conn.wbuf.reserve(1 + 4 + StandbyStatus::ENCODED_LEN);
        self.conn.wbuf.put_u8(COPY_DATA);
        self.conn.wbuf.put_i32(len);
        status.encode(&mut self.conn.wbuf);
        self.conn.flush_writes().await
    }

    /// Ends streaming from our side: sends `CopyDone` and `Terminate`, then waits
    /// (at most 5 s) for the server to close, so that the slot is released when this
    /// returns.
    ///
    /// # Errors
    ///
    /// I/O errors while writing.
    pub async fn finish(mut self) -> Result<(), ReplicationError> {
        if !self.done {
            frontend::copy_done(&mut self.conn.wbuf);
        }
        frontend::terminate(&mut self.conn.wbuf);
        self.conn.flush_writes().await?;
        // Discard whatever is still in flight until the walsender exits (EOF). It
        // releases the slot before it closes the socket.
        let drain = async {
            loop {
                self.conn.rbuf.clear();
                match self.conn.fill().await {
                    Ok(()) => {}
                    Err(_) => break,
                }
            }
        };
        if tokio::time::timeout(FINISH_DRAIN_TIMEOUT, drain)
            .await
            .is_err()
        {
            tracing::debug!(target_db = %self.conn.target, "server did not close the replication connection in time");
        }
        let _ = self.conn.io.shutdown().await;
        Ok(())
    }

    /// A run-time parameter the server reported.
    #[must_use]
    pub fn server_parameter(&self, name: &str) -> Option<&str> {
        self.conn.server_parameter(name)
    }

    /// The walsender's process id.
    #[must_use]
    pub fn backend_pid(&self) -> Option<i32> {
        self.conn.backend_pid
    }

    /// True when the session is encrypted.
    #[must_use]
    pub fn is_tls(&self) -> bool {
        self.conn.io.is_tls()
    }
}

// ---------------------------------------------------------------- commands

/// `'value'` with embedded quotes doubled. Backslashes are not special in the
/// replication grammar (nor in SQL with `standard_conforming_strings`).
#[must_use]
pub fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// `publication_names` value: each name as a quoted identifier, comma-separated
/// (pgoutput splits it with `SplitIdentifierString`).
#[must_use]
pub fn publication_names_option(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| quote_ident(n))
        .collect::<Vec<_>>()
        .join(",")
}

/// The `CREATE_REPLICATION_SLOT` command for a server major version (`None`:
/// assume a current server).
#[must_use]
pub fn create_slot_command(
    name: &str,
    temporary: bool,
    snapshot: SnapshotAction,
    server_major: Option<u32>,
) -> String {
    let mut command = format!("CREATE_REPLICATION_SLOT {}", quote_ident(name));
    if temporary {
        command.push_str(" TEMPORARY");
    }
    command.push_str(" LOGICAL ");
    command.push_str(OUTPUT_PLUGIN);
    if server_major.is_none_or(|v| v >= 15) {
        command.push_str(match snapshot {
            SnapshotAction::Export => " (SNAPSHOT 'export')",
            SnapshotAction::NoExport => " (SNAPSHOT 'nothing')",
            SnapshotAction::Use => " (SNAPSHOT 'use')",
        });
    } else {
        command.push_str(match snapshot {
            SnapshotAction::Export => " EXPORT_SNAPSHOT",
            SnapshotAction::NoExport => " NOEXPORT_SNAPSHOT",
            SnapshotAction::Use => " USE_SNAPSHOT",
        });
    }
    command
}

/// The `START_REPLICATION SLOT … LOGICAL` command.
#[must_use]
pub fn start_replication_command(slot: &str, start: Lsn, options: &[(&str, &str)]) -> String {
    let mut command = format!(
        "START_REPLICATION SLOT {} LOGICAL {start}",
        quote_ident(slot)
    );
    if !options.is_empty() {
        let list = options
            .iter()
            .map(|(name, value)| format!("{} {}", quote_ident(name), quote_literal(value)))
            .collect::<Vec<_>>()
            .join(", ");
        command.push_str(" (");
        command.push_str(&list);
        command.push(')');
    }
    command
}

/// The major version from `server_version` ("15.4 (Debian …)" → 15, "9.6.3" → 9,
/// "17devel" → 17).
#[must_use]
pub fn parse_major_version(server_version: &str) -> Option<u32> {
    let digits: String = server_version
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

fn check_no_nul(what: &str, value: &str) -> Result<(), ReplicationError> {
    if value.contains('\0') {
        Err(ReplicationError::Config(format!(
            "{what} contains a NUL byte"
        )))
    } else {
        Ok(())
    }
}

fn single_row<'a>(
    rows: &'a TextRows,
    command: &str,
    min_columns: usize,
) -> Result<&'a [Option<String>], ReplicationError> {
    match rows.as_slice() {
        [row] if row.len() >= min_columns => Ok(row),
        _ => Err(ReplicationError::Protocol(format!(
            "{command} returned {} rows (expected one with {min_columns} columns)",
            rows.len()
        ))),
    }
}

fn required_field<'a>(
    row: &'a [Option<String>],
    index: usize,
    what: &str,
) -> Result<&'a str, ReplicationError> {
    row.get(index)
        .and_then(Option::as_deref)
        .ok_or_else(|| ReplicationError::Protocol(format!("{what} is missing")))
}

fn parse_field<T: std::str::FromStr>(
    row: &[Option<String>],
    index: usize,
    what: &str,
) -> Result<T, ReplicationError> {
    let text = required_field(row, index, what)?;
    text.parse()
        .map_err(|_| ReplicationError::Protocol(format!("{what} {text:?} is not a number")))
}

fn parse_lsn_field(
    row: &[Option<String>],
    index: usize,
    what: &str,
) -> Result<Lsn, ReplicationError> {
    let text = required_field(row, index, what)?;
    text.parse()
        .map_err(|e| ReplicationError::Protocol(format!("{what}: {e}")))
}

// ---------------------------------------------------------------- wire

const AUTHENTICATION: u8 = b'R';
const BACKEND_KEY_DATA: u8 = b'K';
const COMMAND_COMPLETE: u8 = b'C';
const COPY_BOTH_RESPONSE: u8 = b'W';
const COPY_DATA: u8 = b'd';
const COPY_DONE: u8 = b'c';
const COPY_IN_RESPONSE: u8 = b'G';
const COPY_OUT_RESPONSE: u8 = b'H';
const DATA_ROW: u8 = b'D';
const EMPTY_QUERY_RESPONSE: u8 = b'I';
const ERROR_RESPONSE: u8 = b'E';
const NEGOTIATE_PROTOCOL_VERSION: u8 = b'v';
const NOTICE_RESPONSE: u8 = b'N';
const PARAMETER_STATUS: u8 = b'S';
const READY_FOR_QUERY: u8 = b'Z';
const ROW_DESCRIPTION: u8 = b'T';

const AUTH_OK: i32 = 0;
const AUTH_KERBEROS_V5: i32 = 2;
const AUTH_CLEARTEXT_PASSWORD: i32 = 3;
const AUTH_MD5_PASSWORD: i32 = 5;
const AUTH_SCM_CREDENTIAL: i32 = 6;
const AUTH_GSS: i32 = 7;
const AUTH_GSS_CONTINUE: i32 = 8;
const AUTH_SSPI: i32 = 9;
const AUTH_SASL: i32 = 10;
const AUTH_SASL_CONTINUE: i32 = 11;
const AUTH_SASL_FINAL: i32 = 12;

/// One complete backend message: its tag and its body (length word stripped).
#[derive(Debug)]
struct RawMessage {
    tag: u8,
    body: Bytes,
}

/// Takes one complete message off the front of `buf`, or `None` when more bytes
/// are needed (then reserves room for the rest of the message).
fn take_message(buf: &mut BytesMut) -> Result<Option<RawMessage>, ReplicationError> {
    let Some(header) = buf.get(..5) else {
        return Ok(None);
    };
    let tag = header[0];
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if len < 4 {
        return Err(ReplicationError::Protocol(format!(
            "message {} has invalid length {len}",
            tag_name(tag)
        )));
    }
    if len > MAX_MESSAGE_LEN {
        return Err(ReplicationError::Protocol(format!(
            "message {} claims {len} bytes, more than PostgreSQL ever sends",
            tag_name(tag)
        )));
    }
    let total = len + 1;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let mut frame = buf.split_to(total).freeze();
    frame.advance(5);
    Ok(Some(RawMessage { tag, body: frame }))
}

fn tag_name(tag: u8) -> String {
    if tag.is_ascii_graphic() {
        format!("'{}'", char::from(tag))
    } else {
        format!("0x{tag:02x}")
    }
}

fn unexpected(tag: u8, phase: &str) -> ReplicationError {
    ReplicationError::Protocol(format!(
        "unexpected message {} during {phase}",
        tag_name(tag)
    ))
}

/// A bounds-checked reader over a message body.
struct Cursor<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Cursor<'a> {
    fn new(buf: &'a [u8], what: &'static str) -> Self {
        Cursor { buf, what }
    }

    fn truncated(&self) -> ReplicationError {
        ReplicationError::Protocol(format!("truncated {} message", self.what))
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8], ReplicationError> {
        if self.buf.len() < n {
            return Err(self.truncated());
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, ReplicationError> {
        let (&b, rest) = self.buf.split_first().ok_or_else(|| self.truncated())?;
        self.buf = rest;
        Ok(b)
    }

    fn i16(&mut self) -> Result<i16, ReplicationError> {
        let (head, rest) = self
            .buf
            .split_first_chunk::<2>()
            .ok_or_else(|| self.truncated())?;
        self.buf = rest;
        Ok(i16::from_be_bytes(*head))
    }

    fn i32(&mut self) -> Result<i32, ReplicationError> {
        let (head, rest) = self
            .buf
            .split_first_chunk::<4>()
            .ok_or_else(|| self.truncated())?;
        self.buf = rest;
        Ok(i32::from_be_bytes(*head))
    }

    /// A NUL-terminated string, without the NUL.
    fn cstr(&mut self) -> Result<&'a [u8], ReplicationError> {
        let end = self
            .buf
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| self.truncated())?;
        let s = self.bytes(end)?;
        self.u8()?;
        Ok(s)
    }

    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
}

/// The fields of an `ErrorResponse`/`NoticeResponse`.
#[derive(Debug, Default, PartialEq, Eq)]
struct ErrorFields {
    severity: String,
    code: String,
    message: String,
    detail: Option<String>,
    hint: Option<String>,
}

/// Parses error fields leniently: text is decoded lossily (before `client_encoding`
/// applies it may not be UTF-8), a missing code becomes `XX000`.
fn parse_error_fields(body: &[u8]) -> ErrorFields {
    let mut fields = ErrorFields::default();
    let mut localized_severity = None;
    let mut cursor = Cursor::new(body, "ErrorResponse");
    while let Ok(kind) = cursor.u8() {
        if kind == 0 {
            break;
        }
        let Ok(value) = cursor.cstr() else { break };
        let value = String::from_utf8_lossy(value).into_owned();
        match kind {
            b'V' => fields.severity = value,
            b'S' => localized_severity = Some(value),
            b'C' => fields.code = value,
            b'M' => fields.message = value,
            b'D' => fields.detail = Some(value),
            b'H' => fields.hint = Some(value),
            _ => {}
        }
    }
    if fields.severity.is_empty() {
        fields.severity = localized_severity.unwrap_or_else(|| "ERROR".to_owned());
    }
    if fields.code.is_empty() {
        fields.code = "XX000".to_owned();
    }
    fields
}

fn server_error(body: &[u8]) -> ReplicationError {
    let f = parse_error_fields(body);
    ReplicationError::Server {
        code: f.code,
        message: f.message,
        detail: f.detail,
        hint: f.hint,
    }
}

/// An error during startup: class 28 is an authentication failure.
fn startup_error(body: &[u8], method: &str) -> ReplicationError {
    let f = parse_error_fields(body);
    if f.code.starts_with("28") {
        ReplicationError::Auth {
            method: method.to_owned(),
            code: Some(f.code),
            message: f.message,
        }
    } else {
        ReplicationError::Server {
            code: f.code,
            message: f.message,
            detail: f.detail,
            hint: f.hint,
        }
    }
}

fn log_notice(body: &[u8]) {
    let f = parse_error_fields(body);
    match f.severity.as_str() {
        "WARNING" => tracing::warn!(
            code = %f.code, detail = ?f.detail, hint = ?f.hint,
            "PostgreSQL: {}", f.message
        ),
        "DEBUG" => tracing::debug!(code = %f.code, detail = ?f.detail, "PostgreSQL: {}", f.message),
        _ => tracing::info!(code = %f.code, detail = ?f.detail, "PostgreSQL: {}", f.message),
    }
}

/// Parses a `DataRow` into text columns.
fn parse_data_row(body: &[u8]) -> Result<Vec<Option<String>>, ReplicationError> {
    let mut cursor = Cursor::new(body, "DataRow");
    let count = cursor.i16()?;
    let count = usize::try_from(count)
        .map_err(|_| ReplicationError::Protocol(format!("DataRow with {count} columns")))?;
    let mut row = Vec::with_capacity(count);
    for _ in 0..count {
        let len = cursor.i32()?;
        if len < 0 {
            row.push(None);
            continue;
        }
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        let value = cursor.bytes(len)?;
        let text = std::str::from_utf8(value)
            .map_err(|_| ReplicationError::Protocol("DataRow value is not UTF-8".to_owned()))?;
        row.push(Some(text.to_owned()));
    }
    Ok(row)
}

// ---------------------------------------------------------------- transport

/// The byte stream under a connection.
enum Transport {
    Tcp(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    #[cfg(unix)]
    Unix(tokio::net::UnixStream),
    #[cfg(test)]
    Mock(tokio::io::DuplexStream),
}

impl Transport {
    fn is_tls(&self) -> bool {
        matches!(self, Transport::Tls(_))
    }
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_read(cx, buf),
            #[cfg(test)]
            Transport::Mock(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_write(cx, buf),
            #[cfg(test)]
            Transport::Mock(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_flush(cx),
            Transport::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_flush(cx),
            #[cfg(test)]
            Transport::Mock(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_shutdown(cx),
            #[cfg(test)]
            Transport::Mock(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Opens the socket and, per `sslmode`, TLS. Returns the transport and the
/// channel-binding data of the TLS session, if any.
async fn open_transport(info: &ConnInfo) -> Result<(Transport, Option<Vec<u8>>), ReplicationError> {
    let host = match info.host() {
        Host::Tcp(h) => h,
        #[cfg(unix)]
        Host::Unix(dir) => {
            let path = dir.join(format!(".s.PGSQL.{}", info.port()));
            let stream = tokio::net::UnixStream::connect(&path).await.map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot connect to {}: {e}", path.display()),
                )
            })?;
            return Ok((Transport::Unix(stream), None));
        }
        #[cfg(not(unix))]
        Host::Unix(_) => {
            return Err(ReplicationError::Config(
                "Unix-domain sockets are not supported on this platform".to_owned(),
            ));
        }
    };
    let connected = match info.hostaddr() {
        Some(addr) => TcpStream::connect((addr, info.port())).await,
        None => TcpStream::connect((host.as_str(), info.port())).await,
    };
    let mut tcp = connected
        .map_err(|e| io::Error::new(e.kind(), format!("cannot connect to {info}: {e}")))?;
    // Status updates are tiny and must leave at once.
    tcp.set_nodelay(true)?;
    let Some(connector) = TlsConnector::from_conninfo(info)? else {
        return Ok((Transport::Tcp(tcp), None));
    };
    let server_name = connector.server_name(host)?;

    let mut request = BytesMut::with_capacity(8);
    frontend::ssl_request(&mut request);
    tcp.write_all(&request).await?;
    tcp.flush().await?;
    // Exactly one byte, read straight from the socket: nothing the server (or a man
    // in the middle) sends after it may be taken as plaintext (CVE-2021-23222).
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await.map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            ReplicationError::ConnectionClosed
        } else {
            ReplicationError::Io(e)
        }
    })?;
    match answer[0] {
        b'S' => {
            let tls =
                connector.handshake(server_name, tcp).await.map_err(|e| {
                    match rustls_error(&e) {
                        Some(tls_err) => ReplicationError::Tls(format!(
                            "handshake with {info} failed: {tls_err}"
                        )),
                        None => ReplicationError::Io(io::Error::new(
                            e.kind(),
                            format!("TLS handshake with {info} failed: {e}"),
                        )),
                    }
                })?;
            let binding = session_channel_binding(tls.get_ref().1);
            Ok((Transport::Tls(Box::new(tls)), binding))
        }
        b'N' if info.sslmode() == SslMode::Prefer => Ok((Transport::Tcp(tcp), None)),
        b'N' => Err(ReplicationError::Tls(format!(
            "the server at {info} does not support TLS, but sslmode={} requires it",
            info.sslmode()
        ))),
        b'E' => Err(ReplicationError::Protocol(
            "the server answered the SSLRequest with an error (PostgreSQL too old?)".to_owned(),
        )),
        other => Err(ReplicationError::Protocol(format!(
            "unexpected answer {} to SSLRequest",
            tag_name(other)
        ))),
    }
}

// ---------------------------------------------------------------- connection core

/// Socket plus read/write buffers, shared by both phases.
struct Conn {
    io: Transport,
    rbuf: BytesMut,
    wbuf: BytesMut,
    params: BTreeMap<String, String>,
    backend_pid: Option<i32>,
    target: String,
    auth_method: &'static str,
}

impl Conn {
    fn new(io: Transport, target: String) -> Self {
        Conn {
            io,
            rbuf: BytesMut::with_capacity(READ_CHUNK),
            wbuf: BytesMut::with_capacity(256),
            params: BTreeMap::new(),
            backend_pid: None,
            target,
            auth_method: "none",
        }
    }

    fn server_parameter(&self, name: &str) -> Option<&str> {
        self.params.get(name).map(String::as_str)
    }

    fn take_message(&mut self) -> Result<Option<RawMessage>, ReplicationError> {
        take_message(&mut self.rbuf)
    }

    /// Reads more bytes into the buffer (cancel-safe). EOF is `ConnectionClosed`.
    async fn fill(&mut self) -> Result<(), ReplicationError> {
        if self.rbuf.capacity() - self.rbuf.len() < READ_CHUNK / 4 {
            self.rbuf.reserve(READ_CHUNK);
        }
        let n = self.io.read_buf(&mut self.rbuf).await?;
        if n == 0 {
            return Err(ReplicationError::ConnectionClosed);
        }
        Ok(())
    }

    /// The next complete message (cancel-safe).
    async fn read_message(&mut self) -> Result<RawMessage, ReplicationError> {
        loop {
            if let Some(msg) = self.take_message()? {
                return Ok(msg);
            }
            self.fill().await?;
        }
    }

    /// Writes everything buffered and flushes; on cancellation the rest stays
    /// buffered for the next call.
    async fn flush_writes(&mut self) -> Result<(), ReplicationError> {
        while !self.wbuf.is_empty() {
            let n = self.io.write_buf(&mut self.wbuf).await?;
            if n == 0 {
                return Err(ReplicationError::Io(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "the connection accepts no more data",
                )));
            }
        }
        self.io.flush().await?;
        Ok(())
    }

    fn record_parameter(&mut self, body: &[u8]) -> Result<(), ReplicationError> {
        let mut cursor = Cursor::new(body, "ParameterStatus");
        let name = String::from_utf8_lossy(cursor.cstr()?).into_owned();
        let value = String::from_utf8_lossy(cursor.cstr()?).into_owned();
        self.params.insert(name, value);
        Ok(())
    }

    async fn send_query(&mut self, sql: &str) -> Result<(), ReplicationError> {
        frontend::query(sql, &mut self.wbuf)
            .map_err(|e| ReplicationError::Config(format!("cannot send query: {e}")))?;
        self.flush_writes().await
    }

    async fn simple_query(&mut self, sql: &str) -> Result<TextRows, ReplicationError> {
        self.send_query(sql).await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let msg = self.read_message().await?;
            match msg.tag {
                ROW_DESCRIPTION | COMMAND_COMPLETE | EMPTY_QUERY_RESPONSE => {}
                DATA_ROW => {
                    if error.is_none() {
                        rows.push(parse_data_row(&msg.body)?);
                    }
                }
                ERROR_RESPONSE => error = Some(server_error(&msg.body)),
                NOTICE_RESPONSE => log_notice(&msg.body),
                PARAMETER_STATUS => self.record_parameter(&msg.body)?,
                READY_FOR_QUERY => break,
                COPY_BOTH_RESPONSE | COPY_OUT_RESPONSE | COPY_IN_RESPONSE => {
                    return Err(ReplicationError::Protocol(format!(
                        "simple_query cannot run COPY or START_REPLICATION (got {}); \
                         the connection is no longer usable",
                        tag_name(msg.tag)
                    )));
                }
                other => return Err(unexpected(other, "a simple query")),
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok(rows),
        }
    }

    /// Startup packet, authentication, then parameters until `ReadyForQuery`.
    async fn startup(
        &mut self,
        info: &ConnInfo,
        binding: Option<Vec<u8>>,
    ) -> Result<(), ReplicationError> {
        let options = match info.options() {
            Some(extra) => format!("{SESSION_OPTIONS} {extra}"),
            None => SESSION_OPTIONS.to_owned(),
        };
        let params = [
            ("user", info.user()),
            ("database", info.dbname()),
            ("replication", "database"),
            ("application_name", info.application_name()),
            ("client_encoding", "UTF8"),
            ("options", options.as_str()),
        ];
        frontend::startup_message(params.iter().copied(), &mut self.wbuf)
            .map_err(|e| ReplicationError::Config(format!("bad startup parameter: {e}")))?;
        self.flush_writes().await?;

        let mut auth = Authenticator::new(info, binding);
        loop {
            let msg = self.read_message().await?;
            match msg.tag {
                AUTHENTICATION => {
                    if auth.on_request(&msg.body, &mut self.wbuf)? {
                        self.auth_method = auth.completed_method();
                        break;
                    }
                    self.flush_writes().await?;
                }
                ERROR_RESPONSE => return Err(startup_error(&msg.body, auth.method)),
                NOTICE_RESPONSE => log_notice(&msg.body),
                NEGOTIATE_PROTOCOL_VERSION => {
                    tracing::debug!("server negotiated the protocol version down; continuing");
                }
                other => return Err(unexpected(other, "authentication")),
            }
        }
        loop {
            let msg = self.read_message().await?;
            match msg.tag {
                PARAMETER_STATUS => self.record_parameter(&msg.body)?,
                BACKEND_KEY_DATA => {
                    let mut cursor = Cursor::new(&msg.body, "BackendKeyData");
                    self.backend_pid = Some(cursor.i32()?);
                }
                READY_FOR_QUERY => return Ok(()),
                ERROR_RESPONSE => return Err(startup_error(&msg.body, auth.method)),
                NOTICE_RESPONSE => log_notice(&msg.body),
                NEGOTIATE_PROTOCOL_VERSION => {}
                other => return Err(unexpected(other, "startup")),
            }
        }
    }
}

/// The client side of the authentication exchange.
struct Authenticator<'a> {
    info: &'a ConnInfo,
    binding: Option<Vec<u8>>,
    method: &'static str,
    scram: Option<ScramSha256>,
    scram_finished: bool,
    used_channel_binding: bool,
}

impl<'a> Authenticator<'a> {
    fn new(info: &'a ConnInfo, binding: Option<Vec<u8>>) -> Self {
        let binding = match info.channel_binding() {
            ChannelBindingMode::Disable => None,
            ChannelBindingMode::Prefer | ChannelBindingMode::Require => binding,
        };
        Authenticator {
            info,
            binding,
            method: "none",
            scram: None,
            scram_finished: false,
            used_channel_binding: false,
        }
    }

    /// The method that authenticated us, `-plus` when channel binding was used.
    fn completed_method(&self) -> &'static str {
        if self.used_channel_binding {
            "scram-sha-256-plus"
        } else {
            self.method
        }
    }

    fn fail(&self, message: impl Into<String>) -> ReplicationError {
        ReplicationError::Auth {
            method: self.method.to_owned(),
            code: None,
            message: message.into(),
        }
    }

    fn password(&self) -> Result<&'a str, ReplicationError> {
        self.info.password().ok_or_else(|| {
            self.fail(format!(
                "the server requires a password for user {:?} but the URL has none",
                self.info.user()
            ))
        })
    }

    /// Handles one `Authentication*` message, appending any answer to `out`.
    /// Returns true on `AuthenticationOk`.
    fn on_request(&mut self, body: &[u8], out: &mut BytesMut) -> Result<bool, ReplicationError> {
        let mut cursor = Cursor::new(body, "Authentication");
        let code = cursor.i32()?;
        let io_err = |e: io::Error| ReplicationError::Config(format!("cannot encode: {e}"));
        match code {
            AUTH_OK => {
                if self.method == "none" {
                    self.method = "trust";
                }
                if self.scram.is_some() && !self.scram_finished {
                    return Err(
                        self.fail("the server ended SCRAM without proving it knows the password")
                    );
                }
                if self.info.channel_binding() == ChannelBindingMode::Require
                    && !self.used_channel_binding
                {
                    return Err(self.fail(format!(
                        "channel_binding=require, but the server authenticated with {} \
                         without channel binding",
                        self.method
                    )));
                }
                Ok(true)
            }
            AUTH_CLEARTEXT_PASSWORD => {
                self.method = "password";
                self.require_no_channel_binding()?;
                let password = self.password()?;
                frontend::password_message(password.as_bytes(), out).map_err(io_err)?;
                Ok(false)
            }
            AUTH_MD5_PASSWORD => {
                self.method = "md5";
                self.require_no_channel_binding()?;
                let salt = cursor.bytes(4)?;
                let salt = [salt[0], salt[1], salt[2], salt[3]];
                let password = self.password()?;
                let hash = md5_hash(self.info.user().as_bytes(), password.as_bytes(), salt);
                frontend::password_message(hash.as_bytes(), out).map_err(io_err)?;
                Ok(false)
            }
            AUTH_SASL => {
                self.method = "scram-sha-256";
                let mut mechanisms = Vec::new();
                loop {
                    let m = cursor.cstr()?;
                    if m.is_empty() {
                        break;
                    }
                    mechanisms.push(String::from_utf8_lossy(m).into_owned());
                }
                let offers = |name: &str| mechanisms.iter().any(|m| m == name);
                let (channel_binding, mechanism) = match self.binding.take() {
                    Some(data) if offers(SCRAM_SHA_256_PLUS) => {
                        self.used_channel_binding = true;
                        (
                            ChannelBinding::tls_server_end_point(data),
                            SCRAM_SHA_256_PLUS,
                        )
                    }
                    // We could bind, the server does not offer it: say so ('y').
                    Some(_) if offers(SCRAM_SHA_256) => {
                        (ChannelBinding::unrequested(), SCRAM_SHA_256)
                    }
                    None if offers(SCRAM_SHA_256) => (ChannelBinding::unsupported(), SCRAM_SHA_256),
                    _ => {
                        return Err(
                            self.fail(format!("no supported SASL mechanism among {mechanisms:?}"))
                        );
                    }
                };
                if mechanism != SCRAM_SHA_256_PLUS {
                    self.require_no_channel_binding()?;
                }
                let password = self.password()?;
                let scram = ScramSha256::new(password.as_bytes(), channel_binding);
                frontend::sasl_initial_response(mechanism, scram.message(), out).map_err(io_err)?;
                self.scram = Some(scram);
                Ok(false)
            }
            AUTH_SASL_CONTINUE => {
                let scram = self.scram.as_mut().ok_or_else(|| {
                    ReplicationError::Protocol("SASLContinue without SASL".to_owned())
                })?;
                scram
                    .update(cursor.rest())
                    .map_err(|e| ReplicationError::Auth {
                        method: "scram-sha-256".to_owned(),
                        code: None,
                        message: format!("invalid SCRAM server-first message: {e}"),
                    })?;
                frontend::sasl_response(scram.message(), out).map_err(io_err)?;
                Ok(false)
            }
            AUTH_SASL_FINAL => {
                let scram = self.scram.as_mut().ok_or_else(|| {
                    ReplicationError::Protocol("SASLFinal without SASL".to_owned())
                })?;
                scram
                    .finish(cursor.rest())
                    .map_err(|e| ReplicationError::Auth {
                        method: "scram-sha-256".to_owned(),
                        code: None,
                        message: format!("server signature verification failed: {e}"),
                    })?;
                self.scram_finished = true;
                Ok(false)
            }
            AUTH_KERBEROS_V5 => self.unsupported("kerberos-v5"),
            AUTH_SCM_CREDENTIAL => self.unsupported("scm-credential"),
            AUTH_GSS | AUTH_GSS_CONTINUE => self.unsupported("gss"),
            AUTH_SSPI => self.unsupported("sspi"),
            other => {
                self.method = "unknown";
                Err(self.fail(format!("unknown authentication request {other}")))
            }
        }
    }

    fn unsupported(&mut self, method: &'static str) -> Result<bool, ReplicationError> {
        self.method = method;
        Err(self.fail(format!(
            "the server asks for {method} authentication, which the relay does not support; \
             use scram-sha-256 in pg_hba.conf"
        )))
    }

    fn require_no_channel_binding(&self) -> Result<(), ReplicationError> {
        if self.info.channel_binding() == ChannelBindingMode::Require {
            Err(self.fail(format!(
                "channel_binding=require, but the server asks for {}",
                self.method
            )))
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::replication::frames::{PRIMARY_KEEPALIVE, XLOG_DATA};
    use tokio::io::DuplexStream;

    fn message(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![tag];
        m.extend_from_slice(&u32::try_from(body.len() + 4).unwrap().to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    fn error_body(fields: &[(u8, &str)]) -> Vec<u8> {
        let mut b = Vec::new();
        for (k, v) in fields {
            b.push(*k);
            b.extend_from_slice(v.as_bytes());
            b.push(0);
        }
        b.push(0);
        b
    }

    fn xlog(lsn: u64, data: &[u8]) -> Vec<u8> {
        let mut body = vec![XLOG_DATA];
        body.extend_from_slice(&lsn.to_be_bytes());
        body.extend_from_slice(&lsn.to_be_bytes());
        body.extend_from_slice(&7i64.to_be_bytes());
        body.extend_from_slice(data);
        message(COPY_DATA, &body)
    }

    fn keepalive(lsn: u64, reply: bool) -> Vec<u8> {
        let mut body = vec![PRIMARY_KEEPALIVE];
        body.extend_from_slice(&lsn.to_be_bytes());
        body.extend_from_slice(&9i64.to_be_bytes());
        body.push(u8::from(reply));
        message(COPY_DATA, &body)
    }

    fn mock_stream() -> (ReplicationStream, DuplexStream) {
        let (client, server) = tokio::io::duplex(1 << 20);
        let stream = ReplicationStream {
            conn: Conn::new(Transport::Mock(client), "mock".to_owned()),
            done: false,
        };
        (stream, server)
    }

    #[test]
    fn quotes_identifiers_and_literals() {
        assert_eq!(quote_ident("slot"), "\"slot\"");
        assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(quote_literal(r"back\slash"), r"'back\slash'");
        assert_eq!(
            publication_names_option(&["outbox_relay_pub", "Other \"one\""]),
            "\"outbox_relay_pub\",\"Other \"\"one\"\"\""
        );
    }

    #[test]
    fn builds_start_replication() {
        let pubs = publication_names_option(&["outbox_relay_pub", "o'brien"]);
        let cmd = start_replication_command(
            "relay_slot",
            Lsn(0x16_B374_D848),
            &[("proto_version", "1"), ("publication_names", &pubs)],
        );
        assert_eq!(
            cmd,
            "START_REPLICATION SLOT \"relay_slot\" LOGICAL 16/B374D848 \
             (\"proto_version\" '1', \"publication_names\" '\"outbox_relay_pub\",\"o''brien\"')"
        );
        assert_eq!(
            start_replication_command("s", Lsn::ZERO, &[]),
            "START_REPLICATION SLOT \"s\" LOGICAL 0/0"
        );
    }

    #[test]
    fn builds_create_slot_for_each_server_generation() {
        assert_eq!(
            create_slot_command("s", false, SnapshotAction::NoExport, Some(15)),
            "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'nothing')"
        );
        assert_eq!(
            create_slot_command("s", true, SnapshotAction::Export, Some(17)),
            "CREATE_REPLICATION_SLOT \"s\" TEMPORARY LOGICAL pgoutput (SNAPSHOT 'export')"
        );
        assert_eq!(
            create_slot_command("s", false, SnapshotAction::Use, None),
            "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'use')"
        );
        assert_eq!(
            create_slot_command("s", true, SnapshotAction::NoExport, Some(14)),
            "CREATE_REPLICATION_SLOT \"s\" TEMPORARY LOGICAL pgoutput NOEXPORT_SNAPSHOT"
        );
        assert_eq!(
            create_slot_command("s", false, SnapshotAction::Use, Some(13)),
            "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput USE_SNAPSHOT"
        );
    }

    #[test]
    fn parses_major_versions() {
        assert_eq!(
            parse_major_version("15.18 (Debian 15.18-0+deb12u1)"),
            Some(15)
        );
        assert_eq!(parse_major_version("9.6.24"), Some(9));
        assert_eq!(parse_major_version("17devel"), Some(17));
        assert_eq!(parse_major_version("beta"), None);
    }

    #[test]
    fn frames_messages_across_reads() {
        let mut wire = message(PARAMETER_STATUS, b"a\0b\0");
        wire.extend(message(READY_FOR_QUERY, b"I"));
        let mut buf = BytesMut::new();
        for (i, byte) in wire.iter().enumerate() {
            buf.put_u8(*byte);
            let got = take_message(&mut buf).unwrap();
            match i {
                8 => assert_eq!(
                    got.map(|m| (m.tag, m.body)),
                    Some((b'S', Bytes::from_static(b"a\0b\0")))
                ),
                14 => assert_eq!(
                    got.map(|m| (m.tag, m.body)),
                    Some((b'Z', Bytes::from_static(b"I")))
                ),
                _ => assert!(got.is_none(), "byte {i}"),
            }
        }
        assert!(buf.is_empty());
    }

    #[test]
    fn rejects_impossible_lengths() {
        let mut buf = BytesMut::from(&[b'd', 0, 0, 0, 3][..]);
        assert!(matches!(
            take_message(&mut buf),
            Err(ReplicationError::Protocol(_))
        ));
        let mut buf = BytesMut::from(&[b'd', 0x7f, 0xff, 0xff, 0xff][..]);
        assert!(matches!(
            take_message(&mut buf),
            Err(ReplicationError::Protocol(_))
        ));
    }

    #[test]
    fn parses_error_responses() {
        let body = error_body(&[
            (b'S', "FEHLER"),
            (b'V', "ERROR"),
            (b'C', "55006"),
            (b'M', "replication slot \"s\" is active for PID 42"),
            (b'D', "some detail"),
        ]);
        let err = server_error(&body);
        assert!(err.is_slot_in_use());
        assert!(!err.is_undefined_object());
        assert_eq!(err.classify(), ErrorClass::Fatal);
        assert_eq!(
            err.to_string(),
            "replication slot \"s\" is active for PID 42 (SQLSTATE 55006); detail: some detail"
        );
        // Truncated or garbage bodies never panic.
        for cut in 0..body.len() {
            let _ = parse_error_fields(&body[..cut]);
        }
        assert_eq!(parse_error_fields(b"").code, "XX000");
    }

    #[test]
    fn startup_errors_of_class_28_are_authentication_failures() {
        let body = error_body(&[
            (b'V', "FATAL"),
            (b'C', "28P01"),
            (b'M', "password authentication failed for user \"u\""),
        ]);
        let err = startup_error(&body, "scram-sha-256");
        assert!(
            matches!(&err, ReplicationError::Auth { method, code: Some(c), .. }
            if method == "scram-sha-256" && c == "28P01")
        );
        assert_eq!(err.code(), Some("28P01"));
        assert_eq!(err.classify(), ErrorClass::Fatal);
        let other = startup_error(&error_body(&[(b'C', "3D000"), (b'M', "no db")]), "trust");
        assert!(matches!(other, ReplicationError::Server { .. }));
    }

    #[test]
    fn classifies_errors() {
        let server = |code: &str| ReplicationError::Server {
            code: code.to_owned(),
            message: String::new(),
            detail: None,
            hint: None,
        };
        for code in [
            "57P01", "57P02", "57P03", "08006", "53300", "58030", "XX000", "40001",
        ] {
            assert_eq!(server(code).classify(), ErrorClass::Transient, "{code}");
        }
        for code in [
            "28P01", "28000", "55000", "55006", "42704", "42501", "3D000", "57P04",
        ] {
            assert_eq!(server(code).classify(), ErrorClass::Fatal, "{code}");
        }
        assert!(ReplicationError::ConnectionClosed.is_transient());
        assert!(
            ReplicationError::Io(io::Error::from(io::ErrorKind::ConnectionReset)).is_transient()
        );
        assert!(!ReplicationError::Config(String::new()).is_transient());
        assert!(!ReplicationError::Tls(String::new()).is_transient());
        assert!(!ReplicationError::Protocol(String::new()).is_transient());
        assert!(server("42704").is_undefined_object());
        assert!(server("42710").is_duplicate_object());
    }

    #[test]
    fn parses_data_rows() {
        let mut body = 3i16.to_be_bytes().to_vec();
        body.extend_from_slice(&2i32.to_be_bytes());
        body.extend_from_slice(b"ab");
        body.extend_from_slice(&(-1i32).to_be_bytes());
        body.extend_from_slice(&0i32.to_be_bytes());
        assert_eq!(
            parse_data_row(&body).unwrap(),
            vec![Some("ab".to_owned()), None, Some(String::new())]
        );
        for cut in 0..body.len() {
            assert!(parse_data_row(&body[..cut]).is_err());
        }
        let mut huge = 1i16.to_be_bytes().to_vec();
        huge.extend_from_slice(&i32::MAX.to_be_bytes());
        assert!(parse_data_row(&huge).is_err());
    }

    #[tokio::test]
    async fn a_walsender_exiting_at_shutdown_ends_the_stream() {
        // pg_ctl stop -m fast: "COPY 0" CommandComplete, no CopyDone, then EOF.
        let (mut stream, mut server) = mock_stream();
        let mut wire = keepalive(0x20, false);
        wire.extend(message(COMMAND_COMPLETE, b"COPY 0\0"));
        server.write_all(&wire).await.unwrap();
        assert!(matches!(
            stream.next_frame().await.unwrap(),
            Some(ServerFrame::Keepalive { .. })
        ));
        assert_eq!(stream.next_frame().await.unwrap(), None);
        assert_eq!(stream.next_frame().await.unwrap(), None, "stays ended");
    }

    #[tokio::test]
    async fn streams_frames_and_ends_on_copy_done() {
        let (mut stream, mut server) = mock_stream();
        let mut wire = xlog(0x10, b"Bbegin");
        wire.extend(message(
            NOTICE_RESPONSE,
            &error_body(&[(b'V', "NOTICE"), (b'C', "00000"), (b'M', "hi")]),
        ));
        wire.extend(message(PARAMETER_STATUS, b"TimeZone\0UTC\0"));
        wire.extend(keepalive(0x20, true));
        wire.extend(message(COPY_DONE, b""));
        server.write_all(&wire).await.unwrap();

        match stream.next_frame().await.unwrap() {
            Some(ServerFrame::XLogData {
                wal_start, data, ..
            }) => {
                assert_eq!(wal_start, Lsn(0x10));
                assert_eq!(&data[..], b"Bbegin");
            }
            other => panic!("expected XLogData, got {other:?}"),
        }
        assert_eq!(
            stream.next_frame().await.unwrap(),
            Some(ServerFrame::Keepalive {
                wal_end: Lsn(0x20),
                send_time: 9,
                reply_requested: true
            })
        );
        assert_eq!(stream.server_parameter("TimeZone"), Some("UTC"));
        assert_eq!(stream.next_frame().await.unwrap(), None);
        assert_eq!(stream.next_frame().await.unwrap(), None, "stays ended");
    }

    #[tokio::test]
    async fn reports_server_errors_and_eof() {
        let (mut stream, mut server) = mock_stream();
        let err = error_body(&[
            (b'V', "ERROR"),
            (b'C', "42704"),
            (b'M', "publication \"p\" does not exist"),
        ]);
        server
            .write_all(&message(ERROR_RESPONSE, &err))
            .await
            .unwrap();
        let e = stream.next_frame().await.unwrap_err();
        assert!(e.is_undefined_object(), "{e}");

        let (mut stream, server) = mock_stream();
        drop(server);
        assert!(matches!(
            stream.next_frame().await,
            Err(ReplicationError::ConnectionClosed)
        ));

        let (mut stream, mut server) = mock_stream();
        server.write_all(&message(DATA_ROW, b"\0\0")).await.unwrap();
        assert!(matches!(
            stream.next_frame().await,
            Err(ReplicationError::Protocol(_))
        ));
    }

    /// Dropping `next_frame` at every possible point never loses or splits a frame.
    #[tokio::test]
    async fn next_frame_is_cancel_safe() {
        let (mut stream, mut server) = mock_stream();
        let frames: Vec<Vec<u8>> = (0..200u64)
            .map(|i| {
                xlog(
                    i + 1,
                    &vec![u8::try_from(i % 251).unwrap(); usize::try_from(i * 37 % 3000).unwrap()],
                )
            })
            .collect();
        let wire: Vec<u8> = frames.concat();
        let writer = tokio::spawn(async move {
            // Dribble the bytes in odd-sized pieces with yields between them.
            for chunk in wire.chunks(777) {
                server.write_all(chunk).await.unwrap();
                tokio::task::yield_now().await;
            }
            server
        });
        let mut seen = 0u64;
        let mut cancelled = 0u32;
        while seen < 200 {
            tokio::select! {
                biased;
                () = tokio::task::yield_now() => { cancelled += 1; }
                frame = stream.next_frame() => match frame.unwrap() {
                    Some(ServerFrame::XLogData { wal_start, data, .. }) => {
                        seen += 1;
                        assert_eq!(wal_start, Lsn(seen));
                        let i = seen - 1;
                        assert_eq!(data.len(), usize::try_from(i * 37 % 3000).unwrap());
                        assert!(data.iter().all(|&b| u64::from(b) == i % 251));
                    }
                    other => panic!("unexpected {other:?}"),
                },
            }
        }
        assert!(cancelled > 0, "the test must actually cancel reads");
        let _server = writer.await.unwrap();
    }

    #[tokio::test]
    async fn sends_status_updates_as_copy_data() {
        let (mut stream, mut server) = mock_stream();
        let status = StandbyStatus {
            write: Lsn(3),
            flush: Lsn(2),
            apply: Lsn(1),
            client_time_micros: 5,
            reply_requested: false,
        };
        stream.send_status(&status).await.unwrap();
        let mut got = vec![0u8; 1 + 4 + StandbyStatus::ENCODED_LEN];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(got[0], COPY_DATA);
        assert_eq!(
            u32::from_be_bytes([got[1], got[2], got[3], got[4]]),
            u32::try_from(4 + StandbyStatus::ENCODED_LEN).unwrap()
        );
        assert_eq!(StandbyStatus::parse(&got[5..]).unwrap(), status);

        // The server reads CopyDone + Terminate, then closes (as a walsender does).
        let server_task = tokio::spawn(async move {
            let mut tail = [0u8; 10];
            server.read_exact(&mut tail).await.unwrap();
            tail
        });
        stream.finish().await.unwrap();
        assert_eq!(
            server_task.await.unwrap(),
            [b'c', 0, 0, 0, 4, b'X', 0, 0, 0, 4]
        );
    }

    /// What a scripted startup exchange produced.
    struct Startup {
        result: Result<(), ReplicationError>,
        params: BTreeMap<String, String>,
        backend_pid: Option<i32>,
        /// Everything the client sent.
        received: Vec<u8>,
    }

    /// Runs the client's startup against a scripted server.
    async fn run_startup(url: &str, script: Vec<Vec<u8>>) -> Startup {
        let info = ConnInfo::parse(url).unwrap();
        let (client, mut server) = tokio::io::duplex(1 << 16);
        let server_task = tokio::spawn(async move {
            for m in script {
                server.write_all(&m).await.unwrap();
            }
            server.shutdown().await.unwrap();
            let mut received = Vec::new();
            let _ = server.read_to_end(&mut received).await;
            received
        });
        let mut conn = Conn::new(Transport::Mock(client), info.to_string());
        let result = conn.startup(&info, None).await;
        let Conn {
            io,
            params,
            backend_pid,
            ..
        } = conn;
        drop(io);
        let received = server_task.await.unwrap();
        Startup {
            result,
            params,
            backend_pid,
            received,
        }
    }

    #[tokio::test]
    async fn startup_sends_replication_parameters_and_collects_server_parameters() {
        let script = vec![
            message(AUTHENTICATION, &0i32.to_be_bytes()),
            message(PARAMETER_STATUS, b"server_version\x0015.4\0"),
            message(BACKEND_KEY_DATA, &[0, 0, 0, 42, 0, 0, 0, 1]),
            message(READY_FOR_QUERY, b"I"),
        ];
        let run = run_startup("postgresql://relay@h/app?options=-c%20x%3Dy", script).await;
        run.result.unwrap();
        assert_eq!(
            run.params.get("server_version").map(String::as_str),
            Some("15.4")
        );
        assert_eq!(run.backend_pid, Some(42));
        let text = String::from_utf8_lossy(&run.received);
        for needle in [
            "user\0relay\0",
            "database\0app\0",
            "replication\0database\0",
            "application_name\0outbox-relay\0",
            "client_encoding\0UTF8\0",
            "options\0-c DateStyle=ISO -c TimeZone=UTC -c extra_float_digits=3 -c x=y\0",
        ] {
            assert!(
                text.contains(needle),
                "startup packet lacks {needle:?}: {text:?}"
            );
        }
    }

    #[tokio::test]
    async fn startup_answers_md5_and_cleartext() {
        let mut md5 = 5i32.to_be_bytes().to_vec();
        md5.extend_from_slice(&[1, 2, 3, 4]);
        let script = vec![
            message(AUTHENTICATION, &md5),
            message(AUTHENTICATION, &0i32.to_be_bytes()),
            message(READY_FOR_QUERY, b"I"),
        ];
        let run = run_startup("postgresql://u:pw@h/db", script).await;
        run.result.unwrap();
        let expected = md5_hash(b"u", b"pw", [1, 2, 3, 4]);
        assert!(String::from_utf8_lossy(&run.received).contains(&expected));

        let script = vec![message(AUTHENTICATION, &3i32.to_be_bytes())];
        match run_startup("postgresql://u@h/db", script).await.result {
            Err(ReplicationError::Auth {
                method,
                code: None,
                message,
            }) => {
                assert_eq!(method, "password");
                assert!(message.contains("requires a password"), "{message}");
            }
            other => panic!("expected a missing-password error, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn startup_rejects_unsupported_methods_and_surprises() {
        let result = run_startup(
            "postgresql://u:p@h/db",
            vec![message(AUTHENTICATION, &7i32.to_be_bytes())],
        )
        .await
        .result;
        assert!(
            matches!(result, Err(ReplicationError::Auth { ref method, .. }) if method == "gss")
        );

        let mut sasl = 10i32.to_be_bytes().to_vec();
        sasl.extend_from_slice(b"SCRAM-SHA-1\0\0");
        let result = run_startup(
            "postgresql://u:p@h/db",
            vec![message(AUTHENTICATION, &sasl)],
        )
        .await
        .result;
        assert!(
            matches!(result, Err(ReplicationError::Auth { .. })),
            "{result:?}"
        );

        let result = run_startup("postgresql://u:p@h/db", vec![message(DATA_ROW, b"")])
            .await
            .result;
        assert!(matches!(result, Err(ReplicationError::Protocol(_))));

        let result = run_startup("postgresql://u:p@h/db", vec![]).await.result;
        assert!(matches!(result, Err(ReplicationError::ConnectionClosed)));

        // channel_binding=require refuses trust.
        let result = run_startup(
            "postgresql://u:p@h/db?channel_binding=require",
            vec![message(AUTHENTICATION, &0i32.to_be_bytes())],
        )
        .await
        .result;
        assert!(
            matches!(result, Err(ReplicationError::Auth { .. })),
            "{result:?}"
        );
    }
}
