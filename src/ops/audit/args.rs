//! The flags of `outbox-relay audit` and the range they select.
//!
//! The range is given by time (`--since`/`--until`: an RFC 3339 instant or a
//! duration ago) and/or by id (`--from-id`/`--to-id`, compared in the id column's
//! own type). Durations are resolved once, against the start of the audit, into a
//! [`Range`], so the PostgreSQL rows and the Kafka read (which starts from the
//! offset of `--since`, see [`super::topic`]) describe the same instants. Bad flags
//! are usage errors (exit code 2), reported before anything is read.

use crate::kafka::Isolation;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};

use crate::config::ConfigError;
use crate::config::duration::{DurationError, parse_duration};
use crate::error::Error;

/// Default for `--timeout-secs`.
pub(crate) const DEFAULT_TIMEOUT_SECS: u64 = 30;

/// Flags of `outbox-relay audit` (the CLI adds `--config`).
#[derive(Debug, Clone, clap::Args)]
pub struct AuditArgs {
    /// Only rows with created_at at or after TIME: RFC 3339
    /// (2026-01-31T12:00:00Z) or a duration ago (90s, 15m, 1h, 2d, 1w, 1h30m).
    #[arg(long, value_name = "TIME")]
    pub since: Option<TimeSpec>,
    /// Only rows with created_at before TIME (same forms as --since). A little in
    /// the past (e.g. 1m) keeps events still in flight from counting as lost.
    #[arg(long, value_name = "TIME")]
    pub until: Option<TimeSpec>,
    /// Only rows with id at or after ID (compared in the id column's type).
    #[arg(long, value_name = "ID")]
    pub from_id: Option<String>,
    /// Only rows with id at or before ID.
    #[arg(long, value_name = "ID")]
    pub to_id: Option<String>,
    /// Topic to read (repeatable). Default: the topics the rows map to with the
    /// current config; give it when rows were published under another template.
    #[arg(long = "topic", value_name = "TOPIC")]
    pub topics: Vec<String>,
    /// Print the report as JSON:
    /// {"expected","delivered","lost","duplicates","out_of_order_keys","poisoned"}.
    #[arg(long)]
    pub json: bool,
    /// Stop reading a topic when no record arrived for this long before every
    /// partition reached the end offset captured at start.
    #[arg(long, value_name = "SECS", default_value_t = DEFAULT_TIMEOUT_SECS)]
    pub timeout_secs: u64,
    /// No progress output on stderr.
    #[arg(long)]
    pub no_progress: bool,
    /// What the audit reads of transactional records: `read_uncommitted` (every
    /// record written) or `read_committed` (what a consumer of
    /// `kafka.delivery = "exactly-once"` sees: aborted transactions left out).
    #[arg(long, value_enum, default_value_t = Isolation::ReadUncommitted)]
    pub isolation: Isolation,
}

impl Default for AuditArgs {
    fn default() -> Self {
        AuditArgs {
            since: None,
            until: None,
            from_id: None,
            to_id: None,
            topics: Vec::new(),
            json: false,
            isolation: Isolation::ReadUncommitted,
            timeout_secs: DEFAULT_TIMEOUT_SECS,
            no_progress: false,
        }
    }
}

/// A point in time on the command line: absolute, or a duration before now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeSpec {
    /// RFC 3339, e.g. `2026-01-31T12:00:00Z`.
    At(DateTime<Utc>),
    /// A duration ago, e.g. `1h` (resolved when the audit starts).
    Ago(Duration),
}

impl TimeSpec {
    /// The instant, relative to `now` for a duration.
    #[must_use]
    pub(crate) fn resolve(self, now: DateTime<Utc>) -> DateTime<Utc> {
        match self {
            TimeSpec::At(t) => t,
            TimeSpec::Ago(d) => chrono::Duration::from_std(d)
                .ok()
                .and_then(|d| now.checked_sub_signed(d))
                .unwrap_or(DateTime::<Utc>::MIN_UTC),
        }
    }
}

/// A `--since`/`--until` value that is neither an RFC 3339 time nor a duration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{input:?} is neither an RFC 3339 time (2026-01-31T12:00:00Z) nor a duration \
     like 90s, 15m, 1h, 2d, 1w or 1h30m: {source}"
)]
pub struct InvalidTimeSpec {
    /// The value as given (trimmed).
    pub input: String,
    /// Why it is not a duration either.
    pub source: DurationError,
}

