//! The error of a library command, and what it means for the process.
//!
//! Every error is classified where it appears (`docs/architecture.md#error-classes`):
//! *transient* errors are retried forever with backoff and never poison an event,
//! *poison* errors concern one event and end in `poison_outbox` after `max_attempts`,
//! *fatal* errors stop the process with one clear message and a distinct exit code.
//! The exit codes are part of the CLI contract: 0 ok, 2 usage/config, 3 PostgreSQL
//! prerequisite, 4 broker unreachable at start-up, 1 anything else.
//!
//! # Where this type sits
//!
//! Above the layers it wraps (config, postgres, outbox, kafka), below the commands
//! that return it (poller, cdc, ops). The lower layers have their own error enums
//! and know nothing of this one; each is one variant here, and its exit code and
//! class come from it. The commands' own failures are named variants carrying data
//! (never a type of the command's module, which would point the dependency upwards).
//! Tests match variants, never message text.

use std::process::ExitCode;

use crate::config::ConfigError;
use crate::delivery::ErrorClass;
use crate::kafka::BrokerError;
use crate::outbox::checkpoint::CheckpointError;
use crate::postgres::PgError;
use crate::postgres::prerequisite::Prerequisite;
use crate::postgres::replication::ReplicationError;

/// Top-level error of a library command; decides the exit code.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    // --- the layers below ---
    /// Configuration could not be read or is invalid (exit code 2).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A PostgreSQL prerequisite is missing: wal_level, publication, slot (exit code 3).
    #[error("PostgreSQL prerequisite not met: {0}")]
    Prerequisite(#[from] Prerequisite),
    /// A failure of the PostgreSQL layer (connection, start-up checks, `postgres.url`);
    /// its exit code and class come from [`PgError`]. A [`PgError::Prerequisite`]
    /// becomes [`Error::Prerequisite`] instead (see the `From` impl), so that every
    /// exit-3 error is matched the same way.
    #[error(transparent)]
    Pg(PgError),
    /// A statement on a metadata connection failed (no server error attached: the
    /// connection itself failed, which is transient).
    #[error("PostgreSQL error: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    /// Taking, reading or pruning a checkpoint failed.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// Producer set-up, the broker check, topic creation: exit code and class come
    /// from the [`BrokerError`] (2 refused setting, 4 broker unavailable, else 1).
    #[error(transparent)]
    Broker(#[from] BrokerError),
    /// A Kafka client call outside the producer (consumers reading topics back).
    #[error("Kafka error: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),

    // --- cdc and poller ---
    /// `run`, `poll`, cutover: the producer's delivery-report channel closed while
    /// reports were awaited.
    #[error("the producer's delivery channel closed")]
    DeliveryChannelClosed,
    /// `run`: `START_REPLICATION` lost a race for the slot, typically with the
    /// walsender of a relay that just died; the session is started again.
    #[error(transparent)]
    RelaySlotTaken(ReplicationError),
    /// `run`: another relay healed the lost slot while this one waited for the lock;
    /// the session is started again from the healed slot.
    #[error("replication slot {slot} was healed by another relay; starting again")]
    RelaySlotHealedElsewhere { slot: String },
    /// `run`: a step of a session's start was asked for before the session was
    /// planned (a broken invariant of the shell); the session is started again.
    #[error("a session step came before its start plan")]
    RelayNotPlanned,
    /// `run` with `kafka.delivery = "exactly-once"`: a transactional call failed in a
    /// way the session cannot absorb (fenced by another relay, a broker without
    /// transactions: exit 3), or the progress record could not be read.
    #[error(transparent)]
    Transaction(#[from] crate::kafka::TransactionError),
    /// `run` with `kafka.delivery = "exactly-once"`: the progress topic is missing
    /// (exit 3: `migrate` creates it).
    #[error(
        "the progress topic {topic:?} does not exist: run `outbox-relay migrate` (it creates \
         it, compacted) or create it (cleanup.policy=compact), or set kafka.progress_topic"
    )]
    ProgressTopicMissing { topic: String },
    /// `run` with `kafka.delivery = "exactly-once"`: the progress record could not
    /// be read (retried like a lost connection).
    #[error("{0}")]
    ProgressRecord(String),
    /// `run`: the task writing `poison_outbox` rows stopped.
    #[error("the poison writer stopped")]
    RelayPoisonWriterStopped,
    /// Cutover: the slot of an interrupted cutover is streamed by some process. Right
    /// after a crash the old walsender may hold it until it notices, so `run` retries.
    #[error(
        "replication slot {slot} is active (pid {pid}) although its cutover never finished: \
         stop the process streaming from it (it may miss the backlog), then start again"
    )]
    CutoverSlotActive { slot: String, pid: i32 },
    /// Cutover or resync: a backlog row was given up on and `relay.on_poison =
    /// "halt"`: the rest is resolved, streaming does not start. Retried like a lost
    /// connection, so the row is tried again until its cause is fixed.
    #[error(
        "{count} backlog row(s) cannot be delivered and relay.on_poison = \"halt\"; first: \
         outbox id {id}: {error}. Streaming does not start until they are: fix the cause \
         (the relay keeps trying), or set relay.on_poison to \"skip\" or \"park-key\""
    )]
    BacklogHalted {
        count: usize,
        id: String,
        error: String,
    },
    /// `cutover`: a termination signal arrived before the cutover completed.
    #[error(
        "cutover interrupted before it completed: run it again (or `run`); it starts \
         over from a new slot and re-sends at most the rows that were in flight"
    )]
    CutoverInterrupted,
    /// Metrics: the histogram buckets were refused.
    #[error("metrics: {0}")]
    MetricsBuckets(#[source] metrics_exporter_prometheus::BuildError),
    /// Metrics: a `metrics` recorder is already installed in this process.
    #[error("cannot install the metrics recorder: {0}")]
    MetricsRecorder(#[source] metrics_exporter_prometheus::BuildError),
    /// Metrics: `metrics.listen` cannot be bound.
    #[error("metrics.listen = {listen:?}: cannot bind: {source}")]
    MetricsBind {
        listen: String,
        #[source]
        source: std::io::Error,
    },
    /// Metrics: the bound listener has no local address.
    #[error("metrics listener: {0}")]
    MetricsListener(#[source] std::io::Error),

    // --- poller ---
    /// A poller worker task panicked or was cancelled.
    #[error("poller worker failed: {0}")]
    PollerWorker(#[source] tokio::task::JoinError),
    /// The outbox returned a row whose id (its primary key) is NULL: a broken table.
    #[error("outbox row with a NULL id")]
    NullOutboxId,

    // --- ops ---
    /// `run` at start (the checks of `outbox-relay check`): every check that fails,
    /// named at once. The exit code is that of the first one's side: 2 config,
    /// 3 PostgreSQL, 4 Kafka, as when `run` stopped at the first.
    #[error("not ready to run: {}", render_failed(.failed))]
    ChecksFailed {
        failed: Vec<FailedCheck>,
        exit_code: u8,
    },
    /// `audit`: the range has more rows than a `u32` rank can number.
    #[error("the range has more than 4294967295 rows: audit it in parts (--since/--until)")]
    AuditRangeTooLarge,
    /// `audit`: the range's row count does not fit in this machine's address space.
    #[error("{rows} rows do not fit in memory")]
    AuditRowsDoNotFit { rows: u64 },
    /// `audit`: the blocking task that reads the topics panicked or was cancelled.
    #[error("audit consumer task failed: {0}")]
    AuditConsumerTask(#[source] tokio::task::JoinError),
    /// `audit`: the broker did not answer a metadata, watermark, assignment or fetch
    /// request (exit code 4, the broker is unavailable).
    #[error("Kafka broker unavailable: {what}: {source}")]
    AuditBroker {
        what: String,
        #[source]
        source: rdkafka::error::KafkaError,
    },
    /// `migrate`: a `{{placeholder}}` in a migration that the config does not fill.
    #[error("migration has an unknown placeholder {placeholder}")]
    MigrationPlaceholder { placeholder: String },
    /// `migrate`: PostgreSQL refused a migration's SQL (`detail` is the server's
    /// message with its detail and hint).
    #[error("migration {version:04}_{name} failed: {detail}")]
    MigrationFailed {
        version: i32,
        name: &'static str,
        detail: String,
        #[source]
        source: tokio_postgres::Error,
    },
    /// `replay`: another replay holds the advisory lock of the poison table.
    #[error("another outbox-relay replay is running on {table}; wait for it to finish")]
    ReplayLocked { table: String },
    /// `replay`: the producer's delivery-report channel closed with records in flight.
    #[error("the Kafka delivery-report channel closed during replay")]
    ReplayReportsClosed,
    /// `republish`: another republish holds the advisory lock of the outbox.
    #[error("another outbox-relay republish is running on {table}; wait for it to finish")]
    RepublishLocked { table: String },
    /// `republish`, exactly-once: a window's Kafka transaction failed to commit this
    /// many times in a row.
    #[error(
        "republish: a window's Kafka transaction could not be committed after {attempts} \
         attempts in a row; the rows reported published were committed"
    )]
    RepublishGaveUp { attempts: u32 },
    /// `republish`: a window's record failed for a reason every later window would
    /// meet too (a timeout: the broker is down or too slow); the run stops.
    #[error(
        "republish: the broker did not take a record ({reason}); stopped, run again when \
         it is back"
    )]
    RepublishStalled { reason: String },
    /// `retention --json`: a cycle report could not be serialised.
    #[error("{0}")]
    RetentionReportJson(#[source] serde_json::Error),
    /// `status`: a query failed (`what` says which; `detail` is the server's message).
    #[error("{what}: {detail}")]
    StatusQuery {
        what: &'static str,
        detail: String,
        #[source]
        source: tokio_postgres::Error,
    },
}

/// One failed start-up check: its name (`postgres.wal_level`), what is wrong and
/// how to fix it (see `ops::check`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedCheck {
    pub name: String,
    pub detail: String,
    pub fix: Option<String>,
}

