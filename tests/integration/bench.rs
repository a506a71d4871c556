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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_measures_every_mode_and_cleans_up() {
    let _heavy = harness::heavy().await;
    let env = harness::env();
    let db = harness::unique("bench");
    let admin = harness::connect(&env.pg_url).await;
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let url = harness::database_url(&env.pg_url, &db);
    let config = std::env::temp_dir().join(format!("{db}.toml"));
    std::fs::write(
        &config,
        format!(
            "[postgres]\nurl = \"{url}\"\n\n[kafka]\nbrokers = \"{}\"\n\n[log]\nlevel = \"warn\"\n",
            env.brokers
        ),
    )
    .unwrap();
    let plot = std::env::temp_dir().join(format!("{db}.svg"));
    let args = [
        "bench".to_owned(),
        "--config".to_owned(),
        config.display().to_string(),
        "--events".to_owned(),
        "2000".to_owned(),
        "--repeat".to_owned(),
        "1".to_owned(),
        "--json".to_owned(),
        "--plot".to_owned(),
        plot.display().to_string(),
    ];
    let out = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        harness::run_cli(&args)
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Exactly one JSON object on stdout.
    let report: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!("stdout is not one JSON object ({e}):\n{stdout}");
    });
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

    let svg = std::fs::read_to_string(&plot).expect("the --plot file");
    assert!(svg.contains("<svg") && svg.contains("cdc"), "not a chart");

    // Nothing left behind: no slot, no tables, no publication.
    let client = harness::connect(&url).await;
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
    drop(client);
    let _ = std::fs::remove_file(&plot);
    let _ = std::fs::remove_file(&config);
    let _ = admin
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await;
}
