//! Adopting an existing outbox table: `migrate`, then `run`, on tables that are not
//! this relay's layout — Debezium's (through `outbox.preset = "debezium"`), a
//! poller's without `topic` and `headers` columns, and ids of type bigint, uuid and
//! text with payloads of type json, text and bytea. Each shape is relayed by the
//! real binary, its records are read back (key, topic, headers, payload bytes), and
//! `outbox-relay audit` finds nothing lost.

use std::path::PathBuf;
use std::time::Duration;

use crate::harness::{self, Record, RelayProcess, TestDb};

/// A fresh database holding `table_sql` (the outbox as its owner made it, plus the
/// business table), a config with `topic_template` and `extra` TOML, and the output
/// of `outbox-relay migrate` on it (which must succeed).
async fn adopt(prefix: &str, table_sql: &str, template: &str, extra: &str) -> (TestDb, String) {
    let env = harness::env();
    let name = harness::unique(prefix);
    let admin = harness::connect(&env.pg_url).await;
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .expect("create test database");
    let url = harness::database_url(&env.pg_url, &name);
    let client = harness::connect(&url).await;
    client
        .batch_execute(table_sql)
        .await
        .expect("create the existing outbox");
    client
        .batch_execute(
            "CREATE TABLE business_orders (id bigserial PRIMARY KEY, entity text NOT NULL, amount int NOT NULL)",
        )
        .await
        .expect("create business table");
    let slot = format!("{name}_slot");
    let topic = template.replace("{name}", &name);
    let config_path: PathBuf = std::env::temp_dir().join(format!("{name}.toml"));
    let toml = format!(
        "[postgres]\nurl = \"{url}\"\nslot = \"{slot}\"\n\n[kafka]\nbrokers = \"{}\"\ntopic_template = \"{topic}\"\n\n[log]\nlevel = \"info\"\n\n{extra}",
        env.brokers
    );
    std::fs::write(&config_path, toml).expect("write test config");
    let out = harness::run_cli(&["migrate", "--config", config_path.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "migrate on the existing table failed: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let db = TestDb {
        name,
        url,
        client,
        slot,
        topic,
        config_path,
    };
    (db, stdout)
}

/// Audits the test's outbox: `expected` events, none lost, none poisoned.
fn assert_audit_clean(db: &TestDb, expected: u64) {
    let report = harness::audit(db);
    assert_eq!(report["lost"], 0, "{report}");
    assert_eq!(report["expected"], expected, "{report}");
    assert_eq!(report["delivered"], expected, "{report}");
    assert_eq!(report["poisoned"], 0, "{report}");
}

/// The record whose `idempotency_key` header is `key`.
fn by_key<'a>(records: &'a [Record], key: &str) -> &'a Record {
    records
        .iter()
        .find(|r| r.header("idempotency_key") == Some(key))
        .unwrap_or_else(|| panic!("no record with idempotency_key {key}: {records:?}"))
}

