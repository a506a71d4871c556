//! `migrate` with outbox and poison table names that are not plain lower-case
//! identifiers: a `-` and capitals (valid only quoted), and 63-byte names (the most
//! PostgreSQL keeps of an identifier) that share their first 60 bytes. Every index
//! the migrations create must exist on the right table — above all the poison
//! table's unique occurrence index, which is what de-duplicates poisoned events —
//! `check` must find nothing missing, and the tables must work.

use std::time::Duration;

use outbox_relay::ops::migrate::names::{Index as Named, index_name};

use crate::harness::{self, RelayProcess, TestDb};

/// One index of a table, as the catalog has it.
#[derive(Debug)]
struct Index {
    name: String,
    unique: bool,
    valid: bool,
    definition: String,
}

/// The indexes of `table` (a configured name, `schema.table`) but its primary key.
async fn indexes(db: &TestDb, table: &str) -> Vec<Index> {
    let (schema, name) = table.split_once('.').unwrap();
    let quoted = format!("\"{schema}\".\"{name}\"");
    db.client
        .query(
            "SELECT c.relname::text, i.indisunique, i.indisvalid, pg_get_indexdef(i.indexrelid)
             FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE i.indrelid = to_regclass($1) AND NOT i.indisprimary
             ORDER BY 1",
            &[&quoted],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| Index {
            name: r.get(0),
            unique: r.get(1),
            valid: r.get(2),
            definition: r.get(3),
        })
        .collect()
}

/// The one index of `list` whose definition contains `part`.
fn find<'a>(list: &'a [Index], part: &str, what: &str) -> &'a Index {
    let found: Vec<&Index> = list
        .iter()
        .filter(|i| i.definition.contains(part))
        .collect();
    assert_eq!(
        found.len(),
        1,
        "{what}: no single index with {part:?} in {list:#?}"
    );
    assert!(found[0].valid, "{what}: {:?} is not valid", found[0]);
    found[0]
}

/// A fresh database migrated with these table names; asserts that each index of
/// the migrations exists on its table and returns the indexes' names as
/// `[outbox unsent, poison key, poison occurrence, poison key order]`.
async fn migrated(prefix: &str, outbox: &str, poison: &str) -> (TestDb, [String; 4]) {
    let toml = format!("\n[outbox]\ntable = \"{outbox}\"\npoison_table = \"{poison}\"\n");
    let db = TestDb::create_configured(prefix, 1, &toml).await;
    let on_outbox = indexes(&db, outbox).await;
    let unsent = find(&on_outbox, "WHERE (sent_at IS NULL)", "outbox unsent index");
    let on_poison = indexes(&db, poison).await;
    let key = find(&on_poison, "(idempotency_key)", "poison key index");
    let occurrence = find(
        &on_poison,
        "(duplicate_of IS NULL)",
        "poison occurrence index",
    );
    assert!(occurrence.unique, "{occurrence:?} is not unique");
    let key_order = find(
        &on_poison,
        "(parked OR holds_key)",
        "poison key-order index",
    );
    let names = [unsent, key, occurrence, key_order].map(|i| i.name.clone());
    for name in &names {
        assert!(name.len() <= 63, "{name:?} is longer than PostgreSQL keeps");
    }
    (db, names)
}

/// Records the same poisoned occurrence twice, as the relay does (`ON CONFLICT DO
/// NOTHING`): the unique occurrence index must keep one row.
async fn assert_poison_deduplicated(db: &TestDb, poison: &str) {
    let (schema, name) = poison.split_once('.').unwrap();
    let table = format!("\"{schema}\".\"{name}\"");
    for _ in 0..2 {
        db.client
            .execute(
                &format!(
                    "INSERT INTO {table} (outbox_id, error, error_kind, attempts, lsn)
                     VALUES ('o-1', 'too large', 'permanent', 1, '0/16B3748')
                     ON CONFLICT DO NOTHING"
                ),
                &[],
            )
            .await
            .unwrap();
    }
    let rows: i64 = db
        .client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1, "the same occurrence was recorded twice in {table}");
}

