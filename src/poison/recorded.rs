//! Events a previous process already recorded in the poison table, so that a new
//! session does not produce them again.
//!
//! # Why
//!
//! A poisoned event is resolved once its poison row commits; the slot (and, with
//! `kafka.delivery = "exactly-once"`, the progress record) learns it later, at the
//! next status update or Kafka commit. A relay killed in between streams the event
//! again after its restart. Before, it was produced again: if the broker accepted it
//! this time, the event was in the topic *and* in the poison table, where `replay`
//! would publish it a second time, and under `relay.on_poison = "park-key"` a parked
//! event went out ahead of the poisoned event of its key. With exactly-once
//! delivery it broke the all-or-nothing rule: the event was committed in Kafka and
//! poisoned.
//!
//! # What is read, and how an event is matched
//!
//! At each session start, after any wait for the slot, the shell reads the poison
//! rows whose commit LSN lies between where the session starts and the server's WAL
//! end then: no earlier process can have poisoned an event committed later, and an
//! event committed earlier is not streamed again. A stream row carries its
//! transaction's commit LSN (`Begin.final_lsn`) and its ordinal among the transaction's outbox rows
//! (`tx_position`), the event's name in the core (`cdc::progress::Origin`); when the
//! session is about to produce an event of that name (on any attempt: a produce
//! handed out again after a Kafka abort may never have been sent), the shell also
//! compares the row's occurrence key, the one the table's unique index holds
//! (`outbox_id`, or the content hash for a row without one: `table.rs`). Only when
//! all three agree is the event taken as recorded: a cutover's or a resync's rows
//! carry the slot's consistent point as their LSN and their backlog ordinal, which a
//! streamed transaction committing exactly at that point could share, but never
//! the same outbox row.
//!
//! # Only this relay's rows
//!
//! A poison table may be shared: `outbox.poison_table` defaults to
//! `public.poison_outbox` whatever the outbox, so two relays with outboxes of their
//! own, or the shards of one outbox, write to one table. Each has its own slot, and
//! ordinals count only the rows a slot streams, so the other relay's event of the
//! same transaction has the same name; with outbox ids that run in lockstep (two
//! bigint sequences written together) it has the same `outbox_id` too, and was
//! skipped here as poisoned while it had been deliverable: a silent loss. So only
//! rows whose source (`table.rs`) is this relay's are read: written for the outbox
//! whose poison table it is, through this relay's slot. Rows written before sources
//! were recorded (migration `0012`) have none and are not read: an event such a row
//! recorded is produced again, a duplicate, never a loss.
//!
//! The read is capped ([`MAX_ROWS`], lowest LSNs first);
//! an event past the cap is produced again, as before (a duplicate, never a loss).
//! A poison insert of the killed process that commits after the read is not seen
//! either, with the same consequence. The session makes this read after every
//! other read of the start (the exactly-once start's of the table included), so
//! the window closes as late as the start allows.

use crate::hashing::HashMap;

use super::table::{PoisonRow, StoredRow, source_table};
use crate::config::{OutboxConfig, quote_qualified};
use crate::lsn::Lsn;

/// Most rows read at a session start.
pub(crate) const MAX_ROWS: i64 = 100_000;

/// The read's `statement_timeout`: the column it filters on has no index, and a
/// read that takes longer is given up (duplicates, never a loss) rather than
/// delaying every session start.
const READ_TIMEOUT: &str = "5s";

/// The occurrence key of a poison row as the unique index holds it: whether the
/// outbox row had no id, and its id (or the content hash when it had none).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Occurrence {
    no_id: bool,
    key: String,
}

impl Occurrence {
    /// The key `row` gets when it is stored with values cut to `copy_limit`.
    fn of(row: &PoisonRow, copy_limit: usize) -> Occurrence {
        let stored = StoredRow::new(row, copy_limit);
        match stored.outbox_id {
            Some(id) => Occurrence {
                no_id: false,
                key: id.into_owned(),
            },
            None => Occurrence {
                no_id: true,
                key: stored.row_sha256,
            },
        }
    }
}

/// Poison rows of streamed events recorded before this session (module docs).
#[derive(Debug, Default)]
pub(crate) struct RecordedPoison {
    /// By commit LSN and ordinal.
    rows: HashMap<(Lsn, u32), Occurrence>,
    copy_limit: usize,
    /// Every row asked for was read (`RecordedPoison::complete`).
    complete: bool,
}

