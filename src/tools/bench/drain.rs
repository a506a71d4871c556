//! The contenders: what each mode runs to drain the same backlog, and how the
//! benchmark knows it is done.
//!
//! * `pg-ceiling-recvlogical` — PostgreSQL's own `pg_recvlogical` reading the slot
//!   with `pgoutput` into `/dev/null`, stopped by `--endpos` at the drain target:
//!   how fast the walsender can decode and send, with a client that does nothing.
//! * `pg-ceiling-recvlogical-streaming` — the same with pgoutput protocol v2 and
//!   `streaming 'on'`: a transaction larger than `logical_decoding_work_mem` is sent
//!   in chunks while it is in progress instead of being spilled to disk and sent at
//!   its commit. The relay does not ask for it (nothing may be published before the
//!   commit, so it would have to keep what the server no longer spills); this mode
//!   measures what the server would save: the spill and stream columns of
//!   `pg_stat_replication_slots` are in every WAL-reading mode's figures.
//! * `pg-ceiling-ours` — our replication client, decoder, mapper and ack tracker,
//!   with a sink that acknowledges every event at once: the relay minus Kafka.
//! * `broker-ceiling` — our producer settings ([`Publisher`], `acks=all`,
//!   idempotent) sending records of the workload's size, no database: the relay
//!   minus PostgreSQL. Sends are never awaited one by one: the in-flight window of
//!   the relay's config is kept full, as the relay does.
//! * `cdc` — the real `outbox-relay run` as a child process, done when the slot's
//!   `confirmed_flush_lsn` reaches the target (the relay confirms a transaction
//!   only after the broker acked all its events), then the topic is counted.
//! * `cdc-text` — `cdc` with `postgres.binary_decoding = false`: the walsender
//!   runs the output functions (`cdc` asks for binary values on PostgreSQL 14+).
//! * `pg-ceiling-recvlogical-message`, `cdc-message-unaudited` and `cdc-message` —
//!   the same on a backlog written with the message outbox (`outbox_emit`: each
//!   event a transactional logical decoding message, `crate::outbox::message`)
//!   instead of rows; `pg_recvlogical` asks for `messages 'true'`, as the relay
//!   does. `cdc-message` writes with the message ledger `audit` counts against (one
//!   row update per event, which the walsender decodes too); the other two with
//!   `outbox_relay.message_ledger = 'off'`: messages alone.
//! * `poll-bB-wW` — the real `outbox-relay poll --batch-size B --workers W`, done
//!   when no row has `sent_at IS NULL` (rows are marked only after their ack), then
//!   the topic is counted.
//!
//! Child processes are timed from spawn, so their start-up (connect, broker
//! check) is included, as a restarted relay would pay it.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::Message;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};

use super::error::{BenchError, Result};
use super::fixture::{Fixture, Writes};
use super::usage::Usage;
use crate::cdc::progress::{Action, Core, CoreConfig, StatusUpdate};
use crate::config::Config;
use crate::delivery::EventId;
use crate::kafka::{self, Publisher, RecordRef};
use crate::lsn::Lsn;
use crate::outbox::{Mapped, OutboxMapper};
use crate::postgres::pgoutput::{Decoder, LogicalReplicationMessage};
use crate::postgres::replication::frames::{ServerFrame, StandbyStatus, pg_epoch_micros};
use crate::postgres::replication::{ReplicationConnection, ReplicationStream};

/// How often a running mode is checked (done yet?) and its process sampled.
const WATCH_INTERVAL: Duration = Duration::from_millis(20);

/// pgoutput protocol version, as the relay uses.
const PROTO_VERSION: u8 = 1;

/// One contender.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    RecvLogical,
    /// `RecvLogical` with protocol v2 streaming of large in-progress transactions.
    RecvLogicalStreaming,
    Ours,
    BrokerCeiling,
    Cdc,
    /// `Cdc` with `kafka.delivery = "exactly-once"`.
    CdcExactlyOnce,
    /// `Cdc` with `postgres.binary_decoding = false` (pgoutput text format).
    CdcText,
    /// `Cdc` with every event traced (`[traces]`, OTLP/HTTP to the bench's sink).
    CdcTraced,
    /// `RecvLogical` on a backlog of message-outbox events.
    RecvLogicalMessage,
    /// `Cdc` on a backlog of message-outbox events.
    CdcMessage,
    /// `CdcMessage` with the message ledger off (`outbox_relay.message_ledger`).
    CdcMessageUnaudited,
    Poll {
        batch: u32,
        workers: u32,
    },
}

