//! The poison table as `replay` reads and marks it, through one metadata
//! connection.
//!
//! # Why rows are never deleted, and the original error is kept
//!
//! A poison row is evidence that an event did not arrive in time; the audit counts
//! it. The table refuses `DELETE`/`TRUNCATE` (a trigger), and replay only *updates*
//! `replayed_at` and `replay_count`. `error`, `error_kind` and `attempts` keep the
//! original failure: that is why the row exists. A replay that fails again leaves
//! the row unmarked, so the next `--all` tries it again.
//!
//! # Pages
//!
//! Rows are read in pages of at most `PAGE_ROWS` rows and, with a running sum in
//! SQL, roughly `relay.max_in_flight_bytes` of payload and headers (the first row of
//! a page always comes), so memory does not grow with the size of the poison table.
//! Pages stop at the highest `poison_id` counted at the start, so rows poisoned
//! while `replay` runs wait for the next run. The acknowledged rows of a page are
//! marked with one `UPDATE … WHERE poison_id = ANY($1)`.
//!
//! # Whose rows
//!
//! A poison table may be shared by relays with outboxes of their own (its default
//! name is the same for every outbox). Each row records the outbox it came from
//! (`source_table`, `crate::poison`), and `--all` takes only the rows of the outbox
//! replayed (and rows from before sources were recorded): another outbox's row
//! mapped with this config could go to this outbox's topic, be marked replayed, and
//! never reach its own. `--id` takes the named rows whatever their source.
//!
//! # One replay at a time
//!
//! A replay holds a PostgreSQL advisory lock named after the poison table for its
//! duration (session-level: it also ends with the connection), so two replays
//! cannot publish the same rows at once; the second fails at once (exit code 1).
//!
//! # Truncated copies
//!
//! A value longer than `relay.poison_copy_limit_bytes` is stored cut, and the row
//! marked `truncated` (see `crate::poison`); the original row stays in the outbox.
//! For such a row replay reads the outbox row by `outbox_id` (with the poller's
//! column list, so it is the row the relay saw) and publishes that, keeping the
//! stored topic and `created_at`. It checks that the stored payload is a prefix of
//! the one found; a row that is gone (retention deleted it) or differs fails with
//! error kind `original_unavailable` and stays unmarked. Headers that jsonb refused
//! are read from `headers_text`.
//!
//! # Reading the payload back
//!
//! The payload is read according to the outbox table's `payload` column type,
//! looked up in the catalog: `bytea` rows are stored as `\x…` hex text and decoded
//! back to bytes; with an envelope configured, `json`/`jsonb` are spliced and text is
//! embedded as a string, exactly as the relay does.

use bytes::Bytes;
use tokio_postgres::{Client, Row};

use super::args::Selection;
use crate::config::{ConfigError, OutboxConfig, quote_qualified};
use crate::error::Error;
use crate::lsn::Lsn;
use crate::outbox::{OutboxRow, PayloadFormat};
use crate::poison::{KEY_ORDER, ParkedKey, release_key, unreplayed_key_rows};
use crate::poller;
use crate::postgres::prerequisite::Prerequisite;
use crate::postgres::table_exists;

/// Error kind of a truncated row whose original could not be read.
pub(super) const ORIGINAL_UNAVAILABLE: &str = "original_unavailable";

/// The rows `--all` takes in [`PoisonStore::counts`] (`$3`: the outbox replayed).
const OWN_ROWS: &str = "(source_table IS NULL OR source_table = $3)";

/// One `poison_outbox` row as read back (text forms, see the migration).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct PoisonRecord {
    pub(super) poison_id: i64,
    pub(super) outbox_id: Option<String>,
    pub(super) idempotency_key: Option<String>,
    pub(super) aggregate_type: Option<String>,
    pub(super) aggregate_id: Option<String>,
    pub(super) event_type: Option<String>,
    pub(super) topic: Option<String>,
    /// `headers::text` (jsonb output, as the relay read it from the stream), or
    /// `headers_text` when jsonb refused them.
    pub(super) headers: Option<String>,
    pub(super) payload: Option<String>,
    /// ISO 8601 (`to_json(created_at)`), independent of the session's `DateStyle`.
    pub(super) created_at: Option<String>,
    pub(super) lsn: Option<Lsn>,
    pub(super) replay_count: i32,
    pub(super) error_kind: String,
    /// Some stored value is cut: publish [`original`](Self::original) instead.
    pub(super) truncated: bool,
    /// The outbox row of a truncated copy, once read.
    pub(super) original: Option<OutboxRow>,
    /// `row_data`: every column by name, for the `outbox.additional_placement`
    /// columns (`None` when it was cut and kept as text).
    pub(super) row_data: Option<serde_json::Value>,
    /// Why a truncated copy's original could not be read.
    pub(super) unavailable: Option<String>,
}

