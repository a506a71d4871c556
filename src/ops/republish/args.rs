//! The flags of `outbox-relay republish` and the rows they select.
//!
//! # Selectors
//!
//! Every selector narrows the selection; together they are an AND:
//!
//! * `--from-id` / `--to-id`: the id column, inclusive, compared in the column's
//!   own type (a uuid, a bigint), as `audit` does;
//! * `--since` / `--until`: `created_at` at or after / before, RFC 3339 or a
//!   duration ago (`audit`'s [`TimeSpec`]), resolved once at the start;
//! * `--aggregate-type`, `--aggregate-id`, `--event-type`: equal to the column's
//!   text (the table must have the configured column, else exit code 2);
//! * `--topic`: the topic the row maps to with the current config (the row's
//!   `topic` column or `kafka.topic_template`), checked after mapping.
//!
//! Nothing selected at all is a usage error: re-sending a whole outbox is
//! `--all`, said on purpose.

use chrono::{DateTime, Utc};

use crate::config::{ConfigError, quote_ident};
use crate::ops::audit::TimeSpec;
use crate::poller::{AGGREGATE_ID, AGGREGATE_TYPE, EVENT_TYPE, Layout};

/// Rows the dry run shows by default.
const DEFAULT_SAMPLE: usize = 10;

/// Arguments of `outbox-relay republish` (the config file comes from the CLI wiring).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct RepublishArgs {
    /// Only rows with id at or after ID (compared in the id column's type).
    #[arg(long, value_name = "ID")]
    pub from_id: Option<String>,
    /// Only rows with id at or before ID.
    #[arg(long, value_name = "ID")]
    pub to_id: Option<String>,
    /// Only rows with created_at at or after TIME: RFC 3339
    /// (2026-01-31T12:00:00Z) or a duration ago (90s, 15m, 1h, 2d, 1w).
    #[arg(long, value_name = "TIME")]
    pub since: Option<TimeSpec>,
    /// Only rows with created_at before TIME (same forms as --since).
    #[arg(long, value_name = "TIME")]
    pub until: Option<TimeSpec>,
    /// Only rows of this aggregate type.
    #[arg(long, value_name = "TYPE")]
    pub aggregate_type: Option<String>,
    /// Only rows of this aggregate (entity) id: the record key.
    #[arg(long, value_name = "ID")]
    pub aggregate_id: Option<String>,
    /// Only rows of this event type.
    #[arg(long, value_name = "TYPE")]
    pub event_type: Option<String>,
    /// Only rows whose record goes to this topic (with the current config).
    #[arg(long, value_name = "TOPIC")]
    pub topic: Option<String>,
    /// Every row of the outbox (no other selector needed).
    #[arg(long)]
    pub all: bool,
    /// The outbox to read (its `table`), required when the config has several
    /// `[[outbox]]` entries.
    #[arg(long, value_name = "TABLE")]
    pub outbox: Option<String>,
    /// Count what would be published and show a sample; publish nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Rows the report lists (the first ones, in publishing order).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_SAMPLE)]
    pub sample: usize,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// No progress output on stderr.
    #[arg(long)]
    pub no_progress: bool,
}

impl Default for RepublishArgs {
    fn default() -> Self {
        RepublishArgs {
            from_id: None,
            to_id: None,
            since: None,
            until: None,
            aggregate_type: None,
            aggregate_id: None,
            event_type: None,
            topic: None,
            all: false,
            outbox: None,
            dry_run: false,
            sample: DEFAULT_SAMPLE,
            json: false,
            no_progress: false,
        }
    }
}

/// The selection, checked, with times resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Selection {
    from_id: Option<String>,
    to_id: Option<String>,
    since: Option<DateTime<Utc>>,
    until: Option<DateTime<Utc>>,
    /// `(field, value)`: column equal to the text.
    equal: Vec<(usize, &'static str, String)>,
    /// The topic a record must go to.
    pub(super) topic: Option<String>,
}

/// SQL conditions on alias `o` and their text parameters, numbered from `first`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Filter {
    pub(super) sql: String,
    pub(super) params: Vec<String>,
}

impl Selection {
    /// Checks the flags: something must be selected, `--since` before `--until`.
    pub(super) fn from_args(
        args: &RepublishArgs,
        now: DateTime<Utc>,
    ) -> Result<Selection, ConfigError> {
        let equal: Vec<(usize, &'static str, String)> = [
            (AGGREGATE_TYPE, "--aggregate-type", &args.aggregate_type),
            (AGGREGATE_ID, "--aggregate-id", &args.aggregate_id),
            (EVENT_TYPE, "--event-type", &args.event_type),
        ]
        .into_iter()
        .filter_map(|(field, flag, value)| value.clone().map(|v| (field, flag, v)))
        .collect();
        let selection = Selection {
            from_id: args.from_id.clone(),
            to_id: args.to_id.clone(),
            since: args.since.map(|t| t.resolve(now)),
            until: args.until.map(|t| t.resolve(now)),
            equal,
            topic: args.topic.clone(),
        };
        if !args.all && selection.is_everything() {
            return Err(ConfigError::Invalid(
                "republish needs a selection: --from-id/--to-id, --since/--until, \
                 --aggregate-type, --aggregate-id, --event-type or --topic (or --all for \
                 every row of the outbox)"
                    .into(),
            ));
        }
        if let (Some(s), Some(u)) = (selection.since, selection.until)
            && s >= u
        {
            return Err(ConfigError::Invalid(format!(
                "--since ({s}) must be before --until ({u})"
            )));
        }
        Ok(selection)
    }

