//! The Kafka record an outbox row becomes, and what the mapper says when it cannot.
//!
//! These are the types the rest of the relay sees: [`OutboxEvent`] (one record),
//! [`Mapped`] (what an `Insert` became), [`UnmappableRow`] and [`PoisonFields`]
//! (a row for `poison_outbox`), the header names, and [`error_kind`].
//!
//! # The record contract
//!
//! | record part | source |
//! |---|---|
//! | key | `aggregate_id`, UTF-8 bytes, so every event of one entity lands on one partition, in order |
//! | topic | the row's `topic` column when non-NULL and non-empty, else `kafka.topic_template` with `{aggregate_type}` / `{event_type}` replaced by the row's values |
//! | value | `payload` exactly as PostgreSQL's text output gave it, or the JSON envelope when configured |
//! | headers | `idempotency_key` (always), `event_type`, `aggregate_type`, `occurred_at` (RFC 3339, UTC, microseconds), `source_lsn` (commit LSN `X/Y`, CDC only), then the entries of the row's `headers` JSON object, in that order |
//! | timestamp | `created_at` as Unix milliseconds (CreateTime) |
//!
//! Headers whose column is NULL (or absent) are left out, except `idempotency_key`:
//! it is the consumer's dedupe key, so it is always present — the `idempotency_key`
//! column when it exists and is non-NULL, otherwise the `id` column. `created_at`
//! is read in PostgreSQL's ISO output (the replication session runs with
//! `DateStyle=ISO`); a `timestamp without time zone` column is taken as UTC.
//!
//! # Why bad rows are poisoned instead of stopping the stream
//!
//! The stream is a single ordered queue: a row the relay cannot map (NULL or empty
//! aggregate id, a column of the wrong type, an illegal topic name, `headers` that
//! is not an object, a `created_at` that is not a finite year 1–9999 timestamp)
//! would stop every later event of every entity if it were fatal, and retrying it
//! can never succeed. So it becomes [`Mapped::Unmappable`] carrying everything a
//! `poison_outbox` row needs ([`PoisonFields`]: the mapped fields best-effort and
//! every column as text); the relay writes it to the poison table, where it is
//! visible, counted and replayable, and the stream goes on. Problems of the table
//! itself (a required column missing or of the wrong type) are detected once, when
//! the `Relation` message arrives, and then make every insert of that relation
//! unmappable with a message that names the column, its type and the expected
//! types — loud, but nothing is lost. What *is* fatal is a protocol violation
//! ([`MapError`]): an `Insert` for a relation never described in this session, or
//! with a different column count, means the decoder and server disagree, and
//! guessing would poison good rows.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

use bytes::{BufMut, Bytes};

use super::columns::{FIELD_COUNT, Field, FieldNames};
use super::timestamp::{format_rfc3339, parse_pg_timestamp};
use crate::lsn::Lsn;

/// Name of a Kafka header: borrowed for the relay's own headers, owned for the
/// entries of the row's `headers` object.
pub type HeaderName = Cow<'static, str>;

/// Header carrying the consumer's dedupe key (always present).
pub const HEADER_IDEMPOTENCY_KEY: &str = "idempotency_key";
/// Header carrying the row's `event_type`.
pub const HEADER_EVENT_TYPE: &str = "event_type";
/// Header carrying the row's `aggregate_type`.
pub const HEADER_AGGREGATE_TYPE: &str = "aggregate_type";
/// Header carrying `created_at` in RFC 3339 (UTC, microseconds).
pub const HEADER_OCCURRED_AT: &str = "occurred_at";
/// Header carrying the commit LSN (`X/Y`) of the row's transaction (CDC only).
pub const HEADER_SOURCE_LSN: &str = "source_lsn";

/// Header marking a record `republish` sent again (value: the run's id); last, after
/// the row's own headers. Never on a first delivery.
pub const HEADER_REPUBLISH: &str = "outbox_relay_republish";

/// Header names the relay sets itself; a row's `headers` object may not use them,
/// because consumers reading the last header of a name would get the row's value.
pub(super) const RESERVED_HEADERS: [&str; 5] = [
    HEADER_IDEMPOTENCY_KEY,
    HEADER_EVENT_TYPE,
    HEADER_AGGREGATE_TYPE,
    HEADER_OCCURRED_AT,
    HEADER_SOURCE_LSN,
];