/// Debezium's outbox table, adopted with one line of config: topics routed by
/// `aggregatetype` as Debezium's router does (`outbox.event.{aggregate_type}` style),
/// the key from `aggregateid`, `type` as the `event_type` header, the uuid `id` as
/// the idempotency key. Rows come from Debezium-style INSERTs and from the
/// `outbox_enqueue` helper `migrate` generated for this table.
#[tokio::test]
async fn debezium_outbox_is_relayed_with_the_preset() {
    let (db, migrated) = adopt(
        "adopt_dbz",
        "CREATE TABLE outbox (
             id uuid PRIMARY KEY,
             aggregatetype varchar(255) NOT NULL,
             aggregateid varchar(255) NOT NULL,
             type varchar(255) NOT NULL,
             payload jsonb)",
        "{name}.{aggregate_type}",
        "[outbox]\npreset = \"debezium\"\n",
    )
    .await;
    assert!(migrated.contains("0001_outbox adapted"), "{migrated}");
    assert!(migrated.contains("0004_enqueue adapted"), "{migrated}");
    // The poller and the cutover need the poller's columns: a clear refusal (exit 3),
    // and nothing left behind (no slot).
    for command in ["poll", "cutover"] {
        let out = harness::run_cli(&[command, "--config", db.config_path.to_str().unwrap()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{command}: {stderr}");
        assert!(
            stderr.contains("for outbox.columns.created_at (configured as none), \"sent_at\""),
            "{command}: {stderr}"
        );
    }
    let routed = |aggregate: &str| db.topic.replace("{aggregate_type}", aggregate);
    harness::create_topic(&routed("order"), 2).await;
    harness::create_topic(&routed("customer"), 1).await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;

    let id = "0190a5f0-0000-7000-8000-000000000001";
    db.client
        .batch_execute(&format!(
            "BEGIN;
             INSERT INTO business_orders (entity, amount) VALUES ('o-1', 1);
             INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload)
                 VALUES ('{id}', 'order', 'o-1', 'OrderCreated', '{{\"total\": 10}}');
             COMMIT;"
        ))
        .await
        .unwrap();
    let generated: String = db
        .client
        .query_one(
            "SELECT outbox_enqueue('customer', 'c-9', 'CustomerMoved', '{\"city\": \"Oslo\"}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let headers_refused = db
        .client
        .query_one(
            "SELECT outbox_enqueue('order', 'o-2', 'X', '{}', '{\"trace\": \"t\"}')",
            &[],
        )
        .await
        .unwrap_err();
    assert!(
        harness_error(&headers_refused).contains("headers cannot be stored"),
        "{headers_refused:?}"
    );

    let orders =
        harness::consume_exactly(&routed("order"), 1, Duration::from_secs(30), &relay).await;
    let record = by_key(&orders, id);
    assert_eq!(record.key.as_deref(), Some(&b"o-1"[..]));
    assert_eq!(record.payload.as_deref(), Some(&br#"{"total": 10}"#[..]));
    assert_eq!(record.header("event_type"), Some("OrderCreated"));
    assert_eq!(record.header("aggregate_type"), Some("order"));
    let customers =
        harness::consume_exactly(&routed("customer"), 1, Duration::from_secs(30), &relay).await;
    let record = by_key(&customers, &generated);
    assert!(uuid::Uuid::parse_str(&generated).is_ok(), "{generated}");
    assert_eq!(record.key.as_deref(), Some(&b"c-9"[..]));
    assert_eq!(record.payload.as_deref(), Some(&br#"{"city": "Oslo"}"#[..]));
    assert_eq!(record.header("event_type"), Some("CustomerMoved"));
    // No created_at column: no occurred_at header.
    assert_eq!(record.header("occurred_at"), None);
    assert_audit_clean(&db, 2);
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;
}

fn harness_error(e: &tokio_postgres::Error) -> String {
    outbox_relay::postgres::describe_error(e)
}

/// A poller's outbox without `topic`, `headers` or `idempotency_key` columns, a
/// bigint id and a json payload: `migrate` keeps the table and the poller's index,
/// `run` cuts over the rows the poller had not sent (written before the relay
/// started) and streams the rest; the id is the idempotency key.
#[tokio::test]
async fn poller_outbox_without_topic_and_headers_is_relayed() {
    let (db, migrated) = adopt(
        "adopt_poll",
        "CREATE TABLE outbox (
             id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
             aggregate_type text NOT NULL,
             aggregate_id text NOT NULL,
             event_type text NOT NULL,
             payload json NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now(),
             sent_at timestamptz,
             attempts integer NOT NULL DEFAULT 0,
             last_error text)",
        "{name}.events",
        "[outbox.columns]\ntopic = \"\"\nheaders = \"\"\nidempotency_key = \"\"\n",
    )
    .await;
    assert!(
        migrated.contains("0001_outbox adapted: the existing table is kept as it is (with the polling relay's index)"),
        "the index columns exist: {migrated}"
    );
    assert!(migrated.contains("0004_enqueue adapted"), "{migrated}");
    harness::create_topic(&db.topic, 2).await;
    // The poller's backlog (and one row it had sent, which must not be re-sent).
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, sent_at)
                 VALUES ('order', 'o-0', 'Sent', '{\"n\": 0}', now());
             INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', 'o-1', 'Created', '{\"n\":  1}');",
        )
        .await
        .unwrap();
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let key: String = db
        .client
        .query_one(
            "SELECT outbox_enqueue('order', 'o-2', 'Paid', '{\"n\": 2}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let records = harness::consume_exactly(&db.topic, 2, Duration::from_secs(30), &relay).await;
    let backlog = by_key(&records, "2");
    assert_eq!(backlog.key.as_deref(), Some(&b"o-1"[..]));
    // json keeps its text as written (two spaces), unlike jsonb.
    assert_eq!(backlog.payload.as_deref(), Some(&br#"{"n":  1}"#[..]));
    assert!(backlog.header("occurred_at").is_some());
    let streamed = by_key(&records, &key);
    assert_eq!(key, "3");
    assert_eq!(streamed.header("event_type"), Some("Paid"));
    assert_eq!(streamed.payload.as_deref(), Some(&br#"{"n": 2}"#[..]));
    let extra = harness::reread(&db.topic, &records, Duration::from_secs(2)).await;
    assert_eq!(
        extra.len(),
        2,
        "the row the poller had sent is not sent again"
    );
    // The sent row counts as expected by the audit but is not on the topic: audit
    // only the rows the relay was responsible for.
    db.client
        .batch_execute("DELETE FROM outbox WHERE id = 1")
        .await
        .unwrap();
    assert_audit_clean(&db, 2);
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;
}

/// One table shape of the id/payload matrix: the column types, two rows written by
/// plain INSERTs and the record values they must become.
async fn relay_shape(prefix: &str, id_sql: &str, payload_type: &str, rows: &[(&str, &str, &[u8])]) {
    let (db, migrated) = adopt(
        prefix,
        &format!(
            "CREATE TABLE outbox (
                 {id_sql},
                 aggregate_type text NOT NULL,
                 aggregate_id text NOT NULL,
                 event_type text NOT NULL,
                 payload {payload_type} NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now())"
        ),
        "{name}.events",
        "[outbox.columns]\ntopic = \"\"\nheaders = \"\"\nidempotency_key = \"\"\n",
    )
    .await;
    assert!(
        migrated.contains("0001_outbox adapted"),
        "no sent_at column: {migrated}"
    );
    harness::create_topic(&db.topic, 1).await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let mut ids = Vec::new();
    for (entity, payload_sql, _) in rows {
        let id: String = db
            .client
            .query_one(
                &format!(
                    "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('order', $1, 'Created', {payload_sql}) RETURNING id::text"
                ),
                &[entity],
            )
            .await
            .unwrap()
            .get(0);
        ids.push(id);
    }
    let records =
        harness::consume_exactly(&db.topic, rows.len(), Duration::from_secs(30), &relay).await;
    for (id, (entity, _, value)) in ids.iter().zip(rows) {
        let record = by_key(&records, id);
        assert_eq!(record.key.as_deref(), Some(entity.as_bytes()), "{id}");
        assert_eq!(
            record.payload.as_deref(),
            Some(*value),
            "{id}: payload bytes"
        );
        assert_eq!(record.header("event_type"), Some("Created"));
    }
    assert_audit_clean(&db, rows.len() as u64);
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;
}

/// A bigint identity id, a text payload (sent as its UTF-8 bytes, not JSON).
#[tokio::test]
async fn bigint_id_and_text_payload() {
    relay_shape(
        "adopt_int",
        "id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
        "text",
        &[
            ("e-1", "'plain text, not JSON'", b"plain text, not JSON"),
            (
                "e-2",
                "'caf\u{e9} \u{2713}'",
                "caf\u{e9} \u{2713}".as_bytes(),
            ),
        ],
    )
    .await;
}

/// A uuid id with a default, a bytea payload (sent as the raw bytes, any bytes).
#[tokio::test]
async fn uuid_id_and_bytea_payload() {
    relay_shape(
        "adopt_uuid",
        "id uuid PRIMARY KEY DEFAULT gen_random_uuid()",
        "bytea",
        &[
            ("e-1", "'\\x00ff10'::bytea", &[0x00, 0xff, 0x10]),
            ("e-2", "convert_to('{\"a\": 1}', 'UTF8')", br#"{"a": 1}"#),
        ],
    )
    .await;
}

/// A text id (made by the table's own default expression) and a json payload,
/// whose text is sent as written.
#[tokio::test]
async fn text_id_and_json_payload() {
    relay_shape(
        "adopt_text",
        "id text PRIMARY KEY DEFAULT 'evt-' || gen_random_uuid()::text",
        "json",
        &[
            ("e-1", "'{\"b\" : [1, 2]}'", br#"{"b" : [1, 2]}"#),
            ("e-2", "'[]'", b"[]"),
        ],
    )
    .await;
}

/// Debezium's router turns a row with a NULL payload into a tombstone when
/// `route.tombstone.on.empty.payload` is set; `outbox.tombstone_on_empty_payload`
/// does the same: the record has the row's key and a null value (what log
/// compaction reads as "delete this key"), the row is not poisoned, and the audit
/// counts it delivered.
#[tokio::test]
async fn a_null_payload_is_relayed_as_a_tombstone_with_the_debezium_option() {
    let (db, _) = adopt(
        "adopt_tomb",
        "CREATE TABLE outbox (
             id uuid PRIMARY KEY,
             aggregatetype varchar(255) NOT NULL,
             aggregateid varchar(255) NOT NULL,
             type varchar(255) NOT NULL,
             payload jsonb)",
        "{name}.customers",
        "[outbox]\npreset = \"debezium\"\ntombstone_on_empty_payload = true\n",
    )
    .await;
    harness::create_topic(&db.topic, 1).await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let (created, deleted) = (
        "0190a5f0-0000-7000-8000-0000000000a1",
        "0190a5f0-0000-7000-8000-0000000000a2",
    );
    db.client
        .batch_execute(&format!(
            "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload)
                 VALUES ('{created}', 'customer', 'c-1', 'CustomerCreated', '{{\"name\": \"Ada\"}}');
             INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload)
                 VALUES ('{deleted}', 'customer', 'c-1', 'CustomerDeleted', NULL);"
        ))
        .await
        .unwrap();
    let records = harness::consume_exactly(&db.topic, 2, Duration::from_secs(30), &relay).await;
    let first = by_key(&records, created);
    assert_eq!(first.payload.as_deref(), Some(&br#"{"name": "Ada"}"#[..]));
    let tombstone = by_key(&records, deleted);
    assert_eq!(tombstone.key.as_deref(), Some(&b"c-1"[..]));
    assert_eq!(tombstone.payload, None, "a null value, not an empty one");
    assert_eq!(tombstone.header("event_type"), Some("CustomerDeleted"));
    assert!(tombstone.offset > first.offset);
    assert_eq!(db.poison_rows().await, 0);
    assert_audit_clean(&db, 2);
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;
}
