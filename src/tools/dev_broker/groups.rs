//! Committed consumer offsets, per group, in memory: the minimum for consumers that
//! `assign()` partitions with a `group.id` (OffsetCommit, OffsetFetch) and for
//! offsets committed inside a transaction. No membership, no rebalancing: JoinGroup
//! and friends are not implemented.

use std::collections::BTreeMap;

/// One committed offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Committed {
    pub(super) offset: i64,
    pub(super) metadata: Option<String>,
}

/// Offsets by group, topic and partition.
#[derive(Debug, Default)]
pub(super) struct Offsets {
    by_group: BTreeMap<String, BTreeMap<(String, i32), Committed>>,
}

impl Offsets {
    pub(super) fn commit(&mut self, group: &str, topic: &str, partition: i32, c: Committed) {
        self.by_group
            .entry(group.to_owned())
            .or_default()
            .insert((topic.to_owned(), partition), c);
    }

    pub(super) fn get(&self, group: &str, topic: &str, partition: i32) -> Option<&Committed> {
        self.by_group
            .get(group)?
            .get(&(topic.to_owned(), partition))
    }

    /// Every offset of `group`, by topic then partition.
    pub(super) fn all(&self, group: &str) -> impl Iterator<Item = (&str, i32, &Committed)> {
        self.by_group
            .get(group)
            .into_iter()
            .flatten()
            .map(|((t, p), c)| (t.as_str(), *p, c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_and_read_back() {
        let mut o = Offsets::default();
        let c = |offset| Committed {
            offset,
            metadata: None,
        };
        o.commit("g", "t", 1, c(5));
        o.commit("g", "t", 1, c(7));
        o.commit("g", "a", 0, c(1));
        assert_eq!(o.get("g", "t", 1).map(|c| c.offset), Some(7));
        assert_eq!(o.get("h", "t", 1), None);
        let all: Vec<_> = o.all("g").map(|(t, p, c)| (t, p, c.offset)).collect();
        assert_eq!(all, vec![("a", 0, 1), ("t", 1, 7)]);
    }
}