/// Whether a row's `headers` object or a placement may not use `name`: the relay's
/// own headers, and [`HEADER_REPUBLISH`], which marks only records `republish` sent
/// (a first delivery carrying it would be left out by `audit` and a resync).
pub(super) fn is_reserved_header(name: &str) -> bool {
    RESERVED_HEADERS.contains(&name) || name == HEADER_REPUBLISH
}

/// Values of [`UnmappableRow::error_kind`] (the `poison_outbox.error_kind` column).
pub mod error_kind {
    /// `aggregate_id` is NULL: the record would have no key.
    pub const NULL_KEY: &str = "null_key";
    /// `aggregate_id` is the empty string.
    pub const EMPTY_KEY: &str = "empty_key";
    /// Both `idempotency_key` and `id` are NULL (or absent).
    pub const NULL_IDEMPOTENCY_KEY: &str = "null_idempotency_key";
    /// The idempotency key is the empty string.
    pub const EMPTY_IDEMPOTENCY_KEY: &str = "empty_idempotency_key";
    /// `payload` is NULL.
    pub const NULL_PAYLOAD: &str = "null_payload";
    /// A `bytea` payload whose text is malformed, or that the JSON envelope cannot
    /// embed (not UTF-8).
    pub const BAD_PAYLOAD: &str = "bad_payload";
    /// A required column is missing from the table (or from the publication).
    pub const MISSING_COLUMN: &str = "missing_column";
    /// A column has a type the mapper does not accept.
    pub const BAD_COLUMN_TYPE: &str = "bad_column_type";
    /// A value cannot be read as text (binary format of an unsupported type, or
    /// not UTF-8).
    pub const BAD_VALUE: &str = "bad_value";
    /// An INSERT carried an unchanged-TOAST marker, which it never should.
    pub const UNCHANGED_TOAST: &str = "unchanged_toast";
    /// The topic (column or rendered template) is not a legal Kafka topic name.
    pub const INVALID_TOPIC: &str = "invalid_topic";
    /// `headers` is not a JSON object, or uses a reserved header name.
    pub const BAD_HEADERS: &str = "bad_headers";
    /// `created_at` is not a finite timestamp of years 1–9999.
    pub const BAD_TIMESTAMP: &str = "bad_timestamp";
    /// A message of the message outbox whose content is not a frame the relay
    /// reads (`crate::outbox::message`); its whole content is kept.
    pub const BAD_MESSAGE: &str = "bad_message";
}

/// Why an `Insert` cannot be mapped at all: the stream itself is inconsistent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MapError {
    /// pgoutput sends a Relation message before the first change of a relation in
    /// every session; an Insert without one means messages were lost or misread.
    #[error(
        "pgoutput protocol violation: Insert for relation {relation_id} before any Relation message describing it"
    )]
    UnknownRelation {
        /// The OID the Insert referred to.
        relation_id: u32,
    },
    /// The tuple does not have the columns its Relation message announced.
    #[error(
        "pgoutput protocol violation: Insert for relation {relation_id} has {actual} columns, its Relation message described {expected}"
    )]
    ColumnCount {
        /// The relation OID.
        relation_id: u32,
        /// Columns in the Relation message.
        expected: usize,
        /// Columns in the tuple.
        actual: usize,
    },
}

/// What [`OutboxMapper::map_insert`](crate::outbox::OutboxMapper::map_insert) made of an Insert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mapped {
    /// The relation is not the outbox table (another table in the publication).
    NotOutbox,
    /// One Kafka record.
    Event(OutboxEvent),
    /// An outbox row that can never become a record; it belongs in `poison_outbox`.
    Unmappable(UnmappableRow),
}

/// How the mapper sees a relation, as returned by [`OutboxMapper::on_relation`](crate::outbox::OutboxMapper::on_relation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelationStatus<'a> {
    /// Not the configured outbox table; its inserts map to [`Mapped::NotOutbox`].
    NotOutbox,
    /// The outbox table, with every required column present and well typed.
    Outbox,
    /// The outbox table, but it cannot be mapped: every insert becomes
    /// [`Mapped::Unmappable`] with this reason until a new Relation message.
    Unmappable {
        /// One of [`error_kind`].
        error_kind: &'static str,
        /// Names the columns, their types and the expected types.
        reason: &'a str,
    },
}

