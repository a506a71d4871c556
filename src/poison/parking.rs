//! Parked keys (`relay.on_poison = "park-key"`): the protocol between the relay,
//! which parks, and `replay`, which releases.
//!
//! # Why park
//!
//! Poisoning an event and delivering the later events of its entity (`skip`) breaks
//! per-key order for good: when the poisoned event is replayed, consumers see it
//! after events that depended on it. Stopping everything (`halt`) keeps order but
//! holds every other entity hostage. Parking holds back only the poisoned entity —
//! its record key within its topic — and lets the others flow.
//!
//! # Why durable, and why in the poison table
//!
//! The relay must confirm the slot past a parked event, or WAL piles up for as long
//! as the key waits for an operator, and a restart must not forget that the key is
//! parked. So a parked event is written to the poison table like a poisoned one, with
//! `parked = true`; the key is a row of `outbox_relay_parked_key`, inserted in the
//! same transaction as the poisoned row that parks it (`holds_key = true`). Both are
//! committed before the slot confirms past the events, as for any poisoned event.
//!
//! # Parking and releasing cannot interleave badly
//!
//! The writer parks an event in a transaction that first takes its key's row `FOR
//! SHARE` and finds it not released ([`WriterStatements`]); `replay` releases a key
//! ([`release_key`]) in a transaction that takes the same row `FOR UPDATE`, checks
//! that no unreplayed row of the key is left, and only then sets `released_at`. So
//! each parked event is either committed before the release — and `replay` sees it
//! and delivers it first — or waits for the release to commit, sees the key released,
//! is not written, and is produced by the relay itself ([`Parked::Released`]), after
//! everything `replay` delivered.
//!
//! # Order
//!
//! `replay` delivers a key's rows by commit LSN, then `tx_position` (the row's place
//! in its transaction), then `poison_id`: the order the relay read them, whatever
//! order the writer committed them in.
//!
//! # Limits
//!
//! * Events of the key the producer already had in flight when the poisoned one
//!   failed are delivered, not parked (the per-key limit of `cdc::progress`).
//! * A row that cannot be mapped has no record key: it is poisoned and parks nothing.
//! * A parked event whose insert failed (database unreachable) and that is retried
//!   after `replay` released its key is produced after the key's released events.

use std::collections::BTreeSet;

use crate::hashing::HashSet;

use tokio_postgres::{Client, GenericClient};

use super::table::{PoisonBatch, PoisonRow};
use crate::config::{OutboxConfig, qualified_name, quote_ident};
use crate::outbox::OutboxEvent;

/// `error_kind` of a parked event's row.
pub(crate) const PARKED_KIND: &str = "parked";

/// The poison row of `event`, held back because its key is parked; `tx_position`
/// is its place in its transaction (`replay` delivers a key's rows in that order).
#[must_use]
pub(crate) fn parked_row(event: &OutboxEvent, tx_position: Option<u32>) -> PoisonRow {
    PoisonRow {
        fields: event.poison_fields(),
        error: format!(
            "parked: an earlier event of key {:?} on topic {:?} is poisoned \
             (relay.on_poison = \"park-key\"); replay delivers it after that one",
            String::from_utf8_lossy(&event.key),
            event.topic
        ),
        error_kind: PARKED_KIND.to_owned(),
        attempts: 0,
        lsn: event.source_lsn,
        tx_position,
        parking: super::table::Parking::Parked,
    }
}

/// A parked key: a record key within its topic (keys are stored as text, as the
/// poison table's `aggregate_id`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct ParkedKey {
    pub(crate) topic: String,
    pub(crate) key: String,
}

impl ParkedKey {
    /// A key read as `(topic, record_key)`, the first two columns of `row`.
    ///
    /// # Errors
    ///
    /// A column that is not text.
    pub(crate) fn from_row(row: &tokio_postgres::Row) -> Result<ParkedKey, tokio_postgres::Error> {
        Ok(ParkedKey {
            topic: row.try_get(0)?,
            key: row.try_get(1)?,
        })
    }

    /// The key a poison row parks or is parked under; `None` without topic or key.
    fn of(row: &PoisonRow) -> Option<ParkedKey> {
        Some(ParkedKey {
            topic: row.fields.topic.clone()?,
            key: row.fields.aggregate_id.clone()?,
        })
    }
}

/// `outbox_relay_parked_key` in the outbox table's schema, quoted.
#[must_use]
pub(crate) fn parked_key_table(outbox: &OutboxConfig) -> String {
    let schema = qualified_name(&outbox.table).map_or_else(|_| "public".to_owned(), |(s, _)| s);
    format!("{}.outbox_relay_parked_key", quote_ident(&schema))
}

