//! Sharding (`postgres.shards`): one relay process per shard, each streaming its own
//! publication (a row filter on a hash of the entity id) through its own slot. The
//! tests run the real binary against the real walsenders and check what the shards
//! promise: every event exactly once, each entity wholly in one shard and in order,
//! a shard's cutover publishing its own rows only, `status` showing every shard's
//! slot, and `migrate` refusing a change of the shard count.

use std::collections::HashSet;
use std::time::Duration;

use outbox_relay::tools::workload::Workload;

use crate::harness::{self, RelayProcess, TestDb, assert_per_key_order, consume_exactly};

const SHARDS: u32 = 2;

/// `migrate` again with the shard count, which adds the shards' publications.
fn migrate_sharded(db: &TestDb, shards: u32) -> std::process::Output {
    harness::run_cli(&[
        "migrate",
        "--config",
        db.config_path.to_str().unwrap(),
        "--set",
        &format!("postgres.shards={shards}"),
    ])
}

fn shard_env(shard: u32) -> [(String, String); 2] {
    [
        ("OUTBOX_RELAY__POSTGRES__SHARDS".into(), SHARDS.to_string()),
        ("OUTBOX_RELAY__POSTGRES__SHARD".into(), shard.to_string()),
    ]
}

fn start_shard(db: &TestDb, shard: u32) -> RelayProcess {
    let env = shard_env(shard);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    RelayProcess::start(&db.config_path, &env)
}

/// Waits until the relay streams from shard `shard`'s slot.
async fn wait_streaming(db: &TestDb, relay: &RelayProcess, shard: u32) {
    db.wait_streaming_on(relay, &format!("{}_shard{shard}", db.slot))
        .await;
}

