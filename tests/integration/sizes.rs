//! Size errors blamed on the right record. A broker refuses a whole record batch
//! above the topic's `max.message.bytes`, and librdkafka reports the error for
//! every record in it: small valid events would share the fate of one large one.
//! The relay reads each topic's limit and poisons an oversize event before producing
//! it (the limit in the error), and retries a record of a refused batch alone before
//! blaming it.

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

/// A topic whose `max.message.bytes` is 4,000 (Tansu stores the setting and answers
/// `DescribeConfigs` with it, though it does not enforce it): in one transaction,
/// 40 small events and one of 6,000 bytes. The large one is poisoned before it is
/// produced, at its first attempt, with the topic's limit in the error; the small
/// ones are all delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_above_the_topic_limit_is_poisoned_before_it_is_produced() {
    let db = TestDb::create("size_topic").await;
    let topic = unique("size_limited");
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &harness::env().brokers)
        .create()
        .unwrap();
    let new = NewTopic::new(&topic, 1, TopicReplication::Fixed(1)).set("max.message.bytes", "4000");
    for result in admin
        .create_topics([&new], &AdminOptions::new())
        .await
        .unwrap()
    {
        result.unwrap();
    }
    let relay = RelayProcess::start(
        &db.config_path,
        &[("OUTBOX_RELAY__KAFKA__TOPIC_TEMPLATE", topic.as_str())],
    );
    db.wait_streaming(&relay).await;
    // The first event of the topic makes the relay read its limit.
    one_transaction(&db, 1, None).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !relay.log().contains("max_message_bytes=4000") {
        assert!(
            Instant::now() < deadline,
            "the relay did not read the topic's limit; log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
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
