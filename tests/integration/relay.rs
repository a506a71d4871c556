//! The CDC relay end to end: the real `outbox-relay run` process, the real
//! PostgreSQL walsender, the real broker. Each test asserts no loss, per-key order
//! and how many duplicates, as the promises in `docs/architecture.md` require.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use outbox_relay::tools::workload::{Keys, Workload, Writers};

use crate::harness::{
    self, RelayProcess, TestDb, assert_per_key_order, confirmed_flush, consume, consume_exactly,
    parse_lsn,
};

/// `writers` concurrent writers of `transactions` transactions each, through the
/// library's workload writer: 1-3 outbox rows (payloads of varying length) and a
/// business row per transaction, 5 entities per writer, a `tenant` header, every
/// 10th transaction rolled back. Returns the idempotency keys committed and those
/// rolled back.
async fn write_concurrently(
    db: &TestDb,
    writers: u32,
    transactions: u64,
) -> (Vec<String>, Vec<String>) {
    // Sizes cycle 1, 2, 3: `transactions` of them hold 2 rows on average.
    let workload = Workload {
        events: u64::from(writers) * transactions * 2,
        payload_bytes: 120,
        rows_per_tx: 3,
        writers,
        entities: 5,
    };
    let written = db
        .writers(workload)
        .varied()
        .headers(r#"{"tenant": "t1"}"#)
        .rollback_every(10)
        .run()
        .await
        .expect("write the workload");
    (written.committed, written.rolled_back)
}

fn keys_of(records: &[harness::Record]) -> Vec<String> {
    records
        .iter()
        .map(|r| r.header("idempotency_key").unwrap().to_owned())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relays_concurrent_writers_exactly_once_in_commit_order() {
    let db = TestDb::create("relay_main").await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let (committed, rolled_back) = write_concurrently(&db, 4, 120).await;
    assert!(committed.len() > 800, "{}", committed.len());

    let first = consume_exactly(&db.topic, committed.len(), Duration::from_secs(90), &relay).await;
    // Anything beyond the expected count would be a duplicate: read a little longer.
    let records = harness::reread(&db.topic, &first, Duration::from_secs(3)).await;
    let keys = keys_of(&records);
    let unique: HashSet<&String> = keys.iter().collect();
    assert_eq!(unique.len(), keys.len(), "no duplicates when nothing fails");
    assert_eq!(
        unique,
        committed.iter().collect::<HashSet<_>>(),
        "exactly the committed events"
    );
    for key in &rolled_back {
        assert!(!unique.contains(key), "rolled-back event {key} was relayed");
    }

    // Record contract: key, untouched payload bytes, headers, timestamp.
    let rows = db
        .client
        .query(
            "SELECT idempotency_key, aggregate_id, payload::text, event_type, id::text,
                    (extract(epoch FROM created_at) * 1000)::bigint
             FROM outbox",
            &[],
        )
        .await
        .unwrap();
    let expected: HashMap<String, (String, String, String, i64)> = rows
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(5))))
        .collect();
    let mut max_source_lsn = 0;
    for r in &records {
        let key = r.header("idempotency_key").unwrap();
        let (entity, payload, event_type, created_ms) = &expected[key];
        assert_eq!(r.key.as_deref(), Some(entity.as_bytes()));
        assert_eq!(
            r.payload.as_deref(),
            Some(payload.as_bytes()),
            "payload bytes untouched"
        );
        assert_eq!(r.header("event_type"), Some(event_type.as_str()));
        assert_eq!(r.header("aggregate_type"), Some("order"));
        assert_eq!(r.header("tenant"), Some("t1"), "headers jsonb entries");
        assert!(r.header("occurred_at").unwrap().ends_with('Z'));
        let ts = r.timestamp_ms.unwrap();
        assert!(
            (ts - created_ms).abs() <= 1,
            "CreateTime {ts} vs created_at {created_ms}"
        );
        max_source_lsn = max_source_lsn.max(parse_lsn(r.header("source_lsn").unwrap()));
    }
    assert_per_key_order(&records);

    // The slot confirms past the last event once it is acked.
    harness::wait_confirmed_past(&db, max_source_lsn).await;
    let status = relay.terminate(Duration::from_secs(30)).await;
    assert!(status.success(), "clean stop exits 0: {status:?}");
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_after_clean_stop_resends_nothing() {
    let mut db = TestDb::create("relay_restart").await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    for i in 0..100 {
        db.insert_event(
            &format!("e{}", i % 7),
            "Created",
            &format!(r#"{{"seq": {i}}}"#),
        )
        .await;
    }
    consume_exactly(&db.topic, 100, Duration::from_secs(60), &relay).await;
    let status = relay.terminate(Duration::from_secs(30)).await;
    assert!(status.success(), "{status:?}");

    for i in 100..150 {
        db.insert_event(
            &format!("e{}", i % 7),
            "Created",
            &format!(r#"{{"seq": {i}}}"#),
        )
        .await;
    }
    let relay = RelayProcess::start(&db.config_path, &[]);
    let first = consume_exactly(&db.topic, 150, Duration::from_secs(60), &relay).await;
    let records = harness::reread(&db.topic, &first, Duration::from_secs(3)).await;
    assert_eq!(
        records.len(),
        150,
        "a clean stop confirms everything: nothing is re-sent"
    );
    assert_per_key_order(&records);
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_with_events_in_flight_loses_nothing_and_bounds_duplicates() {
    const WINDOW: usize = 20;
    const EVENTS: usize = 3_000;
    let db = TestDb::create("relay_kill").await;
    db.create_slot().await;
    // Single-row transactions written up front: a backlog the relay drains.
    db.client
        .batch_execute(&format!(
            "DO $$ BEGIN
               FOR g IN 1..{EVENTS} LOOP
                 INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', 'e' || (g % 13), 'Created', jsonb_build_object('seq', g));
                 COMMIT;
               END LOOP;
             END $$"
        ))
        .await
        .unwrap();
    let expected: i64 = db
        .client
        .query_one("SELECT count(*) FROM outbox", &[])
        .await
        .unwrap()
        .get(0);
    let expected = usize::try_from(expected).unwrap();
    let window = WINDOW.to_string();
    let env = [("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", window.as_str())];

    // Kill the relay twice mid-stream, then let a third one finish.
    let mut kills = Vec::new();
    for target in [expected / 4, expected / 2] {
        let relay = RelayProcess::start(&db.config_path, &env);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let seen = consume(&db.topic, target, Duration::from_secs(2))
                .await
                .len();
            if seen >= target {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "relay too slow; log:\n{}",
                relay.log()
            );
        }
        relay.kill9().await;
        kills.push(target);
    }
    let relay = RelayProcess::start(&db.config_path, &env);
    let expected_keys: HashSet<String> = db
        .client
        .query("SELECT idempotency_key FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    // Read until every key arrived.
    let deadline = Instant::now() + Duration::from_secs(120);
    let records = loop {
        let records = consume(&db.topic, usize::MAX, Duration::from_secs(3)).await;
        let seen: HashSet<String> = keys_of(&records).into_iter().collect();
        if seen.len() >= expected_keys.len() {
            break records;
        }
        assert!(
            Instant::now() < deadline,
            "only {} of {} events after restarts; log:\n{}",
            seen.len(),
            expected_keys.len(),
            relay.log()
        );
    };
    let keys = keys_of(&records);
    let seen: HashSet<&String> = keys.iter().collect();
    assert_eq!(seen.len(), expected_keys.len(), "no loss");
    assert!(expected_keys.iter().all(|k| seen.contains(k)), "no loss");
    let duplicates = keys.len() - seen.len();
    // Each crash re-sends what the server had not been told was confirmed: at most the
    // in-flight window plus the events acked since the last status update, which the
    // core caps at one window (single-row transactions here).
    let bound = kills.len() * 2 * WINDOW;
    eprintln!(
        "kill -9 x{}: {duplicates} duplicates (bound {bound})",
        kills.len()
    );
    assert!(
        duplicates <= bound,
        "{duplicates} duplicates > bound {bound}"
    );
    // First deliveries per key are in commit order.
    assert_per_key_order(&records);
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_rows_land_in_poison_outbox_and_the_stream_goes_on() {
    let mut db = TestDb::create("relay_poison").await;
    db.append_config("\n[kafka.producer]\n\"message.max.bytes\" = \"100000\"\n");
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    db.insert_event("before", "Created", r#"{"seq": 0}"#).await;
    let big = format!(r#"{{"blob": "{}"}}"#, "x".repeat(200_000));
    let big_key = db.insert_event("big", "Created", &big).await;
    let null_key: String = db
        .client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', NULL, 'Created', '{}') RETURNING idempotency_key",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    for i in 1..=5 {
        db.insert_event("after", "Created", &format!(r#"{{"seq": {i}}}"#))
            .await;
    }
    let last_lsn: String = db
        .client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let records = consume_exactly(&db.topic, 6, Duration::from_secs(60), &relay).await;
    assert_eq!(records.len(), 6, "the good events are delivered");

    let client = &db.client;
    harness::wait_until(Duration::from_secs(30), "two poison rows", || async {
        let n: i64 = client
            .query_one("SELECT count(*) FROM poison_outbox", &[])
            .await
            .unwrap()
            .get(0);
        n == 2
    })
    .await;
    let rows = db
        .client
        .query(
            "SELECT idempotency_key, error_kind, error, attempts, lsn IS NOT NULL, payload, row_data
             FROM poison_outbox",
            &[],
        )
        .await
        .unwrap();
    let by_key: BTreeMap<String, (String, String, i32, bool)> = rows
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(4))))
        .collect();
    let (kind, error, attempts, has_lsn) = &by_key[&big_key];
    assert!(
        kind.contains("size") || kind.contains("large"),
        "{kind}: {error}"
    );
    assert_eq!(
        *attempts, 1,
        "oversize: refused before producing, no retries"
    );
    assert!(
        error.contains("message.max.bytes = 100000"),
        "the limit is in the error: {error}"
    );
    assert!(has_lsn);
    let (kind, error, _, _) = &by_key[&null_key];
    assert_eq!(kind, "null_key", "{error}");
    // The slot advanced past everything, poison included.
    let last = parse_lsn(&last_lsn);
    harness::wait_until(
        Duration::from_secs(30),
        "slot past the poisoned events",
        || async { confirmed_flush(client, &db.slot).await >= last },
    )
    .await;
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_outbox_does_not_pin_wal() {
    let mut db = TestDb::create("relay_idle").await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    db.insert_event("e", "Created", "{}").await;
    consume_exactly(&db.topic, 1, Duration::from_secs(60), &relay).await;
    // Other WAL activity only: business rows, not in the publication.
    for i in 0..50 {
        db.client
            .execute(
                "INSERT INTO business_orders (entity, amount) VALUES ('x', $1)",
                &[&i],
            )
            .await
            .unwrap();
    }
    let after: String = db
        .client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let after = parse_lsn(&after);
    let client = &db.client;
    harness::wait_until(
        Duration::from_secs(40),
        "confirmed_flush_lsn to follow idle WAL",
        || async { confirmed_flush(client, &db.slot).await >= after },
    )
    .await;
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_publication_and_busy_slot_exit_with_code_3() {
    let db = TestDb::create("relay_prereq").await;
    // A second relay on a slot that is streaming: clear message, exit code 3.
    let first = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&first).await;
    let mut second = RelayProcess::start(
        &db.config_path,
        &[("OUTBOX_RELAY__RELAY__SLOT_BUSY_TIMEOUT_SECS", "1")],
    );
    let status = second.wait(Duration::from_secs(30)).await;
    assert_eq!(status.code(), Some(3), "log:\n{}", second.log());
    assert!(second.log().contains("is active"), "{}", second.log());
    first.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;

    db.client
        .batch_execute("DROP PUBLICATION outbox_relay_pub")
        .await
        .unwrap();
    let mut relay = RelayProcess::start(&db.config_path, &[]);
    let status = relay.wait(Duration::from_secs(30)).await;
    assert_eq!(status.code(), Some(3), "log:\n{}", relay.log());
    assert!(
        relay
            .log()
            .contains("publication outbox_relay_pub does not exist"),
        "{}",
        relay.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_level_replica_is_refused_with_code_3() {
    let cluster = harness::PrivateCluster::start("replica").await;
    let config = std::env::temp_dir().join(format!("{}.toml", harness::unique("replica_cfg")));
    std::fs::write(
        &config,
        harness::config_toml(
            &cluster.url,
            "replica_slot",
            "unused",
            &harness::env().brokers,
        ),
    )
    .unwrap();
    let out = harness::run_cli(&["migrate", "--config", config.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut relay = RelayProcess::start(&config, &[]);
    let status = relay.wait(Duration::from_secs(30)).await;
    assert_eq!(status.code(), Some(3), "log:\n{}", relay.log());
    assert!(
        relay.log().contains("wal_level is 'replica'"),
        "{}",
        relay.log()
    );
    cluster.stop();
}

/// Stop the broker mid-stream: the relay waits (no crash, no poison), the slot's
/// confirmed LSN never passes the first unacked event, and after the broker comes
/// back every event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_holds_the_slot_and_loses_nothing() {
    let mut broker = harness::PrivateBroker::start().await;
    let mut db = TestDb::create("relay_outage").await;
    harness::create_topic_on(&broker.brokers(), &db.topic, 3).await;
    let brokers = broker.brokers();
    let env = [("OUTBOX_RELAY__KAFKA__BROKERS", brokers.as_str())];
    let mut relay = RelayProcess::start(&db.config_path, &env);
    db.wait_streaming(&relay).await;
    for i in 0..50 {
        db.insert_event(
            &format!("e{}", i % 5),
            "Created",
            &format!(r#"{{"seq": {i}}}"#),
        )
        .await;
    }
    let before = harness::consume_from(&brokers, &db.topic, 50, Duration::from_secs(60)).await;
    assert_eq!(before.len(), 50, "log:\n{}", relay.log());

    broker.stop();
    db.insert_event("e0", "Created", r#"{"seq": 50}"#).await;
    // The end of the first unacked transaction's commit record is at or before
    // this position; confirming it (or anything past it) would skip that event
    // after a restart. (Other tests write WAL too, so this is an upper bound.)
    let first_unacked: String = db
        .client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let first_unacked = parse_lsn(&first_unacked);
    for i in 51..100 {
        db.insert_event(
            &format!("e{}", i % 5),
            "Created",
            &format!(r#"{{"seq": {i}}}"#),
        )
        .await;
    }
    // Keepalives and status updates go on during the outage (wal_sender_timeout is
    // 10 s in the test cluster): watch the slot for longer than that.
    let watch_until = Instant::now() + Duration::from_secs(12);
    while Instant::now() < watch_until {
        let confirmed = confirmed_flush(&db.client, &db.slot).await;
        assert!(
            confirmed < first_unacked,
            "confirmed {confirmed:X} passed the unacked events at {first_unacked:X}"
        );
        assert!(
            relay.is_running(),
            "relay exited during the outage:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    broker.resume().await;
    let records = harness::consume_from(&brokers, &db.topic, 100, Duration::from_secs(90)).await;
    let keys = keys_of(&records);
    let unique: HashSet<&String> = keys.iter().collect();
    assert_eq!(
        unique.len(),
        100,
        "no loss across the outage; log:\n{}",
        relay.log()
    );
    eprintln!("broker outage: {} duplicates", keys.len() - unique.len());
    assert_per_key_order(&records);
    let poisoned: i64 = db.poison_rows().await;
    assert_eq!(poisoned, 0, "an outage never poisons");
    let client = &db.client;
    harness::wait_until(
        Duration::from_secs(30),
        "slot to advance after recovery",
        || async { confirmed_flush(client, &db.slot).await > first_unacked },
    )
    .await;
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// 100,000 events from 4 concurrent writers (10 rows per transaction, 1,000
/// entities) as a backlog, then drained by the relay: zero loss, per-key order,
/// and the drain rate printed (events/s from relay start to the slot confirming the
/// last commit). A correctness test first; the number is informative (the bench
/// measures properly).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drains_100k_events_from_concurrent_writers() {
    const WRITERS: u32 = 4;
    const PER_WRITER: u64 = 25_000;
    let _heavy = harness::heavy().await;
    let db = TestDb::create("relay_100k").await;
    db.create_slot().await;
    // 250 entities per writer, seq growing with each writer's commits: commit
    // order per entity is seq order.
    let workload = Workload {
        events: u64::from(WRITERS) * PER_WRITER,
        payload_bytes: 300,
        rows_per_tx: 10,
        writers: WRITERS,
        entities: 250,
    };
    Writers::new(&db.url, "outbox", workload)
        .keys(Keys::PerWriter)
        .run()
        .await
        .expect("write the backlog");
    let end: String = db
        .client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let end = parse_lsn(&end);
    let started = Instant::now();
    let relay = RelayProcess::start(&db.config_path, &[]);
    let client = &db.client;
    let deadline = Instant::now() + Duration::from_secs(300);
    while confirmed_flush(client, &db.slot).await < end {
        assert!(
            Instant::now() < deadline,
            "drain too slow; log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = started.elapsed();
    let total = usize::try_from(u64::from(WRITERS) * PER_WRITER).unwrap();
    let rate = f64::from(u32::try_from(total).unwrap()) / elapsed.as_secs_f64();
    eprintln!("drained {total} events in {elapsed:.2?}: {rate:.0} events/s (incl. process start)");

    let records = consume_exactly(&db.topic, total, Duration::from_secs(120), &relay).await;
    let keys = keys_of(&records);
    let unique: HashSet<&String> = keys.iter().collect();
    assert_eq!(unique.len(), total, "zero loss");
    assert_eq!(keys.len(), total, "no duplicates without failures");
    assert_per_key_order(&records);
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// `status --json` reads the slot and poison table: no slot before the first
/// start, then the streaming relay's pid, a confirmed LSN and the poison backlog.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_reports_slot_lag_and_poison() {
    let mut db = TestDb::create("relay_status").await;
    let config = db.config_path.to_str().unwrap().to_owned();
    let status = |config: String| async move {
        let out = tokio::task::spawn_blocking(move || {
            harness::run_cli(&["status", "--config", &config, "--json"])
        })
        .await
        .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let before = status(config.clone()).await;
    assert_eq!(before["slot_exists"], false);
    assert_eq!(before["poison_total"], 0);

    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    db.insert_event("e", "Created", "{}").await;
    db.client
        .execute(
            "INSERT INTO poison_outbox (idempotency_key, error, error_kind, attempts) VALUES ('k', 'x', 'test', 1)",
            &[],
        )
        .await
        .unwrap();
    consume_exactly(&db.topic, 1, Duration::from_secs(60), &relay).await;
    let during = status(config.clone()).await;
    assert_eq!(during["slot_exists"], true);
    assert!(during["active_pid"].as_i64().is_some(), "{during}");
    assert!(during["lag_bytes"].as_i64().unwrap() >= 0);
    assert!(during["retained_wal_bytes"].as_i64().unwrap() >= 0);
    assert_eq!(during["poison_pending"], 1);
    relay.terminate(Duration::from_secs(30)).await;
    let after = status(config).await;
    assert!(after["active_pid"].is_null(), "{after}");
    db.drop_slot().await;
}

/// One active of N: a second relay on the same config waits as a standby (logging
/// once) while the first streams, and takes over within seconds when the first is
/// killed, with nothing lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_takes_over_when_the_active_relay_dies() {
    let mut db = TestDb::create("relay_ha").await;
    let env = [("OUTBOX_RELAY__RELAY__SLOT_BUSY_TIMEOUT_SECS", "600")];
    let active = RelayProcess::start(&db.config_path, &env);
    db.wait_streaming(&active).await;
    let mut standby = RelayProcess::start(&db.config_path, &env);
    harness::wait_until(
        Duration::from_secs(30),
        "the standby to report the busy slot",
        || {
            let log = standby.log();
            async move { log.contains("replication slot is active in another process") }
        },
    )
    .await;
    for i in 0..100 {
        db.insert_event(
            &format!("e{}", i % 5),
            "Created",
            &format!(r#"{{"seq": {i}}}"#),
        )
        .await;
    }
    consume_exactly(&db.topic, 100, Duration::from_secs(60), &active).await;
    assert!(standby.is_running(), "the standby waits: {}", standby.log());
    assert_eq!(
        standby
            .log()
            .matches("replication slot is active in another process")
            .count(),
        1,
        "the standby logs its wait once"
    );

    active.kill9().await;
    let killed = Instant::now();
    for i in 100..200 {
        db.insert_event(
            &format!("e{}", i % 5),
            "Created",
            &format!(r#"{{"seq": {i}}}"#),
        )
        .await;
    }
    // The takeover is timed to the standby streaming from the slot (at the latest
    // once the writes are done), not to the shared broker serving the records.
    db.wait_streaming(&standby).await;
    let takeover = killed.elapsed();
    let records = consume_exactly(&db.topic, 200, Duration::from_secs(60), &standby).await;
    let keys = keys_of(&records);
    let unique: HashSet<&String> = keys.iter().collect();
    assert_eq!(unique.len(), 200, "nothing lost across the takeover");
    assert_per_key_order(&records);
    eprintln!(
        "standby streamed within {takeover:.1?} of the kill ({} duplicates)",
        keys.len() - unique.len()
    );
    assert!(
        takeover < Duration::from_secs(30),
        "takeover took {takeover:?}"
    );
    standby.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// Cutting the replication connection (`pg_terminate_backend` on the walsender)
/// ends the session, not the process: the relay reconnects from the slot and
/// nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_replication_connection_reconnects_without_loss() {
    let mut db = TestDb::create("relay_cut").await;
    let mut relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    for round in 0..3 {
        for i in 0..50 {
            let seq = round * 50 + i;
            db.insert_event(
                &format!("e{}", seq % 5),
                "Created",
                &format!(r#"{{"seq": {seq}}}"#),
            )
            .await;
        }
        let old_pid: i32 = db
            .client
            .query_one(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                &[&db.slot],
            )
            .await
            .unwrap()
            .get(0);
        let terminated: bool = db
            .client
            .query_one("SELECT pg_terminate_backend($1)", &[&old_pid])
            .await
            .unwrap()
            .get(0);
        assert!(terminated, "round {round}: the walsender was streaming");
        let client = &db.client;
        let slot = &db.slot;
        harness::wait_until(
            Duration::from_secs(30),
            "a new walsender on the slot",
            || async move {
                let pid: Option<i32> = client
                    .query_one(
                        "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                        &[slot],
                    )
                    .await
                    .unwrap()
                    .get(0);
                pid.is_some_and(|p| p != old_pid)
            },
        )
        .await;
    }
    let records = harness::consume_unique(&db.topic, 150, Duration::from_secs(60), &relay).await;
    let keys = keys_of(&records);
    let unique: HashSet<&String> = keys.iter().collect();
    assert_eq!(unique.len(), 150, "no loss; log:\n{}", relay.log());
    eprintln!("3 cuts: {} duplicates", keys.len() - unique.len());
    assert_per_key_order(&records);
    assert!(relay.is_running(), "{}", relay.log());
    assert!(relay.log().contains("reconnecting"), "{}", relay.log());
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// PostgreSQL unreachable at start-up is transient: the relay waits with backoff
/// (logging once) instead of exiting, and still stops cleanly on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_postgres_at_start_is_retried() {
    let db = TestDb::create("relay_unreachable").await;
    let mut relay = RelayProcess::start(
        &db.config_path,
        &[(
            "OUTBOX_RELAY__POSTGRES__URL",
            "postgresql://postgres@127.0.0.1:1/postgres",
        )],
    );
    harness::wait_until(
        Duration::from_secs(30),
        "the relay to report PostgreSQL unreachable",
        || {
            let log = relay.log();
            async move { log.contains("PostgreSQL unreachable; retrying") }
        },
    )
    .await;
    // Several backoff rounds later it still waits, and has logged once.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(relay.is_running(), "{}", relay.log());
    assert_eq!(
        relay.log().matches("PostgreSQL unreachable").count(),
        1,
        "{}",
        relay.log()
    );
    let status = relay.terminate(Duration::from_secs(30)).await;
    assert!(status.success(), "{status:?}");
}
