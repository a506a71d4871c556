//! The outbox columns: their names, Debezium aliases and accepted types.
//!
//! The mapper knows nine fields ([`Field`]); `[outbox.columns]` names the column of
//! each. Types are checked by OID when the `Relation` message arrives (in
//! [`super::relation`]), so a column of the wrong type is reported once, with its
//! name, its type and the expected types, instead of producing garbled records.
//! Only types whose text output can be used as is are accepted.
//!
//! Accepted column types:
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

use std::borrow::Cow;

use crate::config::OutboxConfig;

// Type OIDs (pg_type.dat); stable across PostgreSQL versions.
pub(super) const OID_BYTEA: u32 = 17;
pub(super) const OID_INT8: u32 = 20;
pub(super) const OID_INT2: u32 = 21;
pub(super) const OID_INT4: u32 = 23;
pub(super) const OID_TEXT: u32 = 25;
pub(super) const OID_JSON: u32 = 114;
pub(super) const OID_BPCHAR: u32 = 1042;
pub(super) const OID_VARCHAR: u32 = 1043;
pub(super) const OID_TIMESTAMP: u32 = 1114;
pub(super) const OID_TIMESTAMPTZ: u32 = 1184;
pub(super) const OID_UUID: u32 = 2950;
pub(super) const OID_JSONB: u32 = 3802;

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
/// Types of `payload`.
const PAYLOAD_TYPES: &[u32] = &[
    OID_JSONB,
    OID_JSON,
    OID_TEXT,
    OID_VARCHAR,
    OID_BPCHAR,
    OID_BYTEA,
];
/// Types of `headers`.
pub(super) const HEADERS_TYPES: &[u32] = &[OID_JSONB, OID_JSON];
/// Types of `created_at`.
pub(super) const TIMESTAMP_TYPES: &[u32] = &[OID_TIMESTAMPTZ, OID_TIMESTAMP];

/// Number of outbox fields ([`Field::ALL`]).
pub(super) const FIELD_COUNT: usize = 9;

/// The outbox columns the mapper knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Field {
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
    pub(super) const ALL: [Field; FIELD_COUNT] = [
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
    pub(super) const fn label(self) -> &'static str {
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
    pub(super) const fn alias(self) -> Option<&'static str> {
        match self {
            Field::AggregateType => Some("aggregatetype"),
            Field::AggregateId => Some("aggregateid"),
            Field::EventType => Some("type"),
            _ => None,
        }
    }

    /// Type OIDs whose text output the field accepts.
    pub(super) const fn accepted_types(self) -> &'static [u32] {
        match self {
            Field::Id | Field::IdempotencyKey | Field::AggregateId => KEY_TYPES,
            Field::AggregateType | Field::EventType | Field::Topic => LABEL_TYPES,
            Field::Headers => HEADERS_TYPES,
            Field::Payload => PAYLOAD_TYPES,
            Field::CreatedAt => TIMESTAMP_TYPES,
        }
    }

    /// The column name `[outbox.columns]` gives the field.
    pub(super) fn configured(self, outbox: &OutboxConfig) -> &str {
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
pub(super) struct FieldNames {
    pub(super) names: [String; FIELD_COUNT],
    pub(super) present: [bool; FIELD_COUNT],
    /// Which of the config's outboxes the table is (its place in
    /// `Config::outboxes`): where its events' poison rows go.
    pub(super) outbox: usize,
}

impl FieldNames {
    /// The column name of `field` in this table.
    pub(super) fn get(&self, field: Field) -> &str {
        &self.names[field as usize]
    }

    /// `aggregate_id column "aggregateid"`.
    pub(super) fn describe(&self, field: Field) -> String {
        format!("{} column {:?}", field.label(), self.get(field))
    }
}

/// The name of a type OID, for messages (`oid N` for types the mapper never accepts).
pub(super) fn type_name(oid: u32) -> Cow<'static, str> {
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