/// The read of [`RecordedPoison::read`]: `$1`/`$2` the LSN bounds, `$3` the cap,
/// `$4` the relay's slot; each outbox's poison table, only the rows of that outbox
/// written through that slot (module doc).
fn read_sql(outboxes: &[&OutboxConfig]) -> String {
    // Ordinals count the outbox rows of a transaction over every outbox table,
    // so one (commit, ordinal) names one event whichever poison table holds it.
    let selects: Vec<String> = outboxes
        .iter()
        .map(|outbox| {
            format!(
                "SELECT lsn, tx_position, outbox_id IS NULL AS no_id,
                        COALESCE(outbox_id, row_sha256) AS occurrence
                   FROM {}
                  WHERE lsn >= $1::text::pg_lsn AND lsn <= $2::text::pg_lsn
                    AND tx_position IS NOT NULL AND duplicate_of IS NULL
                    AND COALESCE(outbox_id, row_sha256) IS NOT NULL
                    AND source_table = '{}' AND source_slot = $4",
                quote_qualified(&outbox.poison_table),
                source_table(outbox).replace('\'', "''")
            )
        })
        .collect();
    format!(
        "SELECT lsn::text, tx_position, no_id, occurrence FROM ({}) AS recorded
          ORDER BY lsn, tx_position
          LIMIT $3",
        selects.join(" UNION ALL ")
    )
}

impl RecordedPoison {
    /// Reads the rows whose commit LSN is in `from..=to` that this relay (its
    /// `outboxes`, streamed through `slot`) wrote.
    ///
    /// # Errors
    ///
    /// The query failed (the session start is retried).
    pub(crate) async fn read(
        client: &mut tokio_postgres::Client,
        outboxes: &[&OutboxConfig],
        slot: &str,
        copy_limit: usize,
        from: Lsn,
        to: Lsn,
    ) -> Result<RecordedPoison, tokio_postgres::Error> {
        let mut recorded = RecordedPoison {
            rows: HashMap::default(),
            copy_limit,
            complete: true,
        };
        if to < from {
            return Ok(recorded);
        }
        let sql = read_sql(outboxes);
        let tx = client.transaction().await?;
        tx.batch_execute(&format!("SET LOCAL statement_timeout = '{READ_TIMEOUT}'"))
            .await?;
        let rows = tx
            .query(
                &sql,
                &[&from.to_string(), &to.to_string(), &MAX_ROWS, &slot],
            )
            .await?;
        tx.commit().await?;
        for row in &rows {
            let (Ok(lsn), Ok(position), Ok(no_id), Ok(key)) = (
                row.try_get::<_, String>(0),
                row.try_get::<_, i32>(1),
                row.try_get::<_, bool>(2),
                row.try_get::<_, String>(3),
            ) else {
                continue;
            };
            let (Ok(lsn), Ok(position)) = (lsn.parse::<Lsn>(), u32::try_from(position)) else {
                continue;
            };
            recorded
                .rows
                .insert((lsn, position), Occurrence { no_id, key });
        }
        if rows.len() >= usize::try_from(MAX_ROWS).unwrap_or(usize::MAX) {
            recorded.complete = false;
            tracing::warn!(from = %from, to = %to, rows = rows.len(),
                "more poison rows than read at a session start: events poisoned past them may be produced again");
        }
        if !recorded.rows.is_empty() {
            tracing::info!(rows = recorded.rows.len(), from = %from, to = %to,
                "poison rows of events this session may stream again: they will not be produced");
        }
        Ok(recorded)
    }

    /// The rows as [`RecordedPoison::read`] would have read them (the simulation's
    /// poison table).
    #[cfg(test)]
    pub(crate) fn of_rows(
        rows: impl IntoIterator<Item = ((Lsn, u32), PoisonRow)>,
        copy_limit: usize,
    ) -> RecordedPoison {
        RecordedPoison {
            rows: rows
                .into_iter()
                .map(|(name, row)| (name, Occurrence::of(&row, copy_limit)))
                .collect(),
            copy_limit,
            complete: true,
        }
    }

