//! Outbox rows → Kafka records.
//!
//! The [`OutboxMapper`] turns one `pgoutput` `Insert` into an outbox table into one
//! Kafka record ([`OutboxEvent`]), or says why it cannot ([`UnmappableRow`]). It is
//! pure: no I/O, no clock, no logging, so the sans-IO core and the benchmarks can
//! drive it directly. The polling relay and `replay` build the same record from
//! column text with [`OutboxMapper::map_row`], so `run`, `poll` and `replay` cannot
//! drift apart (`docs/architecture.md#the-kafka-record`).
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
//! Accepted column types (checked once per Relation message, by type OID):
//! `id`, `idempotency_key`, `aggregate_id`: `text`, `varchar`, `bpchar`, `uuid`,
//! `int2/4/8`; `aggregate_type`, `event_type`, `topic`: `text`, `varchar`,
//! `bpchar`; `payload`: `jsonb`, `json`, `text`, `varchar`, `bpchar`, `bytea`;
//! `headers`: `jsonb`, `json`; `created_at`: `timestamptz`, `timestamp`. A domain
//! over one of these has its own OID and is refused.
//!
//! # Debezium compatibility
//!
//! Tables written for Debezium's outbox event router
//! (`io.debezium.transforms.outbox.EventRouter`) work unchanged: when a configured
//! column name is absent, the
//! router's default is accepted in its place — `aggregatetype` for `aggregate_type`,
//! `aggregateid` for `aggregate_id`, `type` for `event_type` (`id` and `payload` are
//! the same names). The record matches the router's defaults where it matters for
//! consumers: the key is the aggregate id, the default template
//! `outbox.event.{aggregate_type}` is the router's `outbox.event.${routedByValue}`,
//! and the value is the payload as stored. The router's `id` header (the event id)
//! is what this relay calls `idempotency_key`: without an `idempotency_key` column
//! it carries the `id` value, so Debezium consumers only rename the header they read.
//! See <https://debezium.io/documentation/reference/stable/transformations/outbox-event-router.html>.
//!
//! # Why the payload is not re-encoded
//!
//! The value is the bytes PostgreSQL's output function produced (`jsonb` and `json`
//! text, `text` as is; `bytea` is decoded from its `\x…` text to the raw bytes).
//! Parsing and re-serialising JSON would cost more than the rest of the mapping
//! together, could change numbers (`1.10` → `1.1`, integers above 2^53), key order
//! or escapes, and would make the value depend on this relay's JSON library instead
//! of on what the application wrote. `jsonb` output is already normalised by the
//! server. In envelope mode the payload is spliced into the envelope verbatim for
//! `json`/`jsonb` (which PostgreSQL guarantees to be valid JSON) and embedded as a
//! JSON string for text-like and `bytea` columns; only the small string fields are
//! escaped. The row's `headers` object is the only JSON parsed per event, and only
//! when the column is non-NULL.
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
//!
//! # Cost
//!
//! Mapping a row allocates the topic `String`, the headers `Vec` and the two short
//! `occurred_at` / `source_lsn` header values (plus the envelope when configured,
//! the decoded payload for `bytea`, and the names and escaped values of the row's
//! `headers` entries). Key, payload, idempotency key, event id and the
//! `event_type` / `aggregate_type` header values are zero-copy slices of the
//! replication message; each is moved into the record once, so a field costs one
//! reference-count increment. The rendered topic is not cached: a cache hit would
//! still copy the name into the record's `String`, which costs about what
//! rendering a template of a few segments does.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use bytes::{BufMut, Bytes, BytesMut};

use crate::config::ConfigError;
pub use crate::config::EnvelopeConfig;
use crate::config::{KafkaConfig, OutboxConfig, qualified_name};
use crate::lsn::Lsn;
use crate::postgres::pgoutput::{ColumnValue, Insert, Relation, TupleData};

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

/// Header names the relay sets itself; a row's `headers` object may not use them,
/// because consumers reading the last header of a name would get the row's value.
pub const RESERVED_HEADERS: [&str; 5] = [
    HEADER_IDEMPOTENCY_KEY,
    HEADER_EVENT_TYPE,
    HEADER_AGGREGATE_TYPE,
    HEADER_OCCURRED_AT,
    HEADER_SOURCE_LSN,
];

/// Longest legal Kafka topic name.
pub const MAX_TOPIC_LEN: usize = 249;

/// Values of [`UnmappableRow::error_kind`] (the `poison_outbox.error_kind` column).
pub mod checkpoint;
pub mod enqueue;

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
}

// Type OIDs (pg_type.dat); stable across PostgreSQL versions.
const OID_BYTEA: u32 = 17;
const OID_INT8: u32 = 20;
const OID_INT2: u32 = 21;
const OID_INT4: u32 = 23;
const OID_TEXT: u32 = 25;
const OID_JSON: u32 = 114;
const OID_BPCHAR: u32 = 1042;
const OID_VARCHAR: u32 = 1043;
const OID_TIMESTAMP: u32 = 1114;
const OID_TIMESTAMPTZ: u32 = 1184;
const OID_UUID: u32 = 2950;
const OID_JSONB: u32 = 3802;

/// Types whose text output is a usable identifier (id, idempotency key, entity id).
const KEY_TYPES: &[u32] = &[
    OID_TEXT,
    OID_VARCHAR,
    OID_BPCHAR,
    OID_UUID,
    OID_INT8,
    OID_INT4,
    OID_INT2,
];
/// Types for names (aggregate type, event type, topic).
const LABEL_TYPES: &[u32] = &[OID_TEXT, OID_VARCHAR, OID_BPCHAR];
const PAYLOAD_TYPES: &[u32] = &[
    OID_JSONB,
    OID_JSON,
    OID_TEXT,
    OID_VARCHAR,
    OID_BPCHAR,
    OID_BYTEA,
];
const HEADERS_TYPES: &[u32] = &[OID_JSONB, OID_JSON];
const TIMESTAMP_TYPES: &[u32] = &[OID_TIMESTAMPTZ, OID_TIMESTAMP];

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

/// What [`OutboxMapper::map_insert`] made of an Insert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mapped {
    /// The relation is not the outbox table (another table in the publication).
    NotOutbox,
    /// One Kafka record.
    Event(OutboxEvent),
    /// An outbox row that can never become a record; it belongs in `poison_outbox`.
    Unmappable(UnmappableRow),
}

/// How the mapper sees a relation, as returned by [`OutboxMapper::on_relation`].
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
/// `SELECT col::text` returns), for [`OutboxMapper::map_row`]. `None` is SQL NULL
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
    source: EventSource,
}

/// The original column values an event keeps so that it can be poisoned with its
/// original data if the broker refuses it (all cheap `Bytes` slices).
#[derive(Debug, Clone, PartialEq, Eq)]
struct EventSource {
    names: Arc<FieldNames>,
    /// `event_id` is the `id` column (not the idempotency key standing in).
    has_id: bool,
    /// The `headers` column text.
    headers: Option<Bytes>,
    /// The payload before the envelope; `None` when it is the record value.
    raw_payload: Option<Bytes>,
    /// Format of the raw payload (`Raw` once `bytea` text was decoded).
    payload_format: PayloadFormat,
    created_at_micros: Option<i64>,
}

impl OutboxEvent {
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
        let payload = payload_text(
            s.raw_payload.as_ref().unwrap_or(&self.payload),
            s.payload_format,
        );
        let created_at = s.created_at_micros.and_then(format_rfc3339);
        let values: [(Field, &Option<String>); FIELD_COUNT] = [
            (Field::Id, &outbox_id),
            (Field::IdempotencyKey, &Some(lossy(&self.idempotency_key))),
            (Field::AggregateType, &aggregate_type),
            (Field::AggregateId, &Some(lossy(&self.key))),
            (Field::EventType, &event_type),
            (Field::Topic, &Some(self.topic.clone())),
            (Field::Headers, &headers),
            (Field::Payload, &Some(payload.clone())),
            (Field::CreatedAt, &created_at),
        ];
        let columns = values
            .iter()
            .filter(|(f, v)| v.is_some() || s.names.present[*f as usize])
            .map(|(f, v)| (s.names.get(*f).to_owned(), (*v).clone()))
            .collect();
        PoisonFields {
            outbox_id,
            idempotency_key: Some(lossy(&self.idempotency_key)),
            aggregate_type,
            aggregate_id: Some(lossy(&self.key)),
            event_type,
            topic: Some(self.topic.clone()),
            headers,
            payload: Some(payload),
            created_at,
            columns,
            lsn: self.source_lsn,
        }
    }
}

/// Everything a `poison_outbox` row needs (migrations/0002_poison_outbox.sql),
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
    /// `json`/`jsonb`, so it always casts to `jsonb`.
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

// ---------------------------------------------------------------------------
// Fields and relations
// ---------------------------------------------------------------------------

const FIELD_COUNT: usize = 9;

/// The outbox columns the mapper knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    Id = 0,
    IdempotencyKey,
    AggregateType,
    AggregateId,
    EventType,
    Topic,
    Headers,
    Payload,
    CreatedAt,
}

impl Field {
    const ALL: [Field; FIELD_COUNT] = [
        Field::Id,
        Field::IdempotencyKey,
        Field::AggregateType,
        Field::AggregateId,
        Field::EventType,
        Field::Topic,
        Field::Headers,
        Field::Payload,
        Field::CreatedAt,
    ];

    /// The name used in messages and in the config's `[outbox.columns]`.
    const fn label(self) -> &'static str {
        match self {
            Field::Id => "id",
            Field::IdempotencyKey => "idempotency_key",
            Field::AggregateType => "aggregate_type",
            Field::AggregateId => "aggregate_id",
            Field::EventType => "event_type",
            Field::Topic => "topic",
            Field::Headers => "headers",
            Field::Payload => "payload",
            Field::CreatedAt => "created_at",
        }
    }

    /// Debezium outbox router default, accepted when the configured name is absent.
    const fn alias(self) -> Option<&'static str> {
        match self {
            Field::AggregateType => Some("aggregatetype"),
            Field::AggregateId => Some("aggregateid"),
            Field::EventType => Some("type"),
            _ => None,
        }
    }

    const fn accepted_types(self) -> &'static [u32] {
        match self {
            Field::Id | Field::IdempotencyKey | Field::AggregateId => KEY_TYPES,
            Field::AggregateType | Field::EventType | Field::Topic => LABEL_TYPES,
            Field::Headers => HEADERS_TYPES,
            Field::Payload => PAYLOAD_TYPES,
            Field::CreatedAt => TIMESTAMP_TYPES,
        }
    }

    fn configured(self, outbox: &OutboxConfig) -> &str {
        let c = &outbox.columns;
        match self {
            Field::Id => &c.id,
            Field::IdempotencyKey => &c.idempotency_key,
            Field::AggregateType => &c.aggregate_type,
            Field::AggregateId => &c.aggregate_id,
            Field::EventType => &c.event_type,
            Field::Topic => &c.topic,
            Field::Headers => &c.headers,
            Field::Payload => &c.payload,
            Field::CreatedAt => &c.created_at,
        }
    }
}

/// Column names of the outbox fields in one table (the resolved alias when the
/// configured name was absent), and which of them the table has.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FieldNames {
    names: [String; FIELD_COUNT],
    present: [bool; FIELD_COUNT],
}

impl FieldNames {
    fn get(&self, field: Field) -> &str {
        &self.names[field as usize]
    }

    /// `aggregate_id column "aggregateid"`.
    fn describe(&self, field: Field) -> String {
        format!("{} column {:?}", field.label(), self.get(field))
    }
}

/// A Relation message for the outbox table, resolved.
#[derive(Debug)]
struct OutboxRelation {
    /// Every column name, in tuple order (for `row_data`).
    columns: Vec<String>,
    /// Every column's type OID, in tuple order.
    type_oids: Vec<u32>,
    /// Tuple position of each field.
    positions: [Option<usize>; FIELD_COUNT],
    names: Arc<FieldNames>,
    /// A table-level problem making every insert unmappable.
    problem: Option<Reject>,
}

impl OutboxRelation {
    fn position(&self, field: Field) -> Option<usize> {
        self.positions[field as usize]
    }

    fn type_of(&self, field: Field) -> Option<u32> {
        self.position(field)
            .and_then(|p| self.type_oids.get(p).copied())
    }
}

#[derive(Debug)]
enum RelationEntry {
    NotOutbox,
    Outbox(Box<OutboxRelation>),
}

/// A cheap hasher for relation OIDs (Fibonacci hashing of the `u32`).
#[derive(Debug, Default)]
struct OidHasher(u64);

impl Hasher for OidHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Why a row is rejected, before its poison data is gathered.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Reject {
    kind: &'static str,
    reason: String,
}

impl Reject {
    fn new(kind: &'static str, reason: String) -> Self {
        Reject { kind, reason }
    }
}

// ---------------------------------------------------------------------------
// Topic template
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(Box<str>),
    AggregateType,
    EventType,
}

#[derive(Debug, Clone)]
struct TopicTemplate {
    source: String,
    segments: Vec<Segment>,
    literal_len: usize,
}

impl TopicTemplate {
    fn parse(template: &str) -> Result<Self, String> {
        if template.is_empty() {
            return Err("is empty".into());
        }
        let mut segments = Vec::new();
        let mut literal_len = 0;
        let mut rest = template;
        while !rest.is_empty() {
            let literal_end = rest.find(['{', '}']).unwrap_or(rest.len());
            let literal = &rest[..literal_end];
            if !literal.is_empty() {
                if let Some(c) = literal
                    .chars()
                    .find(|c| !c.is_ascii() || !is_topic_byte(*c as u8))
                {
                    return Err(format!(
                        "contains {c:?}; topic names allow only ASCII letters, digits, '.', '_' and '-'"
                    ));
                }
                literal_len += literal.len();
                segments.push(Segment::Literal(literal.into()));
            }
            rest = &rest[literal_end..];
            if rest.starts_with('}') {
                return Err("has a '}' without a matching '{'".into());
            }
            if let Some(after) = rest.strip_prefix('{') {
                let Some(close) = after.find('}') else {
                    return Err("has a '{' without a matching '}'".into());
                };
                segments.push(match &after[..close] {
                    "aggregate_type" => Segment::AggregateType,
                    "event_type" => Segment::EventType,
                    other => {
                        return Err(format!(
                            "has the unknown placeholder {{{other}}}; only {{aggregate_type}} and {{event_type}} are replaced"
                        ));
                    }
                });
                rest = &after[close + 1..];
            }
        }
        if literal_len > MAX_TOPIC_LEN {
            return Err(format!(
                "is longer than {MAX_TOPIC_LEN} characters without its placeholders"
            ));
        }
        let has_placeholder = segments.iter().any(|s| !matches!(s, Segment::Literal(_)));
        if !has_placeholder {
            validate_topic_name(template.as_bytes())?;
        }
        Ok(TopicTemplate {
            source: template.to_owned(),
            segments,
            literal_len,
        })
    }

