//! The mapper against the record contract: rows of the migration table, Debezium
//! tables, broken tables, bad values, and properties over arbitrary relations and
//! tuples.

use super::*;
use crate::config::Columns;
use crate::outbox::columns::{
    OID_BPCHAR, OID_BYTEA, OID_INT4, OID_INT8, OID_JSON, OID_JSONB, OID_TEXT, OID_TIMESTAMP,
    OID_TIMESTAMPTZ, OID_UUID, OID_VARCHAR,
};
use crate::postgres::pgoutput::{ColumnValue, RelationColumn, TupleData};
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
const PAYLOAD: &str = r#"{"total": 1.10, "items": [1, 2], "big": 123456789012345678901234567890}"#;

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
    let mut m = OutboxMapper::with_template(&OutboxConfig::default(), template, envelope).unwrap();
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
    let Some(RelationStatus::Unmappable { error_kind, reason }) = Some(m.on_relation(&rel)) else {
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
    // uuid, integers, timestamps: rendered as their output functions print them,
    // so the record is the one text mode gives.
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&[
        0x01, 0x93, 0x7a, 0x2b, 0x3c, 0x4d, 0x7e, 0x5f, 0x80, 0x91, 0xa2, 0xb3, 0xc4, 0xd5, 0xe6,
        0xf7,
    ]);
    let from_binary = event(map(&m, &with(good_values(), "id", bin(&uuid))));
    let from_text = event(map(
        &m,
        &with(
            good_values(),
            "id",
            text("01937a2b-3c4d-7e5f-8091-a2b3c4d5e6f7"),
        ),
    ));
    assert_eq!(from_binary, from_text);
    // 2026-12-04 10:00:00.123456 UTC, in microseconds since 2000-01-01.
    let pg_micros: i64 = (1_796_378_400 - 946_684_800) * 1_000_000 + 123_456;
    let from_binary = event(map(
        &m,
        &with(good_values(), "created_at", bin(&pg_micros.to_be_bytes())),
    ));
    let from_text = event(map(
        &m,
        &with(
            good_values(),
            "created_at",
            text("2026-12-04 10:00:00.123456+00"),
        ),
    ));
    assert_eq!(from_binary.timestamp_ms, from_text.timestamp_ms);
    assert_eq!(from_binary.headers, from_text.headers);
    let infinite = unmappable(map(
        &m,
        &with(good_values(), "created_at", bin(&i64::MAX.to_be_bytes())),
    ));
    assert_eq!(infinite.error_kind, error_kind::BAD_TIMESTAMP);
    // A fixed-size value of the wrong size is refused, clearly.
    let u = unmappable(map(&m, &with(good_values(), "id", bin(&[7; 15]))));
    assert_eq!(u.error_kind, error_kind::BAD_VALUE);
    assert!(u.reason.contains("has 15 bytes, not 16"), "{}", u.reason);
}

#[test]
fn binary_integers_render_as_int_out_does() {
    for (oid, bytes, want) in [
        (OID_INT4, (-42i32).to_be_bytes().to_vec(), "-42"),
        (
            OID_INT8,
            i64::MAX.to_be_bytes().to_vec(),
            "9223372036854775807",
        ),
        (21, 7i16.to_be_bytes().to_vec(), "7"),
    ] {
        let text = crate::outbox::relation::binary_as_text(oid, &Bytes::from(bytes)).unwrap();
        assert_eq!(text, want);
    }
    assert!(crate::outbox::relation::binary_as_text(1700, &Bytes::from_static(b"x")).is_err());
}

