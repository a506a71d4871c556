//! Shared test harness: the throwaway PostgreSQL and Kafka-protocol broker started
//! by `scripts/dev-env up`, with per-test isolation.
//!
//! Each test gets its own database (so its own outbox, poison table and
//! publication), its own slot name and its own topics, so tests run in parallel
//! without seeing each other's events. A missing environment is a test failure
//! with instructions, never a silent skip.

#![allow(dead_code)] // not every test binary module uses every helper

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use outbox_relay::config::Config;
use outbox_relay::tools::workload::{Keys, Workload, Writers};
use rdkafka::ClientConfig;
use rdkafka::Message;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Headers;
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use tokio_postgres::{Client, NoTls};

/// Tests that load the machine for a long time (the 100k drain, the bench, the
/// demo, the fault drill) hold this while they run, so they run one at a time and
/// leave the CPU to the other tests in between rather than starving them all at
/// once.
pub async fn heavy() -> tokio::sync::SemaphorePermit<'static> {
    static HEAVY: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
    HEAVY
        .acquire()
        .await
        .expect("the heavy-test semaphore is never closed")
}

/// The application's own write in each workload transaction: the relay must skip
/// it (not in the publication) and still see the transaction's events.
pub const BUSINESS_ROW: &str =
    "INSERT INTO business_orders (entity, amount) VALUES ('workload', 1)";

/// Connection facts of the running dev environment.
#[derive(Debug, Clone)]
pub struct Env {
    /// Superuser URL of the cluster's `postgres` database.
    pub pg_url: String,
    /// `bootstrap.servers` of the broker.
    pub brokers: String,
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Reads the environment from `OUTBOX_RELAY_TEST_*` variables, or asks
/// `scripts/dev-env env` when they are not set.
pub fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        let from_vars = (
            std::env::var("OUTBOX_RELAY_TEST_PG_URL"),
            std::env::var("OUTBOX_RELAY_TEST_BROKERS"),
        );
        if let (Ok(pg_url), Ok(brokers)) = from_vars {
            return Env { pg_url, brokers };
        }
        let script = repo_root().join("scripts/dev-env");
        let out = Command::new("bash")
            .arg(&script)
            .arg("env")
            .output()
            .expect("run scripts/dev-env env");
        assert!(
            out.status.success(),
            "the test environment is not up: run `scripts/dev-env up` first \
             (or `scripts/test`, which does it). dev-env said: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let get = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("export {name}=")))
                .map(|v| v.trim_matches('\'').to_owned())
                .unwrap_or_else(|| panic!("scripts/dev-env env did not print {name}"))
        };
        Env {
            pg_url: get("OUTBOX_RELAY_TEST_PG_URL"),
            brokers: get("OUTBOX_RELAY_TEST_BROKERS"),
        }
    })
}

/// Connects with tokio-postgres, failing the test with a clear message.
pub async fn connect(url: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "cannot connect to the test PostgreSQL at {url}: {e}. Is `scripts/dev-env up` running?"
            )
        });
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// A short unique suffix for database, slot and topic names.
pub fn unique(prefix: &str) -> String {
    let id = uuid::Uuid::now_v7().simple().to_string();
    // The tail of a v7 UUID is random; the head is the timestamp.
    format!("{prefix}_{}", &id[20..])
}

/// One test's isolated world: a fresh database with the migrations applied, a slot
/// name and a topic (created on the broker).
#[derive(Debug)]
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub client: Client,
    pub slot: String,
    pub topic: String,
    pub config_path: PathBuf,
}

impl TestDb {
    /// Creates the database, applies the migrations through the real binary
    /// (`outbox-relay migrate`), creates a one-partition-per-test topic.
    pub async fn create(prefix: &str) -> TestDb {
        Self::create_with(prefix, 3).await
    }

    pub async fn create_with(prefix: &str, partitions: i32) -> TestDb {
        Self::create_configured(prefix, partitions, "").await
    }

    /// Like [`TestDb::create_with`], with extra TOML in the config before `migrate`
    /// runs (e.g. `[outbox] partitioned = true`).
    pub async fn create_configured(prefix: &str, partitions: i32, extra_toml: &str) -> TestDb {
        Self::create_in(&env().pg_url, prefix, partitions, extra_toml).await
    }