/// The columns [`PoisonRecord::from_row`] reads, in order.
const RECORD_COLUMNS: &str = "poison_id, outbox_id, idempotency_key, aggregate_type, aggregate_id,
     event_type, topic, coalesce(headers::text, headers_text), payload,
     to_json(created_at) #>> '{}', lsn::text, replay_count, error_kind, truncated, row_data";

impl PoisonRecord {
    fn from_row(row: &Row) -> Result<PoisonRecord, tokio_postgres::Error> {
        let lsn: Option<String> = row.try_get(10)?;
        Ok(PoisonRecord {
            poison_id: row.try_get(0)?,
            outbox_id: row.try_get(1)?,
            idempotency_key: row.try_get(2)?,
            aggregate_type: row.try_get(3)?,
            aggregate_id: row.try_get(4)?,
            event_type: row.try_get(5)?,
            topic: row.try_get(6)?,
            headers: row.try_get(7)?,
            payload: row.try_get(8)?,
            created_at: row.try_get(9)?,
            lsn: lsn.and_then(|l| l.parse().ok()),
            replay_count: row.try_get(11)?,
            error_kind: row.try_get(12)?,
            truncated: row.try_get(13)?,
            row_data: row.try_get(14)?,
            original: None,
            unavailable: None,
        })
    }

    /// [`PoisonRecord::outbox_row_placing`] without placed columns.
    #[cfg(test)]
    pub(super) fn outbox_row(&self, payload_format: PayloadFormat) -> OutboxRow {
        self.outbox_row_placing(payload_format, &[])
    }

    /// The outbox row the mapper sees: the stored text forms, unchanged, and the
    /// values of the `placed` columns (`outbox.additional_placement`) from the stored
    /// `row_data`; for a truncated copy, the original row with the stored topic and
    /// `created_at`.
    pub(super) fn outbox_row_placing(
        &self,
        payload_format: PayloadFormat,
        placed: &[std::sync::Arc<str>],
    ) -> OutboxRow {
        let b = |v: &Option<String>| v.clone().map(Bytes::from);
        let extra = placed
            .iter()
            .map(|column| {
                let value = self.row_data.as_ref()?.get(&**column)?;
                match value {
                    serde_json::Value::Null => None,
                    serde_json::Value::String(s) => Some(Bytes::from(s.clone())),
                    other => Some(Bytes::from(other.to_string())),
                }
            })
            .collect();
        if let Some(original) = &self.original {
            return OutboxRow {
                topic: b(&self.topic),
                created_at: b(&self.created_at),
                ..original.clone()
            };
        }
        OutboxRow {
            id: b(&self.outbox_id),
            idempotency_key: b(&self.idempotency_key),
            aggregate_type: b(&self.aggregate_type),
            aggregate_id: b(&self.aggregate_id),
            event_type: b(&self.event_type),
            topic: b(&self.topic),
            headers: b(&self.headers),
            payload: b(&self.payload),
            payload_format,
            created_at: b(&self.created_at),
            extra,
        }
    }
}

/// How the payload text is read, from the outbox `payload` column's type name:
/// `bytea` rows were stored as `\x…` hex; `json`/`jsonb` are spliced into an
/// envelope; anything else is text.
pub(super) fn payload_format_for_type(type_name: Option<&str>) -> PayloadFormat {
    match type_name {
        Some("bytea") => PayloadFormat::ByteaText,
        Some("json" | "jsonb") | None => PayloadFormat::Json,
        Some(_) => PayloadFormat::Text,
    }
}

