//! The database objects and the topic of one measured run, and the workload written
//! into them.
//!
//! Every run gets fresh, uniquely named objects in the configured database — an
//! outbox table, its poison table, a publication, a slot, a topic — so runs never
//! see each other's rows, the poller's dead tuples of one run do not slow the next,
//! and a benchmark can run beside a production outbox without touching it. They are
//! created with the project's own migrations (rendered for the unique names) and
//! dropped afterwards, the slot first: a forgotten slot pins WAL forever.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use tokio_postgres::Client;

use super::{BenchError, Workload};
use crate::config::{Config, quote_ident, quote_qualified};
use crate::error::{Error, Result};
use crate::lsn::Lsn;

/// Partitions of each run's topic.
pub const TOPIC_PARTITIONS: i32 = 6;

/// Length of the jsonb text of a payload without its padding (see [`INSERT_SQL`]).
const PAYLOAD_BASE_BYTES: usize = 84;

/// How long cleanup waits for a slot to be released by a stopped reader.
const SLOT_RELEASE_TIMEOUT: Duration = Duration::from_secs(15);

/// One run's objects. Call [`Fixture::cleanup`] when done (also after a failure).
#[derive(Debug)]
pub struct Fixture {
    /// Unique prefix of every name.
    pub name: String,
    /// The config a relay of this run uses (also written to [`Fixture::config_path`]).
    pub config: Config,
    pub config_path: PathBuf,
    pub topic: String,
    client: Client,
    table: String,
}

/// What writing the workload cost PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fill {
    /// Events written.
    pub events: u64,
    pub elapsed: Duration,
    /// WAL written during the insert, per event.
    pub wal_bytes_per_event: f64,
    /// Average text length of the payloads written.
    pub avg_payload_bytes: f64,
}

/// Size and vacuum state of the outbox table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableStats {
    pub total_bytes: i64,
    pub dead_tuples: i64,
    pub updated: i64,
}

impl Fixture {
    /// Creates the tables, publication and topic for one run (the slot separately,
    /// with [`Fixture::create_slot`], when the mode reads the WAL).
    pub async fn create(base: &Config) -> Result<Fixture> {
        let id = uuid::Uuid::now_v7().simple().to_string();
        let name = format!("bench_{}", &id[20..]);
        let text = relay_toml(base, &name)?;
        let config_path = std::env::temp_dir().join(format!("outbox-relay-{name}.toml"));
        std::fs::write(&config_path, &text)?;
        let config = Config::from_sources(&config_path.display().to_string(), &text, Vec::new())?;
        let client = crate::postgres::connect(&config.postgres.url).await?;
        let fixture = Fixture {
            topic: config.kafka.topic_template.clone(),
            table: quote_qualified(&config.outbox.table),
            name,
            config,
            config_path,
            client,
        };
        if let Err(e) = fixture.create_objects().await {
            fixture.cleanup().await;
            return Err(e);
        }
        Ok(fixture)
    }

    async fn create_objects(&self) -> Result<()> {
        // The migrations, rendered for this run's names. Not recorded in
        // outbox_relay_migrations: that table describes the database's real outbox.
        for migration in crate::ops::migrate::MIGRATIONS {
            let sql = crate::ops::migrate::render(migration.sql, &self.config)?;
            self.client.batch_execute(&sql).await?;
        }
        // `dead_tuples` reports the garbage a mode leaves behind for vacuum; with
        // autovacuum on the run's table it depends on whether autovacuum happened
        // to pass before the reading (it did, under load, and showed 0).
        self.client
            .batch_execute(&format!(
                "ALTER TABLE {} SET (autovacuum_enabled = false)",
                self.table
            ))
            .await?;
        create_topic(&self.config.kafka.brokers, &self.topic, TOPIC_PARTITIONS).await
    }

    /// The PostgreSQL client of this run's database.
    #[must_use]
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Creates the run's logical slot (pgoutput) now, so every row inserted from
    /// here on is in its stream.
    pub async fn create_slot(&self) -> Result<()> {
        self.client
            .execute(
                "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                &[&self.config.postgres.slot],
            )
            .await?;
        Ok(())
    }

