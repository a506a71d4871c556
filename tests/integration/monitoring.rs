//! The monitoring files under `deploy/` (the Prometheus rules and the Grafana
//! dashboard) name only metrics the relay exports: every series name their queries
//! select, as `scripts/check-monitoring --names --json` reads them, is on a real
//! relay's `/metrics`, with the type the name implies (a `_bucket`, `_sum` or
//! `_count` series of a histogram family; any other name a family of its own).
//!
//! The exporter lists a metric once the relay has touched it, and several are only
//! touched by a fault (a replaced producer, a poisoned or parked event, a blocked
//! topic, a lost slot, a halt) or by exactly-once mode. So the test makes those
//! happen, in three relays with the metrics endpoint on, and checks the names
//! against everything they exported together:
//! 1. at-least-once on the dev broker (fault injection, no topic auto-creation),
//!    `relay.on_poison = "park-key"`: events flow; a produce answered with
//!    `OUT_OF_ORDER_SEQUENCE_NUMBER` fails the producer fatally, so it is replaced
//!    and the session ends; an oversized event is poisoned and parks its key, so
//!    the next event of the key is parked; an event for a missing topic blocks it;
//! 2. `relay.on_poison = "halt"` on a slot dropped while the relay was stopped: the
//!    next relay finds the slot lost and resyncs, then halts on an oversized event;
//! 3. `kafka.delivery = "exactly-once"` on the dev broker: transactions commit.
//!
//! The script's reading of the files is checked too: the number of expressions it
//! read must be the number of rules (read here with a YAML parser) and of queries in
//! the dashboard (read with a JSON parser).

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use yaml_rust2::YamlLoader;

use crate::harness::{self, DevBroker, RelayProcess, TestDb};
use crate::operations::{metrics_addr, metrics_page, sample};

/// What `scripts/check-monitoring --names --json` says one file selects.
#[derive(Debug, serde::Deserialize)]
struct Selected {
    expressions: usize,
    names: Vec<String>,
}

#[derive(Debug, serde::Deserialize)]
struct Monitoring {
    rules: Selected,
    dashboard: Selected,
}

fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("read {}: {e}", full.display()))
}

/// The series names the rules and the dashboard select, from the check script,
/// after checking that it read every expression.
fn selected_names() -> Monitoring {
    let out = std::process::Command::new("python3")
        .arg("scripts/check-monitoring")
        .args(["--names", "--json"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run scripts/check-monitoring");
    assert!(
        out.status.success(),
        "scripts/check-monitoring --names: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let selected: Monitoring = serde_json::from_slice(&out.stdout).expect("its JSON");

    let rules = YamlLoader::load_from_str(&repo_file("deploy/prometheus/outbox-relay-rules.yml"))
        .expect("the rules are YAML");
    let rule_count: usize = rules[0]["groups"]
        .as_vec()
        .expect("groups")
        .iter()
        .map(|g| {
            g["rules"]
                .as_vec()
                .expect("rules")
                .iter()
                .filter(|r| r["expr"].as_str().is_some())
                .count()
        })
        .sum();
    assert_eq!(
        selected.rules.expressions, rule_count,
        "the script read another number of rule expressions than the file has"
    );

    let dashboard: serde_json::Value =
        serde_json::from_str(&repo_file("deploy/grafana/outbox-relay-dashboard.json"))
            .expect("the dashboard is JSON");
    fn targets(panels: &serde_json::Value) -> usize {
        panels.as_array().map_or(0, |panels| {
            panels
                .iter()
                .map(|p| {
                    p["targets"].as_array().map_or(0, |t| {
                        t.iter().filter(|t| t["expr"].as_str().is_some()).count()
                    }) + targets(&p["panels"])
                })
                .sum()
        })
    }
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
        .iter()
        .filter(|v| v["type"] == "query")
        .count();
    assert_eq!(
        selected.dashboard.expressions,
        targets(&dashboard["panels"]) + variables,
        "the script read another number of dashboard queries than the file has"
    );
    assert!(
        selected.rules.names.len() >= 10 && selected.dashboard.names.len() >= 20,
        "suspiciously few names: {selected:?}"
    );
    selected
}

/// What scrapes showed: each family's `# TYPE`, and every sample's series name.
#[derive(Debug, Default)]
struct Exported {
    types: BTreeMap<String, String>,
    series: BTreeSet<String>,
}

impl Exported {
    fn add(&mut self, page: &str) {
        for line in page.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut words = rest.split_whitespace();
                if let (Some(name), Some(kind)) = (words.next(), words.next()) {
                    self.types.insert(name.to_owned(), kind.to_owned());
                }
            } else if !line.starts_with('#') && !line.trim().is_empty() {
                let end = line.find(['{', ' ']).unwrap_or(line.len());
                self.series.insert(line[..end].to_owned());
            }
        }
    }

    /// Why `name` cannot be queried on this relay, if it cannot.
    fn problem(&self, name: &str) -> Option<String> {
        let histogram = ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
            let base = name.strip_suffix(suffix)?;
            (self.types.get(base).map(String::as_str) == Some("histogram")).then_some(base)
        });
        match (histogram, self.types.get(name)) {
            (Some(_), _) | (None, Some(_)) if self.series.contains(name) => None,
            (Some(base), _) => Some(format!(
                "{name}: histogram {base} is exported without that series"
            )),
            (None, Some(kind)) if kind == "histogram" => Some(format!(
                "{name} is a histogram: query its _bucket, _sum or _count series"
            )),
            (None, Some(_)) => Some(format!("{name}: declared but no sample")),
            (None, None) => Some(format!("{name} is not exported")),
        }
    }
}

