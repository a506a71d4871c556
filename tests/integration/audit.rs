//! `audit` against the real PostgreSQL and broker: a relay-delivered topic audits
//! clean, and hand-produced topics with duplicates, a missing event, reordered events
//! and a poisoned event are counted as such. Every test has its own database and
//! topic.

use std::time::{Duration, Instant};

use outbox_relay::ops::audit::{self, AuditArgs, AuditReport};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};

use crate::harness::{RelayProcess, TestDb, consume_exactly, env};

/// One record as the relay would produce it (only what the audit reads).
#[derive(Debug, Clone)]
struct Rec {
    entity: String,
    idempotency_key: String,
    source_lsn: Option<String>,
}

fn rec(entity: &str, key: &str, source_lsn: Option<&str>) -> Rec {
    Rec {
        entity: entity.to_owned(),
        idempotency_key: key.to_owned(),
        source_lsn: source_lsn.map(str::to_owned),
    }
}

/// Produces `records` in order with a plain producer (keyed, so one entity stays
/// on one partition), and waits until all are acknowledged.
async fn produce(topic: &str, records: Vec<Rec>) {
    let topic = topic.to_owned();
    tokio::task::spawn_blocking(move || {
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", &env().brokers)
            .set("enable.idempotence", "true")
            .set("linger.ms", "5")
            .set("partitioner", "murmur2_random")
            .create()
            .expect("create producer");
        for r in &records {
            let mut headers = OwnedHeaders::new().insert(Header {
                key: "idempotency_key",
                value: Some(r.idempotency_key.as_bytes()),
            });
            if let Some(lsn) = &r.source_lsn {
                headers = headers.insert(Header {
                    key: "source_lsn",
                    value: Some(lsn.as_bytes()),
                });
            }
            let mut record = BaseRecord::to(&topic)
                .key(r.entity.as_bytes())
                .payload("{}")
                .headers(headers);
            loop {
                match producer.send(record) {
                    Ok(()) => break,
                    Err((e, back)) => {
                        assert!(
                            matches!(
                                e.rdkafka_error_code(),
                                Some(rdkafka::types::RDKafkaErrorCode::QueueFull)
                            ),
                            "produce failed: {e}"
                        );
                        record = back;
                        producer.poll(Duration::from_millis(50));
                    }
                }
            }
            producer.poll(Duration::ZERO);
        }
        producer
            .flush(Duration::from_secs(60))
            .expect("all records acknowledged");
    })
    .await
    .expect("producer task");
}

async fn run_audit(db: &TestDb, args: AuditArgs) -> AuditReport {
    let report = audit::run(&db.config(), &args)
        .await
        .unwrap_or_else(|e| panic!("audit failed: {e}"));
    println!("{}", report.render_table());
    report
}

fn args() -> AuditArgs {
    AuditArgs {
        timeout_secs: 10,
        ..AuditArgs::default()
    }
}

