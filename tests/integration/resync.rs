//! A resync keeps the stream's contract for the rows it publishes: commit order per
//! key, and `relay.on_poison` (`halt` holds, `park-key` parks). Each test stops a
//! streaming relay, drops its slot, commits a backlog while it is gone, and starts
//! it again: the relay finds the slot lost and resyncs. Real relay processes,
//! PostgreSQL and broker; the failing row is a record above the producer's
//! `message.max.bytes`, refused by the real producer.

use std::time::Duration;

use crate::harness::{
    self, PrivateCluster, RelayProcess, TestDb, consume, key_sequence as sequence,
    oversize_payload as oversize,
};

fn small(seq: i64) -> String {
    format!(r#"{{"seq": {seq}}}"#)
}

async fn insert(db: &TestDb, entity: &str, payload: &str) -> String {
    db.client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', $1, 'OrderPlaced', $2::text::jsonb) RETURNING id::text",
            &[&entity, &payload],
        )
        .await
        .unwrap()
        .get(0)
}

/// Waits until `entity`'s records (first deliveries, in offset order) are `seqs`
/// (failing on a wrong prefix or after 120 s); returns every record.
async fn delivered(
    db: &TestDb,
    entity: &str,
    seqs: &[i64],
    relay: &RelayProcess,
) -> Vec<harness::Record> {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let records = consume(&db.topic, usize::MAX, Duration::from_secs(2)).await;
        let got = sequence(&records, entity);
        assert!(
            seqs.starts_with(&got),
            "{entity}: {got:?} is not in order {seqs:?}; log:\n{}",
            relay.log()
        );
        if got == seqs {
            return records;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{entity}: only {got:?} of {seqs:?}; log:\n{}",
            relay.log()
        );
    }
}

/// A database whose relay streamed once and stopped, with its slot dropped: the
/// next start resyncs. `policy` is appended to `[relay]`.
async fn lost_slot_db(prefix: &str, policy: &str) -> TestDb {
    lost_slot_db_in(&harness::env().pg_url, prefix, policy).await
}

/// [`lost_slot_db`] in the cluster whose superuser URL is `pg_url`.
async fn lost_slot_db_in(pg_url: &str, prefix: &str, policy: &str) -> TestDb {
    let mut db = TestDb::create_in(pg_url, prefix, 1, "").await;
    db.append_config(&format!(
        "\n[relay]\ncutover = \"off\"\nmax_attempts = 2\n{policy}\n\
         \n[kafka.producer]\n\"message.max.bytes\" = \"100000\"\n"
    ));
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    insert(&db, "warmup", &small(0)).await;
    harness::consume_exactly(&db.topic, 1, Duration::from_secs(60), &relay).await;
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
    db
}

/// While the slot is lost: a:0, b:0, a:1 (too large), b:1, a:2, a:3, b:2.
async fn write_backlog_with_an_undeliverable_row(db: &TestDb) {
    insert(db, "a", &small(0)).await;
    insert(db, "b", &small(0)).await;
    insert(db, "a", &oversize(1)).await;
    insert(db, "b", &small(1)).await;
    insert(db, "a", &small(2)).await;
    insert(db, "a", &small(3)).await;
    insert(db, "b", &small(2)).await;
}

/// The position row's recorded slot loss (`None`: no loss is recorded).
async fn slot_lost_reason(db: &TestDb) -> Option<String> {
    db.client
        .query_one(
            "SELECT slot_lost_reason FROM outbox_relay_position WHERE slot_name = $1",
            &[&db.slot],
        )
        .await
        .unwrap()
        .get(0)
}