/// The label of [`Mode::CdcExactlyOnce`] (also the steady workload's).
pub(crate) const CDC_EXACTLY_ONCE: &str = "cdc-exactly-once";
/// The label of [`Mode::CdcText`].
pub(crate) const CDC_TEXT: &str = "cdc-text";
/// The label of [`Mode::CdcTraced`].
pub(crate) const CDC_TRACED: &str = "cdc-traced";
/// The label of [`Mode::CdcMessage`].
pub(crate) const CDC_MESSAGE: &str = "cdc-message";
/// The label of [`Mode::CdcMessageUnaudited`].
pub(crate) const CDC_MESSAGE_UNAUDITED: &str = "cdc-message-unaudited";
/// The label of [`Mode::RecvLogicalMessage`].
pub(crate) const PG_CEILING_MESSAGE: &str = "pg-ceiling-recvlogical-message";

impl Mode {
    /// The name in tables and JSON.
    #[must_use]
    pub(crate) fn label(&self) -> String {
        match self {
            Mode::RecvLogical => "pg-ceiling-recvlogical".into(),
            Mode::RecvLogicalStreaming => "pg-ceiling-recvlogical-streaming".into(),
            Mode::Ours => "pg-ceiling-ours".into(),
            Mode::BrokerCeiling => "broker-ceiling".into(),
            Mode::Cdc => "cdc".into(),
            Mode::CdcExactlyOnce => CDC_EXACTLY_ONCE.into(),
            Mode::CdcText => CDC_TEXT.into(),
            Mode::CdcTraced => CDC_TRACED.into(),
            Mode::RecvLogicalMessage => PG_CEILING_MESSAGE.into(),
            Mode::CdcMessage => CDC_MESSAGE.into(),
            Mode::CdcMessageUnaudited => CDC_MESSAGE_UNAUDITED.into(),
            Mode::Poll { batch, workers } => format!("poll-b{batch}-w{workers}"),
        }
    }

    /// What the mode runs, for the table.
    #[must_use]
    pub(crate) fn settings(&self) -> String {
        match self {
            Mode::RecvLogical => "pg_recvlogical, pgoutput v1, to /dev/null".into(),
            Mode::RecvLogicalStreaming => {
                "pg_recvlogical, pgoutput v2 streaming on, to /dev/null".into()
            }
            Mode::Ours => "our client+decoder+mapper+ack tracker, null sink".into(),
            Mode::BrokerCeiling => "relay producer and window, no database".into(),
            Mode::Cdc => "outbox-relay run".into(),
            Mode::CdcExactlyOnce => "outbox-relay run, kafka.delivery = exactly-once".into(),
            Mode::CdcText => "outbox-relay run, postgres.binary_decoding = false".into(),
            Mode::CdcTraced => {
                "outbox-relay run, [traces] every event, OTLP/HTTP protobuf to a local sink".into()
            }
            Mode::RecvLogicalMessage => {
                "pg_recvlogical, pgoutput v1 messages on, message outbox, to /dev/null".into()
            }
            Mode::CdcMessage => "outbox-relay run, message outbox (outbox_emit)".into(),
            Mode::CdcMessageUnaudited => {
                "outbox-relay run, message outbox, outbox_relay.message_ledger = off".into()
            }
            Mode::Poll { batch, workers } => {
                format!("outbox-relay poll --batch-size {batch} --workers {workers}")
            }
        }
    }

    /// Whether the mode reads a replication slot.
    #[must_use]
    pub(crate) fn reads_wal(&self) -> bool {
        matches!(
            self,
            Mode::RecvLogical
                | Mode::RecvLogicalStreaming
                | Mode::Ours
                | Mode::Cdc
                | Mode::CdcExactlyOnce
                | Mode::CdcText
                | Mode::CdcTraced
                | Mode::RecvLogicalMessage
                | Mode::CdcMessage
                | Mode::CdcMessageUnaudited
        )
    }

    /// Whether the mode's records end up on the topic (and are counted there).
    #[must_use]
    pub(crate) fn delivers(&self) -> bool {
        matches!(
            self,
            Mode::Cdc
                | Mode::CdcExactlyOnce
                | Mode::CdcText
                | Mode::CdcTraced
                | Mode::CdcMessage
                | Mode::CdcMessageUnaudited
                | Mode::Poll { .. }
        )
    }

