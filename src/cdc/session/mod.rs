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
//! Before the loop waits, it may pause reading for `relay.read_pause_ms` once it has
//! read everything the walsender sent (`cdc::read_pacing`), so that live traffic is
//! read, produced and acknowledged in batches instead of a wake-up per segment.
//!
//! After every wake-up the core's actions are executed: produce (never awaited — the
//! delivery report arrives later on its channel), insert a poison row (handed to the
//! poison task), send a standby status update. Status updates are therefore sent even
//! while reading is paused, which keeps the walsender from timing us out.
//!
//! Connection loss, a protocol violation in the stream, or a PostgreSQL restart end
//! the *session*, not the process. The relay first lets the broker answer for what is
//! in flight (bounded), then reconnects with a jittered exponential backoff that
//! starts over only after a session confirmed progress; a session that keeps ending at
//! the same position is reported (error log, metric, `/readyz`) instead of looping
//! quietly. Where the next session starts is `cdc::start`'s decision; what the lost
//! session had already delivered is not produced again (the core's resend guard).
//!
//! Status updates never confirm past the position saved in `outbox_relay_position`
//! (`cdc::position_saver`), so a PostgreSQL restart, which rewinds the slot, re-sends
//! nothing the relay delivered, and a lost slot is noticed and healed (`cdc::resync`).
//!
//! A producer that stops reporting while the broker answers (it can lose its
//! idempotence state to a broker restart), or that fails fatally, is replaced: the
//! session ends, a new producer is made, and the server re-sends the unconfirmed
//! transactions in order. Fatal conditions (prerequisites, authentication, a foreign
//! slot) end the process with a distinct exit code.
//!
//! This file is the loop. What it keeps per in-flight event (the record to produce
//! again, the row to poison) is in `in_flight.rs`, its metric handles in
//! `instruments.rs`.

mod assemble;
mod ends;
mod poison_path;

use assemble::relay_publisher;
pub use assemble::{run, run_checked, run_with_health};
use ends::{Drain, FailureStreak, FrameError, Lost, SessionEnd, SlotHolder, session_or_process};
use poison_path::PoisonPath;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::error::RDKafkaErrorCode;
use tokio::sync::mpsc;
use tokio_postgres::Client;

use crate::cdc::binary::{BinaryDecoding, BinaryRefused};
use crate::cdc::confirmation::{Confirmation, Verdict};
use crate::cdc::exactly_once::{ExactlyOnce, PROGRESS_RECORD_ID};
use crate::cdc::heartbeat::{self, HeartbeatConfig};
use crate::cdc::in_flight::{InFlight, order_key};
use crate::cdc::instruments::Instruments;
use crate::cdc::metrics::{self as m, Health};
use crate::cdc::poison_policy::PoisonPolicy;
use crate::cdc::position_saver::SaverEvent;
use crate::cdc::progress::{
    Action, Core, CoreConfig, MissingRecord, ProtocolError, Records, StatusUpdate,
    TransactionLimits,
};
use crate::cdc::read_pacing::ReadPacing;
use crate::cdc::start::{self, Remembered, ServerView, SlotLoss, SlotView, StartPlan};
use crate::cdc::start_checks::{Prerequisites as StartPrerequisites, StartChecks};
use crate::config::{Config, RelayConfig, SlotLossMode};
use crate::delivery::ErrorClass;
use crate::delivery::{EventId, Failure};
use crate::error::{Error, Result};
use crate::kafka::{self, DeliveryReport, IdleGate, Publisher, TopicLimits};
use crate::lifecycle::{Backoff, Shutdown, jittered, millis, sleep_or_shutdown};
use crate::lsn::Lsn;
use crate::outbox::message::{MessageMapped, is_outbox_prefix};
use crate::outbox::position::{PositionTable, ServerHistory};
use crate::outbox::{MapError, Mapped, OutboxMapper};
use crate::poison::{PoisonWriter, RecordedPoison};
use crate::postgres::conninfo::ConnInfo;
use crate::postgres::pgoutput::{DecodeError, Decoder, LogicalReplicationMessage};
use crate::postgres::prerequisite::Prerequisite;
use crate::postgres::replication::frames::{ServerFrame, StandbyStatus, pg_epoch_micros};
use crate::postgres::replication::{
    ReplicationConnection, ReplicationError, ReplicationStream, TimelineSwitch,
};
use crate::postgres::slot::{self, SlotState};

/// pgoutput protocol version requested. v1 sends each transaction whole at commit,
/// which is what the ack tracker models (one transaction at a time).
const PROTO_VERSION: u8 = 1;

/// pgoutput sends logical-decoding messages (our heartbeats) from this server
/// version on (`messages` option).
const MESSAGES_OPTION_SINCE: u32 = 140_000;
/// pgoutput's `binary` option exists since PostgreSQL 14.
const BINARY_OPTION_SINCE: u32 = 140_000;

/// Slot sampling period when the heartbeat itself is off.
const SLOT_SAMPLE_INTERVAL: Duration = Duration::from_secs(10);

/// Reconnect backoff after a lost replication session (jittered); it starts over only
/// after a session confirmed progress.
const RECONNECT_BACKOFF_INITIAL: Duration = Duration::from_millis(200);
const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Sessions in a row ending at one confirmed position before it is reported.
const REPEATED_FAILURE_ALERT: u32 = 3;

/// How long a lost session waits for the broker to answer for its in-flight events.
const LOSS_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the producer watchdog looks.
const WATCHDOG_TICK: Duration = Duration::from_secs(1);

/// The watchdog's broker check (a metadata request).
const WATCHDOG_BROKER_CHECK: Duration = Duration::from_secs(5);

/// How soon a finished Kafka transaction call looks again for its last reports.
const SETTLE_RECHECK: Duration = Duration::from_millis(2);

/// How long a graceful shutdown waits for the final position to be saved.
const FINAL_SAVE_TIMEOUT: Duration = Duration::from_secs(5);

/// What a finished `run` reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunSummary {
    /// Events delivered in this process: acked by the broker, or, in exactly-once
    /// mode, committed in a Kafka transaction.
    pub delivered: u64,
    /// Events written to the poison table in this process.
    pub poisoned: u64,
    /// Events parked behind a poisoned event of their key in this process.
    pub parked: u64,
    /// The last confirmed LSN sent to the server.
    pub confirmed: Lsn,
    /// Replication sessions that ended and were reconnected.
    pub reconnects: u64,
}

/// Why `event` can never be produced: larger than the producer's
/// `message.max.bytes`, or than the topic's `max.message.bytes` (which bounds a
/// record batch: the record plus [`BATCH_OVERHEAD`] and the framing of its headers)
/// when the producer does not compress.
///
/// The two limits are measured on different bytes. librdkafka checks
/// `message.max.bytes` against the record as given, key, value and headers plus
/// framing, before anything is compressed (`rd_kafka_msg_new0`), so that check holds
/// whatever the codec. The broker checks the topic's limit against the record batch
/// as written, which is compressed when `compression.type` is set: a 3 MB JSON event
/// may travel as 300 KB. The uncompressed size then says nothing about the topic's
/// limit, and poisoning by it would poison events the broker accepts, so with
/// `compressed` the topic's limit is not checked here. The event is produced; a
/// broker that refuses it answers `MessageSizeTooLarge` (or `RecordBatchTooLarge`),
/// which is permanent (`kafka::classify`): the record is retried alone, then up to
/// `relay.max_attempts`, then poisoned with the broker's error.
fn too_large(
    event: &crate::outbox::OutboxEvent,
    producer_limit: usize,
    topic_limit: Option<usize>,
    compressed: bool,
) -> Option<String> {
    let size = event.byte_size();
    if size > producer_limit {
        return Some(format!(
            "record of {size} bytes (key, value and headers) is larger than the producer's \
             message.max.bytes = {producer_limit} (kafka.producer)"
        ));
    }
    if compressed {
        return None;
    }
    let limit = topic_limit?;
    let batch = size + BATCH_OVERHEAD + HEADER_OVERHEAD * event.headers.len();
    (batch > limit).then(|| {
        format!(
            "record of {size} bytes (key, value and headers; about {batch} as a record batch) \
             is larger than the topic's max.message.bytes = {limit}"
        )
    })
}

/// Bytes a record batch of one record adds to the record's key, value and header
/// bytes, at most: the batch header (61), and the record's attributes, timestamp
/// and offset deltas, lengths and header count as varints.
const BATCH_OVERHEAD: usize = 61 + 1 + 10 + 5 + 5 + 5 + 5 + 5;

/// Bytes each header adds at most (its name and value lengths as varints).
const HEADER_OVERHEAD: usize = 10;

