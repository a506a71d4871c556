//! `outbox-relay dev-broker` against librdkafka (the rdkafka crate, not the broker's
//! own code): committed and aborted transactions seen through read_committed and
//! read_uncommitted consumers, the last stable offset holding readers back, fencing
//! of an older producer with the same `transactional.id`, the broker aborting a
//! transaction its producer abandoned, the relay's idempotent at-least-once path,
//! and a fault injected through the control listener.
//!
//! Each test starts its own broker process on a free port (no PostgreSQL, no
//! `scripts/dev-env`) and kills it with SIGKILL when done: the broker is in-memory.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{DeliveryResult, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer, ProducerContext};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};

use crate::harness::{DevBroker, unique};

const TIMEOUT: Duration = Duration::from_secs(10);

impl DevBroker {
    /// A transactional producer, initialised.
    fn transactional(&self, id: &str, timeout_ms: u32) -> BaseProducer<Deliveries> {
        let producer: BaseProducer<Deliveries> = self
            .config()
            .set("transactional.id", id)
            .set("transaction.timeout.ms", timeout_ms.to_string())
            .create_with_context(Deliveries::default())
            .expect("create the transactional producer");
        producer
            .init_transactions(TIMEOUT)
            .unwrap_or_else(|e| panic!("init_transactions: {e}; log:\n{}", self.log()));
        producer
    }

    /// The relay's producer: idempotent, acks=all.
    fn idempotent(&self) -> BaseProducer<Deliveries> {
        self.config()
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", "5")
            .create_with_context(Deliveries::default())
            .expect("create the idempotent producer")
    }

    fn consumer(&self, isolation: &str, topic: &str, partitions: i32) -> BaseConsumer {
        let consumer: BaseConsumer = self
            .config()
            .set("group.id", unique("dev_broker_group"))
            .set("isolation.level", isolation)
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .create()
            .expect("create the consumer");
        let mut tpl = TopicPartitionList::new();
        for p in 0..partitions {
            tpl.add_partition_offset(topic, p, Offset::Offset(0))
                .expect("add partition");
        }
        consumer.assign(&tpl).expect("assign");
        consumer
    }

    async fn create_topic(&self, topic: &str, partitions: i32) {
        let admin: AdminClient<DefaultClientContext> =
            self.config().create().expect("create the admin client");
        let results = admin
            .create_topics(
                &[NewTopic::new(topic, partitions, TopicReplication::Fixed(1))],
                &AdminOptions::new().request_timeout(Some(TIMEOUT)),
            )
            .await
            .expect("CreateTopics");
        for r in results {
            r.unwrap_or_else(|(t, code)| panic!("create {t}: {code}"));
        }
    }
}

/// Counts delivery reports.
#[derive(Debug, Default, Clone)]
struct Deliveries {
    delivered: Arc<AtomicUsize>,
    failed: Arc<Mutex<Vec<String>>>,
}

impl ClientContext for Deliveries {}

impl ProducerContext for Deliveries {
    type DeliveryOpaque = ();

    fn delivery(&self, result: &DeliveryResult<'_>, _: ()) {
        match result {
            Ok(_) => {
                self.delivered.fetch_add(1, Ordering::SeqCst);
            }
            Err((e, _)) => self.failed.lock().unwrap().push(e.to_string()),
        }
    }
}

/// One consumed record.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Got {
    partition: i32,
    offset: i64,
    key: String,
    payload: String,
    headers: Vec<(String, String)>,
}

fn send(producer: &BaseProducer<Deliveries>, topic: &str, partition: i32, key: &str) {
    let headers = OwnedHeaders::new()
        .insert(Header {
            key: "idempotency_key",
            value: Some(key.as_bytes()),
        })
        .insert(Header {
            key: "kind",
            value: Some("test".as_bytes()),
        });
    let payload = format!("payload-{key}");
    producer
        .send(
            BaseRecord::to(topic)
                .partition(partition)
                .key(key)
                .payload(&payload)
                .headers(headers),
        )
        .map_err(|(e, _)| e)
        .expect("enqueue");
}

