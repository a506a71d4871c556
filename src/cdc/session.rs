//! The CDC relay: the async shell around the sans-IO core (`crate::cdc::progress::Core`).
//!
//! One task owns the replication stream. Its loop is a `tokio::select! { biased; … }`
//! whose priorities are, in order:
//!
//! 1. **shutdown** — stop reading, drain in-flight acks (bounded), send the final status;
//! 2. **delivery reports** — they free window room and move the watermark;
//! 3. **poison-insert outcomes** — same;
//! 4. **the core's timer** — status-update deadline and retry backoffs;
//! 5. **the next replication frame** — taken only while the in-flight window has room
//!    (`Core::can_read`). When it is full the socket is simply not read: TCP
//!    back-pressure reaches the walsender, and memory stays bounded whatever the
//!    backlog or transaction size.
//!
//! After every wake-up the core's actions are executed: produce (never awaited — the
//! delivery report arrives later on its channel), insert a poison row (handed to the
//! poison task), send a standby status update. Status updates are therefore sent even
//! while reading is paused, which keeps the walsender from timing us out.
//!
//! Connection loss, a protocol violation in the stream, or a PostgreSQL restart end
//! the *session*, not the process: the relay reconnects with backoff and restarts from
//! the slot's `confirmed_flush_lsn`, which is always safe (the server re-sends every
//! transaction not yet confirmed; the in-flight window bounds the duplicates). Fatal
//! conditions (prerequisites, authentication, invalidated slot) end the process with
//! a distinct exit code.
//!
//! This file is the loop. What it keeps per in-flight event (the record to produce
//! again, the row to poison) is in `in_flight.rs`, its metric handles in
//! `instruments.rs`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::cdc::heartbeat::{self, HeartbeatConfig};
use crate::cdc::in_flight::{InFlight, order_key};
use crate::cdc::instruments::Instruments;
use crate::cdc::metrics::Health;
use crate::cdc::progress::{Action, Core, CoreConfig, ProtocolError, StatusUpdate};
use crate::config::Config;
use crate::delivery::ErrorClass;
use crate::delivery::{EventId, Failure};
use crate::error::{Error, Result};
use crate::kafka::{self, BrokerError, BrokerUnavailable, DeliveryReport, Publisher};
use crate::lifecycle::{Backoff, Shutdown, millis, sleep_or_shutdown};
use crate::lsn::Lsn;
use crate::outbox::{MapError, Mapped, OutboxMapper};
use crate::poison::{PoisonOutcome, PoisonRequest, PoisonWriter};
use crate::postgres::conninfo::ConnInfo;
use crate::postgres::pgoutput::{DecodeError, Decoder, LogicalReplicationMessage};
use crate::postgres::replication::frames::{ServerFrame, StandbyStatus, pg_epoch_micros};
use crate::postgres::replication::{ReplicationConnection, ReplicationError, ReplicationStream};
use crate::postgres::slot::{self, SlotState};

/// pgoutput protocol version requested. v1 sends each transaction whole at commit,
/// which is what the ack tracker models (one transaction at a time).
const PROTO_VERSION: u8 = 1;

/// pgoutput sends logical-decoding messages (our heartbeats) from this server
/// version on (`messages` option).
const MESSAGES_OPTION_SINCE: u32 = 140_000;

/// Slot sampling period when the heartbeat itself is off.
const SLOT_SAMPLE_INTERVAL: Duration = Duration::from_secs(10);

/// Reconnect backoff after a lost replication session.
const RECONNECT_BACKOFF_INITIAL: Duration = Duration::from_millis(200);
const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// What a finished `run` reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Events acknowledged by the broker in this process.
    pub delivered: u64,
    /// Events written to the poison table in this process.
    pub poisoned: u64,
    /// The last confirmed LSN sent to the server.
    pub confirmed: Lsn,
    /// Replication sessions that ended and were reconnected.
    pub reconnects: u64,
}

/// Why a replication session ended.
#[derive(Debug)]
enum SessionEnd {
    /// Graceful shutdown finished.
    Shutdown,
    /// Reconnect after this (transient) reason.
    Lost(Lost),
}