/// Row counts taken once, at the start.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Counts {
    pub(super) selected: u64,
    pub(super) already_replayed: u64,
    /// Highest `poison_id` at the start: later rows wait for the next run.
    pub(super) max_id: i64,
}

/// The poison table, through one metadata connection.
#[derive(Debug)]
pub(super) struct PoisonStore {
    pub(super) client: Client,
    /// Quoted, qualified name.
    pub(super) table: String,
    /// As configured, for messages.
    pub(super) name: String,
    /// The parked-key table (`crate::poison::parking`), quoted.
    pub(super) parked_keys: String,
    /// The outbox replayed, as poison rows record their source (`crate::poison`):
    /// `--all` takes its rows and those written before sources were recorded, not
    /// the rows of another outbox sharing the poison table, which this config would
    /// map to the wrong topic (see the module doc).
    pub(super) source_table: String,
}

impl PoisonStore {
    /// Fails with exit code 3 when the table does not exist.
    pub(super) async fn check_table(&self) -> Result<(), Error> {
        let found: Option<String> = self
            .client
            .query_one("SELECT to_regclass($1)::text", &[&self.table])
            .await?
            .try_get(0)?;
        if found.is_none() {
            return Err(Prerequisite::PoisonTableMissing {
                table: self.name.clone(),
            }
            .into());
        }
        Ok(())
    }

    /// Takes the replay lock for this table (session-level, released when the
    /// connection closes).
    pub(super) async fn lock(&self) -> Result<(), Error> {
        let key = format!("outbox-relay replay {}", self.table);
        if !crate::ops::try_advisory_lock(&self.client, &key).await? {
            return Err(Error::ReplayLocked {
                table: self.name.clone(),
            });
        }
        Ok(())
    }

    pub(super) async fn unlock(&self) {
        let key = format!("outbox-relay replay {}", self.table);
        crate::ops::advisory_unlock(&self.client, &key).await;
    }

    /// Every named id must exist; otherwise nothing is replayed (exit code 2).
    pub(super) async fn check_ids(&self, ids: &[i64]) -> Result<(), Error> {
        if ids.is_empty() {
            return Ok(());
        }
        let sql = format!(
            "SELECT id FROM unnest($1::bigint[]) AS id
             WHERE NOT EXISTS (SELECT 1 FROM {} WHERE poison_id = id) ORDER BY id",
            self.table
        );
        let rows = self.client.query(&sql, &[&ids]).await?;
        let missing = rows
            .iter()
            .map(|r| r.try_get::<_, i64>(0))
            .collect::<Result<Vec<_>, _>>()?;
        if missing.is_empty() {
            return Ok(());
        }
        let list: Vec<String> = missing.iter().map(i64::to_string).collect();
        Err(Error::Config(ConfigError::Invalid(format!(
            "no poison row with poison_id {} in {}; nothing was replayed",
            list.join(", "),
            self.name
        ))))
    }