/// Scrapes until every series in `wanted` is on the page (or panics with the
/// page and the log), then returns the page.
async fn scrape_until(addr: &str, relay: &RelayProcess, wanted: &[&str], what: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let page = metrics_page(addr).await;
        if wanted
            .iter()
            .all(|s| sample(&page, s).is_some_and(|v| v > 0.0))
        {
            return page;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: not all of {wanted:?} above 0; page:\n{page}\nlog:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The config every phase shares: the endpoint on a free port, fast heartbeats, an
/// event over 100 kB undeliverable after two attempts.
const CONFIG: &str = "
[relay]
max_attempts = 2
heartbeat_interval_secs = 1
on_poison = \"ON_POISON\"

[kafka.producer]
\"message.max.bytes\" = \"100000\"
\"topic.metadata.propagation.max.ms\" = \"500\"

[metrics]
listen = \"127.0.0.1:0\"
";

/// Phase 1: at-least-once on the dev broker, park-key; a replaced producer (and so
/// a session that ended), a poisoned and a parked event, a blocked topic.
async fn faults_at_least_once(broker: &DevBroker) -> String {
    let mut db = TestDb::create_with("monitoring", 1).await;
    harness::create_topic_on(&broker.address, &db.topic, 1).await;
    db.append_config(&CONFIG.replace("ON_POISON", "park-key"));
    let env = [("OUTBOX_RELAY__KAFKA__BROKERS", broker.address.as_str())];
    let relay = RelayProcess::start(&db.config_path, &env);
    let addr = metrics_addr(&relay).await;
    db.wait_streaming(&relay).await;
    let relayed = format!(
        "outbox_relay_events_relayed_total{{topic=\"{}\"}}",
        db.topic
    );
    db.insert_event("a", "Created", r#"{"seq": 0}"#).await;
    scrape_until(&addr, &relay, &[&relayed], "a delivered event").await;

    // The broker's state diverges from the producer's: fatal, the producer is
    // replaced and the session starts again.
    broker
        .control(&format!(
            "fail-produce {} * OUT_OF_ORDER_SEQUENCE_NUMBER 1",
            db.topic
        ))
        .await;
    db.insert_event("b", "Created", r#"{"seq": 0}"#).await;
    scrape_until(
        &addr,
        &relay,
        &[
            "outbox_relay_producer_restarts_total",
            "outbox_relay_reconnects_total",
        ],
        "a replaced producer",
    )
    .await;

    // Too large: poisoned, its key parked, and the key's next event parked.
    db.insert_event("p", "Created", &harness::oversize_payload(1))
        .await;
    db.insert_event("p", "Created", r#"{"seq": 2}"#).await;
    let poisoned = format!(
        "outbox_relay_events_poisoned_total{{topic=\"{}\"}}",
        db.topic
    );
    scrape_until(
        &addr,
        &relay,
        &[
            &poisoned,
            "outbox_relay_events_parked_total",
            "outbox_relay_parked_keys",
        ],
        "a poisoned and a parked event",
    )
    .await;

    // A topic the broker does not have (and does not create): blocked.
    let missing = harness::unique("monitoring_missing");
    db.client
        .execute(
            "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, topic)
             VALUES ('order', 'm', 'Created', '{}', $1)",
            &[&missing],
        )
        .await
        .expect("insert an event for a missing topic");
    let page = scrape_until(
        &addr,
        &relay,
        &["outbox_relay_blocked_topics"],
        "a blocked topic",
    )
    .await;
    // The blocked event would hold a graceful stop for the whole drain.
    relay.kill9().await;
    db.drop_slot().await;
    page
}

/// Phase 2: a slot dropped while its relay was stopped is found lost, then the relay
/// halts on an undeliverable event (`relay.on_poison = "halt"`).
async fn lost_slot_and_halt() -> String {
    let mut db = TestDb::create_with("monitoring_halt", 1).await;
    db.append_config(&CONFIG.replace("ON_POISON", "halt"));
    let relay = RelayProcess::start(&db.config_path, &[]);
    db.wait_streaming(&relay).await;
    db.insert_event("a", "Created", r#"{"seq": 0}"#).await;
    harness::consume_exactly(&db.topic, 1, Duration::from_secs(60), &relay).await;
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;

    let relay = RelayProcess::start(&db.config_path, &[]);
    let addr = metrics_addr(&relay).await;
    db.wait_streaming(&relay).await;
    assert!(
        relay.log().contains("replication slot lost"),
        "{}",
        relay.log()
    );
    db.insert_event("h", "Created", &harness::oversize_payload(1))
        .await;
    let page = scrape_until(
        &addr,
        &relay,
        &[
            "outbox_relay_slot_losses_total",
            "outbox_relay_halted_events",
        ],
        "a lost slot and a halt",
    )
    .await;
    relay.kill9().await;
    db.drop_slot().await;
    page
}

/// Phase 3: exactly-once on the dev broker; a committed transaction.
async fn exactly_once(broker: &DevBroker) -> String {
    let mut db = TestDb::create_with("monitoring_eos", 1).await;
    harness::create_topic_on(&broker.address, &db.topic, 1).await;
    db.append_config(&CONFIG.replace("ON_POISON", "skip"));
    let env = [
        ("OUTBOX_RELAY__KAFKA__BROKERS", broker.address.as_str()),
        ("OUTBOX_RELAY__KAFKA__DELIVERY", "exactly-once"),
    ];
    let out = harness::run_cli_with(
        &["migrate", "--config", db.config_path.to_str().unwrap()],
        &env,
    );
    assert!(
        out.status.success(),
        "migrate (the progress topic): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let relay = RelayProcess::start(&db.config_path, &env);
    let addr = metrics_addr(&relay).await;
    db.wait_streaming(&relay).await;
    db.insert_event("a", "Created", r#"{"seq": 0}"#).await;
    let page = scrape_until(
        &addr,
        &relay,
        &["outbox_relay_kafka_transactions_total{outcome=\"committed\"}"],
        "a committed transaction",
    )
    .await;
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
    page
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_alerts_and_the_dashboard_name_is_exported() {
    let selected = selected_names();
    let broker = DevBroker::start_with(&["--auto-create-topics", "false"]);
    let mut exported = Exported::default();
    exported.add(&faults_at_least_once(&broker).await);
    exported.add(&lost_slot_and_halt().await);
    exported.add(&exactly_once(&broker).await);

    let mut problems = Vec::new();
    for (file, names) in [
        (
            "deploy/prometheus/outbox-relay-rules.yml",
            &selected.rules.names,
        ),
        (
            "deploy/grafana/outbox-relay-dashboard.json",
            &selected.dashboard.names,
        ),
    ] {
        for name in names {
            if let Some(problem) = exported.problem(name) {
                problems.push(format!("{file}: {problem}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{}\nexported: {:?}",
        problems.join("\n"),
        exported.types
    );
    eprintln!(
        "monitoring: {} names in the rules, {} in the dashboard, all among the {} metric \
         families three relays exported",
        selected.rules.names.len(),
        selected.dashboard.names.len(),
        exported.types.len()
    );
}

/// The checks of [`Exported::problem`], on a page of the exporter's format.
#[test]
fn a_name_must_be_a_series_of_the_right_type() {
    let mut exported = Exported::default();
    exported.add(
        "# HELP h_seconds Heartbeat\n# TYPE h_seconds histogram\n\
         h_seconds_bucket{le=\"0.1\"} 1\nh_seconds_bucket{le=\"+Inf\"} 1\n\
         h_seconds_sum 0.05\nh_seconds_count 1\n\n\
         # TYPE c_total counter\nc_total{topic=\"t\"} 3\n\n# TYPE g gauge\n",
    );
    for ok in [
        "h_seconds_bucket",
        "h_seconds_sum",
        "h_seconds_count",
        "c_total",
    ] {
        assert_eq!(exported.problem(ok), None, "{ok}");
    }
    for bad in ["h_seconds", "c", "c_total_bucket", "g", "missing"] {
        assert!(exported.problem(bad).is_some(), "{bad}");
    }
}
