//! `kafka.delivery = "exactly-once"`: every way a Kafka transaction is aborted while
//! the relay runs (not after a kill) loses nothing. Each test makes the dev broker
//! (`outbox-relay dev-broker`, the only broker at hand with real transactions) abort
//! a transaction whose other events were already acked, by a means a real cluster
//! has too: a topic created after its first events, a broker stall longer than the
//! transaction timeout, a commit that fails abortably, a graceful stop right after
//! an abort. A `read_committed` reader and `audit --isolation read_committed` must
//! then see every committed event exactly once, in per-key order.
//!
//! Before the shell kept each event's record until the core resolved it, every one
//! of these lost the acked events of the aborted transaction (the core asked for
//! them again, the shell had dropped them, the next commit resolved them unsent).

use std::time::{Duration, Instant};

use crate::exactly_once::read_committed_until_complete;
use crate::harness::{self, DevBroker, RelayProcess, TestDb, tally};

/// Events per writer (two writers).
const PER_WRITER: i64 = 400;

/// The relay's environment for `broker`, exactly-once, short transactions.
fn relay_env(brokers: &str) -> Vec<(&'static str, String)> {
    vec![
        ("OUTBOX_RELAY__KAFKA__BROKERS", brokers.to_owned()),
        ("OUTBOX_RELAY__KAFKA__DELIVERY", "exactly-once".to_owned()),
        (
            "OUTBOX_RELAY__KAFKA__TRANSACTION_INTERVAL_MS",
            "200".to_owned(),
        ),
        (
            "OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT_EVENTS",
            "500".to_owned(),
        ),
    ]
}

fn borrowed<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// A test database whose topic (3 partitions) and progress topic live on `broker`
/// (`migrate` creates the progress topic).
async fn exactly_once_db(prefix: &str, broker: &DevBroker, extra_toml: &str) -> TestDb {
    let db = TestDb::create_configured(prefix, 1, extra_toml).await;
    harness::create_topic_on(&broker.address, &db.topic, 3).await;
    let env = relay_env(&broker.address);
    let out = harness::run_cli_with(
        &["migrate", "--config", db.config_path.to_str().unwrap()],
        &borrowed(&env),
    );
    assert!(
        out.status.success(),
        "migrate: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    db
}

/// Writer `w`: `PER_WRITER` events over 11 entities of its own, in transactions of
/// one to three rows, 10 ms apart. Every `late_every`-th row (if any) goes to
/// `late_topic` through the row's `topic` column, on entities of its own.
async fn write(url: String, w: i64, late: Option<(String, i64)>) {
    let client = harness::connect(&url).await;
    let (late_topic, late_every) = late.unwrap_or_default();
    let late_every = if late_every > 0 { late_every } else { i64::MAX };
    client
        .batch_execute(&format!(
            "DO $$ BEGIN
               FOR g IN 0..{last} LOOP
                 IF g % {late_every} = {late_every} - 1 THEN
                   INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, topic)
                   VALUES ('order', 'late{w}-' || (g % 3), 'Created',
                           jsonb_build_object('seq', g), '{late_topic}');
                 ELSE
                   INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                   VALUES ('order', 'w{w}-' || (g % 11), 'Created', jsonb_build_object('seq', g));
                 END IF;
                 IF g % (1 + g % 3) = 0 THEN
                   COMMIT;
                   PERFORM pg_sleep(0.01);
                 END IF;
               END LOOP;
             END $$",
            last = PER_WRITER - 1
        ))
        .await
        .expect("write events");
}

/// Starts two writers on `db`; `late`: see [`write`].
fn writers(db: &TestDb, late: Option<(String, i64)>) -> Vec<tokio::task::JoinHandle<()>> {
    (0..2)
        .map(|w| tokio::spawn(write(db.url.clone(), w, late.clone())))
        .collect()
}

