//! The poison table under load and with hostile content: mass poisoning drains in
//! time proportional to delivery (no cost that grows with the table), content that
//! jsonb or a size limit refuses is still recorded (and the stream goes on), each
//! occurrence is recorded exactly once, the migration that introduced
//! de-duplication by occurrence keeps every old row, and relays that share the
//! poison table never take each other's rows for their own.

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
/// recorded occurrence are skipped, unless another outbox (`source_table`) wrote
/// them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_keeps_every_row_of_an_old_poison_table() {
    let db = TestDb::create("poison_upgrade").await;
    // The table as migration 2 created it, and migrations 8 and 12 not yet applied.
    let old = include_str!("../../migrations/0002_poison_outbox.sql")
        .replace("{{poison_table}}", "\"public\".\"poison_outbox\"")
        .replace("{{poison_key_idx}}", "poison_outbox_key_idx")
        .replace("{{schema}}", "\"public\"");
    db.client
        .batch_execute(&format!(
            "DROP TABLE poison_outbox;
             {old}
             DELETE FROM outbox_relay_migrations WHERE version IN (8, 12);"
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
    // Another outbox sharing the table, whose ids run in lockstep with this one's:
    // its row of the same id and commit is its own occurrence, recorded once.
    for expected in [1, 0] {
        let inserted = db
            .client
            .execute(
                "INSERT INTO poison_outbox (outbox_id, error, error_kind, attempts, lsn,
                                            source_table, source_slot)
                 VALUES ('o1', 'e', 'k', 1, '0/10', 'public.other_outbox', 'other_slot')
                 ON CONFLICT DO NOTHING",
                &[],
            )
            .await
            .unwrap();
        assert_eq!(inserted, expected);
    }
    // Migrations 8 and 12 once more, as the other outbox's own `migrate` runs them
    // on the shared table: 8 labels the other outbox's row a repeat of this one's,
    // 12 takes the label back; no index is replaced by 8's.
    db.client
        .batch_execute("DELETE FROM outbox_relay_migrations WHERE version IN (8, 12)")
        .await
        .unwrap();
    let out = harness::run_cli(&["migrate", "--config", db.config_path.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "migrate failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(insert("o1", Some("0/10")).await, 0);
    let labelled: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM poison_outbox WHERE duplicate_of IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(labelled, 2, "the two repeats of before, no more");
}

/// An outbox table with bigint ids the test sets, so two tables' ids run in
/// lockstep (as two sequences written together do).
const LOCKSTEP_OUTBOX: &str = "(
    id              bigint      PRIMARY KEY,
    idempotency_key text        NOT NULL UNIQUE DEFAULT gen_random_uuid()::text,
    aggregate_type  text        NOT NULL,
    aggregate_id    text,
    event_type      text        NOT NULL,
    topic           text,
    headers         jsonb,
    payload         jsonb       NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    sent_at         timestamptz,
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text)";

/// Two relays, each with its own outbox table, slot and publication, share the
/// default poison table; their outbox ids run in lockstep, so one transaction
/// writes row 1 of each table at one commit, with ordinal 0 in each relay's stream.
/// The first relay poisons its row 1 (and 2); the second, streaming the same
/// transactions afterwards, must still deliver its row 1 (not skip it as an event
/// it poisoned before a crash) and record its own poisoned row 2 (not drop it as a
/// repeat of the first relay's); `replay --all` of each relay takes only its rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_sharing_the_poison_table_keep_their_events_apart() {
    let db = TestDb::create("poison_shared").await;
    let env = harness::env();
    let (slot_a, slot_b) = (format!("{}_a", db.name), format!("{}_b", db.name));
    let topic_b = format!("{}.billing", db.name);
    harness::create_topic(&topic_b, 1).await;
    db.client
        .batch_execute(&format!(
            "CREATE TABLE public.orders_outbox {LOCKSTEP_OUTBOX};
             CREATE TABLE public.billing_outbox {LOCKSTEP_OUTBOX};
             CREATE PUBLICATION {0}_pa FOR TABLE public.orders_outbox WITH (publish = 'insert');
             CREATE PUBLICATION {0}_pb FOR TABLE public.billing_outbox WITH (publish = 'insert');",
            db.name
        ))
        .await
        .unwrap();
    for slot in [&slot_a, &slot_b] {
        db.client
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[slot],
            )
            .await
            .unwrap();
    }
    // Each relay's config names its table, slot and publication; poison_table is
    // the default, public.poison_outbox, for both.
    let config = |which: &str, slot: &str, table: &str, topic: &str| {
        let path = std::env::temp_dir().join(format!("{}_{which}.toml", db.name));
        std::fs::write(
            &path,
            format!(
                "[postgres]\nurl = \"{}\"\nslot = \"{slot}\"\npublication = \"{}_p{which}\"\n\
                 \n[outbox]\ntable = \"{table}\"\n\
                 \n[kafka]\nbrokers = \"{}\"\ntopic_template = \"{topic}\"\n\
                 \n[log]\nlevel = \"info\"\n",
                db.url, db.name, env.brokers
            ),
        )
        .unwrap();
        path
    };
    let config_a = config("a", &slot_a, "public.orders_outbox", &db.topic);
    let config_b = config("b", &slot_b, "public.billing_outbox", &topic_b);

    // Commit 1: order 1 cannot be delivered (no entity id), invoice 1 can.
    // Commit 2: neither order 2 nor invoice 2 can.
    let mut client = harness::connect(&db.url).await;
    let tx = client.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO orders_outbox (id, aggregate_type, aggregate_id, event_type, payload)
         VALUES (1, 'order', NULL, 'OrderPlaced', '{}')",
        &[],
    )
    .await
    .unwrap();
    let invoice: String = tx
        .query_one(
            "INSERT INTO billing_outbox (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (1, 'invoice', 'inv-1', 'InvoiceIssued', '{}') RETURNING idempotency_key",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    tx.commit().await.unwrap();
    client
        .batch_execute(
            "BEGIN;
             INSERT INTO orders_outbox (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (2, 'order', NULL, 'OrderPlaced', '{}');
             INSERT INTO billing_outbox (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (2, 'invoice', NULL, 'InvoiceIssued', '{}');
             COMMIT;",
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
    let streamed = async |relay: &RelayProcess, slot: &str| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while confirmed_flush(&db.client, slot).await < end {
            assert!(
                Instant::now() < deadline,
                "slot {slot} not past the events; log:\n{}",
                relay.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };

    // The orders relay poisons orders 1 and 2.
    let relay = RelayProcess::start(&config_a, &[]);
    streamed(&relay, &slot_a).await;
    assert_eq!(db.poison_rows().await, 2, "log:\n{}", relay.log());
    relay.terminate(Duration::from_secs(30)).await;

    // The billing relay streams the same two commits: invoice 1 is delivered.
    let relay = RelayProcess::start(&config_b, &[]);
    streamed(&relay, &slot_b).await;
    let records = harness::consume(&topic_b, 1, Duration::from_secs(10)).await;
    let delivered: Vec<&str> = records
        .iter()
        .filter_map(|r| r.header("idempotency_key"))
        .collect();
    assert_eq!(
        delivered,
        [invoice.as_str()],
        "invoice 1 lost: the billing relay took the orders relay's poison row of order 1 \
         (same id, commit and ordinal) for its own; log:\n{}",
        relay.log()
    );
    relay.terminate(Duration::from_secs(30)).await;

    // Invoice 2 has a row of its own beside order 2's, and each row names its source.
    let sources: Vec<(String, String, String)> = db
        .client
        .query(
            "SELECT outbox_id, source_table, source_slot FROM poison_outbox
              ORDER BY source_table, outbox_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let row =
        |id: &str, table: &str, slot: &str| (id.to_owned(), table.to_owned(), slot.to_owned());
    assert_eq!(
        sources,
        [
            row("2", "public.billing_outbox", &slot_b),
            row("1", "public.orders_outbox", &slot_a),
            row("2", "public.orders_outbox", &slot_a),
        ]
    );

    // Each relay's `replay --all` selects its own rows only.
    for (config, rows) in [(&config_a, 2), (&config_b, 1)] {
        let out = harness::run_cli(&[
            "replay",
            "--all",
            "--dry-run",
            "--json",
            "--config",
            config.to_str().unwrap(),
        ]);
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "replay --json ({e}): {}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
        assert_eq!(report["selected"], rows, "{report}");
    }
    for slot in [&slot_a, &slot_b] {
        let _ = db
            .client
            .execute("SELECT pg_drop_replication_slot($1)", &[slot])
            .await;
    }
}
