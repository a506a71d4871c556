//! The one event writer of the demo, the benchmark and the integration tests:
//! `writers` concurrent connections inserting `events` outbox rows in
//! transactions of `rows_per_tx`, spread over entities (the Kafka keys).
//!
//! # Why one writer
//!
//! What the relay is judged on (throughput, per-key order, no loss) depends on how
//! the rows were written: how many connections, how many rows per commit, how the
//! entities interleave. With one writer the demo, the benchmark and the tests
//! write the same way, and a figure or an ordering check means the same thing in
//! each of them.
//!
//! # The workload
//!
//! Transaction `t` (0-based, over all writers) holds the events numbered
//! `t × rows_per_tx ..` up to `events`, and writer `w` commits transactions
//! `w, w + writers, w + 2 × writers, …` in that order, so the writers interleave
//! evenly over the whole run. One statement writes one transaction's rows
//! server-side (`generate_series`), so the database, not this client, is what a
//! run measures. Each payload carries its event number as `seq`:
//!
//! * with [`Keys::Shared`] (the benchmark) event `g` belongs to entity
//!   `order-(g % entities)`, written by every writer;
//! * with [`Keys::PerWriter`] (the demo, the tests) each writer owns `entities`
//!   entities of its own, so an entity's events are committed in `seq` order and a
//!   consumer can check per-key order from the payloads alone.
//!
//! With [`Writers::varied`] (the tests) transaction sizes cycle through
//! `1, 2, …, rows_per_tx` and the padding grows by `t % 50` bytes, so a run mixes
//! one-row and multi-row commits and records of different lengths.
//!
//! Pacing ([`Pace`]): as fast as the database takes them (a backlog), open loop on
//! a [`Schedule`] (the benchmark's steady rate: a transaction that is late is sent
//! at once, so a slow database shows up as latency, not as a lower rate), or a
//! pause after each transaction (a background load in tests).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio_postgres::types::ToSql;

use crate::tools::bench::stats::Schedule;

/// Length of the jsonb text of a payload without its padding (see [`insert_sql`]):
/// a `payload_bytes` below it writes no padding.
const PAYLOAD_BASE_BYTES: usize = 84;

/// What a run writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    /// Events (rows) in all.
    pub events: u64,
    /// Approximate payload size (jsonb text) of each event.
    pub payload_bytes: usize,
    /// Rows per transaction (the last one may have fewer).
    pub rows_per_tx: u32,
    /// Concurrent writer connections.
    pub writers: u32,
    /// Entities: in all ([`Keys::Shared`]) or per writer ([`Keys::PerWriter`]).
    pub entities: u32,
}

/// How events are spread over entities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keys {
    /// Entity `order-(g % entities)`: every writer writes every entity.
    Shared,
    /// Entity `order-((g % entities) × writers + w)`: each writer owns its
    /// entities, so per-entity commit order is `seq` order.
    PerWriter,
}

/// When each writer sends its transactions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Pace {
    /// As fast as the database takes them.
    Unpaced,
    /// Open loop: transaction `t` is due `schedule.due(t)` after the start.
    Schedule(Schedule),
    /// A pause after each transaction.
    Pause(Duration),
}

/// Why writing failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkloadError {
    /// Connecting or inserting failed (the relay's own error, with its exit code).
    #[error(transparent)]
    Relay(crate::Error),
    #[error("writer task failed: {0}")]
    Task(#[source] tokio::task::JoinError),
}

impl<E: Into<crate::Error>> From<E> for WorkloadError {
    fn from(e: E) -> WorkloadError {
        WorkloadError::Relay(e.into())
    }
}

/// What the writers wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Written {
    /// Events committed.
    pub events: u64,
    /// Idempotency keys committed (only with [`Writers::returning_keys`]).
    pub committed: Vec<String>,
    /// Idempotency keys rolled back (only with [`Writers::returning_keys`]).
    pub rolled_back: Vec<String>,
}

/// The writers of one run; [`Writers::run`] writes.
#[derive(Debug, Clone)]
pub struct Writers {
    url: String,
    table: String,
    workload: Workload,
    keys: Keys,
    pace: Pace,
    rollback_every: Option<u64>,
    also: Option<String>,
    headers: Option<String>,
    returning: bool,
    varied: bool,
    stop: Option<Arc<AtomicBool>>,
    /// Writes each event with this message-outbox function instead of a row.
    emit: Option<String>,
    /// Run once on each writer's connection (e.g. a `SET`).
    session: Option<String>,
}

