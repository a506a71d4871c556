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
//! This file is the loop. It holds the core, the event records (what it keeps per
//! in-flight event, the record to produce again or the row to poison, is
//! `cdc::in_flight`), the saved position (`cdc::confirmation`), and one part per
//! port of the shell, each in a file of its own that owns its state and nothing
//! else:
//!
//! - `opening`: connects, decides where to start, creates or heals the slot;
//! - `reader`: the replication stream: options, frames, admission, pacing, the
//!   server's silence;
//! - `delivery`: the producer, its reports, retries alone, topic limits and blocks,
//!   the producer watchdog;
//! - `transaction_driver`: exactly-once's Kafka transactions (no-ops otherwise);
//! - `poison_path`: poison rows, parked keys and halts;
//! - `telemetry`: health, metric handles, the run's summary, failure streaks.
//!
//! The loop decides when each part is called and passes the core and the records
//! to the part that needs them, so that every decision about an event stays the
//! core's. `assemble` builds the parts from the configuration; `ends` names how a
//! session ends.

mod assemble;
mod delivery;
mod ends;
mod opening;
mod poison_path;
mod reader;
mod telemetry;
mod transaction_driver;

#[cfg(test)]
pub(crate) use assemble::{ServerFacts, SimulatedPorts, run_on_ports};
pub use assemble::{run, run_checked, run_with_health};
use delivery::{Delivery, Reported};
use ends::{Drain, Lost, SessionEnd};
use opening::Opening;
use poison_path::PoisonPath;
use reader::{Intake, Pause, StreamReader, send_status};
use telemetry::Telemetry;
use transaction_driver::TransactionDriver;

use std::time::{Duration, Instant};

use crate::cdc::confirmation::{Confirmation, Verdict};
use crate::cdc::in_flight::InFlight;
use crate::cdc::poison_policy::PoisonPolicy;
use crate::cdc::ports::clock;
use crate::cdc::ports::database::Start;
use crate::cdc::ports::stream::WalStream;
use crate::cdc::position_saver::SaverEvent;
use crate::cdc::progress::{Action, Core, CoreConfig, MissingRecord, Records};
use crate::cdc::start::StartPlan;
use crate::config::Config;
use crate::delivery::{ErrorClass, EventId};
use crate::error::{Error, Result};
use crate::kafka::{self, DeliveryReport};
use crate::lifecycle::{Backoff, Shutdown, millis, sleep_or_shutdown};
use crate::lsn::Lsn;
use crate::outbox::position::ServerHistory;
use crate::postgres::replication::ReplicationError;

/// Reconnect backoff after a lost replication session (jittered); it starts over only
/// after a session confirmed progress.
const RECONNECT_BACKOFF_INITIAL: Duration = Duration::from_millis(200);
const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// How long a lost session waits for the broker to answer for its in-flight events.
const LOSS_DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// How often the producer watchdog looks.
const WATCHDOG_TICK: Duration = Duration::from_secs(1);

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

/// See the module documentation.
struct Relay {
    config: Config,
    core: Core,
    /// Every event's record between admission and the core's resolution of it
    /// (`progress::records`: an ack inside a Kafka transaction does not drop it).
    records: Records<InFlight>,
    /// The saved position and this session's saver.
    confirmation: Confirmation,
    opening: Opening,
    reader: StreamReader,
    delivery: Delivery,
    transactions: TransactionDriver,
    /// `relay.on_poison`, the keys it parked, the poison rows an earlier process
    /// wrote, and the poison writer's channels.
    poison: PoisonPath,
    telemetry: Telemetry,
}

