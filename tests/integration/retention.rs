//! Retention and the fallback to the poller, against a real relay and broker.
//!
//! "Never deletes an unconfirmed row" is checked directly: a test trigger logs,
//! for every deleted outbox row, the slot's `confirmed_flush_lsn` at the moment of
//! the delete; each deleted event's commit LSN (its `source_lsn` header) must be
//! below it.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use outbox_relay::config::Config;
use outbox_relay::ops::retention::{self, CycleReport};
use outbox_relay::poller::{self, PollArgs, PollSummary};
use tokio::sync::oneshot;

use crate::harness::{
    self, RelayProcess, TestDb, confirmed_flush, consume_unique, parse_lsn, wait_until,
};

/// The SQL rule and its Rust mirror agree on a real server, including 32-bit
/// values that only make sense across a wraparound and an ancient checkpoint.
#[tokio::test]
async fn checkpoint_rule_in_sql_matches_the_rust_mirror() {
    let db = TestDb::create("ckpt_rule").await;
    let horizon: i64 = db
        .client
        .query_one(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let rows: Vec<u32> = [
        -300_i64,
        -101,
        -100,
        -99,
        -1,
        0,
        50,
        4_294_967_000 - horizon,
    ]
    .iter()
    .map(|d| u32::try_from((horizon + d).rem_euclid(1 << 32)).unwrap())
    .collect();
    let values = rows
        .iter()
        .map(|x| format!("('{x}'::xid)"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut answers = HashSet::new();
    for ckpt in [horizon - 100, horizon - (1_i64 << 31) - 5] {
        let sql = format!(
            "SELECT o.xmin::text::bigint, pg_snapshot_xmax(pg_current_snapshot())::text::bigint, {}
               FROM (VALUES {values}) AS o(xmin)",
            outbox_relay::outbox::checkpoint::precedes_sql("o", 1)
        );
        for row in db.client.query(&sql, &[&ckpt]).await.unwrap() {
            let x = u32::try_from(row.get::<_, i64>(0)).unwrap();
            let h: i64 = row.get(1);
            let sql_says: bool = row.get(2);
            answers.insert(sql_says);
            assert_eq!(
                sql_says,
                outbox_relay::outbox::checkpoint::precedes(x, h, ckpt),
                "xmin {x}, horizon {h}, checkpoint {ckpt}"
            );
        }
    }
    assert_eq!(answers.len(), 2, "both answers exercised");
}

async fn cycle(config: &Config) -> CycleReport {
    let mut client = outbox_relay::postgres::connect(&config.postgres.url)
        .await
        .unwrap();
    retention::cycle(&mut client, config, false).await.unwrap()
}

async fn count(db: &TestDb, sql: &str) -> i64 {
    db.client.query_one(sql, &[]).await.unwrap().get(0)
}

/// Logs every deleted outbox row with the slot's confirmed LSN at that moment.
async fn log_deletes(db: &TestDb) {
    db.client
        .batch_execute(&format!(
            "CREATE TABLE deleted_log (idempotency_key text, confirmed pg_lsn);
             CREATE FUNCTION log_delete() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO deleted_log SELECT OLD.idempotency_key, confirmed_flush_lsn
                   FROM pg_replication_slots WHERE slot_name = '{}';
                 RETURN OLD;
             END $$;
             CREATE TRIGGER log_delete BEFORE DELETE ON outbox
                 FOR EACH ROW EXECUTE FUNCTION log_delete();",
            db.slot
        ))
        .await
        .unwrap();
}

/// Inserts `n` events from its own connection, `per_tx` per transaction, spread
/// over about three seconds: retention must get several cycles (and the relay
/// several confirmations) while writers are still writing, however fast the
/// machine inserts.
async fn writer(url: String, name: String, n: usize, per_tx: usize) -> Vec<String> {
    let mut client = harness::connect(&url).await;
    let mut keys = Vec::with_capacity(n);
    let transactions = u32::try_from(n.div_ceil(per_tx.max(1))).unwrap_or(u32::MAX);
    let pause = Duration::from_secs(3) / transactions.max(1);
    while keys.len() < n {
        tokio::time::sleep(pause).await;
        let tx = client.transaction().await.unwrap();
        for _ in 0..per_tx.min(n - keys.len()) {
            let key: String = tx
                .query_one(
                    "SELECT outbox_enqueue('order', $1, 'created', '{\"w\": 1}')",
                    &[&format!("{name}-{}", keys.len() % 7)],
                )
                .await
                .unwrap()
                .get(0);
            keys.push(key);
        }
        tx.commit().await.unwrap();
    }
    keys
}

#[tokio::test]
async fn retention_keeps_the_table_bounded_and_never_deletes_unconfirmed_rows() {
    let mut db = TestDb::create("ret_rows").await;
    db.append_config("\n[retention]\nperiod = \"0s\"\nbatch_size = 50\ninterval = \"1s\"\n");
    log_deletes(&db).await;
    db.create_slot().await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let config = db.config();

    let writers: Vec<_> = (0..4)
        .map(|w| tokio::spawn(writer(db.url.clone(), format!("w{w}"), 500, 1 + w % 3 * 4)))
        .collect();
    let mut max_rows = 0;
    let mut deleted = 0;
    let mut cycles = 0;
    while !writers.iter().all(|w| w.is_finished()) {
        cycles += 1;
        deleted += cycle(&config).await.deleted_rows;
        max_rows = max_rows.max(count(&db, "SELECT count(*) FROM outbox").await);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deleted_while_writing = deleted;
    let mut keys = HashSet::new();
    for w in writers {
        keys.extend(w.await.unwrap());
    }
    assert_eq!(keys.len(), 2000);
    let records = consume_unique(&db.topic, keys.len(), Duration::from_secs(60), &relay).await;

    // Once the relay confirmed everything, a few cycles empty the table.
    let deadline = Instant::now() + Duration::from_secs(30);
    while count(&db, "SELECT count(*) FROM outbox").await > 0 {
        assert!(
            Instant::now() < deadline,
            "retention did not empty the table"
        );
        deleted += cycle(&config).await.deleted_rows;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "retention: {cycles} cycles while writing, max rows seen {max_rows}, \
         {deleted_while_writing} deleted while writing, {deleted} of 2000 in all"
    );
    assert!(
        deleted_while_writing > 0,
        "nothing deleted while the relay ran"
    );
    assert!(max_rows < 2000, "the table was never trimmed");
    assert_eq!(deleted, 2000);

    // None lost, no delete published as an event.
    let commit_lsn: HashMap<&str, u64> = records
        .iter()
        .filter_map(|r| {
            Some((
                r.header("idempotency_key")?,
                parse_lsn(r.header("source_lsn")?),
            ))
        })
        .collect();
    for key in &keys {
        assert!(commit_lsn.contains_key(key.as_str()), "{key} lost");
    }
    assert!(
        commit_lsn.keys().all(|k| keys.contains(*k)),
        "unexpected record"
    );
    // Nothing arrives after the deletes.
    let again = harness::reread(&db.topic, &records, Duration::from_secs(3)).await;
    assert_eq!(again.len(), records.len(), "a delete became a record");

    // Every row was deleted only after the slot had confirmed its commit.
    let log = db
        .client
        .query(
            "SELECT idempotency_key, confirmed::text FROM deleted_log",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(log.len(), 2000);
    for row in log {
        let key: String = row.get(0);
        let confirmed = parse_lsn(&row.get::<_, String>(1));
        let commit = commit_lsn[key.as_str()];
        assert!(
            commit < confirmed,
            "{key} (commit {commit:X}) deleted while the slot had confirmed {confirmed:X}"
        );
    }
    drop(relay);
    db.drop_slot().await;
}

#[tokio::test]
async fn with_the_relay_stopped_retention_deletes_nothing_after_the_confirmed_checkpoint() {
    let mut db = TestDb::create("ret_stop").await;
    db.append_config("\n[retention]\nperiod = \"0s\"\n");
    db.create_slot().await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let config = db.config();
    let mut delivered = Vec::new();
    for i in 0..50 {
        delivered.push(db.insert_event(&format!("e{i}"), "created", "{}").await);
    }
    consume_unique(&db.topic, 50, Duration::from_secs(30), &relay).await;
    // Checkpoints after the 50 rows, each waited for until the relay confirms it,
    // until one covers them all: a checkpoint's xmin is the cluster's, and a
    // transaction of another test open when it was taken holds it below some rows.
    // (A cycle may use its own checkpoint, if the relay was quick enough to confirm
    // it before the cycle read the slot.)
    let mut deleted = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while deleted < 50 {
        assert!(
            Instant::now() < deadline,
            "{deleted} of the 50 relayed rows deleted"
        );
        let report = cycle(&config).await;
        deleted += report.deleted_rows;
        let taken = parse_lsn(&report.checkpoint_taken.expect("checkpoint taken"));
        wait_until(
            Duration::from_secs(30),
            "the slot passes the checkpoint",
            || async { confirmed_flush(&db.client, &db.slot).await >= taken },
        )
        .await;
    }
    assert_eq!(deleted, 50, "exactly the confirmed rows");
    relay.kill9().await;

    // Committed but never relayed: kept, whatever the cycles.
    let mut pending = Vec::new();
    for i in 0..50 {
        pending.push(db.insert_event(&format!("p{i}"), "created", "{}").await);
    }
    for _ in 0..3 {
        let report = cycle(&config).await;
        assert_eq!(report.deleted_rows, 0, "an unconfirmed row deleted");
        assert!(report.checkpoint_used.is_some());
    }
    let left: Vec<String> = db
        .client
        .query(
            "SELECT idempotency_key FROM outbox ORDER BY created_at",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, pending, "unconfirmed rows are all kept");

    // The CLI: a dry run reports and deletes nothing.
    let out = harness::run_cli(&[
        "retention",
        "--once",
        "--dry-run",
        "--json",
        "--config",
        db.config_path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["deleted_rows"], 0, "{report}");
    assert_eq!(report["dry_run"], true);
    db.drop_slot().await;
}

#[tokio::test]
async fn partitioned_outbox_old_partition_dropped_only_once_confirmed() {
    let db = TestDb::create_configured(
        "ret_part",
        3,
        "\n[outbox]\npartitioned = true\npartition_interval = \"day\"\npartitions_ahead = 1\n\
         [retention]\nperiod = \"1h\"\n",
    )
    .await;
    let config = db.config();
    // A partition for the past, as if created two days ago.
    db.client
        .batch_execute(
            "CREATE TABLE outbox_old PARTITION OF outbox FOR VALUES
                 FROM (date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '3 days')
                 TO (date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' - interval '1 day')",
        )
        .await
        .unwrap();
    let partitions = "SELECT count(*) FROM pg_inherits WHERE inhparent = 'outbox'::regclass";
    assert_eq!(count(&db, partitions).await, 3, "today, tomorrow, old");
    db.create_slot().await;
    let mut keys = Vec::new();
    for i in 0..40 {
        let created = if i % 2 == 0 {
            "now() - interval '2 days'"
        } else {
            "now()"
        };
        let key: String = db
            .client
            .query_one(
                &format!(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at)
                     VALUES ('order', $1, 'created', '{{}}', {created}) RETURNING idempotency_key"
                ),
                &[&format!("e{i}")],
            )
            .await
            .unwrap()
            .get(0);
        keys.push(key);
    }
    assert_eq!(count(&db, "SELECT count(*) FROM outbox_old").await, 20);

    // The relay has not run: the old partition's rows are not confirmed, it stays.
    // (One more partition ahead is asked for: the cycle creates it.)
    let mut config = config;
    config.outbox.partitions_ahead = 2;
    let report = cycle(&config).await;
    assert_eq!(report.created_partitions, 1, "{report:?}");
    assert_eq!(count(&db, partitions).await, 4);
    assert!(report.dropped_partitions.is_empty(), "{report:?}");
    assert_eq!(report.kept_partitions, ["public.outbox_old"], "{report:?}");

    // The relay streams the partitioned table under the root's name.
    let relay = RelayProcess::start(&db.config_path, &[]);
    let records = consume_unique(&db.topic, 40, Duration::from_secs(30), &relay).await;
    let got: HashSet<&str> = records
        .iter()
        .filter_map(|r| r.header("idempotency_key"))
        .collect();
    assert!(keys.iter().all(|k| got.contains(k.as_str())));

    // Once a checkpoint after the inserts is confirmed, the partition goes.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let report = cycle(&config).await;
        if !report.dropped_partitions.is_empty() {
            assert_eq!(report.dropped_partitions, ["public.outbox_old"]);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "old partition never dropped: {report:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(count(&db, partitions).await, 3, "today and two ahead");
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox").await,
        20,
        "recent rows kept"
    );
    // A drop is not an event.
    let again = harness::reread(&db.topic, &records, Duration::from_secs(3)).await;
    assert_eq!(again.len(), records.len());
    drop(relay);
    db.drop_slot().await;
}

/// `poller::run` on a task, stopped through its shutdown future.
async fn run_poller(
    config: Config,
    args: PollArgs,
) -> (oneshot::Sender<()>, tokio::task::JoinHandle<PollSummary>) {
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        poller::run(
            config,
            &args,
            Box::pin(async move {
                let _ = stopped.await;
            }),
        )
        .await
        .unwrap()
    });
    (stop, task)
}

#[tokio::test]
async fn fallback_to_the_poller_loses_nothing_and_resends_at_most_one_checkpoint_interval() {
    fallback(false).await;
}

/// The slot was dropped (e.g. to stop it from retaining WAL) before the fallback:
/// the confirmed position recorded with the checkpoints stands in for it.
#[tokio::test]
async fn fallback_after_the_slot_was_dropped_uses_the_recorded_position() {
    fallback(true).await;
}

async fn fallback(drop_slot: bool) {
    let mut db = TestDb::create("fallback").await;
    db.append_config("\n[retention]\nperiod = \"7d\"\n");
    db.create_slot().await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let config = db.config();

    // One writer at a steady rate; retention takes a checkpoint every 200 ms.
    let url = db.url.clone();
    let writing = tokio::spawn(async move {
        let client = harness::connect(&url).await;
        let mut keys = Vec::new();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(8) {
            let key: String = client
                .query_one("SELECT outbox_enqueue('order', 'e', 'created', '{}')", &[])
                .await
                .unwrap()
                .get(0);
            keys.push(key);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        keys
    });
    // Checkpoints every 500 ms; the relay is killed 400 ms after one, so about a
    // whole checkpoint interval of delivered rows is not covered (the worst case).
    let start = Instant::now();
    let mut relay = Some(relay);
    let mut killed_at = None;
    while !writing.is_finished() {
        cycle(&config).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        if start.elapsed() > Duration::from_secs(4) && killed_at.is_none() {
            if let Some(r) = relay.take() {
                r.kill9().await;
            }
            killed_at = Some(count(&db, "SELECT count(*) FROM outbox").await);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let keys = writing.await.unwrap();
    let at_kill = killed_at.unwrap();
    if drop_slot {
        // The walsender of the killed relay may hold the slot a moment longer.
        wait_until(Duration::from_secs(30), "the slot dropped", || async {
            db.client
                .execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                      WHERE slot_name = $1 AND NOT active",
                    &[&db.slot],
                )
                .await
                .unwrap();
            count(
                &db,
                &format!(
                    "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{}'",
                    db.slot
                ),
            )
            .await
                == 0
        })
        .await;
    }

    let args = PollArgs {
        after_cdc: true,
        batch_size: 100,
        poll_interval_ms: 50,
        ..PollArgs::default()
    };
    let (stop, task) = run_poller(config.clone(), args).await;
    wait_until(
        Duration::from_secs(60),
        "the poller sent every unsent row",
        || async { count(&db, "SELECT count(*) FROM outbox WHERE sent_at IS NULL").await == 0 },
    )
    .await;
    let _ = stop.send(());
    let summary = task.await.unwrap();

    let expected: HashSet<&str> = keys.iter().map(String::as_str).collect();
    // Every key, then the whole topic: the poller's re-sends count as duplicates.
    let (first, _) = harness::read_keys(&db.topic, &expected).await;
    let records = harness::reread(&db.topic, &first, Duration::from_secs(3)).await;
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for r in &records {
        *seen
            .entry(r.header("idempotency_key").unwrap())
            .or_default() += 1;
    }
    let lost: Vec<&String> = keys
        .iter()
        .filter(|k| !seen.contains_key(k.as_str()))
        .collect();
    assert!(
        lost.is_empty(),
        "{} lost, e.g. {:?}",
        lost.len(),
        lost.first()
    );
    let duplicates = records.len() - seen.len();
    let resent_by_poller = summary.delivered;
    println!(
        "fallback (slot dropped: {drop_slot}): {} events, {} written before the kill, {} marked from the checkpoint, \
         {} published by the poller, {duplicates} duplicates",
        keys.len(),
        at_kill,
        summary.marked_after_cdc,
        resent_by_poller
    );
    assert!(
        summary.marked_after_cdc > 0,
        "the checkpoint covered nothing"
    );
    // Duplicates are the poller's re-sends of rows the relay had delivered after the
    // checkpoint: never more than what the poller published, and at most the rows
    // written before the kill that the checkpoint did not cover.
    assert!(duplicates as u64 <= resent_by_poller);
    let uncovered_before_kill = u64::try_from(at_kill).unwrap() - summary.marked_after_cdc;
    assert!(
        duplicates as u64 <= uncovered_before_kill,
        "{duplicates} duplicates > {uncovered_before_kill} rows after the checkpoint"
    );
    db.drop_slot().await;
}

/// `retention` without `--once` runs a cycle per interval and stops on SIGTERM.
#[tokio::test]
async fn retention_command_runs_cycles_until_sigterm() {
    let mut db = TestDb::create("ret_cli").await;
    db.append_config("\n[retention]\nperiod = \"0s\"\ninterval = \"200ms\"\n");
    db.create_slot().await;
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(["retention", "--json", "--config"])
        .arg(&db.config_path)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let checkpoints = "SELECT count(*) FROM outbox_relay_checkpoint";
    wait_until(Duration::from_secs(30), "a few cycles", || async {
        count(&db, checkpoints).await >= 3
    })
    .await;
    let status = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let out = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert!(out.status.success(), "{:?}", out.status);
    let lines = String::from_utf8_lossy(&out.stdout);
    assert!(lines.lines().count() >= 3, "{lines}");
    for line in lines.lines() {
        let report: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(report["dry_run"], false);
    }
    db.drop_slot().await;
}

/// A truncated poison copy is replayed from its original outbox row, so retention
/// keeps that row, however old and however delivered it looks, until the copy is
/// replayed.
#[tokio::test]
async fn retention_keeps_the_original_of_a_truncated_poison_copy_until_it_is_replayed() {
    let mut db = TestDb::create("ret_poison").await;
    db.append_config("\n[retention]\nperiod = \"0s\"\n");
    let config = db.config();
    let poison = config.outbox.poison_table.clone();
    let id: String = db
        .client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, sent_at)
             VALUES ('order', 'o1', 'Created', '{\"big\": true}', now())
             RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    db.client
        .execute(
            &format!(
                "INSERT INTO {poison} (outbox_id, payload, error, error_kind, attempts, truncated)
                 VALUES ($1, '{{\"bi', 'too large', 'msg_size_too_large', 1, true)"
            ),
            &[&id],
        )
        .await
        .unwrap();
    let report = cycle(&config).await;
    assert_eq!(
        report.deleted_rows, 0,
        "the original of an unreplayed truncated copy"
    );
    assert_eq!(count(&db, "SELECT count(*) FROM outbox").await, 1);
    db.client
        .execute(&format!("UPDATE {poison} SET replayed_at = now()"), &[])
        .await
        .unwrap();
    let report = cycle(&config).await;
    assert_eq!(report.deleted_rows, 1, "replayed: the original may go");
    assert_eq!(count(&db, "SELECT count(*) FROM outbox").await, 0);
}
