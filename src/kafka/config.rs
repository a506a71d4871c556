//! The producer's configuration: the settings every relay producer carries, which
//! `kafka.producer` pass-through settings are refused, and why.
//!
//! [`producer_config`] is the one place that builds a producer configuration: the CDC
//! relay, the poller, a cutover, `replay` and the bench all start from it, so a record
//! is produced with the same guarantees whichever command sends it. Refusals are
//! [`BrokerError`]s of the configuration kind (exit code 2), raised before anything
//! connects.
//!
//! # Why these producer settings
//!
//! * **`enable.idempotence=true`, `acks=all`, `max.in.flight.requests.per.connection=5`.**
//!   `acks=all` is what "acked" means in promise 1: the record is on every in-sync
//!   replica. The idempotent producer gives every record a per-partition sequence number,
//!   so when librdkafka retries a batch after a timeout or a leader change the broker
//!   drops the duplicate and rejects anything out of sequence; with at most 5 requests in
//!   flight per connection (the limit for which brokers track sequences) a retry can
//!   never overtake a later batch. Together they keep per-partition — hence per-key —
//!   order across retries (promise 3) without the throughput cost of 1 in-flight request.
//!   Pass-through settings that would silently break this are rejected, not ignored.
//! * **`message.timeout.ms=0` (infinite).** A broker outage must never fail an event: the
//!   relay's window fills, it stops reading the WAL, and the slot holds the position
//!   until the broker is back (transient, retried forever: `docs/architecture.md#error-classes`). A finite local
//!   timeout would add nothing but risk: timed-out records come back as failures that
//!   the relay re-produces *after* later records of the same key that were still queued,
//!   which reorders them. So finite timeouts are rejected. What still fails fast, because
//!   librdkafka does not retry it: a record larger than `message.max.bytes` (rejected by
//!   `send` itself), broker-side record rejections (`MessageSizeTooLarge`,
//!   `InvalidRecord`, policy violations), an unauthorised topic, and a topic that does
//!   not exist (after `topic.metadata.propagation.max.ms`, 30 s by default;
//!   `allow.auto.create.topics` defaults to false here so a misspelt topic template
//!   fails instead of creating a topic with broker defaults).
//! * **`partitioner=murmur2_random`** (configurable as `kafka.partitioner`). librdkafka's
//!   own default is `consistent_random` (CRC32), which places keys on *different*
//!   partitions than the Java client; `murmur2_random` is the Java default partitioner,
//!   so a Java/Kotlin producer or a Kafka Streams join keyed by the same entity id agrees
//!   with us. Keys are always present (the entity id); `murmur2_random` hashes an empty
//!   key like Java does and only sends *null* keys to a random partition.
//! * **`queue.buffering.max.messages` / `.kbytes` well above the relay's window.** The
//!   relay bounds what is in flight (events and bytes); librdkafka's queue must never be
//!   the tighter bound, or back-pressure would surface as `QueueFull` errors instead of
//!   as a full window. `QueueFull` is still classified (transient) in case it happens.
//! * **`linger.ms=5`**: a few milliseconds of batching costs little latency and saves a
//!   produce request per event under load. Measured (`docs/benchmarks.md`, "Where the
//!   time goes"): 0 ms lowers the ack median at 1,000 events/s by about 4 ms but raises
//!   it at 5,000, and 1 ms halves the backlog drain rate, so 5 stays.
//! * **`statistics.interval.ms=1000`**: once a second librdkafka reports how many
//!   produce requests it sent and how many records they carried; the relay exports
//!   both (`outbox_relay_kafka_produce_requests_total`,
//!   `outbox_relay_kafka_records_transmitted_total`), because records per request is
//!   what the broker's cost per event follows. Building the report costs a few
//!   kilobytes of JSON a second. `kafka.producer` may change the interval (0 turns the
//!   counters off).

use std::time::Duration;

use rdkafka::ClientConfig;

use crate::config::{KafkaConfig, RelayConfig};

use super::error::BrokerError;

/// `client.id` of the relay's producer (visible in broker logs and quotas).
pub(crate) const CLIENT_ID: &str = "outbox-relay";

