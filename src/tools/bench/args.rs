//! The flags of `outbox-relay bench` and what they select: the workload every run
//! writes and the modes compared on it.

use std::path::PathBuf;

use super::drain::Mode;
use crate::tools::workload::Workload;

/// Entities (Kafka keys) the workload spreads its events over.
pub(crate) const ENTITIES: u32 = 1000;

/// Poller settings compared (batch size, workers).
pub(crate) const POLL_VARIANTS: [(u32, u32); 4] = [(100, 1), (100, 4), (1000, 1), (1000, 4)];

/// Mode groups of `--modes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ModeGroup {
    /// `pg_recvlogical` and our replication client with a null sink.
    PgCeiling,
    /// `pg_recvlogical` with pgoutput v2 streaming: what the server spills or
    /// streams of a transaction larger than `logical_decoding_work_mem`.
    PgStreaming,
    /// Our producer alone, no database.
    BrokerCeiling,
    /// The real `outbox-relay run`.
    Cdc,
    /// The real `outbox-relay run` with `kafka.delivery = "exactly-once"` (needs a
    /// broker with transactions, e.g. `outbox-relay dev-broker`).
    CdcExactlyOnce,
    /// The real `outbox-relay poll`, four settings.
    Poll,
    /// The real `outbox-relay run` in pgoutput text format
    /// (`postgres.binary_decoding = false`), beside `cdc`'s binary.
    CdcText,
    /// The real `outbox-relay run` with `[traces]` on, every event traced, spans
    /// exported over OTLP/HTTP to a sink in the bench: the cost of tracing.
    CdcTraced,
    /// The message outbox (`outbox_emit`): `pg_recvlogical` with `messages 'true'`
    /// and the real `outbox-relay run` on messages alone, and the relay on
    /// messages counted in the message ledger (what `audit` needs).
    CdcMessage,
}

/// Which workloads to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkloadKind {
    /// Pre-inserted backlog, drained as fast as possible.
    Backlog,
    /// Fixed-rate writers; latency from commit to delivery.
    Steady,
    /// Both.
    All,
}

/// One steady-rate point of `--rates`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Rate {
    /// This many events per second.
    Fixed(f64),
    /// As fast as the writers go on this machine without a relay (`max`).
    WritersMax,
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rate::Fixed(rate) => write!(f, "{rate}"),
            Rate::WritersMax => f.write_str("max"),
        }
    }
}

/// `--rates` items: a positive number of events/s, or `max`.
fn parse_rate(text: &str) -> Result<Rate, String> {
    let text = text.trim();
    if text.eq_ignore_ascii_case("max") {
        return Ok(Rate::WritersMax);
    }
    match text.parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate > 0.0 => Ok(Rate::Fixed(rate)),
        _ => Err(format!(
            "{text:?} is not a rate: give events per second (> 0) or max"
        )),
    }
}

/// Flags of `outbox-relay bench` (besides `--config`).
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Events per run.
    #[arg(long, default_value_t = 200_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub events: u64,
    /// Approximate payload size (jsonb text) of each event.
    #[arg(long, default_value_t = 300)]
    pub payload_bytes: usize,
    /// Outbox rows per writer transaction.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..))]
    pub rows_per_tx: u32,
    /// Concurrent writer connections.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub writers: u32,
    /// Modes to compare.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "pg-ceiling,broker-ceiling,cdc,poll"
    )]
    pub modes: Vec<ModeGroup>,
    /// Workload.
    #[arg(long, value_enum, default_value_t = WorkloadKind::Backlog)]
    pub workload: WorkloadKind,
    /// Measurements of each figure (median and min–max are shown).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub repeat: u32,
    /// Seconds each steady-rate point writes (`--steady-secs` is the old name).
    #[arg(
        long = "duration",
        alias = "steady-secs",
        value_name = "SECS",
        default_value_t = 20,
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub steady_secs: u64,
    /// Steady-rate points, events/s: numbers, and `max` for the writers' own maximum
    /// (measured first, without a relay).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1000,5000,20000,50000,max",
        value_parser = parse_rate
    )]
    pub rates: Vec<Rate>,
    /// Shards of the `cdc` backlog drain: one relay process, publication and slot
    /// each (`postgres.shards`); the ceilings still read one slot.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(crate::config::shard::MAX_SHARDS)))]
    pub shards: u32,
    /// Steady workload: pin PostgreSQL (the postmaster and every backend and
    /// walsender, which inherit it) to the first CPU list and this bench, its relay
    /// or poller, consumer and writers' client side, and the broker (the process
    /// listening on the broker's port) to the second, as in production, where only
    /// the walsender runs beside the database. `taskset` lists: `0:1`, `0-1:2-3`.
    #[arg(long, value_name = "DB_CPUS:REST_CPUS")]
    pub pin: Option<super::processes::Pin>,
    /// Steady workload: a hot standby (PostgreSQL 16+) of `postgres.url`'s server,
    /// as a URL of the same database. Adds the point `cdc-standby` (the relay
    /// decoding there with `postgres.slot_url`, writing to the primary) after `cdc`,
    /// charges every point the standby's CPU per event and reports its replay lag;
    /// with `--pin` the standby runs on the second CPU list, beside the relay.
    #[arg(long, value_name = "URL")]
    pub standby_url: Option<String>,
    /// Print one JSON object on stdout instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG bar chart of the results to this file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

impl BenchArgs {
    pub(crate) fn workload(&self) -> Workload {
        Workload {
            events: self.events,
            payload_bytes: self.payload_bytes,
            rows_per_tx: self.rows_per_tx,
            writers: self.writers,
            entities: ENTITIES,
        }
    }

    /// The modes of the selected groups, in a fixed order.
    pub(crate) fn modes(&self) -> Vec<Mode> {
        let mut modes = Vec::new();
        let has = |g| self.modes.contains(&g);
        if has(ModeGroup::PgCeiling) {
            modes.extend([Mode::RecvLogical, Mode::Ours]);
        }
        if has(ModeGroup::PgStreaming) {
            modes.push(Mode::RecvLogicalStreaming);
        }
        if has(ModeGroup::BrokerCeiling) {
            modes.push(Mode::BrokerCeiling);
        }
        if has(ModeGroup::Cdc) {
            modes.push(Mode::Cdc);
        }
        if has(ModeGroup::CdcExactlyOnce) {
            modes.push(Mode::CdcExactlyOnce);
        }
        if has(ModeGroup::CdcText) {
            modes.push(Mode::CdcText);
        }
        if has(ModeGroup::CdcTraced) {
            modes.push(Mode::CdcTraced);
        }
        if has(ModeGroup::CdcMessage) {
            modes.extend([
                Mode::RecvLogicalMessage,
                Mode::CdcMessageUnaudited,
                Mode::CdcMessage,
            ]);
        }
        if has(ModeGroup::Poll) {
            modes.extend(
                POLL_VARIANTS
                    .iter()
                    .map(|&(batch, workers)| Mode::Poll { batch, workers }),
            );
        }
        modes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_numbers_or_max() {
        assert_eq!(parse_rate("5000"), Ok(Rate::Fixed(5000.0)));
        assert_eq!(parse_rate(" MAX "), Ok(Rate::WritersMax));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("-3").is_err());
        assert!(parse_rate("fast").is_err());
        assert!(parse_rate("inf").is_err());
        assert_eq!(Rate::Fixed(1000.0).to_string(), "1000");
    }
}
