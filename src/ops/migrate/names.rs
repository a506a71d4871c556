//! Names of the indexes the migrations create, and how they are written into SQL.
//!
//! # Why
//!
//! An index is named after its table, `<table>_<suffix>`. PostgreSQL keeps at most
//! `NAMEDATALEN - 1` = 63 bytes of an identifier and silently cuts a longer one
//! (<https://www.postgresql.org/docs/current/sql-syntax-lexical.html#SQL-SYNTAX-IDENTIFIERS>).
//! Cut, the index names of a long table name run into each other or into the table
//! itself, and `CREATE INDEX IF NOT EXISTS` skips the index with a notice only: for
//! the poison table's unique occurrence index that silently turns off the
//! de-duplication of poisoned events. So a name longer than 63 bytes keeps the start
//! of the table name (cut on a character boundary) and a hash of the whole table
//! name before the suffix: at most 63 bytes, the same on every run, and different
//! for tables whose names share a long start. A name that fits is unchanged, so
//! `IF NOT EXISTS` still finds the indexes that earlier versions created.
//!
//! Table names come from the config and may need quoting (capitals, `-`, spaces,
//! anything but `"`), so an index name is written quoted — except a plain
//! lower-case one, written bare as before, so that the SQL rendered for existing
//! installations, and the checksum `outbox_relay_migrations` recorded of it, stay
//! the same byte for byte.

use crate::config::{
    OutboxConfig, TableNameError, is_plain_identifier, qualified_name, quote_ident,
};

/// The longest identifier PostgreSQL keeps, in bytes (`NAMEDATALEN - 1`).
pub const MAX_IDENTIFIER_BYTES: usize = 63;

/// Hex digits of the table-name hash in a shortened index name (32 bits).
const HASH_DIGITS: usize = 8;

/// An index the migrations create on the outbox or the poison table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Index {
    /// The outbox's partial index of unsent rows, the poller's scan (`0001`).
    OutboxUnsent,
    /// The poison table's index on `idempotency_key` (`0002`).
    PoisonKey,
    /// The poison table's unique index of event occurrences, which de-duplicates
    /// poisoned events (`0008`).
    PoisonOccurrence,
    /// The poison table's index of a parked key's rows in order (`0009`).
    PoisonKeyOrder,
}

impl Index {
    /// Every index, in the order the migrations create them.
    pub const ALL: [Index; 4] = [
        Index::OutboxUnsent,
        Index::PoisonKey,
        Index::PoisonOccurrence,
        Index::PoisonKeyOrder,
    ];

    /// Its `{{placeholder}}` in the migrations.
    #[must_use]
    pub const fn placeholder(self) -> &'static str {
        match self {
            Index::OutboxUnsent => "outbox_unsent_idx",
            Index::PoisonKey => "poison_key_idx",
            Index::PoisonOccurrence => "poison_occurrence_key",
            Index::PoisonKeyOrder => "poison_key_order_idx",
        }
    }

    /// What follows the table name in its name.
    #[must_use]
    pub const fn suffix(self) -> &'static str {
        match self {
            Index::OutboxUnsent => "unsent_idx",
            Index::PoisonKey => "key_idx",
            Index::PoisonOccurrence => "occurrence_key",
            Index::PoisonKeyOrder => "key_order_idx",
        }
    }

    /// The configured table (`schema.table`) it indexes.
    #[must_use]
    pub fn table(self, outbox: &OutboxConfig) -> &str {
        match self {
            Index::OutboxUnsent => &outbox.table,
            _ => &outbox.poison_table,
        }
    }

    /// Its name for this config, unquoted (see [`index_name`]).
    ///
    /// # Errors
    ///
    /// The configured table name is not `schema.table`.
    pub fn name(self, outbox: &OutboxConfig) -> Result<String, TableNameError> {
        let (_, table) = qualified_name(self.table(outbox))?;
        Ok(index_name(&table, self.suffix()))
    }

    /// Its name as versions before this module wrote it into the migrations:
    /// `<table>_<suffix>`, bare. Only to recognise the checksums they recorded.
    ///
    /// # Errors
    ///
    /// The configured table name is not `schema.table`.
    pub fn legacy_sql(self, outbox: &OutboxConfig) -> Result<String, TableNameError> {
        let (_, table) = qualified_name(self.table(outbox))?;
        Ok(format!("{table}_{}", self.suffix()))
    }

    /// The name PostgreSQL gave the index from [`Index::legacy_sql`]: ASCII
    /// capitals folded (it was not quoted), cut to 63 bytes. An installation
    /// migrated by those versions may have the index under this name.
    ///
    /// # Errors
    ///
    /// The configured table name is not `schema.table`.
    pub fn legacy_name(self, outbox: &OutboxConfig) -> Result<String, TableNameError> {
        let folded = self.legacy_sql(outbox)?.to_ascii_lowercase();
        Ok(prefix_within(&folded, MAX_IDENTIFIER_BYTES).to_owned())
    }
}

/// The name of the index `suffix` of table `table` (its bare name, no schema):
/// `<table>_<suffix>` when that fits in [`MAX_IDENTIFIER_BYTES`], else the start of
/// `table`, a hash of all of it, and the suffix — `<start>_<hash>_<suffix>`, exactly
/// 63 bytes or a few less where a character boundary falls (module doc).
#[must_use]
pub fn index_name(table: &str, suffix: &str) -> String {
    let whole = format!("{table}_{suffix}");
    if whole.len() <= MAX_IDENTIFIER_BYTES {
        return whole;
    }
    let room = MAX_IDENTIFIER_BYTES.saturating_sub(suffix.len() + HASH_DIGITS + 2);
    format!(
        "{}_{}_{suffix}",
        prefix_within(table, room),
        table_hash(table)
    )
}