    /// Like [`TestDb::create_configured`], in the cluster whose superuser URL is
    /// `pg_url` (e.g. a [`PrivateCluster`] a test restarts or reconfigures).
    pub async fn create_in(
        pg_url: &str,
        prefix: &str,
        partitions: i32,
        extra_toml: &str,
    ) -> TestDb {
        let env = env();
        let name = unique(prefix);
        let admin = connect(pg_url).await;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create test database");
        let url = database_url(pg_url, &name);
        let slot = format!("{name}_slot");
        let topic = format!("{name}.events");
        create_topic(&topic, partitions).await;
        let config_path = std::env::temp_dir().join(format!("{name}.toml"));
        let mut toml = config_toml(&url, &slot, &topic, &env.brokers);
        toml.push_str(extra_toml);
        std::fs::write(&config_path, toml).expect("write test config");
        let out = run_cli(&["migrate", "--config", path_str(&config_path)]);
        assert!(
            out.status.success(),
            "outbox-relay migrate failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let client = connect(&url).await;
        client
            .batch_execute(
                "CREATE TABLE business_orders (id bigserial PRIMARY KEY, entity text NOT NULL, amount int NOT NULL)",
            )
            .await
            .expect("create business table");
        TestDb {
            name,
            url,
            client,
            slot,
            topic,
            config_path,
        }
    }

    /// Rows in this test's `poison_outbox`.
    pub async fn poison_rows(&self) -> i64 {
        self.client
            .query_one("SELECT count(*) FROM poison_outbox", &[])
            .await
            .expect("count poison rows")
            .get(0)
    }

    /// Appends TOML (e.g. a `[kafka.producer]` section) to this test's config file.
    pub fn append_config(&mut self, toml: &str) {
        let mut text = std::fs::read_to_string(&self.config_path).expect("read test config");
        text.push_str(toml);
        std::fs::write(&self.config_path, text).expect("write test config");
    }

    /// The config the CLI reads for this test.
    pub fn config(&self) -> Config {
        Config::load(&self.config_path).expect("load test config")
    }

    /// The library's workload writer (the one the demo and the bench use) for this
    /// test's outbox: each writer owns its entities, so per-key order is checkable
    /// from the payloads' `seq` ([`assert_per_key_order`]); every transaction also
    /// writes a business row; the idempotency keys come back.
    pub fn writers(&self, workload: Workload) -> Writers {
        Writers::new(&self.url, "outbox", workload)
            .keys(Keys::PerWriter)
            .also(BUSINESS_ROW)
            .returning_keys()
    }

    /// Inserts a business row and an outbox row in one transaction; returns the
    /// idempotency key. (One hand-made event; workloads use [`TestDb::writers`].)
    pub async fn insert_event(&mut self, entity: &str, event_type: &str, payload: &str) -> String {
        let tx = self.client.transaction().await.expect("begin");
        tx.execute(
            "INSERT INTO business_orders (entity, amount) VALUES ($1, 1)",
            &[&entity],
        )
        .await
        .expect("insert business row");
        let key: String = tx
            .query_one(
                "INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('order', $1, $2, $3::text::jsonb) RETURNING idempotency_key",
                &[&entity, &event_type, &payload],
            )
            .await
            .expect("insert outbox row")
            .get(0);
        tx.commit().await.expect("commit");
        key
    }

    /// Creates the test's slot up front (as the relay would), so rows written
    /// before the relay starts are streamed too.
    pub async fn create_slot(&self) {
        self.client
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&self.slot],
            )
            .await
            .expect("create slot");
    }

    /// Waits until a relay streams from this test's slot. Rows committed before the
    /// slot exists are not in its stream (that is what a cutover is for), so tests
    /// that start a relay on a fresh database wait for this before writing.
    pub async fn wait_streaming(&self, relay: &RelayProcess) {
        self.wait_streaming_on(relay, &self.slot).await;
    }

    /// [`TestDb::wait_streaming`] for another slot of this database (a shard's).
    pub async fn wait_streaming_on(&self, relay: &RelayProcess, slot: &str) {
        // An active slot alone is not enough: while CREATE_REPLICATION_SLOT waits
        // for its consistent point the creating walsender holds it too, and a row
        // committed then is before the slot's start, so it is never decoded (and a
        // second relay could still win the slot). START_REPLICATION moves the
        // walsender past `startup`, and the relay logs its own "streaming" line.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let active: i64 = self
                .client
                .query_one(
                    "SELECT count(*) FROM pg_replication_slots s
                     JOIN pg_stat_replication r ON r.pid = s.active_pid
                     WHERE s.slot_name = $1 AND r.state IN ('catchup', 'streaming')",
                    &[&slot],
                )
                .await
                .expect("read pg_replication_slots")
                .get(0);
            if active == 1 && relay.log().contains(&format!("streaming slot={slot}")) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "relay did not start streaming from {slot}; log:\n{}",
                relay.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether this test's slot exists.
    pub async fn slot_exists(&self) -> bool {
        self.client
            .query_one(
                "SELECT count(*) > 0 FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await
            .expect("read the slots")
            .get(0)
    }

    /// Drops the slot if a test created one, so it does not pin WAL.
    pub async fn drop_slot(&self) {
        let _ = self
            .client
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.slot],
            )
            .await;
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

/// The cluster URL with another database name.
pub fn database_url(base: &str, db: &str) -> String {
    match base.rsplit_once('/') {
        Some((head, _)) => format!("{head}/{db}"),
        None => panic!("unexpected test PG URL {base}"),
    }
}

/// A config file for one test.
pub fn config_toml(url: &str, slot: &str, topic: &str, brokers: &str) -> String {
    format!(
        r#"[postgres]
url = "{url}"
slot = "{slot}"

[kafka]
brokers = "{brokers}"
topic_template = "{topic}"

[log]
level = "info"
"#
    )
}

/// Runs the real binary with arguments; returns its output.
pub fn run_cli(args: &[&str]) -> std::process::Output {
    run_cli_with(args, &[])
}

/// [`run_cli`] with environment overrides (`OUTBOX_RELAY__…`).
pub fn run_cli_with(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("spawn outbox-relay")
}

/// Creates a topic (Tansu does not auto-create) and waits until metadata shows it.
pub async fn create_topic(name: &str, partitions: i32) {
    create_topic_on(&env().brokers, name, partitions).await;
}

/// Creates a topic on a given broker and waits until metadata shows its partitions
/// (a producer that races ahead would see an unknown topic).
pub async fn create_topic_on(brokers: &str, name: &str, partitions: i32) {
    create_topic_with(brokers, name, partitions, &[]).await;
}

/// Creates the exactly-once progress topic on `brokers` as `migrate` does: one
/// partition, compacted.
pub async fn create_progress_topic_on(brokers: &str) {
    create_topic_with(
        brokers,
        "outbox_relay_progress",
        1,
        &[("cleanup.policy", "compact")],
    )
    .await;
}

/// [`create_topic_on`] with topic configs.
pub async fn create_topic_with(
    brokers: &str,
    name: &str,
    partitions: i32,
    configs: &[(&str, &str)],
) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .expect("create Kafka admin client");
    let mut topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    for (key, value) in configs {
        topic = topic.set(key, value);
    }
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results = admin
        .create_topics([&topic], &opts)
        .await
        .unwrap_or_else(|e| panic!("CreateTopics to {brokers} failed: {e}. Is the broker up?"));
    for r in results {
        if let Err((topic, code)) = r {
            assert_eq!(
                code,
                rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists,
                "creating topic {topic} failed"
            );
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let expected = usize::try_from(partitions).unwrap_or(0);
    loop {
        let consumer = consumer_for(brokers);
        let visible = consumer
            .fetch_metadata(Some(name), Duration::from_secs(5))
            .map(|m| {
                m.topics().iter().any(|t| {
                    t.name() == name && t.error().is_none() && t.partitions().len() == expected
                })
            })
            .unwrap_or(false);
        if visible {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "topic {name} never appeared in metadata"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn consumer() -> BaseConsumer {
    consumer_for(&env().brokers)
}

fn consumer_for(brokers: &str) -> BaseConsumer {
    consumer_with(brokers, &[])
}

/// A test consumer with extra librdkafka settings (security, say).
fn consumer_with(brokers: &str, extra: &[(String, String)]) -> BaseConsumer {
    let mut cfg = ClientConfig::new();
    for (key, value) in extra {
        cfg.set(key, value);
    }
    cfg.set("bootstrap.servers", brokers)
        .set("group.id", unique("test_reader"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        // Tansu 0.6 computes a partition's high watermark from its last batch, so
        // a fetch at the true end can come back "offset out of range". Resetting to
        // the earliest offset (and skipping what was already read, see
        // consume_blocking) loses nothing; the default, latest, would skip records.
        .set("auto.offset.reset", "earliest")
        .create()
        .expect("create Kafka consumer")
}

/// A record as a consumer sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    pub headers: BTreeMap<String, Vec<u8>>,
    pub timestamp_ms: Option<i64>,
    /// When this consumer read it (for arrival-time measurements).
    pub received_at: Instant,
}

impl Record {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .and_then(|v| std::str::from_utf8(v).ok())
    }
}

/// Reads a topic from the beginning of every partition until `n` records arrived or
/// `timeout` passed; returns what it read (callers assert on the count).
pub async fn consume(topic: &str, n: usize, timeout: Duration) -> Vec<Record> {
    consume_from(&env().brokers, topic, n, timeout).await
}

/// [`consume`] from a given broker.
pub async fn consume_from(brokers: &str, topic: &str, n: usize, timeout: Duration) -> Vec<Record> {
    consume_with(brokers, &[], topic, n, timeout).await
}

/// [`consume_from`] with extra consumer settings (e.g. SASL and TLS).
pub async fn consume_with(
    brokers: &str,
    settings: &[(&str, &str)],
    topic: &str,
    n: usize,
    timeout: Duration,
) -> Vec<Record> {
    let topic = topic.to_owned();
    let brokers = brokers.to_owned();
    let settings: Vec<(String, String)> = settings
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    tokio::task::spawn_blocking(move || consume_blocking(&brokers, &settings, &topic, n, timeout))
        .await
        .expect("consumer task")
}

fn consume_blocking(
    brokers: &str,
    settings: &[(String, String)],
    topic: &str,
    n: usize,
    timeout: Duration,
) -> Vec<Record> {
    let all = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(usize::MAX));
    consume_until(brokers, settings, topic, n, &all, timeout)
}

/// Reads `topic` from its start while the relay drains, until `until` (which the
/// caller may lower once it knows how many records to expect) records arrived or
/// `timeout` passed; each record keeps the instant it arrived.
pub async fn consume_while_draining(
    topic: String,
    until: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    timeout: Duration,
) -> Vec<Record> {
    let brokers = env().brokers.clone();
    tokio::task::spawn_blocking(move || {
        consume_until(&brokers, &[], &topic, usize::MAX, &until, timeout)
    })
    .await
    .expect("consumer task")
}

fn consume_until(
    brokers: &str,
    settings: &[(String, String)],
    topic: &str,
    n: usize,
    until: &std::sync::atomic::AtomicUsize,
    timeout: Duration,
) -> Vec<Record> {
    let consumer = consumer_with(brokers, settings);
    // A broker that just restarted may drop the first connection, and Tansu on
    // SQLite under the whole suite's load has been seen to time out metadata
    // requests for over 30 s after it answered its first one: ask again, for at
    // least a minute, whatever the caller's read timeout.
    let deadline = Instant::now() + timeout.max(Duration::from_secs(60));
    let metadata = loop {
        match consumer.fetch_metadata(Some(topic), Duration::from_secs(10)) {
            Ok(metadata) => break metadata,
            Err(e) if Instant::now() < deadline => {
                eprintln!("topic metadata of {topic}: {e}; asking again");
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => panic!("topic metadata of {topic}: {e}"),
        }
    };
    let mut assignment = TopicPartitionList::new();
    for t in metadata.topics().iter().filter(|t| t.name() == topic) {
        for p in t.partitions() {
            assignment
                // Offset 0 rather than Offset::Beginning: test topics are never
                // truncated, and this needs no ListOffsets round trip, whose
                // answers from Tansu 0.6 are not reliable (see consumer_for).
                .add_partition_offset(topic, p.id(), Offset::Offset(0))
                .expect("assign partition");
        }
    }
    consumer.assign(&assignment).expect("assign");
    let deadline = Instant::now() + timeout;
    let mut out = Vec::new();
    // Next offset expected per partition: records before it were read already
    // (re-delivered after an offset reset) and are skipped.
    let mut next: std::collections::HashMap<i32, i64> = std::collections::HashMap::new();
    while out.len() < n.min(until.load(std::sync::atomic::Ordering::SeqCst))
        && Instant::now() < deadline
    {
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let expected = next.entry(m.partition()).or_insert(0);
                if m.offset() < *expected {
                    continue;
                }
                *expected = m.offset() + 1;
                let headers = m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|h| (h.key.to_owned(), h.value.unwrap_or_default().to_vec()))
                            .collect()
                    })
                    .unwrap_or_default();
                out.push(Record {
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(<[u8]>::to_vec),
                    payload: m.payload().map(<[u8]>::to_vec),
                    headers,
                    timestamp_ms: m.timestamp().to_millis(),
                    received_at: Instant::now(),
                });
            }
            // A broker that just restarted (or a connection it dropped) is
            // reported once as a consumption error; librdkafka reconnects by itself,
            // as a real consumer would wait for it. The deadline still applies.
            Some(Err(rdkafka::error::KafkaError::MessageConsumption(
                RDKafkaErrorCode::AllBrokersDown | RDKafkaErrorCode::BrokerTransportFailure,
            ))) => {}
            Some(Err(e)) => panic!("consuming {topic} failed: {e}"),
            None => {}
        }
    }
    out
}