/// Default `linger.ms`.
pub(crate) const DEFAULT_LINGER_MS: u32 = 5;

/// `statistics.interval.ms`: how often librdkafka reports what it sent (produce
/// requests, records), for the `outbox_relay_kafka_*` counters.
pub(crate) const STATISTICS_INTERVAL_MS: u32 = 1000;

/// `max.in.flight.requests.per.connection`: the most for which the idempotent
/// producer still guarantees ordering.
pub(crate) const MAX_IN_FLIGHT_REQUESTS: u32 = 5;

/// The partitioners librdkafka knows (`partitioner` property).
pub(crate) const PARTITIONERS: [&str; 7] = [
    "random",
    "consistent",
    "consistent_random",
    "murmur2",
    "murmur2_random",
    "fnv1a",
    "fnv1a_random",
];

/// Slots in the report channel beyond the relay's event window.
pub(crate) const REPORT_CHANNEL_MARGIN: usize = 1024;

/// librdkafka's defaults for the producer queue, kept as floors.
const DEFAULT_QUEUE_MESSAGES: usize = 100_000;
const DEFAULT_QUEUE_KBYTES: usize = 1_048_576;
/// Allowance per queued message for key, headers and librdkafka's own overhead.
const PER_MESSAGE_OVERHEAD_BYTES: usize = 1024;
/// librdkafka's upper bound for both queue limits (`INT_MAX`).
const QUEUE_LIMIT_MAX: usize = i32::MAX as usize;

/// Capacity of the delivery-report channel for a relay window: the window plus
/// `REPORT_CHANNEL_MARGIN`, so the delivery thread never waits for the relay.
#[must_use]
pub fn report_capacity(relay: &RelayConfig) -> usize {
    relay
        .max_in_flight_events
        .saturating_add(REPORT_CHANNEL_MARGIN)
}

/// `queue.buffering.max.messages`: twice the window, at least librdkafka's default.
fn queue_max_messages(relay: &RelayConfig) -> usize {
    relay
        .max_in_flight_events
        .saturating_mul(2)
        .saturating_add(REPORT_CHANNEL_MARGIN)
        .clamp(DEFAULT_QUEUE_MESSAGES, QUEUE_LIMIT_MAX)
}

/// `queue.buffering.max.kbytes`: twice the byte window plus a per-message allowance,
/// at least librdkafka's default (1 GiB).
fn queue_max_kbytes(relay: &RelayConfig) -> usize {
    let bytes = relay
        .max_in_flight_bytes
        .saturating_mul(2)
        .saturating_add(queue_max_messages(relay).saturating_mul(PER_MESSAGE_OVERHEAD_BYTES));
    (bytes / 1024).clamp(DEFAULT_QUEUE_KBYTES, QUEUE_LIMIT_MAX)
}

/// Builds the producer configuration: the guarantees first, then `kafka.producer`
/// pass-through settings (SASL, TLS, compression, …), which may not weaken them.
///
/// Rejected with a configuration [`BrokerError`] (exit code 2): an unknown partitioner
/// ([`BrokerError::UnknownPartitioner`]);
/// `bootstrap.servers` / `metadata.broker.list` (use `kafka.brokers`), `partitioner`
/// (use `kafka.partitioner`), `transactional.id`; `enable.idempotence` other than true;
/// `acks` other than `all`/`-1`; more than 5 in-flight requests; `retries=0`; a non-zero
/// `message.timeout.ms` / `delivery.timeout.ms` (see the module doc);
/// `delivery.report.only.error=true` (every send needs its report); queue limits below
/// the relay's window ([`BrokerError::RefusedSetting`]); and anything librdkafka itself
/// refuses, unknown property or bad value ([`BrokerError::InvalidSetting`]).
pub fn producer_config(
    kafka: &KafkaConfig,
    relay: &RelayConfig,
) -> Result<ClientConfig, BrokerError> {
    if !PARTITIONERS.contains(&kafka.partitioner.as_str()) {
        return Err(BrokerError::UnknownPartitioner {
            value: kafka.partitioner.clone(),
            known: &PARTITIONERS,
        });
    }
    let min_messages = queue_max_messages(relay);
    let min_kbytes = queue_max_kbytes(relay);
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", &kafka.brokers)
        .set("client.id", CLIENT_ID)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set(
            "max.in.flight.requests.per.connection",
            MAX_IN_FLIGHT_REQUESTS.to_string(),
        )
        .set("message.timeout.ms", "0")
        .set("linger.ms", DEFAULT_LINGER_MS.to_string())
        .set("partitioner", &kafka.partitioner)
        .set("allow.auto.create.topics", "false")
        .set("queue.buffering.max.messages", min_messages.to_string())
        .set("queue.buffering.max.kbytes", min_kbytes.to_string())
        .set("statistics.interval.ms", STATISTICS_INTERVAL_MS.to_string());
    for (key, value) in &kafka.producer {
        check_override(key, value, min_messages, min_kbytes)?;
        cfg.set(key, value);
    }
    // Let librdkafka check property names and values now, so a typo is a config error
    // (exit code 2) before anything connects.
    cfg.create_native_config()
        .map_err(BrokerError::InvalidSetting)?;
    Ok(cfg)
}

