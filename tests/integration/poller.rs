//! The polling relay against the real PostgreSQL and broker, run in-process (the
//! library's `poller::run` with a oneshot as its shutdown signal) so faults can be
//! injected between its phases. Each test asserts loss, duplicates and per-key
//! order as the promises in `docs/architecture.md` require, and that the records are the CDC
//! relay's.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use outbox_relay::config::Config;
use outbox_relay::poller::{self, PollArgs, PollSummary, Poller};
use outbox_relay::postgres::prerequisite::Prerequisite;
use outbox_relay::{Error, Result};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::harness::{
    self, Record, RelayProcess, TestDb, assert_per_key_order, consume, consume_from,
};

fn args(batch_size: u32, workers: u32) -> PollArgs {
    PollArgs {
        batch_size,
        workers,
        poll_interval_ms: 50,
        ..PollArgs::default()
    }
}

/// `poller::run` on a task, stopped through its shutdown future.
struct RunningPoller {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<PollSummary>>,
}

impl RunningPoller {
    fn start(config: Config, args: PollArgs) -> RunningPoller {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let shutdown = Box::pin(async move {
                let _ = stopped.await;
            });
            poller::run(config, &args, shutdown).await
        });
        RunningPoller { stop, task }
    }

    /// Signals shutdown and waits (bounded) for the summary of a clean stop.
    async fn stop(self) -> PollSummary {
        let _ = self.stop.send(());
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the poller stops within 30 s of the signal")
            .expect("poller task")
            .expect("a clean stop")
    }
}

/// Rows not yet marked sent, poisoned rows included.
async fn unsent(db: &TestDb) -> i64 {
    db.client
        .query_one("SELECT count(*) FROM outbox WHERE sent_at IS NULL", &[])
        .await
        .unwrap()
        .get(0)
}

async fn wait_all_sent(db: &TestDb, poisoned: i64) {
    harness::wait_until(Duration::from_secs(60), "every row marked sent", || async {
        unsent(db).await == poisoned
    })
    .await;
}