/// Polls `cond` until it returns true or the deadline passes (then panics with `what`).
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    let mut delay = Duration::from_millis(10);
    loop {
        if cond().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_millis(250));
    }
}

/// The relay binary running as a child process, with its log in a file.
#[derive(Debug)]
pub struct RelayProcess {
    child: std::process::Child,
    pub log_path: PathBuf,
}

impl RelayProcess {
    /// Starts `outbox-relay run --config FILE` with extra environment overrides
    /// (`OUTBOX_RELAY__…`).
    pub fn start(config_path: &Path, env_overrides: &[(&str, &str)]) -> RelayProcess {
        Self::start_command(&["run"], config_path, env_overrides)
    }

    /// Starts another long-running command (e.g. `["poll", "--batch-size", "100"]`)
    /// with `--config FILE`, the same way.
    pub fn start_command(
        command: &[&str],
        config_path: &Path,
        env_overrides: &[(&str, &str)],
    ) -> RelayProcess {
        let log_path = config_path.with_extension(format!("{}.log", unique("relay")));
        let log = std::fs::File::create(&log_path).expect("create relay log");
        // OUTBOX_RELAY_TEST_BIN runs another build (e.g. the release binary) for
        // throughput measurements.
        let bin = std::env::var("OUTBOX_RELAY_TEST_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_outbox-relay").to_owned());
        let mut cmd = Command::new(bin);
        cmd.args(command)
            .args(["--config", path_str(config_path)])
            .stdout(std::process::Stdio::null())
            .stderr(log);
        for (k, v) in env_overrides {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn outbox-relay run");
        RelayProcess { child, log_path }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The relay's log so far (for assertion messages).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Sends a signal with the `kill` command (no libc bindings needed).
    fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig} {} failed", self.pid());
    }

    /// SIGTERM, then waits for the exit status (bounded).
    pub async fn terminate(mut self, timeout: Duration) -> std::process::ExitStatus {
        self.signal("-TERM");
        self.wait(timeout).await
    }

    /// SIGKILL (no chance to send a final status), then reaps it.
    pub async fn kill9(mut self) {
        self.signal("-KILL");
        let _ = self.wait(Duration::from_secs(10)).await;
    }

    /// Waits for the process to exit by itself.
    pub async fn wait(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "relay did not exit within {timeout:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Whether it is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if std::thread::panicking() {
            eprintln!(
                "relay log (last 100 lines):\n{}",
                last_lines(&self.log(), 100)
            );
        }
    }
}