/// Rejects a pass-through producer setting that would break a guarantee.
fn check_override(
    key: &str,
    value: &str,
    min_messages: usize,
    min_kbytes: usize,
) -> Result<(), BrokerError> {
    let reject = |why: &str| {
        Err(BrokerError::RefusedSetting {
            key: key.to_owned(),
            value: value.to_owned(),
            why: why.to_owned(),
        })
    };
    let v = value.trim();
    let int = v.parse::<i64>().ok();
    let int_in = |lo: i64, hi: i64| matches!(int, Some(n) if (lo..=hi).contains(&n));
    let at_least = |min: usize| int_in(i64::try_from(min).unwrap_or(i64::MAX), i64::MAX);
    let max_requests = i64::from(MAX_IN_FLIGHT_REQUESTS);
    match key {
        "bootstrap.servers" | "metadata.broker.list" => reject("set kafka.brokers instead"),
        "partitioner" => reject("set kafka.partitioner instead"),
        "transactional.id" => reject(
            "at-least-once delivery is not transactional, and kafka.delivery = \"exactly-once\" \
             sets its own (outbox-relay.<slot>)",
        ),
        "enable.idempotence" if !v.eq_ignore_ascii_case("true") => reject(
            "the idempotent producer is required: without it a retry can duplicate or reorder",
        ),
        "acks" | "request.required.acks" if !(v == "all" || v == "-1") => {
            reject("must be all (-1): an event counts as delivered only on every in-sync replica")
        }
        "max.in.flight.requests.per.connection" | "max.in.flight" if !int_in(1, max_requests) => {
            reject("must be 1..=5: more in-flight requests may reorder retried batches")
        }
        "retries" | "message.send.max.retries" if !int_in(1, i64::MAX) => {
            reject("must be > 0: transient broker errors are retried by the producer")
        }
        "message.timeout.ms" | "delivery.timeout.ms" if int != Some(0) => reject(
            "must be 0 (infinite): a broker outage must not fail events, and re-producing \
             timed-out events would reorder them",
        ),
        "delivery.report.only.error" if !v.eq_ignore_ascii_case("false") => {
            reject("every send needs a delivery report")
        }
        "queue.buffering.max.messages" if !(int == Some(0) || at_least(min_messages)) => reject(
            &format!("must be 0 (unlimited) or at least {min_messages}, above the relay's window"),
        ),
        "queue.buffering.max.kbytes" if !at_least(min_kbytes) => reject(&format!(
            "must be at least {min_kbytes}, above the relay's window"
        )),
        _ => Ok(()),
    }
}

