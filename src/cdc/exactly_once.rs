//! The session's side of `kafka.delivery = "exactly-once"`: the transactional
//! producer's calls in the order the core asks for them, and the progress record.
//!
//! The decisions (when to commit, what a commit makes durable, what an abort sends
//! again, where a new process resumes) are the core's (`cdc::progress::transactions`),
//! where the simulator checks them. This file only carries them out:
//!
//! * **At the start of a session**, once `START_REPLICATION` holds the slot (so a
//!   standby waiting for the slot never fences the active relay), the producer's
//!   `init_transactions` fences any older producer of the slot's `transactional.id`
//!   and aborts what it left open; then the last committed progress record is read
//!   (`read_committed`) and the core resumes from it. A record of another server
//!   history is cut at the fork: positions after it name transactions the new
//!   timeline does not have; a record of another database is not used at all (a
//!   warning says that events may be published again).
//! * **Produces** go into a transaction begun lazily before the first of them.
//! * **A commit** writes the progress record (key: the slot) in the transaction, then
//!   runs `commit_transaction` on a blocking thread while the loop goes on; **an
//!   abort** runs `abort_transaction` the same way.
//! * **An outcome** is handed to the core only once every delivery report of the
//!   transaction was (librdkafka's in-flight count is zero and the report channel is
//!   empty): the core's contract. A retriable failure repeats the call; a commit that
//!   must be aborted is aborted; a fenced producer ends the process (exit 3: another
//!   relay holds the stream), unless the fence is the coordinator's own abort of a
//!   transaction older than its timeout (`cdc::session::transaction_driver`); any
//!   other fatal failure ends the session, and the replaced producer's
//!   `init_transactions` aborts what this one left open.

use std::time::Instant;

use rdkafka::ClientConfig;

use crate::cdc::fence;
use crate::cdc::ports::clock;
use crate::cdc::ports::database::SessionDatabase;
use crate::cdc::ports::producer::librdkafka::KafkaProgressReader;
use crate::cdc::ports::producer::{Producer, ProgressReader};
use crate::cdc::progress::{Core, Origin, ProgressMark};
use crate::cdc::progress_record::ProgressRecord;
use crate::cdc::start::ServerView;
use crate::cdc::unreplayed_poison::{self, PoisonedEvents};
use crate::cdc::wal_identity::{TxIdentity, TxLog, TxNames, Verdict};
use crate::config::{Config, DeliveryMode};
use crate::delivery::EventId;
use crate::error::Result;
use crate::kafka::{self, Isolation, RecordRef, TransactionCall, TransactionError};
use crate::lsn::Lsn;
use crate::outbox::position::ServerHistory;
use crate::postgres::replication::TimelineSwitch;

/// The delivery id of the progress record (never an event's: ids count up from 1).
pub(crate) const PROGRESS_RECORD_ID: EventId = EventId::from_raw(u64::MAX);

/// `client.id` of the progress record's reader.
const READER_CLIENT_ID: &str = "outbox-relay-progress";

/// Largest progress record written: `partial` entries past it are left out (which
/// only makes a restart send their events again), so that a large window cannot
/// make the record larger than the topic accepts.
pub(crate) const MAX_RECORD_BYTES: usize = 256 * 1024;

/// Times a retriable `init_transactions` is made again before the session ends.
const INIT_ATTEMPTS: u32 = 3;

/// What the transactional call under way is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Commit,
    Abort,
}

