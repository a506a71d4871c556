//! `[traces]` end to end: the relay exports its spans over OTLP/HTTP (JSON) to a
//! receiver in this test, which decodes them. An event written with a sampled
//! `traceparent` gets a span in that trace, child of that span, lasting at least as
//! long as the event waited, with the Kafka attributes of its record; an event
//! without one is not traced at `sample_ratio = 0`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;

use crate::harness::{self, RelayProcess, TestDb, consume};

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_SPAN: &str = "00f067aa0ba902b7";

/// An OTLP/HTTP receiver: every request body to `/v1/traces`, decoded.
async fn receiver() -> (String, Arc<Mutex<Vec<Value>>>) {
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let kept = bodies.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let kept = kept.clone();
            async move {
                let json: Value = serde_json::from_slice(&body).expect("an OTLP/JSON body");
                kept.lock().unwrap().push(json);
                ([("content-type", "application/json")], "{}")
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (address, bodies)
}

/// Every span received so far.
fn spans(bodies: &Mutex<Vec<Value>>) -> Vec<Value> {
    let bodies = bodies.lock().unwrap();
    let mut out = Vec::new();
    for body in bodies.iter() {
        for resource in body["resourceSpans"].as_array().into_iter().flatten() {
            for scope in resource["scopeSpans"].as_array().into_iter().flatten() {
                out.extend(scope["spans"].as_array().into_iter().flatten().cloned());
            }
        }
    }
    out
}

/// A span attribute's value as text (OTLP/JSON writes 64-bit integers as strings).
fn attribute(span: &Value, key: &str) -> Option<String> {
    let value = span["attributes"]
        .as_array()?
        .iter()
        .find(|a| a["key"] == key)?
        .get("value")?
        .clone();
    value
        .get("stringValue")
        .or_else(|| value.get("intValue"))
        .map(|v| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
}

fn nanos(v: &Value) -> u128 {
    match v {
        Value::String(s) => s.parse().unwrap(),
        other => u128::from(other.as_u64().unwrap()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_events_span_joins_its_writers_trace_and_lasts_its_whole_wait() {
    let (endpoint, bodies) = receiver().await;
    let db = TestDb::create("traces").await;
    let env = [
        ("OUTBOX_RELAY__TRACES__ENABLED", "true"),
        ("OUTBOX_RELAY__TRACES__SAMPLE_RATIO", "0"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ("OTEL_SERVICE_NAME", "outbox-relay-test"),
    ];
    let relay = RelayProcess::start(&db.config_path, &env);
    db.wait_streaming(&relay).await;
    // Not traced: no parent, and a sample ratio of 0.
    let untraced: String = db
        .client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             VALUES ('order', 'o-1', 'Created', '{\"seq\": 0}') RETURNING idempotency_key",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // Written 1.5 s before it commits: the span must cover that wait.
    let traceparent = format!("00-{TRACE_ID}-{PARENT_SPAN}-01");
    let traced: String = db
        .client
        .query_one(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers, created_at)
             VALUES ('order', 'o-1', 'Paid', '{\"seq\": 1}',
                     jsonb_build_object('traceparent', $1::text),
                     clock_timestamp() - interval '1.5 seconds')
             RETURNING idempotency_key",
            &[&traceparent],
        )
        .await
        .unwrap()
        .get(0);
    let records = consume(&db.topic, 2, Duration::from_secs(60)).await;
    assert_eq!(records.len(), 2);
    let record = records
        .iter()
        .find(|r| r.header("idempotency_key") == Some(traced.as_str()))
        .unwrap();
    harness::wait_until(Duration::from_secs(30), "the event's span", || async {
        spans(&bodies)
            .iter()
            .any(|s| attribute(s, "messaging.message.id").as_deref() == Some(&traced))
    })
    .await;
    let all = spans(&bodies);
    assert!(
        all.iter()
            .all(|s| attribute(s, "messaging.message.id").as_deref() != Some(&untraced)),
        "an event without a sampled parent was traced at ratio 0"
    );
    let span = all
        .iter()
        .find(|s| attribute(s, "messaging.message.id").as_deref() == Some(&traced))
        .unwrap();
    assert_eq!(span["traceId"], TRACE_ID, "{span}");
    assert_eq!(span["parentSpanId"], PARENT_SPAN, "{span}");
    assert_eq!(span["kind"], 4, "a PRODUCER span: {span}");
    assert_eq!(span["name"], format!("send {}", db.topic));
    let (start, end) = (
        nanos(&span["startTimeUnixNano"]),
        nanos(&span["endTimeUnixNano"]),
    );
    assert!(end - start >= 1_500_000_000, "{} ns", end - start);
    // It starts at created_at, which is the record's timestamp (milliseconds).
    let created_ms = u128::try_from(record.timestamp_ms.unwrap()).unwrap();
    assert_eq!(start / 1_000_000, created_ms);
    let expected = [
        ("messaging.system", "kafka".to_owned()),
        ("messaging.operation.type", "send".to_owned()),
        ("messaging.destination.name", db.topic.clone()),
        (
            "messaging.destination.partition.id",
            record.partition.to_string(),
        ),
        ("messaging.kafka.offset", record.offset.to_string()),
        ("messaging.kafka.message.key", "o-1".to_owned()),
    ];
    for (key, value) in expected {
        assert_eq!(
            attribute(span, key).as_deref(),
            Some(value.as_str()),
            "{key}: {span}"
        );
    }
    let events: Vec<(&str, u128)> = span["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["name"].as_str().unwrap(), nanos(&e["timeUnixNano"])))
        .collect();
    let names: Vec<&str> = events.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["committed", "decoded", "produced", "acked"]);
    for pair in events.windows(2) {
        assert!(pair[0].1 <= pair[1].1, "events out of order: {events:?}");
    }
    assert!(
        events.iter().all(|(_, t)| (start..=end).contains(t)),
        "{events:?}"
    );
    let service = bodies.lock().unwrap()[0]["resourceSpans"][0]["resource"]["attributes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|a| a["key"] == "service.name" && a["value"]["stringValue"] == "outbox-relay-test");
    assert!(service, "OTEL_SERVICE_NAME names the service");
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
}

/// The gRPC transport with no collector listening: the exports fail on their own
/// threads, and the relay delivers every event and stops promptly on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_exporter_without_a_collector_neither_slows_nor_wedges_the_relay() {
    let closed = format!("http://127.0.0.1:{}", harness::free_port());
    let db = TestDb::create("traces_grpc").await;
    let env = [
        ("OUTBOX_RELAY__TRACES__ENABLED", "true"),
        ("OUTBOX_RELAY__TRACES__SAMPLE_RATIO", "1"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", closed.as_str()),
        ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let relay = RelayProcess::start(&db.config_path, &env);
    db.wait_streaming(&relay).await;
    db.client
        .batch_execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
             SELECT 'order', 'o-' || (g % 5), 'Created', jsonb_build_object('seq', g)
             FROM generate_series(1, 500) g",
        )
        .await
        .unwrap();
    let records = consume(&db.topic, 500, Duration::from_secs(60)).await;
    assert_eq!(records.len(), 500, "log:\n{}", relay.log());
    assert!(
        relay
            .log()
            .contains("exporting a trace span per sampled event")
    );
    let stopping = std::time::Instant::now();
    let status = relay.terminate(Duration::from_secs(30)).await;
    assert!(status.success(), "{status:?}");
    // The last export may wait out its 5 s bound; nothing more.
    assert!(
        stopping.elapsed() < Duration::from_secs(12),
        "stopping took {:?}",
        stopping.elapsed()
    );
    db.drop_slot().await;
}
