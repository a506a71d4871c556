//! `republish` against the real PostgreSQL and broker: each selector sends exactly
//! its rows again, as records equal to the stream's (byte for byte, but for
//! `source_lsn` and the run's `outbox_relay_republish` header), in per-key order;
//! rows the relay has not delivered are refused; a range crossing a kill -9 of the
//! relay beside it republishes only delivered rows and the relay still loses
//! nothing; exactly-once runs are read once per run by `read_committed` readers.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use outbox_relay::Error;
use outbox_relay::ops::republish::{self, REPUBLISH_HEADER, RepublishArgs, RepublishReport};

use crate::harness::{
    self, DevBroker, Record, RelayProcess, TestDb, assert_per_key_order, consume, consume_with,
};

/// One outbox row as written: `(id, idempotency key)`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Row {
    id: String,
    key: String,
}

/// Inserts one row; `created_at` given (RFC 3339) or the default clock.
async fn insert(
    db: &TestDb,
    aggregate_type: &str,
    entity: &str,
    event_type: &str,
    seq: i64,
    created_at: Option<&str>,
) -> Row {
    let row = db
        .client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, created_at)
             VALUES ($1, $2, $3, jsonb_build_object('seq', $4::int8),
                     '{\"tenant\": \"t1\", \"traceparent\": \"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\"}',
                     COALESCE($5::text::timestamptz, clock_timestamp()))
             RETURNING id::text, idempotency_key",
            &[&aggregate_type, &entity, &event_type, &seq, &created_at],
        )
        .await
        .unwrap();
    Row {
        id: row.get(0),
        key: row.get(1),
    }
}

/// The relay records what it delivered at each position save, and an idle one
/// saves at its heartbeats: a short interval keeps the tests' waits short.
const FAST_HEARTBEAT: [(&str, &str); 1] = [("OUTBOX_RELAY__RELAY__HEARTBEAT_INTERVAL_SECS", "1")];

fn args() -> RepublishArgs {
    RepublishArgs {
        no_progress: true,
        ..RepublishArgs::default()
    }
}

fn all() -> RepublishArgs {
    RepublishArgs {
        all: true,
        ..args()
    }
}

/// Waits until the relay's delivered checkpoint covers every row (a dry run
/// refuses none): it trails the stream by about two position saves.
async fn wait_reached(db: &TestDb) {
    harness::wait_until(
        Duration::from_secs(60),
        "the relay's delivered checkpoint to cover every row",
        || async {
            let report = republish::run(
                &db.config(),
                &RepublishArgs {
                    dry_run: true,
                    ..all()
                },
            )
            .await
            .unwrap();
            report.refused == 0
        },
    )
    .await;
}

/// The records of one run (by its header), in topic order per partition.
fn of_run<'a>(records: &'a [Record], report: &RepublishReport) -> Vec<&'a Record> {
    records
        .iter()
        .filter(|r| r.header(REPUBLISH_HEADER) == Some(report.run_id.as_str()))
        .collect()
}

/// First deliveries (no republish header), by idempotency key.
fn streamed(records: &[Record]) -> HashMap<String, &Record> {
    records
        .iter()
        .filter(|r| r.header(REPUBLISH_HEADER).is_none())
        .map(|r| (r.header("idempotency_key").unwrap().to_owned(), r))
        .collect()
}

/// A republished record equals the stream's, but for `source_lsn` (which a table
/// row cannot know) and the run's header.
fn assert_same_record(stream: &Record, again: &Record) {
    assert_eq!(stream.partition, again.partition);
    assert_eq!(stream.key, again.key);
    assert_eq!(stream.payload, again.payload);
    assert_eq!(stream.timestamp_ms, again.timestamp_ms);
    let without = |r: &Record, name: &str| -> BTreeMap<String, Vec<u8>> {
        let mut h = r.headers.clone();
        h.remove(name);
        h
    };
    assert!(stream.header("source_lsn").is_some());
    assert_eq!(
        without(stream, "source_lsn"),
        without(again, REPUBLISH_HEADER)
    );
}

