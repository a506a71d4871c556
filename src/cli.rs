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
    /// Send chosen outbox rows again (by id or time range, aggregate, event type or
    /// topic), with the original idempotency key; only rows the relay has delivered.
    Republish {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        args: crate::ops::republish::RepublishArgs,
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

#[cfg(test)]
mod tests {
    //! The commands tables of the README and the docs against the CLI itself: a
    //! command added (or renamed) in [`Command`] and missing from a table, or a row
    //! left for a command that is gone, fails here rather than in a reader's shell.

    use std::collections::BTreeSet;

    use clap::CommandFactory;

    use super::Cli;

    /// The tables that list every command: file, text, and the heading they are under.
    const TABLES: [(&str, &str, &str); 3] = [
        ("README.md", include_str!("../README.md"), "## Commands"),
        (
            "docs/operations.md",
            include_str!("../docs/operations.md"),
            "## Commands",
        ),
        (
            "docs/architecture.md",
            include_str!("../docs/architecture.md"),
            "### Command line",
        ),
    ];

    /// The rows of the tables under `heading` (up to the next heading) whose first cell
    /// is code: the command (the cell's first word) and the whole cell,
    /// `` | `poll [--after-cdc]` | `` giving `poll` and `poll [--after-cdc]`.
    fn rows(text: &str, heading: &str) -> Vec<(String, String)> {
        let mut lines = text.lines().skip_while(|line| *line != heading);
        assert!(lines.next().is_some(), "no heading {heading:?}");
        let mut fenced = false;
        let mut out = Vec::new();
        for line in lines {
            if line.starts_with("```") {
                fenced = !fenced;
            }
            if fenced {
                continue;
            }
            if line.starts_with('#') {
                break;
            }
            let Some(rest) = line.strip_prefix("| `") else {
                continue;
            };
            let cell = rest.split("` |").next().unwrap_or_default();
            let name = cell.split(['`', ' ']).next().unwrap_or_default();
            out.push((name.to_owned(), cell.to_owned()));
        }
        out
    }

    /// The commands the tables under `heading` list, in order.
    fn listed(text: &str, heading: &str) -> Vec<String> {
        rows(text, heading)
            .into_iter()
            .map(|(name, _)| name)
            .collect()
    }

    fn commands() -> BTreeSet<String> {
        Cli::command()
            .get_subcommands()
            .map(|c| c.get_name().to_owned())
            .filter(|name| name != "help")
            .collect()
    }

    #[test]
    fn every_command_has_a_row_in_each_commands_table() {
        let ours = commands();
        assert!(ours.contains("run") && ours.contains("migrate"), "{ours:?}");
        for (file, text, heading) in TABLES {
            let rows = listed(text, heading);
            let listed: BTreeSet<String> = rows.iter().cloned().collect();
            assert_eq!(
                listed.len(),
                rows.len(),
                "{file}: a command twice: {rows:?}"
            );
            let missing: Vec<&String> = ours.difference(&listed).collect();
            assert!(
                missing.is_empty(),
                "{file}, {heading:?}: no row for {missing:?}"
            );
            // Without the `tools` feature the CLI lacks `demo`, `bench` and
            // `dev-broker`, which the tables still describe.
            if cfg!(feature = "tools") {
                let unknown: Vec<&String> = listed.difference(&ours).collect();
                assert!(
                    unknown.is_empty(),
                    "{file}, {heading:?}: rows for commands the CLI does not have: {unknown:?}"
                );
            }
        }
    }

    /// The command-line table of docs/architecture.md gives each command's usage:
    /// every flag of the command is in its row (those every command takes, `--config`
    /// and `--set`, are in the line above the table).
    #[test]
    fn every_flag_is_in_the_usage_table() {
        let (file, text, heading) = TABLES[2];
        let usage = rows(text, heading);
        let mut missing = Vec::new();
        for command in Cli::command().get_subcommands() {
            let name = command.get_name();
            let Some((_, cell)) = usage.iter().find(|(listed, _)| listed == name) else {
                continue; // every_command_has_a_row_in_each_commands_table says so
            };
            for arg in command.get_arguments() {
                let Some(long) = arg.get_long() else { continue };
                if arg.is_hide_set() || matches!(long, "config" | "set" | "help") {
                    continue;
                }
                if !cell.contains(&format!("--{long}")) {
                    missing.push(format!("{name} --{long}"));
                }
            }
        }
        assert!(
            missing.is_empty(),
            "{file}, {heading:?}: flags missing from their command's row: {missing:?}"
        );
    }

    #[test]
    fn a_table_is_read_as_the_commands_it_lists() {
        let text = "## Commands\n\n```sh\n| `not-a-row` |\n```\n\n| command | what |\n|---|---|\n\
                    | `poll [--after-cdc]` | p |\n| `replay --id ID` | r |\n\n## Next\n| `later` | x |\n";
        assert_eq!(listed(text, "## Commands"), ["poll", "replay"]);
    }
}