    pub(super) async fn counts(&self, sel: &Selection) -> Result<Counts, Error> {
        let sql = format!(
            "SELECT count(*) FILTER (WHERE (poison_id = ANY($1) OR ($2 AND replayed_at IS NULL
                                                                 AND {OWN_ROWS}))
                                       AND NOT (parked AND replayed_at IS NULL)),
                    count(*) FILTER (WHERE $2 AND replayed_at IS NOT NULL AND {OWN_ROWS}
                                       AND poison_id <> ALL($1)),
                    coalesce(max(poison_id), 0)
             FROM {}",
            self.table
        );
        let row = self
            .client
            .query_one(&sql, &[&sel.ids, &sel.all, &self.source_table])
            .await?;
        let count = |i: usize| -> Result<u64, Error> {
            let n: i64 = row.try_get(i)?;
            Ok(u64::try_from(n).unwrap_or_default())
        };
        Ok(Counts {
            selected: count(0)?,
            already_replayed: count(1)?,
            max_id: row.try_get(2)?,
        })
    }

    /// The outbox `payload` column's type name, when the table exists.
    pub(super) async fn payload_type(
        &self,
        outbox: &OutboxConfig,
    ) -> Result<Option<String>, Error> {
        let row = self
            .client
            .query_opt(
                "SELECT t.typname::text FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
                 WHERE a.attrelid = to_regclass($1) AND a.attname = $2
                   AND a.attnum > 0 AND NOT a.attisdropped",
                &[&quote_qualified(&outbox.table), &outbox.columns.payload],
            )
            .await?;
        Ok(match row {
            Some(r) => r.try_get(0)?,
            None => None,
        })
    }

    /// The next page of selected rows after `after`: at most `max_rows`, and rows
    /// only while the payload and headers before them stay under `max_bytes` (the
    /// first row always comes).
    pub(super) async fn page(
        &self,
        sel: &Selection,
        after: i64,
        max_id: i64,
        max_rows: usize,
        max_bytes: usize,
    ) -> Result<Vec<PoisonRecord>, Error> {
        let sql = format!(
            "SELECT {RECORD_COLUMNS} FROM (
                 SELECT *, sum(coalesce(octet_length(payload), 0)
                               + coalesce(octet_length(coalesce(headers::text, headers_text)), 0))
                           OVER (ORDER BY poison_id) AS running,
                        coalesce(octet_length(payload), 0)
                          + coalesce(octet_length(coalesce(headers::text, headers_text)), 0) AS own
                 FROM (SELECT * FROM {}
                       WHERE poison_id > $1 AND poison_id <= $2
                         AND (poison_id = ANY($3)
                              OR ($4 AND replayed_at IS NULL
                                  AND (source_table IS NULL OR source_table = $7)))
                         AND NOT (parked AND replayed_at IS NULL)
                       ORDER BY poison_id LIMIT $5) AS candidates
             ) AS page
             WHERE running - own < $6
             ORDER BY poison_id",
            self.table
        );
        let limit = i64::try_from(max_rows).unwrap_or(i64::MAX);
        let bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
        let rows = self
            .client
            .query(
                &sql,
                &[
                    &after,
                    &max_id,
                    &sel.ids,
                    &sel.all,
                    &limit,
                    &bytes,
                    &self.source_table,
                ],
            )
            .await?;
        rows.iter()
            .map(|r| PoisonRecord::from_row(r).map_err(Error::from))
            .collect()
    }

    /// Reads the original outbox row of every truncated copy in `page` (see the
    /// module doc); a row whose original cannot be read gets
    /// [`unavailable`](PoisonRecord::unavailable).
    pub(super) async fn restore_originals(
        &self,
        outbox: &OutboxConfig,
        originals: &mut Originals,
        page: &mut [PoisonRecord],
    ) -> Result<(), Error> {
        for rec in page.iter_mut().filter(|r| r.truncated) {
            let Some(id) = rec.outbox_id.clone() else {
                rec.unavailable = Some(
                    "the copy is truncated and has no outbox_id to find the original by".into(),
                );
                continue;
            };
            let (statement, format) = match originals.statement(&self.client, outbox).await {
                Ok(found) => found,
                Err(reason) => {
                    rec.unavailable = Some(reason);
                    continue;
                }
            };
            let Some(row) = self.client.query_opt(&statement, &[&id]).await? else {
                rec.unavailable = Some(format!(
                    "the copy is truncated and outbox row {id} is gone (deleted by retention?)"
                ));
                continue;
            };
            let (_, original) = poller::read_row(&row, format)?;
            let stored = rec.payload.as_deref().unwrap_or("").as_bytes();
            if !original
                .payload
                .as_deref()
                .unwrap_or(&[])
                .starts_with(stored)
            {
                rec.unavailable = Some(format!(
                    "the copy is truncated and outbox row {id} is not the row poisoned (its payload differs from the stored one)"
                ));
                continue;
            }
            rec.original = Some(original);
        }
        Ok(())
    }

    /// The parked keys this replay may release: every one with `--all`, else those
    /// of the named rows; none before migration `0009`.
    pub(super) async fn parked_keys(&self, sel: &Selection) -> Result<Vec<ParkedKey>, Error> {
        if !table_exists(&self.client, &self.parked_keys).await? {
            return Ok(Vec::new());
        }
        let sql = format!(
            "SELECT k.topic, k.record_key FROM {keys} AS k
             WHERE k.released_at IS NULL
               AND ($2 OR EXISTS (SELECT 1 FROM {poison} AS p
                                  WHERE p.poison_id = ANY($1) AND (p.parked OR p.holds_key)
                                    AND p.topic = k.topic AND p.aggregate_id = k.record_key))
             ORDER BY k.parked_at, k.topic, k.record_key",
            keys = self.parked_keys,
            poison = self.table
        );
        let rows = self.client.query(&sql, &[&sel.ids, &sel.all]).await?;
        Ok(rows
            .iter()
            .map(ParkedKey::from_row)
            .collect::<Result<_, _>>()?)
    }

    /// The first poisoned row of `key` not delivered yet: the key stays parked
    /// until it is.
    pub(super) async fn blocker(&self, key: &ParkedKey) -> Result<Option<i64>, Error> {
        let sql = format!(
            "SELECT poison_id FROM {} AND holds_key ORDER BY {KEY_ORDER} LIMIT 1",
            unreplayed_key_rows(&self.table)
        );
        let row = self.client.query_opt(&sql, &[&key.topic, &key.key]).await?;
        Ok(match row {
            Some(r) => Some(r.try_get(0)?),
            None => None,
        })
    }

    /// The next `limit` undelivered rows of `key` in delivery order, skipping
    /// `offset` (a dry run marks nothing, so it pages by offset).
    pub(super) async fn key_page(
        &self,
        key: &ParkedKey,
        offset: usize,
        limit: usize,
    ) -> Result<Vec<PoisonRecord>, Error> {
        let sql = format!(
            "SELECT {RECORD_COLUMNS} FROM {} ORDER BY {KEY_ORDER} OFFSET $3 LIMIT $4",
            unreplayed_key_rows(&self.table)
        );
        let offset = i64::try_from(offset).unwrap_or(i64::MAX);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = self
            .client
            .query(&sql, &[&key.topic, &key.key, &offset, &limit])
            .await?;
        rows.iter()
            .map(|r| PoisonRecord::from_row(r).map_err(Error::from))
            .collect()
    }

    /// Releases `key` unless rows of it were parked meanwhile (`Ok(false)`).
    pub(super) async fn release(&self, key: &ParkedKey) -> Result<bool, Error> {
        Ok(release_key(&self.client, &self.parked_keys, &self.table, key).await?)
    }

    /// Marks acknowledged rows; returns how many were updated.
    pub(super) async fn mark_replayed(&self, ids: &[i64]) -> Result<u64, Error> {
        if ids.is_empty() {
            return Ok(0);
        }
        let sql = format!(
            "UPDATE {} SET replayed_at = now(), replay_count = replay_count + 1
             WHERE poison_id = ANY($1)",
            self.table
        );
        Ok(self.client.execute(&sql, &[&ids]).await?)
    }
}

