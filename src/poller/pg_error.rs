//! How a failed statement of the poller (or of a cutover, which shares its
//! statements) is classified: retried, a missing prerequisite, or fatal.
//!
//! The classes are the CDC relay's (`docs/architecture.md#error-classes`, and
//! [`classify_sqlstate`] for the SQLSTATE table): connection loss, server shutdown,
//! serialization failures and resource exhaustion are transient — the batch's
//! transaction is rolled back (nothing was marked) and retried after a backoff;
//! authentication, missing objects, privileges and `wal_level` are prerequisite
//! errors (exit code 3), as on the relay's own connections; anything else stops the
//! poller. The error keeps the [`tokio_postgres::Error`] as its source, and its text
//! is the one the relay's connections print for the same failure.
//!
//! Failures while *connecting* do not come through here: they are classified by
//! [`crate::postgres::connect_info`].

use std::error::Error as _;

use crate::delivery::ErrorClass;
use crate::error::Error;
use crate::postgres::prerequisite::Prerequisite;
use crate::postgres::replication::classify_sqlstate;

/// What every poller statement error says first.
const CONTEXT: &str = "PostgreSQL: ";

/// SQLSTATEs that mean a PostgreSQL prerequisite is not met (besides class 28,
/// authentication): `wal_level` / slot invalidated, undefined object, object in use,
/// no such database, insufficient privilege.
const PREREQUISITE_SQLSTATES: [&str; 5] = ["55000", "42704", "55006", "3D000", "42501"];

/// Classifies a PostgreSQL error of a poller statement (see the module doc):
/// [`Error::Statement`] (transient or not), or [`Error::Prerequisite`] when the
/// server refused for a missing prerequisite.
pub(crate) fn pg_error(e: tokio_postgres::Error) -> Error {
    let (message, verdict) = describe(&e);
    match verdict {
        Verdict::Refused(sqlstate) => Error::Prerequisite(Prerequisite::Refused {
            context: CONTEXT.to_owned(),
            message,
            sqlstate,
        }),
        Verdict::Class(class) => Error::Statement {
            message,
            transient: class == ErrorClass::Transient,
            source: e,
        },
    }
}

/// How the poller treats one failure.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    /// A missing prerequisite, with the server's SQLSTATE.
    Refused(Option<String>),
    /// Transient (retried) or fatal.
    Class(ErrorClass),
}

/// The failure's text and verdict, in the words of the replication connection's
/// errors (`ReplicationError`): the server's message with its SQLSTATE, detail and
/// hint; a closed connection; an I/O error; else a protocol violation.
fn describe(e: &tokio_postgres::Error) -> (String, Verdict) {
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        if code.starts_with("28") {
            let message = format!(
                "authentication failed (method unknown): {} (SQLSTATE {code})",
                db.message()
            );
            return (message, Verdict::Refused(Some(code.to_owned())));
        }
        let mut message = format!("{} (SQLSTATE {code})", db.message());
        if let Some(detail) = db.detail() {
            message.push_str(&format!("; detail: {detail}"));
        }
        if let Some(hint) = db.hint() {
            message.push_str(&format!("; hint: {hint}"));
        }
        let verdict = if PREREQUISITE_SQLSTATES.contains(&code) {
            Verdict::Refused(Some(code.to_owned()))
        } else {
            Verdict::Class(classify_sqlstate(code))
        };
        return (message, verdict);
    }
    if e.is_closed() {
        return (
            "the server closed the connection".to_owned(),
            Verdict::Class(ErrorClass::Transient),
        );
    }
    let text = e.to_string();
    let source = e.source();
    let described = match source {
        Some(s) => format!("{text}: {s}"),
        None => text.clone(),
    };
    let io = source.is_some_and(|s| s.is::<std::io::Error>());
    if io || text.starts_with("timeout waiting for server") {
        (
            format!("I/O error on the PostgreSQL connection: {described}"),
            Verdict::Class(ErrorClass::Transient),
        )
    } else {
        (
            format!("PostgreSQL protocol violation: {described}"),
            Verdict::Class(ErrorClass::Fatal),
        )
    }
}