/// The keys parked now.
///
/// # Errors
///
/// The query's error.
pub(crate) async fn load_parked_keys(
    client: &impl GenericClient,
    table: &str,
) -> Result<HashSet<ParkedKey>, tokio_postgres::Error> {
    let rows = client
        .query(
            &format!("SELECT topic, record_key FROM {table} WHERE released_at IS NULL"),
            &[],
        )
        .await?;
    rows.iter().map(ParkedKey::from_row).collect()
}

/// What happened to a parked event's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parked {
    /// The row is committed (parked, or poisoned).
    Recorded,
    /// Its key was released meanwhile: nothing was written; produce the event.
    Released,
}

/// The statements of a writer transaction that parks keys or events.
#[derive(Debug, Clone)]
pub(crate) struct WriterStatements {
    /// Parks keys (`$1` topics, `$2` keys); re-parks released ones.
    park: String,
    /// The keys of `$1`/`$2` still parked, locked against a concurrent release.
    still_parked: String,
}

impl WriterStatements {
    #[must_use]
    pub(crate) fn new(outbox: &OutboxConfig) -> WriterStatements {
        let table = parked_key_table(outbox);
        WriterStatements {
            park: format!(
                "INSERT INTO {table} AS k (topic, record_key)
                 SELECT * FROM unnest($1::text[], $2::text[])
                 ON CONFLICT (topic, record_key) DO UPDATE
                     SET released_at = NULL, parked_at = clock_timestamp()
                     WHERE k.released_at IS NOT NULL"
            ),
            still_parked: format!(
                "SELECT topic, record_key FROM {table}
                 WHERE (topic, record_key) IN (SELECT * FROM unnest($1::text[], $2::text[]))
                   AND released_at IS NULL
                 FOR SHARE"
            ),
        }
    }
}

/// Whether a batch needs the parking transaction rather than one plain insert.
#[must_use]
pub(crate) fn needs_parking(rows: &[&PoisonRow]) -> bool {
    rows.iter()
        .any(|r| r.parking != super::table::Parking::None)
}

/// Inserts `rows` in one transaction that parks the keys of the `HoldsKey` rows and
/// writes a `Parked` row only while its key is still parked (see the module doc).
/// One answer per row, in order.
///
/// # Errors
///
/// The first failing statement's error; nothing is committed then.
pub(crate) async fn insert_parking(
    client: &mut Client,
    statements: &WriterStatements,
    insert: &str,
    rows: &[&PoisonRow],
    copy_limit: usize,
) -> Result<Vec<Parked>, tokio_postgres::Error> {
    let tx = client.transaction().await?;
    let answers = insert_parking_in(&tx, statements, insert, rows, copy_limit).await?;
    tx.commit().await?;
    Ok(answers)
}

/// [`insert_parking`] inside a transaction the caller commits (a backlog writes its
/// marks in the same one).
///
/// # Errors
///
/// The first failing statement's error.
pub(crate) async fn insert_parking_in<T>(
    tx: &(impl GenericClient + Sync),
    statements: &WriterStatements,
    insert: &T,
    rows: &[&PoisonRow],
    copy_limit: usize,
) -> Result<Vec<Parked>, tokio_postgres::Error>
where
    T: ?Sized + tokio_postgres::ToStatement + Sync + Send,
{
    use super::table::Parking;
    let keys_of = |which: Parking| -> BTreeSet<ParkedKey> {
        rows.iter()
            .filter(|r| r.parking == which)
            .filter_map(|r| ParkedKey::of(r))
            .collect()
    };
    let parks = keys_of(Parking::HoldsKey);
    if !parks.is_empty() {
        let (topics, keys) = columns(&parks);
        tx.execute(&statements.park, &[&topics, &keys]).await?;
    }
    let wanted = keys_of(Parking::Parked);
    let mut parked: HashSet<ParkedKey> = HashSet::default();
    if !wanted.is_empty() {
        let (topics, keys) = columns(&wanted);
        for row in tx
            .query(&statements.still_parked, &[&topics, &keys])
            .await?
        {
            parked.insert(ParkedKey::from_row(&row)?);
        }
    }
    let answers: Vec<Parked> = rows
        .iter()
        .map(|r| match (r.parking, ParkedKey::of(r)) {
            (Parking::Parked, Some(key)) if !parked.contains(&key) => Parked::Released,
            _ => Parked::Recorded,
        })
        .collect();
    let kept = rows
        .iter()
        .zip(&answers)
        .filter(|(_, a)| **a == Parked::Recorded)
        .map(|(r, _)| *r);
    let batch = PoisonBatch::new(kept, copy_limit);
    super::table::insert_batch(tx, insert, &batch).await?;
    Ok(answers)
}

