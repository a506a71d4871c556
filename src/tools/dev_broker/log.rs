//! One partition's log: stored batches with their offsets, the high watermark, the
//! open transactions that hold back the last stable offset (LSO), and the aborted
//! transactions that read_committed fetches must report.
//!
//! Offsets: the log starts at 0 and is never truncated, so the log start offset is
//! always 0 and every offset below the high watermark is readable. With one replica,
//! an appended batch is committed at once: the high watermark is the log end.
//!
//! The LSO is the first offset of the earliest transaction still open on this
//! partition (or the high watermark when none is): read_committed consumers read up
//! to it and no further. An aborted transaction is remembered as (producer id, first
//! offset, offset of its ABORT marker); a Fetch lists those that overlap the range
//! it returns, and librdkafka skips that producer's transactional batches from the
//! first offset up to the marker (`rdkafka_msgset_reader.c`).

use std::collections::{BTreeMap, HashMap};

use bytes::Bytes;

use super::batch::{self, Batch, BatchError, MarkerType};
use super::sequence::{ProducerSequences, SequenceCheck, SequenceError};

/// A batch in the log, with the broker's offsets written in.
#[derive(Debug, Clone)]
struct StoredBatch {
    base_offset: i64,
    last_offset: i64,
    max_timestamp: i64,
    control: bool,
    bytes: Bytes,
}

/// An aborted transaction on this partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct AbortedTxn {
    pub(super) producer_id: i64,
    pub(super) first_offset: i64,
    /// The offset of the ABORT marker.
    pub(super) last_offset: i64,
}

/// Why an append was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(super) enum AppendError {
    #[error(transparent)]
    Sequence(#[from] SequenceError),
    #[error(transparent)]
    Batch(#[from] BatchError),
}

/// What an accepted append did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Appended {
    /// Written at this base offset.
    New { base_offset: i64 },
    /// A retry of a batch already at this base offset; nothing written.
    Duplicate { base_offset: i64 },
}

impl Appended {
    pub(super) fn base_offset(self) -> i64 {
        match self {
            Appended::New { base_offset } | Appended::Duplicate { base_offset } => base_offset,
        }
    }
}

/// The batches a read returns.
#[derive(Debug, Default)]
pub(super) struct Read {
    pub(super) batches: Vec<Bytes>,
    pub(super) bytes: usize,
    /// One past the last offset returned (the read's upper bound).
    pub(super) end_offset: i64,
}

/// One partition's log.
#[derive(Debug, Default)]
pub(super) struct PartitionLog {
    batches: Vec<StoredBatch>,
    high_watermark: i64,
    /// Producer id → first offset of its open transaction on this partition.
    open: BTreeMap<i64, i64>,
    aborted: Vec<AbortedTxn>,
    producers: HashMap<i64, ProducerSequences>,
}

impl PartitionLog {
    pub(super) fn high_watermark(&self) -> i64 {
        self.high_watermark
    }

    pub(super) fn log_start_offset(&self) -> i64 {
        0
    }

    /// The last stable offset: the first offset of the earliest open transaction,
    /// or the high watermark.
    pub(super) fn last_stable_offset(&self) -> i64 {
        self.open
            .values()
            .min()
            .copied()
            .unwrap_or(self.high_watermark)
    }

    /// The readable end for an isolation level (0 read_uncommitted, 1 read_committed).
    pub(super) fn end_for(&self, isolation_level: i8) -> i64 {
        if isolation_level == 1 {
            self.last_stable_offset()
        } else {
            self.high_watermark
        }
    }

    /// Appends a produced batch after the idempotence check (the caller has made
    /// the cross-partition checks: issued producer id, epoch, transaction state).
    pub(super) fn append(&mut self, batch: &Batch) -> Result<Appended, AppendError> {
        let header = batch.header;
        if header.has_producer_id() {
            let state = self.producers.get(&header.producer_id);
            if let SequenceCheck::Duplicate { base_offset } =
                ProducerSequences::check(state, &header)?
            {
                return Ok(Appended::Duplicate { base_offset });
            }
        }
        let base_offset = self.high_watermark;
        let last_offset = base_offset + i64::from(header.last_offset_delta);
        self.batches.push(StoredBatch {
            base_offset,
            last_offset,
            max_timestamp: header.max_timestamp,
            control: false,
            bytes: batch.with_base_offset(base_offset),
        });
        self.high_watermark = last_offset + 1;
        if header.has_producer_id() {
            self.producers
                .entry(header.producer_id)
                .or_default()
                .record(&header, base_offset);
            if header.transactional {
                self.open.entry(header.producer_id).or_insert(base_offset);
            }
        }
        Ok(Appended::New { base_offset })
    }

