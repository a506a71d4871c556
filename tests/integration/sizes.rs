//! Size errors blamed on the right record. A broker refuses a whole record batch
//! above the topic's `max.message.bytes`, and librdkafka reports the error for
//! every record in it: small valid events would share the fate of one large one.
//! The relay reads each topic's limit and poisons an oversize event before producing
//! it (the limit in the error), and retries a record of a refused batch alone before
//! blaming it. When the producer compresses, the limit bounds the compressed batch,
//! so the relay produces the event and lets the broker decide.

use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;

use crate::harness::{self, RelayProcess, TestDb, consume_from, consume_unique, unique};

/// Inserts `n` small events, one of about `big` bytes when set, and `n` more, in one
/// transaction (so they travel in one batch); returns the big one's idempotency key.
async fn one_transaction(db: &TestDb, n: i64, big: Option<usize>) -> Option<String> {
    let small = |from: i64, to: i64| {
        format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'e' || (g % 5), 'Created', jsonb_build_object('seq', g)
             FROM generate_series({from}, {to}) AS g"
        )
    };
    db.client.batch_execute("BEGIN").await.unwrap();
    db.client.batch_execute(&small(1, n)).await.unwrap();
    let key = match big {
        Some(bytes) => Some(
            db.client
                .query_one(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('order', 'big', 'Created',
                             jsonb_build_object('seq', 0, 'blob', repeat('x', $1)))
                     RETURNING idempotency_key",
                    &[&i32::try_from(bytes).unwrap()],
                )
                .await
                .unwrap()
                .get(0),
        ),
        None => None,
    };
    db.client.batch_execute(&small(n + 1, 2 * n)).await.unwrap();
    db.client.batch_execute("COMMIT").await.unwrap();
    key
}

/// Creates a topic of one partition whose `max.message.bytes` is `limit` (Tansu
/// stores the setting and answers `DescribeConfigs` with it, though it does not
/// enforce it).
async fn limited_topic(prefix: &str, limit: usize) -> String {
    let topic = unique(prefix);
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &harness::env().brokers)
        .create()
        .unwrap();
    let limit = limit.to_string();
    let new = NewTopic::new(&topic, 1, TopicReplication::Fixed(1)).set("max.message.bytes", &limit);
    for result in admin
        .create_topics([&new], &AdminOptions::new())
        .await
        .unwrap()
    {
        result.unwrap();
    }
    topic
}

