//! The steady-rate workload: open-loop writers at fixed absolute rates
//! (`--rates`, events/s, and `max`: the writers' own maximum on this machine,
//! measured first without a relay), and the latency of each event from its
//! `created_at` (which the relay and the poller both send as the record's
//! CreateTime) to the moment a consumer of the topic reads it.
//!
//! Open loop: each writer's transactions are due on a fixed schedule
//! ([`Schedule`]) and a late one is sent at once, so a struggling database shows up
//! as latency rather than as a quietly lower rate. Every point is recorded with the
//! rate the writers achieved. The consumer reads with a short fetch wait
//! (`fetch.wait.max.ms` 5), so its own delay is a few milliseconds of every figure;
//! both relays pay it alike.
//!
//! # A point that fails does not end the run
//!
//! A point fails when the writers cannot keep the schedule (still writing at twice
//! the duration plus [`WRITE_SLACK`]: the rate is beyond this machine), when not
//! every event reached the topic within [`DRAIN_GRACE`] after the writers stopped,
//! or when anything else about it goes wrong (the relay exits, a query fails). It
//! is reported as failed with that reason, and the next point runs: a long run
//! that stopped at its first bad point would report nothing. Only Ctrl-C ends the
//! run early.
//!
//! # Where the time goes
//!
//! The CDC relay runs with its metrics endpoint on a loopback port; after each
//! point its per-stage histograms are read (`scrape`), so the report shows, next
//! to the end-to-end latency, how long events spent between commit and receipt,
//! receipt and produce, produce and ack, ack and confirmation. The poller serves
//! its metrics too; from both pages comes the number of produce requests per
//! record their producers sent (librdkafka's statistics), and from `/proc` the
//! wake-ups per event of the relay's threads and of the walsender.
//!
//! `cdc-message` runs the CDC relay on the message outbox (`outbox_emit`, with its
//! ledger); its no-relay point is the row writers'.
//!
//! # What PostgreSQL alone charges for a slot
//!
//! [`RECVLOGICAL`] (with `--modes pg-ceiling`) attaches PostgreSQL's own
//! `pg_recvlogical` to the slot, writing to `/dev/null`: the walsender decodes and
//! sends every transaction as it does for the relay, and nothing past it does any
//! work. Its point shows what any logical-decoding consumer costs the database's
//! cores and the writers' rate, so a CDC point can be read against it: what is
//! above it is the relay's (or the broker's) doing, what is not is PostgreSQL's.
//! Nothing is consumed, so it has no latency; its "relay" CPU is
//! `pg_recvlogical`'s.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{ClientConfig, Message, Offset, TopicPartitionList};

use super::args::{BenchArgs, Rate};
use super::drain::{
    CDC_EXACTLY_ONCE, CDC_MESSAGE, Mode, Options, StopOnDrop, exactly_once_env,
    recvlogical_command, relay_command,
};
use super::error::{BenchError, Result};
use super::fixture::{Fixture, Writes};
use super::processes;
use super::progress::{Progress, until_interrupted};
use super::scrape::{self, StageLatency};
use super::stats::{Drift, Latency, LatencySpread, Schedule, Spread, rate, signed_f64};
use super::steady_report::{PerEvent, PerEventSpread, StageSpread, SteadyResult};
use crate::config::Config;
use crate::tools::workload::{Pace, Workload};

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
/// The writers of a point must be done by twice its duration plus this.
const WRITE_SLACK: Duration = Duration::from_secs(2);

/// Label of the point with the writers alone: what the database costs and how
/// fast the writers go without any relay.
pub(crate) const NO_RELAY: &str = "no-relay";

/// Label of the point with `pg_recvlogical` on the slot: PostgreSQL's share of a
/// consumer's cost (see the module doc).
pub(crate) const RECVLOGICAL: &str = "pg-ceiling-recvlogical";

/// Label of the point with the CDC relay decoding on a standby (`--standby-url`,
/// `postgres.slot_url`): the slot and its walsender on the standby, the relay's
/// writes on the primary.
pub(crate) const CDC_STANDBY: &str = "cdc-standby";

/// How often the standby's replay lag is sampled during a point.
const REPLAY_LAG_SAMPLE: Duration = Duration::from_millis(250);

/// How long a walsender may take to decode the last writes once the writers
/// stopped before its point fails.
const DECODE_GRACE: Duration = Duration::from_secs(30);

