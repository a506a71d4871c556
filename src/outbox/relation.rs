//! The relation cache: binding the outbox fields to the columns of pgoutput
//! `Relation` messages, and reading them from `Insert` tuples.
//!
//! pgoutput describes a table once per session, in a `Relation` message (OID,
//! schema, name, and each column's name and type OID), before the first change of
//! that table, and again after `ALTER TABLE`; each `Insert` then carries only the
//! relation OID and the values in column order
//! (<https://www.postgresql.org/docs/current/protocol-logicalrep-message-formats.html>).
//! So the work that depends on the table — which column is which field, whether
//! required columns exist, whether their types are accepted — is done once per
//! `Relation` message ([`OutboxRelation::resolve`]) and cached by OID; an `Insert`
//! is then read by position. A table-level problem is cached with the relation and
//! makes each of its inserts unmappable until a new `Relation` message replaces it.
//!
//! Values arrive in text format (`'t'`), or in binary (`'b'`) when the session
//! asked for `binary 'true'` (`crate::cdc::binary`, which it does only while every
//! column has a type [`binary_as_text`] reads): text-like types and `jsonb` after
//! its version byte are their text, `bytea` its raw bytes, and uuids, integers and
//! timestamps are rendered as their output functions print them, so a record is
//! the same either way. Any other binary type is refused rather than decoded by
//! guesswork. An INSERT never carries the
//! unchanged-TOAST marker (`'u'`), which only UPDATEs use; one would mean the value
//! was not sent, so that row is unmappable.

use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::str::Utf8Error;
use std::sync::Arc;

use bytes::Bytes;

use super::columns::{
    FIELD_COUNT, Field, FieldNames, HEADERS_TYPES, OID_BPCHAR, OID_BYTEA, OID_INT2, OID_INT4,
    OID_INT8, OID_JSON, OID_JSONB, OID_TEXT, OID_TIMESTAMP, OID_TIMESTAMPTZ, OID_UUID, OID_VARCHAR,
    TIMESTAMP_TYPES, type_name,
};
use super::record::{
    OutboxRow, PayloadFormat, PoisonFields, Reject, RelationStatus, error_kind, hex_text, lossy,
    payload_text, poison_timestamp,
};
use crate::config::OutboxConfig;
use crate::lsn::Lsn;
use crate::postgres::pgoutput::{ColumnValue, Relation, TupleData};

/// Why a binary-format value has no usable text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum BinaryValueError {
    /// A text-like type whose bytes are not UTF-8.
    #[error("binary-format {type_name} value is not UTF-8: {source}")]
    NotUtf8 {
        type_name: Cow<'static, str>,
        source: Utf8Error,
    },
    /// `jsonb_send` output starts with version byte 1.
    #[error("binary-format jsonb value does not start with version 1")]
    JsonbVersion,
    /// A fixed-size type with another number of bytes.
    #[error("binary-format {type_name} value has {actual} bytes, not {expected}")]
    Length {
        type_name: Cow<'static, str>,
        expected: usize,
        actual: usize,
    },
    /// A type whose binary form is not its text.
    #[error(
        "binary-format values of type {0} are not read by the relay (it asks for binary 'true' only when every outbox column has a type it reads)"
    )]
    Unsupported(Cow<'static, str>),
}

/// A Relation message for the outbox table, resolved.
#[derive(Debug)]
pub(super) struct OutboxRelation {
    /// Every column name, in tuple order (for `row_data`).
    pub(super) columns: Vec<String>,
    /// Every column's type OID, in tuple order.
    type_oids: Vec<u32>,
    /// Tuple position of each field.
    positions: [Option<usize>; FIELD_COUNT],
    /// The column name of each field (configured or alias).
    pub(super) names: Arc<FieldNames>,
    /// A table-level problem making every insert unmappable.
    pub(super) problem: Option<Reject>,
    /// Each `outbox.additional_placement` column and its tuple position.
    pub(super) extra: Vec<(Arc<str>, Option<usize>)>,
}

