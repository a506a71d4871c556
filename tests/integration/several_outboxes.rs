//! One relay, one slot and one publication for two outbox tables of different
//! layouts (`[[outbox]]`): the relay's own layout in `public`, and a Debezium-shaped
//! table in another schema with its own poison table and topic.

use std::collections::HashSet;
use std::time::Duration;

use tokio_postgres::Client;

use crate::harness::{
    self, RelayProcess, TestDb, Written, assert_per_key_order, connect, consume, read_all, tally,
    wait_until,
};

/// Transactions each writer commits or rolls back.
const TRANSACTIONS: i64 = 240;
/// Entities per writer (each key's events carry a growing `seq`).
const ENTITIES: i64 = 4;
/// Between a writer's transactions (inside each, before its commit).
const WRITE_PAUSE: Duration = Duration::from_millis(10);

/// The Debezium router's table, as Debezium users have it.
const DEBEZIUM_TABLE: &str = "CREATE SCHEMA shipping;
     CREATE TABLE shipping.outbox_events (
         id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
         aggregatetype varchar(255) NOT NULL,
         aggregateid varchar(255) NOT NULL,
         type varchar(255) NOT NULL,
         payload jsonb)";

/// Two outbox tables in one relay: concurrent writers to each (with rolled-back
/// transactions, and transactions writing both tables), a kill -9 mid-stream, a
/// poison row of the second table; each table's events reach its topic with lost 0
/// and per-key order, none from a rolled-back transaction, the poison row lands in
/// the second table's poison table, and `migrate`, `check`, `audit`, `status` and
/// `retention` see both tables.
#[tokio::test]
async fn one_relay_serves_two_outbox_tables_of_different_layouts() {
    let mut db = TestDb::create("two_outboxes").await;
    db.client.batch_execute(DEBEZIUM_TABLE).await.unwrap();
    let shipping_topic = format!("{}.shipping", db.name);
    harness::create_topic(&shipping_topic, 3).await;
    db.append_config(&format!(
        "\n[[outbox]]\ntable = \"public.outbox\"\npoison_table = \"public.poison_outbox\"\n\
         \n[[outbox]]\ntable = \"shipping.outbox_events\"\npreset = \"debezium\"\n\
         poison_table = \"shipping.poison_outbox\"\ntopic_template = \"{shipping_topic}\"\n"
    ));
    let config = db.config_path.to_str().unwrap().to_owned();

    // migrate: the second outbox's migrations (its poison table, adopted for the
    // Debezium layout) and its place in the publication.
    let out = harness::run_cli(&["migrate", "--config", &config]);
    let migrated = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{migrated}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        migrated.contains("outbox shipping.outbox_events added to the publication"),
        "{migrated}"
    );
    assert!(
        migrated.contains("outbox shipping.outbox_events: migration 0001_outbox adapted"),
        "{migrated}"
    );
    let again = harness::run_cli(&["migrate", "--config", &config]);
    let again = String::from_utf8_lossy(&again.stdout).into_owned();
    for table in ["public.outbox", "shipping.outbox_events"] {
        assert!(
            again.contains(&format!("outbox {table}: migrations: 0 applied")),
            "{again}"
        );
    }
    assert!(!again.contains("added to the publication"), "{again}");

    // check: the per-table checks name both tables, none is a problem.
    let out = harness::run_cli(&["check", "--json", "--config", &config]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let checks = report["checks"].as_array().expect("checks");
    for check in checks {
        assert_ne!(check["status"], "problem", "{check}");
    }
    let publication = checks
        .iter()
        .find(|c| c["name"] == "postgres.publication")
        .expect("a publication check");
    let detail = publication["detail"].as_str().unwrap();
    assert!(
        detail.contains("public.outbox:") && detail.contains("shipping.outbox_events:"),
        "{detail}"
    );

    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let orders = tokio::spawn(write_orders(db.url.clone()));
    let parcels = tokio::spawn(write_parcels(db.url.clone()));
    // A row of the second table that can never be delivered (no payload).
    db.client
        .execute(
            "INSERT INTO shipping.outbox_events (aggregatetype, aggregateid, type, payload)
             VALUES ('parcel', 'p-poison', 'ParcelLost', NULL)",
            &[],
        )
        .await
        .unwrap();
    // Killed mid-stream, then started again: what it had not confirmed comes again.
    let first = consume(&db.topic, 50, Duration::from_secs(60)).await;
    assert!(first.len() >= 50, "relay log:\n{}", relay.log());
    relay.kill9().await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        !orders.is_finished() && !parcels.is_finished(),
        "the writers finished before the kill: write more"
    );
    let relay = RelayProcess::start(&db.config_path, &[]);
    let orders = orders.await.unwrap();
    let parcels = parcels.await.unwrap();

    // The mixed transactions put one parcel event per committed order transaction
    // into the second table too (key "mixed").
    let order_keys: HashSet<&str> = orders.0.committed.iter().map(String::as_str).collect();
    let parcel_keys: HashSet<&str> = parcels
        .committed
        .iter()
        .chain(&orders.1.committed)
        .map(String::as_str)
        .collect();
    let order_records = read_all(&db.topic, &order_keys, &relay).await;
    let parcel_records = read_all(&shipping_topic, &parcel_keys, &relay).await;
    for (records, rolled_back) in [
        (&order_records, &orders.0.rolled_back),
        (&parcel_records, &parcels.rolled_back),
        (&parcel_records, &orders.1.rolled_back),
    ] {
        for key in rolled_back {
            assert!(
                records
                    .iter()
                    .all(|r| r.header("idempotency_key") != Some(key)),
                "event {key} of a rolled-back transaction was published"
            );
        }
    }
    assert_per_key_order(&order_records);
    assert_per_key_order(&parcel_records);
    let (order_events, order_dups) = tally(&order_records);
    let (parcel_events, parcel_dups) = tally(&parcel_records);
    assert_eq!(
        order_events,
        order_keys.len(),
        "orders: no stranger, no loss"
    );
    assert_eq!(
        parcel_events,
        parcel_keys.len(),
        "parcels: no stranger, no loss"
    );
    // Each record's layout is its table's: the Debezium one has no created_at.
    assert!(
        order_records
            .iter()
            .all(|r| r.header("occurred_at").is_some())
    );
    assert!(
        parcel_records
            .iter()
            .all(|r| r.header("occurred_at").is_none() && r.header("event_type").is_some())
    );

    // The poison row is in the second outbox's poison table, and only there.
    wait_until(Duration::from_secs(30), "the poison row", || async {
        count(&db.client, "shipping.poison_outbox").await == 1
    })
    .await;
    assert_eq!(count(&db.client, "public.poison_outbox").await, 0);

    let audit = harness::audit(&db);
    assert_eq!(audit["lost"], 0, "{audit}");
    assert_eq!(audit["out_of_order_keys"], 0, "{audit}");
    assert_eq!(audit["poisoned"], 1, "{audit}");
    assert_eq!(
        audit["expected"],
        u64::try_from(order_keys.len() + parcel_keys.len() + 1).unwrap(),
        "{audit}"
    );

    let out = harness::run_cli(&["status", "--json", "--config", &config]);
    let status: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(status["poison_total"], 1, "{status}");
    let outboxes = status["outboxes"].as_array().expect("outboxes in status");
    assert_eq!(outboxes.len(), 2, "{status}");
    assert_eq!(outboxes[1]["poison_table"], "shipping.poison_outbox");
    assert_eq!(outboxes[1]["poison_total"], 1, "{status}");

    let out = harness::run_cli(&[
        "retention",
        "--once",
        "--dry-run",
        "--json",
        "--config",
        &config,
    ]);
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // The Debezium layout has no created_at: retention leaves that table alone.
    let tables: Vec<&str> = lines.iter().filter_map(|l| l["table"].as_str()).collect();
    assert_eq!(
        tables,
        ["public.outbox"],
        "{lines:?} {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // replay needs to know which poison table: named, it finds the row.
    let out = harness::run_cli(&["replay", "--all", "--dry-run", "--config", &config]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--outbox TABLE"));
    let out = harness::run_cli(&[
        "replay",
        "--all",
        "--dry-run",
        "--json",
        "--outbox",
        "shipping.outbox_events",
        "--config",
        &config,
    ]);
    let replay: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(replay["selected"], 1, "{replay}");

    // A third outbox cannot join the publication under the existing slot: its
    // earlier rows would never be streamed. migrate refuses, naming the slot.
    db.client
        .batch_execute("CREATE TABLE shipping.late_outbox (LIKE public.outbox INCLUDING ALL)")
        .await
        .unwrap();
    db.append_config(
        "\n[[outbox]]\ntable = \"shipping.late_outbox\"\npoison_table = \"shipping.late_poison\"\n",
    );
    let out = harness::run_cli(&["migrate", "--config", &config]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("is not in publication") && stderr.contains(&db.slot),
        "{stderr}"
    );
    let published: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM pg_publication_tables WHERE tablename = 'late_outbox'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(published, 0);
    // check names the same problem, without suggesting ALTER PUBLICATION.
    let out = harness::run_cli(&["check", "--json", "--config", &config]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let publication = report["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "postgres.publication")
        .unwrap()
        .clone();
    assert_eq!(publication["status"], "problem", "{publication}");
    let detail = publication["detail"].as_str().unwrap();
    assert!(
        detail.contains("shipping.late_outbox: publication"),
        "{detail}"
    );
    assert!(detail.contains("exists"), "{detail}");
    assert!(
        !publication["fix"]
            .as_str()
            .unwrap()
            .contains("ADD TABLE \"shipping\".\"late_outbox\""),
        "{publication}"
    );

    println!(
        "two outboxes: {order_events} order events ({order_dups} duplicates), \
         {parcel_events} parcel events ({parcel_dups} duplicates) after a kill -9; \
         lost 0, 1 poisoned"
    );
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;
}

/// Rows of `table`.
async fn count(client: &Client, table: &str) -> i64 {
    client
        .query_one(&format!("SELECT count(*) FROM {table}"), &[])
        .await
        .unwrap()
        .get(0)
}

/// Order events into `public.outbox`; every tenth transaction also writes a parcel
/// event into the second table, every seventh rolls back. Returns what was written
/// to each table.
async fn write_orders(url: String) -> (Written, Written) {
    let mut client = connect(&url).await;
    let mut orders = Written::default();
    let mut mixed = Written::default();
    for seq in 0..TRANSACTIONS {
        let tx = client.transaction().await.unwrap();
        let entity = format!("order-{}", seq % ENTITIES);
        let key: String = tx
            .query_one(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', $1, 'OrderChanged', jsonb_build_object('seq', $2::bigint))
                 RETURNING idempotency_key",
                &[&entity, &seq],
            )
            .await
            .unwrap()
            .get(0);
        let parcel = if seq % 10 == 0 {
            let id: String = tx
                .query_one(
                    "INSERT INTO shipping.outbox_events (aggregatetype, aggregateid, type, payload)
                     VALUES ('parcel', 'mixed', 'ParcelBooked', jsonb_build_object('seq', $1::bigint))
                     RETURNING id::text",
                    &[&seq],
                )
                .await
                .unwrap()
                .get(0);
            Some(id)
        } else {
            None
        };
        // Paced, so that the writers are still writing across the kill.
        tokio::time::sleep(WRITE_PAUSE).await;
        if seq % 7 == 3 {
            tx.rollback().await.unwrap();
            orders.rolled_back.push(key);
            mixed.rolled_back.extend(parcel);
        } else {
            tx.commit().await.unwrap();
            orders.committed.push(key);
            mixed.committed.extend(parcel);
        }
    }
    (orders, mixed)
}

/// Debezium-style inserts into `shipping.outbox_events`, two per transaction;
/// every ninth transaction rolls back.
async fn write_parcels(url: String) -> Written {
    let mut client = connect(&url).await;
    let mut written = Written::default();
    for seq in 0..TRANSACTIONS {
        let tx = client.transaction().await.unwrap();
        let mut keys = Vec::new();
        for step in 0..2 {
            let entity = format!("parcel-{}", (seq + step) % ENTITIES);
            let id: String = tx
                .query_one(
                    "INSERT INTO shipping.outbox_events (aggregatetype, aggregateid, type, payload)
                     VALUES ('parcel', $1, 'ParcelMoved', jsonb_build_object('seq', $2::bigint))
                     RETURNING id::text",
                    &[&entity, &(seq * 2 + step)],
                )
                .await
                .unwrap()
                .get(0);
            keys.push(id);
        }
        tokio::time::sleep(WRITE_PAUSE).await;
        written.end(tx, seq % 9 == 4, keys).await;
    }
    written
}

/// Two outboxes of the relay's own layout, drained by `poll` (a poller per table),
/// then cut over by `run`: the rows the poller had not sent, from both tables, are
/// published from the slot's snapshot, and what commits later is streamed. Then the
/// slot is lost while the relay is down, and the next start resyncs both tables.
/// Each topic holds every event of its table, in per-key order.
#[tokio::test]
async fn poll_then_cutover_serve_two_outbox_tables() {
    let mut db = TestDb::create("two_cutover").await;
    db.client
        .batch_execute("CREATE SCHEMA billing")
        .await
        .unwrap();
    let billing_topic = format!("{}.billing", db.name);
    harness::create_topic(&billing_topic, 3).await;
    db.append_config(&format!(
        "\n[[outbox]]\ntable = \"public.outbox\"\n\
         \n[[outbox]]\ntable = \"billing.outbox\"\npoison_table = \"billing.poison_outbox\"\n\
         topic_template = \"{billing_topic}\"\n"
    ));
    let config = db.config_path.to_str().unwrap().to_owned();
    let out = harness::run_cli(&["migrate", "--config", &config]);
    let migrated = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success(), "{migrated}");
    // Both outboxes in one schema would share outbox_enqueue; here each has its own.
    assert!(
        migrated.contains("outbox billing.outbox: migrations: 12 applied"),
        "{migrated}"
    );

    let tables = [
        ("public.outbox", &db.topic),
        ("billing.outbox", &billing_topic),
    ];
    let mut keys: Vec<Vec<String>> = vec![Vec::new(), Vec::new()];
    let mut seq = 0;
    let mut write = async |client: &Client, keys: &mut Vec<Vec<String>>, n: i64| {
        for _ in 0..n {
            for (i, (table, _)) in tables.iter().enumerate() {
                let key: String = client
                    .query_one(
                        &format!(
                            "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload)
                             VALUES ('invoice', $1, 'InvoiceChanged',
                                     jsonb_build_object('seq', $2::bigint))
                             RETURNING idempotency_key"
                        ),
                        &[&format!("k-{}", seq % ENTITIES), &seq],
                    )
                    .await
                    .unwrap()
                    .get(0);
                keys[i].push(key);
            }
            seq += 1;
        }
    };

    write(&db.client, &mut keys, 20).await;
    let poller = RelayProcess::start_command(
        &["poll", "--batch-size", "5", "--poll-interval-ms", "50"],
        &db.config_path,
        &[],
    );
    for (_, topic) in &tables {
        let records = consume(topic, 20, Duration::from_secs(60)).await;
        assert!(records.len() >= 20, "poller log:\n{}", poller.log());
    }
    poller.terminate(Duration::from_secs(20)).await;
    // Left unsent by the poller: the cutover's to publish.
    write(&db.client, &mut keys, 30).await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    assert!(
        relay.log().contains("cutover complete"),
        "relay log:\n{}",
        relay.log()
    );
    write(&db.client, &mut keys, 10).await;

    for (i, (_, topic)) in tables.iter().enumerate() {
        let expected: HashSet<&str> = keys[i].iter().map(String::as_str).collect();
        let records = read_all(topic, &expected, &relay).await;
        let (events, _) = tally(&records);
        assert_eq!(events, 60, "{topic}: every event, none other");
        assert_per_key_order(&records);
    }

    // The slot is lost while the relay is down: the next start resyncs both tables.
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;
    write(&db.client, &mut keys, 15).await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    assert!(
        relay.log().contains("resync complete"),
        "relay log:\n{}",
        relay.log()
    );
    write(&db.client, &mut keys, 5).await;
    for (i, (_, topic)) in tables.iter().enumerate() {
        let expected: HashSet<&str> = keys[i].iter().map(String::as_str).collect();
        let records = read_all(topic, &expected, &relay).await;
        let (events, duplicates) = tally(&records);
        assert_eq!(events, 80, "{topic}: every event, none other");
        assert_per_key_order(&records);
        println!(
            "{topic}: 80 events after a poll, a cutover and a resync, {duplicates} duplicates"
        );
    }
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;
}

/// Two outboxes whose events go to one topic. A message of the first (written with
/// `outbox_emit` before the slot existed: counted in the message ledger, never in
/// the stream) is lost; the second outbox's row of the same entity reaches the
/// topic. `audit` must report the message lost: the other outbox's record is not a
/// delivery of it, although no row of the first outbox explains it either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_outboxs_record_on_a_shared_topic_does_not_hide_a_lost_message() {
    let mut db = TestDb::create("shared_topic_audit").await;
    db.client
        .batch_execute("CREATE SCHEMA billing")
        .await
        .unwrap();
    db.append_config(
        "\n[[outbox]]\ntable = \"public.outbox\"\n\
         \n[[outbox]]\ntable = \"billing.outbox\"\npoison_table = \"billing.poison_outbox\"\n",
    );
    let config = db.config_path.to_str().unwrap().to_owned();
    let out = harness::run_cli(&["migrate", "--config", &config]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Emitted before the relay's slot exists: in the ledger, lost to the stream.
    db.client
        .query_one(
            "SELECT outbox_emit('order', 'order-7', 'OrderPlaced', '{}')",
            &[],
        )
        .await
        .unwrap();
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let invoice: String = db
        .client
        .query_one(
            "INSERT INTO billing.outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'order-7', 'InvoiceIssued', '{}') RETURNING idempotency_key",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let records = harness::consume_exactly(&db.topic, 1, Duration::from_secs(30), &relay).await;
    assert_eq!(records[0].header("idempotency_key"), Some(invoice.as_str()));
    relay.terminate(Duration::from_secs(20)).await;

    let audit = harness::audit(&db);
    assert_eq!(
        audit["lost"], 1,
        "the lost message of order-7 passed for delivered by billing's record: {audit}"
    );
    assert_eq!(audit["expected"], 2, "{audit}");
    assert_eq!(audit["delivered"], 1, "{audit}");
    db.drop_slot().await;
}

/// Two outboxes whose events go to one topic, with the same keys. While the slot is
/// lost, rows of each key are committed to one table, then the other, then the
/// first again (runs of three across four keys); the resync must publish them in
/// that order, as the stream would have. It published the first table's backlog,
/// then the second's: every key went out of order.
async fn a_resync_merges_the_outboxes_in_commit_order(prefix: &str, exactly_once: bool) {
    let broker = exactly_once.then(harness::DevBroker::start);
    let mut db = TestDb::create(prefix).await;
    db.client
        .batch_execute("CREATE SCHEMA billing")
        .await
        .unwrap();
    db.append_config(&format!(
        "\n[relay]\ncutover = \"off\"\n\
         \n[[outbox]]\ntable = \"public.outbox\"\n\
         \n[[outbox]]\ntable = \"billing.outbox\"\npoison_table = \"billing.poison_outbox\"\n\
         topic_template = \"{}\"\n",
        db.topic
    ));
    let config = db.config_path.to_str().unwrap().to_owned();
    let out = harness::run_cli(&["migrate", "--config", &config]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let env = match &broker {
        Some(broker) => crate::exactly_once::exactly_once_on(&broker.address, &db, None).await,
        None => Vec::new(),
    };
    let relay = RelayProcess::start(&db.config_path, &env);
    db.wait_streaming(&relay).await;
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;

    const ROWS: i64 = 48;
    let mut keys: Vec<String> = Vec::new();
    for seq in 0..ROWS {
        let table = if (seq / 3) % 2 == 0 {
            "public.outbox"
        } else {
            "billing.outbox"
        };
        let key: String = db
            .client
            .query_one(
                &format!(
                    "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload)
                     VALUES ('invoice', $1, 'InvoiceChanged', jsonb_build_object('seq', $2::bigint))
                     RETURNING idempotency_key"
                ),
                &[&format!("k-{}", seq % 4), &seq],
            )
            .await
            .unwrap()
            .get(0);
        keys.push(key);
    }
    let relay = RelayProcess::start(&db.config_path, &env);
    db.wait_streaming(&relay).await;
    let log = relay.log();
    assert!(log.contains("resync complete"), "{log}");
    let expected: HashSet<&str> = keys.iter().map(String::as_str).collect();
    let records = match &broker {
        Some(broker) => {
            crate::exactly_once::read_committed_until_complete(
                &broker.address,
                &db.topic,
                keys.len(),
                Duration::from_secs(60),
            )
            .await
        }
        None => read_all(&db.topic, &expected, &relay).await,
    };
    let (events, duplicates) = tally(&records);
    assert_eq!(events, keys.len(), "{log}");
    if exactly_once {
        assert_eq!(duplicates, 0, "read_committed saw rows twice; log:\n{log}");
    }
    assert_per_key_order(&records);
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resync_of_two_outboxes_sharing_keys_keeps_commit_order() {
    a_resync_merges_the_outboxes_in_commit_order("two_merged", false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exactly_once_resync_of_two_outboxes_sharing_keys_keeps_commit_order() {
    a_resync_merges_the_outboxes_in_commit_order("two_merged_eos", true).await;
}