fn got(m: &impl Message) -> Got {
    let text = |b: Option<&[u8]>| String::from_utf8_lossy(b.unwrap_or_default()).into_owned();
    Got {
        partition: m.partition(),
        offset: m.offset(),
        key: text(m.key()),
        payload: text(m.payload()),
        headers: m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|x| (x.key.to_owned(), text(x.value)))
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// Polls until `want` records arrived, then `quiet` more (to catch any extra);
/// returns what arrived.
fn read(consumer: &BaseConsumer, want: usize, quiet: Duration) -> Vec<Got> {
    let mut out = Vec::new();
    let deadline = Instant::now() + TIMEOUT;
    let mut settle: Option<Instant> = None;
    loop {
        let now = Instant::now();
        if settle.is_some_and(|s| now >= s) || now >= deadline {
            return out;
        }
        if let Some(m) = consumer.poll(Duration::from_millis(50)) {
            out.push(got(&m.expect("consume")));
        }
        if out.len() >= want && settle.is_none() {
            settle = Some(Instant::now() + quiet);
        }
    }
}

/// Keys by partition, in consumption order.
fn keys_by_partition(records: &[Got]) -> BTreeMap<i32, Vec<String>> {
    let mut out: BTreeMap<i32, Vec<String>> = BTreeMap::new();
    for r in records {
        out.entry(r.partition).or_default().push(r.key.clone());
    }
    out
}

fn expect_keys(records: &[Got], want: &[(i32, &[&str])]) {
    let want: BTreeMap<i32, Vec<String>> = want
        .iter()
        .map(|(p, keys)| (*p, keys.iter().map(|k| (*k).to_owned()).collect()))
        .collect();
    assert_eq!(keys_by_partition(records), want, "records: {records:#?}");
}

fn is_fencing(e: &KafkaError) -> bool {
    matches!(
        e.rdkafka_error_code(),
        Some(
            RDKafkaErrorCode::Fenced
                | RDKafkaErrorCode::ProducerFenced
                | RDKafkaErrorCode::InvalidProducerEpoch
        )
    )
}

fn is_fatal(e: &KafkaError) -> bool {
    matches!(e, KafkaError::Transaction(t) if t.is_fatal())
}

#[tokio::test]
async fn dev_broker_committed_and_aborted_transactions() {
    let broker = DevBroker::start();
    let topic = unique("txn_basic");
    broker.create_topic(&topic, 2).await;
    let producer = broker.transactional(&unique("tx"), 60_000);

    producer.begin_transaction().expect("begin A");
    send(&producer, &topic, 0, "a1");
    send(&producer, &topic, 1, "a2");
    send(&producer, &topic, 0, "a3");
    producer.commit_transaction(TIMEOUT).expect("commit A");

    producer.begin_transaction().expect("begin B");
    send(&producer, &topic, 0, "b1");
    send(&producer, &topic, 1, "b2");
    producer.flush(TIMEOUT).expect("flush B");
    producer.abort_transaction(TIMEOUT).expect("abort B");

    producer.begin_transaction().expect("begin C");
    send(&producer, &topic, 1, "c1");
    producer.commit_transaction(TIMEOUT).expect("commit C");
    // b1 and b2 were flushed (acknowledged) before the abort.
    assert_eq!(producer.context().delivered.load(Ordering::SeqCst), 6);

    let committed = read(
        &broker.consumer("read_committed", &topic, 2),
        4,
        Duration::from_millis(1500),
    );
    expect_keys(&committed, &[(0, &["a1", "a3"]), (1, &["a2", "c1"])]);
    for r in &committed {
        assert_eq!(r.payload, format!("payload-{}", r.key));
        assert_eq!(
            r.headers,
            vec![
                ("idempotency_key".to_owned(), r.key.clone()),
                ("kind".to_owned(), "test".to_owned())
            ]
        );
    }
    let uncommitted = read(
        &broker.consumer("read_uncommitted", &topic, 2),
        6,
        Duration::from_millis(1500),
    );
    expect_keys(
        &uncommitted,
        &[(0, &["a1", "a3", "b1"]), (1, &["a2", "b2", "c1"])],
    );
}

#[tokio::test]
async fn dev_broker_open_transaction_holds_back_read_committed() {
    let broker = DevBroker::start();
    let topic = unique("txn_lso");
    broker.create_topic(&topic, 1).await;
    let plain = broker.idempotent();
    send(&plain, &topic, 0, "i0");
    plain.flush(TIMEOUT).expect("flush i0");

    let txn = broker.transactional(&unique("tx"), 60_000);
    txn.begin_transaction().expect("begin");
    send(&txn, &topic, 0, "t1");
    txn.flush(TIMEOUT).expect("flush t1");
    send(&plain, &topic, 0, "i1");
    send(&plain, &topic, 0, "i2");
    plain.flush(TIMEOUT).expect("flush i1, i2");
    assert_eq!(plain.context().delivered.load(Ordering::SeqCst), 3);

    let uncommitted = read(
        &broker.consumer("read_uncommitted", &topic, 1),
        4,
        Duration::from_millis(200),
    );
    expect_keys(&uncommitted, &[(0, &["i0", "t1", "i1", "i2"])]);

    let committed_reader = broker.consumer("read_committed", &topic, 1);
    let before = read(&committed_reader, 2, Duration::from_millis(1500));
    expect_keys(&before, &[(0, &["i0"])]);

    txn.commit_transaction(TIMEOUT).expect("commit");
    let after = read(&committed_reader, 3, Duration::from_millis(500));
    expect_keys(&after, &[(0, &["t1", "i1", "i2"])]);
}

#[tokio::test]
async fn dev_broker_fences_the_older_producer() {
    let broker = DevBroker::start();
    let topic = unique("txn_fence");
    broker.create_topic(&topic, 2).await;
    let id = unique("t");

    let p1 = broker.transactional(&id, 60_000);
    p1.begin_transaction().expect("P1 begin");
    send(&p1, &topic, 0, "p1-a");
    send(&p1, &topic, 1, "p1-b");
    p1.flush(TIMEOUT).expect("P1 flush");

    // P2 takes over the transactional id: P1's open transaction is aborted.
    let p2 = broker.transactional(&id, 60_000);

    send(&p1, &topic, 0, "p1-c");
    let err = p1
        .commit_transaction(TIMEOUT)
        .expect_err("the fenced producer must not commit");
    assert!(
        is_fencing(&err),
        "expected a fencing error, got {err:?}; log:\n{}",
        broker.log()
    );
    assert!(is_fatal(&err), "fencing is fatal: {err:?}");

    p2.begin_transaction().expect("P2 begin");
    send(&p2, &topic, 1, "p2-a");
    p2.commit_transaction(TIMEOUT).expect("P2 commit");

    let committed = read(
        &broker.consumer("read_committed", &topic, 2),
        1,
        Duration::from_millis(1500),
    );
    expect_keys(&committed, &[(1, &["p2-a"])]);
    // The aborted records are in the log all the same.
    let uncommitted = read(
        &broker.consumer("read_uncommitted", &topic, 2),
        3,
        Duration::from_millis(1000),
    );
    let keys = keys_by_partition(&uncommitted);
    assert_eq!(keys.get(&0).map(Vec::len), Some(1), "{uncommitted:#?}");
    assert!(keys.get(&1).is_some_and(|k| k.contains(&"p2-a".to_owned())));
}

#[tokio::test]
async fn dev_broker_aborts_an_abandoned_transaction_on_timeout() {
    let broker = DevBroker::start();
    let topic = unique("txn_timeout");
    broker.create_topic(&topic, 1).await;
    let abandoned = broker.transactional(&unique("tx"), 2_000);
    // Before the first send, so before AddPartitionsToTxn starts the timeout.
    let started = Instant::now();
    abandoned.begin_transaction().expect("begin");
    send(&abandoned, &topic, 0, "x1");
    send(&abandoned, &topic, 0, "x2");
    abandoned.flush(TIMEOUT).expect("flush");

    let plain = broker.idempotent();
    send(&plain, &topic, 0, "y1");
    plain.flush(TIMEOUT).expect("flush y1");

    // Held back while the transaction is open, until the broker aborts it (2 s
    // timeout, checked every 100 ms).
    let reader = broker.consumer("read_committed", &topic, 1);
    let deadline = Instant::now() + TIMEOUT;
    let first = loop {
        assert!(Instant::now() < deadline, "y1 never became visible");
        if let Some(m) = reader.poll(Duration::from_millis(50)) {
            break got(&m.expect("consume"));
        }
    };
    let visible_after = started.elapsed();
    assert_eq!(first.key, "y1", "{first:?}");
    assert!(
        visible_after >= Duration::from_millis(2_000),
        "visible after {visible_after:?}, before the transaction timed out"
    );
    let rest = read(&reader, 0, Duration::from_millis(1000));
    assert!(rest.is_empty(), "aborted records visible: {rest:#?}");
    assert!(
        broker.log().contains("transaction timed out"),
        "log:\n{}",
        broker.log()
    );
    // The producer that came back late is fenced (the abort bumped its epoch).
    let err = abandoned
        .commit_transaction(TIMEOUT)
        .expect_err("a timed-out transaction must not commit");
    assert!(is_fencing(&err), "got {err:?}");
    drop(abandoned);

    // The LSO moved on: later records are readable at once.
    send(&plain, &topic, 0, "y2");
    plain.flush(TIMEOUT).expect("flush y2");
    let more = read(&reader, 1, Duration::from_millis(300));
    expect_keys(&more, &[(0, &["y2"])]);
}

#[tokio::test]
async fn dev_broker_serves_the_idempotent_at_least_once_path() {
    const RECORDS: usize = 10_000;
    const PARTITIONS: i32 = 3;
    let broker = DevBroker::start();
    let topic = unique("idempotent");
    broker.create_topic(&topic, PARTITIONS).await;
    let producer = broker.idempotent();
    for i in 0..RECORDS {
        let partition = i32::try_from(i).unwrap() % PARTITIONS;
        let key = format!("k{i:05}");
        loop {
            let headers = OwnedHeaders::new().insert(Header {
                key: "idempotency_key",
                value: Some(key.as_bytes()),
            });
            let payload = format!("payload-{key}");
            let record = BaseRecord::to(&topic)
                .partition(partition)
                .key(&key)
                .payload(&payload)
                .headers(headers);
            match producer.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    producer.poll(Duration::from_millis(10));
                }
                Err((e, _)) => panic!("send: {e}"),
            }
        }
    }
    producer.flush(Duration::from_secs(30)).expect("flush");
    assert_eq!(
        *producer.context().failed.lock().unwrap(),
        Vec::<String>::new()
    );
    assert_eq!(producer.context().delivered.load(Ordering::SeqCst), RECORDS);

    let records = read(
        &broker.consumer("read_committed", &topic, PARTITIONS),
        RECORDS,
        Duration::from_millis(500),
    );
    assert_eq!(records.len(), RECORDS);
    for (partition, keys) in keys_by_partition(&records) {
        let expected: Vec<String> = (0..RECORDS)
            .filter(|i| i32::try_from(*i).unwrap() % PARTITIONS == partition)
            .map(|i| format!("k{i:05}"))
            .collect();
        assert_eq!(
            keys, expected,
            "partition {partition} out of order or incomplete"
        );
    }
    for r in &records {
        assert_eq!(r.payload, format!("payload-{}", r.key));
        assert_eq!(
            r.headers,
            vec![("idempotency_key".to_owned(), r.key.clone())]
        );
    }
    // Offsets are dense per partition: no duplicate was written.
    let mut last: BTreeMap<i32, i64> = BTreeMap::new();
    for r in &records {
        let prev = last.insert(r.partition, r.offset);
        assert_eq!(r.offset, prev.map_or(0, |p| p + 1), "{r:?}");
    }
}