    /// How the mode's backlog is written: the ceiling of messages is measured on
    /// messages alone (no ledger), the relay on both.
    #[must_use]
    pub(crate) fn writes(&self) -> Writes {
        match self {
            Mode::CdcMessage => Writes::Messages,
            Mode::RecvLogicalMessage | Mode::CdcMessageUnaudited => Writes::UnauditedMessages,
            _ => Writes::Rows,
        }
    }

    /// Whether the mode's backlog is written with the message outbox.
    #[must_use]
    pub(crate) fn writes_messages(&self) -> bool {
        self.writes() != Writes::Rows
    }
}

/// What draining took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Drained {
    pub(crate) elapsed: Duration,
    /// CPU and peak RSS of the process doing the work (with shards: of all the
    /// relays, summed), while it did it.
    pub(crate) usage: Option<Usage>,
    /// CPU of the walsenders serving it (read from `/proc`, so only with the
    /// database on this machine), summed over the shards' slots.
    pub(crate) walsender_cpu: Option<Duration>,
}

/// Everything a mode needs to know about the backlog.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Target {
    pub(crate) events: u64,
    /// A WAL position past the last event's commit.
    pub(crate) end_lsn: Lsn,
    /// Payload size of the broker-ceiling records.
    pub(crate) payload_bytes: usize,
}

/// Drains the backlog of `fixture` with `mode`.
pub(crate) async fn drain(mode: Mode, fixture: &Fixture, target: Target) -> Result<Drained> {
    match mode {
        Mode::RecvLogical => recvlogical(fixture, target, Options::Plain).await,
        Mode::RecvLogicalStreaming => recvlogical(fixture, target, Options::Streaming).await,
        Mode::RecvLogicalMessage => recvlogical(fixture, target, Options::Messages).await,
        Mode::Ours => null_sink(&fixture.config, target).await,
        Mode::BrokerCeiling => broker_ceiling(&fixture.config, target).await,
        Mode::Cdc | Mode::CdcMessage | Mode::CdcMessageUnaudited => {
            cdc(fixture, target, Variant::AtLeastOnce).await
        }
        Mode::CdcExactlyOnce => cdc(fixture, target, Variant::ExactlyOnce).await,
        Mode::CdcText => cdc(fixture, target, Variant::Text).await,
        Mode::CdcTraced => {
            let sink = super::otlp_sink::OtlpSink::start().await?;
            let drained = cdc(fixture, target, Variant::Traced(&sink.endpoint)).await;
            sink.report(target.events);
            drained
        }
        Mode::Poll { batch, workers } => {
            let (batch, workers) = (batch.to_string(), workers.to_string());
            let args = ["poll", "--batch-size", &batch, "--workers", &workers];
            let child = RelayChild::spawn(fixture, &args)?;
            child
                .watch(target, fixture, || async {
                    Ok(!fixture.any_unsent().await?)
                })
                .await
        }
    }
}

/// One `outbox-relay run` per shard (`--shards`), all of them sampled, until the
/// slot confirms the backlog's end.
/// What a `cdc` mode changes in the relay's config.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Variant<'a> {
    AtLeastOnce,
    ExactlyOnce,
    /// `postgres.binary_decoding = false`.
    Text,
    /// `[traces]` on, every event sampled, exported to this OTLP/HTTP endpoint.
    Traced(&'a str),
}

async fn cdc(fixture: &Fixture, target: Target, variant: Variant<'_>) -> Result<Drained> {
    let exactly_once = variant == Variant::ExactlyOnce;
    if exactly_once {
        fixture.create_progress_topic().await?;
    }
    let mut children = Vec::new();
    for shard in 0..fixture.config.postgres.shards {
        let mut cmd = relay_command(fixture, &["run"])?;
        cmd.env(
            format!("{}POSTGRES__SHARD", crate::config::ENV_PREFIX),
            shard.to_string(),
        );
        if exactly_once {
            exactly_once_env(&mut cmd);
        }
        if variant == Variant::Text {
            cmd.env(
                format!("{}POSTGRES__BINARY_DECODING", crate::config::ENV_PREFIX),
                "false",
            );
        }
        if let Variant::Traced(endpoint) = variant {
            let prefix = crate::config::ENV_PREFIX;
            cmd.env(format!("{prefix}TRACES__ENABLED"), "true")
                .env(format!("{prefix}TRACES__SAMPLE_RATIO"), "1")
                .env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
                .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
                .env_remove("OTEL_TRACES_SAMPLER");
        }
        children.push(RelayChild::start(
            cmd,
            "outbox-relay run",
            &format!("{}-{shard}", fixture.name),
        )?);
    }
    let mut children = children.into_iter();
    let Some(first) = children.next() else {
        return Err(BenchError::NoModes);
    };
    first
        .with_siblings(children.collect())
        .watch(target, fixture, || async {
            Ok(fixture.confirmed_flush().await? >= target.end_lsn)
        })
        .await
}

