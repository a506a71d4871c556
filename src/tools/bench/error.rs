//! Why a benchmark run fails.
//!
//! The benchmark sits above the relay: it starts relays, reads slots, produces to
//! the broker. Errors of those parts keep their own type, [`crate::Error`], wrapped
//! in [`BenchError::Relay`] (so its message and exit code survive: the caller maps a
//! wrapped error to that error's exit code, anything else to 1). `crate::Error`
//! itself knows nothing of the benchmark: the dependency points one way, from the
//! tool down to the relay.

use crate::tools::workload::WorkloadError;

/// Why the `--plot` chart could not be drawn (the SVG backend writes the file).
pub(crate) type PlotError = plotters::drawing::DrawingAreaErrorKind<std::io::Error>;

/// Errors of `outbox-relay bench`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A relay, database or broker error, with its own exit code.
    #[error(transparent)]
    Relay(crate::Error),
    #[error("benchmark setup: --modes selects nothing")]
    NoModes,
    /// `--pin` could not set a process's CPU affinity.
    #[error("--pin: {0}")]
    Pin(String),
    /// `--standby-url` is not usable (not a standby, or a point needs it).
    #[error("--standby-url: {0}")]
    Standby(String),
    #[error("benchmark setup: no steady schedule for {events_per_s} events/s")]
    NoSchedule { events_per_s: f64 },
    #[error("benchmark setup: no latency samples")]
    NoLatencySamples,
    #[error("benchmark setup: the relay was not ready within 30 s")]
    RelayNotReady,
    #[error("benchmark setup: {0}")]
    RunConfig(#[source] toml::ser::Error),
    /// The run's config has no valid outbox mapping (for the null-sink reader).
    #[error("benchmark setup: {0}")]
    Mapper(#[source] crate::config::ConfigError),
    #[error("benchmark setup: the server ended the replication stream")]
    StreamEnded,
    #[error("benchmark setup: the producer's report channel closed")]
    ReportsClosed,
    /// The replication stream broke the protocol (decoder, mapper or ack tracker).
    #[error("benchmark setup: replication stream: {0}")]
    Stream(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("bad LSN {text:?} from the server: {source}")]
    BadLsn {
        text: String,
        source: crate::lsn::ParseLsnError,
    },
    #[error("topic {topic} never appeared in the broker's metadata")]
    TopicNotVisible { topic: String },
    #[error("cannot start {what}: {source}")]
    Spawn {
        what: String,
        source: std::io::Error,
    },
    #[error("{what} failed: {message}")]
    Child { what: String, message: String },
    #[error("{0} is needed for this mode but was not found")]
    Missing(String),
    #[error("benchmark task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
    #[error("{mode}: {found} of {expected} events on the topic")]
    Undelivered {
        mode: String,
        found: u64,
        expected: u64,
    },
    #[error("cannot write {path}: {source}")]
    Output { path: String, source: PlotError },
    #[error("interrupted (the run's slot, tables and topic were dropped)")]
    Interrupted,
}

impl BenchError {
    /// The exit code (`docs/architecture.md#exit-codes`): a wrapped relay error's
    /// own, 4 when the broker never showed the run's topic (broker unavailable),
    /// 1 for the benchmark's other errors.
    #[must_use]
    pub fn exit_code(&self) -> std::process::ExitCode {
        match self {
            BenchError::Relay(e) => e.exit_code(),
            BenchError::TopicNotVisible { .. } => std::process::ExitCode::from(4),
            _ => std::process::ExitCode::from(1),
        }
    }
}

/// Every error the relay's own functions return (PostgreSQL, Kafka, I/O, config,
/// prerequisites) converts as it would into [`crate::Error`], so `?` works on them.
impl<E: Into<crate::Error>> From<E> for BenchError {
    fn from(e: E) -> BenchError {
        BenchError::Relay(e.into())
    }
}

impl From<WorkloadError> for BenchError {
    fn from(e: WorkloadError) -> BenchError {
        match e {
            WorkloadError::Relay(e) => BenchError::Relay(e),
            WorkloadError::Task(e) => BenchError::Task(e),
        }
    }
}

/// Result of the benchmark's functions.
pub(crate) type Result<T, E = BenchError> = std::result::Result<T, E>;
