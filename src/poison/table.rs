//! The `poison_outbox` table's contract: what one row holds and the one statement
//! that writes it.
//!
//! Three writers share this contract and must agree byte for byte, because `replay`
//! and operators read the rows back whoever wrote them: the CDC relay's writer task
//! (`writer.rs`), the poller (inside its batch transaction) and a cutover (inside its
//! marking transaction). So the row type, the `INSERT` and the value conversions live
//! here, apart from any connection handling.
//!
//! # Recorded once per occurrence
//!
//! After a crash between the poison commit and the slot confirmation, the relay sees
//! the event again, fails it again, and must not record it twice; but two different
//! rows of one transaction are two events, whatever their idempotency keys. What
//! identifies an occurrence is the outbox row and its commit: its table, `outbox_id`
//! (the row's content hash stands in for a missing id) and `lsn`: a unique index on
//! that key (`migrations/0008_poison_dedup.sql`, `0012_poison_source.sql`) and `ON
//! CONFLICT DO NOTHING`, so an insert costs an index probe however large the table
//! is.
//!
//! # The source
//!
//! `outbox.poison_table` defaults to `public.poison_outbox` whatever the outbox, so
//! relays with outboxes of their own (and the shards of one) may share a table. Ids
//! of two outboxes can run in lockstep (two bigint sequences written together), so
//! `(outbox_id, lsn)` does not say whose row it is: every row records its source,
//! the outbox table (`source_table`, `schema.table`, part of the occurrence) and the
//! slot of the relay that read it (`source_slot`; none for the poller; not part of
//! the occurrence, which is the same whichever slot reads the row). Without it, a
//! second relay's insert was taken for a repeat of the first's row and dropped, and
//! after a restart its deliverable event was skipped as poisoned (`recorded.rs`).
//!
//! # An insert that cannot fail because of content
//!
//! A poison insert that fails is retried, and while it fails the slot cannot confirm
//! past the event: WAL piles up until the disk is full. So nothing in the statement
//! may depend on the content being well-formed:
//!
//! * jsonb and timestamptz casts go through `outbox_relay_try_jsonb` /
//!   `outbox_relay_try_timestamptz`, which return NULL instead of failing; headers
//!   and `row_data` that jsonb refuses (not JSON, a `\u0000`) are kept as text in
//!   `headers_text` / `row_data_text`;
//! * a value longer than the copy limit (`relay.poison_copy_limit_bytes`: payload,
//!   headers, `row_data`, error) is cut to its first bytes, and identifiers to
//!   [`IDENTIFIER_LIMIT`] (btree indexes refuse entries above 2704 bytes); the row is
//!   marked `truncated` and keeps the size and sha256 of the whole `row_data` text.
//!   The original stays in the outbox; `replay` reads it there;
//! * a NUL character, which PostgreSQL text cannot hold, becomes U+FFFD (and the row
//!   is marked `truncated`: its copy is not exact).
//!
//! # One statement for many rows
//!
//! The statement takes one array per column (`unnest`), so a batch of rows costs one
//! round trip: the CDC writer inserts whatever is queued at once, which keeps mass
//! poisoning within a small factor of delivery (2.2–2.9× on the 2-core test machine:
//! a row, its index entries and WAL cost more than a record on the broker, and each
//! guarded cast above enters a plpgsql exception block).
//!
//! Rows are never deleted (a trigger refuses it).

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::config::{OutboxConfig, qualified_name, quote_ident, quote_qualified};
use crate::lsn::Lsn;
use crate::outbox::PoisonFields;

/// Longest identifier stored (ids, keys, types, topic): below the 2704 bytes a btree
/// entry may hold, so neither the occurrence index nor the one on `idempotency_key`
/// refuses a row (the migration's index predicate names the same number).
pub(crate) const IDENTIFIER_LIMIT: usize = 2048;

