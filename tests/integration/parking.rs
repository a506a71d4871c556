//! `relay.on_poison = "park-key"`: a poisoned event parks its entity; later events
//! of that entity are recorded as parked (durably, across a relay restart) while
//! other entities flow; `replay` delivers the poisoned event and then the parked
//! ones in order, and releases the key, after which the running relay produces the
//! entity's events itself. Real relay processes, PostgreSQL and broker.

use std::process::ExitCode;
use std::time::Duration;

use outbox_relay::ops::replay::{self, KeyOutcome, ReplayArgs};

use crate::harness::{
    self, RelayProcess, TestDb, consume_exactly, key_sequence as sequence,
    oversize_payload as oversize,
};

async fn insert(db: &TestDb, entity: &str, payload: &str) -> String {
    db.client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', $1, 'OrderPlaced', $2::text::jsonb) RETURNING idempotency_key",
            &[&entity, &payload],
        )
        .await
        .unwrap()
        .get(0)
}

async fn insert_seq(db: &TestDb, entity: &str, seq: i64) -> String {
    insert(db, entity, &format!(r#"{{"seq": {seq}}}"#)).await
}

/// `(holds_key rows, parked rows)` not replayed yet.
async fn parked_rows(db: &TestDb) -> (i64, i64) {
    let row = db
        .client
        .query_one(
            "SELECT count(*) FILTER (WHERE holds_key AND replayed_at IS NULL),
                    count(*) FILTER (WHERE parked AND replayed_at IS NULL)
             FROM poison_outbox",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

fn all() -> ReplayArgs {
    ReplayArgs {
        all: true,
        ..ReplayArgs::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_key_keeps_per_entity_order_through_poison_restart_and_replay() {
    let mut db = TestDb::create_with("park_key", 1).await;
    db.append_config(
        "\n[relay]\non_poison = \"park-key\"\nmax_attempts = 2\n\
         \n[kafka.producer]\n\"message.max.bytes\" = \"100000\"\n",
    );
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;

    // a: 0 delivered, 1 too large (poisoned, parks "a"), 2 and 3 parked.
    // b: flows throughout.
    insert_seq(&db, "a", 0).await;
    insert_seq(&db, "b", 0).await;
    let poisoned_key = insert(&db, "a", &oversize(1)).await;
    insert_seq(&db, "b", 1).await;
    insert_seq(&db, "a", 2).await;
    insert_seq(&db, "a", 3).await;
    insert_seq(&db, "b", 2).await;
    consume_exactly(&db.topic, 4, Duration::from_secs(60), &relay).await;
    harness::wait_until(
        Duration::from_secs(60),
        "one poisoned and two parked rows",
        || async { parked_rows(&db).await == (1, 2) },
    )
    .await;
    let holder: String = db
        .client
        .query_one(
            "SELECT idempotency_key FROM poison_outbox WHERE holds_key",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(holder, poisoned_key);

    // Durable: a restarted relay still parks "a" and still delivers "b".
    relay.terminate(Duration::from_secs(30)).await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    insert_seq(&db, "a", 4).await;
    insert_seq(&db, "b", 3).await;
    let first = consume_exactly(&db.topic, 5, Duration::from_secs(60), &relay).await;
    harness::wait_until(Duration::from_secs(60), "a:4 parked too", || async {
        parked_rows(&db).await == (1, 3)
    })
    .await;
    let records = harness::reread(&db.topic, &first, Duration::from_secs(3)).await;
    assert_eq!(
        sequence(&records, "a"),
        vec![0],
        "nothing of a after the poison"
    );
    assert_eq!(sequence(&records, "b"), vec![0, 1, 2, 3]);

    // status and audit know the parked events.
    let out = harness::run_cli(&[
        "status",
        "--config",
        db.config_path.to_str().unwrap(),
        "--json",
    ]);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (
            status["parked_keys"].as_i64(),
            status["parked_events"].as_i64()
        ),
        (Some(1), Some(3)),
        "{status}"
    );
    let audit = harness::audit(&db);
    assert_eq!(
        (audit["lost"].as_i64(), audit["poisoned"].as_i64()),
        (Some(0), Some(4)),
        "{audit}"
    );

    // Cause not fixed: the poisoned row fails again and "a" stays parked.
    let report = replay::run(&db.config(), &all()).await.unwrap();
    assert_eq!((report.selected, report.failed), (1, 1), "{report}");
    assert_eq!(report.exit_code(), ExitCode::from(1));
    assert!(
        matches!(&report.keys[..], [k] if k.key == "a"
            && matches!(&k.outcome, KeyOutcome::StillParked { reason } if reason.contains("not delivered"))),
        "{report}"
    );
    assert_eq!(parked_rows(&db).await, (1, 3));

    // Fixed (default 1 MB limit): a:1, then a:2..4 in order, and the key is released,
    // while the relay keeps running.
    let mut fixed = db.config();
    fixed.kafka.producer.remove("message.max.bytes");
    let report = replay::run(&fixed, &all()).await.unwrap();
    eprintln!("{report}");
    assert!(report.is_success(), "{report}");
    assert_eq!((report.published, report.failed), (4, 0), "{report}");
    assert!(
        matches!(&report.keys[..], [k] if k.outcome == KeyOutcome::Released { delivered: 3 }),
        "{report}"
    );
    assert_eq!(parked_rows(&db).await, (0, 0));

    // The running relay notices the release at a's next event and produces it.
    insert_seq(&db, "a", 5).await;
    insert_seq(&db, "b", 4).await;
    let records = consume_exactly(&db.topic, 11, Duration::from_secs(60), &relay).await;
    assert_eq!(
        sequence(&records, "a"),
        vec![0, 1, 2, 3, 4, 5],
        "{}",
        relay.log()
    );
    assert_eq!(sequence(&records, "b"), vec![0, 1, 2, 3, 4]);
    harness::assert_per_key_order(&records);
    let parked_a5: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM poison_outbox WHERE payload::jsonb ->> 'seq' = '5'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(parked_a5, 0, "a:5 was produced, not parked");
    let released: Option<bool> = db
        .client
        .query_one(
            "SELECT released_at IS NOT NULL FROM outbox_relay_parked_key WHERE record_key = 'a'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(released, Some(true));

    relay.terminate(Duration::from_secs(30)).await;
    let audit = harness::audit(&db);
    assert_eq!(
        (
            audit["lost"].as_i64(),
            audit["poisoned"].as_i64(),
            audit["out_of_order_keys"].as_i64()
        ),
        (Some(0), Some(0), Some(0)),
        "{audit}"
    );
}

/// `park-key` needs the parked-key table: a relay pointed at a database migrated
/// before it existed says so and stops (exit 3) instead of poisoning without
/// parking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn park_key_without_the_parked_key_table_is_refused() {
    let mut db = TestDb::create("park_nomig").await;
    db.client
        .batch_execute("DROP TABLE outbox_relay_parked_key")
        .await
        .unwrap();
    db.append_config("\n[relay]\non_poison = \"park-key\"\n");
    let mut relay = RelayProcess::start(&db.config_path, &[]);
    let status = relay.wait(Duration::from_secs(60)).await;
    assert_eq!(status.code(), Some(3), "{}", relay.log());
    assert!(
        relay.log().contains("outbox_relay_parked_key") && relay.log().contains("migrate"),
        "{}",
        relay.log()
    );
}