    fn render(
        &self,
        aggregate_type: Option<&[u8]>,
        event_type: Option<&[u8]>,
    ) -> Result<String, String> {
        let value = |seg: &Segment| -> Result<Option<&[u8]>, String> {
            let (name, v) = match seg {
                Segment::Literal(_) => return Ok(None),
                Segment::AggregateType => ("aggregate_type", aggregate_type),
                Segment::EventType => ("event_type", event_type),
            };
            let v = v.ok_or_else(|| {
                format!(
                    "topic template {:?} needs {name}, which is NULL",
                    self.source
                )
            })?;
            if v.is_empty() {
                return Err(format!(
                    "topic template {:?} needs {name}, which is empty",
                    self.source
                ));
            }
            if let Some(&b) = v.iter().find(|b| !is_topic_byte(**b)) {
                return Err(format!(
                    "{name} {:?} contains {:?}, which is not allowed in a topic name (topic template {:?}; allowed: ASCII letters, digits, '.', '_', '-')",
                    String::from_utf8_lossy(v),
                    char::from(b),
                    self.source
                ));
            }
            Ok(Some(v))
        };
        let mut len = self.literal_len;
        for seg in &self.segments {
            if let Some(v) = value(seg)? {
                len += v.len();
            }
        }
        let mut out = Vec::with_capacity(len);
        for seg in &self.segments {
            match seg {
                Segment::Literal(l) => out.extend_from_slice(l.as_bytes()),
                other => out.extend_from_slice(value(other)?.unwrap_or_default()),
            }
        }
        validate_topic_name(&out).map_err(|e| {
            format!(
                "topic {:?} rendered from template {:?} {e}",
                String::from_utf8_lossy(&out),
                self.source
            )
        })?;
        String::from_utf8(out).map_err(|e| format!("topic is not UTF-8: {e}"))
    }
}

fn is_topic_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-')
}

/// Checks a Kafka topic name: 1 to 249 of ASCII letters, digits, `.`, `_`, `-`,
/// and not `.` or `..` (Kafka's `Topic.validate`).
///
/// # Errors
///
/// Says what is wrong, as a phrase to follow the name ("is empty", …).
pub fn validate_topic_name(name: &[u8]) -> Result<(), String> {
    if name.is_empty() {
        return Err("is empty".into());
    }
    if name.len() > MAX_TOPIC_LEN {
        return Err(format!(
            "is {} characters long, more than Kafka's {MAX_TOPIC_LEN}",
            name.len()
        ));
    }
    if name == b"." || name == b".." {
        return Err("is '.' or '..', which Kafka forbids".into());
    }
    if let Some(&b) = name.iter().find(|b| !is_topic_byte(**b)) {
        return Err(format!(
            "contains {:?}; topic names allow only ASCII letters, digits, '.', '_' and '-'",
            char::from(b)
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The mapper
// ---------------------------------------------------------------------------

/// Maps outbox inserts to Kafka records; holds the relation cache of one
/// replication session.
#[derive(Debug)]
pub struct OutboxMapper {
    outbox: OutboxConfig,
    schema: String,
    table: String,
    template: TopicTemplate,
    envelope: Option<Envelope>,
    /// Field names as configured, for [`OutboxMapper::map_row`].
    configured_names: Arc<FieldNames>,
    relations: HashMap<u32, RelationEntry, BuildHasherDefault<OidHasher>>,
}

/// The envelope's constant fields, pre-encoded as JSON strings.
#[derive(Debug, Clone)]
struct Envelope {
    producer: Bytes,
    schema_version: Bytes,
}

impl OutboxMapper {
    /// Builds a mapper for `outbox.table`, with `kafka.topic_template` and an
    /// optional payload envelope.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] when the table name is malformed or the template
    /// has a placeholder other than `{aggregate_type}` / `{event_type}`, unbalanced
    /// braces, or characters that can never appear in a topic name.
    pub fn new(
        outbox: &OutboxConfig,
        kafka: &KafkaConfig,
        envelope: Option<EnvelopeConfig>,
    ) -> Result<Self, ConfigError> {
        Self::with_template(outbox, &kafka.topic_template, envelope)
    }

    /// Like [`OutboxMapper::new`], with the topic template given directly.
    ///
    /// # Errors
    ///
    /// As [`OutboxMapper::new`].
    pub fn with_template(
        outbox: &OutboxConfig,
        topic_template: &str,
        envelope: Option<EnvelopeConfig>,
    ) -> Result<Self, ConfigError> {
        let (schema, table) = qualified_name(&outbox.table)
            .map_err(|m| ConfigError::Invalid(format!("outbox.table: {m}")))?;
        let template = TopicTemplate::parse(topic_template).map_err(|m| {
            ConfigError::Invalid(format!("kafka.topic_template {topic_template:?} {m}"))
        })?;
        let envelope = envelope.map(|e| {
            let encode = |s: &str| {
                let mut b = BytesMut::with_capacity(s.len() + 2);
                put_json_string(&mut b, s);
                b.freeze()
            };
            Envelope {
                producer: encode(&e.producer),
                schema_version: encode(&e.schema_version),
            }
        });
        let configured_names = Arc::new(FieldNames {
            names: Field::ALL.map(|f| f.configured(outbox).to_owned()),
            present: [true; FIELD_COUNT],
        });
        Ok(OutboxMapper {
            outbox: outbox.clone(),
            schema,
            table,
            template,
            envelope,
            configured_names,
            relations: HashMap::default(),
        })
    }

    /// Forgets every relation, for a new replication session (the server describes
    /// each relation again before its first change).
    pub fn reset_session(&mut self) {
        self.relations.clear();
    }

    /// Records a Relation message. A second message for the same OID (after
    /// `ALTER TABLE`, or a new session) replaces the first, so later inserts use
    /// the new column positions and types.
    pub fn on_relation(&mut self, rel: &Relation) -> RelationStatus<'_> {
        let entry = if rel.namespace == self.schema && rel.name == self.table {
            RelationEntry::Outbox(Box::new(self.resolve(rel)))
        } else {
            RelationEntry::NotOutbox
        };
        status_of(self.relations.entry(rel.id).insert_entry(entry).into_mut())
    }

    /// How the mapper sees relation `relation_id`, if it was described.
    #[must_use]
    pub fn relation_status(&self, relation_id: u32) -> Option<RelationStatus<'_>> {
        self.relations.get(&relation_id).map(status_of)
    }

    fn resolve(&self, rel: &Relation) -> OutboxRelation {
        let find = |name: &str| rel.columns.iter().position(|c| c.name == name);
        let mut positions = [None; FIELD_COUNT];
        let mut names = Field::ALL.map(|f| f.configured(&self.outbox).to_owned());
        for field in Field::ALL {
            let configured = field.configured(&self.outbox);
            let (pos, name) = match (find(configured), field.alias()) {
                (Some(p), _) => (Some(p), configured),
                (None, Some(alias)) => (find(alias), alias),
                (None, None) => (None, configured),
            };
            if pos.is_some() {
                names[field as usize] = name.to_owned();
            }
            positions[field as usize] = pos;
        }
        let present = positions.map(|p| p.is_some());
        let names = Arc::new(FieldNames { names, present });
        let type_oids: Vec<u32> = rel.columns.iter().map(|c| c.type_oid).collect();

        let mut missing = Vec::new();
        let describe_missing = |field: Field| match field.alias() {
            Some(alias) => format!(
                "{} column {:?} (or {alias:?})",
                field.label(),
                field.configured(&self.outbox)
            ),
            None => format!(
                "{} column {:?}",
                field.label(),
                field.configured(&self.outbox)
            ),
        };
        for field in [Field::AggregateId, Field::Payload] {
            if !present[field as usize] {
                missing.push(describe_missing(field));
            }
        }
        if !present[Field::IdempotencyKey as usize] && !present[Field::Id as usize] {
            missing.push(format!(
                "{} or {}",
                describe_missing(Field::IdempotencyKey),
                describe_missing(Field::Id)
            ));
        }
        let mut bad_types = Vec::new();
        for field in Field::ALL {
            let Some(oid) = positions[field as usize].and_then(|p| type_oids.get(p).copied())
            else {
                continue;
            };
            let accepted = field.accepted_types();
            if !accepted.contains(&oid) {
                let expected: Vec<Cow<'static, str>> =
                    accepted.iter().map(|o| type_name(*o)).collect();
                bad_types.push(format!(
                    "{} has type {} (oid {oid}), expected one of {}",
                    names.describe(field),
                    type_name(oid),
                    expected.join(", ")
                ));
            }
        }
        let table = format!("outbox table {}.{}", rel.namespace, rel.name);
        let problem = if !missing.is_empty() {
            let mut reason = format!("{table} has no {}", missing.join(", no "));
            if !bad_types.is_empty() {
                reason.push_str("; ");
                reason.push_str(&bad_types.join("; "));
            }
            Some(Reject::new(error_kind::MISSING_COLUMN, reason))
        } else if !bad_types.is_empty() {
            Some(Reject::new(
                error_kind::BAD_COLUMN_TYPE,
                format!("{table}: {}", bad_types.join("; ")),
            ))
        } else {
            None
        };
        OutboxRelation {
            columns: rel.columns.iter().map(|c| c.name.clone()).collect(),
            type_oids,
            positions,
            names,
            problem,
        }
    }

    /// Maps one Insert of the replication stream; `commit_lsn` is its transaction's
    /// commit LSN (the `source_lsn` header).
    ///
    /// # Errors
    ///
    /// [`MapError`] when the Insert contradicts the session's Relation messages.
    pub fn map_insert(&self, insert: &Insert, commit_lsn: Lsn) -> Result<Mapped, MapError> {
        let rel = match self.relations.get(&insert.relation_id) {
            None => {
                return Err(MapError::UnknownRelation {
                    relation_id: insert.relation_id,
                });
            }
            Some(RelationEntry::NotOutbox) => return Ok(Mapped::NotOutbox),
            Some(RelationEntry::Outbox(rel)) => rel,
        };
        if insert.tuple.len() != rel.columns.len() {
            return Err(MapError::ColumnCount {
                relation_id: insert.relation_id,
                expected: rel.columns.len(),
                actual: insert.tuple.len(),
            });
        }
        let result = match &rel.problem {
            Some(problem) => Err(problem.clone()),
            None => extract_row(rel, &insert.tuple)
                .and_then(|row| self.build(row, &rel.names, Some(commit_lsn))),
        };
        Ok(match result {
            Ok(event) => Mapped::Event(event),
            Err(reject) => Mapped::Unmappable(UnmappableRow {
                reason: reject.reason,
                error_kind: reject.kind,
                fields: poison_from_tuple(rel, &insert.tuple, commit_lsn),
            }),
        })
    }

    /// Maps one outbox row given as column text (the polling relay, `replay`),
    /// with the same rules as [`OutboxMapper::map_insert`]. `source_lsn` is `None`
    /// outside CDC (no `source_lsn` header).
    ///
    /// # Errors
    ///
    /// The row cannot become a record; the error carries its poison data.
    pub fn map_row(
        &self,
        row: &OutboxRow,
        source_lsn: Option<Lsn>,
    ) -> Result<OutboxEvent, Box<UnmappableRow>> {
        self.build(RowRef::of(row), &self.configured_names, source_lsn)
            .map_err(|reject| {
                Box::new(UnmappableRow {
                    reason: reject.reason,
                    error_kind: reject.kind,
                    fields: poison_from_row(&self.configured_names, row, source_lsn),
                })
            })
    }

    /// The mapping rules proper. Every value ends up in the event at most once
    /// (moved out of `row`), so a field costs one reference-count increment.
    fn build(
        &self,
        row: RowRef<'_>,
        names: &Arc<FieldNames>,
        source_lsn: Option<Lsn>,
    ) -> Result<OutboxEvent, Reject> {
        let RowRef {
            id,
            idempotency_key,
            aggregate_type,
            aggregate_id,
            event_type,
            topic,
            headers: row_headers,
            payload,
            payload_format,
            created_at,
        } = row;

        // Key: the entity id.
        let key = match aggregate_id {
            None => {
                return Err(Reject::new(
                    error_kind::NULL_KEY,
                    format!(
                        "{} is NULL: an event without an entity id has no Kafka key",
                        names.describe(Field::AggregateId)
                    ),
                ));
            }
            Some(k) if k.is_empty() => {
                return Err(Reject::new(
                    error_kind::EMPTY_KEY,
                    format!(
                        "{} is empty: an event without an entity id has no Kafka key",
                        names.describe(Field::AggregateId)
                    ),
                ));
            }
            Some(k) => k.into_owned(),
        };

        // Idempotency key: the idempotency_key column, else the id.
        let (idempotency_key, key_field) = match (idempotency_key, &id) {
            (Some(k), _) => (k.into_owned(), Field::IdempotencyKey),
            (None, Some(id)) => (Bytes::clone(id), Field::Id),
            (None, None) => {
                return Err(Reject::new(
                    error_kind::NULL_IDEMPOTENCY_KEY,
                    format!(
                        "no idempotency key: {} and {} are NULL",
                        names.describe(Field::IdempotencyKey),
                        names.describe(Field::Id)
                    ),
                ));
            }
        };
        if idempotency_key.is_empty() {
            return Err(Reject::new(
                error_kind::EMPTY_IDEMPOTENCY_KEY,
                format!(
                    "{} is empty: consumers could not deduplicate the event",
                    names.describe(key_field)
                ),
            ));
        }

        // Payload, as PostgreSQL gave it.
        let Some(raw_payload) = payload else {
            return Err(Reject::new(
                error_kind::NULL_PAYLOAD,
                format!("{} is NULL", names.describe(Field::Payload)),
            ));
        };
        let (value, payload_format) = match payload_format {
            PayloadFormat::Json | PayloadFormat::Text | PayloadFormat::Raw => {
                (raw_payload.into_owned(), payload_format)
            }
            PayloadFormat::ByteaText => {
                let bytes = decode_bytea_text(&raw_payload).map_err(|e| {
                    Reject::new(
                        error_kind::BAD_PAYLOAD,
                        format!(
                            "{} is not bytea text output: {e}",
                            names.describe(Field::Payload)
                        ),
                    )
                })?;
                (bytes, PayloadFormat::Raw)
            }
        };

        // Topic: the row's, else the template's.
        let topic = match topic.as_deref() {
            Some(t) if !t.is_empty() => {
                validate_topic_name(t).map_err(|e| {
                    Reject::new(
                        error_kind::INVALID_TOPIC,
                        format!(
                            "topic {:?} from the {} {e}",
                            String::from_utf8_lossy(t),
                            names.describe(Field::Topic)
                        ),
                    )
                })?;
                String::from_utf8(t.to_vec()).map_err(|e| {
                    Reject::new(
                        error_kind::INVALID_TOPIC,
                        format!("topic is not UTF-8: {e}"),
                    )
                })?
            }
            _ => self
                .template
                .render(
                    aggregate_type.as_deref().map(|b| &b[..]),
                    event_type.as_deref().map(|b| &b[..]),
                )
                .map_err(|e| Reject::new(error_kind::INVALID_TOPIC, e))?,
        };

        // created_at → CreateTime and occurred_at.
        let created_at_micros = match &created_at {
            None => None,
            Some(text) => Some(parse_pg_timestamp(text).map_err(|e| {
                Reject::new(
                    error_kind::BAD_TIMESTAMP,
                    format!("{}: {e}", names.describe(Field::CreatedAt)),
                )
            })?),
        };
        let occurred_at = created_at_micros.map(|micros| {
            let mut buf = Vec::with_capacity(RFC3339_LEN);
            put_rfc3339(&mut buf, micros);
            Bytes::from(buf)
        });

        let has_id = id.is_some();
        let event_id = match id {
            Some(id) => id.into_owned(),
            None => idempotency_key.clone(),
        };

        let (payload, raw_payload) = match &self.envelope {
            None => (value, None),
            Some(envelope) => {
                let wrapped = build_envelope(
                    envelope,
                    &event_id,
                    event_type.as_deref().map(|b| &b[..]),
                    occurred_at.as_deref(),
                    &value,
                    payload_format,
                )
                .map_err(|e| {
                    Reject::new(
                        error_kind::BAD_PAYLOAD,
                        format!("{}: {e}", names.describe(Field::Payload)),
                    )
                })?;
                (wrapped, Some(value))
            }
        };

        // Headers, in contract order.
        let mut headers: Vec<(HeaderName, Bytes)> =
            Vec::with_capacity(RESERVED_HEADERS.len() + if row_headers.is_some() { 4 } else { 0 });
        headers.push((
            Cow::Borrowed(HEADER_IDEMPOTENCY_KEY),
            idempotency_key.clone(),
        ));
        if let Some(v) = event_type {
            headers.push((Cow::Borrowed(HEADER_EVENT_TYPE), v.into_owned()));
        }
        if let Some(v) = aggregate_type {
            headers.push((Cow::Borrowed(HEADER_AGGREGATE_TYPE), v.into_owned()));
        }
        if let Some(v) = occurred_at {
            headers.push((Cow::Borrowed(HEADER_OCCURRED_AT), v));
        }
        if let Some(lsn) = source_lsn {
            let mut buf = Vec::with_capacity(17);
            put_lsn(&mut buf, lsn);
            headers.push((Cow::Borrowed(HEADER_SOURCE_LSN), Bytes::from(buf)));
        }
        if let Some(text) = &row_headers {
            parse_header_object(text, &mut headers).map_err(|e| {
                Reject::new(
                    error_kind::BAD_HEADERS,
                    format!("{}: {e}", names.describe(Field::Headers)),
                )
            })?;
        }

        let timestamp_ms = created_at_micros
            .map(|m| m.div_euclid(1000))
            .filter(|ms| *ms >= 0);

        Ok(OutboxEvent {
            key,
            topic,
            payload,
            headers,
            timestamp_ms,
            idempotency_key,
            event_id,
            source_lsn,
            source: EventSource {
                names: Arc::clone(names),
                has_id,
                headers: row_headers.map(Cow::into_owned),
                raw_payload,
                payload_format,
                created_at_micros,
            },
        })
    }
}

fn status_of(entry: &RelationEntry) -> RelationStatus<'_> {
    match entry {
        RelationEntry::NotOutbox => RelationStatus::NotOutbox,
        RelationEntry::Outbox(rel) => match &rel.problem {
            Some(p) => RelationStatus::Unmappable {
                error_kind: p.kind,
                reason: &p.reason,
            },
            None => RelationStatus::Outbox,
        },
    }
}

/// The outbox fields of one row, borrowed from the tuple (or an [`OutboxRow`]);
/// owned only where a binary-format value had to be re-sliced.
struct RowRef<'a> {
    id: Option<Cow<'a, Bytes>>,
    idempotency_key: Option<Cow<'a, Bytes>>,
    aggregate_type: Option<Cow<'a, Bytes>>,
    aggregate_id: Option<Cow<'a, Bytes>>,
    event_type: Option<Cow<'a, Bytes>>,
    topic: Option<Cow<'a, Bytes>>,
    headers: Option<Cow<'a, Bytes>>,
    payload: Option<Cow<'a, Bytes>>,
    payload_format: PayloadFormat,
    created_at: Option<Cow<'a, Bytes>>,
}