/// See the module documentation.
pub(crate) struct ExactlyOnce {
    /// `transactional.id` (from the slot's name).
    id: String,
    slot: String,
    topic: String,
    /// Reads the progress record back (`read_committed`).
    reader: Box<dyn ProgressReader>,
    /// `init_transactions` succeeded on the current producer.
    initialized: bool,
    /// A transaction is begun on the current producer.
    begun: bool,
    /// When the transaction now open or ending was begun, until its commit or abort
    /// succeeded (a fence is told apart from a takeover by it, `cdc::session`).
    begun_at: Option<Instant>,
    /// The start-up transaction that shows the broker can commit succeeded.
    probed: bool,
    /// `kafka.transaction_timeout_ms`: a fence of a transaction at least this old
    /// may be the coordinator's own abort, not another relay.
    timeout: std::time::Duration,
    /// A transactional failure at the start of a session: the producer must be
    /// replaced before the next one (its transaction state is unknown or stuck).
    replace_producer: bool,
    /// The commit or abort under way.
    call: Option<(Ending, TransactionCall)>,
    /// A finished call whose outcome waits for the transaction's last reports.
    outcome: Option<(Ending, std::result::Result<(), TransactionError>)>,
    /// A failure the session must act on ([`ExactlyOnce::take_failure`]).
    failure: Option<TransactionError>,
    /// The identities of the transactions the next record may name
    /// (`cdc::wal_identity`).
    transactions: TxLog,
    /// `track_commit_timestamp` was found off (said once).
    unverifiable_said: bool,
    /// The events poisoned, for the next record (`cdc::unreplayed_poison`).
    poisoned: PoisonedEvents,
}

impl ExactlyOnce {
    /// `Some` in exactly-once mode; makes `producer_config` transactional.
    ///
    /// # Errors
    ///
    /// The reader's configuration refused by librdkafka (exit code 2).
    pub(crate) fn new(
        config: &Config,
        producer_config: &mut ClientConfig,
    ) -> Result<Option<ExactlyOnce>> {
        let Some(id) = make_transactional(config, producer_config) else {
            return Ok(None);
        };
        let slot = config.postgres.slot_name();
        let reader = Box::new(KafkaProgressReader(progress_reader_config(
            config,
            READER_CLIENT_ID,
        )?));
        Ok(Some(ExactlyOnce {
            id,
            slot,
            topic: config.kafka.progress_topic.clone(),
            reader,
            initialized: false,
            begun: false,
            begun_at: None,
            probed: false,
            timeout: std::time::Duration::from_millis(config.kafka.transaction_timeout_ms),
            replace_producer: false,
            call: None,
            outcome: None,
            failure: None,
            transactions: TxLog::default(),
            unverifiable_said: false,
            poisoned: PoisonedEvents::default(),
        }))
    }

    /// Reads the progress record through `reader` (the simulation's broker).
    #[cfg(test)]
    pub(crate) fn read_progress_with(&mut self, reader: Box<dyn ProgressReader>) {
        self.reader = reader;
    }

    /// A `Begin`: the transaction committing at `commit` has this xid and commit
    /// time (microseconds since 2000-01-01), which a record naming it carries.
    pub(crate) fn transaction_begun(&mut self, commit: Lsn, xid: u32, commit_time: i64) {
        self.transactions
            .begin(commit, TxIdentity::from_begin(xid, commit_time));
    }

    /// A `Commit`: the transaction committing at `commit` ends at `end`; the slot
    /// is confirmed to `confirmed` (no record names what ended before it).
    pub(crate) fn transaction_ended(&mut self, commit: Lsn, end: Lsn, confirmed: Lsn) {
        self.transactions.commit(commit, end, confirmed);
    }

    /// The producer was replaced: the new one needs its `init_transactions`, and
    /// nothing of the old one's transaction is pending any more.
    pub(crate) fn producer_replaced(&mut self) {
        self.begun_at = None;
        self.initialized = false;
        self.replace_producer = false;
        self.begun = false;
        self.call = None;
        self.outcome = None;
        self.failure = None;
    }

    /// Whether the producer must be replaced before the next session: a start
    /// failed in a transactional call, or a session ended with a transaction begun
    /// or its outcome unknown (the next producer's `init_transactions` fences this
    /// one and settles what it left: committed or aborted, the progress record read
    /// at the next start says which).
    pub(crate) fn needs_new_producer(&self) -> bool {
        self.replace_producer || self.begun || self.call.is_some() || self.outcome.is_some()
    }

    /// Whether the current producer ran `init_transactions`: another producer of the
    /// same `transactional.id` initialised after it (a backlog's, `cdc::backlog`)
    /// fences it.
    pub(crate) fn initialized(&self) -> bool {
        self.initialized
    }

    /// A failure the session must act on: fenced or unsupported ends the process
    /// ([`TransactionError::needs_operator`]), any other replaces the producer.
    pub(crate) fn take_failure(&mut self) -> Option<TransactionError> {
        self.failure.take()
    }

