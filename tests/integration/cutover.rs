//! Cutover from a polling relay: the real `outbox-relay poll`, `cutover` and `run`
//! processes against the real PostgreSQL and broker. Asserts, from the topic and
//! the outbox, that no event is lost, none is sent by both relays, and per-key
//! order holds across the switch.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox_relay::tools::workload::{Pace, Workload};

use crate::harness::{
    self, RelayProcess, TestDb, assert_per_key_order, audit, consume, consume_unique, deliveries,
    run_cli,
};

async fn count(db: &TestDb, sql: &str) -> i64 {
    db.client.query_one(sql, &[]).await.unwrap().get(0)
}

/// The marker row: (consistent point, published, poisoned, completed).
async fn marker(db: &TestDb) -> Option<(Option<String>, i64, i64, bool)> {
    db.client
        .query_opt(
            "SELECT consistent_point::text, published, poisoned, completed_at IS NOT NULL
             FROM outbox_relay_cutover WHERE slot_name = $1",
            &[&db.slot],
        )
        .await
        .unwrap()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
}

/// A random-ish delay in `0..max_ms`, printed so that a failure can be replayed
/// with `CUTOVER_TEST_DELAY_MS`.
fn random_delay(max_ms: u64) -> Duration {
    let ms = std::env::var("CUTOVER_TEST_DELAY_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            // The low 64 bits of a v7 UUID are random.
            let random = uuid::Uuid::now_v7().as_u64_pair().1;
            random % max_ms
        });
    println!("switching {ms} ms after the poller's first marks (CUTOVER_TEST_DELAY_MS={ms})");
    Duration::from_millis(ms)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn switching_from_the_poller_loses_nothing_and_sends_nothing_twice() {
    let db = TestDb::create("cutover_main").await;
    // 4 writers until `stop`, 1-3 rows and a business row per transaction, every
    // 7th rolled back, paced to a few hundred transactions per second each.
    let stop = Arc::new(AtomicBool::new(false));
    let workload = Workload {
        events: u64::MAX,
        payload_bytes: 0,
        rows_per_tx: 3,
        writers: 4,
        entities: 4,
    };
    let writers = tokio::spawn(
        db.writers(workload)
            .varied()
            .rollback_every(7)
            .pace(Pace::Pause(Duration::from_millis(2)))
            .until(Arc::clone(&stop))
            .run(),
    );

    // The poller drains the outbox while the writers write.
    let poller = RelayProcess::start_command(
        &["poll", "--batch-size", "200", "--poll-interval-ms", "50"],
        &db.config_path,
        &[],
    );
    harness::wait_until(Duration::from_secs(60), "the poller marks rows", || async {
        count(&db, "SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL").await >= 100
    })
    .await;
    tokio::time::sleep(random_delay(1500)).await;

    // The switch: a graceful stop of the poller, then `run` (relay.cutover = auto).
    let status = poller.terminate(Duration::from_secs(30)).await;
    assert!(status.success(), "the poller stops cleanly: {status:?}");
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    // Keep writing while the relay streams.
    let streamed_from = count(&db, "SELECT count(*) FROM outbox").await;
    harness::wait_until(
        Duration::from_secs(60),
        "more rows after the switch",
        || async { count(&db, "SELECT count(*) FROM outbox").await >= streamed_from + 300 },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let written = writers.await.unwrap().expect("the writers");
    let (committed, rolled_back) = (written.committed, written.rolled_back);

    let records =
        consume_unique(&db.topic, committed.len(), Duration::from_secs(120), &relay).await;
    // A little longer, to see late duplicates.
    let records = harness::reread(&db.topic, &records, Duration::from_secs(3)).await;
    let counts = deliveries(&records);
    let lost: Vec<&String> = committed
        .iter()
        .filter(|k| !counts.contains_key(*k))
        .collect();
    assert!(lost.is_empty(), "lost {} events: {lost:?}", lost.len());
    let twice: Vec<(&String, &usize)> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "sent more than once: {twice:?}");
    assert!(
        rolled_back.iter().all(|k| !counts.contains_key(k)),
        "a rolled-back event was published"
    );
    assert_eq!(counts.len(), committed.len());
    assert_per_key_order(&records);

    // Who sent what: the poller (no source_lsn, marked sent), the cutover (the
    // consistent point, marked sent), the stream (commit LSNs at or after the
    // consistent point, never marked).
    let (cp, published, poisoned, completed) = marker(&db).await.expect("a marker row");
    assert!(completed, "the cutover completed");
    assert_eq!(poisoned, 0);
    let cp = harness::parse_lsn(&cp.expect("consistent point recorded"));
    let marked: HashSet<String> = db
        .client
        .query(
            "SELECT idempotency_key FROM outbox WHERE sent_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (mut by_poller, mut by_cutover, mut by_stream) = (0, 0i64, 0);
    for r in &records {
        let was_marked = marked.contains(r.header("idempotency_key").unwrap());
        match (r.header("source_lsn").map(harness::parse_lsn), was_marked) {
            (None, true) => by_poller += 1,
            (Some(lsn), true) => {
                assert_eq!(lsn, cp, "the cutover's source_lsn is the consistent point");
                by_cutover += 1;
            }
            (Some(lsn), false) => {
                assert!(
                    lsn >= cp,
                    "nothing streamed from before the consistent point"
                );
                by_stream += 1;
            }
            (None, false) => panic!("a record without source_lsn that nobody marked: {r:?}"),
        }
    }
    println!("poller {by_poller}, cutover {by_cutover} (marker {published}), stream {by_stream}");
    assert!(by_poller > 0 && by_stream > 0, "both relays took part");
    assert_eq!(by_cutover, published, "the cutover marked what it sent");
    assert_eq!(
        marked.len(),
        by_poller + usize::try_from(by_cutover).unwrap()
    );

    let report = audit(&db);
    assert_eq!(report["lost"], 0, "{report}");
    assert_eq!(report["duplicates"], 0, "{report}");
    assert_eq!(report["out_of_order_keys"], 0, "{report}");
    assert_eq!(
        report["expected"].as_u64(),
        Some(committed.len() as u64),
        "{report}"
    );

    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// Inserts one outbox row; returns its idempotency key.
async fn insert(db: &TestDb, entity: Option<&str>, seq: i64) -> String {
    db.client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', $1, 'OrderPlaced', $2::text::jsonb) RETURNING idempotency_key",
            &[&entity, &format!(r#"{{"seq": {seq}}}"#)],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cutover_publishes_only_unsent_unpoisoned_rows() {
    let db = TestDb::create("cutover_backlog").await;
    let mut keys = Vec::new();
    for i in 0..12 {
        keys.push(insert(&db, Some(&format!("e{}", i % 3)), i).await);
    }
    // What the poller left behind: 4 rows sent, 2 poisoned by it (attempts
    // exhausted, with their poison rows), 1 poisoned by a CDC relay (a poison row
    // only), and an unmappable row (no entity id) nobody tried yet.
    let (sent, rest) = keys.split_at(4);
    let (poisoned, unsent) = rest.split_at(3);
    db.client
        .execute(
            "UPDATE outbox SET sent_at = now() WHERE idempotency_key = ANY($1)",
            &[&sent],
        )
        .await
        .unwrap();
    db.client
        .execute(
            "UPDATE outbox SET attempts = 5, last_error = 'too large'
             WHERE idempotency_key = ANY($1)",
            &[&&poisoned[..2]],
        )
        .await
        .unwrap();
    db.client
        .execute(
            "INSERT INTO poison_outbox (outbox_id, idempotency_key, aggregate_id, error, error_kind, attempts)
             SELECT id::text, idempotency_key, aggregate_id, 'too large', 'message_size_too_large', 5
             FROM outbox WHERE idempotency_key = ANY($1)",
            &[&poisoned],
        )
        .await
        .unwrap();
    let unmappable = insert(&db, None, 99).await;

    let config = db.config_path.to_str().unwrap();
    let out = run_cli(&["cutover", "--config", config]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "cutover failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("backlog 6 rows: 5 published, 1 poisoned"),
        "{stdout}"
    );

    let records = consume(&db.topic, unsent.len() + 1, Duration::from_secs(20)).await;
    let mut got: Vec<String> = records
        .iter()
        .map(|r| r.header("idempotency_key").unwrap().to_owned())
        .collect();
    got.sort();
    let mut want = unsent.to_vec();
    want.sort();
    assert_eq!(got, want, "exactly the unsent, unpoisoned, mappable rows");
    let (cp, published, poisoned_count, completed) = marker(&db).await.unwrap();
    assert_eq!((published, poisoned_count, completed), (5, 1, true));
    let cp = cp.unwrap();
    assert!(
        records
            .iter()
            .all(|r| r.header("source_lsn") == Some(cp.as_str()))
    );
    assert_per_key_order(&records);
    // Marked like the poller marks: published rows sent, the unmappable one poisoned.
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox WHERE sent_at IS NOT NULL").await,
        9
    );
    let kind: String = db
        .client
        .query_one(
            "SELECT error_kind FROM poison_outbox WHERE idempotency_key = $1",
            &[&unmappable],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(kind, "null_key");

    // Running it again does nothing; `run` streams from the consistent point.
    let again = run_cli(&["cutover", "--config", config]);
    assert!(again.status.success());
    assert!(String::from_utf8_lossy(&again.stdout).contains("already completed"));
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let later = insert(&db, Some("e0"), 100).await;
    let records =
        harness::consume_exactly(&db.topic, unsent.len() + 1, Duration::from_secs(30), &relay)
            .await;
    let records = harness::reread(&db.topic, &records, Duration::from_secs(3)).await;
    assert_eq!(records.len(), unsent.len() + 1, "nothing re-sent by run");
    let streamed = records
        .iter()
        .find(|r| r.header("idempotency_key") == Some(later.as_str()))
        .expect("the new row is streamed");
    assert!(harness::parse_lsn(streamed.header("source_lsn").unwrap()) > harness::parse_lsn(&cp));
    relay.terminate(Duration::from_secs(30)).await;

    // A slot that was not made by a cutover is refused by the command.
    db.drop_slot().await;
    db.client
        .execute("DELETE FROM outbox_relay_cutover", &[])
        .await
        .unwrap();
    db.create_slot().await;
    let refused = run_cli(&["cutover", "--config", config]);
    assert_eq!(refused.status.code(), Some(3));
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_mid_cutover_is_resumed_without_loss() {
    let db = TestDb::create("cutover_crash").await;
    // A backlog big enough for many windows of 50 rows.
    db.client
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'e' || (g % 10), 'OrderPlaced', jsonb_build_object('seq', g)
             FROM generate_series(1, 20000) g",
            &[],
        )
        .await
        .unwrap();
    let window = [("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", "50")];
    let relay = RelayProcess::start(&db.config_path, &window);
    harness::wait_until(Duration::from_secs(60), "the cutover publishes", || async {
        marker(&db)
            .await
            .is_some_and(|(_, published, _, _)| published >= 100)
    })
    .await;
    relay.kill9().await;
    let (_, published_before, _, completed) = marker(&db).await.unwrap();
    assert!(
        !completed,
        "killed mid-cutover (raise the backlog if this fails)"
    );
    assert!(
        count(&db, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = current_database() || '_slot'").await == 1,
        "the slot exists although the cutover did not finish"
    );

    // Rows committed after the crash belong to the resumed cutover or the stream.
    for i in 0..20 {
        insert(&db, Some("late"), i).await;
    }
    let relay = RelayProcess::start(&db.config_path, &window);
    db.wait_streaming(&relay).await;
    for i in 20..40 {
        insert(&db, Some("late"), i).await;
    }
    let expected = 20_040;
    let records = consume_unique(&db.topic, expected, Duration::from_secs(180), &relay).await;
    let records = harness::reread(&db.topic, &records, Duration::from_secs(3)).await;
    let counts = deliveries(&records);
    assert_eq!(counts.len(), expected, "every event delivered");
    let duplicates: usize = counts.values().map(|n| n - 1).sum();
    println!("published before the crash {published_before}, duplicates {duplicates}");
    // Only the window in flight at the crash (published, not yet marked).
    assert!(duplicates <= 50, "{duplicates} duplicates");
    assert!(
        relay.log().contains("cutover was interrupted"),
        "{}",
        relay.log()
    );
    assert!(
        marker(&db).await.unwrap().3,
        "the resumed cutover completed"
    );
    let report = audit(&db);
    assert_eq!(report["lost"], 0, "{report}");
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_without_poller_columns_is_not_cut_over() {
    let db = TestDb::create("cutover_nopoll").await;
    db.client
        .batch_execute("ALTER TABLE outbox DROP COLUMN sent_at, DROP COLUMN attempts")
        .await
        .unwrap();
    let before = insert(&db, Some("e"), 0).await;
    // The explicit command refuses, and leaves neither slot nor marker behind.
    let out = run_cli(&["cutover", "--config", db.config_path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("sent_at"),
        "{out:?}"
    );
    assert!(marker(&db).await.is_none());
    assert_eq!(
        count(&db, "SELECT count(*) FROM pg_replication_slots WHERE slot_name = current_database() || '_slot'").await,
        0
    );
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let after = insert(&db, Some("e"), 1).await;
    let records = harness::consume_exactly(&db.topic, 1, Duration::from_secs(30), &relay).await;
    let records = harness::reread(&db.topic, &records, Duration::from_secs(3)).await;
    let keys: Vec<&str> = records
        .iter()
        .filter_map(|r| r.header("idempotency_key"))
        .collect();
    assert_eq!(
        keys,
        vec![after.as_str()],
        "only what commits after the slot"
    );
    assert_ne!(before, after);
    assert!(marker(&db).await.is_none(), "no cutover recorded");
    assert!(relay.log().contains("no polling relay to cut over from"));
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_relays_starting_together_cut_over_once() {
    let db = TestDb::create("cutover_twice").await;
    db.client
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'e' || (g % 10), 'OrderPlaced', jsonb_build_object('seq', g)
             FROM generate_series(1, 3000) g",
            &[],
        )
        .await
        .unwrap();
    // Small windows make the cutover last; the second relay is a standby.
    let env = [
        ("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", "100"),
        ("OUTBOX_RELAY__RELAY__SLOT_BUSY_TIMEOUT_SECS", "3600"),
    ];
    let first = RelayProcess::start(&db.config_path, &env);
    let second = RelayProcess::start(&db.config_path, &env);
    // Either may win the lock and the slot; the other must wait as a standby.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let first_won = loop {
        if first.log().contains("streaming slot=") {
            break true;
        }
        if second.log().contains("streaming slot=") {
            break false;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "neither relay started streaming; logs:\n{}\n---\n{}",
            first.log(),
            second.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (active, mut standby) = if first_won {
        (first, second)
    } else {
        (second, first)
    };
    db.wait_streaming(&active).await;
    insert(&db, Some("late"), 0).await;
    let records = consume_unique(&db.topic, 3001, Duration::from_secs(120), &active).await;
    let records = harness::reread(&db.topic, &records, Duration::from_secs(3)).await;
    let counts = deliveries(&records);
    assert_eq!(counts.len(), 3001);
    assert!(
        counts.values().all(|n| *n == 1),
        "the backlog was published once"
    );
    let (_, published, _, completed) = marker(&db).await.unwrap();
    assert_eq!((published, completed), (3000, true));
    assert!(standby.is_running(), "the other relay waits as a standby");
    let cutovers = [active.log(), standby.log()]
        .iter()
        .filter(|log| log.contains("cutover complete"))
        .count();
    assert_eq!(cutovers, 1, "one relay cut over");
    active.terminate(Duration::from_secs(30)).await;
    standby.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// A row a poller gave up on (attempts past `relay.max_attempts`, e.g. a poller run
/// with `--max-attempts 10`, and no poison row) is published by the cutover, not
/// left behind, neither sent nor poisoned, for retention to delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_past_max_attempts_is_published_by_the_cutover() {
    let db = TestDb::create("cutover_attempts").await;
    let key = insert(&db, Some("e1"), 1).await;
    db.client
        .execute(
            "UPDATE outbox SET attempts = 10, last_error = 'the poller gave up' WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap();
    let out = run_cli(&["cutover", "--config", db.config_path.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let records = consume(&db.topic, 1, Duration::from_secs(30)).await;
    assert_eq!(
        records
            .iter()
            .filter_map(|r| r.header("idempotency_key"))
            .collect::<Vec<_>>(),
        [key.as_str()],
        "published: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let sent: bool = db
        .client
        .query_one(
            "SELECT sent_at IS NOT NULL FROM outbox WHERE idempotency_key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get(0);
    assert!(sent, "marked sent");
    db.drop_slot().await;
}
