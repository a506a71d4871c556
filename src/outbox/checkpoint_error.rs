//! The error of the relay's bookkeeping tables, the checkpoints
//! ([`super::checkpoint`]) and the relay's saved position ([`super::position`]),
//! and the reading of the LSNs they hold.
//!
//! It sits below both: `checkpoint` reads the saved position (retention never
//! deletes past it), so `position` must not import anything from `checkpoint`, or
//! the two would import each other. The type keeps its name and its public path
//! (`outbox::checkpoint::CheckpointError`, re-exported there): the checkpoint table
//! came first, and the commands' error wraps it under that name.

use crate::delivery::ErrorClass;
use crate::lsn::{Lsn, ParseLsnError};

/// Why a checkpoint could not be taken, read or pruned, or the relay's position
/// could not be read or saved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// `outbox.table` is not a table name like `schema.table` (the configuration
    /// check refuses it first; the message is the configuration's).
    #[error(transparent)]
    TableName(#[from] crate::config::TableNameError),
    /// A statement on the checkpoint or position table, or on `pg_replication_slots`,
    /// failed.
    #[error("PostgreSQL error: {}", crate::postgres::describe_error(.0))]
    Postgres(#[from] tokio_postgres::Error),
    /// The server sent text that is not an LSN.
    #[error("server sent an invalid LSN {text:?}: {source}")]
    InvalidLsn {
        /// The text as received.
        text: String,
        /// Why it is not an LSN.
        source: ParseLsnError,
    },
    /// A column of the relay's position table holds a value the relay never writes.
    #[error("{column} in the relay position table is invalid: {text:?}")]
    InvalidValue {
        /// The column.
        column: &'static str,
        /// The text as read.
        text: String,
    },
}

impl CheckpointError {
    /// The process exit code: 1, as for any PostgreSQL failure that is not a missing
    /// prerequisite (exit code 3 is reserved for the checks in
    /// `postgres::prerequisite`).
    #[must_use]
    pub fn exit_code(&self) -> u8 {
        1
    }

    /// Whether retrying can help: a PostgreSQL error without a server error (the
    /// connection failed) is transient, anything else is fatal.
    #[must_use]
    pub fn class(&self) -> ErrorClass {
        match self {
            CheckpointError::Postgres(e) if e.as_db_error().is_none() => ErrorClass::Transient,
            _ => ErrorClass::Fatal,
        }
    }
}

/// `text` (an LSN as the server writes it, `16/B374D848`) as an LSN, or the error
/// that names the text: the server sent it, so it is checked, never unwrapped.
pub(super) fn parse_lsn(text: &str) -> Result<Lsn, CheckpointError> {
    text.parse().map_err(|source| CheckpointError::InvalidLsn {
        text: text.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsns_from_the_server_are_checked() {
        assert_eq!(parse_lsn("16/B374D848").unwrap(), Lsn(0x16_B374_D848));
        let err = parse_lsn("not an lsn").unwrap_err();
        assert!(
            matches!(&err, CheckpointError::InvalidLsn { text, .. } if text == "not an lsn"),
            "{err:?}"
        );
        assert_eq!(err.class(), ErrorClass::Fatal);
    }
}
