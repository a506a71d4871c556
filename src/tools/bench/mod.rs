//! `outbox-relay bench`: the CDC relay side by side with the polling relay and
//! with the two ceilings it can never beat, on the same workload in the same run.
//!
//! # Why this shape
//!
//! A throughput figure alone says little: 30,000 events/s is excellent if
//! PostgreSQL's own walsender decodes 35,000/s on that machine, and poor if it
//! decodes 300,000/s. So every run measures, on identical backlogs:
//!
//! * the **PostgreSQL ceiling** — `pg_recvlogical` draining the slot into
//!   `/dev/null`, and our own replication client, decoder, mapper and ack tracker
//!   with a sink that acknowledges at once (the relay minus Kafka);
//! * the **broker ceiling** — our producer, with the relay's settings and window,
//!   sending records of the same size with no database (the relay minus PostgreSQL);
//! * **cdc** — the real `outbox-relay run` binary, as deployed;
//! * **poll** — the real `outbox-relay poll`, at batch 100 and 1,000 with 1 and 4
//!   workers; the best of them is the baseline the CDC relay is compared with.
//!
//! The backlog workload pre-inserts N events (slot created first, so they are all
//! in its stream), then times each mode from its start until the last event is
//! acknowledged by the broker: for the CDC relay, until the slot's confirmed LSN
//! passes a position inside a marker transaction committed after the workload
//! (the relay confirms only acked transactions); for the poller, until no row is
//! unsent (it marks only acked rows). Both are then checked by counting the
//! records on the topic.
//!
//! The steady workload writes at a fixed rate (25/50/80% of the CDC maximum just
//! measured) from open-loop writers and reports the latency from the row's
//! `created_at` (the record's CreateTime) to the moment a consumer reads it.
//!
//! Each figure is measured `--repeat` times, modes interleaved within a repeat so
//! that machine noise spreads over all of them, and shown as median with min–max.
//! Everything a run creates (tables, publication, slot, topic) has a unique name
//! and is dropped afterwards, so the benchmark can run against a shared database.
//!
//! Costs besides speed: CPU seconds per million events and peak RSS of the process
//! doing the work (from `/proc`, see [`usage`]), WAL bytes per event written by the
//! application's inserts and by the drain itself (the poller's `UPDATE`s), and the
//! poller's dead tuples and table growth.

pub mod drain;
pub mod fixture;
mod plot;
pub mod report;
pub mod stats;
pub mod steady;
pub mod usage;

use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};

use self::drain::{Drained, Mode, Target};
use self::fixture::Fixture;
use self::report::{Report, Sample, WorkloadInfo};
use crate::config::Config;
use crate::error::Result;

/// Entities (Kafka keys) the workload spreads its events over.
pub const ENTITIES: u32 = 1000;

/// Poller settings compared (batch size, workers).
pub const POLL_VARIANTS: [(u32, u32); 4] = [(100, 1), (100, 4), (1000, 1), (1000, 4)];

/// Errors of the benchmark itself (database and broker errors keep their own types).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    #[error("benchmark setup: {0}")]
    Setup(String),
    #[error("cannot start {0}: {1}")]
    Spawn(String, String),
    #[error("{what} failed: {message}")]
    Child { what: String, message: String },
    #[error("{0} is needed for this mode but was not found")]
    Missing(String),
    #[error("benchmark task failed: {0}")]
    Task(String),
    #[error("{mode}: {found} of {expected} events on the topic")]
    Undelivered {
        mode: String,
        found: u64,
        expected: u64,
    },
    #[error("cannot write {path}: {message}")]
    Output { path: String, message: String },
    #[error("interrupted (the run's slot, tables and topic were dropped)")]
    Interrupted,
}

/// Mode groups of `--modes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeGroup {
    /// `pg_recvlogical` and our replication client with a null sink.
    PgCeiling,
    /// Our producer alone, no database.
    BrokerCeiling,
    /// The real `outbox-relay run`.
    Cdc,
    /// The real `outbox-relay poll`, four settings.
    Poll,
}

/// Which workloads to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    /// Pre-inserted backlog, drained as fast as possible.
    Backlog,
    /// Fixed-rate writers; latency from commit to delivery.
    Steady,
    /// Both.
    All,
}

