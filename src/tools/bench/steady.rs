//! The steady-rate workload: open-loop writers at a fixed fraction of the CDC
//! relay's backlog maximum, and the latency of each event from its `created_at`
//! (which the relay and the poller both send as the record's CreateTime) to the
//! moment a consumer of the topic reads it.
//!
//! Open loop: each writer's transactions are due on a fixed schedule
//! ([`Schedule`]) and a late one is sent at once, so a struggling database shows up
//! as latency rather than as a quietly lower rate. The consumer reads with a short
//! fetch wait (`fetch.wait.max.ms` 5), so its own delay is a few milliseconds of
//! every figure; both relays pay it alike.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use super::args::BenchArgs;
use super::drain::{Mode, StopOnDrop, relay_command};
use super::error::{BenchError, Result};
use super::fixture::Fixture;
use super::progress::{Progress, until_interrupted};
use super::report::{LatencySpread, SteadyResult};
use super::stats::{Latency, Schedule, Spread, rate, signed_f64};
use crate::config::Config;
use crate::tools::workload::{Pace, Workload};

/// Offered load as fractions of the CDC backlog maximum.
pub(crate) const FRACTIONS: [f64; 3] = [0.25, 0.5, 0.8];
/// Label of the poller in the steady runs: the backlog label of its settings.
pub(crate) const POLL_LABEL: &str = "poll-b1000-w1";
/// The poller's settings for the steady runs: one worker keeps per-key order, a
/// 50 ms interval trades idle queries for latency.
const POLL_ARGS: [&str; 7] = [
    "poll",
    "--batch-size",
    "1000",
    "--workers",
    "1",
    "--poll-interval-ms",
    "50",
];
/// How long to wait for the last events after the writers stopped.
const DRAIN_GRACE: Duration = Duration::from_secs(60);

/// Which contenders run the steady workload: the two real relays.
#[must_use]
pub(crate) fn modes(modes: &[Mode]) -> Vec<&'static str> {
    let mut out = Vec::new();
    if modes.contains(&Mode::Cdc) {
        out.push("cdc");
    }
    if modes.iter().any(|m| matches!(m, Mode::Poll { .. })) {
        out.push(POLL_LABEL);
    }
    out
}

/// Runs every (mode, fraction) `--repeat` times.
pub(crate) async fn run(
    config: &Config,
    workload: &Workload,
    modes: &[&'static str],
    cdc_max: f64,
    args: &BenchArgs,
    progress: &Progress,
) -> Result<Vec<SteadyResult>> {
    let duration = Duration::from_secs(args.steady_secs);
    let mut runs: HashMap<(&str, usize), Vec<(f64, Latency)>> = HashMap::new();
    for repeat in 1..=args.repeat {
        for (f, fraction) in FRACTIONS.iter().enumerate() {
            for &mode in modes {
                let target = cdc_max * fraction;
                progress.step(format!(
                    "{mode} steady {:.0}% ({target:.0} events/s), run {repeat}/{}",
                    fraction * 100.0,
                    args.repeat
                ));
                let (achieved, latency) = one_run(config, workload, mode, target, duration).await?;
                progress.done(&format!(
                    "{mode} steady {:.0}%: {achieved:.0} events/s, p50 {:.1} ms, p99 {:.1} ms",
                    fraction * 100.0,
                    latency.p50,
                    latency.p99
                ));
                runs.entry((mode, f)).or_default().push((achieved, latency));
            }
        }
    }
    let mut out = Vec::new();
    for (f, fraction) in FRACTIONS.iter().enumerate() {
        for &mode in modes {
            let Some(samples) = runs.get(&(mode, f)) else {
                continue;
            };
            let achieved: Vec<f64> = samples.iter().map(|(a, _)| *a).collect();
            let latencies: Vec<Latency> = samples.iter().map(|(_, l)| *l).collect();
            if let (Some(achieved), Some(latency)) =
                (Spread::of(&achieved), LatencySpread::of(&latencies))
            {
                out.push(SteadyResult {
                    mode: mode.to_owned(),
                    fraction: *fraction,
                    target_events_per_s: cdc_max * fraction,
                    achieved_events_per_s: achieved,
                    latency,
                });
            }
        }
    }
    Ok(out)
}

async fn one_run(
    config: &Config,
    workload: &Workload,
    mode: &str,
    events_per_s: f64,
    duration: Duration,
) -> Result<(f64, Latency)> {
    let fixture = Fixture::create(config).await?;
    let result = until_interrupted(run_in(&fixture, workload, mode, events_per_s, duration)).await;
    fixture.cleanup().await;
    result
}

async fn run_in(
    fixture: &Fixture,
    workload: &Workload,
    mode: &str,
    events_per_s: f64,
    duration: Duration,
) -> Result<(f64, Latency)> {
    let schedule = Schedule::new(events_per_s, workload.rows_per_tx, duration)
        .ok_or(BenchError::NoSchedule { events_per_s })?;
    let cdc = mode == "cdc";
    debug_assert!(cdc || mode == POLL_LABEL);
    if cdc {
        fixture.create_slot().await?;
    }
    let mut child = spawn(fixture, cdc)?;
    wait_ready(fixture, cdc, &mut child).await?;
    let expected = schedule.count() * u64::from(workload.rows_per_tx);
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_on_drop = StopOnDrop(Arc::clone(&stop));
    let consumer = {
        let cfg = consumer_config(&fixture.config);
        let topic = fixture.topic.clone();
        let stop = Arc::clone(&stop);
        tokio::task::spawn_blocking(move || consume_latencies(&cfg, &topic, expected, &stop))
    };
    let started = Instant::now();
    let written = write(fixture, workload, schedule).await;
    let write_elapsed = started.elapsed();
    let deadline = tokio::time::Instant::now() + DRAIN_GRACE;
    let mut consumer = consumer;
    let latencies = tokio::select! {
        joined = &mut consumer => joined.map_err(BenchError::Task)??,
        () = tokio::time::sleep_until(deadline) => {
            stop.store(true, Ordering::Release);
            consumer.await.map_err(BenchError::Task)??
        }
    };
    let _ = child.start_kill();
    let _ = child.wait().await;
    let written = written?;
    let found = u64::try_from(latencies.len()).unwrap_or(u64::MAX);
    if found < written {
        return Err(BenchError::Undelivered {
            mode: format!("{mode} (steady)"),
            found,
            expected: written,
        });
    }
    let latency = Latency::of(latencies).ok_or(BenchError::NoLatencySamples)?;
    // The schedule spans `duration`; writers that fell behind took longer.
    Ok((rate(written, write_elapsed.max(duration)), latency))
}

fn spawn(fixture: &Fixture, cdc: bool) -> Result<tokio::process::Child> {
    let args: &[&str] = if cdc { &["run"] } else { &POLL_ARGS };
    let mut cmd = relay_command(fixture, args)?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    cmd.spawn().map_err(|source| BenchError::Spawn {
        what: "the relay".into(),
        source,
    })
}

/// Waits until the relay reads: the CDC relay holds its slot; the poller has run
/// its poll query once.
async fn wait_ready(fixture: &Fixture, cdc: bool, child: &mut tokio::process::Child) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let table = fixture.config.outbox.table.clone();
    let (_, table_name) = crate::config::qualified_name(&table)?;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tick.tick().await;
        let ready: bool = if cdc {
            fixture
                .client()
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active)",
                    &[&fixture.config.postgres.slot],
                )
                .await?
                .get(0)
        } else {
            fixture
                .client()
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE query LIKE '%' || $1 || '%sent_at IS NULL%' AND pid <> pg_backend_pid())",
                    &[&table_name],
                )
                .await?
                .get(0)
        };
        if ready {
            return Ok(());
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(BenchError::Child {
                what: "the relay".into(),
                message: format!("exited with {status} before it was ready"),
            });
        }
        if Instant::now() > deadline {
            return Err(BenchError::RelayNotReady);
        }
    }
}

