//! The publisher against the real Kafka-protocol broker: every accepted send is
//! reported exactly once, records arrive intact and in per-key order on the partition
//! the Java client would pick, record-level rejections come back as permanent
//! failures, and an unreachable broker is a clear start-up error.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use outbox_relay::Error;
use outbox_relay::config::{KafkaConfig, RelayConfig};
use outbox_relay::delivery::{EventId, Failure};
use outbox_relay::kafka::{
    BrokerError, DeliveryReport, Publisher, RecordRef, producer_config, report_capacity,
};
use rdkafka::types::RDKafkaErrorCode;
use tokio::sync::mpsc;

use crate::harness::{Record, consume, create_topic, env, unique};

fn kafka_config(brokers: &str, producer: &[(&str, &str)]) -> KafkaConfig {
    // Through serde, so fields added to `KafkaConfig` later keep their defaults.
    let mut table = toml::Table::new();
    table.insert("brokers".into(), brokers.into());
    let producer: toml::Table = producer
        .iter()
        .map(|(k, v)| ((*k).to_owned(), toml::Value::from(*v)))
        .collect();
    table.insert("producer".into(), producer.into());
    table.try_into().expect("kafka config")
}

fn publisher(producer: &[(&str, &str)]) -> (Publisher, mpsc::Receiver<DeliveryReport>) {
    let relay = RelayConfig::default();
    let cfg =
        producer_config(&kafka_config(&env().brokers, producer), &relay).expect("producer config");
    Publisher::new(cfg, report_capacity(&relay)).expect("create publisher")
}

async fn next_report(rx: &mut mpsc::Receiver<DeliveryReport>, timeout: Duration) -> DeliveryReport {
    tokio::time::timeout(timeout, rx.recv())
        .await
        .unwrap_or_else(|_| panic!("no delivery report within {timeout:?}"))
        .expect("report channel open")
}

/// Kafka's `Utils.murmur2`, as the Java client's default partitioner uses it.
fn java_murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    // Java hashes an `int` length; keys here are far shorter than 4 GiB.
    let length = u32::try_from(data.len()).expect("key shorter than 4 GiB");
    let mut h: u32 = 0x9747_b28c ^ length;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> 24;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        if rest.len() >= 3 {
            h ^= u32::from(rest[2]) << 16;
        }
        if rest.len() >= 2 {
            h ^= u32::from(rest[1]) << 8;
        }
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h
}

fn java_partition(key: &[u8], partitions: u32) -> i32 {
    i32::try_from((java_murmur2(key) & 0x7fff_ffff) % partitions).expect("small partition")
}

#[test]
fn java_murmur2_matches_kafka_test_vectors() {
    // From Kafka's UtilsTest.testMurmur2.
    for (input, expected) in [
        ("21", -973_932_308_i32),
        ("foobar", -790_332_482),
        ("a-little-bit-long-string", -985_981_536),
        ("a-little-bit-longer-string", -1_486_304_829),
        (
            "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
            -58_897_971,
        ),
    ] {
        // Kafka's vectors are Java `int`s: the same 32 bits, read as signed.
        assert_eq!(
            java_murmur2(input.as_bytes()).cast_signed(),
            expected,
            "{input}"
        );
    }
}