/// `name` as SQL text: bare when PostgreSQL reads it unchanged (lower-case ASCII,
/// digits, `_`, at most 63 bytes; an index name ends in its suffix, so it is never
/// a keyword), else quoted.
#[must_use]
pub fn sql_name(name: &str) -> String {
    if is_plain_identifier(name) {
        name.to_owned()
    } else {
        quote_ident(name)
    }
}

/// The longest start of `s` of at most `max` bytes that ends on a character boundary.
fn prefix_within(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// [`HASH_DIGITS`] hex digits of FNV-1a over the whole table name: stable across
/// runs, builds and platforms (unlike `std`'s hasher).
fn table_hash(table: &str) -> String {
    format!("{:08x}", super::fnv1a(table.as_bytes()) >> 32)
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::test_config as cfg;

    fn all_names(table: &str) -> Vec<String> {
        Index::ALL
            .iter()
            .map(|i| index_name(table, i.suffix()))
            .collect()
    }

    #[test]
    fn a_name_that_fits_is_table_then_suffix() {
        assert_eq!(index_name("outbox", "unsent_idx"), "outbox_unsent_idx");
        assert_eq!(
            index_name("Order-Events", "occurrence_key"),
            "Order-Events_occurrence_key"
        );
    }

    #[test]
    fn exactly_63_bytes_is_kept_and_64_is_shortened() {
        let suffix = "key_idx";
        let fits = "t".repeat(MAX_IDENTIFIER_BYTES - suffix.len() - 1);
        assert_eq!(index_name(&fits, suffix), format!("{fits}_{suffix}"));
        assert_eq!(index_name(&fits, suffix).len(), MAX_IDENTIFIER_BYTES);
        let over = format!("{fits}t");
        let name = index_name(&over, suffix);
        assert_eq!(name.len(), MAX_IDENTIFIER_BYTES, "{name}");
        assert!(name.ends_with("_key_idx"), "{name}");
        assert!(name.starts_with(&over[..40]), "{name}");
    }

    #[test]
    fn long_names_stay_within_the_limit_and_keep_their_suffix() {
        for len in [64, 70, 100, 1000] {
            let table = "x".repeat(len);
            for (index, name) in Index::ALL.iter().zip(all_names(&table)) {
                assert!(name.len() <= MAX_IDENTIFIER_BYTES, "{name}");
                assert!(name.ends_with(&format!("_{}", index.suffix())), "{name}");
            }
        }
    }

    #[test]
    fn multibyte_names_are_cut_on_a_character_boundary() {
        // 2, 3 and 4 bytes a character: every cut position is tried.
        for c in ["é", "€", "🦀"] {
            for len in 15..70 {
                let table = c.repeat(len);
                for name in all_names(&table) {
                    assert!(name.len() <= MAX_IDENTIFIER_BYTES, "{name}");
                    // A &str is valid UTF-8; the start is whole characters of the table.
                    let start = name.split('_').next().unwrap_or_default();
                    assert!(table.starts_with(start), "{name}");
                }
            }
        }
    }

    #[test]
    fn the_hash_is_stable() {
        // Index names are recorded in databases: they must never change.
        let table = format!("{:x<63}", "outbox_relay_events_");
        assert_eq!(
            index_name(&table, "occurrence_key"),
            "outbox_relay_events_xxxxxxxxxxxxxxxxxxx_b5168c44_occurrence_key"
        );
        assert_eq!(table_hash(""), "cbf29ce4");
    }

    #[test]
    fn every_index_of_a_long_table_has_its_own_name() {
        for table in [
            "y".repeat(55),
            "y".repeat(62),
            "y".repeat(63),
            "ü".repeat(40),
        ] {
            let mut names = all_names(&table);
            names.sort();
            names.dedup();
            assert_eq!(names.len(), Index::ALL.len(), "{names:?}");
            assert!(!names.contains(&table), "an index named like its table");
        }
    }

    #[test]
    fn tables_sharing_a_long_start_get_different_names() {
        let shared = "s".repeat(60);
        for index in Index::ALL {
            let a = index_name(&format!("{shared}out"), index.suffix());
            let b = index_name(&format!("{shared}poi"), index.suffix());
            assert_ne!(a, b);
        }
    }

    #[test]
    fn only_plain_names_are_written_bare() {
        assert_eq!(sql_name("outbox_unsent_idx"), "outbox_unsent_idx");
        assert_eq!(sql_name("Outbox_unsent_idx"), "\"Outbox_unsent_idx\"");
        assert_eq!(
            sql_name("x; DROP TABLE t; --_key_idx"),
            "\"x; DROP TABLE t; --_key_idx\""
        );
    }

    #[test]
    fn names_follow_the_configured_tables() {
        let c = cfg("[outbox]\ntable = \"app.Events\"\npoison_table = \"app.bad-events\"\n");
        let names: Vec<String> = Index::ALL
            .iter()
            .map(|i| i.name(&c.outbox).unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "Events_unsent_idx",
                "bad-events_key_idx",
                "bad-events_occurrence_key",
                "bad-events_key_order_idx"
            ]
        );
        assert_eq!(
            Index::OutboxUnsent.legacy_name(&c.outbox).unwrap(),
            "events_unsent_idx"
        );
        let long = cfg(&format!(
            "[outbox]\npoison_table = \"{}\"\n",
            "P".repeat(60)
        ));
        assert_eq!(
            Index::PoisonOccurrence.legacy_name(&long.outbox).unwrap(),
            format!("{}_oc", "p".repeat(60))
        );
    }
}
