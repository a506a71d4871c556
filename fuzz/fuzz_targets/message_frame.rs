//! Fuzzes the message outbox: arbitrary message contents under the outbox's prefix
//! go through `OutboxMapper::map_message`, as the relay maps them.
//!
//! Checks beyond "no panic": a content that decodes as a frame maps to an event or
//! an unmappable row, one that does not is an unmappable `bad_message` row; every
//! unmappable row is marked as a message (so `audit` and the poison writer know it)
//! and keeps the whole content of an unreadable frame.
#![no_main]

use std::sync::OnceLock;

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use outbox_relay::Lsn;
use outbox_relay::config::{KafkaConfig, OutboxConfig};
use outbox_relay::outbox::message::{self, MessageMapped};
use outbox_relay::outbox::{Mapped, OutboxMapper, error_kind};
use outbox_relay::postgres::pgoutput::{LogicalDecodingMessage, PgStr};

fn mapper() -> &'static OutboxMapper {
    static MAPPER: OnceLock<OutboxMapper> = OnceLock::new();
    MAPPER.get_or_init(|| {
        let kafka: KafkaConfig = toml::from_str("brokers = \"b:9092\"").expect("kafka config");
        OutboxMapper::new(&OutboxConfig::default(), &kafka, None).expect("mapper")
    })
}

fuzz_target!(|data: &[u8]| {
    let content = Bytes::copy_from_slice(data);
    let prefix = PgStr::new(Bytes::from(message::prefix_of("public.outbox"))).expect("prefix");
    let msg = LogicalDecodingMessage {
        xid: None,
        flags: LogicalDecodingMessage::TRANSACTIONAL,
        lsn: Lsn(1),
        prefix,
        content: content.clone(),
    };
    let frame = message::decode_frame(&content);
    match mapper().map_message(&msg, Lsn(2)) {
        MessageMapped::Outbox(Mapped::Event(event)) => {
            assert!(frame.is_ok());
            assert!(!event.key.is_empty());
        }
        MessageMapped::Outbox(Mapped::Unmappable(row)) => {
            assert!(row.fields.is_message());
            if frame.is_err() {
                assert_eq!(row.error_kind, error_kind::BAD_MESSAGE);
                assert!(row.fields.payload.is_some());
            }
        }
        other => panic!("an outbox message mapped to {other:?}"),
    }
});
