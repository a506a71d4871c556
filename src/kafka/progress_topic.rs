//! What exactly-once needs of the progress topic and of the cluster's transaction
//! coordinator, read from a real cluster and judged before `run` relies on it.
//!
//! # Why each rule
//!
//! * **One partition.** The record is keyed by the slot and read back from the
//!   topic's end (`cdc::progress_record`). A topic of several partitions places the
//!   key by the partitioner, and a record written before the topic was widened sits
//!   in another partition than the next one: the reader may take a stale record, and
//!   a restart then publishes events again (duplicates for `read_committed`
//!   readers).
//! * **`cleanup.policy` includes `compact`.** With `delete` alone, a relay idle for
//!   longer than `retention.ms` loses its only record, and its next start publishes
//!   what the record said was done.
//! * **Replicas ≥ `min.insync.replicas`.** The record is written in every commit with
//!   `acks=all`; a topic with fewer replicas than its `min.insync.replicas` refuses
//!   every one (`NOT_ENOUGH_REPLICAS`), so no transaction ever commits. One replica on
//!   a cluster of several brokers commits, but stops every commit while that broker
//!   is down: a warning.
//! * **`transaction.max.timeout.ms` ≥ the producer's `transaction.timeout.ms`**
//!   (`kafka.transaction_timeout_ms`): otherwise the coordinator refuses
//!   `init_transactions` with `INVALID_TRANSACTION_TIMEOUT`, which no retry fixes.
//!
//! The transactional-id ACL cannot be read without the right to describe ACLs,
//! which a relay's principal seldom has; `run` makes a transaction at start, and a
//! refused `transactional.id` ends it with exit code 3 and the ACL to grant
//! (`kafka::transactions`).
//!
//! References: Apache Kafka's topic configs (`cleanup.policy`,
//! `min.insync.replicas`) and broker configs (`transaction.max.timeout.ms`), KIP-98.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::client::DefaultClientContext;

/// How long one describe request may take.
const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The progress topic and the cluster as read from the brokers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProgressTopicLayout {
    /// Partitions of the topic.
    pub partitions: usize,
    /// The fewest replicas of any of its partitions.
    pub replicas: usize,
    /// Brokers in the cluster.
    pub brokers: usize,
    /// The topic's `cleanup.policy`, if the broker tells.
    pub cleanup_policy: Option<String>,
    /// The topic's `min.insync.replicas`, if the broker tells.
    pub min_insync_replicas: Option<usize>,
    /// A broker's `transaction.max.timeout.ms`, if it tells.
    pub transaction_max_timeout_ms: Option<u64>,
}

/// Something about the progress topic or the cluster that breaks exactly-once.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutProblem {
    #[error(
        "the progress topic has {0} partitions: the reader may take a stale record, and a \
         restart publishes events again"
    )]
    Partitions(usize),
    #[error(
        "the progress topic's cleanup.policy is {0:?}: an idle relay's record expires, and its \
         next start publishes events again"
    )]
    NotCompacted(String),
    #[error(
        "the progress topic has {replicas} replica(s), below its min.insync.replicas \
         ({min_insync}): every commit is refused (NOT_ENOUGH_REPLICAS)"
    )]
    TooFewReplicas { replicas: usize, min_insync: usize },
    #[error(
        "the brokers' transaction.max.timeout.ms is {max_ms} ms, below \
         kafka.transaction_timeout_ms ({ours_ms} ms): init_transactions is refused \
         (INVALID_TRANSACTION_TIMEOUT)"
    )]
    TransactionTimeout { ours_ms: u64, max_ms: u64 },
}

impl LayoutProblem {
    /// What to do about it.
    #[must_use]
    pub fn fix(&self, topic: &str) -> String {
        match self {
            LayoutProblem::Partitions(_) => format!(
                "recreate {topic:?} with one partition (stop the relays, delete it, run \
                 `outbox-relay migrate`), or set kafka.progress_topic to a new one-partition \
                 compacted topic"
            ),
            LayoutProblem::NotCompacted(_) => format!(
                "kafka-configs --alter --entity-type topics --entity-name {topic} \
                 --add-config cleanup.policy=compact"
            ),
            LayoutProblem::TooFewReplicas { min_insync, .. } => format!(
                "raise {topic:?}'s replication factor to at least {min_insync} (partition \
                 reassignment), or lower its min.insync.replicas"
            ),
            LayoutProblem::TransactionTimeout { max_ms, .. } => format!(
                "set kafka.transaction_timeout_ms to at most {max_ms}, or raise the brokers' \
                 transaction.max.timeout.ms"
            ),
        }
    }
}