/// Which contenders run the steady workload: the writers alone, then the real
/// relays (with a standby, the CDC relay also decoding there).
#[must_use]
pub(crate) fn modes(modes: &[Mode], standby: bool) -> Vec<&'static str> {
    let mut out = vec![NO_RELAY];
    if modes.contains(&Mode::RecvLogical) {
        out.push(RECVLOGICAL);
    }
    if modes.contains(&Mode::Cdc) {
        out.push("cdc");
        if standby {
            out.push(CDC_STANDBY);
        }
    }
    if modes.contains(&Mode::CdcExactlyOnce) {
        out.push(CDC_EXACTLY_ONCE);
    }
    if modes.contains(&Mode::CdcMessage) {
        out.push(CDC_MESSAGE);
    }
    if modes.iter().any(|m| matches!(m, Mode::Poll { .. })) {
        out.push(POLL_LABEL);
    }
    if out.len() == 1 {
        // No relay to compare with.
        out.clear();
    }
    out
}

/// What one run of a point came to.
#[derive(Debug, Clone, PartialEq)]
enum Outcome {
    Measured {
        achieved: f64,
        /// `None` for the no-relay and `pg_recvlogical` points (nothing is
        /// consumed).
        latency: Option<Latency>,
        /// CPU per event by process (boxed: the largest field by far).
        cpu: Box<PerEvent>,
        /// The relay's per-stage figures, each with its drift when the quarter
        /// pages were read (CDC only; empty when unreadable).
        stages: Vec<StageLatency>,
        /// First against last quarter of the run (`None` under four events).
        drift: Option<Drift>,
    },
    Failed {
        reason: String,
        /// The rate the writers reached, when they ran.
        achieved: Option<f64>,
    },
}

/// Runs every (rate, mode) point `--repeat` times; a failed point is recorded and
/// the run goes on.
pub(crate) async fn run(
    config: &Config,
    workload: &Workload,
    modes: &[&'static str],
    args: &BenchArgs,
    progress: &Progress,
) -> Result<Vec<SteadyResult>> {
    let duration = Duration::from_secs(args.steady_secs);
    let writers_max = if args.rates.contains(&Rate::WritersMax) {
        progress.step(format!("measuring the writers' maximum ({duration:?})"));
        let max = Box::pin(writers_max(config, workload, duration)).await?;
        progress.done(&match &max {
            Ok(rate) => format!("writers' maximum: {rate:.0} events/s"),
            Err(reason) => format!("writers' maximum not measured: {reason}"),
        });
        Some(max)
    } else {
        None
    };
    let target = |rate: Rate| match (rate, &writers_max) {
        (Rate::Fixed(r), _) => Ok(r),
        (Rate::WritersMax, Some(Ok(max))) => Ok(*max),
        (Rate::WritersMax, Some(Err(reason))) => {
            Err(format!("the writers' maximum was not measured: {reason}"))
        }
        (Rate::WritersMax, None) => Err("the writers' maximum was not measured".to_owned()),
    };
    let watch = Watch::find(config, args.standby_url.as_deref()).await?;
    let pinned = match (&args.pin, watch.postmaster) {
        (Some(pin), Some(postmaster)) => Some(processes::pin(
            pin,
            postmaster,
            watch.broker,
            watch.standby,
        )?),
        (Some(_), None) => {
            return Err(BenchError::Pin(
                "PostgreSQL does not run on this machine (its postmaster is not found)".into(),
            ));
        }
        (None, _) => None,
    };
    let result = Box::pin(run_points(
        config, workload, modes, args, progress, &watch, &target,
    ))
    .await;
    if let Some(pinned) = pinned {
        pinned.release();
    }
    let mut runs = result?;
    let mut out = Vec::new();
    for (r, &rate) in args.rates.iter().enumerate() {
        for &mode in modes {
            let outcomes = runs.remove(&(mode, r)).unwrap_or_default();
            out.push(aggregate(mode, rate, target(rate).ok(), &outcomes));
        }
    }
    Ok(out)
}

/// The processes whose CPU a point charges besides the relay's, found once.
#[derive(Debug, Clone, Default)]
struct Watch {
    postmaster: Option<u32>,
    broker: Option<u32>,
    /// The standby's postmaster (`--standby-url`), when it runs on this machine.
    standby: Option<u32>,
    /// `--standby-url`.
    standby_url: Option<String>,
}

impl Watch {
    async fn find(config: &Config, standby_url: Option<&str>) -> Result<Watch> {
        let postmaster = match crate::postgres::connect(&config.postgres.url).await {
            Ok(client) => processes::postmaster(&client).await,
            Err(_) => None,
        };
        let standby = match standby_url {
            Some(url) => {
                let client = crate::postgres::connect(url).await?;
                let in_recovery: bool = client
                    .query_one("SELECT pg_is_in_recovery()", &[])
                    .await?
                    .get(0);
                if !in_recovery {
                    return Err(BenchError::Standby(format!(
                        "--standby-url {} is not a standby (not in recovery)",
                        crate::config::redact_url(url)
                    )));
                }
                processes::postmaster(&client).await
            }
            None => None,
        };
        let broker = config
            .kafka
            .brokers
            .split(',')
            .next()
            .and_then(|b| b.trim().rsplit(':').next()?.parse::<u16>().ok())
            .and_then(processes::listening_on);
        Ok(Watch {
            postmaster,
            broker,
            standby,
            standby_url: standby_url.map(str::to_owned),
        })
    }
}

/// The standby's replay lag sampled through a point (`--standby-url`).
struct LagSampler {
    stop: Arc<AtomicBool>,
    task: Option<tokio::task::JoinHandle<Option<f64>>>,
}

impl LagSampler {
    /// Starts sampling on a connection of its own to the primary, when there is a
    /// standby to watch.
    fn start(fixture: &Fixture, watch: &Watch) -> LagSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let task = watch.standby_url.as_ref().map(|_| {
            let url = fixture.config.postgres.url.clone();
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                let primary = crate::postgres::connect(&url).await.ok()?;
                replay_lag_max(&primary, stop).await
            })
        });
        LagSampler { stop, task }
    }

    /// Stops sampling; the highest lag seen, ms.
    async fn finish(self) -> Option<f64> {
        self.stop.store(true, Ordering::Release);
        self.task?.await.ok().flatten()
    }
}

