//! Configuration: a TOML file layered with `OUTBOX_RELAY__SECTION__KEY` environment
//! variables and `--set` overrides, then validated.
//!
//! The file is optional because a container's convention is configuration by
//! environment: without `--config`, `relay.toml` is read when it exists, and when it
//! does not, the environment and `--set` alone must give the required keys. A file
//! that is *named* (`--config`, `OUTBOX_RELAY_CONFIG`) and missing stays an error: a
//! typo in a path must not silently start a relay on defaults.
//!
//! Unknown keys are rejected (`deny_unknown_fields`) because a misspelt key that is
//! silently ignored is how a relay ends up publishing to the wrong topic. The
//! PostgreSQL URL may carry a password: `Debug`, the serialized config and every
//! error message about the file or a `--set` only ever show text passed through
//! [`redact_url`], which hides it even when it breaks the URL's syntax. Secret
//! librdkafka settings under `kafka.producer` (`sasl.password`, `ssl.key.password`,
//! an inline `ssl.key.pem`, …: [`is_secret_setting`]) are shown as `***` in `Debug`
//! and in the serialized config.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

#[cfg(test)]
pub(crate) mod documented;
pub mod duration;
mod error;
mod redact;
pub mod shard;

pub use error::ConfigError;
pub use redact::{is_secret_setting, redact_url};

use duration::parse_duration;

/// Prefix of environment variables that override config keys.
pub const ENV_PREFIX: &str = "OUTBOX_RELAY__";

/// The config file read when none is named, if it exists in the working directory.
pub const DEFAULT_CONFIG_FILE: &str = "relay.toml";

/// Keys without a default (`section.key`), with the environment variable that sets each.
const REQUIRED: [(&str, &str); 2] = [
    ("postgres.url", "OUTBOX_RELAY__POSTGRES__URL"),
    ("kafka.brokers", "OUTBOX_RELAY__KAFKA__BROKERS"),
];

/// The whole configuration.
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub postgres: PostgresConfig,
    /// The outbox (`[outbox]`), or the first of several (`[[outbox]]`).
    #[serde(default)]
    pub outbox: OutboxConfig,
    /// The outboxes after the first when the file has several `[[outbox]]`
    /// entries: one relay, slot and publication for all of them (see
    /// [`Config::outboxes`] and [`Config::per_outbox`]).
    #[serde(skip)]
    pub more_outboxes: Vec<OutboxConfig>,
    /// In a view of one outbox ([`Config::per_outbox`]): the first outbox's table,
    /// whose schema holds the relay's own tables ([`Config::relay_schema`]).
    #[serde(skip)]
    home_outbox: Option<String>,
    /// In a view of one of several outboxes: the tables of the outboxes before it.
    #[serde(skip)]
    earlier_outboxes: Vec<String>,
    pub kafka: KafkaConfig,
    #[serde(default)]
    pub relay: RelayConfig,
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub metrics: MetricsConfig,
    #[serde(default)]
    pub traces: TracesConfig,
    #[serde(default)]
    pub retention: RetentionConfig,
}

/// Where the outbox lives and how the relay reads it.
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresConfig {
    /// libpq-style URL, e.g. `postgresql://relay:secret@db:5432/app?sslmode=require`.
    /// Serialized with the password masked, like `Debug`.
    #[serde(serialize_with = "serialize_redacted")]
    pub url: String,
    /// Where the replication slot lives and is decoded, when that is not `url`'s
    /// server: a physical standby of it (PostgreSQL 16+), so that the primary does
    /// not pay for logical decoding. The relay's writes (its position, poison rows,
    /// heartbeats, backlog marks) and every table command still go to `url`.
    /// Unset: the slot is on `url`'s server. Serialized with the password masked.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "serialize_redacted_option"
    )]
    pub slot_url: Option<String>,
    /// Logical replication slot (created with `pgoutput` when missing).
    #[serde(default = "default_slot")]
    pub slot: String,
    /// Publication for the outbox table(s) (created by `migrate`).
    #[serde(default = "default_publication")]
    pub publication: String,
    /// Shards the outbox is split into by a hash of the entity id, each streamed by
    /// its own relay through its own publication and slot (`{publication}_shard{i}`,
    /// `{slot}_shard{i}`); 1 = not sharded. See [`shard`].
    #[serde(default = "default_shards")]
    pub shards: u32,
    /// The shard this relay streams, `0..shards`.
    #[serde(default)]
    pub shard: u32,
    /// Ask pgoutput for binary-format values (`binary 'true'`, PostgreSQL 14+):
    /// cheaper for the walsender (no output functions). Used while every column of
    /// the outbox tables has a type the relay reads in binary; a session that meets
    /// another type ends and streams on in text (`docs/architecture.md#binary-decoding`).
    #[serde(default = "default_true")]
    pub binary_decoding: bool,
}

impl PostgresConfig {
    /// The URL of the server the slot lives on: `slot_url`, or `url`.
    #[must_use]
    pub fn slot_server_url(&self) -> &str {
        self.slot_url.as_deref().unwrap_or(&self.url)
    }

    /// Whether the slot lives on another server than the relay's writes go to
    /// (`slot_url` is set).
    #[must_use]
    pub fn slot_elsewhere(&self) -> bool {
        self.slot_url.is_some()
    }

    /// The slot this relay streams from: `slot`, or its shard's.
    #[must_use]
    pub fn slot_name(&self) -> String {
        shard::shard_name(&self.slot, self.shards, self.shard)
    }

    /// The publication this relay's slot decodes: `publication`, or its shard's.
    #[must_use]
    pub fn publication_name(&self) -> String {
        shard::shard_name(&self.publication, self.shards, self.shard)
    }

    /// Every shard's slot, in shard order (just `slot` when not sharded): what
    /// retention and `status` must consider.
    #[must_use]
    pub fn all_slot_names(&self) -> Vec<String> {
        self.all_shard_names(&self.slot)
    }

    /// Every shard's publication, in shard order (just `publication` when not
    /// sharded).
    #[must_use]
    pub fn all_publication_names(&self) -> Vec<String> {
        self.all_shard_names(&self.publication)
    }

    fn all_shard_names(&self, base: &str) -> Vec<String> {
        (0..self.shards.max(1))
            .map(|i| shard::shard_name(base, self.shards, i))
            .collect()
    }
}

/// The outbox table, its poison side table, and the column names.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct OutboxConfig {
    /// `schema.table` or `table` (then `public`).
    pub table: String,
    /// Side table for undeliverable rows.
    pub poison_table: String,
    /// This outbox's topic template, in place of `kafka.topic_template` (for
    /// several `[[outbox]]` entries whose events go to different topics).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub topic_template: Option<String>,
    /// A row whose payload is NULL becomes a record with a null value (a tombstone,
    /// which log compaction reads as "delete this key") instead of a poison row:
    /// Debezium's `route.tombstone.on.empty.payload`.
    pub tombstone_on_empty_payload: bool,
    /// More columns placed in each record, in Debezium's
    /// `table.fields.additional.placement` syntax: `"column:header[:name]"` (a
    /// header) or `"column:envelope[:name]"` (a field of `[kafka.envelope]`), e.g.
    /// `["tenant_id:header", "version:header:schema_version"]`.
    pub additional_placement: Vec<String>,
    /// Create the outbox partitioned by `created_at` range (`migrate`), so that
    /// retention drops whole partitions instead of deleting rows.
    pub partitioned: bool,
    /// Width of one partition: `hour`, `day`, `week` or `month` (UTC).
    pub partition_interval: PartitionInterval,
    /// Partitions kept ready beyond the current one (`migrate` and `retention`).
    pub partitions_ahead: u32,
    /// A known outbox layout whose column names fill the `[outbox.columns]` keys
    /// the config does not set (applied while loading, see [`OutboxPreset`]).
    pub preset: OutboxPreset,
    pub columns: Columns,
}

/// The keys of the `[kafka.envelope]` object, which a placed field may not reuse.
const ENVELOPE_KEYS: [&str; 6] = [
    "event_id",
    "event_type",
    "schema_version",
    "occurred_at",
    "producer",
    "payload",
];

/// One `outbox.additional_placement` entry: a column and where its value goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    pub column: String,
    pub target: PlacementTarget,
    /// The header's or envelope field's name (the column's when not given).
    pub name: String,
}

/// Where an additional column is placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PlacementTarget {
    Header,
    Envelope,
}

impl OutboxConfig {
    /// The parsed `additional_placement` entries, in order.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Invalid`] for an entry that is not `column:header[:name]` or
    /// `column:envelope[:name]`.
    pub fn placements(&self) -> Result<Vec<Placement>, ConfigError> {
        self.additional_placement
            .iter()
            .map(|entry| {
                let parts: Vec<&str> = entry.split(':').map(str::trim).collect();
                let target = match parts.get(1).copied() {
                    Some("header") => PlacementTarget::Header,
                    Some("envelope") => PlacementTarget::Envelope,
                    Some("partition") => {
                        return Err(ConfigError::Invalid(format!(
                            "outbox.additional_placement {entry:?}: the partition placement is \
                             not supported (records are partitioned by their key, the entity id)"
                        )));
                    }
                    _ => {
                        return Err(ConfigError::Invalid(format!(
                            "outbox.additional_placement {entry:?}: use \"column:header[:name]\" \
                             or \"column:envelope[:name]\""
                        )));
                    }
                };
                let column = parts.first().copied().unwrap_or_default();
                let name = parts.get(2).copied().unwrap_or(column);
                if column.is_empty() || name.is_empty() || parts.len() > 3 {
                    return Err(ConfigError::Invalid(format!(
                        "outbox.additional_placement {entry:?}: use \"column:header[:name]\" \
                         or \"column:envelope[:name]\""
                    )));
                }
                Ok(Placement {
                    column: column.to_owned(),
                    target,
                    name: name.to_owned(),
                })
            })
            .collect()
    }
}