/// `N checks failed:` and one indented line per check.
fn render_failed(failed: &[FailedCheck]) -> String {
    let mut out = format!(
        "{} check{} failed:",
        failed.len(),
        if failed.len() == 1 { "" } else { "s" }
    );
    for f in failed {
        out.push_str(&format!("\n  {}: {}", f.name, f.detail));
        if let Some(fix) = &f.fix {
            out.push_str(&format!(" (fix: {fix})"));
        }
    }
    out
}

/// A table name that is not `schema.table` is a configuration error (exit code 2).
impl From<crate::config::TableNameError> for Error {
    fn from(e: crate::config::TableNameError) -> Self {
        Error::Config(e.into())
    }
}

impl From<PgError> for Error {
    fn from(e: PgError) -> Self {
        match e {
            PgError::Prerequisite(p) => Error::Prerequisite(p),
            other => Error::Pg(other),
        }
    }
}

impl Error {
    /// The process exit code for this error (`docs/architecture.md#exit-codes`).
    #[must_use]
    pub fn exit_code(&self) -> ExitCode {
        ExitCode::from(match self {
            Error::Config(_) => 2,
            Error::Prerequisite(_) => 3,
            Error::Transaction(e) if e.needs_operator() => 3,
            Error::ProgressTopicMissing { .. } => 3,
            Error::Transaction(_) | Error::ProgressRecord(_) => 1,
            Error::Pg(e) => e.exit_code(),
            Error::Checkpoint(e) => e.exit_code(),
            Error::Broker(e) => e.exit_code(),
            Error::AuditBroker { .. } => 4,
            Error::ChecksFailed { exit_code, .. } => *exit_code,
            Error::Postgres(_)
            | Error::Kafka(_)
            | Error::Io(_)
            // cdc
            | Error::RelaySlotTaken(_)
            | Error::RelaySlotHealedElsewhere { .. }
            | Error::RelayNotPlanned
            | Error::RelayPoisonWriterStopped
            | Error::CutoverSlotActive { .. }
            | Error::BacklogHalted { .. }
            | Error::CutoverInterrupted
            | Error::MetricsBuckets(_)
            | Error::MetricsRecorder(_)
            | Error::MetricsBind { .. }
            | Error::MetricsListener(_)
            // poller
            | Error::DeliveryChannelClosed
            | Error::PollerWorker(_)
            | Error::NullOutboxId
            // ops
            | Error::AuditRangeTooLarge
            | Error::AuditRowsDoNotFit { .. }
            | Error::AuditConsumerTask(_)
            | Error::MigrationPlaceholder { .. }
            | Error::MigrationFailed { .. }
            | Error::ReplayLocked { .. }
            | Error::ReplayReportsClosed
            | Error::RepublishLocked { .. }
            | Error::RepublishGaveUp { .. }
            | Error::RepublishStalled { .. }
            | Error::RetentionReportJson(_)
            | Error::StatusQuery { .. } => 1,
        })
    }

