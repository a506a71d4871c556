//! PostgreSQL 17 failover slots: the relay creates its slot with `FAILOVER true`,
//! a standby with `sync_replication_slots = on` keeps a synced copy, and after the
//! primary dies and the standby is promoted the relay resumes from that copy: no
//! event lost, per-key order kept, duplicates only among what the dead relay had
//! delivered past the synced position.
//!
//! It needs a PostgreSQL 17 primary and a streaming standby set up for slot
//! synchronization, which the main suite does not have: it is `#[ignore]`d there
//! and run by `scripts/pg17-failover-drill`, which starts both (and a broker) and
//! passes them in `OUTBOX_RELAY_PG17_PRIMARY_URL` and
//! `OUTBOX_RELAY_PG17_STANDBY_URL` (superuser URLs of their `postgres` database).
//! Run without them, it fails and says so; it never skips.

use std::time::{Duration, Instant};

use tokio_postgres::Client;

use crate::harness::{
    self, RelayProcess, TestDb, assert_per_key_order, consume, consume_unique, deliveries, tally,
};

/// Events written on the primary before the kill, at least (more when the slot took
/// long to be synced: the kill still comes with events in flight).
const BEFORE_KILL: i64 = 2_000;
const AFTER_PROMOTION: i64 = 1_000;
/// The killed relay's in-flight window (`relay.max_in_flight_events`): what it can
/// have delivered past what it confirmed.
const WINDOW: usize = 200;
/// Events written at a time while waiting for the slot to be synced.
const CHUNK: i64 = 50;

/// A variable the drill sets; its absence is a failure, not a skip.
fn required(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| {
        panic!(
            "{name} is not set: this test needs a PostgreSQL 17 primary and a standby with \
             sync_replication_slots = on; run it with scripts/pg17-failover-drill"
        )
    })
}

/// Commits rows `seqs` as single-row transactions, 13 entities round robin.
pub(crate) async fn write(client: &Client, seqs: std::ops::Range<i64>) {
    client
        .batch_execute(&format!(
            "DO $$ BEGIN
               FOR g IN {}..{} LOOP
                 INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', 'e' || (g % 13), 'Created', jsonb_build_object('seq', g));
                 COMMIT;
               END LOOP;
             END $$",
            seqs.start,
            seqs.end - 1
        ))
        .await
        .expect("write events");
}