/// `outbox.preset`: the column names of a well-known outbox layout, so that
/// adopting such a table takes one line. Keys set in `[outbox.columns]` (file,
/// environment or `--set`) win over the preset's.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum OutboxPreset {
    /// This relay's own layout (the `[outbox.columns]` defaults).
    #[default]
    None,
    /// Debezium's outbox event router table: `id uuid, aggregatetype,
    /// aggregateid, type, payload`, no topic, headers, idempotency key or
    /// timestamp column (`id` is then the idempotency key).
    Debezium,
}

impl OutboxPreset {
    /// `(columns key, column name)` the preset sets; `""` = the table has none.
    #[must_use]
    pub fn columns(self) -> &'static [(&'static str, &'static str)] {
        match self {
            OutboxPreset::None => &[],
            OutboxPreset::Debezium => &[
                ("id", "id"),
                ("idempotency_key", ""),
                ("aggregate_type", "aggregatetype"),
                ("aggregate_id", "aggregateid"),
                ("event_type", "type"),
                ("topic", ""),
                ("headers", ""),
                ("payload", "payload"),
                ("created_at", ""),
            ],
        }
    }
}

/// Width of one partition of a partitioned outbox (a `date_trunc` field).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PartitionInterval {
    Hour,
    #[default]
    Day,
    Week,
    Month,
}

impl PartitionInterval {
    /// The `date_trunc` field (and `interval` unit) for this width.
    #[must_use]
    pub fn sql_unit(self) -> &'static str {
        match self {
            PartitionInterval::Hour => "hour",
            PartitionInterval::Day => "day",
            PartitionInterval::Week => "week",
            PartitionInterval::Month => "month",
        }
    }
}

/// `outbox-relay retention`: what is deleted, how much at a time, how often.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Rows (or partitions) younger than this are kept even when delivered, e.g. `7d`.
    pub period: String,
    /// Rows deleted per statement (one short transaction each).
    pub batch_size: u32,
    /// Pause between two cycles (checkpoint, delete) of `retention` without `--once`.
    pub interval: String,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            period: "7d".into(),
            batch_size: 1000,
            interval: "1m".into(),
        }
    }
}

impl RetentionConfig {
    /// `period` as a duration (validated by [`Config::validate`]).
    pub fn period(&self) -> Result<std::time::Duration, ConfigError> {
        parse_duration(&self.period)
            .map_err(|m| ConfigError::Invalid(format!("retention.period {:?}: {m}", self.period)))
    }

    /// `interval` as a duration (validated by [`Config::validate`]).
    pub fn interval(&self) -> Result<std::time::Duration, ConfigError> {
        parse_duration(&self.interval).map_err(|m| {
            ConfigError::Invalid(format!("retention.interval {:?}: {m}", self.interval))
        })
    }
}

/// Column names of the outbox table (defaults match our migration; Debezium's
/// `aggregatetype`, `aggregateid`, `type` are accepted by the mapper as aliases).
/// An empty name says the table has no such column: allowed for the optional ones
/// (`topic`, `headers`, `created_at`, `aggregate_type`, `event_type`, and one of
/// `id` / `idempotency_key`), which are then read as NULL.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Columns {
    pub id: String,
    pub idempotency_key: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub topic: String,
    pub headers: String,
    pub payload: String,
    pub created_at: String,
}

/// Broker connection and record shape.
#[derive(Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// `bootstrap.servers`.
    pub brokers: String,
    /// Topic for rows without a `topic` column value; `{aggregate_type}` and
    /// `{event_type}` are replaced by the row's values.
    #[serde(default = "default_topic_template")]
    pub topic_template: String,
    /// librdkafka partitioner; `murmur2_random` places keys like the Java client.
    #[serde(default = "default_partitioner")]
    pub partitioner: String,
    /// Extra librdkafka producer settings passed through verbatim (e.g. SASL/SSL).
    /// Serialized with secret values masked, like `Debug`.
    #[serde(default, serialize_with = "serialize_settings_redacted")]
    pub producer: BTreeMap<String, String>,
    /// When present, the record value is an envelope around the payload.
    #[serde(default)]
    pub envelope: Option<EnvelopeConfig>,
    /// When present, every record is a CloudEvent (`[kafka.cloudevents]`).
    #[serde(default)]
    pub cloudevents: Option<CloudEventsConfig>,
    /// `at-least-once` (the default: every event is acked, a crash may re-send a
    /// window) or `exactly-once` (Kafka transactions: a `read_committed` consumer sees
    /// each event once; see `docs/architecture.md#exactly-once`).
    #[serde(default)]
    pub delivery: DeliveryMode,
    /// Exactly-once: a Kafka transaction commits once this many events are written
    /// in it, or `transaction_interval_ms` after the first, whichever comes first.
    #[serde(default = "default_transaction_max_events")]
    pub transaction_max_events: usize,
    /// Exactly-once: the longest an event waits in an open Kafka transaction
    /// (`read_committed` consumers see it only after the commit).
    #[serde(default = "default_transaction_interval_ms")]
    pub transaction_interval_ms: u64,
    /// Exactly-once: `transaction.timeout.ms` of the producer, which is also its
    /// `message.timeout.ms` (a record not delivered by then fails its transaction,
    /// which is aborted and produced again). At most the cluster's
    /// `transaction.max.timeout.ms`; 1000-60000.
    #[serde(default = "default_transaction_timeout_ms")]
    pub transaction_timeout_ms: u64,
    /// Exactly-once: the compacted topic holding each relay's progress record (key:
    /// the slot name), written in every Kafka transaction; `migrate` creates it.
    #[serde(default = "default_progress_topic")]
    pub progress_topic: String,
    /// Exactly-once: the replication factor `migrate` creates the progress topic
    /// with; unset, the cluster's `default.replication.factor` (never 1 silently:
    /// with `min.insync.replicas = 2` a topic of one replica refuses every commit).
    #[serde(default)]
    pub progress_topic_replication_factor: Option<i16>,
}

/// `kafka.delivery`: what a consumer of the topics sees after a crash.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum DeliveryMode {
    /// Every event is acked by the broker before its position is confirmed; a crash
    /// re-sends at most a window of events (consumers de-duplicate by the
    /// idempotency key).
    #[default]
    AtLeastOnce,
    /// Events and the relay's progress record are written in Kafka transactions; a
    /// `read_committed` consumer sees each event once, across crashes and restarts.
    ExactlyOnce,
}

/// Relay tuning.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RelayConfig {
    /// In-flight window: events produced and not yet resolved.
    pub max_in_flight_events: usize,
    /// In-flight window: payload bytes produced and not yet resolved.
    pub max_in_flight_bytes: usize,
    /// Attempts for an event failing with a permanent error before it is poisoned.
    pub max_attempts: u32,
    /// Largest value copied whole into a poison row (payload, headers, `row_data`,
    /// error); a longer one is cut to this many bytes, with the row's size and hash,
    /// and the original stays in the outbox. Below PostgreSQL's jsonb and message
    /// size limits by construction (at most [`MAX_POISON_COPY_LIMIT`]).
    pub poison_copy_limit_bytes: usize,
    /// Seconds to wait for in-flight acks on SIGINT/SIGTERM.
    pub shutdown_timeout_secs: u64,
    /// Seconds to wait for a replication slot held by another process before
    /// giving up (exit code 3). Large values make a second relay a standby.
    pub slot_busy_timeout_secs: u64,
    /// Seconds between heartbeats (`pg_logical_emit_message` on the metadata
    /// connection, which keeps an idle slot advancing and measures the round
    /// trip); 0 turns the heartbeat off (the slot is still sampled every 10 s).
    pub heartbeat_interval_secs: u64,
    /// What `run` does when it has to create the slot: publish the rows a polling
    /// relay had not sent first (`auto`), or only stream from the new slot (`off`).
    pub cutover: CutoverMode,
    /// What `run` does when the slot it streamed from is gone, invalidated, or was
    /// re-created by someone else: publish the rows committed since the recorded
    /// position, then stream (`resync`), or stop with exit code 3 (`fail`).
    pub on_slot_loss: SlotLossMode,
    /// What a broker error that concerns the topic's or cluster's setup (missing
    /// topic or partition, no authorization, a timestamp outside the topic's window)
    /// does to the event: `block` holds it (retried with backoff, alerted) until the
    /// setup is fixed; `poison` treats it like the event's own fault.
    pub on_config_error: ConfigErrorMode,
    /// What an event the relay poisons does to the later events of its entity (its
    /// record key within its topic): `skip` lets them flow, `park-key` holds them
    /// back durably until `replay` releases the poisoned one, `halt` stops
    /// confirming and alerts. See `docs/architecture.md#poison-key-policy`.
    pub on_poison: PoisonKeyMode,
    /// Seconds with events in flight and no delivery report from a reachable broker
    /// after which the producer is considered wedged: it is replaced and the
    /// unconfirmed events are produced again. 0 turns the watchdog off.
    pub producer_stall_secs: u64,
    /// Seconds without any message from the server while the relay reads the
    /// replication stream after which the session is taken as lost (a silent network
    /// partition); from half of it the relay asks the server for a keepalive and
    /// `/readyz` turns 503. Never below twice the server's `wal_sender_timeout`.
    /// 0 turns the check off.
    pub receive_timeout_secs: u64,
    /// Least milliseconds between two writes of the relay's position table while
    /// events flow (idle progress is written once per status interval). Unset:
    /// [`RelayConfig::position_save_interval`]'s default.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position_save_interval_ms: Option<u64>,
    /// When the replication stream has nothing more to read between transactions,
    /// send the records the producer holds at once instead of waiting out
    /// `linger.ms`; while frames keep coming, `linger.ms` batches as configured.
    pub flush_when_idle: bool,
    /// Milliseconds the relay waits, once it has read everything the walsender sent
    /// so far, before it reads again, so that the transactions committed meanwhile
    /// are read, produced and acknowledged together: fewer wake-ups per event for
    /// up to this much more latency. 0 reads as soon as bytes arrive.
    pub read_pause_ms: u64,
}