#[test]
fn binary_timestamps_render_as_timestamp_out_does() {
    let render = |oid: u32, pg_micros: i64| {
        let b = Bytes::copy_from_slice(&pg_micros.to_be_bytes());
        crate::outbox::relation::binary_as_text(oid, &b).unwrap()
    };
    // 2026-12-04 10:00:00 UTC in microseconds since 2000-01-01.
    let base: i64 = (1_796_378_400 - 946_684_800) * 1_000_000;
    assert_eq!(render(OID_TIMESTAMPTZ, base), "2026-12-04 10:00:00+00");
    assert_eq!(
        render(OID_TIMESTAMPTZ, base + 123_400),
        "2026-12-04 10:00:00.1234+00"
    );
    assert_eq!(
        render(OID_TIMESTAMP, base + 5),
        "2026-12-04 10:00:00.000005"
    );
    assert_eq!(render(OID_TIMESTAMP, 0), "2000-01-01 00:00:00");
    assert_eq!(render(OID_TIMESTAMPTZ, i64::MAX), "infinity");
    assert_eq!(render(OID_TIMESTAMP, i64::MIN), "-infinity");
    assert_eq!(
        crate::outbox::relation::binary_as_text(OID_BYTEA, &Bytes::from_static(b"\x00\xff"))
            .unwrap(),
        "\\x00ff"
    );
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
    assert!(OutboxMapper::with_template(&config, &format!("{long}{{event_type}}"), None).is_err());
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
    let v: serde_json::Value = serde_json::from_slice(&event(map(&m, &values)).payload).unwrap();
    assert!(
        v["event_type"].is_null() && v["occurred_at"].is_null(),
        "{v}"
    );

    // Strings that need escaping.
    let values = with(good_values(), "event_type", text("a\"b\\c\n\u{1}é"));
    let v: serde_json::Value = serde_json::from_slice(&event(map(&m, &values)).payload).unwrap();
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

// ---- poll / replay path and poisoning of events ----

/// The row text of `good_values()` with a `{"h": "1"}` headers object, as the
/// poller and replay give it, with `extra` as its placed columns.
fn good_row(extra: Vec<Option<Bytes>>) -> OutboxRow {
    let b = |s: &str| Some(Bytes::copy_from_slice(s.as_bytes()));
    OutboxRow {
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
        extra,
    }
}

#[test]
fn map_row_produces_the_same_record_without_source_lsn() {
    let m = mapper();
    let cdc = event(map(
        &m,
        &with(good_values(), "headers", text(r#"{"h": "1"}"#)),
    ));
    let row = good_row(Vec::new());
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
            payload_format: format, created_at: v(8), extra: Vec::new(),
        };
        if let Ok(e) = m.map_row(&row, Some(LSN)) {
            check_event(&e);
        }
    }







}

/// Mapping cost; run with
/// `cargo test --release --lib outbox::mapper::tests::mapping_cost -- --ignored --nocapture`.
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

/// `[[outbox]]`: each table is mapped with its own columns and topic template, its
/// events and unmappable rows name their outbox (for the poison table), and a table
/// of neither is not an outbox.
#[test]
fn several_outboxes_map_each_table_with_its_own_layout() {
    let config = crate::config::test_config(
        "[[outbox]]\ntable = \"public.outbox\"\n\
         [[outbox]]\ntable = \"shipping.events\"\npreset = \"debezium\"\n\
         poison_table = \"shipping.poison\"\ntopic_template = \"ship.{event_type}\"\n",
    );
    let mut m = OutboxMapper::for_config(&config).unwrap();
    assert_eq!(m.on_relation(&outbox_relation()), RelationStatus::Outbox);
    let debezium = relation(
        REL + 1,
        "shipping",
        "events",
        vec![
            col("id", OID_UUID),
            col("aggregatetype", OID_VARCHAR),
            col("aggregateid", OID_VARCHAR),
            col("type", OID_VARCHAR),
            col("payload", OID_JSONB),
        ],
    );
    assert_eq!(m.on_relation(&debezium), RelationStatus::Outbox);
    let other = relation(REL + 2, "public", "events", migration_columns());
    assert_eq!(m.on_relation(&other), RelationStatus::NotOutbox);

    let first = event(map(&m, &good_values()));
    assert_eq!(first.topic, "outbox.event.Order");
    assert_eq!(first.poison_fields().outbox, 0);

    let values = [
        ("id", text(ID)),
        ("aggregatetype", text("parcel")),
        ("aggregateid", text("p-1")),
        ("type", text("ParcelMoved")),
        ("payload", text("{}")),
    ];
    let second = event(m.map_insert(&insert(&debezium, &values), LSN).unwrap());
    assert_eq!(second.topic, "ship.ParcelMoved");
    assert_eq!(&second.key[..], b"p-1");
    assert_eq!(&second.idempotency_key[..], ID.as_bytes());
    assert_eq!(second.poison_fields().outbox, 1);

    let no_payload = &values[..4];
    let refused = unmappable(m.map_insert(&insert(&debezium, no_payload), LSN).unwrap());
    assert_eq!(refused.fields.outbox, 1);
    assert!(
        m.map_insert(&insert(&other, &good_values()), LSN)
            .is_ok_and(|mapped| matches!(mapped, Mapped::NotOutbox))
    );
}

/// `tombstone_on_empty_payload`: a NULL payload is a record with a null value (key
/// and headers as usual, no envelope around it); without it, a poison row.
#[test]
fn a_null_payload_is_a_tombstone_when_the_outbox_says_so() {
    let values = with(good_values(), "payload", ColumnValue::Null);
    let refused = unmappable(map(&mapper(), &values));
    assert_eq!(refused.error_kind, error_kind::NULL_PAYLOAD);

    let outbox = OutboxConfig {
        tombstone_on_empty_payload: true,
        ..OutboxConfig::default()
    };
    let envelope = EnvelopeConfig {
        producer: "svc".into(),
        schema_version: "1".into(),
    };
    let mut m = OutboxMapper::with_template(&outbox, "t", Some(envelope)).unwrap();
    m.on_relation(&outbox_relation());
    let e = event(map(&m, &values));
    assert!(e.tombstone);
    assert!(e.payload.is_empty());
    assert_eq!(&e.key[..], b"42");
    assert_eq!(&e.idempotency_key[..], b"order-42-created");
    assert_eq!(e.poison_fields().payload, None);
    // A payload that is there is a record as always.
    let e = event(map(&m, &good_values()));
    assert!(!e.tombstone);
    assert!(e.payload.starts_with(b"{\"event_id\""));
}

/// `additional_placement`: columns as headers (after the relay's own, before the
/// row's) and as envelope fields; their values go into `row_data` when poisoned; a
/// placed column the table lacks makes the table unmappable; `map_row` (poller,
/// replay) places the same values.
#[test]
fn placed_columns_become_headers_and_envelope_fields() {
    let outbox = OutboxConfig {
        additional_placement: vec![
            "tenant:header".into(),
            "version:header:schema_version".into(),
            "region:envelope:region".into(),
        ],
        ..OutboxConfig::default()
    };
    let envelope = EnvelopeConfig {
        producer: "svc".into(),
        schema_version: "1".into(),
    };
    let mut columns = migration_columns();
    columns.extend([
        col("tenant", OID_TEXT),
        col("version", OID_INT4),
        col("region", OID_TEXT),
    ]);
    let rel = relation(REL, "public", "outbox", columns);
    let mut m = OutboxMapper::with_template(&outbox, "t", Some(envelope)).unwrap();
    assert_eq!(m.on_relation(&rel), RelationStatus::Outbox);
    let mut values = with(good_values(), "headers", text(r#"{"h": "1"}"#));
    values.extend([
        ("tenant", text("acme")),
        ("version", text("3")),
        ("region", text("eu \"west\"")),
    ]);
    let e = event(m.map_insert(&insert(&rel, &values), LSN).unwrap());
    let names: Vec<String> = header_list(&e).into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "idempotency_key",
            "event_type",
            "aggregate_type",
            "occurred_at",
            "source_lsn",
            "tenant",
            "schema_version",
            "h"
        ]
    );
    assert!(header_list(&e).contains(&("schema_version".into(), "3".into())));
    let value: serde_json::Value = serde_json::from_slice(&e.payload).unwrap();
    assert_eq!(value["region"], "eu \"west\"");
    let poisoned = e.poison_fields();
    assert!(
        poisoned
            .columns
            .contains(&("tenant".into(), Some("acme".into())))
    );

    // A NULL placed column: no header, a null envelope field.
    let values = with(values, "tenant", ColumnValue::Null);
    let e = event(m.map_insert(&insert(&rel, &values), LSN).unwrap());
    assert!(!header_list(&e).iter().any(|(n, _)| n == "tenant"));

    // The poller's and replay's row text, with the placed values: the same record.
    let b = |s: &str| Some(Bytes::copy_from_slice(s.as_bytes()));
    let row = good_row(vec![None, b("3"), b("eu \"west\"")]);
    let polled = m.map_row(&row, Some(LSN)).unwrap();
    assert_eq!(polled.headers, e.headers);
    assert_eq!(polled.payload, e.payload);

    // A row header with a placed header's name is refused (it would shadow it).
    let values = with(values, "headers", text(r#"{"schema_version": "9"}"#));
    let refused = unmappable(m.map_insert(&insert(&rel, &values), LSN).unwrap());
    assert_eq!(refused.error_kind, error_kind::BAD_HEADERS);

    // map_row's unmappable rows keep the placed values in row_data (for replay).
    let no_payload = OutboxRow {
        payload: None,
        ..row.clone()
    };
    let refused = m.map_row(&no_payload, None).unwrap_err();
    assert!(
        refused
            .fields
            .columns
            .contains(&("version".into(), Some("3".into())))
    );

    // A placed column the table does not have: every insert is unmappable.
    let mut without = OutboxMapper::with_template(&outbox, "t", None).unwrap();
    without.on_relation(&outbox_relation());
    let refused = unmappable(map(&without, &good_values()));
    assert_eq!(refused.error_kind, error_kind::MISSING_COLUMN);
    assert!(
        refused
            .reason
            .contains("\"tenant\" (outbox.additional_placement)")
    );
}

// ---------------------------------------------------------------------------
// The message outbox
// ---------------------------------------------------------------------------

fn message(prefix: &str, flags: u8, content: Vec<u8>) -> LogicalDecodingMessage {
    LogicalDecodingMessage {
        xid: None,
        flags,
        lsn: LSN,
        prefix: crate::postgres::pgoutput::PgStr::new(Bytes::copy_from_slice(prefix.as_bytes()))
            .unwrap(),
        content: Bytes::from(content),
    }
}

fn frame(aggregate_id: Option<&[u8]>) -> Vec<u8> {
    message::encode_frame(
        PayloadFormat::Json,
        [
            Some(b"k-1"),
            Some(b"order"),
            aggregate_id,
            Some(b"order_created"),
            None,
            Some(br#"{"traceparent":"00-ab-cd-01"}"#),
            Some(br#"{"total": 10}"#),
            Some(b"2026-12-04 10:00:00.123456+00"),
        ],
    )
}

const PREFIX: &str = "outbox-relay:public.outbox";

#[test]
fn a_message_maps_to_the_record_a_row_with_its_fields_would_give() {
    let m = mapper();
    let MessageMapped::Outbox(Mapped::Event(from_message)) = m.map_message(
        &message(
            PREFIX,
            LogicalDecodingMessage::TRANSACTIONAL,
            frame(Some(b"42")),
        ),
        LSN,
    ) else {
        panic!("not an event");
    };
    let Mapped::Event(from_row) = map(
        &m,
        &[
            ("idempotency_key", text("k-1")),
            ("aggregate_type", text("order")),
            ("aggregate_id", text("42")),
            ("event_type", text("order_created")),
            ("headers", text(r#"{"traceparent":"00-ab-cd-01"}"#)),
            ("payload", text(r#"{"total": 10}"#)),
            ("created_at", text("2026-12-04 10:00:00.123456+00")),
        ],
    ) else {
        panic!("the row is not an event");
    };
    assert_eq!(from_message.key, from_row.key);
    assert_eq!(from_message.topic, from_row.topic);
    assert_eq!(from_message.payload, from_row.payload);
    assert_eq!(from_message.timestamp_ms, from_row.timestamp_ms);
    // The row's headers, without the event id the row's `id` column would give.
    assert_eq!(from_message.headers, from_row.headers);
    // Refused by the broker, it is poisoned with the message marker.
    assert!(from_message.poison_fields().is_message());
    assert!(!from_row.poison_fields().is_message());
}

#[test]
fn messages_that_are_not_this_relays_events_are_told_apart() {
    let m = mapper();
    let content = frame(Some(b"42"));
    let tx = LogicalDecodingMessage::TRANSACTIONAL;
    assert_eq!(
        m.map_message(&message("outbox-relay", 0, content.clone()), LSN),
        MessageMapped::Foreign
    );
    assert_eq!(
        m.map_message(&message("debezium", tx, content.clone()), LSN),
        MessageMapped::Foreign
    );
    assert_eq!(
        m.map_message(
            &message("outbox-relay:app.outbox", tx, content.clone()),
            LSN
        ),
        MessageMapped::OtherOutbox
    );
    assert_eq!(
        m.map_message(&message(PREFIX, 0, content), LSN),
        MessageMapped::NotTransactional
    );
}

#[test]
fn an_undeliverable_message_is_poisoned_whole_and_marked() {
    let m = mapper();
    let tx = LogicalDecodingMessage::TRANSACTIONAL;
    let MessageMapped::Outbox(Mapped::Unmappable(no_key)) =
        m.map_message(&message(PREFIX, tx, frame(None)), LSN)
    else {
        panic!("a message without an entity id is not unmappable");
    };
    assert_eq!(no_key.error_kind, error_kind::NULL_KEY);
    assert!(no_key.fields.is_message());
    // The same message again in the same transaction (another LSN) is another
    // poison row: the marker, part of the content hash, names the message's LSN.
    let mut later = message(PREFIX, tx, frame(None));
    later.lsn = Lsn(LSN.0 + 100);
    let MessageMapped::Outbox(Mapped::Unmappable(again)) = m.map_message(&later, LSN) else {
        panic!("not unmappable");
    };
    assert_ne!(no_key.fields.columns, again.fields.columns);
    assert_eq!(no_key.fields.idempotency_key.as_deref(), Some("k-1"));
    assert_eq!(no_key.fields.outbox_id, None);

    let MessageMapped::Outbox(Mapped::Unmappable(garbage)) =
        m.map_message(&message(PREFIX, tx, vec![2, 0xff]), LSN)
    else {
        panic!("a message that is no frame is not unmappable");
    };
    assert_eq!(garbage.error_kind, error_kind::BAD_MESSAGE);
    assert!(garbage.fields.is_message());
    assert_eq!(garbage.fields.payload.as_deref(), Some("\\x02ff"));
    assert_eq!(garbage.fields.lsn, Some(LSN));
}
