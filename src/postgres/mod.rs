//! Everything that talks to PostgreSQL.
//!
//! Two kinds of connection are used. The *metadata* connection is an ordinary
//! `tokio-postgres` client: prerequisites (`wal_level`, publication, slot state,
//! `wal_sender_timeout`) and poison inserts. The *replication* connection speaks the
//! streaming-replication sub-protocol, which `tokio-postgres` does not support; it is
//! hand-written on `postgres-protocol`.
//!
//! - [`conninfo`]: the libpq-style URL both connections are opened from;
//! - [`tls`]: `sslmode` and channel binding on rustls, for both connections;
//! - `metadata.rs`: opening the metadata connection ([`connect`], [`connect_info`],
//!   [`connect_metadata`], [`parse_url`]);
//! - [`replication`]: the replication connection; [`pgoutput`]: decoding what it
//!   streams;
//! - [`slot`] and [`prerequisite`]: the start-up checks and their typed exit-3 errors;
//! - [`servers`]: the slot's server and the writes' server, the same or a standby
//!   and its primary;
//! - `error.rs`: [`PgError`], the layer's error with its exit code and class.

mod error;
mod metadata;

pub mod conninfo;
pub mod pgoutput;
pub mod prerequisite;
pub mod replication;
pub mod servers;
pub mod shard_publication;
pub mod slot;
pub mod tls;

pub use error::{PgError, describe_error, process_error};
pub use metadata::{
    bound_statements, connect, connect_info, connect_metadata, parse_url, postmaster_started,
    table_exists, wal_end,
};