impl Writers {
    /// Writers into `table` (a quoted, possibly schema-qualified name) of the
    /// database at `url`, with shared entities, unpaced, everything committed.
    #[must_use]
    pub fn new(url: &str, table: &str, workload: Workload) -> Writers {
        Writers {
            url: url.to_owned(),
            table: table.to_owned(),
            workload,
            keys: Keys::Shared,
            pace: Pace::Unpaced,
            rollback_every: None,
            also: None,
            headers: None,
            returning: false,
            varied: false,
            stop: None,
            emit: None,
            session: None,
        }
    }

    /// Runs `sql` once on each writer's connection before it writes (a `SET`).
    #[must_use]
    pub fn on_connect(mut self, sql: &str) -> Writers {
        self.session = Some(sql.to_owned());
        self
    }

    /// Writes each event as a message of the message outbox, with `function` (a
    /// quoted name of `outbox_emit` or one made like it), instead of a row.
    #[must_use]
    pub fn emitting(mut self, function: &str) -> Writers {
        self.emit = Some(function.to_owned());
        self
    }

    /// How events are spread over entities.
    #[must_use]
    pub fn keys(mut self, keys: Keys) -> Writers {
        self.keys = keys;
        self
    }

    /// When transactions are sent.
    #[must_use]
    pub fn pace(mut self, pace: Pace) -> Writers {
        self.pace = pace;
        self
    }

    /// Rolls back every `n`-th transaction of each writer (`n`-th, `2n`-th, …)
    /// instead of committing it; `0` rolls back none.
    #[must_use]
    pub fn rollback_every(mut self, n: u64) -> Writers {
        self.rollback_every = (n > 0).then_some(n);
        self
    }

    /// Runs `sql` in each transaction before the outbox insert: the application's
    /// own write, committed (or rolled back) with its events.
    #[must_use]
    pub fn also(mut self, sql: &str) -> Writers {
        self.also = Some(sql.to_owned());
        self
    }

    /// The `headers` jsonb of every row.
    #[must_use]
    pub fn headers(mut self, json: &str) -> Writers {
        self.headers = Some(json.to_owned());
        self
    }

    /// Collects the idempotency keys written (`RETURNING idempotency_key`).
    #[must_use]
    pub fn returning_keys(mut self) -> Writers {
        self.returning = true;
        self
    }

    /// Varies transaction sizes (`1 + t % rows_per_tx` rows) and payload lengths
    /// (`t % 50` more bytes of padding) from one transaction to the next.
    #[must_use]
    pub fn varied(mut self) -> Writers {
        self.varied = true;
        self
    }

    /// Stops each writer before its next transaction once `stop` is set.
    #[must_use]
    pub fn until(mut self, stop: Arc<AtomicBool>) -> Writers {
        self.stop = Some(stop);
        self
    }

    /// The insert every writer repeats.
    #[must_use]
    pub fn sql(&self) -> String {
        match &self.emit {
            Some(function) => emit_sql(function, self.keys, self.headers.is_some()),
            None => insert_sql(
                &self.table,
                self.keys,
                self.headers.is_some(),
                self.returning,
            ),
        }
    }

    /// Writes the workload from concurrent connections; returns what was committed
    /// (and rolled back). The first error stops the run (the other writers are
    /// aborted).
    pub async fn run(self) -> Result<Written, WorkloadError> {
        let start = tokio::time::Instant::now();
        let this = Arc::new(self);
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..this.workload.writers {
            let this = Arc::clone(&this);
            tasks.spawn(async move { this.writer(w, start).await });
        }
        let mut written = Written::default();
        while let Some(joined) = tasks.join_next().await {
            let one = joined.map_err(WorkloadError::Task)??;
            written.events += one.events;
            written.committed.extend(one.committed);
            written.rolled_back.extend(one.rolled_back);
        }
        Ok(written)
    }

