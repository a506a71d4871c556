//! The hand-written replication connection against the real cluster: every
//! authentication method, each `sslmode`, the metadata connection's TLS, streaming
//! with standby status updates, cancel safety on a real socket, and the server errors
//! the relay must classify (slot in use, missing slot or publication).
//!
//! Roles and TLS files come from `scripts/dev-env` (`OUTBOX_RELAY_TEST_PG_PASSWORD`,
//! `OUTBOX_RELAY_TEST_PG_CA`); each streaming test has its own database and slot.

use std::time::{Duration, SystemTime};

use outbox_relay::delivery::ErrorClass;
use outbox_relay::lsn::Lsn;
use outbox_relay::postgres::connect_metadata;
use outbox_relay::postgres::conninfo::{ConnInfo, Host};
use outbox_relay::postgres::replication::frames::{ServerFrame, StandbyStatus, pg_epoch_micros};
use outbox_relay::postgres::replication::{
    ReplicationConnection, ReplicationError, ReplicationStream, SnapshotAction,
};

use crate::harness::{self, TestDb};

const PUBLICATION: &str = "outbox_relay_pub";
const WAIT: Duration = Duration::from_secs(30);

fn password() -> String {
    std::env::var("OUTBOX_RELAY_TEST_PG_PASSWORD").unwrap_or_else(|_| "relay-test-secret".into())
}

fn ca_path() -> String {
    std::env::var("OUTBOX_RELAY_TEST_PG_CA")
        .unwrap_or_else(|_| concat!(env!("CARGO_MANIFEST_DIR"), "/.dev/pg/tls/ca.crt").into())
}

/// Host and port of the test cluster, from the harness URL.
fn cluster() -> (String, u16) {
    let info = ConnInfo::parse(&harness::env().pg_url).expect("harness URL parses");
    let host = match info.host() {
        Host::Tcp(h) => h.clone(),
        Host::Unix(p) => panic!("the tests need TCP, the harness uses {}", p.display()),
    };
    (host, info.port())
}

fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A URL for `user` on the test cluster; `host` replaces the harness host.
fn url(user: &str, password: Option<&str>, host: Option<&str>, query: &str) -> String {
    let (default_host, port) = cluster();
    let host = host.map_or(default_host, str::to_owned);
    let userinfo = match password {
        Some(p) => format!("{user}:{}", encode(p)),
        None => user.to_owned(),
    };
    let query = if query.is_empty() {
        String::new()
    } else {
        format!("?{query}")
    };
    format!("postgresql://{userinfo}@{host}:{port}/postgres{query}")
}

fn info(url: &str) -> ConnInfo {
    ConnInfo::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
}

async fn connect(url: &str) -> Result<ReplicationConnection, ReplicationError> {
    ReplicationConnection::connect(&info(url)).await
}

async fn scalar(conn: &mut ReplicationConnection, sql: &str) -> Option<String> {
    let rows = conn.simple_query(sql).await.expect(sql);
    assert_eq!(rows.len(), 1, "{sql} returned {rows:?}");
    rows.into_iter()
        .next()
        .and_then(|r| r.into_iter().next())
        .flatten()
}

async fn session_uses_tls(conn: &mut ReplicationConnection) -> bool {
    scalar(
        conn,
        "SELECT ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
    )
    .await
    .as_deref()
        == Some("true")
}

fn status(lsn: Lsn) -> StandbyStatus {
    StandbyStatus {
        write: lsn,
        flush: lsn,
        apply: lsn,
        client_time_micros: pg_epoch_micros(SystemTime::now()),
        reply_requested: false,
    }
}

/// The `end_lsn` of a pgoutput Commit message: 'C', flags, commit LSN, end LSN, time.
fn commit_end_lsn(data: &[u8]) -> Option<Lsn> {
    if data.first() != Some(&b'C') {
        return None;
    }
    let end: [u8; 8] = data.get(10..18)?.try_into().ok()?;
    Some(Lsn(u64::from_be_bytes(end)))
}

