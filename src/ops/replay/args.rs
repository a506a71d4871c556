//! The flags of `outbox-relay replay` and the selection they make.
//!
//! # Selection, and why a second `--all` publishes nothing
//!
//! * `--all` selects the rows with `replayed_at IS NULL`. A replayed row is marked
//!   (`replayed_at = now()`, `replay_count + 1`), so running `--all` again finds
//!   nothing and publishes nothing: the command is idempotent.
//! * `--id ID` (repeatable, or comma-separated) selects exactly those rows, *whether
//!   or not they were replayed before*: naming a row is an explicit request to send
//!   it again (e.g. a consumer lost it); `replay_count` then counts every send. An
//!   unknown id is a usage error (exit code 2) and nothing is published.
//! * Both together select the union. Neither is a usage error.
//! * Rows are published in `poison_id` order; rows poisoned while `replay` runs (a
//!   relay may be running) are left for the next run.
//!
//! The SQL that applies a [`Selection`] is in [`super::store`].

use std::collections::BTreeSet;

use crate::config::{Config, ConfigError};

/// Arguments of `outbox-relay replay` (the config file comes from the CLI wiring).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct ReplayArgs {
    /// Replay the poison row with this `poison_id`, even if it was replayed before
    /// (repeatable, or comma-separated).
    #[arg(long = "id", value_name = "ID", value_delimiter = ',')]
    pub ids: Vec<i64>,
    /// Replay every poison row that was not replayed yet (`replayed_at IS NULL`).
    #[arg(long)]
    pub all: bool,
    /// Show what would be published; publish nothing, change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// The outbox whose poison table to replay from (its `table`), required when the
    /// config has several `[[outbox]]` entries.
    #[arg(long, value_name = "TABLE")]
    pub outbox: Option<String>,
}

/// The config of the outbox `replay` works on: the only one, or the one `--outbox`
/// names.
///
/// # Errors
///
/// [`ConfigError::Invalid`] when several outboxes leave it open or `--outbox` names
/// none of them.
pub(super) fn replayed_outbox(config: &Config, args: &ReplayArgs) -> Result<Config, ConfigError> {
    crate::ops::chosen_outbox(config, args.outbox.as_deref(), "poison rows to replay")
}

/// Which rows to replay, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Selection {
    /// Explicitly named `poison_id`s, sorted, without duplicates.
    pub(super) ids: Vec<i64>,
    /// Every row not replayed yet.
    pub(super) all: bool,
}

impl Selection {
    pub(super) fn from_args(args: &ReplayArgs) -> Result<Selection, ConfigError> {
        if args.ids.is_empty() && !args.all {
            return Err(ConfigError::Invalid(
                "replay needs --id ID (repeatable) or --all: say which poison rows to re-publish"
                    .into(),
            ));
        }
        let ids: BTreeSet<i64> = args.ids.iter().copied().collect();
        Ok(Selection {
            ids: ids.into_iter().collect(),
            all: args.all,
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
        args: ReplayArgs,
    }

    fn parse(argv: &[&str]) -> ReplayArgs {
        Cli::try_parse_from(std::iter::once("replay").chain(argv.iter().copied()))
            .unwrap()
            .args
    }

    #[test]
    fn arguments_parse() {
        let a = parse(&["--id", "3", "--id", "1,2", "--dry-run", "--json"]);
        assert_eq!(a.ids, vec![3, 1, 2]);
        assert!(!a.all && a.dry_run && a.json);
        let a = parse(&["--all"]);
        assert!(a.all && a.ids.is_empty() && !a.dry_run && !a.json);
        assert!(Cli::try_parse_from(["replay", "--id", "x"]).is_err());
    }

    #[test]
    fn selection_needs_ids_or_all() {
        let err = Selection::from_args(&ReplayArgs::default()).unwrap_err();
        assert!(err.to_string().contains("--id") && err.to_string().contains("--all"));
        let err = Error::from(err);
        assert_eq!(err.exit_code(), ExitCode::from(2));
        let sel = Selection::from_args(&ReplayArgs {
            ids: vec![5, 2, 5, 9],
            ..ReplayArgs::default()
        })
        .unwrap();
        assert_eq!(sel.ids, vec![2, 5, 9]);
        assert!(!sel.all);
        let sel = Selection::from_args(&ReplayArgs {
            all: true,
            ..ReplayArgs::default()
        })
        .unwrap();
        assert!(sel.all && sel.ids.is_empty());
    }
}