    /// Writes the backlog: `workload.events` rows in transactions of
    /// `rows_per_tx`, from `writers` concurrent connections.
    pub async fn fill(&self, workload: &Workload) -> Result<Fill> {
        let before = self.wal_lsn().await?;
        let started = Instant::now();
        let mut tasks = tokio::task::JoinSet::new();
        for w in 0..workload.writers {
            let url = self.config.postgres.url.clone();
            let sql = insert_sql(&self.table);
            let workload = workload.clone();
            tasks.spawn(async move {
                let client = crate::postgres::connect(&url).await?;
                let statement = client.prepare(&sql).await?;
                let chunks = workload.events.div_ceil(u64::from(workload.rows_per_tx));
                let mut chunk = u64::from(w);
                while chunk < chunks {
                    let first = chunk * u64::from(workload.rows_per_tx);
                    let last = (first + u64::from(workload.rows_per_tx)).min(workload.events) - 1;
                    let (entities, pad, first, last) = insert_params(&workload, first, last);
                    client
                        .execute(&statement, &[&entities, &pad, &first, &last])
                        .await?;
                    chunk += u64::from(workload.writers);
                }
                Ok::<(), Error>(())
            });
        }
        while let Some(joined) = tasks.join_next().await {
            joined.map_err(|e| BenchError::Task(e.to_string()))??;
        }
        let elapsed = started.elapsed();
        let after = self.wal_lsn().await?;
        let avg: Option<f64> = self
            .client
            .query_one(
                &format!(
                    "SELECT avg(octet_length(payload::text))::float8 FROM {}",
                    self.table
                ),
                &[],
            )
            .await?
            .get(0);
        #[allow(clippy::cast_precision_loss)]
        let per_event = (after.0.saturating_sub(before.0)) as f64 / workload.events.max(1) as f64;
        Ok(Fill {
            events: workload.events,
            elapsed,
            wal_bytes_per_event: per_event,
            avg_payload_bytes: avg.unwrap_or(0.0),
        })
    }

    /// Commits one marker row after the workload and returns a WAL position taken
    /// inside its transaction, after its insert: past every workload commit, before
    /// the marker's own commit.
    ///
    /// A reader that confirmed this position has resolved every workload event,
    /// and the CDC relay confirms it as soon as the marker is acked. (A position
    /// after the last commit that no transaction follows, such as a
    /// non-transactional logical message, would be confirmed only at the
    /// walsender's next keepalive, seconds later.) `pg_recvlogical --endpos` stops
    /// at the marker's commit, the first record past it.
    pub async fn end_marker(&self) -> Result<Lsn> {
        self.client.batch_execute("BEGIN").await?;
        let lsn = async {
            self.client
                .execute(
                    &format!(
                        "INSERT INTO {} (aggregate_type, aggregate_id, event_type, payload)
                         VALUES ('bench', 'end-marker', 'BenchEnd', '{{}}')",
                        self.table
                    ),
                    &[],
                )
                .await?;
            let lsn: String = self
                .client
                .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
                .await?
                .get(0);
            parse_lsn(&lsn)
        }
        .await;
        match lsn {
            Ok(lsn) => {
                self.client.batch_execute("COMMIT").await?;
                Ok(lsn)
            }
            Err(e) => {
                let _ = self.client.batch_execute("ROLLBACK").await;
                Err(e)
            }
        }
    }

    /// `pg_current_wal_lsn()`.
    pub async fn wal_lsn(&self) -> Result<Lsn> {
        let lsn: String = self
            .client
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await?
            .get(0);
        parse_lsn(&lsn)
    }