/// One `poison_outbox` row: the outbox row as it was, and why it failed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct PoisonRow {
    /// The original data (see [`PoisonFields`]).
    pub(crate) fields: PoisonFields,
    pub(crate) error: String,
    pub(crate) error_kind: String,
    pub(crate) attempts: i32,
    /// Commit LSN of the transaction that inserted the row (`None` outside CDC).
    pub(crate) lsn: Option<Lsn>,
    /// The row's place among its transaction's outbox rows (`None` outside CDC).
    pub(crate) tx_position: Option<u32>,
    /// What the row means for its key under `relay.on_poison = "park-key"`.
    pub(crate) parking: Parking,
}

/// A poison row's part in parking its key (`relay.on_poison = "park-key"`, see
/// `parking.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Parking {
    /// An event poisoned without parking its key.
    #[default]
    None,
    /// A poisoned event that parks its key: the later events of the key are parked
    /// until `replay` delivers it.
    HoldsKey,
    /// A deliverable event held back because its key is parked.
    Parked,
}

impl PoisonRow {
    /// About the bytes this row adds to an insert statement (its longest values
    /// count twice: once as themselves, once inside `row_data`), without building
    /// the stored form.
    #[must_use]
    pub(crate) fn approximate_size(&self) -> usize {
        let f = &self.fields;
        let len = |v: &Option<String>| v.as_ref().map_or(0, String::len);
        let columns: usize = f
            .columns
            .iter()
            .map(|(name, value)| name.len() + len(value))
            .sum();
        len(&f.payload) + len(&f.headers) + columns + self.error.len()
    }
}

/// The outbox table as a poison row's `source_table` records it: `schema.table`,
/// unquoted (a config may say just `table`).
#[must_use]
pub(crate) fn source_table(outbox: &OutboxConfig) -> String {
    qualified_name(&outbox.table).map_or_else(
        |_| outbox.table.clone(),
        |(schema, table)| format!("{schema}.{table}"),
    )
}

/// `value` as an SQL string literal.
fn literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// The `INSERT` of a batch of [`PoisonRow`]s into `outbox.poison_table` (parameters:
/// one array per column, see [`insert_rows`]), each row recorded as read from
/// `outbox` through `slot` (`None`: the poller). A row whose occurrence is already
/// recorded is skipped (`ON CONFLICT DO NOTHING`, see the module doc).
#[must_use]
pub(crate) fn insert_statement(outbox: &OutboxConfig, slot: Option<&str>) -> String {
    let source_table = literal(&source_table(outbox));
    let source_slot = slot.map_or_else(|| "NULL".to_owned(), literal);
    let table = quote_qualified(&outbox.poison_table);
    // The migrations create the helper functions in the outbox table's schema; a
    // validated config always has one.
    let schema = qualified_name(&outbox.table).map_or_else(
        |_| quote_ident("public"),
        |(schema, _)| quote_ident(&schema),
    );
    format!(
        "INSERT INTO {table} (outbox_id, idempotency_key, aggregate_type, aggregate_id,
             event_type, topic, headers, headers_text, payload, created_at, row_data,
             row_data_text, row_bytes, row_sha256, truncated, error, error_kind, attempts,
             lsn, tx_position, parked, holds_key, source_table, source_slot)
         SELECT r.outbox_id, r.idempotency_key, r.aggregate_type, r.aggregate_id,
                r.event_type, r.topic, c.headers,
                CASE WHEN c.headers IS NULL THEN r.headers END,
                r.payload, {schema}.outbox_relay_try_timestamptz(r.created_at), c.row_data,
                CASE WHEN c.row_data IS NULL THEN r.row_data END,
                r.row_bytes, r.row_sha256, r.truncated, r.error, r.error_kind, r.attempts,
                r.lsn::pg_lsn, r.tx_position, r.parked, r.holds_key,
                {source_table}::text, {source_slot}::text
         FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
                     $6::text[], $7::text[], $8::bool[], $9::text[], $10::text[],
                     $11::text[], $12::bool[], $13::int8[], $14::text[], $15::bool[],
                     $16::text[], $17::text[], $18::int4[], $19::text[], $20::int4[],
                     $21::bool[], $22::bool[])
              AS r(outbox_id, idempotency_key, aggregate_type, aggregate_id, event_type,
                   topic, headers, headers_cut, payload, created_at, row_data,
                   row_data_cut, row_bytes, row_sha256, truncated, error, error_kind,
                   attempts, lsn, tx_position, parked, holds_key),
              LATERAL (SELECT
                  CASE WHEN NOT r.headers_cut THEN {schema}.outbox_relay_try_jsonb(r.headers) END
                      AS headers,
                  CASE WHEN NOT r.row_data_cut THEN {schema}.outbox_relay_try_jsonb(r.row_data) END
                      AS row_data) AS c
         ON CONFLICT DO NOTHING"
    )
}