/// Runs `args`, then checks that the run published exactly `expected` (by
/// idempotency key, in the order given per key), each once and equal to the
/// stream's record; `on_topic` counts the records of each topic so far.
async fn republish_expecting(
    db: &TestDb,
    args: &RepublishArgs,
    expected: &[&Row],
    topic: &str,
    on_topic: &mut HashMap<String, usize>,
) {
    let report = republish::run(&db.config(), args).await.unwrap();
    assert_eq!(
        (report.published, report.failed, report.refused, report.held),
        (expected.len() as u64, 0, 0, 0),
        "{args:?}: {report}"
    );
    let total = on_topic.entry(topic.to_owned()).or_default();
    *total += expected.len();
    // One more than expected: waits a little for a record that must not be there.
    let records = consume(topic, *total + 1, Duration::from_secs(2)).await;
    assert_eq!(records.len(), *total, "records on {topic}");
    let again = of_run(&records, &report);
    let keys: Vec<&str> = again
        .iter()
        .map(|r| r.header("idempotency_key").unwrap())
        .collect();
    let wanted: HashSet<&str> = expected.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(keys.len(), expected.len(), "{args:?}: one record per row");
    assert_eq!(keys.iter().copied().collect::<HashSet<_>>(), wanted);
    let first = streamed(&records);
    for r in &again {
        assert_same_record(first[r.header("idempotency_key").unwrap()], r);
    }
    let owned: Vec<Record> = again.into_iter().cloned().collect();
    assert_per_key_order(&owned);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_selector_republishes_its_rows_as_the_stream_sent_them() {
    let db = TestDb::create("republish_sel").await;
    let relay = RelayProcess::start(&db.config_path, &FAST_HEARTBEAT);
    db.wait_streaming(&relay).await;
    let mut rows = Vec::new();
    // Two aggregate types, two event types, three entities, and fixed times.
    for seq in 0..12i64 {
        let (aggregate, entity) = match seq % 3 {
            0 => ("order", "o-1"),
            1 => ("order", "o-2"),
            _ => ("invoice", "i-1"),
        };
        let event = if seq % 2 == 0 { "Created" } else { "Paid" };
        let at = format!("2026-12-0{}T10:00:00Z", 1 + seq / 4);
        rows.push(insert(&db, aggregate, entity, event, seq, Some(&at)).await);
    }
    let invoices = format!("{}.invoices", db.name);
    harness::create_topic(&invoices, 3).await;
    let own_topic = db
        .client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, topic, payload)
             VALUES ('order', 'o-9', 'Created', $1, '{\"seq\": 0}') RETURNING id::text, idempotency_key",
            &[&invoices],
        )
        .await
        .unwrap();
    let routed = Row {
        id: own_topic.get(0),
        key: own_topic.get(1),
    };
    let mut records = consume(&db.topic, 12, Duration::from_secs(60)).await;
    records.extend(consume(&invoices, 1, Duration::from_secs(60)).await);
    assert_eq!(records.len(), 13, "the stream delivered every row");
    wait_reached(&db).await;
    let mut on_topic = HashMap::from([(db.topic.clone(), 12), (invoices.clone(), 1)]);
    let topic = db.topic.as_str();
    let pick = |f: &dyn Fn(usize) -> bool| -> Vec<&Row> {
        rows.iter()
            .enumerate()
            .filter(|(i, _)| f(*i))
            .map(|(_, r)| r)
            .collect()
    };

    // Ids are UUIDs, compared as PostgreSQL does (bytes: their lowercase text).
    let mut sorted: Vec<&str> = rows.iter().map(|r| r.id.as_str()).collect();
    sorted.sort_unstable();
    let (low, high) = (sorted[3], sorted[7]);
    let by_id = RepublishArgs {
        from_id: Some(low.to_owned()),
        to_id: Some(high.to_owned()),
        ..args()
    };
    let in_range = pick(&|i| (low..=high).contains(&rows[i].id.as_str()));
    assert_eq!(in_range.len(), 5);
    republish_expecting(&db, &by_id, &in_range, topic, &mut on_topic).await;
    let by_time = RepublishArgs {
        since: Some("2026-12-02T00:00:00Z".parse().unwrap()),
        until: Some("2026-12-03T00:00:00Z".parse().unwrap()),
        ..args()
    };
    republish_expecting(&db, &by_time, &pick(&|i| i / 4 == 1), topic, &mut on_topic).await;
    let by_type = RepublishArgs {
        aggregate_type: Some("invoice".into()),
        ..args()
    };
    republish_expecting(&db, &by_type, &pick(&|i| i % 3 == 2), topic, &mut on_topic).await;
    let by_entity = RepublishArgs {
        aggregate_id: Some("o-2".into()),
        ..args()
    };
    republish_expecting(
        &db,
        &by_entity,
        &pick(&|i| i % 3 == 1),
        topic,
        &mut on_topic,
    )
    .await;
    let by_event = RepublishArgs {
        event_type: Some("Paid".into()),
        aggregate_type: Some("order".into()),
        ..args()
    };
    let paid_orders = pick(&|i| i % 2 == 1 && i % 3 != 2);
    republish_expecting(&db, &by_event, &paid_orders, topic, &mut on_topic).await;
    let by_topic = RepublishArgs {
        topic: Some(invoices.clone()),
        ..args()
    };
    republish_expecting(&db, &by_topic, &[&routed], &invoices, &mut on_topic).await;

    // A dry run counts and lists, and sends nothing.
    let dry = RepublishArgs {
        dry_run: true,
        sample: 2,
        ..all()
    };
    let report = republish::run(&db.config(), &dry).await.unwrap();
    assert_eq!((report.selected, report.published), (13, 13));
    assert_eq!(report.rows.len(), 2);
    assert!(report.message_outbox, "migrate installs outbox_emit");
    for (topic, total) in &on_topic {
        let after = consume(topic, total + 1, Duration::from_secs(2)).await;
        assert_eq!(after.len(), *total, "a dry run publishes nothing");
    }
    // `audit` leaves republished records out: no duplicates, every row delivered.
    let audit = outbox_relay::ops::audit::run(
        &db.config(),
        &outbox_relay::ops::audit::AuditArgs {
            no_progress: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        (
            audit.expected,
            audit.delivered,
            audit.duplicates,
            audit.lost
        ),
        (13, 13, 0, 0)
    );
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_the_relay_has_not_delivered_are_refused_and_a_second_run_waits_its_turn() {
    let db = TestDb::create("republish_refuse").await;
    db.create_slot().await;
    let mut rows = Vec::new();
    for seq in 0..6 {
        rows.push(
            insert(
                &db,
                "order",
                &format!("o-{}", seq % 2),
                "Created",
                seq,
                None,
            )
            .await,
        );
    }
    // No relay yet: nothing is delivered, so everything is refused and nothing sent.
    let report = republish::run(&db.config(), &all()).await.unwrap();
    assert_eq!(
        (report.selected, report.published, report.refused),
        (6, 0, 6),
        "{report}"
    );
    assert_eq!(report.refused_ids[0], rows[0].id);
    assert!(report.to_string().contains("6 refused"));
    assert!(
        consume(&db.topic, 1, Duration::from_secs(3))
            .await
            .is_empty()
    );

    // One run per outbox: a held lock refuses a second one.
    let lock = "outbox-relay republish \"public\".\"outbox\"";
    db.client
        .execute("SELECT pg_advisory_lock(hashtext($1))", &[&lock])
        .await
        .unwrap();
    let err = republish::run(&db.config(), &all()).await.unwrap_err();
    assert!(matches!(err, Error::RepublishLocked { .. }), "{err}");
    db.client
        .execute("SELECT pg_advisory_unlock(hashtext($1))", &[&lock])
        .await
        .unwrap();

    // Once the relay delivered them, they are published again.
    let relay = RelayProcess::start(&db.config_path, &FAST_HEARTBEAT);
    let records = consume(&db.topic, 6, Duration::from_secs(60)).await;
    assert_eq!(records.len(), 6);
    wait_reached(&db).await;
    let report = republish::run(&db.config(), &all()).await.unwrap();
    assert_eq!((report.published, report.refused), (6, 0), "{report}");
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;

    // A row with a poison row is `replay`'s: counted, not published.
    db.client
        .execute(
            "INSERT INTO poison_outbox (outbox_id, idempotency_key, aggregate_type, aggregate_id,
                 event_type, payload, created_at, error, error_kind, attempts)
             VALUES ($1, $2, 'order', 'o-0', 'Created', '{}', now(), 'test', 'test', 1)",
            &[&rows[2].id, &rows[2].key],
        )
        .await
        .unwrap();
    let report = republish::run(&db.config(), &all()).await.unwrap();
    assert_eq!(
        (report.selected, report.published, report.poisoned),
        (5, 5, 1),
        "{report}"
    );

    // The command line: a selection is required (exit 2); --json is one object.
    let config = db.config_path.to_str().unwrap();
    let out = harness::run_cli(&["republish", "--config", config]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--all"));
    let out = harness::run_cli(&[
        "republish",
        "--config",
        config,
        "--aggregate-id",
        "o-1",
        "--dry-run",
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(0));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["published"], 3);
    assert_eq!(json["dry_run"], true);
    assert_eq!(json["rows"][0]["outcome"], "would_publish");
    // An id that is not of the column's type is a usage error, said before reading.
    let out = harness::run_cli(&["republish", "--config", config, "--from-id", "12"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--from-id"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_across_a_kill_9_of_the_relay_republishes_only_delivered_rows() {
    let _heavy = harness::heavy().await;
    let db = TestDb::create("republish_kill").await;
    let relay = RelayProcess::start(&db.config_path, &FAST_HEARTBEAT);
    db.wait_streaming(&relay).await;
    // Writers keep going while the relay is killed, restarted and republished beside.
    let writer = {
        let url = db.url.clone();
        tokio::spawn(async move {
            let client = harness::connect(&url).await;
            for seq in 0..1500i64 {
                client
                    .execute(
                        "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                         VALUES ('order', 'e-' || ($1::int8 % 7), 'Created', jsonb_build_object('seq', $1::int8))",
                        &[&seq],
                    )
                    .await
                    .unwrap();
                if seq % 25 == 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
        })
    };
    harness::wait_until(Duration::from_secs(60), "some delivered rows", || async {
        consume(&db.topic, 300, Duration::from_secs(2)).await.len() >= 300
    })
    .await;
    relay.kill9().await;

    // While the relay is down: only what it delivered goes out again.
    let report = republish::run(&db.config(), &all()).await.unwrap();
    assert_eq!(report.failed + report.held, 0, "{report}");
    assert!(report.published > 0, "{report}");
    let records = consume(&db.topic, usize::MAX, Duration::from_secs(5)).await;
    let first = streamed(&records);
    let again = of_run(&records, &report);
    assert_eq!(again.len() as u64, report.published);
    for r in &again {
        let key = r.header("idempotency_key").unwrap();
        let stream = first
            .get(key)
            .unwrap_or_else(|| panic!("{key} republished before the relay delivered it"));
        assert_same_record(stream, r);
    }
    assert_per_key_order(&again.into_iter().cloned().collect::<Vec<_>>());

    // The relay comes back and a run beside it, while rows are still written.
    let relay = RelayProcess::start(&db.config_path, &FAST_HEARTBEAT);
    let beside = republish::run(&db.config(), &all()).await.unwrap();
    assert_eq!(beside.failed + beside.held, 0, "{beside}");
    writer.await.unwrap();
    let expected: HashSet<String> = db
        .client
        .query("SELECT idempotency_key FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(expected.len(), 1500);
    harness::wait_until(Duration::from_secs(120), "every row delivered", || async {
        let records = consume(&db.topic, usize::MAX, Duration::from_secs(3)).await;
        streamed(&records).len() == expected.len()
    })
    .await;
    let records = consume(&db.topic, usize::MAX, Duration::from_secs(3)).await;
    let first = streamed(&records);
    assert!(
        expected.iter().all(|k| first.contains_key(k)),
        "lost events"
    );
    for run in [&report, &beside] {
        let again = of_run(&records, run);
        let keys: HashSet<&str> = again
            .iter()
            .map(|r| r.header("idempotency_key").unwrap())
            .collect();
        assert_eq!(keys.len(), again.len(), "a run sends each row once");
    }
    wait_reached(&db).await;
    let last = republish::run(&db.config(), &all()).await.unwrap();
    assert_eq!((last.published, last.refused), (1500, 0), "{last}");
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_runs_are_read_once_per_run_by_read_committed_readers() {
    let broker = DevBroker::start();
    let brokers = broker.address.clone();
    let mut db = TestDb::create("republish_eos").await;
    harness::create_topic_on(&brokers, &db.topic, 3).await;
    db.append_config("\n[relay]\nmax_in_flight_events = 64\n");
    let env = [
        ("OUTBOX_RELAY__KAFKA__BROKERS", brokers.as_str()),
        ("OUTBOX_RELAY__KAFKA__DELIVERY", "exactly-once"),
        FAST_HEARTBEAT[0],
    ];
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["migrate", "--config", db.config_path.to_str().unwrap()])
        .envs(env)
        .output()
        .unwrap();
    assert!(out.status.success());
    let relay = RelayProcess::start(&db.config_path, &env);
    db.wait_streaming(&relay).await;
    for seq in 0..200 {
        insert(
            &db,
            "order",
            &format!("o-{}", seq % 9),
            "Created",
            seq,
            None,
        )
        .await;
    }
    let read_committed = [
        ("isolation.level", "read_committed"),
        ("broker.address.family", "v4"),
    ];
    let records = consume_with(
        &brokers,
        &read_committed,
        &db.topic,
        200,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(records.len(), 200);
    let mut config = db.config();
    config.kafka.brokers = brokers.clone();
    config.kafka.delivery = outbox_relay::config::DeliveryMode::ExactlyOnce;
    harness::wait_until(Duration::from_secs(60), "every row delivered", || async {
        let dry = RepublishArgs {
            dry_run: true,
            ..all()
        };
        republish::run(&config, &dry).await.unwrap().refused == 0
    })
    .await;
    let runs = [
        republish::run(&config, &all()).await.unwrap(),
        republish::run(&config, &all()).await.unwrap(),
    ];
    for run in &runs {
        assert!(run.exactly_once);
        assert_eq!((run.published, run.failed), (200, 0), "{run}");
        assert!(run.transactions >= 200 / 64, "{run}");
    }
    let records = consume_with(
        &brokers,
        &read_committed,
        &db.topic,
        600,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(records.len(), 600, "the stream's 200 and two runs of 200");
    let first = streamed(&records);
    for run in &runs {
        let again = of_run(&records, run);
        let keys: HashSet<&str> = again
            .iter()
            .map(|r| r.header("idempotency_key").unwrap())
            .collect();
        assert_eq!((again.len(), keys.len()), (200, 200), "once per run");
        for r in &again {
            assert_same_record(first[r.header("idempotency_key").unwrap()], r);
        }
        assert_per_key_order(&again.into_iter().cloned().collect::<Vec<_>>());
    }
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
    drop(db);
}
