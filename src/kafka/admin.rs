//! Topic administration for the developer tools, and the progress topic of
//! exactly-once mode.
//!
//! The relay itself never creates the event topics: its producer runs with
//! `allow.auto.create.topics=false` so that a misspelt topic template fails (poison,
//! `unknown_topic`) instead of creating a topic with broker defaults. `demo --brokers`
//! and `bench` do need their topic up front, and Tansu and many production brokers
//! never auto-create, hence this one admin call. Failures are
//! [`BrokerUnavailable`] (exit code 4), as for the relay's own start-up check.
//!
//! `migrate` creates `kafka.progress_topic` when `kafka.delivery = "exactly-once"`:
//! one partition (every relay's record is small and keyed by its slot), compacted
//! (only each slot's latest record matters), with the connection settings of
//! `kafka.producer` (a production cluster wants its SASL and TLS). Its replication
//! factor is `kafka.progress_topic_replication_factor`, or else the cluster's
//! `default.replication.factor` (a factor of -1 in CreateTopics, KIP-464): never 1
//! by default, because a progress topic with fewer replicas than the cluster's
//! `min.insync.replicas` refuses the record written in every commit, and one on a
//! single broker stops every commit when that broker goes.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;

use super::error::{BrokerError, BrokerUnavailable};
use crate::config::KafkaConfig;

/// A replication factor of -1: the cluster's `default.replication.factor` (KIP-464,
/// CreateTopics v4 and later).
const BROKER_DEFAULT_REPLICATION: i32 = -1;

/// How long the broker may take to create the topic.
const CREATE_TIMEOUT: Duration = Duration::from_secs(10);

/// Creates a topic (Tansu and many production brokers never auto-create); an
/// existing topic is fine. Used by `demo --brokers` and `bench`.
///
/// # Errors
///
/// [`BrokerError::Client`] when the admin client cannot be created,
/// [`BrokerError::Unavailable`] when the request fails or the broker refuses.
#[cfg(feature = "tools")]
pub(crate) async fn create_topic(
    brokers: &str,
    name: &str,
    partitions: i32,
) -> Result<(), BrokerError> {
    let mut cfg = rdkafka::ClientConfig::new();
    cfg.set("bootstrap.servers", brokers);
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    create(&cfg, brokers, &topic).await
}

/// Creates `kafka.progress_topic` (compacted, one partition); an existing topic is
/// fine.
///
/// # Errors
///
/// [`BrokerError::Client`] when the admin client cannot be created,
/// [`BrokerError::Unavailable`] when the request fails or the broker refuses.
pub async fn create_progress_topic(kafka: &KafkaConfig) -> Result<(), BrokerError> {
    let cfg = super::consumer::connection_config(kafka);
    let replication = kafka
        .progress_topic_replication_factor
        .map_or(BROKER_DEFAULT_REPLICATION, i32::from);
    let topic = NewTopic::new(
        &kafka.progress_topic,
        1,
        TopicReplication::Fixed(replication),
    )
    .set("cleanup.policy", "compact");
    create(&cfg, &kafka.brokers, &topic).await
}

async fn create(
    cfg: &rdkafka::ClientConfig,
    brokers: &str,
    topic: &NewTopic<'_>,
) -> Result<(), BrokerError> {
    let name = topic.name;
    let admin: AdminClient<DefaultClientContext> = cfg.create()?;
    let opts = AdminOptions::new().operation_timeout(Some(CREATE_TIMEOUT));
    let results = admin
        .create_topics([topic], &opts)
        .await
        .map_err(|source| BrokerUnavailable::CreateTopic {
            topic: name.to_owned(),
            brokers: brokers.to_owned(),
            source,
        })?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((topic, code)) => {
                return Err(BrokerUnavailable::TopicRefused {
                    topic,
                    brokers: brokers.to_owned(),
                    code,
                }
                .into());
            }
        }
    }
    Ok(())
}
