//! The flags of `outbox-relay poll` and their resolution against the config.
//!
//! The limits are checked twice on purpose: clap refuses out-of-range flags with a
//! usage error, and [`Settings::new`] refuses the same values when the library is
//! driven without clap (tests, embedding), where a zero batch or an `attempts` limit
//! beyond the `integer` column would otherwise reach SQL.

use std::time::Duration;

use crate::config::{Config, ConfigError};

/// Default `--batch-size`.
const DEFAULT_BATCH_SIZE: u32 = 1000;
/// Largest `--batch-size`: the producer queue (at least 100 000 records) holds a batch.
const MAX_BATCH_SIZE: u32 = 100_000;
/// Default `--workers`.
const DEFAULT_WORKERS: u32 = 1;
/// Default `--poll-interval-ms`.
const DEFAULT_POLL_INTERVAL_MS: u64 = 200;

/// Flags of `outbox-relay poll` (besides `--config`).
#[derive(Debug, Clone, clap::Args)]
pub struct PollArgs {
    /// Rows per batch: one transaction, one round of produce and acks.
    #[arg(long, default_value_t = DEFAULT_BATCH_SIZE,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_BATCH_SIZE)))]
    pub batch_size: u32,
    /// Concurrent workers, each with its own PostgreSQL connection and producer.
    /// More than 1 breaks per-key order (SKIP LOCKED lets a later batch commit
    /// first); keep 1 unless consumers do not need order.
    #[arg(long, default_value_t = DEFAULT_WORKERS,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub workers: u32,
    /// Pause after a batch that came back short (never after a full one).
    #[arg(long, default_value_t = DEFAULT_POLL_INTERVAL_MS)]
    pub poll_interval_ms: u64,
    /// Permanent delivery failures before a row is poisoned [default: relay.max_attempts].
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(i32::MAX)))]
    pub max_attempts: Option<u32>,
    /// Fall back from the CDC relay: first mark sent every row the relay confirmed
    /// (by the newest checkpoint its slot passed, see `retention`), then poll the
    /// rest. Rows after that checkpoint are sent again (duplicates, never losses).
    #[arg(long)]
    pub after_cdc: bool,
}

impl Default for PollArgs {
    fn default() -> Self {
        PollArgs {
            batch_size: DEFAULT_BATCH_SIZE,
            workers: DEFAULT_WORKERS,
            poll_interval_ms: DEFAULT_POLL_INTERVAL_MS,
            max_attempts: None,
            after_cdc: false,
        }
    }
}

/// The flags resolved against the config.
#[derive(Debug, Clone, Copy)]
pub(super) struct Settings {
    pub(super) batch_size: u32,
    pub(super) workers: u32,
    pub(super) poll_interval: Duration,
    /// At least 1, at most `i32::MAX` (the `attempts` column is `integer`).
    pub(super) max_attempts: i32,
    pub(super) shutdown_grace: Duration,
}

impl Settings {
    pub(super) fn new(config: &Config, args: &PollArgs) -> Result<Settings, ConfigError> {
        let invalid = |m: &str| Err(ConfigError::Invalid(m.to_owned()));
        if !(1..=MAX_BATCH_SIZE).contains(&args.batch_size) {
            return invalid(&format!("--batch-size must be 1..={MAX_BATCH_SIZE}"));
        }
        if args.workers == 0 {
            return invalid("--workers must be at least 1");
        }
        let max_attempts = args.max_attempts.unwrap_or(config.relay.max_attempts);
        let Ok(max_attempts @ 1..) = i32::try_from(max_attempts) else {
            return invalid("--max-attempts (relay.max_attempts) must be 1..=2147483647");
        };
        Ok(Settings {
            batch_size: args.batch_size,
            workers: args.workers,
            poll_interval: Duration::from_millis(args.poll_interval_ms),
            max_attempts,
            shutdown_grace: Duration::from_secs(config.relay.shutdown_timeout_secs),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    /// `poll` as the CLI declares it: `--config` and `--set` beside the poller's flags.
    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        config: crate::cli::ConfigArg,
        #[command(flatten)]
        args: PollArgs,
    }

    fn parse(args: &[&str]) -> std::result::Result<PollArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("poll").chain(args.iter().copied())).map(|c| c.args)
    }

    fn config() -> Config {
        Config::from_sources(
            "test",
            "[postgres]\nurl = \"postgresql://h/db\"\n[kafka]\nbrokers = \"k:9092\"\n",
            [],
        )
        .unwrap()
    }

    #[test]
    fn flags_default_as_documented() {
        let args = parse(&[]).unwrap();
        let d = PollArgs::default();
        assert_eq!(
            (
                args.batch_size,
                args.workers,
                args.poll_interval_ms,
                args.max_attempts
            ),
            (d.batch_size, d.workers, d.poll_interval_ms, d.max_attempts)
        );
        assert_eq!(
            (d.batch_size, d.workers, d.poll_interval_ms),
            (1000, 1, 200)
        );
        let s = Settings::new(&config(), &args).unwrap();
        assert_eq!(s.max_attempts, 5, "relay.max_attempts by default");
        assert_eq!(s.poll_interval, Duration::from_millis(200));

        let args = parse(&[
            "--batch-size",
            "10",
            "--workers",
            "3",
            "--poll-interval-ms",
            "50",
            "--max-attempts",
            "2",
        ])
        .unwrap();
        let s = Settings::new(&config(), &args).unwrap();
        assert_eq!((s.batch_size, s.workers, s.max_attempts), (10, 3, 2));
    }

    #[test]
    fn out_of_range_flags_are_refused() {
        for bad in [
            &["--batch-size", "0"][..],
            &["--batch-size", "100001"],
            &["--workers", "0"],
            &["--max-attempts", "0"],
            &["--poll-interval-ms", "-1"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} accepted");
        }
        // Built by hand (not through clap), the same limits hold.
        let args = PollArgs {
            max_attempts: Some(u32::MAX),
            ..PollArgs::default()
        };
        assert!(Settings::new(&config(), &args).is_err());
        let args = PollArgs {
            batch_size: 0,
            ..PollArgs::default()
        };
        assert!(Settings::new(&config(), &args).is_err());
    }
}