    /// Writer `w`: transactions `w, w + writers, …`.
    async fn writer(&self, w: u32, start: tokio::time::Instant) -> Result<Written, WorkloadError> {
        let workload = &self.workload;
        let mut client = crate::postgres::connect(&self.url).await?;
        if let Some(sql) = &self.session {
            client.batch_execute(sql).await?;
        }
        let statement = client.prepare(&self.sql()).await?;
        let sizes = TxSizes::new(workload.rows_per_tx, self.varied);
        let writers = u64::from(workload.writers);
        let transactions = sizes.transactions(workload.events);
        let schedule = match self.pace {
            Pace::Schedule(schedule) => schedule.split(workload.writers).get(w as usize).copied(),
            Pace::Unpaced | Pace::Pause(_) => None,
        };
        let entities = i64::from(workload.entities);
        let pad = i32::try_from(workload.payload_bytes.saturating_sub(PAYLOAD_BASE_BYTES))
            .unwrap_or(i32::MAX);
        let (all_writers, writer) = (i64::from(workload.writers), i64::from(w));
        let mut written = Written::default();
        let (mut t, mut i) = (u64::from(w), 0u64);
        while t < transactions
            && !self
                .stop
                .as_ref()
                .is_some_and(|s| s.load(Ordering::Relaxed))
        {
            if let Some((offset, part)) = schedule {
                tokio::time::sleep_until(start + offset + part.due(i)).await;
            }
            let (first, end) = sizes.range(t);
            let last = end.min(workload.events) - 1;
            let pad = if self.varied {
                pad.saturating_add(i32::try_from(t % 50).unwrap_or(0))
            } else {
                pad
            };
            let (first_g, last_g) = (
                i64::try_from(first).unwrap_or(i64::MAX),
                i64::try_from(last).unwrap_or(i64::MAX),
            );
            let mut params: Vec<&(dyn ToSql + Sync)> = vec![&entities, &pad, &first_g, &last_g];
            if self.keys == Keys::PerWriter {
                params.extend([&all_writers as &(dyn ToSql + Sync), &writer]);
            }
            if let Some(headers) = &self.headers {
                params.push(headers);
            }
            let rollback = self.rollback_every.is_some_and(|n| (i + 1) % n == 0);
            let keys = if self.also.is_none() && !rollback {
                // One autocommitted statement: the benchmark's insert, as measured.
                if self.returning {
                    keys_of(client.query(&statement, &params).await?)
                } else {
                    client.execute(&statement, &params).await?;
                    Vec::new()
                }
            } else {
                let tx = client.transaction().await?;
                if let Some(also) = &self.also {
                    tx.batch_execute(also).await?;
                }
                let keys = keys_of(tx.query(&statement, &params).await?);
                if rollback {
                    tx.rollback().await?;
                } else {
                    tx.commit().await?;
                }
                keys
            };
            if rollback {
                written.rolled_back.extend(keys);
            } else {
                written.events += last - first + 1;
                written.committed.extend(keys);
            }
            if let Pace::Pause(pause) = self.pace {
                tokio::time::sleep(pause).await;
            }
            t += writers;
            i += 1;
        }
        Ok(written)
    }
}

/// Which events each transaction holds: `rows` each, or (varied) sizes cycling
/// through `1..=rows`.
#[derive(Debug, Clone, Copy)]
struct TxSizes {
    rows: u64,
    varied: bool,
}

impl TxSizes {
    fn new(rows_per_tx: u32, varied: bool) -> TxSizes {
        TxSizes {
            rows: u64::from(rows_per_tx.max(1)),
            varied,
        }
    }

    /// Events before transaction `t`.
    fn start(self, t: u64) -> u64 {
        if !self.varied {
            return t.saturating_mul(self.rows);
        }
        let (cycles, rest) = (t / self.rows, t % self.rows);
        cycles
            .saturating_mul(self.rows * (self.rows + 1) / 2)
            .saturating_add(rest * (rest + 1) / 2)
    }

    /// Events `first..end` of transaction `t`.
    fn range(self, t: u64) -> (u64, u64) {
        (self.start(t), self.start(t + 1))
    }

    /// Transactions needed for `events` events.
    fn transactions(self, events: u64) -> u64 {
        if !self.varied {
            return events.div_ceil(self.rows);
        }
        let per_cycle = self.rows * (self.rows + 1) / 2;
        let mut t = (events / per_cycle).saturating_mul(self.rows);
        while self.start(t) < events {
            t += 1;
        }
        t
    }
}

fn keys_of(rows: Vec<tokio_postgres::Row>) -> Vec<String> {
    rows.iter()
        .filter_map(|r| r.try_get::<_, String>(0).ok())
        .collect()
}

/// The entity expression, the order id expression and the last parameter number
/// of the key parameters.
fn key_exprs(keys: Keys) -> (&'static str, &'static str, usize) {
    match keys {
        Keys::Shared => ("(g % $1)", "g % $1", 4),
        Keys::PerWriter => ("((g % $1) * $5 + $6)", "(g % $1) * $5 + $6", 6),
    }
}

