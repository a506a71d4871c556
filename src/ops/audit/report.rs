//! What the audit found, and the two ways it is printed.
//!
//! # The JSON contract
//!
//! `--json` prints exactly six keys, `expected`, `delivered`, `lost`, `duplicates`,
//! `out_of_order_keys` and `poisoned` (`docs/architecture.md#json-output`; defined
//! in [`super::ledger`]), so `expected = delivered + poisoned + lost` can be checked
//! by a script and the object never grows a key a consumer does not expect. Anything
//! that qualifies the numbers (a topic not read to its end, a missing poison table)
//! is a *note*: in the human table, and on stderr with `--json`.
//!
//! # The table
//!
//! The human table shows the six numbers with what each non-zero one means, then the
//! detail the JSON leaves out: records read outside the range or without a key,
//! unmappable rows, rows sharing a key, a sample of lost idempotency keys, the
//! notes, the state held, and one verdict line. A report is *clean* when nothing is
//! lost and nothing is out of order: duplicates (at-least-once) and poisoned events
//! (visible in `poison_outbox`) are within the relay's promises.

use std::fmt::Write as _;
use std::time::Duration;

/// What the audit found. The first six fields are the JSON contract
/// (`docs/architecture.md#json-output`);
/// the rest is detail for the human table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuditReport {
    /// Distinct idempotency keys among the outbox rows in the range.
    pub expected: u64,
    /// Expected events found at least once on a topic.
    pub delivered: u64,
    /// Expected events neither delivered nor in the poison table.
    pub lost: u64,
    /// Extra deliveries (n − 1 for an event delivered n times).
    pub duplicates: u64,
    /// Entities whose first deliveries are not in commit order.
    pub out_of_order_keys: u64,
    /// Expected events not delivered but in the poison table.
    pub poisoned: u64,
    /// Events delivered more than once.
    pub duplicated_events: u64,
    /// Of `poisoned`: events parked behind a poisoned event of their key
    /// (`relay.on_poison = "park-key"`), waiting for `replay`.
    pub parked: u64,
    /// Poisoned events that were delivered anyway (replayed); counted as delivered.
    pub replayed: u64,
    /// First deliveries that went back in commit order (an entity may have several).
    pub out_of_order_records: u64,
    /// Records read from the topics.
    pub records_read: u64,
    /// Records whose idempotency key is not a row of the range.
    pub outside_range: u64,
    /// Records without an `idempotency_key` header.
    pub without_key: u64,
    /// Rows that the current config cannot map to a record (the relay poisons them).
    pub unmappable_rows: u64,
    /// Rows that share their idempotency key (or its hash) with another row.
    pub shared_keys: u64,
    /// The range, as SQL-ish text.
    pub range: String,
    /// Topics read.
    pub topics: Vec<String>,
    /// Up to `LOST_SAMPLE` (20) idempotency keys of lost events.
    pub lost_sample: Vec<String>,
    /// Things the reader should know (missing topic, partitions not read to the end).
    pub notes: Vec<String>,
    /// Bytes of per-row state held.
    pub state_bytes: u64,
    /// Wall-clock time of the audit.
    pub elapsed: Duration,
}

impl AuditReport {
    /// Names the table this report is about in its range and notes (the first of
    /// several outboxes, see [`AuditReport::add`]).
    pub fn label_by(&mut self, table: &str) {
        self.range = format!("{table}: {}", self.range);
        for note in &mut self.notes {
            *note = format!("{table}: {note}");
        }
    }

    /// Adds the report of another outbox table: counts add up (each event is a row
    /// of one table), topics, samples and notes are joined.
    pub fn add(&mut self, mut other: AuditReport, table: &str) {
        other.label_by(table);
        self.expected += other.expected;
        self.delivered += other.delivered;
        self.lost += other.lost;
        self.duplicates += other.duplicates;
        self.out_of_order_keys += other.out_of_order_keys;
        self.poisoned += other.poisoned;
        self.duplicated_events += other.duplicated_events;
        self.parked += other.parked;
        self.replayed += other.replayed;
        self.out_of_order_records += other.out_of_order_records;
        self.records_read += other.records_read;
        self.outside_range += other.outside_range;
        self.without_key += other.without_key;
        self.unmappable_rows += other.unmappable_rows;
        self.shared_keys += other.shared_keys;
        self.range = format!("{}; {}", self.range, other.range);
        for topic in other.topics {
            if !self.topics.contains(&topic) {
                self.topics.push(topic);
            }
        }
        self.lost_sample.extend(other.lost_sample);
        self.lost_sample.truncate(super::load::LOST_SAMPLE);
        self.notes.extend(other.notes);
        self.state_bytes = self.state_bytes.max(other.state_bytes);
    }