    fn is_everything(&self) -> bool {
        self.from_id.is_none()
            && self.to_id.is_none()
            && self.since.is_none()
            && self.until.is_none()
            && self.equal.is_empty()
            && self.topic.is_none()
    }

    /// The conditions on the table (the topic is checked after mapping), with text
    /// parameters numbered from `$first`.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] (exit code 2) when a selector names a column the
    /// table does not have.
    pub(super) fn filter(&self, layout: &Layout, first: usize) -> Result<Filter, ConfigError> {
        let mut sql = vec!["true".to_owned()];
        let mut params = Vec::new();
        let mut next = |value: String| {
            params.push(value);
            first + params.len() - 1
        };
        // The layout always has an id column.
        let id = quote_ident(layout.column(crate::poller::ID_FIELD).unwrap_or("id"));
        let id_type = layout.id_type();
        if let Some(v) = &self.from_id {
            let n = next(v.clone());
            sql.push(format!("o.{id} >= ${n}::text::{id_type}"));
        }
        if let Some(v) = &self.to_id {
            let n = next(v.clone());
            sql.push(format!("o.{id} <= ${n}::text::{id_type}"));
        }
        // Compared as timestamptz: a `timestamp` column is read in the session's
        // UTC, as the mapper reads it.
        let stamp = |t: &DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true);
        for (time, flag, op) in [
            (&self.since, "--since", ">="),
            (&self.until, "--until", "<"),
        ] {
            let Some(t) = time else { continue };
            let Some(column) = layout.column(crate::poller::CREATED_AT_FIELD) else {
                return Err(ConfigError::Invalid(format!(
                    "{flag}: the outbox table has no created_at column (see [outbox.columns])"
                )));
            };
            let n = next(stamp(t));
            sql.push(format!(
                "o.{} {op} ${n}::text::timestamptz",
                quote_ident(column)
            ));
        }
        for (field, flag, value) in &self.equal {
            let Some(column) = layout.column(*field) else {
                return Err(ConfigError::Invalid(format!(
                    "{flag}: the outbox table has no such column (see [outbox.columns])"
                )));
            };
            let n = next(value.clone());
            sql.push(format!("o.{}::text = ${n}", quote_ident(column)));
        }
        Ok(Filter {
            sql: sql.join(" AND "),
            params,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::process::ExitCode;

    use clap::Parser;

    use super::*;
    use crate::error::Error;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: RepublishArgs,
    }

    fn parse(argv: &[&str]) -> RepublishArgs {
        Cli::try_parse_from(std::iter::once("republish").chain(argv.iter().copied()))
            .unwrap()
            .args
    }

    fn now() -> DateTime<Utc> {
        "2026-12-07T10:00:00Z".parse().unwrap()
    }

    #[test]
    fn arguments_parse() {
        let a = parse(&[
            "--from-id",
            "10",
            "--since",
            "2h",
            "--aggregate-type",
            "order",
            "--topic",
            "t",
            "--dry-run",
            "--sample",
            "3",
        ]);
        assert_eq!(a.from_id.as_deref(), Some("10"));
        assert_eq!(a.aggregate_type.as_deref(), Some("order"));
        assert_eq!((a.dry_run, a.sample, a.json), (true, 3, false));
        assert_eq!(parse(&[]).sample, DEFAULT_SAMPLE);
        assert!(Cli::try_parse_from(["republish", "--since", "yesterday"]).is_err());
    }

    #[test]
    fn a_selection_is_required_and_said_on_purpose() {
        let err = Selection::from_args(&RepublishArgs::default(), now()).unwrap_err();
        assert!(err.to_string().contains("--all"));
        assert_eq!(Error::from(err).exit_code(), ExitCode::from(2));
        let all = RepublishArgs {
            all: true,
            ..RepublishArgs::default()
        };
        assert!(Selection::from_args(&all, now()).unwrap().is_everything());
        let backwards = RepublishArgs {
            since: Some("1h".parse().unwrap()),
            until: Some("2h".parse().unwrap()),
            ..RepublishArgs::default()
        };
        assert!(
            Selection::from_args(&backwards, now())
                .unwrap_err()
                .to_string()
                .contains("before --until")
        );
    }

    #[test]
    fn the_filter_numbers_its_parameters_and_casts_to_the_columns_types() {
        let layout = crate::poller::migrated_layout_for_tests();
        let args = RepublishArgs {
            from_id: Some("5".into()),
            since: Some("2026-12-07T09:00:00Z".parse().unwrap()),
            aggregate_id: Some("order-1".into()),
            event_type: Some("Placed".into()),
            ..RepublishArgs::default()
        };
        let f = Selection::from_args(&args, now())
            .unwrap()
            .filter(&layout, 2)
            .unwrap();
        assert_eq!(
            f.sql,
            "true AND o.\"id\" >= $2::text::uuid AND o.\"created_at\" >= $3::text::timestamptz \
             AND o.\"aggregate_id\"::text = $4 AND o.\"event_type\"::text = $5"
        );
        assert_eq!(
            f.params,
            ["5", "2026-12-07T09:00:00.000000Z", "order-1", "Placed"]
        );
    }

    #[test]
    fn a_selector_on_a_missing_column_is_a_usage_error() {
        let mut layout = crate::poller::migrated_layout_for_tests();
        layout.forget_column_for_tests(EVENT_TYPE);
        let args = RepublishArgs {
            event_type: Some("Placed".into()),
            ..RepublishArgs::default()
        };
        let err = Selection::from_args(&args, now())
            .unwrap()
            .filter(&layout, 1)
            .unwrap_err();
        assert!(err.to_string().contains("--event-type"));
    }
}
