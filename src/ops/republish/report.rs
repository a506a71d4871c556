//! What a `republish` run did: counts, the rows it lists, text and JSON forms.

use std::fmt;
use std::process::ExitCode;

use serde::Serialize;

use crate::outbox::OutboxEvent;

/// Failed rows listed in a report at most (they are all counted).
const MAX_FAILED_LISTED: u64 = 100;

/// Refused ids listed at most.
const MAX_REFUSED_LISTED: usize = 10;

/// What became of one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RowOutcome {
    /// Acked by the broker (committed, under exactly-once).
    Published,
    /// `--dry-run`: would be published.
    WouldPublish,
    /// The broker refused it or it could not be mapped.
    Failed,
    /// Not sent: an earlier row of its key failed in this run.
    Held,
}

/// One listed row.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RepublishedRow {
    /// The `id` column.
    pub id: String,
    pub outcome: RowOutcome,
    pub idempotency_key: Option<String>,
    pub key: Option<String>,
    pub topic: Option<String>,
    /// Record value bytes.
    pub bytes: usize,
    pub error_kind: Option<String>,
    pub error: Option<String>,
}

impl RepublishedRow {
    pub(super) fn of_event(id: &str, outcome: RowOutcome, event: &OutboxEvent) -> RepublishedRow {
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        RepublishedRow {
            id: id.to_owned(),
            outcome,
            idempotency_key: Some(text(&event.idempotency_key)),
            key: Some(text(&event.key)),
            topic: Some(event.topic.clone()),
            bytes: event.payload.len(),
            error_kind: None,
            error: None,
        }
    }

    pub(super) fn failed(mut self, kind: &str, error: String) -> RepublishedRow {
        self.outcome = RowOutcome::Failed;
        self.error_kind = Some(kind.to_owned());
        self.error = Some(error);
        self
    }

    pub(super) fn unmappable(id: &str, kind: &str, error: String) -> RepublishedRow {
        RepublishedRow {
            id: id.to_owned(),
            outcome: RowOutcome::Failed,
            idempotency_key: None,
            key: None,
            topic: None,
            bytes: 0,
            error_kind: Some(kind.to_owned()),
            error: Some(error),
        }
    }
}

/// The report of one run (`--json` prints it as one object).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RepublishReport {
    /// The outbox table read.
    pub outbox: String,
    /// The value of the `outbox_relay_republish` header of this run's records.
    pub run_id: String,
    pub dry_run: bool,
    /// Published in Kafka transactions (`kafka.delivery = "exactly-once"`).
    pub exactly_once: bool,
    /// Rows selected in the table (rows with a poison row left out: `replay`'s).
    pub selected: u64,
    /// Rows published (with `--dry-run`: that would be).
    pub published: u64,
    /// Rows the broker refused, or that could not be mapped.
    pub failed: u64,
    /// Rows not sent because an earlier row of their key failed.
    pub held: u64,
    /// Rows the relay has not delivered yet (on their way), or behind one of their
    /// key: not published.
    pub refused: u64,
    /// Rows whose record goes to another topic than `--topic`.
    pub other_topic: u64,
    /// Rows of the selection with a poison row: left to `replay`.
    pub poisoned: u64,
    /// Kafka transactions committed (exactly-once).
    pub transactions: u64,
    /// The first refused rows' ids.
    pub refused_ids: Vec<String>,
    /// `outbox_emit` is installed: events written as messages are in no table, and
    /// cannot be published again.
    pub message_outbox: bool,
    /// The first `--sample` published rows, then every failed one (up to 100).
    pub rows: Vec<RepublishedRow>,
    /// Why the run stopped before the end of the selection (the rows reported
    /// published were published).
    pub aborted: Option<String>,
}

impl RepublishReport {
    pub(super) fn add(&mut self, row: RepublishedRow, sample: usize) {
        match row.outcome {
            RowOutcome::Published | RowOutcome::WouldPublish => {
                self.published += 1;
                let listed = self
                    .rows
                    .iter()
                    .filter(|r| r.outcome == row.outcome)
                    .count();
                if listed < sample {
                    self.rows.push(row);
                }
            }
            RowOutcome::Failed => {
                self.failed += 1;
                if self.failed <= MAX_FAILED_LISTED {
                    self.rows.push(row);
                }
            }
            RowOutcome::Held => self.held += 1,
        }
    }