/// `(holds_key, parked, other)` poison rows.
async fn poison_kinds(db: &TestDb) -> (i64, i64, i64) {
    let row = db
        .client
        .query_one(
            "SELECT count(*) FILTER (WHERE holds_key), count(*) FILTER (WHERE parked),
                    count(*) FILTER (WHERE NOT holds_key AND NOT parked)
             FROM poison_outbox",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2))
}

/// Rows committed while the slot was lost, a:1 too large: under `park-key` the
/// resync poisons a:1 as holding the key and parks a:2, a:3; b flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_parks_the_key_of_a_poisoned_row() {
    let db = lost_slot_db("resync_park", "on_poison = \"park-key\"").await;
    write_backlog_with_an_undeliverable_row(&db).await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    harness::wait_until(
        Duration::from_secs(60),
        "one row holding a, two parked",
        || async { poison_kinds(&db).await == (1, 2, 0) },
    )
    .await;
    // Streaming after the resync: a stays parked, b flows.
    insert(&db, "a", &small(4)).await;
    insert(&db, "b", &small(3)).await;
    harness::wait_until(Duration::from_secs(60), "a:4 parked too", || async {
        poison_kinds(&db).await == (1, 3, 0)
    })
    .await;
    let records = delivered(&db, "b", &[0, 1, 2, 3], &relay).await;
    assert_eq!(sequence(&records, "a"), vec![0], "{}", relay.log());
    assert!(relay.log().contains("resync complete"), "{}", relay.log());
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// Under `halt` the resync poisons nothing and publishes nothing of a after a:1; b
/// flows, the slot stays lost (streaming does not start) while the relay keeps
/// trying. Once the cause is fixed a:1, a:2, a:3 are published in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_halts_on_an_undeliverable_row() {
    let db = lost_slot_db("resync_halt", "on_poison = \"halt\"").await;
    write_backlog_with_an_undeliverable_row(&db).await;
    let mut relay = RelayProcess::start(&db.config_path, &[]);
    harness::wait_until(Duration::from_secs(60), "the resync halts", || async {
        relay.log().contains("relay.on_poison = \\\"halt\\\"")
            || relay.log().contains("relay.on_poison = \"halt\"")
    })
    .await;
    let records = delivered(&db, "b", &[0, 1, 2], &relay).await;
    assert_eq!(sequence(&records, "a"), vec![0], "{}", relay.log());
    assert_eq!(poison_kinds(&db).await, (0, 0, 0));
    let lost = slot_lost_reason(&db).await;
    assert!(lost.is_some(), "the resync must not complete");
    assert!(relay.is_running(), "{}", relay.log());

    // The cause is fixed: the producer takes larger records now (a restart, as any
    // configuration change).
    relay.terminate(Duration::from_secs(30)).await;
    let config = std::fs::read_to_string(&db.config_path).unwrap();
    std::fs::write(
        &db.config_path,
        config.replace(
            "\"message.max.bytes\" = \"100000\"",
            "\"message.max.bytes\" = \"1000000\"",
        ),
    )
    .unwrap();
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    insert(&db, "a", &small(4)).await;
    delivered(&db, "a", &[0, 1, 2, 3, 4], &relay).await;
    assert_eq!(poison_kinds(&db).await, (0, 0, 0));
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// The backlog's order is the commit order, not the insert order (`created_at`, the
/// id, or the xid, all handed out at the insert): with `track_commit_timestamp =
/// on`, of two writers of one key that do not lock it, the one that inserted first
/// and committed second is published second, as the stream would have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_publishes_in_commit_order() {
    let cluster = PrivateCluster::start("logical").await;
    harness::connect(&cluster.url)
        .await
        .batch_execute("ALTER SYSTEM SET track_commit_timestamp = on")
        .await
        .unwrap();
    cluster.restart("fast").await;
    let db = lost_slot_db_in(&cluster.url, "resync_order", "").await;
    let early = harness::connect(&db.url).await;
    // `early` inserts seq 0 first and commits after seq 1 was committed.
    early
        .batch_execute(&format!(
            "BEGIN; INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'k', 'OrderPlaced', '{}'::jsonb)",
            small(0)
        ))
        .await
        .unwrap();
    insert(&db, "k", &small(1)).await;
    early.batch_execute("COMMIT").await.unwrap();
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    delivered(&db, "k", &[1, 0], &relay).await;
    assert!(relay.log().contains("resync complete"), "{}", relay.log());
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// The candidates, delivered checkpoint and its LSN of the position row.
async fn checkpoints(db: &TestDb) -> (Vec<String>, Vec<i64>, Option<i64>, Option<String>) {
    let row = db
        .client
        .query_one(
            "SELECT candidate_lsns::text[], candidate_xmins::text[]::bigint[],
                    delivered_xmin::text::bigint, delivered_lsn::text
             FROM outbox_relay_position",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

/// The xmin of a snapshot taken now: no transaction id below it is still running.
async fn snapshot_xmin(db: &TestDb) -> i64 {
    db.client
        .query_one(
            "SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// While the confirmed position lags several saves behind the WAL, every save keeps
/// a candidate checkpoint, and a save promotes the newest one the position passed
/// (one candidate at a time used to keep `delivered_xmin` about two lags behind:
/// the rows a resync sends again). At most 16 are kept, the newest replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_position_promotes_the_newest_checkpoint_it_passed() {
    use outbox_relay::lsn::Lsn;
    use outbox_relay::outbox::position::{PositionTable, ServerHistory};
    let db = TestDb::create_with("position_checkpoints", 1).await;
    let positions = PositionTable::new(&db.config()).unwrap();
    let history = ServerHistory {
        system_identifier: 1,
        timeline: 1,
    };
    let start = Lsn::from(harness::parse_lsn("0/1000"));
    positions
        .adopt(&db.client, history, start, false)
        .await
        .unwrap();
    // Three saves that confirm nothing new, each after a write: three candidates.
    for seq in 0..3 {
        insert(&db, "k", &small(seq)).await;
        assert!(positions.save(&db.client, history, start).await.unwrap());
    }
    let (lsns, xmins, delivered, _) = checkpoints(&db).await;
    assert_eq!(lsns.len(), 3, "{lsns:?}");
    assert!(xmins.windows(2).all(|w| w[0] <= w[1]), "{xmins:?}");
    assert_eq!(delivered, None);
    // The position passes the second candidate: it is promoted, the third is kept.
    let passed = Lsn::from(harness::parse_lsn(&lsns[1]));
    assert!(positions.save(&db.client, history, passed).await.unwrap());
    let (after, _, delivered, delivered_lsn) = checkpoints(&db).await;
    assert_eq!(
        delivered,
        Some(xmins[1]),
        "the newest passed, not the oldest"
    );
    assert_eq!(delivered_lsn.as_deref(), Some(lsns[1].as_str()));
    assert_eq!(after[0], lsns[2], "{after:?}");
    // Many saves without progress: 16 kept, the oldest stay, the newest is fresh.
    // Transaction ids are cluster-wide and other tests run beside this one, so
    // "fresh" is "not older than a snapshot taken just before the last save".
    let mut before_last_save = 0;
    for seq in 0..30 {
        insert(&db, "k", &small(seq)).await;
        before_last_save = snapshot_xmin(&db).await;
        assert!(positions.save(&db.client, history, passed).await.unwrap());
    }
    let (full, full_xmins, _, _) = checkpoints(&db).await;
    assert_eq!(full.len(), 16, "{full:?}");
    assert_eq!(full[0], lsns[2]);
    assert!(
        full_xmins.windows(2).all(|w| w[0] <= w[1]),
        "{full_xmins:?}"
    );
    assert!(
        full_xmins[15] >= before_last_save,
        "newest candidate {} is stale (snapshot before the save: {before_last_save})",
        full_xmins[15]
    );
    // A save that confirms everything written so far (an idle outbox after a
    // burst) promotes its own candidate: no later save has to pass it.
    insert(&db, "k", &small(99)).await;
    let insert_lsn: String = db
        .client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let everything = Lsn::from(harness::parse_lsn(&insert_lsn) + 0x10_0000);
    assert!(
        positions
            .save(&db.client, history, everything)
            .await
            .unwrap()
    );
    let (left, _, delivered, delivered_lsn) = checkpoints(&db).await;
    assert!(left.is_empty(), "every candidate passed: {left:?}");
    let delivered = delivered.expect("a delivered checkpoint");
    // A transaction of another test may hold the cluster's xmin where it was at
    // the previous save, so only "not older" holds; the LSN below tells the
    // candidates apart.
    assert!(
        delivered >= full_xmins[15],
        "{delivered} after {full_xmins:?}"
    );
    let delivered_lsn = harness::parse_lsn(&delivered_lsn.expect("its LSN"));
    assert!(delivered_lsn >= harness::parse_lsn(&insert_lsn));
}

/// An adopted layout without the columns a resync marks rows with: a lost slot is
/// refused at once with exit 3, in the resync's terms and with both ways out, and
/// nothing is recorded (no loss marked, no slot made).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_the_layout_cannot_carry_is_refused_with_the_ways_out() {
    let db = lost_slot_db("resync_nocols", "").await;
    db.client
        .batch_execute("ALTER TABLE outbox DROP COLUMN sent_at, DROP COLUMN attempts")
        .await
        .unwrap();
    insert(&db, "k", &small(1)).await;
    let mut relay = RelayProcess::start(&db.config_path, &[]);
    let status = relay.wait(Duration::from_secs(60)).await;
    assert_eq!(status.code(), Some(3), "{}", relay.log());
    let log = relay.log();
    assert!(log.contains("cannot be resynced"), "{log}");
    assert!(log.contains("ALTER TABLE"), "{log}");
    assert!(log.contains("delete the slot's row"), "{log}");
    let lost = slot_lost_reason(&db).await;
    assert_eq!(lost, None, "nothing recorded");
    assert!(!db.slot_exists().await, "no slot made");
}

/// Every record of `entity`, duplicates included, as the seqs of their payloads in
/// offset order (a compacted topic's reader sees the last one as the state).
fn every_seq(records: &[harness::Record], entity: &str) -> Vec<i64> {
    let mut mine: Vec<&harness::Record> = records
        .iter()
        .filter(|r| r.key.as_deref() == Some(entity.as_bytes()))
        .collect();
    mine.sort_by_key(|r| (r.partition, r.offset));
    mine.iter()
        .map(|r| {
            let v: serde_json::Value =
                serde_json::from_slice(r.payload.as_deref().unwrap()).unwrap();
            v["seq"].as_i64().unwrap()
        })
        .collect()
}

/// Produces the record the relay makes of outbox row `id` (key, value, idempotency
/// key, and the row's `created_at` as its timestamp), as the lost slot's stream
/// would have delivered it.
async fn deliver_as_the_stream_did(db: &TestDb, id: &str) {
    let row = db
        .client
        .query_one(
            "SELECT aggregate_id, payload::text, idempotency_key,
                    (extract(epoch FROM created_at) * 1000)::int8
             FROM outbox WHERE id::text = $1",
            &[&id],
        )
        .await
        .unwrap();
    let (key, value, idempotency_key, created_ms): (String, String, String, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    let topic = db.topic.clone();
    tokio::task::spawn_blocking(move || {
        use rdkafka::ClientConfig;
        use rdkafka::message::{Header, OwnedHeaders};
        use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
        let producer: BaseProducer = ClientConfig::new()
            .set("bootstrap.servers", &harness::env().brokers)
            .create()
            .expect("create producer");
        let headers = OwnedHeaders::new().insert(Header {
            key: "idempotency_key",
            value: Some(idempotency_key.as_bytes()),
        });
        producer
            .send(
                BaseRecord::to(&topic)
                    .key(key.as_bytes())
                    .payload(value.as_bytes())
                    .timestamp(created_ms)
                    .headers(headers),
            )
            .map_err(|(e, _)| e)
            .expect("queue the record");
        producer
            .flush(Duration::from_secs(30))
            .expect("the record acknowledged");
    })
    .await
    .unwrap();
}

/// While the slot was lost, k:0 then k:1 were committed. The topic holds k:1's
/// record but not k:0's: the stream delivered both and the log cleaner of a
/// compacted topic removed k:0's once k:1 superseded it (the broker here does not
/// compact, so the test produces k:1's record alone). The resync publishes k:0 and
/// must then publish k:1 again rather than skip it as held: skipped, the key's
/// latest record would be k:0, and a compacted topic's state for `k` would go back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_that_publishes_a_key_again_ends_it_with_its_latest_row() {
    let db = lost_slot_db("resync_latest", "").await;
    insert(&db, "k", &small(0)).await;
    let later = insert(&db, "k", &small(1)).await;
    insert(&db, "held", &small(0)).await;
    deliver_as_the_stream_did(&db, &later).await;
    let held = db
        .client
        .query_one(
            "SELECT id::text FROM outbox WHERE aggregate_id = 'held'",
            &[],
        )
        .await
        .unwrap()
        .get::<_, String>(0);
    deliver_as_the_stream_did(&db, &held).await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    // The backlog is acked before streaming starts.
    let log = relay.log();
    assert!(log.contains("resync complete"), "{log}");
    let records = consume(&db.topic, usize::MAX, Duration::from_secs(5)).await;
    let seqs = every_seq(&records, "k");
    assert_eq!(
        seqs,
        [1, 0, 1],
        "k's records: the planted k:1, then k:0 and k:1 published again; log:\n{log}"
    );
    // `held`'s record was there and nothing of its key was published: skipped.
    let held_records = records
        .iter()
        .filter(|r| r.key.as_deref() == Some(b"held".as_slice()))
        .count();
    assert_eq!(held_records, 1, "held is not published again; log:\n{log}");
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// [`a_resync_that_publishes_a_key_again_ends_it_with_its_latest_row`], with the
/// resync that published k:0 again stopped before k:1: k:0 is marked sent and its
/// new record follows k:1's. The resync that starts over reads k:1 alone and finds
/// its record; it must see the older record after it and publish k:1 again, or the
/// key's latest record stays k:0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_started_over_ends_a_key_with_its_latest_row() {
    let db = lost_slot_db("resync_over", "").await;
    let earlier = insert(&db, "k", &small(0)).await;
    let later = insert(&db, "k", &small(1)).await;
    deliver_as_the_stream_did(&db, &later).await;
    // What the resync that stopped did: published k:0 again and marked it sent.
    deliver_as_the_stream_did(&db, &earlier).await;
    db.client
        .execute(
            "UPDATE outbox SET sent_at = clock_timestamp() WHERE id::text = $1",
            &[&earlier],
        )
        .await
        .unwrap();
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let log = relay.log();
    assert!(log.contains("resync complete"), "{log}");
    let records = consume(&db.topic, usize::MAX, Duration::from_secs(5)).await;
    let seqs = every_seq(&records, "k");
    assert_eq!(seqs, [1, 0, 1], "k ends with its latest row; log:\n{log}");
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}
