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

use super::error::{BenchError, Result};
use super::stats::count_f64;
use crate::config::{Config, quote_ident, quote_qualified};
use crate::lsn::Lsn;
use crate::tools::workload::{Workload, Writers};

/// Partitions of each run's topic.
pub(crate) const TOPIC_PARTITIONS: i32 = 6;

/// How long cleanup waits for a slot to be released by a stopped reader.
const SLOT_RELEASE_TIMEOUT: Duration = Duration::from_secs(15);

/// One run's objects. Call [`Fixture::cleanup`] when done (also after a failure).
#[derive(Debug)]
pub(crate) struct Fixture {
    /// Unique prefix of every name.
    pub(crate) name: String,
    /// The config a relay of this run uses (also written to [`Fixture::config_path`]).
    pub(crate) config: Config,
    pub(crate) config_path: PathBuf,
    pub(crate) topic: String,
    client: Client,
    table: String,
    /// The standby the run's slot lives on (`postgres.slot_url`), when it decodes
    /// there ([`Fixture::decode_on`]).
    standby: Option<(String, Client)>,
}

/// Bytes logical decoding spilled to disk (a transaction larger than
/// `logical_decoding_work_mem`, sent at its commit) and streamed in progress
/// (protocol v2 `streaming`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct DecodingStats {
    pub(crate) spill_bytes: i64,
    pub(crate) stream_bytes: i64,
}

/// How the writers write the workload's events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Writes {
    /// Outbox rows.
    Rows,
    /// `outbox_emit`, counted in the message ledger.
    Messages,
    /// `outbox_emit` with `outbox_relay.message_ledger = 'off'`.
    UnauditedMessages,
}

/// What writing the workload cost PostgreSQL.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Fill {
    /// Events written.
    pub(crate) events: u64,
    pub(crate) elapsed: Duration,
    /// WAL written during the insert, per event.
    pub(crate) wal_bytes_per_event: f64,
    /// Average text length of the payloads written.
    pub(crate) avg_payload_bytes: f64,
}

/// Size and vacuum state of the outbox table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TableStats {
    pub(crate) total_bytes: i64,
    pub(crate) dead_tuples: i64,
    pub(crate) updated: i64,
}