    /// Whether the event named `(commit, ordinal)`, whose poison row `row` makes,
    /// is recorded; a recorded one is forgotten (it is resolved once). The row is
    /// made only for a name that is recorded.
    pub(crate) fn take(
        &mut self,
        commit: Lsn,
        ordinal: u32,
        row: impl FnOnce() -> PoisonRow,
    ) -> bool {
        let Some(occurrence) = self.rows.get(&(commit, ordinal)) else {
            return false;
        };
        if *occurrence != Occurrence::of(&row(), self.copy_limit) {
            return false;
        }
        self.rows.remove(&(commit, ordinal));
        true
    }

    /// Whether a row of the event named `(commit, ordinal)` was read (matched or
    /// not yet).
    pub(crate) fn holds(&self, commit: Lsn, ordinal: u32) -> bool {
        self.rows.contains_key(&(commit, ordinal))
    }

    /// The names of the rows read (not yet matched).
    pub(crate) fn names(&self) -> impl Iterator<Item = (Lsn, u32)> + '_ {
        self.rows.keys().copied()
    }

    /// Whether the read found every row it asked for: it succeeded and was not cut
    /// at [`MAX_ROWS`].
    pub(crate) fn complete(&self) -> bool {
        self.complete
    }

    /// Whether every row read was matched (or none was read).
    pub(crate) fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::PoisonFields;

    fn row(id: Option<&str>, payload: &str) -> PoisonRow {
        PoisonRow {
            fields: PoisonFields {
                outbox_id: id.map(str::to_owned),
                payload: Some(payload.to_owned()),
                columns: vec![("payload".to_owned(), Some(payload.to_owned()))],
                ..PoisonFields::default()
            },
            ..PoisonRow::default()
        }
    }

    fn recorded(entries: &[((u64, u32), &PoisonRow)]) -> RecordedPoison {
        let copy_limit = 1024;
        RecordedPoison {
            rows: entries
                .iter()
                .map(|((lsn, ord), r)| ((Lsn(*lsn), *ord), Occurrence::of(r, copy_limit)))
                .collect(),
            copy_limit,
            complete: true,
        }
    }

    #[test]
    fn an_event_is_recorded_only_when_its_name_and_its_row_agree() {
        let poisoned = row(Some("17"), "a");
        let mut r = recorded(&[((100, 0), &poisoned)]);
        // Same name, another outbox row (a backlog's row at the consistent point).
        assert!(!r.take(Lsn(100), 0, || row(Some("18"), "a")));
        // Same row, another name.
        assert!(!r.take(Lsn(100), 1, || poisoned.clone()));
        assert!(!r.take(Lsn(101), 0, || poisoned.clone()));
        assert!(r.take(Lsn(100), 0, || poisoned.clone()));
        // Resolved once.
        assert!(!r.take(Lsn(100), 0, || poisoned.clone()));
        assert!(r.is_empty());
    }

    #[test]
    fn only_rows_of_this_relays_outboxes_and_slot_are_read() {
        let outbox = |table: &str, poison: &str| OutboxConfig {
            table: table.into(),
            poison_table: poison.into(),
            ..OutboxConfig::default()
        };
        let (a, b) = (
            outbox("outbox", "public.poison_outbox"),
            outbox("shipping.Parcel's", "shipping.poison"),
        );
        let sql = read_sql(&[&a, &b]);
        assert!(sql.contains("FROM \"public\".\"poison_outbox\""), "{sql}");
        assert!(sql.contains("FROM \"shipping\".\"poison\""), "{sql}");
        assert!(
            sql.contains("source_table = 'public.outbox' AND source_slot = $4"),
            "{sql}"
        );
        assert!(
            sql.contains("source_table = 'shipping.Parcel''s' AND source_slot = $4"),
            "{sql}"
        );
    }

    #[test]
    fn a_row_without_an_id_is_matched_by_its_content() {
        let poisoned = row(None, "a");
        let mut r = recorded(&[((100, 0), &poisoned)]);
        assert!(!r.take(Lsn(100), 0, || row(None, "b")));
        // An id never meets a hash.
        assert!(!r.take(Lsn(100), 0, || row(Some("a"), "a")));
        assert!(r.take(Lsn(100), 0, || poisoned.clone()));
    }
}
