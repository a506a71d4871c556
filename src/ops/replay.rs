//! `outbox-relay replay`: re-publish rows of `poison_outbox` once their cause is fixed.
//!
//! Promise 5 (`docs/architecture.md#promises`) says nothing is silently dropped: an event the relay could
//! not deliver lands in the poison table with its error, and stays there. This module
//! is the way back out. The operator fixes the cause (raises `message.max.bytes`,
//! creates the missing topic, grants the ACL, repairs the row) and runs
//! `outbox-relay replay --all` (or `--id N` for chosen rows); each selected row is
//! published again and then marked.
//!
//! # Why the record is rebuilt with the relay's mapper
//!
//! The poison row keeps the outbox row's columns as text, not the Kafka record. The
//! record is rebuilt with [`OutboxMapper::map_row`], the function the polling relay
//! uses, so a replayed record follows the same contract as one from `run` or `poll`
//! (`docs/architecture.md#the-kafka-record`): key = `aggregate_id`, the original `idempotency_key` header first
//! (consumers dedupe on it, so a replay of an event that did arrive after all is
//! harmless), `event_type`, `aggregate_type`, `occurred_at`, then the row's `headers`
//! entries; the timestamp is the original `created_at`. Two details:
//!
//! * **`source_lsn`** is the commit LSN stored with the poison row when there is one
//!   (rows poisoned by the CDC relay), so the record is header for header the one the
//!   relay would have produced. Rows without an LSN (poisoned by the polling relay)
//!   get no `source_lsn` header, as in `poll`.
//! * **No extra header** such as `replayed_from_poison` or `replay_count`: the
//!   contract says the record is *the same* for `run`, `poll` and `replay`, and a
//!   new relay-owned header name could collide with a name in a row's `headers`
//!   object. Replays are recorded where operators look for them — `replayed_at`
//!   and `replay_count` in the poison table, and this command's report.
//!
//! The topic is the poison row's `topic` when set (the topic the relay produced to,
//! or the row's own `topic` column) and otherwise `kafka.topic_template`. The payload
//! is read according to the outbox table's `payload` column type, looked up in the
//! catalog (`bytea` rows are stored as `\x…` hex text and decoded back to bytes;
//! with an envelope configured, `json`/`jsonb` are spliced and text is embedded as a
//! string, exactly as the relay does). A row that still cannot be mapped (a NULL
//! `aggregate_id`, say) is reported as failed with the mapper's reason and left
//! unmarked.
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
//! # Why rows are never deleted, and the original error is kept
//!
//! A poison row is evidence that an event did not arrive in time; the audit counts
//! it. The table refuses `DELETE`/`TRUNCATE` (a trigger), and replay only *updates*
//! `replayed_at` and `replay_count`. `error`, `error_kind` and `attempts` keep the
//! original failure: that is why the row exists. A replay that fails again is
//! reported by this command (per row, with the broker's or the mapper's reason) and
//! leaves the row unmarked, so the next `--all` tries it again.
//!
//! # At-least-once, like the relay
//!
//! Rows are marked only after the broker acknowledged them (`acks=all`), in the same
//! pages they were published in. A crash between the ack and the `UPDATE` re-publishes
//! that page on the next run, with the same idempotency keys; nothing is marked that
//! was not delivered.
//!
//! # Bounded, not awaited one at a time
//!
//! Rows are read in pages of at most [`PAGE_ROWS`] rows and roughly
//! `relay.max_in_flight_bytes` of payload, so memory does not grow with the size of
//! the poison table. A page is handed to the [`Publisher`] in one go (no `await` per
//! send) and its [`DeliveryReport`]s are collected from the report channel; then the
//! acknowledged rows of the page are marked with one `UPDATE … WHERE poison_id =
//! ANY($1)`. Replays of [`PROGRESS_MIN_ROWS`] rows or more show progress on stderr
//! (`crate::ops::meter`).
//!
//! The producer is the relay's ([`kafka::producer_config`]: idempotent, `acks=all`,
//! the same partitioner, so a replayed event lands on its entity's partition), with
//! one difference: a finite `message.timeout.ms` ([`DELIVERY_TIMEOUT`]). The relay
//! waits forever for an unreachable broker because it must not skip an event; an
//! operator command should end, and a row whose delivery timed out is simply reported
//! as failed and not marked.
//!
//! # Concurrency and exit codes
//!
//! A replay holds a PostgreSQL advisory lock named after the poison table for its
//! duration, so two replays cannot publish the same rows at once (the second fails
//! at once, exit code 1). `--dry-run` takes no lock, connects to no broker, publishes
//! nothing and changes nothing; it lists what would be published (poison id,
//! idempotency key, key, topic, record bytes) and which rows cannot be mapped.
//!
//! [`run`] fails with exit code 2 for a bad selection, 3 when the poison table does
//! not exist (run `migrate`), 4 when the broker is unreachable at start (checked only
//! when there is something to publish). Otherwise it returns a [`ReplayReport`];
//! [`ReplayReport::exit_code`] is 1 when a row failed or the producer hit a fatal
//! error, else 0.