/// The Prometheus and health HTTP endpoint.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// `host:port` for `/metrics`, `/healthz`, `/readyz`; empty (the default) = off.
    pub listen: String,
    /// `/readyz` turns not-ready when events are pending and the confirmed LSN has
    /// not advanced for this many seconds.
    pub ready_stall_secs: u64,
}

/// OpenTelemetry traces of each event's trip (`run`), exported over OTLP; where
/// and how is the standard `OTEL_*` variables' business (`OTEL_EXPORTER_OTLP_ENDPOINT`,
/// `OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER`, …).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TracesConfig {
    /// Export a span per sampled event. Off by default.
    pub enabled: bool,
    /// Share of the events whose row has no `traceparent` that are traced, 0.0 to
    /// 1.0 (a sampled parent is always followed, an unsampled one never), unless
    /// `OTEL_TRACES_SAMPLER` chooses the sampler.
    pub sample_ratio: f64,
}

impl Default for TracesConfig {
    fn default() -> Self {
        TracesConfig {
            enabled: false,
            sample_ratio: 0.01,
        }
    }
}

/// The optional JSON envelope around the payload.
///
/// With an envelope the record value is
/// `{"event_id":…,"event_type":…,"schema_version":…,"occurred_at":…,"producer":…,"payload":…}`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct EnvelopeConfig {
    /// Written as `"producer"`, e.g. the service name.
    pub producer: String,
    /// Written as `"schema_version"`.
    pub schema_version: String,
}

/// `[kafka.cloudevents]`: records as CloudEvents 1.0 in a mode of the Kafka protocol
/// binding (see `crate::outbox` and docs/architecture.md#cloudevents).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct CloudEventsConfig {
    /// `binary` (attributes in `ce_*` headers, the payload untouched) or
    /// `structured` (the JSON event format as the value).
    #[serde(default)]
    pub mode: CloudEventsMode,
    /// The `source` attribute: a URI-reference naming the producer, e.g.
    /// `"/services/orders"` or `"urn:example:orders"`.
    pub source: String,
}

/// Whether a header name is one CloudEvents reads (`ce_*` in any case,
/// `content-type`): another header of that name would be read twice by a consumer's
/// SDK (or, in structured mode, make it take the record for a binary-mode one).
#[must_use]
pub fn is_cloudevents_header(name: &str) -> bool {
    // SDKs compare header names case-insensitively (the Python SDK lowercases them).
    name.get(..3).is_some_and(|p| p.eq_ignore_ascii_case("ce_"))
        || name.eq_ignore_ascii_case("content-type")
}

/// `kafka.cloudevents.mode`.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CloudEventsMode {
    #[default]
    Binary,
    Structured,
}

/// `relay.cutover`: whether `run` cuts over from a polling relay when it creates the
/// replication slot (see [`crate::cdc::cutover`]).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CutoverMode {
    /// Creating the slot also publishes every unsent, unpoisoned outbox row in the
    /// slot's exported snapshot. On an empty outbox this costs one query.
    #[default]
    Auto,
    /// Creating the slot streams only what commits after it; rows already in the
    /// outbox are left to `outbox-relay cutover` (or to nobody).
    Off,
}

/// `relay.on_slot_loss`: what `run` does when the slot it has recorded progress for
/// is missing, invalidated or re-created (see `crate::cdc::start`).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SlotLossMode {
    /// Create the slot with an exported snapshot, publish every outbox row committed
    /// after the recorded position and before the new slot, then stream.
    #[default]
    Resync,
    /// Stop with exit code 3 and say what happened; an operator decides.
    Fail,
}

/// `relay.on_config_error` (see `docs/architecture.md#the-delivery-failure-policy`).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ConfigErrorMode {
    /// Hold the event (and its key's later events) and retry with backoff, with an
    /// error log naming the topic and the fix, a metric and `/readyz` 503.
    #[default]
    Block,
    /// Retry up to `relay.max_attempts`, then poison, as for an oversize record.
    Poison,
}

impl ConfigErrorMode {
    /// Whether configuration failures are poisoned.
    #[must_use]
    pub fn poisons(self) -> bool {
        self == ConfigErrorMode::Poison
    }
}

/// `relay.on_poison`: what a poisoned event means for the later events of its key
/// (see `docs/architecture.md#poison-key-policy`).
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum PoisonKeyMode {
    /// The later events of the key are delivered; the poisoned one is out of order
    /// when it is replayed.
    #[default]
    Skip,
    /// The later events of the key are written to the poison table as *parked*
    /// (durable, so the slot confirms past them) until `replay` delivers the
    /// poisoned one; then `replay` delivers them in order and releases the key.
    ParkKey,
    /// Nothing is poisoned: the event stays unresolved, the relay stops confirming
    /// past it and raises an alert until it is fixed and the relay restarted.
    Halt,
}

impl PoisonKeyMode {
    /// The name as written in the config.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            PoisonKeyMode::Skip => "skip",
            PoisonKeyMode::ParkKey => "park-key",
            PoisonKeyMode::Halt => "halt",
        }
    }
}

/// Logging.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogConfig {
    /// `human` or `json`.
    pub format: LogFormat,
    /// A `tracing` filter, e.g. `info` or `outbox_relay=debug`; `RUST_LOG` wins.
    pub level: String,
}

/// Log line format.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

fn default_slot() -> String {
    "outbox_relay".into()
}
fn default_publication() -> String {
    "outbox_relay_pub".into()
}
fn default_true() -> bool {
    true
}
fn default_shards() -> u32 {
    1
}
fn default_topic_template() -> String {
    "outbox.event.{aggregate_type}".into()
}
fn default_partitioner() -> String {
    "murmur2_random".into()
}
fn default_transaction_max_events() -> usize {
    5_000
}
fn default_transaction_interval_ms() -> u64 {
    100
}
fn default_transaction_timeout_ms() -> u64 {
    60_000
}
fn default_progress_topic() -> String {
    "outbox_relay_progress".into()
}

impl Default for OutboxConfig {
    fn default() -> Self {
        OutboxConfig {
            table: "public.outbox".into(),
            poison_table: "public.poison_outbox".into(),
            topic_template: None,
            tombstone_on_empty_payload: false,
            additional_placement: Vec::new(),
            partitioned: false,
            partition_interval: PartitionInterval::Day,
            partitions_ahead: 3,
            preset: OutboxPreset::None,
            columns: Columns::default(),
        }
    }
}

impl Columns {
    /// Every column as `(config key, configured name)`, in the order of the
    /// outbox row's fields (`id`, `idempotency_key`, …, `created_at`); an empty
    /// name means the table has no such column.
    #[must_use]
    pub fn by_key(&self) -> [(&'static str, &str); 9] {
        [
            ("id", &self.id),
            ("idempotency_key", &self.idempotency_key),
            ("aggregate_type", &self.aggregate_type),
            ("aggregate_id", &self.aggregate_id),
            ("event_type", &self.event_type),
            ("topic", &self.topic),
            ("headers", &self.headers),
            ("payload", &self.payload),
            ("created_at", &self.created_at),
        ]
    }

    /// An empty name means "no such column"; the mapper cannot do without the key
    /// and the payload, nor without both the idempotency key and the id.
    fn validate(&self) -> Result<(), ConfigError> {
        for (key, name) in [
            ("aggregate_id", &self.aggregate_id),
            ("payload", &self.payload),
        ] {
            if name.is_empty() {
                return Err(ConfigError::Invalid(format!(
                    "outbox.columns.{key} is empty: every outbox needs this column"
                )));
            }
        }
        if self.id.is_empty() && self.idempotency_key.is_empty() {
            return Err(ConfigError::Invalid(
                "outbox.columns.id and idempotency_key are both empty: one must name a column (the idempotency key)".into(),
            ));
        }
        Ok(())
    }
}

impl Default for Columns {
    fn default() -> Self {
        Columns {
            id: "id".into(),
            idempotency_key: "idempotency_key".into(),
            aggregate_type: "aggregate_type".into(),
            aggregate_id: "aggregate_id".into(),
            event_type: "event_type".into(),
            topic: "topic".into(),
            headers: "headers".into(),
            payload: "payload".into(),
            created_at: "created_at".into(),
        }
    }
}

/// Default of `relay.poison_copy_limit_bytes`: 16 MiB, so a payload a broker refused
/// as too large (typically a few MiB) is still copied whole.
pub const DEFAULT_POISON_COPY_LIMIT: usize = 16 * 1024 * 1024;

/// Bounds of `relay.poison_copy_limit_bytes`. The upper one keeps a poison insert
/// (payload, headers, `row_data` and error, each at most this long) far below
/// jsonb's 256 MiB and a protocol message's 1 GiB.
pub const MIN_POISON_COPY_LIMIT: usize = 1024;
/// Default of `relay.read_pause_ms`.
pub const DEFAULT_READ_PAUSE_MS: u64 = 2;
/// Longest `relay.read_pause_ms`: a pause is for batching reads, far below every
/// timeout the server or the relay keeps (`wal_sender_timeout`, the receive timeout).
pub const MAX_READ_PAUSE_MS: u64 = 100;
/// See [`MIN_POISON_COPY_LIMIT`].
pub const MAX_POISON_COPY_LIMIT: usize = 128 * 1024 * 1024;

/// `relay.position_save_interval_ms` when unset, with the slot on `postgres.url`'s
/// server.
pub const POSITION_SAVE_INTERVAL_MS: u64 = 50;

/// `relay.position_save_interval_ms` when unset, with the slot on a standby
/// (`postgres.slot_url`): the saves are then the relay's only steady work on the
/// primary, one transaction each; at 50 ms they cost the primary about as much CPU
/// as the standby saves it at 1,000 events/s in transactions of 10
/// (`docs/benchmarks.md`, decoding on a standby).
pub const POSITION_SAVE_INTERVAL_ON_STANDBY_MS: u64 = 250;

impl RelayConfig {
    /// The least time between two saves of the position while events flow:
    /// `position_save_interval_ms`, or its default, longer when the slot lives on a
    /// standby (`slot_elsewhere`).
    #[must_use]
    pub fn position_save_interval(&self, slot_elsewhere: bool) -> std::time::Duration {
        let default = if slot_elsewhere {
            POSITION_SAVE_INTERVAL_ON_STANDBY_MS
        } else {
            POSITION_SAVE_INTERVAL_MS
        };
        std::time::Duration::from_millis(self.position_save_interval_ms.unwrap_or(default))
    }
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            max_in_flight_events: 10_000,
            max_in_flight_bytes: 32 * 1024 * 1024,
            max_attempts: 5,
            poison_copy_limit_bytes: DEFAULT_POISON_COPY_LIMIT,
            shutdown_timeout_secs: 30,
            slot_busy_timeout_secs: 30,
            heartbeat_interval_secs: 10,
            cutover: CutoverMode::Auto,
            on_slot_loss: SlotLossMode::Resync,
            on_config_error: ConfigErrorMode::Block,
            on_poison: PoisonKeyMode::Skip,
            producer_stall_secs: 60,
            receive_timeout_secs: 60,
            position_save_interval_ms: None,
            flush_when_idle: true,
            read_pause_ms: DEFAULT_READ_PAUSE_MS,
        }
    }
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            listen: String::new(),
            ready_stall_secs: 60,
        }
    }
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::Human,
            level: "info".into(),
        }
    }
}

