//! Writer helpers: `outbox_enqueue()` in SQL and `enqueue(&Transaction, &Event)` in
//! Rust put the event in the business transaction: a rollback leaves nothing, a
//! commit is relayed with the given or generated idempotency key.

use std::collections::BTreeSet;
use std::time::Duration;

use outbox_relay::outbox::enqueue::{EnqueueError, Event, enqueue};

use crate::harness::{RelayProcess, TestDb, consume_exactly};

#[tokio::test]
async fn rolled_back_enqueue_leaves_nothing_committed_one_is_relayed_with_its_key() {
    let mut db = TestDb::create("enqueue").await;
    db.create_slot().await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;

    // Rolled back: the business row and the event go together.
    let tx = db.client.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO business_orders (entity, amount) VALUES ('o-1', 10)",
        &[],
    )
    .await
    .unwrap();
    let event = Event::new("order", "o-1", "order_created", serde_json::json!({"n": 1}))
        .with_idempotency_key("rolled-back-key");
    enqueue(&tx, &event).await.unwrap();
    tx.rollback().await.unwrap();

    // Committed: one with a given key and headers, one with a generated key.
    let tx = db.client.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO business_orders (entity, amount) VALUES ('o-2', 20)",
        &[],
    )
    .await
    .unwrap();
    let given = Event::new("order", "o-2", "order_created", serde_json::json!({"n": 2}))
        .with_idempotency_key("given-key-2")
        .with_headers(serde_json::json!({"trace_id": "t-2"}));
    assert_eq!(enqueue(&tx, &given).await.unwrap(), "given-key-2");
    let filled = enqueue(
        &tx,
        &Event::new("order", "o-2", "order_paid", serde_json::json!({"n": 3})),
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();
    let uuid = uuid::Uuid::parse_str(&filled).expect("generated key is a UUID");
    assert_eq!(uuid.get_version_num(), 7, "{filled}");

    // The SQL helper, with defaults.
    let sql_key: String = db
        .client
        .query_one(
            "SELECT outbox_enqueue('order', 'o-3', 'order_created', '{\"n\": 4}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        uuid::Uuid::parse_str(&sql_key).unwrap().get_version_num(),
        7
    );

    // A key given twice is refused (the event was enqueued before).
    let tx = db.client.transaction().await.unwrap();
    let again = enqueue(&tx, &given).await.unwrap_err();
    assert!(
        matches!(again, EnqueueError::DuplicateKey(ref k) if k == "given-key-2"),
        "{again}"
    );
    tx.rollback().await.unwrap();

    let records = consume_exactly(&db.topic, 3, Duration::from_secs(30), &relay).await;
    let keys: BTreeSet<&str> = records
        .iter()
        .filter_map(|r| r.header("idempotency_key"))
        .collect();
    let expected: BTreeSet<&str> = ["given-key-2", filled.as_str(), sql_key.as_str()].into();
    assert_eq!(keys, expected);
    let given_record = records
        .iter()
        .find(|r| r.header("idempotency_key") == Some("given-key-2"))
        .unwrap();
    assert_eq!(given_record.key.as_deref(), Some(&b"o-2"[..]));
    assert_eq!(given_record.header("trace_id"), Some("t-2"));
    assert_eq!(given_record.payload.as_deref(), Some(&br#"{"n": 2}"#[..]));

    let rows: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM outbox WHERE idempotency_key = 'rolled-back-key'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
    drop(relay);
    db.drop_slot().await;
}