impl FromStr for TimeSpec {
    type Err = InvalidTimeSpec;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if let Ok(t) = DateTime::parse_from_rfc3339(s) {
            return Ok(TimeSpec::At(t.with_timezone(&Utc)));
        }
        parse_duration(s)
            .map(TimeSpec::Ago)
            .map_err(|source| InvalidTimeSpec {
                input: s.to_owned(),
                source,
            })
    }
}

/// The range after resolving durations against the start time.
#[derive(Debug, Clone, Default)]
pub(super) struct Range {
    pub(super) since: Option<DateTime<Utc>>,
    pub(super) until: Option<DateTime<Utc>>,
    pub(super) from_id: Option<String>,
    pub(super) to_id: Option<String>,
}

impl Range {
    /// Resolves the flags against `now`; `--since` must come before `--until`.
    pub(super) fn resolve(args: &AuditArgs, now: DateTime<Utc>) -> Result<Range, Error> {
        let range = Range {
            since: args.since.map(|t| t.resolve(now)),
            until: args.until.map(|t| t.resolve(now)),
            from_id: args.from_id.clone(),
            to_id: args.to_id.clone(),
        };
        if let (Some(s), Some(u)) = (range.since, range.until)
            && s >= u
        {
            return Err(usage(format!(
                "--since ({}) must be before --until ({})",
                rfc3339(s),
                rfc3339(u)
            )));
        }
        Ok(range)
    }
}

/// An instant as the audit prints and binds it (microseconds, `Z`).
pub(super) fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// A usage error (exit code 2).
pub(super) fn usage(message: String) -> Error {
    Error::Config(ConfigError::Invalid(message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn flags_parse_with_clap() {
        use clap::Parser;
        #[derive(Debug, clap::Parser)]
        struct Cli {
            #[command(flatten)]
            audit: AuditArgs,
        }
        let cli = Cli::try_parse_from([
            "audit",
            "--since",
            "2026-01-31T12:00:00Z",
            "--until",
            "5m",
            "--from-id",
            "10",
            "--topic",
            "a",
            "--topic",
            "b",
            "--json",
            "--timeout-secs",
            "7",
        ])
        .unwrap();
        let a = cli.audit;
        assert!(matches!(a.since, Some(TimeSpec::At(_))));
        assert_eq!(a.until, Some(TimeSpec::Ago(Duration::from_secs(300))));
        assert_eq!(a.from_id.as_deref(), Some("10"));
        assert_eq!(a.topics, vec!["a", "b"]);
        assert!(a.json);
        assert_eq!(a.timeout_secs, 7);
        let defaults = Cli::try_parse_from(["audit"]).unwrap().audit;
        assert_eq!(defaults.timeout_secs, DEFAULT_TIMEOUT_SECS);
        assert!(!defaults.json && defaults.topics.is_empty() && defaults.since.is_none());
        let err = Cli::try_parse_from(["audit", "--since", "yesterday"]).unwrap_err();
        assert!(err.to_string().contains("RFC 3339"), "{err}");
    }

    #[test]
    fn time_specs_parse_and_resolve() {
        let now = DateTime::parse_from_rfc3339("2026-01-31T12:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let at: TimeSpec = "2026-01-01T00:00:00+01:00".parse().unwrap();
        assert_eq!(rfc3339(at.resolve(now)), "2025-12-31T23:00:00.000000Z");
        let ago: TimeSpec = "1h".parse().unwrap();
        assert_eq!(rfc3339(ago.resolve(now)), "2026-01-31T11:00:00.000000Z");
        assert!("yesterday".parse::<TimeSpec>().is_err());
        let huge = TimeSpec::Ago(Duration::from_secs(u64::MAX));
        assert_eq!(huge.resolve(now), DateTime::<Utc>::MIN_UTC);
    }

    #[test]
    fn since_must_precede_until() {
        let args = AuditArgs {
            since: Some("1h".parse().unwrap()),
            until: Some("2h".parse().unwrap()),
            ..AuditArgs::default()
        };
        let err = Range::resolve(&args, Utc::now()).unwrap_err();
        assert!(matches!(err, Error::Config(_)), "{err}");
    }

    proptest! {
        #[test]
        fn time_spec_parse_never_panics(s in ".{0,24}") {
            let _ = s.parse::<TimeSpec>();
        }
    }
}