impl<'a> RowRef<'a> {
    fn of(row: &'a OutboxRow) -> Self {
        let b = |v: &'a Option<Bytes>| v.as_ref().map(Cow::Borrowed);
        RowRef {
            id: b(&row.id),
            idempotency_key: b(&row.idempotency_key),
            aggregate_type: b(&row.aggregate_type),
            aggregate_id: b(&row.aggregate_id),
            event_type: b(&row.event_type),
            topic: b(&row.topic),
            headers: b(&row.headers),
            payload: b(&row.payload),
            payload_format: row.payload_format,
            created_at: b(&row.created_at),
        }
    }
}

/// Reads the outbox fields of a tuple (already checked to match the relation).
fn extract_row<'a>(rel: &OutboxRelation, tuple: &'a TupleData) -> Result<RowRef<'a>, Reject> {
    let get = |field: Field| -> Result<Option<Cow<'a, Bytes>>, Reject> {
        let Some(pos) = rel.position(field) else {
            return Ok(None);
        };
        match tuple.get(pos) {
            None | Some(ColumnValue::Null) => Ok(None),
            Some(ColumnValue::UnchangedToast) => Err(Reject::new(
                error_kind::UNCHANGED_TOAST,
                format!(
                    "{} is an unchanged-TOAST marker ('u'), which an INSERT never carries: the value was not sent",
                    rel.names.describe(field)
                ),
            )),
            Some(ColumnValue::Text(b)) => Ok(Some(Cow::Borrowed(b))),
            Some(ColumnValue::Binary(b)) => {
                let oid = rel.type_oids.get(pos).copied().unwrap_or_default();
                binary_as_text(oid, b)
                    .map(|b| Some(Cow::Owned(b)))
                    .map_err(|e| {
                        Reject::new(
                            error_kind::BAD_VALUE,
                            format!("{}: {e}", rel.names.describe(field)),
                        )
                    })
            }
        }
    };
    let payload_oid = rel.type_of(Field::Payload).unwrap_or(OID_JSONB);
    let (payload, payload_format) = match (
        rel.position(Field::Payload).and_then(|p| tuple.get(p)),
        payload_oid,
    ) {
        (Some(ColumnValue::Binary(b)), OID_BYTEA) => (Some(Cow::Borrowed(b)), PayloadFormat::Raw),
        (_, oid) => (get(Field::Payload)?, payload_format_of(oid)),
    };
    Ok(RowRef {
        id: get(Field::Id)?,
        idempotency_key: get(Field::IdempotencyKey)?,
        aggregate_type: get(Field::AggregateType)?,
        aggregate_id: get(Field::AggregateId)?,
        event_type: get(Field::EventType)?,
        topic: get(Field::Topic)?,
        headers: get(Field::Headers)?,
        payload,
        payload_format,
        created_at: get(Field::CreatedAt)?,
    })
}

fn payload_format_of(oid: u32) -> PayloadFormat {
    match oid {
        OID_JSON | OID_JSONB => PayloadFormat::Json,
        OID_BYTEA => PayloadFormat::ByteaText,
        _ => PayloadFormat::Text,
    }
}

/// The text form of a binary-format (`'b'`) value, where it has one without copying.
fn binary_as_text(oid: u32, b: &Bytes) -> Result<Bytes, String> {
    let utf8 = |b: Bytes| match std::str::from_utf8(&b) {
        Ok(_) => Ok(b),
        Err(e) => Err(format!(
            "binary-format {} value is not UTF-8: {e}",
            type_name(oid)
        )),
    };
    match oid {
        OID_TEXT | OID_VARCHAR | OID_BPCHAR | OID_JSON => utf8(b.clone()),
        // jsonb_send: a version byte (1), then the text.
        OID_JSONB => match b.first() {
            Some(1) => utf8(b.slice(1..)),
            _ => Err("binary-format jsonb value does not start with version 1".into()),
        },
        _ => Err(format!(
            "binary-format values of type {} are not supported; the relay reads pgoutput text format (no binary 'true')",
            type_name(oid)
        )),
    }
}

/// Poison data of a tuple of an outbox relation: every column by name, and the
/// mapped fields where they can be read.
fn poison_from_tuple(rel: &OutboxRelation, tuple: &TupleData, lsn: Lsn) -> PoisonFields {
    let text_of = |field: Field| -> Option<String> {
        let pos = rel.position(field)?;
        let value = tuple.get(pos)?;
        let oid = rel.type_oids.get(pos).copied().unwrap_or_default();
        match value {
            ColumnValue::Text(b) => Some(lossy(b)),
            ColumnValue::Binary(b) => binary_as_text(oid, b).ok().map(|b| lossy(&b)),
            ColumnValue::Null | ColumnValue::UnchangedToast => None,
        }
    };
    let typed = |field: Field, types: &[u32]| -> Option<String> {
        rel.type_of(field)
            .filter(|oid| types.contains(oid))
            .and_then(|_| text_of(field))
    };
    let headers = typed(Field::Headers, HEADERS_TYPES);
    let created_at = typed(Field::CreatedAt, TIMESTAMP_TYPES).map(|t| poison_timestamp(&t));
    let payload = match rel.position(Field::Payload).and_then(|p| tuple.get(p)) {
        Some(ColumnValue::Binary(b)) if rel.type_of(Field::Payload) == Some(OID_BYTEA) => {
            Some(payload_text(b, PayloadFormat::Raw))
        }
        Some(ColumnValue::Binary(b)) => Some(lossy(b)),
        _ => text_of(Field::Payload),
    };
    let id = text_of(Field::Id);
    let columns = rel
        .columns
        .iter()
        .zip(&tuple.columns)
        .zip(&rel.type_oids)
        .map(|((name, value), oid)| {
            let text = match value {
                ColumnValue::Text(b) => Some(lossy(b)),
                ColumnValue::Binary(b) => Some(match binary_as_text(*oid, b) {
                    Ok(t) => lossy(&t),
                    Err(_) => hex_text(b),
                }),
                ColumnValue::Null | ColumnValue::UnchangedToast => None,
            };
            (name.clone(), text)
        })
        .collect();
    PoisonFields {
        idempotency_key: text_of(Field::IdempotencyKey).or_else(|| id.clone()),
        outbox_id: id,
        aggregate_type: text_of(Field::AggregateType),
        aggregate_id: text_of(Field::AggregateId),
        event_type: text_of(Field::EventType),
        topic: text_of(Field::Topic),
        headers,
        payload,
        created_at,
        columns,
        lsn: Some(lsn),
    }
}

/// Poison data of a row given as text.
fn poison_from_row(names: &FieldNames, row: &OutboxRow, lsn: Option<Lsn>) -> PoisonFields {
    let text = |b: &Option<Bytes>| b.as_deref().map(lossy);
    let payload = row.payload.as_ref().map(|p| match row.payload_format {
        PayloadFormat::Raw => payload_text(p, PayloadFormat::Raw),
        _ => lossy(p),
    });
    let created_at = text(&row.created_at).map(|t| poison_timestamp(&t));
    let values = [
        (Field::Id, text(&row.id)),
        (Field::IdempotencyKey, text(&row.idempotency_key)),
        (Field::AggregateType, text(&row.aggregate_type)),
        (Field::AggregateId, text(&row.aggregate_id)),
        (Field::EventType, text(&row.event_type)),
        (Field::Topic, text(&row.topic)),
        (Field::Headers, text(&row.headers)),
        (Field::Payload, payload.clone()),
        (Field::CreatedAt, text(&row.created_at)),
    ];
    PoisonFields {
        outbox_id: text(&row.id),
        idempotency_key: text(&row.idempotency_key).or_else(|| text(&row.id)),
        aggregate_type: text(&row.aggregate_type),
        aggregate_id: text(&row.aggregate_id),
        event_type: text(&row.event_type),
        topic: text(&row.topic),
        headers: text(&row.headers),
        payload,
        created_at,
        columns: values
            .into_iter()
            .map(|(f, v)| (names.get(f).to_owned(), v))
            .collect(),
        lsn,
    }
}

/// `created_at` for the poison table: RFC 3339 when parseable (unambiguous even
/// for `timestamp without time zone`), else PostgreSQL's own text, which it
/// accepts back (`infinity`, BC dates, years past 9999).
fn poison_timestamp(text: &str) -> String {
    parse_pg_timestamp(text.as_bytes())
        .ok()
        .and_then(format_rfc3339)
        .unwrap_or_else(|| text.to_owned())
}

/// The payload as text for the poison table (`\x…` hex for raw bytes).
fn payload_text(payload: &[u8], format: PayloadFormat) -> String {
    match format {
        PayloadFormat::Raw => hex_text(payload),
        _ => lossy(payload),
    }
}

fn hex_text(b: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 + b.len() * 2);
    s.push_str("\\x");
    for byte in b {
        s.push(char::from(HEX[usize::from(byte >> 4)]));
        s.push(char::from(HEX[usize::from(byte & 0xf)]));
    }
    s
}

fn lossy(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn type_name(oid: u32) -> Cow<'static, str> {
    Cow::Borrowed(match oid {
        16 => "bool",
        OID_BYTEA => "bytea",
        18 => "char",
        19 => "name",
        OID_INT8 => "int8",
        OID_INT2 => "int2",
        OID_INT4 => "int4",
        OID_TEXT => "text",
        26 => "oid",
        OID_JSON => "json",
        142 => "xml",
        700 => "float4",
        701 => "float8",
        OID_BPCHAR => "bpchar",
        OID_VARCHAR => "varchar",
        1082 => "date",
        1083 => "time",
        OID_TIMESTAMP => "timestamp",
        OID_TIMESTAMPTZ => "timestamptz",
        1266 => "timetz",
        1700 => "numeric",
        OID_UUID => "uuid",
        OID_JSONB => "jsonb",
        _ => return Cow::Owned(format!("oid {oid}")),
    })
}

// ---------------------------------------------------------------------------
// Payload encodings
// ---------------------------------------------------------------------------

/// Decodes `bytea` text output: hex (`\x0a1b…`, the default) or the escape format
/// (`\\`, `\ooo` octal, other bytes literal).
fn decode_bytea_text(text: &[u8]) -> Result<Bytes, String> {
    if let Some(hex) = text.strip_prefix(b"\\x") {
        let digit = |c: u8| -> Result<u8, String> {
            match c {
                b'0'..=b'9' => Ok(c - b'0'),
                b'a'..=b'f' => Ok(c - b'a' + 10),
                b'A'..=b'F' => Ok(c - b'A' + 10),
                _ => Err(format!("{:?} is not a hex digit", char::from(c))),
            }
        };
        if hex.len() % 2 != 0 {
            return Err("odd number of hex digits".into());
        }
        let mut out = Vec::with_capacity(hex.len() / 2);
        for pair in hex.chunks_exact(2) {
            out.push((digit(pair[0])? << 4) | digit(pair[1])?);
        }
        return Ok(Bytes::from(out));
    }
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while let Some(&c) = text.get(i) {
        if c != b'\\' {
            out.push(c);
            i += 1;
            continue;
        }
        match text.get(i + 1..i + 4) {
            Some(&[b'\\', ..]) => {
                out.push(b'\\');
                i += 2;
            }
            Some(&[a @ b'0'..=b'3', b @ b'0'..=b'7', c @ b'0'..=b'7']) => {
                out.push(((a - b'0') << 6) | ((b - b'0') << 3) | (c - b'0'));
                i += 4;
            }
            _ if text.get(i + 1) == Some(&b'\\') => {
                out.push(b'\\');
                i += 2;
            }
            _ => return Err(format!("bad escape sequence at byte {i}")),
        }
    }
    Ok(Bytes::from(out))
}