use std::collections::BTreeSet;
use std::fmt;
use std::process::ExitCode;
use std::time::Duration;

use bytes::Bytes;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio_postgres::{Client, Row};

use crate::config::ConfigError;
use crate::config::{Config, OutboxConfig, quote_qualified};
use crate::delivery::EventId;
use crate::error::Error;
use crate::kafka::{self, DeliveryReport, Publisher};
use crate::lsn::Lsn;
use crate::ops::meter::Meter;
use crate::outbox::{OutboxEvent, OutboxMapper, OutboxRow, PayloadFormat};
use crate::postgres::prerequisite::Prerequisite;

/// Most rows read (and in flight) per page.
pub const PAGE_ROWS: usize = 500;

/// Replays of at least this many rows show progress on stderr.
pub const PROGRESS_MIN_ROWS: u64 = 1000;

/// `message.timeout.ms` of the replay producer (see the module doc).
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(120);

/// How long the broker may take to answer the start-up metadata request.
const BROKER_CHECK_TIMEOUT: Duration = Duration::from_secs(10);

/// How long to wait for a delivery report before saying on stderr that we wait.
const STALL_NOTICE: Duration = Duration::from_secs(10);

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
}

/// Which rows to replay, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Selection {
    /// Explicitly named `poison_id`s, sorted, without duplicates.
    ids: Vec<i64>,
    /// Every row not replayed yet.
    all: bool,
}

impl Selection {
    fn from_args(args: &ReplayArgs) -> Result<Selection, ConfigError> {
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
    fn new(rec: &PoisonRecord) -> ReplayedRow {
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

    fn set_event(&mut self, event: &OutboxEvent) {
        self.idempotency_key = Some(String::from_utf8_lossy(&event.idempotency_key).into_owned());
        self.key = Some(String::from_utf8_lossy(&event.key).into_owned());
        self.topic = Some(event.topic.clone());
        self.bytes = event.byte_size();
    }

    fn fail(&mut self, kind: &str, error: impl Into<String>) {
        self.outcome = Outcome::Failed;
        self.error_kind = Some(kind.to_owned());
        self.error = Some(error.into());
    }

    fn delivered(&mut self, partition: i32, offset: i64) {
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
    /// Every processed row, in `poison_id` order.
    pub rows: Vec<ReplayedRow>,
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

    fn add(&mut self, row: ReplayedRow) {
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
        if let Some(reason) = &self.aborted {
            line.push_str(&format!("; ABORTED: {reason}"));
        }
        line
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
        write!(f, "{}", self.summary())
    }
}

/// One `poison_outbox` row as read back (text forms, see the migration).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PoisonRecord {
    poison_id: i64,
    outbox_id: Option<String>,
    idempotency_key: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<String>,
    event_type: Option<String>,
    topic: Option<String>,
    /// `headers::text` (jsonb output, as the relay read it from the stream).
    headers: Option<String>,
    payload: Option<String>,
    /// ISO 8601 (`to_json(created_at)`), independent of the session's `DateStyle`.
    created_at: Option<String>,
    lsn: Option<Lsn>,
    replay_count: i32,
    error_kind: String,
}

/// The columns [`PoisonRecord::from_row`] reads, in order.
const RECORD_COLUMNS: &str = "poison_id, outbox_id, idempotency_key, aggregate_type, aggregate_id,
     event_type, topic, headers::text, payload, to_json(created_at) #>> '{}', lsn::text,
     replay_count, error_kind";

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
        })
    }

    /// The outbox row the mapper sees: the stored text forms, unchanged.
    fn outbox_row(&self, payload_format: PayloadFormat) -> OutboxRow {
        let b = |v: &Option<String>| v.clone().map(Bytes::from);
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
        }
    }
}