/// How the `payload` value is turned into the record value.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PayloadFormat {
    /// `json`/`jsonb` text: used verbatim, spliced verbatim into the envelope.
    #[default]
    Json,
    /// Text-like column: used verbatim, embedded as a JSON string in the envelope.
    Text,
    /// `bytea` text output (`\x…` hex or escape format): decoded to the raw bytes.
    ByteaText,
    /// Raw bytes (binary-format `bytea`): used verbatim.
    Raw,
}

/// The outbox columns of one row as text (what pgoutput sends, or what
/// `SELECT col::text` returns), for [`OutboxMapper::map_row`](crate::outbox::OutboxMapper::map_row). `None` is SQL NULL
/// or a column the table does not have.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutboxRow {
    /// `id` (event id).
    pub id: Option<Bytes>,
    /// `idempotency_key`; when `None` the `id` is the key.
    pub idempotency_key: Option<Bytes>,
    /// `aggregate_type`.
    pub aggregate_type: Option<Bytes>,
    /// `aggregate_id` (the record key).
    pub aggregate_id: Option<Bytes>,
    /// `event_type`.
    pub event_type: Option<Bytes>,
    /// `topic`; when `None` or empty the template decides.
    pub topic: Option<Bytes>,
    /// `headers`, JSON text of an object.
    pub headers: Option<Bytes>,
    /// `payload`.
    pub payload: Option<Bytes>,
    /// How to read `payload`.
    pub payload_format: PayloadFormat,
    /// `created_at`, PostgreSQL ISO text (`2026-11-30 14:29:33.123456+00`).
    pub created_at: Option<Bytes>,
    /// The `outbox.additional_placement` columns, in their order (missing ones
    /// read as NULL).
    pub extra: Vec<Option<Bytes>>,
}

/// One Kafka record for one outbox row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxEvent {
    /// Record key: the `aggregate_id` bytes (a slice of the replication message).
    pub key: Bytes,
    /// Destination topic, a legal Kafka topic name.
    pub topic: String,
    /// Record value: the payload bytes as PostgreSQL gave them, or the envelope.
    pub payload: Bytes,
    /// The value is null (a tombstone: the payload was NULL and the outbox has
    /// `tombstone_on_empty_payload`); `payload` is then empty.
    pub tombstone: bool,
    /// Record headers, in contract order (see the module docs).
    pub headers: Vec<(HeaderName, Bytes)>,
    /// CreateTime in Unix milliseconds; `None` without `created_at` or before 1970
    /// (Kafka has no negative timestamps; the broker then stamps the record).
    pub timestamp_ms: Option<i64>,
    /// The dedupe key (also the first header).
    pub idempotency_key: Bytes,
    /// The `id` column, or the idempotency key when `id` is NULL or absent.
    pub event_id: Bytes,
    /// Commit LSN of the row's transaction; `None` outside CDC.
    pub source_lsn: Option<Lsn>,
    pub(super) source: EventSource,
}

/// The original column values an event keeps so that it can be poisoned with its
/// original data if the broker refuses it (all cheap `Bytes` slices).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct EventSource {
    /// The table's column names (for `row_data`).
    pub(super) names: Arc<FieldNames>,
    /// `event_id` is the `id` column (not the idempotency key standing in).
    pub(super) has_id: bool,
    /// The `headers` column text.
    pub(super) headers: Option<Bytes>,
    /// The payload before the envelope; `None` when it is the record value.
    pub(super) raw_payload: Option<Bytes>,
    /// Format of the raw payload (`Raw` once `bytea` text was decoded).
    pub(super) payload_format: PayloadFormat,
    /// `created_at` in Unix microseconds.
    pub(super) created_at_micros: Option<i64>,
    /// The `outbox.additional_placement` columns (name, value), for `row_data`.
    pub(super) extra: Vec<(Arc<str>, Option<Bytes>)>,
    /// The prefix and LSN of the message of the message outbox the event came from
    /// (`None` for a row): its poison row is marked, and stored whole.
    pub(super) message: Option<(Arc<str>, Lsn)>,
}

impl OutboxEvent {
    /// The row's `created_at` in Unix microseconds (`None` without one).
    #[must_use]
    pub fn created_at_micros(&self) -> Option<i64> {
        self.source.created_at_micros
    }