/// 1,000 sends to a 3-partition topic: one report per id with distinct offsets, every
/// record consumed back intact, each key on the partition the Java client would pick,
/// and per-key order equal to send order.
#[tokio::test]
async fn thousand_sends_are_reported_once_and_round_trip_in_key_order() {
    const N: u64 = 1_000;
    const PARTITIONS: u32 = 3;
    let topic = unique("kafka_pub");
    create_topic(&topic, i32::try_from(PARTITIONS).expect("few partitions")).await;
    let (publisher, mut rx) = publisher(&[]);
    publisher
        .check_broker(Duration::from_secs(10))
        .await
        .expect("broker reachable");

    let base_ts = 1_700_000_000_000_i64;
    let key_of = |i: u64| format!("entity-{}", i % 17);
    let started = Instant::now();
    for i in 0..N {
        let key = key_of(i);
        let payload = format!("{{\"seq\":{i},\"key\":\"{key}\"}}");
        let idem = format!("idem-{i}");
        let headers: [(&str, &[u8]); 3] = [
            ("idempotency_key", idem.as_bytes()),
            ("event_type", b"OrderCreated"),
            ("seq", payload.as_bytes()),
        ];
        publisher
            .send(
                EventId::from_raw(i + 1),
                RecordRef {
                    topic: &topic,
                    key: key.as_bytes(),
                    payload: payload.as_bytes(),
                    headers: &headers,
                    timestamp_ms: Some(base_ts + i64::try_from(i).expect("i < N")),
                },
            )
            .expect("send accepted");
    }
    let send_time = started.elapsed();

    let mut ids = BTreeSet::new();
    let mut positions = BTreeSet::new();
    let mut position_of = BTreeMap::new();
    for _ in 0..N {
        let report = next_report(&mut rx, Duration::from_secs(60)).await;
        let (partition, offset) = report
            .result
            .clone()
            .unwrap_or_else(|e| panic!("{} failed: {e:?}", report.id));
        assert!(ids.insert(report.id), "{} reported twice", report.id);
        assert!(
            positions.insert((partition, offset)),
            "offset {partition}/{offset} reported twice"
        );
        position_of.insert(report.id.get() - 1, (partition, offset));
    }
    assert_eq!(ids.len() as u64, N);
    assert_eq!(
        ids.iter().map(|id| id.get()).collect::<Vec<_>>(),
        (1..=N).collect::<Vec<_>>()
    );
    publisher
        .flush(Duration::from_secs(10))
        .await
        .expect("flush");
    assert_eq!(publisher.in_flight(), 0);
    assert!(rx.try_recv().is_err(), "no report beyond one per send");
    assert!(
        send_time < Duration::from_secs(5),
        "sends must not wait for the broker: {send_time:?}"
    );

    let n = usize::try_from(N).expect("N fits in usize");
    let records: Vec<Record> = consume(&topic, n, Duration::from_secs(60)).await;
    assert_eq!(records.len() as u64, N, "consumed everything back");
    let mut last_seq_per_key: BTreeMap<Vec<u8>, (i32, u64)> = BTreeMap::new();
    let mut ordered = records.clone();
    ordered.sort_by_key(|r| (r.partition, r.offset));
    for r in &ordered {
        let idem = r.header("idempotency_key").expect("idempotency_key header");
        let seq: u64 = idem
            .strip_prefix("idem-")
            .and_then(|s| s.parse().ok())
            .expect("idempotency key of ours");
        let key = key_of(seq);
        let payload = format!("{{\"seq\":{seq},\"key\":\"{key}\"}}");
        assert_eq!(r.key.as_deref(), Some(key.as_bytes()), "key of {seq}");
        assert_eq!(
            r.payload.as_deref(),
            Some(payload.as_bytes()),
            "payload of {seq}"
        );
        assert_eq!(r.header("event_type"), Some("OrderCreated"));
        assert_eq!(r.header("seq"), Some(payload.as_str()));
        let names: Vec<&str> = r.headers.keys().map(String::as_str).collect();
        assert_eq!(names, ["event_type", "idempotency_key", "seq"]);
        assert_eq!(
            r.timestamp_ms,
            Some(base_ts + i64::try_from(seq).expect("seq < N")),
            "CreateTime of {seq}"
        );
        assert_eq!(
            position_of.get(&seq),
            Some(&(r.partition, r.offset)),
            "report and topic agree on {seq}"
        );
        assert_eq!(
            r.partition,
            java_partition(key.as_bytes(), PARTITIONS),
            "{key} placed like the Java client"
        );
        if let Some(&(partition, last)) = last_seq_per_key.get(key.as_bytes()) {
            assert_eq!(partition, r.partition, "{key} stays on one partition");
            assert!(seq > last, "{key}: {seq} after {last}");
        }
        last_seq_per_key.insert(key.into_bytes(), (r.partition, seq));
    }
    assert_eq!(last_seq_per_key.len(), 17);
    let used: BTreeSet<i32> = records.iter().map(|r| r.partition).collect();
    assert!(used.len() > 1, "17 keys spread over partitions: {used:?}");
}