/// The problems of `layout` for a producer whose `transaction.timeout.ms` is
/// `transaction_timeout_ms`, and a warning (one replica on a cluster of several
/// brokers), if any.
#[must_use]
pub fn judge(
    layout: &ProgressTopicLayout,
    transaction_timeout_ms: u64,
) -> (Vec<LayoutProblem>, Option<String>) {
    let mut problems = Vec::new();
    if layout.partitions > 1 {
        problems.push(LayoutProblem::Partitions(layout.partitions));
    }
    if let Some(policy) = &layout.cleanup_policy
        && !policy.split(',').any(|p| p.trim() == "compact")
    {
        problems.push(LayoutProblem::NotCompacted(policy.clone()));
    }
    if let Some(min_insync) = layout.min_insync_replicas
        && layout.replicas < min_insync
    {
        problems.push(LayoutProblem::TooFewReplicas {
            replicas: layout.replicas,
            min_insync,
        });
    }
    if let Some(max_ms) = layout.transaction_max_timeout_ms
        && max_ms < transaction_timeout_ms
    {
        problems.push(LayoutProblem::TransactionTimeout {
            ours_ms: transaction_timeout_ms,
            max_ms,
        });
    }
    let warning = (layout.replicas == 1 && layout.brokers > 1).then(|| {
        format!(
            "the progress topic has one replica on a cluster of {} brokers: every commit \
             stops while its broker is down",
            layout.brokers
        )
    });
    (problems, warning)
}

/// Reads what [`judge`] needs of `topic`, with an admin client made from the
/// producer's settings; `partitions`, `replicas`, `brokers` and a broker id come
/// from the caller's metadata ([`crate::kafka::Publisher::topic_layout`]).
pub(crate) async fn describe(
    producer: &ClientConfig,
    topic: &str,
    broker_id: Option<i32>,
    mut layout: ProgressTopicLayout,
) -> ProgressTopicLayout {
    let Ok(admin) =
        super::topic_limits::admin_config(producer).create::<AdminClient<DefaultClientContext>>()
    else {
        return layout;
    };
    let opts = AdminOptions::new().request_timeout(Some(DESCRIBE_TIMEOUT));
    let topic_resource = ResourceSpecifier::Topic(topic);
    let broker_resource = broker_id.map(ResourceSpecifier::Broker);
    let mut resources = vec![&topic_resource];
    resources.extend(broker_resource.as_ref());
    let Ok(results) = admin.describe_configs(resources, &opts).await else {
        return layout;
    };
    for resource in results.into_iter().flatten() {
        let value = |name: &str| {
            resource
                .get(name)
                .and_then(|e| e.value.as_deref())
                .map(str::to_owned)
        };
        match resource.specifier {
            rdkafka::admin::OwnedResourceSpecifier::Topic(_) => {
                layout.cleanup_policy = value("cleanup.policy");
                layout.min_insync_replicas =
                    value("min.insync.replicas").and_then(|v| v.trim().parse().ok());
            }
            rdkafka::admin::OwnedResourceSpecifier::Broker(_) => {
                layout.transaction_max_timeout_ms =
                    value("transaction.max.timeout.ms").and_then(|v| v.trim().parse().ok());
            }
            rdkafka::admin::OwnedResourceSpecifier::Group(_) => {}
        }
    }
    layout
}

#[cfg(test)]
mod tests {
    use super::*;

    fn healthy() -> ProgressTopicLayout {
        ProgressTopicLayout {
            partitions: 1,
            replicas: 3,
            brokers: 3,
            cleanup_policy: Some("compact".into()),
            min_insync_replicas: Some(2),
            transaction_max_timeout_ms: Some(900_000),
        }
    }

    #[test]
    fn a_healthy_layout_has_no_problem() {
        assert_eq!(judge(&healthy(), 60_000), (vec![], None));
        let unknown = ProgressTopicLayout {
            partitions: 1,
            replicas: 1,
            brokers: 1,
            ..ProgressTopicLayout::default()
        };
        assert_eq!(
            judge(&unknown, 60_000),
            (vec![], None),
            "what is not told is not judged"
        );
        let both = ProgressTopicLayout {
            cleanup_policy: Some("compact, delete".into()),
            ..healthy()
        };
        assert_eq!(judge(&both, 60_000).0, vec![]);
    }

    #[test]
    fn each_rule_names_its_problem_and_fix() {
        let layout = ProgressTopicLayout {
            partitions: 3,
            replicas: 1,
            brokers: 3,
            cleanup_policy: Some("delete".into()),
            min_insync_replicas: Some(2),
            transaction_max_timeout_ms: Some(30_000),
        };
        let (problems, warning) = judge(&layout, 60_000);
        assert_eq!(
            problems,
            vec![
                LayoutProblem::Partitions(3),
                LayoutProblem::NotCompacted("delete".into()),
                LayoutProblem::TooFewReplicas {
                    replicas: 1,
                    min_insync: 2
                },
                LayoutProblem::TransactionTimeout {
                    ours_ms: 60_000,
                    max_ms: 30_000
                },
            ]
        );
        assert!(
            warning
                .expect("one replica of three brokers")
                .contains("3 brokers")
        );
        assert!(problems[3].fix("p").contains("at most 30000"));
        assert!(problems[1].fix("p").contains("cleanup.policy=compact"));
    }
}
