//! Command-line interface (clap derive). Every command reads its configuration from
//! `--config FILE` (optional: `relay.toml` when present), `OUTBOX_RELAY__SECTION__KEY`
//! environment variables and `--set` overrides.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// Relays transactional-outbox events from PostgreSQL to Kafka by streaming the WAL.
#[derive(Debug, Parser)]
#[command(name = "outbox-relay", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// Where every command's configuration comes from.
#[derive(Debug, Clone, Args)]
pub struct ConfigArg {
    /// Path to the TOML config (see config/relay.example.toml). Without it,
    /// `relay.toml` is read when present; with neither, the environment and `--set`
    /// must give every required key. A file named here that is missing is an error.
    #[arg(long, short = 'c', env = "OUTBOX_RELAY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Override one config key, e.g. `--set relay.max_attempts=7` or
    /// `--set kafka.producer.linger.ms=5` (repeatable; wins over file and env).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    pub overrides: Vec<String>,
}

impl ConfigArg {
    /// Loads the config file (if any) with environment and `--set` overrides.
    pub fn load(&self) -> Result<crate::config::Config, crate::config::ConfigError> {
        crate::config::Config::load_with(self.config.as_deref(), &self.overrides)
    }
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the CDC relay: stream outbox inserts from the replication slot to Kafka.
    Run(ConfigArg),
    /// Cut over from a polling relay: create the slot with an exported snapshot and
    /// publish the rows the poller had not sent, so that `run` streams the rest.
    /// Stop the poller first.
    Cutover(ConfigArg),
    /// Create the outbox and poison tables and the publication (idempotent).
    Migrate(ConfigArg),
    /// Check everything a deploy needs (config, PostgreSQL, role, publication, slot,
    /// migrations, broker, topics): one line per check with its fix; exit 0 when
    /// ready. `run` makes the same checks at start.
    Check {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        args: crate::ops::check::CheckArgs,
    },
    /// Run the polling relay (no logical replication needed; the benchmark baseline).
    Poll {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        poll: crate::poller::PollArgs,
    },
    /// Compare the outbox (and poison table) with what the topics hold: lost,
    /// duplicated and out-of-order events. Exit code 1 when anything is lost or out of order.
    Audit {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        args: crate::ops::audit::AuditArgs,
    },
    #[cfg(feature = "tools")]
    /// Try it in one command: throwaway PostgreSQL, embedded broker, sample events
    /// relayed and audited, summary printed, everything cleaned up.
    Demo(crate::tools::demo::DemoArgs),
    #[cfg(feature = "tools")]
    /// A single-node, in-memory Kafka-protocol broker with transactions, for trying
    /// and testing `kafka.delivery = "exactly-once"`.
    DevBroker(crate::tools::dev_broker::DevBrokerArgs),
    /// Re-publish poison rows with their original idempotency key (never deletes).
    Replay {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        args: crate::ops::replay::ReplayArgs,
    },
    /// Delete outbox rows (or drop partitions) the relay has confirmed and that are
    /// older than retention.period; never touches a row not yet confirmed.
    Retention {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        args: crate::ops::retention::RetentionArgs,
    },
    #[cfg(feature = "tools")]
    /// Side-by-side throughput and latency: the PostgreSQL and broker ceilings, the
    /// CDC relay and the poller, on the same workload (creates and drops its own
    /// tables, slot and topic).
    Bench {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        args: crate::tools::bench::BenchArgs,
    },
    /// Probe a running relay's /healthz (or /readyz with --ready): exit 0 on 200,
    /// 1 otherwise. For health checks in images without an HTTP client.
    Health {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        args: crate::ops::health::HealthArgs,
    },
    /// Show the slot (confirmed LSN, lag, retained WAL) and the poison backlog.
    Status {
        #[command(flatten)]
        config: ConfigArg,
        /// Print one JSON object instead of lines.
        #[arg(long)]
        json: bool,
    },
}