/// Why a session was lost: the relay reconnects and restarts from the slot, which is
/// always safe. The text is the reason logged with "replication session lost".
#[derive(Debug, thiserror::Error)]
enum Lost {
    /// The connection failed (transiently) or a status update could not be sent.
    #[error(transparent)]
    Connection(#[from] ReplicationError),
    /// The server ended the CopyBoth stream.
    #[error("the server ended the replication stream")]
    StreamEnded,
    /// A frame could not be trusted.
    #[error(transparent)]
    Frame(#[from] FrameError),
}

/// A replication frame the relay cannot make sense of: the stream is inconsistent
/// from here on, so the session ends (see [`Relay::on_frame`]).
#[derive(Debug, thiserror::Error)]
enum FrameError {
    /// The XLogData payload is not a pgoutput message.
    #[error("undecodable pgoutput message: {0}")]
    Decode(#[source] DecodeError),
    /// An Insert does not match the relation it names.
    #[error(transparent)]
    Map(#[from] MapError),
    /// The transaction framing was violated (or the window contract, by us).
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
}

/// Runs the CDC relay until `shutdown` completes or a fatal error occurs.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<RunSummary> {
    run_with_health(config, shutdown, Health::default()).await
}

/// [`run`], reporting streaming state and progress to `health` (for `/readyz`).
pub async fn run_with_health(
    config: Config,
    mut shutdown: Shutdown,
    health: Health,
) -> Result<RunSummary> {
    let conninfo = crate::postgres::parse_url(&config.postgres.url)?;
    let Some(metadata) = connect_when_reachable(&conninfo, &mut shutdown).await? else {
        return Ok(RunSummary::default());
    };
    let prerequisites = slot::check_prerequisites(&metadata, &config).await?;
    tracing::info!(
        server_version = %prerequisites.server_version,
        wal_sender_timeout_ms = millis(prerequisites.wal_sender_timeout),
        "connected to PostgreSQL"
    );

    let producer_config = kafka::producer_config(&config.kafka, &config.relay)?;
    let (publisher, reports) =
        Publisher::new(producer_config, kafka::report_capacity(&config.relay))?;
    publisher.check_broker(Duration::from_secs(10)).await?;
    tracing::info!(brokers = %config.kafka.brokers, "connected to Kafka");

    let mapper = OutboxMapper::new(&config.outbox, &config.kafka, config.kafka.envelope.clone())?;

    let (poison_tx, poison_rx) = mpsc::channel(config.relay.max_in_flight_events.max(1));
    let (outcome_tx, outcomes) = mpsc::channel(config.relay.max_in_flight_events.max(1));
    let writer = PoisonWriter::new(conninfo.clone(), &config.outbox.poison_table);
    tokio::spawn(crate::poison::run_writer(writer, poison_rx, outcome_tx));

    let core_config = CoreConfig {
        max_in_flight_events: config.relay.max_in_flight_events,
        max_in_flight_bytes: config.relay.max_in_flight_bytes,
        max_attempts: config.relay.max_attempts,
        status_interval: prerequisites.status_interval(),
        ..CoreConfig::default()
    };
    drop(metadata);
    let heartbeat_secs = config.relay.heartbeat_interval_secs;
    let _heartbeat = AbortOnDrop(tokio::spawn(heartbeat::run(HeartbeatConfig {
        conninfo: conninfo.clone(),
        slot: config.postgres.slot.clone(),
        interval: if heartbeat_secs == 0 {
            SLOT_SAMPLE_INTERVAL
        } else {
            Duration::from_secs(heartbeat_secs)
        },
        emit: heartbeat_secs > 0,
    })));
    let mut relay = Relay {
        config,
        conninfo,
        core: Core::new(core_config, Lsn::ZERO, Instant::now()),
        pending: HashMap::new(),
        mapper,
        publisher,
        reports,
        poison_tx,
        outcomes,
        current_commit_lsn: Lsn::ZERO,
        current_commit_time: 0,
        summary: RunSummary::default(),
        wal_sender_timeout: prerequisites.wal_sender_timeout,
        messages_option: prerequisites.server_version_num >= MESSAGES_OPTION_SINCE,
        health,
        instruments: Instruments::new(),
    };
    relay.run(shutdown).await
}

/// Opens the first metadata connection, waiting with backoff while PostgreSQL is
/// unreachable or starting up (a transient condition: the relay may start before
/// its database). Fatal errors (authentication, TLS, missing database) return at
/// once; `None` when shutdown came first.
async fn connect_when_reachable(
    conninfo: &ConnInfo,
    shutdown: &mut Shutdown,
) -> Result<Option<tokio_postgres::Client>> {
    let mut backoff = Backoff::new(RECONNECT_BACKOFF_INITIAL, RECONNECT_BACKOFF_MAX);
    let mut logged = false;
    loop {
        match crate::postgres::connect_info(conninfo).await {
            Ok(client) => return Ok(Some(client)),
            Err(e) if e.class() == ErrorClass::Transient => {
                if !logged {
                    tracing::warn!(error = %e, "PostgreSQL unreachable; retrying with backoff");
                    logged = true;
                }
            }
            Err(e) => return Err(e.into()),
        }
        if sleep_or_shutdown(shutdown, backoff.next_pause()).await {
            return Ok(None);
        }
    }
}

/// Aborts a background task when dropped (the heartbeat stops with the relay).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Relay {
    config: Config,
    conninfo: ConnInfo,
    core: Core,
    pending: HashMap<EventId, InFlight>,
    mapper: OutboxMapper,
    publisher: Publisher,
    reports: mpsc::Receiver<DeliveryReport>,
    poison_tx: mpsc::Sender<PoisonRequest>,
    outcomes: mpsc::Receiver<PoisonOutcome>,
    /// Commit LSN of the open transaction (from its Begin), for `source_lsn`.
    current_commit_lsn: Lsn,
    /// Commit time of the open transaction (from its Begin), for the latency metric.
    current_commit_time: i64,
    summary: RunSummary,
    /// After a lost connection the server keeps our old walsender (and so the slot)
    /// until it notices, at most this long.
    wal_sender_timeout: Duration,
    /// Ask pgoutput for logical-decoding messages (heartbeats); PostgreSQL 14+.
    messages_option: bool,
    health: Health,
    instruments: Instruments,
}

impl Relay {
    async fn run(&mut self, mut shutdown: Shutdown) -> Result<RunSummary> {
        let mut backoff = Backoff::new(RECONNECT_BACKOFF_INITIAL, RECONNECT_BACKOFF_MAX);
        let mut first = true;
        loop {
            let stream = tokio::select! {
                biased;
                () = &mut shutdown => return Ok(self.summary.clone()),
                stream = self.start_session(first) => stream,
            };
            first = false;
            let stream = match stream {
                Ok(stream) => stream,
                Err(e) if e.class() == ErrorClass::Transient => {
                    let pause = backoff.next_pause();
                    tracing::warn!(error = %e, retry_in_ms = millis(pause), "cannot start replication; retrying");
                    if sleep_or_shutdown(&mut shutdown, pause).await {
                        return Ok(self.summary.clone());
                    }
                    continue;
                }
                Err(e) => return Err(e),
            };
            self.health.set_streaming(true, Instant::now());
            let ended = self.stream(stream, &mut shutdown).await;
            self.health.set_streaming(false, Instant::now());
            match ended? {
                SessionEnd::Shutdown => return Ok(self.summary.clone()),
                SessionEnd::Lost(reason) => {
                    self.summary.reconnects += 1;
                    self.instruments.reconnect();
                    tracing::warn!(%reason, confirmed = %self.core.confirmed(), "replication session lost; reconnecting");
                    // A session that streamed starts the backoff over.
                    backoff.reset();
                    if sleep_or_shutdown(&mut shutdown, backoff.peek()).await {
                        return Ok(self.summary.clone());
                    }
                }
            }
        }
    }

    /// Connects, makes sure the slot exists and is ours, and starts streaming from
    /// its confirmed LSN with a fresh core (event ids continue across sessions).
    async fn start_session(&mut self, first: bool) -> Result<ReplicationStream> {
        // A fresh metadata connection per session: the previous one may have died
        // with the server.
        let mut metadata = crate::postgres::connect_info(&self.conninfo).await?;
        let mut conn = ReplicationConnection::connect(&self.conninfo)
            .await
            .map_err(replication_error)?;
        // A missing slot (or an interrupted cutover) first gets the backlog the
        // poller had not sent; then the slot exists and streaming starts at its
        // consistent point.
        crate::cdc::cutover::prepare(
            &self.config,
            &self.conninfo,
            &mut conn,
            &mut metadata,
            crate::cdc::cutover::Trigger::Run(self.config.relay.cutover),
        )
        .await?;
        let slot_name = self.config.postgres.slot.clone();
        let mut busy_timeout = Duration::from_secs(self.config.relay.slot_busy_timeout_secs);
        if !first {
            // On a reconnect the slot may still be held by our own previous
            // walsender (e.g. after a network cut) until wal_sender_timeout.
            busy_timeout = busy_timeout.max(self.wal_sender_timeout * 2);
        }
        let state = slot::wait_for_slot(&mut conn, &metadata, &slot_name, busy_timeout).await?;
        let start = match state {
            SlotState::Created(created) => {
                tracing::info!(slot = %slot_name, consistent_point = %created.consistent_point, "replication slot created");
                created.consistent_point
            }
            SlotState::Existing { confirmed_flush } => confirmed_flush,
        };
        let now = Instant::now();
        let core = std::mem::replace(
            &mut self.core,
            Core::new(CoreConfig::default(), Lsn::ZERO, now),
        );
        self.core = if first {
            Core::new(core.config().clone(), start, now)
        } else {
            core.restart(start, now)
        };
        self.pending.clear();
        self.mapper.reset_session();
        let publications = crate::postgres::replication::publication_names_option(&[self
            .config
            .postgres
            .publication
            .as_str()]);
        let version = PROTO_VERSION.to_string();
        let mut options = vec![
            ("proto_version", version.as_str()),
            ("publication_names", publications.as_str()),
        ];
        if self.messages_option {
            options.push(("messages", "true"));
        }
        let stream = conn
            .start_replication_with_options(&slot_name, start, &options)
            .await
            .map_err(|e| {
                // Lost a race for the slot (e.g. with the walsender of a relay that
                // just died): retry; wait_for_slot applies the busy timeout.
                if e.is_slot_in_use() {
                    Error::RelaySlotTaken(e)
                } else {
                    replication_error(e)
                }
            })?;
        tracing::info!(slot = %slot_name, from = %start, "streaming");
        Ok(stream)
    }

    /// The replication loop of one session.
    async fn stream(
        &mut self,
        mut stream: ReplicationStream,
        shutdown: &mut Shutdown,
    ) -> Result<SessionEnd> {
        let timer = tokio::time::sleep(Duration::from_secs(3600));
        tokio::pin!(timer);
        loop {
            if let Err(e) = self.execute_actions(&mut stream).await {
                return Ok(SessionEnd::Lost(e.into()));
            }
            self.instruments.observe(&self.core, &self.health);
            if let Some(deadline) = self.core.next_deadline() {
                timer
                    .as_mut()
                    .reset(tokio::time::Instant::from_std(deadline));
            }
            let has_deadline = self.core.next_deadline().is_some();
            let can_read = self.core.can_read();
            tokio::select! {
                biased;
                () = &mut *shutdown => {
                    return self.graceful_shutdown(stream).await;
                }
                report = self.reports.recv() => {
                    let Some(report) = report else {
                        return Err(Error::DeliveryChannelClosed);
                    };
                    self.on_report(report)?;
                    while let Ok(report) = self.reports.try_recv() {
                        self.on_report(report)?;
                    }
                }
                outcome = self.outcomes.recv() => {
                    let Some(outcome) = outcome else {
                        return Err(Error::RelayPoisonWriterStopped);
                    };
                    self.on_poison_outcome(outcome);
                }
                () = &mut timer, if has_deadline => {
                    self.core.tick(Instant::now());
                }
                frame = stream.next_frame(), if can_read => {
                    match frame {
                        Ok(Some(frame)) => {
                            if let Err(reason) = self.on_frame(frame) {
                                return Ok(SessionEnd::Lost(reason.into()));
                            }
                        }
                        Ok(None) => return Ok(SessionEnd::Lost(Lost::StreamEnded)),
                        Err(e) if e.is_transient() => return Ok(SessionEnd::Lost(e.into())),
                        Err(e) => return Err(replication_error(e)),
                    }
                }
            }
        }
    }

    /// Handles one frame of the CopyBoth stream. An `Err` ends the session (the
    /// stream is inconsistent; restarting from the slot is always safe).
    fn on_frame(&mut self, frame: ServerFrame) -> std::result::Result<(), FrameError> {
        let now = Instant::now();
        match frame {
            ServerFrame::XLogData { wal_end, data, .. } => {
                self.core.received(wal_end);
                let message = Decoder::new(PROTO_VERSION)
                    .decode(data)
                    .map_err(FrameError::Decode)?;
                self.on_message(message, now)
            }
            ServerFrame::Keepalive {
                wal_end,
                reply_requested,
                ..
            } => {
                self.core.keepalive(wal_end, reply_requested, now);
                Ok(())
            }
        }
    }

    fn on_message(
        &mut self,
        message: LogicalReplicationMessage,
        now: Instant,
    ) -> std::result::Result<(), FrameError> {
        match message {
            LogicalReplicationMessage::Begin(begin) => {
                tracing::trace!(xid = begin.xid, final_lsn = %begin.final_lsn, "begin");
                self.current_commit_lsn = begin.final_lsn;
                self.current_commit_time = begin.commit_time;
                Ok(self.core.begin(begin.final_lsn, begin.xid)?)
            }
            LogicalReplicationMessage::Commit(commit) => {
                tracing::trace!(commit_lsn = %commit.commit_lsn, end_lsn = %commit.end_lsn, "commit");
                Ok(self.core.commit(commit.commit_lsn, commit.end_lsn, now)?)
            }
            LogicalReplicationMessage::Relation(relation) => {
                self.mapper.on_relation(&relation);
                Ok(())
            }
            LogicalReplicationMessage::Insert(insert) => {
                let mapped = self.mapper.map_insert(&insert, self.current_commit_lsn)?;
                Ok(self.admit(mapped, now)?)
            }
            LogicalReplicationMessage::Message(message) => {
                self.instruments.logical_message(&message);
                Ok(())
            }
            // Updates, deletes and truncates of the outbox are not events (the
            // publication normally does not even send them); origins and types
            // carry nothing to relay.
            _ => Ok(()),
        }
    }

    fn admit(&mut self, mapped: Mapped, now: Instant) -> std::result::Result<(), ProtocolError> {
        match mapped {
            Mapped::NotOutbox => Ok(()),
            Mapped::Event(event) => {
                let id = self
                    .core
                    .admit_keyed(event.byte_size(), Some(order_key(&event)), now)?;
                self.pending.insert(
                    id,
                    InFlight::Event {
                        event,
                        committed_at: self.current_commit_time,
                        last_error: None,
                    },
                );
                Ok(())
            }
            Mapped::Unmappable(row) => {
                let size = row.fields.payload.as_ref().map_or(0, String::len);
                let id = self.core.admit_unmappable(size)?;
                self.pending.insert(
                    id,
                    InFlight::Unmappable {
                        fields: Box::new(row.fields),
                        error_kind: row.error_kind,
                        reason: row.reason,
                        lsn: self.current_commit_lsn,
                    },
                );
                Ok(())
            }
        }
    }

    fn on_report(&mut self, report: DeliveryReport) -> Result<()> {
        let now = Instant::now();
        let fatal = report.is_fatal();
        match report.result {
            Ok((partition, offset)) => {
                tracing::trace!(id = %report.id, partition, offset, "delivered");
                if let Some(pending) = self.pending.remove(&report.id) {
                    self.summary.delivered += 1;
                    if let InFlight::Event {
                        event,
                        committed_at,
                        ..
                    } = &pending
                    {
                        self.instruments.delivered(&event.topic, *committed_at);
                    }
                }
                self.core.delivered(report.id, now);
            }
            Err((code, message)) => {
                if fatal {
                    return Err(BrokerError::from(BrokerUnavailable::FatalReport {
                        code,
                        message,
                    })
                    .into());
                }
                let failure = kafka::classify(code);
                if failure == Failure::Transient {
                    self.instruments.transient_error();
                }
                self.record_failure(report.id, kafka::error_kind(code), &message, failure);
                self.core.delivery_failed(report.id, failure, now);
            }
        }
        Ok(())
    }

    fn record_failure(&mut self, id: EventId, kind: &'static str, message: &str, failure: Failure) {
        if let Some(InFlight::Event {
            last_error, event, ..
        }) = self.pending.get_mut(&id)
        {
            if failure == Failure::Permanent {
                tracing::debug!(%id, topic = %event.topic, kind, message, "delivery failed");
            }
            *last_error = Some((kind, message.to_owned()));
        }
    }

    fn on_poison_outcome(&mut self, outcome: PoisonOutcome) {
        let now = Instant::now();
        match outcome.result {
            Ok(()) => {
                if let Some(pending) = self.pending.remove(&outcome.id) {
                    self.summary.poisoned += 1;
                    self.instruments.poisoned(pending.topic());
                }
                self.core.poison_committed(outcome.id, now);
            }
            Err(_) => self.core.poison_insert_failed(outcome.id, now),
        }
    }

    /// Executes every action the core has queued.
    async fn execute_actions(
        &mut self,
        stream: &mut ReplicationStream,
    ) -> std::result::Result<(), ReplicationError> {
        while let Some(action) = self.core.next_action() {
            match action {
                Action::Produce { id, .. } => self.produce(id),
                Action::InsertPoison { id, attempts } => self.request_poison(id, attempts),
                Action::SendStatus(status) => {
                    tracing::trace!(flush = %status.flush, "standby status");
                    send_status(stream, status).await?;
                    self.summary.confirmed = status.flush;
                }
            }
        }
        Ok(())
    }

    fn produce(&mut self, id: EventId) {
        let Some(InFlight::Event { event, .. }) = self.pending.get(&id) else {
            return;
        };
        tracing::trace!(%id, topic = %event.topic, "produce");
        if let Err(rejected) = self.publisher.send_event(id, event) {
            let kind = kafka::error_kind(rejected.code);
            self.record_failure(id, kind, &rejected.message, rejected.failure);
            self.core
                .delivery_failed(id, rejected.failure, Instant::now());
        }
    }

    fn request_poison(&mut self, id: EventId, attempts: u32) {
        let Some(pending) = self.pending.get(&id) else {
            return;
        };
        let row = pending.poison_row(attempts);
        // The channel holds one request per in-flight event at most, so it is never
        // full; if it were, the core retries after a backoff.
        if self.poison_tx.try_send(PoisonRequest { id, row }).is_err() {
            self.core.poison_insert_failed(id, Instant::now());
        }
    }

    /// Stop reading, wait (bounded) for in-flight events to resolve, send the final
    /// status update, end the stream.
    async fn graceful_shutdown(&mut self, mut stream: ReplicationStream) -> Result<SessionEnd> {
        let timeout = Duration::from_secs(self.config.relay.shutdown_timeout_secs);
        let deadline = tokio::time::Instant::now() + timeout;
        tracing::info!(
            in_flight = self.core.in_flight_events(),
            "shutting down: waiting for in-flight events"
        );
        while self.core.in_flight_events() > 0 {
            if self.execute_actions(&mut stream).await.is_err() {
                break;
            }
            let next = self
                .core
                .next_deadline()
                .map_or(deadline, tokio::time::Instant::from_std)
                .min(deadline);
            tokio::select! {
                biased;
                report = self.reports.recv() => match report {
                    Some(report) => self.on_report(report)?,
                    None => break,
                },
                outcome = self.outcomes.recv() => match outcome {
                    Some(outcome) => self.on_poison_outcome(outcome),
                    None => break,
                },
                () = tokio::time::sleep_until(next) => {
                    if tokio::time::Instant::now() >= deadline {
                        tracing::warn!(
                            in_flight = self.core.in_flight_events(),
                            "shutdown timeout: unconfirmed events will be re-sent on the next start"
                        );
                        break;
                    }
                    self.core.tick(Instant::now());
                }
            }
        }
        let status = self.core.shutdown_status();
        if send_status(&mut stream, status).await.is_ok() {
            self.summary.confirmed = status.flush;
        }
        if let Err(e) = stream.finish().await {
            tracing::debug!(error = %e, "ending the replication stream");
        }
        tracing::info!(confirmed = %self.summary.confirmed, delivered = self.summary.delivered, "stopped");
        Ok(SessionEnd::Shutdown)
    }
}

async fn send_status(
    stream: &mut ReplicationStream,
    status: StatusUpdate,
) -> std::result::Result<(), ReplicationError> {
    let frame = StandbyStatus {
        write: status.write,
        flush: status.flush,
        apply: status.apply,
        client_time_micros: pg_epoch_micros(std::time::SystemTime::now()),
        reply_requested: status.reply_requested,
    };
    stream.send_status(&frame).await
}

fn replication_error(e: ReplicationError) -> Error {
    crate::postgres::process_error(e, "").into()
}
