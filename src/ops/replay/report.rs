//! What `replay` did, per row and in sum: the human table with its summary line,
//! or one JSON object (`--json`).
//!
//! Row failures are not errors of the command: each failed row is in the report
//! with the mapper's or the broker's reason (and the `error_kind` it was poisoned
//! with, which stays in the table), and [`ReplayReport::exit_code`] is 1 when a row
//! failed or the producer hit a fatal error, else 0.

use std::fmt;
use std::process::ExitCode;

use serde::Serialize;

use super::store::PoisonRecord;
use crate::outbox::OutboxEvent;

/// What happened to one poison row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Acknowledged by the broker and marked replayed.
    Published,
    /// `--dry-run`: the record could be built and would be published.
    WouldPublish,
    /// Not published (or not acknowledged); the row is left unmarked.
    Failed,
}

impl Outcome {
    fn label(self) -> &'static str {
        match self {
            Outcome::Published => "published",
            Outcome::WouldPublish => "would publish",
            Outcome::Failed => "failed",
        }
    }
}

/// One selected poison row in the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplayedRow {
    pub poison_id: i64,
    pub outcome: Outcome,
    /// The idempotency key (the record's first header).
    pub idempotency_key: Option<String>,
    /// The record key (`aggregate_id`).
    pub key: Option<String>,
    /// The topic published to (or that would be); `None` when the row cannot be mapped.
    pub topic: Option<String>,
    /// Record size: key, value and headers; 0 when the row cannot be mapped.
    pub bytes: usize,
    /// Where the broker stored it.
    pub partition: Option<i32>,
    pub offset: Option<i64>,
    /// `replay_count` after this run.
    pub replay_count: i32,
    /// Why it failed now: the mapper's or the broker's error kind.
    pub error_kind: Option<String>,
    /// Why it failed now, in words.
    pub error: Option<String>,
    /// The `error_kind` it was poisoned with (unchanged in the table).
    pub poisoned_as: String,
}

impl ReplayedRow {
    pub(super) fn new(rec: &PoisonRecord) -> ReplayedRow {
        ReplayedRow {
            poison_id: rec.poison_id,
            outcome: Outcome::Failed,
            idempotency_key: rec
                .idempotency_key
                .clone()
                .or_else(|| rec.outbox_id.clone()),
            key: rec.aggregate_id.clone(),
            topic: None,
            bytes: 0,
            partition: None,
            offset: None,
            replay_count: rec.replay_count,
            error_kind: None,
            error: None,
            poisoned_as: rec.error_kind.clone(),
        }
    }

    pub(super) fn set_event(&mut self, event: &OutboxEvent) {
        self.idempotency_key = Some(String::from_utf8_lossy(&event.idempotency_key).into_owned());
        self.key = Some(String::from_utf8_lossy(&event.key).into_owned());
        self.topic = Some(event.topic.clone());
        self.bytes = event.byte_size();
    }

    pub(super) fn fail(&mut self, kind: &str, error: impl Into<String>) {
        self.outcome = Outcome::Failed;
        self.error_kind = Some(kind.to_owned());
        self.error = Some(error.into());
    }

    pub(super) fn delivered(&mut self, partition: i32, offset: i64) {
        self.outcome = Outcome::Published;
        self.partition = Some(partition);
        self.offset = Some(offset);
        self.replay_count = self.replay_count.saturating_add(1);
    }
}

/// What `replay` did (or, with `--dry-run`, would do).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ReplayReport {
    /// The poison table, as configured.
    pub poison_table: String,
    pub dry_run: bool,
    /// Rows selected by `--id` / `--all`.
    pub selected: u64,
    /// Rows published and marked (with `--dry-run`: rows that would be published).
    pub published: u64,
    /// Rows that could not be mapped or were not acknowledged; left unmarked.
    pub failed: u64,
    /// Rows with `replayed_at` set that `--all` did not select (name them with
    /// `--id` to send them again).
    pub already_replayed: u64,
    /// Set when the producer hit a fatal error and the replay stopped early; the
    /// rows not reached are not in `rows` and stay unmarked.
    pub aborted: Option<String>,
    /// Every processed row, in `poison_id` order; then the parked rows released,
    /// key by key, in the order the relay read them.
    pub rows: Vec<ReplayedRow>,
    /// The parked keys (`relay.on_poison = "park-key"`) this run looked at.
    pub keys: Vec<ParkedKeyReport>,
}

/// A parked key and what this run did with it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ParkedKeyReport {
    pub topic: String,
    pub key: String,
    #[serde(flatten)]
    pub outcome: KeyOutcome,
}