/// Sends the topic's first event, which makes the relay read its limit, and waits
/// until the relay logs `limit`.
async fn wait_for_the_limit(db: &TestDb, relay: &RelayProcess, limit: usize) {
    one_transaction(db, 1, None).await;
    let logged = format!("max_message_bytes={limit}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !relay.log().contains(&logged) {
        assert!(
            Instant::now() < deadline,
            "the relay did not read the topic's limit; log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A topic whose `max.message.bytes` is 4,000: in one transaction, 40 small events
/// and one of 6,000 bytes. The large one is poisoned before it is produced, at its
/// first attempt, with the topic's limit in the error; the small ones are all
/// delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_above_the_topic_limit_is_poisoned_before_it_is_produced() {
    let db = TestDb::create("size_topic").await;
    let topic = limited_topic("size_limited", 4_000).await;
    let relay = RelayProcess::start(
        &db.config_path,
        &[("OUTBOX_RELAY__KAFKA__TOPIC_TEMPLATE", topic.as_str())],
    );
    db.wait_streaming(&relay).await;
    wait_for_the_limit(&db, &relay, 4_000).await;
    let big = one_transaction(&db, 20, Some(6_000)).await.unwrap();
    let records = consume_unique(&topic, 42, Duration::from_secs(60), &relay).await;
    assert_eq!(
        records.len(),
        42,
        "every small event; log:\n{}",
        relay.log()
    );
    assert!(
        records
            .iter()
            .all(|r| r.key.as_deref() != Some(&b"big"[..]))
    );
    harness::wait_until(Duration::from_secs(30), "the poison row", || async {
        db.poison_rows().await == 1
    })
    .await;
    let row = db
        .client
        .query_one(
            "SELECT idempotency_key, error, attempts FROM poison_outbox",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), big);
    let error: String = row.get(1);
    assert!(
        error.contains("topic's max.message.bytes = 4000"),
        "the limit is in the error: {error}"
    );
    assert_eq!(row.get::<_, i32>(2), 1, "poisoned at once, not retried");
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// With `compression.type = zstd` the topic's `max.message.bytes` bounds the
/// compressed batch, not the event: on a topic limited to 4,000 bytes, an event of
/// 12,000 bytes of repeated text (a few dozen bytes once compressed) is produced
/// and delivered with the small events of its transaction, not poisoned for its
/// uncompressed size. Tansu does not enforce the limit, so this shows that the
/// relay no longer refuses the event itself; what a broker's refusal does is the
/// next test's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressible_event_above_the_topic_limit_is_delivered() {
    let db = TestDb::create("size_zstd").await;
    let topic = limited_topic("size_zstd", 4_000).await;
    let relay = RelayProcess::start(
        &db.config_path,
        &[
            ("OUTBOX_RELAY__KAFKA__TOPIC_TEMPLATE", topic.as_str()),
            ("OUTBOX_RELAY__KAFKA__PRODUCER__compression.type", "zstd"),
        ],
    );
    db.wait_streaming(&relay).await;
    wait_for_the_limit(&db, &relay, 4_000).await;
    one_transaction(&db, 20, Some(12_000)).await.unwrap();
    let records = consume_unique(&topic, 43, Duration::from_secs(60), &relay).await;
    let big = records
        .iter()
        .find(|r| r.key.as_deref() == Some(&b"big"[..]))
        .unwrap_or_else(|| panic!("the large event was not delivered; log:\n{}", relay.log()));
    assert!(
        big.payload.as_ref().is_some_and(|p| p.len() > 12_000),
        "the whole event"
    );
    let delivered = harness::deliveries(&records);
    assert_eq!(delivered.len(), 43, "every event; log:\n{}", relay.log());
    assert_eq!(db.poison_rows().await, 0, "log:\n{}", relay.log());
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// With compression the relay produces an event whatever its size against the
/// topic's limit, and the broker's answer decides: a refusal for size (injected
/// with librdkafka's mock cluster, as Tansu does not enforce the limit) is
/// permanent. With `max_attempts = 1` the event is retried alone once (the refusal
/// may have been for another record of its batch), refused again, and poisoned
/// with the broker's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_event_the_broker_refuses_for_its_size_is_poisoned() {
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

    let mut db = TestDb::create("size_refused").await;
    db.append_config("\n[relay]\nmax_attempts = 1\n");
    let mock = MockCluster::new(1).expect("mock cluster");
    mock.create_topic(&db.topic, 1, 1).expect("mock topic");
    let mut config = db.config();
    config.kafka.brokers = mock.bootstrap_servers();
    config
        .kafka
        .producer
        .insert("compression.type".into(), "zstd".into());
    let relay = harness::InProcessRelay::start(&db, config).await;
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE; 2],
    );
    let big = one_transaction(&db, 0, Some(12_000)).await.unwrap();
    harness::wait_until(Duration::from_secs(60), "the poison row", || async {
        db.poison_rows().await == 1
    })
    .await;
    let row = db
        .client
        .query_one(
            "SELECT idempotency_key, error_kind, attempts FROM poison_outbox",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), big);
    assert_eq!(row.get::<_, String>(1), "message_size_too_large");
    // Produced twice, in its batch and then alone; with max_attempts = 1 only the
    // second refusal counted against it.
    assert_eq!(row.get::<_, i32>(2), 2, "two produce attempts");
    let summary = relay.stop().await;
    assert_eq!((summary.delivered, summary.poisoned), (0, 1), "{summary:?}");
    db.drop_slot().await;
}

/// A batch refused for its size (injected with librdkafka's mock cluster, which
/// stands in for a broker enforcing a topic limit below the batch: Tansu does not
/// enforce it; PostgreSQL is the real one) with `max_attempts = 1`: before, every
/// event of that batch was poisoned; now each is retried alone and delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_of_a_batch_refused_for_its_size_are_retried_alone() {
    use rdkafka::mocking::MockCluster;
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

    let mut db = TestDb::create("size_batch").await;
    db.append_config("\n[relay]\nmax_attempts = 1\n");
    let mock = MockCluster::new(1).expect("mock cluster");
    mock.create_topic(&db.topic, 1, 1).expect("mock topic");
    let mut config = db.config();
    config.kafka.brokers = mock.bootstrap_servers();
    let relay = harness::InProcessRelay::start(&db, config).await;
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE],
    );
    one_transaction(&db, 25, None).await;
    let brokers = mock.bootstrap_servers();
    let records = consume_from(&brokers, &db.topic, 50, Duration::from_secs(60)).await;
    let poisoned: i64 = db.poison_rows().await;
    assert_eq!(
        (records.len(), poisoned),
        (50, 0),
        "all delivered, none poisoned"
    );
    let summary = relay.stop().await;
    assert_eq!(
        (summary.delivered, summary.poisoned),
        (50, 0),
        "{summary:?}"
    );
    db.drop_slot().await;
}