impl Fixture {
    /// Creates the tables, publication and topic for one run (the slot separately,
    /// with [`Fixture::create_slot`], when the mode reads the WAL).
    pub(crate) async fn create(base: &Config) -> Result<Fixture> {
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
            standby: None,
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
        // The writer functions and the message ledger get this run's names: the
        // schema's own `outbox_enqueue` / `outbox_emit` write to the real outbox and
        // must not be replaced by ones that write to this run's.
        for migration in crate::ops::migrate::MIGRATIONS {
            let sql = crate::ops::migrate::render(migration.sql, &self.config)?
                .replace("outbox_enqueue(", &format!("{}_enqueue(", self.name))
                .replace("outbox_emit(", &format!("{}_emit(", self.name))
                .replace(
                    "outbox_relay_message_ledger",
                    &format!("{}_ledger", self.name),
                );
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
        // With `--shards`, the shards' publications, as `migrate` makes them.
        crate::postgres::shard_publication::ensure(&self.client, &self.config).await?;
        if self.config.kafka.delivery == crate::config::DeliveryMode::ExactlyOnce {
            // As `migrate` does for `run`.
            crate::kafka::create_progress_topic(&self.config.kafka).await?;
        }
        create_topic(&self.config.kafka.brokers, &self.topic, TOPIC_PARTITIONS).await
    }

    /// The run's slots: the shards' (what `cdc` streams) and, when sharded, also the
    /// configured one, which the single-walsender ceilings read.
    fn slots(&self) -> Vec<String> {
        let mut slots = self.config.postgres.all_slot_names();
        if self.config.postgres.shards > 1 {
            slots.push(self.config.postgres.slot.clone());
        }
        slots
    }

    /// The processes of the walsenders streaming the run's slots now.
    pub(crate) async fn walsender_pids(&self) -> Vec<String> {
        match self
            .slot_client()
            .query(
                "SELECT active_pid FROM pg_replication_slots
                  WHERE slot_name = ANY($1::text[]) AND active_pid IS NOT NULL",
                &[&self.slots()],
            )
            .await
        {
            Ok(rows) => rows
                .iter()
                .map(|r| r.get::<_, i32>(0).to_string())
                .collect(),
            Err(_) => Vec::new(),
        }
    }

    /// The PostgreSQL client of this run's database.
    #[must_use]
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// The run's slot lives on the standby at `url` (the same database): the
    /// relay decodes there, and the slot's walsenders, readiness and cleanup are
    /// looked for there.
    pub(crate) async fn decode_on(&mut self, url: &str) -> Result<()> {
        let client = crate::postgres::connect(url).await?;
        self.standby = Some((url.to_owned(), client));
        Ok(())
    }

    /// The standby's URL when the run decodes on one.
    #[must_use]
    pub(crate) fn slot_url(&self) -> Option<&str> {
        self.standby.as_ref().map(|(url, _)| url.as_str())
    }

    /// The client of the server the run's slot lives on.
    #[must_use]
    pub(crate) fn slot_client(&self) -> &Client {
        self.standby.as_ref().map_or(&self.client, |(_, c)| c)
    }

    /// Creates `kafka.progress_topic`, which the exactly-once relay writes its
    /// progress to (an existing topic is fine; the run's slot names its records).
    pub(crate) async fn create_progress_topic(&self) -> Result<()> {
        crate::kafka::create_progress_topic(&self.config.kafka).await?;
        Ok(())
    }

    /// Creates the run's logical slot (pgoutput) now, so every row inserted from
    /// here on is in its stream.
    pub(crate) async fn create_slot(&self) -> Result<()> {
        for slot in self.slots() {
            self.client
                .execute(
                    "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
                    &[&slot],
                )
                .await?;
        }
        Ok(())
    }

    /// Writes the backlog: `workload.events` rows in transactions of
    /// `rows_per_tx`, from `writers` concurrent connections.
    pub(crate) async fn fill(&self, workload: &Workload, writes: Writes) -> Result<Fill> {
        let before = self.wal_lsn().await?;
        let started = Instant::now();
        let writers = self.writers(workload);
        match writes {
            Writes::Rows => writers.run().await?,
            Writes::Messages => writers.emitting(&self.emit_function()?).run().await?,
            Writes::UnauditedMessages => {
                writers
                    .emitting(&self.emit_function()?)
                    .on_connect("SET outbox_relay.message_ledger = 'off'")
                    .run()
                    .await?
            }
        };
        let messages = writes != Writes::Rows;
        let elapsed = started.elapsed();
        let after = self.wal_lsn().await?;
        // Messages leave no payload to measure: the writers' payload expression is
        // measured instead, over the same events.
        let avg: Option<f64> = if messages {
            None
        } else {
            self.client
                .query_one(
                    &format!(
                        "SELECT avg(octet_length(payload::text))::float8 FROM {}",
                        self.table
                    ),
                    &[],
                )
                .await?
                .get(0)
        };
        let per_event =
            count_f64(after.0.saturating_sub(before.0)) / count_f64(workload.events.max(1));
        Ok(Fill {
            events: workload.events,
            elapsed,
            wal_bytes_per_event: per_event,
            avg_payload_bytes: avg.unwrap_or(0.0),
        })
    }

    /// The workload's writers, into this run's table (the steady runs pace them).
    pub(crate) fn writers(&self, workload: &Workload) -> Writers {
        Writers::new(&self.config.postgres.url, &self.table, workload.clone())
    }

    /// This run's `outbox_emit` (see [`Fixture::create`]), quoted.
    pub(crate) fn emit_function(&self) -> Result<String> {
        Ok(format!("{}_emit", self.schema_prefix()?))
    }

    /// `"schema".name`: where this run's functions and ledger live.
    fn schema_prefix(&self) -> Result<String> {
        let (schema, _) = crate::config::qualified_name(&self.config.outbox.table)?;
        Ok(format!("{}.{}", quote_ident(&schema), self.name))
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
    pub(crate) async fn end_marker(&self) -> Result<Lsn> {
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

    /// What logical decoding of the run's slots spilled to disk and streamed in
    /// progress (`pg_stat_replication_slots`, zero for a new slot), in bytes.
    pub(crate) async fn decoding_stats(&self) -> Result<DecodingStats> {
        let row = self
            .client
            .query_one(
                "SELECT COALESCE(sum(spill_bytes), 0)::bigint, COALESCE(sum(stream_bytes), 0)::bigint
                   FROM pg_stat_replication_slots WHERE slot_name = ANY($1::text[])",
                &[&self.slots()],
            )
            .await?;
        Ok(DecodingStats {
            spill_bytes: row.get(0),
            stream_bytes: row.get(1),
        })
    }

    /// `pg_current_wal_lsn()`.
    pub(crate) async fn wal_lsn(&self) -> Result<Lsn> {
        let lsn: String = self
            .client
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await?
            .get(0);
        parse_lsn(&lsn)
    }

    /// The relay's slot's `confirmed_flush_lsn`; with shards, the lowest of theirs
    /// (zero while one is missing).
    pub(crate) async fn confirmed_flush(&self) -> Result<Lsn> {
        let slots = self.config.postgres.all_slot_names();
        let lsn: Option<String> = self
            .client
            .query_one(
                "SELECT CASE WHEN count(*) = cardinality($1::text[])
                             THEN min(confirmed_flush_lsn)::text END
                   FROM pg_replication_slots WHERE slot_name = ANY($1::text[])",
                &[&slots],
            )
            .await?
            .get(0);
        lsn.map_or(Ok(Lsn::ZERO), |l| parse_lsn(&l))
    }

    /// Whether any row is still unsent (the poller's view).
    pub(crate) async fn any_unsent(&self) -> Result<bool> {
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

    /// Size, dead tuples and updates of the outbox table, and of the message
    /// ledger (the message outbox's only table).
    pub(crate) async fn table_stats(&self) -> Result<TableStats> {
        let (schema, table) = crate::config::qualified_name(&self.config.outbox.table)?;
        let ledger = format!("{}_ledger", self.name);
        let row = self
            .client
            .query_one(
                "SELECT sum(pg_total_relation_size(format('%I.%I', $1::text, t)::regclass))::int8,
                        coalesce((SELECT sum(n_dead_tup) FROM pg_stat_user_tables
                                  WHERE schemaname = $1 AND relname = ANY($2)), 0)::int8,
                        coalesce((SELECT n_tup_upd FROM pg_stat_user_tables
                                  WHERE schemaname = $1 AND relname = $2[1]), 0)
                   FROM unnest($2::text[]) t",
                &[&schema, &vec![table, ledger]],
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
    pub(crate) async fn cleanup(mut self) {
        if self.client.is_closed() {
            // The server went away during the run (a restart, a crash): its objects
            // are still there once it is back.
            // Boxed: a connect future is large, and cleanup is awaited inside every run.
            match Box::pin(reconnect(&self.config.postgres.url)).await {
                Ok(client) => self.client = client,
                Err(e) => {
                    tracing::warn!(error = %e, name = %self.name, "cannot reconnect to drop the benchmark's slot and tables; drop them by hand");
                }
            }
        }
        for slot in self.slots() {
            if let Err(e) = self.drop_slot(&slot).await {
                tracing::warn!(%slot, error = %e, "cannot drop the benchmark slot; drop it by hand");
            }
        }
        let publications: Vec<String> = self
            .config
            .postgres
            .all_publication_names()
            .into_iter()
            .chain(std::iter::once(self.config.postgres.publication.clone()))
            .map(|p| format!("DROP PUBLICATION IF EXISTS {};", quote_ident(&p)))
            .collect();
        let own = self.schema_prefix().unwrap_or_else(|_| self.name.clone());
        let sql = format!(
            "{} DROP TABLE IF EXISTS {}; DROP TABLE IF EXISTS {}; DROP TABLE IF EXISTS {own}_ledger;
             DROP FUNCTION IF EXISTS {own}_emit; DROP FUNCTION IF EXISTS {own}_enqueue;",
            publications.join(" "),
            self.table,
            quote_qualified(&self.config.outbox.poison_table),
        );
        if let Err(e) = self.client.batch_execute(&sql).await {
            tracing::warn!(error = %e, "cannot drop the benchmark tables");
        }
        delete_topic(&self.config.kafka.brokers, &self.topic).await;
        let _ = std::fs::remove_file(&self.config_path);
    }

    async fn drop_slot(&self, slot: &str) -> Result<()> {
        let deadline = Instant::now() + SLOT_RELEASE_TIMEOUT;
        let mut pause = Duration::from_millis(10);
        loop {
            let client = self.slot_client();
            let row = client
                .query_opt(
                    "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                    &[&slot],
                )
                .await?;
            let Some(row) = row else { return Ok(()) };
            let active: Option<i32> = row.get(0);
            match active {
                None => {
                    client
                        .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
                        .await?;
                    return Ok(());
                }
                Some(pid) if Instant::now() > deadline => {
                    // Our reader is gone; its walsender has not noticed yet.
                    client
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

/// How long cleanup keeps trying to reach a server that went away.
const RECONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// A new connection to `url`, retried with backoff for [`RECONNECT_TIMEOUT`] (a
/// restarted server refuses connections while it recovers).
async fn reconnect(url: &str) -> Result<Client> {
    let deadline = Instant::now() + RECONNECT_TIMEOUT;
    let mut pause = Duration::from_millis(100);
    loop {
        match crate::postgres::connect(url).await {
            Ok(client) => return Ok(client),
            Err(e) if Instant::now() > deadline => return Err(e.into()),
            Err(_) => {}
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

fn parse_lsn(text: &str) -> Result<Lsn> {
    text.parse().map_err(|source| BenchError::BadLsn {
        text: text.to_owned(),
        source,
    })
}

/// The config of one run: the user's connection, producer and relay settings, this
/// run's names.
fn relay_toml(base: &Config, name: &str) -> Result<String> {
    use toml::{Table, Value};
    let (schema, _) = crate::config::qualified_name(&base.outbox.table)?;
    let mut postgres = Table::new();
    postgres.insert("url".into(), Value::String(base.postgres.url.clone()));
    postgres.insert("slot".into(), Value::String(format!("{name}_slot")));
    postgres.insert("publication".into(), Value::String(format!("{name}_pub")));
    postgres.insert(
        "shards".into(),
        Value::Integer(i64::from(base.postgres.shards)),
    );
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
    // The delivery mode and its transactions (`bench --set kafka.delivery=…`
    // compares the modes).
    for (key, value) in [
        (
            "delivery",
            Value::try_from(base.kafka.delivery).map_err(BenchError::RunConfig)?,
        ),
        (
            "transaction_max_events",
            Value::Integer(i64::try_from(base.kafka.transaction_max_events).unwrap_or(i64::MAX)),
        ),
        (
            "transaction_interval_ms",
            Value::Integer(i64::try_from(base.kafka.transaction_interval_ms).unwrap_or(i64::MAX)),
        ),
        (
            "transaction_timeout_ms",
            Value::Integer(i64::try_from(base.kafka.transaction_timeout_ms).unwrap_or(i64::MAX)),
        ),
        (
            "progress_topic",
            Value::String(base.kafka.progress_topic.clone()),
        ),
    ] {
        kafka.insert(key.into(), value);
    }
    // Every relay setting of the user's config (window, attempts, idle flushing, …),
    // so that a bench config compares them.
    let relay = Value::try_from(&base.relay).map_err(BenchError::RunConfig)?;
    let mut log = Table::new();
    log.insert("level".into(), Value::String("warn".into()));
    let mut doc = Table::new();
    doc.insert("postgres".into(), Value::Table(postgres));
    doc.insert("outbox".into(), Value::Table(outbox));
    doc.insert("kafka".into(), Value::Table(kafka));
    doc.insert("relay".into(), relay);
    doc.insert("log".into(), Value::Table(log));
    toml::to_string(&doc).map_err(BenchError::RunConfig)
}

/// Creates a topic and waits until metadata shows every partition, so producers do
/// not race it.
async fn create_topic(brokers: &str, name: &str, partitions: i32) -> Result<()> {
    crate::kafka::create_topic(brokers, name, partitions).await?;
    let brokers = brokers.to_owned();
    let name = name.to_owned();
    tokio::task::spawn_blocking(move || wait_for_topic(&brokers, &name, partitions))
        .await
        .map_err(BenchError::Task)?
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
    Err(BenchError::TopicNotVisible {
        topic: name.to_owned(),
    })
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
            "[postgres]\nurl = \"postgresql://u@h/db\"\n[kafka]\nbrokers = \"k:9092\"\n[kafka.producer]\n\"linger.ms\" = \"20\"\n[relay]\nflush_when_idle = false\nmax_attempts = 7\n",
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
        assert!(!c.relay.flush_when_idle);
        assert_eq!(c.relay.max_attempts, 7);
    }
}