/// Makes a relay command of [`relay_command`] deliver exactly once.
pub(crate) fn exactly_once_env(cmd: &mut tokio::process::Command) {
    cmd.env(
        format!("{}KAFKA__DELIVERY", crate::config::ENV_PREFIX),
        "exactly-once",
    );
}

/// Generous bound for one drain: at least 1,000 events/s, plus start-up.
fn deadline_for(target: Target) -> Duration {
    Duration::from_secs(60 + target.events / 1000)
}

// ---------------------------------------------------------------------------
// Child processes
// ---------------------------------------------------------------------------

/// `outbox-relay <args> --config <fixture config>` (this very binary), with no
/// `OUTBOX_RELAY__` variables inherited: they would override the run's unique
/// names.
pub(crate) fn relay_command(fixture: &Fixture, args: &[&str]) -> Result<tokio::process::Command> {
    let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
    cmd.args(args).arg("--config").arg(&fixture.config_path);
    for (name, _) in std::env::vars_os() {
        let inherited_override = name.to_str().is_some_and(|n| {
            n.starts_with(crate::config::ENV_PREFIX) || n == "OUTBOX_RELAY_CONFIG"
        });
        if inherited_override {
            cmd.env_remove(name);
        }
    }
    Ok(cmd)
}

/// A child process of this binary (or `pg_recvlogical`) with its stderr in a file.
struct RelayChild {
    child: tokio::process::Child,
    pid: String,
    log: PathBuf,
    started: Instant,
    what: String,
    /// The other shards' relays: sampled with this one, stopped with it.
    siblings: Vec<RelayChild>,
}

impl RelayChild {
    /// `outbox-relay <args>` for the fixture (see [`relay_command`]).
    fn spawn(fixture: &Fixture, args: &[&str]) -> Result<RelayChild> {
        let cmd = relay_command(fixture, args)?;
        RelayChild::start(
            cmd,
            &format!("outbox-relay {}", args.join(" ")),
            &fixture.name,
        )
    }

