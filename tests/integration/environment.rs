//! The foundation: the throwaway cluster is really `wal_level=logical`, outbox rows
//! are visible through a `pgoutput` slot, the broker round-trips a record produced
//! with our producer settings, and `migrate` builds a schema that keeps its promises.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::harness::{self, TestDb};

#[tokio::test]
async fn cluster_has_logical_wal() {
    let client = harness::connect(&harness::env().pg_url).await;
    let row = client
        .query_one(
            "SELECT current_setting('wal_level'), current_setting('max_replication_slots')::int",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "logical");
    assert!(
        row.get::<_, i32>(1) >= 16,
        "too few replication slots for parallel tests"
    );
}

/// A row inserted into `outbox` in one transaction with a business row is visible
/// through a logical slot decoding with pgoutput; the business row is not (the
/// publication covers the outbox only).
#[tokio::test]
async fn outbox_insert_is_visible_through_a_pgoutput_slot() {
    let mut db = TestDb::create("env_slot").await;
    db.client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&db.slot],
        )
        .await
        .unwrap();
    let payload = r#"{"order": 42, "note": "zero-copy"}"#;
    let key = db.insert_event("order-42", "OrderCreated", payload).await;

    let rows = db
        .client
        .query(
            "SELECT data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
                 'proto_version', '1', 'publication_names', 'outbox_relay_pub')",
            &[&db.slot],
        )
        .await
        .unwrap();
    let messages: Vec<Vec<u8>> = rows.iter().map(|r| r.get(0)).collect();
    let tags: Vec<char> = messages.iter().map(|m| char::from(m[0])).collect();
    assert_eq!(
        tags,
        ['B', 'R', 'I', 'C'],
        "one transaction, one outbox insert"
    );
    let insert = &messages[2];
    let contains = |needle: &[u8]| insert.windows(needle.len()).any(|w| w == needle);
    assert!(
        contains(key.as_bytes()),
        "insert carries the idempotency key"
    );
    assert!(contains(b"order-42"), "insert carries the entity id");
    // jsonb's text output normalises spacing, so look for a value, not the input bytes.
    assert!(contains(b"zero-copy"), "insert carries the payload");
    let relation = &messages[1];
    assert!(
        relation.windows(6).any(|w| w == b"outbox"),
        "relation message names the outbox table"
    );
    db.drop_slot().await;
}

