//! Record batches (format v2) as the broker stores them: the bytes a producer sent,
//! split and validated, with the header fields the broker needs read out; and the
//! control batches (COMMIT/ABORT markers) it writes itself.
//!
//! The broker never decodes the records inside a produced batch. A v2 batch's CRC
//! covers everything from `attributes` on, so the two fields the broker assigns,
//! `baseOffset` and `partitionLeaderEpoch`, can be overwritten without recomputing it:
//! consumers get the producer's keys, values, headers (duplicates included) and
//! compressed payloads byte for byte, and no codec has to be built here.
//!
//! ```text
//! offset  field                 offset  field
//!      0  baseOffset       i64      35  maxTimestamp     i64
//!      8  batchLength      i32      43  producerId       i64
//!     12  partitionLeaderEpoch      51  producerEpoch    i16
//!     16  magic (2)        i8       53  baseSequence     i32
//!     17  crc (crc32c)     u32      57  recordCount      i32
//!     21  attributes       i16      61  records…
//!     23  lastOffsetDelta  i32
//!     27  baseTimestamp    i64
//! ```

use bytes::{Bytes, BytesMut};
use kafka_protocol::records::{
    Compression, Record, RecordBatchDecoder, RecordBatchEncoder, RecordEncodeOptions, TimestampType,
};

/// Bytes of a v2 batch header, up to the first record.
const HEADER_LEN: usize = 61;
/// `baseOffset` + `batchLength`: what `batchLength` does not count.
const LOG_OVERHEAD: usize = 12;
/// The partition leader epoch the broker writes (it never changes leader).
pub(super) const LEADER_EPOCH: i32 = 0;

/// Why a produced record set was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(super) enum BatchError {
    #[error("record set truncated: a batch needs {needed} bytes, {left} left")]
    Truncated { needed: usize, left: usize },
    #[error("record batch with magic {0}: only format v2 is supported")]
    Magic(i8),
    #[error("invalid record batch: {0}")]
    Invalid(String),
    #[error("a producer may not write control batches")]
    Control,
    #[error("empty record set")]
    Empty,
}

/// The header fields of one batch that the broker acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct BatchHeader {
    pub(super) last_offset_delta: i32,
    pub(super) max_timestamp: i64,
    pub(super) producer_id: i64,
    pub(super) producer_epoch: i16,
    pub(super) base_sequence: i32,
    pub(super) transactional: bool,
    pub(super) control: bool,
}

impl BatchHeader {
    /// Whether the batch carries a producer id (idempotent or transactional).
    pub(super) fn has_producer_id(&self) -> bool {
        self.producer_id >= 0
    }

    /// The sequence number of the batch's last record. Sequences wrap from
    /// `i32::MAX` to 0, as in Kafka.
    pub(super) fn last_sequence(&self) -> i32 {
        add_sequence(self.base_sequence, self.last_offset_delta)
    }
}

/// `seq + n` with Kafka's wrap-around after `i32::MAX` (to 0, never negative).
pub(super) fn add_sequence(seq: i32, n: i32) -> i32 {
    let sum = i64::from(seq) + i64::from(n);
    let wrapped = sum.rem_euclid(i64::from(i32::MAX) + 1);
    // rem_euclid by 2^31 is within 0..=i32::MAX.
    i32::try_from(wrapped).unwrap_or(0)
}

/// One validated batch as produced (its own bytes, `baseOffset` not yet assigned).
#[derive(Debug, Clone)]
pub(super) struct Batch {
    pub(super) header: BatchHeader,
    pub(super) bytes: Bytes,
}

impl Batch {
    /// The batch's bytes with the broker's `baseOffset` and leader epoch written in
    /// (neither is covered by the CRC).
    pub(super) fn with_base_offset(&self, base_offset: i64) -> Bytes {
        let mut out = BytesMut::from(&self.bytes[..]);
        out[0..8].copy_from_slice(&base_offset.to_be_bytes());
        out[12..16].copy_from_slice(&LEADER_EPOCH.to_be_bytes());
        out.freeze()
    }
}