/// The last `n` lines of a log, for a failed test's report.
fn last_lines(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Reads the topic until `n` records arrived, failing with the relay's log when
/// the deadline passes first.
pub async fn consume_exactly(
    topic: &str,
    n: usize,
    timeout: Duration,
    relay: &RelayProcess,
) -> Vec<Record> {
    let records = consume(topic, n, timeout).await;
    assert!(
        records.len() >= n,
        "expected {n} records on {topic}, got {} within {timeout:?}; relay log:\n{}",
        records.len(),
        relay.log()
    );
    records
}

/// An outbox payload with `seq` and a blob above a producer's `message.max.bytes =
/// 100000` (the tests that need an event the relay cannot deliver set that limit).
pub fn oversize_payload(seq: i64) -> String {
    format!(r#"{{"seq": {seq}, "blob": "{}"}}"#, "x".repeat(200_000))
}

/// The payload `seq`s of `entity`'s records in offset order, first delivery of
/// each (a deduplicating consumer's view of one key).
pub fn key_sequence(records: &[Record], entity: &str) -> Vec<i64> {
    let mut mine: Vec<&Record> = records
        .iter()
        .filter(|r| r.key.as_deref() == Some(entity.as_bytes()))
        .collect();
    mine.sort_by_key(|r| (r.partition, r.offset));
    let mut seen = std::collections::HashSet::new();
    mine.into_iter()
        .filter(|r| seen.insert(r.header("idempotency_key").map(str::to_owned)))
        .map(|r| {
            let v: serde_json::Value =
                serde_json::from_slice(r.payload.as_deref().unwrap()).unwrap();
            v["seq"].as_i64().unwrap()
        })
        .collect()
}

/// Distinct events (idempotency keys) and duplicates among `records`.
pub fn tally(records: &[Record]) -> (usize, usize) {
    let unique: HashSet<&str> = records
        .iter()
        .filter_map(|r| r.header("idempotency_key"))
        .collect();
    (unique.len(), records.len() - unique.len())
}

/// Per-key order as a deduplicating consumer sees it: in each partition's offset
/// order, considering the first delivery of each event only (a re-delivery after a
/// crash repeats an earlier event; consumers drop it by its idempotency key), the
/// payload's `seq` of every key only grows. Callers that promise exactly-once
/// count duplicates separately.
pub fn assert_per_key_order(records: &[Record]) {
    let mut sorted: Vec<&Record> = records.iter().collect();
    sorted.sort_by_key(|r| (r.partition, r.offset));
    let mut seen = HashSet::new();
    let mut last: HashMap<&[u8], i64> = HashMap::new();
    for r in sorted {
        let key = r
            .header("idempotency_key")
            .expect("an idempotency_key header");
        if !seen.insert(key) {
            continue;
        }
        let payload: serde_json::Value =
            serde_json::from_slice(r.payload.as_deref().expect("a payload")).expect("json");
        let seq = payload["seq"]
            .as_i64()
            .expect("a numeric seq in the payload");
        let entity = r.key.as_deref().expect("a record key");
        if let Some(prev) = last.get(entity) {
            assert!(
                seq > *prev,
                "key {} out of order: seq {seq} after {prev}",
                String::from_utf8_lossy(entity)
            );
        }
        last.insert(entity, seq);
    }
}

/// The slot's `confirmed_flush_lsn` as a number (0 when missing).
pub async fn confirmed_flush(client: &Client, slot: &str) -> u64 {
    let row = client
        .query_opt(
            "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("read pg_replication_slots");
    row.and_then(|r| r.get::<_, Option<i64>>(0))
        .map_or(0, |v| u64::try_from(v).unwrap_or(0))
}

/// Waits (up to 30 s) until the slot's `confirmed_flush_lsn` is past `lsn`, the
/// `source_lsn` of the last event the relay delivered.
pub async fn wait_confirmed_past(db: &TestDb, lsn: u64) {
    let client = &db.client;
    wait_until(
        Duration::from_secs(30),
        "confirmed_flush_lsn past the last event",
        || async { confirmed_flush(client, &db.slot).await > lsn },
    )
    .await;
}

/// Parses a `X/Y` LSN header value.
pub fn parse_lsn(text: &str) -> u64 {
    text.parse::<outbox_relay::Lsn>()
        .unwrap_or_else(|e| panic!("bad LSN {text:?}: {e}"))
        .as_u64()
}

/// A second, private PostgreSQL cluster (e.g. with `wal_level = replica`), made by
/// the same `scripts/dev-env` code path in its own state directory.
#[derive(Debug)]
pub struct PrivateCluster {
    dir: PathBuf,
    pub url: String,
}

impl PrivateCluster {
    pub async fn start(wal_level: &str) -> PrivateCluster {
        let dir = repo_root().join(".dev").join(unique("cluster"));
        let url = dev_env(&dir, &["pg-up"], &[("DEV_ENV_WAL_LEVEL", wal_level)]).await;
        PrivateCluster { dir, url }
    }

    pub fn stop(self) {
        drop(self);
    }

    /// The CA that signed this cluster's server certificate (for `sslrootcert`).
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("pg/tls/ca.crt")
    }

    /// `pg_ctl restart -m <mode>`: `fast` (clean shutdown) or `immediate` (a crash,
    /// recovered from WAL at the start). Same port and data.
    pub async fn restart(&self, mode: &str) {
        dev_env(&self.dir, &["pg-restart", mode], &[]).await;
    }

    /// `scripts/dev-env pg-snapshot NAME`: a copy of the data directory across a
    /// clean stop; the server runs again afterwards.
    pub async fn snapshot(&self, name: &str) {
        dev_env(&self.dir, &["pg-snapshot", name], &[]).await;
    }

    /// `scripts/dev-env pg-restore NAME`: the snapshot put back in place after an
    /// immediate stop (same system identifier and timeline, an older WAL end).
    pub async fn restore(&self, name: &str) {
        dev_env(&self.dir, &["pg-restore", name], &[]).await;
    }

    /// A physical standby of this cluster (`scripts/dev-env pg-standby-of`), in a
    /// state directory of its own, streaming from it.
    pub async fn standby(&self) -> PrivateCluster {
        let dir = repo_root().join(".dev").join(unique("standby"));
        let primary = self.dir.to_string_lossy().into_owned();
        let url = dev_env(&dir, &["pg-standby-of", &primary], &[]).await;
        PrivateCluster { dir, url }
    }

    /// `pg_ctl promote` of this standby: a new timeline begins.
    pub async fn promote(&self) {
        dev_env(&self.dir, &["pg-promote"], &[]).await;
    }

    /// The port this cluster listens on.
    pub fn port(&self) -> u16 {
        self.url
            .rsplit(':')
            .next()
            .and_then(|rest| rest.split('/').next())
            .and_then(|p| p.parse().ok())
            .expect("a port in the cluster's URL")
    }
}

/// `scripts/dev-env ARGS` with `DEV_ENV_DIR=dir` (and `env`), on a blocking thread;
/// fails the test unless it succeeds, and returns what it printed (trimmed).
async fn dev_env(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let dir = dir.to_path_buf();
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let what = args.join(" ");
    let out = tokio::task::spawn_blocking(move || {
        Command::new("bash")
            .arg(repo_root().join("scripts/dev-env"))
            .args(&args)
            .env("DEV_ENV_DIR", &dir)
            .envs(env)
            .output()
            .expect("run scripts/dev-env")
    })
    .await
    .expect("dev-env task");
    assert!(
        out.status.success(),
        "scripts/dev-env {what} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(repo_root().join("scripts/dev-env"))
            .arg("pg-down")
            .env("DEV_ENV_DIR", &self.dir)
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A broker of this test's own (Tansu on SQLite storage, so topics and records
/// survive a restart), for tests that stop and start the broker without disturbing
/// the shared one.
#[derive(Debug)]
pub struct PrivateBroker {
    dir: PathBuf,
    port: u16,
    /// The port the broker names in metadata: its own, or that of a proxy in
    /// front of it (a TLS terminator).
    advertised_port: u16,
    /// `--authentication`: every client must pass SASL (SCRAM) first.
    authentication: bool,
    child: Option<std::process::Child>,
}

/// A free loopback port (bound and released at once).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

impl PrivateBroker {
    pub async fn start() -> PrivateBroker {
        let port = free_port();
        Self::start_advertising(port, port).await
    }

    /// A broker listening on `port` that tells clients to connect to
    /// `advertised_port` (where a proxy in front of it listens).
    pub async fn start_advertising(port: u16, advertised_port: u16) -> PrivateBroker {
        let dir = repo_root().join(".dev").join(unique("broker"));
        std::fs::create_dir_all(&dir).expect("broker dir");
        let mut broker = PrivateBroker {
            dir,
            port,
            advertised_port,
            authentication: false,
            child: None,
        };
        broker.resume().await;
        broker
    }

    /// `host:port` for `bootstrap.servers` (the broker's own listener).
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The broker's directory (its log, its SQLite storage), for files a test
    /// keeps beside it.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Creates a SCRAM user with Tansu's own CLI (`tansu user create`).
    /// `mechanism` is `scram256` or `scram512`. Tansu's CLI cannot authenticate,
    /// so this works only while authentication is off.
    pub fn create_user(&self, name: &str, password: &str, mechanism: &str) {
        assert!(!self.authentication, "create users before requiring them");
        let out = Command::new(Self::tansu_bin())
            .args(["user", "create", "--broker"])
            .arg(format!("tcp://{}", self.brokers()))
            .args([name, password, "--mechanism", mechanism])
            .output()
            .expect("run tansu user create");
        assert!(
            out.status.success(),
            "tansu user create failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Creates a topic with Tansu's own CLI, which talks to this listener
    /// directly (an admin client would follow the advertised address, which may
    /// be a proxy's). Only while authentication is off.
    pub fn create_topic(&self, name: &str, partitions: i32) {
        assert!(
            !self.authentication,
            "create topics before requiring logins"
        );
        let out = Command::new(Self::tansu_bin())
            .args(["topic", "create", "--broker"])
            .arg(format!("tcp://{}", self.brokers()))
            .args(["--partitions", &partitions.to_string(), name])
            .output()
            .expect("run tansu topic create");
        assert!(
            out.status.success(),
            "tansu topic create failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Restarts the broker (same port and storage, so users and topics stay) with
    /// `--authentication`: from then on every client must pass SASL first.
    pub async fn require_authentication(&mut self) {
        self.stop_gracefully();
        self.authentication = true;
        self.resume().await;
    }

    fn tansu_bin() -> PathBuf {
        let out = Command::new("bash")
            .arg(repo_root().join("scripts/dev-env"))
            .arg("tansu-bin")
            .output()
            .expect("run scripts/dev-env tansu-bin");
        assert!(
            out.status.success(),
            "no Tansu binary: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    }

    /// Starts (or restarts) the broker on the same port and storage, and waits
    /// until it answers a metadata request.
    pub async fn resume(&mut self) {
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let advertised = format!("tcp://127.0.0.1:{}", self.advertised_port);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("broker.log"))
            .expect("broker log");
        let mut cmd = Command::new(Self::tansu_bin());
        cmd.current_dir(&self.dir)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &advertised,
            ])
            // Relative: Tansu resolves it against its working directory.
            .args(["--storage-engine", "sqlite://tansu.db"]);
        if self.authentication {
            cmd.arg("--authentication");
        }
        let child = cmd
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn tansu");
        self.child = Some(child);
        let brokers = self.brokers();
        let authentication = self.authentication;
        // Generous: a restart on a loaded machine (the whole suite) can take a while.
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let brokers = brokers.clone();
            let ok = tokio::task::spawn_blocking(move || {
                if authentication {
                    // Metadata needs a login now: an open port must do.
                    let ok = brokers.parse().is_ok_and(|addr| {
                        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500))
                            .is_ok()
                    });
                    if !ok {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    return ok;
                }
                consumer_for(&brokers)
                    .fetch_metadata(None, Duration::from_millis(500))
                    .is_ok()
            })
            .await
            .expect("metadata task");
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "private broker did not start");
        }
    }

    /// Stops the broker with SIGTERM (a clean stop, which on SQLite storage has been
    /// seen to lose the idempotent producers' state, after which a producer that
    /// bumps its epoch makes Tansu's storage panic) and waits for it to exit.
    pub fn stop_gracefully(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the broker (SIGKILL: an outage, not a goodbye).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        self.stop();
        if std::thread::panicking() {
            // The broker's side of a failed test: its log goes with its directory.
            let log = std::fs::read_to_string(self.dir.join("broker.log")).unwrap_or_default();
            eprintln!(
                "private broker log (last 200 lines):\n{}",
                last_lines(&log, 200)
            );
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Reads `topic` again from its start for `extra` (late duplicates count too), and
/// at least as far as `earlier`, a read of the same topic, got on each partition.
/// A partition's log only grows, so a re-read that ends short of it is the shared
/// broker being slow under the suite's load, not a loss: it is read again, for up to
/// a minute, and then returned as it is for the caller's assertions.
pub async fn reread(topic: &str, earlier: &[Record], extra: Duration) -> Vec<Record> {
    fn reached(records: &[Record]) -> HashMap<i32, i64> {
        let mut ends = HashMap::new();
        for r in records {
            let end = ends.entry(r.partition).or_insert(r.offset);
            *end = (*end).max(r.offset);
        }
        ends
    }
    let want = reached(earlier);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let records = consume(topic, usize::MAX, extra).await;
        let got = reached(&records);
        let covers = want
            .iter()
            .all(|(p, end)| got.get(p).is_some_and(|g| g >= end));
        if covers || Instant::now() >= deadline {
            return records;
        }
        eprintln!("a re-read of {topic} ended short of an earlier read; reading again");
    }
}

/// Reads the topic until `n` distinct idempotency keys arrived (duplicates do not
/// count), failing with the relay's log at the deadline. Returns every record read.
pub async fn consume_unique(
    topic: &str,
    n: usize,
    timeout: Duration,
    relay: &RelayProcess,
) -> Vec<Record> {
    let deadline = Instant::now() + timeout;
    loop {
        let records = consume(topic, usize::MAX, Duration::from_secs(2)).await;
        let unique: std::collections::HashSet<&str> = records
            .iter()
            .filter_map(|r| r.header("idempotency_key"))
            .collect();
        if unique.len() >= n {
            return records;
        }
        assert!(
            Instant::now() < deadline,
            "expected {n} distinct events on {topic}, got {} ({} records) within {timeout:?}; relay log:\n{}",
            unique.len(),
            records.len(),
            relay.log()
        );
    }
}

/// How many times each idempotency key was delivered.
pub fn deliveries(records: &[Record]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for r in records {
        *counts
            .entry(r.header("idempotency_key").unwrap().to_owned())
            .or_default() += 1;
    }
    counts
}

/// `outbox-relay audit --json`, parsed.
/// `outbox-relay audit --json` for this test's config.
pub fn audit(db: &TestDb) -> serde_json::Value {
    let config = db.config_path.to_str().unwrap();
    let out = run_cli(&["audit", "--json", "--config", config]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| {
        panic!(
            "audit --json printed no JSON ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The relay's library entry point (`outbox_relay::cdc::run`) on a task of this
/// process: for tests whose broker is librdkafka's mock cluster, which lives in
/// the test process.
pub struct InProcessRelay {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<outbox_relay::Result<outbox_relay::cdc::RunSummary>>,
}

impl InProcessRelay {
    /// Starts the relay with `config` and waits (30 s at most) until it streams
    /// from `db`'s slot.
    pub async fn start(db: &TestDb, config: Config) -> InProcessRelay {
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(outbox_relay::cdc::run(
            config,
            Box::pin(async move {
                let _ = stopped.await;
            }),
        ));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !db
            .client
            .query_one(
                "SELECT count(*) > 0 FROM pg_replication_slots
                 WHERE slot_name = $1 AND active_pid IS NOT NULL",
                &[&db.slot],
            )
            .await
            .is_ok_and(|r| r.get::<_, bool>(0))
        {
            assert!(
                !task.is_finished() && Instant::now() < deadline,
                "the relay did not stream"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        InProcessRelay { stop, task }
    }

    /// Whether the relay returned (it should not before [`InProcessRelay::stop`]).
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Shuts the relay down as SIGTERM would and returns its summary.
    pub async fn stop(self) -> outbox_relay::cdc::RunSummary {
        let _ = self.stop.send(());
        self.task.await.expect("relay task").expect("relay result")
    }
}

/// `outbox-relay dev-broker` (the in-memory broker with transactions) as a child
/// process on a free port, with its fault-injection control listener on another
/// ([`DevBroker::control`]).
pub struct DevBroker {
    child: Child,
    pub address: String,
    /// The control listener (`--control`): one text command a line.
    pub control_address: String,
    log_path: std::path::PathBuf,
    _stdout: BufReader<ChildStdout>,
}

impl DevBroker {
    pub fn start() -> DevBroker {
        Self::start_with(&[])
    }

    /// [`DevBroker::start`] with more `dev-broker` flags (`--auto-create-topics
    /// false`, …).
    pub fn start_with(extra: &[&str]) -> DevBroker {
        let log_path = std::env::temp_dir().join(format!("{}.log", unique("dev_broker")));
        let log = std::fs::File::create(&log_path).expect("create the broker log");
        let mut child = Command::new(env!("CARGO_BIN_EXE_outbox-relay"))
            .args([
                "dev-broker",
                "--listen",
                "127.0.0.1:0",
                "--partitions",
                "1",
                "--control",
                "127.0.0.1:0",
            ])
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("spawn outbox-relay dev-broker");
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut next_line = |prefix: &str| {
            let mut line = String::new();
            stdout.read_line(&mut line).expect("read a line of stdout");
            line.trim()
                .strip_prefix(prefix)
                .unwrap_or_else(|| {
                    panic!(
                        "expected `{prefix}<host:port>`, got {line:?}; log:\n{}",
                        std::fs::read_to_string(&log_path).unwrap_or_default()
                    )
                })
                .to_owned()
        };
        let address = next_line("listening on ");
        let control_address = next_line("control on ");
        DevBroker {
            child,
            address,
            control_address,
            log_path,
            _stdout: stdout,
        }
    }

    /// Sends one command to the control listener (`fail-produce t 0
    /// NOT_LEADER_OR_FOLLOWER`, `stall 500`, `reset`, ...) and returns its reply
    /// line; panics, with the broker's log, on an `error` reply.
    pub async fn control(&self, command: &str) -> String {
        use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
        let stream = tokio::net::TcpStream::connect(&self.control_address)
            .await
            .unwrap_or_else(|e| panic!("connect to {}: {e}", self.control_address));
        let (read, mut write) = stream.into_split();
        write
            .write_all(format!("{command}\n").as_bytes())
            .await
            .expect("send the control command");
        let mut reply = String::new();
        tokio::io::BufReader::new(read)
            .read_line(&mut reply)
            .await
            .expect("read the control reply");
        let reply = reply.trim().to_owned();
        assert!(
            !reply.is_empty() && !reply.starts_with("error"),
            "control {command:?} answered {reply:?}; log:\n{}",
            self.log()
        );
        reply
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Sends a signal to the broker process (`-STOP` pauses it as a stalled broker,
    /// `-CONT` resumes it).
    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill {sig} of the dev broker failed");
    }

    pub fn config(&self) -> ClientConfig {
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &self.address)
            .set("broker.address.family", "v4");
        c
    }
}

impl Drop for DevBroker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads `topic` until every key of `expected` arrived (90 s at most).
pub async fn read_all(topic: &str, expected: &HashSet<&str>, relay: &RelayProcess) -> Vec<Record> {
    let (records, missing) = read_keys(topic, expected).await;
    assert_eq!(
        missing,
        0,
        "events missing from {topic}; relay log:\n{}",
        relay.log()
    );
    records
}

/// Reads `topic` until every key of `expected` arrived or 90 s passed; returns the
/// last read and how many keys it lacks, for the caller to assert on.
pub async fn read_keys(topic: &str, expected: &HashSet<&str>) -> (Vec<Record>, usize) {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    let mut want = expected.len();
    loop {
        let records = consume(topic, want, Duration::from_secs(20)).await;
        let seen: HashSet<&str> = records
            .iter()
            .filter_map(|r| r.header("idempotency_key"))
            .collect();
        let missing = expected.iter().filter(|k| !seen.contains(*k)).count();
        if missing == 0 || std::time::Instant::now() >= deadline {
            return (records, missing);
        }
        // Duplicates take places: ask for as many more records as are missing.
        want = records.len() + missing;
    }
}

/// What a test's writer committed and rolled back (idempotency keys).
#[derive(Debug, Default)]
pub struct Written {
    pub committed: Vec<String>,
    pub rolled_back: Vec<String>,
}

impl Written {
    /// Ends `tx` (rolled back when `rollback`) and records its `keys` as such.
    pub async fn end(
        &mut self,
        tx: tokio_postgres::Transaction<'_>,
        rollback: bool,
        keys: Vec<String>,
    ) {
        if rollback {
            tx.rollback().await.unwrap();
            self.rolled_back.extend(keys);
        } else {
            tx.commit().await.unwrap();
            self.committed.extend(keys);
        }
    }
}
