//! How a failed statement of the poller (or of a cutover, which shares its
//! statements) is classified: retried, a missing prerequisite, or fatal.
//!
//! Exactly as a failure on the relay's own connections: the error becomes a
//! [`ReplicationError`](crate::postgres::replication::ReplicationError) (the
//! server's message with its SQLSTATE, detail and hint; a closed connection; an I/O
//! error; else a protocol violation) and [`crate::postgres::process_error`] decides
//! (`docs/architecture.md#error-classes`). Connection loss, server shutdown,
//! serialization failures and resource exhaustion are transient — the batch's
//! transaction is rolled back (nothing was marked) and retried after a backoff;
//! authentication, missing objects, privileges and `wal_level` are prerequisite
//! errors (exit code 3); anything else stops the poller.

use crate::error::Error;

/// What every poller statement error says first.
const CONTEXT: &str = "PostgreSQL: ";

/// Classifies a PostgreSQL error of a poller statement (see the module doc).
pub(crate) fn pg_error(e: tokio_postgres::Error) -> Error {
    crate::postgres::process_error(e.into(), CONTEXT).into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::delivery::ErrorClass;

    #[tokio::test]
    async fn a_refused_connection_is_transient() {
        // Nothing listens on port 1: the connect fails with an I/O error.
        let err = tokio_postgres::connect("host=127.0.0.1 port=1", tokio_postgres::NoTls)
            .await
            .map(|_| ())
            .expect_err("nothing listens on port 1");
        let err = pg_error(err);
        assert_eq!(err.class(), ErrorClass::Transient, "{err}");
        assert!(!matches!(err, Error::Prerequisite(_)));
        assert!(err.to_string().starts_with(CONTEXT), "{err}");
    }
}
