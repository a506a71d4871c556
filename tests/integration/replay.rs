//! `replay` against the real PostgreSQL and broker: a poisoned event reaches its
//! topic once the cause is fixed, with its original idempotency key, key and headers;
//! poison rows are marked, never deleted; a second `--all` publishes nothing;
//! `--dry-run` changes nothing; unknown ids and rows that still cannot be mapped are
//! reported, not published, not marked.

use std::collections::BTreeSet;
use std::process::ExitCode;
use std::time::Duration;

use outbox_relay::Error;
use outbox_relay::config::Config;
use outbox_relay::kafka::BrokerError;
use outbox_relay::ops::audit::{self, AuditArgs, AuditReport};
use outbox_relay::ops::replay::{self, Outcome, ReplayArgs};

use crate::harness::{self, RelayProcess, TestDb, consume, consume_exactly};

fn all() -> ReplayArgs {
    ReplayArgs {
        all: true,
        ..ReplayArgs::default()
    }
}

fn ids(ids: &[i64]) -> ReplayArgs {
    ReplayArgs {
        ids: ids.to_vec(),
        ..ReplayArgs::default()
    }
}

/// An outbox row with a `headers` object, as an application would write it.
async fn insert_outbox(db: &TestDb, entity: &str, payload: &str) -> String {
    db.client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES ('order', $1, 'OrderPlaced', $2::text::jsonb, '{\"tenant\": \"t1\"}')
             RETURNING idempotency_key",
            &[&entity, &payload],
        )
        .await
        .unwrap()
        .get(0)
}

/// A poison row written directly (as the relay would after a broker rejection;
/// `topic` NULL so the test's template decides). Returns `(poison_id, key)`.
async fn insert_poison(db: &TestDb, aggregate_id: Option<&str>, payload: &str) -> (i64, String) {
    let key = uuid::Uuid::now_v7().to_string();
    let row = db
        .client
        .query_one(
            "INSERT INTO poison_outbox (outbox_id, idempotency_key, aggregate_type, aggregate_id,
                 event_type, topic, headers, payload, created_at, error, error_kind, attempts, lsn)
             VALUES ($1, $1, 'order', $2, 'Created', NULL, '{\"tenant\": \"t1\"}', $3,
                     '2026-01-02 03:04:05.678901+00', 'original error', 'message_size_too_large',
                     5, '0/16B3748')
             RETURNING poison_id",
            &[&key, &aggregate_id, &payload],
        )
        .await
        .unwrap();
    (row.get(0), key)
}

/// `(replayed_at IS NOT NULL, replay_count, error, error_kind)` of a poison row.
async fn poison_state(db: &TestDb, poison_id: i64) -> (bool, i32, String, String) {
    let r = db
        .client
        .query_one(
            "SELECT replayed_at IS NOT NULL, replay_count, error, error_kind
             FROM poison_outbox WHERE poison_id = $1",
            &[&poison_id],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2), r.get(3))
}

async fn audit(config: &Config) -> AuditReport {
    let args = AuditArgs {
        no_progress: true,
        ..AuditArgs::default()
    };
    audit::run(config, &args).await.unwrap()
}