/// What happened to a parked key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum KeyOutcome {
    /// Its parked rows were delivered in order and the relay produces its events again.
    Released { delivered: u64 },
    /// `--dry-run`: it would be released after publishing this many parked rows.
    WouldRelease { rows: u64 },
    /// It stays parked, for this reason.
    StillParked { reason: String },
}

impl ReplayReport {
    /// 0 when every selected row was published (or would be), else 1.
    #[must_use]
    pub fn exit_code(&self) -> ExitCode {
        if self.is_success() {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }
    }

    /// No row failed and the replay was not aborted.
    #[must_use]
    pub fn is_success(&self) -> bool {
        self.failed == 0 && self.aborted.is_none()
    }

    /// The report as one line of JSON.
    #[must_use]
    pub fn to_json(&self) -> String {
        // Plain strings and numbers only: serialisation cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// JSON (`--json`) or the human table and summary line.
    #[must_use]
    pub fn render(&self, json: bool) -> String {
        if json {
            self.to_json()
        } else {
            self.to_string()
        }
    }

    pub(super) fn add(&mut self, row: ReplayedRow) {
        match row.outcome {
            Outcome::Published | Outcome::WouldPublish => self.published += 1,
            Outcome::Failed => self.failed += 1,
        }
        self.rows.push(row);
    }

    fn summary(&self) -> String {
        let table = &self.poison_table;
        let mut line = if self.selected == 0 {
            format!("nothing to replay in {table}")
        } else if self.dry_run {
            format!(
                "dry run: would publish {} of {} selected poison rows from {table}; nothing was published or changed",
                self.published, self.selected
            )
        } else {
            format!(
                "replayed {} of {} selected poison rows from {table}",
                self.published, self.selected
            )
        };
        if self.failed > 0 {
            let verb = if self.dry_run {
                "cannot be mapped"
            } else {
                "failed"
            };
            line.push_str(&format!(
                "; {} {verb} (left unmarked, original error kept)",
                self.failed
            ));
        }
        if self.already_replayed > 0 {
            line.push_str(&format!(
                "; {} already replayed, not selected by --all (name them with --id to send again)",
                self.already_replayed
            ));
        }
        let released = self
            .keys
            .iter()
            .filter(|k| matches!(k.outcome, KeyOutcome::Released { .. }))
            .count();
        let would = self
            .keys
            .iter()
            .filter(|k| matches!(k.outcome, KeyOutcome::WouldRelease { .. }))
            .count();
        let parked = self.keys.len() - released - would;
        if released > 0 {
            line.push_str(&format!("; {released} parked key(s) released"));
        }
        if would > 0 {
            line.push_str(&format!("; {would} parked key(s) would be released"));
        }
        if parked > 0 {
            line.push_str(&format!("; {parked} key(s) stay parked"));
        }
        if let Some(reason) = &self.aborted {
            line.push_str(&format!("; ABORTED: {reason}"));
        }
        line
    }

    /// One line per parked key that stays parked, with the reason.
    fn still_parked(&self) -> String {
        let mut out = String::new();
        for k in &self.keys {
            if let KeyOutcome::StillParked { reason } = &k.outcome {
                out.push_str(&format!(
                    "key {:?} on topic {:?} stays parked: {reason}\n",
                    k.key, k.topic
                ));
            }
        }
        out
    }
}

impl fmt::Display for ReplayReport {
    /// A table of the processed rows, then one summary line.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.rows.is_empty() {
            let cells: Vec<[String; 7]> = self
                .rows
                .iter()
                .map(|r| {
                    let or_dash = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
                    let detail = match (r.outcome, &r.error_kind, &r.error) {
                        (Outcome::Failed, kind, error) => format!(
                            "{}: {}",
                            kind.as_deref().unwrap_or("error"),
                            error.as_deref().unwrap_or("")
                        ),
                        (Outcome::Published, _, _) => format!(
                            "partition {} offset {}, replay_count {}",
                            r.partition.unwrap_or_default(),
                            r.offset.unwrap_or_default(),
                            r.replay_count
                        ),
                        (Outcome::WouldPublish, _, _) => {
                            format!("poisoned as {}", r.poisoned_as)
                        }
                    };
                    [
                        r.poison_id.to_string(),
                        r.outcome.label().to_owned(),
                        or_dash(&r.idempotency_key),
                        or_dash(&r.key),
                        or_dash(&r.topic),
                        if r.bytes == 0 {
                            "-".to_owned()
                        } else {
                            r.bytes.to_string()
                        },
                        detail,
                    ]
                })
                .collect();
            let header = [
                "poison_id",
                "outcome",
                "idempotency_key",
                "key",
                "topic",
                "bytes",
                "detail",
            ];
            let mut widths = header.map(str::len);
            for row in &cells {
                for (w, cell) in widths.iter_mut().zip(row) {
                    *w = (*w).max(cell.chars().count());
                }
            }
            let line = |f: &mut fmt::Formatter<'_>, row: [&str; 7]| -> fmt::Result {
                // Numbers right-aligned, text left-aligned; the last column unpadded.
                write!(f, "{:>w$}", row[0], w = widths[0])?;
                for i in 1..6 {
                    if i == 5 {
                        write!(f, "  {:>w$}", row[i], w = widths[i])?;
                    } else {
                        write!(f, "  {:<w$}", row[i], w = widths[i])?;
                    }
                }
                writeln!(f, "  {}", row[6])
            };
            line(f, header)?;
            for row in &cells {
                line(f, row.each_ref().map(String::as_str))?;
            }
        }
        write!(f, "{}{}", self.still_parked(), self.summary())
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::{mapper, original_row, poisoned};
    use super::super::publish::dry_run_page;
    use super::*;
    use crate::outbox::PayloadFormat;

    fn sample_report(dry_run: bool) -> ReplayReport {
        let m = mapper(None);
        let (_, good) = poisoned(&m, &original_row(), None);
        let bad = PoisonRecord {
            poison_id: 9,
            idempotency_key: Some("k-9".into()),
            error_kind: "null_key".into(),
            ..PoisonRecord::default()
        };
        let mut report = ReplayReport {
            poison_table: "public.poison_outbox".into(),
            dry_run,
            selected: 2,
            already_replayed: 1,
            ..ReplayReport::default()
        };
        let mut rows = dry_run_page(&m, &[good, bad], PayloadFormat::Json);
        if !dry_run {
            rows[0].delivered(2, 41);
        }
        for row in rows {
            report.add(row);
        }
        report
    }

    #[test]
    fn human_report_is_a_table_and_a_summary() {
        let report = sample_report(false);
        let text = report.to_string();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[0].starts_with("poison_id  outcome"), "{text}");
        assert!(
            lines[1].contains("published") && lines[1].contains("key-42"),
            "{text}"
        );
        assert!(lines[1].contains("order-7") && lines[1].contains("outbox.event.order"));
        assert!(
            lines[1].contains("partition 2 offset 41, replay_count 1"),
            "{text}"
        );
        assert!(
            lines[2].contains("failed") && lines[2].contains("null_key"),
            "{text}"
        );
        assert!(
            lines[3].starts_with(
                "replayed 1 of 2 selected poison rows from public.poison_outbox; 1 failed"
            ),
            "{text}"
        );
        assert!(lines[3].contains("1 already replayed"), "{text}");
        assert_eq!(report.exit_code(), ExitCode::from(1));
        assert!(!report.is_success());

        let dry = sample_report(true).to_string();
        assert!(dry.contains("would publish"), "{dry}");
        assert!(dry.contains("dry run: would publish 1 of 2"), "{dry}");
        assert!(dry.contains("1 cannot be mapped"), "{dry}");

        let empty = ReplayReport {
            poison_table: "public.poison_outbox".into(),
            ..ReplayReport::default()
        };
        assert_eq!(
            empty.to_string(),
            "nothing to replay in public.poison_outbox"
        );
        assert_eq!(empty.exit_code(), ExitCode::SUCCESS);
    }

    #[test]
    fn json_report_has_counts_and_rows() {
        let report = sample_report(false);
        let v: serde_json::Value = serde_json::from_str(&report.render(true)).unwrap();
        assert_eq!(v["selected"], 2);
        assert_eq!(v["published"], 1);
        assert_eq!(v["failed"], 1);
        assert_eq!(v["already_replayed"], 1);
        assert_eq!(v["dry_run"], false);
        assert!(v["aborted"].is_null());
        assert_eq!(v["rows"][0]["outcome"], "published");
        assert_eq!(v["rows"][0]["idempotency_key"], "key-42");
        assert_eq!(v["rows"][0]["key"], "order-7");
        assert_eq!(v["rows"][0]["partition"], 2);
        assert_eq!(v["rows"][0]["replay_count"], 1);
        assert_eq!(v["rows"][1]["outcome"], "failed");
        assert_eq!(v["rows"][1]["error_kind"], "null_key");
        assert_eq!(v["rows"][1]["poisoned_as"], "null_key");
        assert_eq!(sample_report(true).render(true).lines().count(), 1);
        let dry: serde_json::Value = serde_json::from_str(&sample_report(true).to_json()).unwrap();
        assert_eq!(dry["rows"][0]["outcome"], "would_publish");
    }
}