/// Samples the standby's replay lag on the primary (`pg_stat_replication.replay_lag`
/// of the physical walsenders) until aborted; returns the highest seen, in ms.
async fn replay_lag_max(primary: &tokio_postgres::Client, stop: Arc<AtomicBool>) -> Option<f64> {
    let mut highest: Option<f64> = None;
    let mut tick = tokio::time::interval(REPLAY_LAG_SAMPLE);
    while !stop.load(Ordering::Acquire) {
        tick.tick().await;
        let row = primary
            .query_one(
                "SELECT max(extract(epoch FROM r.replay_lag) * 1000)::float8
                   FROM pg_stat_replication r
                   JOIN pg_replication_slots s ON s.active_pid = r.pid
                  WHERE s.slot_type = 'physical'",
                &[],
            )
            .await
            .ok()?;
        if let Some(ms) = row.get::<_, Option<f64>>(0) {
            highest = Some(highest.map_or(ms, |h| h.max(ms)));
        }
    }
    highest.or(Some(0.0))
}

type Runs = HashMap<(&'static str, usize), Vec<Outcome>>;

/// Every run of every point.
async fn run_points(
    config: &Config,
    workload: &Workload,
    modes: &[&'static str],
    args: &BenchArgs,
    progress: &Progress,
    watch: &Watch,
    target: &dyn Fn(Rate) -> std::result::Result<f64, String>,
) -> Result<Runs> {
    let duration = Duration::from_secs(args.steady_secs);
    let mut runs: Runs = HashMap::new();
    for repeat in 1..=args.repeat {
        for (r, &rate) in args.rates.iter().enumerate() {
            for &mode in modes {
                let outcome = match target(rate) {
                    Ok(events_per_s) => {
                        progress.step(format!(
                            "{mode} steady {rate} ({events_per_s:.0} events/s), run {repeat}/{}",
                            args.repeat
                        ));
                        Box::pin(one_run(
                            config,
                            workload,
                            mode,
                            events_per_s,
                            duration,
                            watch,
                        ))
                        .await?
                    }
                    Err(reason) => Outcome::Failed {
                        reason,
                        achieved: None,
                    },
                };
                progress.done(&describe(mode, rate, &outcome));
                runs.entry((mode, r)).or_default().push(outcome);
            }
        }
    }
    Ok(runs)
}

/// The progress line of one run.
fn describe(mode: &str, rate: Rate, outcome: &Outcome) -> String {
    match outcome {
        Outcome::Measured {
            achieved,
            latency: Some(latency),
            ..
        } => format!(
            "{mode} steady {rate}: {achieved:.0} events/s, p50 {:.1} ms, p99 {:.1} ms",
            latency.p50, latency.p99
        ),
        Outcome::Measured { achieved, .. } => {
            format!("{mode} steady {rate}: {achieved:.0} events/s")
        }
        Outcome::Failed { reason, .. } => format!("{mode} steady {rate}: FAILED: {reason}"),
    }
}

/// One point's runs, aggregated: spreads over the measured runs, every failure's
/// reason.
fn aggregate(mode: &str, rate: Rate, target: Option<f64>, outcomes: &[Outcome]) -> SteadyResult {
    let mut achieved = Vec::new();
    let mut latencies = Vec::new();
    let mut stages: Vec<&StageLatency> = Vec::new();
    let mut drifts = Vec::new();
    let mut failures = Vec::new();
    let mut cpus = Vec::new();
    for outcome in outcomes {
        match outcome {
            Outcome::Measured {
                achieved: a,
                latency,
                cpu,
                stages: s,
                drift,
            } => {
                achieved.push(*a);
                latencies.extend(*latency);
                cpus.push(**cpu);
                stages.extend(s);
                drifts.extend(drift.map(|d| d.change_pct()));
            }
            Outcome::Failed {
                reason,
                achieved: a,
            } => {
                achieved.extend(a);
                failures.push(reason.clone());
            }
        }
    }
    SteadyResult {
        mode: mode.to_owned(),
        rate,
        target_events_per_s: target,
        runs: outcomes.len(),
        achieved_events_per_s: Spread::of(&achieved),
        latency: LatencySpread::of(&latencies),
        stages: stage_spreads(&stages),
        drift_pct: Spread::of(&drifts),
        failures,
        cpu: PerEventSpread::of(&cpus),
    }
}

/// Per stage (in the relay's order), the spread of p50, p99 and drift over the runs.
fn stage_spreads(stages: &[&StageLatency]) -> Vec<StageSpread> {
    let mut names: Vec<&'static str> = Vec::new();
    for s in stages {
        if !names.contains(&s.stage) {
            names.push(s.stage);
        }
    }
    names
        .into_iter()
        .filter_map(|name| {
            let mine: Vec<&&StageLatency> = stages.iter().filter(|s| s.stage == name).collect();
            let p50: Vec<f64> = mine.iter().map(|s| s.p50_ms).collect();
            let p99: Vec<f64> = mine.iter().map(|s| s.p99_ms).collect();
            let drift: Vec<f64> = mine
                .iter()
                .filter_map(|s| s.drift.map(|d| d.change_pct()))
                .collect();
            Some(StageSpread {
                stage: name,
                p50: Spread::of(&p50)?,
                p99: Spread::of(&p99)?,
                drift_pct: Spread::of(&drift),
            })
        })
        .collect()
}

/// The writers' own maximum: unpaced, no relay, no slot, for `duration`. `Ok(Err)`
/// when it could not be measured (the `max` points then fail with that reason).
async fn writers_max(
    config: &Config,
    workload: &Workload,
    duration: Duration,
) -> Result<std::result::Result<f64, String>> {
    Box::pin(until_interrupted(async {
        let fixture = match Fixture::create(config).await {
            Ok(fixture) => fixture,
            Err(e) => return Ok(Err(e.to_string())),
        };
        let stop = Arc::new(AtomicBool::new(false));
        let timer = {
            let stop = Arc::clone(&stop);
            tokio::spawn(async move {
                tokio::time::sleep(duration).await;
                stop.store(true, Ordering::Release);
            })
        };
        let unbounded = Workload {
            events: u64::MAX / 2,
            ..workload.clone()
        };
        let started = Instant::now();
        let written = fixture.writers(&unbounded).until(stop).run().await;
        let elapsed = started.elapsed();
        timer.abort();
        fixture.cleanup().await;
        Ok(match written {
            Ok(w) if w.events > 0 => Ok(rate(w.events, elapsed)),
            Ok(_) => Err("the writers wrote nothing".to_owned()),
            Err(e) => Err(BenchError::from(e).to_string()),
        })
    }))
    .await
}

/// One run of a point in fresh objects; only Ctrl-C is an `Err`, anything else
/// that goes wrong is a failed [`Outcome`].
async fn one_run(
    config: &Config,
    workload: &Workload,
    mode: &str,
    events_per_s: f64,
    duration: Duration,
    watch: &Watch,
) -> Result<Outcome> {
    let result = Box::pin(until_interrupted(async {
        let mut fixture = Fixture::create(config).await?;
        if mode == CDC_STANDBY {
            let url = watch.standby_url.as_deref().ok_or_else(|| {
                BenchError::Standby("the cdc-standby point needs --standby-url".into())
            })?;
            fixture.decode_on(url).await?;
        }
        let fixture = fixture;
        let result = match mode {
            NO_RELAY => {
                writers_alone(&fixture, workload, events_per_s, duration, watch, None).await
            }
            RECVLOGICAL => {
                recvlogical_attached(&fixture, workload, events_per_s, duration, watch).await
            }
            _ => run_in(&fixture, workload, mode, events_per_s, duration, watch).await,
        };
        fixture.cleanup().await;
        result
    }))
    .await;
    match result {
        Ok(outcome) => Ok(outcome),
        Err(BenchError::Interrupted) => Err(BenchError::Interrupted),
        Err(e) => Ok(Outcome::Failed {
            reason: e.to_string(),
            achieved: None,
        }),
    }
}

async fn run_in(
    fixture: &Fixture,
    workload: &Workload,
    mode: &str,
    events_per_s: f64,
    duration: Duration,
    watch: &Watch,
) -> Result<Outcome> {
    let schedule = Schedule::new(events_per_s, workload.rows_per_tx, duration)
        .ok_or(BenchError::NoSchedule { events_per_s })?;
    let exactly_once = mode == CDC_EXACTLY_ONCE;
    let messages = mode == CDC_MESSAGE;
    let on_standby = mode == CDC_STANDBY;
    let cdc = mode == "cdc" || exactly_once || messages || on_standby;
    debug_assert!(cdc || mode == POLL_LABEL);
    if cdc && !on_standby {
        fixture.create_slot().await?;
    }
    // On a standby the relay creates the slot itself: the creation waits for a
    // running-transactions record, which it asks the primary for.
    if exactly_once {
        fixture.create_progress_topic().await?;
    }
    // Both serve their metrics (the produce-request counters); only the CDC relay
    // has stage histograms and a readiness to wait for.
    let metrics = scrape::free_port()?;
    let mut child = spawn(fixture, cdc, exactly_once, metrics)?;
    wait_ready(fixture, cdc, metrics, &mut child).await?;
    let scheduled = schedule.count() * u64::from(workload.rows_per_tx);
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_on_drop = StopOnDrop(Arc::clone(&stop));
    let consumer = {
        let cfg = consumer_config(&fixture.config);
        let topic = fixture.topic.clone();
        let stop = Arc::clone(&stop);
        tokio::task::spawn_blocking(move || consume_latencies(&cfg, &topic, scheduled, &stop))
    };
    let quarters = cdc.then(|| {
        tokio::spawn(quarter_pages(
            metrics,
            tokio::time::Instant::now(),
            duration,
        ))
    });
    let relay_pid = child.id();
    let walsenders: Vec<u32> = if cdc {
        fixture
            .walsender_pids()
            .await
            .iter()
            .filter_map(|p| p.parse().ok())
            .collect()
    } else {
        Vec::new()
    };
    let cpu_start = CpuReading::take(watch, relay_pid, &walsenders);
    let lag = LagSampler::start(fixture, watch);
    let started = Instant::now();
    let write_deadline = duration * 2 + WRITE_SLACK;
    let writes = if messages {
        Writes::Messages
    } else {
        Writes::Rows
    };
    let written = write(fixture, workload, schedule, writes, write_deadline).await?;
    let write_elapsed = started.elapsed();
    let achieved = rate(written, write_elapsed.max(duration));
    if written < scheduled {
        // The consumer and the relay are done with before the run's topic is
        // dropped.
        stop.store(true, Ordering::Release);
        let _ = consumer.await;
        if let Some(quarters) = &quarters {
            quarters.abort();
        }
        let _ = child.start_kill();
        let _ = child.wait().await;
        return Ok(Outcome::Failed {
            reason: format!(
                "the writers fell behind: {written} of {scheduled} events written in {:.1} s \
                 ({achieved:.0} events/s of {events_per_s:.0} targeted)",
                write_elapsed.as_secs_f64()
            ),
            achieved: Some(achieved),
        });
    }
    let deadline = tokio::time::Instant::now() + DRAIN_GRACE;
    let mut consumer = consumer;
    let latencies = tokio::select! {
        joined = &mut consumer => joined.map_err(BenchError::Task)??,
        () = tokio::time::sleep_until(deadline) => {
            stop.store(true, Ordering::Release);
            consumer.await.map_err(BenchError::Task)??
        }
    };
    let end_page = relay_page(metrics).await;
    let quarter_pages = match quarters {
        Some(quarters) => match quarters.await {
            Ok((Some(first), Some(third))) => Some((first, third)),
            _ => None,
        },
        None => None,
    };
    let stages = end_page
        .as_deref()
        .map(|end| {
            let quarters = quarter_pages
                .as_ref()
                .map(|(first, third)| (first.as_str(), third.as_str()));
            scrape::stages_of(end, quarters)
        })
        .unwrap_or_default();
    let mut cpu = cpu_start.per_event(&CpuReading::take(watch, relay_pid, &walsenders), written);
    cpu.produce_requests = end_page.as_deref().and_then(produce_requests);
    cpu.replay_lag_ms = lag.finish().await;
    let _ = child.start_kill();
    let _ = child.wait().await;
    let found = u64::try_from(latencies.len()).unwrap_or(u64::MAX);
    if found < written {
        return Ok(Outcome::Failed {
            reason: format!(
                "{found} of {written} events on the topic {} s after the writers stopped",
                DRAIN_GRACE.as_secs()
            ),
            achieved: Some(achieved),
        });
    }
    let drift = Drift::of(&latencies);
    let latency = Latency::of(latencies).ok_or(BenchError::NoLatencySamples)?;
    Ok(Outcome::Measured {
        achieved,
        latency: Some(latency),
        cpu: Box::new(cpu),
        stages,
        drift,
    })
}

/// A consumer of the slot that nothing is measured after: `pg_recvlogical`.
struct Reader {
    pid: Option<u32>,
    walsenders: Vec<u32>,
}

/// The no-relay point: the writers alone at the rate (no slot, no relay), for the
/// database's own cost per event and the rate it sustains; with a `reader`, the
/// same beside it, charged until its walsender has decoded every write.
async fn writers_alone(
    fixture: &Fixture,
    workload: &Workload,
    events_per_s: f64,
    duration: Duration,
    watch: &Watch,
    reader: Option<&Reader>,
) -> Result<Outcome> {
    let schedule = Schedule::new(events_per_s, workload.rows_per_tx, duration)
        .ok_or(BenchError::NoSchedule { events_per_s })?;
    let scheduled = schedule.count() * u64::from(workload.rows_per_tx);
    let (pid, walsenders) = reader.map_or((None, &[][..]), |r| (r.pid, &r.walsenders[..]));
    let cpu_start = CpuReading::take(watch, pid, walsenders);
    let lag = LagSampler::start(fixture, watch);
    let started = Instant::now();
    let written = write(
        fixture,
        workload,
        schedule,
        Writes::Rows,
        duration * 2 + WRITE_SLACK,
    )
    .await?;
    let elapsed = started.elapsed();
    let achieved = rate(written, elapsed.max(duration));
    if written < scheduled {
        return Ok(Outcome::Failed {
            reason: format!(
                "the writers fell behind: {written} of {scheduled} events written in {:.1} s",
                elapsed.as_secs_f64()
            ),
            achieved: Some(achieved),
        });
    }
    if reader.is_some() {
        decoded(fixture, walsenders).await?;
    }
    let mut cpu = cpu_start.per_event(&CpuReading::take(watch, pid, walsenders), written);
    cpu.replay_lag_ms = lag.finish().await;
    Ok(Outcome::Measured {
        achieved,
        latency: None,
        cpu: Box::new(cpu),
        stages: Vec::new(),
        drift: None,
    })
}

/// The writers beside `pg_recvlogical` on the slot: PostgreSQL's cost of a
/// logical-decoding consumer, with nothing past the walsender.
async fn recvlogical_attached(
    fixture: &Fixture,
    workload: &Workload,
    events_per_s: f64,
    duration: Duration,
    watch: &Watch,
) -> Result<Outcome> {
    fixture.create_slot().await?;
    let mut cmd = recvlogical_command(fixture, Options::Plain)?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    let mut child = cmd.spawn().map_err(|source| BenchError::Spawn {
        what: "pg_recvlogical".into(),
        source,
    })?;
    let result = async {
        let walsenders = walsenders_of(fixture, &mut child).await?;
        let reader = Reader {
            pid: child.id(),
            walsenders,
        };
        writers_alone(
            fixture,
            workload,
            events_per_s,
            duration,
            watch,
            Some(&reader),
        )
        .await
    }
    .await;
    let _ = child.start_kill();
    let _ = child.wait().await;
    result
}

/// The walsenders of the fixture's slot, once `child` holds it.
async fn walsenders_of(fixture: &Fixture, child: &mut tokio::process::Child) -> Result<Vec<u32>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tick.tick().await;
        let pids: Vec<u32> = fixture
            .walsender_pids()
            .await
            .iter()
            .filter_map(|p| p.parse().ok())
            .collect();
        if !pids.is_empty() {
            return Ok(pids);
        }
        if let Ok(Some(status)) = child.try_wait() {
            return Err(BenchError::Child {
                what: "pg_recvlogical".into(),
                message: format!("exited with {status} before it held the slot"),
            });
        }
        if Instant::now() > deadline {
            return Err(BenchError::Child {
                what: "pg_recvlogical".into(),
                message: "did not hold the slot within 30 s".into(),
            });
        }
    }
}