    /// Ends `producer_id`'s transaction on this partition: writes the COMMIT or
    /// ABORT marker and, for an abort of a transaction that wrote here, records the
    /// aborted range. Returns the marker's offset.
    pub(super) fn write_marker(
        &mut self,
        producer_id: i64,
        producer_epoch: i16,
        marker: MarkerType,
        timestamp_ms: i64,
    ) -> Result<i64, BatchError> {
        let offset = self.high_watermark;
        let bytes =
            batch::control_batch(offset, producer_id, producer_epoch, marker, 0, timestamp_ms)?;
        self.batches.push(StoredBatch {
            base_offset: offset,
            last_offset: offset,
            max_timestamp: timestamp_ms,
            control: true,
            bytes,
        });
        self.high_watermark = offset + 1;
        if let Some(first_offset) = self.open.remove(&producer_id)
            && marker == MarkerType::Abort
        {
            self.aborted.push(AbortedTxn {
                producer_id,
                first_offset,
                last_offset: offset,
            });
        }
        self.producers
            .entry(producer_id)
            .or_insert_with(|| ProducerSequences::at_epoch(producer_epoch))
            .record_marker(producer_epoch);
        Ok(offset)
    }

    /// Whole batches from the one holding `from` up to `end` (exclusive), at most
    /// about `max_bytes` (always the first batch, as Kafka does since KIP-74, so a
    /// batch larger than the limit cannot stall a consumer).
    pub(super) fn read(&self, from: i64, end: i64, max_bytes: usize) -> Read {
        let start = self.batches.partition_point(|b| b.last_offset < from);
        let mut read = Read {
            end_offset: from,
            ..Read::default()
        };
        for b in self.batches.iter().skip(start) {
            if b.base_offset >= end {
                break;
            }
            if !read.batches.is_empty() && read.bytes + b.bytes.len() > max_bytes {
                break;
            }
            read.bytes += b.bytes.len();
            read.batches.push(b.bytes.clone());
            read.end_offset = b.last_offset + 1;
        }
        read
    }

    /// The aborted transactions that overlap `[from, end)`, as (producer id, first
    /// offset), oldest first.
    pub(super) fn aborted_between(&self, from: i64, end: i64) -> Vec<(i64, i64)> {
        self.aborted
            .iter()
            .filter(|a| a.last_offset >= from && a.first_offset < end)
            .map(|a| (a.producer_id, a.first_offset))
            .collect()
    }

    /// The first offset of the first data batch whose max timestamp is at least
    /// `timestamp` (batch granularity), with that timestamp; `None` past the end.
    pub(super) fn offset_for_timestamp(&self, timestamp: i64) -> Option<(i64, i64)> {
        self.batches
            .iter()
            .find(|b| !b.control && b.max_timestamp >= timestamp)
            .map(|b| (b.base_offset, b.max_timestamp))
    }