async fn count(db: &TestDb, sql: &str) -> i64 {
    db.client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Inserts `n` events round-robin over `entities`, each payload carrying the
/// entity's sequence number; returns the idempotency keys in insert order.
async fn insert_sequenced(db: &mut TestDb, entities: usize, from: usize, n: usize) -> Vec<String> {
    let mut keys = Vec::with_capacity(n);
    for i in from..from + n {
        let entity = format!("e{}", i % entities);
        let seq = i / entities;
        let payload = format!(r#"{{"entity": "{entity}", "seq": {seq}}}"#);
        keys.push(db.insert_event(&entity, "Created", &payload).await);
    }
    keys
}

fn keys_of(records: &[Record]) -> Vec<String> {
    records
        .iter()
        .map(|r| r.header("idempotency_key").unwrap().to_owned())
        .collect()
}

/// Reads the topic until `n` records arrived, then a little longer to catch extras.
async fn consume_all(topic: &str, n: usize) -> Vec<Record> {
    let records = consume(topic, n, Duration::from_secs(60)).await;
    assert!(
        records.len() >= n,
        "expected {n} records, got {}",
        records.len()
    );
    harness::reread(topic, &records, Duration::from_secs(3)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delivers_every_row_once_with_the_cdc_relays_record() {
    let db = TestDb::create("poll_shape").await;
    // The slot first, so the CDC relay later streams the same rows.
    db.create_slot().await;
    let payloads = [
        r#"{"n": 1.10, "big": 123456789012345678901234567890}"#,
        r#"{"text": "é ✓ \"quoted\" \\ back", "nested": {"b": [1, 2], "a": null}}"#,
        r#"[1, "two", {"three": 3.0}]"#,
        r#""just a string""#,
    ];
    let mut expected = 0;
    for i in 0..40 {
        let headers =
            (i % 3 != 0).then(|| format!(r#"{{"tenant": "t{}", "trace": "x-{i}"}}"#, i % 2));
        db.client
            .execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
                 VALUES ($1, $2, $3, $4::text::jsonb, $5::text::jsonb)",
                &[
                    &["order", "customer"][i % 2],
                    &format!("entity-{}", i % 7),
                    &format!("Event{}", i % 4),
                    &payloads[i % payloads.len()],
                    &headers,
                ],
            )
            .await
            .unwrap();
        expected += 1;
    }

    let running = RunningPoller::start(db.config(), args(16, 1));
    wait_all_sent(&db, 0).await;
    let summary = running.stop().await;
    assert_eq!(summary.delivered, expected as u64);
    assert_eq!((summary.poisoned, summary.failed_attempts), (0, 0));

    let polled = consume_all(&db.topic, expected).await;
    let keys = keys_of(&polled);
    let unique: HashSet<&String> = keys.iter().collect();
    assert_eq!(keys.len(), expected, "each row exactly once");
    assert_eq!(unique.len(), expected);

    let rows = db
        .client
        .query(
            "SELECT idempotency_key, aggregate_id, payload::text, event_type, aggregate_type,
                    headers::text, (extract(epoch FROM created_at) * 1000)::bigint
             FROM outbox",
            &[],
        )
        .await
        .unwrap();
    for row in &rows {
        let key: String = row.get(0);
        let r = polled
            .iter()
            .find(|r| r.header("idempotency_key") == Some(key.as_str()))
            .unwrap_or_else(|| panic!("{key} not delivered"));
        assert_eq!(r.key.as_deref(), Some(row.get::<_, String>(1).as_bytes()));
        assert_eq!(
            r.payload.as_deref(),
            Some(row.get::<_, String>(2).as_bytes()),
            "payload bytes are payload::text"
        );
        assert_eq!(r.header("event_type"), Some(row.get::<_, &str>(3)));
        assert_eq!(r.header("aggregate_type"), Some(row.get::<_, &str>(4)));
        let occurred_at = r.header("occurred_at").unwrap();
        assert!(occurred_at.ends_with('Z'), "{occurred_at}");
        assert_eq!(r.header("source_lsn"), None, "source_lsn is CDC-only");
        match row.get::<_, Option<String>>(5) {
            Some(headers) => {
                let headers: serde_json::Value = serde_json::from_str(&headers).unwrap();
                assert_eq!(r.header("tenant"), headers["tenant"].as_str());
                assert_eq!(r.header("trace"), headers["trace"].as_str());
            }
            None => assert_eq!(r.headers.len(), 4, "{:?}", r.headers),
        }
        let created_ms: i64 = row.get(6);
        assert!((r.timestamp_ms.unwrap() - created_ms).abs() <= 1);
    }

    // The CDC relay streams the same rows: every record must be byte-identical but
    // for its source_lsn header, down to the partition the key hashes to.
    let relay = RelayProcess::start(&db.config_path, &[]);
    let all =
        harness::consume_exactly(&db.topic, 2 * expected, Duration::from_secs(90), &relay).await;
    relay.terminate(Duration::from_secs(30)).await;
    let mut by_key: BTreeMap<String, Vec<&Record>> = BTreeMap::new();
    for r in &all {
        by_key
            .entry(r.header("idempotency_key").unwrap().to_owned())
            .or_default()
            .push(r);
    }
    assert_eq!(by_key.len(), expected);
    for (key, pair) in by_key {
        let (cdc, poll): (Vec<&Record>, Vec<&Record>) = pair
            .iter()
            .partition(|r| r.headers.contains_key("source_lsn"));
        assert_eq!((cdc.len(), poll.len()), (1, 1), "{key}: {pair:?}");
        let (cdc, poll) = (cdc[0], poll[0]);
        let mut cdc_headers = cdc.headers.clone();
        cdc_headers.remove("source_lsn");
        assert_eq!(poll.headers, cdc_headers, "{key}");
        assert_eq!(poll.key, cdc.key, "{key}");
        assert_eq!(poll.payload, cdc.payload, "{key}");
        assert_eq!(poll.timestamp_ms, cdc.timestamp_ms, "{key}");
        assert_eq!(poll.partition, cdc.partition, "{key}");
    }
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_worker_keeps_per_key_order_across_batches() {
    let mut db = TestDb::create("poll_order").await;
    let mut keys = insert_sequenced(&mut db, 5, 0, 100).await;
    let running = RunningPoller::start(db.config(), args(10, 1));
    // The second half arrives while the poller is draining the first.
    keys.extend(insert_sequenced(&mut db, 5, 100, 100).await);
    wait_all_sent(&db, 0).await;
    let summary = running.stop().await;
    assert_eq!(summary.delivered, 200);
    assert!(summary.batches >= 20, "batches of 10: {summary:?}");

    let records = consume_all(&db.topic, 200).await;
    let delivered = keys_of(&records);
    assert_eq!(delivered.len(), 200, "no duplicates without a crash");
    assert_eq!(
        delivered.iter().collect::<HashSet<_>>(),
        keys.iter().collect::<HashSet<_>>()
    );
    assert_per_key_order(&records);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failures_count_attempts_then_poison() {
    let mut db = TestDb::create("poll_poison").await;
    db.append_config("\n[kafka.producer]\n\"message.max.bytes\" = \"100000\"\n");
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

    let running = RunningPoller::start(db.config(), args(100, 1));
    wait_all_sent(&db, 2).await;
    harness::wait_until(Duration::from_secs(30), "two poison rows", || async {
        count(&db, "SELECT count(*) FROM poison_outbox").await == 2
    })
    .await;
    let summary = running.stop().await;
    assert_eq!(summary.delivered, 6, "{summary:?}");
    assert_eq!(summary.poisoned, 2, "{summary:?}");
    assert_eq!(summary.failed_attempts, 5 + 1, "{summary:?}");

    let records = consume_all(&db.topic, 6).await;
    assert_eq!(records.len(), 6, "the good rows, once each");
    assert!(!keys_of(&records).contains(&big_key));

    // The outbox rows: never marked sent, attempts at max_attempts (which excludes
    // them from polling), the broker's error kept.
    let big_row = db
        .client
        .query_one(
            "SELECT attempts, last_error, sent_at IS NULL FROM outbox WHERE idempotency_key = $1",
            &[&big_key],
        )
        .await
        .unwrap();
    assert_eq!(big_row.get::<_, i32>(0), 5);
    let last_error: String = big_row.get(1);
    assert!(
        last_error.contains("message_size_too_large"),
        "{last_error}"
    );
    assert!(big_row.get::<_, bool>(2));
    let null_row = db
        .client
        .query_one(
            "SELECT attempts, last_error FROM outbox WHERE idempotency_key = $1",
            &[&null_key],
        )
        .await
        .unwrap();
    assert_eq!(null_row.get::<_, i32>(0), 5);
    assert!(null_row.get::<_, String>(1).starts_with("null_key"));

    // The poison rows, as the CDC relay writes them (no LSN: the poller has none).
    let rows = db
        .client
        .query(
            "SELECT idempotency_key, error_kind, error, attempts, lsn IS NULL, topic,
                    payload, aggregate_id, row_data ? 'payload'
             FROM poison_outbox",
            &[],
        )
        .await
        .unwrap();
    let by_key: BTreeMap<String, &tokio_postgres::Row> =
        rows.iter().map(|r| (r.get(0), r)).collect();
    let p = by_key[&big_key];
    let kind: String = p.get(1);
    assert_eq!(kind, "message_size_too_large", "{}", p.get::<_, String>(2));
    assert_eq!(p.get::<_, i32>(3), 5, "max_attempts attempts");
    assert!(p.get::<_, bool>(4), "lsn is NULL");
    assert_eq!(
        p.get::<_, String>(5),
        db.topic,
        "the topic it was produced to"
    );
    assert_eq!(p.get::<_, String>(6).len(), big.len());
    assert_eq!(p.get::<_, String>(7), "big");
    assert!(p.get::<_, bool>(8), "row_data holds the columns");
    let p = by_key[&null_key];
    assert_eq!(p.get::<_, String>(1), "null_key");
    assert_eq!(
        p.get::<_, i32>(3),
        1,
        "unmappable: poisoned on its first attempt"
    );

    // A restart neither re-sends nor re-poisons anything.
    let running = RunningPoller::start(db.config(), args(100, 1));
    tokio::time::sleep(Duration::from_millis(500)).await;
    let summary = running.stop().await;
    assert_eq!(summary, PollSummary::default(), "nothing left to do");

    // Lowering max_attempts must not strand rows between the two limits: the
    // start-up sweep poisons them (and only them).
    let stranded = db.insert_event("stranded", "Created", "{}").await;
    db.client
        .execute(
            "UPDATE outbox SET attempts = 3, last_error = 'invalid_record: refused'
             WHERE idempotency_key = $1",
            &[&stranded],
        )
        .await
        .unwrap();
    let lowered = PollArgs {
        max_attempts: Some(3),
        ..args(100, 1)
    };
    let running = RunningPoller::start(db.config(), lowered);
    harness::wait_until(
        Duration::from_secs(30),
        "the stranded row poisoned",
        || async { count(&db, "SELECT count(*) FROM poison_outbox").await == 3 },
    )
    .await;
    let summary = running.stop().await;
    assert_eq!((summary.poisoned, summary.delivered), (1, 0), "{summary:?}");
    let row = db
        .client
        .query_one(
            "SELECT error_kind, error, attempts FROM poison_outbox WHERE idempotency_key = $1",
            &[&stranded],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), poller::ATTEMPTS_EXHAUSTED);
    assert!(row.get::<_, String>(1).contains("invalid_record: refused"));
    assert_eq!(row.get::<_, i32>(2), 3);
    assert_eq!(consume(&db.topic, 7, Duration::from_secs(3)).await.len(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_between_publish_and_mark_resends_the_batch_and_loses_nothing() {
    let mut db = TestDb::create("poll_crash").await;
    let keys = insert_sequenced(&mut db, 3, 0, 30).await;
    let config = db.config();

    let mut poller = Poller::connect(&config, &args(10, 1)).await.unwrap();
    let batch = poller.publish_batch().await.unwrap();
    assert_eq!((batch.len(), batch.acked()), (10, 10), "{batch:?}");
    // Acked by the broker, not yet marked: the crash window.
    let acked = consume(&db.topic, 10, Duration::from_secs(30)).await;
    assert_eq!(
        keys_of(&acked).iter().collect::<HashSet<_>>(),
        keys[..10].iter().collect::<HashSet<_>>(),
        "the first batch in (created_at, id) order"
    );
    assert_eq!(unsent(&db).await, 30, "nothing marked before the commit");
    // The crash: the transaction and the connection go away without the UPDATE.
    drop(batch);
    drop(poller);

    let running = RunningPoller::start(config, args(10, 1));
    wait_all_sent(&db, 0).await;
    let summary = running.stop().await;
    assert_eq!(summary.delivered, 30, "{summary:?}");

    let records = consume_all(&db.topic, 40).await;
    let delivered = keys_of(&records);
    assert_eq!(delivered.len(), 40, "exactly the batch is duplicated");
    let mut copies: HashMap<&String, usize> = HashMap::new();
    for key in &delivered {
        *copies.entry(key).or_default() += 1;
    }
    assert_eq!(copies.len(), 30, "nothing lost");
    for (i, key) in keys.iter().enumerate() {
        let expected = if i < 10 { 2 } else { 1 };
        assert_eq!(copies[key], expected, "row {i} ({key})");
    }
    assert_per_key_order(&records);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn several_workers_share_the_outbox_and_stop_gracefully() {
    const ROWS: i64 = 1000;
    let db = TestDb::create("poll_workers").await;
    db.client
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'e' || (i % 10), 'Created',
                    jsonb_build_object('entity', 'e' || (i % 10), 'seq', i / 10)
             FROM generate_series(0, $1::int8 - 1) i",
            &[&ROWS],
        )
        .await
        .unwrap();
    let keys: HashSet<String> = db
        .client
        .query("SELECT idempotency_key FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let running = RunningPoller::start(db.config(), args(10, 3));
    // Stop as soon as something was sent: every worker finishes and commits the
    // batch it holds, and stops.
    harness::wait_until(Duration::from_secs(60), "some rows sent", || async {
        unsent(&db).await < ROWS
    })
    .await;
    let first = running.stop().await;
    let sent = count(&db, "SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL").await;
    assert_eq!(first.delivered, u64::try_from(sent).unwrap(), "{first:?}");
    assert!(
        sent < ROWS,
        "stopped before the end (else the test proves little): {first:?}"
    );
    let lockable = count(
        &db,
        "SELECT count(*) FROM (SELECT 1 FROM outbox FOR UPDATE SKIP LOCKED) s",
    )
    .await;
    assert_eq!(lockable, ROWS, "no lock outlives the stop");
    let total = usize::try_from(ROWS).unwrap();
    // Nothing beyond what was marked reached the topic: the stop lost no ack.
    let sent = usize::try_from(sent).unwrap();
    let so_far = consume(&db.topic, sent, Duration::from_secs(60)).await;
    let so_far = harness::reread(&db.topic, &so_far, Duration::from_secs(3)).await;
    assert_eq!(so_far.len(), sent);

    let running = RunningPoller::start(db.config(), args(10, 3));
    wait_all_sent(&db, 0).await;
    let second = running.stop().await;
    assert_eq!(first.delivered + second.delivered, 1000);

    let records = consume_all(&db.topic, total).await;
    let delivered = keys_of(&records);
    assert_eq!(delivered.len(), total, "SKIP LOCKED: no row sent twice");
    assert_eq!(delivered.into_iter().collect::<HashSet<_>>(), keys);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_outage_waits_without_counting_attempts() {
    let mut broker = harness::PrivateBroker::start().await;
    let mut db = TestDb::create("poll_outage").await;
    harness::create_topic_on(&broker.brokers(), &db.topic, 3).await;
    let brokers = broker.brokers();
    let mut config = db.config();
    config.kafka.brokers = brokers.clone();

    let mut keys = insert_sequenced(&mut db, 5, 0, 50).await;
    let running = RunningPoller::start(config, args(20, 1));
    wait_all_sent(&db, 0).await;

    broker.stop();
    keys.extend(insert_sequenced(&mut db, 5, 50, 50).await);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        unsent(&db).await,
        50,
        "nothing marked while the broker is down"
    );
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox WHERE attempts > 0").await,
        0,
        "an outage never counts attempts"
    );
    assert!(
        !running.task.is_finished(),
        "the poller waits, it does not exit"
    );

    broker.resume().await;
    wait_all_sent(&db, 0).await;
    let summary = running.stop().await;
    assert_eq!(summary.poisoned, 0);

    let records = consume_from(&brokers, &db.topic, 100, Duration::from_secs(60)).await;
    let delivered = keys_of(&records);
    assert_eq!(
        delivered.iter().collect::<HashSet<_>>(),
        keys.iter().collect::<HashSet<_>>(),
        "no loss across the outage"
    );
    assert_per_key_order(&records);
    assert_eq!(count(&db, "SELECT count(*) FROM poison_outbox").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_partial_index_serves_the_poll() {
    let db = TestDb::create("poll_index").await;
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'e' || (i % 10), 'Created', '{}' FROM generate_series(1, 2000) i;
             UPDATE outbox SET sent_at = now() WHERE aggregate_id <> 'e0';
             ANALYZE outbox;",
        )
        .await
        .unwrap();
    let poller = Poller::connect(&db.config(), &PollArgs::default())
        .await
        .unwrap();
    db.client
        .batch_execute(&format!(
            "SET enable_seqscan = off; SET enable_bitmapscan = off;
             PREPARE poll(int4, int8) AS {}",
            poller.poll_sql()
        ))
        .await
        .unwrap();
    let plan: Vec<String> = db
        .client
        .query("EXPLAIN EXECUTE poll(5, 1000)", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let plan = plan.join("\n");
    assert!(
        plan.contains("Index Scan using outbox_unsent_idx"),
        "{plan}"
    );
    assert!(!plan.contains("Sort"), "the index gives the order: {plan}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_table_is_a_prerequisite_error() {
    let db = TestDb::create("poll_prereq").await;
    let mut config = db.config();
    config.outbox.table = "public.no_such_outbox".into();
    let err = Poller::connect(&config, &PollArgs::default())
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            Error::Prerequisite(Prerequisite::OutboxTableMissing { table })
                if table == "public.no_such_outbox"
        ),
        "{err:?}"
    );

    db.client
        .batch_execute("ALTER TABLE outbox DROP COLUMN attempts")
        .await
        .unwrap();
    let err = Poller::connect(&db.config(), &PollArgs::default())
        .await
        .unwrap_err();
    assert!(
        matches!(
            &err,
            Error::Prerequisite(Prerequisite::PollerColumnsMissing { columns, .. })
                if columns == "\"attempts\""
        ),
        "{err:?}"
    );
    assert_eq!(
        format!("{:?}", err.exit_code()),
        format!("{:?}", std::process::ExitCode::from(3))
    );
}