/// Waits until `walsenders` have decoded the WAL written so far, so that a point
/// charges them for every write.
async fn decoded(fixture: &Fixture, walsenders: &[u32]) -> Result<()> {
    let end = fixture.wal_lsn().await?.to_string();
    let pids: Vec<i32> = walsenders
        .iter()
        .filter_map(|&p| i32::try_from(p).ok())
        .collect();
    let deadline = Instant::now() + DECODE_GRACE;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tick.tick().await;
        let row = fixture
            .client()
            .query_one(
                "SELECT count(*), count(*) FILTER (WHERE sent_lsn >= $2::text::pg_lsn)
                   FROM pg_stat_replication WHERE pid = ANY($1)",
                &[&pids, &end],
            )
            .await?;
        let (serving, caught_up): (i64, i64) = (row.get(0), row.get(1));
        if serving < i64::try_from(pids.len()).unwrap_or(i64::MAX) {
            return Err(BenchError::Child {
                what: "the walsender".into(),
                message: "stopped before it decoded the last writes".into(),
            });
        }
        if caught_up == serving {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(BenchError::Child {
                what: "the walsender".into(),
                message: format!(
                    "had not decoded up to {end} {} s after the writers stopped",
                    DECODE_GRACE.as_secs()
                ),
            });
        }
    }
}

