//! `outbox-relay bench`, small: every mode measured against the real PostgreSQL
//! and broker, one JSON object on stdout, a chart, and nothing left behind.

use serde_json::Value;

use crate::harness;

const MODES: [&str; 8] = [
    "pg-ceiling-recvlogical",
    "pg-ceiling-ours",
    "broker-ceiling",
    "cdc",
    "poll-b100-w1",
    "poll-b100-w4",
    "poll-b1000-w1",
    "poll-b1000-w4",
];

fn positive(v: &Value, what: &str) -> f64 {
    let n = v
        .as_f64()
        .unwrap_or_else(|| panic!("{what} is not a number: {v}"));
    assert!(n.is_finite() && n > 0.0, "{what} = {n}");
    n
}

/// A database of its own and a config pointing at it, for one bench run.
struct BenchDb {
    admin: tokio_postgres::Client,
    name: String,
    url: String,
    config: std::path::PathBuf,
    plot: std::path::PathBuf,
}

impl BenchDb {
    async fn create() -> BenchDb {
        let env = harness::env();
        let name = harness::unique("bench");
        let admin = harness::connect(&env.pg_url).await;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let url = harness::database_url(&env.pg_url, &name);
        let config = std::env::temp_dir().join(format!("{name}.toml"));
        std::fs::write(
            &config,
            format!(
                "[postgres]\nurl = \"{url}\"\n\n[kafka]\nbrokers = \"{}\"\n\n[log]\nlevel = \"warn\"\n",
                env.brokers
            ),
        )
        .unwrap();
        let plot = std::env::temp_dir().join(format!("{name}.svg"));
        BenchDb {
            admin,
            name,
            url,
            config,
            plot,
        }
    }