/// The idempotency keys of the outbox rows in shard `shard`, by the same hash the
/// publications filter on.
async fn keys_in_shard(db: &TestDb, shard: u32) -> HashSet<String> {
    db.client
        .query(
            "SELECT idempotency_key FROM outbox
              WHERE (hashtext(coalesce(aggregate_id::text COLLATE \"C\", '')) & 2147483647) % $1 = $2",
            &[
                &i32::try_from(SHARDS).unwrap(),
                &i32::try_from(shard).unwrap(),
            ],
        )
        .await
        .expect("read the shard's rows")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

fn keys_of(records: &[harness::Record]) -> Vec<String> {
    records
        .iter()
        .map(|r| {
            r.header("idempotency_key")
                .expect("idempotency_key")
                .to_owned()
        })
        .collect()
}

/// Writes `per_writer` events from each of 4 writers; returns their idempotency keys.
async fn write(db: &TestDb, per_writer: u64) -> HashSet<String> {
    let workload = Workload {
        events: 4 * per_writer,
        payload_bytes: 100,
        rows_per_tx: 4,
        writers: 4,
        entities: 24,
    };
    db.writers(workload)
        .run()
        .await
        .expect("write the workload")
        .committed
        .into_iter()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_shards_relay_every_event_once_and_keep_each_key_in_one_shard() {
    let db = TestDb::create("shards").await;
    let out = migrate_sharded(&db, SHARDS);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("shard publication outbox_relay_pub_shard0 created")
            && stdout.contains("shard publication outbox_relay_pub_shard1 created"),
        "{stdout}"
    );

    // Shard 0 alone: it relays its own rows and none of shard 1's.
    let first = start_shard(&db, 0);
    wait_streaming(&db, &first, 0).await;
    let written_first = write(&db, 60).await;
    let written = written_first.len();
    let shard0 = keys_in_shard(&db, 0).await;
    let shard1 = keys_in_shard(&db, 1).await;
    assert_eq!(shard0.len() + shard1.len(), written);
    assert!(
        !shard0.is_empty() && !shard1.is_empty(),
        "24 entities fall into both shards: {} / {}",
        shard0.len(),
        shard1.len()
    );
    let earlier = consume_exactly(&db.topic, shard0.len(), Duration::from_secs(60), &first).await;
    let records = harness::reread(&db.topic, &earlier, Duration::from_secs(3)).await;
    let seen: HashSet<String> = keys_of(&records).into_iter().collect();
    assert_eq!(
        seen, shard0,
        "shard 0's relay sent exactly its shard's rows"
    );

    // Shard 1 starts later: its slot is created now, and its cutover publishes the
    // rows of its shard written before (and only those: shard 0 delivered its own).
    let second = start_shard(&db, 1);
    wait_streaming(&db, &second, 1).await;
    let written_second = write(&db, 40).await;
    let total = written + written_second.len();
    let earlier = consume_exactly(&db.topic, total, Duration::from_secs(90), &second).await;
    let records = harness::reread(&db.topic, &earlier, Duration::from_secs(3)).await;
    let keys = keys_of(&records);
    let unique: HashSet<&String> = keys.iter().collect();
    assert_eq!(
        keys.len(),
        total,
        "every event exactly once over both shards and the cutover"
    );
    assert_eq!(unique.len(), total);
    // Each write restarts the entities' `seq`: order is checked per write.
    for batch in [&written_first, &written_second] {
        let mine: Vec<harness::Record> = records
            .iter()
            .filter(|r| {
                r.header("idempotency_key")
                    .is_some_and(|k| batch.contains(k))
            })
            .cloned()
            .collect();
        assert_eq!(mine.len(), batch.len());
        assert_per_key_order(&mine);
    }
    let report = harness::audit(&db);
    assert_eq!(report["lost"], 0, "{report}");
    assert_eq!(
        report["delivered"],
        u64::try_from(total).unwrap(),
        "{report}"
    );

    // `status` of a sharded outbox lists both shards' slots, both streaming.
    let out = harness::run_cli(&[
        "status",
        "--json",
        "--config",
        db.config_path.to_str().unwrap(),
        "--set",
        "postgres.shards=2",
    ]);
    let status: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("status --json: {e}"));
    let shards = status["shards"].as_array().expect("a shards list");
    assert_eq!(shards.len(), 2, "{status}");
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(s["slot"], format!("{}_shard{i}", db.slot), "{status}");
        assert!(s["active_pid"].is_i64(), "shard {i} streaming: {status}");
    }

    // Another shard count would move rows between shards: refused, nothing changed.
    let out = migrate_sharded(&db, 3);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(
        stderr.contains("outbox_relay_pub_shard0 is marked \"outbox-relay shard 0 of 2"),
        "{stderr}"
    );
    let publications: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM pg_publication WHERE pubname LIKE 'outbox_relay_pub_shard%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(publications, 2);

    first.terminate(Duration::from_secs(20)).await;
    second.terminate(Duration::from_secs(20)).await;
    for i in 0..SHARDS {
        let _ = db
            .client
            .execute(
                "SELECT pg_drop_replication_slot($1)",
                &[&format!("{}_shard{i}", db.slot)],
            )
            .await;
    }
}

/// An id's shard is a function of its bytes, not of the column's collation: with a
/// nondeterministic (ICU, case-insensitive) collation `hashtext` would hash the sort
/// key, so "Order-1" and "ORDER-1" would share a shard, and an ICU upgrade could move
/// ids between shards (breaking per-key order).
#[tokio::test]
async fn the_shard_of_an_id_ignores_the_columns_collation() {
    let db = TestDb::create("shard_collation").await;
    let icu = db
        .client
        .batch_execute(
            "CREATE COLLATION shard_ci (provider = icu, locale = 'und-u-ks-level2', deterministic = false);
             CREATE TABLE ids (ci text COLLATE shard_ci, c text COLLATE \"C\");
             INSERT INTO ids SELECT v, v FROM unnest(ARRAY['Order-1', 'ORDER-1', 'order-1', 'x', 'X']) v;",
        )
        .await;
    if let Err(e) = icu {
        // A server built without ICU cannot make the collation at all.
        eprintln!("skipped: this PostgreSQL has no ICU collations ({e})");
        return;
    }
    let filter = |column: &str| {
        outbox_relay::config::shard::row_filter(column, 7, 0)
            .expect("a filter for 7 shards")
            .replace(" = 0", "")
    };
    let rows = db
        .client
        .query(
            &format!(
                "SELECT c, {} AS by_ci, {} AS by_c FROM ids",
                filter("ci"),
                filter("c")
            ),
            &[],
        )
        .await
        .expect("evaluate the shard filter");
    for row in &rows {
        let (id, by_ci, by_c): (String, i32, i32) = (row.get(0), row.get(1), row.get(2));
        assert_eq!(by_ci, by_c, "{id}: the collation moved it to another shard");
    }
}