    /// Bytes counted against the in-flight window: key, value and headers.
    #[must_use]
    pub fn byte_size(&self) -> usize {
        let headers: usize = self
            .headers
            .iter()
            .map(|(name, value)| name.len() + value.len())
            .sum();
        self.key.len() + self.payload.len() + headers
    }

    /// The value of one of the relay's own headers (they come first and the row's
    /// headers cannot reuse their names).
    fn relay_header(&self, name: &str) -> Option<&Bytes> {
        self.headers
            .iter()
            .take(RESERVED_HEADERS.len())
            .find(|(n, _)| n == name)
            .map(|(_, v)| v)
    }

    /// The original data of this event, for a `poison_outbox` row when the broker
    /// refuses it. `row_data` holds the mapped columns under their table names.
    #[must_use]
    pub fn poison_fields(&self) -> PoisonFields {
        let s = &self.source;
        let text = |b: Option<&Bytes>| b.map(|b| lossy(b));
        let outbox_id = s.has_id.then(|| lossy(&self.event_id));
        let aggregate_type = text(self.relay_header(HEADER_AGGREGATE_TYPE));
        let event_type = text(self.relay_header(HEADER_EVENT_TYPE));
        let headers = text(s.headers.as_ref());
        let payload = (!self.tombstone).then(|| {
            payload_text(
                s.raw_payload.as_ref().unwrap_or(&self.payload),
                s.payload_format,
            )
        });
        let created_at = s.created_at_micros.and_then(format_rfc3339);
        let values: [(Field, &Option<String>); FIELD_COUNT] = [
            (Field::Id, &outbox_id),
            (Field::IdempotencyKey, &Some(lossy(&self.idempotency_key))),
            (Field::AggregateType, &aggregate_type),
            (Field::AggregateId, &Some(lossy(&self.key))),
            (Field::EventType, &event_type),
            (Field::Topic, &Some(self.topic.clone())),
            (Field::Headers, &headers),
            (Field::Payload, &payload),
            (Field::CreatedAt, &created_at),
        ];
        let columns = values
            .iter()
            .filter(|(f, v)| v.is_some() || s.names.present[*f as usize])
            .map(|(f, v)| (s.names.get(*f).to_owned(), (*v).clone()))
            .chain(
                s.extra
                    .iter()
                    .map(|(name, v)| (name.to_string(), v.as_ref().map(|b| lossy(b)))),
            )
            .chain(
                s.message
                    .as_ref()
                    .map(|(prefix, lsn)| poison_marker(prefix, *lsn)),
            )
            .collect();
        PoisonFields {
            outbox_id,
            idempotency_key: Some(lossy(&self.idempotency_key)),
            aggregate_type,
            aggregate_id: Some(lossy(&self.key)),
            event_type,
            topic: Some(self.topic.clone()),
            headers,
            payload,
            created_at,
            columns,
            lsn: self.source_lsn,
            outbox: s.names.outbox,
        }
    }
}

/// Everything a `poison_outbox` row needs (migrations/0002_poison_outbox.sql and
/// 0008_poison_dedup.sql),
/// best-effort: a field is `None` when the row had no usable value for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoisonFields {
    /// `outbox_id`: the `id` column as text.
    pub outbox_id: Option<String>,
    /// The idempotency key (the `idempotency_key` column, else `id`).
    pub idempotency_key: Option<String>,
    /// `aggregate_type`.
    pub aggregate_type: Option<String>,
    /// `aggregate_id`.
    pub aggregate_id: Option<String>,
    /// `event_type`.
    pub event_type: Option<String>,
    /// For an event: the topic it was produced to; for an unmappable row: the
    /// row's `topic` column.
    pub topic: Option<String>,
    /// `headers` as JSON text; from the replication stream only when the column is
    /// `json`/`jsonb`. Stored as `jsonb` when jsonb takes it (a `json` column may hold
    /// a `\u0000` jsonb refuses), else in `headers_text`.
    pub headers: Option<String>,
    /// `payload` as text (for `bytea`, PostgreSQL's `\x…` hex text).
    pub payload: Option<String>,
    /// `created_at` as text PostgreSQL accepts as `timestamptz` (RFC 3339 when it
    /// could be parsed, else the original text); only set for timestamp columns.
    pub created_at: Option<String>,
    /// `row_data`: column name → text value (lossy UTF-8; `None` for NULL).
    pub columns: Vec<(String, Option<String>)>,
    /// The commit LSN, when the row came from the replication stream.
    pub lsn: Option<Lsn>,
    /// Which of the config's outboxes the row is from (its place in
    /// `Config::outboxes`): the poison table it goes to.
    pub outbox: usize,
}