impl Config {
    /// Reads `path`, overlays `OUTBOX_RELAY__…` variables from the process
    /// environment, and validates the result.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::load_with(Some(path), &[])
    }

    /// Reads the named file (an error when missing) or, with `None`,
    /// [`DEFAULT_CONFIG_FILE`] when it exists; overlays the environment, then
    /// `--set section.key=value` overrides, which win over both.
    pub fn load_with(path: Option<&Path>, overrides: &[String]) -> Result<Config, ConfigError> {
        let (origin, text) = read_file(path)?;
        let mut sources: Vec<(String, String)> = std::env::vars().collect();
        for set in overrides {
            sources.push(cli_override(set)?);
        }
        Config::from_sources(&origin, &text, sources)
    }

    /// Builds a config from TOML text and `(name, value)` environment pairs.
    pub fn from_sources(
        origin: &str,
        toml_text: &str,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        // TOML errors quote the offending line, which may be the URL's.
        let parse_error = |e: toml::de::Error| ConfigError::Parse {
            origin: origin.to_owned(),
            message: redact_url(&e.to_string()),
        };
        let mut doc: toml::Table = toml::from_str(toml_text).map_err(parse_error)?;
        for (name, value) in env {
            if let Some(rest) = name.strip_prefix(ENV_PREFIX) {
                overlay_env(&mut doc, &name, rest, &value)?;
            }
        }
        let more = split_outboxes(&mut doc)?;
        if let Some(outbox) = doc.get_mut("outbox").and_then(toml::Value::as_table_mut) {
            apply_preset(outbox)?;
        }
        let mut config: Config = match doc.clone().try_into() {
            Ok(config) => config,
            // Serde would only say "missing field `url`": name the key and its
            // variable instead. Other errors (an unknown key) come first as they are.
            Err(e) if e.message().starts_with("missing field") => {
                require_keys(&doc, origin)?;
                return Err(parse_error(e));
            }
            Err(e) => return Err(parse_error(e)),
        };
        for (i, mut outbox) in more.into_iter().enumerate() {
            apply_preset(&mut outbox)?;
            let entry = OutboxConfig::deserialize(toml::Value::Table(outbox))
                .map_err(|e| ConfigError::Invalid(format!("[[outbox]] entry {}: {e}", i + 2)))?;
            config.more_outboxes.push(entry);
        }
        config.validate()?;
        Ok(config)
    }

    /// Every outbox this relay serves: `outbox`, then `more_outboxes`.
    pub fn outboxes(&self) -> impl Iterator<Item = &OutboxConfig> {
        std::iter::once(&self.outbox).chain(&self.more_outboxes)
    }

    /// Whether the config names more than one outbox table.
    #[must_use]
    pub fn has_several_outboxes(&self) -> bool {
        !self.more_outboxes.is_empty()
    }

    /// One config per outbox, each naming only that outbox as `outbox` and its topic
    /// template as `kafka.topic_template`: what the commands that work on one table
    /// at a time (`migrate`, `audit`, `retention`, `replay`, a resync) run on.
    #[must_use]
    pub fn per_outbox(&self) -> Vec<Config> {
        self.outboxes()
            .enumerate()
            .map(|(i, outbox)| {
                let mut view = self.clone();
                view.earlier_outboxes = self.outboxes().take(i).map(|o| o.table.clone()).collect();
                view.outbox = outbox.clone();
                view.more_outboxes.clear();
                if self.has_several_outboxes() {
                    view.home_outbox = Some(self.outbox.table.clone());
                }
                if let Some(template) = &outbox.topic_template {
                    view.kafka.topic_template.clone_from(template);
                }
                view
            })
            .collect()
    }

    /// The schema of the relay's own tables (its position, checkpoints, cutover
    /// marker): the first outbox's, in a view of another outbox too.
    ///
    /// # Errors
    ///
    /// The table name is malformed (a validated config never has one).
    pub fn relay_schema(&self) -> Result<String, TableNameError> {
        qualified_name(self.home_outbox.as_deref().unwrap_or(&self.outbox.table))
            .map(|(schema, _)| schema)
    }

    /// In a view of one of several outboxes: the tables of the outboxes before it.
    #[must_use]
    pub fn earlier_outboxes(&self) -> &[String] {
        &self.earlier_outboxes
    }

    /// Whether this config names several outboxes, or is a view of one of several.
    #[must_use]
    pub fn serves_several_outboxes(&self) -> bool {
        self.has_several_outboxes() || self.home_outbox.is_some()
    }

    /// Whether `outbox` is the first outbox (also in a view of it): the one whose
    /// schema holds the relay's own tables and whose migrations are recorded in
    /// `outbox_relay_migrations`.
    #[must_use]
    pub fn is_first_outbox(&self) -> bool {
        self.home_outbox
            .as_deref()
            .is_none_or(|home| home == self.outbox.table)
    }

    /// The topic template of `outbox`: its own, else `kafka.topic_template`.
    #[must_use]
    pub fn topic_template_of<'a>(&'a self, outbox: &'a OutboxConfig) -> &'a str {
        outbox
            .topic_template
            .as_deref()
            .unwrap_or(&self.kafka.topic_template)
    }

    /// Checks what serde cannot: names, ranges, conflicting producer settings.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        if self.postgres.url.trim().is_empty() {
            return invalid("postgres.url is empty".into());
        }
        if self
            .postgres
            .slot_url
            .as_deref()
            .is_some_and(|url| url.trim().is_empty())
        {
            return invalid(
                "postgres.slot_url is empty: remove it (the slot is then on postgres.url's \
                 server) or name the standby"
                    .into(),
            );
        }
        if !(1..=shard::MAX_SHARDS).contains(&self.postgres.shards) {
            return invalid(format!(
                "postgres.shards = {}: use 1 (not sharded) to {}",
                self.postgres.shards,
                shard::MAX_SHARDS
            ));
        }
        if self.postgres.shard >= self.postgres.shards {
            return invalid(format!(
                "postgres.shard = {}: shards are numbered 0..{} (postgres.shards = {})",
                self.postgres.shard,
                self.postgres.shards - 1,
                self.postgres.shards
            ));
        }
        let last = self.postgres.shards - 1;
        for (key, name) in [
            ("postgres.slot", &self.postgres.slot),
            ("postgres.publication", &self.postgres.publication),
        ] {
            let longest = shard::shard_name(name, self.postgres.shards, last);
            if !is_plain_identifier(name) || !is_plain_identifier(&longest) {
                return invalid(format!(
                    "{key} = {name:?}: use lowercase letters, digits and underscores (at most 63, \
                     including a shard suffix such as \"_shard{last}\")"
                ));
            }
        }
        self.validate_outboxes()?;
        if self.kafka.brokers.trim().is_empty() {
            return invalid("kafka.brokers is empty".into());
        }
        self.validate_delivery()?;
        if self.relay.max_in_flight_events == 0 || self.relay.max_in_flight_bytes == 0 {
            return invalid(
                "relay.max_in_flight_events and max_in_flight_bytes must be > 0".into(),
            );
        }
        if self.relay.max_attempts == 0 {
            return invalid("relay.max_attempts must be at least 1".into());
        }
        if !(MIN_POISON_COPY_LIMIT..=MAX_POISON_COPY_LIMIT)
            .contains(&self.relay.poison_copy_limit_bytes)
        {
            return invalid(format!(
                "relay.poison_copy_limit_bytes must be {MIN_POISON_COPY_LIMIT}..={MAX_POISON_COPY_LIMIT}"
            ));
        }
        if self.relay.read_pause_ms > MAX_READ_PAUSE_MS {
            return invalid(format!(
                "relay.read_pause_ms = {} is more than {MAX_READ_PAUSE_MS}: a pause delays every event read after it and every status update",
                self.relay.read_pause_ms
            ));
        }
        let listen = self.metrics.listen.trim();
        if !listen.is_empty()
            && listen
                .rsplit_once(':')
                .is_none_or(|(_, port)| port.parse::<u16>().is_err())
        {
            return invalid(format!(
                "metrics.listen = {listen:?}: use host:port, e.g. \"127.0.0.1:9187\" (or \"\" for off)"
            ));
        }
        if !(0.0..=1.0).contains(&self.traces.sample_ratio) {
            return invalid(format!(
                "traces.sample_ratio must be between 0.0 and 1.0, not {}",
                self.traces.sample_ratio
            ));
        }
        if self.metrics.ready_stall_secs == 0 {
            return invalid("metrics.ready_stall_secs must be at least 1".into());
        }
        self.retention.period()?;
        if self.retention.interval()?.is_zero() {
            return invalid("retention.interval must be more than 0s".into());
        }
        if self.retention.batch_size == 0 || self.retention.batch_size > 1_000_000 {
            return invalid("retention.batch_size must be 1..=1000000".into());
        }
        Ok(())
    }

    /// `additional_placement`: the envelope exists for envelope fields, and no placed
    /// name repeats another, an envelope key, or a header CloudEvents writes.
    fn validate_placements(&self, outbox: &OutboxConfig) -> Result<(), ConfigError> {
        let placements = outbox.placements()?;
        for (i, placement) in placements.iter().enumerate() {
            let name = placement.name.as_str();
            let clash = match placement.target {
                PlacementTarget::Envelope if self.kafka.envelope.is_none() => {
                    Some("[kafka.envelope] is not set")
                }
                PlacementTarget::Envelope if ENVELOPE_KEYS.contains(&name) => {
                    Some("the envelope has that key already")
                }
                PlacementTarget::Header
                    if self.kafka.cloudevents.is_some() && is_cloudevents_header(name) =>
                {
                    Some("[kafka.cloudevents] writes that header")
                }
                _ if placements[..i]
                    .iter()
                    .any(|p| p.target == placement.target && p.name == placement.name) =>
                {
                    Some("another entry places a value under that name")
                }
                _ => None,
            };
            if let Some(why) = clash {
                return Err(ConfigError::Invalid(format!(
                    "outbox.additional_placement places {:?} as {name:?}: {why}",
                    placement.column
                )));
            }
        }
        Ok(())
    }

    /// Each outbox's names and columns; with several, that their tables differ and
    /// what they cannot be combined with yet.
    fn validate_outboxes(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        let mut tables: Vec<(String, String)> = Vec::new();
        for outbox in self.outboxes() {
            let table = qualified_name(&outbox.table)
                .map_err(|m| ConfigError::Invalid(format!("outbox.table: {m}")))?;
            let poison = qualified_name(&outbox.poison_table)
                .map_err(|m| ConfigError::Invalid(format!("outbox.poison_table: {m}")))?;
            if outbox.partitions_ahead > 1000 {
                return invalid("outbox.partitions_ahead must be at most 1000".into());
            }
            outbox.columns.validate()?;
            self.validate_placements(outbox)?;
            if !self.has_several_outboxes() {
                break;
            }
            for name in [table, poison] {
                if tables.contains(&name) {
                    return invalid(format!(
                        "table {}.{} is named twice in [[outbox]]: each outbox needs its own \
                         table and poison table",
                        name.0, name.1
                    ));
                }
                tables.push(name);
            }
        }
        if self.has_several_outboxes() {
            if self.postgres.shards > 1 {
                return invalid(
                    "postgres.shards > 1 with several [[outbox]] entries: shard one outbox \
                     per relay"
                        .into(),
                );
            }
            if self.relay.on_poison == PoisonKeyMode::ParkKey {
                return invalid(
                    "relay.on_poison = \"park-key\" with several [[outbox]] entries: parked \
                     keys are kept per outbox schema; run one relay per outbox to park keys"
                        .into(),
                );
            }
        }
        Ok(())
    }
}

