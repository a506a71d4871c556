//! A transaction far larger than the relay's in-flight window and than the server's
//! `logical_decoding_work_mem`, with small transactions committed before, during
//! and after it.
//!
//! The relay asks for pgoutput protocol 1, so PostgreSQL decodes the big transaction
//! into memory up to `logical_decoding_work_mem`, spills the rest to disk, and sends
//! it all at its commit: a burst of every row at once. The relay must take that
//! burst through its window (bounded memory), keep commit order (the small
//! transactions committed after the big one come after it on every partition, the
//! ones committed before it ahead of it) and lose nothing.
//!
//! The CI run writes [`DEFAULT_ROWS`] rows; `OUTBOX_RELAY_HUGE_TX_ROWS=1000000` runs
//! the full-size version (`docs/benchmarks.md#a-million-row-transaction`).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;

use crate::harness::{self, RelayProcess, TestDb, assert_per_key_order, consume, tally};

/// Rows of the big transaction in the CI run.
const DEFAULT_ROWS: i64 = 200_000;

/// The relay's peak resident set may not pass this, whatever the transaction's size.
const RSS_BOUND_MIB: u64 = 128;

/// Small transactions the writer commits after the big one's commit.
const SMALL_AFTER: i64 = 100;

/// Peak resident set of process `pid` so far (`VmHWM`), KiB.
fn peak_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// One-row transactions on keys `s0..s4`, `seq` counting up, until `stop` and then
/// [`SMALL_AFTER`] more; returns how many it committed.
async fn small_writer(url: String, stop: Arc<AtomicBool>, written: Arc<AtomicI64>) -> i64 {
    let client = harness::connect(&url).await;
    let mut seq = 0_i64;
    let mut after = 0;
    while after < SMALL_AFTER {
        if stop.load(Ordering::SeqCst) {
            after += 1;
        }
        client
            .execute(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', 's' || ($1::bigint % 5), 'Created', jsonb_build_object('seq', $1::bigint))",
                &[&seq],
            )
            .await
            .expect("a small transaction");
        seq += 1;
        written.store(seq, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    seq
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_transaction_goes_through_in_bounded_memory_and_commit_order() {
    // Every walsender of the suite decodes this transaction's WAL: one at a time with
    // the other heavy tests.
    let _heavy = harness::heavy().await;
    let rows: i64 = std::env::var("OUTBOX_RELAY_HUGE_TX_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_ROWS);
    let db = TestDb::create("huge_tx").await;
    // A small decoding memory makes the server spill even the CI-sized transaction
    // (the walsender applies the database's settings).
    db.client
        .batch_execute(&format!(
            "ALTER DATABASE {} SET logical_decoding_work_mem = '4MB'",
            db.name
        ))
        .await
        .expect("set logical_decoding_work_mem");
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;

    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicI64::new(0));
    let small = tokio::spawn(small_writer(db.url.clone(), stop.clone(), written.clone()));
    harness::wait_until(Duration::from_secs(30), "small transactions", || async {
        written.load(Ordering::SeqCst) >= 20
    })
    .await;
    let started = std::time::Instant::now();
    db.client
        .batch_execute(&format!(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'h' || (g % 13), 'Created',
                    jsonb_build_object('seq', g, 'pad', repeat('x', 200))
             FROM generate_series(1, {rows}) g"
        ))
        .await
        .expect("the big transaction");
    let big_commit = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let small_count = small.await.expect("small writer");

    let expected = usize::try_from(rows + small_count).unwrap();
    let records = consume(&db.topic, expected, Duration::from_secs(600)).await;
    let peak_mib = peak_rss_kib(relay.pid()) / 1024;
    let (unique, duplicates) = tally(&records);
    assert_eq!(unique, expected, "lost events; relay log:\n{}", relay.log());
    assert_per_key_order(&records);
    assert_commit_order(&records);
    let spilled: i64 = db
        .client
        .query_one(
            "SELECT COALESCE(sum(spill_bytes), 0)::bigint FROM pg_stat_replication_slots
              WHERE slot_name = $1",
            &[&db.slot],
        )
        .await
        .unwrap()
        .get(0);
    eprintln!(
        "huge transaction: {rows} rows committed in {big_commit:.1?} beside {small_count} small \
         transactions: {unique} events, {duplicates} duplicates, relay peak RSS {peak_mib} MiB, \
         server spilled {} MiB",
        spilled / (1024 * 1024)
    );
    assert!(
        spilled > 0,
        "the server did not spill the transaction: the test does not test what it says"
    );
    assert!(
        peak_mib <= RSS_BOUND_MIB,
        "the relay's peak RSS was {peak_mib} MiB (bound {RSS_BOUND_MIB} MiB)"
    );
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// Commit order as each partition shows it: in offset order, the commit LSNs
/// (`source_lsn`) of first deliveries never go back.
fn assert_commit_order(records: &[harness::Record]) {
    let mut sorted: Vec<&harness::Record> = records.iter().collect();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    let mut seen = std::collections::HashSet::new();
    let mut last: HashMap<i32, u64> = HashMap::new();
    for r in sorted {
        if !seen.insert(r.header("idempotency_key")) {
            continue;
        }
        let lsn = harness::parse_lsn(r.header("source_lsn").expect("a source_lsn header"));
        let previous = last.insert(r.partition, lsn).unwrap_or(0);
        assert!(
            lsn >= previous,
            "partition {} goes back from commit {previous:#x} to {lsn:#x} at offset {}",
            r.partition,
            r.offset
        );
    }
}