/// `audit --isolation read_committed --json` against `broker`: `(lost, duplicates)`.
fn audit_read_committed(db: &TestDb, brokers: &str) -> (u64, u64, serde_json::Value) {
    let env = relay_env(brokers);
    let out = harness::run_cli_with(
        &[
            "audit",
            "--json",
            "--no-progress",
            "--isolation",
            "read_committed",
            "--timeout-secs",
            "20",
            "--config",
            db.config_path.to_str().unwrap(),
        ],
        &borrowed(&env),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "audit --json printed no JSON ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let lost = json["lost"].as_u64().expect("lost");
    let duplicates = json["duplicates"].as_u64().expect("duplicates");
    (lost, duplicates, json)
}

/// Every event of the outbox, by topic: `(topic, count)`.
async fn committed_per_topic(db: &TestDb, default_topic: &str) -> Vec<(String, usize)> {
    let rows = db
        .client
        .query(
            "SELECT coalesce(nullif(topic, ''), $1), count(*) FROM outbox GROUP BY 1 ORDER BY 1",
            &[&default_topic],
        )
        .await
        .expect("count events per topic");
    rows.iter()
        .map(|r| {
            (
                r.get::<_, String>(0),
                usize::try_from(r.get::<_, i64>(1)).expect("a count"),
            )
        })
        .collect()
}

/// The end of every test: the relay delivers everything (read_committed, once each,
/// in per-key order, none poisoned), and the audit agrees. Returns the records read.
async fn assert_every_event_once(db: &TestDb, broker: &DevBroker, relay: &RelayProcess) -> usize {
    let mut total = 0;
    for (topic, expected) in committed_per_topic(db, &db.topic).await {
        let records = read_committed_until_complete(
            &broker.address,
            &topic,
            expected,
            Duration::from_secs(120),
        )
        .await;
        let (unique, duplicates) = tally(&records);
        assert_eq!(
            (unique, duplicates),
            (expected, 0),
            "{topic}: read_committed saw {unique} of {expected} events and {duplicates} \
             duplicates; relay log:\n{}\nbroker log:\n{}",
            relay.log(),
            broker.log()
        );
        harness::assert_per_key_order(&records);
        total += expected;
    }
    assert_eq!(db.poison_rows().await, 0, "nothing is poison here");
    let (lost, duplicates, json) = audit_read_committed(db, &broker.address);
    assert_eq!((lost, duplicates), (0, 0), "audit: {json}");
    total
}

/// One test's world: the dev broker, a database on it, the relay's environment,
/// and two writers at work once [`Scenario::start`] returned.
struct Scenario {
    broker: DevBroker,
    db: TestDb,
    env: Vec<(&'static str, String)>,
    writers: Vec<tokio::task::JoinHandle<()>>,
}

impl Scenario {
    /// The database (`extra_toml` in its config), the relay (`extra_env` beside
    /// [`relay_env`]) streaming from it, then the writers (`late`: see [`write`]).
    async fn start(
        prefix: &str,
        broker: DevBroker,
        extra_toml: &str,
        extra_env: &[(&'static str, &str)],
        late: Option<(String, i64)>,
    ) -> (Scenario, RelayProcess) {
        let db = exactly_once_db(prefix, &broker, extra_toml).await;
        let mut env = relay_env(&broker.address);
        env.extend(extra_env.iter().map(|(k, v)| (*k, (*v).to_owned())));
        let relay = RelayProcess::start(&db.config_path, &borrowed(&env));
        db.wait_streaming(&relay).await;
        let writers = writers(&db, late);
        let scenario = Scenario {
            broker,
            db,
            env,
            writers,
        };
        (scenario, relay)
    }

    /// Another relay process on the same database.
    fn relay(&self) -> RelayProcess {
        RelayProcess::start(&self.db.config_path, &borrowed(&self.env))
    }

    /// Waits for the writers, then checks that `relay` delivered every event once
    /// ([`assert_every_event_once`]); returns how many.
    async fn all_once(&mut self, relay: &RelayProcess) -> usize {
        for w in self.writers.drain(..) {
            w.await.expect("writer");
        }
        assert_every_event_once(&self.db, &self.broker, relay).await
    }

    /// Stops `relay` and drops the slot.
    async fn end(self, relay: RelayProcess) {
        relay.terminate(Duration::from_secs(30)).await;
        self.db.drop_slot().await;
    }
}

/// A topic created after its first events were written (`relay.on_config_error =
/// "block"`, the default): each produce to it fails, and each failure aborts a
/// transaction full of acked events of the other topic. Nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_created_after_its_first_events_loses_nothing() {
    let broker = DevBroker::start_with(&["--auto-create-topics", "false"]);
    let late_topic = harness::unique("eos_late_topic");
    // librdkafka fails a record for a missing topic after this long (30 s by default).
    let (mut s, relay) = Scenario::start(
        "eos_late_topic",
        broker,
        "\n[kafka.producer]\n\"topic.metadata.propagation.max.ms\" = \"500\"\n",
        &[],
        Some((late_topic.clone(), 25)),
    )
    .await;
    let refused = "the broker refuses this topic's events";
    harness::wait_until(Duration::from_secs(90), refused, || async {
        relay.log().contains(refused)
    })
    .await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    harness::create_topic_on(&s.broker.address, &late_topic, 1).await;
    let total = s.all_once(&relay).await;
    let aborted = relay
        .log()
        .matches("aborting the Kafka transaction")
        .count();
    assert!(
        aborted > 0,
        "no transaction was aborted; log:\n{}",
        relay.log()
    );
    eprintln!("late topic: {total} events once each, {aborted} transactions aborted");
    s.end(relay).await;
}

/// The broker stops answering (SIGSTOP) for longer than the transaction timeout,
/// then goes on (SIGCONT): records time out, the coordinator aborts the transaction
/// on its timeout and fences the producer. The relay, which still holds the slot,
/// tells that from a takeover: it replaces its producer instead of exiting, and
/// nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_stall_past_the_transaction_timeout_loses_nothing() {
    let timeout = [("OUTBOX_RELAY__KAFKA__TRANSACTION_TIMEOUT_MS", "3000")];
    let (mut s, mut relay) =
        Scenario::start("eos_stall", DevBroker::start(), "", &timeout, None).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    s.broker.signal("-STOP");
    tokio::time::sleep(Duration::from_secs(6)).await;
    s.broker.signal("-CONT");
    let total = s.all_once(&relay).await;
    assert!(
        relay.is_running(),
        "the relay exited; log:\n{}",
        relay.log()
    );
    let log = relay.log();
    let timed_out = log
        .matches("the transaction coordinator fenced this producer while this relay holds the slot")
        .count();
    // A record of the transaction failed, or its commit did: either way aborted.
    let aborted = log.matches("aborting the Kafka transaction").count()
        + log
            .matches("Kafka transaction cannot commit; aborting it")
            .count();
    assert!(
        timed_out + aborted > 0,
        "the stall aborted no transaction; log:\n{log}"
    );
    eprintln!(
        "broker stall: {total} events once each; {timed_out} transaction(s) aborted by the \
         coordinator's timeout, {aborted} aborted by the relay"
    );
    s.end(relay).await;
}

/// The commit itself fails abortably (the broker refuses the progress record written
/// at the commit): the whole transaction, every event of it acked, is aborted and
/// produced again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abortable_commit_error_loses_nothing() {
    let (mut s, relay) =
        Scenario::start("eos_commit_fails", DevBroker::start(), "", &[], None).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    s.broker
        .control("fail-produce outbox_relay_progress * INVALID_RECORD 3")
        .await;
    let total = s.all_once(&relay).await;
    assert!(
        relay.log().contains("Kafka transaction cannot commit"),
        "no commit failed; log:\n{}",
        relay.log()
    );
    eprintln!("abortable commit errors: {total} events once each");
    s.end(relay).await;
}

/// A record the broker refuses aborts its transaction, and the relay is stopped
/// gracefully (SIGTERM) right then: what the stop commits holds only what was sent
/// again, and the next start sends the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_right_after_an_abort_loses_nothing() {
    let (mut s, relay) =
        Scenario::start("eos_stop_after_abort", DevBroker::start(), "", &[], None).await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    s.broker
        .control(&format!("fail-produce {} * INVALID_RECORD 1", s.db.topic))
        .await;
    // The refused record's report aborts the transaction at once; its events go out
    // again after the core's pause (100 ms): the stop comes right then.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !s.broker.log().contains("fault fired: fail-produce") {
        assert!(Instant::now() < deadline, "the fault never fired");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let status = relay.terminate(Duration::from_secs(60)).await;
    assert!(status.success(), "the stop failed: {status:?}");
    let relay = s.relay();
    let total = s.all_once(&relay).await;
    eprintln!("graceful stop after an abort: {total} events once each");
    s.end(relay).await;
}

