//! The poison table under load and with hostile content: mass poisoning drains in
//! time proportional to delivery (no cost that grows with the table), content that
//! jsonb or a size limit refuses is still recorded (and the stream goes on), each
//! occurrence is recorded exactly once, and the migration that introduced
//! de-duplication by occurrence keeps every old row.

use std::time::{Duration, Instant};

use tokio_postgres::SimpleQueryMessage;

use crate::harness::{self, RelayProcess, TestDb, confirmed_flush, parse_lsn};

/// Events per measured batch.
const EVENTS: u32 = 10_000;
/// Each batch is written as this many transactions of `EVENTS / TXS` rows.
const TXS: u32 = 100;
/// Measured rounds of each kind.
const ROUNDS: u32 = 3;

/// Writes one batch of `EVENTS` outbox rows (`aggregate_id` NULL makes every row
/// unmappable, so poisoned at once) while the relay streams, and returns how long
/// the relay took from the first write to confirming the last transaction.
///
/// The target is the WAL insert position inside the last transaction, after its
/// rows and before its commit: the slot's confirmed LSN passes it only once that
/// transaction is resolved, and so every one before it. (A position taken after the
/// commit would also need the relay's idle advance, which waits for the server's
/// next keepalive: seconds that have nothing to do with the work.)
async fn drain(db: &TestDb, relay: &RelayProcess, round: u32, poisoned: bool) -> Duration {
    let per_tx = EVENTS / TXS;
    let aggregate = if poisoned {
        "NULL".to_owned()
    } else {
        "'e' || (g % 100)".to_owned()
    };
    let mut sql = String::new();
    for tx in 0..TXS {
        sql.push_str(&format!(
            "BEGIN;
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', {aggregate}, 'Created',
                    jsonb_build_object('round', {round}, 'tx', {tx}, 'seq', g, 'pad', repeat('x', 200))
             FROM generate_series(1, {per_tx}) AS g;"
        ));
        if tx + 1 == TXS {
            sql.push_str("SELECT pg_current_wal_insert_lsn()::text;");
        }
        sql.push_str("COMMIT;");
    }
    let started = Instant::now();
    let messages = db.client.simple_query(&sql).await.unwrap();
    let end = messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => row.get(0).map(parse_lsn),
            _ => None,
        })
        .expect("the last transaction's WAL position");
    let deadline = started + Duration::from_secs(300);
    while confirmed_flush(&db.client, &db.slot).await < end {
        assert!(
            Instant::now() < deadline,
            "round {round} (poisoned: {poisoned}) not drained within 300 s; log tail:\n{}",
            tail(&relay.log())
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    started.elapsed()
}

fn tail(log: &str) -> &str {
    let start = log.len().saturating_sub(4000);
    let start = (start..log.len())
        .find(|&i| log.is_char_boundary(i))
        .unwrap_or(log.len());
    &log[start..]
}

/// 10,000 events that all poison drain within three times the time 10,000
/// deliverable events take, measured in one run of the real binary. Three rounds of
/// each, interleaved (normal, poison, normal, …), and the fastest round of each kind
/// compared: the machine is shared, and a stall of a few hundred milliseconds in
/// either single measurement would otherwise decide the test. Later poison rounds
/// write into a table that already holds 10,000 or 20,000 poison rows, which is
/// where an insert whose cost grows with the table shows (before the unique index:
/// 62 s and 162 s for the first two rounds, against 0.8 s for normal events).
///
/// Why three and not two: on the 2-core test machine the fastest poison round takes
/// 2.2–2.9 times the fastest normal one (debug and release binaries alike, e.g.
/// 0.97 s against 0.44 s), because a poisoned event costs PostgreSQL a row, its index
/// entries and their WAL, and each guarded cast in the insert (`outbox_relay_try_jsonb`
/// and `outbox_relay_try_timestamptz`, plpgsql with an exception block) about 2.8 µs
/// against 0.2 µs for a plain cast. At a bound of 2× the test failed at random; at
/// 3× it still fails by far for the quadratic insert it was written against.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mass_poisoning_drains_within_three_times_the_normal_time() {
    let _heavy = harness::heavy().await;
    let mut db = TestDb::create("poison_mass").await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    // Warm-up: topic metadata, connections, the first poison insert.
    db.insert_event("warm", "Created", "{}").await;
    db.client
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', NULL, 'Created', '{}')",
            &[],
        )
        .await
        .unwrap();
    harness::wait_until(
        Duration::from_secs(30),
        "the warm-up poison row",
        || async { db.poison_rows().await == 1 },
    )
    .await;

    let mut normal = Vec::new();
    let mut poison = Vec::new();
    for round in 0..ROUNDS {
        normal.push(drain(&db, &relay, round * 2, false).await);
        poison.push(drain(&db, &relay, round * 2 + 1, true).await);
    }
    eprintln!(
        "{EVENTS} events in {TXS} transactions: normal drain {normal:.2?}, all-poisoned drain {poison:.2?}"
    );
    assert_eq!(
        db.poison_rows().await,
        1 + i64::from(ROUNDS * EVENTS),
        "every poisoned event recorded once"
    );
    let best_normal = normal.iter().min().copied().unwrap();
    let best_poison = poison.iter().min().copied().unwrap();
    // 3x, plus 250 ms: each drain also holds time that does not scale with the work
    // and is not the relay's (the 100 transactions' write, the 10 ms polling here,
    // the wait for CPU on a machine whose other tests run at the same time), and
    // multiplying it would make the bound depend on that noise.
    let bound = best_normal * 3 + Duration::from_millis(250);
    assert!(
        best_poison <= bound,
        "poison drain {best_poison:.2?} > 3 x normal drain {best_normal:.2?} + 250 ms; log tail:\n{}",
        tail(&relay.log())
    );
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// Content the old insert could not store is recorded and the stream goes on: a
/// `\u0000` in a `json` headers column (jsonb refuses it) and a payload above the
/// poison copy limit (set to 4 KiB here; the real limit keeps far below jsonb's).
/// `replay` then publishes the truncated row's whole payload, read from the outbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unstorable_content_is_recorded_and_the_stream_goes_on() {
    let mut db = TestDb::create("poison_content").await;
    db.append_config(
        "\n[relay]\npoison_copy_limit_bytes = 4096\n\n[kafka.producer]\n\"message.max.bytes\" = \"100000\"\n",
    );
    db.client
        .batch_execute("ALTER TABLE outbox ALTER COLUMN headers TYPE json")
        .await
        .unwrap();
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    db.insert_event("before", "Created", "{}").await;
    // No entity id, so poisoned at once, and headers jsonb cannot hold.
    let nul_headers = r#"{"trace": "a\u0000b"}"#;
    let nul_key: String = db
        .client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES ('order', NULL, 'Created', '{}', $1::text::json) RETURNING idempotency_key",
            &[&nul_headers],
        )
        .await
        .unwrap()
        .get(0);
    // Refused by the producer (message.max.bytes), poisoned after max_attempts, and
    // larger than the copy limit.
    let big = format!(r#"{{"blob": "{}"}}"#, "x".repeat(200_000));
    let big_key = db.insert_event("big", "Created", &big).await;
    db.insert_event("after", "Created", "{}").await;
    let end: String = db
        .client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let end = parse_lsn(&end);

    let records = harness::consume_exactly(&db.topic, 2, Duration::from_secs(60), &relay).await;
    assert_eq!(records.len(), 2, "the good events are delivered");
    harness::wait_until(Duration::from_secs(60), "two poison rows", || async {
        db.poison_rows().await == 2
    })
    .await;
    harness::wait_until(
        Duration::from_secs(30),
        "the slot past the poisoned events",
        || async { confirmed_flush(&db.client, &db.slot).await >= end },
    )
    .await;

    let row = db
        .client
        .query_one(
            "SELECT headers IS NULL, headers_text, truncated, row_data IS NOT NULL, error_kind
             FROM poison_outbox WHERE idempotency_key = $1",
            &[&nul_key],
        )
        .await
        .unwrap();
    let (no_jsonb, text, truncated, has_row_data, kind): (
        bool,
        Option<String>,
        bool,
        bool,
        String,
    ) = (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
    assert_eq!(kind, "null_key");
    assert!(no_jsonb, "jsonb cannot hold the headers");
    assert_eq!(
        text.as_deref(),
        Some(nul_headers),
        "kept as text, unchanged"
    );
    assert!(
        !truncated && has_row_data,
        "row_data holds the text as a string"
    );

    let row = db
        .client
        .query_one(
            "SELECT poison_id, truncated, octet_length(payload), row_data IS NULL,
                    octet_length(row_data_text), row_bytes, row_sha256, error_kind
             FROM poison_outbox WHERE idempotency_key = $1",
            &[&big_key],
        )
        .await
        .unwrap();
    let poison_id: i64 = row.get(0);
    let (truncated, payload_len, no_row_data): (bool, i32, bool) =
        (row.get(1), row.get(2), row.get(3));
    let (row_text_len, row_bytes, sha, kind): (i32, i64, String, String) =
        (row.get(4), row.get(5), row.get(6), row.get(7));
    assert!(kind.contains("size") || kind.contains("large"), "{kind}");
    assert!(truncated && no_row_data);
    assert_eq!(payload_len, 4096, "a preview of the payload");
    assert_eq!(row_text_len, 4096, "a preview of row_data");
    assert!(row_bytes > 200_000, "the whole row's size: {row_bytes}");
    assert_eq!(sha.len(), 64, "{sha}");
    assert!(sha.chars().all(|c| c.is_ascii_hexdigit()), "{sha}");

    // replay finds the original row in the outbox and publishes all of it (with the
    // producer limit lifted: that was the cause).
    let config = db.config_path.to_str().unwrap().to_owned();
    let id = poison_id.to_string();
    let out = tokio::task::spawn_blocking(move || {
        harness::run_cli(&[
            "replay",
            "--id",
            &id,
            "--json",
            "--config",
            &config,
            "--set",
            "kafka.producer.message.max.bytes=1000000",
        ])
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "replay failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(report["published"], 1, "{report}");
    let records = harness::consume(&db.topic, 3, Duration::from_secs(30)).await;
    let replayed = records
        .iter()
        .find(|r| r.header("idempotency_key") == Some(big_key.as_str()))
        .unwrap_or_else(|| panic!("the replayed record; report {report}"));
    let original: String = db
        .client
        .query_one(
            "SELECT payload::text FROM outbox WHERE idempotency_key = $1",
            &[&big_key],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        replayed.payload.as_deref(),
        Some(original.as_bytes()),
        "the whole payload"
    );
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// Two rows of one transaction are two events, whatever their idempotency keys
/// (here the same key twice, and no key twice): each is recorded. And an occurrence
/// seen again (a second slot decodes the same transaction, as the relay would after
/// a crash before confirming) is not recorded twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_occurrence_is_recorded_once() {
    let db = TestDb::create("poison_once").await;
    db.client
        .batch_execute(
            "ALTER TABLE outbox DROP CONSTRAINT outbox_idempotency_key_key,
                 ALTER COLUMN idempotency_key DROP NOT NULL,
                 ALTER COLUMN idempotency_key DROP DEFAULT",
        )
        .await
        .unwrap();
    db.create_slot().await;
    let second = format!("{}_b", db.slot);
    db.client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&second],
        )
        .await
        .unwrap();
    // Four rows without an entity id in one transaction, then one good event.
    db.client
        .batch_execute(
            "BEGIN;
             INSERT INTO outbox (idempotency_key, aggregate_type, aggregate_id, event_type, payload)
             VALUES ('same', 'order', NULL, 'Created', '{\"n\": 1}'),
                    ('same', 'order', NULL, 'Created', '{\"n\": 2}'),
                    (NULL, 'order', NULL, 'Created', '{\"n\": 3}'),
                    (NULL, 'order', NULL, 'Created', '{\"n\": 4}');
             COMMIT;
             INSERT INTO outbox (idempotency_key, aggregate_type, aggregate_id, event_type, payload)
             VALUES ('good', 'order', 'e1', 'Created', '{}');",
        )
        .await
        .unwrap();
    let end: String = db
        .client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let end = parse_lsn(&end);
    let counts = || async {
        let row = db
            .client
            .query_one(
                "SELECT count(*), count(DISTINCT outbox_id), count(DISTINCT lsn),
                        count(*) FILTER (WHERE idempotency_key = 'same')
                 FROM poison_outbox",
                &[],
            )
            .await
            .unwrap();
        (
            row.get::<_, i64>(0),
            row.get::<_, i64>(1),
            row.get::<_, i64>(2),
            row.get::<_, i64>(3),
        )
    };

    for slot in [db.slot.clone(), second.clone()] {
        let relay =
            RelayProcess::start(&db.config_path, &[("OUTBOX_RELAY__POSTGRES__SLOT", &slot)]);
        let deadline = Instant::now() + Duration::from_secs(60);
        while confirmed_flush(&db.client, &slot).await < end {
            assert!(
                Instant::now() < deadline,
                "slot {slot} not past the events; log:\n{}",
                relay.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(
            counts().await,
            (4, 4, 1, 2),
            "each row of the transaction once (slot {slot}); log:\n{}",
            relay.log()
        );
        relay.terminate(Duration::from_secs(30)).await;
    }
    db.drop_slot().await;
    let _ = db
        .client
        .execute("SELECT pg_drop_replication_slot($1)", &[&second])
        .await;
}

/// `migrate` upgrades a poison table created before de-duplication by occurrence
/// without losing a row, even when rows already repeat an occurrence: the repeats
/// are labelled (`duplicate_of`) and left out of the unique index; new inserts of a
/// recorded occurrence are skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_keeps_every_row_of_an_old_poison_table() {
    let db = TestDb::create("poison_upgrade").await;
    // The table as migration 2 created it, and migration 8 not yet applied.
    let old = include_str!("../../migrations/0002_poison_outbox.sql")
        .replace("{{poison_table}}", "\"public\".\"poison_outbox\"")
        .replace("{{poison_key_idx}}", "poison_outbox_key_idx")
        .replace("{{schema}}", "\"public\"");
    db.client
        .batch_execute(&format!(
            "DROP TABLE poison_outbox;
             {old}
             DELETE FROM outbox_relay_migrations WHERE version = 8;"
        ))
        .await
        .unwrap();
    // Repeats of one occurrence (CDC, then poller), rows without an id, and one
    // outbox row poisoned at two commits (two occurrences).
    db.client
        .batch_execute(
            "INSERT INTO poison_outbox (outbox_id, idempotency_key, error, error_kind, attempts, lsn)
             VALUES ('o1', 'k1', 'e', 'k', 5, '0/10'), ('o1', 'k1', 'e', 'k', 5, '0/10'),
                    ('o2', 'k2', 'e', 'k', 5, NULL), ('o2', 'k2', 'e', 'k', 5, NULL),
                    (NULL, 'k3', 'e', 'k', 1, '0/20'), (NULL, 'k4', 'e', 'k', 1, '0/20'),
                    ('o3', 'k5', 'e', 'k', 1, '0/10'), ('o3', 'k5', 'e', 'k', 1, '0/30')",
        )
        .await
        .unwrap();
    let out = harness::run_cli(&["migrate", "--config", db.config_path.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "migrate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = db
        .client
        .query(
            "SELECT poison_id, outbox_id, duplicate_of FROM poison_outbox ORDER BY poison_id",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 8, "every row kept");
    let duplicates: Vec<(Option<String>, i64, i64)> = rows
        .iter()
        .filter_map(|r| {
            r.get::<_, Option<i64>>(2)
                .map(|first| (r.get(1), r.get(0), first))
        })
        .collect();
    assert_eq!(duplicates.len(), 2, "{duplicates:?}");
    for (outbox_id, id, first) in &duplicates {
        assert!(first < id, "labelled with the first row");
        assert!(
            matches!(outbox_id.as_deref(), Some("o1" | "o2")),
            "{duplicates:?}"
        );
    }
    // After the upgrade, recorded occurrences are skipped, new ones inserted.
    let insert = |outbox_id: &'static str, lsn: Option<&'static str>| {
        let client = &db.client;
        async move {
            client
                .execute(
                    "INSERT INTO poison_outbox (outbox_id, error, error_kind, attempts, lsn)
                     VALUES ($1, 'e', 'k', 1, $2::text::pg_lsn) ON CONFLICT DO NOTHING",
                    &[&outbox_id, &lsn],
                )
                .await
                .unwrap()
        }
    };
    assert_eq!(insert("o1", Some("0/10")).await, 0);
    assert_eq!(insert("o2", None).await, 0);
    assert_eq!(insert("o3", Some("0/40")).await, 1);
    assert_eq!(insert("o4", None).await, 1);
    assert_eq!(insert("o4", None).await, 0);
    assert_eq!(db.poison_rows().await, 10);
}
