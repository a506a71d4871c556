//! [`ProtocolError`]: a violation of pgoutput's transaction framing.
//!
//! The core models pgoutput protocol version 1: each transaction arrives whole at its
//! commit, as `Begin`, rows, `Commit`, one at a time, with commit LSNs that never go
//! back. Anything else means the stream was misread or messages were lost, and no
//! watermark computed past that point can be trusted. The error is therefore not
//! retried by the core: the shell drops the connection and restarts from the slot's
//! `confirmed_flush_lsn`, which is always safe (the server re-sends every transaction
//! not yet confirmed). Each variant carries the LSNs and xids involved, so the log line
//! says exactly what arrived out of place.

use crate::lsn::Lsn;

/// A violation of the pgoutput transaction framing (or of the window contract by the
/// shell). The stream cannot be trusted past it: the shell should drop the connection and
/// restart from the slot, which is always safe.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolError {
    /// `Begin` while another transaction is still open.
    #[error(
        "Begin of transaction {xid} (final LSN {final_lsn}) while transaction {open_xid} (final LSN {open_final_lsn}) is still open"
    )]
    BeginInsideTransaction {
        open_xid: u32,
        open_final_lsn: Lsn,
        xid: u32,
        final_lsn: Lsn,
    },
    /// `Commit` with no open transaction.
    #[error("Commit (commit LSN {commit_lsn}, end LSN {end_lsn}) without a Begin")]
    CommitWithoutBegin { commit_lsn: Lsn, end_lsn: Lsn },
    /// A row change with no open transaction.
    #[error("row change outside a transaction (no Begin)")]
    ChangeOutsideTransaction,
    /// `Commit`'s commit LSN differs from the open transaction's `Begin` final LSN.
    #[error(
        "Commit LSN {commit_lsn} does not match the final LSN {final_lsn} announced by Begin of transaction {xid}"
    )]
    CommitLsnMismatch {
        xid: u32,
        final_lsn: Lsn,
        commit_lsn: Lsn,
    },
    /// `Commit`'s end LSN is not after its commit LSN.
    #[error("transaction {xid} ends at {end_lsn}, not after its commit LSN {commit_lsn}")]
    CommitEndNotAfterCommit {
        xid: u32,
        commit_lsn: Lsn,
        end_lsn: Lsn,
    },
    /// A transaction commits before the end of the previous one: commit order went back.
    #[error(
        "transaction {xid} commits at {final_lsn}, before the end {previous_end} of the previous commit"
    )]
    CommitLsnWentBackwards {
        xid: u32,
        final_lsn: Lsn,
        previous_end: Lsn,
    },
    /// The shell admitted an event while [`Core::can_read`](super::Core::can_read) was false.
    #[error(
        "in-flight window is full ({events} events, {bytes} bytes): the shell must not read while can_read() is false"
    )]
    WindowFull { events: usize, bytes: usize },
}
