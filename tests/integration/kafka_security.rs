//! Kafka security and compression, end to end through the real binary.
//!
//! What serves what, and why:
//! * **TLS** (server verification with a custom CA, and client certificates): a
//!   private Tansu broker behind `stunnel` ([`TlsProxy`]), which the broker
//!   advertises as its address, because Tansu 0.6's own TLS listener does not work
//!   here (see `tls_proxy.rs`).
//! * **SASL SCRAM-SHA-256/512**: Tansu itself, started with `--authentication`.
//!   Its CLI cannot log in, so the users are created (`tansu user create`) before
//!   authentication is switched on, on the same SQLite storage.
//! * **SASL PLAIN and OAUTHBEARER**: Tansu 0.6 does not serve them (PLAIN is not
//!   built into its SASL server; its OAUTHBEARER validation accepts no token), and
//!   librdkafka's mock cluster has no SASL at all. So only the client side is shown
//!   against the real broker: the relay speaks the mechanism, the broker refuses
//!   it, and the relay stops at once with exit code 4 and the reason. A successful
//!   PLAIN or OAUTHBEARER login is not tested here.
//! * **Codecs**: the shared broker; each codec is checked twice — the relay's own
//!   librdkafka log line for the produce request names the codec (the batch went
//!   out compressed), and a separate consumer reads the records back byte for byte.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::harness::{self, PrivateBroker, RelayProcess, TestDb, free_port};
use crate::tls_proxy::{TestPki, TlsProxy};

/// `OUTBOX_RELAY__KAFKA__PRODUCER__<name>`: librdkafka settings as a deployment
/// would give them, through the environment (secrets included).
fn producer_env(settings: &[(&str, &str)]) -> Vec<(String, String)> {
    settings
        .iter()
        .map(|(k, v)| {
            (
                format!("OUTBOX_RELAY__KAFKA__PRODUCER__{k}"),
                (*v).to_owned(),
            )
        })
        .collect()
}

fn as_refs(env: &[(String, String)]) -> Vec<(&str, &str)> {
    env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect()
}

/// Starts the relay for `db` against `brokers` with these producer settings.
fn relay_with(db: &TestDb, brokers: &str, settings: &[(&str, &str)]) -> RelayProcess {
    let mut env = producer_env(settings);
    env.push(("OUTBOX_RELAY__KAFKA__BROKERS".into(), brokers.to_owned()));
    RelayProcess::start(&db.config_path, &as_refs(&env))
}

/// The broker's start-up check waits 10 s for metadata; a refused handshake must
/// end it well before that.
const FAST: Duration = Duration::from_secs(8);

/// Runs the relay, expects it to stop by itself with exit code 4, fast, with a
/// message naming the refusal; returns its log.
async fn expect_refused(
    db: &TestDb,
    brokers: &str,
    settings: &[(&str, &str)],
    cause: &[&str],
) -> String {
    let started = Instant::now();
    let mut relay = relay_with(db, brokers, settings);
    let status = relay.wait(Duration::from_secs(60)).await;
    let took = started.elapsed();
    let log = relay.log();
    assert_eq!(
        status.code(),
        Some(4),
        "{settings:?}: exit code; log:\n{log}"
    );
    assert!(
        took < FAST,
        "{settings:?}: took {took:?} to fail; log:\n{log}"
    );
    assert!(
        log.contains("refused the connection's security"),
        "{settings:?}: the message names the refusal; log:\n{log}"
    );
    assert!(
        cause.iter().any(|c| log.contains(c)),
        "{settings:?}: the message gives librdkafka's reason ({cause:?}); log:\n{log}"
    );
    log
}