/// Flags of `outbox-relay bench` (besides `--config`).
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Events per run.
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub events: u64,
    /// Approximate payload size (jsonb text) of each event.
    #[arg(long, default_value_t = 300)]
    pub payload_bytes: usize,
    /// Outbox rows per writer transaction.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub rows_per_tx: u32,
    /// Concurrent writer connections.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub writers: u32,
    /// Modes to compare.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "pg-ceiling,broker-ceiling,cdc,poll"
    )]
    pub modes: Vec<ModeGroup>,
    /// Workload.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Backlog)]
    pub workload: WorkloadKind,
    /// Measurements of each figure (median and min–max are shown).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
    /// Seconds each steady-rate run writes.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub steady_secs: u64,
    /// Print one JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG bar chart of the results to this file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

/// The workload of every run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    pub events: u64,
    pub payload_bytes: usize,
    pub rows_per_tx: u32,
    pub writers: u32,
    pub entities: u32,
}

impl BenchArgs {
    fn workload(&self) -> Workload {
        Workload {
            events: self.events,
            payload_bytes: self.payload_bytes,
            rows_per_tx: self.rows_per_tx,
            writers: self.writers,
            entities: ENTITIES,
        }
    }

    /// The modes of the selected groups, in a fixed order.
    fn modes(&self) -> Vec<Mode> {
        let mut modes = Vec::new();
        let has = |g| self.modes.contains(&g);
        if has(ModeGroup::PgCeiling) {
            modes.extend([Mode::RecvLogical, Mode::Ours]);
        }
        if has(ModeGroup::BrokerCeiling) {
            modes.push(Mode::BrokerCeiling);
        }
        if has(ModeGroup::Cdc) {
            modes.push(Mode::Cdc);
        }
        if has(ModeGroup::Poll) {
            modes.extend(
                POLL_VARIANTS
                    .iter()
                    .map(|&(batch, workers)| Mode::Poll { batch, workers }),
            );
        }
        modes
    }
}

/// Progress on stderr: a bar on a terminal, plain lines otherwise.
#[derive(Debug)]
pub struct Progress {
    bar: Option<ProgressBar>,
}