impl Config {
    /// `kafka.delivery` and its transaction settings.
    fn validate_delivery(&self) -> Result<(), ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        let kafka = &self.kafka;
        if let Some(ce) = &kafka.cloudevents {
            if ce.source.trim().is_empty() {
                return invalid(
                    "kafka.cloudevents.source is empty: a CloudEvent needs a source (a \
                     URI-reference naming the producer, e.g. \"/services/orders\")"
                        .into(),
                );
            }
            if kafka.envelope.is_some() {
                return invalid(
                    "[kafka.envelope] and [kafka.cloudevents] are both set: choose one form \
                     of record"
                        .into(),
                );
            }
        }
        if kafka.transaction_max_events == 0 {
            return invalid("kafka.transaction_max_events must be at least 1".into());
        }
        if !(1..=60_000).contains(&kafka.transaction_interval_ms) {
            return invalid(format!(
                "kafka.transaction_interval_ms = {}: use 1..=60000 (the longest an event waits \
                 for its Kafka transaction to commit)",
                kafka.transaction_interval_ms
            ));
        }
        // The coordinator's clock starts at the transaction's first record, the
        // interval's at its first ack: a second between them keeps an interval's
        // commit from reaching the coordinator after it timed the transaction out.
        if !(1_000..=60_000).contains(&kafka.transaction_timeout_ms)
            || kafka.transaction_timeout_ms < kafka.transaction_interval_ms.saturating_add(1_000)
        {
            return invalid(format!(
                "kafka.transaction_timeout_ms = {}: use 1000..=60000, at least a second above \
                 kafka.transaction_interval_ms ({}), and at most the cluster's \
                 transaction.max.timeout.ms",
                kafka.transaction_timeout_ms, kafka.transaction_interval_ms
            ));
        }
        if kafka.delivery == DeliveryMode::ExactlyOnce && !is_topic_name(&kafka.progress_topic) {
            return invalid(format!(
                "kafka.progress_topic = {:?}: a topic name is 1-249 letters, digits, '.', '_' or '-'",
                kafka.progress_topic
            ));
        }
        if let Some(factor) = kafka.progress_topic_replication_factor
            && factor < 1
        {
            return invalid(format!(
                "kafka.progress_topic_replication_factor = {factor}: use 1 or more, or leave it \
                 out for the cluster's default.replication.factor"
            ));
        }
        Ok(())
    }
}

/// Kafka's topic name rule (`[a-zA-Z0-9._-]{1,249}`, not `.` or `..`).
fn is_topic_name(name: &str) -> bool {
    (1..=249).contains(&name.len())
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Takes the entries after the first out of an `[[outbox]]` array, leaving the
/// first as `outbox`; a single `[outbox]` section gives none.
fn split_outboxes(doc: &mut toml::Table) -> Result<Vec<toml::Table>, ConfigError> {
    let Some(toml::Value::Array(entries)) = doc.get("outbox") else {
        return Ok(Vec::new());
    };
    let mut tables = entries
        .iter()
        .map(|entry| {
            entry.as_table().cloned().ok_or_else(|| {
                ConfigError::Invalid("outbox: use [outbox] or [[outbox]] sections".into())
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    if tables.is_empty() {
        return Err(ConfigError::Invalid(
            "outbox: an empty list; name at least one [[outbox]]".into(),
        ));
    }
    let first = tables.remove(0);
    doc.insert("outbox".into(), toml::Value::Table(first));
    Ok(tables)
}

/// Fills the `[outbox.columns]` keys that no source set from `outbox.preset`.
/// Done on the document, before defaults, so "set" means set by the file, the
/// environment or `--set`, even to the default name.
fn apply_preset(outbox: &mut toml::Table) -> Result<(), ConfigError> {
    let preset = match outbox.get("preset") {
        None => return Ok(()),
        Some(value) => OutboxPreset::deserialize(value.clone()).map_err(|e| {
            ConfigError::Invalid(format!("outbox.preset: {e} (use \"none\" or \"debezium\")"))
        })?,
    };
    let columns = outbox
        .entry("columns")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()))
        .as_table_mut()
        .ok_or_else(|| ConfigError::Invalid("outbox.columns is not a section".into()))?;
    for (key, name) in preset.columns() {
        columns
            .entry((*key).to_owned())
            .or_insert_with(|| toml::Value::String((*name).to_owned()));
    }
    Ok(())
}

/// The origin (for messages) and text of the config file: the named one, which must
/// exist, else [`DEFAULT_CONFIG_FILE`] if present, else none (empty text).
fn read_file(path: Option<&Path>) -> Result<(String, String), ConfigError> {
    let (path, named) = match path {
        Some(path) => (path, true),
        None => (Path::new(DEFAULT_CONFIG_FILE), false),
    };
    match std::fs::read_to_string(path) {
        Ok(text) => Ok((format!("config file {}", path.display()), text)),
        Err(e) if !named && e.kind() == std::io::ErrorKind::NotFound => Ok((
            format!("no config file ({DEFAULT_CONFIG_FILE} absent): environment and --set only"),
            String::new(),
        )),
        Err(source) => Err(ConfigError::Read {
            path: path.display().to_string(),
            source,
        }),
    }
}

/// Names a required key that no source gave, with the variable that would set it
/// (serde would only say "missing field `url`").
fn require_keys(doc: &toml::Table, origin: &str) -> Result<(), ConfigError> {
    for (key, env_name) in REQUIRED {
        let (section, name) = key.split_once('.').unwrap_or((key, ""));
        let present = doc
            .get(section)
            .and_then(toml::Value::as_table)
            .is_some_and(|table| table.contains_key(name));
        if !present {
            return Err(ConfigError::Missing {
                key,
                env_name,
                origin: origin.to_owned(),
            });
        }
    }
    Ok(())
}

/// Applies one `OUTBOX_RELAY__SECTION__KEY=value` variable to the TOML document.
/// Values are read as TOML scalars when they parse as such (`5`, `true`), else as
/// strings, so `OUTBOX_RELAY__RELAY__MAX_ATTEMPTS=7` sets an integer.
fn overlay_env(
    doc: &mut toml::Table,
    name: &str,
    path: &str,
    value: &str,
) -> Result<(), ConfigError> {
    let env_err = |message: &str| ConfigError::Env {
        name: name.to_owned(),
        message: message.to_owned(),
    };
    let mut keys: Vec<String> = path.split("__").map(str::to_ascii_lowercase).collect();
    // librdkafka settings keep their own spelling and are always strings.
    let producer = keys.len() >= 3 && keys[0] == "kafka" && keys[1] == "producer";
    if producer {
        let key = path.splitn(3, "__").nth(2).unwrap_or_default().to_owned();
        keys = vec!["kafka".into(), "producer".into(), key];
    }
    if keys.iter().any(String::is_empty) {
        return Err(env_err("empty key segment"));
    }
    let Some((last, sections)) = keys.split_last() else {
        return Err(env_err("no key"));
    };
    let mut table = doc;
    for section in sections {
        let entry = table
            .entry(section.clone())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if entry.is_array() {
            return Err(env_err(&format!(
                "{section} has several [[{section}]] entries: set their keys in the file"
            )));
        }
        table = entry
            .as_table_mut()
            .ok_or_else(|| env_err(&format!("{section} is not a section")))?;
    }
    let value = if producer {
        toml::Value::String(value.to_owned())
    } else {
        scalar(value)
    };
    table.insert(last.clone(), value);
    Ok(())
}

/// `section.key=value` as the equivalent environment variable. Keys under
/// `kafka.producer.` are librdkafka names and keep their dots
/// (`kafka.producer.linger.ms=5`).
fn cli_override(set: &str) -> Result<(String, String), ConfigError> {
    // Name the key only: the value may be a URL with a password.
    let key = set.split_once('=').map_or(set, |(key, _)| key);
    let invalid = || {
        ConfigError::Invalid(format!(
            "--set {:?}: expected section.key=value",
            redact_url(key)
        ))
    };
    let (path, value) = set.split_once('=').ok_or_else(invalid)?;
    let path = path.trim();
    if let Some(key) = path.strip_prefix("kafka.producer.") {
        if key.is_empty() {
            return Err(invalid());
        }
        // Producer values are strings; quote so a number stays a string.
        return Ok((
            format!("{ENV_PREFIX}KAFKA__PRODUCER__{key}"),
            value.to_owned(),
        ));
    }
    let segments: Vec<&str> = path.split('.').collect();
    if segments.len() < 2 || segments.iter().any(|s| s.is_empty()) {
        return Err(invalid());
    }
    Ok((
        format!("{ENV_PREFIX}{}", segments.join("__")),
        value.to_owned(),
    ))
}

fn scalar(value: &str) -> toml::Value {
    if let Ok(i) = value.parse::<i64>() {
        return toml::Value::Integer(i);
    }
    match value {
        "true" => toml::Value::Boolean(true),
        "false" => toml::Value::Boolean(false),
        _ => toml::Value::String(value.to_owned()),
    }
}

/// Lowercase SQL identifier that needs no quoting (slots allow only these).
#[must_use]
pub fn is_plain_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !s.as_bytes()[0].is_ascii_digit()
}

/// A configured table name that is not `schema.table` (or `table`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name:?} is not a table name like schema.table")]
pub struct TableNameError {
    /// The name as configured.
    pub name: String,
}

/// Whether two table names (`schema.table`, or `table` in `public`) name one table.
#[must_use]
pub fn same_table(a: &str, b: &str) -> bool {
    match (qualified_name(a), qualified_name(b)) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// Splits `schema.table` (or `table`, meaning `public`) into its parts.
pub fn qualified_name(s: &str) -> Result<(String, String), TableNameError> {
    let (schema, table) = match s.split_once('.') {
        Some((schema, table)) => (schema, table),
        None => ("public", s),
    };
    if schema.is_empty() || table.is_empty() || table.contains('.') || s.contains('"') {
        return Err(TableNameError { name: s.to_owned() });
    }
    Ok((schema.to_owned(), table.to_owned()))
}

/// A config for unit tests: the two required keys, then `extra` TOML.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) fn test_config(extra: &str) -> Config {
    Config::from_sources(
        "t",
        &format!("[postgres]\nurl = \"postgresql://h/db\"\n[kafka]\nbrokers = \"b\"\n{extra}"),
        Vec::new(),
    )
    .unwrap()
}

/// Quotes an SQL identifier (`"` doubled), for names that come from config.
#[must_use]
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// `"schema"."table"` for a configured table name (already validated).
#[must_use]
pub fn quote_qualified(s: &str) -> String {
    match qualified_name(s) {
        Ok((schema, table)) => format!("{}.{}", quote_ident(&schema), quote_ident(&table)),
        Err(_) => quote_ident(s),
    }
}

fn serialize_redacted<S: serde::Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redact_url(url))
}

