//! Test fixtures shared by the replay tests: a mapper, an outbox row, and the
//! poison row the relay writes for it, read back the way `replay` reads it.

use bytes::Bytes;

use super::store::PoisonRecord;
use crate::config::{KafkaConfig, OutboxConfig};
use crate::lsn::Lsn;
use crate::outbox::{EnvelopeConfig, OutboxEvent, OutboxMapper, OutboxRow, PayloadFormat};

fn kafka_config(template: &str) -> KafkaConfig {
    let mut table = toml::Table::new();
    table.insert("brokers".into(), "k:9092".into());
    table.insert("topic_template".into(), template.into());
    table.try_into().unwrap()
}

pub(super) fn mapper(envelope: Option<EnvelopeConfig>) -> OutboxMapper {
    OutboxMapper::new(
        &OutboxConfig::default(),
        &kafka_config("outbox.event.{aggregate_type}"),
        envelope,
    )
    .unwrap()
}

pub(super) fn text(s: &str) -> Option<Bytes> {
    Some(Bytes::copy_from_slice(s.as_bytes()))
}

/// What the relay would have published for a row, and the poison row it writes
/// when the broker refuses it, read back the way `replay` reads it.
pub(super) fn poisoned(
    m: &OutboxMapper,
    row: &OutboxRow,
    lsn: Option<Lsn>,
) -> (OutboxEvent, PoisonRecord) {
    let event = m.map_row(row, lsn).unwrap();
    let f = event.poison_fields();
    let rec = PoisonRecord {
        poison_id: 7,
        outbox_id: f.outbox_id,
        idempotency_key: f.idempotency_key,
        aggregate_type: f.aggregate_type,
        aggregate_id: f.aggregate_id,
        event_type: f.event_type,
        topic: f.topic,
        headers: f.headers,
        payload: f.payload,
        // `to_json(timestamptz)` in a UTC session.
        created_at: f.created_at.map(|t| t.replace('Z', "+00:00")),
        lsn: f.lsn,
        replay_count: 0,
        error_kind: "message_size_too_large".into(),
        truncated: false,
        original: None,
        row_data: None,
        unavailable: None,
    };
    (event, rec)
}

pub(super) fn original_row() -> OutboxRow {
    OutboxRow {
        id: text("0190f5c6-8d2a-7b3e-9c41-5d6e7f8a9b0c"),
        idempotency_key: text("key-42"),
        aggregate_type: text("order"),
        aggregate_id: text("order-7"),
        event_type: text("OrderPlaced"),
        topic: None,
        headers: text(r#"{"tenant": "acme", "trace": 17}"#),
        payload: text(r#"{"amount": 1.10, "big": 12345678901234567890}"#),
        payload_format: PayloadFormat::Json,
        created_at: text("2026-11-30 14:29:33.123456+00"),
        extra: Vec::new(),
    }
}