/// The CPU counters of a point's processes at one instant.
#[derive(Debug, Clone)]
struct CpuReading {
    db: Option<processes::DbSnapshot>,
    standby: Option<processes::DbSnapshot>,
    walsenders: Option<Duration>,
    relay: Option<Duration>,
    broker: Option<Duration>,
    bench: Option<Duration>,
    relay_wakeups: Option<u64>,
    walsender_wakeups: Option<u64>,
}

impl CpuReading {
    fn take(watch: &Watch, relay: Option<u32>, walsenders: &[u32]) -> CpuReading {
        CpuReading {
            db: watch.postmaster.and_then(processes::DbSnapshot::take),
            standby: watch.standby.and_then(processes::DbSnapshot::take),
            walsenders: sum_over(walsenders, processes::process_cpu),
            relay: relay.and_then(processes::process_cpu),
            broker: watch.broker.and_then(processes::process_cpu),
            bench: processes::process_cpu(std::process::id()),
            relay_wakeups: relay.and_then(processes::wakeups),
            walsender_wakeups: sum_over(walsenders, processes::wakeups),
        }
    }

    /// Microseconds of CPU and wake-ups per event from `self` to `end`, by process
    /// (produce requests are the relay's to say: [`produce_requests`]).
    fn per_event(&self, end: &CpuReading, events: u64) -> PerEvent {
        let events = super::stats::count_f64(events.max(1));
        let micros = |d: Duration| d.as_secs_f64() * 1e6 / events;
        let delta = |a: Option<Duration>, b: Option<Duration>| Some(micros(b?.saturating_sub(a?)));
        let per_event = |a: Option<u64>, b: Option<u64>| {
            Some(super::stats::count_f64(b?.saturating_sub(a?)) / events)
        };
        PerEvent {
            db: match (&self.db, &end.db) {
                (Some(a), Some(b)) => Some(micros(a.until(b))),
                _ => None,
            },
            standby: match (&self.standby, &end.standby) {
                (Some(a), Some(b)) => Some(micros(a.until(b))),
                _ => None,
            },
            replay_lag_ms: None,
            walsender: delta(self.walsenders, end.walsenders),
            relay: delta(self.relay, end.relay),
            broker: delta(self.broker, end.broker),
            bench: delta(self.bench, end.bench),
            produce_requests: None,
            relay_wakeups: per_event(self.relay_wakeups, end.relay_wakeups),
            walsender_wakeups: per_event(self.walsender_wakeups, end.walsender_wakeups),
        }
    }
}