    /// The slot's `confirmed_flush_lsn`.
    pub async fn confirmed_flush(&self) -> Result<Lsn> {
        let lsn: Option<String> = self
            .client
            .query_opt(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.config.postgres.slot],
            )
            .await?
            .and_then(|row| row.get(0));
        lsn.map_or(Ok(Lsn::ZERO), |l| parse_lsn(&l))
    }

    /// Whether any row is still unsent (the poller's view).
    pub async fn any_unsent(&self) -> Result<bool> {
        Ok(self
            .client
            .query_one(
                &format!(
                    "SELECT EXISTS (SELECT 1 FROM {} WHERE sent_at IS NULL)",
                    self.table
                ),
                &[],
            )
            .await?
            .get(0))
    }

    /// Size, dead tuples and updates of the outbox table.
    pub async fn table_stats(&self) -> Result<TableStats> {
        let (schema, table) = crate::config::qualified_name(&self.config.outbox.table)
            .map_err(|e| BenchError::Setup(e.clone()))?;
        let row = self
            .client
            .query_one(
                "SELECT pg_total_relation_size(format('%I.%I', $1::text, $2::text)::regclass),
                        coalesce((SELECT n_dead_tup FROM pg_stat_user_tables
                                  WHERE schemaname = $1 AND relname = $2), 0),
                        coalesce((SELECT n_tup_upd FROM pg_stat_user_tables
                                  WHERE schemaname = $1 AND relname = $2), 0)",
                &[&schema, &table],
            )
            .await?;
        Ok(TableStats {
            total_bytes: row.get(0),
            dead_tuples: row.get(1),
            updated: row.get(2),
        })
    }

    /// Drops the slot (waiting for its reader to let go), the publication, the
    /// tables, the topic and the config file. Best effort: a failure is logged, not
    /// returned, so that it never hides the run's own error.
    pub async fn cleanup(self) {
        if let Err(e) = self.drop_slot().await {
            tracing::warn!(slot = %self.config.postgres.slot, error = %e, "cannot drop the benchmark slot; drop it by hand");
        }
        let sql = format!(
            "DROP PUBLICATION IF EXISTS {}; DROP TABLE IF EXISTS {}; DROP TABLE IF EXISTS {};",
            quote_ident(&self.config.postgres.publication),
            self.table,
            quote_qualified(&self.config.outbox.poison_table),
        );
        if let Err(e) = self.client.batch_execute(&sql).await {
            tracing::warn!(error = %e, "cannot drop the benchmark tables");
        }
        delete_topic(&self.config.kafka.brokers, &self.topic).await;
        let _ = std::fs::remove_file(&self.config_path);
    }

    async fn drop_slot(&self) -> Result<()> {
        let slot = &self.config.postgres.slot;
        let deadline = Instant::now() + SLOT_RELEASE_TIMEOUT;
        let mut pause = Duration::from_millis(10);
        loop {
            let row = self
                .client
                .query_opt(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                    &[slot],
                )
                .await?;
            let Some(row) = row else { return Ok(()) };
            let active: Option<i32> = row.get(0);
            match active {
                None => {
                    self.client
                        .execute("SELECT pg_drop_replication_slot($1)", &[slot])
                        .await?;
                    return Ok(());
                }
                Some(pid) if Instant::now() > deadline => {
                    // Our reader is gone; its walsender has not noticed yet.
                    self.client
                        .execute("SELECT pg_terminate_backend($1)", &[&pid])
                        .await?;
                }
                Some(_) => {}
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(500));
        }
    }
}

/// The statement each writer repeats: `$3..=$4` numbered events, ~`$2` bytes of
/// padding, entity `order-(g % $1)`.
fn insert_sql(table: &str) -> String {
    format!(
        "INSERT INTO {table} (aggregate_type, aggregate_id, event_type, payload)
         SELECT 'order', 'order-' || (g % $1), 'OrderPlaced',
                jsonb_build_object('order_id', g % $1, 'seq', g, 'amount_cents', 1000 + g % 9000,
                                   'currency', 'EUR', 'note', repeat('x', $2::int))
         FROM generate_series($3::bigint, $4::bigint) g"
    )
}

/// Parameters of [`insert_sql`] for events `first..=last`.
#[must_use]
pub fn insert_params(workload: &Workload, first: u64, last: u64) -> (i64, i32, i64, i64) {
    let pad = i32::try_from(workload.payload_bytes.saturating_sub(PAYLOAD_BASE_BYTES))
        .unwrap_or(i32::MAX);
    (
        i64::from(workload.entities),
        pad,
        i64::try_from(first).unwrap_or(i64::MAX),
        i64::try_from(last).unwrap_or(i64::MAX),
    )
}

/// The insert statement for a table, for the steady-rate writers.
#[must_use]
pub fn insert_statement(fixture: &Fixture) -> String {
    insert_sql(&fixture.table)
}

fn parse_lsn(text: &str) -> Result<Lsn> {
    text.parse()
        .map_err(|e| Error::Other(format!("bad LSN {text:?} from the server: {e}")))
}