    fn start(mut cmd: tokio::process::Command, what: &str, name: &str) -> Result<RelayChild> {
        let log = std::env::temp_dir().join(format!("outbox-relay-{name}.log"));
        let stderr = std::fs::File::create(&log)?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr))
            .kill_on_drop(true);
        let started = Instant::now();
        let child = cmd.spawn().map_err(|source| BenchError::Spawn {
            what: what.to_owned(),
            source,
        })?;
        let pid = child.id().map(|p| p.to_string()).unwrap_or_default();
        Ok(RelayChild {
            child,
            pid,
            log,
            started,
            what: what.to_owned(),
            siblings: Vec::new(),
        })
    }

    fn with_siblings(mut self, siblings: Vec<RelayChild>) -> RelayChild {
        self.siblings = siblings;
        self
    }

    /// This child's and its siblings' counters, summed.
    fn sample(&self, last: Option<Usage>) -> Option<Usage> {
        let pids: Vec<&str> = std::iter::once(self.pid.as_str())
            .chain(self.siblings.iter().map(|s| s.pid.as_str()))
            .collect();
        sample(&pids, last)
    }

    /// Samples the child until `done` says so (then stops it) or it exits: an exit
    /// with success counts as done (`pg_recvlogical --endpos`), any other as a failure.
    async fn watch<F, Fut>(
        mut self,
        target: Target,
        fixture: &Fixture,
        mut done: F,
    ) -> Result<Drained>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool>>,
    {
        let deadline = self.started + deadline_for(target);
        let mut last = None;
        let mut walsenders = Walsenders::default();
        let mut tick = tokio::time::interval(WATCH_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let outcome = loop {
            tokio::select! {
                status = self.child.wait() => {
                    let elapsed = self.started.elapsed();
                    break match status {
                        Ok(s) if s.success() => Ok(elapsed),
                        Ok(s) => Err(self.failure(&format!("exited with {s}"))),
                        Err(e) => Err(e.into()),
                    };
                }
                _ = tick.tick() => {
                    last = self.sample(last);
                    walsenders.sample(fixture).await;
                    if let Some(sibling) = self.siblings.iter_mut().find_map(|s| {
                        s.child.try_wait().ok().flatten().map(|status| (s.what.clone(), status))
                    }) {
                        break Err(self.failure(&format!("a sibling {} exited with {}", sibling.0, sibling.1)));
                    }
                    if done().await? {
                        let elapsed = self.started.elapsed();
                        last = self.sample(last);
                        walsenders.sample(fixture).await;
                        break Ok(elapsed);
                    }
                    if Instant::now() > deadline {
                        break Err(self.failure("did not finish in time"));
                    }
                }
            }
        };
        let _ = self.child.start_kill();
        for sibling in &mut self.siblings {
            let _ = sibling.child.start_kill();
            let _ = sibling.child.wait().await;
        }
        let _ = self.child.wait().await;
        let elapsed = outcome?;
        let _ = std::fs::remove_file(&self.log);
        for sibling in &self.siblings {
            let _ = std::fs::remove_file(&sibling.log);
        }
        Ok(Drained {
            elapsed,
            usage: last,
            walsender_cpu: walsenders.total(),
        })
    }

    fn failure(&self, what: &str) -> BenchError {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(10).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        BenchError::Child {
            what: self.what.clone(),
            message: format!("{what}; last log lines:\n{}", tail.join("\n")),
        }
    }
}

// ---------------------------------------------------------------------------
// pg_recvlogical
// ---------------------------------------------------------------------------

/// What `pg_recvlogical` asks pgoutput for besides protocol version 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Options {
    Plain,
    /// Protocol v2, `streaming 'on'`.
    Streaming,
    /// `messages 'true'` (the message outbox).
    Messages,
}

async fn recvlogical(fixture: &Fixture, target: Target, options: Options) -> Result<Drained> {
    let mut cmd = recvlogical_command(fixture, options)?;
    cmd.arg("--endpos").arg(target.end_lsn.to_string());
    let child = RelayChild::start(cmd, "pg_recvlogical", &fixture.name)?;
    child.watch(target, fixture, || async { Ok(false) }).await
}

/// `pg_recvlogical` streaming the fixture's slot from where it stands to
/// `/dev/null` with `options`, until it is stopped (or given `--endpos`).
pub(crate) fn recvlogical_command(
    fixture: &Fixture,
    options: Options,
) -> Result<tokio::process::Command> {
    let Some(exe) = find_pg_tool("pg_recvlogical") else {
        return Err(BenchError::Missing(
            "pg_recvlogical (install the PostgreSQL client/server binaries)".into(),
        ));
    };
    let config = &fixture.config;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.arg("--dbname")
        .arg(&config.postgres.url)
        .arg("--slot")
        .arg(&config.postgres.slot)
        .arg("--start")
        .arg("--no-loop")
        .args(match options {
            Options::Streaming => ["-o", "proto_version=2", "-o", "streaming=on"].as_slice(),
            Options::Messages => ["-o", "proto_version=1", "-o", "messages=true"].as_slice(),
            Options::Plain => ["-o", "proto_version=1"].as_slice(),
        })
        .arg("-o")
        .arg(format!("publication_names={}", config.postgres.publication))
        .args(["--file", "/dev/null", "--fsync-interval", "0"]);
    Ok(cmd)
}

/// A PostgreSQL client tool on `PATH` or in `/usr/lib/postgresql/*/bin` (newest).
fn find_pg_tool(name: &str) -> Option<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| {
        let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path().join("bin").join(name)))
            .filter(|p| p.is_file())
            .collect();
        // /usr/lib/postgresql/<major>/bin/<name>: newest major last.
        found.sort_by_key(|p| {
            p.iter()
                .nth(4)
                .and_then(|v| v.to_str()?.parse::<u32>().ok())
                .unwrap_or(0)
        });
        found.pop()
    })
}

// ---------------------------------------------------------------------------
// Our replication client with a null sink
// ---------------------------------------------------------------------------