/// One row's values as stored: cut to their limits, without NUL characters, with
/// the size and hash of the whole row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredRow<'a> {
    pub(crate) outbox_id: Option<Cow<'a, str>>,
    pub(crate) idempotency_key: Option<Cow<'a, str>>,
    pub(crate) aggregate_type: Option<Cow<'a, str>>,
    pub(crate) aggregate_id: Option<Cow<'a, str>>,
    pub(crate) event_type: Option<Cow<'a, str>>,
    pub(crate) topic: Option<Cow<'a, str>>,
    pub(crate) headers: Option<Cow<'a, str>>,
    /// `headers` holds only the first bytes: store it as text, never as jsonb.
    pub(crate) headers_cut: bool,
    pub(crate) payload: Option<Cow<'a, str>>,
    pub(crate) created_at: Option<Cow<'a, str>>,
    /// Every column by name, as JSON text (cut when `row_data_cut`).
    pub(crate) row_data: String,
    pub(crate) row_data_cut: bool,
    /// Size and sha256 (hex) of the whole `row_data` text.
    pub(crate) row_bytes: i64,
    pub(crate) row_sha256: String,
    /// Some value is not stored exactly as it was (cut, or a NUL replaced).
    pub(crate) truncated: bool,
    pub(crate) error: Cow<'a, str>,
    pub(crate) lsn: Option<String>,
}

/// What a poisoned message keeps of each value (see [`StoredRow::new`]): 128 MiB,
/// so that payload and `row_data` together stay far below PostgreSQL's 1 GiB
/// message limit and `row_data` below jsonb's 255 MiB.
pub(crate) const MESSAGE_COPY_LIMIT: usize = 128 * 1024 * 1024;