/// The open-loop writers; returns how many events they wrote. Writer `w` sends
/// transactions `w, w + writers, …` on the schedule, each `rows_per_tx` rows.
async fn write(fixture: &Fixture, workload: &Workload, schedule: Schedule) -> Result<u64> {
    let workload = Workload {
        events: schedule.count() * u64::from(workload.rows_per_tx),
        ..workload.clone()
    };
    let written = fixture
        .writers(&workload)
        .pace(Pace::Schedule(schedule))
        .run()
        .await?;
    Ok(written.events)
}

fn consumer_config(config: &Config) -> ClientConfig {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", &config.kafka.brokers)
        .set(
            "group.id",
            format!("{}-latency", config.kafka.topic_template),
        )
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .set("fetch.wait.max.ms", "5")
        .set("auto.offset.reset", "earliest");
    for (key, value) in &config.kafka.producer {
        if key.starts_with("security.") || key.starts_with("sasl.") || key.starts_with("ssl.") {
            cfg.set(key, value);
        }
    }
    cfg
}

/// Reads the topic from the start and returns, per distinct record, now − its
/// timestamp in ms; stops at `expected` records or when `stop` is set.
fn consume_latencies(
    cfg: &ClientConfig,
    topic: &str,
    expected: u64,
    stop: &AtomicBool,
) -> Result<Vec<f64>> {
    let consumer: BaseConsumer = cfg.create()?;
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let mut assignment = TopicPartitionList::new();
    for t in metadata.topics().iter().filter(|t| t.name() == topic) {
        for p in t.partitions() {
            assignment.add_partition_offset(topic, p.id(), Offset::Offset(0))?;
        }
    }
    consumer.assign(&assignment)?;
    let mut next: HashMap<i32, i64> = HashMap::new();
    let mut out = Vec::with_capacity(usize::try_from(expected).unwrap_or(0));
    while u64::try_from(out.len()).unwrap_or(u64::MAX) < expected && !stop.load(Ordering::Acquire) {
        let Some(Ok(m)) = consumer.poll(Duration::from_millis(50)) else {
            continue;
        };
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1000.0);
        let seen = next.entry(m.partition()).or_insert(0);
        if m.offset() < *seen {
            continue;
        }
        *seen = m.offset() + 1;
        if let Some(ts) = m.timestamp().to_millis() {
            out.push(now_ms - signed_f64(ts));
        }
    }
    Ok(out)
}