impl Relay {
    async fn run(&mut self, mut shutdown: Shutdown) -> Result<RunSummary> {
        let mut backoff = Backoff::new(RECONNECT_BACKOFF_INITIAL, RECONNECT_BACKOFF_MAX);
        let mut first = true;
        loop {
            let stream = tokio::select! {
                biased;
                () = &mut shutdown => return Ok(self.telemetry.summary.clone()),
                stream = self.start_session(first) => stream,
            };
            first = false;
            if self.transactions.needs_new_producer() {
                // A transactional call failed at the start, or a session ended with
                // its transaction in an unknown state: the next producer's
                // `init_transactions` fences this one and settles what it left.
                tracing::warn!("replacing the transactional producer");
                self.replace_producer()?;
            }
            let stream = match stream {
                Ok(stream) => stream,
                Err(e) if e.class() == ErrorClass::Transient => {
                    let pause = clock::jittered(backoff.next_pause());
                    tracing::warn!(error = %e, retry_in_ms = millis(pause), "cannot start replication; retrying");
                    if sleep_or_shutdown(&mut shutdown, pause).await {
                        return Ok(self.telemetry.summary.clone());
                    }
                    continue;
                }
                Err(e) => return Err(e),
            };
            let started_at = self.core.confirmed();
            self.telemetry.health.set_streaming(true, clock::now());
            let walsender = stream.backend_pid();
            let ended = self.stream(stream, &mut shutdown).await;
            self.telemetry.health.set_streaming(false, clock::now());
            let SessionEnd::Lost(reason) = ended? else {
                return Ok(self.telemetry.summary.clone());
            };
            self.telemetry.summary.reconnects += 1;
            self.telemetry.instruments.reconnect();
            tracing::warn!(%reason, confirmed = %self.core.confirmed(), "replication session lost; reconnecting");
            if self.drain_after_loss(&mut shutdown, walsender).await? {
                return Ok(self.telemetry.summary.clone());
            }
            let transaction_unsettled =
                self.transactions.needs_new_producer() || self.core.transaction_events() > 0;
            if reason.needs_new_producer() || transaction_unsettled {
                tracing::error!(%reason, "replacing the Kafka producer; unconfirmed events are produced again in order");
                self.replace_producer()?;
            }
            let progressed = self.core.confirmed() > started_at;
            if progressed {
                backoff.reset();
            }
            self.telemetry
                .session_ended(&reason, self.core.confirmed(), progressed);
            let pause = clock::jittered(backoff.next_pause());
            if sleep_or_shutdown(&mut shutdown, pause).await {
                return Ok(self.telemetry.summary.clone());
            }
        }
    }