    /// At the start of a session (the slot held): fences older producers (a new
    /// producer's `init_transactions`), reads the last committed progress record, and
    /// adds what it names as durable to the core's memory. Read at every session, not
    /// only the first: another relay may have streamed from the slot meanwhile, and a
    /// replaced producer's last transaction may have committed.
    ///
    /// The record is not used past `start` when the database went back: a record
    /// written when the relay's saved position was `saved` cannot hold for a server
    /// whose session starts below it (a data directory restored in place keeps its
    /// system identifier and timeline, and hands out the same LSNs again).
    ///
    /// # Errors
    ///
    /// Fenced or unsupported (exit 3), a missing progress topic (exit 3); other
    /// failures end the start (transient), and a transactional one replaces the
    /// producer first.
    pub(crate) async fn start_session(
        &mut self,
        publisher: &dyn Producer,
        core: &mut Core,
        server: &ServerView,
        database: &mut dyn SessionDatabase,
        start: Lsn,
        walsender: Option<i32>,
    ) -> Result<()> {
        let outcome = self
            .prepare(publisher, core, server, database, start, walsender)
            .await;
        if let Err(crate::error::Error::Transaction(e)) = &outcome
            && !e.needs_operator()
        {
            self.replace_producer = true;
        }
        outcome
    }

    async fn prepare(
        &mut self,
        publisher: &dyn Producer,
        core: &mut Core,
        server: &ServerView,
        database: &mut dyn SessionDatabase,
        start: Lsn,
        walsender: Option<i32>,
    ) -> Result<()> {
        if !self.initialized {
            self.init(publisher).await?;
        }
        if !self.probed {
            self.probe(publisher, walsender, database).await?;
            self.probed = true;
        }
        // What the last session saw may be sent again, or be another WAL's.
        self.transactions.clear();
        let latest = self.reader.read_latest(&self.topic, &self.slot).await?;
        self.poisoned = PoisonedEvents::from_start(start);
        let Some(record) = latest else {
            tracing::info!(topic = %self.topic, slot = %self.slot, "no progress record yet: nothing to skip");
            return Ok(());
        };
        // The WAL end now, read after the record: `server` was seen when the session
        // connected, before any wait for the slot, and the relay that held the slot
        // meanwhile committed records past it. Judged by that older end, its last
        // record looked written past the server's WAL (a restore) and was dropped,
        // and a standby that took over published the records since again.
        let wal_end = server.wal_end.max(database.wal_end().await?);
        let history = server.history;
        match usable_mark(&record, history, &server.forks, start, wal_end) {
            Ok(mark) if !self.same_wal(database, &record, history, start).await? => {
                tracing::warn!(%start, %wal_end, recorded_saved = %record.saved, confirmed = %mark.confirmed,
                    "the transactions the progress record names are not this server's (restored in place and written since?): the record is not used; events it covered may be published again");
            }
            Ok(mark) => {
                let fork = fork_of(&record, history, &server.forks);
                let (mark, poisoned) =
                    unreplayed_poison_guard(mark, &record, start, fork, database).await;
                self.poisoned = poisoned;
                tracing::info!(confirmed = %mark.confirmed, partial = mark.partial.len(), recorded = %record.history, %history,
                    "resuming from the last committed progress record");
                if record.history == history {
                    self.transactions.remember(mark.confirmed, &record.names);
                }
                core.resume_from(&mark);
            }
            Err(Unused::Restored) => {
                tracing::warn!(%start, %wal_end, recorded_saved = %record.saved, confirmed = %record.mark.confirmed,
                "the database is behind the progress record (restored in place?): the record is not used; events it covered may be published again")
            }
            Err(Unused::OtherDatabase) => tracing::warn!(recorded = %record.history, %history,
                "the progress record belongs to another database: not used; events it covered may be published again"),
        }
        Ok(())
    }

