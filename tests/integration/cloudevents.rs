//! CloudEvents records (`[kafka.cloudevents]`), read back with the CloudEvents
//! Python SDK's Kafka binding (an independent implementation of the binding, which
//! detects the mode by itself): both modes parse, with the row's idempotency key as
//! `id`, its event type as `type`, its `created_at` as `time` and the payload as
//! `data`; a row's W3C trace context arrives as headers; a row without an event type
//! is poisoned, not published.

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::Duration;

use base64::Engine as _;

use crate::harness::{self, RelayProcess, TestDb, consume_exactly};

const SOURCE: &str = "/services/orders";
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// The SDK's view of each record (`tests/integration/cloudevents_sdk.py`).
fn read_with_sdk(records: &[harness::Record]) -> Vec<serde_json::Value> {
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let python_path = std::env::var("OUTBOX_RELAY_TEST_PYTHONPATH").unwrap_or_else(|_| {
        panic!("OUTBOX_RELAY_TEST_PYTHONPATH is not set: run the tests through scripts/test")
    });
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/integration/cloudevents_sdk.py"
    );
    let mut child = Command::new("python3")
        .arg(script)
        .env("PYTHONPATH", python_path)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run python3");
    let mut input = String::new();
    for r in records {
        let headers: serde_json::Map<String, serde_json::Value> = r
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), b64(v).into()))
            .collect();
        let line = serde_json::json!({
            "headers": headers,
            "key": r.key.as_deref().map(b64),
            "value": b64(r.payload.as_deref().unwrap_or_default()),
        });
        input.push_str(&line.to_string());
        input.push('\n');
    }
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "the CloudEvents SDK refused the records: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

async fn relay_as_cloudevents(mode: &str) {
    let db = TestDb::create_configured(
        &format!("ce_{mode}"),
        1,
        &format!("\n[kafka.cloudevents]\nmode = \"{mode}\"\nsource = \"{SOURCE}\"\n"),
    )
    .await;
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    let key: String = db
        .client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES ('order', 'o-1', 'com.example.order.created',
                     '{\"total\": 1.10, \"big\": 123456789012345678901234567890}',
                     jsonb_build_object('traceparent', $1::text, 'tracestate', 'rojo=00f067aa0ba902b7'))
             RETURNING idempotency_key",
            &[&TRACEPARENT],
        )
        .await
        .unwrap()
        .get(0);
    // An empty event type: no CloudEvent can be made of it.
    db.client
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'o-2', '', '{}')",
            &[],
        )
        .await
        .unwrap();
    let second: String = db
        .client
        .query_one(
            "SELECT outbox_enqueue('order', 'o-1', 'com.example.order.paid', '[1, \"two\"]')",
            &[],
        )
        .await
        .unwrap()
        .get(0);

    let records = consume_exactly(&db.topic, 2, Duration::from_secs(30), &relay).await;
    assert_eq!(records.len(), 2, "the row without a type is not published");
    let events = read_with_sdk(&records);
    assert_eq!(events.len(), 2);
    for (event, (id, event_type)) in events.iter().zip([
        (&key, "com.example.order.created"),
        (&second, "com.example.order.paid"),
    ]) {
        assert_eq!(event["specversion"], "1.0", "{event}");
        assert_eq!(event["id"], id.as_str(), "{event}");
        assert_eq!(event["source"], SOURCE, "{event}");
        assert_eq!(event["type"], event_type, "{event}");
        assert_eq!(event["datacontenttype"], "application/json", "{event}");
        assert!(
            event["time"].as_str().is_some_and(|t| t.starts_with("20")),
            "{event}"
        );
    }
    assert_eq!(events[0]["data"]["total"], 1.1);
    assert_eq!(events[1]["data"], serde_json::json!([1, "two"]));
    let first = &records[0];
    match mode {
        // The payload is the value, byte for byte; the attributes are headers.
        "binary" => {
            assert_eq!(
                first.payload.as_deref(),
                Some(&br#"{"big": 123456789012345678901234567890, "total": 1.10}"#[..])
            );
            assert_eq!(first.header("ce_id"), Some(key.as_str()));
            assert_eq!(first.header("content-type"), Some("application/json"));
        }
        // The whole event is the value, the payload spliced in unchanged.
        _ => {
            let value = std::str::from_utf8(first.payload.as_deref().unwrap()).unwrap();
            assert!(
                value.contains(r#""data":{"big": 123456789012345678901234567890, "total": 1.10}"#),
                "{value}"
            );
            assert_eq!(
                first.header("content-type"),
                Some("application/cloudevents+json; charset=UTF-8")
            );
        }
    }
    // The relay's own headers stay, and the row's trace context is passed on.
    assert_eq!(first.header("idempotency_key"), Some(key.as_str()));
    assert_eq!(first.header("traceparent"), Some(TRACEPARENT));
    assert_eq!(first.header("tracestate"), Some("rojo=00f067aa0ba902b7"));

    harness::wait_until(
        Duration::from_secs(30),
        "the typeless row poisoned",
        || async { db.poison_rows().await == 1 },
    )
    .await;
    let reason: String = db
        .client
        .query_one("SELECT error FROM poison_outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert!(reason.contains("needs a type"), "{reason}");
    relay.terminate(Duration::from_secs(20)).await;
    db.drop_slot().await;
}

#[tokio::test]
async fn binary_mode_cloudevents_parse_with_an_independent_sdk() {
    relay_as_cloudevents("binary").await;
}

#[tokio::test]
async fn structured_mode_cloudevents_parse_with_an_independent_sdk() {
    relay_as_cloudevents("structured").await;
}
