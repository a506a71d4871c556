//! The relay's readers of Kafka (the audit, the exactly-once progress record): what
//! they copy from `kafka.producer`, and which isolation level they read at.
//!
//! A reader is assigned partitions (no group membership) and commits nothing, so it
//! leaves no trace on the cluster. It copies from `kafka.producer` only the settings
//! that say how to reach and authenticate to the brokers (`security.protocol`,
//! `sasl.*`, `ssl.*`, …); producer tuning does not apply.
//!
//! # Isolation
//!
//! `read_uncommitted` (librdkafka's consumer default is `read_committed`; readers
//! here set it explicitly) sees every record written, including those of aborted
//! Kafka transactions and of open ones. `read_committed` stops at the last stable
//! offset (the first record of the oldest open transaction) and drops records of
//! aborted transactions: what the consumers of `kafka.delivery = "exactly-once"`
//! see. The progress record is always read `read_committed`: an aborted record
//! names events that were never committed.

use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::types::RDKafkaErrorCode;

use crate::config::KafkaConfig;

/// `kafka.producer` settings copied to a reader: how to reach and authenticate to
/// the brokers (names equal to, or starting with, one of these).
const PASSTHROUGH: [&str; 9] = [
    "security.protocol",
    "sasl.",
    "ssl.",
    "ssl_",
    "enable.ssl.",
    "enable.sasl.",
    "client.dns.lookup",
    "broker.address.family",
    "socket.",
];

/// What a reader sees of transactional records (`isolation.level`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum Isolation {
    /// Every record written, committed or not.
    #[default]
    ReadUncommitted,
    /// Committed records only, up to the last stable offset.
    ReadCommitted,
}

impl Isolation {
    /// librdkafka's `isolation.level` value.
    #[must_use]
    pub fn setting(self) -> &'static str {
        match self {
            Isolation::ReadUncommitted => "read_uncommitted",
            Isolation::ReadCommitted => "read_committed",
        }
    }
}

/// The client context of a reader: the end of a partition is how a reader knows it
/// read everything, not an error worth a log line (rdkafka's default context logs
/// every client error at ERROR level). `reader` names it in the log.
#[derive(Debug, Clone, Copy)]
pub struct ReaderContext {
    pub reader: &'static str,
}

impl rdkafka::ClientContext for ReaderContext {
    fn error(&self, error: KafkaError, reason: &str) {
        let eof = matches!(error, KafkaError::PartitionEOF(_))
            || error.rdkafka_error_code() == Some(RDKafkaErrorCode::PartitionEOF);
        if eof {
            tracing::debug!(reader = self.reader, %error, reason, "reader reached a partition end");
        } else {
            tracing::warn!(reader = self.reader, %error, reason, "reader error");
        }
    }
}

impl rdkafka::consumer::ConsumerContext for ReaderContext {}

/// Whether a `kafka.producer` setting is about reaching or authenticating to the
/// brokers, and so applies to a reader too.
fn is_passthrough(key: &str) -> bool {
    PASSTHROUGH
        .iter()
        .any(|p| key == *p || (p.ends_with(['.', '_']) && key.starts_with(p)))
}

/// A client configuration with `kafka.brokers` and the connection settings of
/// `kafka.producer` only (for readers and admin requests).
pub(crate) fn connection_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut cfg = ClientConfig::new();
    cfg.set("bootstrap.servers", &kafka.brokers);
    for (key, value) in &kafka.producer {
        if is_passthrough(key) {
            cfg.set(key, value);
        }
    }
    cfg
}

/// A reader's configuration: assigned partitions only, no commits, end of partition
/// reported, reading at `isolation`.
///
/// # Errors
///
/// librdkafka's message when it refuses a copied setting.
pub fn reader_config(
    kafka: &KafkaConfig,
    client_id: &str,
    isolation: Isolation,
) -> Result<ClientConfig, String> {
    let mut cfg = connection_config(kafka);
    cfg.set("client.id", client_id)
        // Required by librdkafka for a consumer; never joined (assign, not subscribe).
        .set("group.id", client_id)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", isolation.setting());
    cfg.create_native_config().map_err(|e| e.to_string())?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_connection_settings_reach_the_consumer() {
        for yes in [
            "security.protocol",
            "sasl.mechanism",
            "sasl.username",
            "ssl.ca.location",
            "enable.ssl.certificate.verification",
            "socket.timeout.ms",
        ] {
            assert!(is_passthrough(yes), "{yes}");
        }
        for no in ["linger.ms", "acks", "security", "compression.type", "sasl"] {
            assert!(!is_passthrough(no), "{no}");
        }
    }
}