/// A record produced with the relay's producer settings (idempotent, acks=all,
/// murmur2_random) is consumed back with key, payload and headers intact.
#[tokio::test]
async fn broker_round_trips_a_record() {
    let topic = harness::unique("env_broker");
    harness::create_topic(&topic, 3).await;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &harness::env().brokers)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .create()
        .unwrap();
    let headers = OwnedHeaders::new().insert(Header {
        key: "idempotency_key",
        value: Some("k-1"),
    });
    let delivery = producer
        .send(
            FutureRecord::to(&topic)
                .key("entity-1")
                .payload(r#"{"a":1}"#)
                .headers(headers),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .unwrap();
    assert!(delivery.offset >= 0);

    let records = harness::consume(&topic, 1, Duration::from_secs(20)).await;
    assert_eq!(records.len(), 1, "record not consumed back");
    let r = &records[0];
    assert_eq!(r.partition, delivery.partition);
    assert_eq!(r.key.as_deref(), Some(&b"entity-1"[..]));
    assert_eq!(r.payload.as_deref(), Some(&br#"{"a":1}"#[..]));
    assert_eq!(r.header("idempotency_key"), Some("k-1"));
}

#[tokio::test]
async fn migrate_is_idempotent_and_builds_the_schema() {
    let db = TestDb::create("env_migrate").await;
    // Second run: nothing to apply.
    let out = harness::run_cli(&["migrate", "--config", db.config_path.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!(
            "0 applied, {} already present",
            outbox_relay::ops::migrate::MIGRATIONS.len()
        )),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // This relay's own table runs every migration's own SQL (checksums unchanged).
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        !stdout.contains("adapted") && !stdout.contains("skipped:"),
        "{stdout}"
    );
    let publication = db
        .client
        .query_one(
            "SELECT pubinsert, pubupdate, pubdelete, pubtruncate FROM pg_publication WHERE pubname = 'outbox_relay_pub'",
            &[],
        )
        .await
        .unwrap();
    assert!(
        publication.get::<_, bool>(0),
        "publication publishes inserts"
    );
    assert!(
        !publication.get::<_, bool>(1)
            && !publication.get::<_, bool>(2)
            && !publication.get::<_, bool>(3),
        "updates, deletes and truncates are never published"
    );
    let tables: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM pg_publication_tables WHERE pubname = 'outbox_relay_pub' AND tablename = 'outbox'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 1);
    let cutover_table: bool = db
        .client
        .query_one(
            "SELECT to_regclass('public.outbox_relay_cutover') IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(cutover_table, "the cutover marker table exists");
    // The generated ids are UUID version 7 and differ per row.
    let row = db
        .client
        .query_one(
            "SELECT a::text, b::text FROM (SELECT outbox_relay_uuid_v7() AS a, outbox_relay_uuid_v7() AS b) s",
            &[],
        )
        .await
        .unwrap();
    let (a, b): (String, String) = (row.get(0), row.get(1));
    assert_ne!(a, b);
    assert_eq!(&a[14..15], "7", "version nibble of {a}");
}

#[tokio::test]
async fn poison_rows_cannot_be_deleted() {
    let db = TestDb::create("env_poison").await;
    db.client
        .execute(
            "INSERT INTO poison_outbox (idempotency_key, error, error_kind, attempts) VALUES ('k', 'too large', 'poison', 5)",
            &[],
        )
        .await
        .unwrap();
    let err = db
        .client
        .execute("DELETE FROM poison_outbox", &[])
        .await
        .unwrap_err();
    assert!(
        err.as_db_error()
            .unwrap()
            .message()
            .contains("never deleted"),
        "{err}"
    );
    assert!(
        db.client
            .execute("TRUNCATE poison_outbox", &[])
            .await
            .is_err()
    );
    let count: i64 = db.poison_rows().await;
    assert_eq!(count, 1);
}

#[tokio::test]
async fn bad_config_exits_with_code_2() {
    let path = std::env::temp_dir().join(format!("{}.toml", harness::unique("bad_config")));
    std::fs::write(
        &path,
        "[postgres]\nurl = \"postgresql://h/db\"\nsloth = 1\n",
    )
    .unwrap();
    let out = harness::run_cli(&["migrate", "--config", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("sloth"),
        "error names the unknown key: {stderr}"
    );
    let out = harness::run_cli(&["migrate", "--config", "/nonexistent/relay.toml"]);
    assert_eq!(out.status.code(), Some(2));
}

#[tokio::test]
#[ignore = "debugging aid: DUMP_TOPIC=name cargo test -- --ignored dump_topic"]
async fn dump_topic() {
    let topic = std::env::var("DUMP_TOPIC").unwrap();
    let records = harness::consume(&topic, usize::MAX, Duration::from_secs(5)).await;
    let mut per_partition = std::collections::BTreeMap::new();
    for r in &records {
        *per_partition.entry(r.partition).or_insert(0) += 1;
    }
    eprintln!("{} records: {per_partition:?}", records.len());
}

/// The binary with `args`, run in `cwd`, with none of the test process's
/// `OUTBOX_RELAY_…` variables and exactly the given ones.
fn run_cli_env(
    cwd: &std::path::Path,
    args: &[&str],
    vars: &[(&str, &str)],
) -> std::process::Output {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    cmd.args(args).current_dir(cwd);
    for (name, _) in std::env::vars_os() {
        if name
            .to_str()
            .is_some_and(|n| n.starts_with("OUTBOX_RELAY_"))
        {
            cmd.env_remove(name);
        }
    }
    cmd.envs(vars.iter().copied());
    cmd.output().expect("spawn outbox-relay")
}

/// No config file at all (none named, no `relay.toml` in the working directory):
/// `migrate` takes every value from `OUTBOX_RELAY__…` variables and `--set`, and
/// builds the schema; without the required keys it says which variable to set.
#[tokio::test]
async fn env_and_set_alone_configure_a_command() {
    let name = harness::unique("env_only");
    let admin = harness::connect(&harness::env().pg_url).await;
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let url = harness::database_url(&harness::env().pg_url, &name);
    let cwd = std::env::temp_dir().join(&name);
    std::fs::create_dir_all(&cwd).unwrap();

    let out = run_cli_env(&cwd, &["migrate"], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("OUTBOX_RELAY__POSTGRES__URL"), "{stderr}");

    let brokers = format!("kafka.brokers={}", harness::env().brokers);
    let out = run_cli_env(
        &cwd,
        &["migrate", "--set", &brokers],
        &[("OUTBOX_RELAY__POSTGRES__URL", &url)],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "migrate from env alone: {stderr}");
    let db = harness::connect(&url).await;
    let tables: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE tablename IN ('outbox', 'poison_outbox')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 2, "migrate built the schema");
    drop(db);
    let _ = admin
        .batch_execute(&format!("DROP DATABASE {name} WITH (FORCE)"))
        .await;
}

/// A config file that is named, by `--config` or by `OUTBOX_RELAY_CONFIG`, and is
/// missing is an error (exit 2), even when the environment gives every value: a
/// typo in a path must not start a relay on other settings.
#[test]
fn a_named_config_file_that_is_missing_is_an_error() {
    let cwd = std::env::temp_dir();
    let vars = [
        ("OUTBOX_RELAY__POSTGRES__URL", "postgresql://h/db"),
        ("OUTBOX_RELAY__KAFKA__BROKERS", "k:9092"),
    ];
    let missing = "/nonexistent/relay.toml";
    for (args, extra) in [
        (vec!["migrate", "--config", missing], None),
        (vec!["migrate"], Some(("OUTBOX_RELAY_CONFIG", missing))),
    ] {
        let mut all = vars.to_vec();
        all.extend(extra);
        let out = run_cli_env(&cwd, &args, &all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("cannot read config file /nonexistent/relay.toml"),
            "{stderr}"
        );
    }
}