/// `read` summed over `pids` (those it can read); `None` when there are no pids.
fn sum_over<T: std::iter::Sum>(pids: &[u32], read: fn(u32) -> Option<T>) -> Option<T> {
    (!pids.is_empty()).then(|| pids.iter().filter_map(|&pid| read(pid)).sum())
}

/// Produce requests per record the relay's (or poller's) producers sent, from its
/// metrics page (librdkafka statistics, once a second: the page's figures lag the
/// point's end by up to a second, but requests and records come from the same
/// report).
fn produce_requests(page: &str) -> Option<f64> {
    let requests = scrape::counter(page, crate::kafka::PRODUCE_REQUESTS)?;
    let records = scrape::counter(page, crate::kafka::RECORDS_TRANSMITTED)?;
    (records > 0.0).then(|| requests / records)
}

/// The relay's metrics page at the end of a point; none (with a warning) when it
/// cannot be read.
async fn relay_page(addr: SocketAddr) -> Option<String> {
    scrape::page(addr)
        .await
        .inspect_err(|reason| tracing::warn!(%reason, "cannot read the relay's metrics page"))
        .ok()
}

/// The relay's metrics pages at a quarter and at three quarters of the writing
/// (from `started`), for the stages' drift; `None` for one that could not be
/// read.
async fn quarter_pages(
    addr: SocketAddr,
    started: tokio::time::Instant,
    duration: Duration,
) -> (Option<String>, Option<String>) {
    tokio::time::sleep_until(started + duration / 4).await;
    let first = scrape::page(addr).await.ok();
    tokio::time::sleep_until(started + duration * 3 / 4).await;
    let third = scrape::page(addr).await.ok();
    (first, third)
}

