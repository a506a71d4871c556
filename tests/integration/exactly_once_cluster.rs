//! What exactly-once needs from a production cluster, told to the operator before
//! the relay relies on it: `check` (and `run`'s start checks) name a progress topic
//! and a transaction coordinator unfit for it, and a refusal no retry can fix ends
//! the relay with the fix instead of a loop. The cluster is the dev broker
//! (`outbox-relay dev-broker`), told to misbehave as a real cluster can.

use std::time::Duration;

use crate::harness::{self, DevBroker, RelayProcess, TestDb};

/// The relay's environment for exactly-once against `brokers`.
fn exactly_once(brokers: &str) -> [(&'static str, &str); 2] {
    [
        ("OUTBOX_RELAY__KAFKA__BROKERS", brokers),
        ("OUTBOX_RELAY__KAFKA__DELIVERY", "exactly-once"),
    ]
}

/// `outbox-relay check --json` with `env`: its exit code and the `kafka.delivery`
/// check.
fn delivery_check(db: &TestDb, env: &[(&str, &str)]) -> (Option<i32>, serde_json::Value) {
    let out = harness::run_cli_with(
        &[
            "check",
            "--json",
            "--config",
            db.config_path.to_str().unwrap(),
        ],
        env,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "check --json printed no JSON ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let check = report["checks"]
        .as_array()
        .and_then(|checks| checks.iter().find(|c| c["name"] == "kafka.delivery"))
        .cloned()
        .unwrap_or_else(|| panic!("no kafka.delivery check: {report}"));
    (out.status.code(), check)
}

/// Creates the progress topic as an operator might by hand: `partitions`, with
/// `configs`.
async fn progress_topic(brokers: &str, partitions: i32, configs: &[(&str, &str)]) {
    harness::create_topic_with(brokers, "outbox_relay_progress", partitions, configs).await;
}

/// A progress topic of three partitions, `cleanup.policy=delete`, one replica under
/// `min.insync.replicas=2`, and a coordinator whose `transaction.max.timeout.ms` is
/// below the relay's 60 s: `check` names all four with their fixes and exits 4, and
/// `run` refuses to start with the same. Fixed, `check` is ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_a_progress_topic_and_coordinator_unfit_for_exactly_once() {
    let broker = DevBroker::start_with(&["--transaction-max-timeout-ms", "30000"]);
    let db = TestDb::create("eos_cluster_check").await;
    harness::create_topic_on(&broker.address, &db.topic, 3).await;
    progress_topic(
        &broker.address,
        3,
        &[("cleanup.policy", "delete"), ("min.insync.replicas", "2")],
    )
    .await;
    let env = exactly_once(&broker.address);
    let (code, check) = delivery_check(&db, &env);
    assert_eq!(check["status"], "problem", "{check}");
    let detail = check["detail"].as_str().unwrap_or_default();
    let fix = check["fix"].as_str().unwrap_or_default();
    for found in [
        "3 partitions",
        "cleanup.policy is \"delete\"",
        "1 replica(s), below its min.insync.replicas (2)",
        "transaction.max.timeout.ms is 30000 ms",
    ] {
        assert!(detail.contains(found), "{found:?} not in {detail}");
    }
    for to_do in ["one partition", "cleanup.policy=compact", "at most 30000"] {
        assert!(fix.contains(to_do), "{to_do:?} not in {fix}");
    }
    assert_eq!(code, Some(4), "a Kafka-side problem: exit 4");
    let mut relay = RelayProcess::start(&db.config_path, &env);
    let status = relay.wait(Duration::from_secs(60)).await;
    assert_eq!(status.code(), Some(4), "{}", relay.log());
    assert!(
        relay
            .log()
            .contains("transaction.max.timeout.ms is 30000 ms"),
        "{}",
        relay.log()
    );

    // The timeout lowered to what the coordinator allows, and a fit progress topic.
    let fixed = DevBroker::start_with(&["--transaction-max-timeout-ms", "30000"]);
    harness::create_topic_on(&fixed.address, &db.topic, 3).await;
    progress_topic(&fixed.address, 1, &[("cleanup.policy", "compact")]).await;
    let env = [
        ("OUTBOX_RELAY__KAFKA__BROKERS", fixed.address.as_str()),
        ("OUTBOX_RELAY__KAFKA__DELIVERY", "exactly-once"),
        ("OUTBOX_RELAY__KAFKA__TRANSACTION_TIMEOUT_MS", "30000"),
    ];
    let (code, check) = delivery_check(&db, &env);
    assert_eq!(check["status"], "ok", "{check}");
    assert_eq!(code, Some(0), "{check}");
    db.drop_slot().await;
}

/// The coordinator refuses the relay's `transactional.id` (no ACL): the relay ends
/// with exit code 3 and the ACL to grant, instead of replacing its producer forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_transactional_id_ends_the_relay_with_the_acl_to_grant() {
    let broker = DevBroker::start();
    let db = TestDb::create("eos_cluster_acl").await;
    harness::create_topic_on(&broker.address, &db.topic, 3).await;
    progress_topic(&broker.address, 1, &[("cleanup.policy", "compact")]).await;
    broker
        .control("coordinator-error TRANSACTIONAL_ID_AUTHORIZATION_FAILED 100000")
        .await;
    let env = exactly_once(&broker.address);
    let mut relay = RelayProcess::start(&db.config_path, &env);
    let status = relay.wait(Duration::from_secs(90)).await;
    let log = relay.log();
    assert_eq!(status.code(), Some(3), "{log}");
    assert!(log.contains("TransactionalId"), "the ACL to grant: {log}");
    db.drop_slot().await;
}
