//! The streaming-replication connection: startup, authentication, replication
//! commands and the `CopyBoth` stream, written on `postgres-protocol`.
//!
//! `tokio-postgres` cannot open a replication connection (it has no
//! `replication=database` startup parameter and no `CopyBoth` support), so this module
//! speaks the wire protocol itself; `postgres-protocol` supplies the frontend message
//! encoders and the MD5/SCRAM computations, and a small checked cursor parses what the
//! server sends (it never panics and never trusts a length).
//!
//! The connection goes through two phases, each in its own file:
//!
//! - `connection.rs` ([`ReplicationConnection`]): startup (`replication=database`,
//!   session settings), then command mode: `IDENTIFY_SYSTEM`,
//!   `CREATE_REPLICATION_SLOT`, SQL; built from the command texts and answer parsers
//!   of `commands.rs`;
//! - `stream.rs` ([`ReplicationStream`]): the `CopyBoth` phase after
//!   `START_REPLICATION`, carrying the XLogData, keepalive and standby status frames
//!   of [`frames`].
//!
//! Under both: `transport.rs` (TCP, Unix socket or TLS, with the read/write buffers
//! that make reads cancel-safe), `messages.rs` (backend message framing and
//! parsing), `auth.rs` (cleartext, MD5, SCRAM-SHA-256 with channel binding) and
//! `error.rs` ([`ReplicationError`] and its transient/fatal classification, shared
//! with the metadata connection).

mod auth;
mod commands;
mod connection;
mod error;
pub mod frames;
mod messages;
mod stream;
mod transport;

#[cfg(test)]
mod tests;

pub use commands::{
    CreatedSlot, SnapshotAction, SystemIdentity, TextRows, TimelineSwitch, create_slot_command,
    parse_timeline_history,
};
pub(crate) use commands::{publication_names_option, quote_literal};
pub use connection::ReplicationConnection;
pub(crate) use connection::SESSION_OPTIONS;
pub use error::{ReplicationError, classify_sqlstate, sqlstate};
pub use stream::ReplicationStream;