/// The relay's read path — replication client, pgoutput decoder, outbox mapper,
/// ack tracker with its status updates — with every event acked at once.
async fn null_sink(config: &Config, target: Target) -> Result<Drained> {
    Usage::reset_self_peak();
    let before = Usage::of_self();
    let started = Instant::now();
    let conninfo = crate::postgres::parse_url(&config.postgres.url)?;
    let conn = ReplicationConnection::connect(&conninfo)
        .await
        .map_err(replication_error)?;
    let publication = config.postgres.publication.as_str();
    let mut stream = conn
        .start_logical_replication(
            &config.postgres.slot,
            Lsn::ZERO,
            &[publication],
            PROTO_VERSION,
        )
        .await
        .map_err(replication_error)?;
    let mapper =
        OutboxMapper::new(&config.outbox, &config.kafka, None).map_err(BenchError::Mapper)?;
    let core = Core::new(
        CoreConfig {
            max_in_flight_events: config.relay.max_in_flight_events,
            max_in_flight_bytes: config.relay.max_in_flight_bytes,
            ..CoreConfig::default()
        },
        Lsn::ZERO,
        Instant::now(),
    );
    let mut sink = NullSink {
        core,
        mapper,
        decoder: Decoder::new(PROTO_VERSION),
        commit_lsn: Lsn::ZERO,
        events: 0,
    };
    let deadline = started + deadline_for(target);
    while sink.events < target.events || sink.core.in_transaction() {
        let frame = tokio::time::timeout_at(deadline.into(), stream.next_frame())
            .await
            .map_err(|_| BenchError::Child {
                what: "pg-ceiling-ours".into(),
                message: format!(
                    "only {} of {} events read in time",
                    sink.events, target.events
                ),
            })?
            .map_err(replication_error)?;
        let Some(frame) = frame else {
            return Err(BenchError::StreamEnded);
        };
        sink.on_frame(frame)?;
        sink.execute(&mut stream).await?;
    }
    let elapsed = started.elapsed();
    let status = sink.core.shutdown_status();
    send_status(&mut stream, status).await?;
    let _ = stream.finish().await;
    Ok(Drained {
        elapsed,
        usage: usage_since(before),
        walsender_cpu: None,
    })
}

struct NullSink {
    core: Core,
    mapper: OutboxMapper,
    decoder: Decoder,
    commit_lsn: Lsn,
    events: u64,
}

impl NullSink {
    fn on_frame(&mut self, frame: ServerFrame) -> Result<()> {
        let now = Instant::now();
        match frame {
            ServerFrame::XLogData { wal_end, data, .. } => {
                self.core.received(wal_end);
                match self
                    .decoder
                    .decode(data)
                    .map_err(|e| BenchError::Stream(e.into()))?
                {
                    LogicalReplicationMessage::Begin(b) => {
                        self.commit_lsn = b.final_lsn;
                        self.core
                            .begin(b.final_lsn, b.xid)
                            .map_err(|e| BenchError::Stream(e.into()))?;
                    }
                    LogicalReplicationMessage::Relation(r) => {
                        self.mapper.on_relation(&r);
                    }
                    LogicalReplicationMessage::Insert(insert) => {
                        let mapped = self
                            .mapper
                            .map_insert(&insert, self.commit_lsn)
                            .map_err(|e| BenchError::Stream(e.into()))?;
                        if let Mapped::Event(event) = mapped {
                            self.core
                                .admit(event.byte_size(), now)
                                .map_err(|e| BenchError::Stream(e.into()))?;
                            self.events += 1;
                        }
                    }
                    LogicalReplicationMessage::Commit(c) => {
                        self.core
                            .commit(c.commit_lsn, c.end_lsn, now)
                            .map_err(|e| BenchError::Stream(e.into()))?;
                    }
                    _ => {}
                }
            }
            ServerFrame::Keepalive {
                wal_end,
                reply_requested,
                ..
            } => self.core.keepalive(wal_end, reply_requested, now),
        }
        Ok(())
    }

