//! The replication stream port: one session's `START_REPLICATION` stream.
//!
//! Frames come in ([`WalStream::next_frame`]); standby status updates go out
//! ([`WalStream::send_status`]); an error or the end of the stream ends the session.
//! A pause in reading (`cdc::read_pacing`) holds the stream's readiness so that
//! the loop is not woken by every segment the server sends meanwhile; a stream that
//! cannot hold it is never paused.
//!
//! The real adapter is [`ReplicationStream`] (the hand-written replication
//! protocol, `postgres::replication`); the simulated one is `cdc::simulation`'s
//! walsender.

use super::Boxed;
use crate::postgres::replication::frames::{ServerFrame, StandbyStatus};
use crate::postgres::replication::{ReplicationError, ReplicationStream};

/// See the module documentation.
pub(crate) trait WalStream: Send + Sync {
    /// The next frame; `None` when the server ended the stream.
    fn next_frame(&mut self) -> Boxed<'_, Result<Option<ServerFrame>, ReplicationError>>;

    /// Whether a whole frame can be taken without waiting.
    ///
    /// # Errors
    ///
    /// The stream failed.
    fn frame_ready(&mut self) -> Result<bool, ReplicationError>;

    /// Waits until the held readiness is reached (see [`WalStream::hold_readiness`]).
    fn read_more(&mut self) -> Boxed<'_, Result<(), ReplicationError>>;

    /// Holds the stream's readiness for a pause; `false` where it cannot be held.
    ///
    /// # Errors
    ///
    /// The socket refused.
    fn hold_readiness(&self) -> Result<bool, ReplicationError>;

    /// Releases what [`WalStream::hold_readiness`] held.
    ///
    /// # Errors
    ///
    /// The socket refused.
    fn release_readiness(&self) -> Result<(), ReplicationError>;

    /// Sends a standby status update.
    fn send_status<'a>(
        &'a mut self,
        status: &'a StandbyStatus,
    ) -> Boxed<'a, Result<(), ReplicationError>>;

    /// The pid of the walsender serving this stream.
    fn backend_pid(&self) -> Option<i32>;

    /// Ends the stream (`CopyDone`) at a graceful shutdown.
    fn finish(self: Box<Self>) -> Boxed<'static, Result<(), ReplicationError>>;
}

impl WalStream for ReplicationStream {
    fn next_frame(&mut self) -> Boxed<'_, Result<Option<ServerFrame>, ReplicationError>> {
        Box::pin(ReplicationStream::next_frame(self))
    }

    fn frame_ready(&mut self) -> Result<bool, ReplicationError> {
        ReplicationStream::frame_ready(self)
    }

    fn read_more(&mut self) -> Boxed<'_, Result<(), ReplicationError>> {
        Box::pin(ReplicationStream::read_more(self))
    }

    fn hold_readiness(&self) -> Result<bool, ReplicationError> {
        ReplicationStream::hold_readiness(self)
    }

    fn release_readiness(&self) -> Result<(), ReplicationError> {
        ReplicationStream::release_readiness(self)
    }

    fn send_status<'a>(
        &'a mut self,
        status: &'a StandbyStatus,
    ) -> Boxed<'a, Result<(), ReplicationError>> {
        Box::pin(ReplicationStream::send_status(self, status))
    }

    fn backend_pid(&self) -> Option<i32> {
        ReplicationStream::backend_pid(self)
    }

    fn finish(self: Box<Self>) -> Boxed<'static, Result<(), ReplicationError>> {
        Box::pin(ReplicationStream::finish(*self))
    }
}