/// How the payload text is read, from the outbox `payload` column's type name:
/// `bytea` rows were stored as `\x…` hex; `json`/`jsonb` are spliced into an
/// envelope; anything else is text.
fn payload_format_for_type(type_name: Option<&str>) -> PayloadFormat {
    match type_name {
        Some("bytea") => PayloadFormat::ByteaText,
        Some("json" | "jsonb") | None => PayloadFormat::Json,
        Some(_) => PayloadFormat::Text,
    }
}

/// Row counts taken once, at the start.
#[derive(Debug, Clone, Copy, Default)]
struct Counts {
    selected: u64,
    already_replayed: u64,
    /// Highest `poison_id` at the start: later rows wait for the next run.
    max_id: i64,
}

/// The poison table, through one metadata connection.
#[derive(Debug)]
struct PoisonStore {
    client: Client,
    /// Quoted, qualified name.
    table: String,
    /// As configured, for messages.
    name: String,
}

impl PoisonStore {
    /// Fails with exit code 3 when the table does not exist.
    async fn check_table(&self) -> Result<(), Error> {
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
    async fn lock(&self) -> Result<(), Error> {
        let key = format!("outbox-relay replay {}", self.table);
        let locked: bool = self
            .client
            .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&key])
            .await?
            .try_get(0)?;
        if !locked {
            return Err(Error::Other(format!(
                "another outbox-relay replay is running on {}; wait for it to finish",
                self.name
            )));
        }
        Ok(())
    }

    async fn unlock(&self) {
        let key = format!("outbox-relay replay {}", self.table);
        // Best effort: the lock also ends with the session.
        let _ = self
            .client
            .execute("SELECT pg_advisory_unlock(hashtext($1))", &[&key])
            .await;
    }

    /// Every named id must exist; otherwise nothing is replayed (exit code 2).
    async fn check_ids(&self, ids: &[i64]) -> Result<(), Error> {
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

    async fn counts(&self, sel: &Selection) -> Result<Counts, Error> {
        let sql = format!(
            "SELECT count(*) FILTER (WHERE poison_id = ANY($1) OR ($2 AND replayed_at IS NULL)),
                    count(*) FILTER (WHERE $2 AND replayed_at IS NOT NULL AND poison_id <> ALL($1)),
                    coalesce(max(poison_id), 0)
             FROM {}",
            self.table
        );
        let row = self.client.query_one(&sql, &[&sel.ids, &sel.all]).await?;
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
    async fn payload_type(&self, outbox: &OutboxConfig) -> Result<Option<String>, Error> {
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
    async fn page(
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
                               + coalesce(octet_length(headers::text), 0))
                           OVER (ORDER BY poison_id) AS running,
                        coalesce(octet_length(payload), 0)
                          + coalesce(octet_length(headers::text), 0) AS own
                 FROM (SELECT * FROM {}
                       WHERE poison_id > $1 AND poison_id <= $2
                         AND (poison_id = ANY($3) OR ($4 AND replayed_at IS NULL))
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
            .query(&sql, &[&after, &max_id, &sel.ids, &sel.all, &limit, &bytes])
            .await?;
        rows.iter()
            .map(|r| PoisonRecord::from_row(r).map_err(Error::from))
            .collect()
    }

    /// Marks acknowledged rows; returns how many were updated.
    async fn mark_replayed(&self, ids: &[i64]) -> Result<u64, Error> {
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

/// The producer and its report channel.
#[derive(Debug)]
struct Sender {
    publisher: Publisher,
    reports: mpsc::Receiver<DeliveryReport>,
    brokers: String,
}

impl Sender {
    async fn connect(config: &Config) -> Result<Sender, Error> {
        let mut cfg = kafka::producer_config(&config.kafka, &config.relay)?;
        // A finite delivery timeout for an operator command (see the module doc).
        cfg.remove("delivery.timeout.ms");
        cfg.set(
            "message.timeout.ms",
            DELIVERY_TIMEOUT.as_millis().to_string(),
        );
        let capacity = kafka::report_capacity(&config.relay).max(PAGE_ROWS);
        let (publisher, reports) = Publisher::new(cfg, capacity)?;
        publisher.check_broker(BROKER_CHECK_TIMEOUT).await?;
        Ok(Sender {
            publisher,
            reports,
            brokers: config.kafka.brokers.clone(),
        })
    }

    /// Publishes one page and collects its reports. Returns the rows and, when the
    /// producer hit a fatal error, its description.
    async fn publish_page(
        &mut self,
        mapper: &OutboxMapper,
        page: &[PoisonRecord],
        payload_format: PayloadFormat,
    ) -> Result<(Vec<ReplayedRow>, Option<String>), Error> {
        let mut rows = Vec::with_capacity(page.len());
        let mut awaiting = vec![false; page.len()];
        let mut outstanding = 0usize;
        for (i, rec) in page.iter().enumerate() {
            let mut row = ReplayedRow::new(rec);
            match mapper.map_row(&rec.outbox_row(payload_format), rec.lsn) {
                Err(unmappable) => row.fail(unmappable.error_kind, unmappable.reason),
                Ok(event) => {
                    row.set_event(&event);
                    match self
                        .publisher
                        .send_event(EventId::from_raw(i as u64), &event)
                    {
                        Ok(()) => {
                            awaiting[i] = true;
                            outstanding += 1;
                        }
                        Err(rejected) => {
                            row.fail(kafka::error_kind(rejected.code), rejected.message)
                        }
                    }
                }
            }
            rows.push(row);
        }
        let mut fatal = None;
        while outstanding > 0 {
            let report = match tokio::time::timeout(STALL_NOTICE, self.reports.recv()).await {
                Ok(Some(report)) => report,
                Ok(None) => {
                    return Err(Error::Other(
                        "the Kafka delivery-report channel closed during replay".into(),
                    ));
                }
                Err(_) => {
                    eprintln!(
                        "replay: waiting for {outstanding} delivery report(s) from {} \
                         (records time out after {}s)",
                        self.brokers,
                        DELIVERY_TIMEOUT.as_secs()
                    );
                    continue;
                }
            };
            let index = usize::try_from(report.id.get()).unwrap_or(usize::MAX);
            let (Some(row), Some(waiting)) = (rows.get_mut(index), awaiting.get_mut(index)) else {
                continue;
            };
            if !std::mem::replace(waiting, false) {
                continue;
            }
            outstanding -= 1;
            match &report.result {
                Ok((partition, offset)) => row.delivered(*partition, *offset),
                Err((code, message)) => {
                    if report.is_fatal() && fatal.is_none() {
                        fatal = Some(match self.publisher.fatal_error() {
                            Some((c, m)) => format!("Kafka producer failed ({c:?}): {m}"),
                            None => format!("Kafka producer failed ({code:?}): {message}"),
                        });
                    }
                    row.fail(kafka::error_kind(*code), message.clone());
                }
            }
        }
        Ok((rows, fatal))
    }
}

/// Rows of a page as `--dry-run` reports them.
fn dry_run_page(
    mapper: &OutboxMapper,
    page: &[PoisonRecord],
    payload_format: PayloadFormat,
) -> Vec<ReplayedRow> {
    page.iter()
        .map(|rec| {
            let mut row = ReplayedRow::new(rec);
            match mapper.map_row(&rec.outbox_row(payload_format), rec.lsn) {
                Ok(event) => {
                    row.set_event(&event);
                    row.outcome = Outcome::WouldPublish;
                }
                Err(unmappable) => row.fail(unmappable.error_kind, unmappable.reason),
            }
            row
        })
        .collect()
}

/// Runs `replay`: selects poison rows, re-publishes them with their original
/// idempotency key and headers, marks the acknowledged ones. See the module doc.
///
/// # Errors
///
/// [`Error::Config`] (exit 2) without `--id`/`--all` or for an unknown id;
/// [`Error::Prerequisite`] (exit 3) when the poison table is missing;
/// [`Error::BrokerUnavailable`] (exit 4) when the broker does not answer;
/// PostgreSQL errors (exit 1). Row failures are not errors: they are in the report.
pub async fn run(config: &Config, args: &ReplayArgs) -> Result<ReplayReport, Error> {
    let selection = Selection::from_args(args)?;
    let mapper = OutboxMapper::new(&config.outbox, &config.kafka, config.kafka.envelope.clone())?;
    let client = crate::postgres::connect(&config.postgres.url).await?;
    let store = PoisonStore {
        client,
        table: quote_qualified(&config.outbox.poison_table),
        name: config.outbox.poison_table.clone(),
    };
    store.check_table().await?;
    if !args.dry_run {
        store.lock().await?;
    }
    let result = replay(config, args, &selection, &mapper, &store).await;
    if !args.dry_run {
        store.unlock().await;
    }
    result
}

async fn replay(
    config: &Config,
    args: &ReplayArgs,
    selection: &Selection,
    mapper: &OutboxMapper,
    store: &PoisonStore,
) -> Result<ReplayReport, Error> {
    store.check_ids(&selection.ids).await?;
    let counts = store.counts(selection).await?;
    let payload_format =
        payload_format_for_type(store.payload_type(&config.outbox).await?.as_deref());
    let mut report = ReplayReport {
        poison_table: config.outbox.poison_table.clone(),
        dry_run: args.dry_run,
        selected: counts.selected,
        already_replayed: counts.already_replayed,
        ..ReplayReport::default()
    };
    if counts.selected == 0 {
        return Ok(report);
    }
    tracing::info!(
        rows = counts.selected,
        table = %config.outbox.poison_table,
        dry_run = args.dry_run,
        "replaying poison rows"
    );
    // The broker is needed only when there is something to publish.
    let mut sender = if args.dry_run {
        None
    } else {
        Some(Sender::connect(config).await?)
    };
    let page_rows = PAGE_ROWS.min(config.relay.max_in_flight_events.max(1));
    let mut after = 0;
    let what = if args.dry_run {
        "poison rows (dry run)"
    } else {
        "poison rows"
    };
    let mut meter = Meter::new(
        "replay",
        what,
        counts.selected,
        counts.selected >= PROGRESS_MIN_ROWS,
    );
    loop {
        let page = store
            .page(
                selection,
                after,
                counts.max_id,
                page_rows,
                config.relay.max_in_flight_bytes,
            )
            .await?;
        let Some(last) = page.last() else { break };
        after = last.poison_id;
        let (rows, fatal) = match sender.as_mut() {
            None => (dry_run_page(mapper, &page, payload_format), None),
            Some(sender) => sender.publish_page(mapper, &page, payload_format).await?,
        };
        drop(page);
        let acked: Vec<i64> = rows
            .iter()
            .filter(|r| r.outcome == Outcome::Published)
            .map(|r| r.poison_id)
            .collect();
        let marked = store.mark_replayed(&acked).await?;
        if marked != acked.len() as u64 {
            tracing::warn!(
                acked = acked.len(),
                marked,
                "not every acknowledged poison row could be marked"
            );
        }
        meter.inc(rows.len() as u64);
        for row in rows {
            report.add(row);
        }
        if let Some(reason) = fatal {
            report.aborted = Some(reason);
            break;
        }
    }
    meter.finish();
    tracing::info!(
        published = report.published,
        failed = report.failed,
        dry_run = args.dry_run,
        "replay finished"
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::KafkaConfig;
    use crate::outbox::EnvelopeConfig;
    use clap::Parser;

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

    fn kafka_config(template: &str) -> KafkaConfig {
        let mut table = toml::Table::new();
        table.insert("brokers".into(), "k:9092".into());
        table.insert("topic_template".into(), template.into());
        table.try_into().unwrap()
    }

    fn mapper(envelope: Option<EnvelopeConfig>) -> OutboxMapper {
        OutboxMapper::new(
            &OutboxConfig::default(),
            &kafka_config("outbox.event.{aggregate_type}"),
            envelope,
        )
        .unwrap()
    }

    fn text(s: &str) -> Option<Bytes> {
        Some(Bytes::copy_from_slice(s.as_bytes()))
    }

    /// What the relay would have published for a row, and the poison row it writes
    /// when the broker refuses it, read back the way `replay` reads it.
    fn poisoned(
        m: &OutboxMapper,
        row: &OutboxRow,
        lsn: Option<Lsn>,
    ) -> (OutboxEvent, PoisonRecord) {
        let event = m.map_row(row, lsn).unwrap();
        let f = event.poison_fields();
        let rec = PoisonRecord {
            poison_id: 7,
            outbox_id: f.outbox_id,
            idempotency_key: f.idempotency_key,
            aggregate_type: f.aggregate_type,
            aggregate_id: f.aggregate_id,
            event_type: f.event_type,
            topic: f.topic,
            headers: f.headers,
            payload: f.payload,
            // `to_json(timestamptz)` in a UTC session.
            created_at: f.created_at.map(|t| t.replace('Z', "+00:00")),
            lsn: f.lsn,
            replay_count: 0,
            error_kind: "message_size_too_large".into(),
        };
        (event, rec)
    }

    fn original_row() -> OutboxRow {
        OutboxRow {
            id: text("0190f5c6-8d2a-7b3e-9c41-5d6e7f8a9b0c"),
            idempotency_key: text("key-42"),
            aggregate_type: text("order"),
            aggregate_id: text("order-7"),
            event_type: text("OrderPlaced"),
            topic: None,
            headers: text(r#"{"tenant": "acme", "trace": 17}"#),
            payload: text(r#"{"amount": 1.10, "big": 12345678901234567890}"#),
            payload_format: PayloadFormat::Json,
            created_at: text("2026-11-30 14:29:33.123456+00"),
        }
    }

    fn same_record(a: &OutboxEvent, b: &OutboxEvent) {
        assert_eq!(a.key, b.key);
        assert_eq!(a.topic, b.topic);
        assert_eq!(a.payload, b.payload);
        assert_eq!(a.headers, b.headers);
        assert_eq!(a.timestamp_ms, b.timestamp_ms);
        assert_eq!(a.idempotency_key, b.idempotency_key);
    }

    #[test]
    fn a_poisoned_event_replays_as_the_same_record() {
        let m = mapper(None);
        let lsn = Some(Lsn(0x16_B374_D848));
        let (original, rec) = poisoned(&m, &original_row(), lsn);
        let replayed = m
            .map_row(&rec.outbox_row(PayloadFormat::Json), rec.lsn)
            .unwrap();
        same_record(&original, &replayed);
        let names: Vec<&str> = replayed.headers.iter().map(|(n, _)| n.as_ref()).collect();
        assert_eq!(
            names,
            [
                "idempotency_key",
                "event_type",
                "aggregate_type",
                "occurred_at",
                "source_lsn",
                "tenant",
                "trace"
            ]
        );
        assert_eq!(&replayed.headers[0].1[..], b"key-42");
        assert_eq!(replayed.topic, "outbox.event.order");
        // Without an LSN (a row the polling relay poisoned): no source_lsn header.
        let (original, rec) = poisoned(&m, &original_row(), None);
        let replayed = m
            .map_row(&rec.outbox_row(PayloadFormat::Json), None)
            .unwrap();
        same_record(&original, &replayed);
        assert!(replayed.headers.iter().all(|(n, _)| n != "source_lsn"));
    }

    #[test]
    fn envelope_and_bytea_payloads_replay_unchanged() {
        let envelope = EnvelopeConfig {
            producer: "orders".into(),
            schema_version: "1".into(),
        };
        let m = mapper(Some(envelope));
        let (original, rec) = poisoned(&m, &original_row(), None);
        let replayed = m
            .map_row(&rec.outbox_row(PayloadFormat::Json), None)
            .unwrap();
        same_record(&original, &replayed);

        let m = mapper(None);
        let row = OutboxRow {
            payload: text(r"\x00ff10"),
            payload_format: PayloadFormat::ByteaText,
            ..original_row()
        };
        let (original, rec) = poisoned(&m, &row, None);
        assert_eq!(rec.payload.as_deref(), Some(r"\x00ff10"));
        let replayed = m
            .map_row(&rec.outbox_row(PayloadFormat::ByteaText), None)
            .unwrap();
        same_record(&original, &replayed);
        assert_eq!(&replayed.payload[..], [0x00, 0xff, 0x10]);
    }

    #[test]
    fn the_stored_topic_wins_over_the_template() {
        let m = mapper(None);
        let row = OutboxRow {
            topic: text("orders.special"),
            ..original_row()
        };
        let (_, rec) = poisoned(&m, &row, None);
        let replayed = m
            .map_row(&rec.outbox_row(PayloadFormat::Json), None)
            .unwrap();
        assert_eq!(replayed.topic, "orders.special");
        // No stored topic: the template decides.
        let rec = PoisonRecord { topic: None, ..rec };
        let replayed = m
            .map_row(&rec.outbox_row(PayloadFormat::Json), None)
            .unwrap();
        assert_eq!(replayed.topic, "outbox.event.order");
    }

    #[test]
    fn an_unmappable_row_fails_with_the_mappers_reason() {
        let m = mapper(None);
        let rec = PoisonRecord {
            poison_id: 3,
            idempotency_key: Some("k".into()),
            aggregate_type: Some("order".into()),
            event_type: Some("Created".into()),
            payload: Some("{}".into()),
            error_kind: "null_key".into(),
            ..PoisonRecord::default()
        };
        let rows = dry_run_page(&m, std::slice::from_ref(&rec), PayloadFormat::Json);
        assert_eq!(rows[0].outcome, Outcome::Failed);
        assert_eq!(rows[0].error_kind.as_deref(), Some("null_key"));
        assert!(rows[0].error.as_deref().unwrap().contains("aggregate_id"));
        assert_eq!(rows[0].bytes, 0);
        assert_eq!(rows[0].replay_count, 0);
    }

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