    /// Produce actions are acked and saves taken as written on the spot (the core
    /// alone, without a broker or a position table); status updates go to the server.
    async fn execute(&mut self, stream: &mut ReplicationStream) -> Result<()> {
        while let Some(action) = self.core.next_action() {
            match action {
                Action::Produce { id, .. } => self.core.delivered(id, Instant::now()),
                Action::InsertPoison { id, .. } => self.core.poison_committed(id, Instant::now()),
                Action::Save { lsn, .. } => self.core.saved(lsn, Instant::now()),
                Action::SendStatus(status) => send_status(stream, status).await?,
                // Kafka transactions commit on the spot too (no broker here).
                Action::CommitTransaction => self.core.transaction_committed(Instant::now()),
                Action::AbortTransaction => self.core.transaction_aborted(Instant::now()),
            }
        }
        // No records here: the resolved ids are dropped, or the log would grow with
        // the run (and inflate the peak memory it reports).
        self.core.drain_resolved().for_each(drop);
        Ok(())
    }
}

async fn send_status(stream: &mut ReplicationStream, status: StatusUpdate) -> Result<()> {
    let frame = StandbyStatus {
        write: status.write,
        flush: status.flush,
        apply: status.apply,
        client_time_micros: pg_epoch_micros(std::time::SystemTime::now()),
        reply_requested: false,
    };
    stream.send_status(&frame).await.map_err(replication_error)
}

fn replication_error(e: crate::postgres::replication::ReplicationError) -> BenchError {
    BenchError::from(crate::postgres::process_error(e, ""))
}

/// This process's CPU since `before`, and its peak RSS since the last reset.
fn usage_since(before: Option<Usage>) -> Option<Usage> {
    let (before, after) = (before?, Usage::of_self()?);
    Some(Usage {
        cpu: after.cpu.saturating_sub(before.cpu),
        peak_rss_kib: after.peak_rss_kib,
        io_calls: after.io_calls.saturating_sub(before.io_calls),
    })
}

// ---------------------------------------------------------------------------
// Broker ceiling
// ---------------------------------------------------------------------------

/// The relay's producer alone: `target.events` records of the workload's size and
/// shape (key, the relay's headers), the relay's in-flight window kept full.
async fn broker_ceiling(config: &Config, target: Target) -> Result<Drained> {
    Usage::reset_self_peak();
    let before = Usage::of_self();
    let started = Instant::now();
    let producer_config = kafka::producer_config(&config.kafka, &config.relay)?;
    let (publisher, mut reports) =
        Publisher::new(producer_config, kafka::report_capacity(&config.relay))?;
    publisher.check_broker(Duration::from_secs(10)).await?;
    let topic = config.kafka.topic_template.as_str();
    let payload = vec![b'x'; target.payload_bytes];
    let window = u64::try_from(config.relay.max_in_flight_events.max(1)).unwrap_or(u64::MAX);
    let occurred_at = chrono::Utc::now().to_rfc3339();
    let deadline = started + deadline_for(target);
    let (mut sent, mut acked) = (0u64, 0u64);
    while acked < target.events {
        while sent < target.events && sent - acked < window {
            let key = format!("order-{}", sent % 1000);
            let idempotency_key = uuid::Uuid::now_v7().to_string();
            let headers: [(&str, &[u8]); 4] = [
                ("idempotency_key", idempotency_key.as_bytes()),
                ("event_type", b"OrderPlaced"),
                ("aggregate_type", b"order"),
                ("occurred_at", occurred_at.as_bytes()),
            ];
            let record = RecordRef {
                topic,
                key: key.as_bytes(),
                payload: &payload,
                headers: &headers,
                timestamp_ms: None,
            };
            match publisher.send(EventId::from_raw(sent + 1), record) {
                Ok(()) => sent += 1,
                // librdkafka's queue is full: wait for reports below, then go on.
                Err(rejected) if rejected.failure == crate::delivery::Failure::Transient => break,
                Err(rejected) => {
                    return Err(BenchError::Child {
                        what: "broker-ceiling".into(),
                        message: rejected.message,
                    });
                }
            }
        }
        let report = tokio::time::timeout_at(deadline.into(), reports.recv())
            .await
            .map_err(|_| BenchError::Child {
                what: "broker-ceiling".into(),
                message: format!("only {acked} of {} records acked in time", target.events),
            })?
            .ok_or(BenchError::ReportsClosed)?;
        acked += count_ok(report)?;
        while let Ok(report) = reports.try_recv() {
            acked += count_ok(report)?;
        }
    }
    let elapsed = started.elapsed();
    drop(publisher);
    Ok(Drained {
        elapsed,
        usage: usage_since(before),
        walsender_cpu: None,
    })
}