impl<'a> StoredRow<'a> {
    /// The stored form of `row` with values cut to `copy_limit` bytes (identifiers to
    /// [`IDENTIFIER_LIMIT`] or `copy_limit`, the smaller).
    #[must_use]
    pub(crate) fn new(row: &'a PoisonRow, copy_limit: usize) -> StoredRow<'a> {
        let f = &row.fields;
        // A message of the message outbox has no row to go back to: it is kept whole
        // up to a limit far above the default one (but under jsonb's 255 MiB, so
        // the insert cannot fail forever). An identifier cut for the index marks
        // the row truncated as for a row: replay builds the record from the stored
        // columns, so it refuses such a row rather than publish a cut key (the
        // whole value stays in row_data, for a person to read).
        let copy_limit = if f.is_message() {
            copy_limit.max(MESSAGE_COPY_LIMIT)
        } else {
            copy_limit
        };
        let id_limit = IDENTIFIER_LIMIT.min(copy_limit);
        let mut truncated = false;
        let mut keep = |value: &'a Option<String>, limit: usize| {
            value.as_deref().map(|v| {
                let (stored, exact) = storable(v, limit);
                truncated |= !exact;
                stored
            })
        };
        let outbox_id = keep(&f.outbox_id, id_limit);
        let idempotency_key = keep(&f.idempotency_key, id_limit);
        let aggregate_type = keep(&f.aggregate_type, id_limit);
        let aggregate_id = keep(&f.aggregate_id, id_limit);
        let event_type = keep(&f.event_type, id_limit);
        let topic = keep(&f.topic, id_limit);
        let payload = keep(&f.payload, copy_limit);
        let created_at = keep(&f.created_at, id_limit);
        let headers_cut = f.headers.as_ref().is_some_and(|h| h.len() > copy_limit);
        let headers = keep(&f.headers, copy_limit);
        let (error, exact) = storable(&row.error, copy_limit);
        truncated |= !exact;
        // serde_json escapes control characters, so the text holds no NUL.
        let full = row_data_json(&f.columns);
        let row_bytes = i64::try_from(full.len()).unwrap_or(i64::MAX);
        let row_sha256 = sha256_hex(full.as_bytes());
        let row_data_cut = full.len() > copy_limit;
        let row_data = if row_data_cut {
            truncated = true;
            cut(&full, copy_limit).to_owned()
        } else {
            full
        };
        StoredRow {
            outbox_id,
            idempotency_key,
            aggregate_type,
            aggregate_id,
            event_type,
            topic,
            headers,
            headers_cut,
            payload,
            created_at,
            row_data,
            row_data_cut,
            row_bytes,
            row_sha256,
            truncated,
            error,
            lsn: row.lsn.map(|l| l.to_string()),
        }
    }
}

/// Rows in the statement's parameter form: one array per column, owned, so a batch
/// can be prepared on one task while another inserts the previous one.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct PoisonBatch {
    outbox_id: Vec<Option<String>>,
    idempotency_key: Vec<Option<String>>,
    aggregate_type: Vec<Option<String>>,
    aggregate_id: Vec<Option<String>>,
    event_type: Vec<Option<String>>,
    topic: Vec<Option<String>>,
    headers: Vec<Option<String>>,
    headers_cut: Vec<bool>,
    payload: Vec<Option<String>>,
    created_at: Vec<Option<String>>,
    row_data: Vec<String>,
    row_data_cut: Vec<bool>,
    row_bytes: Vec<i64>,
    row_sha256: Vec<String>,
    truncated: Vec<bool>,
    error: Vec<String>,
    error_kind: Vec<String>,
    attempts: Vec<i32>,
    lsn: Vec<Option<String>>,
    tx_position: Vec<Option<i32>>,
    parked: Vec<bool>,
    holds_key: Vec<bool>,
}

impl PoisonBatch {
    /// The stored form of `rows`, values cut to `copy_limit` bytes.
    #[must_use]
    pub(crate) fn new<'r>(
        rows: impl IntoIterator<Item = &'r PoisonRow>,
        copy_limit: usize,
    ) -> PoisonBatch {
        let mut batch = PoisonBatch::default();
        for row in rows {
            batch.push(row, copy_limit);
        }
        batch
    }

    fn push(&mut self, row: &PoisonRow, copy_limit: usize) {
        let s = StoredRow::new(row, copy_limit);
        let owned = |v: Option<Cow<'_, str>>| v.map(Cow::into_owned);
        self.outbox_id.push(owned(s.outbox_id));
        self.idempotency_key.push(owned(s.idempotency_key));
        self.aggregate_type.push(owned(s.aggregate_type));
        self.aggregate_id.push(owned(s.aggregate_id));
        self.event_type.push(owned(s.event_type));
        self.topic.push(owned(s.topic));
        self.headers.push(owned(s.headers));
        self.headers_cut.push(s.headers_cut);
        self.payload.push(owned(s.payload));
        self.created_at.push(owned(s.created_at));
        self.row_data.push(s.row_data);
        self.row_data_cut.push(s.row_data_cut);
        self.row_bytes.push(s.row_bytes);
        self.row_sha256.push(s.row_sha256);
        self.truncated.push(s.truncated);
        self.error.push(s.error.into_owned());
        self.error_kind
            .push(storable(&row.error_kind, IDENTIFIER_LIMIT).0.into_owned());
        self.attempts.push(row.attempts);
        self.lsn.push(s.lsn);
        self.tx_position.push(
            row.tx_position
                .map(|p| i32::try_from(p).unwrap_or(i32::MAX)),
        );
        self.parked.push(row.parking == Parking::Parked);
        self.holds_key.push(row.parking == Parking::HoldsKey);
    }

    /// Rows in the batch.
    #[must_use]
    pub(crate) fn len(&self) -> usize {
        self.attempts.len()
    }
}

