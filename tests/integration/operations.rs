//! Running it in production: the metrics and health endpoints, the heartbeat, and
//! the least-privilege role. Real relay processes, real PostgreSQL, real broker;
//! the endpoints are read over plain HTTP/1.1 like a Prometheus scraper or a
//! Kubernetes probe would.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::{self, RelayProcess, TestDb, confirmed_flush, parse_lsn, unique};

/// `GET path` on `addr`; returns the status code and the body.
pub(crate) async fn http_get(addr: &str, path: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.expect("read");
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The value of the first sample whose name (with labels) is exactly `series`.
pub(crate) fn sample(page: &str, series: &str) -> Option<f64> {
    page.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// Waits for the relay's "listening" line and returns the bound address.
pub(crate) async fn metrics_addr(relay: &RelayProcess) -> String {
    let mut found = None;
    harness::wait_until(
        Duration::from_secs(30),
        "metrics endpoint to listen",
        || {
            let log = relay.log();
            found = log
                .lines()
                .find(|l| l.contains("metrics and health endpoints listening"))
                .and_then(|l| l.split("addr=").nth(1))
                .map(|a| a.trim().to_owned());
            let ok = found.is_some();
            async move { ok }
        },
    )
    .await;
    found.unwrap_or_default()
}

/// Waits until `/readyz` answers 503 with `needle` in its body.
async fn wait_not_ready(addr: &str, timeout: Duration, what: &str, needle: &str) {
    harness::wait_until(timeout, what, || async move {
        let (status, body) = http_get(addr, "/readyz").await;
        status == 503 && body.contains(needle)
    })
    .await;
}

/// Waits until `/readyz` answers 200.
async fn wait_ready(addr: &str, timeout: Duration) {
    harness::wait_until(timeout, "/readyz to recover", || async move {
        http_get(addr, "/readyz").await.0 == 200
    })
    .await;
}

pub(crate) async fn metrics_page(addr: &str) -> String {
    let (status, body) = http_get(addr, "/metrics").await;
    assert_eq!(status, 200, "{body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_readiness_follow_the_relay() {
    let mut broker = harness::PrivateBroker::start().await;
    let mut db = TestDb::create("ops_metrics").await;
    harness::create_topic_on(&broker.brokers(), &db.topic, 3).await;
    let brokers = broker.brokers();
    let relay = RelayProcess::start(
        &db.config_path,
        &[
            ("OUTBOX_RELAY__KAFKA__BROKERS", brokers.as_str()),
            ("OUTBOX_RELAY__METRICS__LISTEN", "127.0.0.1:0"),
            ("OUTBOX_RELAY__METRICS__READY_STALL_SECS", "2"),
            ("OUTBOX_RELAY__RELAY__HEARTBEAT_INTERVAL_SECS", "1"),
        ],
    );
    let addr = metrics_addr(&relay).await;
    db.wait_streaming(&relay).await;
    assert_eq!(http_get(&addr, "/healthz").await, (200, "ok\n".to_owned()));
    assert_eq!(http_get(&addr, "/readyz").await.0, 200);

    for i in 0..20 {
        db.insert_event(
            &format!("e{}", i % 4),
            "Created",
            &format!(r#"{{"i": {i}}}"#),
        )
        .await;
    }
    let records = harness::consume_from(&brokers, &db.topic, 20, Duration::from_secs(60)).await;
    assert_eq!(records.len(), 20, "log:\n{}", relay.log());
    let relayed = format!(
        "outbox_relay_events_relayed_total{{topic=\"{}\"}}",
        db.topic
    );
    let a = addr.clone();
    harness::wait_until(
        Duration::from_secs(30),
        "the counters to show 20 events",
        || {
            let (a, relayed) = (a.clone(), relayed.clone());
            async move {
                let page = metrics_page(&a).await;
                sample(&page, &relayed) == Some(20.0)
                    && sample(&page, "outbox_relay_delivery_latency_seconds_count") == Some(20.0)
                    && sample(&page, "outbox_relay_heartbeat_round_trip_seconds_count")
                        .is_some_and(|n| n >= 1.0)
                    && sample(&page, "outbox_relay_slot_lag_bytes").is_some()
                    && sample(&page, "outbox_relay_slot_retained_wal_bytes").is_some()
                    && sample(&page, "outbox_relay_slot_safe_wal_bytes").is_some()
                    && sample(&page, "outbox_relay_slot_lag_seconds") == Some(0.0)
            }
        },
    )
    .await;
    let page = metrics_page(&addr).await;
    let confirmed = sample(&page, "outbox_relay_confirmed_lsn").expect("confirmed gauge");
    let received = sample(&page, "outbox_relay_received_lsn").expect("received gauge");
    assert!(confirmed > 0.0 && received >= confirmed, "{page}");
    assert_eq!(sample(&page, "outbox_relay_streaming"), Some(1.0), "{page}");
    assert_eq!(sample(&page, "outbox_relay_ready"), Some(1.0), "{page}");
    assert!(
        page.contains("# TYPE outbox_relay_delivery_latency_seconds histogram"),
        "{page}"
    );

    // Broker gone: the event stays in flight, the confirmed LSN stops, and after
    // ready_stall_secs the relay is not ready (while /healthz stays fine).
    broker.stop();
    db.insert_event("e0", "Created", r#"{"i": 20}"#).await;
    wait_not_ready(
        &addr,
        Duration::from_secs(60),
        "/readyz to report the stall",
        "events pending",
    )
    .await;
    assert_eq!(http_get(&addr, "/healthz").await.0, 200);
    let page = metrics_page(&addr).await;
    assert!(
        sample(&page, "outbox_relay_in_flight_events").is_some_and(|n| n >= 1.0),
        "{page}"
    );
    // The ready gauge says what /readyz says; the pending event's age is at least
    // the stall window (its commit preceded it).
    assert_eq!(sample(&page, "outbox_relay_ready"), Some(0.0), "{page}");
    assert!(
        sample(&page, "outbox_relay_slot_lag_seconds").is_some_and(|s| s >= 2.0),
        "{page}"
    );

    broker.resume().await;
    wait_ready(&addr, Duration::from_secs(90)).await;
    let records = harness::consume_from(&brokers, &db.topic, 21, Duration::from_secs(60)).await;
    assert!(records.len() >= 21, "log:\n{}", relay.log());
    let a = addr.clone();
    harness::wait_until(
        Duration::from_secs(30),
        "the ready gauge back at 1 and nothing unconfirmed",
        || {
            let a = a.clone();
            async move {
                let page = metrics_page(&a).await;
                sample(&page, "outbox_relay_ready") == Some(1.0)
                    && sample(&page, "outbox_relay_slot_lag_seconds") == Some(0.0)
            }
        },
    )
    .await;
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_advances_the_slot_while_other_databases_write() {
    let mut db = TestDb::create("ops_heartbeat").await;
    let relay = RelayProcess::start(
        &db.config_path,
        &[("OUTBOX_RELAY__RELAY__HEARTBEAT_INTERVAL_SECS", "1")],
    );
    db.wait_streaming(&relay).await;
    db.insert_event("e", "Created", "{}").await;
    harness::consume_exactly(&db.topic, 1, Duration::from_secs(60), &relay).await;
    // WAL from another database only: this database's outbox stays idle.
    let (other, conn) = tokio_postgres::connect(&harness::env().pg_url, tokio_postgres::NoTls)
        .await
        .expect("connect to the postgres database");
    tokio::spawn(conn);
    let table = unique("ops_heartbeat_other");
    other
        .batch_execute(&format!(
            "CREATE TABLE {table} (x int); INSERT INTO {table} SELECT generate_series(1, 5000);"
        ))
        .await
        .expect("write in another database");
    let after: String = other
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .expect("current LSN")
        .get(0);
    let after = parse_lsn(&after);
    let client = &db.client;
    harness::wait_until(
        Duration::from_secs(40),
        "confirmed_flush_lsn to pass the other database's WAL",
        || async { confirmed_flush(client, &db.slot).await >= after },
    )
    .await;
    other
        .batch_execute(&format!("DROP TABLE {table}"))
        .await
        .expect("drop the table");
    assert!(!relay.log().contains("heartbeat failed"), "{}", relay.log());
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// The documented least-privilege role (`config/least-privilege.sql`) is enough to
/// relay, poison and heartbeat, and gives nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_privilege_role_relays_poisons_and_heartbeats() {
    let mut db = TestDb::create("ops_role").await;
    let role = unique("relay_app");
    let grants =
        include_str!("../../config/least-privilege.sql").replace("outbox_relay_app", &role);
    db.client
        .batch_execute(&grants)
        .await
        .expect("apply the documented grants");
    let url = db.url.replacen("://postgres@", &format!("://{role}@"), 1);
    assert_ne!(url, db.url, "test URLs name the postgres user");

    let relay = RelayProcess::start(
        &db.config_path,
        &[
            ("OUTBOX_RELAY__POSTGRES__URL", url.as_str()),
            ("OUTBOX_RELAY__RELAY__HEARTBEAT_INTERVAL_SECS", "1"),
        ],
    );
    db.wait_streaming(&relay).await;
    for i in 0..5 {
        db.insert_event("e", "Created", &format!(r#"{{"i": {i}}}"#))
            .await;
    }
    // No entity id: unmappable, so the relay writes it to the poison table.
    db.client
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', NULL, 'Created', '{}')",
            &[],
        )
        .await
        .expect("insert a row without a key");
    harness::consume_exactly(&db.topic, 5, Duration::from_secs(60), &relay).await;
    let client = &db.client;
    harness::wait_until(Duration::from_secs(30), "the poison row", || async {
        client
            .query_one("SELECT count(*) FROM poison_outbox", &[])
            .await
            .map(|r| r.get::<_, i64>(0) == 1)
            .unwrap_or(false)
    })
    .await;
    // Heartbeats ran as the role: two ticks completed on one connection of the
    // role (a failed tick drops its connection, and logs a failure).
    let heartbeat_tick = || async {
        client
            .query_opt(
                "SELECT pid, query_start::text FROM pg_stat_activity
                 WHERE usename = $1 AND state = 'idle'
                   AND query LIKE '%(w.lsn - restart_lsn)::float8%'",
                &[&role],
            )
            .await
            .ok()
            .flatten()
            .map(|r| (r.get::<_, i32>(0), r.get::<_, Option<String>>(1)))
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut first = None;
    loop {
        let tick = heartbeat_tick().await;
        match (&first, tick) {
            (Some((pid, at)), Some((now_pid, now_at))) if *pid == now_pid && *at != now_at => {
                break;
            }
            (None, tick) => first = tick,
            _ => {}
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no two heartbeats as the role; log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!relay.log().contains("heartbeat failed"), "{}", relay.log());

    // ... and the role can do nothing else to the outbox.
    let row = db
        .client
        .query_one(
            "SELECT has_table_privilege($1, 'outbox', 'DELETE'),
                    has_table_privilege($1, 'outbox', 'UPDATE'),
                    has_table_privilege($1, 'outbox', 'INSERT'),
                    has_table_privilege($1, 'poison_outbox', 'DELETE'),
                    has_column_privilege($1, 'poison_outbox', 'error', 'UPDATE'),
                    (SELECT rolsuper OR rolcreatedb OR rolcreaterole FROM pg_roles WHERE rolname = $1)",
            &[&role],
        )
        .await
        .expect("read privileges");
    let granted: Vec<bool> = (0..row.len()).map(|i| row.get(i)).collect();
    assert_eq!(granted, vec![false; 6], "the role has more than it needs");

    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
    db.client
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .expect("drop the role");
}

/// The delivery-failure policy for a topic that does not exist yet (it used to be
/// poisoned within seconds): with the default `relay.on_config_error = "block"` the
/// events wait, the relay says which topic and what to do, `/readyz` is 503 and the
/// metric counts; the topic is created a minute after the first event and every
/// event arrives, in per-key order, none poisoned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_created_a_minute_late_receives_every_event_in_order() {
    let mut db = TestDb::create("ops_late_topic").await;
    let late = format!("{}.late", db.name);
    let relay = RelayProcess::start(
        &db.config_path,
        &[
            ("OUTBOX_RELAY__KAFKA__TOPIC_TEMPLATE", late.as_str()),
            ("OUTBOX_RELAY__METRICS__LISTEN", "127.0.0.1:0"),
        ],
    );
    let addr = metrics_addr(&relay).await;
    db.wait_streaming(&relay).await;
    let first = std::time::Instant::now();
    for seq in 0..20 {
        let entity = format!("e{}", seq % 2);
        db.insert_event(&entity, "Created", &format!(r#"{{"seq": {seq}}}"#))
            .await;
    }
    wait_not_ready(
        &addr,
        Duration::from_secs(60),
        "/readyz to name the refused topic",
        "the broker refuses",
    )
    .await;
    let log = relay.log();
    assert!(
        log.contains("the broker refuses this topic's events"),
        "{log}"
    );
    assert!(log.contains(&late), "the log names the topic: {log}");
    let page = metrics_page(&addr).await;
    assert!(
        page.lines()
            .any(|l| l.starts_with("outbox_relay_configuration_errors_total")),
        "{page}"
    );
    tokio::time::sleep(Duration::from_secs(60).saturating_sub(first.elapsed())).await;
    harness::create_topic(&late, 3).await;
    let records = harness::consume_unique(&late, 20, Duration::from_secs(120), &relay).await;
    harness::assert_per_key_order(&records);
    let poisoned: i64 = db.poison_rows().await;
    assert_eq!(poisoned, 0, "nothing poisoned; log:\n{}", relay.log());
    wait_ready(&addr, Duration::from_secs(60)).await;
    assert!(relay.log().contains("accepts this topic's events again"));
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// `relay.on_poison = "halt"`: an event that would be poisoned is not; the relay
/// stops confirming before it, holds its entity's later events, lets other entities
/// flow, and says so (`/readyz` 503 naming the event, a gauge, an error log). Fixed
/// and restarted, it delivers the event and the held ones in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_poison_halt_stops_confirming_and_alerts_until_fixed() {
    let mut db = TestDb::create_with("ops_halt", 1).await;
    let original = std::fs::read_to_string(&db.config_path).unwrap();
    db.append_config(
        "\n[relay]\non_poison = \"halt\"\nmax_attempts = 2\n\
         \n[kafka.producer]\n\"message.max.bytes\" = \"100000\"\n",
    );
    let relay = RelayProcess::start(
        &db.config_path,
        &[("OUTBOX_RELAY__METRICS__LISTEN", "127.0.0.1:0")],
    );
    let addr = metrics_addr(&relay).await;
    db.wait_streaming(&relay).await;
    db.insert_event("a", "Created", r#"{"seq": 0}"#).await;
    let before_bad = confirmed_flush(&db.client, &db.slot).await;
    let big = format!(r#"{{"seq": 1, "blob": "{}"}}"#, "x".repeat(200_000));
    let bad_key = db.insert_event("a", "Created", &big).await;
    let after_bad: String = db
        .client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    db.insert_event("a", "Created", r#"{"seq": 2}"#).await;
    db.insert_event("b", "Created", r#"{"seq": 0}"#).await;
    wait_not_ready(
        &addr,
        Duration::from_secs(60),
        "/readyz to report the halt",
        "halt",
    )
    .await;
    let (_, body) = http_get(&addr, "/readyz").await;
    assert!(body.contains(&bad_key), "the alert names the event: {body}");
    assert_eq!(
        sample(&metrics_page(&addr).await, "outbox_relay_halted_events"),
        Some(1.0)
    );
    let first = harness::consume(&db.topic, 2, Duration::from_secs(60)).await;
    let records = harness::reread(&db.topic, &first, Duration::from_secs(3)).await;
    let keys: Vec<&[u8]> = records.iter().filter_map(|r| r.key.as_deref()).collect();
    assert_eq!(
        keys,
        vec![&b"a"[..], b"b"],
        "a:0 and b:0 only; log:\n{}",
        relay.log()
    );
    let poisoned: i64 = db.poison_rows().await;
    assert_eq!(poisoned, 0);
    // b:0 was delivered after it, yet the slot stays before the halted event.
    let confirmed = confirmed_flush(&db.client, &db.slot).await;
    assert!(
        confirmed >= before_bad && confirmed < parse_lsn(&after_bad),
        "confirmed {confirmed:#x}, halted event before {after_bad}"
    );
    assert!(
        relay
            .log()
            .contains("an event cannot be delivered and relay.on_poison = \"halt\""),
        "{}",
        relay.log()
    );
    relay.terminate(Duration::from_secs(30)).await;

    // Fixed: the default 1 MB producer limit; the restarted relay delivers a:1, a:2.
    std::fs::write(
        &db.config_path,
        format!("{original}\n[relay]\non_poison = \"halt\"\n"),
    )
    .unwrap();
    let relay = RelayProcess::start(&db.config_path, &[]);
    let records = harness::consume_unique(&db.topic, 4, Duration::from_secs(60), &relay).await;
    harness::assert_per_key_order(&records);
    relay.terminate(Duration::from_secs(30)).await;
    let audit = harness::audit(&db);
    assert_eq!(
        (audit["lost"].as_i64(), audit["poisoned"].as_i64()),
        (Some(0), Some(0)),
        "{audit}"
    );
}

/// `relay.read_pause_ms`: live traffic read in pauses (concurrent writers, then a
/// sparse tail) arrives whole, once, in each key's commit order, and the slot is
/// confirmed past it; each sparse event is followed by a counted pause, so they
/// were taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_in_pauses_loses_nothing_and_keeps_order() {
    let mut db = TestDb::create("ops_read_pause").await;
    let relay = RelayProcess::start(
        &db.config_path,
        &[
            ("OUTBOX_RELAY__RELAY__READ_PAUSE_MS", "5"),
            ("OUTBOX_RELAY__METRICS__LISTEN", "127.0.0.1:0"),
        ],
    );
    let addr = metrics_addr(&relay).await;
    db.wait_streaming(&relay).await;
    let workload = outbox_relay::tools::workload::Workload {
        events: 2_000,
        payload_bytes: 100,
        rows_per_tx: 3,
        writers: 4,
        entities: 20,
    };
    let written = db
        .writers(workload)
        .varied()
        .run()
        .await
        .expect("write the workload");
    let mut expected = written.committed;
    // The writers' burst is relayed first, so each sparse event below reaches an
    // idle relay: it is read alone and followed by a pause, whatever the load.
    harness::consume_exactly(&db.topic, expected.len(), Duration::from_secs(90), &relay).await;
    let pauses = || async { sample(&metrics_page(&addr).await, "outbox_relay_read_pauses_total") };
    for i in 0..20 {
        let before = pauses().await.unwrap_or(0.0);
        expected.push(
            db.insert_event(
                &format!("tail{}", i % 3),
                "Tail",
                &format!(r#"{{"seq": {i}}}"#),
            )
            .await,
        );
        harness::wait_until(
            Duration::from_secs(30),
            &format!("a pause after sparse event {i}"),
            || async { pauses().await.is_some_and(|n| n > before) },
        )
        .await;
    }
    let first =
        harness::consume_exactly(&db.topic, expected.len(), Duration::from_secs(90), &relay).await;
    let records = harness::reread(&db.topic, &first, Duration::from_secs(3)).await;
    let keys: Vec<&str> = records
        .iter()
        .map(|r| r.header("idempotency_key").expect("idempotency key"))
        .collect();
    let unique: std::collections::HashSet<&str> = keys.iter().copied().collect();
    assert_eq!(unique.len(), keys.len(), "no duplicates when nothing fails");
    assert_eq!(
        unique,
        expected.iter().map(String::as_str).collect(),
        "exactly the committed events"
    );
    harness::assert_per_key_order(&records);
    let last = records
        .iter()
        .map(|r| parse_lsn(r.header("source_lsn").expect("source_lsn")))
        .max()
        .unwrap_or(0);
    harness::wait_confirmed_past(&db, last).await;
    let status = relay.terminate(Duration::from_secs(30)).await;
    assert!(status.success(), "clean stop exits 0: {status:?}");
    db.drop_slot().await;
}