impl OutboxRelation {
    /// Binds the configured fields to the columns of a Relation message of the
    /// outbox table (configured name first, then the Debezium alias) and checks
    /// that the required ones are present and every bound one is well typed.
    pub(super) fn resolve(
        rel: &Relation,
        outbox: &OutboxConfig,
        index: usize,
        placed: &[Arc<str>],
    ) -> Self {
        let find = |name: &str| rel.columns.iter().position(|c| c.name == name);
        let mut positions = [None; FIELD_COUNT];
        let mut names = Field::ALL.map(|f| f.configured(outbox).to_owned());
        for field in Field::ALL {
            let configured = field.configured(outbox);
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
        let names = Arc::new(FieldNames {
            names,
            present,
            outbox: index,
        });
        let type_oids: Vec<u32> = rel.columns.iter().map(|c| c.type_oid).collect();

        let mut missing = Vec::new();
        let describe_missing = |field: Field| match field.alias() {
            Some(alias) => format!(
                "{} column {:?} (or {alias:?})",
                field.label(),
                field.configured(outbox)
            ),
            None => format!("{} column {:?}", field.label(), field.configured(outbox)),
        };
        for field in [Field::AggregateId, Field::Payload] {
            if !present[field as usize] {
                missing.push(describe_missing(field));
            }
        }
        let extra: Vec<(Arc<str>, Option<usize>)> = placed
            .iter()
            .map(|column| (Arc::clone(column), find(column)))
            .collect();
        for (column, _) in extra.iter().filter(|(_, pos)| pos.is_none()) {
            missing.push(format!("column {column:?} (outbox.additional_placement)"));
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
            extra,
        }
    }

    fn position(&self, field: Field) -> Option<usize> {
        self.positions[field as usize]
    }

    fn type_of(&self, field: Field) -> Option<u32> {
        self.position(field)
            .and_then(|p| self.type_oids.get(p).copied())
    }
}

/// What a relation OID stands for in this session.
#[derive(Debug)]
pub(super) enum RelationEntry {
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

/// The relations described in this replication session, by OID. pgoutput sends a
/// Relation message before the first change of each relation in a session (and
/// again after its schema changed), so the cache starts empty each session.
#[derive(Debug, Default)]
pub(super) struct RelationCache(HashMap<u32, RelationEntry, BuildHasherDefault<OidHasher>>);

impl RelationCache {
    /// Forgets every relation.
    pub(super) fn clear(&mut self) {
        self.0.clear();
    }

    /// Records (or replaces) what relation `id` is; returns the stored entry.
    pub(super) fn insert(&mut self, id: u32, entry: RelationEntry) -> &RelationEntry {
        self.0.entry(id).insert_entry(entry).into_mut()
    }

    /// What relation `id` is, if it was described.
    pub(super) fn get(&self, id: u32) -> Option<&RelationEntry> {
        self.0.get(&id)
    }
}

/// How the mapper reports a relation entry.
pub(super) fn status_of(entry: &RelationEntry) -> RelationStatus<'_> {
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
pub(super) struct RowRef<'a> {
    pub(super) id: Option<Cow<'a, Bytes>>,
    pub(super) idempotency_key: Option<Cow<'a, Bytes>>,
    pub(super) aggregate_type: Option<Cow<'a, Bytes>>,
    pub(super) aggregate_id: Option<Cow<'a, Bytes>>,
    pub(super) event_type: Option<Cow<'a, Bytes>>,
    pub(super) topic: Option<Cow<'a, Bytes>>,
    pub(super) headers: Option<Cow<'a, Bytes>>,
    pub(super) payload: Option<Cow<'a, Bytes>>,
    pub(super) payload_format: PayloadFormat,
    pub(super) created_at: Option<Cow<'a, Bytes>>,
    /// The `outbox.additional_placement` columns, in their order.
    pub(super) extra: Vec<Option<Cow<'a, Bytes>>>,
}

impl<'a> RowRef<'a> {
    /// Borrows the fields of a row given as text.
    pub(super) fn of(row: &'a OutboxRow) -> Self {
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
            extra: row.extra.iter().map(b).collect(),
        }
    }
}