    /// Whether the transactions `record` names by identity are this server's
    /// (`cdc::wal_identity`): asked on the record's own history when its mark
    /// reaches past `start` (below it nothing is sent again). `true` when the server
    /// cannot say (`track_commit_timestamp` off, said once) or the record names none.
    ///
    /// # Errors
    ///
    /// The server's answer failed.
    async fn same_wal(
        &mut self,
        database: &mut dyn SessionDatabase,
        record: &ProgressRecord,
        history: ServerHistory,
        start: Lsn,
    ) -> Result<bool> {
        let reaches_past_start =
            record.mark.confirmed > start || record.mark.partial.iter().any(|p| p.commit >= start);
        if record.history != history || !reaches_past_start {
            return Ok(true);
        }
        let verdict = database
            .wal_identity(&record.names, record.mark.confirmed, start)
            .await?;
        match verdict {
            Verdict::Same => Ok(true),
            Verdict::Other { xid } => {
                tracing::warn!(
                    xid,
                    "a transaction the progress record names did not commit on this server at the recorded time"
                );
                Ok(false)
            }
            Verdict::Unknown => {
                if !self.unverifiable_said {
                    self.unverifiable_said = true;
                    tracing::warn!(
                        "the server keeps no commit time for the progress record's transactions (track_commit_timestamp off, or turned on since they committed): the relay cannot tell a data directory restored in place and written past the record from a restart; with track_commit_timestamp = on (it needs a restart) such a restore publishes again instead of skipping new events"
                    );
                }
                Ok(true)
            }
        }
    }

    /// [`probe`] with this session's producer.
    ///
    /// A fence of the probe's transaction is judged as one in the stream
    /// ([`fence`](crate::cdc::fence)): when it waited `kafka.transaction_timeout_ms`
    /// (a broker stall at the start) and no other walsender than this session's
    /// (`walsender`) holds the slot, the coordinator aborted it on its timeout, and
    /// the start is retried with a new producer instead of the process exiting as if
    /// another relay had taken over (the whole-relay simulation found this).
    async fn probe(
        &mut self,
        publisher: &dyn Producer,
        walsender: Option<i32>,
        database: &dyn SessionDatabase,
    ) -> Result<()> {
        let began = clock::now();
        let Err(failed) = probe(publisher, &self.id, &self.topic, &self.slot).await else {
            return Ok(());
        };
        self.replace_producer |= failed.producer_unusable;
        let waited = clock::elapsed(began);
        if !failed.error.is_fenced()
            || !fence::coordinator_timed_out(
                &failed.error,
                Some(waited),
                self.timeout,
                walsender,
                database,
            )
            .await
        {
            return Err(failed.error.into());
        }
        tracing::warn!(error = %failed.error, waited_ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
            "the start-up probe's transaction outlived kafka.transaction_timeout_ms and the coordinator fenced it (a broker stall, not another relay): retrying with a new producer");
        self.replace_producer = true;
        Err(TransactionError::Abortable {
            code: rdkafka::error::RDKafkaErrorCode::InvalidProducerEpoch,
            message: format!(
                "the coordinator aborted the start-up probe on its timeout ({})",
                failed.error
            ),
        }
        .into())
    }

    async fn init(&mut self, publisher: &dyn Producer) -> Result<()> {
        let mut attempt = 1;
        loop {
            match publisher.init_transactions(&self.id).await {
                Ok(()) => break,
                Err(TransactionError::Retriable { .. }) if attempt < INIT_ATTEMPTS => attempt += 1,
                Err(e) => return Err(e.into()),
            }
        }
        tracing::info!(transactional_id = %self.id, "transactions initialised; older producers of this id are fenced");
        self.initialized = true;
        self.begun = false;
        Ok(())
    }

    /// Before a produce: begins the transaction if none is. `false` when librdkafka
    /// refused (the producer is unusable: [`ExactlyOnce::take_failure`] says why).
    pub(crate) fn before_produce(&mut self, publisher: &dyn Producer) -> bool {
        if self.begun {
            return true;
        }
        match publisher.begin_transaction(&self.id) {
            Ok(()) => {
                self.begun = true;
                self.begun_at = Some(clock::now());
                true
            }
            Err(e) => {
                self.failure.get_or_insert(e);
                false
            }
        }
    }