/// The statement that reads an outbox row by id, found on first use.
#[derive(Debug, Default)]
pub(super) struct Originals {
    found: Option<Result<(String, PayloadFormat), String>>,
}

impl Originals {
    async fn statement(
        &mut self,
        client: &Client,
        outbox: &OutboxConfig,
    ) -> Result<(String, PayloadFormat), String> {
        if self.found.is_none() {
            self.found = Some(match poller::inspect_tables(client, outbox).await {
                Ok(layout) => Ok((
                    poller::Sql::new(outbox, &layout, 0, None, None).by_id,
                    layout.payload_format,
                )),
                Err(e) => Err(format!(
                    "the copy is truncated and the outbox cannot be read: {e}"
                )),
            });
        }
        self.found.clone().unwrap_or_else(|| Err(String::new()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_format_follows_the_column_type() {
        assert_eq!(payload_format_for_type(Some("jsonb")), PayloadFormat::Json);
        assert_eq!(payload_format_for_type(Some("json")), PayloadFormat::Json);
        assert_eq!(payload_format_for_type(None), PayloadFormat::Json);
        assert_eq!(
            payload_format_for_type(Some("bytea")),
            PayloadFormat::ByteaText
        );
        assert_eq!(payload_format_for_type(Some("text")), PayloadFormat::Text);
        assert_eq!(
            payload_format_for_type(Some("varchar")),
            PayloadFormat::Text
        );
    }
}