/// Reads the outbox fields of a tuple (already checked to match the relation).
pub(super) fn extract_row<'a>(
    rel: &OutboxRelation,
    tuple: &'a TupleData,
) -> Result<RowRef<'a>, Reject> {
    let get = |field: Field| -> Result<Option<Cow<'a, Bytes>>, Reject> {
        let Some(pos) = rel.position(field) else {
            return Ok(None);
        };
        value_at(rel, tuple, pos, &|| rel.names.describe(field))
    };
    let payload_oid = rel.type_of(Field::Payload).unwrap_or(OID_JSONB);
    let (payload, payload_format) = match (
        rel.position(Field::Payload).and_then(|p| tuple.get(p)),
        payload_oid,
    ) {
        (Some(ColumnValue::Binary(b)), OID_BYTEA) => (Some(Cow::Borrowed(b)), PayloadFormat::Raw),
        (_, oid) => (get(Field::Payload)?, payload_format_of(oid)),
    };
    let extra = rel
        .extra
        .iter()
        .map(|(name, pos)| match pos {
            Some(pos) => value_at(rel, tuple, *pos, &|| format!("column {name:?}")),
            None => Ok(None),
        })
        .collect::<Result<Vec<_>, _>>()?;
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
        extra,
    })
}

/// The text of the value at tuple position `pos` (`None` for NULL); `describe`
/// names the column in an error.
fn value_at<'a>(
    rel: &OutboxRelation,
    tuple: &'a TupleData,
    pos: usize,
    describe: &dyn Fn() -> String,
) -> Result<Option<Cow<'a, Bytes>>, Reject> {
    match tuple.get(pos) {
        None | Some(ColumnValue::Null) => Ok(None),
        Some(ColumnValue::UnchangedToast) => Err(Reject::new(
            error_kind::UNCHANGED_TOAST,
            format!(
                "{} is an unchanged-TOAST marker ('u'), which an INSERT never carries: the value was not sent",
                describe()
            ),
        )),
        Some(ColumnValue::Text(b)) => Ok(Some(Cow::Borrowed(b))),
        Some(ColumnValue::Binary(b)) => {
            let oid = rel.type_oids.get(pos).copied().unwrap_or_default();
            binary_as_text(oid, b)
                .map(|b| Some(Cow::Owned(b)))
                .map_err(|e| Reject::new(error_kind::BAD_VALUE, format!("{}: {e}", describe())))
        }
    }
}

fn payload_format_of(oid: u32) -> PayloadFormat {
    match oid {
        OID_JSON | OID_JSONB => PayloadFormat::Json,
        OID_BYTEA => PayloadFormat::ByteaText,
        _ => PayloadFormat::Text,
    }
}

/// The text form of a binary-format (`'b'`) value: the same bytes PostgreSQL's
/// output function would have sent in text mode (`binary 'true'`, see
/// `crate::postgres::binary_decoding`). Text-like types and `jsonb` are slices of the
/// message; `uuid`, the integers and the timestamps are rendered.
///
/// # Errors
///
/// [`BinaryValueError`]: a type the relay does not read in binary, or bytes that
/// are not what the type's send function writes.
pub(crate) fn binary_as_text(oid: u32, b: &Bytes) -> Result<Bytes, BinaryValueError> {
    let utf8 = |b: Bytes| match std::str::from_utf8(&b) {
        Ok(_) => Ok(b),
        Err(source) => Err(BinaryValueError::NotUtf8 {
            type_name: type_name(oid),
            source,
        }),
    };
    let fixed = |n: usize| -> Result<&[u8], BinaryValueError> {
        if b.len() == n {
            Ok(&b[..])
        } else {
            Err(BinaryValueError::Length {
                type_name: type_name(oid),
                expected: n,
                actual: b.len(),
            })
        }
    };
    match oid {
        OID_TEXT | OID_VARCHAR | OID_BPCHAR | OID_JSON => utf8(b.clone()),
        // jsonb_send: a version byte (1), then the text.
        OID_JSONB => match b.first() {
            Some(1) => utf8(b.slice(1..)),
            _ => Err(BinaryValueError::JsonbVersion),
        },
        // byteaout's hex format (a bytea payload is read raw before this).
        OID_BYTEA => Ok(Bytes::from(hex_text(b))),
        OID_UUID => Ok(Bytes::from(uuid_text(fixed(16)?))),
        OID_INT2 => {
            let v = fixed(2)?;
            Ok(Bytes::from(i16::from_be_bytes([v[0], v[1]]).to_string()))
        }
        OID_INT4 => {
            let v = fixed(4)?;
            Ok(Bytes::from(
                i32::from_be_bytes([v[0], v[1], v[2], v[3]]).to_string(),
            ))
        }
        OID_INT8 => Ok(Bytes::from(be_i64(fixed(8)?).to_string())),
        OID_TIMESTAMP | OID_TIMESTAMPTZ => Ok(Bytes::from(pg_timestamp_text(
            be_i64(fixed(8)?),
            oid == OID_TIMESTAMPTZ,
        ))),
        _ => Err(BinaryValueError::Unsupported(type_name(oid))),
    }
}