    /// `{"expected","delivered","lost","duplicates","out_of_order_keys","poisoned"}`.
    #[must_use]
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "expected": self.expected,
            "delivered": self.delivered,
            "lost": self.lost,
            "duplicates": self.duplicates,
            "out_of_order_keys": self.out_of_order_keys,
            "poisoned": self.poisoned,
        })
    }

    /// Nothing lost and nothing out of order (duplicates and poison rows are within
    /// the promises: at-least-once, and visible poison).
    #[must_use]
    pub fn is_clean(&self) -> bool {
        self.lost == 0 && self.out_of_order_keys == 0
    }

    /// The human table.
    #[must_use]
    pub fn render_table(&self) -> String {
        let mut out = String::new();
        let topics = if self.topics.is_empty() {
            "(none)".to_owned()
        } else {
            self.topics.join(", ")
        };
        let _ = writeln!(out, "outbox audit: {}", self.range);
        let _ = writeln!(out, "topics:       {topics}");
        let _ = writeln!(out);
        let mut line = |label: &str, value: u64, note: String| {
            let _ = writeln!(out, "  {label:<18} {value:>12}  {note}");
        };
        line("expected", self.expected, String::new());
        line("delivered", self.delivered, {
            if self.replayed > 0 {
                format!("incl. {} replayed from poison", self.replayed)
            } else {
                String::new()
            }
        });
        line(
            "lost",
            self.lost,
            if self.lost > 0 {
                "LOST: in the outbox, on no topic, not poisoned".into()
            } else {
                String::new()
            },
        );
        line(
            "duplicates",
            self.duplicates,
            if self.duplicates > 0 {
                format!(
                    "extra deliveries of {} event(s); consumers dedupe by idempotency_key",
                    self.duplicated_events
                )
            } else {
                String::new()
            },
        );
        line(
            "out of order keys",
            self.out_of_order_keys,
            if self.out_of_order_keys > 0 {
                format!(
                    "OUT OF ORDER: {} first deliveries went back in commit order",
                    self.out_of_order_records
                )
            } else {
                String::new()
            },
        );
        line("poisoned", self.poisoned, {
            if self.parked > 0 {
                format!(
                    "in poison_outbox, not delivered (outbox-relay replay); incl. {} parked \
                     behind a poisoned event of their key",
                    self.parked
                )
            } else if self.poisoned > 0 {
                "in poison_outbox, not delivered (outbox-relay replay)".into()
            } else {
                String::new()
            }
        });
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "records read: {} ({} outside the range, {} without key)",
            self.records_read, self.outside_range, self.without_key
        );
        if self.unmappable_rows > 0 {
            let _ = writeln!(
                out,
                "unmappable rows: {} (the relay poisons them)",
                self.unmappable_rows
            );
        }
        if self.shared_keys > 0 {
            let _ = writeln!(
                out,
                "rows sharing an idempotency key with another row: {}",
                self.shared_keys
            );
        }
        if !self.lost_sample.is_empty() {
            let more = if self.lost > self.lost_sample.len() as u64 {
                format!(" (first {} of {})", self.lost_sample.len(), self.lost)
            } else {
                String::new()
            };
            let _ = writeln!(out, "lost idempotency keys{more}:");
            for key in &self.lost_sample {
                let _ = writeln!(out, "  {key}");
            }
        }
        for note in &self.notes {
            let _ = writeln!(out, "note: {note}");
        }
        let _ = writeln!(
            out,
            "state: {:.1} MiB, {:.1}s",
            mebibytes(self.state_bytes),
            self.elapsed.as_secs_f64()
        );
        let verdict = match (self.lost > 0, self.out_of_order_keys > 0) {
            (false, false) => "result: clean",
            (true, false) => "result: EVENTS LOST",
            (false, true) => "result: OUT OF ORDER",
            (true, true) => "result: EVENTS LOST and OUT OF ORDER",
        };
        let _ = writeln!(out, "{verdict}");
        out
    }
}

/// Bytes in MiB, for display with one decimal.
// `u64 -> f64` rounds only above 2^53 bytes (8 PiB), far more state than an audit
// can hold, and one decimal of MiB would not show it anyway.
#[allow(clippy::cast_precision_loss)]
fn mebibytes(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn report_json_has_exactly_the_contract_keys() {
        let r = AuditReport {
            expected: 5,
            delivered: 3,
            lost: 1,
            duplicates: 2,
            out_of_order_keys: 1,
            poisoned: 1,
            ..AuditReport::default()
        };
        let v = r.to_json();
        let keys: BTreeSet<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            BTreeSet::from([
                "expected",
                "delivered",
                "lost",
                "duplicates",
                "out_of_order_keys",
                "poisoned"
            ])
        );
        assert_eq!(v["lost"], 1);
        assert_eq!(v["duplicates"], 2);
        assert!(!r.is_clean());
    }

    #[test]
    fn clean_means_nothing_lost_nor_out_of_order() {
        let mut r = AuditReport {
            expected: 3,
            delivered: 2,
            poisoned: 1,
            duplicates: 7,
            ..AuditReport::default()
        };
        assert!(r.is_clean());
        r.out_of_order_keys = 1;
        assert!(!r.is_clean());
        r.out_of_order_keys = 0;
        r.lost = 1;
        assert!(!r.is_clean());
    }

    #[test]
    fn table_names_problems() {
        let r = AuditReport {
            expected: 3,
            delivered: 1,
            lost: 1,
            poisoned: 1,
            lost_sample: vec!["abc".into()],
            notes: vec!["topic x does not exist".into()],
            topics: vec!["t".into()],
            range: "all rows".into(),
            ..AuditReport::default()
        };
        let t = r.render_table();
        assert!(t.contains("expected"), "{t}");
        assert!(t.contains("EVENTS LOST"), "{t}");
        assert!(t.contains("abc"), "{t}");
        assert!(t.contains("note: topic x does not exist"), "{t}");
        let clean = AuditReport::default().render_table();
        assert!(clean.contains("result: clean"), "{clean}");
    }
}