/// Runs [`insert_statement`] (text or prepared) for `batch` on a client or inside a
/// transaction; returns the rows inserted (fewer than the batch's when some were
/// already recorded).
pub(crate) async fn insert_batch<C, T>(
    client: &C,
    statement: &T,
    batch: &PoisonBatch,
) -> Result<u64, tokio_postgres::Error>
where
    C: tokio_postgres::GenericClient + Sync,
    T: ?Sized + tokio_postgres::ToStatement + Sync + Send,
{
    if batch.len() == 0 {
        return Ok(0);
    }
    let b = batch;
    client
        .execute(
            statement,
            &[
                &b.outbox_id,
                &b.idempotency_key,
                &b.aggregate_type,
                &b.aggregate_id,
                &b.event_type,
                &b.topic,
                &b.headers,
                &b.headers_cut,
                &b.payload,
                &b.created_at,
                &b.row_data,
                &b.row_data_cut,
                &b.row_bytes,
                &b.row_sha256,
                &b.truncated,
                &b.error,
                &b.error_kind,
                &b.attempts,
                &b.lsn,
                &b.tx_position,
                &b.parked,
                &b.holds_key,
            ],
        )
        .await
}

/// [`insert_batch`] for `rows`, values cut to `copy_limit` bytes.
pub(crate) async fn insert_rows<C, T>(
    client: &C,
    statement: &T,
    rows: &[&PoisonRow],
    copy_limit: usize,
) -> Result<u64, tokio_postgres::Error>
where
    C: tokio_postgres::GenericClient + Sync,
    T: ?Sized + tokio_postgres::ToStatement + Sync + Send,
{
    let batch = PoisonBatch::new(rows.iter().copied(), copy_limit);
    insert_batch(client, statement, &batch).await
}

/// `row_data`: the columns by name as a JSON object (NULL for a NULL value), keys
/// sorted and the last of a repeated name kept, exactly as `serde_json` writes a map.
/// Written by hand because it runs for every poisoned event, and the generic
/// serializer costs more than the rest of the insert in an unoptimised build.
fn row_data_json(columns: &[(String, Option<String>)]) -> String {
    let map: BTreeMap<&str, Option<&str>> = columns
        .iter()
        .map(|(name, value)| (name.as_str(), value.as_deref()))
        .collect();
    let size: usize = map
        .iter()
        .map(|(name, value)| name.len() + value.map_or(4, str::len) + 6)
        .sum();
    let mut out = String::with_capacity(size + 2);
    out.push('{');
    for (i, (name, value)) in map.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_json_string(&mut out, name);
        out.push(':');
        match value {
            Some(value) => push_json_string(&mut out, value),
            None => out.push_str("null"),
        }
    }
    out.push('}');
    out
}

/// Appends `s` as a JSON string with `serde_json`'s escapes.
fn push_json_string(out: &mut String, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push('"');
    let bytes = s.as_bytes();
    let mut start = 0;
    // An index loop, not an iterator chain: this runs per byte, also in test builds.
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        i += 1;
        let escape = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0x08 => "\\b",
            0x0c => "\\f",
            0..=0x1f => "",
            _ => continue,
        };
        // `b` is ASCII, so it starts and ends a character.
        out.push_str(&s[start..i - 1]);
        if escape.is_empty() {
            out.push_str("\\u00");
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        } else {
            out.push_str(escape);
        }
        start = i;
    }
    out.push_str(&s[start..]);
    out.push('"');
}