/// The commit LSN of a transaction just committed is at most this.
async fn current_lsn(db: &TestDb) -> String {
    db.client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_delivered_topic_audits_clean() {
    let mut db = TestDb::create("audit_clean").await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    for i in 0..30 {
        db.insert_event(
            &format!("e{}", i % 4),
            "OrderPlaced",
            &format!(r#"{{"n": {i}}}"#),
        )
        .await;
    }
    // A transaction with several events of one entity: same source_lsn, the row
    // order decides.
    let tx = db.client.transaction().await.unwrap();
    for n in 0..3 {
        tx.execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'e0', 'OrderChanged', $1::text::jsonb)",
            &[&format!(r#"{{"tx": {n}}}"#)],
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    consume_exactly(&db.topic, 33, Duration::from_secs(60), &relay).await;

    let report = run_audit(&db, args()).await;
    assert_eq!(report.expected, 33);
    assert_eq!(report.delivered, 33);
    assert_eq!(report.lost, 0);
    assert_eq!(report.duplicates, 0);
    assert_eq!(report.out_of_order_keys, 0);
    assert_eq!(report.poisoned, 0);
    assert!(report.is_clean());
    assert_eq!(report.topics, vec![db.topic.clone()]);
    assert_eq!(report.records_read, 33);
    assert_eq!(report.state_bytes, 33 * 16);
    assert_eq!(
        report.to_json(),
        serde_json::json!({"expected": 33, "delivered": 33, "lost": 0, "duplicates": 0,
                           "out_of_order_keys": 0, "poisoned": 0})
    );

    // The same range by time: the topic is read from the offset for `since`.
    let since = run_audit(
        &db,
        AuditArgs {
            since: Some("1h".parse().unwrap()),
            until: Some("0s".parse().unwrap()),
            ..args()
        },
    )
    .await;
    assert_eq!((since.expected, since.delivered, since.lost), (33, 33, 0));
    assert!(since.is_clean());

    // An empty range in the future: nothing expected; the records are outside it.
    let future = run_audit(
        &db,
        AuditArgs {
            since: Some("2999-01-01T00:00:00Z".parse().unwrap()),
            ..args()
        },
    )
    .await;
    assert_eq!(future.expected, 0);
    assert!(future.is_clean());

    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_are_counted() {
    let mut db = TestDb::create("audit_dup").await;
    let k0 = db.insert_event("a", "OrderPlaced", "{}").await;
    let k1 = db.insert_event("a", "OrderPaid", "{}").await;
    let k2 = db.insert_event("b", "OrderPlaced", "{}").await;
    // UUID v7 ids made within one millisecond are not ordered among themselves;
    // the --from-id range below needs k0 < k1 < k2.
    for (i, key) in [&k0, &k1, &k2].into_iter().enumerate() {
        let id = format!("00000000-0000-7000-8000-{:012}", i + 1);
        db.client
            .execute(
                "UPDATE outbox SET id = $1::text::uuid WHERE idempotency_key = $2",
                &[&id, key],
            )
            .await
            .unwrap();
    }
    produce(
        &db.topic,
        vec![
            rec("a", &k0, None),
            rec("a", &k1, None),
            // Re-sent after a "crash": same idempotency key again.
            rec("a", &k1, None),
            rec("b", &k2, None),
        ],
    )
    .await;

    let report = run_audit(&db, args()).await;
    assert_eq!(report.expected, 3);
    assert_eq!(report.delivered, 3);
    assert_eq!(report.duplicates, 1);
    assert_eq!(report.duplicated_events, 1);
    assert_eq!(report.lost, 0);
    assert_eq!(report.out_of_order_keys, 0);
    assert!(report.is_clean(), "duplicates are within at-least-once");

    // A range by id: the first row is left out, its record is outside the range.
    let id1: String = db
        .client
        .query_one(
            "SELECT id::text FROM outbox WHERE idempotency_key = $1",
            &[&k1],
        )
        .await
        .unwrap()
        .get(0);
    let by_id = run_audit(
        &db,
        AuditArgs {
            from_id: Some(id1),
            ..args()
        },
    )
    .await;
    assert_eq!((by_id.expected, by_id.delivered), (2, 2));
    assert_eq!(by_id.outside_range, 1);
    assert_eq!(by_id.duplicates, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undelivered_row_is_lost() {
    let mut db = TestDb::create("audit_lost").await;
    let k0 = db.insert_event("a", "OrderPlaced", "{}").await;
    let k1 = db.insert_event("a", "OrderPaid", "{}").await;
    let k2 = db.insert_event("b", "OrderPlaced", "{}").await;
    produce(&db.topic, vec![rec("a", &k0, None), rec("b", &k2, None)]).await;

    let report = run_audit(&db, args()).await;
    assert_eq!(report.expected, 3);
    assert_eq!(report.delivered, 2);
    assert_eq!(report.lost, 1);
    assert_eq!(report.poisoned, 0);
    assert!(!report.is_clean());
    assert_eq!(report.lost_sample, vec![k1]);
    assert_eq!(report.to_json()["lost"], 1);
    assert!(report.render_table().contains("EVENTS LOST"));

    // A topic that does not exist delivers nothing: everything is lost, and said why.
    let missing = run_audit(
        &db,
        AuditArgs {
            topics: vec![format!("{}.nope", db.topic)],
            ..args()
        },
    )
    .await;
    assert_eq!(missing.lost, 3);
    assert!(
        missing.notes.iter().any(|n| n.contains("does not exist")),
        "{:?}",
        missing.notes
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_produced_against_commit_order_are_out_of_order() {
    let mut db = TestDb::create("audit_order").await;
    let a1 = db.insert_event("a", "OrderPlaced", "{}").await;
    let lsn1 = current_lsn(&db).await;
    let b1 = db.insert_event("b", "OrderPlaced", "{}").await;
    let lsn2 = current_lsn(&db).await;
    let a2 = db.insert_event("a", "OrderPaid", "{}").await;
    let lsn3 = current_lsn(&db).await;
    let b2 = db.insert_event("b", "OrderPaid", "{}").await;
    let lsn4 = current_lsn(&db).await;
    produce(
        &db.topic,
        vec![
            // Entity a: its second commit first.
            rec("a", &a2, Some(&lsn3)),
            rec("a", &a1, Some(&lsn1)),
            // Entity b: in commit order.
            rec("b", &b1, Some(&lsn2)),
            rec("b", &b2, Some(&lsn4)),
        ],
    )
    .await;

    let report = run_audit(&db, args()).await;
    assert_eq!(report.expected, 4);
    assert_eq!(report.delivered, 4);
    assert_eq!(report.lost, 0);
    assert_eq!(report.out_of_order_keys, 1);
    assert!(!report.is_clean());
    assert!(report.render_table().contains("OUT OF ORDER"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_source_lsn_created_at_order_decides() {
    let mut db = TestDb::create("audit_order_nolsn").await;
    let a1 = db.insert_event("a", "OrderPlaced", "{}").await;
    let a2 = db.insert_event("a", "OrderPaid", "{}").await;
    let b1 = db.insert_event("b", "OrderPlaced", "{}").await;
    let b2 = db.insert_event("b", "OrderPaid", "{}").await;
    // As the polling relay or replay would publish (no source_lsn), a reversed.
    produce(
        &db.topic,
        vec![
            rec("a", &a2, None),
            rec("a", &a1, None),
            rec("b", &b1, None),
            rec("b", &b2, None),
        ],
    )
    .await;
    let report = run_audit(&db, args()).await;
    assert_eq!((report.expected, report.delivered), (4, 4));
    assert_eq!(report.out_of_order_keys, 1);
    assert!(!report.is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_row_counts_as_poisoned_not_lost() {
    let mut db = TestDb::create("audit_poison").await;
    let k0 = db.insert_event("a", "OrderPlaced", "{}").await;
    let k1 = db.insert_event("a", "OrderPaid", "{}").await;
    let k2 = db.insert_event("a", "OrderShipped", "{}").await;
    db.client
        .execute(
            "INSERT INTO poison_outbox (outbox_id, idempotency_key, aggregate_type, aggregate_id,
                 event_type, error, error_kind, attempts)
             SELECT id::text, idempotency_key, aggregate_type, aggregate_id, event_type,
                    'Broker: Message size too large', 'message_size_too_large', 5
             FROM outbox WHERE idempotency_key = $1",
            &[&k1],
        )
        .await
        .unwrap();
    produce(&db.topic, vec![rec("a", &k0, None), rec("a", &k2, None)]).await;

    let report = run_audit(&db, args()).await;
    assert_eq!(report.expected, 3);
    assert_eq!(report.delivered, 2);
    assert_eq!(report.poisoned, 1);
    assert_eq!(report.lost, 0);
    assert!(report.is_clean(), "a poisoned event is visible, not lost");

    // Replayed later (after its successor): delivered, not out of order.
    produce(&db.topic, vec![rec("a", &k1, None)]).await;
    let replayed = run_audit(&db, args()).await;
    assert_eq!((replayed.delivered, replayed.poisoned), (3, 0));
    assert_eq!(replayed.replayed, 1);
    assert_eq!(replayed.out_of_order_keys, 0);
    assert!(replayed.is_clean());
}

/// 100 000 rows and records: bounded state (16 bytes a row), and the time it takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn audits_a_hundred_thousand_rows() {
    const N: i64 = 100_000;
    let db = TestDb::create("audit_large").await;
    db.client
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'e' || (g % 1000), 'OrderPlaced', jsonb_build_object('n', g)
             FROM generate_series(1, $1::int8) g",
            &[&N],
        )
        .await
        .unwrap();
    let rows = db
        .client
        .query(
            "SELECT aggregate_id, idempotency_key FROM outbox ORDER BY created_at, id",
            &[],
        )
        .await
        .unwrap();
    let records: Vec<Rec> = rows.iter().map(|r| rec(r.get(0), r.get(1), None)).collect();
    let started = Instant::now();
    produce(&db.topic, records).await;
    println!("produced {N} records in {:?}", started.elapsed());

    let started = Instant::now();
    let report = run_audit(
        &db,
        AuditArgs {
            timeout_secs: 30,
            ..AuditArgs::default()
        },
    )
    .await;
    println!("audited {N} rows in {:?}", started.elapsed());
    let n = u64::try_from(N).unwrap();
    assert_eq!(report.expected, n);
    assert_eq!(report.delivered, n);
    assert_eq!(report.records_read, n);
    assert_eq!(report.lost, 0);
    assert_eq!(report.duplicates, 0);
    assert_eq!(report.out_of_order_keys, 0);
    assert!(report.is_clean());
    assert_eq!(report.state_bytes, n * 16, "16 bytes of state per row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bounds_and_missing_table_are_clear_errors() {
    let db = TestDb::create("audit_errors").await;
    let err = audit::run(
        &db.config(),
        &AuditArgs {
            from_id: Some("not-a-uuid".into()),
            ..args()
        },
    )
    .await
    .unwrap_err();
    assert!(
        matches!(err, outbox_relay::Error::Config(_)),
        "usage error (exit 2): {err}"
    );
    assert!(err.to_string().contains("--from-id"), "{err}");

    let mut config = db.config();
    config.outbox.table = "public.no_such_outbox".into();
    let err = audit::run(&config, &args()).await.unwrap_err();
    assert!(
        matches!(err, outbox_relay::Error::Prerequisite(_)),
        "prerequisite (exit 3): {err}"
    );
}
