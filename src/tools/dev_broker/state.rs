//! The broker's whole state, behind one lock: topics and their logs, the
//! transaction coordinator, committed offsets. Every request handler runs with the
//! lock held and returns without waiting (a long-polling Fetch waits outside it).

use std::collections::BTreeMap;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::batch::MarkerType;
use super::faults::{Command, Faults};
use super::groups::{Committed, Offsets};
use super::topics::{Topic, TopicError, Topics};
use super::txn::{Coordinator, Markers, PendingOffset};

/// Facts fixed at start.
#[derive(Debug, Clone)]
pub(super) struct Settings {
    /// The host and port clients are told to connect to.
    pub(super) host: String,
    pub(super) port: i32,
    pub(super) default_partitions: i32,
    pub(super) auto_create_topics: bool,
    /// `transaction.max.timeout.ms`: the longest transaction timeout a producer may
    /// ask for (a longer one is refused with INVALID_TRANSACTION_TIMEOUT).
    pub(super) transaction_max_timeout_ms: i32,
}

/// The node id of the only broker.
pub(super) const NODE_ID: i32 = 1;

/// The state.
#[derive(Debug)]
pub(super) struct Broker {
    pub(super) settings: Settings,
    pub(super) topics: Topics,
    pub(super) coordinator: Coordinator,
    pub(super) offsets: Offsets,
    /// Faults armed through the control listener.
    pub(super) faults: Faults,
    /// Incremented by every write to a log; a waiting Fetch re-reads when it moves.
    changes: u64,
}

/// Milliseconds since the Unix epoch (marker timestamps).
pub(super) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

impl Broker {
    pub(super) fn new(settings: Settings) -> Broker {
        Broker {
            coordinator: Coordinator::with_max_timeout(settings.transaction_max_timeout_ms),
            settings,
            topics: Topics::default(),
            offsets: Offsets::default(),
            faults: Faults::default(),
            changes: 0,
        }
    }

    pub(super) fn changes(&self) -> u64 {
        self.changes
    }

    /// Marks the logs as changed (wakes waiting fetches).
    pub(super) fn changed(&mut self) {
        self.changes = self.changes.wrapping_add(1);
    }

    /// Creates a topic with the default partition count (Metadata auto-creation).
    pub(super) fn auto_create(&mut self, name: &str) -> Result<&Topic, TopicError> {
        let partitions = self.settings.default_partitions;
        let created = self.topics.create(name, partitions, BTreeMap::new());
        if created.is_ok() {
            tracing::info!(topic = name, partitions, "topic auto-created");
        }
        created
    }

    /// Writes a transaction's markers into its partitions (a deleted partition is
    /// skipped) and applies a commit's offsets.
    pub(super) fn end_transaction(&mut self, markers: &Markers, offsets: Vec<PendingOffset>) {
        let marker = if markers.commit {
            MarkerType::Commit
        } else {
            MarkerType::Abort
        };
        let timestamp = now_ms();
        for tp in &markers.partitions {
            let Some(log) = self.topics.partition_mut(&tp.topic, tp.partition) else {
                continue;
            };
            if let Err(e) = log.write_marker(
                markers.producer_id,
                markers.producer_epoch,
                marker,
                timestamp,
            ) {
                tracing::error!(topic = %tp.topic, partition = tp.partition, error = %e, "cannot write a transaction marker");
            }
        }
        for o in offsets {
            self.offsets.commit(
                &o.group,
                &o.topic,
                o.partition,
                Committed {
                    offset: o.offset,
                    metadata: o.metadata,
                },
            );
        }
        tracing::debug!(
            transactional_id = %markers.transactional_id,
            producer_id = markers.producer_id,
            commit = markers.commit,
            partitions = markers.partitions.len(),
            "transaction ended"
        );
        self.changed();
    }

    /// Runs a control command; the detail of its `ok` reply.
    pub(super) fn control(&mut self, command: Command, now: Instant) -> String {
        if command != Command::AbortTransactions {
            return self.faults.arm(command, now);
        }
        let aborted = self.coordinator.abort_all();
        tracing::info!(open = aborted.len(), "fault armed: abort-transactions");
        for markers in &aborted {
            tracing::info!(
                transactional_id = %markers.transactional_id,
                producer_id = markers.producer_id,
                "fault fired: abort-transactions: aborted, producer fenced"
            );
            self.end_transaction(markers, Vec::new());
        }
        format!("{} aborted", aborted.len())
    }

    /// Aborts the transactions open past their timeout (none while the broker is
    /// stalled: a paused broker times nothing out).
    pub(super) fn expire_transactions(&mut self, now: Instant) {
        if self.faults.stalled(now).is_some() {
            return;
        }
        for markers in self.coordinator.expire(now) {
            tracing::info!(
                transactional_id = %markers.transactional_id,
                producer_id = markers.producer_id,
                "transaction timed out: aborted, producer fenced"
            );
            self.end_transaction(&markers, Vec::new());
        }
    }
}
