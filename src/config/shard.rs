//! Sharding the outbox across several walsenders: names and the row filter.
//!
//! # Why shards
//!
//! One relay reads, maps and produces everything one slot streams. With
//! `postgres.shards = N`, the outbox is split by a hash of the entity id into N
//! publications, each with a row filter (PostgreSQL 15, [CREATE PUBLICATION … WHERE][rf]),
//! each streamed through its own slot by its own relay process (`postgres.shard = i`),
//! so that work is spread over N processes and hosts. Every event of one entity lands
//! in the same shard, so per-key order holds; the shards progress independently.
//!
//! # The filter
//!
//! `(hashtext(coalesce((id)::text COLLATE "C", '')) & 2147483647) % N = i`, over the configured
//! entity-id column (the record key). Each part is what a row filter allows: built-in
//! immutable functions and operators, no user-defined ones. `hashtext` is the hash
//! PostgreSQL's own hash indexes use for text; `& 2147483647` drops the sign bit
//! instead of `abs()`, which fails on `-2147483648`; `coalesce` puts rows with a
//! NULL id (which the relay poisons as unmappable) into exactly one shard, where a
//! NULL filter result would publish them to none. The cast to text covers ids of type
//! text, bigint and uuid alike. `COLLATE "C"` (a built-in collation, which a row
//! filter allows) makes the hash one of the id's bytes: `hashtext` hashes a
//! *nondeterministic* collation's sort key instead (an ICU case-insensitive collation
//! on the column, say), which moves ids between shards when the ICU library is
//! upgraded and breaks per-key order. For the usual deterministic collations both
//! hash the same bytes, so publications made before keep their shards.
//!
//! # What sharding does not remove
//!
//! Every walsender still reads and decodes *all* the WAL; the row filter only drops
//! the other shards' rows after decoding, and decoding is what costs the walsender
//! its CPU (measured: about 10 µs per event for each walsender, however few of the
//! rows it sends). So N shards use N cores of the database server for the same WAL,
//! and one walsender's decode rate still bounds every shard: sharding helps when the
//! relay's side is the limit, not the decoding. See `docs/benchmarks.md`, "Sharding".
//!
//! [rf]: https://www.postgresql.org/docs/15/sql-createpublication.html

use super::quote_ident;

/// Most shards a config may ask for: each costs a replication slot, a walsender and a
/// core's worth of decoding on the database server.
pub const MAX_SHARDS: u32 = 64;

/// The name of shard `shard`'s slot or publication, from the configured base name;
/// the base name itself when the outbox is not sharded.
#[must_use]
pub fn shard_name(base: &str, shards: u32, shard: u32) -> String {
    if shards <= 1 {
        base.to_owned()
    } else {
        format!("{base}_shard{shard}")
    }
}

/// The row filter of shard `shard` of `shards` over the entity-id column `id_column`
/// (unquoted), or `None` when the outbox is not sharded.
#[must_use]
pub fn row_filter(id_column: &str, shards: u32, shard: u32) -> Option<String> {
    (shards > 1).then(|| {
        format!(
            "(hashtext(coalesce(({})::text COLLATE \"C\", '')) & 2147483647) % {shards} = {shard}",
            quote_ident(id_column)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_shard_keeps_the_configured_names_and_filters_nothing() {
        assert_eq!(shard_name("outbox_relay", 1, 0), "outbox_relay");
        assert_eq!(row_filter("aggregate_id", 1, 0), None);
    }

    #[test]
    fn shards_get_their_own_names_and_a_hash_filter() {
        assert_eq!(shard_name("outbox_relay", 4, 3), "outbox_relay_shard3");
        assert_eq!(
            row_filter("aggregateId", 4, 3).as_deref(),
            Some(
                "(hashtext(coalesce((\"aggregateId\")::text COLLATE \"C\", '')) & 2147483647) % 4 = 3"
            )
        );
    }
}