/// The check `name` of `check --json` on this test's config.
fn check(db: &TestDb, name: &str) -> serde_json::Value {
    let config = db.config_path.to_str().unwrap();
    let out = harness::run_cli(&["check", "--json", "--config", config]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let doc: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("check --json printed no JSON ({e}): {stdout}"));
    doc["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no check {name}: {doc}"))
        .clone()
}

/// `check`: the PostgreSQL side finds every migration and index in place.
fn assert_check_ok(db: &TestDb) {
    for name in [
        "postgres.migrations",
        "postgres.publication",
        "postgres.privileges",
    ] {
        let check = check(db, name);
        assert_eq!(check["status"], "ok", "{check}");
    }
}

/// Names valid only quoted: each index is named `<table>_<suffix>`, exactly as
/// before for names that fit, capitals and `-` kept; the relay delivers an event
/// enqueued into the outbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quoted_table_names_get_every_index_and_relay() {
    let outbox = "public.Order-Events";
    let poison = "public.Order-Events Poison";
    let (db, names) = migrated("names_quoted", outbox, poison).await;
    assert_eq!(
        names,
        [
            "Order-Events_unsent_idx",
            "Order-Events Poison_key_idx",
            "Order-Events Poison_occurrence_key",
            "Order-Events Poison_key_order_idx",
        ]
    );
    assert_poison_deduplicated(&db, poison).await;
    assert_check_ok(&db);

    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let key: String = db
        .client
        .query_one(
            "SELECT outbox_enqueue('order', 'o-7', 'OrderPlaced', '{\"total\": 7}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let records = harness::consume_exactly(&db.topic, 1, Duration::from_secs(30), &relay).await;
    assert_eq!(records[0].header("idempotency_key"), Some(key.as_str()));
    assert_eq!(records[0].key.as_deref(), Some(&b"o-7"[..]));
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;
}

/// 63-byte names sharing their first 60 bytes: `<table>_<suffix>` would be cut to
/// the table's own name (and every index skipped by `IF NOT EXISTS`), so each index
/// name keeps a shortened table name with a hash of the whole one: distinct, and
/// de-duplication works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_names_of_63_bytes_get_every_index() {
    let shared = format!("{:x<60}", "outbox_relay_events_");
    let outbox = format!("public.{shared}out");
    let poison = format!("public.{shared}poi");
    assert_eq!(outbox.len() - "public.".len(), 63);
    let (db, names) = migrated("names_long", &outbox, &poison).await;
    let mut distinct = names.to_vec();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 4, "{names:?}");
    let config = db.config();
    let expected = Named::ALL.map(|i| i.name(&config.outbox).unwrap());
    assert_eq!(names, expected);
    assert!(names[2].ends_with("_occurrence_key"), "{names:?}");
    assert_eq!(
        names[2],
        index_name(&format!("{shared}poi"), "occurrence_key")
    );
    assert_poison_deduplicated(&db, &poison).await;
    assert_check_ok(&db);
    let key: String = db
        .client
        .query_one(
            "SELECT outbox_enqueue('order', 'o-1', 'OrderPlaced', '{}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let (schema, name) = outbox.split_once('.').unwrap();
    let read: String = db
        .client
        .query_one(
            &format!("SELECT event_type FROM \"{schema}\".\"{name}\" WHERE idempotency_key = $1"),
            &[&key],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(read, "OrderPlaced");

    // Without the unique index, `check` says de-duplication is off.
    db.client
        .batch_execute(&format!("DROP INDEX \"public\".\"{}\"", names[2]))
        .await
        .unwrap();
    let missing = check(&db, "postgres.migrations");
    assert_eq!(missing["status"], "problem", "{missing}");
    let detail = missing["detail"].as_str().unwrap();
    assert!(detail.contains(&names[2]), "{detail}");
    assert!(detail.contains("not de-duplicated"), "{detail}");
}