    /// The first offset of the data batch with the largest timestamp (`-3`,
    /// KIP-734), with that timestamp (batch granularity).
    pub(super) fn max_timestamp(&self) -> Option<(i64, i64)> {
        self.batches
            .iter()
            .filter(|b| !b.control)
            .fold(None, |best: Option<(i64, i64)>, b| match best {
                Some((_, ts)) if ts >= b.max_timestamp => best,
                _ => Some((b.base_offset, b.max_timestamp)),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::super::batch::tests::produced;
    use super::*;

    fn batch(pid: i64, epoch: i16, seq: i32, count: i32, txn: bool) -> Batch {
        batch::split(&produced(pid, epoch, seq, count, txn))
            .expect("valid")
            .remove(0)
    }

    #[test]
    fn offsets_and_duplicates() {
        let mut log = PartitionLog::default();
        assert_eq!(
            log.append(&batch(1, 0, 0, 3, false)),
            Ok(Appended::New { base_offset: 0 })
        );
        assert_eq!(
            log.append(&batch(1, 0, 3, 2, false)),
            Ok(Appended::New { base_offset: 3 })
        );
        assert_eq!(
            log.append(&batch(1, 0, 0, 3, false)),
            Ok(Appended::Duplicate { base_offset: 0 })
        );
        assert_eq!(log.high_watermark(), 5);
        assert!(matches!(
            log.append(&batch(1, 0, 9, 1, false)),
            Err(AppendError::Sequence(SequenceError::OutOfOrder {
                expected: 5,
                ..
            }))
        ));
        // Non-idempotent producers are not checked.
        assert!(log.append(&batch(-1, -1, -1, 1, false)).is_ok());
        assert!(log.append(&batch(-1, -1, -1, 1, false)).is_ok());
        assert_eq!(log.high_watermark(), 7);
    }

    #[test]
    fn open_transaction_holds_the_lso() {
        let mut log = PartitionLog::default();
        log.append(&batch(1, 0, 0, 2, false)).expect("append");
        log.append(&batch(2, 0, 0, 2, true)).expect("append"); // txn at 2..=3
        log.append(&batch(1, 0, 2, 3, false)).expect("append"); // 4..=6
        assert_eq!((log.last_stable_offset(), log.high_watermark()), (2, 7));
        assert_eq!(log.end_for(1), 2);
        assert_eq!(log.end_for(0), 7);
        let committed = log.read(0, log.end_for(1), usize::MAX);
        assert_eq!((committed.batches.len(), committed.end_offset), (1, 2));
        let marker = log
            .write_marker(2, 0, MarkerType::Commit, 0)
            .expect("marker");
        assert_eq!(marker, 7);
        assert_eq!(log.last_stable_offset(), 8);
        assert!(log.aborted_between(0, 8).is_empty());
    }

    #[test]
    fn earliest_open_transaction_wins() {
        let mut log = PartitionLog::default();
        log.append(&batch(2, 0, 0, 1, true)).expect("append"); // 0
        log.append(&batch(3, 0, 0, 1, true)).expect("append"); // 1
        log.write_marker(3, 0, MarkerType::Commit, 0)
            .expect("marker"); // 2
        assert_eq!(log.last_stable_offset(), 0);
        log.write_marker(2, 0, MarkerType::Abort, 0)
            .expect("marker"); // 3
        assert_eq!(log.last_stable_offset(), 4);
    }

    #[test]
    fn aborted_ranges_overlapping_the_read() {
        let mut log = PartitionLog::default();
        log.append(&batch(5, 0, 0, 2, true)).expect("append"); // 0..=1
        log.write_marker(5, 0, MarkerType::Abort, 0)
            .expect("marker"); // 2
        log.append(&batch(1, 0, 0, 2, false)).expect("append"); // 3..=4
        log.append(&batch(5, 0, 2, 1, true)).expect("append"); // 5
        log.write_marker(5, 0, MarkerType::Abort, 0)
            .expect("marker"); // 6
        assert_eq!(log.aborted_between(0, 7), vec![(5, 0), (5, 5)]);
        assert_eq!(log.aborted_between(3, 5), Vec::<(i64, i64)>::new());
        assert_eq!(log.aborted_between(2, 3), vec![(5, 0)]);
        assert_eq!(log.aborted_between(4, 7), vec![(5, 5)]);
        // An abort with nothing written here leaves no range.
        log.write_marker(9, 0, MarkerType::Abort, 0)
            .expect("marker");
        assert_eq!(log.aborted_between(0, 8).len(), 2);
    }

    #[test]
    fn read_starts_at_the_batch_holding_the_offset_and_respects_max_bytes() {
        let mut log = PartitionLog::default();
        for seq in [0, 3, 6] {
            log.append(&batch(1, 0, seq, 3, false)).expect("append");
        }
        let r = log.read(4, 9, usize::MAX);
        assert_eq!((r.batches.len(), r.end_offset), (2, 9));
        let one = log.read(0, 9, 1);
        assert_eq!((one.batches.len(), one.end_offset), (1, 3));
        let none = log.read(9, 9, usize::MAX);
        assert!(none.batches.is_empty());
        assert_eq!(none.end_offset, 9);
    }

    #[test]
    fn a_fencing_marker_moves_the_producer_to_its_new_epoch() {
        let mut log = PartitionLog::default();
        log.append(&batch(2, 0, 0, 1, true)).expect("append");
        log.write_marker(2, 1, MarkerType::Abort, 0)
            .expect("marker");
        assert!(matches!(
            log.append(&batch(2, 0, 1, 1, true)),
            Err(AppendError::Sequence(SequenceError::StaleEpoch { .. }))
        ));
        assert!(log.append(&batch(2, 1, 0, 1, true)).is_ok());
    }

    #[test]
    fn timestamps() {
        let mut log = PartitionLog::default();
        log.append(&batch(1, 0, 0, 3, false)).expect("append"); // ts 1000..=1002
        log.append(&batch(1, 0, 3, 5, false)).expect("append"); // ts 1000..=1004
        assert_eq!(log.offset_for_timestamp(1002), Some((0, 1002)));
        assert_eq!(log.offset_for_timestamp(1003), Some((3, 1004)));
        assert_eq!(log.offset_for_timestamp(2000), None);
        assert_eq!(log.max_timestamp(), Some((3, 1004)));
    }
}