/// Writes `s` as a JSON string literal.
fn put_json_string<B: BufMut>(out: &mut B, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    out.put_u8(b'"');
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0..=0x1f => {
                out.put_slice(&bytes[start..i]);
                out.put_slice(b"\\u00");
                out.put_u8(HEX[usize::from(b >> 4)]);
                out.put_u8(HEX[usize::from(b & 0xf)]);
                start = i + 1;
                continue;
            }
            _ => continue,
        };
        out.put_slice(&bytes[start..i]);
        out.put_slice(escape);
        start = i + 1;
    }
    out.put_slice(&bytes[start..]);
    out.put_u8(b'"');
}

fn put_json_string_or_null<B: BufMut>(out: &mut B, value: Option<&[u8]>) -> Result<(), String> {
    match value {
        None => out.put_slice(b"null"),
        Some(v) => put_json_string(out, std::str::from_utf8(v).map_err(|e| e.to_string())?),
    }
    Ok(())
}

/// `{"event_id":…,"event_type":…,"schema_version":…,"occurred_at":…,"producer":…,"payload":…}`
fn build_envelope(
    envelope: &Envelope,
    event_id: &[u8],
    event_type: Option<&[u8]>,
    occurred_at: Option<&[u8]>,
    payload: &[u8],
    format: PayloadFormat,
) -> Result<Bytes, String> {
    let strings = event_id.len() + event_type.map_or(4, <[u8]>::len) + RFC3339_LEN;
    let constants = envelope.producer.len() + envelope.schema_version.len();
    let mut out = BytesMut::with_capacity(96 + strings + constants + payload.len());
    out.put_slice(b"{\"event_id\":");
    put_json_string_or_null(&mut out, Some(event_id))
        .map_err(|e| format!("event id is not UTF-8: {e}"))?;
    out.put_slice(b",\"event_type\":");
    put_json_string_or_null(&mut out, event_type)
        .map_err(|e| format!("event type is not UTF-8: {e}"))?;
    out.put_slice(b",\"schema_version\":");
    out.put_slice(&envelope.schema_version);
    out.put_slice(b",\"occurred_at\":");
    put_json_string_or_null(&mut out, occurred_at)?;
    out.put_slice(b",\"producer\":");
    out.put_slice(&envelope.producer);
    out.put_slice(b",\"payload\":");
    match format {
        PayloadFormat::Json => out.put_slice(payload),
        PayloadFormat::Text | PayloadFormat::ByteaText | PayloadFormat::Raw => {
            let text = std::str::from_utf8(payload).map_err(|e| {
                format!(
                    "payload is not UTF-8, so the JSON envelope cannot embed it as a string: {e}"
                )
            })?;
            put_json_string(&mut out, text);
        }
    }
    out.put_u8(b'}');
    Ok(out.freeze())
}

// ---------------------------------------------------------------------------
// The row's headers object
// ---------------------------------------------------------------------------

/// Appends the entries of a JSON object as headers, in document order: string
/// values as their (unescaped) string, other values as their JSON text, sliced
/// from the input without copying.
fn parse_header_object(text: &Bytes, out: &mut Vec<(HeaderName, Bytes)>) -> Result<(), String> {
    // serde_json validates (no allocation); the scan below then only has to find
    // token boundaries, and still checks every index it uses.
    serde_json::from_slice::<serde::de::IgnoredAny>(text)
        .map_err(|e| format!("not valid JSON: {e}"))?;
    let b: &[u8] = text;
    let mut i = skip_ws(b, 0);
    match b.get(i) {
        Some(b'{') => i += 1,
        other => {
            let kind = match other {
                Some(b'[') => "an array",
                Some(b'"') => "a string",
                Some(b'n') => "null",
                Some(b't' | b'f') => "a boolean",
                _ => "a number",
            };
            return Err(format!("must be a JSON object, is {kind}"));
        }
    }
    i = skip_ws(b, i);
    if b.get(i) == Some(&b'}') {
        return Ok(());
    }
    loop {
        let (key_end, key_escaped) = scan_string(b, i)?;
        let name = json_string_value(text, i, key_end, key_escaped)?;
        let name =
            String::from_utf8(name.to_vec()).map_err(|e| format!("key is not UTF-8: {e}"))?;
        if RESERVED_HEADERS.contains(&name.as_str()) {
            return Err(format!(
                "key {name:?} is a header the relay sets itself (reserved: {})",
                RESERVED_HEADERS.join(", ")
            ));
        }
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return Err(format!("expected ':' at byte {i}"));
        }
        i = skip_ws(b, i + 1);
        let value = if b.get(i) == Some(&b'"') {
            let (end, escaped) = scan_string(b, i)?;
            let v = json_string_value(text, i, end, escaped)?;
            i = end;
            v
        } else {
            let (end, next) = skip_value(b, i)?;
            let v = text.slice(i..end);
            i = next;
            v
        };
        out.push((Cow::Owned(name), value));
        i = skip_ws(b, i);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => return Ok(()),
            _ => return Err(format!("expected ',' or '}}' at byte {i}")),
        }
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// `b[start]` is `"`; returns the index just past the closing quote and whether
/// the string has escapes.
fn scan_string(b: &[u8], start: usize) -> Result<(usize, bool), String> {
    if b.get(start) != Some(&b'"') {
        return Err(format!("expected a string at byte {start}"));
    }
    let mut i = start + 1;
    let mut escaped = false;
    loop {
        match b.get(i) {
            None => return Err("unterminated string".into()),
            Some(b'\\') => {
                escaped = true;
                i += 2;
            }
            Some(b'"') => return Ok((i + 1, escaped)),
            Some(_) => i += 1,
        }
    }
}

/// The value of the string token `text[start..end]`: a zero-copy slice unless it
/// has escapes.
fn json_string_value(
    text: &Bytes,
    start: usize,
    end: usize,
    escaped: bool,
) -> Result<Bytes, String> {
    if !escaped {
        return text
            .get(start + 1..end - 1)
            .map(|_| text.slice(start + 1..end - 1))
            .ok_or_else(|| "bad string bounds".to_owned());
    }
    let token = text.get(start..end).ok_or("bad string bounds")?;
    serde_json::from_slice::<String>(token)
        .map(Bytes::from)
        .map_err(|e| format!("bad string: {e}"))
}

/// Skips a non-string JSON value starting at `start`; returns the end of the
/// value (trailing whitespace excluded) and the index of the `,` or `}` after it.
fn skip_value(b: &[u8], start: usize) -> Result<(usize, usize), String> {
    let mut depth = 0usize;
    let mut i = start;
    let mut end = start;
    loop {
        match b.get(i) {
            None => return Err("unterminated value".into()),
            Some(b'"') => {
                i = scan_string(b, i)?.0;
                end = i;
                continue;
            }
            Some(b'{' | b'[') => depth += 1,
            Some(b'}' | b']') if depth == 0 => return Ok((end, i)),
            Some(b'}' | b']') => depth -= 1,
            Some(b',') if depth == 0 => return Ok((end, i)),
            Some(b' ' | b'\t' | b'\n' | b'\r') => {
                i += 1;
                continue;
            }
            Some(_) => {}
        }
        i += 1;
        end = i;
    }
}

// ---------------------------------------------------------------------------
// Timestamps
// ---------------------------------------------------------------------------

/// Length of `YYYY-MM-DDTHH:MM:SS.ffffffZ`.
const RFC3339_LEN: usize = 27;
/// 0001-01-01T00:00:00Z in Unix microseconds.
const MIN_MICROS: i64 = -62_135_596_800_000_000;
/// 9999-12-31T23:59:59.999999Z in Unix microseconds.
const MAX_MICROS: i64 = 253_402_300_799_999_999;
const MICROS_PER_SECOND: i64 = 1_000_000;
const SECONDS_PER_DAY: i64 = 86_400;

/// Why a `created_at` text is not a usable timestamp.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "timestamp {input:?} {reason} (expected PostgreSQL ISO output like 2026-11-30 14:29:33.123456+00, years 1-9999)"
)]
pub struct TimestampError {
    input: String,
    reason: &'static str,
}

impl TimestampError {
    /// What is wrong with the input.
    #[must_use]
    pub fn reason(&self) -> &'static str {
        self.reason
    }
}

/// Parses PostgreSQL's ISO text output of `timestamptz` (`DateStyle=ISO`) or
/// `timestamp` into Unix microseconds: `YYYY-MM-DD HH:MM:SS[.f{1,6}][±HH[:MM[:SS]]]`.
/// Without an offset (`timestamp without time zone`) the value is taken as UTC;
/// `T` is accepted for the space and `Z` for `+00`.
///
/// # Errors
///
/// Anything else, including `infinity`, `-infinity`, BC dates and years past 9999
/// (which RFC 3339 cannot express), and values that fall outside years 1–9999
/// once converted to UTC.
pub fn parse_pg_timestamp(text: &[u8]) -> Result<i64, TimestampError> {
    let err = |reason: &'static str| TimestampError {
        input: String::from_utf8_lossy(&text[..text.len().min(64)]).into_owned(),
        reason,
    };
    match text {
        b"infinity" | b"-infinity" => return Err(err("is infinite")),
        _ if text.ends_with(b" BC") => return Err(err("is a BC date")),
        _ => {}
    }
    let mut c = Cursor { b: text, i: 0 };
    let year_digits = c.b.iter().take_while(|b| b.is_ascii_digit()).count();
    if year_digits > 4 {
        return Err(err("has a year past 9999"));
    }
    let year = c.digits(4).ok_or_else(|| err("has no 4-digit year"))?;
    c.expect(b'-')
        .ok_or_else(|| err("is malformed after the year"))?;
    let month = c.digits(2).ok_or_else(|| err("has no 2-digit month"))?;
    c.expect(b'-')
        .ok_or_else(|| err("is malformed after the month"))?;
    let day = c.digits(2).ok_or_else(|| err("has no 2-digit day"))?;
    if year == 0 {
        return Err(err("has year 0"));
    }
    if !(1..=12).contains(&month) || day < 1 || day > days_in_month(year, month) {
        return Err(err("has no such date"));
    }
    match c.bump() {
        Some(b' ' | b'T') => {}
        _ => return Err(err("has no time after the date")),
    }
    let hour = c.digits(2).ok_or_else(|| err("has no 2-digit hour"))?;
    c.expect(b':')
        .ok_or_else(|| err("is malformed after the hour"))?;
    let minute = c.digits(2).ok_or_else(|| err("has no 2-digit minute"))?;
    c.expect(b':')
        .ok_or_else(|| err("is malformed after the minute"))?;
    let second = c.digits(2).ok_or_else(|| err("has no 2-digit second"))?;
    if hour > 23 || minute > 59 || second > 59 {
        return Err(err("has no such time of day"));
    }
    let mut micros = 0;
    if c.peek() == Some(b'.') {
        c.i += 1;
        let n = c.b[c.i..].iter().take_while(|b| b.is_ascii_digit()).count();
        if n == 0 || n > 6 {
            return Err(err("has a fraction of other than 1 to 6 digits"));
        }
        micros = c.digits(n).ok_or_else(|| err("has a bad fraction"))?;
        for _ in n..6 {
            micros *= 10;
        }
    }
    let offset_seconds = match c.bump() {
        None => 0,
        Some(b'Z') => 0,
        Some(sign @ (b'+' | b'-')) => {
            let h = c
                .digits(2)
                .ok_or_else(|| err("has a malformed UTC offset"))?;
            let mut m = 0;
            let mut s = 0;
            if c.peek() == Some(b':') {
                c.i += 1;
                m = c
                    .digits(2)
                    .ok_or_else(|| err("has a malformed UTC offset"))?;
                if c.peek() == Some(b':') {
                    c.i += 1;
                    s = c
                        .digits(2)
                        .ok_or_else(|| err("has a malformed UTC offset"))?;
                }
            }
            if h > 15 || m > 59 || s > 59 {
                return Err(err("has a UTC offset out of range"));
            }
            let total = h * 3600 + m * 60 + s;
            if sign == b'-' { -total } else { total }
        }
        Some(_) => return Err(err("has unexpected characters after the time")),
    };
    if c.peek().is_some() {
        return Err(err("has trailing characters"));
    }
    let days = days_from_civil(year, month, day);
    let seconds = days * SECONDS_PER_DAY + hour * 3600 + minute * 60 + second - offset_seconds;
    let unix_micros = seconds * MICROS_PER_SECOND + micros;
    if !(MIN_MICROS..=MAX_MICROS).contains(&unix_micros) {
        return Err(err("is outside years 1-9999 in UTC"));
    }
    Ok(unix_micros)
}

/// Formats Unix microseconds as RFC 3339 in UTC with microseconds,
/// `2026-11-30T14:29:33.123456Z`; `None` outside years 1–9999.
#[must_use]
pub fn format_rfc3339(unix_micros: i64) -> Option<String> {
    if !(MIN_MICROS..=MAX_MICROS).contains(&unix_micros) {
        return None;
    }
    let mut buf = Vec::with_capacity(RFC3339_LEN);
    put_rfc3339(&mut buf, unix_micros);
    String::from_utf8(buf).ok()
}

/// Writes RFC 3339 for `unix_micros`, which the caller has range-checked.
fn put_rfc3339<B: BufMut>(out: &mut B, unix_micros: i64) {
    let seconds = unix_micros.div_euclid(MICROS_PER_SECOND);
    let days = seconds.div_euclid(SECONDS_PER_DAY);
    let (year, month, day) = civil_from_days(days);
    // All in range for u32 after the caller's check (years 1..=9999).
    let [year, month, day] = [year, month, day].map(|v| u32::try_from(v).unwrap_or(0));
    let micros = u32::try_from(unix_micros.rem_euclid(MICROS_PER_SECOND)).unwrap_or(0);
    let secs_of_day = u32::try_from(seconds.rem_euclid(SECONDS_PER_DAY)).unwrap_or(0);
    let mut buf = *b"0000-00-00T00:00:00.000000Z";
    let mut put = |end: usize, width: usize, mut v: u32| {
        for slot in buf[end - width..end].iter_mut().rev() {
            *slot = b'0' + (v % 10) as u8;
            v /= 10;
        }
    };
    put(4, 4, year);
    put(7, 2, month);
    put(10, 2, day);
    put(13, 2, secs_of_day / 3600);
    put(16, 2, secs_of_day / 60 % 60);
    put(19, 2, secs_of_day % 60);
    put(26, 6, micros);
    out.put_slice(&buf);
}

/// Writes an LSN as PostgreSQL prints it, `X/Y` in upper-case hex.
fn put_lsn<B: BufMut>(out: &mut B, lsn: Lsn) {
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

struct Cursor<'a> {
    b: &'a [u8],
    i: usize,
}

impl Cursor<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn bump(&mut self) -> Option<u8> {
        let c = self.peek()?;
        self.i += 1;
        Some(c)
    }

    fn expect(&mut self, want: u8) -> Option<()> {
        (self.bump()? == want).then_some(())
    }

    /// Exactly `n` ASCII digits as a number.
    fn digits(&mut self, n: usize) -> Option<i64> {
        let s = self.b.get(self.i..self.i + n)?;
        let mut v = 0i64;
        for &d in s {
            if !d.is_ascii_digit() {
                return None;
            }
            v = v * 10 + i64::from(d - b'0');
        }
        self.i += n;
        Some(v)
    }
}

