//! The `CopyBoth` phase: XLogData and keepalives in, standby status updates out.
//!
//! `START_REPLICATION` answers `CopyBothResponse`; from then on both directions carry
//! `CopyData` messages (<https://www.postgresql.org/docs/current/protocol-flow.html#PROTOCOL-COPY>).
//! The walsender sends XLogData (`'w'`, one `pgoutput` message each) and primary
//! keepalives (`'k'`); we send standby status updates (`'r'`). Both are parsed and
//! encoded in [`frames`](super::frames). The server ends the stream with `CopyDone` (seen as
//! `Ok(None)` from [`ReplicationStream::next_frame`]) or an `ErrorResponse` (for
//! example when the publication does not exist, which is only noticed when the first
//! change is decoded); [`ReplicationStream::finish`] ends it from our side.
//!
//! Errors before `CopyBothResponse` (slot in use, slot missing, `wal_level` too low)
//! come back from [`ReplicationConnection::start_logical_replication`]: PostgreSQL
//! sends `CopyBothResponse` only once the walsender is fully set up.
//!
//! [`ReplicationConnection::start_logical_replication`]: super::ReplicationConnection::start_logical_replication
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
//! The buffers live in the connection ([`super::transport`]).

use std::fmt;
use std::time::Duration;

use bytes::BufMut;
use postgres_protocol::message::frontend;
use tokio::io::AsyncWriteExt;

use super::error::ReplicationError;
use super::frames::{ServerFrame, StandbyStatus};
use super::messages::{
    COMMAND_COMPLETE, COPY_DATA, COPY_DONE, ERROR_RESPONSE, NOTICE_RESPONSE, PARAMETER_STATUS,
    READY_FOR_QUERY, log_notice, server_error, unexpected,
};
use super::transport::Conn;

/// The low-water mark while readiness is held. Linux caps it at half the largest
/// receive buffer (`net.ipv4.tcp_rmem`, 3 MiB by default) and grows the socket's
/// receive buffer to hold that much, so the server is not stopped by a pause, and a
/// burst that fills it (a backlog, better read at once) ends the pause.
const HELD_READINESS_BYTES: i32 = i32::MAX;

/// How long [`ReplicationStream::finish`] waits for the server to close.
const FINISH_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

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
    pub(super) conn: Conn,
    pub(super) done: bool,
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

    /// Whether [`Self::next_frame`] would answer without waiting: a whole message is
    /// buffered, or the socket holds bytes right now (read into the buffer here if
    /// tokio already knows of them, else seen in the kernel's receive queue; they may
    /// still be only part of a message). Never waits and wakes no task later.
    ///
    /// # Errors
    ///
    /// As [`Self::next_frame`]'s read: [`ReplicationError::ConnectionClosed`] at EOF,
    /// [`ReplicationError::Io`].
    pub fn frame_ready(&mut self) -> Result<bool, ReplicationError> {
        if self.done || self.conn.message_buffered() {
            return Ok(true);
        }
        Ok(self.conn.fill_now()? || self.conn.kernel_has_bytes())
    }

    /// Reads what arrives into the buffer, without taking a frame out (cancel-safe):
    /// for waiting on the socket while not reading frames.
    ///
    /// # Errors
    ///
    /// [`ReplicationError::ConnectionClosed`] at EOF, [`ReplicationError::Io`].
    pub async fn read_more(&mut self) -> Result<(), ReplicationError> {
        self.conn.fill().await
    }

    /// Until [`Self::release_readiness`], bytes arriving on the socket wake nobody
    /// (unless a great many arrive): for a pause in reading (`cdc::read_pacing`),
    /// which would otherwise be interrupted by every segment the server sends.
    /// `Ok(false)` where that cannot be done safely (a Unix socket, a kernel older
    /// than Linux 4.18): nothing changed.
    ///
    /// # Errors
    ///
    /// [`ReplicationError::Io`] if the socket option cannot be set.
    pub fn hold_readiness(&self) -> Result<bool, ReplicationError> {
        Ok(self.conn.set_read_threshold(HELD_READINESS_BYTES)?)
    }

    /// Ends [`Self::hold_readiness`]: the socket is readable again as soon as a byte
    /// is queued. Must succeed before the stream is read again.
    ///
    /// # Errors
    ///
    /// [`ReplicationError::Io`] if the socket option cannot be set; the caller must
    /// then give the connection up, since its reads could wait for ever.
    pub fn release_readiness(&self) -> Result<(), ReplicationError> {
        self.conn.set_read_threshold(1)?;
        Ok(())
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