/// Whether the producer compresses its record batches: `compression.type` or its
/// alias `compression.codec` (`kafka.producer`) names a codec, not `none` (nor
/// `inherit`, the topic-level default that defers to the global setting).
///
/// Matters for size limits: the broker applies the topic's `max.message.bytes` to
/// the batch as written, compressed when the producer compresses, so the record's
/// own size then says nothing about that limit (`cdc::session`). When both keys are
/// set and disagree, which one librdkafka applies depends on the order it is given
/// them, so a codec in either counts: taking a compressing producer for a plain one
/// would poison events the broker accepts, the other way round only lets the broker
/// decide.
#[must_use]
pub fn compresses(cfg: &ClientConfig) -> bool {
    ["compression.type", "compression.codec"]
        .iter()
        .filter_map(|key| cfg.get(key))
        .map(str::trim)
        .any(|codec| {
            !(codec.is_empty()
                || codec.eq_ignore_ascii_case("none")
                || codec.eq_ignore_ascii_case("inherit"))
        })
}

/// The producer's `linger.ms` (or its alias `queue.buffering.max.ms`; librdkafka
/// takes fractions), 5 ms (the default this crate sets) when neither is set or one is unreadable.
#[must_use]
pub fn linger(cfg: &ClientConfig) -> Duration {
    ["linger.ms", "queue.buffering.max.ms"]
        .iter()
        .find_map(|key| cfg.get(key))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|ms| ms.is_finite() && *ms >= 0.0)
        .map_or(Duration::from_millis(u64::from(DEFAULT_LINGER_MS)), |ms| {
            Duration::from_secs_f64(ms / 1000.0)
        })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn linger_reads_the_setting_or_its_alias_and_falls_back_to_the_default() {
        let mut cfg = ClientConfig::new();
        assert_eq!(linger(&cfg), Duration::from_millis(5));
        cfg.set("queue.buffering.max.ms", "0.5");
        assert_eq!(linger(&cfg), Duration::from_micros(500));
        cfg.set("linger.ms", "20");
        assert_eq!(linger(&cfg), Duration::from_millis(20));
        cfg.set("linger.ms", "soon");
        assert_eq!(linger(&cfg), Duration::from_millis(5));
    }

    #[test]
    fn compression_is_read_from_either_key() {
        let compresses_with = |settings: &[(&str, &str)]| compresses(&build(settings).unwrap());
        assert!(!compresses_with(&[]), "librdkafka's default is none");
        assert!(!compresses_with(&[("compression.type", "none")]));
        assert!(!compresses_with(&[("compression.codec", "none")]));
        for codec in ["gzip", "snappy", "lz4", "zstd"] {
            assert!(compresses_with(&[("compression.type", codec)]), "{codec}");
            assert!(compresses_with(&[("compression.codec", codec)]), "{codec}");
        }
        // Disagreeing keys: librdkafka's choice depends on the order, so a codec wins.
        assert!(compresses_with(&[
            ("compression.type", "none"),
            ("compression.codec", "zstd")
        ]));
        let mut cfg = ClientConfig::new();
        cfg.set("compression.type", " ZSTD ");
        assert!(compresses(&cfg));
        cfg.set("compression.type", "inherit");
        assert!(!compresses(&cfg));
    }

    pub(crate) fn kafka(producer: &[(&str, &str)]) -> KafkaConfig {
        // Through serde, so fields added to `KafkaConfig` later keep their defaults.
        let mut table = toml::Table::new();
        table.insert("brokers".into(), "k1:9092,k2:9092".into());
        let producer: toml::Table = producer
            .iter()
            .map(|(k, v)| ((*k).to_owned(), toml::Value::from(*v)))
            .collect();
        table.insert("producer".into(), producer.into());
        table.try_into().unwrap()
    }

    fn build(producer: &[(&str, &str)]) -> Result<ClientConfig, BrokerError> {
        producer_config(&kafka(producer), &RelayConfig::default())
    }

    fn rejected(producer: &[(&str, &str)]) -> BrokerError {
        match build(producer) {
            Ok(_) => panic!("{producer:?} was accepted"),
            Err(e) => {
                assert_eq!(e.exit_code(), 2, "a configuration error: {e}");
                e
            }
        }
    }

    #[test]
    fn defaults_carry_the_guarantees() {
        let cfg = build(&[]).unwrap();
        let expect = [
            ("bootstrap.servers", "k1:9092,k2:9092"),
            ("client.id", "outbox-relay"),
            ("enable.idempotence", "true"),
            ("acks", "all"),
            ("max.in.flight.requests.per.connection", "5"),
            ("message.timeout.ms", "0"),
            ("linger.ms", "5"),
            ("partitioner", "murmur2_random"),
            ("allow.auto.create.topics", "false"),
            ("statistics.interval.ms", "1000"),
        ];
        for (key, value) in expect {
            assert_eq!(cfg.get(key), Some(value), "{key}");
        }
    }

    #[test]
    fn queue_limits_exceed_the_window() {
        let relay = RelayConfig {
            max_in_flight_events: 400_000,
            max_in_flight_bytes: 4 << 30,
            ..RelayConfig::default()
        };
        let cfg = producer_config(&kafka(&[]), &relay).unwrap();
        let messages: usize = cfg
            .get("queue.buffering.max.messages")
            .unwrap()
            .parse()
            .unwrap();
        let kbytes: usize = cfg
            .get("queue.buffering.max.kbytes")
            .unwrap()
            .parse()
            .unwrap();
        assert!(messages >= 2 * relay.max_in_flight_events, "{messages}");
        assert!(kbytes * 1024 >= 2 * relay.max_in_flight_bytes, "{kbytes}");
        assert!(report_capacity(&relay) > relay.max_in_flight_events);
        // Defaults keep librdkafka's own (larger) floors.
        let cfg = build(&[]).unwrap();
        assert_eq!(cfg.get("queue.buffering.max.messages"), Some("100000"));
        assert_eq!(cfg.get("queue.buffering.max.kbytes"), Some("1048576"));
        // Huge windows are clamped to what librdkafka accepts.
        let huge = RelayConfig {
            max_in_flight_events: usize::MAX / 2,
            max_in_flight_bytes: usize::MAX / 2,
            ..RelayConfig::default()
        };
        producer_config(&kafka(&[]), &huge).unwrap();
    }

    #[test]
    fn pass_through_settings_apply_after_defaults() {
        let cfg = build(&[
            ("linger.ms", "20"),
            ("compression.type", "lz4"),
            ("client.id", "relay-eu-1"),
            ("acks", "-1"),
            ("enable.idempotence", "true"),
            ("max.in.flight.requests.per.connection", "1"),
            ("retries", "10"),
            ("message.timeout.ms", "0"),
            ("allow.auto.create.topics", "true"),
            ("queue.buffering.max.messages", "0"),
            ("topic.metadata.propagation.max.ms", "100"),
        ])
        .unwrap();
        assert_eq!(cfg.get("linger.ms"), Some("20"));
        assert_eq!(cfg.get("compression.type"), Some("lz4"));
        assert_eq!(cfg.get("client.id"), Some("relay-eu-1"));
        assert_eq!(cfg.get("max.in.flight.requests.per.connection"), Some("1"));
    }

    /// librdkafka refuses a setting whose feature it was built without ("OpenSSL
    /// not available at build time", "libzstd not available"): producing a client
    /// with each of these proves the build has TLS, every SASL mechanism the docs
    /// offer and all four codecs.
    #[test]
    fn security_and_codecs_are_built_in() {
        use rdkafka::producer::BaseProducer;
        let cases: &[&[(&str, &str)]] = &[
            &[("security.protocol", "SSL"), ("ssl.ca.location", "probe")],
            &[
                ("security.protocol", "SASL_SSL"),
                ("sasl.mechanism", "SCRAM-SHA-512"),
                ("sasl.username", "relay"),
                ("sasl.password", "x"),
            ],
            &[
                ("security.protocol", "SASL_SSL"),
                ("sasl.mechanism", "SCRAM-SHA-256"),
                ("sasl.username", "relay"),
                ("sasl.password", "x"),
            ],
            &[
                ("security.protocol", "SASL_PLAINTEXT"),
                ("sasl.mechanism", "PLAIN"),
                ("sasl.username", "relay"),
                ("sasl.password", "x"),
            ],
            &[
                ("security.protocol", "SASL_SSL"),
                ("sasl.mechanism", "OAUTHBEARER"),
                ("enable.sasl.oauthbearer.unsecure.jwt", "true"),
                ("sasl.oauthbearer.config", "principal=relay"),
            ],
            &[("compression.type", "gzip")],
            &[("compression.type", "snappy")],
            &[("compression.type", "lz4")],
            &[("compression.type", "zstd")],
        ];
        for settings in cases {
            let cfg = build(settings).unwrap_or_else(|e| panic!("{settings:?}: {e}"));
            let created: Result<BaseProducer, _> = cfg.create();
            assert!(created.is_ok(), "{settings:?}: {:?}", created.err());
        }
    }

    #[test]
    fn settings_that_break_guarantees_are_rejected() {
        let cases: &[(&str, &str, &str)] = &[
            ("enable.idempotence", "false", "idempotent"),
            ("acks", "1", "all"),
            ("request.required.acks", "0", "all"),
            ("max.in.flight.requests.per.connection", "6", "1..=5"),
            ("max.in.flight", "0", "1..=5"),
            ("retries", "0", "> 0"),
            ("message.send.max.retries", "0", "> 0"),
            ("bootstrap.servers", "other:9092", "kafka.brokers"),
            ("metadata.broker.list", "other:9092", "kafka.brokers"),
            ("transactional.id", "relay", "not transactional"),
            ("partitioner", "random", "kafka.partitioner"),
            ("message.timeout.ms", "30000", "infinite"),
            ("delivery.timeout.ms", "120000", "infinite"),
            ("delivery.report.only.error", "true", "report"),
            ("queue.buffering.max.messages", "1000", "window"),
            ("queue.buffering.max.kbytes", "1024", "window"),
        ];
        for (key, value, hint) in cases {
            let err = rejected(&[(key, value)]);
            let BrokerError::RefusedSetting {
                key: refused,
                value: given,
                why,
            } = &err
            else {
                panic!("{key}: {err:?}");
            };
            assert_eq!((refused.as_str(), given.as_str()), (*key, *value));
            assert!(why.contains(hint), "{key}: {why}");
            let message = err.to_string();
            assert!(
                message.starts_with(&format!("invalid configuration: kafka.producer.\"{key}\"")),
                "{message}"
            );
        }
    }

    #[test]
    fn librdkafka_checks_names_and_values() {
        for (key, value) in [("linger.msec", "5"), ("compression.type", "brotli")] {
            let err = rejected(&[(key, value)]);
            assert!(matches!(err, BrokerError::InvalidSetting(_)), "{err:?}");
            assert!(err.to_string().contains(key), "{err}");
        }
    }

    #[test]
    fn partitioner_is_validated() {
        for p in PARTITIONERS {
            let mut k = kafka(&[]);
            k.partitioner = p.into();
            let cfg = producer_config(&k, &RelayConfig::default()).unwrap();
            assert_eq!(cfg.get("partitioner"), Some(p));
        }
        let mut k = kafka(&[]);
        k.partitioner = "murmur3".into();
        let err = producer_config(&k, &RelayConfig::default()).unwrap_err();
        assert!(
            matches!(&err, BrokerError::UnknownPartitioner { value, .. } if value == "murmur3"),
            "{err:?}"
        );
        assert_eq!(err.exit_code(), 2);
        assert!(err.to_string().contains("murmur2_random"), "{err}");
    }

    /// The `[kafka.producer]` settings `config/relay.example.toml` shows (commented
    /// out: its samples turned on) are librdkafka's: the config loader passes any name
    /// through, so librdkafka is what knows them (see `config::documented`).
    #[test]
    fn the_example_configs_producer_settings_are_librdkafkas() {
        let mut shown = 0;
        for (label, text) in crate::config::documented::example_variants() {
            let config = crate::config::Config::from_sources(&label, &text, Vec::new())
                .unwrap_or_else(|e| panic!("{label}: {e}"));
            shown += config.kafka.producer.len();
            if let Err(e) = producer_config(&config.kafka, &config.relay) {
                panic!("{label}: {e}");
            }
        }
        assert!(shown >= 5, "the example shows {shown} producer settings");
        // Not vacuous: a name librdkafka does not know is refused.
        let err = rejected(&[("ssl.ca.locaton", "/etc/ca.crt")]);
        assert!(matches!(err, BrokerError::InvalidSetting(_)), "{err:?}");
    }
}