struct Relay {
    config: Config,
    conninfo: ConnInfo,
    core: Core,
    /// Every event's record between admission and the core's resolution of it
    /// (`progress::records`: an ack inside a Kafka transaction does not drop it).
    records: Records<InFlight>,
    mapper: OutboxMapper,
    publisher: Publisher,
    /// To make a new producer when the current one is wedged.
    producer_config: ClientConfig,
    reports: mpsc::Receiver<DeliveryReport>,
    /// The saved position and this session's saver.
    confirmation: Confirmation,
    /// The server history of the last session (`None` before the first).
    history: Option<ServerHistory>,
    /// When the server of the last session started (a restart forgets the
    /// remembered position, `cdc::start`).
    server_started: Option<i64>,
    /// Last delivery report (or moment the producer had nothing in flight).
    last_report_at: Instant,
    /// A fatal delivery report: the session ends and the producer is replaced.
    producer_fatal: Option<(RDKafkaErrorCode, String)>,
    /// The watchdog raised its alert; cleared by the next delivery.
    producer_alerted: bool,
    /// Topics whose events a configuration error holds (`relay.on_config_error =
    /// "block"`), with the error kind; cleared by a delivery to the topic.
    blocked_topics: HashMap<String, &'static str>,
    streak: FailureStreak,
    /// `relay.on_poison`, the keys it parked, the poison rows an earlier process
    /// wrote, and the poison writer's channels.
    poison: PoisonPath,
    /// Sends records in batches of one, for retries after a size error (see
    /// [`Relay::retry_alone`]); made on first use.
    alone: Option<Publisher>,
    /// The topics' `max.message.bytes` as far as known.
    topic_limits: TopicLimits,
    /// When the stream goes idle between transactions, whether the producer may be
    /// told to send without lingering (`relay.flush_when_idle`, `kafka::idle_flush`).
    idle_gate: IdleGate,
    /// `relay.read_pause_ms`: whether to wait before reading again once caught up.
    pacing: ReadPacing,
    /// Commit LSN of the open transaction (from its Begin), for `source_lsn`.
    current_commit_lsn: Lsn,
    /// Commit time of the open transaction (from its Begin), for the latency metric.
    current_commit_time: i64,
    summary: RunSummary,
    /// After a lost connection the server keeps our old walsender (and so the slot)
    /// until it notices, at most this long.
    wal_sender_timeout: Duration,
    /// Ask pgoutput for logical-decoding messages (heartbeats, the message
    /// outbox); PostgreSQL 14+.
    messages_option: bool,
    /// Whether sessions ask for binary-format values.
    binary: BinaryDecoding,
    health: Health,
    instruments: Instruments,
    /// `kafka.delivery = "exactly-once"`: the Kafka transactions (`cdc::exactly_once`).
    exactly_once: Option<ExactlyOnce>,
    /// The last status update sent in this session: repeated with `reply_requested`
    /// to make a silent server answer ([`Relay::watch_server`]).
    last_status: Option<StatusUpdate>,
}