/// Key in a poisoned message's `row_data` that marks it as a message of the
/// message outbox (`crate::outbox::message`): `audit` counts such poison rows
/// against the message ledger, and the poison writer keeps them whole.
pub const POISON_MARKER: &str = "outbox_relay_message";

/// The `row_data` entry that marks a poison row as a message's: the prefix and
/// the message's own LSN, which also tells two identical messages of one
/// transaction apart (the poison table de-duplicates by content for rows without
/// an id).
#[must_use]
pub fn poison_marker(prefix: &str, lsn: Lsn) -> (String, Option<String>) {
    (POISON_MARKER.to_owned(), Some(format!("{prefix}@{lsn}")))
}

impl PoisonFields {
    /// Whether these are the fields of a message of the message outbox (see
    /// [`POISON_MARKER`]), not of a row.
    #[must_use]
    pub fn is_message(&self) -> bool {
        self.columns.iter().any(|(name, _)| name == POISON_MARKER)
    }
}

/// An outbox row that cannot become a Kafka record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnmappableRow {
    /// What is wrong, naming the column and value or type.
    pub reason: String,
    /// One of [`error_kind`].
    pub error_kind: &'static str,
    /// The row's data for `poison_outbox`.
    pub fields: PoisonFields,
}

impl fmt::Display for UnmappableRow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.error_kind, self.reason)
    }
}

/// Why a row is rejected, before its poison data is gathered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Reject {
    /// One of [`error_kind`].
    pub(super) kind: &'static str,
    /// What is wrong, naming the column.
    pub(super) reason: String,
}

impl Reject {
    pub(super) fn new(kind: &'static str, reason: String) -> Self {
        Reject { kind, reason }
    }
}

/// `created_at` for the poison table: RFC 3339 when parseable (unambiguous even
/// for `timestamp without time zone`), else PostgreSQL's own text, which it
/// accepts back (`infinity`, BC dates, years past 9999).
pub(super) fn poison_timestamp(text: &str) -> String {
    parse_pg_timestamp(text.as_bytes())
        .ok()
        .and_then(format_rfc3339)
        .unwrap_or_else(|| text.to_owned())
}

/// The payload as text for the poison table (`\x…` hex for raw bytes).
pub(super) fn payload_text(payload: &[u8], format: PayloadFormat) -> String {
    match format {
        PayloadFormat::Raw => hex_text(payload),
        _ => lossy(payload),
    }
}

/// `\x…` hex, as PostgreSQL prints `bytea`.
pub(super) fn hex_text(b: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 + b.len() * 2);
    s.push_str("\\x");
    for byte in b {
        s.push(char::from(HEX[usize::from(byte >> 4)]));
        s.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
    s
}

/// Lossy UTF-8 text of a value.
pub(super) fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Writes an LSN as PostgreSQL prints it, `X/Y` in upper-case hex.
pub(super) fn put_lsn<B: BufMut>(out: &mut B, lsn: Lsn) {
    fn put_hex<B: BufMut>(out: &mut B, v: u32) {
        const HEX: &[u8; 16] = b"0123456789ABCDEF";
        let digits = (32 - v.leading_zeros()).div_ceil(4).max(1);
        for k in (0..digits).rev() {
            out.put_u8(HEX[((v >> (k * 4)) & 0xf) as usize]);
        }
    }
    let v = lsn.as_u64();
    put_hex(out, (v >> 32) as u32);
    out.put_u8(b'/');
    put_hex(out, (v & 0xFFFF_FFFF) as u32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn lsn_header_matches_lsn_display() {
        for v in [0, 1, 0xF, 0x1_0000_0000, 0x16_B374_D848, u64::MAX] {
            let mut b = Vec::new();
            put_lsn(&mut b, Lsn(v));
            assert_eq!(String::from_utf8(b).unwrap(), Lsn(v).to_string());
        }
    }

    proptest! {
        #[test]
        fn lsn_writer_matches_display(v in any::<u64>()) {
            let mut b = Vec::new();
            put_lsn(&mut b, Lsn(v));
            prop_assert_eq!(String::from_utf8(b).unwrap(), Lsn(v).to_string());
        }
    }
}