fn be_i16(b: &[u8], at: usize) -> Option<i16> {
    Some(i16::from_be_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn be_i32(b: &[u8], at: usize) -> Option<i32> {
    Some(i32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn be_i64(b: &[u8], at: usize) -> Option<i64> {
    Some(i64::from_be_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Splits a produced record set into its batches and validates each: format v2,
/// lengths, CRC (through kafka-protocol's header decoder, which checks it without
/// decompressing), at least one record, not a control batch.
pub(super) fn split(records: &Bytes) -> Result<Vec<Batch>, BatchError> {
    let mut batches = Vec::new();
    let mut at = 0;
    while at < records.len() {
        let rest = &records[at..];
        if rest.len() < HEADER_LEN {
            return Err(BatchError::Truncated {
                needed: HEADER_LEN,
                left: rest.len(),
            });
        }
        let magic = rest.get(16).map_or(-1, |&b| i8::from_be_bytes([b]));
        if magic != 2 {
            return Err(BatchError::Magic(magic));
        }
        let length = be_i32(rest, 8).unwrap_or(-1);
        let total = usize::try_from(length)
            .ok()
            .and_then(|l| l.checked_add(LOG_OVERHEAD))
            .filter(|&t| t >= HEADER_LEN)
            .ok_or_else(|| BatchError::Invalid(format!("batch length {length}")))?;
        if total > rest.len() {
            return Err(BatchError::Truncated {
                needed: total,
                left: rest.len(),
            });
        }
        let bytes = records.slice(at..at + total);
        let info = RecordBatchDecoder::decode_batch_info(&mut bytes.clone())
            .map_err(|e| BatchError::Invalid(e.to_string()))?;
        let Some(info) = info.first() else {
            return Err(BatchError::Invalid("no batch header".into()));
        };
        let header = BatchHeader {
            last_offset_delta: be_i32(&bytes, 23).unwrap_or(-1),
            max_timestamp: be_i64(&bytes, 35).unwrap_or(-1),
            producer_id: info.producer_id,
            producer_epoch: info.producer_epoch,
            base_sequence: info.base_sequence,
            transactional: info.transactional,
            control: info.control,
        };
        if header.control {
            return Err(BatchError::Control);
        }
        if info.record_count < 1 || header.last_offset_delta != info.record_count - 1 {
            return Err(BatchError::Invalid(format!(
                "{} records with last offset delta {}",
                info.record_count, header.last_offset_delta
            )));
        }
        // Guard the fields read by hand as well (cannot fail after the length check).
        if be_i16(&bytes, 21).is_none() {
            return Err(BatchError::Invalid("short header".into()));
        }
        batches.push(Batch { header, bytes });
        at += total;
    }
    if batches.is_empty() {
        return Err(BatchError::Empty);
    }
    Ok(batches)
}

/// The control record types of KIP-98.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum MarkerType {
    Abort = 0,
    Commit = 1,
}

/// A control batch with one COMMIT or ABORT record at `offset`: attributes
/// transactional + control, key = version 0 + type, value = version 0 +
/// coordinator epoch, base sequence -1 (what librdkafka's msgset reader expects).
pub(super) fn control_batch(
    offset: i64,
    producer_id: i64,
    producer_epoch: i16,
    marker: MarkerType,
    coordinator_epoch: i32,
    timestamp_ms: i64,
) -> Result<Bytes, BatchError> {
    let mut key = Vec::with_capacity(4);
    key.extend_from_slice(&0i16.to_be_bytes());
    key.extend_from_slice(&(marker as i16).to_be_bytes());
    let mut value = Vec::with_capacity(6);
    value.extend_from_slice(&0i16.to_be_bytes());
    value.extend_from_slice(&coordinator_epoch.to_be_bytes());
    let record = Record {
        transactional: true,
        control: true,
        delete_horizon: false,
        partition_leader_epoch: LEADER_EPOCH,
        producer_id,
        producer_epoch,
        timestamp_type: TimestampType::Creation,
        offset,
        sequence: -1,
        timestamp: timestamp_ms,
        key: Some(Bytes::from(key)),
        value: Some(Bytes::from(value)),
        headers: Default::default(),
    };
    let mut buf = BytesMut::new();
    let options = RecordEncodeOptions {
        version: 2,
        compression: Compression::None,
    };
    RecordBatchEncoder::encode(&mut buf, [&record], &options)
        .map_err(|e| BatchError::Invalid(e.to_string()))?;
    Ok(buf.freeze())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use kafka_protocol::indexmap::IndexMap;

    /// A produced batch of `count` records (test helper shared by the other modules).
    pub(crate) fn produced(
        producer_id: i64,
        epoch: i16,
        base_sequence: i32,
        count: i32,
        transactional: bool,
    ) -> Bytes {
        let records: Vec<Record> = (0..count)
            .map(|i| Record {
                transactional,
                control: false,
                delete_horizon: false,
                partition_leader_epoch: -1,
                producer_id,
                producer_epoch: epoch,
                timestamp_type: TimestampType::Creation,
                offset: i64::from(i),
                sequence: base_sequence.wrapping_add(i),
                timestamp: 1_000 + i64::from(i),
                key: Some(Bytes::from(format!("k{i}"))),
                value: Some(Bytes::from(format!("v{i}"))),
                headers: IndexMap::new(),
            })
            .collect();
        let mut buf = BytesMut::new();
        let options = RecordEncodeOptions {
            version: 2,
            compression: Compression::None,
        };
        RecordBatchEncoder::encode(&mut buf, records.iter(), &options).expect("encode");
        buf.freeze()
    }

    #[test]
    fn splits_and_reads_the_header() {
        let mut set = BytesMut::new();
        set.extend_from_slice(&produced(7, 2, 10, 3, true));
        set.extend_from_slice(&produced(7, 2, 13, 1, true));
        let batches = split(&set.freeze()).expect("valid");
        assert_eq!(batches.len(), 2);
        let h = batches[0].header;
        assert_eq!(
            (h.producer_id, h.producer_epoch, h.base_sequence),
            (7, 2, 10)
        );
        assert_eq!((h.last_offset_delta, h.last_sequence()), (2, 12));
        assert!(h.transactional && !h.control);
        assert_eq!(h.max_timestamp, 1_002);
    }

    #[test]
    fn rewriting_the_base_offset_keeps_the_crc_valid() {
        let batches = split(&produced(1, 0, 0, 2, false)).expect("valid");
        let stored = batches[0].with_base_offset(1234);
        let info = RecordBatchDecoder::decode_batch_info(&mut stored.clone()).expect("crc");
        assert_eq!(info[0].min_offset, 1234);
        assert_eq!(info[0].partition_leader_epoch, LEADER_EPOCH);
    }

    #[test]
    fn refuses_corrupt_truncated_and_old_batches() {
        let good = produced(1, 0, 0, 2, false);
        let mut corrupt = BytesMut::from(&good[..]);
        let last = corrupt.len() - 1;
        corrupt[last] ^= 0xff;
        assert!(matches!(
            split(&corrupt.freeze()),
            Err(BatchError::Invalid(_))
        ));
        assert!(matches!(
            split(&good.slice(..good.len() - 1)),
            Err(BatchError::Truncated { .. })
        ));
        assert!(matches!(
            split(&good.slice(..20)),
            Err(BatchError::Truncated { .. })
        ));
        let mut old = BytesMut::from(&good[..]);
        old[16] = 1;
        assert_eq!(split(&old.freeze()).err(), Some(BatchError::Magic(1)));
        let mut negative = BytesMut::from(&good[..]);
        negative[8..12].copy_from_slice(&(-5i32).to_be_bytes());
        assert!(matches!(
            split(&negative.freeze()),
            Err(BatchError::Invalid(_))
        ));
        assert_eq!(split(&Bytes::new()).err(), Some(BatchError::Empty));
    }

    #[test]
    fn refuses_produced_control_batches() {
        let marker = control_batch(0, 1, 0, MarkerType::Commit, 0, 5).expect("encode");
        assert_eq!(split(&marker).err(), Some(BatchError::Control));
    }

    #[test]
    fn control_batch_is_what_librdkafka_parses() {
        let marker = control_batch(42, 9, 3, MarkerType::Abort, 7, 5).expect("encode");
        let set = RecordBatchDecoder::decode(&mut marker.clone()).expect("decode");
        let r = &set.records[0];
        assert!(r.control && r.transactional);
        assert_eq!((r.offset, r.producer_id, r.producer_epoch), (42, 9, 3));
        assert_eq!(r.key.as_deref(), Some(&[0u8, 0, 0, 0][..]));
        assert_eq!(r.value.as_deref(), Some(&[0u8, 0, 0, 0, 0, 7][..]));
        assert_eq!(be_i32(&marker, 53), Some(-1), "base sequence");
    }

    #[test]
    fn sequences_wrap_at_i32_max() {
        assert_eq!(add_sequence(5, 1), 6);
        assert_eq!(add_sequence(i32::MAX, 1), 0);
        assert_eq!(add_sequence(i32::MAX - 1, 3), 1);
    }
}