/// Writes `n` events and returns idempotency key → payload as PostgreSQL prints it
/// (the bytes the relay sends for a jsonb payload).
async fn write_events(db: &mut TestDb, n: usize, filler: usize) -> HashMap<String, String> {
    let pad = "compressible ".repeat(filler);
    let mut keys = Vec::new();
    for i in 0..n {
        let payload = format!(r#"{{"seq": {i}, "note": "{pad}"}}"#);
        keys.push(
            db.insert_event(&format!("e{}", i % 3), "Created", &payload)
                .await,
        );
    }
    let rows = db
        .client
        .query("SELECT idempotency_key, payload::text FROM outbox", &[])
        .await
        .unwrap();
    let all: HashMap<String, String> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    keys.into_iter()
        .map(|k| {
            let payload = all[&k].clone();
            (k, payload)
        })
        .collect()
}

/// Every expected event arrived once with its payload's exact bytes.
fn assert_same_events(records: &[harness::Record], expected: &HashMap<String, String>) {
    let mut seen = HashMap::new();
    for r in records {
        let key = r.header("idempotency_key").unwrap().to_owned();
        let payload = String::from_utf8(r.payload.clone().unwrap()).unwrap();
        assert_eq!(expected.get(&key), Some(&payload), "payload of {key}");
        *seen.entry(key).or_insert(0) += 1;
    }
    assert_eq!(seen.len(), expected.len(), "every event arrived");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_ca_verification_and_client_certificates() {
    let (plain_port, tls_port) = (free_port(), free_port());
    let broker = PrivateBroker::start_advertising(plain_port, tls_port).await;
    let pki = TestPki::create(&broker.dir().join("pki"));
    let proxy = TlsProxy::start(&pki, tls_port, plain_port, true).await;
    let mut db = TestDb::create_with("ksec_tls", 1).await;
    broker.create_topic(&db.topic, 1);
    db.create_slot().await;
    let expected = write_events(&mut db, 20, 4).await;
    let (ca, other_ca) = (pki.file("ca.crt"), pki.file("other-ca.crt"));
    let (cert, key) = (pki.file("client.crt"), pki.file("client.key"));

    // A CA that did not sign the broker's certificate: refused at once.
    expect_refused(
        &db,
        &proxy.brokers(),
        &[
            ("security.protocol", "SSL"),
            ("ssl.ca.location", &other_ca),
            ("ssl.certificate.location", &cert),
            ("ssl.key.location", &key),
        ],
        &[
            "certificate verify failed",
            "Failed to verify broker certificate",
        ],
    )
    .await;
    assert_eq!(
        db.poison_rows().await,
        0,
        "a refused handshake poisons nothing"
    );

    // The right CA and a client certificate the proxy requires: delivered, and
    // read back by a consumer through the same listener (the broker advertises it).
    let tls = [
        ("security.protocol", "SSL"),
        ("ssl.ca.location", ca.as_str()),
        ("ssl.certificate.location", cert.as_str()),
        ("ssl.key.location", key.as_str()),
    ];
    let relay = relay_with(&db, &proxy.brokers(), &tls);
    let records = consume_all(&proxy.brokers(), &tls, &db.topic, expected.len(), &relay).await;
    assert_same_events(&records, &expected);
    assert_eq!(db.poison_rows().await, 0);
    let status = relay.terminate(Duration::from_secs(30)).await;
    assert!(status.success(), "{status:?}");
    db.drop_slot().await;
}

/// Reads the topic until `n` distinct events arrived (with the relay's log on
/// failure), then a moment longer to see duplicates.
async fn consume_all(
    brokers: &str,
    settings: &[(&str, &str)],
    topic: &str,
    n: usize,
    relay: &RelayProcess,
) -> Vec<harness::Record> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let records =
            harness::consume_with(brokers, settings, topic, n, Duration::from_secs(3)).await;
        if records.len() >= n {
            return harness::consume_with(brokers, settings, topic, n + 1, Duration::from_secs(2))
                .await;
        }
        assert!(
            Instant::now() < deadline,
            "{} of {n} events on {topic}; relay log:\n{}",
            records.len(),
            relay.log()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sasl_ssl_scram_bad_password_fails_fast_then_delivers() {
    const PASSWORD: &str = "Rl4y-Scram-512";
    const WRONG: &str = "Wr0ng-Scram-512";
    let (plain_port, tls_port) = (free_port(), free_port());
    let mut broker = PrivateBroker::start_advertising(plain_port, tls_port).await;
    let pki = TestPki::create(&broker.dir().join("pki"));
    let mut db = TestDb::create_with("ksec_sasl", 1).await;
    broker.create_topic(&db.topic, 1);
    broker.create_user("relay", PASSWORD, "scram512");
    broker.create_user("reader", "Rd3r-Scram-256", "scram256");
    broker.require_authentication().await;
    let proxy = TlsProxy::start(&pki, tls_port, plain_port, false).await;
    db.create_slot().await;
    let expected = write_events(&mut db, 20, 4).await;
    let ca = pki.file("ca.crt");
    let sasl = |mechanism: &'static str, password: &'static str| {
        vec![
            ("security.protocol", "SASL_SSL"),
            ("ssl.ca.location", ca.as_str()),
            ("sasl.mechanism", mechanism),
            ("sasl.username", "relay"),
            ("sasl.password", password),
        ]
    };

    // A wrong password: the broker's SCRAM check refuses it.
    let log = expect_refused(
        &db,
        &proxy.brokers(),
        &sasl("SCRAM-SHA-512", WRONG),
        &["SASL"],
    )
    .await;
    assert!(
        !log.contains(WRONG),
        "the password is never printed:\n{log}"
    );
    // Mechanisms Tansu does not serve: the relay speaks them, the broker refuses.
    expect_refused(
        &db,
        &proxy.brokers(),
        &sasl("PLAIN", PASSWORD),
        &["SASL PLAIN"],
    )
    .await;
    let oauth = [
        ("security.protocol", "SASL_SSL"),
        ("ssl.ca.location", ca.as_str()),
        ("sasl.mechanism", "OAUTHBEARER"),
        ("enable.sasl.oauthbearer.unsecure.jwt", "true"),
        ("sasl.oauthbearer.config", "principal=relay"),
    ];
    expect_refused(&db, &proxy.brokers(), &oauth, &["SASL"]).await;
    assert_eq!(db.poison_rows().await, 0, "refused logins poison nothing");

    // The right password, given only through the environment: every event arrives,
    // read back by another user over SCRAM-SHA-256 through the same TLS listener.
    let relay = relay_with(&db, &proxy.brokers(), &sasl("SCRAM-SHA-512", PASSWORD));
    let reader = [
        ("security.protocol", "SASL_SSL"),
        ("ssl.ca.location", ca.as_str()),
        ("sasl.mechanism", "SCRAM-SHA-256"),
        ("sasl.username", "reader"),
        ("sasl.password", "Rd3r-Scram-256"),
    ];
    let records = consume_all(&proxy.brokers(), &reader, &db.topic, expected.len(), &relay).await;
    assert_same_events(&records, &expected);
    assert_eq!(db.poison_rows().await, 0);
    let log = relay.log();
    assert!(
        !log.contains(PASSWORD),
        "the password is never printed:\n{log}"
    );
    let status = relay.terminate(Duration::from_secs(30)).await;
    assert!(status.success(), "{status:?}");
    db.drop_slot().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_codec_round_trips() {
    for codec in ["gzip", "snappy", "lz4", "zstd"] {
        let mut db = TestDb::create_with(&format!("ksec_{codec}"), 1).await;
        db.create_slot().await;
        // Payloads of a few KiB of repeated text: worth compressing.
        let expected = write_events(&mut db, 30, 300).await;
        let env = [
            ("OUTBOX_RELAY__KAFKA__PRODUCER__compression.type", codec),
            // librdkafka's produce-request debug line names the batch's codec.
            ("OUTBOX_RELAY__KAFKA__PRODUCER__debug", "msg"),
            ("OUTBOX_RELAY__LOG__LEVEL", "info,librdkafka=debug"),
        ];
        let relay = RelayProcess::start(&db.config_path, &env);
        let records = consume_all(
            &harness::env().brokers,
            &[],
            &db.topic,
            expected.len(),
            &relay,
        )
        .await;
        assert_same_events(&records, &expected);
        let log = relay.log();
        assert!(
            log.contains("Produce MessageSet") && log.contains(&format!(", {codec})")),
            "{codec}: the batches went out compressed; log:\n{log}"
        );
        let status = relay.terminate(Duration::from_secs(30)).await;
        assert!(status.success(), "{codec}: {status:?}");
        db.drop_slot().await;
    }
}
