//! `outbox-relay demo`, the README's first command: its own throwaway PostgreSQL,
//! the embedded broker (or a real one with `--brokers`), events relayed and audited.

use crate::harness;

fn assert_clean_summary(out: &std::process::Output) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "demo failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("events relayed   2000"), "{stdout}");
    let lost = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("lost"))
        .unwrap_or_else(|| panic!("no lost line: {stdout}"));
    assert_eq!(lost.split_whitespace().last(), Some("0"), "{stdout}");
    assert!(stdout.contains("result: clean"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_with_the_embedded_broker_relays_and_audits_clean() {
    let _heavy = harness::heavy().await;
    let out = tokio::task::spawn_blocking(|| harness::run_cli(&["demo", "--events", "2000"]))
        .await
        .unwrap();
    assert_clean_summary(&out);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_with_a_real_broker() {
    let _heavy = harness::heavy().await;
    let brokers = harness::env().brokers.clone();
    let out = tokio::task::spawn_blocking(move || {
        harness::run_cli(&["demo", "--events", "2000", "--brokers", &brokers])
    })
    .await
    .unwrap();
    assert_clean_summary(&out);
}
