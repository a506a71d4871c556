//! A walsender connection in command mode: startup, then replication commands and
//! SQL over the simple query protocol, until `START_REPLICATION` turns it into a
//! [`ReplicationStream`].
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

use std::fmt;
use std::io;

use postgres_protocol::message::frontend;
use tokio::io::AsyncWriteExt;

use crate::config::quote_ident;
use crate::lsn::Lsn;
use crate::postgres::conninfo::ConnInfo;

use super::auth::Authenticator;
use super::commands::{
    CreatedSlot, SnapshotAction, SystemIdentity, TextRows, TimelineSwitch, check_no_nul,
    create_slot_command, parse_field, parse_lsn_field, parse_major_version, parse_timeline_history,
    publication_names_option, required_field, single_row, start_replication_command,
};
use super::error::ReplicationError;
use super::messages::{
    AUTHENTICATION, BACKEND_KEY_DATA, COMMAND_COMPLETE, COPY_BOTH_RESPONSE, COPY_IN_RESPONSE,
    COPY_OUT_RESPONSE, Cursor, DATA_ROW, EMPTY_QUERY_RESPONSE, ERROR_RESPONSE,
    NEGOTIATE_PROTOCOL_VERSION, NOTICE_RESPONSE, PARAMETER_STATUS, READY_FOR_QUERY,
    ROW_DESCRIPTION, log_notice, parse_data_row, server_error, startup_error, tag_name, unexpected,
};
use super::stream::ReplicationStream;
use super::transport::{Conn, open_transport};

/// Session settings sent at startup so `pgoutput`'s text output is stable.
pub(crate) const SESSION_OPTIONS: &str = "-c DateStyle=ISO -c TimeZone=UTC -c extra_float_digits=3";

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
    /// exist), [`ReplicationError::TlsConfig`] (TLS roots cannot be loaded),
    /// [`ReplicationError::Config`].
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

    /// Whether the server is a hot standby (in recovery) as it reported at
    /// connection: `in_hot_standby`, a parameter PostgreSQL 14+ reports to every
    /// client. A standby that is promoted later reports it again, but this is read
    /// per command, and a session's connection is new.
    #[must_use]
    pub fn on_standby(&self) -> bool {
        self.server_parameter("in_hot_standby") == Some("on")
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

    /// `TIMELINE_HISTORY tli`: where each ancestor of timeline `tli` ended. Timeline
    /// 1 has no ancestors (and no history file): an empty list, without asking.
    ///
    /// # Errors
    ///
    /// As [`Self::simple_query`]; [`ReplicationError::Protocol`] for a malformed answer.
    pub async fn timeline_history(
        &mut self,
        timeline: u32,
    ) -> Result<Vec<TimelineSwitch>, ReplicationError> {
        if timeline <= 1 {
            return Ok(Vec::new());
        }
        let rows = self
            .simple_query(&format!("TIMELINE_HISTORY {timeline}"))
            .await?;
        let row = single_row(&rows, "TIMELINE_HISTORY", 2)?;
        parse_timeline_history(required_field(row, 1, "TIMELINE_HISTORY content")?)
    }

    /// `CREATE_REPLICATION_SLOT "name" [TEMPORARY] LOGICAL pgoutput …`.
    ///
    /// Uses the option-list syntax on PostgreSQL 15+ and the keyword syntax
    /// (`NOEXPORT_SNAPSHOT`, …) before. A permanent slot on PostgreSQL 17+ is a
    /// failover slot (`FAILOVER true`): standbys with `sync_replication_slots` keep
    /// a copy that a promoted standby resumes from. A temporary slot is dropped
    /// when this connection ends (including after streaming from it).
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
        let command = create_slot_command(
            name,
            temporary,
            snapshot,
            self.server_major_version(),
            self.on_standby(),
        );
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

impl Conn {
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
    pub(super) async fn startup(
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
