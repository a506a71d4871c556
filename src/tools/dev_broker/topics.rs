//! Topics: names, ids, partitions and the per-topic config a client can read back
//! (DescribeConfigs: the relay's size check and `check` read `max.message.bytes`).

use std::collections::BTreeMap;

use super::log::PartitionLog;

/// The largest partition count accepted (a guard against a typo allocating millions).
const MAX_PARTITIONS: i32 = 10_000;

/// Config values every topic reports unless created with an override (Kafka 3.x
/// defaults; `max.message.bytes` is the 1 MiB + record overhead default).
pub(super) const DEFAULT_CONFIGS: &[(&str, &str)] = &[
    ("cleanup.policy", "delete"),
    ("compression.type", "producer"),
    ("max.message.bytes", "1048588"),
    ("message.timestamp.type", "CreateTime"),
    ("min.insync.replicas", "1"),
    ("retention.bytes", "-1"),
    ("retention.ms", "604800000"),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum TopicError {
    #[error("topic already exists")]
    AlreadyExists,
    #[error("invalid topic name")]
    InvalidName,
    #[error("partition count {0} out of range 1..={MAX_PARTITIONS}")]
    InvalidPartitions(i32),
    #[error("unknown topic or partition")]
    Unknown,
}

/// One topic.
#[derive(Debug)]
pub(super) struct Topic {
    pub(super) id: uuid::Uuid,
    pub(super) partitions: Vec<PartitionLog>,
    /// Configs set at creation (overrides of [`DEFAULT_CONFIGS`], or extra keys).
    pub(super) overrides: BTreeMap<String, String>,
}

/// `max.message.bytes` when the topic does not override it.
const DEFAULT_MAX_MESSAGE_BYTES: usize = 1_048_588;

impl Topic {
    /// The largest batch a producer may write (`max.message.bytes`).
    pub(super) fn max_message_bytes(&self) -> usize {
        self.overrides
            .get("max.message.bytes")
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_MAX_MESSAGE_BYTES)
    }

    /// Every config with its value and whether it is a default.
    pub(super) fn configs(&self) -> Vec<(String, String, bool)> {
        let mut all: BTreeMap<String, (String, bool)> = DEFAULT_CONFIGS
            .iter()
            .map(|(k, v)| ((*k).to_owned(), ((*v).to_owned(), true)))
            .collect();
        for (k, v) in &self.overrides {
            all.insert(k.clone(), (v.clone(), false));
        }
        all.into_iter().map(|(k, (v, d))| (k, v, d)).collect()
    }
}

/// All topics, by name.
#[derive(Debug, Default)]
pub(super) struct Topics {
    by_name: BTreeMap<String, Topic>,
}

/// Kafka's rule: 1 to 249 characters of `[a-zA-Z0-9._-]`, not `.` or `..`.
pub(super) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 249
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-')
}

impl Topics {
    pub(super) fn create(
        &mut self,
        name: &str,
        partitions: i32,
        overrides: BTreeMap<String, String>,
    ) -> Result<&Topic, TopicError> {
        if !valid_name(name) {
            return Err(TopicError::InvalidName);
        }
        if self.by_name.contains_key(name) {
            return Err(TopicError::AlreadyExists);
        }
        let count = usize::try_from(partitions)
            .ok()
            .filter(|_| (1..=MAX_PARTITIONS).contains(&partitions))
            .ok_or(TopicError::InvalidPartitions(partitions))?;
        let topic = Topic {
            id: uuid::Uuid::now_v7(),
            partitions: (0..count).map(|_| PartitionLog::default()).collect(),
            overrides,
        };
        Ok(self.by_name.entry(name.to_owned()).or_insert(topic))
    }

    pub(super) fn get(&self, name: &str) -> Option<&Topic> {
        self.by_name.get(name)
    }

    pub(super) fn delete(&mut self, name: &str) -> Result<Topic, TopicError> {
        self.by_name.remove(name).ok_or(TopicError::Unknown)
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&String, &Topic)> {
        self.by_name.iter()
    }

    pub(super) fn partition(&self, name: &str, partition: i32) -> Option<&PartitionLog> {
        let index = usize::try_from(partition).ok()?;
        self.by_name.get(name)?.partitions.get(index)
    }

    pub(super) fn partition_mut(
        &mut self,
        name: &str,
        partition: i32,
    ) -> Option<&mut PartitionLog> {
        let index = usize::try_from(partition).ok()?;
        self.by_name.get_mut(name)?.partitions.get_mut(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_name("outbox.event.order_1-x"));
        assert!(!valid_name(""));
        assert!(!valid_name(".."));
        assert!(!valid_name("a b"));
        assert!(!valid_name(&"a".repeat(250)));
    }

    #[test]
    fn create_lookup_delete() {
        let mut topics = Topics::default();
        assert_eq!(
            topics
                .create("t", 3, BTreeMap::new())
                .map(|t| t.partitions.len()),
            Ok(3)
        );
        assert_eq!(
            topics.create("t", 3, BTreeMap::new()).err(),
            Some(TopicError::AlreadyExists)
        );
        assert_eq!(
            topics.create("u", 0, BTreeMap::new()).err(),
            Some(TopicError::InvalidPartitions(0))
        );
        assert!(topics.partition("t", 2).is_some());
        assert!(topics.partition("t", 3).is_none());
        assert!(topics.partition("t", -1).is_none());
        assert!(topics.delete("t").is_ok());
        assert_eq!(topics.delete("t").err(), Some(TopicError::Unknown));
    }

    #[test]
    fn configs_merge_overrides() {
        let mut topics = Topics::default();
        let overrides = BTreeMap::from([("cleanup.policy".to_owned(), "compact".to_owned())]);
        let topic = topics.create("t", 1, overrides).expect("create");
        let configs = topic.configs();
        assert!(configs.contains(&("cleanup.policy".into(), "compact".into(), false)));
        assert!(configs.contains(&("max.message.bytes".into(), "1048588".into(), true)));
    }
}