fn serialize_redacted_option<S: serde::Serializer>(
    url: &Option<String>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match url {
        Some(url) => s.serialize_some(&redact_url(url)),
        None => s.serialize_none(),
    }
}

impl fmt::Debug for PostgresConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresConfig")
            .field("url", &redact_url(&self.url))
            .field("slot_url", &self.slot_url.as_deref().map(redact_url))
            .field("slot", &self.slot)
            .field("publication", &self.publication)
            .field("shards", &self.shards)
            .field("shard", &self.shard)
            .field("binary_decoding", &self.binary_decoding)
            .finish()
    }
}

/// librdkafka settings with the values of secret ones replaced by `***`.
fn redacted_settings(settings: &BTreeMap<String, String>) -> BTreeMap<&str, &str> {
    settings
        .iter()
        .map(|(k, v)| {
            let shown = if is_secret_setting(k) { "***" } else { v };
            (k.as_str(), shown)
        })
        .collect()
}

fn serialize_settings_redacted<S: serde::Serializer>(
    settings: &BTreeMap<String, String>,
    s: S,
) -> Result<S::Ok, S::Error> {
    serde::Serialize::serialize(&redacted_settings(settings), s)
}

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let producer = redacted_settings(&self.producer);
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("topic_template", &self.topic_template)
            .field("partitioner", &self.partitioner)
            .field("producer", &producer)
            .field("envelope", &self.envelope)
            .field("cloudevents", &self.cloudevents)
            .field("delivery", &self.delivery)
            .field("transaction_max_events", &self.transaction_max_events)
            .field("transaction_interval_ms", &self.transaction_interval_ms)
            .field("transaction_timeout_ms", &self.transaction_timeout_ms)
            .field("progress_topic", &self.progress_topic)
            .field(
                "progress_topic_replication_factor",
                &self.progress_topic_replication_factor,
            )
            .finish()
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("postgres", &self.postgres)
            .field("outbox", &self.outbox)
            .field("more_outboxes", &self.more_outboxes)
            .field("kafka", &self.kafka)
            .field("relay", &self.relay)
            .field("log", &self.log)
            .field("metrics", &self.metrics)
            .field("retention", &self.retention)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_name_their_slots_and_publications_and_are_checked() {
        let base = "[postgres]\nurl = \"postgresql://u@h/db\"\n[kafka]\nbrokers = \"k:9092\"\n";
        let load = |extra: &str| {
            let text = base.replace("[kafka]", &format!("{extra}\n[kafka]"));
            Config::from_sources("t", &text, Vec::new())
        };
        let one = load("").unwrap();
        assert_eq!(one.postgres.slot_name(), "outbox_relay");
        assert_eq!(one.postgres.publication_name(), "outbox_relay_pub");
        assert_eq!(one.postgres.all_slot_names(), ["outbox_relay"]);
        let third = load("shards = 4\nshard = 2").unwrap();
        assert_eq!(third.postgres.slot_name(), "outbox_relay_shard2");
        assert_eq!(third.postgres.publication_name(), "outbox_relay_pub_shard2");
        assert_eq!(third.postgres.all_slot_names().len(), 4);
        for bad in ["shards = 0", "shards = 65", "shards = 4\nshard = 4"] {
            let err = load(bad).unwrap_err().to_string();
            assert!(err.contains("postgres.shard"), "{bad}: {err}");
        }
        // A base name that fits alone but not with its shard suffix.
        let long = "s".repeat(60);
        let err = load(&format!("slot = \"{long}\"\nshards = 2")).unwrap_err();
        assert!(err.to_string().contains("_shard1"), "{err}");
    }

    const MINIMAL: &str = r#"
        [postgres]
        url = "postgresql://relay:s3cret@db:5432/app"
        [kafka]
        brokers = "k:9092"
    "#;

    fn load(text: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
        Config::from_sources(
            "test.toml",
            text,
            env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
        )
    }

    #[test]
    fn read_pause_is_bounded() {
        let with = |ms: u64| load(&format!("{MINIMAL}\n[relay]\nread_pause_ms = {ms}\n"), &[]);
        assert_eq!(
            load(MINIMAL, &[]).unwrap().relay.read_pause_ms,
            DEFAULT_READ_PAUSE_MS
        );
        assert_eq!(with(0).unwrap().relay.read_pause_ms, 0);
        assert_eq!(
            with(MAX_READ_PAUSE_MS).unwrap().relay.read_pause_ms,
            MAX_READ_PAUSE_MS
        );
        let err = with(MAX_READ_PAUSE_MS + 1).unwrap_err().to_string();
        assert!(err.contains("relay.read_pause_ms"), "{err}");
    }

    #[test]
    fn minimal_config_gets_defaults() {
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.postgres.slot, "outbox_relay");
        assert_eq!(c.outbox.table, "public.outbox");
        assert_eq!(c.kafka.partitioner, "murmur2_random");
        assert_eq!(c.relay.max_attempts, 5);
    }

    #[test]
    fn env_alone_gives_a_whole_config() {
        let c = load(
            "",
            &[
                (
                    "OUTBOX_RELAY__POSTGRES__URL",
                    "postgresql://relay:s3cret@db/app",
                ),
                ("OUTBOX_RELAY__KAFKA__BROKERS", "k:9092"),
                ("OUTBOX_RELAY__OUTBOX__COLUMNS__TOPIC", ""),
            ],
        )
        .unwrap();
        assert_eq!(c.kafka.brokers, "k:9092");
        assert_eq!(c.postgres.slot, "outbox_relay");
        assert_eq!(c.outbox.columns.topic, "");
    }

    #[test]
    fn a_missing_required_key_names_its_variable() {
        let err = load("", &[("OUTBOX_RELAY__KAFKA__BROKERS", "k:9092")]).unwrap_err();
        let shown = err.to_string();
        assert!(
            matches!(
                err,
                ConfigError::Missing {
                    key: "postgres.url",
                    ..
                }
            ),
            "{shown}"
        );
        assert!(shown.contains("OUTBOX_RELAY__POSTGRES__URL"), "{shown}");
        let err = load("[postgres]\nurl = \"postgresql://h/db\"\n", &[]).unwrap_err();
        assert!(
            err.to_string().contains("OUTBOX_RELAY__KAFKA__BROKERS"),
            "{err}"
        );
    }

    #[test]
    fn a_named_file_that_is_missing_is_an_error() {
        let missing = std::env::temp_dir().join("outbox-relay-no-such-dir/relay.toml");
        let err = read_file(Some(&missing)).unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }), "{err}");
        assert!(err.to_string().contains("no-such-dir"), "{err}");
    }

    #[test]
    fn several_outboxes_are_a_list_with_their_own_settings() {
        let text = format!(
            "{MINIMAL}\n[[outbox]]\ntable = \"billing.outbox\"\npoison_table = \"billing.poison\"\n\
             [[outbox]]\ntable = \"shipping.events\"\npreset = \"debezium\"\n\
             poison_table = \"shipping.poison\"\ntopic_template = \"ship.{{event_type}}\"\n"
        );
        let c = load(&text, &[]).unwrap();
        assert!(c.has_several_outboxes());
        let tables: Vec<&str> = c.outboxes().map(|o| o.table.as_str()).collect();
        assert_eq!(tables, ["billing.outbox", "shipping.events"]);
        // The preset applies to its own entry only.
        assert_eq!(c.outbox.columns.aggregate_id, "aggregate_id");
        assert_eq!(c.more_outboxes[0].columns.aggregate_id, "aggregateid");
        let views = c.per_outbox();
        assert_eq!(views[0].kafka.topic_template, c.kafka.topic_template);
        assert_eq!(views[1].kafka.topic_template, "ship.{event_type}");
        assert_eq!(views[1].outbox.table, "shipping.events");
        assert!(!views[1].has_several_outboxes());
        // The relay's own tables stay in the first outbox's schema.
        assert_eq!(views[1].relay_schema().unwrap(), "billing");
        assert!(views[0].is_first_outbox() && !views[1].is_first_outbox());

        // One [outbox] section is one outbox, as before.
        let one = load(
            &format!("{MINIMAL}\n[outbox]\ntable = \"app.events\"\n"),
            &[],
        )
        .unwrap();
        assert!(!one.has_several_outboxes());
        assert_eq!(one.per_outbox().len(), 1);
        assert!(one.is_first_outbox());

        let two = "[[outbox]]\ntable = \"a.t\"\npoison_table = \"a.p\"\n\
                   [[outbox]]\ntable = \"b.t\"\npoison_table = \"b.p\"\n";
        for (extra, env, expected) in [
            (
                "[[outbox]]\ntable = \"a.t\"\npoison_table = \"a.p\"\n\
                 [[outbox]]\ntable = \"a.t\"\npoison_table = \"b.p\"\n",
                None,
                "named twice",
            ),
            (
                "[[outbox]]\ntable = \"a.t\"\npoison_table = \"a.p\"\n\
                 [[outbox]]\ntable = \"b.t\"\npoison_table = \"a.p\"\n",
                None,
                "named twice",
            ),
            (
                two,
                Some(("OUTBOX_RELAY__POSTGRES__SHARDS", "2")),
                "postgres.shards",
            ),
            (
                two,
                Some(("OUTBOX_RELAY__RELAY__ON_POISON", "park-key")),
                "park-key",
            ),
            (
                "[[outbox]]\ntable = \"a.t\"\nbogus = 1\n[[outbox]]\ntable = \"b.t\"\n",
                None,
                "bogus",
            ),
        ] {
            let env: Vec<(&str, &str)> = env.into_iter().collect();
            let err = match load(&format!("{MINIMAL}\n{extra}"), &env) {
                Ok(_) => panic!("accepted: {extra}"),
                Err(e) => e.to_string(),
            };
            assert!(err.contains(expected), "{extra}: {err}");
        }
        // An environment variable cannot say which of several entries it sets.
        let err = load(&text, &[("OUTBOX_RELAY__OUTBOX__TABLE", "x.y")]).unwrap_err();
        assert!(
            err.to_string().contains("set their keys in the file"),
            "{err}"
        );
    }

    #[test]
    fn additional_placement_uses_debeziums_syntax() {
        let c = load(
            &format!(
                "{MINIMAL}\n[kafka.envelope]\nproducer = \"p\"\nschema_version = \"1\"\n\
                 [outbox]\nadditional_placement = [\"tenant:header\", \"v:header:schema_version\", \"r:envelope\"]\n"
            ),
            &[],
        )
        .unwrap();
        let placements = c.outbox.placements().unwrap();
        assert_eq!(
            placements,
            [
                Placement {
                    column: "tenant".into(),
                    target: PlacementTarget::Header,
                    name: "tenant".into()
                },
                Placement {
                    column: "v".into(),
                    target: PlacementTarget::Header,
                    name: "schema_version".into()
                },
                Placement {
                    column: "r".into(),
                    target: PlacementTarget::Envelope,
                    name: "r".into()
                },
            ]
        );
        for (entry, expected) in [
            ("\"x:partition\"", "partition placement is not supported"),
            ("\"x\"", "column:header[:name]"),
            ("\"x:header:a:b\"", "column:header[:name]"),
            ("\"x:envelope\"", "[kafka.envelope] is not set"),
            (
                "\"a:header:t\", \"b:header:t\"",
                "another entry places a value under that name",
            ),
        ] {
            let text = format!("{MINIMAL}\n[outbox]\nadditional_placement = [{entry}]\n");
            let err = load(&text, &[]).unwrap_err().to_string();
            assert!(err.contains(expected), "{entry}: {err}");
        }
        for (extra, expected) in [
            (
                "[kafka.envelope]\nproducer = \"p\"\nschema_version = \"1\"\n\
                 [outbox]\nadditional_placement = [\"v:envelope:schema_version\"]\n",
                "the envelope has that key already",
            ),
            (
                "[kafka.cloudevents]\nsource = \"/s\"\n\
                 [outbox]\nadditional_placement = [\"t:header:CE_type\"]\n",
                "[kafka.cloudevents] writes that header",
            ),
        ] {
            let err = load(&format!("{MINIMAL}\n{extra}"), &[])
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{extra}: {err}");
        }
    }

    #[test]
    fn the_debezium_preset_names_the_columns_unless_set() {
        let c = load(
            &format!("{MINIMAL}\n[outbox]\npreset = \"debezium\"\n"),
            &[],
        )
        .unwrap();
        let cols = &c.outbox.columns;
        assert_eq!(
            [
                &cols.id,
                &cols.aggregate_type,
                &cols.aggregate_id,
                &cols.event_type,
                &cols.payload
            ],
            ["id", "aggregatetype", "aggregateid", "type", "payload"]
        );
        for absent in [
            &cols.idempotency_key,
            &cols.topic,
            &cols.headers,
            &cols.created_at,
        ] {
            assert_eq!(absent, "");
        }
        // A key set anywhere wins over the preset, also when set to the default name.
        let c = load(
            &format!(
                "{MINIMAL}\n[outbox]\npreset = \"debezium\"\n[outbox.columns]\npayload = \"body\"\n"
            ),
            &[("OUTBOX_RELAY__OUTBOX__COLUMNS__CREATED_AT", "created_at")],
        )
        .unwrap();
        assert_eq!(c.outbox.columns.payload, "body");
        assert_eq!(c.outbox.columns.created_at, "created_at");
        assert_eq!(c.outbox.columns.aggregate_id, "aggregateid");
        let by_env = load(MINIMAL, &[("OUTBOX_RELAY__OUTBOX__PRESET", "debezium")]).unwrap();
        assert_eq!(by_env.outbox.preset, OutboxPreset::Debezium);
        assert_eq!(by_env.outbox.columns.event_type, "type");
        let err = load(MINIMAL, &[("OUTBOX_RELAY__OUTBOX__PRESET", "maxwell")]).unwrap_err();
        assert!(err.to_string().contains("outbox.preset"), "{err}");
    }

    #[test]
    fn only_optional_columns_may_be_absent() {
        for (key, ok) in [
            ("TOPIC", true),
            ("HEADERS", true),
            ("CREATED_AT", true),
            ("IDEMPOTENCY_KEY", true),
            ("PAYLOAD", false),
            ("AGGREGATE_ID", false),
        ] {
            let name = format!("OUTBOX_RELAY__OUTBOX__COLUMNS__{key}");
            assert_eq!(load(MINIMAL, &[(name.as_str(), "")]).is_ok(), ok, "{key}");
        }
        let both = [
            ("OUTBOX_RELAY__OUTBOX__COLUMNS__ID", ""),
            ("OUTBOX_RELAY__OUTBOX__COLUMNS__IDEMPOTENCY_KEY", ""),
        ];
        assert!(load(MINIMAL, &both).is_err());
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let err = load(&format!("{MINIMAL}\n[relay]\nmax_atempts = 3\n"), &[]).unwrap_err();
        assert!(err.to_string().contains("max_atempts"), "{err}");
    }

    #[test]
    fn env_overrides_file() {
        let c = load(
            MINIMAL,
            &[
                ("OUTBOX_RELAY__RELAY__MAX_ATTEMPTS", "7"),
                ("OUTBOX_RELAY__POSTGRES__SLOT", "other_slot"),
                ("OUTBOX_RELAY__KAFKA__PRODUCER__LINGER", "5"),
                ("UNRELATED", "x"),
            ],
        );
        // librdkafka settings stay strings, whatever they look like.
        assert_eq!(c.unwrap().kafka.producer["LINGER"], "5");
        let c = load(
            MINIMAL,
            &[
                ("OUTBOX_RELAY__RELAY__MAX_ATTEMPTS", "7"),
                ("OUTBOX_RELAY__POSTGRES__SLOT", "other_slot"),
            ],
        )
        .unwrap();
        assert_eq!(c.relay.max_attempts, 7);
        assert_eq!(c.postgres.slot, "other_slot");
    }

    #[test]
    fn cli_overrides_map_to_config_keys() {
        assert_eq!(
            cli_override("relay.max_attempts=7").unwrap(),
            ("OUTBOX_RELAY__relay__max_attempts".into(), "7".into())
        );
        assert_eq!(
            cli_override("kafka.producer.linger.ms=5").unwrap(),
            (
                "OUTBOX_RELAY__KAFKA__PRODUCER__linger.ms".into(),
                "5".into()
            )
        );
        for bad in ["relay", "relay.max_attempts", ".x=1", "kafka.producer.=1"] {
            assert!(cli_override(bad).is_err(), "{bad}");
        }
        let (name, value) = cli_override("kafka.producer.linger.ms=5").unwrap();
        let c = load(MINIMAL, &[(name.as_str(), value.as_str())]).unwrap();
        assert_eq!(c.kafka.producer["linger.ms"], "5");
    }

    #[test]
    fn env_with_unknown_key_is_rejected() {
        assert!(load(MINIMAL, &[("OUTBOX_RELAY__RELAY__NOPE", "1")]).is_err());
    }

    #[test]
    fn invalid_values_are_rejected() {
        assert!(load(MINIMAL, &[("OUTBOX_RELAY__POSTGRES__SLOT", "Bad-Slot")]).is_err());
        assert!(load(MINIMAL, &[("OUTBOX_RELAY__RELAY__MAX_ATTEMPTS", "0")]).is_err());
        for bad in ["1023", "134217729"] {
            let var = ("OUTBOX_RELAY__RELAY__POISON_COPY_LIMIT_BYTES", bad);
            assert!(load(MINIMAL, &[var]).is_err(), "{bad}");
        }
        assert!(load(MINIMAL, &[("OUTBOX_RELAY__OUTBOX__TABLE", "a.b.c")]).is_err());
        assert!(load("not toml [", &[]).is_err());
        for bad in ["9187", "localhost", "127.0.0.1:http", ":99999"] {
            assert!(
                load(MINIMAL, &[("OUTBOX_RELAY__METRICS__LISTEN", bad)]).is_err(),
                "{bad}"
            );
        }
        let ok = load(MINIMAL, &[("OUTBOX_RELAY__METRICS__LISTEN", "[::1]:0")]).unwrap();
        assert_eq!(ok.metrics.listen, "[::1]:0");
        // Exactly-once's timeouts: in range, and a second above the commit interval.
        for (timeout, interval) in [("999", "100"), ("60001", "100"), ("5000", "4500")] {
            let vars = [
                ("OUTBOX_RELAY__KAFKA__TRANSACTION_TIMEOUT_MS", timeout),
                ("OUTBOX_RELAY__KAFKA__TRANSACTION_INTERVAL_MS", interval),
            ];
            assert!(load(MINIMAL, &vars).is_err(), "{timeout} / {interval}");
        }
        let vars = [
            ("OUTBOX_RELAY__KAFKA__TRANSACTION_TIMEOUT_MS", "5000"),
            ("OUTBOX_RELAY__KAFKA__TRANSACTION_INTERVAL_MS", "4000"),
        ];
        assert_eq!(
            load(MINIMAL, &vars).unwrap().kafka.transaction_timeout_ms,
            5000
        );
        let zero_replicas = (
            "OUTBOX_RELAY__KAFKA__PROGRESS_TOPIC_REPLICATION_FACTOR",
            "0",
        );
        assert!(load(MINIMAL, &[zero_replicas]).is_err());
    }

    #[test]
    fn debug_redacts_password() {
        let c = load(MINIMAL, &[]).unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
        let serialized = toml::to_string(&c).unwrap();
        assert!(!serialized.contains("s3cret"), "{serialized}");
        assert!(shown.contains("relay:***@db"), "{shown}");
    }

    #[test]
    fn kafka_secrets_are_masked_in_debug_and_serialized_form() {
        let secrets = [
            ("OUTBOX_RELAY__KAFKA__PRODUCER__sasl.password", "Kx7Sasl"),
            ("OUTBOX_RELAY__KAFKA__PRODUCER__ssl.key.password", "Kx7Key"),
            ("OUTBOX_RELAY__KAFKA__PRODUCER__ssl.key.pem", "Kx7Pem"),
            (
                "OUTBOX_RELAY__KAFKA__PRODUCER__sasl.oauthbearer.client.secret",
                "Kx7Oidc",
            ),
        ];
        let mut env = secrets.to_vec();
        env.push(("OUTBOX_RELAY__KAFKA__PRODUCER__sasl.username", "relay-user"));
        let c = load(MINIMAL, &env).unwrap();
        assert_eq!(c.kafka.producer["sasl.password"], "Kx7Sasl", "set from env");
        let shown = format!("{c:?}\n{}", toml::to_string(&c).unwrap());
        for (_, secret) in secrets {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("relay-user"), "{shown}");
        assert!(shown.contains("sasl.password"), "{shown}");
    }

    #[test]
    fn debug_redacts_a_password_that_breaks_the_url() {
        let c = load(
            MINIMAL,
            &[(
                "OUTBOX_RELAY__POSTGRES__URL",
                "postgresql://relay:Kx7/Qz9?Wv@db/app",
            )],
        )
        .unwrap();
        let shown = format!("{c:?}{}", toml::to_string(&c).unwrap());
        for part in ["Kx7", "Qz9", "Wv@"] {
            assert!(!shown.contains(part), "{part} in {shown}");
        }
    }

    #[test]
    fn errors_about_the_file_or_a_set_never_show_a_password() {
        // An invalid escape: the TOML error quotes the line with the URL.
        let text =
            "[postgres]\nurl = \"postgresql://relay:Kx7\\Qz9@db/app\"\n[kafka]\nbrokers = \"k\"\n";
        let err = load(text, &[]).unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
        assert!(!err.contains("Kx7") && !err.contains("Qz9"), "{err}");
        for set in [
            "postgres_url=postgresql://relay:Kx7/Qz9@db/app",
            "postgres.url:postgresql://relay:Kx7/Qz9@db/app",
            "postgres.url postgresql://relay:Kx7/Qz9@db/app",
        ] {
            let err = cli_override(set).unwrap_err().to_string();
            assert!(!err.contains("Kx7") && !err.contains("Qz9"), "{err}");
        }
    }

    #[test]
    fn example_config_is_valid_and_complete() {
        let text = include_str!("../../config/relay.example.toml");
        let c = load(text, &[]).unwrap();
        assert_eq!(c.relay.max_attempts, RelayConfig::default().max_attempts);
        // Every key the config has is documented in the example: the example is
        // the configuration reference.
        let example: toml::Table = toml::from_str(text).unwrap();
        let ours = toml::Table::try_from(load(MINIMAL, &[]).unwrap()).unwrap();
        let mut missing = Vec::new();
        undocumented(&ours, &example, "", &mut missing);
        assert!(
            missing.is_empty(),
            "keys missing from config/relay.example.toml: {missing:?}"
        );
    }

    fn undocumented(ours: &toml::Table, example: &toml::Table, path: &str, out: &mut Vec<String>) {
        for (key, value) in ours {
            let here = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            // Free-form librdkafka settings: the example shows a few, not all.
            if here == "kafka.producer" {
                continue;
            }
            match (value, example.get(key)) {
                (_, None) => out.push(here),
                (toml::Value::Table(a), Some(toml::Value::Table(b))) => {
                    undocumented(a, b, &here, out);
                }
                _ => {}
            }
        }
    }

    #[test]
    fn retention_keys_are_validated() {
        let c = load(MINIMAL, &[]).unwrap();
        assert_eq!(c.retention.period().unwrap().as_secs(), 7 * 86_400);
        assert_eq!(c.retention.interval().unwrap().as_secs(), 60);
        assert!(!c.outbox.partitioned);
        assert_eq!(c.outbox.partition_interval.sql_unit(), "day");
        for (name, value) in [
            ("OUTBOX_RELAY__RETENTION__PERIOD", "seven days"),
            ("OUTBOX_RELAY__RETENTION__INTERVAL", "0s"),
            ("OUTBOX_RELAY__RETENTION__BATCH_SIZE", "0"),
            ("OUTBOX_RELAY__OUTBOX__PARTITION_INTERVAL", "fortnight"),
        ] {
            assert!(load(MINIMAL, &[(name, value)]).is_err(), "{name}={value}");
        }
        let c = load(
            MINIMAL,
            &[
                ("OUTBOX_RELAY__RETENTION__PERIOD", "36h"),
                ("OUTBOX_RELAY__OUTBOX__PARTITIONED", "true"),
                ("OUTBOX_RELAY__OUTBOX__PARTITION_INTERVAL", "hour"),
            ],
        )
        .unwrap();
        assert_eq!(c.retention.period().unwrap().as_secs(), 36 * 3600);
        assert!(c.outbox.partitioned);
    }

    #[test]
    fn cutover_is_auto_unless_turned_off() {
        assert_eq!(load(MINIMAL, &[]).unwrap().relay.cutover, CutoverMode::Auto);
        let off = load(&format!("{MINIMAL}\n[relay]\ncutover = \"off\"\n"), &[]).unwrap();
        assert_eq!(off.relay.cutover, CutoverMode::Off);
        let env = [("OUTBOX_RELAY__RELAY__CUTOVER", "off")];
        assert_eq!(load(MINIMAL, &env).unwrap().relay.cutover, CutoverMode::Off);
        assert!(
            load(
                &format!("{MINIMAL}\n[relay]\ncutover = \"sometimes\"\n"),
                &[]
            )
            .is_err()
        );
    }

    #[test]
    fn qualified_names() {
        assert_eq!(
            qualified_name("outbox").unwrap(),
            ("public".into(), "outbox".into())
        );
        assert_eq!(quote_qualified("app.Outbox"), "\"app\".\"Outbox\"");
        assert!(qualified_name("").is_err());
    }
}
