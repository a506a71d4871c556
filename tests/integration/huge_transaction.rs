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
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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
/// [`SMALL_AFTER`] more; returns how many it committed, and when each of those after
/// `stop` committed (by `seq`).
async fn small_writer(
    url: String,
    stop: Arc<AtomicBool>,
    written: Arc<AtomicI64>,
) -> (i64, HashMap<i64, Instant>) {
    let client = harness::connect(&url).await;
    let mut seq = 0_i64;
    let mut after = 0;
    let mut committed_after = HashMap::new();
    while after < SMALL_AFTER {
        let stopped = stop.load(Ordering::SeqCst);
        if stopped {
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
        if stopped {
            committed_after.insert(seq, Instant::now());
        }
        seq += 1;
        written.store(seq, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    (seq, committed_after)
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
    // Read while the relay drains, so that each record's arrival time is known.
    let until = Arc::new(AtomicUsize::new(usize::MAX));
    let reader = tokio::spawn(harness::consume_while_draining(
        db.topic.clone(),
        until.clone(),
        Duration::from_secs(600),
    ));
    let started = Instant::now();
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
    let (small_count, committed_after) = small.await.expect("small writer");

    let expected = usize::try_from(rows + small_count).unwrap();
    until.store(expected, Ordering::SeqCst);
    let mut records = reader.await.expect("reader");
    if records.len() < expected {
        records = consume(&db.topic, expected, Duration::from_secs(60)).await;
    }
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
    report_small_delays(&records, &committed_after, started + big_commit);
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

/// How long the small transactions committed after the big one waited beyond what
/// commit order requires: each one's arrival at this consumer after the later of its
/// own commit and the arrival of the big transaction's last record (printed, not
/// asserted: a timing on a shared machine). `big_committed` is when the big
/// transaction's commit returned.
fn report_small_delays(
    records: &[harness::Record],
    committed_after: &HashMap<i64, Instant>,
    big_committed: Instant,
) {
    let big_done = records
        .iter()
        .filter(|r| r.key.as_deref().is_some_and(|k| k.starts_with(b"h")))
        .map(|r| r.received_at)
        .max();
    let Some(big_done) = big_done else {
        return;
    };
    let mut delays: Vec<Duration> = records
        .iter()
        .filter(|r| r.key.as_deref().is_some_and(|k| k.starts_with(b"s")))
        .filter_map(|r| {
            let payload: serde_json::Value = serde_json::from_slice(r.payload.as_deref()?).ok()?;
            let committed = committed_after.get(&payload["seq"].as_i64()?)?;
            Some(
                r.received_at
                    .saturating_duration_since((*committed).max(big_done)),
            )
        })
        .collect();
    if delays.is_empty() {
        return;
    }
    delays.sort();
    // Nearest rank, in integers: `per_mille` of the way through the sorted delays.
    let at = |per_mille: usize| delays[(delays.len() - 1) * per_mille / 1000];
    eprintln!(
        "huge transaction: its last record arrived {:.1?} after its commit; the {} small \
         transactions committed after it arrived, beyond the later of their commit and that \
         last record, p50 {:.1?}, p99 {:.1?}, max {:.1?}",
        big_done.saturating_duration_since(big_committed),
        delays.len(),
        at(500),
        at(990),
        at(1000)
    );
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