/// What every rolling restart of a cluster does to a transactional producer: leaders
/// move (NOT_LEADER_OR_FOLLOWER), the coordinator moves or is busy (NOT_COORDINATOR,
/// CONCURRENT_TRANSACTIONS on AddPartitionsToTxn and EndTxn), and a partition's new
/// leader may not know the producer's sequence (OUT_OF_ORDER_SEQUENCE_NUMBER, fatal
/// to the producer, which is replaced). Each is retried or recovered: nothing lost,
/// nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_errors_of_a_rolling_restart_lose_nothing() {
    let (mut s, relay) = Scenario::start("eos_rolling", DevBroker::start(), "", &[], None).await;
    for command in [
        format!("fail-produce {} * NOT_LEADER_OR_FOLLOWER 5", s.db.topic),
        "coordinator-error NOT_COORDINATOR 3".to_owned(),
        "coordinator-error CONCURRENT_TRANSACTIONS 3".to_owned(),
        "end-txn-error CONCURRENT_TRANSACTIONS 2".to_owned(),
        format!(
            "fail-produce {} 0 OUT_OF_ORDER_SEQUENCE_NUMBER 1",
            s.db.topic
        ),
    ] {
        tokio::time::sleep(Duration::from_millis(700)).await;
        s.broker.control(&command).await;
    }
    let total = s.all_once(&relay).await;
    let fired = s.broker.log().matches("fault fired").count();
    assert!(
        fired >= 5,
        "only {fired} faults fired; broker log:\n{}",
        s.broker.log()
    );
    eprintln!("rolling-restart errors: {total} events once each, {fired} faults fired");
    s.end(relay).await;
}