#[tokio::test]
async fn dev_broker_fail_produce_fails_one_delivery_then_appends() {
    let broker = DevBroker::start();
    let topic = unique("fault_produce");
    broker.create_topic(&topic, 1).await;
    let producer = broker.idempotent();
    send(&producer, &topic, 0, "k0");
    producer.flush(TIMEOUT).expect("flush k0");

    // Retriable (a leader moving): librdkafka refreshes metadata and retries, the
    // application sees nothing.
    broker
        .control(&format!("fail-produce {topic} 0 NOT_LEADER_OR_FOLLOWER 2"))
        .await;
    send(&producer, &topic, 0, "k1");
    producer.flush(TIMEOUT).expect("flush k1");
    assert_eq!(producer.context().delivered.load(Ordering::SeqCst), 2);
    assert!(
        broker.log().contains("fault fired: fail-produce"),
        "log:\n{}",
        broker.log()
    );

    // Permanent: that delivery fails with the error, the next one succeeds (the
    // idempotent producer bumps its epoch and carries on).
    let reply = broker
        .control(&format!("fail-produce {topic} * POLICY_VIOLATION"))
        .await;
    assert_eq!(reply, format!("ok {topic} * POLICY_VIOLATION (44) x1"));
    send(&producer, &topic, 0, "k2");
    producer.flush(TIMEOUT).expect("flush k2");
    let failed = producer.context().failed.lock().unwrap().clone();
    let policy = RDKafkaErrorCode::PolicyViolation.to_string();
    assert!(
        failed.len() == 1 && failed[0].contains(&policy),
        "expected one {policy} failure, got {failed:?}; log:\n{}",
        broker.log()
    );
    send(&producer, &topic, 0, "k3");
    producer.flush(TIMEOUT).expect("flush k3");
    assert_eq!(producer.context().delivered.load(Ordering::SeqCst), 3);
    assert_eq!(producer.context().failed.lock().unwrap().len(), 1);

    let records = read(
        &broker.consumer("read_committed", &topic, 1),
        3,
        Duration::from_millis(500),
    );
    expect_keys(&records, &[(0, &["k0", "k1", "k3"])]);
    let offsets: Vec<i64> = records.iter().map(|r| r.offset).collect();
    assert_eq!(offsets, vec![0, 1, 2], "nothing appended for the failures");
}