async fn next(stream: &mut ReplicationStream) -> ServerFrame {
    tokio::time::timeout(WAIT, stream.next_frame())
        .await
        .expect("a frame within the timeout")
        .expect("next_frame")
        .expect("the stream continues")
}

/// Creates a temporary slot (dropped with the connection) and starts streaming it.
async fn stream_from_temporary_slot(db: &TestDb) -> ReplicationStream {
    let mut conn = connect(&db.url).await.expect("connect");
    let slot = conn
        .create_logical_slot(&db.slot, true, SnapshotAction::NoExport)
        .await
        .expect("create slot");
    assert_eq!(slot.slot_name, db.slot);
    assert!(!slot.consistent_point.is_zero());
    assert_eq!(slot.snapshot_name, None);
    conn.start_logical_replication(&db.slot, Lsn::ZERO, &[PUBLICATION], 1)
        .await
        .expect("START_REPLICATION")
}

#[tokio::test]
async fn trust_connects_and_identifies_the_system() {
    let mut conn = connect(&harness::env().pg_url)
        .await
        .expect("connect as postgres");
    assert_eq!(conn.authentication_method(), "trust");
    assert!(conn.server_major_version().is_some_and(|v| v >= 13));
    assert!(conn.backend_pid().is_some());
    // The session settings pgoutput's text output depends on.
    assert_eq!(conn.server_parameter("TimeZone"), Some("UTC"));
    assert!(
        conn.server_parameter("DateStyle")
            .is_some_and(|d| d.starts_with("ISO"))
    );
    assert_eq!(conn.server_parameter("client_encoding"), Some("UTF8"));
    // sslmode defaults to prefer, and the cluster offers TLS.
    assert!(conn.is_tls());
    assert!(session_uses_tls(&mut conn).await);

    let id = conn.identify_system().await.expect("IDENTIFY_SYSTEM");
    assert!(id.systemid > 0);
    assert!(id.timeline >= 1);
    assert!(!id.xlogpos.is_zero());
    assert_eq!(id.dbname.as_deref(), Some("postgres"));
    // SQL works on a replication=database connection too.
    assert_eq!(
        scalar(&mut conn, "SELECT 1 + 1").await.as_deref(),
        Some("2")
    );
    let err = conn
        .simple_query("SELECT * FROM no_such_table")
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("42P01"), "{err}");
    assert_eq!(
        scalar(&mut conn, "SELECT 'still usable'").await.as_deref(),
        Some("still usable")
    );
    conn.close().await.expect("close");
}

#[tokio::test]
async fn password_methods_authenticate() {
    let pw = password();
    for (user, query, method) in [
        ("relay_scram", "sslmode=disable", "scram-sha-256"),
        ("relay_scram", "sslmode=require", "scram-sha-256-plus"),
        (
            "relay_scram",
            "sslmode=require&channel_binding=disable",
            "scram-sha-256",
        ),
        ("relay_md5", "sslmode=disable", "md5"),
        ("relay_password", "sslmode=disable", "password"),
        ("relay_password", "sslmode=require", "password"),
    ] {
        let url = url(user, Some(&pw), None, query);
        let mut conn = connect(&url)
            .await
            .unwrap_or_else(|e| panic!("{user} with {query}: {e}"));
        assert_eq!(conn.authentication_method(), method, "{user} with {query}");
        assert_eq!(
            conn.is_tls(),
            query.contains("require"),
            "{user} with {query}"
        );
        let id = conn.identify_system().await.expect("IDENTIFY_SYSTEM");
        assert_eq!(id.dbname.as_deref(), Some("postgres"));
        assert_eq!(
            scalar(&mut conn, "SELECT current_user").await.as_deref(),
            Some(user)
        );
        conn.close().await.expect("close");
    }
}

