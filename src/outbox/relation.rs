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
//! Values arrive in text format (`'t'`) because the relay does not request binary
//! (`binary 'true'`); a binary value (`'b'`) is still read where its bytes are the
//! text (text-like types, and `jsonb` after its version byte) and refused
//! otherwise, rather than decoded by guesswork. An INSERT never carries the
//! unchanged-TOAST marker (`'u'`), which only UPDATEs use; one would mean the value
//! was not sent, so that row is unmappable.

use std::borrow::Cow;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::str::Utf8Error;
use std::sync::Arc;

use bytes::Bytes;

use super::columns::{
    FIELD_COUNT, Field, FieldNames, HEADERS_TYPES, OID_BPCHAR, OID_BYTEA, OID_JSON, OID_JSONB,
    OID_TEXT, OID_VARCHAR, TIMESTAMP_TYPES, type_name,
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
enum BinaryValueError {
    /// A text-like type whose bytes are not UTF-8.
    #[error("binary-format {type_name} value is not UTF-8: {source}")]
    NotUtf8 {
        type_name: Cow<'static, str>,
        source: Utf8Error,
    },
    /// `jsonb_send` output starts with version byte 1.
    #[error("binary-format jsonb value does not start with version 1")]
    JsonbVersion,
    /// A type whose binary form is not its text.
    #[error(
        "binary-format values of type {0} are not supported; the relay reads pgoutput text format (no binary 'true')"
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

/// The text form of a binary-format (`'b'`) value, where it has one without copying.
///
/// # Errors
///
/// [`BinaryValueError`]: the type has no text form without a copy, or the bytes
/// are not what the type's send function writes.
fn binary_as_text(oid: u32, b: &Bytes) -> Result<Bytes, BinaryValueError> {
    let utf8 = |b: Bytes| match std::str::from_utf8(&b) {
        Ok(_) => Ok(b),
        Err(source) => Err(BinaryValueError::NotUtf8 {
            type_name: type_name(oid),
            source,
        }),
    };
    match oid {
        OID_TEXT | OID_VARCHAR | OID_BPCHAR | OID_JSON => utf8(b.clone()),
        // jsonb_send: a version byte (1), then the text.
        OID_JSONB => match b.first() {
            Some(1) => utf8(b.slice(1..)),
            _ => Err(BinaryValueError::JsonbVersion),
        },
        _ => Err(BinaryValueError::Unsupported(type_name(oid))),
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
        outbox: rel.names.outbox,
    }
}
