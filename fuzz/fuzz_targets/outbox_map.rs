//! Fuzzes the outbox mapper: decoded `Relation` / `Insert` messages are fed to
//! `OutboxMapper::on_relation` and `OutboxMapper::map_insert`, as the relay does.
//!
//! Input layout: byte 0 is a flag byte, the rest is a sequence of `pgoutput`
//! messages separated by [`SEP`], decoded with a `Decoder` (v4, so streamed
//! transactions decode too).
//!
//! Flags:
//! - bit 0: before an Insert for a relation the session has not described, register
//!   the canonical outbox relation (the columns of `migrations/0001_outbox.sql`)
//!   under that id, so the fuzzer reaches the row mapping without having to
//!   produce a matching Relation message first.
//! - bits 2..3: the canonical relation's `payload` type: jsonb, json, text, bytea.
//! - bit 1: map with a second mapper that has a JSON envelope as well.
//!
//! The mapper is built as the relay builds it: `OutboxMapper::new(&OutboxConfig::default(),
//! &kafka_config, None)` with `kafka_config` from `brokers = "b:9092"`.
//!
//! Checks beyond "no panic": an event has a legal topic, a non-empty key and
//! idempotency key, `idempotency_key` as its first header; an unmappable row has a
//! known error kind; and for the canonical relation with text/NULL columns only,
//! `map_row` (the polling relay and `replay`) gives the same result as `map_insert`.
#![no_main]

use std::sync::OnceLock;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use outbox_relay::Lsn;
use outbox_relay::config::{KafkaConfig, OutboxConfig};
use outbox_relay::outbox::{
    EnvelopeConfig, HEADER_IDEMPOTENCY_KEY, Mapped, OutboxMapper, OutboxRow, PayloadFormat,
    error_kind, validate_topic_name,
};
use outbox_relay::postgres::pgoutput::{
    ColumnValue, Decoder, Insert, LogicalReplicationMessage, Relation, RelationColumn,
};

const SEP: &[u8] = b"\xff\xfe\xfd\xfc";

/// `FUZZ_DEBUG=1` prints what each input decodes to (for checking seeds with
/// `-runs=0`); read once.
fn debug() -> bool {
    static DEBUG: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DEBUG.get_or_init(|| std::env::var_os("FUZZ_DEBUG").is_some())
}

const OID_BYTEA: u32 = 17;
const OID_INT4: u32 = 23;
const OID_TEXT: u32 = 25;
const OID_JSON: u32 = 114;
const OID_TIMESTAMPTZ: u32 = 1184;
const OID_UUID: u32 = 2950;
const OID_JSONB: u32 = 3802;

const ERROR_KINDS: &[&str] = &[
    error_kind::NULL_KEY,
    error_kind::EMPTY_KEY,
    error_kind::NULL_IDEMPOTENCY_KEY,
    error_kind::EMPTY_IDEMPOTENCY_KEY,
    error_kind::NULL_PAYLOAD,
    error_kind::BAD_PAYLOAD,
    error_kind::MISSING_COLUMN,
    error_kind::BAD_COLUMN_TYPE,
    error_kind::BAD_VALUE,
    error_kind::UNCHANGED_TOAST,
    error_kind::INVALID_TOPIC,
    error_kind::BAD_HEADERS,
    error_kind::BAD_TIMESTAMP,
];

fn split(mut data: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut done = false;
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        // Compared as a u32, not a slice: a slice compare is a memcmp call, which
        // libFuzzer intercepts and traces at every position, slowing big inputs.
        let sep = u32::from_le_bytes([SEP[0], SEP[1], SEP[2], SEP[3]]);
        match data
            .windows(SEP.len())
            .position(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) == sep)
        {
            Some(i) => {
                let (head, tail) = data.split_at(i);
                data = &tail[SEP.len()..];
                Some(head)
            }
            None => {
                done = true;
                Some(data)
            }
        }
    })
}

fn kafka_config() -> &'static KafkaConfig {
    static CONFIG: OnceLock<KafkaConfig> = OnceLock::new();
    CONFIG.get_or_init(|| toml::from_str("brokers = \"b:9092\"").expect("kafka config"))
}

fn mapper(envelope: bool) -> OutboxMapper {
    let envelope = envelope.then(|| EnvelopeConfig {
        producer: "fuzz \"producer\"".into(),
        schema_version: "1".into(),
    });
    OutboxMapper::new(&OutboxConfig::default(), kafka_config(), envelope).expect("mapper")
}

/// The columns of the outbox table as `migrate` creates it, in table order.
const CANONICAL: [(&str, u32); 12] = [
    ("id", OID_UUID),
    ("idempotency_key", OID_TEXT),
    ("aggregate_type", OID_TEXT),
    ("aggregate_id", OID_TEXT),
    ("event_type", OID_TEXT),
    ("topic", OID_TEXT),
    ("headers", OID_JSONB),
    ("payload", OID_JSONB),
    ("created_at", OID_TIMESTAMPTZ),
    ("sent_at", OID_TIMESTAMPTZ),
    ("attempts", OID_INT4),
    ("last_error", OID_TEXT),
];
const PAYLOAD_POS: usize = 7;

fn canonical_relation(id: u32, payload_oid: u32) -> Relation {
    Relation {
        xid: None,
        id,
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: b'd',
        columns: CANONICAL
            .iter()
            .enumerate()
            .map(|(i, &(name, oid))| RelationColumn {
                flags: u8::from(i == 0),
                name: name.into(),
                type_oid: if i == PAYLOAD_POS { payload_oid } else { oid },
                type_modifier: -1,
            })
            .collect(),
    }
}