/// The payload every event carries (~`$2` bytes of padding).
fn payload_expr(id: &str) -> String {
    format!(
        "jsonb_build_object('order_id', {id}, 'seq', g, 'amount_cents', 1000 + g % 9000,
                                   'currency', 'EUR', 'note', repeat('x', $2::int))"
    )
}

/// [`insert_sql`] for the message outbox: the same events, each written by
/// `function` (which returns its idempotency key).
fn emit_sql(function: &str, keys: Keys, headers: bool) -> String {
    let (key, id, n) = key_exprs(keys);
    let headers = if headers {
        format!(", ${}::text::jsonb", n + 1)
    } else {
        String::new()
    };
    format!(
        "SELECT {function}('order', 'order-' || {key}, 'OrderPlaced',
                {}{headers})
         FROM generate_series($3::bigint, $4::bigint) g",
        payload_expr(id)
    )
}

/// The statement each writer repeats: events `$3..=$4`, ~`$2` bytes of padding,
/// `$1` entities (per writer: `$5` writers, this is writer `$6`), then the headers.
fn insert_sql(table: &str, keys: Keys, headers: bool, returning: bool) -> String {
    let (key, id, mut n) = key_exprs(keys);
    let (headers_column, headers_value) = if headers {
        n += 1;
        (", headers", format!(", ${n}::text::jsonb"))
    } else {
        ("", String::new())
    };
    let returning = if returning {
        " RETURNING idempotency_key"
    } else {
        ""
    };
    format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload{headers_column})
         SELECT 'order', 'order-' || {key}, 'OrderPlaced',
                {}{headers_value}
         FROM generate_series($3::bigint, $4::bigint) g{returning}",
        payload_expr(id)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varied_transactions_cycle_through_their_sizes() {
        let sizes = TxSizes::new(3, true);
        let ranges: Vec<_> = (0..5).map(|t| sizes.range(t)).collect();
        assert_eq!(ranges, [(0, 1), (1, 3), (3, 6), (6, 7), (7, 9)]);
        assert_eq!(sizes.transactions(9), 5);
        assert_eq!(sizes.transactions(8), 5);
        assert_eq!(sizes.transactions(6), 3);
        let fixed = TxSizes::new(2, false);
        assert_eq!((fixed.range(3), fixed.transactions(7)), ((6, 8), 4));
        // An endless run (`events: u64::MAX`) neither overflows nor loops forever.
        assert!(sizes.transactions(u64::MAX) > u64::MAX / 3);
    }

    /// The benchmark's statement, byte for byte as it has always been measured.
    #[test]
    fn shared_keys_keep_the_benchmark_statement() {
        let table = "\"public\".\"bench_x_outbox\"";
        assert_eq!(
            insert_sql(table, Keys::Shared, false, false),
            format!(
                "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'order-' || (g % $1), 'OrderPlaced',
                jsonb_build_object('order_id', g % $1, 'seq', g, 'amount_cents', 1000 + g % 9000,
                                   'currency', 'EUR', 'note', repeat('x', $2::int))
         FROM generate_series($3::bigint, $4::bigint) g"
            )
        );
    }

    #[test]
    fn messages_carry_the_same_events() {
        let sql = emit_sql("\"public\".outbox_emit", Keys::PerWriter, true);
        assert!(
            sql.starts_with(
                "SELECT \"public\".outbox_emit('order', 'order-' || ((g % $1) * $5 + $6)"
            ),
            "{sql}"
        );
        assert!(
            sql.contains("repeat('x', $2::int)), $7::text::jsonb)"),
            "{sql}"
        );
        assert!(
            sql.ends_with("generate_series($3::bigint, $4::bigint) g"),
            "{sql}"
        );
    }

    #[test]
    fn options_number_their_parameters() {
        let sql = insert_sql("outbox", Keys::PerWriter, true, true);
        assert!(sql.contains("'order-' || ((g % $1) * $5 + $6)"), "{sql}");
        assert!(sql.contains("payload, headers)"), "{sql}");
        assert!(sql.contains(", $7::text::jsonb"), "{sql}");
        assert!(sql.ends_with(" g RETURNING idempotency_key"), "{sql}");
        let sql = insert_sql("outbox", Keys::Shared, true, false);
        assert!(sql.contains(", $5::text::jsonb"), "{sql}");
    }
}