fn is_leap(year: i64) -> bool {
    (year % 4 == 0 && year % 100 != 0) || year % 400 == 0
}

fn days_in_month(year: i64, month: i64) -> i64 {
    match month {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if is_leap(year) => 29,
        2 => 28,
        _ => 0,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date of a day count since 1970-01-01 (inverse of [`days_from_civil`]).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Columns;
    use crate::postgres::pgoutput::RelationColumn;
    use proptest::prelude::*;

    const REL: u32 = 16_385;
    const LSN: Lsn = Lsn(0x16_B374_D848);

    fn col(name: &str, type_oid: u32) -> RelationColumn {
        RelationColumn {
            flags: 0,
            name: name.into(),
            type_oid,
            type_modifier: -1,
        }
    }

    fn relation(id: u32, namespace: &str, name: &str, columns: Vec<RelationColumn>) -> Relation {
        Relation {
            xid: None,
            id,
            namespace: namespace.into(),
            name: name.into(),
            replica_identity: b'd',
            columns,
        }
    }

    /// The table of migrations/0001_outbox.sql, in column order.
    fn migration_columns() -> Vec<RelationColumn> {
        vec![
            col("id", OID_UUID),
            col("idempotency_key", OID_TEXT),
            col("aggregate_type", OID_TEXT),
            col("aggregate_id", OID_TEXT),
            col("event_type", OID_TEXT),
            col("topic", OID_TEXT),
            col("headers", OID_JSONB),
            col("payload", OID_JSONB),
            col("created_at", OID_TIMESTAMPTZ),
            col("sent_at", OID_TIMESTAMPTZ),
            col("attempts", OID_INT4),
            col("last_error", OID_TEXT),
        ]
    }

    fn outbox_relation() -> Relation {
        relation(REL, "public", "outbox", migration_columns())
    }

    fn text(s: &str) -> ColumnValue {
        ColumnValue::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    /// An Insert for `rel` with the named columns set and the others NULL.
    fn insert(rel: &Relation, values: &[(&str, ColumnValue)]) -> Insert {
        let columns = rel
            .columns
            .iter()
            .map(|c| {
                values
                    .iter()
                    .find(|(n, _)| *n == c.name)
                    .map_or(ColumnValue::Null, |(_, v)| v.clone())
            })
            .collect();
        Insert {
            xid: None,
            relation_id: rel.id,
            tuple: TupleData { columns },
        }
    }

    const ID: &str = "0193a5c4-7d1e-7c3a-9f6b-2d4e8a1b3c5d";
    const PAYLOAD: &str =
        r#"{"total": 1.10, "items": [1, 2], "big": 123456789012345678901234567890}"#;

    /// A typical row of the migration table.
    fn good_values() -> Vec<(&'static str, ColumnValue)> {
        vec![
            ("id", text(ID)),
            ("idempotency_key", text("order-42-created")),
            ("aggregate_type", text("Order")),
            ("aggregate_id", text("42")),
            ("event_type", text("OrderCreated")),
            ("payload", text(PAYLOAD)),
            ("created_at", text("2026-11-30 14:29:33.123456+00")),
            ("attempts", text("0")),
        ]
    }

    fn with(
        mut values: Vec<(&'static str, ColumnValue)>,
        name: &'static str,
        v: ColumnValue,
    ) -> Vec<(&'static str, ColumnValue)> {
        values.retain(|(n, _)| *n != name);
        values.push((name, v));
        values
    }

    fn mapper_with(template: &str, envelope: Option<EnvelopeConfig>) -> OutboxMapper {
        let mut m =
            OutboxMapper::with_template(&OutboxConfig::default(), template, envelope).unwrap();
        assert_eq!(m.on_relation(&outbox_relation()), RelationStatus::Outbox);
        m
    }

    fn mapper() -> OutboxMapper {
        mapper_with("outbox.event.{aggregate_type}", None)
    }

    fn map(m: &OutboxMapper, values: &[(&str, ColumnValue)]) -> Mapped {
        m.map_insert(&insert(&outbox_relation(), values), LSN)
            .unwrap()
    }

    fn event(mapped: Mapped) -> OutboxEvent {
        match mapped {
            Mapped::Event(e) => e,
            other => panic!("expected an event, got {other:?}"),
        }
    }

    fn unmappable(mapped: Mapped) -> UnmappableRow {
        match mapped {
            Mapped::Unmappable(u) => u,
            other => panic!("expected an unmappable row, got {other:?}"),
        }
    }

    fn header_list(e: &OutboxEvent) -> Vec<(String, String)> {
        e.headers
            .iter()
            .map(|(n, v)| (n.to_string(), String::from_utf8_lossy(v).into_owned()))
            .collect()
    }

    fn pairs(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(a, b)| ((*a).to_owned(), (*b).to_owned()))
            .collect()
    }

    // ---- the record contract ----

    #[test]
    fn row_maps_to_the_record_contract() {
        let e = event(map(&mapper(), &good_values()));
        assert_eq!(e.key, "42");
        assert_eq!(e.topic, "outbox.event.Order");
        assert_eq!(
            e.payload, PAYLOAD,
            "payload bytes are passed through verbatim"
        );
        assert_eq!(
            header_list(&e),
            pairs(&[
                ("idempotency_key", "order-42-created"),
                ("event_type", "OrderCreated"),
                ("aggregate_type", "Order"),
                ("occurred_at", "2026-11-30T14:29:33.123456Z"),
                ("source_lsn", "16/B374D848"),
            ])
        );
        assert_eq!(e.timestamp_ms, Some(1_796_048_973_123));
        assert_eq!(e.idempotency_key, "order-42-created");
        assert_eq!(e.event_id, ID);
        assert_eq!(e.source_lsn, Some(LSN));
        let headers: usize = e.headers.iter().map(|(n, v)| n.len() + v.len()).sum();
        assert_eq!(e.byte_size(), 2 + PAYLOAD.len() + headers);
        assert!(e.headers.iter().all(|(n, _)| matches!(n, Cow::Borrowed(_))));
    }

    #[test]
    fn key_payload_and_header_values_are_slices_of_the_message() {
        let buf = Bytes::from_static(b"42Order{\"a\":1}key-1OrderCreated");
        let values = vec![
            ("aggregate_id", ColumnValue::Text(buf.slice(0..2))),
            ("aggregate_type", ColumnValue::Text(buf.slice(2..7))),
            ("payload", ColumnValue::Text(buf.slice(7..14))),
            ("idempotency_key", ColumnValue::Text(buf.slice(14..19))),
            ("event_type", ColumnValue::Text(buf.slice(19..31))),
        ];
        let e = event(map(&mapper(), &values));
        let inside = |b: &Bytes| {
            let start = buf.as_ptr() as usize;
            let p = b.as_ptr() as usize;
            p >= start && p + b.len() <= start + buf.len()
        };
        assert!(inside(&e.key) && inside(&e.payload) && inside(&e.idempotency_key));
        assert!(e.headers[..3].iter().all(|(_, v)| inside(v)));
    }

    #[test]
    fn optional_columns_null_leave_their_headers_out() {
        let values = vec![
            ("idempotency_key", text("k")),
            ("aggregate_type", text("Order")),
            ("aggregate_id", text("42")),
            ("payload", text("{}")),
        ];
        let e = event(map(&mapper(), &values));
        assert_eq!(
            header_list(&e),
            pairs(&[
                ("idempotency_key", "k"),
                ("aggregate_type", "Order"),
                ("source_lsn", "16/B374D848"),
            ])
        );
        assert_eq!(e.timestamp_ms, None);
        assert_eq!(e.event_id, "k", "without an id the event id is the key");
    }

    #[test]
    fn other_relations_are_not_outbox_and_unknown_ones_are_protocol_errors() {
        let mut m = mapper();
        let other = relation(7, "public", "orders", vec![col("id", OID_INT8)]);
        assert_eq!(m.on_relation(&other), RelationStatus::NotOutbox);
        let elsewhere = relation(8, "app", "outbox", migration_columns());
        assert_eq!(m.on_relation(&elsewhere), RelationStatus::NotOutbox);
        let catalog = relation(9, "", "outbox", migration_columns());
        assert_eq!(m.on_relation(&catalog), RelationStatus::NotOutbox);
        assert_eq!(
            m.map_insert(&insert(&other, &[("id", text("1"))]), LSN),
            Ok(Mapped::NotOutbox)
        );
        assert_eq!(
            m.map_insert(&insert(&elsewhere, &good_values()), LSN),
            Ok(Mapped::NotOutbox)
        );
        let unknown = Insert {
            xid: None,
            relation_id: 99,
            tuple: TupleData::default(),
        };
        let err = m.map_insert(&unknown, LSN).unwrap_err();
        assert_eq!(err, MapError::UnknownRelation { relation_id: 99 });
        assert!(
            err.to_string().contains("before any Relation message"),
            "{err}"
        );
        assert_eq!(m.relation_status(99), None);
        assert_eq!(m.relation_status(7), Some(RelationStatus::NotOutbox));

        let mut short = insert(&outbox_relation(), &good_values());
        short.tuple.columns.pop();
        assert_eq!(
            m.map_insert(&short, LSN),
            Err(MapError::ColumnCount {
                relation_id: REL,
                expected: 12,
                actual: 11
            })
        );

        m.reset_session();
        assert!(matches!(
            m.map_insert(&insert(&outbox_relation(), &good_values()), LSN),
            Err(MapError::UnknownRelation { .. })
        ));
    }

    #[test]
    fn configured_table_with_and_without_schema() {
        let config = OutboxConfig {
            table: "app.events".into(),
            ..OutboxConfig::default()
        };
        let mut m = OutboxMapper::with_template(&config, "t", None).unwrap();
        let rel = relation(1, "app", "events", migration_columns());
        assert_eq!(m.on_relation(&rel), RelationStatus::Outbox);
        assert_eq!(
            m.on_relation(&relation(2, "public", "events", migration_columns())),
            RelationStatus::NotOutbox
        );
        assert!(matches!(
            m.map_insert(&insert(&rel, &good_values()), LSN),
            Ok(Mapped::Event(_))
        ));

        let config = OutboxConfig {
            table: "events".into(),
            ..OutboxConfig::default()
        };
        let mut m = OutboxMapper::with_template(&config, "t", None).unwrap();
        assert_eq!(
            m.on_relation(&relation(2, "public", "events", migration_columns())),
            RelationStatus::Outbox
        );
        let bad = OutboxConfig {
            table: "a.b.c".into(),
            ..OutboxConfig::default()
        };
        assert!(OutboxMapper::with_template(&bad, "t", None).is_err());
    }

    // ---- column names and aliases ----

    #[test]
    fn debezium_column_names_are_accepted() {
        let mut m = mapper();
        let rel = relation(
            REL,
            "public",
            "outbox",
            vec![
                col("id", OID_UUID),
                col("aggregatetype", OID_VARCHAR),
                col("aggregateid", OID_VARCHAR),
                col("type", OID_VARCHAR),
                col("payload", OID_JSONB),
            ],
        );
        assert_eq!(m.on_relation(&rel), RelationStatus::Outbox);
        let values = [
            ("id", text(ID)),
            ("aggregatetype", text("Order")),
            ("aggregateid", text("42")),
            ("type", text("OrderCreated")),
            ("payload", text(PAYLOAD)),
        ];
        let e = event(m.map_insert(&insert(&rel, &values), LSN).unwrap());
        assert_eq!(e.key, "42");
        assert_eq!(e.topic, "outbox.event.Order", "Debezium's default route");
        assert_eq!(e.payload, PAYLOAD);
        assert_eq!(
            header_list(&e),
            pairs(&[
                ("idempotency_key", ID),
                ("event_type", "OrderCreated"),
                ("aggregate_type", "Order"),
                ("source_lsn", "16/B374D848"),
            ])
        );
        // Messages name the column actually used.
        let u = unmappable(
            m.map_insert(
                &insert(&rel, &[("id", text(ID)), ("payload", text("{}"))]),
                LSN,
            )
            .unwrap(),
        );
        assert_eq!(u.error_kind, error_kind::NULL_KEY);
        assert!(
            u.reason.contains("aggregate_id column \"aggregateid\""),
            "{}",
            u.reason
        );
        assert_eq!(
            u.fields.columns,
            vec![
                ("id".to_owned(), Some(ID.to_owned())),
                ("aggregatetype".to_owned(), None),
                ("aggregateid".to_owned(), None),
                ("type".to_owned(), None),
                ("payload".to_owned(), Some("{}".to_owned())),
            ]
        );
    }

    #[test]
    fn configured_name_wins_over_alias() {
        let mut m = mapper();
        let rel = relation(
            REL,
            "public",
            "outbox",
            vec![
                col("id", OID_UUID),
                col("aggregate_id", OID_TEXT),
                col("aggregateid", OID_TEXT),
                col("payload", OID_JSONB),
                col("aggregate_type", OID_TEXT),
            ],
        );
        m.on_relation(&rel);
        let values = [
            ("id", text(ID)),
            ("aggregate_id", text("configured")),
            ("aggregateid", text("alias")),
            ("payload", text("{}")),
            ("aggregate_type", text("A")),
        ];
        assert_eq!(
            event(m.map_insert(&insert(&rel, &values), LSN).unwrap()).key,
            "configured"
        );
    }

    #[test]
    fn custom_column_names_from_config() {
        let config = OutboxConfig {
            table: "public.events".into(),
            columns: Columns {
                id: "event_uuid".into(),
                idempotency_key: "dedupe".into(),
                aggregate_type: "entity".into(),
                aggregate_id: "entity_id".into(),
                event_type: "kind".into(),
                topic: "destination".into(),
                headers: "meta".into(),
                payload: "body".into(),
                created_at: "ts".into(),
            },
            ..OutboxConfig::default()
        };
        let m = OutboxMapper::with_template(&config, "{entity}", None).unwrap_err();
        assert!(m.to_string().contains("{entity}"), "{m}");
        let mut m =
            OutboxMapper::with_template(&config, "ev.{aggregate_type}.{event_type}", None).unwrap();
        let rel = relation(
            3,
            "public",
            "events",
            vec![
                col("body", OID_JSON),
                col("entity_id", OID_INT8),
                col("kind", OID_VARCHAR),
                col("entity", OID_BPCHAR),
                col("event_uuid", OID_UUID),
                col("dedupe", OID_TEXT),
                col("meta", OID_JSON),
                col("ts", OID_TIMESTAMP),
                col("destination", OID_VARCHAR),
            ],
        );
        assert_eq!(m.on_relation(&rel), RelationStatus::Outbox);
        let values = [
            ("body", text("[1,2]")),
            ("entity_id", text("9000000000")),
            ("kind", text("Shipped")),
            ("entity", text("Parcel")),
            ("event_uuid", text(ID)),
            ("dedupe", text("d-1")),
            ("meta", text(r#"{"trace": "abc"}"#)),
            ("ts", text("2026-01-02 03:04:05")),
        ];
        let e = event(m.map_insert(&insert(&rel, &values), LSN).unwrap());
        assert_eq!(e.key, "9000000000");
        assert_eq!(e.topic, "ev.Parcel.Shipped");
        assert_eq!(e.payload, "[1,2]");
        assert_eq!(
            header_list(&e),
            pairs(&[
                ("idempotency_key", "d-1"),
                ("event_type", "Shipped"),
                ("aggregate_type", "Parcel"),
                ("occurred_at", "2026-01-02T03:04:05.000000Z"),
                ("source_lsn", "16/B374D848"),
                ("trace", "abc"),
            ])
        );
        let p = e.poison_fields();
        assert!(
            p.columns
                .contains(&("dedupe".to_owned(), Some("d-1".to_owned()))),
            "{p:?}"
        );
    }

    #[test]
    fn alter_table_relation_replaces_the_entry() {
        let mut m = mapper_with("outbox.{event_type}", None);
        // After ALTER TABLE: columns reordered (drop + re-add) and a new one.
        let mut columns = migration_columns();
        columns.reverse();
        columns.push(col("tenant", OID_TEXT));
        let altered = relation(REL, "public", "outbox", columns);
        assert_eq!(m.on_relation(&altered), RelationStatus::Outbox);
        let mut values = good_values();
        values.push(("tenant", text("t1")));
        let e = event(m.map_insert(&insert(&altered, &values), LSN).unwrap());
        assert_eq!(e.key, "42");
        assert_eq!(e.topic, "outbox.OrderCreated");
        // The old layout no longer matches.
        assert!(matches!(
            m.map_insert(&insert(&outbox_relation(), &good_values()), LSN),
            Err(MapError::ColumnCount { .. })
        ));

        // ALTER COLUMN aggregate_id TYPE boolean: every insert is unmappable...
        let mut columns = migration_columns();
        columns[3] = col("aggregate_id", 16);
        let broken = relation(REL, "public", "outbox", columns);
        let status = m.on_relation(&broken);
        let RelationStatus::Unmappable { error_kind, reason } = status else {
            panic!("{status:?}");
        };
        assert_eq!(error_kind, error_kind::BAD_COLUMN_TYPE);
        assert!(
            reason.contains("aggregate_id column \"aggregate_id\" has type bool (oid 16)"),
            "{reason}"
        );
        let u = unmappable(m.map_insert(&insert(&broken, &good_values()), LSN).unwrap());
        assert_eq!(u.error_kind, error_kind::BAD_COLUMN_TYPE);
        // ...until it is fixed.
        assert_eq!(m.on_relation(&outbox_relation()), RelationStatus::Outbox);
        assert!(matches!(map(&m, &good_values()), Mapped::Event(_)));
    }

    // ---- type validation ----

    #[test]
    fn column_types_are_validated_at_relation_time() {
        let cases: [(&str, u32, &str); 7] = [
            (
                "aggregate_id",
                16,
                "expected one of text, varchar, bpchar, uuid, int8, int4, int2",
            ),
            ("idempotency_key", OID_JSONB, "has type jsonb (oid 3802)"),
            (
                "aggregate_type",
                OID_INT4,
                "expected one of text, varchar, bpchar",
            ),
            ("headers", OID_TEXT, "expected one of jsonb, json"),
            (
                "payload",
                OID_INT4,
                "expected one of jsonb, json, text, varchar, bpchar, bytea",
            ),
            (
                "created_at",
                1082,
                "has type date (oid 1082), expected one of timestamptz, timestamp",
            ),
            ("topic", 99_999, "has type oid 99999 (oid 99999)"),
        ];
        for (name, oid, expected) in cases {
            let mut m = mapper();
            let columns = migration_columns()
                .into_iter()
                .map(|c| if c.name == name { col(name, oid) } else { c })
                .collect();
            let rel = relation(REL, "public", "outbox", columns);
            let status = m.on_relation(&rel);
            assert!(
                matches!(status, RelationStatus::Unmappable { error_kind: error_kind::BAD_COLUMN_TYPE, reason } if reason.contains(expected) && reason.contains(name)),
                "{name}: {status:?}"
            );
            let u = unmappable(m.map_insert(&insert(&rel, &good_values()), LSN).unwrap());
            assert_eq!(u.error_kind, error_kind::BAD_COLUMN_TYPE);
            assert!(
                u.reason.contains("outbox table public.outbox"),
                "{}",
                u.reason
            );
            // The poison row still has every column.
            assert_eq!(u.fields.columns.len(), 12);
            assert_eq!(u.fields.lsn, Some(LSN));
        }
    }

    #[test]
    fn missing_required_columns() {
        let drop = |names: &[&str]| {
            relation(
                REL,
                "public",
                "outbox",
                migration_columns()
                    .into_iter()
                    .filter(|c| !names.contains(&c.name.as_str()))
                    .collect(),
            )
        };
        for (dropped, expected) in [
            (
                &["aggregate_id"][..],
                "no aggregate_id column \"aggregate_id\" (or \"aggregateid\")",
            ),
            (&["payload"][..], "no payload column \"payload\""),
            (
                &["id", "idempotency_key"][..],
                "no idempotency_key column \"idempotency_key\" or id column \"id\"",
            ),
        ] {
            let mut m = mapper();
            let rel = drop(dropped);
            let status = m.on_relation(&rel);
            assert!(
                matches!(status, RelationStatus::Unmappable { error_kind: error_kind::MISSING_COLUMN, reason } if reason.contains(expected)),
                "{dropped:?}: {status:?}"
            );
            let u = unmappable(m.map_insert(&insert(&rel, &good_values()), LSN).unwrap());
            assert_eq!(u.error_kind, error_kind::MISSING_COLUMN);
            assert_eq!(u.fields.columns.len(), rel.columns.len());
        }

        // Missing and wrongly typed at once: both are named.
        let mut m = mapper();
        let mut rel = drop(&["payload"]);
        rel.columns[3] = col("aggregate_id", 16);
        let Some(RelationStatus::Unmappable { error_kind, reason }) = Some(m.on_relation(&rel))
        else {
            panic!()
        };
        assert_eq!(error_kind, error_kind::MISSING_COLUMN);
        assert!(
            reason.contains("payload") && reason.contains("type bool"),
            "{reason}"
        );

        // Only id, no idempotency_key: the id is the key. Optional columns may go.
        let mut m = mapper_with("fixed", None);
        let rel = drop(&[
            "idempotency_key",
            "topic",
            "headers",
            "created_at",
            "event_type",
            "aggregate_type",
        ]);
        assert_eq!(m.on_relation(&rel), RelationStatus::Outbox);
        let e = event(m.map_insert(&insert(&rel, &good_values()), LSN).unwrap());
        assert_eq!(e.idempotency_key, ID);
        assert_eq!(e.topic, "fixed");
        assert_eq!(
            header_list(&e),
            pairs(&[("idempotency_key", ID), ("source_lsn", "16/B374D848")])
        );
    }

    // ---- row values ----

    #[test]
    fn null_or_empty_key_and_null_payload_are_unmappable() {
        let m = mapper();
        let u = unmappable(map(
            &m,
            &with(good_values(), "aggregate_id", ColumnValue::Null),
        ));
        assert_eq!(u.error_kind, error_kind::NULL_KEY);
        assert!(
            u.reason
                .contains("aggregate_id column \"aggregate_id\" is NULL"),
            "{}",
            u.reason
        );
        let u = unmappable(map(&m, &with(good_values(), "aggregate_id", text(""))));
        assert_eq!(u.error_kind, error_kind::EMPTY_KEY);
        let u = unmappable(map(&m, &with(good_values(), "payload", ColumnValue::Null)));
        assert_eq!(u.error_kind, error_kind::NULL_PAYLOAD);
        assert!(
            u.reason.contains("payload column \"payload\" is NULL"),
            "{}",
            u.reason
        );

        // The poison data of a rejected row.
        let f = unmappable(map(
            &m,
            &with(good_values(), "aggregate_id", ColumnValue::Null),
        ))
        .fields;
        assert_eq!(f.outbox_id.as_deref(), Some(ID));
        assert_eq!(f.idempotency_key.as_deref(), Some("order-42-created"));
        assert_eq!(f.aggregate_type.as_deref(), Some("Order"));
        assert_eq!(f.aggregate_id, None);
        assert_eq!(f.event_type.as_deref(), Some("OrderCreated"));
        assert_eq!(f.topic, None);
        assert_eq!(f.headers, None);
        assert_eq!(f.payload.as_deref(), Some(PAYLOAD));
        assert_eq!(f.created_at.as_deref(), Some("2026-11-30T14:29:33.123456Z"));
        assert_eq!(f.lsn, Some(LSN));
        assert_eq!(f.columns.len(), 12);
        assert_eq!(f.columns[0], ("id".to_owned(), Some(ID.to_owned())));
        assert_eq!(f.columns[3], ("aggregate_id".to_owned(), None));
        assert_eq!(f.columns[10], ("attempts".to_owned(), Some("0".to_owned())));
    }

    #[test]
    fn idempotency_key_falls_back_to_id() {
        let m = mapper();
        let e = event(map(
            &m,
            &with(good_values(), "idempotency_key", ColumnValue::Null),
        ));
        assert_eq!(e.idempotency_key, ID);
        assert_eq!(e.headers[0].1, ID);
        let values = with(
            with(good_values(), "idempotency_key", ColumnValue::Null),
            "id",
            ColumnValue::Null,
        );
        assert_eq!(
            unmappable(map(&m, &values)).error_kind,
            error_kind::NULL_IDEMPOTENCY_KEY
        );
        let u = unmappable(map(&m, &with(good_values(), "idempotency_key", text(""))));
        assert_eq!(u.error_kind, error_kind::EMPTY_IDEMPOTENCY_KEY);
        // id NULL, key present: the event id is the key.
        let e = event(map(&m, &with(good_values(), "id", ColumnValue::Null)));
        assert_eq!(e.event_id, "order-42-created");
    }

    #[test]
    fn unchanged_toast_in_an_insert_is_unmappable() {
        let m = mapper();
        let u = unmappable(map(
            &m,
            &with(good_values(), "payload", ColumnValue::UnchangedToast),
        ));
        assert_eq!(u.error_kind, error_kind::UNCHANGED_TOAST);
        assert!(
            u.reason.contains("payload column \"payload\""),
            "{}",
            u.reason
        );
        assert_eq!(u.fields.payload, None);
        // In a column the mapper does not read it does not matter.
        assert!(matches!(
            map(
                &m,
                &with(good_values(), "last_error", ColumnValue::UnchangedToast)
            ),
            Mapped::Event(_)
        ));
    }

    #[test]
    fn binary_format_values() {
        let m = mapper();
        let bin = |b: &[u8]| ColumnValue::Binary(Bytes::copy_from_slice(b));
        // Text types: their bytes, if UTF-8.
        let e = event(map(
            &m,
            &with(good_values(), "aggregate_id", bin("ü-1".as_bytes())),
        ));
        assert_eq!(e.key, "ü-1");
        let u = unmappable(map(
            &m,
            &with(good_values(), "aggregate_id", bin(b"\xff\xfe")),
        ));
        assert_eq!(u.error_kind, error_kind::BAD_VALUE);
        assert!(u.reason.contains("not UTF-8"), "{}", u.reason);
        assert_eq!(u.fields.columns[3].1.as_deref(), Some("\\xfffe"));
        // jsonb: version byte 1, then the text.
        let e = event(map(
            &m,
            &with(good_values(), "payload", bin(b"\x01{\"a\": 1}")),
        ));
        assert_eq!(e.payload, "{\"a\": 1}");
        let u = unmappable(map(&m, &with(good_values(), "payload", bin(b"\x02{}"))));
        assert_eq!(u.error_kind, error_kind::BAD_VALUE);
        // uuid, timestamptz: no text form without copying → refused, clearly.
        let u = unmappable(map(&m, &with(good_values(), "id", bin(&[7; 16]))));
        assert_eq!(u.error_kind, error_kind::BAD_VALUE);
        assert!(
            u.reason.contains("binary-format values of type uuid"),
            "{}",
            u.reason
        );
        let u = unmappable(map(&m, &with(good_values(), "created_at", bin(&[0; 8]))));
        assert_eq!(u.error_kind, error_kind::BAD_VALUE);
    }

    #[test]
    fn bytea_payload_is_decoded_to_its_bytes() {
        let mut m = mapper();
        let mut columns = migration_columns();
        columns[7] = col("payload", OID_BYTEA);
        let rel = relation(REL, "public", "outbox", columns);
        assert_eq!(m.on_relation(&rel), RelationStatus::Outbox);
        let run = |v: ColumnValue| {
            m.map_insert(&insert(&rel, &with(good_values(), "payload", v)), LSN)
                .unwrap()
        };
        assert_eq!(event(run(text("\\x00ff41"))).payload, &b"\x00\xffA"[..]);
        assert_eq!(event(run(text("\\x"))).payload, "");
        assert_eq!(event(run(text("a\\\\b\\001"))).payload, &b"a\\b\x01"[..]);
        let e = event(run(ColumnValue::Binary(Bytes::from_static(b"\x00raw"))));
        assert_eq!(e.payload, &b"\x00raw"[..]);
        assert_eq!(e.poison_fields().payload.as_deref(), Some("\\x00726177"));
        for bad in ["\\x0", "\\xzz", "a\\9"] {
            let u = unmappable(run(text(bad)));
            assert_eq!(u.error_kind, error_kind::BAD_PAYLOAD, "{bad}");
            assert_eq!(u.fields.payload.as_deref(), Some(bad));
        }
    }

    #[test]
    fn text_payload_is_passed_through() {
        let mut m = mapper();
        let mut columns = migration_columns();
        columns[7] = col("payload", OID_TEXT);
        let rel = relation(REL, "public", "outbox", columns);
        m.on_relation(&rel);
        let values = with(good_values(), "payload", text("not json \"at all\""));
        let e = event(m.map_insert(&insert(&rel, &values), LSN).unwrap());
        assert_eq!(e.payload, "not json \"at all\"");
    }

    // ---- topic ----

    #[test]
    fn topic_column_wins_over_template() {
        let m = mapper();
        let e = event(map(&m, &with(good_values(), "topic", text("orders.v2"))));
        assert_eq!(e.topic, "orders.v2");
        // Empty or NULL: the template.
        let e = event(map(&m, &with(good_values(), "topic", text(""))));
        assert_eq!(e.topic, "outbox.event.Order");
        let e = event(map(&m, &with(good_values(), "topic", ColumnValue::Null)));
        assert_eq!(e.topic, "outbox.event.Order");
    }

    #[test]
    fn invalid_topics_are_unmappable() {
        let m = mapper();
        let long = "x".repeat(250);
        for bad in ["orders v2", ".", "..", "tópico", long.as_str(), "a/b"] {
            let u = unmappable(map(&m, &with(good_values(), "topic", text(bad))));
            assert_eq!(u.error_kind, error_kind::INVALID_TOPIC, "{bad}");
            assert!(u.reason.contains("topic column \"topic\""), "{}", u.reason);
            assert_eq!(u.fields.topic.as_deref(), Some(bad));
        }
        let ok = "x".repeat(249);
        assert_eq!(
            event(map(&m, &with(good_values(), "topic", text(&ok)))).topic,
            ok
        );

        // From the template.
        let u = unmappable(map(
            &m,
            &with(good_values(), "aggregate_type", text("Order Line")),
        ));
        assert_eq!(u.error_kind, error_kind::INVALID_TOPIC);
        assert!(
            u.reason
                .contains("aggregate_type \"Order Line\" contains ' '"),
            "{}",
            u.reason
        );
        let u = unmappable(map(
            &m,
            &with(good_values(), "aggregate_type", ColumnValue::Null),
        ));
        assert_eq!(u.error_kind, error_kind::INVALID_TOPIC);
        assert!(
            u.reason.contains("needs aggregate_type, which is NULL"),
            "{}",
            u.reason
        );
        let u = unmappable(map(&m, &with(good_values(), "aggregate_type", text(""))));
        assert!(u.reason.contains("which is empty"), "{}", u.reason);
        let u = unmappable(map(
            &m,
            &with(good_values(), "aggregate_type", text(&"y".repeat(240))),
        ));
        assert!(u.reason.contains("more than Kafka's 249"), "{}", u.reason);
        let dots = mapper_with("{aggregate_type}", None);
        let u = unmappable(map(
            &dots,
            &with(good_values(), "aggregate_type", text("..")),
        ));
        assert_eq!(u.error_kind, error_kind::INVALID_TOPIC);
        // A row topic avoids the template entirely.
        let e = event(map(
            &m,
            &with(
                with(good_values(), "aggregate_type", ColumnValue::Null),
                "topic",
                text("t"),
            ),
        ));
        assert_eq!(e.topic, "t");
    }

    #[test]
    fn topic_templates_are_validated_at_start() {
        let config = OutboxConfig::default();
        for good in [
            "outbox.event.{aggregate_type}",
            "{aggregate_type}.{event_type}",
            "{event_type}",
            "events",
            "a-b_c.D9",
        ] {
            assert!(
                OutboxMapper::with_template(&config, good, None).is_ok(),
                "{good}"
            );
        }
        for (bad, why) in [
            (
                "outbox.{aggregate_id}",
                "unknown placeholder {aggregate_id}",
            ),
            ("outbox.{aggregate_type", "without a matching '}'"),
            ("outbox.aggregate_type}", "without a matching '{'"),
            ("out box.{event_type}", "contains ' '"),
            ("", "is empty"),
            (".", "'.' or '..'"),
            ("{}", "unknown placeholder {}"),
            ("tópico.{event_type}", "contains 'ó'"),
        ] {
            let err = OutboxMapper::with_template(&config, bad, None).unwrap_err();
            assert!(matches!(err, ConfigError::Invalid(_)));
            assert!(err.to_string().contains(why), "{bad}: {err}");
            assert!(err.to_string().contains("kafka.topic_template"), "{err}");
        }
        let long = "x".repeat(250);
        assert!(OutboxMapper::with_template(&config, &long, None).is_err());
        assert!(
            OutboxMapper::with_template(&config, &format!("{long}{{event_type}}"), None).is_err()
        );
    }

    #[test]
    fn new_reads_the_kafka_template() {
        let kafka: crate::config::KafkaConfig =
            toml::from_str("brokers = \"k:9092\"\ntopic_template = \"t.{event_type}\"").unwrap();
        let mut m = OutboxMapper::new(&OutboxConfig::default(), &kafka, None).unwrap();
        m.on_relation(&outbox_relation());
        assert_eq!(event(map(&m, &good_values())).topic, "t.OrderCreated");
        let kafka: crate::config::KafkaConfig =
            toml::from_str("brokers = \"k:9092\"\ntopic_template = \"t.{nope}\"").unwrap();
        assert!(OutboxMapper::new(&OutboxConfig::default(), &kafka, None).is_err());
    }

    // ---- headers ----

    #[test]
    fn headers_object_entries_follow_the_relay_headers() {
        let m = mapper();
        let json = r#"{"trace_id": "abc", "n": 1.50, "big": 123456789012345678901, "obj": {"x": [1, "]"]}, "arr": [ ], "t": true, "nothing": null, "esc": "line\nbreak \u00e9 \"q\"", "": "empty name"}"#;
        let e = event(map(&m, &with(good_values(), "headers", text(json))));
        let got = header_list(&e);
        assert_eq!(got.len(), 5 + 9);
        assert_eq!(
            got[5..],
            pairs(&[
                ("trace_id", "abc"),
                ("n", "1.50"),
                ("big", "123456789012345678901"),
                ("obj", r#"{"x": [1, "]"]}"#),
                ("arr", "[ ]"),
                ("t", "true"),
                ("nothing", "null"),
                ("esc", "line\nbreak é \"q\""),
                ("", "empty name"),
            ])[..]
        );
        assert!(matches!(e.headers[5].0, Cow::Owned(_)));
        // Escaped keys are decoded too.
        let e = event(map(
            &m,
            &with(good_values(), "headers", text(r#"{"a\"b": "v"}"#)),
        ));
        assert_eq!(e.headers[5].0, "a\"b");
        // An empty object adds nothing.
        let e = event(map(&m, &with(good_values(), "headers", text(" { } "))));
        assert_eq!(e.headers.len(), 5);
    }

    #[test]
    fn headers_that_are_not_an_object_are_unmappable() {
        let m = mapper();
        for (bad, why) in [
            ("[1, 2]", "must be a JSON object, is an array"),
            ("\"s\"", "is a string"),
            ("12", "is a number"),
            ("null", "is null"),
            ("true", "is a boolean"),
            ("{\"a\": }", "not valid JSON"),
            ("{\"a\": 1", "not valid JSON"),
            ("", "not valid JSON"),
            ("{\"idempotency_key\": \"mine\"}", "reserved"),
            ("{\"x\": 1, \"source_lsn\": \"0/0\"}", "reserved"),
        ] {
            let u = unmappable(map(&m, &with(good_values(), "headers", text(bad))));
            assert_eq!(u.error_kind, error_kind::BAD_HEADERS, "{bad}");
            assert!(u.reason.contains(why), "{bad}: {}", u.reason);
            assert!(
                u.reason.contains("headers column \"headers\""),
                "{}",
                u.reason
            );
            assert_eq!(u.fields.headers.as_deref(), Some(bad));
        }
    }

    #[test]
    fn unescaped_header_strings_are_slices() {
        let text = Bytes::from_static(br#"{"a": "value", "b": [1]}"#);
        let mut out = Vec::new();
        parse_header_object(&text, &mut out).unwrap();
        for (_, v) in &out {
            let start = text.as_ptr() as usize;
            assert!(
                v.as_ptr() as usize >= start && v.as_ptr() as usize + v.len() <= start + text.len()
            );
        }
        assert_eq!(out[0].1, "value");
        assert_eq!(out[1].1, "[1]");
    }

    // ---- envelope ----

    fn envelope() -> EnvelopeConfig {
        EnvelopeConfig {
            producer: "order-service \"eu\"".into(),
            schema_version: "1.2".into(),
        }
    }

    #[test]
    fn envelope_is_valid_json_and_embeds_the_payload_verbatim() {
        let m = mapper_with("outbox.event.{aggregate_type}", Some(envelope()));
        let e = event(map(&m, &good_values()));
        let raw = std::str::from_utf8(&e.payload).unwrap();
        assert!(raw.ends_with(&format!(",\"payload\":{PAYLOAD}}}")), "{raw}");
        let v: serde_json::Value = serde_json::from_slice(&e.payload).unwrap();
        assert_eq!(v["event_id"], ID);
        assert_eq!(v["event_type"], "OrderCreated");
        assert_eq!(v["schema_version"], "1.2");
        assert_eq!(v["occurred_at"], "2026-11-30T14:29:33.123456Z");
        assert_eq!(v["producer"], "order-service \"eu\"");
        assert_eq!(v["payload"]["items"], serde_json::json!([1, 2]));
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys.len(), 6);
        // Everything else is unchanged; poison data keeps the raw payload.
        assert_eq!(e.key, "42");
        assert_eq!(e.headers.len(), 5);
        assert_eq!(e.poison_fields().payload.as_deref(), Some(PAYLOAD));

        // NULL event type and created_at are JSON null.
        let values = with(
            with(good_values(), "event_type", ColumnValue::Null),
            "created_at",
            ColumnValue::Null,
        );
        let v: serde_json::Value =
            serde_json::from_slice(&event(map(&m, &values)).payload).unwrap();
        assert!(
            v["event_type"].is_null() && v["occurred_at"].is_null(),
            "{v}"
        );

        // Strings that need escaping.
        let values = with(good_values(), "event_type", text("a\"b\\c\n\u{1}é"));
        let v: serde_json::Value =
            serde_json::from_slice(&event(map(&m, &values)).payload).unwrap();
        assert_eq!(v["event_type"], "a\"b\\c\n\u{1}é");
    }

    #[test]
    fn envelope_embeds_text_payloads_as_strings() {
        let mut m = mapper_with("t", Some(envelope()));
        let mut columns = migration_columns();
        columns[7] = col("payload", OID_TEXT);
        let rel = relation(REL, "public", "outbox", columns);
        m.on_relation(&rel);
        let body = "plain \"text\"\twith\u{7f} controls\u{0}";
        let e = event(
            m.map_insert(
                &insert(&rel, &with(good_values(), "payload", text(body))),
                LSN,
            )
            .unwrap(),
        );
        let v: serde_json::Value = serde_json::from_slice(&e.payload).unwrap();
        assert_eq!(v["payload"], body);

        let mut columns = migration_columns();
        columns[7] = col("payload", OID_BYTEA);
        let rel = relation(REL, "public", "outbox", columns);
        m.on_relation(&rel);
        let e = event(
            m.map_insert(
                &insert(&rel, &with(good_values(), "payload", text("\\x6869"))),
                LSN,
            )
            .unwrap(),
        );
        let v: serde_json::Value = serde_json::from_slice(&e.payload).unwrap();
        assert_eq!(v["payload"], "hi");
        let u = unmappable(
            m.map_insert(
                &insert(&rel, &with(good_values(), "payload", text("\\xff"))),
                LSN,
            )
            .unwrap(),
        );
        assert_eq!(u.error_kind, error_kind::BAD_PAYLOAD);
        assert!(u.reason.contains("not UTF-8"), "{}", u.reason);
    }

    // ---- timestamps ----

    #[test]
    fn created_at_becomes_create_time_and_occurred_at() {
        let m = mapper();
        let at = |s: &str| event(map(&m, &with(good_values(), "created_at", text(s))));
        let e = at("1970-01-01 00:00:00.001+00");
        assert_eq!(e.timestamp_ms, Some(1));
        let e = at("1969-12-31 23:59:59.999+00");
        assert_eq!(e.timestamp_ms, None, "no negative CreateTime");
        assert_eq!(e.headers[3].1, "1969-12-31T23:59:59.999000Z");
        let e = at("2026-11-30 20:00:00+05:30");
        assert_eq!(e.headers[3].1, "2026-11-30T14:30:00.000000Z");
    }

    #[test]
    fn bad_created_at_is_unmappable() {
        let m = mapper();
        for bad in [
            "infinity",
            "-infinity",
            "2026-11-30 14:29:33+00 BC",
            "12026-01-01 00:00:00+00",
            "Mon Nov 30 14:29:33 2026 UTC",
        ] {
            let u = unmappable(map(&m, &with(good_values(), "created_at", text(bad))));
            assert_eq!(u.error_kind, error_kind::BAD_TIMESTAMP, "{bad}");
            assert!(
                u.reason.contains("created_at column \"created_at\""),
                "{}",
                u.reason
            );
            assert!(u.reason.contains(bad), "{}", u.reason);
            // PostgreSQL accepts its own text back as timestamptz.
            assert_eq!(u.fields.created_at.as_deref(), Some(bad));
        }
    }

    #[test]
    fn timestamp_parsing() {
        let p = |s: &str| parse_pg_timestamp(s.as_bytes());
        let f = |s: &str| {
            p(s).ok()
                .and_then(format_rfc3339)
                .unwrap_or_else(|| panic!("{s}"))
        };
        assert_eq!(
            f("2026-11-30 14:29:33.123456+00"),
            "2026-11-30T14:29:33.123456Z"
        );
        assert_eq!(f("2026-11-30 14:29:33+00"), "2026-11-30T14:29:33.000000Z");
        assert_eq!(f("2026-11-30 14:29:33.1+00"), "2026-11-30T14:29:33.100000Z");
        assert_eq!(
            f("2026-11-30 14:29:33.12+00:00"),
            "2026-11-30T14:29:33.120000Z"
        );
        assert_eq!(
            f("2026-11-30 14:29:33+05:30"),
            "2026-11-30T08:59:33.000000Z"
        );
        assert_eq!(f("2026-11-30 23:29:33-03"), "2026-12-01T02:29:33.000000Z");
        assert_eq!(
            f("1883-11-18 12:03:58+00:03:58"),
            "1883-11-18T12:00:00.000000Z"
        );
        assert_eq!(f("2026-11-30 14:29:33"), "2026-11-30T14:29:33.000000Z");
        assert_eq!(f("2026-11-30T14:29:33Z"), "2026-11-30T14:29:33.000000Z");
        assert_eq!(f("2024-02-29 00:00:00+00"), "2024-02-29T00:00:00.000000Z");
        assert_eq!(f("2000-02-29 00:00:00+00"), "2000-02-29T00:00:00.000000Z");
        assert_eq!(f("0001-01-01 00:00:00+00"), "0001-01-01T00:00:00.000000Z");
        assert_eq!(
            f("9999-12-31 23:59:59.999999+00"),
            "9999-12-31T23:59:59.999999Z"
        );
        assert_eq!(p("1970-01-01 00:00:00+00"), Ok(0));
        assert_eq!(p("1969-12-31 23:59:59.999999+00"), Ok(-1));

        for (bad, reason) in [
            ("infinity", "is infinite"),
            ("-infinity", "is infinite"),
            ("0044-03-15 12:00:00+00 BC", "BC"),
            ("10000-01-01 00:00:00+00", "past 9999"),
            ("275760-09-13 00:00:00+00", "past 9999"),
            ("0000-01-01 00:00:00+00", "year 0"),
            ("0001-01-01 00:00:00+01", "outside years 1-9999"),
            ("9999-12-31 23:59:59-01", "outside years 1-9999"),
            ("2026-02-29 00:00:00+00", "no such date"),
            ("1900-02-29 00:00:00+00", "no such date"),
            ("2026-13-01 00:00:00+00", "no such date"),
            ("2026-04-31 00:00:00+00", "no such date"),
            ("2026-01-00 00:00:00+00", "no such date"),
            ("2026-01-01 24:00:00+00", "no such time"),
            ("2026-01-01 23:60:00+00", "no such time"),
            ("2026-01-01 23:59:60+00", "no such time"),
            ("2026-01-01 00:00:00.1234567+00", "1 to 6 digits"),
            ("2026-01-01 00:00:00.+00", "1 to 6 digits"),
            ("2026-01-01 00:00:00+16", "offset out of range"),
            ("2026-01-01 00:00:00+5", "malformed UTC offset"),
            ("2026-01-01 00:00:00+05:3", "malformed UTC offset"),
            ("2026-01-01 00:00:00+00 ", "trailing"),
            ("2026-01-01 00:00:00 UTC", "unexpected characters"),
            ("2026-01-01", "no time"),
            ("26-01-01 00:00:00+00", "4-digit year"),
            ("2026/01/01 00:00:00+00", "after the year"),
            ("2026-1-01 00:00:00+00", "2-digit month"),
            ("", "4-digit year"),
            ("２０２６-01-01 00:00:00+00", "4-digit year"),
        ] {
            let err = p(bad).unwrap_err();
            assert!(err.to_string().contains(reason), "{bad:?}: {err}");
            assert!(
                err.to_string().contains("expected PostgreSQL ISO output"),
                "{err}"
            );
        }
        assert_eq!(format_rfc3339(MAX_MICROS + 1), None);
        assert_eq!(format_rfc3339(MIN_MICROS - 1), None);
        assert_eq!(
            format_rfc3339(-1).as_deref(),
            Some("1969-12-31T23:59:59.999999Z")
        );
    }

    #[test]
    fn lsn_header_matches_lsn_display() {
        for v in [0, 1, 0xF, 0x1_0000_0000, 0x16_B374_D848, u64::MAX] {
            let mut b = Vec::new();
            put_lsn(&mut b, Lsn(v));
            assert_eq!(String::from_utf8(b).unwrap(), Lsn(v).to_string());
        }
    }

    // ---- poll / replay path and poisoning of events ----

    #[test]
    fn map_row_produces_the_same_record_without_source_lsn() {
        let m = mapper();
        let cdc = event(map(
            &m,
            &with(good_values(), "headers", text(r#"{"h": "1"}"#)),
        ));
        let b = |s: &str| Some(Bytes::copy_from_slice(s.as_bytes()));
        let row = OutboxRow {
            id: b(ID),
            idempotency_key: b("order-42-created"),
            aggregate_type: b("Order"),
            aggregate_id: b("42"),
            event_type: b("OrderCreated"),
            topic: None,
            headers: b(r#"{"h": "1"}"#),
            payload: b(PAYLOAD),
            payload_format: PayloadFormat::Json,
            created_at: b("2026-11-30 14:29:33.123456+00"),
        };
        let polled = m.map_row(&row, None).unwrap();
        assert_eq!(polled.key, cdc.key);
        assert_eq!(polled.topic, cdc.topic);
        assert_eq!(polled.payload, cdc.payload);
        assert_eq!(polled.timestamp_ms, cdc.timestamp_ms);
        let mut expected = cdc.headers.clone();
        expected.retain(|(n, _)| n != HEADER_SOURCE_LSN);
        assert_eq!(polled.headers, expected);
        assert_eq!(polled.source_lsn, None);

        let bad = OutboxRow {
            aggregate_id: None,
            ..row
        };
        let u = m.map_row(&bad, None).unwrap_err();
        assert_eq!(u.error_kind, error_kind::NULL_KEY);
        assert_eq!(
            u.fields.idempotency_key.as_deref(),
            Some("order-42-created")
        );
        assert_eq!(u.fields.columns.len(), 9);
        assert_eq!(u.fields.lsn, None);
        assert_eq!(u.to_string(), format!("null_key: {}", u.reason));
    }

    #[test]
    fn events_keep_their_original_data_for_poisoning() {
        let m = mapper();
        let values = with(
            with(good_values(), "headers", text(r#"{"h": 1}"#)),
            "topic",
            text("custom"),
        );
        let p = event(map(&m, &values)).poison_fields();
        assert_eq!(p.outbox_id.as_deref(), Some(ID));
        assert_eq!(p.idempotency_key.as_deref(), Some("order-42-created"));
        assert_eq!(p.aggregate_type.as_deref(), Some("Order"));
        assert_eq!(p.aggregate_id.as_deref(), Some("42"));
        assert_eq!(p.event_type.as_deref(), Some("OrderCreated"));
        assert_eq!(p.topic.as_deref(), Some("custom"));
        assert_eq!(p.headers.as_deref(), Some(r#"{"h": 1}"#));
        assert_eq!(p.payload.as_deref(), Some(PAYLOAD));
        assert_eq!(p.created_at.as_deref(), Some("2026-11-30T14:29:33.123456Z"));
        assert_eq!(p.lsn, Some(LSN));
        let names: Vec<&str> = p.columns.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "id",
                "idempotency_key",
                "aggregate_type",
                "aggregate_id",
                "event_type",
                "topic",
                "headers",
                "payload",
                "created_at"
            ]
        );
        // A JSON text of the poison row's headers casts to jsonb.
        let v: serde_json::Value = serde_json::from_str(p.headers.as_deref().unwrap()).unwrap();
        assert!(v.is_object());
    }

    #[test]
    fn json_escaping() {
        let mut out = Vec::new();
        put_json_string(&mut out, "a\"\\\n\r\t\u{8}\u{c}\u{1f}\u{7f}é\u{2028}");
        let s = String::from_utf8(out).unwrap();
        assert_eq!(s, "\"a\\\"\\\\\\n\\r\\t\\b\\f\\u001f\u{7f}é\u{2028}\"");
        assert_eq!(
            serde_json::from_str::<String>(&s).unwrap(),
            "a\"\\\n\r\t\u{8}\u{c}\u{1f}\u{7f}é\u{2028}"
        );
    }

    // ---- property tests ----

    fn arb_value() -> impl Strategy<Value = ColumnValue> {
        let interesting = proptest::sample::select(vec![
            "",
            "42",
            "Order",
            "{}",
            "[]",
            "null",
            "{\"a\": 1}",
            "{\"a\": \"b\\\"\"}",
            "{\"idempotency_key\": 1}",
            "2026-11-30 14:29:33.123456+00",
            "infinity",
            "0001-01-01 00:00:00+01",
            "\\x00ff",
            "\\x0",
            "a b",
            ".",
            "..",
            "{",
            "{\"a\":",
            "{\"a\" 1}",
            "\"",
            "{\"a\":[}",
            "0044-01-01 00:00:00+00 BC",
        ]);
        let bytes = proptest::collection::vec(any::<u8>(), 0..40).prop_map(Bytes::from);
        prop_oneof![
            Just(ColumnValue::Null),
            Just(ColumnValue::UnchangedToast),
            interesting.prop_map(|s: &str| ColumnValue::Text(Bytes::from_static(s.as_bytes()))),
            "[ -~]{0,40}".prop_map(|s| ColumnValue::Text(Bytes::from(s))),
            bytes.clone().prop_map(ColumnValue::Text),
            bytes.prop_map(ColumnValue::Binary),
        ]
    }

    fn arb_columns() -> impl Strategy<Value = Vec<RelationColumn>> {
        let names = proptest::sample::select(vec![
            "id",
            "idempotency_key",
            "aggregate_type",
            "aggregatetype",
            "aggregate_id",
            "aggregateid",
            "event_type",
            "type",
            "topic",
            "headers",
            "payload",
            "created_at",
            "other",
        ]);
        let oids = proptest::sample::select(vec![
            OID_TEXT,
            OID_VARCHAR,
            OID_BPCHAR,
            OID_UUID,
            OID_INT8,
            OID_JSON,
            OID_JSONB,
            OID_BYTEA,
            OID_TIMESTAMP,
            OID_TIMESTAMPTZ,
            16,
            0,
        ]);
        proptest::collection::vec((names, oids), 0..14).prop_map(|cols| {
            let mut seen = std::collections::HashSet::new();
            cols.into_iter()
                .filter(|(n, _)| seen.insert(*n))
                .map(|(n, oid)| col(n, oid))
                .collect()
        })
    }

    fn check_event(e: &OutboxEvent) {
        assert!(!e.key.is_empty());
        assert!(!e.idempotency_key.is_empty());
        assert!(
            validate_topic_name(e.topic.as_bytes()).is_ok(),
            "{}",
            e.topic
        );
        assert_eq!(e.headers[0].0, HEADER_IDEMPOTENCY_KEY);
        let _ = e.byte_size();
        let _ = e.poison_fields();
    }

    proptest! {
        #[test]
        fn map_insert_never_panics(
            columns in arb_columns(),
            values in proptest::collection::vec(arb_value(), 14),
            envelope_on in any::<bool>(),
            template in proptest::sample::select(vec!["outbox.event.{aggregate_type}", "{event_type}", "x"]),
        ) {
            let mut m = OutboxMapper::with_template(
                &OutboxConfig::default(),
                template,
                envelope_on.then(envelope),
            ).unwrap();
            let rel = relation(REL, "public", "outbox", columns);
            m.on_relation(&rel);
            let tuple = TupleData { columns: values[..rel.columns.len()].to_vec() };
            let ins = Insert { xid: None, relation_id: REL, tuple };
            match m.map_insert(&ins, LSN) {
                Ok(Mapped::Event(e)) => {
                    check_event(&e);
                    if envelope_on {
                        let prefix: &[u8] = b"{\"event_id\":";
                        prop_assert!(e.payload.starts_with(prefix));
                    }
                }
                Ok(Mapped::Unmappable(u)) => {
                    prop_assert!(!u.reason.is_empty());
                    prop_assert_eq!(u.fields.columns.len(), rel.columns.len());
                }
                Ok(Mapped::NotOutbox) | Err(_) => prop_assert!(false, "unexpected"),
            }
        }

        #[test]
        fn map_row_never_panics(
            values in proptest::collection::vec(proptest::option::of(proptest::collection::vec(any::<u8>(), 0..30)), 9),
            format in proptest::sample::select(vec![PayloadFormat::Json, PayloadFormat::Text, PayloadFormat::ByteaText, PayloadFormat::Raw]),
            envelope_on in any::<bool>(),
        ) {
            let m = OutboxMapper::with_template(&OutboxConfig::default(), "{aggregate_type}.{event_type}", envelope_on.then(envelope)).unwrap();
            let v = |i: usize| values[i].clone().map(Bytes::from);
            let row = OutboxRow {
                id: v(0), idempotency_key: v(1), aggregate_type: v(2), aggregate_id: v(3),
                event_type: v(4), topic: v(5), headers: v(6), payload: v(7),
                payload_format: format, created_at: v(8),
            };
            if let Ok(e) = m.map_row(&row, Some(LSN)) {
                check_event(&e);
            }
        }

        #[test]
        fn rfc3339_matches_chrono(micros in MIN_MICROS..=MAX_MICROS) {
            let ours = format_rfc3339(micros).unwrap();
            let theirs = chrono::DateTime::from_timestamp_micros(micros)
                .unwrap()
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
            prop_assert_eq!(&ours, &theirs);
        }

        #[test]
        fn postgres_text_round_trips(
            micros in MIN_MICROS + 86_400_000_000..=MAX_MICROS - 86_400_000_000,
            offset_minutes in -15 * 60i32..=15 * 60,
            trim_fraction in any::<bool>(),
        ) {
            // Render like PostgreSQL would in a session with that UTC offset.
            let micros = if trim_fraction { micros - micros.rem_euclid(1_000_000) } else { micros };
            let offset = chrono::FixedOffset::east_opt(offset_minutes * 60).unwrap();
            let local = chrono::DateTime::from_timestamp_micros(micros).unwrap().with_timezone(&offset);
            let mut text = local.format("%Y-%m-%d %H:%M:%S").to_string();
            let frac = micros.rem_euclid(1_000_000);
            if frac != 0 {
                let digits = format!("{frac:06}");
                text.push('.');
                text.push_str(digits.trim_end_matches('0'));
            }
            let (sign, abs) = if offset_minutes < 0 { ('-', -offset_minutes) } else { ('+', offset_minutes) };
            text.push_str(&format!("{sign}{:02}", abs / 60));
            if abs % 60 != 0 {
                text.push_str(&format!(":{:02}", abs % 60));
            }
            prop_assert_eq!(parse_pg_timestamp(text.as_bytes()), Ok(micros), "{}", text);
        }

        #[test]
        fn timestamp_parser_never_panics(s in "[0-9 :+.TZ-]{0,34}", b in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = parse_pg_timestamp(s.as_bytes());
            let _ = parse_pg_timestamp(&b);
        }

        #[test]
        fn header_objects_match_serde_json(
            entries in proptest::collection::vec(("[a-z\"\\\\\u{e9}\n]{0,6}", arb_json()), 0..6),
        ) {
            let object = serde_json::Value::Object(entries.iter().cloned().collect());
            let text = Bytes::from(serde_json::to_vec_pretty(&object).unwrap());
            let mut out = Vec::new();
            parse_header_object(&text, &mut out).map_err(TestCaseError::fail)?;
            let expected: Vec<(String, serde_json::Value)> = object.as_object().unwrap().clone().into_iter().collect();
            prop_assert_eq!(out.len(), expected.len());
            for ((name, value), (want_name, want)) in out.iter().zip(&expected) {
                prop_assert_eq!(name.as_ref(), want_name.as_str());
                match want {
                    serde_json::Value::String(s) => prop_assert_eq!(&value[..], s.as_bytes()),
                    other => prop_assert_eq!(&serde_json::from_slice::<serde_json::Value>(value).unwrap(), other),
                }
            }
        }

        #[test]
        fn header_parser_never_panics(s in "[{}\\[\\]\",: a-z0-9\\\\]{0,40}") {
            let mut out = Vec::new();
            let _ = parse_header_object(&Bytes::from(s), &mut out);
        }

        #[test]
        fn lsn_writer_matches_display(v in any::<u64>()) {
            let mut b = Vec::new();
            put_lsn(&mut b, Lsn(v));
            prop_assert_eq!(String::from_utf8(b).unwrap(), Lsn(v).to_string());
        }

        #[test]
        fn json_strings_round_trip(s in "\\PC*|[\u{0}-\u{1f}\"\\\\]{0,10}") {
            let mut out = Vec::new();
            put_json_string(&mut out, &s);
            prop_assert_eq!(serde_json::from_slice::<String>(&out).unwrap(), s);
        }
    }

    fn arb_json() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            // Quarters are exact in binary and short in decimal, so serde_json (the
            // oracle) reads them back exactly.
            any::<i32>().prop_map(|q| Value::from(f64::from(q) / 4.0)),
            "[a-z \"\\\\\n\u{e9}]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z]{0,4}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Mapping cost; run with
    /// `cargo test --release --lib outbox::tests::mapping_cost -- --ignored --nocapture`.
    #[test]
    #[ignore = "timing, run in release"]
    fn mapping_cost() {
        let m = mapper();
        let cases = [
            ("no headers", good_values()),
            (
                "headers object",
                with(
                    good_values(),
                    "headers",
                    text(r#"{"trace_id": "4bf92f3577b34da6", "tenant": "acme"}"#),
                ),
            ),
        ];
        for (label, values) in cases {
            let ins = insert(&outbox_relation(), &values);
            let n = 1_000_000u32;
            let start = std::time::Instant::now();
            let mut sink = 0usize;
            for _ in 0..n {
                if let Ok(Mapped::Event(e)) = m.map_insert(std::hint::black_box(&ins), LSN) {
                    sink += e.byte_size();
                }
            }
            let per = start.elapsed() / n;
            println!("map_insert ({label}): {per:?} per event (sink {sink})");
        }
        let em = mapper_with("outbox.event.{aggregate_type}", Some(envelope()));
        let ins = insert(&outbox_relation(), &good_values());
        let n = 1_000_000u32;
        let start = std::time::Instant::now();
        for _ in 0..n {
            let _ = std::hint::black_box(em.map_insert(std::hint::black_box(&ins), LSN));
        }
        println!("map_insert (envelope): {:?} per event", start.elapsed() / n);
    }
}