    pub(super) fn refuse(&mut self, id: &str) {
        self.refused += 1;
        if self.refused_ids.len() < MAX_REFUSED_LISTED {
            self.refused_ids.push(id.to_owned());
        }
    }

    /// No row failed or was held behind a failure and the run went to the end: 0,
    /// else 1.
    #[must_use]
    pub fn exit_code(&self) -> ExitCode {
        if self.failed == 0 && self.held == 0 && self.aborted.is_none() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }
    }

    /// JSON (`--json`) or the human summary and row list.
    #[must_use]
    pub fn render(&self, json: bool) -> String {
        if json {
            // Plain strings and numbers only: serialisation cannot fail.
            serde_json::to_string(self).unwrap_or_default()
        } else {
            self.to_string()
        }
    }
}

impl fmt::Display for RepublishReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for row in &self.rows {
            let outcome = match row.outcome {
                RowOutcome::Published => "published",
                RowOutcome::WouldPublish => "would publish",
                RowOutcome::Failed => "FAILED",
                RowOutcome::Held => "held",
            };
            write!(
                f,
                "{outcome:<13} id {} key {} topic {} ({} bytes)",
                row.id,
                row.key.as_deref().unwrap_or("-"),
                row.topic.as_deref().unwrap_or("-"),
                row.bytes
            )?;
            if let (Some(kind), Some(error)) = (&row.error_kind, &row.error) {
                write!(f, ": {kind}: {error}")?;
            }
            writeln!(f)?;
        }
        let verb = if self.dry_run {
            "would be published"
        } else {
            "published"
        };
        write!(
            f,
            "republish {} (run {}): {} selected, {} {verb}",
            self.outbox, self.run_id, self.selected, self.published
        )?;
        if self.exactly_once && !self.dry_run {
            write!(f, " in {} Kafka transaction(s)", self.transactions)?;
        }
        write!(f, ", {} failed, {} held", self.failed, self.held)?;
        if self.other_topic > 0 {
            write!(f, ", {} for other topics", self.other_topic)?;
        }
        if self.poisoned > 0 {
            write!(f, ", {} with a poison row (use replay)", self.poisoned)?;
        }
        if self.refused > 0 {
            write!(
                f,
                "\n{} refused: the relay has not delivered them yet (they are on their way; \
                 run again once it has); first ids: {}",
                self.refused,
                self.refused_ids.join(", ")
            )?;
        }
        if let Some(reason) = &self.aborted {
            write!(f, "\nSTOPPED before the end of the selection: {reason}")?;
        }
        if self.message_outbox {
            write!(
                f,
                "\nnote: events written with outbox_emit (the message outbox) are in no table \
                 and cannot be published again"
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, outcome: RowOutcome) -> RepublishedRow {
        RepublishedRow {
            id: id.into(),
            outcome,
            idempotency_key: Some(format!("k{id}")),
            key: Some("order-1".into()),
            topic: Some("t".into()),
            bytes: 3,
            error_kind: None,
            error: None,
        }
    }

    #[test]
    fn the_report_counts_every_row_and_lists_a_sample_and_the_failures() {
        let mut r = RepublishReport::default();
        for i in 0..5 {
            r.add(row(&i.to_string(), RowOutcome::Published), 2);
        }
        r.add(row("9", RowOutcome::Published).failed("x", "why".into()), 2);
        r.add(row("10", RowOutcome::Held), 2);
        r.refuse("11");
        assert_eq!((r.published, r.failed, r.held, r.refused), (5, 1, 1, 1));
        let listed: Vec<&str> = r.rows.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(listed, ["0", "1", "9"]);
        assert_eq!(r.exit_code(), ExitCode::from(1));
        let text = r.to_string();
        assert!(text.contains("FAILED") && text.contains("1 refused") && text.contains("11"));
        let json: serde_json::Value = serde_json::from_str(&r.render(true)).unwrap();
        assert_eq!(json["rows"][2]["outcome"], "failed");
        assert_eq!(json["refused_ids"][0], "11");
    }

    #[test]
    fn refused_rows_alone_are_not_a_failure() {
        let mut r = RepublishReport::default();
        r.refuse("1");
        assert_eq!(r.exit_code(), ExitCode::SUCCESS);
    }
}