fn payload_format_of(oid: u32) -> PayloadFormat {
    match oid {
        OID_JSON | OID_JSONB => PayloadFormat::Json,
        OID_BYTEA => PayloadFormat::ByteaText,
        _ => PayloadFormat::Text,
    }
}

/// The canonical row as column text, as the polling relay would read it; `None`
/// when a column is not text or NULL (only pgoutput has those).
fn as_row(insert: &Insert, payload_oid: u32) -> Option<OutboxRow> {
    let cols = &insert.tuple.columns;
    if cols.len() != CANONICAL.len() {
        return None;
    }
    let mut text = Vec::with_capacity(cols.len());
    for c in cols {
        text.push(match c {
            ColumnValue::Null => None,
            ColumnValue::Text(b) => Some(b.clone()),
            _ => return None,
        });
    }
    Some(OutboxRow {
        id: text[0].clone(),
        idempotency_key: text[1].clone(),
        aggregate_type: text[2].clone(),
        aggregate_id: text[3].clone(),
        event_type: text[4].clone(),
        topic: text[5].clone(),
        headers: text[6].clone(),
        payload: text[7].clone(),
        payload_format: payload_format_of(payload_oid),
        created_at: text[8].clone(),
        extra: Vec::new(),
    })
}

fn check(mapped: &Mapped) {
    match mapped {
        Mapped::NotOutbox => {}
        Mapped::Event(event) => {
            assert!(
                validate_topic_name(event.topic.as_bytes()).is_ok(),
                "event with an illegal topic {:?}",
                event.topic
            );
            assert!(!event.key.is_empty(), "event with an empty key");
            assert!(!event.idempotency_key.is_empty(), "empty idempotency key");
            let first = event.headers.first().expect("no headers");
            assert_eq!(first.0, HEADER_IDEMPOTENCY_KEY);
            assert_eq!(first.1, event.idempotency_key);
            let _ = event.byte_size();
            let _ = event.poison_fields();
        }
        Mapped::Unmappable(row) => {
            assert!(
                ERROR_KINDS.contains(&row.error_kind),
                "unknown error kind {:?}",
                row.error_kind
            );
            let _ = row.to_string();
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, rest)) = data.split_first() else {
        return;
    };
    let canonical = flags & 0x01 != 0;
    let with_envelope = flags & 0x02 != 0;
    let payload_oid = [OID_JSONB, OID_JSON, OID_TEXT, OID_BYTEA][usize::from((flags >> 2) & 3)];

    let mut plain = mapper(false);
    let mut enveloped = with_envelope.then(|| mapper(true));
    // Relation ids registered as the canonical relation (for the map_row check).
    let mut canonical_ids: Vec<u32> = Vec::new();
    let mut decoder = Decoder::new(4);
    let mut commit_lsn = Lsn(0);

    for msg in split(rest) {
        let msg = match decoder.decode(Bytes::copy_from_slice(msg)) {
            Ok(msg) => msg,
            Err(e) => {
                if debug() {
                    eprintln!("  decode error: {e}");
                }
                continue;
            }
        };
        match msg {
            LogicalReplicationMessage::Begin(b) => commit_lsn = b.final_lsn,
            LogicalReplicationMessage::Relation(rel) => {
                canonical_ids.retain(|&id| id != rel.id);
                let _ = plain.on_relation(&rel);
                if let Some(m) = enveloped.as_mut() {
                    let _ = m.on_relation(&rel);
                }
            }
            LogicalReplicationMessage::Insert(insert) => {
                if canonical && plain.relation_status(insert.relation_id).is_none() {
                    let rel = canonical_relation(insert.relation_id, payload_oid);
                    let _ = plain.on_relation(&rel);
                    if let Some(m) = enveloped.as_mut() {
                        let _ = m.on_relation(&rel);
                    }
                    canonical_ids.push(insert.relation_id);
                }
                let mapped = plain.map_insert(&insert, commit_lsn);
                if debug() {
                    match &mapped {
                        Ok(Mapped::Event(e)) => {
                            eprintln!("  event topic={} key={:?}", e.topic, e.key)
                        }
                        Ok(Mapped::Unmappable(u)) => eprintln!("  unmappable {u}"),
                        other => eprintln!("  {other:?}"),
                    }
                }
                if let Ok(mapped) = &mapped {
                    check(mapped);
                    if canonical_ids.contains(&insert.relation_id)
                        && let Some(row) = as_row(&insert, payload_oid)
                    {
                        let by_row = plain.map_row(&row, Some(commit_lsn));
                        match (mapped, &by_row) {
                            (Mapped::Event(a), Ok(b)) => {
                                assert_eq!(a, b, "map_insert and map_row disagree")
                            }
                            (Mapped::Unmappable(a), Err(b)) => {
                                assert_eq!(a.error_kind, b.error_kind);
                                assert_eq!(a.reason, b.reason);
                            }
                            _ => panic!("map_insert gave {mapped:?}, map_row gave {by_row:?}"),
                        }
                    }
                }
                if let Some(m) = enveloped.as_ref()
                    && let Ok(mapped) = m.map_insert(&insert, commit_lsn)
                {
                    check(&mapped);
                }
            }
            _ => {}
        }
    }
});