fn spawn(
    fixture: &Fixture,
    cdc: bool,
    exactly_once: bool,
    metrics: SocketAddr,
) -> Result<tokio::process::Child> {
    let args: &[&str] = if cdc { &["run"] } else { &POLL_ARGS };
    let mut cmd = relay_command(fixture, args)?;
    if let Some(url) = fixture.slot_url() {
        cmd.env(
            format!("{}POSTGRES__SLOT_URL", crate::config::ENV_PREFIX),
            url,
        );
    }
    if exactly_once {
        exactly_once_env(&mut cmd);
    }
    cmd.env(
        format!("{}METRICS__LISTEN", crate::config::ENV_PREFIX),
        metrics.to_string(),
    );
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    cmd.spawn().map_err(|source| BenchError::Spawn {
        what: "the relay".into(),
        source,
    })
}

/// Waits until the relay reads: the CDC relay holds its slot and its `/readyz` says
/// it streams (an exactly-once relay holds the slot a few hundred milliseconds
/// before it reads: it initialises its transactions and reads its progress record
/// first, and the first events written then would wait for it and count as latency
/// of the steady state); the poller has run its poll query once.
async fn wait_ready(
    fixture: &Fixture,
    cdc: bool,
    metrics: SocketAddr,
    child: &mut tokio::process::Child,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let table = fixture.config.outbox.table.clone();
    let (_, table_name) = crate::config::qualified_name(&table)?;
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    loop {
        tick.tick().await;
        let ready: bool = if cdc {
            fixture
                .slot_client()
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
        let streaming = if ready && cdc {
            scrape::ready(metrics).await
        } else {
            ready
        };
        if streaming {
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
/// transactions `w, w + writers, …` on the schedule, each `rows_per_tx` rows; at
/// `deadline` (from the start) they stop before their next transaction.
async fn write(
    fixture: &Fixture,
    workload: &Workload,
    schedule: Schedule,
    writes: Writes,
    deadline: Duration,
) -> Result<u64> {
    let workload = Workload {
        events: schedule.count() * u64::from(workload.rows_per_tx),
        ..workload.clone()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let timer = {
        let stop = Arc::clone(&stop);
        tokio::spawn(async move {
            tokio::time::sleep(deadline).await;
            stop.store(true, Ordering::Release);
        })
    };
    let mut writers = fixture
        .writers(&workload)
        .pace(Pace::Schedule(schedule))
        .until(stop);
    if writes == Writes::Messages {
        writers = writers.emitting(&fixture.emit_function()?);
    }
    let written = writers.run().await;
    timer.abort();
    Ok(written?.events)
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
    // Bounded: a rate beyond the writers schedules far more than they write.
    let mut out = Vec::with_capacity(usize::try_from(expected.min(1 << 20)).unwrap_or(0));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_cdc_delivery_modes_and_the_poller_run_the_steady_workload() {
        let poll = Mode::Poll {
            batch: 1000,
            workers: 1,
        };
        assert_eq!(
            modes(
                &[Mode::RecvLogical, Mode::Cdc, Mode::CdcExactlyOnce, poll],
                false
            ),
            vec![NO_RELAY, RECVLOGICAL, "cdc", CDC_EXACTLY_ONCE, POLL_LABEL]
        );
        assert_eq!(
            modes(&[Mode::RecvLogical, Mode::Ours], false),
            vec![NO_RELAY, RECVLOGICAL],
            "PostgreSQL's own consumer is a steady point; our null sink is not"
        );
        assert_eq!(
            modes(&[Mode::CdcExactlyOnce], false),
            vec![NO_RELAY, CDC_EXACTLY_ONCE]
        );
        assert!(modes(&[Mode::BrokerCeiling], false).is_empty());
        assert_eq!(
            modes(&[Mode::Cdc, Mode::CdcMessage, poll], false),
            vec![NO_RELAY, "cdc", CDC_MESSAGE, POLL_LABEL]
        );
        assert!(
            modes(
                &[Mode::CdcMessageUnaudited, Mode::RecvLogicalMessage],
                false
            )
            .is_empty(),
            "the unaudited message outbox and its pg_recvlogical are backlog modes only"
        );
        assert_eq!(
            modes(&[Mode::Cdc, poll], true),
            vec![NO_RELAY, "cdc", CDC_STANDBY, POLL_LABEL],
            "with a standby, the relay also decodes there"
        );
        assert_eq!(
            modes(&[Mode::CdcExactlyOnce], true),
            vec![NO_RELAY, CDC_EXACTLY_ONCE]
        );
    }
}
