//! Decoding on a standby (`postgres.slot_url`, PostgreSQL 16+): the relay's slot and
//! walsender live on a physical standby, its writes (position, poison rows,
//! heartbeats, cutover marks) go to the primary, and every promise holds across a
//! kill -9 of the relay, an immediate restart of the standby, a fast restart of the
//! primary, the slot lost on the standby (a resync reading the table there) and a
//! promotion of that standby (the slot survives it: the relay streams on from it).
//!
//! With `kafka.delivery = "exactly-once"` (against the project's dev broker, which
//! has transactions), a `read_committed` reader sees every event once across kills
//! and a restart of the standby: the progress record is judged by the standby's WAL.
//!
//! It needs a primary and a standby, which the main suite does not have: it is
//! `#[ignore]`d there and run by `scripts/pg17-failover-drill` on PostgreSQL 17
//! clusters of its own (`OUTBOX_RELAY_PG17_PRIMARY_URL`,
//! `OUTBOX_RELAY_PG17_STANDBY_URL`; `OUTBOX_RELAY_PG17_DRILL` is the drill script,
//! whose `ctl` restarts a server). Run without them, it fails and says so.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::exactly_once::{PER_WRITER, exactly_once_on, read_committed_until_complete};
use crate::harness::{
    self, DevBroker, RelayProcess, TestDb, assert_per_key_order, consume, consume_unique,
    deliveries, tally,
};
use crate::pg17_failover::write;

/// The relay's in-flight window: what a kill can have delivered past its position.
const WINDOW: usize = 200;

/// A variable the drill sets; its absence is a failure, not a skip.
fn required(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: this test needs a PostgreSQL 16+ primary and a hot standby; \
             run it with scripts/pg17-failover-drill"
        )
    })
}

/// `(active, walsender state)` of `slot` on a server: whether a walsender streams
/// from it there.
async fn streaming_there(client: &Client, slot: &str) -> bool {
    client
        .query_one(
            "SELECT count(*) FROM pg_replication_slots s
             JOIN pg_stat_replication r ON r.pid = s.active_pid
             WHERE s.slot_name = $1 AND r.state IN ('catchup', 'streaming')",
            &[&slot],
        )
        .await
        .expect("read pg_replication_slots")
        .get::<_, i64>(0)
        == 1
}

/// Logical slots and logical walsenders of `db` on a server.
async fn logical_on(client: &Client, db: &str) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM pg_replication_slots
                     WHERE slot_type = 'logical' AND database = $1),
                    (SELECT count(*) FROM pg_stat_activity
                     WHERE backend_type = 'walsender' AND datname = $1)",
            &[&db],
        )
        .await
        .expect("read the server's slots and walsenders");
    (row.get(0), row.get(1))
}