    /// After a lost session: lets the broker answer for the in-flight events (up to
    /// [`LOSS_DRAIN_TIMEOUT`]), so that completed transactions are confirmed in memory
    /// and not re-sent, then records what the unconfirmed ones had resolved. Returns
    /// `true` if shutdown came first. `walsender` was the session's (a fence is told
    /// apart from a takeover by it).
    async fn drain_after_loss(
        &mut self,
        shutdown: &mut Shutdown,
        walsender: Option<i32>,
    ) -> Result<bool> {
        let deadline = tokio::time::Instant::now()
            + if self.transactions.on() {
                // A commit or an abort may take its own timeout.
                LOSS_DRAIN_TIMEOUT.max(kafka::TRANSACTION_CALL_TIMEOUT)
            } else {
                LOSS_DRAIN_TIMEOUT
            };
        while (self.core.resolvable_events() > 0 || self.transactions.unfinished(&self.core))
            && !self.delivery.failed_fatally()
        {
            // Exactly-once: what is written commits now, before the core restarts.
            self.core.commit_now();
            if let Err(e) = self.execute_offline_actions() {
                tracing::error!(error = %e, "draining the lost session");
                break;
            }
            let failure = self
                .transactions
                .failure(walsender, self.opening.database.as_ref())
                .await?;
            if let Some(lost) = failure {
                tracing::warn!(%lost, "the Kafka transaction could not end; the next producer aborts it");
                self.delivery.give_up(lost.to_string());
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
        let (calling, settling) = self.transactions.waits();
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
            () = self.transactions.finished(), if calling => Drain::Progress,
            report = self.delivery.next_report() => match report {
                Some(report) => {
                    self.on_report(report);
                    if self.delivery.failed_fatally() {
                        Drain::Ended
                    } else {
                        Drain::Progress
                    }
                }
                None => Drain::Ended,
            },
            outcome = self.poison.next_outcome() => match outcome {
                Some(outcome) => {
                    self.on_poison_outcome(outcome);
                    Drain::Progress
                }
                None => Drain::Ended,
            },
            () = tokio::time::sleep_until(next) => {
                if tokio::time::Instant::now() >= deadline {
                    Drain::TimedOut
                } else {
                    self.core.tick(clock::now());
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
        self.forget_resolved(clock::now());
        while let Some(action) = self.core.next_action() {
            match action {
                // No stream to send it on: the next session starts from what is
                // saved or remembered.
                Action::SendStatus(_) => {}
                action => self.execute(action)?,
            }
        }
        Ok(())
    }

    /// Executes every action the core has queued.
    async fn execute_actions(
        &mut self,
        stream: &mut dyn WalStream,
    ) -> std::result::Result<(), Lost> {
        let now = clock::now();
        self.forget_resolved(now);
        self.telemetry
            .instruments
            .resolved_up_to(self.core.confirmed(), now);
        while let Some(action) = self.core.next_action() {
            match action {
                Action::SendStatus(status) => {
                    // The core caps it at the saved position (`progress::saving`).
                    tracing::trace!(flush = %status.flush, confirmed = %self.core.confirmed(), "standby status");
                    send_status(stream, status).await?;
                    self.reader.status_sent(status);
                    self.telemetry
                        .instruments
                        .status_sent(status.flush, clock::now());
                    self.telemetry.summary.confirmed = status.flush;
                }
                action => self.execute(action)?,
            }
        }
        Ok(())
    }

    /// Executes one action of the core's other than a status update.
    fn execute(&mut self, action: Action) -> std::result::Result<(), MissingRecord> {
        match action {
            Action::Produce { id, attempt } => self.produce(id, attempt)?,
            Action::InsertPoison { id, attempts } => {
                let committed = self.poison.request(
                    id,
                    attempts,
                    &mut self.core,
                    &mut self.records,
                    &self.telemetry.health,
                );
                self.transactions.poisoned(committed);
            }
            Action::Save { lsn, urgent } => self.confirmation.request(lsn, urgent),
            Action::CommitTransaction => self.transactions.commit(
                self.delivery.publisher(),
                &self.core,
                self.opening.history(),
            ),
            Action::AbortTransaction => self
                .transactions
                .abort(self.delivery.publisher(), &self.core),
            Action::SendStatus(_) => {}
        }
        Ok(())
    }

    /// Exactly-once: hands a finished commit's or abort's outcome to the core once
    /// the transaction's last reports are in.
    fn settle_transaction(&mut self) {
        let delivery = &self.delivery;
        self.transactions
            .settle(delivery.publisher(), &mut self.core, || delivery.drained());
    }

    /// Before a cutover or a resync: their backlog's transactional producer takes the
    /// slot's `transactional.id` (`cdc::backlog`) and would fence this session's if it
    /// is initialised, whether the backlog succeeds or not. A new producer is only
    /// initialised when streaming starts, after the backlog.
    fn before_backlog(&mut self) -> Result<()> {
        if self.transactions.initialized() {
            tracing::info!(
                "replacing the transactional producer: a backlog's producer takes its transactional.id"
            );
            self.replace_producer()?;
        }
        Ok(())
    }

    /// Replaces a wedged or fatally failed producer (`Delivery::replace`).
    fn replace_producer(&mut self) -> Result<()> {
        self.delivery.replace()?;
        self.transactions.producer_replaced();
        Ok(())
    }

    /// Connects, decides where to start (`cdc::start`), heals a lost slot, and starts
    /// streaming with a core that continues this process's event ids; then lets
    /// go of the start's connections, whatever came of it.
    async fn start_session(&mut self, first: bool) -> Result<Box<dyn WalStream>> {
        let started = Box::pin(self.open_session(first)).await;
        self.opening.database.release();
        started
    }

    /// See [`Relay::start_session`].
    async fn open_session(&mut self, first: bool) -> Result<Box<dyn WalStream>> {
        // The previous session's saver stops before anything is decided: a late save
        // of its would move the position row under this session's plan.
        self.confirmation.end_session();
        let busy_timeout = self.opening.busy_timeout(&self.config, first);
        let remembered = self.opening.remembered(&self.core);
        let plan = self.opening.decide(remembered, busy_timeout).await?;
        if matches!(plan, StartPlan::Fresh | StartPlan::Lost { .. }) {
            self.before_backlog()?;
        }
        let (
            Start {
                at: start,
                fresh_core,
            },
            opened,
        ) = self
            .opening
            .carry_out(plan, remembered, busy_timeout, &self.telemetry.health)
            .await?;
        let history = opened.server.history;
        self.reset_core(history, start, fresh_core);
        self.opening.opened(history, opened.server.started);
        // Saved where the writes go, checked against that server's start.
        let writes = self
            .opening
            .database
            .position_writes(history, opened.writes_started);
        self.confirmation.start_session(
            writes,
            start,
            self.config
                .relay
                .position_save_interval(self.config.postgres.slot_elsewhere()),
        );
        let slot_name = self.config.postgres.slot_name();
        let stream = self
            .reader
            .start(
                self.opening.database.as_mut(),
                &self.config,
                &slot_name,
                start,
            )
            .await?;
        if let Some(eo) = self.transactions.exactly_once() {
            // Only now, holding the slot: fences the producer of a relay that held
            // it before, and resumes a core without this process's memory.
            eo.start_session(
                self.delivery.publisher(),
                &mut self.core,
                &opened.server,
                self.opening.database.as_mut(),
                start,
                stream.backend_pid(),
            )
            .await?;
        }
        // The poison rows an earlier process wrote, read last of the start's reads
        // of the table (the exactly-once start reads it too, for its record): a
        // killed process's insert that commits meanwhile is then refused as well,
        // where an earlier read would have missed it and produced the event again.
        let recorded = self.opening.database.recorded_poison(start).await;
        self.poison.set_recorded(recorded);
        // Every session, after the poison rows: a cutover's or a resync's backlog
        // may have parked keys meanwhile, and so may a relay that streamed while
        // this one waited for the slot; and a row and its parked key commit
        // together, so every key of a row read is here (an event refused by a row
        // whose key this session lacked would let later events of its key out
        // before it). A start that fails before this read reads again on retry.
        let parked = self.opening.database.parked_keys().await?;
        self.poison
            .set_policy(PoisonPolicy::new(self.config.relay.on_poison, parked));
        tracing::info!(slot = %slot_name, from = %start, %history, "streaming");
        Ok(stream)
    }

    /// A fresh core for the session starting at `start`. On the same history it
    /// continues the old one (ids, the highest confirmed position, what the lost
    /// session resolved); on another, or when the start plan found this process's
    /// positions void (`fresh`), nothing of the old positions is kept.
    fn reset_core(&mut self, history: ServerHistory, start: Lsn, fresh: bool) {
        let now = clock::now();
        let core = std::mem::replace(
            &mut self.core,
            Core::new(CoreConfig::default(), Lsn::ZERO, now),
        );
        self.core = match self.opening.history() {
            None => Core::new(core.config().clone(), start, now),
            Some(previous) if previous == history && !fresh => core.restart(start, now),
            Some(_) => core.restart_on_new_history(start, now),
        };
        self.telemetry.instruments.session_started(start);
        self.records.clear();
        self.reader.reset_session();
        self.delivery.session_started(now);
    }

    /// The replication loop of one session.
    async fn stream(
        &mut self,
        mut stream: Box<dyn WalStream>,
        shutdown: &mut Shutdown,
    ) -> Result<SessionEnd> {
        let timer = tokio::time::sleep(Duration::from_secs(3600));
        tokio::pin!(timer);
        let mut watchdog = tokio::time::interval(WATCHDOG_TICK);
        watchdog.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.reader.streaming();
        self.telemetry.health.set_alert("replication", None);
        loop {
            self.settle_transaction();
            if let Err(lost) = self.execute_actions(stream.as_mut()).await {
                return Ok(SessionEnd::Lost(lost));
            }
            if let Some((code, message)) = self.delivery.take_fatal() {
                return Ok(SessionEnd::Lost(Lost::ProducerFatal { code, message }));
            }
            if let Some(lost) = self
                .transactions
                .failure(stream.backend_pid(), self.opening.database.as_ref())
                .await?
            {
                return Ok(SessionEnd::Lost(lost));
            }
            let (calling, settling) = self.transactions.waits();
            self.telemetry
                .instruments
                .observe(&self.core, &self.telemetry.health);
            self.telemetry.clear_streak_alert(self.core.confirmed());
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
                self.reader.not_reading();
            }
            let may_read = can_read && !calling && !settling && !self.core.in_transaction();
            match self
                .reader
                .pause_if_caught_up(
                    stream.as_mut(),
                    shutdown,
                    may_read,
                    &mut self.delivery,
                    &self.telemetry.instruments,
                )
                .await
            {
                Ok(None) => {}
                Ok(Some(Pause::Taken)) => continue,
                Ok(Some(Pause::ShutDown)) => return self.graceful_shutdown(stream).await,
                Err(e) if e.is_transient() => return Ok(SessionEnd::Lost(e.into())),
                Err(e) => return Err(replication_error(e)),
            }
            let may_nudge = self.delivery.may_nudge(self.core.in_transaction());
            tokio::select! {
                biased;
                () = &mut *shutdown => {
                    return self.graceful_shutdown(stream).await;
                }
                report = self.delivery.next_report() => {
                    let Some(report) = report else {
                        return Err(Error::DeliveryChannelClosed);
                    };
                    self.on_report(report);
                    while let Some(report) = self.delivery.waiting_report() {
                        self.on_report(report);
                    }
                }
                outcome = self.poison.next_outcome() => {
                    let Some(outcome) = outcome else {
                        return Err(Error::RelayPoisonWriterStopped);
                    };
                    self.on_poison_outcome(outcome);
                }
                event = self.confirmation.next_event() => {
                    if let Some(lost) = self.on_saver_event(event) {
                        return Ok(SessionEnd::Lost(lost));
                    }
                }
                () = &mut timer, if has_deadline => {
                    self.core.tick(clock::now());
                }
                () = self.transactions.finished(), if calling => {}
                // The transaction's last report may arrive just before librdkafka
                // counts it out of flight: look again shortly.
                () = tokio::time::sleep(SETTLE_RECHECK), if settling => {}
                _ = watchdog.tick() => {
                    if let Some(lost) = self.delivery.watch(&self.telemetry.health).await {
                        return Ok(SessionEnd::Lost(lost));
                    }
                    if let Some(lost) = self.reader.watch_server(stream.as_mut(), &self.telemetry.health).await {
                        return Ok(SessionEnd::Lost(lost));
                    }
                }
                frame = stream.next_frame(), if can_read => {
                    match frame {
                        Ok(Some(frame)) => {
                            let intake = Intake {
                                core: &mut self.core,
                                records: &mut self.records,
                                transactions: &mut self.transactions,
                                instruments: &mut self.telemetry.instruments,
                            };
                            if let Err(reason) = self.reader.on_frame(frame, intake, &self.telemetry.health) {
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
                () = tokio::task::coop::consume_budget(), if may_nudge => self.delivery.nudge(),
            }
        }
    }

    /// A delivery report: the delivery path tells the core; records of what the
    /// core resolved are dropped.
    fn on_report(&mut self, report: DeliveryReport) {
        let reported =
            self.delivery
                .on_report(report, &mut self.core, &mut self.records, &self.telemetry);
        if reported == Reported::Acked {
            self.forget_resolved(clock::now());
        }
    }

    /// A poison insert finished (`PoisonPath::on_outcome`).
    fn on_poison_outcome(&mut self, outcome: crate::poison::PoisonOutcome) {
        let committed = self.poison.on_outcome(
            outcome,
            &mut self.core,
            &mut self.records,
            &mut self.telemetry.summary,
            &mut self.telemetry.instruments,
        );
        self.transactions.poisoned(committed);
    }

    /// Drops the records of the events the core resolved (`Telemetry::forget_resolved`).
    fn forget_resolved(&mut self, now: Instant) {
        self.telemetry
            .forget_resolved(&mut self.records, &mut self.core, now);
    }

    /// What the saver did (the core decides what it means for the statuses); a
    /// refused row or a server shutting down ends the session.
    fn on_saver_event(&mut self, event: SaverEvent) -> Option<Lost> {
        match self
            .confirmation
            .on_event(event, &mut self.core, &self.telemetry.health)
        {
            Verdict::Continue => None,
            Verdict::ServerStopping(reason) => Some(Lost::ServerStopping { reason }),
            Verdict::Refused(reason) => Some(Lost::PositionRefused { reason }),
        }
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
            self.core.refuse(id, clock::now());
            return Ok(());
        }
        let Ok(InFlight::Event { event, parked, .. }) = self.records.to_produce(id, attempt) else {
            // An unmappable row is never produced either: the core poisons it at
            // admission.
            return Err(delivery::missing_record(&mut self.core, id, attempt));
        };
        if attempt == 1 && self.poison.parks(event) {
            // Its key waits for `replay` (relay.on_poison = "park-key").
            *parked = true;
            self.core.park(id, clock::now());
            return Ok(());
        }
        let transactions = &mut self.transactions;
        self.delivery.send(
            id,
            attempt,
            &mut self.core,
            &mut self.records,
            &self.telemetry,
            |publisher| transactions.before_produce(publisher),
        )
    }

    /// Stop reading, wait (bounded) for in-flight events to resolve, send the final
    /// status update, end the stream.
    async fn graceful_shutdown(&mut self, mut stream: Box<dyn WalStream>) -> Result<SessionEnd> {
        let timeout = Duration::from_secs(self.config.relay.shutdown_timeout_secs);
        let deadline = tokio::time::Instant::now() + timeout;
        tracing::info!(
            in_flight = self.core.in_flight_events(),
            "shutting down: waiting for in-flight events"
        );
        while self.core.resolvable_events() > 0 || self.transactions.unfinished(&self.core) {
            // Exactly-once: what is written commits now.
            self.core.commit_now();
            if let Err(lost) = self.execute_actions(stream.as_mut()).await {
                tracing::warn!(%lost, "shutting down: the session ended early; unconfirmed events will be re-sent on the next start");
                break;
            }
            let failure = self
                .transactions
                .failure(stream.backend_pid(), self.opening.database.as_ref())
                .await?;
            if failure.is_some() {
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
        if send_status(stream.as_mut(), status).await.is_ok() {
            self.telemetry.summary.confirmed = status.flush;
        }
        if let Err(e) = stream.finish().await {
            tracing::debug!(error = %e, "ending the replication stream");
        }
        // The last commit's events, resolved after the loop's last execution.
        self.forget_resolved(clock::now());
        tracing::info!(confirmed = %self.telemetry.summary.confirmed, delivered = self.telemetry.summary.delivered, "stopped");
        Ok(SessionEnd::Shutdown)
    }
}

/// A replication error as the relay's error, classified (`postgres::process_error`).
fn replication_error(e: ReplicationError) -> Error {
    crate::postgres::process_error(e, "").into()
}
