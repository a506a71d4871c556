//! `outbox-relay demo`: the whole product in one command on a fresh machine.
//!
//! It starts a throwaway PostgreSQL with `wal_level = logical` through the same
//! script the test environment uses (`scripts/dev-env`, embedded in the binary), an
//! embedded Kafka-protocol broker (librdkafka's mock cluster, which speaks the Kafka
//! protocol on a loopback port) unless `--brokers` names a real one, applies the
//! migrations, writes sample events from a few concurrent writers, relays them with
//! the real `run` code path, audits the topic against the outbox, prints a summary
//! and cleans up.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rdkafka::error::KafkaError;
use rdkafka::mocking::MockCluster;

use crate::config::{Config, redact_url};
use crate::lsn::Lsn;
use crate::ops::meter::Meter;
use crate::postgres::prerequisite::Prerequisite;
use crate::tools::workload::{Keys, Workload, WorkloadError, Writers};

/// The dev-env script, so the demo works from an installed binary too.
const DEV_ENV_SCRIPT: &str = include_str!("../../scripts/dev-env");
const TOPIC: &str = "outbox.event.order";
const SLOT: &str = "outbox_relay_demo";
/// Entities each writer owns: an entity's events come from one writer, in order.
const ENTITIES_PER_WRITER: u32 = 100;