/// A 2 MB record (above the 1 MB `message.max.bytes`) is refused, permanently.
#[tokio::test]
async fn oversized_record_is_a_permanent_failure() {
    let topic = unique("kafka_big");
    create_topic(&topic, 1).await;
    let (publisher, mut rx) = publisher(&[]);
    let payload = vec![b'x'; 2 * 1024 * 1024];
    let id = EventId::from_raw(7);
    let sent = publisher.send(
        id,
        RecordRef {
            topic: &topic,
            key: b"big",
            payload: &payload,
            headers: &[("idempotency_key", b"big-1")],
            timestamp_ms: None,
        },
    );
    let (code, failure) = match sent {
        Err(rejected) => {
            assert!(
                tokio::time::timeout(Duration::from_millis(500), rx.recv())
                    .await
                    .is_err(),
                "a rejected send has no report"
            );
            (rejected.code, rejected.failure)
        }
        Ok(()) => {
            let report = next_report(&mut rx, Duration::from_secs(30)).await;
            assert_eq!(report.id, id);
            let failure = report.failure().expect("a failure");
            let (code, _) = report.result.expect_err("not delivered");
            (code, failure)
        }
    };
    assert_eq!(code, RDKafkaErrorCode::MessageSizeTooLarge);
    assert_eq!(failure, Failure::Permanent);
}

/// A topic that does not exist (no auto-creation) fails the record once the metadata
/// propagation time has passed, instead of waiting forever; the failure is the
/// setup's, not the record's (a configuration failure), so by default it blocks
/// (retried as transient) and poisons only with `relay.on_config_error = "poison"`.
#[tokio::test]
async fn missing_topic_is_a_configuration_failure() {
    let topic = unique("kafka_missing");
    let (publisher, mut rx) = publisher(&[("topic.metadata.propagation.max.ms", "1000")]);
    let id = EventId::from_raw(11);
    let started = Instant::now();
    let sent = publisher.send(
        id,
        RecordRef {
            topic: &topic,
            key: b"k",
            payload: b"{}",
            headers: &[("idempotency_key", b"missing-1")],
            timestamp_ms: None,
        },
    );
    let (code, failure) = match sent {
        Err(rejected) => (rejected.code, rejected.failure),
        Ok(()) => {
            let report = next_report(&mut rx, Duration::from_secs(30)).await;
            assert_eq!(report.id, id);
            let failure = report.failure().expect("a failure");
            let (code, _) = report.result.expect_err("not delivered");
            (code, failure)
        }
    };
    assert!(
        matches!(
            code,
            RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic
        ),
        "{code:?}"
    );
    // A rejection at send has the policy applied already; a report carries the class.
    assert!(
        matches!(failure, Failure::Configuration | Failure::Transient),
        "{failure:?}"
    );
    assert_eq!(
        publisher.classify(code),
        Failure::Transient,
        "blocks by default"
    );
    let publisher = publisher.with_configuration_errors_poisoned(true);
    assert_eq!(
        publisher.classify(code),
        Failure::Permanent,
        "opt-in poison"
    );
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// Nothing listens on port 1: the start-up check fails with `BrokerError::Unavailable`
/// (exit code 4) within its timeout.
#[tokio::test]
async fn unreachable_broker_is_reported_at_start_up() {
    let relay = RelayConfig::default();
    let cfg = producer_config(&kafka_config("127.0.0.1:1", &[]), &relay).expect("config");
    let (publisher, _rx) = Publisher::new(cfg, report_capacity(&relay)).expect("publisher");
    let started = Instant::now();
    let err = publisher
        .check_broker(Duration::from_secs(2))
        .await
        .expect_err("nothing listens on port 1");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(err, BrokerError::Unavailable(_)), "{err:?}");
    let err = Error::from(err);
    assert_eq!(err.exit_code(), std::process::ExitCode::from(4));
    assert!(err.to_string().contains("127.0.0.1:1"), "{err}");
}
