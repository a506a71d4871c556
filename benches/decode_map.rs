//! Micro-benchmarks of the per-event hot path: decoding a pgoutput `Insert` of the
//! default outbox table, and mapping it to a Kafka record. Events/s per core is
//! `1 / time per iteration`. Run with `cargo bench --bench decode_map`.
//!
//! Before timing, it counts heap allocations per event (decode, map, both) with a
//! counting global allocator and prints them: zero-copy decoding should allocate
//! nothing, and the mapper only what a record must own.

use std::alloc::System;

use bytes::{BufMut, Bytes, BytesMut};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use outbox_relay::config::{KafkaConfig, OutboxConfig};
use outbox_relay::lsn::Lsn;
use outbox_relay::outbox::{Mapped, OutboxMapper};
use outbox_relay::postgres::pgoutput::{
    Decoder, LogicalReplicationMessage, Relation, RelationColumn,
};
use stats_alloc::{INSTRUMENTED_SYSTEM, Region, StatsAlloc};

// Counts allocations (stats_alloc wraps the system allocator; this crate forbids
// unsafe code, so no hand-written GlobalAlloc).
#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

/// Allocations per call of `f`, averaged over many calls.
fn allocations_per_call<T>(mut f: impl FnMut() -> T) -> f64 {
    const CALLS: u32 = 10_000;
    let region = Region::new(GLOBAL);
    for _ in 0..CALLS {
        std::hint::black_box(f());
    }
    let stats = region.change();
    #[allow(clippy::cast_precision_loss)]
    let per_call = (stats.allocations + stats.reallocations) as f64 / f64::from(CALLS);
    per_call
}

const RELATION_ID: u32 = 16_385;
const TEXT: u32 = 25;
const UUID: u32 = 2950;
const JSONB: u32 = 3802;
const TIMESTAMPTZ: u32 = 1184;
const INT4: u32 = 23;

/// The default outbox table as pgoutput describes it.
fn relation() -> Relation {
    let col = |name: &str, type_oid| RelationColumn {
        flags: 0,
        name: name.to_owned(),
        type_oid,
        type_modifier: -1,
    };
    Relation {
        xid: None,
        id: RELATION_ID,
        namespace: "public".into(),
        name: "outbox".into(),
        replica_identity: b'd',
        columns: vec![
            col("id", UUID),
            col("idempotency_key", TEXT),
            col("aggregate_type", TEXT),
            col("aggregate_id", TEXT),
            col("event_type", TEXT),
            col("topic", TEXT),
            col("headers", JSONB),
            col("payload", JSONB),
            col("created_at", TIMESTAMPTZ),
            col("sent_at", TIMESTAMPTZ),
            col("attempts", INT4),
            col("last_error", TEXT),
        ],
    }
}

/// An `Insert` message with a ~300-byte JSON payload, byte for byte as pgoutput
/// sends it (protocol v1).
fn insert_frame() -> Bytes {
    let payload = format!(
        r#"{{"order_id": 4711, "customer": "c-0042", "amount_cents": 12999, "currency": "EUR", "items": [{{"sku": "sku-1", "qty": 2}}, {{"sku": "sku-2", "qty": 1}}], "note": "{}"}}"#,
        "x".repeat(150)
    );
    let values: [Option<&str>; 12] = [
        Some("0192f1a0-7b1c-7d2e-8f00-123456789abc"),
        Some("0192f1a0-7b1c-7d2e-8f00-cba987654321"),
        Some("order"),
        Some("order-4711"),
        Some("OrderPlaced"),
        None,
        None,
        Some(&payload),
        Some("2026-11-30 14:29:33.123456+00"),
        None,
        Some("0"),
        None,
    ];
    let mut b = BytesMut::new();
    b.put_u8(b'I');
    b.put_u32(RELATION_ID);
    b.put_u8(b'N');
    b.put_i16(12);
    for v in values {
        match v {
            None => b.put_u8(b'n'),
            Some(v) => {
                b.put_u8(b't');
                b.put_i32(i32::try_from(v.len()).expect("small"));
                b.put_slice(v.as_bytes());
            }
        }
    }
    b.freeze()
}

fn mapper() -> OutboxMapper {
    let kafka: KafkaConfig = toml::from_str("brokers = \"b:9092\"").expect("kafka config");
    let mut mapper = OutboxMapper::new(&OutboxConfig::default(), &kafka, None).expect("mapper");
    mapper.on_relation(&relation());
    mapper
}

fn print_allocations(frame: &Bytes, mapper: &OutboxMapper) {
    let mut decoder = Decoder::new(1);
    let decode = allocations_per_call(|| decoder.decode(frame.clone()).expect("decodes"));
    let Ok(LogicalReplicationMessage::Insert(insert)) = decoder.decode(frame.clone()) else {
        panic!("not an insert");
    };
    let map = allocations_per_call(|| mapper.map_insert(&insert, Lsn(0x16_B374_D848)));
    eprintln!(
        "allocations per event: decode {decode:.1}, map {map:.1}, decode+map {:.1}",
        decode + map
    );
}

fn bench(c: &mut Criterion) {
    let frame = insert_frame();
    let mapper = mapper();
    print_allocations(&frame, &mapper);
    let mut group = c.benchmark_group("per_event");
    group.throughput(Throughput::Elements(1));
    group.bench_function("decode_insert", |b| {
        let mut decoder = Decoder::new(1);
        b.iter(|| decoder.decode(frame.clone()).expect("decodes"));
    });
    group.bench_function("map_insert", |b| {
        let mut decoder = Decoder::new(1);
        let Ok(LogicalReplicationMessage::Insert(insert)) = decoder.decode(frame.clone()) else {
            panic!("not an insert");
        };
        b.iter(|| match mapper.map_insert(&insert, Lsn(0x16_B374_D848)) {
            Ok(Mapped::Event(e)) => e,
            other => panic!("unexpected {other:?}"),
        });
    });
    group.bench_function("decode_and_map", |b| {
        let mut decoder = Decoder::new(1);
        b.iter(|| {
            let Ok(LogicalReplicationMessage::Insert(insert)) = decoder.decode(frame.clone())
            else {
                panic!("not an insert");
            };
            match mapper.map_insert(&insert, Lsn(0x16_B374_D848)) {
                Ok(Mapped::Event(e)) => e,
                other => panic!("unexpected {other:?}"),
            }
        });
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