/// Waits until the relay streams from `slot` on the server of `client`.
async fn wait_streaming(client: &Client, slot: &str, relay: &RelayProcess, after_lines: usize) {
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let log = relay.log();
        let streaming_logged = log
            .lines()
            .skip(after_lines)
            .any(|l| l.contains(&format!("streaming slot={slot}")));
        if streaming_logged && streaming_there(client, slot).await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the relay did not stream from {slot} within 90 s; log:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The relay's confirmed position as saved on the primary.
async fn saved_position(client: &Client, slot: &str) -> Option<String> {
    client
        .query_opt(
            "SELECT confirmed_lsn::text FROM outbox_relay_position WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("read outbox_relay_position")
        .map(|r| r.get(0))
}

/// Drops `slot` on the server of `client` (a test's slot on the standby, at its
/// end, or to lose it).
async fn drop_slot(client: &Client, slot: &str) {
    client
        .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await
        .expect("drop the slot on the standby");
}

/// `(status, detail)` of the check `name` in a `check --json` report.
fn check_status(report: &serde_json::Value, name: &str) -> (String, String) {
    report["checks"]
        .as_array()
        .and_then(|checks| checks.iter().find(|c| c["name"] == name))
        .map(|c| {
            (
                c["status"].as_str().unwrap_or("").to_owned(),
                c["detail"].to_string(),
            )
        })
        .unwrap_or_else(|| panic!("no check {name}: {report}"))
}

/// Runs `scripts/pg17-failover-drill ctl SERVER ARGS…` (pg_ctl on that cluster).
fn ctl(server: &str, args: &[&str]) {
    let drill = required("OUTBOX_RELAY_PG17_DRILL");
    let status = std::process::Command::new(&drill)
        .arg("ctl")
        .arg(server)
        .args(args)
        .status()
        .unwrap_or_else(|e| panic!("run {drill} ctl: {e}"));
    assert!(status.success(), "{drill} ctl {server} {args:?} failed");
}

/// The number of lines of a log so far (to look only at what comes after).
fn lines(relay: &RelayProcess) -> usize {
    relay.log().lines().count()
}

/// Connects to `url`, waiting (bounded) for a standby to have replayed the
/// database's creation.
async fn connect_when_replayed(url: &str) -> Client {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match tokio_postgres::connect(url, tokio_postgres::NoTls).await {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                return client;
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "{url}: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Exactly-once with the slot on the standby: four writers on the primary, the
/// relay killed twice and the standby restarted at once under it, and a
/// `read_committed` reader sees every event once, in per-key order. It leaves the
/// standby a standby (the drill runs it before the test that promotes it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a PostgreSQL 16+ primary and standby: scripts/pg17-failover-drill"]
async fn exactly_once_on_a_standby_reads_each_event_once_across_kills_and_a_standby_restart() {
    let primary_url = required("OUTBOX_RELAY_PG17_PRIMARY_URL");
    let standby_url = required("OUTBOX_RELAY_PG17_STANDBY_URL");
    let broker = DevBroker::start();
    let brokers = broker.address.clone();
    let db = TestDb::create_in(&primary_url, "standby_eos", 3, "").await;
    let replica_url = harness::database_url(&standby_url, &db.name);
    let mut env = exactly_once_on(&brokers, &db, Some("500")).await;
    env.push(("OUTBOX_RELAY__POSTGRES__SLOT_URL", replica_url.as_str()));
    let mut writers = Vec::new();
    for w in 0..4 {
        let client = harness::connect(&db.url).await;
        writers.push(tokio::spawn(crate::exactly_once::write(client, w)));
    }
    let replica = connect_when_replayed(&replica_url).await;
    for pause_ms in [1_200, 1_700] {
        let relay = RelayProcess::start(&db.config_path, &env);
        wait_streaming(&replica, &db.slot, &relay, 0).await;
        tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        relay.kill9().await;
    }
    let relay = RelayProcess::start(&db.config_path, &env);
    wait_streaming(&replica, &db.slot, &relay, 0).await;
    let before_restart = lines(&relay);
    ctl("standby", &["restart", "-m", "immediate"]);
    let replica = harness::connect(&replica_url).await;
    wait_streaming(&replica, &db.slot, &relay, before_restart).await;
    for w in writers {
        w.await.expect("writer");
    }
    let expected = usize::try_from(4 * PER_WRITER).expect("count");
    let records =
        read_committed_until_complete(&brokers, &db.topic, expected, Duration::from_secs(120))
            .await;
    let (unique, duplicates) = tally(&records);
    let log = relay.log();
    eprintln!(
        "exactly-once on a standby: 2 kill -9 and an immediate standby restart, {expected} \
         events: read_committed saw {unique}, {duplicates} duplicates"
    );
    assert_eq!(
        unique, expected,
        "read_committed saw {unique} of {expected}; log:\n{log}"
    );
    assert_eq!(duplicates, 0, "read_committed saw duplicates; log:\n{log}");
    assert_per_key_order(&records);
    assert_eq!(
        logical_on(&db.client, &db.name).await,
        (0, 0),
        "the primary has a logical slot or walsender of the test database"
    );
    relay.terminate(Duration::from_secs(30)).await;
    drop_slot(&replica, &db.slot).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a PostgreSQL 16+ primary and standby: scripts/pg17-failover-drill"]
async fn a_relay_decoding_on_a_standby_keeps_every_promise_across_kills_restarts_and_promotion() {
    let primary_url = required("OUTBOX_RELAY_PG17_PRIMARY_URL");
    let standby_url = required("OUTBOX_RELAY_PG17_STANDBY_URL");
    let standby_admin = harness::connect(&standby_url).await;
    let (in_recovery, feedback): (bool, String) = {
        let row = standby_admin
            .query_one(
                "SELECT pg_is_in_recovery(), current_setting('hot_standby_feedback')",
                &[],
            )
            .await
            .expect("read the standby's settings");
        (row.get(0), row.get(1))
    };
    assert!(
        in_recovery && feedback == "on",
        "{standby_url} must be a hot standby with hot_standby_feedback = on"
    );

    let db = TestDb::create_in(&primary_url, "standby_decoding", 3, "").await;
    let replica_url = harness::database_url(&standby_url, &db.name);
    let total_started = Instant::now();

    // A backlog a polling relay had not sent: the first start cuts over from it,
    // reading the rows in the snapshot the slot's creation exported on the standby.
    const BACKLOG: i64 = 300;
    write(&db.client, 0..BACKLOG).await;
    let window = WINDOW.to_string();
    let env = [
        ("OUTBOX_RELAY__POSTGRES__SLOT_URL", replica_url.as_str()),
        ("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", window.as_str()),
    ];
    let relay = RelayProcess::start(&db.config_path, &env);
    // The standby has the test database once it replayed its creation.
    let replica = connect_when_replayed(&replica_url).await;
    wait_streaming(&replica, &db.slot, &relay, 0).await;
    let created = total_started.elapsed();

    // The primary decodes nothing: no logical slot, no walsender of this database.
    assert_eq!(
        logical_on(&db.client, &db.name).await,
        (0, 0),
        "the primary has a logical slot or walsender of the test database; log:\n{}",
        relay.log()
    );
    let (standby_slots, standby_senders) = logical_on(&replica, &db.name).await;
    assert_eq!(
        (standby_slots, standby_senders),
        (1, 1),
        "the standby's logical slots and walsenders"
    );

    // `check` checks the standby, and makes the slot's checks there.
    let out = harness::run_cli_with(
        &[
            "check",
            "--json",
            "--config",
            db.config_path.to_str().expect("utf-8 path"),
        ],
        &env,
    );
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("check --json prints JSON");
    let status_of = |name: &str| check_status(&report, name);
    for name in [
        "postgres.standby",
        "postgres.standby.hot_standby_feedback",
        "postgres.standby.physical_slot",
        "postgres.standby.replay_lag",
        "postgres.standby.primary_writes",
    ] {
        let (status, detail) = status_of(name);
        assert_eq!(status, "ok", "{name}: {detail}");
    }
    let (_, slot_detail) = status_of("postgres.slot");
    assert!(
        slot_detail.contains("streamed by pid"),
        "postgres.slot was not checked on the standby, where the relay streams: {slot_detail}"
    );
    // A postgres.url that is a standby is refused: the relay's writes cannot go there.
    let refused = harness::run_cli_with(
        &[
            "run",
            "--config",
            db.config_path.to_str().expect("utf-8 path"),
        ],
        &[("OUTBOX_RELAY__POSTGRES__URL", replica_url.as_str())],
    );
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("is a standby"), "{stderr}");

    // Retention finds the slot on the standby and takes its checkpoints on the
    // primary, where the relay's saved position judges them.
    {
        let out = harness::run_cli_with(
            &[
                "retention",
                "--once",
                "--json",
                "--config",
                db.config_path.to_str().expect("utf-8 path"),
            ],
            &env,
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "retention: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let cycle: serde_json::Value =
            serde_json::from_str(stdout.trim()).expect("retention --json prints JSON");
        assert!(
            cycle["checkpoint_taken"].is_string(),
            "retention took no checkpoint with the slot on the standby: {cycle}"
        );
    }

    // Live events, and a kill -9 while they are delivered.
    let mut written = BACKLOG;
    write(&db.client, written..written + 1_500).await;
    written += 1_500;
    relay.kill9().await;
    let delivered_before_kill =
        tally(&consume(&db.topic, usize::MAX, Duration::from_secs(2)).await).0;
    let relay = RelayProcess::start(&db.config_path, &env);
    wait_streaming(&replica, &db.slot, &relay, 0).await;
    write(&db.client, written..written + 1_000).await;
    written += 1_000;

    // An immediate restart of the standby under the streaming relay: its session
    // ends, and it resumes once the standby accepts connections again.
    let before_restart = lines(&relay);
    ctl("standby", &["restart", "-m", "immediate"]);
    write(&db.client, written..written + 1_000).await;
    written += 1_000;
    let replica = harness::connect(&replica_url).await;
    wait_streaming(&replica, &db.slot, &relay, before_restart).await;

    // A fast restart of the primary: the relay's writes (and the standby's stream)
    // stop for a moment; its position saver sees a restarted primary and the session
    // starts again.
    ctl("primary", &["restart", "-m", "fast"]);
    let primary = harness::connect(&db.url).await;
    write(&primary, written..written + 1_000).await;
    written += 1_000;
    let total = usize::try_from(written).expect("count");
    consume_unique(&db.topic, total, Duration::from_secs(120), &relay).await;

    // The slot is lost on the standby (dropped while the relay is stopped, as a
    // rebuilt standby would have none): the relay resyncs from its saved position,
    // reading the table in the snapshot its new slot exported on the standby.
    relay.terminate(Duration::from_secs(30)).await;
    let saved = saved_position(&primary, &db.slot).await;
    assert!(
        saved.as_deref().is_some_and(|s| s != "0/0"),
        "the relay saved no position on the primary: {saved:?}"
    );
    drop_slot(&replica, &db.slot).await;
    write(&primary, written..written + 500).await;
    written += 500;
    let relay = RelayProcess::start(&db.config_path, &env);
    wait_streaming(&replica, &db.slot, &relay, 0).await;
    let resync_log = relay.log();
    assert!(
        resync_log.contains("resync complete"),
        "the relay did not resync the lost slot; log:\n{resync_log}"
    );
    write(&primary, written..written + 500).await;
    written += 500;
    let total = usize::try_from(written).expect("count");
    let before_promotion = consume_unique(&db.topic, total, Duration::from_secs(120), &relay).await;
    assert_eq!(
        logical_on(&primary, &db.name).await,
        (0, 0),
        "the primary has a logical slot or walsender of the test database"
    );

    // The standby is promoted (the primary stops first, as in a failover). The slot
    // lives on it: the relay, pointed at the new primary alone, streams on from it.
    relay.terminate(Duration::from_secs(30)).await;
    ctl("primary", &["stop", "-m", "fast"]);
    let promoted: bool = replica
        .query_one("SELECT pg_promote(true, 60)", &[])
        .await
        .expect("pg_promote")
        .get(0);
    assert!(promoted, "the standby was not promoted within 60 s");
    write(&replica, written..written + 1_000).await;
    written += 1_000;
    let config = std::fs::read_to_string(&db.config_path)
        .expect("the test config")
        .replace(&db.url, &replica_url);
    let promoted_config = db.config_path.with_extension("promoted.toml");
    std::fs::write(&promoted_config, config).expect("write the promoted config");
    let relay = RelayProcess::start(
        &promoted_config,
        &[("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", window.as_str())],
    );
    let total = usize::try_from(written).expect("count");
    let first = consume_unique(&db.topic, total, Duration::from_secs(120), &relay).await;
    let records = harness::reread(&db.topic, &first, Duration::from_secs(3)).await;
    let (unique, duplicates) = tally(&records);
    let log = relay.log();
    eprintln!(
        "standby decoding: {total} events ({BACKLOG} cut over from the standby's snapshot); slot \
         created and streaming on the standby {} ms after start; {delivered_before_kill} \
         delivered before the kill -9; {} records before the promotion; lost {}, duplicates \
         {duplicates}; {} s in all",
        created.as_millis(),
        before_promotion.len(),
        total.saturating_sub(unique),
        total_started.elapsed().as_secs()
    );
    assert_eq!(unique, total, "events lost; log:\n{log}");
    assert_per_key_order(&records);
    // Only the kill -9 and the restarts can repeat events: each at most the
    // in-flight window and what was resolved past the last save (the resync starts
    // from a graceful stop's position and skips what the topic holds).
    assert!(
        duplicates <= 6 * WINDOW,
        "{duplicates} duplicates, more than six in-flight windows of {WINDOW}; log:\n{log}"
    );
    assert!(
        deliveries(&records).values().all(|&n| n <= 3),
        "an event was delivered more than three times"
    );
    // The slot survived the promotion: no resync.
    assert!(
        !log.contains("replication slot lost"),
        "the slot was not trusted after the promotion; log:\n{log}"
    );
    relay.terminate(Duration::from_secs(30)).await;
}

/// Events of the message outbox (`outbox_emit`: a transactional logical decoding
/// message, no table row) and rows of the same entities, written on the primary
/// in one transaction each, decoded by the relay's slot on the standby.
async fn emit(client: &Client, range: std::ops::Range<i64>) {
    for i in range {
        let entity = format!("e{}", i % 7);
        let message = format!(r#"{{"seq": {}}}"#, 2 * i);
        let mut sql = format!(
            "BEGIN; SELECT outbox_emit('order', '{entity}', 'changed', '{message}', NULL, 'msg-{i}');"
        );
        if i % 4 == 0 {
            let row = format!(r#"{{"seq": {}}}"#, 2 * i + 1);
            sql.push_str(&format!(
                " SELECT outbox_enqueue('order', '{entity}', 'row', '{row}', NULL, 'row-{i}');"
            ));
        }
        sql.push_str(" COMMIT;");
        client.batch_execute(&sql).await.expect("emit an event");
    }
}

/// The message outbox on a standby: messages decode there like rows (the standby
/// replays the primary's message records), across a `kill -9` of the relay; every
/// event arrives in per-key order and `audit` counts none lost from the message
/// ledger on the primary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a PostgreSQL 16+ primary and standby: scripts/pg17-failover-drill"]
async fn the_message_outbox_decodes_on_a_standby_across_a_kill() {
    let primary_url = required("OUTBOX_RELAY_PG17_PRIMARY_URL");
    let standby_url = required("OUTBOX_RELAY_PG17_STANDBY_URL");
    let db = TestDb::create_in(&primary_url, "standby_messages", 3, "").await;
    let replica_url = harness::database_url(&standby_url, &db.name);
    let window = WINDOW.to_string();
    let env = [
        ("OUTBOX_RELAY__POSTGRES__SLOT_URL", replica_url.as_str()),
        ("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", window.as_str()),
    ];
    let relay = RelayProcess::start(&db.config_path, &env);
    let replica = connect_when_replayed(&replica_url).await;
    wait_streaming(&replica, &db.slot, &relay, 0).await;
    assert_eq!(logical_on(&db.client, &db.name).await, (0, 0));

    emit(&db.client, 0..200).await;
    relay.kill9().await;
    emit(&db.client, 200..400).await;
    let relay = RelayProcess::start(&db.config_path, &env);
    wait_streaming(&replica, &db.slot, &relay, 0).await;
    // 400 messages and a row for every fourth.
    let total = 400 + 100;
    let records = consume_unique(&db.topic, total, Duration::from_secs(120), &relay).await;
    let (unique, duplicates) = tally(&records);
    assert_eq!(unique, total, "events delivered; log:\n{}", relay.log());
    // A kill re-sends at most the in-flight window and what was acked since the
    // last position save (every 250 ms on a standby): the fault drill's bound.
    assert!(
        duplicates <= 2 * WINDOW + 3,
        "{duplicates} duplicates, more than two in-flight windows of {WINDOW}"
    );
    assert_per_key_order(&records);
    relay.terminate(Duration::from_secs(30)).await;
    let audit = harness::audit(&db);
    assert_eq!(audit["lost"], 0, "{audit}");
    assert_eq!(audit["expected"], total, "{audit}");
    drop_slot(&replica, &db.slot).await;
}

/// The primary's `wal_level` lowered under a relay decoding on its standby: the
/// standby invalidates the slot (`wal_level_insufficient`), the relay says so with
/// that cause, keeps running while the standby cannot decode (it waits for the
/// primary instead of exiting), and once the primary is back at `logical` resyncs
/// from its saved position; no event is lost. It leaves the primary at `logical`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a PostgreSQL 16+ primary and standby: scripts/pg17-failover-drill"]
async fn a_slot_invalidated_by_the_primarys_wal_level_is_said_waited_out_and_resynced() {
    let primary_url = required("OUTBOX_RELAY_PG17_PRIMARY_URL");
    let standby_url = required("OUTBOX_RELAY_PG17_STANDBY_URL");
    let admin = harness::connect(&primary_url).await;
    // A logical slot on the primary would keep it from starting at `replica`.
    let slots: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'",
            &[],
        )
        .await
        .expect("read the primary's slots")
        .get(0);
    assert_eq!(slots, 0, "the primary has logical slots");
    let db = TestDb::create_in(&primary_url, "standby_invalidated", 3, "").await;
    let replica_url = harness::database_url(&standby_url, &db.name);
    let window = WINDOW.to_string();
    let env = [
        ("OUTBOX_RELAY__POSTGRES__SLOT_URL", replica_url.as_str()),
        ("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", window.as_str()),
    ];
    let mut relay = RelayProcess::start(&db.config_path, &env);
    let replica = connect_when_replayed(&replica_url).await;
    wait_streaming(&replica, &db.slot, &relay, 0).await;
    write(&db.client, 0..300).await;
    consume_unique(&db.topic, 300, Duration::from_secs(60), &relay).await;

    admin
        .batch_execute("ALTER SYSTEM SET wal_level = replica")
        .await
        .expect("lower wal_level");
    ctl("primary", &["restart", "-m", "fast"]);
    let primary = harness::connect(&db.url).await;
    write(&primary, 300..600).await;
    harness::wait_until(
        Duration::from_secs(90),
        "the slot lost, with its cause",
        || {
            let log = relay.log();
            async move {
                log.contains("replication slot lost")
                    && log.contains("the primary's wal_level went below logical")
            }
        },
    )
    .await;
    // The standby cannot decode now: the relay waits for the primary.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        relay.is_running(),
        "the relay exited; log:\n{}",
        relay.log()
    );

    let admin = harness::connect(&primary_url).await;
    admin
        .batch_execute("ALTER SYSTEM SET wal_level = logical")
        .await
        .expect("raise wal_level");
    ctl("primary", &["restart", "-m", "fast"]);
    let primary = harness::connect(&db.url).await;
    write(&primary, 600..900).await;
    harness::wait_until(Duration::from_secs(120), "the resync", || {
        let log = relay.log();
        async move { log.contains("resync complete") }
    })
    .await;
    let records = consume_unique(&db.topic, 900, Duration::from_secs(120), &relay).await;
    let (unique, _) = tally(&records);
    assert_eq!(unique, 900, "events delivered; log:\n{}", relay.log());
    assert_per_key_order(&records);
    relay.terminate(Duration::from_secs(30)).await;
    let audit = harness::audit(&db);
    assert_eq!(audit["lost"], 0, "{audit}");
    drop_slot(&replica, &db.slot).await;
}

/// Turns `hot_standby_feedback` on or off on the standby of `standby`, and waits
/// until the primary's physical slot for it shows that: off, the standby's last
/// feedback clears the slot's horizons; on, it sets them again.
async fn set_feedback(standby: &Client, primary: &Client, on: bool) {
    // Each its own statement: ALTER SYSTEM runs outside a transaction.
    for statement in [
        format!("ALTER SYSTEM SET hot_standby_feedback = {on}"),
        "SELECT pg_reload_conf()".to_owned(),
    ] {
        standby
            .batch_execute(&statement)
            .await
            .expect("set hot_standby_feedback");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let held: bool = primary
            .query_one(
                "SELECT coalesce(bool_or(xmin IS NOT NULL OR catalog_xmin IS NOT NULL), false)
                 FROM pg_replication_slots WHERE slot_type = 'physical' AND slot_name = $1",
                &[&"pg17_drill_standby"],
            )
            .await
            .expect("read the standby's physical slot")
            .get(0);
        if held == on {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the primary's physical slot still shows hot_standby_feedback = {} after 30 s",
            !on
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Catalog rows removed on the primary: a table made and dropped, and the catalogs
/// it touched vacuumed. Each is its own transaction: rows a transaction inserts and
/// deletes itself were never visible, and their removal conflicts with no snapshot
/// or slot on a standby; VACUUM runs outside a transaction anyway.
async fn churn_catalog(client: &Client, round: usize) {
    let statements = [
        format!("CREATE TABLE catalog_churn_{round} (a int)"),
        format!("DROP TABLE catalog_churn_{round}"),
    ];
    let vacuums =
        ["pg_class", "pg_attribute", "pg_type", "pg_depend"].map(|c| format!("VACUUM {c}"));
    for statement in statements.iter().chain(&vacuums) {
        client
            .batch_execute(statement)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
}

/// `hot_standby_feedback` turned off on the standby a relay decodes on: `check` says
/// so; while the relay is stopped the primary's vacuum removes catalog rows its slot
/// still needs and the standby invalidates the slot (`rows_removed`); started, the
/// relay says the slot is lost with that cause and that the standby runs without
/// feedback, and resyncs from its saved position, reading the table on the
/// standby; no event is lost, keys keep their order. It turns the setting back on.
/// (A slot invalidated under a streaming relay is the `wal_level` test's case.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a PostgreSQL 16+ primary and standby: scripts/pg17-failover-drill"]
async fn without_hot_standby_feedback_a_slot_invalidated_by_vacuum_is_said_and_resynced() {
    let primary_url = required("OUTBOX_RELAY_PG17_PRIMARY_URL");
    let standby_url = required("OUTBOX_RELAY_PG17_STANDBY_URL");
    let db = TestDb::create_in(&primary_url, "standby_feedback", 3, "").await;
    let replica_url = harness::database_url(&standby_url, &db.name);
    let window = WINDOW.to_string();
    let env = [
        ("OUTBOX_RELAY__POSTGRES__SLOT_URL", replica_url.as_str()),
        ("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", window.as_str()),
    ];
    let relay = RelayProcess::start(&db.config_path, &env);
    let replica = connect_when_replayed(&replica_url).await;
    wait_streaming(&replica, &db.slot, &relay, 0).await;
    write(&db.client, 0..300).await;
    consume_unique(&db.topic, 300, Duration::from_secs(60), &relay).await;

    let standby_admin = harness::connect(&standby_url).await;
    let primary_admin = harness::connect(&primary_url).await;
    set_feedback(&standby_admin, &primary_admin, false).await;
    let out = harness::run_cli_with(
        &[
            "check",
            "--json",
            "--config",
            db.config_path.to_str().expect("utf-8 path"),
        ],
        &env,
    );
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).expect("check --json prints JSON");
    let (status, detail) = check_status(&report, "postgres.standby.hot_standby_feedback");
    assert_ne!(
        status, "ok",
        "check did not say hot_standby_feedback is off: {detail}"
    );

    // The relay stops (its slot's catalog horizon then stays where it is), and the
    // primary removes catalog rows past it while events are written: the standby
    // replays a removal and invalidates the slot.
    relay.terminate(Duration::from_secs(30)).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut written = 300;
    let mut round = 0;
    loop {
        write(&db.client, written..written + 50).await;
        written += 50;
        churn_catalog(&db.client, round).await;
        round += 1;
        let reason: Option<String> = replica
            .query_one(
                "SELECT invalidation_reason FROM pg_replication_slots WHERE slot_name = $1",
                &[&db.slot],
            )
            .await
            .expect("read the slot on the standby")
            .get(0);
        if reason.as_deref() == Some("rows_removed") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the slot was not invalidated for removed rows within 60 s ({round} rounds): {reason:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let relay = RelayProcess::start(&db.config_path, &env);
    harness::wait_until(Duration::from_secs(120), "the resync", || {
        let log = relay.log();
        async move { log.contains("resync complete") }
    })
    .await;
    let log = relay.log();
    assert!(
        log.contains("replication slot lost")
            && log.contains("the catalog rows it needed were removed"),
        "the relay did not say the slot was lost for removed rows; log:\n{log}"
    );
    assert!(
        log.contains("hot_standby_feedback = off"),
        "the relay did not say the standby runs without hot_standby_feedback; log:\n{log}"
    );
    set_feedback(&standby_admin, &primary_admin, true).await;
    write(&db.client, written..written + 300).await;
    written += 300;
    let total = usize::try_from(written).expect("count");
    let records = consume_unique(&db.topic, total, Duration::from_secs(120), &relay).await;
    let (unique, duplicates) = tally(&records);
    let log = relay.log();
    eprintln!(
        "hot_standby_feedback off: slot invalidated after {round} rounds of catalog churn; \
         {total} events, lost {}, duplicates {duplicates}",
        total.saturating_sub(unique)
    );
    assert_eq!(unique, total, "events lost; log:\n{log}");
    assert_per_key_order(&records);
    relay.terminate(Duration::from_secs(30)).await;
    let audit = harness::audit(&db);
    assert_eq!(audit["lost"], 0, "{audit}");
    drop_slot(&replica, &db.slot).await;
}

/// A promotion of *another* standby: the relay decodes on the first standby and is
/// killed while it delivers, the primary stops (a fast stop: both standbys have its
/// WAL), the second standby is promoted and the relay is pointed at it alone, as a
/// DNS switch and a restart would. The slot is not there (a slot made on a standby
/// is synced to no other server): the relay says the slot is lost and resyncs from
/// its saved position, which the new primary replayed, reading the table there;
/// no event is lost, keys keep their order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a PostgreSQL 16+ primary and two standbys: scripts/pg17-failover-drill"]
async fn a_promotion_of_another_standby_is_a_lost_slot_resynced_on_the_new_primary() {
    let primary_url = required("OUTBOX_RELAY_PG17_PRIMARY_URL");
    let standby_url = required("OUTBOX_RELAY_PG17_STANDBY_URL");
    let standby2_url = required("OUTBOX_RELAY_PG17_STANDBY2_URL");
    let db = TestDb::create_in(&primary_url, "standby_other", 3, "").await;
    let replica_url = harness::database_url(&standby_url, &db.name);
    let other_url = harness::database_url(&standby2_url, &db.name);
    let window = WINDOW.to_string();
    let env = [
        ("OUTBOX_RELAY__POSTGRES__SLOT_URL", replica_url.as_str()),
        ("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", window.as_str()),
    ];
    let relay = RelayProcess::start(&db.config_path, &env);
    let replica = connect_when_replayed(&replica_url).await;
    wait_streaming(&replica, &db.slot, &relay, 0).await;
    write(&db.client, 0..1_000).await;
    consume_unique(&db.topic, 1_000, Duration::from_secs(60), &relay).await;
    write(&db.client, 1_000..2_500).await;
    relay.kill9().await;
    let mut written = 2_500;

    ctl("primary", &["stop", "-m", "fast"]);
    let other = connect_when_replayed(&other_url).await;
    let promoted: bool = other
        .query_one("SELECT pg_promote(true, 60)", &[])
        .await
        .expect("pg_promote")
        .get(0);
    assert!(promoted, "the second standby was not promoted within 60 s");
    write(&other, written..written + 1_000).await;
    written += 1_000;
    let config = std::fs::read_to_string(&db.config_path)
        .expect("the test config")
        .replace(&db.url, &other_url);
    let promoted_config = db.config_path.with_extension("other.toml");
    std::fs::write(&promoted_config, config).expect("write the new primary's config");
    let relay = RelayProcess::start(
        &promoted_config,
        &[("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", window.as_str())],
    );
    write(&other, written..written + 500).await;
    written += 500;
    let total = usize::try_from(written).expect("count");
    let first = consume_unique(&db.topic, total, Duration::from_secs(120), &relay).await;
    let records = harness::reread(&db.topic, &first, Duration::from_secs(3)).await;
    let (unique, duplicates) = tally(&records);
    let log = relay.log();
    eprintln!(
        "promotion of another standby: {total} events, lost {}, duplicates {duplicates}",
        total.saturating_sub(unique)
    );
    assert!(
        log.contains("replication slot lost") && log.contains("resync complete"),
        "the relay did not say the slot was lost and resync; log:\n{log}"
    );
    assert_eq!(unique, total, "events lost; log:\n{log}");
    assert_per_key_order(&records);
    // The kill re-sends at most its window and what was acked past the last save;
    // the resync skips what the topic holds.
    assert!(
        duplicates <= 2 * WINDOW + 3,
        "{duplicates} duplicates, more than two in-flight windows of {WINDOW}; log:\n{log}"
    );
    assert_eq!(
        logical_on(&other, &db.name).await.0,
        1,
        "the relay's slot is not on the new primary"
    );
    relay.terminate(Duration::from_secs(30)).await;
}
