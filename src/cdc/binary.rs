//! Binary decoding: when a session asks pgoutput for binary-format values.
//!
//! # Why
//!
//! With `binary 'true'` (PostgreSQL 14+) the walsender sends each column with its
//! type's send function instead of its output function. For the outbox that is
//! cheaper where it matters, in the walsender, the relay's ceiling: uuids, integers
//! and timestamps go out as fixed-size bytes instead of being formatted (a
//! timestamp in the session's time zone, as a date), `bytea` raw instead of as hex;
//! jsonb is printed either way (measured in `docs/benchmarks.md`,
//! "binary decoding": −10 % walsender CPU per event with a jsonb payload, −17 %
//! with bytea). The relay turns those values back into the text the mapper reads
//! (`outbox::relation::binary_as_text`), so records are byte for byte the same.
//!
//! # When not
//!
//! Binary applies to every column of every published table, and a type the relay
//! does not read would then be unreadable (a poisoned row where text mode relays
//! it). Which types a relation has is only known from its `Relation` message, at
//! the point in the WAL where it is decoded (an `ALTER TABLE` may have changed it
//! since), so the check is made there, before any of its rows: a relation with a
//! column of another type ends the session ([`BinaryRefused`]); the relay then
//! reconnects and streams from its confirmed position in text mode, for the rest of
//! the process. Restarting from the slot is always safe (at most the window is
//! delivered again).

use crate::outbox::reads_binary;
use crate::postgres::pgoutput::Relation;

/// A relation a binary session cannot read.
#[derive(Debug, thiserror::Error)]
#[error(
    "relation {relation} has column {column:?} of type OID {type_oid}, which the relay does not \
     read in binary format: streaming on in text format"
)]
pub(crate) struct BinaryRefused {
    relation: String,
    column: String,
    type_oid: u32,
}

/// Whether sessions ask for binary-format values, and whether this one did.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BinaryDecoding {
    /// Configured and supported by the server.
    wanted: bool,
    /// A relation refused it: text for the rest of the process.
    refused: bool,
    /// The current session asked for it.
    session: bool,
}

impl BinaryDecoding {
    pub(crate) fn new(wanted: bool) -> BinaryDecoding {
        BinaryDecoding {
            wanted,
            refused: false,
            session: false,
        }
    }

    /// A session starts: it asks for binary unless a relation refused it.
    pub(crate) fn start_session(&mut self) {
        self.session = self.wanted && !self.refused;
    }

    /// Whether this session asks for (and gets) binary-format values.
    pub(crate) fn active(&self) -> bool {
        self.session
    }

    /// Checks a `Relation` message of a binary session (module docs).
    ///
    /// # Errors
    ///
    /// [`BinaryRefused`] for a column of a type the relay does not read in binary:
    /// the session must end; the next one is text.
    pub(crate) fn check(&mut self, relation: &Relation) -> Result<(), BinaryRefused> {
        if !self.session {
            return Ok(());
        }
        let Some(column) = relation.columns.iter().find(|c| !reads_binary(c.type_oid)) else {
            return Ok(());
        };
        self.refused = true;
        self.session = false;
        Err(BinaryRefused {
            relation: format!("{}.{}", relation.namespace, relation.name),
            column: column.name.to_string(),
            type_oid: column.type_oid,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::postgres::pgoutput::RelationColumn;

    fn relation(types: &[u32]) -> Relation {
        Relation {
            xid: None,
            id: 1,
            namespace: "public".into(),
            name: "outbox".into(),
            replica_identity: b'd',
            columns: types
                .iter()
                .enumerate()
                .map(|(i, &type_oid)| RelationColumn {
                    flags: 0,
                    name: format!("c{i}").as_str().into(),
                    type_oid,
                    type_modifier: -1,
                })
                .collect(),
        }
    }

    #[test]
    fn a_relation_of_other_types_ends_binary_for_the_process() {
        let mut b = BinaryDecoding::new(true);
        b.start_session();
        assert!(b.active());
        // uuid, text, jsonb, timestamptz, int4: all read.
        assert!(b.check(&relation(&[2950, 25, 3802, 1184, 23])).is_ok());
        // numeric is not.
        let refused = b.check(&relation(&[2950, 1700])).unwrap_err();
        assert!(
            refused.to_string().contains("\"c1\" of type OID 1700"),
            "{refused}"
        );
        assert!(!b.active());
        b.start_session();
        assert!(!b.active(), "text for the rest of the process");
        // A text session checks nothing.
        assert!(b.check(&relation(&[1700])).is_ok());
    }

    #[test]
    fn not_wanted_means_never() {
        let mut b = BinaryDecoding::new(false);
        b.start_session();
        assert!(!b.active());
    }
}