async fn lsn_of(client: &Client, sql: &str) -> u64 {
    let v: Option<i64> = client
        .query_one(sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .get(0);
    v.map_or(0, |v| u64::try_from(v).unwrap_or(0))
}

/// `(synced, temporary, failover, confirmed_flush)` of `slot` on a server.
async fn slot_row(client: &Client, slot: &str) -> Option<(bool, bool, bool, u64)> {
    client
        .query_opt(
            "SELECT synced, temporary, failover,
                    coalesce((confirmed_flush_lsn - '0/0'::pg_lsn)::bigint, 0)
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("read pg_replication_slots")
        .map(|r| {
            (
                r.get(0),
                r.get(1),
                r.get(2),
                u64::try_from(r.get::<_, i64>(3)).unwrap_or(0),
            )
        })
}

fn lsn_text(lsn: u64) -> String {
    outbox_relay::Lsn(lsn).to_string()
}

/// The URL of `db` on another server of the same cluster (the standby).
fn on_server(db: &TestDb, server_url: &str) -> String {
    harness::database_url(server_url, &db.name)
}

/// Stops a PostgreSQL server at once, as `pg_ctl stop -m immediate` does (SIGQUIT
/// to the postmaster): the primary dies.
async fn crash(client: &Client) {
    let data_dir: String = client
        .query_one("SHOW data_directory", &[])
        .await
        .expect("read data_directory")
        .get(0);
    let pid_file = std::path::Path::new(&data_dir).join("postmaster.pid");
    let text = std::fs::read_to_string(&pid_file)
        .unwrap_or_else(|e| panic!("read {}: {e}", pid_file.display()));
    let pid = text.lines().next().expect("the postmaster's pid").trim();
    let status = std::process::Command::new("kill")
        .args(["-QUIT", pid])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -QUIT {pid} failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a PostgreSQL 17 primary and standby: scripts/pg17-failover-drill"]
async fn pg17_failover_resumes_from_the_synced_slot_on_the_promoted_standby() {
    let primary_url = required("OUTBOX_RELAY_PG17_PRIMARY_URL");
    let standby_url = required("OUTBOX_RELAY_PG17_STANDBY_URL");
    let admin = harness::connect(&primary_url).await;
    let version: i32 = admin
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .expect("server_version_num")
        .get(0);
    assert!(
        version >= 170_000,
        "{primary_url} is PostgreSQL {version}, not 17 or later"
    );
    let standby_admin = harness::connect(&standby_url).await;
    let settings: (bool, String, String) = {
        let row = standby_admin
            .query_one(
                "SELECT pg_is_in_recovery(), current_setting('sync_replication_slots'),
                        current_setting('hot_standby_feedback')",
                &[],
            )
            .await
            .expect("read the standby's settings");
        (row.get(0), row.get(1), row.get(2))
    };
    assert_eq!(
        settings,
        (true, "on".to_owned(), "on".to_owned()),
        "{standby_url} must be a standby with sync_replication_slots and hot_standby_feedback on"
    );

    let mut db = TestDb::create_in(&primary_url, "pg17_failover", 3, "").await;
    db.append_config("\n[relay]\non_slot_loss = \"fail\"\n");
    let started = Instant::now();
    let window = WINDOW.to_string();
    let relay = RelayProcess::start(
        &db.config_path,
        &[("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS", window.as_str())],
    );
    db.wait_streaming(&relay).await;
    // PostgreSQL 17: the relay made a failover slot.
    let (_, _, failover, _) = slot_row(&db.client, &db.slot)
        .await
        .expect("the relay created its slot");
    assert!(
        failover,
        "the relay's slot on PostgreSQL 17 is not a failover slot"
    );

    // The standby's copy of a new slot stays temporary (not usable after a
    // promotion) until the primary's slot has moved past what the standby itself
    // reserved for it: the relay must confirm past a running-transactions record
    // logged after the copy was made (every 15 s on a busy server; sooner with
    // pg_log_standby_snapshot()).
    let replica = harness::connect(&on_server(&db, &standby_url)).await;
    let mut written = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        write(&db.client, written..written + CHUNK).await;
        written += CHUNK;
        db.client
            .execute("SELECT pg_log_standby_snapshot()", &[])
            .await
            .expect("pg_log_standby_snapshot");
        if matches!(
            slot_row(&replica, &db.slot).await,
            Some((true, false, true, _))
        ) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the slot was not synced to the standby within 120 s: {:?}; relay log:\n{}",
            slot_row(&replica, &db.slot).await,
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let sync_ready = started.elapsed();
    eprintln!(
        "the slot is sync-ready on the standby {} ms after the relay started ({written} events written)",
        sync_ready.as_millis()
    );
    // More events, and the relay killed while it delivers them.
    let before_kill = BEFORE_KILL.max(written + 10 * CHUNK);
    write(&db.client, written..before_kill).await;
    relay.kill9().await;
    let killed_at = started.elapsed();
    let delivered_before = tally(&consume(&db.topic, usize::MAX, Duration::from_secs(2)).await).0;

    // The standby has every committed row and the slot as the primary left it.
    let primary_end = lsn_of(
        &db.client,
        "SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::bigint",
    )
    .await;
    let wait_start = Instant::now();
    let deadline = wait_start + Duration::from_secs(90);
    let (primary_slot, synced) = loop {
        // The killed relay's walsender goes away (at the latest within
        // wal_sender_timeout); the primary's slot stands still after that.
        let primary_slot = harness::confirmed_flush(&db.client, &db.slot).await;
        let replayed = lsn_of(
            &replica,
            "SELECT (pg_last_wal_replay_lsn() - '0/0'::pg_lsn)::bigint",
        )
        .await;
        let synced = slot_row(&replica, &db.slot).await;
        if replayed >= primary_end
            && matches!(synced, Some((true, false, true, at)) if at == primary_slot)
        {
            break (primary_slot, synced);
        }
        assert!(
            Instant::now() < deadline,
            "within 90 s the standby did not replay the primary's WAL (to {}: at {}) and sync \
             the slot to the primary's position {} (synced, temporary, failover, confirmed: \
             {synced:?})",
            lsn_text(primary_end),
            lsn_text(replayed),
            lsn_text(primary_slot),
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let sync_wait = wait_start.elapsed();
    eprintln!(
        "slot synced on the standby at {} (the primary's slot at {}, its WAL end {}) {} ms after the kill",
        lsn_text(synced.map_or(0, |s| s.3)),
        lsn_text(primary_slot),
        lsn_text(primary_end),
        sync_wait.as_millis()
    );

    // The primary dies; the standby is promoted.
    crash(&admin).await;
    let promote_start = Instant::now();
    let promoted: bool = standby_admin
        .query_one("SELECT pg_promote(true, 60)", &[])
        .await
        .expect("pg_promote")
        .get(0);
    assert!(promoted, "the standby was not promoted within 60 s");
    let promotion = promote_start.elapsed();
    let promoted_url = on_server(&db, &standby_url);
    let promoted_client = harness::connect(&promoted_url).await;
    let in_recovery: bool = promoted_client
        .query_one("SELECT pg_is_in_recovery()", &[])
        .await
        .expect("pg_is_in_recovery")
        .get(0);
    assert!(!in_recovery, "the promoted server is still in recovery");
    let (_, temporary, failover, at) = slot_row(&promoted_client, &db.slot)
        .await
        .expect("the synced slot is on the promoted server");
    assert!(
        !temporary && failover,
        "the promoted server's slot: temporary {temporary}, failover {failover}"
    );
    eprintln!(
        "promoted in {} ms; the slot there is at {}",
        promotion.as_millis(),
        lsn_text(at)
    );

    // Writers follow the new primary; so does the relay (its config points there).
    write(&promoted_client, before_kill..before_kill + AFTER_PROMOTION).await;
    let config = std::fs::read_to_string(&db.config_path)
        .expect("the test config")
        .replace(&db.url, &promoted_url);
    let promoted_config = db.config_path.with_extension("promoted.toml");
    std::fs::write(&promoted_config, config).expect("write the promoted config");
    let resume_start = Instant::now();
    let relay = RelayProcess::start(&promoted_config, &[]);
    let total = usize::try_from(before_kill + AFTER_PROMOTION).unwrap();
    let first = consume_unique(&db.topic, total, Duration::from_secs(180), &relay).await;
    let caught_up = resume_start.elapsed();
    // Read a little longer: late duplicates count too.
    let records = harness::reread(&db.topic, &first, Duration::from_secs(3)).await;
    let (unique, duplicates) = tally(&records);
    let lost = total.saturating_sub(unique);
    eprintln!(
        "pg17 failover: {total} events ({before_kill} on the primary, {AFTER_PROMOTION} after the \
         promotion), {delivered_before} delivered before the kill -9 at {} ms; promotion {} ms; \
         all delivered {} ms after the relay started on the promoted server; lost {lost}, \
         duplicates {duplicates}",
        killed_at.as_millis(),
        promotion.as_millis(),
        caught_up.as_millis()
    );
    let log = relay.log();
    assert_eq!(unique, total, "events lost; log:\n{log}");
    assert_per_key_order(&records);
    // Only what the killed relay had delivered can come again, and once at most:
    // its in-flight window and what it resolved after the last position it
    // confirmed (saves come at least every half window), which the synced slot
    // had caught up with.
    assert!(
        duplicates <= delivered_before,
        "{duplicates} duplicates, more than the {delivered_before} events delivered before the kill"
    );
    assert!(
        duplicates <= 3 * WINDOW,
        "{duplicates} duplicates, more than three in-flight windows of {WINDOW}; log:\n{log}"
    );
    assert!(
        deliveries(&records).values().all(|&n| n <= 2),
        "an event was delivered more than twice"
    );
    // The synced slot was trusted: streamed from, on the new timeline, no resync.
    assert!(
        !log.contains("replication slot lost"),
        "the synced slot was not trusted; log:\n{log}"
    );
    assert!(
        log.contains(&format!("streaming slot={} from={}", db.slot, lsn_text(at))),
        "the relay did not stream from the synced slot's position; log:\n{log}"
    );
    let (resyncs, lost_reason): (i64, Option<String>) = {
        let row = promoted_client
            .query_one(
                "SELECT resyncs, slot_lost_reason FROM outbox_relay_position WHERE slot_name = $1",
                &[&db.slot],
            )
            .await
            .expect("the relay's position row");
        (row.get(0), row.get(1))
    };
    assert_eq!((resyncs, lost_reason), (0, None));
    relay.terminate(Duration::from_secs(30)).await;
}