    /// [`Action::CommitTransaction`](crate::cdc::progress::Action): writes the
    /// progress record in the transaction and starts the commit.
    pub(crate) fn commit(&mut self, publisher: &dyn Producer, core: &Core, history: ServerHistory) {
        let mark = core.transaction_mark().cloned().unwrap_or_default();
        let names = TxNames {
            watermark: self.transactions.ending_at(mark.confirmed),
            partial: mark
                .partial
                .iter()
                .filter_map(|p| {
                    self.transactions
                        .committing_at(p.commit)
                        .map(|id| (p.commit, id))
                })
                .collect(),
        };
        let record = ProgressRecord {
            slot: self.slot.clone(),
            history,
            saved: core.saved_position(),
            mark,
            names,
            backlog: None,
            poisoned: self.poisoned.clone(),
        };
        let value = record.encode_within(MAX_RECORD_BYTES);
        let sent = send_progress(publisher, &self.topic, &self.slot, &value);
        match sent {
            Ok(()) => self.start(publisher, Ending::Commit),
            Err(rejected) => {
                // Committing the events without their record would make a restart
                // send them again: the transaction is aborted instead.
                tracing::warn!(error = %rejected, topic = %self.topic, "the progress record was refused; aborting the transaction");
                self.start(publisher, Ending::Abort);
            }
        }
    }

    /// The event named `origin` is poisoned (its row committed): the next records
    /// name it (`cdc::unreplayed_poison`).
    pub(crate) fn poisoned(&mut self, origin: Origin) {
        self.poisoned.push(origin.commit, origin.ordinal);
    }

    /// [`Action::AbortTransaction`](crate::cdc::progress::Action).
    pub(crate) fn abort(&mut self, publisher: &dyn Producer) {
        self.start(publisher, Ending::Abort);
    }

    fn start(&mut self, publisher: &dyn Producer, ending: Ending) {
        let call = match ending {
            Ending::Commit => publisher.start_commit(&self.id),
            Ending::Abort => publisher.start_abort(&self.id),
        };
        self.begun = false;
        self.call = Some((ending, call));
    }

    /// How long the transaction now open or ending has been open (`None` without
    /// one): the coordinator aborts a transaction older than `transaction.timeout.ms`.
    pub(crate) fn transaction_age(&self, now: Instant) -> Option<std::time::Duration> {
        self.begun_at.map(|at| now.saturating_duration_since(at))
    }

    /// Whether a commit or an abort is under way (await [`ExactlyOnce::finished`]).
    pub(crate) fn calling(&self) -> bool {
        self.call.is_some()
    }

    /// Waits for the call under way; pending forever when there is none.
    pub(crate) async fn finished(&mut self) {
        let Some((ending, call)) = self.call.as_mut() else {
            return std::future::pending().await;
        };
        let outcome = kafka::joined(call.await);
        let ending = *ending;
        self.call = None;
        self.outcome = Some((ending, outcome));
    }

    /// Whether an outcome waits to be handed to the core.
    pub(crate) fn settling(&self) -> bool {
        self.outcome.is_some()
    }

    /// Hands a finished call's outcome to the core once every report of the
    /// transaction is in (`drained`: librdkafka has nothing in flight and the report
    /// channel is empty); retries, aborts or gives up as the outcome says.
    pub(crate) fn settle(&mut self, publisher: &dyn Producer, core: &mut Core, drained: bool) {
        // A success waits for the last reports (the core's contract); a failure is
        // acted on at once (a retry or an abort need not wait for them).
        if !drained && matches!(self.outcome, Some((_, Ok(())))) {
            return;
        }
        let Some((ending, outcome)) = self.outcome.take() else {
            return;
        };
        let now = clock::now();
        match (ending, outcome) {
            (Ending::Commit, Ok(())) => {
                ::metrics::counter!(crate::cdc::metrics::KAFKA_TRANSACTIONS, "outcome" => "committed")
                    .increment(1);
                self.begun_at = None;
                core.transaction_committed(now);
            }
            (Ending::Abort, Ok(())) => {
                ::metrics::counter!(crate::cdc::metrics::KAFKA_TRANSACTIONS, "outcome" => "aborted")
                    .increment(1);
                self.begun_at = None;
                core.transaction_aborted(now);
            }
            (ending, Err(TransactionError::Retriable { code, message })) => {
                tracing::warn!(?ending, ?code, %message, "Kafka transaction call failed; trying again");
                self.start(publisher, ending);
            }
            (Ending::Commit, Err(TransactionError::Abortable { code, message })) => {
                tracing::warn!(?code, %message, "Kafka transaction cannot commit; aborting it (its events are produced again)");
                self.start(publisher, Ending::Abort);
            }
            (_, Err(e)) => {
                self.failure.get_or_insert(e);
            }
        }
    }
}

