//! Topic administration for the developer tools.
//!
//! The relay itself never creates topics: its producer runs with
//! `allow.auto.create.topics=false` so that a misspelt topic template fails (poison,
//! `unknown_topic`) instead of creating a topic with broker defaults. `demo --brokers`
//! and `bench` do need their topic up front, and Tansu and many production brokers
//! never auto-create, hence this one admin call. Failures are
//! [`BrokerUnavailable`] (exit code 4), as for the relay's own start-up check.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;

use super::error::{BrokerError, BrokerUnavailable};

/// How long the broker may take to create the topic.
const CREATE_TIMEOUT: Duration = Duration::from_secs(10);

/// Creates a topic (Tansu and many production brokers never auto-create); an
/// existing topic is fine. Used by `demo --brokers` and `bench`.
///
/// # Errors
///
/// [`BrokerError::Client`] when the admin client cannot be created,
/// [`BrokerError::Unavailable`] when the request fails or the broker refuses.
pub(crate) async fn create_topic(
    brokers: &str,
    name: &str,
    partitions: i32,
) -> Result<(), BrokerError> {
    let admin: AdminClient<DefaultClientContext> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()?;
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    let opts = AdminOptions::new().operation_timeout(Some(CREATE_TIMEOUT));
    let results = admin
        .create_topics([&topic], &opts)
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