fn count_ok(report: kafka::DeliveryReport) -> Result<u64> {
    match report.result {
        Ok(_) => Ok(1),
        Err((code, message)) => Err(BenchError::Child {
            what: "broker-ceiling".into(),
            message: format!("delivery failed ({code:?}): {message}"),
        }),
    }
}

// ---------------------------------------------------------------------------
// Counting what reached the topic
// ---------------------------------------------------------------------------

/// Reads the topic from offset 0 until `expected` distinct offsets were seen or
/// nothing arrived for `idle`; returns how many it saw.
pub(crate) async fn count_on_topic(config: &Config, expected: u64, idle: Duration) -> Result<u64> {
    let brokers = config.kafka.brokers.clone();
    let topic = config.kafka.topic_template.clone();
    let mut consumer_config = ClientConfig::new();
    consumer_config
        .set("bootstrap.servers", &brokers)
        .set("group.id", format!("{topic}-count"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        // Tansu 0.6 may answer a fetch at the very end "offset out of range"; from
        // the earliest offset nothing is skipped (already-seen offsets are ignored).
        .set("auto.offset.reset", "earliest");
    for (key, value) in &config.kafka.producer {
        if key.starts_with("security.") || key.starts_with("sasl.") || key.starts_with("ssl.") {
            consumer_config.set(key, value);
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let _stop_on_drop = StopOnDrop(Arc::clone(&stop));
    tokio::task::spawn_blocking(move || {
        count_blocking(&consumer_config, &topic, expected, idle, &stop)
    })
    .await
    .map_err(BenchError::Task)?
}

/// Sets its flag when dropped: a consumer loop on a blocking thread watches it,
/// so an interrupted (dropped) caller stops the loop and the consumer is closed
/// before the process exits.
#[derive(Debug)]
pub(crate) struct StopOnDrop(pub(crate) Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

fn count_blocking(
    cfg: &ClientConfig,
    topic: &str,
    expected: u64,
    idle: Duration,
    stop: &AtomicBool,
) -> Result<u64> {
    let consumer: BaseConsumer = cfg.create()?;
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let mut assignment = TopicPartitionList::new();
    for t in metadata.topics().iter().filter(|t| t.name() == topic) {
        for p in t.partitions() {
            assignment.add_partition_offset(topic, p.id(), Offset::Offset(0))?;
        }
    }
    consumer.assign(&assignment)?;
    let mut next: std::collections::HashMap<i32, i64> = std::collections::HashMap::new();
    let mut seen = 0u64;
    let mut last_progress = Instant::now();
    while seen < expected && last_progress.elapsed() < idle && !stop.load(Ordering::Acquire) {
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(m)) => {
                let expected_offset = next.entry(m.partition()).or_insert(0);
                if m.offset() >= *expected_offset {
                    *expected_offset = m.offset() + 1;
                    seen += 1;
                    last_progress = Instant::now();
                }
            }
            Some(Err(e)) => tracing::debug!(error = %e, "consumer error while counting"),
            None => {}
        }
    }
    Ok(seen)
}

/// A new reading of the children's counters (summed over `pids`) folded into the
/// previous one (the peak is the highest seen; see [`Usage::then`]); the previous one
/// when they are gone.
fn sample(pids: &[&str], last: Option<Usage>) -> Option<Usage> {
    let now = pids
        .iter()
        .filter_map(|pid| Usage::read(pid))
        .reduce(|a, b| Usage {
            cpu: a.cpu + b.cpu,
            peak_rss_kib: a.peak_rss_kib + b.peak_rss_kib,
            io_calls: a.io_calls + b.io_calls,
        });
    match (last, now) {
        (Some(last), Some(now)) => Some(last.then(now)),
        (last, now) => now.or(last),
    }
}

/// The CPU time of the walsenders streaming the run's slots, by process: each is
/// read while it lives, and its last reading counts.
#[derive(Debug, Default)]
struct Walsenders {
    cpu: std::collections::HashMap<String, Duration>,
}

impl Walsenders {
    async fn sample(&mut self, fixture: &Fixture) {
        for pid in fixture.walsender_pids().await {
            if let Some(usage) = Usage::read(&pid) {
                let seen = self.cpu.entry(pid).or_default();
                *seen = (*seen).max(usage.cpu);
            }
        }
    }

    fn total(&self) -> Option<Duration> {
        (!self.cpu.is_empty()).then(|| self.cpu.values().sum())
    }
}