/// Whether [`binary_as_text`] reads values of this type: a relation whose every
/// column is one can be streamed with `binary 'true'`.
#[must_use]
pub(crate) fn reads_binary(oid: u32) -> bool {
    BINARY_TYPES.contains(&oid)
}

/// The types [`binary_as_text`] reads.
pub(crate) const BINARY_TYPES: &[u32] = &[
    OID_TEXT,
    OID_VARCHAR,
    OID_BPCHAR,
    OID_JSON,
    OID_JSONB,
    OID_BYTEA,
    OID_UUID,
    OID_INT2,
    OID_INT4,
    OID_INT8,
    OID_TIMESTAMP,
    OID_TIMESTAMPTZ,
];

fn be_i64(v: &[u8]) -> i64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(v);
    i64::from_be_bytes(a)
}

/// `uuid_out`: 8-4-4-4-12 lowercase hex.
fn uuid_text(v: &[u8]) -> String {
    let mut out = String::with_capacity(36);
    for (i, byte) in v.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            out.push('-');
        }
        out.push(char::from(b"0123456789abcdef"[usize::from(byte >> 4)]));
        out.push(char::from(b"0123456789abcdef"[usize::from(byte & 0xf)]));
    }
    out
}

/// Microseconds between 1970-01-01 and PostgreSQL's epoch, 2000-01-01.
const PG_EPOCH_UNIX_MICROS: i64 = 946_684_800_000_000;

/// `timestamp(tz)_send` microseconds since 2000-01-01 as `timestamp(tz)_out`
/// prints them with `DateStyle = ISO` and `TimeZone = UTC` (the relay's session
/// settings): `2026-11-30 14:29:33.1234+00`, the fraction without trailing zeros
/// (none at all for whole seconds), the offset only with a time zone;
/// `infinity` / `-infinity` for the sentinels; a year outside 1–9999 as a text the
/// mapper refuses, as it refuses the text-mode one.
fn pg_timestamp_text(pg_micros: i64, with_zone: bool) -> String {
    match pg_micros {
        i64::MAX => return "infinity".to_owned(),
        i64::MIN => return "-infinity".to_owned(),
        _ => {}
    }
    let zone = if with_zone { "+00" } else { "" };
    let Some(unix) = pg_micros.checked_add(PG_EPOCH_UNIX_MICROS) else {
        return "infinity".to_owned();
    };
    match super::timestamp::format_rfc3339(unix) {
        // 2026-11-30T14:29:33.123400Z → 2026-11-30 14:29:33.1234
        Some(rfc) => {
            let fraction = rfc[20..26].trim_end_matches('0');
            let dot = if fraction.is_empty() { "" } else { "." };
            format!("{} {}{dot}{fraction}{zone}", &rfc[..10], &rfc[11..19])
        }
        None if unix < 0 => "0001-01-01 00:00:00 BC".to_owned(),
        None => format!("10000-01-01 00:00:00{zone}"),
    }
}

/// Poison data of a tuple of an outbox relation: every column by name, and the
/// mapped fields where they can be read.
pub(super) fn poison_from_tuple(rel: &OutboxRelation, tuple: &TupleData, lsn: Lsn) -> PoisonFields {
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
        // jsonb without its version byte, as text mode gives it (replay maps it).
        Some(ColumnValue::Binary(b)) => Some(
            match binary_as_text(rel.type_of(Field::Payload).unwrap_or_default(), b) {
                Ok(text) => lossy(&text),
                Err(_) => hex_text(b),
            },
        ),
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
        outbox: rel.names.outbox,
    }
}