/// `value` as PostgreSQL text can hold it: at most `limit` bytes (cut on a character
/// boundary), NUL replaced by U+FFFD. The flag says whether it is unchanged.
fn storable(value: &str, limit: usize) -> (Cow<'_, str>, bool) {
    let kept = cut(value, limit);
    let exact = kept.len() == value.len();
    if kept.contains('\0') {
        (Cow::Owned(kept.replace('\0', "\u{fffd}")), false)
    } else {
        (Cow::Borrowed(kept), exact)
    }
}

/// The longest prefix of `value` of at most `limit` bytes that ends on a character
/// boundary.
fn cut(value: &str, limit: usize) -> &str {
    if value.len() <= limit {
        return value;
    }
    let mut end = limit;
    while !value.is_char_boundary(end) {
        end -= 1;
    }
    &value[..end]
}

/// Lowercase hex sha256 of `bytes`.
fn sha256_hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = String::with_capacity(64);
    for b in digest.as_ref() {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0xf)]));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(payload: &str) -> PoisonRow {
        PoisonRow {
            fields: PoisonFields {
                outbox_id: Some("id-1".into()),
                idempotency_key: Some("key-1".into()),
                headers: Some(r#"{"h":"\u0000"}"#.into()),
                payload: Some(payload.into()),
                columns: vec![
                    ("id".into(), Some("id-1".into())),
                    ("payload".into(), Some(payload.into())),
                    ("topic".into(), None),
                ],
                ..PoisonFields::default()
            },
            error: "too large".into(),
            error_kind: "message_size_too_large".into(),
            attempts: 5,
            lsn: Some(Lsn::from(0x16_0000)),
            ..PoisonRow::default()
        }
    }

    #[test]
    fn values_within_the_limit_are_stored_exactly() {
        let r = row(r#"{"a":1}"#);
        let s = StoredRow::new(&r, 1024);
        assert!(!s.truncated && !s.headers_cut && !s.row_data_cut);
        assert_eq!(s.payload.as_deref(), Some(r#"{"a":1}"#));
        // Headers jsonb would refuse are passed on as they are: the statement's
        // try-cast decides, and the text column keeps them.
        assert_eq!(s.headers.as_deref(), Some(r#"{"h":"\u0000"}"#));
        assert_eq!(
            s.row_data,
            r#"{"id":"id-1","payload":"{\"a\":1}","topic":null}"#
        );
        assert_eq!(s.row_bytes, i64::try_from(s.row_data.len()).unwrap());
        assert_eq!(s.row_sha256, sha256_hex(s.row_data.as_bytes()));
        assert_eq!(s.lsn.as_deref(), Some("0/160000"));
    }

    #[test]
    fn values_over_the_limit_are_cut_with_the_size_and_hash_of_the_whole_row() {
        let big = format!(r#"{{"blob":"{}"}}"#, "é".repeat(2000));
        let r = row(&big);
        let whole = row_data_json(&r.fields.columns);
        // `{"blob":"` is 9 bytes, then 2-byte characters: 1026 falls inside one.
        let s = StoredRow::new(&r, 1026);
        assert!(s.truncated && s.row_data_cut && !s.headers_cut);
        let payload = s.payload.as_deref().unwrap();
        assert!(big.starts_with(payload), "a prefix");
        assert_eq!(payload.len(), 1025, "cut on a character boundary");
        assert!(whole.starts_with(&s.row_data) && s.row_data.len() <= 1026);
        assert_eq!(s.row_bytes, i64::try_from(whole.len()).unwrap());
        assert_eq!(s.row_sha256, sha256_hex(whole.as_bytes()));
    }

    #[test]
    fn headers_over_the_limit_are_cut_and_kept_as_text() {
        let mut r = row("{}");
        r.fields.headers = Some(format!(r#"{{"h":"{}"}}"#, "x".repeat(5000)));
        let s = StoredRow::new(&r, 1024);
        assert!(s.headers_cut && s.truncated);
        assert_eq!(s.headers.as_deref().map(str::len), Some(1024));
    }

    #[test]
    fn identifiers_are_cut_below_the_btree_entry_limit() {
        let mut r = row("{}");
        r.fields.idempotency_key = Some("k".repeat(10_000));
        let s = StoredRow::new(&r, 1 << 20);
        assert_eq!(
            s.idempotency_key.as_deref().map(str::len),
            Some(IDENTIFIER_LIMIT)
        );
        assert!(s.truncated);
    }

    #[test]
    fn nul_characters_are_replaced() {
        let mut r = row("a\0b");
        r.error = "bad\0".into();
        let s = StoredRow::new(&r, 1024);
        assert_eq!(s.payload.as_deref(), Some("a\u{fffd}b"));
        assert_eq!(s.error, "bad\u{fffd}");
        assert!(s.truncated);
        assert!(!s.row_data.contains('\0'), "row_data escapes it");
    }

    #[test]
    fn row_data_is_the_json_serde_writes() {
        let columns = vec![
            (
                "z".to_owned(),
                Some("quote \" backslash \\ nl \n tab \t cr \r".to_owned()),
            ),
            (
                "a".to_owned(),
                Some("ctl \u{1} \u{8} \u{c} \u{1f} nul \0 é ✓".to_owned()),
            ),
            ("m".to_owned(), None),
            ("a".to_owned(), Some("last wins".to_owned())),
            (
                "payload".to_owned(),
                Some(r#"{"k": [1, 2.5, "x"]}"#.to_owned()),
            ),
        ];
        let expected: serde_json::Map<String, serde_json::Value> = columns
            .iter()
            .map(|(n, v)| {
                (
                    n.clone(),
                    v.clone()
                        .map_or(serde_json::Value::Null, serde_json::Value::String),
                )
            })
            .collect();
        assert_eq!(
            row_data_json(&columns),
            serde_json::Value::Object(expected).to_string()
        );
        assert_eq!(row_data_json(&[]), "{}");
        let escaped = row_data_json(&[("c".into(), Some("\u{1}\0".into()))]);
        assert_eq!(escaped, r#"{"c":"\u0001\u0000"}"#);
    }

    #[test]
    fn sha256_is_the_standard_digest() {
        assert_eq!(
            sha256_hex(b"abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn statement_targets_the_configured_tables() {
        let outbox = OutboxConfig {
            table: "app.events".into(),
            poison_table: "ops.dead_letters".into(),
            ..OutboxConfig::default()
        };
        let sql = insert_statement(&outbox, Some("relay_slot"));
        assert!(
            sql.contains("INSERT INTO \"ops\".\"dead_letters\""),
            "{sql}"
        );
        assert!(sql.contains("\"app\".outbox_relay_try_jsonb("), "{sql}");
        assert!(sql.contains("ON CONFLICT DO NOTHING"), "{sql}");
        assert!(!sql.contains("NOT EXISTS"), "{sql}");
        assert!(
            sql.contains("'app.events'::text, 'relay_slot'::text"),
            "{sql}"
        );
        // The poller reads no slot.
        let sql = insert_statement(&outbox, None);
        assert!(sql.contains("'app.events'::text, NULL::text"), "{sql}");
    }

    #[test]
    fn the_source_table_is_schema_qualified_and_unquoted() {
        let outbox = |table: &str| OutboxConfig {
            table: table.into(),
            ..OutboxConfig::default()
        };
        assert_eq!(source_table(&outbox("outbox")), "public.outbox");
        assert_eq!(
            source_table(&outbox("App.Order-Events")),
            "App.Order-Events"
        );
        assert_eq!(literal("it's"), "'it''s'");
    }
}
