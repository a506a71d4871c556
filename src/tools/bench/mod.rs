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
//! The steady workload writes at fixed absolute rates (`--rates`, and the writers'
//! own maximum) from open-loop writers and reports the latency from the row's
//! `created_at` (the record's CreateTime) to the moment a consumer reads it, and
//! for the CDC relay the time spent in each of its stages (see `steady`). A point
//! that fails is reported with its reason and the run goes on.
//!
//! Each figure is measured `--repeat` times, modes interleaved within a repeat so
//! that machine noise spreads over all of them, and shown as median with min–max.
//! Everything a run creates (tables, publication, slot, topic) has a unique name
//! and is dropped afterwards, so the benchmark can run against a shared database.
//!
//! Costs besides speed: CPU seconds per million events and peak RSS of the process
//! doing the work (from `/proc`, see `usage`), WAL bytes per event written by the
//! application's inserts and by the drain itself (the poller's `UPDATE`s), and the
//! poller's dead tuples and table growth.

mod args;
mod drain;
mod error;
mod fixture;
mod otlp_sink;
mod plot;
mod processes;
mod progress;
pub mod report;
mod scrape;
pub mod stats;
mod steady;
mod steady_report;
mod usage;

pub use self::args::{BenchArgs, ModeGroup, Rate, WorkloadKind};
pub use self::error::BenchError;

use std::time::Duration;

use self::drain::{Drained, Mode, Target};
use self::error::Result;
use self::fixture::Fixture;
use self::progress::{Progress, until_interrupted};
use self::report::{Report, Sample, WorkloadInfo};
use crate::config::Config;
use crate::tools::workload::Workload;

/// Runs the benchmark and returns its report (printing is the caller's).
pub async fn run(config: &Config, args: &BenchArgs) -> Result<Report> {
    // `--shards`: every run's config is sharded; `cdc` then runs one relay per shard.
    let mut sharded = config.clone();
    sharded.postgres.shards = args.shards;
    sharded.postgres.shard = 0;
    let config = &sharded;
    let workload = args.workload();
    let modes = args.modes();
    if modes.is_empty() {
        return Err(BenchError::NoModes);
    }
    let steady = matches!(args.workload, WorkloadKind::Steady | WorkloadKind::All);
    let backlog = matches!(args.workload, WorkloadKind::Backlog | WorkloadKind::All);
    let steady_modes = steady::modes(&modes, args.standby_url.is_some());
    let backlog_modes: Vec<Mode> = if backlog { modes.clone() } else { Vec::new() };
    let backlog_runs = u64::from(args.repeat) * backlog_modes.len() as u64;
    let steady_runs = if steady {
        let calibration = u64::from(args.rates.contains(&Rate::WritersMax));
        u64::from(args.repeat) * (steady_modes.len() * args.rates.len()) as u64 + calibration
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
        report.steady = Box::pin(steady::run(
            config,
            &workload,
            &steady_modes,
            args,
            &progress,
        ))
        .await?;
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

async fn backlog_in(
    fixture: &Fixture,
    mode: Mode,
    workload: &Workload,
    progress: &Progress,
) -> Result<Sample> {
    if mode.reads_wal() {
        fixture.create_slot().await?;
    }
    // Before the writers: the growth reported is what the events left behind
    // (rows, or the message ledger), plus what draining did to it (the poller's
    // updates).
    let table_empty = fixture.table_stats().await?;
    let fill = if mode == Mode::BrokerCeiling {
        None
    } else {
        progress.step(format!(
            "{}: writing {} events",
            mode.label(),
            workload.events
        ));
        Some(fixture.fill(workload, mode.writes()).await?)
    };
    let end_lsn = fixture.end_marker().await?;
    let target = Target {
        events: workload.events,
        end_lsn,
        payload_bytes: fill.map_or(workload.payload_bytes, |f| {
            let avg = stats::truncate_u64(f.avg_payload_bytes.round());
            usize::try_from(avg).unwrap_or(usize::MAX)
        }),
    };
    progress.step(format!("{}: draining", mode.label()));
    let drained: Drained = drain::drain(mode, fixture, target).await?;
    let decoding = if mode.reads_wal() {
        Some(fixture.decoding_stats().await?)
    } else {
        None
    };
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
            });
        }
        Some(found)
    } else {
        None
    };
    let table_after = match mode {
        Mode::Poll { .. } => Some(settled_table_stats(fixture, workload.events).await?),
        // What the writers left behind: rows, or the message ledger.
        Mode::Cdc | Mode::CdcText | Mode::CdcMessage | Mode::CdcMessageUnaudited => {
            Some(fixture.table_stats().await?)
        }
        _ => None,
    };
    let _ = on_topic;
    Ok(sample_of(
        workload.events,
        &drained,
        decoding,
        fill.as_ref(),
        wal_after.0.saturating_sub(end_lsn.0),
        table_empty,
        table_after,
    ))
}

/// The figures of one drain.
fn sample_of(
    events: u64,
    drained: &Drained,
    decoding: Option<fixture::DecodingStats>,
    fill: Option<&fixture::Fill>,
    drain_wal_bytes: u64,
    table_before: fixture::TableStats,
    table_after: Option<fixture::TableStats>,
) -> Sample {
    let (n, drain_wal) = (
        stats::count_f64(events.max(1)),
        stats::count_f64(drain_wal_bytes),
    );
    Sample {
        events_per_s: stats::rate(events, drained.elapsed),
        cpu_s_per_1m: drained.usage.map(|u| u.cpu.as_secs_f64() * 1e6 / n),
        walsender_cpu_s_per_1m: drained.walsender_cpu.map(|c| c.as_secs_f64() * 1e6 / n),
        io_calls_per_event: drained
            .usage
            .filter(|u| u.io_calls > 0)
            .map(|u| stats::count_f64(u.io_calls) / n),
        rss_mib: drained
            .usage
            .map(|u| stats::count_f64(u.peak_rss_kib) / 1024.0),
        insert_wal_bytes_per_event: fill.map(|f| f.wal_bytes_per_event),
        insert_events_per_s: fill.map(|f| stats::rate(f.events, f.elapsed)),
        avg_payload_bytes: fill.map(|f| f.avg_payload_bytes),
        drain_wal_bytes_per_event: fill.map(|_| drain_wal / n),
        dead_tuples: table_after.map(|t| t.dead_tuples),
        table_growth_bytes: table_after.map(|t| t.total_bytes - table_before.total_bytes),
        spill_mib: decoding.map(|d| mib(d.spill_bytes)),
        stream_mib: decoding.map(|d| mib(d.stream_bytes)),
    }
}

fn mib(bytes: i64) -> f64 {
    stats::signed_f64(bytes) / (1024.0 * 1024.0)
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