    /// Whether retrying can help (`docs/architecture.md#error-classes`).
    #[must_use]
    pub fn class(&self) -> ErrorClass {
        match self {
            Error::Io(_)
            | Error::RelaySlotTaken(_)
            | Error::RelaySlotHealedElsewhere { .. }
            | Error::RelayNotPlanned
            | Error::BacklogHalted { .. }
            | Error::CutoverSlotActive { .. } => ErrorClass::Transient,
            Error::ProgressRecord(_) => ErrorClass::Transient,
            Error::Transaction(e) if !e.needs_operator() => ErrorClass::Transient,
            // No server error attached: the connection itself failed.
            Error::Postgres(e) if e.as_db_error().is_none() => ErrorClass::Transient,
            Error::Pg(e) => e.class(),
            Error::Checkpoint(e) => e.class(),
            Error::Broker(e) => e.class(),
            _ => ErrorClass::Fatal,
        }
    }
}

/// Result alias for library commands.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_follow_the_contract() {
        let code = |e: Error| e.exit_code();
        assert_eq!(
            code(ConfigError::Invalid("x".into()).into()),
            ExitCode::from(2)
        );
        assert_eq!(
            code(Prerequisite::SlotInvalidated { slot: "s".into() }.into()),
            ExitCode::from(3)
        );
        // A prerequisite found by the PostgreSQL layer is matched as one, too.
        let from_pg = Error::from(PgError::Prerequisite(Prerequisite::WalLevel {
            actual: "replica".into(),
        }));
        assert!(matches!(
            from_pg,
            Error::Prerequisite(Prerequisite::WalLevel { .. })
        ));
        assert_eq!(code(from_pg), ExitCode::from(3));
        assert_eq!(code(Error::CutoverInterrupted), ExitCode::from(1));
    }

    #[test]
    fn lost_connections_are_transient_refusals_are_not() {
        let io = Error::from(std::io::Error::from(std::io::ErrorKind::ConnectionReset));
        assert_eq!(io.class(), ErrorClass::Transient);
        let busy = Error::CutoverSlotActive {
            slot: "s".into(),
            pid: 1,
        };
        assert_eq!(busy.class(), ErrorClass::Transient);
        let refused = Error::from(Prerequisite::SlotBusy {
            slot: "s".into(),
            pid: 1,
            waited_secs: 30,
        });
        assert_eq!(refused.class(), ErrorClass::Fatal);
    }
}