/// Why the demo failed. A relay error keeps its own exit code
/// ([`DemoError::exit_code`]); the demo's own failures exit with 1.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DemoError {
    /// The relay, PostgreSQL or the broker failed, with the relay's own error.
    #[error(transparent)]
    Relay(crate::Error),
    #[error("cannot start the embedded broker: {0}")]
    EmbeddedBroker(#[source] KafkaError),
    #[error("cannot create the demo topic: {0}")]
    DemoTopic(#[source] KafkaError),
    #[error("relay task failed: {0}")]
    RelayTask(#[source] tokio::task::JoinError),
    #[error("the relay did not start streaming within 60 s")]
    NotStreaming,
    #[error("bad LSN from the server: {0}")]
    BadLsn(#[source] crate::lsn::ParseLsnError),
    #[error("the relay stopped before relaying every event")]
    RelayStopped,
    #[error("events not relayed within 10 minutes")]
    NotRelayed,
    #[error("writer task failed: {0}")]
    WriterTask(#[source] tokio::task::JoinError),
}

impl DemoError {
    /// The exit code (`docs/architecture.md#exit-codes`): a wrapped relay error's
    /// own, 1 for the demo's own failures.
    #[must_use]
    pub fn exit_code(&self) -> std::process::ExitCode {
        match self {
            DemoError::Relay(e) => e.exit_code(),
            _ => std::process::ExitCode::from(1),
        }
    }
}

impl<E: Into<crate::Error>> From<E> for DemoError {
    fn from(e: E) -> DemoError {
        DemoError::Relay(e.into())
    }
}

impl From<WorkloadError> for DemoError {
    fn from(e: WorkloadError) -> DemoError {
        match e {
            WorkloadError::Relay(e) => DemoError::Relay(e),
            WorkloadError::Task(e) => DemoError::WriterTask(e),
        }
    }
}

type Result<T, E = DemoError> = std::result::Result<T, E>;

/// Flags of `outbox-relay demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// Events to write.
    #[arg(long, default_value_t = 20_000)]
    pub events: usize,
    /// Concurrent writers.
    #[arg(long, default_value_t = 4)]
    pub writers: usize,
    /// Outbox rows per transaction.
    #[arg(long, default_value_t = 10)]
    pub rows_per_tx: usize,
    /// Use this broker (`host:port`) instead of the embedded one. The topic
    /// `outbox.event.order` is created if missing.
    #[arg(long)]
    pub brokers: Option<String>,
    /// Keep the throwaway PostgreSQL running and print its URL.
    #[arg(long)]
    pub keep: bool,
}

/// What the demo measured.
#[derive(Debug, Clone, PartialEq)]
pub struct DemoSummary {
    pub events: usize,
    pub elapsed: Duration,
    pub events_per_s: f64,
    pub lag_bytes: Option<i64>,
    pub audit: crate::ops::audit::AuditReport,
}

/// A throwaway cluster started with the embedded dev-env script; stopped on drop.
struct DemoCluster {
    dir: PathBuf,
    script: PathBuf,
    url: String,
    keep: bool,
}

impl DemoCluster {
    async fn start(keep: bool) -> Result<DemoCluster> {
        let dir = std::env::temp_dir().join(format!("outbox-relay-demo-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let script = dir.join("dev-env");
        std::fs::write(&script, DEV_ENV_SCRIPT)?;
        let out = tokio::process::Command::new("bash")
            .arg(&script)
            .arg("pg-up")
            .env("DEV_ENV_DIR", &dir)
            .output()
            .await?;
        if !out.status.success() {
            return Err(Prerequisite::NoLocalServer {
                reason: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            }
            .into());
        }
        let url = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        Ok(DemoCluster {
            dir,
            script,
            url,
            keep,
        })
    }
}

impl Drop for DemoCluster {
    fn drop(&mut self) {
        if self.keep {
            return;
        }
        let _ = std::process::Command::new("bash")
            .arg(&self.script)
            .arg("pg-down")
            .env("DEV_ENV_DIR", &self.dir)
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn demo_config(url: &str, brokers: &str) -> Result<Config> {
    let text = format!(
        "[postgres]\nurl = \"{url}\"\nslot = \"{SLOT}\"\n\n[kafka]\nbrokers = \"{brokers}\"\n\n[log]\nlevel = \"warn\"\n"
    );
    Ok(Config::from_sources("demo", &text, Vec::new())?)
}

/// Runs the demo and prints its summary.
pub async fn run(args: &DemoArgs) -> Result<DemoSummary> {
    if args.events == 0 || args.writers == 0 || args.rows_per_tx == 0 {
        return Err(crate::config::ConfigError::Invalid(
            "--events, --writers and --rows-per-tx must be positive".into(),
        )
        .into());
    }
    eprintln!("demo: starting a throwaway PostgreSQL (wal_level=logical)…");
    let cluster = DemoCluster::start(args.keep).await?;
    let mock;
    let brokers = match &args.brokers {
        Some(brokers) => {
            crate::kafka::create_topic(brokers, TOPIC, 6).await?;
            brokers.clone()
        }
        None => {
            mock = MockCluster::new(1).map_err(DemoError::EmbeddedBroker)?;
            mock.create_topic(TOPIC, 6, 1)
                .map_err(DemoError::DemoTopic)?;
            mock.bootstrap_servers()
        }
    };
    eprintln!(
        "demo: PostgreSQL at {}, broker at {brokers}",
        redact_url(&cluster.url)
    );
    let config = demo_config(&cluster.url, &brokers)?;
    let mut client = crate::postgres::connect(&config.postgres.url).await?;
    crate::ops::migrate::apply(&mut client, &config).await?;

    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let relay_config = config.clone();
    let relay = tokio::spawn(async move {
        Box::pin(crate::cdc::session::run(
            relay_config,
            Box::pin(async move {
                let _ = stop_rx.await;
            }),
        ))
        .await
    });
    wait_for_slot(&client).await?;

    eprintln!(
        "demo: {} writers inserting {} events ({} per transaction)…",
        args.writers, args.events, args.rows_per_tx
    );
    let started = Instant::now();
    let begin = current_lsn(&client).await?;
    write_events(&config.postgres.url, args).await?;
    let end = current_lsn(&client).await?;
    wait_confirmed(&client, (begin, started), end, &relay).await?;
    let elapsed = started.elapsed();
    let status = crate::ops::status::read(&client, &client, &config).await?;
    let _ = stop_tx.send(());
    match relay.await {
        Ok(result) => {
            result?;
        }
        Err(e) => return Err(DemoError::RelayTask(e)),
    }

    eprintln!("demo: auditing the topic against the outbox…");
    let audit = crate::ops::audit::run(&config, &crate::ops::audit::AuditArgs::default()).await?;
    let events = u64::try_from(args.events).unwrap_or(u64::MAX);
    let events_per_s = crate::tools::bench::stats::rate(events, elapsed);
    let summary = DemoSummary {
        events: args.events,
        elapsed,
        events_per_s,
        lag_bytes: status.lag_bytes,
        audit,
    };
    if args.keep {
        eprintln!(
            "demo: PostgreSQL kept running at {}",
            redact_url(&cluster.url)
        );
    }
    drop(cluster);
    Ok(summary)
}

impl DemoSummary {
    /// The lines the demo prints.
    #[must_use]
    pub fn render(&self) -> String {
        format!(
            "events relayed   {}\nelapsed          {:.2?} (first write to slot confirmed)\n\
             throughput       {:.0} events/s\nslot lag         {} bytes\n\n{}",
            self.events,
            self.elapsed,
            self.events_per_s,
            self.lag_bytes.map_or_else(|| "-".into(), |b| b.to_string()),
            self.audit.render_table()
        )
    }
}

/// Waits until the relay holds the slot *and* the slot has its consistent point.
/// While CREATE_REPLICATION_SLOT still searches for that point the slot is already
/// listed as active but `confirmed_flush_lsn` is NULL, and a transaction committed
/// then is before the slot's start: it would never be decoded.
async fn wait_for_slot(client: &tokio_postgres::Client) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let active: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_replication_slots
                 WHERE slot_name = $1 AND active AND confirmed_flush_lsn IS NOT NULL",
                &[&SLOT],
            )
            .await?
            .get(0);
        if active == 1 {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(DemoError::NotStreaming);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn current_lsn(client: &tokio_postgres::Client) -> Result<Lsn> {
    let lsn: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await?
        .get(0);
    lsn.parse().map_err(DemoError::BadLsn)
}

/// Waits until the slot is confirmed at `end`, showing the WAL relayed since
/// `begin` (written from `started` on) as progress.
async fn wait_confirmed(
    client: &tokio_postgres::Client,
    (begin, started): (Lsn, Instant),
    end: Lsn,
    relay: &tokio::task::JoinHandle<crate::Result<crate::cdc::session::RunSummary>>,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(600);
    let total = end.as_u64().saturating_sub(begin.as_u64());
    let mut meter = Meter::new("demo", "WAL bytes relayed", total, true).started_at(started);
    let mut shown = begin;
    loop {
        let confirmed: Option<String> = client
            .query_one(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&SLOT],
            )
            .await?
            .get(0);
        let confirmed: Lsn = confirmed.and_then(|c| c.parse().ok()).unwrap_or(Lsn::ZERO);
        let now_at = confirmed.min(end);
        if now_at > shown {
            meter.inc(now_at.as_u64() - shown.as_u64());
            shown = now_at;
        }
        if confirmed >= end {
            meter.finish();
            return Ok(());
        }
        if relay.is_finished() {
            return Err(DemoError::RelayStopped);
        }
        if Instant::now() > deadline {
            return Err(DemoError::NotRelayed);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Concurrent writers; each owns a set of entities, so per-entity commit order is
/// the order each writer inserts them in.
async fn write_events(url: &str, args: &DemoArgs) -> Result<()> {
    let workload = Workload {
        events: u64::try_from(args.events).unwrap_or(u64::MAX),
        payload_bytes: 0,
        rows_per_tx: u32::try_from(args.rows_per_tx).unwrap_or(u32::MAX),
        writers: u32::try_from(args.writers).unwrap_or(u32::MAX),
        entities: ENTITIES_PER_WRITER,
    };
    Writers::new(url, "outbox", workload)
        .keys(Keys::PerWriter)
        .run()
        .await?;
    Ok(())
}