impl Progress {
    fn new(total: u64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::new(total);
            if let Ok(style) =
                ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")
            {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.enable_steady_tick(Duration::from_millis(200));
            bar
        });
        Progress { bar }
    }

    /// Announces the next step.
    pub fn step(&self, message: String) {
        match &self.bar {
            Some(bar) => bar.set_message(message),
            None => eprintln!("bench: {message}"),
        }
    }

    /// One run is done.
    pub fn done(&self, message: &str) {
        match &self.bar {
            Some(bar) => {
                bar.inc(1);
                bar.println(format!("bench: {message}"));
            }
            None => eprintln!("bench: {message}"),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// Runs the benchmark and returns its report (printing is the caller's).
pub async fn run(config: &Config, args: &BenchArgs) -> Result<Report> {
    let workload = args.workload();
    let modes = args.modes();
    if modes.is_empty() {
        return Err(BenchError::Setup("--modes selects nothing".into()).into());
    }
    let steady = matches!(args.workload, WorkloadKind::Steady | WorkloadKind::All);
    let backlog = matches!(args.workload, WorkloadKind::Backlog | WorkloadKind::All);
    let steady_modes = steady::modes(&modes);
    let backlog_modes: Vec<Mode> = if backlog {
        modes.clone()
    } else {
        // The steady rates are fractions of the CDC maximum: measure it first.
        vec![Mode::Cdc]
    };
    let backlog_runs = u64::from(args.repeat) * backlog_modes.len() as u64;
    let steady_runs = if steady {
        u64::from(args.repeat) * (steady_modes.len() * steady::FRACTIONS.len()) as u64
    } else {
        0
    };
    let progress = Progress::new(backlog_runs + steady_runs);
    let mut samples: Vec<(Mode, Sample)> = Vec::new();
    for repeat in 1..=args.repeat {
        for &mode in &backlog_modes {
            progress.step(format!(
                "{} backlog, run {repeat}/{}",
                mode.label(),
                args.repeat
            ));
            let sample = backlog_run(config, mode, &workload, &progress).await?;
            progress.done(&format!(
                "{} run {repeat}: {:.0} events/s",
                mode.label(),
                sample.events_per_s
            ));
            samples.push((mode, sample));
        }
    }
    let mut report = Report::new(
        WorkloadInfo::new(args, &workload, &samples),
        &backlog_modes,
        &samples,
    );
    if steady {
        let cdc_max = report
            .result("cdc")
            .map(|r| r.events_per_s.median)
            .ok_or_else(|| {
                BenchError::Setup("no CDC maximum to derive the steady rates from".into())
            })?;
        report.steady =
            steady::run(config, &workload, &steady_modes, cdc_max, args, &progress).await?;
        report.attach_latencies();
    }
    progress.finish();
    Ok(report)
}

/// One measured drain of a fresh backlog.
async fn backlog_run(
    config: &Config,
    mode: Mode,
    workload: &Workload,
    progress: &Progress,
) -> Result<Sample> {
    let fixture = Fixture::create(config).await?;
    let result = until_interrupted(backlog_in(&fixture, mode, workload, progress)).await;
    fixture.cleanup().await;
    result
}

/// Runs `work` unless Ctrl-C comes first, so that the caller can still drop the
/// run's slot (a forgotten slot pins WAL). Child processes die with the dropped
/// future (`kill_on_drop`).
pub(crate) async fn until_interrupted<T>(
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::select! {
        result = work => result,
        _ = tokio::signal::ctrl_c() => Err(BenchError::Interrupted.into()),
    }
}

async fn backlog_in(
    fixture: &Fixture,
    mode: Mode,
    workload: &Workload,
    progress: &Progress,
) -> Result<Sample> {
    if mode.reads_wal() {
        fixture.create_slot().await?;
    }
    let fill = if mode == Mode::BrokerCeiling {
        None
    } else {
        progress.step(format!(
            "{}: writing {} events",
            mode.label(),
            workload.events
        ));
        Some(fixture.fill(workload).await?)
    };
    let end_lsn = fixture.end_marker().await?;
    let table_before = fixture.table_stats().await?;
    let target = Target {
        events: workload.events,
        end_lsn,
        payload_bytes: fill.map_or(workload.payload_bytes, |f| {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let avg = f.avg_payload_bytes.round() as usize;
            avg
        }),
    };
    progress.step(format!("{}: draining", mode.label()));
    let drained: Drained = drain::drain(mode, fixture, target).await?;
    let wal_after = fixture.wal_lsn().await?;
    let on_topic = if mode.delivers() {
        progress.step(format!("{}: counting the topic", mode.label()));
        let found =
            drain::count_on_topic(&fixture.config, workload.events, Duration::from_secs(10))
                .await?;
        if found < workload.events {
            return Err(BenchError::Undelivered {
                mode: mode.label(),
                found,
                expected: workload.events,
            }
            .into());
        }
        Some(found)
    } else {
        None
    };
    let table_after = if matches!(mode, Mode::Poll { .. }) {
        Some(settled_table_stats(fixture, workload.events).await?)
    } else {
        None
    };
    let _ = on_topic;
    Ok(sample_of(
        workload.events,
        &drained,
        fill.as_ref(),
        wal_after.0.saturating_sub(end_lsn.0),
        table_before,
        table_after,
    ))
}

/// The figures of one drain.
fn sample_of(
    events: u64,
    drained: &Drained,
    fill: Option<&fixture::Fill>,
    drain_wal_bytes: u64,
    table_before: fixture::TableStats,
    table_after: Option<fixture::TableStats>,
) -> Sample {
    #[allow(clippy::cast_precision_loss)]
    let (n, drain_wal) = (events.max(1) as f64, drain_wal_bytes as f64);
    #[allow(clippy::cast_precision_loss)]
    Sample {
        events_per_s: stats::rate(events, drained.elapsed),
        cpu_s_per_1m: drained.usage.map(|u| u.cpu.as_secs_f64() * 1e6 / n),
        rss_mib: drained.usage.map(|u| u.peak_rss_kib as f64 / 1024.0),
        insert_wal_bytes_per_event: fill.map(|f| f.wal_bytes_per_event),
        insert_events_per_s: fill.map(|f| stats::rate(f.events, f.elapsed)),
        avg_payload_bytes: fill.map(|f| f.avg_payload_bytes),
        drain_wal_bytes_per_event: fill.map(|_| drain_wal / n),
        dead_tuples: table_after.map(|t| t.dead_tuples),
        table_growth_bytes: table_after.map(|t| t.total_bytes - table_before.total_bytes),
    }
}

/// The table's statistics once the poller's updates are all counted (statistics
/// reach `pg_stat_user_tables` shortly after the backend reports them).
async fn settled_table_stats(fixture: &Fixture, events: u64) -> Result<fixture::TableStats> {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let stats = fixture.table_stats().await?;
        let all = u64::try_from(stats.updated).unwrap_or(0) >= events;
        if all || std::time::Instant::now() > deadline {
            return Ok(stats);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