    /// `outbox-relay bench --config … --json --plot … <args>`; its JSON report.
    async fn bench(&self, args: &[&str]) -> Value {
        let mut all = vec![
            "bench".to_owned(),
            "--config".to_owned(),
            self.config.display().to_string(),
            "--json".to_owned(),
            "--plot".to_owned(),
            self.plot.display().to_string(),
        ];
        all.extend(args.iter().map(|a| (*a).to_owned()));
        let out = tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = all.iter().map(String::as_str).collect();
            harness::run_cli(&args)
        })
        .await
        .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "bench failed ({}): {}\n{stdout}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        // Exactly one JSON object on stdout.
        serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
            panic!("stdout is not one JSON object ({e}):\n{stdout}");
        })
    }

    fn svg(&self) -> String {
        std::fs::read_to_string(&self.plot).expect("the --plot file")
    }

    /// Nothing left behind: no slot, no tables, no publication.
    async fn assert_clean(&self) {
        let client = harness::connect(&self.url).await;
        let leftovers: i64 = client
            .query_one(
                "SELECT (SELECT count(*) FROM pg_replication_slots WHERE database = current_database())
                      + (SELECT count(*) FROM pg_tables WHERE tablename LIKE 'bench\\_%')
                      + (SELECT count(*) FROM pg_publication WHERE pubname LIKE 'bench\\_%')",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(leftovers, 0, "bench left objects behind");
    }

    async fn remove(self) {
        let _ = std::fs::remove_file(&self.plot);
        let _ = std::fs::remove_file(&self.config);
        let _ = self
            .admin
            .batch_execute(&format!("DROP DATABASE {} WITH (FORCE)", self.name))
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_measures_every_mode_and_cleans_up() {
    let _heavy = harness::heavy().await;
    let db = BenchDb::create().await;
    let report = db.bench(&["--events", "2000", "--repeat", "1"]).await;
    assert_eq!(report["workload"]["events"], 2000, "{report}");
    assert_eq!(report["workload"]["repeat"], 1, "{report}");
    positive(
        &report["workload"]["wal_bytes_per_event"],
        "wal_bytes_per_event",
    );
    let results = report["results"].as_array().expect("results array");
    let modes: Vec<&str> = results
        .iter()
        .map(|r| r["mode"].as_str().expect("mode name"))
        .collect();
    assert_eq!(modes, MODES, "{report}");
    for r in results {
        let mode = r["mode"].as_str().unwrap_or_default();
        positive(&r["events_per_s"], &format!("{mode} events_per_s"));
        for key in ["p50_ms", "p99_ms", "cpu_s_per_1m", "rss_mib"] {
            assert!(r.get(key).is_some(), "{mode} has no {key}: {r}");
        }
        positive(&r["rss_mib"], &format!("{mode} rss_mib"));
    }
    for ratio in ["cdc_vs_poll", "cdc_vs_pg_ceiling", "cdc_vs_broker_ceiling"] {
        positive(&report["ratios"][ratio], ratio);
    }
    // The poller's UPDATEs leave dead tuples and WAL; the CDC relay writes nothing.
    let poll = &results[4];
    positive(&poll["dead_tuples"], "poll dead_tuples");
    positive(&poll["drain_wal_bytes_per_event"], "poll drain WAL");

    let svg = db.svg();
    assert!(svg.contains("<svg") && svg.contains("cdc"), "not a chart");
    db.assert_clean().await;
    db.remove().await;
}

/// A rate no writer on this machine reaches in time: its points must fail.
const UNREACHABLE_RATE: &str = "50000000";

/// The steady workload at fixed rates, with a point that cannot succeed first: every
/// point is reported, the impossible one as failed with its reason, the run goes on,
/// and the CDC relay's per-stage figures come from its own histograms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_reports_every_point_and_goes_on_after_a_failed_one() {
    let _heavy = harness::heavy().await;
    let db = BenchDb::create().await;
    let rates = format!("{UNREACHABLE_RATE},300,max");
    let report = db
        .bench(&[
            "--workload",
            "steady",
            "--modes",
            "cdc,poll",
            "--rates",
            &rates,
            "--duration",
            "2",
            "--rows-per-tx",
            "1",
            "--writers",
            "2",
            "--repeat",
            "1",
        ])
        .await;
    let steady = report["steady"].as_array().expect("steady array");
    let points: Vec<(&str, &str)> = steady
        .iter()
        .map(|s| (s["rate"].as_str().unwrap(), s["mode"].as_str().unwrap()))
        .collect();
    assert_eq!(
        points,
        [
            (UNREACHABLE_RATE, "no-relay"),
            (UNREACHABLE_RATE, "cdc"),
            (UNREACHABLE_RATE, "poll-b1000-w1"),
            ("300", "no-relay"),
            ("300", "cdc"),
            ("300", "poll-b1000-w1"),
            ("max", "no-relay"),
            ("max", "cdc"),
            ("max", "poll-b1000-w1"),
        ],
        "{report}"
    );
    for failed in &steady[..3] {
        assert_eq!(failed["failed"], true, "{failed}");
        let reason = failed["failures"][0].as_str().unwrap_or_default();
        assert!(reason.contains("writers fell behind"), "{failed}");
        assert!(failed["p99_ms"].is_null(), "{failed}");
        // The rate reached is still recorded.
        positive(&failed["events_per_s"], "the failed point's achieved rate");
    }
    // The writers alone: their rate and the database's CPU, no latency.
    let alone = &steady[3];
    assert_eq!(alone["failed"], false, "{alone}");
    assert!(alone["p99_ms"].is_null(), "{alone}");
    positive(&alone["events_per_s"], "the writers' rate alone");
    positive(
        &alone["cpu_us_per_event"]["postgres"],
        "the database's CPU per event alone",
    );
    assert!(alone["cpu_us_per_event"]["relay"].is_null(), "{alone}");
    for ok in &steady[4..6] {
        assert_eq!(ok["failed"], false, "{ok}");
        let achieved = positive(&ok["events_per_s"], "achieved rate");
        assert!((240.0..=330.0).contains(&achieved), "{ok}");
        let (p50, p99) = (
            positive(&ok["p50_ms"], "p50"),
            positive(&ok["p99_ms"], "p99"),
        );
        assert!(p50 <= p99, "{ok}");
        // CPU per event by process: the database's and the relay's or poller's.
        positive(&ok["cpu_us_per_event"]["postgres"], "PostgreSQL CPU");
        positive(&ok["cpu_us_per_event"]["relay"], "relay CPU");
        // From the relay's or poller's librdkafka statistics: a request carries at
        // least one record (records are counted as a request is built, requests as
        // it is sent; only retried requests count twice and could push it above 1).
        let requests = positive(&ok["per_event"]["produce_requests"], "produce requests");
        assert!(requests <= 1.2, "{ok}");
        positive(&ok["per_event"]["relay_wakeups"], "relay wake-ups");
    }
    positive(
        &steady[4]["per_event"]["walsender_wakeups"],
        "the walsender's wake-ups",
    );
    assert!(steady[5]["per_event"]["walsender_wakeups"].is_null());
    positive(
        &steady[4]["cpu_us_per_event"]["walsender"],
        "the CDC relay's walsender CPU",
    );
    assert!(steady[5]["cpu_us_per_event"]["walsender"].is_null());
    // Where the time goes, from the relay's /metrics.
    let stages = &steady[4]["stages"];
    for stage in [
        "commit_to_received",
        "received_to_produced",
        "produced_to_acked",
        "acked_to_confirmed",
        "commit_to_ack",
    ] {
        let p50 = stages[stage]["p50_ms"].as_f64();
        let p99 = stages[stage]["p99_ms"].as_f64();
        assert!(
            matches!((p50, p99), (Some(a), Some(b)) if a >= 0.0 && a <= b),
            "{stage}: {stages}"
        );
    }
    positive(&stages["produced_to_acked"]["p99_ms"], "produced→acked p99");
    assert!(
        steady[5]["stages"]
            .as_object()
            .is_some_and(|s| s.is_empty()),
        "the poller has no stages: {}",
        steady[5]
    );
    // The writers' maximum was measured and each of its points either measured or
    // failed with a reason.
    for max in &steady[6..] {
        positive(&max["target_events_per_s"], "the writers' maximum");
        if max["failed"] == true {
            assert!(
                max["failures"][0].as_str().is_some_and(|r| !r.is_empty()),
                "{max}"
            );
        } else if max["mode"] != "no-relay" {
            positive(&max["p99_ms"], "p99 at max");
        }
    }
    let svg = db.svg();
    assert!(
        svg.contains("events/s achieved") && svg.contains("failed point"),
        "no latency-against-rate chart"
    );
    db.assert_clean().await;
    db.remove().await;
}