/// The config of one run: the user's connection and producer settings, this run's
/// names.
fn relay_toml(base: &Config, name: &str) -> Result<String> {
    use toml::{Table, Value};
    let (schema, _) =
        crate::config::qualified_name(&base.outbox.table).map_err(BenchError::Setup)?;
    let mut postgres = Table::new();
    postgres.insert("url".into(), Value::String(base.postgres.url.clone()));
    postgres.insert("slot".into(), Value::String(format!("{name}_slot")));
    postgres.insert("publication".into(), Value::String(format!("{name}_pub")));
    let mut outbox = Table::new();
    outbox.insert(
        "table".into(),
        Value::String(format!("{schema}.{name}_outbox")),
    );
    outbox.insert(
        "poison_table".into(),
        Value::String(format!("{schema}.{name}_poison")),
    );
    let mut kafka = Table::new();
    kafka.insert("brokers".into(), Value::String(base.kafka.brokers.clone()));
    kafka.insert(
        "topic_template".into(),
        Value::String(format!("outbox-relay-{}", name.replace('_', "-"))),
    );
    kafka.insert(
        "partitioner".into(),
        Value::String(base.kafka.partitioner.clone()),
    );
    let producer: Table = base
        .kafka
        .producer
        .iter()
        .map(|(k, v)| (k.clone(), Value::String(v.clone())))
        .collect();
    kafka.insert("producer".into(), Value::Table(producer));
    let int = |n: u64| Value::Integer(i64::try_from(n).unwrap_or(i64::MAX));
    let mut relay = Table::new();
    relay.insert(
        "max_in_flight_events".into(),
        int(base.relay.max_in_flight_events as u64),
    );
    relay.insert(
        "max_in_flight_bytes".into(),
        int(base.relay.max_in_flight_bytes as u64),
    );
    relay.insert(
        "max_attempts".into(),
        int(u64::from(base.relay.max_attempts)),
    );
    let mut log = Table::new();
    log.insert("level".into(), Value::String("warn".into()));
    let mut doc = Table::new();
    doc.insert("postgres".into(), Value::Table(postgres));
    doc.insert("outbox".into(), Value::Table(outbox));
    doc.insert("kafka".into(), Value::Table(kafka));
    doc.insert("relay".into(), Value::Table(relay));
    doc.insert("log".into(), Value::Table(log));
    toml::to_string(&doc).map_err(|e| BenchError::Setup(e.to_string()).into())
}

/// Creates a topic and waits until metadata shows every partition, so producers do
/// not race it.
async fn create_topic(brokers: &str, name: &str, partitions: i32) -> Result<()> {
    crate::kafka::create_topic(brokers, name, partitions).await?;
    let brokers = brokers.to_owned();
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || wait_for_topic(&brokers, &name, partitions))
        .await
        .map_err(|e| BenchError::Task(e.to_string()))?
}

fn wait_for_topic(brokers: &str, name: &str, partitions: i32) -> Result<()> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let expected = usize::try_from(partitions).unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let ready = consumer
            .fetch_metadata(Some(name), Duration::from_secs(5))
            .is_ok_and(|m| {
                m.topics().iter().any(|t| {
                    t.name() == name && t.error().is_none() && t.partitions().len() == expected
                })
            });
        if ready {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(Error::BrokerUnavailable(format!(
        "topic {name} never appeared in the broker's metadata"
    )))
}

async fn delete_topic(brokers: &str, name: &str) {
    let admin: std::result::Result<AdminClient<DefaultClientContext>, _> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create();
    let Ok(admin) = admin else { return };
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    if let Err(e) = admin.delete_topics(&[name], &opts).await {
        tracing::debug!(topic = name, error = %e, "cannot delete the benchmark topic");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Config {
        Config::from_sources(
            "t",
            "[postgres]\nurl = \"postgresql://u@h/db\"\n[kafka]\nbrokers = \"k:9092\"\n[kafka.producer]\n\"linger.ms\" = \"20\"\n",
            Vec::new(),
        )
        .unwrap()
    }

    #[test]
    fn run_config_keeps_connections_and_renames_objects() {
        let text = relay_toml(&base(), "bench_abc").unwrap();
        let c = Config::from_sources("t", &text, Vec::new()).unwrap();
        assert_eq!(c.postgres.url, "postgresql://u@h/db");
        assert_eq!(c.postgres.slot, "bench_abc_slot");
        assert_eq!(c.postgres.publication, "bench_abc_pub");
        assert_eq!(c.outbox.table, "public.bench_abc_outbox");
        assert_eq!(c.outbox.poison_table, "public.bench_abc_poison");
        assert_eq!(c.kafka.topic_template, "outbox-relay-bench-abc");
        assert_eq!(c.kafka.producer["linger.ms"], "20");
    }
}