/// In exactly-once mode, makes `producer_config` transactional under the slot's
/// `transactional.id` and returns the id; `None` in at-least-once mode. The stream's
/// producer and a backlog's take the same id, so each fences the other.
pub(crate) fn make_transactional(
    config: &Config,
    producer_config: &mut ClientConfig,
) -> Option<String> {
    if config.kafka.delivery != DeliveryMode::ExactlyOnce {
        return None;
    }
    let id = kafka::transactional_id(&config.postgres.slot_name());
    kafka::transactional_config(
        producer_config,
        &id,
        std::time::Duration::from_millis(config.kafka.transaction_timeout_ms),
    );
    Some(id)
}

/// The settings of a progress record reader (`read_committed`).
///
/// # Errors
///
/// The reader's configuration refused by librdkafka (exit code 2).
pub(crate) fn progress_reader_config(config: &Config, client_id: &str) -> Result<ClientConfig> {
    Ok(
        kafka::reader_config(&config.kafka, client_id, Isolation::ReadCommitted).map_err(|e| {
            crate::config::ConfigError::Invalid(format!(
                "kafka.producer (progress record reader): {e}"
            ))
        })?,
    )
}

/// Queues one record of the progress topic `topic`, reported as
/// [`PROGRESS_RECORD_ID`].
pub(crate) fn send_progress(
    publisher: &dyn Producer,
    topic: &str,
    key: &str,
    value: &[u8],
) -> std::result::Result<(), kafka::SendRejected> {
    publisher.send(
        PROGRESS_RECORD_ID,
        RecordRef {
            topic,
            key: key.as_bytes(),
            payload: value,
            headers: &[],
            timestamp_ms: None,
        },
    )
}

/// A start-up transaction that failed.
pub(crate) struct ProbeFailed {
    pub(crate) error: TransactionError,
    /// Its abort failed too: the producer must be replaced.
    pub(crate) producer_unusable: bool,
}

/// One transaction with one record under the key `<slot>.probe` (which readers of
/// the slot's record skip, and compaction keeps once): a broker that cannot commit a
/// transaction is found at start, with a clear message, instead of at the first
/// commit; and before the progress record is read, so that a broker that leaves the
/// transaction open cannot hold that read.
pub(crate) async fn probe(
    publisher: &dyn Producer,
    id: &str,
    topic: &str,
    slot: &str,
) -> std::result::Result<(), ProbeFailed> {
    let key = format!("{slot}.probe");
    let unusable = |error| ProbeFailed {
        error,
        producer_unusable: true,
    };
    publisher.begin_transaction(id).map_err(unusable)?;
    let committed = match send_progress(publisher, topic, &key, b"{}") {
        Ok(()) => kafka::joined(publisher.start_commit(id).await),
        Err(rejected) => Err(TransactionError::Abortable {
            code: rejected.code,
            message: rejected.message,
        }),
    };
    match committed {
        Ok(()) => Ok(()),
        Err(error @ TransactionError::Unsupported { .. }) => Err(ProbeFailed {
            error,
            producer_unusable: false,
        }),
        // Aborting the probe loses nothing; if the abort fails too, the producer is
        // replaced.
        Err(error) => Err(ProbeFailed {
            error,
            producer_unusable: kafka::joined(publisher.start_abort(id).await).is_err(),
        }),
    }
}

/// Why a progress record is not used at a session start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unused {
    /// Another system identifier.
    OtherDatabase,
    /// The same timeline, and the session starts below the position the relay had
    /// saved when the record was written, or the server's WAL ends before what the
    /// record names: the data directory went back (restored in place), and its LSNs
    /// will be handed out again to new commits.
    Restored,
}