/// What the session last heard from the server ([`Relay::watch_server`]).
#[derive(Debug, Clone, Copy)]
struct Hearing {
    /// The last frame read, or the last moment the relay was not reading (a paused
    /// read is no silence of the server's).
    heard_at: Instant,
    /// A keepalive was asked for since then.
    asked: bool,
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
            if self
                .exactly_once
                .as_ref()
                .is_some_and(ExactlyOnce::needs_new_producer)
            {
                // A transactional call failed at the start, or a session ended with
                // its transaction in an unknown state: the next producer's
                // `init_transactions` fences this one and settles what it left.
                tracing::warn!("replacing the transactional producer");
                self.replace_producer()?;
            }
            let stream = match stream {
                Ok(stream) => stream,
                Err(e) if e.class() == ErrorClass::Transient => {
                    let pause = jittered(backoff.next_pause());
                    tracing::warn!(error = %e, retry_in_ms = millis(pause), "cannot start replication; retrying");
                    if sleep_or_shutdown(&mut shutdown, pause).await {
                        return Ok(self.summary.clone());
                    }
                    continue;
                }
                Err(e) => return Err(e),
            };
            let started_at = self.core.confirmed();
            self.health.set_streaming(true, Instant::now());
            let ended = self.stream(stream, &mut shutdown).await;
            self.health.set_streaming(false, Instant::now());
            let SessionEnd::Lost(reason) = ended? else {
                return Ok(self.summary.clone());
            };
            self.summary.reconnects += 1;
            self.instruments.reconnect();
            tracing::warn!(%reason, confirmed = %self.core.confirmed(), "replication session lost; reconnecting");
            if self.drain_after_loss(&mut shutdown).await? {
                return Ok(self.summary.clone());
            }
            let transaction_unsettled = self
                .exactly_once
                .as_ref()
                .is_some_and(ExactlyOnce::needs_new_producer)
                || self.core.transaction_events() > 0;
            if reason.needs_new_producer() || transaction_unsettled {
                tracing::error!(%reason, "replacing the Kafka producer; unconfirmed events are produced again in order");
                self.replace_producer()?;
            }
            let progressed = self.core.confirmed() > started_at;
            if progressed {
                backoff.reset();
            }
            self.note_session_end(&reason, progressed);
            let pause = jittered(backoff.next_pause());
            if sleep_or_shutdown(&mut shutdown, pause).await {
                return Ok(self.summary.clone());
            }
        }
    }

    /// Counts sessions ending without progress at one position; from
    /// [`REPEATED_FAILURE_ALERT`] on, says so loudly and turns not-ready.
    fn note_session_end(&mut self, reason: &Lost, progressed: bool) {
        let confirmed = self.core.confirmed();
        let count = self.streak.ended(confirmed, progressed);
        ::metrics::gauge!(m::REPEATED_FAILURES).set(f64::from(count));
        if count >= REPEATED_FAILURE_ALERT {
            tracing::error!(
                %reason,
                %confirmed,
                sessions = count,
                "replication keeps failing at the same position without progress; backing off"
            );
            self.health.set_alert(
                "sessions",
                Some(format!(
                    "{count} replication sessions in a row ended at {confirmed} without progress: {reason}"
                )),
            );
        }
    }

    /// After a lost session: lets the broker answer for the in-flight events (up to
    /// [`LOSS_DRAIN_TIMEOUT`]), so that completed transactions are confirmed in memory
    /// and not re-sent, then records what the unconfirmed ones had resolved. Returns
    /// `true` if shutdown came first.
    async fn drain_after_loss(&mut self, shutdown: &mut Shutdown) -> Result<bool> {
        let deadline = tokio::time::Instant::now()
            + if self.exactly_once.is_some() {
                // A commit or an abort may take its own timeout.
                LOSS_DRAIN_TIMEOUT.max(kafka::TRANSACTION_CALL_TIMEOUT)
            } else {
                LOSS_DRAIN_TIMEOUT
            };
        while (self.core.resolvable_events() > 0 || self.transaction_unfinished())
            && self.producer_fatal.is_none()
        {
            // Exactly-once: what is written commits now, before the core restarts.
            self.core.commit_now();
            if let Err(e) = self.execute_offline_actions() {
                tracing::error!(error = %e, "draining the lost session");
                break;
            }
            if let Some(lost) = self.transaction_failure()? {
                tracing::warn!(%lost, "the Kafka transaction could not end; the next producer aborts it");
                self.producer_fatal
                    .get_or_insert((RDKafkaErrorCode::Fail, lost.to_string()));
                break;
            }
            let step = tokio::select! {
                biased;
                () = &mut *shutdown => return Ok(true),
                step = self.await_in_flight(deadline) => step,
            };
            if step != Drain::Progress {
                break;
            }
        }
        if let Err(e) = self.execute_offline_actions() {
            tracing::error!(error = %e, "draining the lost session");
        }
        Ok(false)
    }

    /// One wait of a drain without reading the stream (after a lost session, at
    /// shutdown): a delivery report, a poison outcome, or the core's next timer, at
    /// the latest `deadline`.
    async fn await_in_flight(&mut self, deadline: tokio::time::Instant) -> Drain {
        self.settle_transaction();
        let (calling, settling) = transaction_waits(self.exactly_once.as_ref());
        let mut next = self
            .core
            .next_deadline()
            .map_or(deadline, tokio::time::Instant::from_std)
            .min(deadline);
        if settling {
            next = next.min(tokio::time::Instant::now() + SETTLE_RECHECK);
        }
        tokio::select! {
            biased;
            () = transaction_finished(&mut self.exactly_once), if calling => Drain::Progress,
            report = self.reports.recv() => match report {
                Some(report) => {
                    self.on_report(report);
                    if self.producer_fatal.is_some() {
                        Drain::Ended
                    } else {
                        Drain::Progress
                    }
                }
                None => Drain::Ended,
            },
            outcome = self.poison.next_outcome() => match outcome {
                Some(outcome) => {
                    self.poison
                        .on_outcome(outcome, &mut self.core, &mut self.records, &mut self.summary, &mut self.instruments);
                    Drain::Progress
                }
                None => Drain::Ended,
            },
            () = tokio::time::sleep_until(next) => {
                if tokio::time::Instant::now() >= deadline {
                    Drain::TimedOut
                } else {
                    self.core.tick(Instant::now());
                    Drain::Progress
                }
            }
        }
    }

    /// Executes the core's actions without a replication stream: produce, poison and
    /// save as usual; status updates have nowhere to go.
    ///
    /// # Errors
    ///
    /// A produce without a record ([`MissingRecord`]): nothing more is executed.
    fn execute_offline_actions(&mut self) -> std::result::Result<(), MissingRecord> {
        self.forget_resolved(Instant::now());
        while let Some(action) = self.core.next_action() {
            match action {
                Action::Produce { id, attempt } => self.produce(id, attempt)?,
                Action::InsertPoison { id, attempts } => self.request_poison(id, attempts),
                Action::Save { lsn, urgent } => self.request_save(lsn, urgent),
                // No stream to send it on: the next session starts from what is
                // saved or remembered.
                Action::SendStatus(_) => {}
                Action::CommitTransaction => self.commit_transaction(),
                Action::AbortTransaction => self.abort_transaction(),
            }
        }
        Ok(())
    }

    /// Exactly-once: writes the progress record and starts the commit.
    fn commit_transaction(&mut self) {
        if let (Some(eo), Some(history)) = (self.exactly_once.as_mut(), self.history) {
            eo.commit(&self.publisher, &self.core, history);
        }
    }

    /// Exactly-once: starts the abort.
    fn abort_transaction(&mut self) {
        if let Some(eo) = self.exactly_once.as_mut() {
            tracing::info!(
                events = self.core.transaction_events(),
                "aborting the Kafka transaction: a record in it failed; its events are produced again"
            );
            eo.abort(&self.publisher);
        }
    }

    /// Exactly-once: hands a finished commit's or abort's outcome to the core once
    /// the transaction's last reports are in.
    fn settle_transaction(&mut self) {
        if let Some(eo) = self.exactly_once.as_mut()
            && eo.settling()
        {
            let drained = self.publisher.in_flight() == 0 && self.reports.is_empty();
            eo.settle(&self.publisher, &mut self.core, drained);
        }
    }

    /// Exactly-once: a transactional failure ends the session (the producer is
    /// replaced) or, fenced or unsupported, the process.
    fn transaction_failure(&mut self) -> Result<Option<Lost>> {
        self.exactly_once
            .as_mut()
            .and_then(ExactlyOnce::take_failure)
            .map(session_or_process)
            .transpose()
    }

    /// [`Relay::transaction_failure`] while `stream` holds the slot. A fence is then
    /// told apart from a takeover. The coordinator fences a producer itself when it
    /// aborts its transaction on `transaction.timeout.ms` (a broker stall, a
    /// coordinator that lost the transaction): the epoch is bumped as for a new
    /// producer. It is that, and no takeover, when both hold: the transaction had been
    /// open for at least the timeout, and this session's walsender is still the
    /// slot's active one (relays initialise the slot's `transactional.id` only once
    /// they hold the slot, so no other relay can have fenced this one). The producer
    /// is then replaced and the events are sent again; anything else, a producer of
    /// another process with the same id included, ends the process (exit 3) as
    /// before, so two processes never fence each other in turn.
    async fn transaction_failure_in(&mut self, stream: &ReplicationStream) -> Result<Option<Lost>> {
        let Some(e) = self
            .exactly_once
            .as_mut()
            .and_then(ExactlyOnce::take_failure)
        else {
            return Ok(None);
        };
        if e.is_fenced() && self.fenced_by_timeout(&e, stream).await {
            tracing::warn!(error = %e, "the transaction coordinator fenced this producer while this relay holds the slot: it aborted the transaction itself (kafka.transaction_timeout_ms passed, e.g. in a broker stall), no other relay took over");
            ::metrics::counter!(m::KAFKA_TRANSACTIONS, "outcome" => "timed_out").increment(1);
            return Ok(Some(Lost::CoordinatorAborted(e)));
        }
        session_or_process(e).map(Some)
    }

    /// Whether the fence `e` is the coordinator's timeout abort (see
    /// [`Relay::transaction_failure_in`]): the transaction was that old, and the slot
    /// is this session's. Says why when it is not.
    async fn fenced_by_timeout(
        &self,
        e: &crate::kafka::TransactionError,
        stream: &ReplicationStream,
    ) -> bool {
        let timeout = Duration::from_millis(self.config.kafka.transaction_timeout_ms);
        let age = self
            .exactly_once
            .as_ref()
            .and_then(|eo| eo.transaction_age(Instant::now()));
        if age.is_none_or(|age| age < timeout) {
            tracing::error!(error = %e, transaction_age_ms = age.map(millis), "fenced before the transaction could time out: another producer took this transactional.id");
            return false;
        }
        // Boxed: the connection's future is large, and this path is rare.
        match Box::pin(self.slot_holder(stream)).await {
            SlotHolder::ThisSession => true,
            SlotHolder::Other(pid) => {
                tracing::error!(error = %e, slot_pid = ?pid, "fenced, and the slot is not this session's: another relay took over");
                false
            }
        }
    }

    /// Who holds the slot according to the server (a short connection of its own;
    /// any failure answers "another", the safe side).
    async fn slot_holder(&self, stream: &ReplicationStream) -> SlotHolder {
        const ASK_TIMEOUT: Duration = Duration::from_secs(5);
        let ours = stream.backend_pid();
        let slot = self.config.postgres.slot_name();
        let ask = async {
            let client = crate::postgres::connect_info(&self.conninfo).await.ok()?;
            let row = client
                .query_opt(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await
                .ok()??;
            row.try_get::<_, Option<i32>>(0).ok()
        };
        match tokio::time::timeout(ASK_TIMEOUT, ask).await {
            Ok(Some(active)) if active.is_some() && active == ours => SlotHolder::ThisSession,
            Ok(Some(active)) => SlotHolder::Other(active),
            _ => SlotHolder::Other(None),
        }
    }

    /// Whether a Kafka transaction still has to end (a call or its outcome pending,
    /// events written or produced in it).
    fn transaction_unfinished(&self) -> bool {
        self.exactly_once
            .as_ref()
            .is_some_and(|eo| eo.calling() || eo.settling())
            || self.core.transaction_events() > 0
    }

    /// Before a cutover or a resync: their backlog's transactional producer takes the
    /// slot's `transactional.id` (`cdc::backlog`) and would fence this session's if it
    /// is initialised, whether the backlog succeeds or not. A new producer is only
    /// initialised when streaming starts, after the backlog.
    fn before_backlog(&mut self) -> Result<()> {
        if self
            .exactly_once
            .as_ref()
            .is_some_and(ExactlyOnce::initialized)
        {
            tracing::info!(
                "replacing the transactional producer: a backlog's producer takes its transactional.id"
            );
            self.replace_producer()?;
        }
        Ok(())
    }

    /// Replaces a wedged or fatally failed producer. The old one is dropped on a
    /// blocking thread (librdkafka's destroy may wait for its broker connections);
    /// its late reports go nowhere.
    fn replace_producer(&mut self) -> Result<()> {
        let (publisher, reports) = relay_publisher(&self.producer_config, &self.config.relay)?;
        let old = std::mem::replace(&mut self.publisher, publisher);
        let old_alone = self.alone.take();
        self.reports = reports;
        self.producer_fatal = None;
        self.last_report_at = Instant::now();
        if let Some(eo) = self.exactly_once.as_mut() {
            eo.producer_replaced();
        }
        tokio::task::spawn_blocking(move || drop((old, old_alone)));
        ::metrics::counter!(m::PRODUCER_RESTARTS).increment(1);
        Ok(())
    }

    /// Connects, decides where to start (`cdc::start`), heals a lost slot, and starts
    /// streaming with a core that continues this process's event ids.
    async fn start_session(&mut self, first: bool) -> Result<ReplicationStream> {
        // The previous session's saver stops before anything is decided: a late save
        // of its would move the position row under this session's plan.
        self.confirmation.end_session();
        // A fresh metadata connection per session: the previous one may have died
        // with the server.
        let mut metadata = crate::postgres::connect_info(&self.conninfo).await?;
        let mut conn = ReplicationConnection::connect(&self.conninfo)
            .await
            .map_err(replication_error)?;
        let identity = conn.identify_system().await.map_err(replication_error)?;
        let history = ServerHistory {
            system_identifier: identity.systemid,
            timeline: identity.timeline,
        };
        let server = ServerView {
            history,
            wal_end: identity.xlogpos,
            forks: timeline_forks(&mut conn, identity.timeline).await,
            started: crate::postgres::postmaster_started(&metadata).await?,
        };
        let slot_name = self.config.postgres.slot_name();
        let mut busy_timeout = Duration::from_secs(self.config.relay.slot_busy_timeout_secs);
        if !first {
            // On a reconnect the slot may still be held by our own previous
            // walsender (e.g. after a network cut) until wal_sender_timeout.
            busy_timeout = busy_timeout.max(self.wal_sender_timeout * 2);
        }
        let remembered = self.history.map(|history| Remembered {
            history,
            confirmed: self.core.confirmed(),
            saved: self.core.saved_position(),
            server_started: self.server_started,
        });
        // Decide on the facts after waiting for the slot: another relay may have
        // streamed from it meanwhile, and an active slot is never judged.
        let mut waited = false;
        let plan = loop {
            match self.plan(&metadata, &server, remembered).await? {
                StartPlan::Busy { .. } => {}
                StartPlan::Resume { .. } if !waited => {}
                plan => break plan,
            }
            slot::wait_for_slot(&mut conn, &metadata, &slot_name, busy_timeout).await?;
            waited = true;
        };
        let mut fresh_core = false;
        let start = match plan {
            // The loop above does not let it through; were it to, it means what a
            // wait that timed out means.
            StartPlan::Busy { pid } => {
                return Err(Prerequisite::SlotBusy {
                    slot: slot_name,
                    pid,
                    waited_secs: busy_timeout.as_secs(),
                }
                .into());
            }
            StartPlan::Fresh => {
                // The core starts at exactly what was recorded, nothing remembered.
                fresh_core = true;
                self.before_backlog()?;
                self.create_slot(&mut conn, &mut metadata, busy_timeout, history)
                    .await?
            }
            StartPlan::Resume {
                from,
                history_changed,
                keep_checkpoint,
                server_restarted,
            } => {
                if server_restarted {
                    // Nothing of the old server's WAL is kept (a restore restarts it).
                    fresh_core = true;
                }
                if history_changed {
                    tracing::warn!(slot = %slot_name, %history, from = %from, server_wal_end = %server.wal_end,
                        previous = ?self.history, remembered = ?remembered.map(|r| r.confirmed),
                        "recording the position on this server history (failover, or WAL restored in place)");
                    self.confirmation
                        .positions()
                        .adopt(&metadata, history, from, keep_checkpoint)
                        .await?;
                    fresh_core = true;
                } else if !self
                    .confirmation
                    .positions()
                    .save(&metadata, history, from)
                    .await?
                {
                    // The start may come from this process's memory: saved before
                    // any status can confirm it. A row that refuses it (marked lost
                    // by a relay resyncing, or of another history meanwhile): decide
                    // again.
                    return Err(Error::RelaySlotHealedElsewhere { slot: slot_name });
                }
                from
            }
            StartPlan::Lost { loss, .. } => {
                fresh_core = true;
                self.before_backlog()?;
                self.heal(&mut conn, &mut metadata, &server, remembered, &loss)
                    .await?
            }
        };
        if fresh_core || first {
            // A cutover's or a resync's backlog may have parked keys meanwhile, and
            // so may the relay that streamed while this one waited for the slot.
            self.poison.set_policy(PoisonPolicy::new(
                self.config.relay.on_poison,
                crate::cdc::poison_policy::parked_keys(&metadata, &self.config).await?,
            ));
        }
        self.reset_core(history, start, fresh_core);
        let recorded = self.recorded_poison(&mut metadata, start).await;
        self.poison.set_recorded(recorded);
        self.server_started = server.started;
        self.confirmation.start_session(
            &self.conninfo,
            history,
            server.started,
            start,
            Duration::from_millis(self.config.relay.position_save_interval_ms),
        );
        let publication = self.config.postgres.publication_name();
        let publications =
            crate::postgres::replication::publication_names_option(&[publication.as_str()]);
        let version = PROTO_VERSION.to_string();
        let mut options = vec![
            ("proto_version", version.as_str()),
            ("publication_names", publications.as_str()),
        ];
        if self.messages_option {
            options.push(("messages", "true"));
        }
        self.binary.start_session();
        if self.binary.active() {
            options.push(("binary", "true"));
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
        if let Some(eo) = self.exactly_once.as_mut() {
            // Only now, holding the slot: fences the producer of a relay that held
            // it before, and resumes a core without this process's memory.
            eo.start_session(&self.publisher, &mut self.core, &server, &metadata, start)
                .await?;
        }
        tracing::info!(slot = %slot_name, from = %start, %history, "streaming");
        Ok(stream)
    }

    /// The poison rows of events this session may stream again (from `start` to the
    /// WAL end now, after any wait for the slot): a failed read costs duplicates,
    /// never a loss, so it does not stop the start.
    async fn recorded_poison(
        &self,
        metadata: &mut tokio_postgres::Client,
        start: Lsn,
    ) -> RecordedPoison {
        let copy_limit = self.config.relay.poison_copy_limit_bytes;
        let read = async {
            let wal_end = crate::postgres::wal_end(&*metadata).await?;
            let outboxes: Vec<_> = self.config.outboxes().collect();
            let slot = self.config.postgres.slot_name();
            RecordedPoison::read(metadata, &outboxes, &slot, copy_limit, start, wal_end).await
        };
        read.await
            .unwrap_or_else(|e| {
                tracing::warn!(error = %e, "cannot read the poison rows of this session's stretch of WAL: events an earlier process poisoned may be produced again");
                RecordedPoison::default()
            })
    }

    /// The start plan from the slot and the recorded position as they are now. The
    /// slot is read first: a relay streaming from it saves before it confirms, so
    /// read in this order the slot can only look behind the record, never ahead
    /// (`cdc::start`).
    async fn plan(
        &self,
        metadata: &Client,
        server: &ServerView,
        remembered: Option<Remembered>,
    ) -> Result<StartPlan> {
        let slot_name = &self.config.postgres.slot_name();
        let slot = slot::slot_info(metadata, slot_name)
            .await?
            .map(|info| SlotView {
                confirmed: info.confirmed_flush.unwrap_or(Lsn::ZERO),
                invalidated: info.wal_status.as_deref() == Some("lost"),
                active_pid: info.active_pid,
            });
        let recorded = self.confirmation.positions().load(metadata).await?;
        // The WAL end last, and now: a session that waited for its slot must not
        // judge a position saved meanwhile by the WAL end it saw before the wait.
        let server = ServerView {
            wal_end: server
                .wal_end
                .max(crate::postgres::wal_end(metadata).await?),
            ..server.clone()
        };
        Ok(start::plan(
            slot_name,
            &server,
            recorded.as_ref(),
            slot,
            remembered,
        ))
    }

    /// First start: the slot is created (after a cutover from a poller when
    /// configured) and its position recorded.
    async fn create_slot(
        &mut self,
        conn: &mut ReplicationConnection,
        metadata: &mut Client,
        busy_timeout: Duration,
        history: ServerHistory,
    ) -> Result<Lsn> {
        let slot_name = self.config.postgres.slot_name();
        // A missing slot (or an interrupted cutover) first gets the backlog the
        // poller had not sent; then the slot exists and streaming starts at its
        // consistent point.
        crate::cdc::cutover::prepare(
            &self.config,
            &self.conninfo,
            conn,
            metadata,
            history,
            crate::cdc::cutover::Trigger::Run(self.config.relay.cutover),
        )
        .await?;
        let state = slot::wait_for_slot(conn, metadata, &slot_name, busy_timeout).await?;
        let start = match state {
            SlotState::Created(created) => {
                tracing::info!(slot = %slot_name, consistent_point = %created.consistent_point, "replication slot created");
                created.consistent_point
            }
            SlotState::Existing { confirmed_flush } => confirmed_flush,
        };
        self.confirmation
            .positions()
            .adopt(&*metadata, history, start, false)
            .await?;
        Ok(start)
    }

    /// A lost slot: fail (exit 3) or resync, under the cutover's advisory lock so
    /// two relays do not heal it twice. Returns the new slot's consistent point.
    async fn heal(
        &mut self,
        conn: &mut ReplicationConnection,
        metadata: &mut Client,
        server: &ServerView,
        remembered: Option<Remembered>,
        loss: &SlotLoss,
    ) -> Result<Lsn> {
        let history = server.history;
        let slot_name = self.config.postgres.slot_name();
        ::metrics::counter!(m::SLOT_LOSSES).increment(1);
        tracing::error!(slot = %slot_name, %loss, on_slot_loss = ?self.config.relay.on_slot_loss, "replication slot lost");
        if self.config.relay.on_slot_loss == SlotLossMode::Fail {
            return Err(Prerequisite::SlotLost {
                detail: loss.to_string(),
            }
            .into());
        }
        self.health
            .set_alert("slot", Some(format!("{loss}; resyncing before streaming")));
        let lock = crate::cdc::cutover::lock_key(&slot_name);
        metadata
            .execute("SELECT pg_advisory_lock(hashtext($1))", &[&lock])
            .await?;
        let replanned = self.plan(metadata, server, remembered).await?;
        let StartPlan::Lost {
            loss,
            delivered_xmin,
        } = replanned
        else {
            // Healed by another relay while we waited for the lock; the session
            // ends with the connection, which releases the lock.
            return Err(Error::RelaySlotHealedElsewhere { slot: slot_name });
        };
        let summary = crate::cdc::resync::resync(
            &self.config,
            &self.conninfo,
            conn,
            metadata,
            history,
            &loss,
            delivered_xmin,
        )
        .await?;
        metadata
            .execute("SELECT pg_advisory_unlock(hashtext($1))", &[&lock])
            .await?;
        self.health.set_alert("slot", None);
        Ok(summary.consistent_point)
    }

    /// A fresh core for the session starting at `start`. On the same history it
    /// continues the old one (ids, the highest confirmed position, what the lost
    /// session resolved); on another, or when the start plan found this process's
    /// positions void (`fresh`), nothing of the old positions is kept.
    fn reset_core(&mut self, history: ServerHistory, start: Lsn, fresh: bool) {
        let now = Instant::now();
        let core = std::mem::replace(
            &mut self.core,
            Core::new(CoreConfig::default(), Lsn::ZERO, now),
        );
        self.core = match self.history {
            None => Core::new(core.config().clone(), start, now),
            Some(previous) if previous == history && !fresh => core.restart(start, now),
            Some(_) => core.restart_on_new_history(start, now),
        };
        self.history = Some(history);
        self.instruments.session_started(start);
        self.records.clear();
        self.mapper.reset_session();
        self.last_report_at = now;
    }

    /// The replication loop of one session.
    async fn stream(
        &mut self,
        mut stream: ReplicationStream,
        shutdown: &mut Shutdown,
    ) -> Result<SessionEnd> {
        let timer = tokio::time::sleep(Duration::from_secs(3600));
        tokio::pin!(timer);
        let mut watchdog = tokio::time::interval(WATCHDOG_TICK);
        watchdog.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.last_status = None;
        self.health.set_alert("replication", None);
        let mut hearing = Hearing {
            heard_at: Instant::now(),
            asked: false,
        };
        loop {
            self.settle_transaction();
            if let Err(lost) = self.execute_actions(&mut stream).await {
                return Ok(SessionEnd::Lost(lost));
            }
            if let Some((code, message)) = self.producer_fatal.take() {
                return Ok(SessionEnd::Lost(Lost::ProducerFatal { code, message }));
            }
            if let Some(lost) = self.transaction_failure_in(&stream).await? {
                return Ok(SessionEnd::Lost(lost));
            }
            let (calling, settling) = transaction_waits(self.exactly_once.as_ref());
            self.instruments.observe(&self.core, &self.health);
            self.clear_streak_alert();
            if let Some(deadline) = self.core.next_deadline() {
                timer
                    .as_mut()
                    .reset(tokio::time::Instant::from_std(deadline));
            }
            let has_deadline = self.core.next_deadline().is_some();
            // The core also pauses reading while a window's worth of resolved
            // events waits for a save (`progress::saving`).
            let can_read = self.core.can_read();
            if !can_read {
                hearing.heard_at = Instant::now();
            }
            let may_read = can_read && !calling && !settling && !self.core.in_transaction();
            match self
                .pause_if_caught_up(&mut stream, shutdown, may_read)
                .await
            {
                Ok(None) => {}
                Ok(Some(Pause::Taken)) => continue,
                Ok(Some(Pause::ShutDown)) => return self.graceful_shutdown(stream).await,
                Err(e) if e.is_transient() => return Ok(SessionEnd::Lost(e.into())),
                Err(e) => return Err(replication_error(e)),
            }
            tokio::select! {
                biased;
                () = &mut *shutdown => {
                    return self.graceful_shutdown(stream).await;
                }
                report = self.reports.recv() => {
                    let Some(report) = report else {
                        return Err(Error::DeliveryChannelClosed);
                    };
                    self.on_report(report);
                    while let Ok(report) = self.reports.try_recv() {
                        self.on_report(report);
                    }
                }
                outcome = self.poison.next_outcome() => {
                    let Some(outcome) = outcome else {
                        return Err(Error::RelayPoisonWriterStopped);
                    };
                    self.poison
                        .on_outcome(outcome, &mut self.core, &mut self.records, &mut self.summary, &mut self.instruments);
                }
                event = self.confirmation.next_event() => {
                    if let Some(lost) = self.on_saver_event(event) {
                        return Ok(SessionEnd::Lost(lost));
                    }
                }
                () = &mut timer, if has_deadline => {
                    self.core.tick(Instant::now());
                }
                () = transaction_finished(&mut self.exactly_once), if calling => {}
                // The transaction's last report may arrive just before librdkafka
                // counts it out of flight: look again shortly.
                () = tokio::time::sleep(SETTLE_RECHECK), if settling => {}
                _ = watchdog.tick() => {
                    if let Some(lost) = self.watch_producer().await {
                        return Ok(SessionEnd::Lost(lost));
                    }
                    if let Some(lost) = self.watch_server(&mut stream, &mut hearing).await {
                        return Ok(SessionEnd::Lost(lost));
                    }
                }
                frame = stream.next_frame(), if can_read => {
                    match frame {
                        Ok(Some(frame)) => {
                            if matches!(frame, ServerFrame::XLogData { .. }) {
                                self.pacing.frame_read();
                            }
                            hearing.heard_at = Instant::now();
                            if hearing.asked {
                                hearing.asked = false;
                                self.health.set_alert("replication", None);
                            }
                            if let Err(reason) = self.on_frame(frame) {
                                return Ok(SessionEnd::Lost(reason.into()));
                            }
                        }
                        Ok(None) => return Ok(SessionEnd::Lost(Lost::StreamEnded)),
                        Err(e) if e.is_transient() => return Ok(SessionEnd::Lost(e.into())),
                        Err(e) => return Err(replication_error(e)),
                    }
                }
                // Last, so it is taken only when nothing above is ready: the stream
                // has no frame to give right now. `consume_budget` (not `ready`) so
                // that a task whose cooperative budget ran out, for which every
                // branch above is pending too, yields instead of taking it for idle.
                () = tokio::task::coop::consume_budget(), if self.may_nudge() => self.nudge(),
            }
        }
    }

    /// A pause in reading before the loop waits (`cdc::read_pacing`), when the loop
    /// may read (`may_read`) and the stream has nothing more right now; `None`: read
    /// as usual. A pause is taken only where the socket's readiness can be held: one
    /// without it could not be ended by a burst. What the last read produced is sent
    /// first, if few records linger.
    ///
    /// # Errors
    ///
    /// The stream's: checking it, waiting on it or releasing its readiness failed.
    async fn pause_if_caught_up(
        &mut self,
        stream: &mut ReplicationStream,
        shutdown: &mut Shutdown,
        may_read: bool,
    ) -> std::result::Result<Option<Pause>, ReplicationError> {
        let Some(pause) = self.pacing.pause_if_caught_up(may_read) else {
            return Ok(None);
        };
        if stream.frame_ready()? {
            return Ok(None);
        }
        self.pacing.pausing();
        if !hold_for_pause(stream) {
            return Ok(None);
        }
        if self
            .idle_gate
            .may_nudge_before_pause(self.publisher.queued())
        {
            self.nudge();
        }
        let paused = pause_reading(stream, shutdown, pause).await?;
        if paused == Pause::Taken {
            self.instruments.read_pause();
        }
        Ok(Some(paused))
    }

    /// Whether the producer may be told that the stream went idle between
    /// transactions (`kafka::idle_flush`): asked when the stream has nothing to read.
    fn may_nudge(&self) -> bool {
        self.idle_gate.pending()
            && !self.core.in_transaction()
            && self
                .idle_gate
                .may_nudge(Instant::now(), self.publisher.queued())
    }

    /// Sends what lingers in the producer at once.
    fn nudge(&mut self) {
        self.idle_gate.nudged(Instant::now());
        self.publisher.stream_idle();
    }

    /// The producer watchdog: a fatal error, or messages in flight with no report
    /// for `relay.producer_stall_secs` while the broker answers a metadata request,
    /// ends the session so that the producer is replaced (both producers: the main
    /// one and the retry-alone one).
    async fn watch_producer(&mut self) -> Option<Lost> {
        let producers = std::iter::once(&self.publisher).chain(self.alone.as_ref());
        let mut in_flight = 0_i32;
        for producer in producers {
            if let Some((code, message)) = producer.fatal_error() {
                return Some(Lost::ProducerFatal { code, message });
            }
            // The retry-alone producer reports into the same channel: its silence
            // counts as the main one's does.
            in_flight = in_flight.saturating_add(producer.in_flight().max(0));
        }
        if in_flight == 0 {
            self.last_report_at = Instant::now();
            return None;
        }
        let stall = Duration::from_secs(self.config.relay.producer_stall_secs);
        let silent = self.last_report_at.elapsed();
        if stall.is_zero() || silent < stall {
            return None;
        }
        // A broker that is down explains the silence: waiting is right then, and the
        // producer gets a full stall period once it is back.
        if let Err(e) = self.publisher.check_broker(WATCHDOG_BROKER_CHECK).await {
            tracing::debug!(error = %e, in_flight, "no delivery reports; the broker is unreachable");
            self.last_report_at = Instant::now();
            return None;
        }
        // Reports that arrived during the check (the loop waited for it).
        if !self.reports.is_empty() {
            return None;
        }
        self.producer_alerted = true;
        self.health.set_alert(
            "producer",
            Some(format!(
                "the Kafka producer sent no delivery report for {}s with {in_flight} messages in flight; replacing it",
                silent.as_secs()
            )),
        );
        Some(Lost::ProducerStalled {
            silent_secs: silent.as_secs(),
            in_flight,
        })
    }

    /// The receive timeout (`relay.receive_timeout_secs`): from half of it without a
    /// message the server is asked for a keepalive at every watchdog tick (the last
    /// status again, with `reply_requested`) and `/readyz` turns 503; after all of it
    /// the session is lost. A server that stops answering without closing the
    /// connection (a network partition drops packets, sends no RST) is noticed within
    /// the timeout, whatever TCP does.
    ///
    /// The timeout is never below twice the server's `wal_sender_timeout`: a
    /// walsender replaying a large transaction it filters out reads its client's
    /// messages only every half of that, so an answer can take that long; with the
    /// server's timeout off it promises nothing, and the check is off too.
    async fn watch_server(
        &mut self,
        stream: &mut ReplicationStream,
        hearing: &mut Hearing,
    ) -> Option<Lost> {
        let configured = Duration::from_secs(self.config.relay.receive_timeout_secs);
        if configured.is_zero() || self.wal_sender_timeout.is_zero() {
            return None;
        }
        let timeout = configured.max(self.wal_sender_timeout * 2);
        let silent = hearing.heard_at.elapsed();
        if silent >= timeout {
            return Some(Lost::ServerSilent {
                silent_secs: silent.as_secs(),
            });
        }
        if silent < timeout / 2 {
            return None;
        }
        if !hearing.asked {
            hearing.asked = true;
            tracing::warn!(
                silent_secs = silent.as_secs(),
                "no message from PostgreSQL; asking for keepalives"
            );
            self.health.set_alert(
                "replication",
                Some(format!(
                    "no message from PostgreSQL for {}s on the replication connection",
                    silent.as_secs()
                )),
            );
        }
        let status = self.last_status?;
        let ask = StatusUpdate {
            reply_requested: true,
            ..status
        };
        send_status(stream, ask).await.err().map(Lost::from)
    }

    /// Clears the alert of a failure streak (or a replaced producer) once the
    /// confirmed position moves past where the streak was.
    fn clear_streak_alert(&mut self) {
        if self.streak.count > 0 && self.core.confirmed() > self.streak.at {
            self.streak.count = 0;
            ::metrics::gauge!(m::REPEATED_FAILURES).set(0.0);
            self.health.set_alert("sessions", None);
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
                if let Some(eo) = self.exactly_once.as_mut() {
                    eo.transaction_begun(begin.final_lsn, begin.xid, begin.commit_time);
                }
                Ok(self.core.begin(begin.final_lsn, begin.xid)?)
            }
            LogicalReplicationMessage::Commit(commit) => {
                tracing::trace!(commit_lsn = %commit.commit_lsn, end_lsn = %commit.end_lsn, "commit");
                if let Some(eo) = self.exactly_once.as_mut() {
                    eo.transaction_ended(commit.commit_lsn, commit.end_lsn, self.core.confirmed());
                }
                Ok(self.core.commit(commit.commit_lsn, commit.end_lsn, now)?)
            }
            LogicalReplicationMessage::Relation(relation) => {
                self.binary.check(&relation)?;
                self.mapper.on_relation(&relation);
                Ok(())
            }
            LogicalReplicationMessage::Insert(insert) => {
                let mapped = self.mapper.map_insert(&insert, self.current_commit_lsn)?;
                Ok(self.admit(mapped, now)?)
            }
            LogicalReplicationMessage::Message(message) => {
                self.instruments.logical_message(&message);
                // Messages pass every shard's publication: only shard 0 relays them
                // (`migrate` installs no `outbox_emit` when sharded).
                if self.config.postgres.shard > 0 && is_outbox_prefix(message.prefix.as_bytes()) {
                    self.instruments
                        .ignored_message(&MessageMapped::OtherOutbox, &message);
                    return Ok(());
                }
                match self.mapper.map_message(&message, self.current_commit_lsn) {
                    MessageMapped::Outbox(mapped) => Ok(self.admit(mapped, now)?),
                    ignored => {
                        self.instruments.ignored_message(&ignored, &message);
                        Ok(())
                    }
                }
            }
            // Updates, deletes and truncates of the outbox are not events (the
            // publication normally does not even send them); origins and types
            // carry nothing to relay.
            _ => Ok(()),
        }
    }

    /// Admits an outbox row to the core; the shell keeps the record only while the
    /// core has something to do for it (an event a lost session already resolved is
    /// resolved at admission).
    fn admit(&mut self, mapped: Mapped, now: Instant) -> std::result::Result<(), ProtocolError> {
        match mapped {
            Mapped::NotOutbox => Ok(()),
            Mapped::Event(event) => {
                let id = self
                    .core
                    .admit_keyed(event.byte_size(), Some(order_key(&event)), now)?;
                self.instruments.received(self.current_commit_time);
                self.records.admitted(
                    &self.core,
                    id,
                    InFlight::Event {
                        event,
                        committed_at: self.current_commit_time,
                        received_at: now,
                        produced_at: now,
                        last_error: None,
                        parked: false,
                        recorded_before: false,
                        alone: false,
                    },
                );
                Ok(())
            }
            Mapped::Unmappable(row) => {
                let size = row.fields.payload.as_ref().map_or(0, String::len);
                let id = self.core.admit_unmappable(size)?;
                self.records.admitted(
                    &self.core,
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

    fn on_report(&mut self, report: DeliveryReport) {
        let now = Instant::now();
        self.last_report_at = now;
        if report.id == PROGRESS_RECORD_ID {
            // Its failure fails the commit, which is then aborted.
            if let Err((code, message)) = &report.result {
                tracing::warn!(?code, %message, "the progress record was not written");
            }
            return;
        }
        let fatal = report.is_fatal();
        match report.result {
            Ok((partition, offset)) => {
                tracing::trace!(id = %report.id, partition, offset, "delivered");
                // The record stays until the core resolves the event: in a Kafka
                // transaction an ack is a write, and an abort asks for it again.
                if let Some(InFlight::Event { event, .. }) =
                    self.records.acked(report.id, report.reported_at)
                    && self.blocked_topics.contains_key(&event.topic)
                {
                    let topic = event.topic.clone();
                    self.topic_accepts(&topic);
                }
                if self.producer_alerted {
                    self.producer_alerted = false;
                    self.health.set_alert("producer", None);
                }
                self.core.delivered(report.id, now);
                self.forget_resolved(now);
            }
            Err((code, message)) => {
                if fatal {
                    // Not the event's fault: the producer is replaced and the event
                    // produced again by the next session.
                    self.producer_fatal = Some((code, message));
                    return;
                }
                if self.retry_alone(report.id, code, &message) {
                    self.record_failure(
                        report.id,
                        kafka::error_kind(code),
                        &message,
                        Failure::Transient,
                    );
                    self.core
                        .delivery_failed(report.id, Failure::Transient, now);
                    return;
                }
                let failure = self.publisher.classify(code);
                if kafka::is_configuration(code) {
                    self.topic_refuses(report.id, code, &message);
                } else if failure == Failure::Transient {
                    self.instruments.transient_error();
                }
                self.record_failure(report.id, kafka::error_kind(code), &message, failure);
                self.core.delivery_failed(report.id, failure, now);
            }
        }
    }

    /// Drops the records of the events the core resolved, counting the delivered ones
    /// (the poisoned ones were counted and dropped when their row committed).
    fn forget_resolved(&mut self, now: Instant) {
        let (instruments, summary) = (&mut self.instruments, &mut self.summary);
        self.records
            .forget_resolved(&mut self.core, |record, acked_at| {
                if let InFlight::Event {
                    event,
                    committed_at,
                    produced_at,
                    ..
                } = record
                {
                    summary.delivered += 1;
                    instruments.delivered(
                        &event.topic,
                        committed_at,
                        produced_at,
                        acked_at.unwrap_or(now),
                        now,
                    );
                }
            });
    }

    /// A configuration error (missing topic, no authorization…) for the event `id`:
    /// counted; in `block` mode its topic is recorded as blocked, said once at error
    /// with the fix, and `/readyz` turns 503 until a delivery to the topic succeeds.
    fn topic_refuses(&mut self, id: EventId, code: RDKafkaErrorCode, message: &str) {
        let kind = kafka::error_kind(code);
        ::metrics::counter!(m::CONFIGURATION_ERRORS, "kind" => kind).increment(1);
        if self.config.relay.on_config_error.poisons() {
            return;
        }
        let Some(InFlight::Event { event, .. }) = self.records.get(id) else {
            return;
        };
        if self.blocked_topics.contains_key(&event.topic) {
            return;
        }
        tracing::error!(
            topic = %event.topic,
            kind,
            error = message,
            fix = kafka::configuration_fix(code),
            "the broker refuses this topic's events: they are held and retried until the setup is \
             fixed (relay.on_config_error = \"block\"; \"poison\" would poison them instead)"
        );
        self.blocked_topics.insert(event.topic.clone(), kind);
        self.publish_blocked_topics();
    }

    /// A delivery to `topic` succeeded: it is no longer blocked.
    fn topic_accepts(&mut self, topic: &str) {
        if self.blocked_topics.remove(topic).is_some() {
            tracing::info!(topic, "the broker accepts this topic's events again");
            self.publish_blocked_topics();
        }
    }

    /// The blocked topics to the gauge and `/readyz`.
    fn publish_blocked_topics(&self) {
        // Exact: far fewer topics than 2^53.
        #[allow(clippy::cast_precision_loss)]
        ::metrics::gauge!(m::BLOCKED_TOPICS).set(self.blocked_topics.len() as f64);
        let alert = (!self.blocked_topics.is_empty()).then(|| {
            let mut topics: Vec<String> = self
                .blocked_topics
                .iter()
                .map(|(topic, kind)| format!("{topic} ({kind})"))
                .collect();
            topics.sort();
            let shown = topics.len().min(5);
            format!(
                "events held for {} topic(s) the broker refuses: {}{}",
                topics.len(),
                topics[..shown].join(", "),
                if topics.len() > shown { ", …" } else { "" }
            )
        });
        self.health.set_alert("topics", alert);
    }

    fn record_failure(&mut self, id: EventId, kind: &'static str, message: &str, failure: Failure) {
        if let Some(InFlight::Event {
            last_error, event, ..
        }) = self.records.get_mut(id)
        {
            if failure == Failure::Permanent {
                tracing::debug!(%id, topic = %event.topic, kind, message, "delivery failed");
            }
            *last_error = Some((kind, message.to_owned()));
        }
    }

    /// Executes every action the core has queued.
    async fn execute_actions(
        &mut self,
        stream: &mut ReplicationStream,
    ) -> std::result::Result<(), Lost> {
        let now = Instant::now();
        self.forget_resolved(now);
        self.instruments.resolved_up_to(self.core.confirmed(), now);
        while let Some(action) = self.core.next_action() {
            match action {
                Action::Produce { id, attempt } => self.produce(id, attempt)?,
                Action::InsertPoison { id, attempts } => self.request_poison(id, attempts),
                Action::Save { lsn, urgent } => self.request_save(lsn, urgent),
                Action::SendStatus(status) => {
                    // The core caps it at the saved position (`progress::saving`).
                    tracing::trace!(flush = %status.flush, confirmed = %self.core.confirmed(), "standby status");
                    send_status(stream, status).await?;
                    self.last_status = Some(status);
                    self.instruments.status_sent(status.flush, Instant::now());
                    self.summary.confirmed = status.flush;
                }
                Action::CommitTransaction => self.commit_transaction(),
                Action::AbortTransaction => self.abort_transaction(),
            }
        }
        Ok(())
    }

    /// Hands a save the core asked for to the saver.
    fn request_save(&self, lsn: Lsn, urgent: bool) {
        self.confirmation.request(lsn, urgent);
    }

    /// What the saver did (the core decides what it means for the statuses); a
    /// refused row or a server shutting down ends the session.
    fn on_saver_event(&mut self, event: SaverEvent) -> Option<Lost> {
        match self
            .confirmation
            .on_event(event, &mut self.core, &self.health)
        {
            Verdict::Continue => None,
            Verdict::ServerStopping(reason) => Some(Lost::ServerStopping { reason }),
            Verdict::Refused(reason) => Some(Lost::PositionRefused { reason }),
        }
    }

    /// [`Action::InsertPoison`]: the poison path disposes of `id` (`relay.on_poison`).
    fn request_poison(&mut self, id: EventId, attempts: u32) {
        self.poison.request(
            id,
            attempts,
            &mut self.core,
            &mut self.records,
            &self.health,
        );
    }

    /// Hands the record of `id` to the producer (or refuses, parks or fails it, and
    /// tells the core so). A produce the core asks for without a record kept is a
    /// broken invariant that ends the session ([`MissingRecord`]).
    fn produce(&mut self, id: EventId, attempt: u32) -> std::result::Result<(), MissingRecord> {
        if self
            .poison
            .recorded_before(id, &self.core, &mut self.records)
        {
            // Resolved as poisoned without an insert (`request_poison`). Any attempt:
            // a produce handed out again after an abort may never have been sent.
            self.core.refuse(id, Instant::now());
            return Ok(());
        }
        let Ok(InFlight::Event { event, parked, .. }) = self.records.to_produce(id, attempt) else {
            // An unmappable row is never produced either: the core poisons it at
            // admission.
            return Err(self.missing_record(id, attempt));
        };
        if attempt == 1 && self.poison.parks(event) {
            // Its key waits for `replay` (relay.on_poison = "park-key").
            *parked = true;
            self.core.park(id, Instant::now());
            return Ok(());
        }
        tracing::trace!(%id, topic = %event.topic, "produce");
        let now = Instant::now();
        let topic_limit = self.topic_limits.limit(&event.topic, now);
        let producer_limit = self.publisher.max_message_bytes();
        let compressed = self.publisher.compresses();
        if let Some(why) = too_large(event, producer_limit, topic_limit, compressed) {
            // No retry can make it fit: poisoned now, with the limit in the error.
            let message = format!("{why}; topic {:?}", event.topic);
            self.record_failure(
                id,
                kafka::error_kind(RDKafkaErrorCode::MessageSizeTooLarge),
                &message,
                Failure::Permanent,
            );
            self.core.refuse(id, Instant::now());
            return Ok(());
        }
        if let Some(eo) = self.exactly_once.as_mut()
            && !eo.before_produce(&self.publisher)
        {
            // The producer cannot begin a transaction: the session ends and the
            // event goes out with the next producer.
            self.core.delivery_failed(id, Failure::Transient, now);
            return Ok(());
        }
        let publisher = if self.make_alone_publisher(id) {
            self.alone.as_ref().unwrap_or(&self.publisher)
        } else {
            &self.publisher
        };
        let Some(InFlight::Event {
            event,
            received_at,
            produced_at,
            ..
        }) = self.records.get_mut(id)
        else {
            return Err(self.missing_record(id, attempt));
        };
        let sent = publisher.send_event(id, event);
        if sent.is_ok() {
            self.core.produce_sent(id);
            self.idle_gate.produced();
            // The instant before the send: a clock read less per event, for a
            // microsecond of the produced → acked stage.
            *produced_at = now;
            if attempt == 1 {
                self.instruments.produced(*received_at, *produced_at);
            }
        }
        if let Err(rejected) = sent {
            if kafka::is_configuration(rejected.code) {
                self.topic_refuses(id, rejected.code, &rejected.message);
            }
            let kind = kafka::error_kind(rejected.code);
            self.record_failure(id, kind, &rejected.message, rejected.failure);
            self.core
                .delivery_failed(id, rejected.failure, Instant::now());
        }
        Ok(())
    }

    /// A produce without a record: the core counts it failed, which blocks its key
    /// (no later event of the key leaves ahead of it while the lost session drains)
    /// and aborts the open Kafka transaction it joined; the caller ends the session.
    fn missing_record(&mut self, id: EventId, attempt: u32) -> MissingRecord {
        self.core
            .delivery_failed(id, Failure::Transient, Instant::now());
        MissingRecord { id, attempt }
    }

    /// Whether `id` is to be retried alone; makes the producer that sends records
    /// alone on first use (when it cannot be made, the shared producer is used).
    fn make_alone_publisher(&mut self, id: EventId) -> bool {
        if self.exactly_once.is_some() {
            // Another producer cannot write into this one's transaction.
            return false;
        }
        if !matches!(
            self.records.get(id),
            Some(InFlight::Event { alone: true, .. })
        ) {
            return false;
        }
        if self.alone.is_none() {
            match self.publisher.alone(&self.producer_config) {
                Ok(p) => self.alone = Some(p),
                Err(e) => tracing::warn!(error = %e, "cannot make the retry-alone producer"),
            }
        }
        true
    }

    /// A size error for `id` that may belong to another record of its batch: when
    /// `id` fits every known limit and was not retried alone yet, it is retried
    /// alone, and the failure does not count against it. `true` when so.
    fn retry_alone(&mut self, id: EventId, code: RDKafkaErrorCode, message: &str) -> bool {
        if !kafka::is_size_error(code) {
            return false;
        }
        let producer_limit = self.publisher.max_message_bytes();
        let compressed = self.publisher.compresses();
        let Some(InFlight::Event { event, alone, .. }) = self.records.get_mut(id) else {
            return false;
        };
        let topic_limit = self.topic_limits.limit(&event.topic, Instant::now());
        if *alone || too_large(event, producer_limit, topic_limit, compressed).is_some() {
            return false;
        }
        *alone = true;
        tracing::info!(
            %id,
            topic = %event.topic,
            bytes = event.byte_size(),
            error = message,
            "the broker refused a batch for its size; retrying this record alone"
        );
        true
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
        while self.core.resolvable_events() > 0 || self.transaction_unfinished() {
            // Exactly-once: what is written commits now.
            self.core.commit_now();
            if let Err(lost) = self.execute_actions(&mut stream).await {
                tracing::warn!(%lost, "shutting down: the session ended early; unconfirmed events will be re-sent on the next start");
                break;
            }
            if self.transaction_failure()?.is_some() {
                tracing::warn!(
                    "the Kafka transaction could not commit; the next start aborts it and sends its events again"
                );
                break;
            }
            match self.await_in_flight(deadline).await {
                Drain::Progress => {}
                Drain::Ended => break,
                Drain::TimedOut => {
                    tracing::warn!(
                        in_flight = self.core.in_flight_events(),
                        "shutdown timeout: unconfirmed events will be re-sent on the next start"
                    );
                    break;
                }
            }
        }
        self.confirmation
            .final_save(&mut self.core, FINAL_SAVE_TIMEOUT)
            .await;
        let status = self.core.shutdown_status();
        if send_status(&mut stream, status).await.is_ok() {
            self.summary.confirmed = status.flush;
        }
        if let Err(e) = stream.finish().await {
            tracing::debug!(error = %e, "ending the replication stream");
        }
        // The last commit's events, resolved after the loop's last execution.
        self.forget_resolved(Instant::now());
        tracing::info!(confirmed = %self.summary.confirmed, delivered = self.summary.delivered, "stopped");
        Ok(SessionEnd::Shutdown)
    }
}

/// Whether a Kafka transaction call is under way, and whether its outcome waits for
/// the last reports (both `false` in at-least-once mode).
fn transaction_waits(exactly_once: Option<&ExactlyOnce>) -> (bool, bool) {
    exactly_once.map_or((false, false), |eo| (eo.calling(), eo.settling()))
}

/// How a pause in reading ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pause {
    /// It ran its length, or a burst of bytes ended it early.
    Taken,
    /// Shutdown came during it.
    ShutDown,
}

/// Raises the socket's low-water mark for a pause; `false` where that cannot be
/// done (a Unix socket, a kernel before Linux 4.18, a failed `setsockopt`), and then
/// no pause is taken and the producer's idle flush keeps its usual rules.
fn hold_for_pause(stream: &ReplicationStream) -> bool {
    stream.hold_readiness().unwrap_or_else(|e| {
        tracing::debug!(error = %e, "cannot hold the replication socket's readiness; not pausing");
        false
    })
}

/// A pause in reading (`cdc::read_pacing`), the socket's readiness held
/// ([`hold_for_pause`]): waits `pause`, or until shutdown, or until the socket holds
/// so much that reading at once is better, without being woken by each segment the
/// server sends meanwhile; then releases the readiness.
///
/// # Errors
///
/// The socket failed, or its readiness could not be released (its reads could then
/// wait for ever): the connection is given up.
async fn pause_reading(
    stream: &mut ReplicationStream,
    shutdown: &mut Shutdown,
    pause: Duration,
) -> std::result::Result<Pause, ReplicationError> {
    let outcome = tokio::select! {
        biased;
        () = &mut *shutdown => Ok(Pause::ShutDown),
        () = tokio::time::sleep(pause) => Ok(Pause::Taken),
        read = stream.read_more() => read.map(|()| Pause::Taken),
    };
    match (stream.release_readiness(), outcome) {
        // Stopping anyway (the finished shutdown future must not be polled again):
        // the shutdown goes on, its final reads bounded by their own timeout.
        (Err(e), Ok(Pause::ShutDown)) => {
            tracing::warn!(error = %e, "cannot release the replication socket's readiness at shutdown");
            Ok(Pause::ShutDown)
        }
        (Err(e), _) => Err(e),
        (Ok(()), outcome) => outcome,
    }
}

/// Waits for the Kafka transaction call under way (pending forever without one).
async fn transaction_finished(exactly_once: &mut Option<ExactlyOnce>) {
    match exactly_once {
        Some(eo) => eo.finished().await,
        None => std::future::pending().await,
    }
}

/// Where each ancestor of `timeline` ended (`TIMELINE_HISTORY`), for the start plan's
/// check of a slot after a promotion. Without it (a history file removed by hand) the
/// check falls back to the recorded position alone, so a failure is only logged.
async fn timeline_forks(conn: &mut ReplicationConnection, timeline: u32) -> Vec<TimelineSwitch> {
    match conn.timeline_history(timeline).await {
        Ok(forks) => forks,
        Err(e) => {
            tracing::warn!(error = %e, timeline, "cannot read the timeline history; a slot after a promotion is checked against the recorded position only");
            Vec::new()
        }
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

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::config::OutboxConfig;
    use crate::outbox::{OutboxEvent, OutboxMapper, OutboxRow};

    /// An event whose payload is `bytes` bytes of one repeated letter: what
    /// compresses to almost nothing.
    fn event_of(bytes: usize) -> OutboxEvent {
        let mapper = OutboxMapper::with_template(&OutboxConfig::default(), "events", None)
            .expect("a valid template");
        let row = OutboxRow {
            id: Some(Bytes::from_static(b"1")),
            aggregate_id: Some(Bytes::from_static(b"order-1")),
            payload: Some(Bytes::from(format!("\"{}\"", "x".repeat(bytes - 2)))),
            ..OutboxRow::default()
        };
        mapper.map_row(&row, None).expect("a mappable row")
    }

    #[test]
    fn the_topic_limit_applies_only_to_uncompressed_batches() {
        let event = event_of(12_000);
        assert!(event.byte_size() > 12_000);
        let why = too_large(&event, 1_000_000, Some(4_000), false).expect("above the topic limit");
        assert!(
            why.contains("topic's max.message.bytes = 4000"),
            "the limit is in the error: {why}"
        );
        // Compressed, the batch the broker measures may be far smaller than the
        // record: the broker decides, the relay does not poison in advance.
        assert_eq!(too_large(&event, 1_000_000, Some(4_000), true), None);
        // Within every limit either way.
        for compressed in [false, true] {
            assert_eq!(
                too_large(&event, 1_000_000, Some(1_000_000), compressed),
                None
            );
            assert_eq!(too_large(&event, 1_000_000, None, compressed), None);
        }
    }

    #[test]
    fn the_producer_limit_applies_whether_compressed_or_not() {
        // librdkafka compares message.max.bytes with the uncompressed record.
        let event = event_of(12_000);
        for compressed in [false, true] {
            let why = too_large(&event, 10_000, None, compressed).expect("above the producer's");
            assert!(
                why.contains("message.max.bytes = 10000"),
                "compressed {compressed}: {why}"
            );
        }
    }
}