/// Everything on the test's topic (waits `quiet` for records beyond `expected`).
async fn topic_records(db: &TestDb, expected: usize, quiet: Duration) -> Vec<harness::Record> {
    consume(&db.topic, expected + 1, quiet).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_after_raising_the_size_limit_delivers_the_original_event() {
    let mut db = TestDb::create("replay_fix").await;
    db.append_config("\n[kafka.producer]\n\"message.max.bytes\" = \"100000\"\n");
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let small_key = insert_outbox(&db, "small", r#"{"seq": 0}"#).await;
    let big = format!(r#"{{"blob": "{}"}}"#, "x".repeat(200_000));
    let big_key = insert_outbox(&db, "big", &big).await;
    let later_key = insert_outbox(&db, "big", r#"{"seq": 2}"#).await;
    consume_exactly(&db.topic, 2, Duration::from_secs(60), &relay).await;
    harness::wait_until(Duration::from_secs(60), "the poison row", || async {
        db.poison_rows().await == 1
    })
    .await;
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
    let poison_id: i64 = db
        .client
        .query_one(
            "SELECT poison_id FROM poison_outbox WHERE idempotency_key = $1",
            &[&big_key],
        )
        .await
        .unwrap()
        .get(0);

    let before = audit(&db.config()).await;
    assert_eq!(
        (
            before.expected,
            before.delivered,
            before.poisoned,
            before.lost
        ),
        (3, 2, 1, 0)
    );

    // Cause not fixed yet: the replay fails, says why, and leaves the row unmarked.
    let report = replay::run(&db.config(), &all()).await.unwrap();
    assert_eq!(
        (report.selected, report.published, report.failed),
        (1, 0, 1)
    );
    let kind = report.rows[0].error_kind.clone().unwrap();
    assert!(
        kind.contains("size") || kind.contains("large"),
        "{report:?}"
    );
    assert_eq!(report.exit_code(), ExitCode::from(1));
    assert!(
        !poison_state(&db, poison_id).await.0,
        "a failed replay does not mark"
    );

    // Fixed: the producer limit is back to its default (1 MB).
    let mut fixed = db.config();
    fixed.kafka.producer.remove("message.max.bytes");
    let report = replay::run(&fixed, &all()).await.unwrap();
    eprintln!("{report}");
    assert_eq!(
        (report.selected, report.published, report.failed),
        (1, 1, 0),
        "{report:?}"
    );
    assert!(report.is_success());
    let row = &report.rows[0];
    assert_eq!(row.outcome, Outcome::Published);
    assert_eq!(row.idempotency_key.as_deref(), Some(big_key.as_str()));
    assert_eq!(row.key.as_deref(), Some("big"));
    assert_eq!(row.topic.as_deref(), Some(db.topic.as_str()));
    assert_eq!(row.replay_count, 1);

    let records = consume(&db.topic, 3, Duration::from_secs(60)).await;
    assert_eq!(records.len(), 3, "{records:?}");
    let by_key = |k: &str| {
        records
            .iter()
            .find(|r| r.header("idempotency_key") == Some(k))
            .unwrap_or_else(|| panic!("no record with idempotency_key {k}"))
    };
    let (normal, later, replayed) = (by_key(&small_key), by_key(&later_key), by_key(&big_key));
    assert_eq!(replayed.key.as_deref(), Some(&b"big"[..]));
    // Same header names as an event the relay delivered itself, in the contract.
    let names = |r: &harness::Record| r.headers.keys().cloned().collect::<BTreeSet<_>>();
    assert_eq!(names(replayed), names(normal));
    assert_eq!(replayed.header("tenant"), Some("t1"));
    assert_eq!(replayed.header("event_type"), Some("OrderPlaced"));
    assert_eq!(replayed.header("aggregate_type"), Some("order"));
    // The entity's partition (murmur2 of the key), like its other event.
    assert_eq!(replayed.partition, later.partition);
    let original = db
        .client
        .query_one(
            "SELECT o.payload::text, floor(extract(epoch FROM o.created_at) * 1000)::bigint,
                    p.lsn::text, to_json(o.created_at)::text
             FROM outbox o JOIN poison_outbox p USING (idempotency_key)
             WHERE o.idempotency_key = $1",
            &[&big_key],
        )
        .await
        .unwrap();
    let payload: String = original.get(0);
    assert_eq!(replayed.payload.as_deref(), Some(payload.as_bytes()));
    assert_eq!(replayed.timestamp_ms, Some(original.get::<_, i64>(1)));
    assert_eq!(
        replayed.header("source_lsn"),
        Some(original.get::<_, &str>(2))
    );
    let occurred_at = replayed.header("occurred_at").unwrap();
    assert!(occurred_at.ends_with('Z'), "{occurred_at}");

    // Marked, still there, original error kept.
    let (replayed_at, count, error, kind) = poison_state(&db, poison_id).await;
    assert!(replayed_at);
    assert_eq!(count, 1);
    assert!(
        kind.contains("size") || kind.contains("large"),
        "{kind}: {error}"
    );
    assert_eq!(db.poison_rows().await, 1, "poison rows are never deleted");

    // `audit` counts the replayed event as delivered.
    let after = audit(&fixed).await;
    assert_eq!(
        (after.expected, after.delivered, after.poisoned, after.lost),
        (3, 3, 0, 0)
    );
    assert_eq!(
        (after.replayed, after.duplicates, after.out_of_order_keys),
        (1, 0, 0)
    );

    // A second --all finds nothing to publish.
    let again = replay::run(&fixed, &all()).await.unwrap();
    assert_eq!(
        (again.selected, again.published, again.already_replayed),
        (0, 0, 1)
    );
    assert!(again.rows.is_empty());
    assert_eq!(topic_records(&db, 3, Duration::from_secs(5)).await.len(), 3);
    assert_eq!(poison_state(&db, poison_id).await.1, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_all_twice_publishes_once_and_id_sends_again() {
    let db = TestDb::create("replay_twice").await;
    let mut rows = Vec::new();
    for i in 0..3 {
        rows.push(insert_poison(&db, Some(&format!("e{i}")), &format!(r#"{{"n": {i}}}"#)).await);
    }
    let config = db.config();
    let first = replay::run(&config, &all()).await.unwrap();
    assert_eq!(
        (first.selected, first.published, first.failed),
        (3, 3, 0),
        "{first:?}"
    );
    let ids: Vec<i64> = first.rows.iter().map(|r| r.poison_id).collect();
    assert_eq!(
        ids,
        rows.iter().map(|r| r.0).collect::<Vec<_>>(),
        "poison_id order"
    );

    let second = replay::run(&config, &all()).await.unwrap();
    assert_eq!((second.selected, second.published), (0, 0));
    assert_eq!(second.already_replayed, 3);
    assert!(
        second.to_string().starts_with("nothing to replay"),
        "{second}"
    );

    let records = topic_records(&db, 3, Duration::from_secs(10)).await;
    assert_eq!(records.len(), 3, "the second --all published nothing");
    for (poison_id, key) in &rows {
        assert_eq!(poison_state(&db, *poison_id).await.1, 1);
        let r = records
            .iter()
            .find(|r| r.header("idempotency_key") == Some(key))
            .unwrap();
        assert_eq!(r.header("tenant"), Some("t1"));
        assert_eq!(r.header("source_lsn"), Some("0/16B3748"));
        assert_eq!(r.header("occurred_at"), Some("2026-01-02T03:04:05.678901Z"));
        assert_eq!(r.timestamp_ms, Some(1_767_323_045_678));
    }

    // Naming a row sends it again, explicitly.
    let (poison_id, key) = &rows[0];
    let named = replay::run(
        &config,
        &replay::ReplayArgs {
            ids: vec![*poison_id, *poison_id],
            ..ReplayArgs::default()
        },
    )
    .await
    .unwrap();
    assert_eq!((named.selected, named.published), (1, 1));
    assert_eq!(named.rows[0].replay_count, 2);
    assert_eq!(poison_state(&db, *poison_id).await.1, 2);
    let records = topic_records(&db, 4, Duration::from_secs(5)).await;
    assert_eq!(records.len(), 4);
    let copies = records
        .iter()
        .filter(|r| r.header("idempotency_key") == Some(key))
        .count();
    assert_eq!(copies, 2, "same idempotency key, so consumers dedupe");
    assert_eq!(db.poison_rows().await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_changes_nothing_and_needs_no_broker() {
    let db = TestDb::create("replay_dry").await;
    let (good, good_key) = insert_poison(&db, Some("e1"), r#"{"n": 1}"#).await;
    let (bad, _) = insert_poison(&db, None, "{}").await;
    let mut config = db.config();
    // Nothing listens here: a dry run must not need the broker.
    config.kafka.brokers = "127.0.0.1:9".into();
    let args = ReplayArgs {
        dry_run: true,
        ..all()
    };
    let report = replay::run(&config, &args).await.unwrap();
    eprintln!("{report}\n{}", report.to_json());
    assert!(report.dry_run);
    assert_eq!(
        (report.selected, report.published, report.failed),
        (2, 1, 1)
    );
    let row = &report.rows[0];
    assert_eq!((row.poison_id, row.outcome), (good, Outcome::WouldPublish));
    assert_eq!(row.idempotency_key.as_deref(), Some(good_key.as_str()));
    assert_eq!(row.key.as_deref(), Some("e1"));
    assert_eq!(row.topic.as_deref(), Some(db.topic.as_str()));
    assert!(row.bytes > good_key.len(), "{row:?}");
    assert_eq!(row.replay_count, 0);
    assert_eq!(report.rows[1].outcome, Outcome::Failed);
    let text = report.to_string();
    assert!(
        text.contains("dry run") && text.contains("would publish"),
        "{text}"
    );

    for id in [good, bad] {
        let (replayed_at, count, error, _) = poison_state(&db, id).await;
        assert!(!replayed_at);
        assert_eq!(count, 0);
        assert_eq!(error, "original error");
    }
    assert!(
        topic_records(&db, 0, Duration::from_secs(3))
            .await
            .is_empty()
    );

    // For real, the unreachable broker is a start-up error (exit code 4), and
    // nothing is marked.
    let err = replay::run(&config, &all()).await.unwrap_err();
    assert!(
        matches!(err, Error::Broker(BrokerError::Unavailable(_))),
        "{err}"
    );
    assert_eq!(err.exit_code(), ExitCode::from(4));
    assert!(!poison_state(&db, good).await.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_id_or_no_selection_is_a_usage_error() {
    let db = TestDb::create("replay_unknown").await;
    let (known, _) = insert_poison(&db, Some("e1"), "{}").await;
    let config = db.config();
    let unknown = known + 1000;
    let err = replay::run(&config, &ids(&[known, unknown]))
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert_eq!(err.exit_code(), ExitCode::from(2));
    let message = err.to_string();
    assert!(message.contains(&unknown.to_string()), "{message}");
    assert!(!message.contains(&format!("{known},")), "{message}");
    assert!(message.contains("poison_outbox"), "{message}");
    // Nothing was published, the known row is not marked.
    assert!(!poison_state(&db, known).await.0);
    assert!(
        topic_records(&db, 0, Duration::from_secs(3))
            .await
            .is_empty()
    );

    let err = replay::run(&config, &ReplayArgs::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Config(_)), "{err}");
    assert!(err.to_string().contains("--all"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_that_still_cannot_be_mapped_is_reported_and_not_marked() {
    let db = TestDb::create("replay_unmappable").await;
    let (good, _) = insert_poison(&db, Some("e1"), r#"{"ok": true}"#).await;
    let (bad, bad_key) = insert_poison(&db, None, r#"{"ok": false}"#).await;
    let config = db.config();
    let report = replay::run(&config, &all()).await.unwrap();
    assert_eq!(
        (report.selected, report.published, report.failed),
        (2, 1, 1)
    );
    assert_eq!(report.exit_code(), ExitCode::from(1));
    let failed = report.rows.iter().find(|r| r.poison_id == bad).unwrap();
    assert_eq!(failed.outcome, Outcome::Failed);
    assert_eq!(failed.error_kind.as_deref(), Some("null_key"));
    assert!(
        failed.error.as_deref().unwrap().contains("aggregate_id"),
        "{failed:?}"
    );
    assert_eq!(failed.idempotency_key.as_deref(), Some(bad_key.as_str()));
    let json: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
    assert_eq!(json["failed"], 1);

    let (replayed_at, count, error, kind) = poison_state(&db, bad).await;
    assert!(!replayed_at);
    assert_eq!(count, 0);
    assert_eq!(
        (error.as_str(), kind.as_str()),
        ("original error", "message_size_too_large")
    );
    assert!(poison_state(&db, good).await.0);

    // Still unmarked, so the next --all tries it again (and only it).
    let again = replay::run(&config, &all()).await.unwrap();
    assert_eq!((again.selected, again.published, again.failed), (1, 0, 1));
    assert_eq!(again.already_replayed, 1);
    assert_eq!(topic_records(&db, 1, Duration::from_secs(5)).await.len(), 1);
}

/// `outbox.additional_placement` (Debezium's `table.fields.additional.placement`):
/// columns placed as headers arrive on the streamed record, on the record `poll`
/// publishes, and on the record `replay` publishes from the poison row (which keeps
/// every column in `row_data`): the three paths agree.
#[tokio::test]
async fn placed_columns_arrive_as_headers_from_the_stream_the_poller_and_replay() {
    let mut db = TestDb::create_configured(
        "placement",
        1,
        "\n[outbox]\nadditional_placement = [\"tenant:header\", \"version:header:schema_version\"]\n",
    )
    .await;
    db.client
        .batch_execute("ALTER TABLE outbox ADD COLUMN tenant text, ADD COLUMN version int")
        .await
        .unwrap();
    db.append_config("\n[kafka.producer]\n\"message.max.bytes\" = \"100000\"\n");
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let insert = |entity: &'static str, payload: String, tenant: &'static str, version: i32| {
        let client = &db.client;
        async move {
            client
                .query_one(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, tenant, version)
                     VALUES ('order', $1, 'OrderPlaced', $2::text::jsonb, $3, $4)
                     RETURNING idempotency_key",
                    &[&entity, &payload, &tenant, &version],
                )
                .await
                .unwrap()
                .get::<_, String>(0)
        }
    };
    let streamed = insert("o-1", r#"{"seq": 1}"#.into(), "acme", 3).await;
    let big = format!(r#"{{"blob": "{}"}}"#, "x".repeat(200_000));
    let poisoned = insert("o-2", big, "beta", 4).await;
    consume_exactly(&db.topic, 1, Duration::from_secs(60), &relay).await;
    harness::wait_until(Duration::from_secs(60), "the poison row", || async {
        db.poison_rows().await == 1
    })
    .await;
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;

    // replay, with the size limit back to its default.
    let mut fixed = db.config();
    fixed.kafka.producer.remove("message.max.bytes");
    let report = replay::run(&fixed, &all()).await.unwrap();
    assert_eq!((report.published, report.failed), (1, 0), "{report:?}");

    // poll: the rows are unsent for the poller (the stream does not mark them).
    let polled = insert("o-3", r#"{"seq": 3}"#.into(), "gamma", 5).await;
    db.client
        .batch_execute("UPDATE outbox SET sent_at = now() WHERE aggregate_id <> 'o-3'")
        .await
        .unwrap();
    let poller = RelayProcess::start_command(&["poll"], &db.config_path, &[]);
    let records = consume(&db.topic, 3, Duration::from_secs(60)).await;
    poller.terminate(Duration::from_secs(20)).await;
    assert_eq!(records.len(), 3, "{records:?}");
    for (key, tenant, version) in [
        (&streamed, "acme", "3"),
        (&poisoned, "beta", "4"),
        (&polled, "gamma", "5"),
    ] {
        let record = records
            .iter()
            .find(|r| r.header("idempotency_key") == Some(key.as_str()))
            .unwrap_or_else(|| panic!("no record {key}: {records:?}"));
        assert_eq!(record.header("tenant"), Some(tenant), "{record:?}");
        assert_eq!(record.header("schema_version"), Some(version), "{record:?}");
    }
}