/// The part of `record` a session of `history` starting at `start`, on a server
/// whose WAL ends at `wal_end`, can resume from.
///
/// On the record's own timeline, two signs of a restore in place make the record
/// unusable (events it names may be published again; none is lost):
/// * the session starts below the position the relay had saved when it wrote the
///   record (the position row went back with the data);
/// * the server's WAL ends before the record's watermark. Everything the record names
///   was decoded, so it was flushed, and flushed WAL survives a crash and a restart:
///   a server whose WAL is shorter lost it. Checking the saved position alone let a
///   restore that landed between the record's saved position and its watermark
///   through, and the commits made after the restore, which take LSNs the record
///   names, were resolved without a produce. (A restore whose server was written
///   past the watermark before the relay came back looks like a restart: what
///   tells those apart is the content of the WAL, which the record does not carry.)
///
/// The restore guard holds on the record's own timeline only. On a later timeline
/// (a promoted standby, PostgreSQL 17's synced failover slot among them) the slot
/// is almost always behind the primary's saved position, and that says nothing of a
/// restore: the fork point is what tells which positions the new timeline shares,
/// and [`mark_on`] keeps the record up to it. (Dropping the record there published
/// the events up to the fork a second time.)
fn usable_mark(
    record: &ProgressRecord,
    history: ServerHistory,
    forks: &[TimelineSwitch],
    start: Lsn,
    wal_end: Lsn,
) -> std::result::Result<ProgressMark, Unused> {
    if record.history.system_identifier == history.system_identifier
        && record.history.timeline == history.timeline
        && (start < record.saved || wal_end < record.mark.confirmed)
    {
        return Err(Unused::Restored);
    }
    mark_on(record, history, forks).ok_or(Unused::OtherDatabase)
}

/// Where `record`'s timeline ended in the history of a server on a later timeline
/// of its database (`None` on its own timeline, or another database's).
fn fork_of(
    record: &ProgressRecord,
    history: ServerHistory,
    forks: &[TimelineSwitch],
) -> Option<Lsn> {
    let promoted = record.history.system_identifier == history.system_identifier
        && record.history.timeline != history.timeline;
    promoted.then(|| {
        forks
            .iter()
            .find(|f| f.timeline == record.history.timeline)
            .map_or(Lsn::ZERO, |f| f.switchpoint)
    })
}

/// `mark` cut below the first event the record names poisoned whose poison row
/// this server lacks (a promoted standby that had not replayed it, a data directory
/// restored from before it: `cdc::unreplayed_poison`), and the list of poisoned
/// events this session goes on from: the record's, and the names of this server's
/// poison rows from below where the record's writer may have gone on without a
/// record. A failed read takes every listed event for missing (duplicates, never a
/// loss) and lists nothing more.
async fn unreplayed_poison_guard(
    mark: ProgressMark,
    record: &ProgressRecord,
    start: Lsn,
    fork: Option<Lsn>,
    database: &mut dyn SessionDatabase,
) -> (ProgressMark, PoisonedEvents) {
    let from = unreplayed_poison::read_from(&record.mark, start);
    let rows = database.recorded_poison(from).await;
    let (mark, cut) = unreplayed_poison::guard(mark, &record.poisoned, start, |commit, ordinal| {
        rows.holds(commit, ordinal)
    });
    if let Some(at) = cut {
        tracing::warn!(%at, %start, poisoned_since = ?record.poisoned.since, history = %record.history,
            "the progress record names a poisoned event at or after this point whose poison row this server does not have (a promoted standby that had not replayed it, or a restore): it and the events after it are sent again");
    }
    let poisoned =
        record
            .poisoned
            .carried(&record.mark, start, fork, rows.names(), rows.complete());
    (mark, poisoned)
}