#[tokio::test]
async fn wrong_password_is_an_auth_error_with_sqlstate_28p01() {
    for (user, method) in [
        ("relay_scram", "scram-sha-256"),
        ("relay_md5", "md5"),
        ("relay_password", "password"),
    ] {
        let url = url(user, Some("not-the-password"), None, "sslmode=disable");
        let err = connect(&url).await.expect_err("wrong password must fail");
        match &err {
            ReplicationError::Auth {
                method: m,
                code: Some(code),
                ..
            } => {
                assert_eq!(code, "28P01", "{user}: {err}");
                assert_eq!(m, method, "{user}: {err}");
            }
            other => panic!("{user}: expected an Auth error, got {other:?}"),
        }
        assert_eq!(err.classify(), ErrorClass::Fatal);
        assert!(!err.to_string().contains("not-the-password"));
    }
}

#[tokio::test]
async fn missing_password_is_an_auth_error() {
    let err = connect(&url("relay_scram", None, None, "sslmode=disable"))
        .await
        .expect_err("no password");
    match &err {
        ReplicationError::Auth {
            method,
            code: None,
            message,
        } => {
            assert_eq!(method, "scram-sha-256");
            assert!(message.contains("requires a password"), "{message}");
        }
        other => panic!("expected a client-side Auth error, got {other:?}"),
    }
    assert_eq!(err.classify(), ErrorClass::Fatal);
}

#[tokio::test]
async fn tls_require_encrypts_without_verifying() {
    let mut conn = connect(&url(
        "relay_tls",
        Some(&password()),
        None,
        "sslmode=require",
    ))
    .await
    .expect("relay_tls over TLS");
    assert!(conn.is_tls());
    assert!(session_uses_tls(&mut conn).await);
    // SCRAM bound to the TLS session: proves the tls-server-end-point hash matches.
    assert_eq!(conn.authentication_method(), "scram-sha-256-plus");
    conn.identify_system().await.expect("IDENTIFY_SYSTEM");
    conn.close().await.expect("close");
}

#[tokio::test]
async fn tls_verify_full_checks_chain_and_host_name() {
    let pw = password();
    let ca = encode(&ca_path());
    for host in ["localhost", "127.0.0.1"] {
        let query = format!("sslmode=verify-full&sslrootcert={ca}");
        let mut conn = connect(&url("relay_tls", Some(&pw), Some(host), &query))
            .await
            .unwrap_or_else(|e| panic!("verify-full against {host}: {e}"));
        assert!(session_uses_tls(&mut conn).await);
        conn.close().await.expect("close");
    }

    // Connect to 127.0.0.1 but expect the certificate to name another host.
    let wrong_name = |mode: &str| {
        url(
            "relay_tls",
            Some(&pw),
            Some("wrong-name.invalid"),
            &format!("sslmode={mode}&sslrootcert={ca}&hostaddr=127.0.0.1"),
        )
    };
    let err = connect(&wrong_name("verify-full"))
        .await
        .expect_err("the certificate does not name wrong-name.invalid");
    assert!(matches!(err, ReplicationError::Tls(_)), "{err:?}");
    assert_eq!(err.classify(), ErrorClass::Fatal);
    // verify-ca checks the chain only.
    let conn = connect(&wrong_name("verify-ca"))
        .await
        .expect("verify-ca ignores the host name");
    conn.close().await.expect("close");
    // The test CA is not in the system store.
    let err = connect(&url(
        "relay_tls",
        Some(&pw),
        None,
        "sslmode=verify-ca&sslrootcert=system",
    ))
    .await
    .expect_err("unknown issuer");
    assert!(
        matches!(
            err,
            ReplicationError::Tls(_) | ReplicationError::TlsConfig(_)
        ),
        "{err:?}"
    );
}

