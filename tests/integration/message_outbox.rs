//! The message outbox (`outbox_emit`, `pg_logical_emit_message`): events that are
//! never rows, relayed with the rows' rules and audited against the message ledger.

use std::collections::HashSet;
use std::time::Duration;

use crate::harness::{
    self, RelayProcess, TestDb, Written, assert_per_key_order, connect, consume, read_all, tally,
    wait_until,
};

/// Transactions each writer commits or rolls back.
const TRANSACTIONS: i64 = 150;
const WRITERS: i64 = 3;
/// Entities per writer (each key's events carry a growing `seq`).
const ENTITIES: i64 = 4;
const WRITE_PAUSE: Duration = Duration::from_millis(10);
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Writer `w`: transactions of 1–3 messages, every 6th with a row of the table too
/// (same entity, same `seq` sequence), every 7th rolled back.
async fn write(url: String, w: i64) -> Written {
    let mut client = connect(&url).await;
    let mut written = Written::default();
    let mut seq = vec![0i64; usize::try_from(ENTITIES).unwrap()];
    for i in 0..TRANSACTIONS {
        let entity = i % ENTITIES;
        let key = format!("w{w}-e{entity}");
        let tx = client.transaction().await.unwrap();
        let mut keys = Vec::new();
        for m in 0..=(i % 3) {
            let n = &mut seq[usize::try_from(entity).unwrap()];
            *n += 1;
            let ikey = format!("msg-{w}-{i}-{m}");
            let payload = format!(r#"{{"seq": {n}, "writer": {w}}}"#);
            tx.query_one(
                "SELECT outbox_emit('order', $1, 'order_changed', $2::text::jsonb,
                                    $3::text::jsonb, $4)",
                &[
                    &key,
                    &payload,
                    &format!(r#"{{"traceparent": "{TRACEPARENT}"}}"#),
                    &ikey,
                ],
            )
            .await
            .unwrap();
            keys.push(ikey);
        }
        if i % 6 == 0 {
            let n = &mut seq[usize::try_from(entity).unwrap()];
            *n += 1;
            let ikey = format!("row-{w}-{i}");
            let payload = format!(r#"{{"seq": {n}, "writer": {w}}}"#);
            tx.query_one(
                "SELECT outbox_enqueue('order', $1, 'order_row', $2::text::jsonb, NULL, $3)",
                &[&key, &payload, &ikey],
            )
            .await
            .unwrap();
            keys.push(ikey);
        }
        tokio::time::sleep(WRITE_PAUSE).await;
        written.end(tx, i % 7 == 3, keys).await;
    }
    written
}

/// Concurrent writers of messages and rows (with rolled-back transactions), a
/// `kill -9` of the relay mid-stream, messages the relay must ignore (another
/// prefix, not transactional), a poisoned message and an unreadable one: every
/// committed event arrives once or more in per-key order, none from a rolled-back
/// transaction, a `traceparent` written with the event arrives as a header, and
/// `audit` proves lost 0 from the message ledger, without a table of the messages.
#[tokio::test]
async fn message_outbox_events_are_relayed_with_rows_and_audited_without_a_table() {
    let db = TestDb::create("message_outbox").await;
    let config = db.config_path.to_str().unwrap().to_owned();
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| tokio::spawn(write(db.url.clone(), w)))
        .collect();

    // Messages that are not events of this relay: another application's prefix,
    // and an outbox frame written with transactional = false.
    db.client
        .batch_execute(
            "SELECT pg_logical_emit_message(true, 'someone-else', 'hello');
             SELECT pg_logical_emit_message(false, 'outbox-relay:public.outbox',
                 '\\x016a'::bytea || outbox_relay_frame('not-transactional')
                 || outbox_relay_frame('order') || outbox_relay_frame('nt')
                 || outbox_relay_frame('order_changed') || outbox_relay_frame(NULL)
                 || outbox_relay_frame(NULL) || outbox_relay_frame('{\"seq\": 1}')
                 || outbox_relay_frame(NULL));",
        )
        .await
        .unwrap();
    // A message that can never be delivered (no entity id), and one that is not a
    // frame at all: both kept whole in the poison table.
    db.client
        .batch_execute(
            "SELECT outbox_emit('order', NULL, 'order_changed', '{\"seq\": 1}', NULL, 'msg-poison');
             SELECT pg_logical_emit_message(true, 'outbox-relay:public.outbox', '\\x02ff'::bytea);",
        )
        .await
        .unwrap();

    let first = consume(&db.topic, 50, Duration::from_secs(60)).await;
    assert!(first.len() >= 50, "relay log:\n{}", relay.log());
    relay.kill9().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        writers.iter().any(|w| !w.is_finished()),
        "the writers finished before the kill: write more"
    );
    let relay = RelayProcess::start(&db.config_path, &[]);
    let mut written = Written::default();
    for w in writers {
        let w = w.await.unwrap();
        written.committed.extend(w.committed);
        written.rolled_back.extend(w.rolled_back);
    }
    let expected: HashSet<&str> = written.committed.iter().map(String::as_str).collect();

    let records = read_all(&db.topic, &expected, &relay).await;
    let rolled_back: HashSet<&str> = written.rolled_back.iter().map(String::as_str).collect();
    for r in &records {
        let key = r.header("idempotency_key").expect("an idempotency key");
        assert!(
            !rolled_back.contains(key),
            "{key} of a rolled-back transaction"
        );
        assert!(
            expected.contains(key),
            "{key} was never committed as an event"
        );
    }
    assert_per_key_order(&records);
    let (events, duplicates) = tally(&records);
    assert_eq!(events, expected.len(), "lost 0");
    let messages = records
        .iter()
        .filter(|r| {
            r.header("idempotency_key")
                .is_some_and(|k| k.starts_with("msg-"))
        })
        .collect::<Vec<_>>();
    assert!(
        messages
            .iter()
            .all(|r| r.header("traceparent") == Some(TRACEPARENT)
                && r.header("event_type") == Some("order_changed")
                && r.header("source_lsn").is_some()
                && r.header("occurred_at").is_some()),
        "message records carry the row's headers and the traceparent"
    );

    // The poison table holds both undeliverable messages, whole.
    wait_until(Duration::from_secs(30), "two poison rows", || async {
        db.client
            .query_one("SELECT count(*) FROM poison_outbox", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 2
    })
    .await;
    let kinds: Vec<(String, bool)> = db
        .client
        .query(
            "SELECT error_kind, row_data ? 'outbox_relay_message' FROM poison_outbox ORDER BY error_kind",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        kinds,
        [
            ("bad_message".to_owned(), true),
            ("null_key".to_owned(), true)
        ]
    );
    let content: String = db
        .client
        .query_one(
            "SELECT payload FROM poison_outbox WHERE error_kind = 'bad_message'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(content, "\\x02ff");

    // audit: the table's rows by key, the messages against their ledger.
    let audit = harness::audit(&db);
    assert_eq!(audit["lost"], 0, "{audit}");
    assert_eq!(audit["out_of_order_keys"], 0, "{audit}");
    assert_eq!(audit["poisoned"], 1, "{audit}");
    assert_eq!(
        audit["expected"],
        u64::try_from(expected.len() + 1).unwrap(),
        "{audit}"
    );
    let out = harness::run_cli(&["audit", "--no-progress", "--config", &config]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains(&format!(
            "message outbox (outbox_relay_message_ledger): {} emitted",
            expected.len() - rows_written(&expected) + 1
        )),
        "{table}"
    );

    // replay selects the poisoned messages from the poison table.
    let out = harness::run_cli(&[
        "replay",
        "--all",
        "--dry-run",
        "--json",
        "--config",
        &config,
    ]);
    let replay: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(replay["selected"], 2, "{replay}");

    // check states what a lost slot means for messages.
    let out = harness::run_cli(&["check", "--json", "--config", &config]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let resync = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "postgres.resync")
        .unwrap()
        .clone();
    assert!(
        resync["detail"].as_str().unwrap().contains("outbox_emit"),
        "{resync}"
    );

    // A relay that lost events would show it: count one more emitted event in the
    // ledger than was written, and audit reports it lost.
    db.client
        .execute(
            "UPDATE outbox_relay_message_ledger SET events = events + 1
              WHERE aggregate_id = 'w0-e0'",
            &[],
        )
        .await
        .unwrap();
    let audit = harness::audit(&db);
    assert_eq!(audit["lost"], 1, "{audit}");

    let rows = rows_written(&expected);
    println!(
        "message outbox: {events} events ({} messages, {rows} rows), {duplicates} duplicates \
         after a kill -9; lost 0; {} rolled-back events absent",
        events - rows,
        rolled_back.len()
    );
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;
}

/// Of the committed events, how many were rows (not messages).
fn rows_written(expected: &HashSet<&str>) -> usize {
    expected.iter().filter(|k| k.starts_with("row-")).count()
}