/// The part of `record`'s mark that holds on the server history `history`: all of
/// it on the same history; up to the fork when `history` branched off the record's
/// timeline later; nothing of another database.
fn mark_on(
    record: &ProgressRecord,
    history: ServerHistory,
    forks: &[TimelineSwitch],
) -> Option<ProgressMark> {
    if record.history.system_identifier != history.system_identifier {
        return None;
    }
    if record.history.timeline == history.timeline {
        return Some(record.mark.clone());
    }
    // Where the record's timeline ended in this server's history; a record of a
    // later timeline than this server's (or one it never had) keeps nothing.
    let fork = forks
        .iter()
        .find(|f| f.timeline == record.history.timeline)
        .map_or(Lsn::ZERO, |f| f.switchpoint);
    Some(ProgressMark {
        confirmed: record.mark.confirmed.min(fork),
        partial: record
            .mark
            .partial
            .iter()
            .filter(|p| p.commit < fork)
            .cloned()
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdc::progress::PartialTx;

    fn record(timeline: u32) -> ProgressRecord {
        ProgressRecord {
            slot: "s".into(),
            history: ServerHistory {
                system_identifier: 7,
                timeline,
            },
            saved: Lsn(100),
            mark: ProgressMark {
                confirmed: Lsn(500),
                partial: vec![
                    PartialTx {
                        commit: Lsn(300),
                        admitted: 2,
                        unresolved: vec![],
                    },
                    PartialTx {
                        commit: Lsn(600),
                        admitted: 1,
                        unresolved: vec![],
                    },
                ],
            },
            names: TxNames::default(),
            backlog: None,
            poisoned: PoisonedEvents::default(),
        }
    }

    #[test]
    fn a_record_of_an_earlier_timeline_holds_up_to_the_fork() {
        let now = ServerHistory {
            system_identifier: 7,
            timeline: 2,
        };
        let forks = [TimelineSwitch {
            timeline: 1,
            switchpoint: Lsn(400),
        }];
        let mark = mark_on(&record(1), now, &forks).unwrap();
        assert_eq!(mark.confirmed, Lsn(400));
        assert_eq!(
            mark.partial.len(),
            1,
            "only the transaction before the fork"
        );
        assert_eq!(mark_on(&record(2), now, &forks).unwrap(), record(2).mark);
        // A timeline this server never had: nothing holds.
        let unknown = mark_on(&record(5), now, &forks).unwrap();
        assert_eq!(unknown.confirmed, Lsn::ZERO);
        assert!(unknown.partial.is_empty());
        let other_db = ServerHistory {
            system_identifier: 8,
            timeline: 2,
        };
        assert_eq!(mark_on(&record(2), other_db, &forks), None);
    }

    #[test]
    fn a_promoted_standby_behind_the_saved_position_resumes_up_to_the_fork() {
        // The record's relay had saved 100 on timeline 1; the standby promoted at 400
        // streams from its synced slot at 80.
        let promoted = ServerHistory {
            system_identifier: 7,
            timeline: 2,
        };
        let forks = [TimelineSwitch {
            timeline: 1,
            switchpoint: Lsn(400),
        }];
        let mark = usable_mark(&record(1), promoted, &forks, Lsn(80), Lsn(90)).expect("used");
        assert_eq!(mark.confirmed, Lsn(400));
        assert_eq!(mark.partial.len(), 1);
        // On the record's own timeline, a start below its saved position is a restore.
        let same = ServerHistory {
            system_identifier: 7,
            timeline: 1,
        };
        assert_eq!(
            usable_mark(&record(1), same, &[], Lsn(80), Lsn(900)),
            Err(Unused::Restored)
        );
        assert_eq!(
            usable_mark(&record(1), same, &[], Lsn(100), Lsn(900)),
            Ok(record(1).mark)
        );
        let other_db = ServerHistory {
            system_identifier: 8,
            timeline: 1,
        };
        assert_eq!(
            usable_mark(&record(1), other_db, &[], Lsn(200), Lsn(900)),
            Err(Unused::OtherDatabase)
        );
    }

    #[test]
    fn a_server_whose_wal_ends_before_the_record_was_restored_in_place() {
        // Saved 100, watermark 500: a restore to 300 starts at the restored saved
        // position (100 or more) with the WAL ending near 300; commits after the
        // restore take LSNs up to 500 that the record names.
        let same = ServerHistory {
            system_identifier: 7,
            timeline: 1,
        };
        assert_eq!(
            usable_mark(&record(1), same, &[], Lsn(100), Lsn(300)),
            Err(Unused::Restored)
        );
        // A restart keeps every flushed position: the WAL ends at or past 500.
        assert_eq!(
            usable_mark(&record(1), same, &[], Lsn(100), Lsn(500)),
            Ok(record(1).mark)
        );
    }
}