/// `sslmode=disable` never negotiates TLS. The dev cluster's `pg_hba.conf` only has
/// `hostssl` lines for relay_tls, so a plaintext login must not succeed *through
/// them*: it is either refused (28000, no matching entry) or falls through to the
/// catch-all `trust` line and is plaintext.
#[tokio::test]
async fn sslmode_disable_never_negotiates_tls() {
    match connect(&url(
        "relay_tls",
        Some(&password()),
        None,
        "sslmode=disable",
    ))
    .await
    {
        Err(err) => {
            assert_eq!(err.code(), Some("28000"), "{err:?}");
            assert!(matches!(err, ReplicationError::Auth { .. }), "{err:?}");
        }
        Ok(mut conn) => {
            assert!(!conn.is_tls());
            assert!(!session_uses_tls(&mut conn).await);
            assert_ne!(conn.authentication_method(), "scram-sha-256-plus");
            conn.close().await.expect("close");
        }
    }
}

#[tokio::test]
async fn metadata_connection_shares_the_tls_modes() {
    let pw = password();
    let ca = encode(&ca_path());
    let client = connect_metadata(&info(&url(
        "relay_tls",
        Some(&pw),
        Some("localhost"),
        &format!("sslmode=verify-full&sslrootcert={ca}&application_name=meta-test"),
    )))
    .await
    .expect("metadata connection with verify-full");
    let row = client
        .query_one(
            "SELECT s.ssl, a.application_name FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid)
             WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .expect("query");
    assert!(row.get::<_, bool>(0));
    assert_eq!(row.get::<_, String>(1), "meta-test");

    let err = connect_metadata(&info(&url(
        "relay_tls",
        Some(&pw),
        Some("wrong-name.invalid"),
        &format!("sslmode=verify-full&sslrootcert={ca}&hostaddr=127.0.0.1"),
    )))
    .await
    .expect_err("wrong host name");
    assert!(matches!(err, ReplicationError::Tls(_)), "{err:?}");

    let plain = connect_metadata(&info(&url(
        "relay_scram",
        Some(&pw),
        None,
        "sslmode=disable",
    )))
    .await
    .expect("plain scram");
    let ssl: bool = plain
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .expect("query")
        .get(0);
    assert!(!ssl);

    let err = connect_metadata(&info(&url(
        "relay_md5",
        Some("nope"),
        None,
        "sslmode=disable",
    )))
    .await
    .expect_err("wrong password");
    assert_eq!(err.code(), Some("28P01"), "{err:?}");
    assert_eq!(err.classify(), ErrorClass::Fatal);
}

#[tokio::test]
async fn connection_failures_are_classified() {
    // Nothing listens on port 1: transient (the server may come back).
    let err = ReplicationConnection::connect(&info("postgresql://postgres@127.0.0.1:1/postgres"))
        .await
        .expect_err("refused");
    assert!(matches!(err, ReplicationError::Io(_)), "{err:?}");
    assert_eq!(err.classify(), ErrorClass::Transient);

    let (host, port) = cluster();
    let missing_db = format!(
        "postgresql://postgres@{host}:{port}/{}",
        harness::unique("rc_nodb")
    );
    let err = connect(&missing_db).await.expect_err("no such database");
    assert_eq!(err.code(), Some("3D000"), "{err:?}");
    assert_eq!(err.classify(), ErrorClass::Fatal);
}

#[tokio::test]
async fn streams_an_outbox_insert_and_confirms_the_flush_position() {
    let mut db = TestDb::create("rc_stream").await;
    let mut stream = stream_from_temporary_slot(&db).await;
    db.insert_event("order-1", "OrderCreated", r#"{"n": 1}"#)
        .await;

    // Begin, Relation, Insert, Commit (pgoutput), with keepalives possibly between.
    let mut saw_insert = false;
    let end_lsn = loop {
        if let ServerFrame::XLogData { data, .. } = next(&mut stream).await {
            if data.first() == Some(&b'I') {
                saw_insert = true;
            }
            if let Some(end) = commit_end_lsn(&data) {
                break end;
            }
        }
    };
    assert!(saw_insert, "the transaction carried the outbox insert");

    // Ask for a keepalive, answer it with the commit's end LSN as flush position.
    stream
        .send_status(&StandbyStatus {
            reply_requested: true,
            ..status(Lsn::ZERO)
        })
        .await
        .expect("status");
    loop {
        if let ServerFrame::Keepalive { wal_end, .. } = next(&mut stream).await {
            assert!(wal_end >= end_lsn);
            break;
        }
    }
    stream.send_status(&status(end_lsn)).await.expect("status");

    let slot = db.slot.clone();
    let client = &db.client;
    harness::wait_until(WAIT, "confirmed_flush_lsn to reach the flush we sent", || {
        let slot = slot.clone();
        async move {
            let row = client
                .query_one(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .expect("slot row");
            row.get::<_, Option<String>>(0).and_then(|t| t.parse::<Lsn>().ok()) == Some(end_lsn)
        }
    })
    .await;

    stream.finish().await.expect("finish");
    db.drop_slot().await;
}

#[tokio::test]
async fn a_slot_streamed_by_another_connection_is_in_use() {
    let db = TestDb::create("rc_inuse").await;
    let first = stream_from_temporary_slot(&db).await;
    let second = connect(&db.url).await.expect("second connection");
    let err = second
        .start_logical_replication(&db.slot, Lsn::ZERO, &[PUBLICATION], 1)
        .await
        .expect_err("the slot is active");
    assert!(err.is_slot_in_use(), "{err:?}");
    assert_eq!(err.classify(), ErrorClass::Fatal);
    first.finish().await.expect("finish");
    db.drop_slot().await;
}

#[tokio::test]
async fn missing_slot_and_publication_are_undefined_objects() {
    let mut db = TestDb::create("rc_missing").await;
    let conn = connect(&db.url).await.expect("connect");
    let err = conn
        .start_logical_replication("no_such_slot", Lsn::ZERO, &[PUBLICATION], 1)
        .await
        .expect_err("no such slot");
    assert!(err.is_undefined_object(), "{err:?}");

    // A missing publication is only noticed when the first change is decoded.
    let mut conn = connect(&db.url).await.expect("connect");
    conn.create_logical_slot(&db.slot, true, SnapshotAction::NoExport)
        .await
        .expect("create slot");
    let mut stream = conn
        .start_logical_replication(&db.slot, Lsn::ZERO, &["no_such_pub"], 1)
        .await
        .expect("START_REPLICATION succeeds before decoding");
    db.insert_event("order-1", "OrderCreated", "{}").await;
    let err = tokio::time::timeout(WAIT, async {
        loop {
            match stream.next_frame().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("stream ended without an error"),
                Err(e) => break e,
            }
        }
    })
    .await
    .expect("an error within the timeout");
    assert!(err.is_undefined_object(), "{err:?}");
    assert!(err.to_string().contains("no_such_pub"), "{err}");
    assert_eq!(err.classify(), ErrorClass::Fatal);
    db.drop_slot().await;
}

#[tokio::test]
async fn creates_and_drops_a_permanent_slot() {
    let db = TestDb::create("rc_slot").await;
    let mut conn = connect(&db.url).await.expect("connect");
    let created = conn
        .create_logical_slot(&db.slot, false, SnapshotAction::Export)
        .await
        .expect("create slot");
    assert_eq!(created.slot_name, db.slot);
    assert_eq!(created.output_plugin.as_deref(), Some("pgoutput"));
    assert!(created.snapshot_name.is_some(), "an exported snapshot");
    assert!(!created.consistent_point.is_zero());

    let again = conn
        .create_logical_slot(&db.slot, false, SnapshotAction::NoExport)
        .await
        .expect_err("exists");
    assert!(again.is_duplicate_object(), "{again:?}");

    conn.drop_slot(&db.slot, false).await.expect("drop");
    let gone = conn.drop_slot(&db.slot, false).await.expect_err("dropped");
    assert!(gone.is_undefined_object(), "{gone:?}");
    conn.close().await.expect("close");
    db.drop_slot().await;
}

/// `finish` returns once the walsender has exited, so the slot is free again.
#[tokio::test]
async fn finish_releases_the_slot() {
    let db = TestDb::create("rc_finish").await;
    let mut conn = connect(&db.url).await.expect("connect");
    conn.create_logical_slot(&db.slot, false, SnapshotAction::NoExport)
        .await
        .expect("create slot");
    let stream = conn
        .start_logical_replication(&db.slot, Lsn::ZERO, &[PUBLICATION], 1)
        .await
        .expect("start");
    stream.finish().await.expect("finish");
    let active: bool = db
        .client
        .query_one(
            "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
            &[&db.slot],
        )
        .await
        .expect("slot row")
        .get(0);
    assert!(
        !active,
        "finish() returned while the walsender still held the slot"
    );
    // And it can be streamed again right away.
    let again = connect(&db.url)
        .await
        .expect("connect")
        .start_logical_replication(&db.slot, Lsn::ZERO, &[PUBLICATION], 1)
        .await
        .expect("restart on the released slot");
    again.finish().await.expect("finish");
    db.drop_slot().await;
}

/// `next_frame` inside `select!` with a branch that wins whenever the read has to
/// wait: every insert still arrives exactly once and in commit order.
#[tokio::test]
async fn next_frame_is_cancel_safe_on_a_real_socket() {
    const EVENTS: usize = 40;
    let mut db = TestDb::create("rc_cancel").await;
    let mut stream = stream_from_temporary_slot(&db).await;
    // Insert while reading, so that reads keep waiting for the socket.
    let inserter = tokio::spawn(async move {
        for i in 0..EVENTS {
            let payload = format!(r#"{{"i": {i}, "pad": "{}"}}"#, "x".repeat(i * 997));
            db.insert_event(&format!("order-{i}"), "OrderCreated", &payload)
                .await;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        db
    });
    let mut inserts = 0;
    let mut commits = Vec::new();
    let mut cancelled = 0u64;
    let deadline = tokio::time::Instant::now() + WAIT;
    while commits.len() < EVENTS {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out: {inserts} inserts"
        );
        tokio::select! {
            biased;
            () = tokio::task::yield_now() => cancelled += 1,
            frame = stream.next_frame() => {
                if let ServerFrame::XLogData { data, .. } = frame.expect("frame").expect("open") {
                    if data.first() == Some(&b'I') {
                        inserts += 1;
                    }
                    if let Some(end) = commit_end_lsn(&data) {
                        commits.push(end);
                    }
                }
            }
        }
    }
    let db = inserter.await.expect("inserter");
    assert_eq!(inserts, EVENTS);
    assert!(commits.windows(2).all(|w| w[0] < w[1]), "commit order");
    assert!(cancelled > 0, "the test must actually cancel reads");
    stream.finish().await.expect("finish");
    db.drop_slot().await;
}

/// Keepalives, `tcp_user_timeout` and `connect_timeout` from the URL are accepted
/// by both connections to the real server (the socket options themselves are
/// checked by the unit tests).
#[tokio::test]
async fn both_connections_work_with_keepalive_and_timeout_parameters() {
    let pw = password();
    for query in [
        "sslmode=disable&keepalives_idle=5&keepalives_interval=1&keepalives_count=2\
         &tcp_user_timeout=5000&connect_timeout=5",
        "sslmode=require&keepalives=0&connect_timeout=0",
    ] {
        let url = url("relay_scram", Some(&pw), None, query);
        let mut conn = connect(&url)
            .await
            .unwrap_or_else(|e| panic!("replication connection with {query}: {e}"));
        assert_eq!(
            scalar(&mut conn, "SELECT 1").await.as_deref(),
            Some("1"),
            "{query}"
        );
        conn.close().await.expect("close");
        let client = connect_metadata(&info(&url))
            .await
            .unwrap_or_else(|e| panic!("metadata connection with {query}: {e}"));
        let one: i32 = client
            .query_one("SELECT 1", &[])
            .await
            .expect("query")
            .get(0);
        assert_eq!(one, 1, "{query}");
    }
}