fn columns(keys: &BTreeSet<ParkedKey>) -> (Vec<&str>, Vec<&str>) {
    keys.iter()
        .map(|k| (k.topic.as_str(), k.key.as_str()))
        .unzip()
}

/// The order `replay` delivers a key's rows in: as the relay read them.
pub(crate) const KEY_ORDER: &str =
    "COALESCE(lsn, '0/0'::pg_lsn), COALESCE(tx_position, -1), poison_id";

/// Which rows of a key (`$1` topic, `$2` record key) are still to be delivered
/// before it can be released.
#[must_use]
pub(crate) fn unreplayed_key_rows(poison_table: &str) -> String {
    format!(
        "{poison_table} WHERE topic = $1 AND aggregate_id = $2 AND replayed_at IS NULL
           AND (parked OR holds_key) AND duplicate_of IS NULL"
    )
}

/// Releases `key` if no unreplayed row of it is left, in one transaction that
/// holds the key's row lock (see the module doc). `Ok(false)`: rows are left
/// (parked while `replay` ran); deliver them and call again.
///
/// # Errors
///
/// The statements' errors; nothing is released then.
pub(crate) async fn release_key(
    client: &Client,
    parked_key_table: &str,
    poison_table: &str,
    key: &ParkedKey,
) -> Result<bool, tokio_postgres::Error> {
    client.batch_execute("BEGIN").await?;
    let result = release_in_transaction(client, parked_key_table, poison_table, key).await;
    let end = if matches!(result, Ok(true)) {
        "COMMIT"
    } else {
        "ROLLBACK"
    };
    client.batch_execute(end).await?;
    result
}

async fn release_in_transaction(
    client: &Client,
    parked_key_table: &str,
    poison_table: &str,
    key: &ParkedKey,
) -> Result<bool, tokio_postgres::Error> {
    client
        .query_opt(
            &format!(
                "SELECT 1 FROM {parked_key_table} WHERE topic = $1 AND record_key = $2 FOR UPDATE"
            ),
            &[&key.topic, &key.key],
        )
        .await?;
    let left = client
        .query_opt(
            &format!(
                "SELECT 1 FROM {} LIMIT 1",
                unreplayed_key_rows(poison_table)
            ),
            &[&key.topic, &key.key],
        )
        .await?;
    if left.is_some() {
        return Ok(false);
    }
    client
        .execute(
            &format!(
                "UPDATE {parked_key_table} SET released_at = clock_timestamp()
                 WHERE topic = $1 AND record_key = $2 AND released_at IS NULL"
            ),
            &[&key.topic, &key.key],
        )
        .await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::poison::table::Parking;

    fn row(topic: &str, key: &str, parking: Parking) -> PoisonRow {
        let mut row = PoisonRow {
            parking,
            ..PoisonRow::default()
        };
        row.fields.topic = Some(topic.to_owned());
        row.fields.aggregate_id = Some(key.to_owned());
        row
    }

    #[test]
    fn only_batches_with_parking_rows_need_the_transaction() {
        let plain = row("t", "k", Parking::None);
        let holds = row("t", "k", Parking::HoldsKey);
        assert!(!needs_parking(&[&plain, &plain]));
        assert!(needs_parking(&[&plain, &holds]));
        assert!(needs_parking(&[&row("t", "k", Parking::Parked)]));
    }

    #[test]
    fn a_key_needs_topic_and_record_key() {
        let mut r = row("orders", "42", Parking::Parked);
        assert_eq!(
            ParkedKey::of(&r),
            Some(ParkedKey {
                topic: "orders".into(),
                key: "42".into()
            })
        );
        r.fields.topic = None;
        assert_eq!(ParkedKey::of(&r), None);
    }

    #[test]
    fn the_table_lives_in_the_outbox_schema() {
        let outbox = OutboxConfig {
            table: "app.outbox".into(),
            ..OutboxConfig::default()
        };
        assert_eq!(parked_key_table(&outbox), "\"app\".outbox_relay_parked_key");
        assert!(
            WriterStatements::new(&outbox)
                .park
                .contains("\"app\".outbox_relay_parked_key")
        );
    }

    #[test]
    fn a_key_is_blocked_by_its_unreplayed_parked_and_holding_rows() {
        let sql = unreplayed_key_rows("\"public\".\"poison_outbox\"");
        assert!(sql.contains("replayed_at IS NULL") && sql.contains("(parked OR holds_key)"));
        assert!(sql.contains("duplicate_of IS NULL"));
    }
}
