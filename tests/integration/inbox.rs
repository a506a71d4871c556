//! The consumer's half: `examples/inbox_consumer.rs` (rdkafka and the library's
//! `inbox`) applies each event exactly once, while the relay is killed mid-stream
//! (duplicates on the topic) and when the topic is read again from the start by a
//! new consumer group (every record redelivered).

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::harness::{self, RelayProcess, TestDb, consume, tally};

const EVENTS: i64 = 600;
const ENTITIES: i64 = 6;

/// Builds the example (a no-op when it is fresh) and returns its path.
fn example_binary() -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "--quiet", "--example", "inbox_consumer"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .expect("run cargo build --example inbox_consumer");
    assert!(status.success(), "the inbox example does not build");
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/integration-… → target/<profile>/examples/inbox_consumer
    let profile_dir = exe.parent().and_then(|deps| deps.parent()).unwrap();
    profile_dir.join("examples").join("inbox_consumer")
}

/// Runs the example until it has handled `records` records (or, should fewer be
/// on the topic, been idle for 60 s: a consumer group's first join on the shared
/// broker can take seconds); returns (applied, skipped).
fn run_example(bin: &PathBuf, db: &TestDb, group: &str, records: usize) -> (u64, u64) {
    let out = Command::new(bin)
        .env("INBOX_DATABASE_URL", &db.url)
        .env("INBOX_BROKERS", &harness::env().brokers)
        .env("INBOX_TOPIC", &db.topic)
        .env("INBOX_GROUP", format!("{}-{group}", db.name))
        .env("INBOX_CONSUMER", "billing")
        .env("INBOX_EXIT_AFTER_RECORDS", records.to_string())
        .env("INBOX_IDLE_EXIT_SECS", "60")
        .output()
        .expect("run the inbox example");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let number = |label: &str| -> u64 {
        stdout
            .split(label)
            .nth(1)
            .and_then(|rest| rest.split([',', ' ']).find(|w| !w.is_empty()))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no {label:?} in {stdout}"))
    };
    (number("applied "), number("skipped "))
}

#[tokio::test]
async fn the_inbox_example_applies_each_event_once_across_relay_kills_and_replays() {
    let db = TestDb::create("inbox").await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let url = db.url.clone();
    let writer = tokio::spawn(async move {
        let client = harness::connect(&url).await;
        let mut keys = Vec::new();
        for seq in 0..EVENTS {
            let key: String = client
                .query_one(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('order', $1, 'OrderChanged', jsonb_build_object('seq', $2::bigint))
                     RETURNING idempotency_key",
                    &[&format!("o-{}", seq % ENTITIES), &seq],
                )
                .await
                .unwrap()
                .get(0);
            keys.push(key);
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        keys
    });
    let early = consume(&db.topic, 100, Duration::from_secs(60)).await;
    assert!(early.len() >= 100, "relay log:\n{}", relay.log());
    relay.kill9().await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    let keys: HashSet<String> = writer.await.unwrap().into_iter().collect();
    let mut records = consume(&db.topic, keys.len(), Duration::from_secs(60)).await;
    for _ in 0..10 {
        let seen: HashSet<&str> = records
            .iter()
            .filter_map(|r| r.header("idempotency_key"))
            .collect();
        if keys.iter().all(|k| seen.contains(k.as_str())) {
            break;
        }
        records = consume(&db.topic, records.len() + 50, Duration::from_secs(10)).await;
    }
    let (events, duplicates) = tally(&records);
    assert_eq!(events, keys.len(), "relay log:\n{}", relay.log());

    let bin = example_binary();
    let (applied, skipped) = run_example(&bin, &db, "billing-1", records.len());
    assert_eq!(applied, u64::try_from(keys.len()).unwrap());
    assert_eq!(skipped, u64::try_from(duplicates).unwrap());
    let counted: i64 = db
        .client
        .query_one("SELECT sum(events)::bigint FROM entity_events", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(counted, EVENTS, "every event counted once");

    // A new consumer group reads the topic again from its start: every record is
    // redelivered, none applied.
    let (again, skipped_again) = run_example(&bin, &db, "billing-2", records.len());
    assert_eq!(again, 0);
    assert_eq!(skipped_again, u64::try_from(records.len()).unwrap());
    let counted: i64 = db
        .client
        .query_one("SELECT sum(events)::bigint FROM entity_events", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(counted, EVENTS, "still once");
    println!(
        "inbox: {events} events, {duplicates} duplicates on the topic after a kill -9; \
         applied {applied} once, skipped {skipped} then {skipped_again} redeliveries"
    );
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;
}
