//! Idempotent-producer sequence checks for one partition (KIP-98's producer state):
//! per producer id, the epoch and the sequence ranges of its last five batches, so a
//! retried batch is recognised (and answered with its original offset, not written
//! twice) and a gap is refused. The cross-partition rules (which producer ids were
//! issued, fencing) are [`super::txn`]'s.

use std::collections::VecDeque;

use super::batch::{BatchHeader, add_sequence};

/// How many batches per producer a partition remembers: librdkafka keeps at most
/// `max.in.flight.requests.per.connection` = 5 batches in flight with idempotence.
const REMEMBERED_BATCHES: usize = 5;

/// A batch whose sequence the partition cannot accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(super) enum SequenceError {
    #[error("producer {producer_id}: sequence {got}, expected {expected}")]
    OutOfOrder {
        producer_id: i64,
        expected: i32,
        got: i32,
    },
    #[error("producer {producer_id}: epoch {got} is older than {current}")]
    StaleEpoch {
        producer_id: i64,
        current: i16,
        got: i16,
    },
}

/// What the partition does with a batch that passed the check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SequenceCheck {
    /// Write it.
    Append,
    /// A retry of a batch already written at this base offset: do not write again.
    Duplicate { base_offset: i64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Written {
    first_sequence: i32,
    last_sequence: i32,
    base_offset: i64,
}

/// One producer id's state in one partition.
#[derive(Debug, Clone, Default)]
pub(super) struct ProducerSequences {
    epoch: i16,
    recent: VecDeque<Written>,
}

impl ProducerSequences {
    /// Checks `batch` against this state (`None`: the producer has not written here).
    pub(super) fn check(
        state: Option<&ProducerSequences>,
        batch: &BatchHeader,
    ) -> Result<SequenceCheck, SequenceError> {
        let first = batch.base_sequence;
        let out_of_order = |expected| SequenceError::OutOfOrder {
            producer_id: batch.producer_id,
            expected,
            got: first,
        };
        let Some(state) = state else {
            return if first == 0 {
                Ok(SequenceCheck::Append)
            } else {
                Err(out_of_order(0))
            };
        };
        if batch.producer_epoch < state.epoch {
            return Err(SequenceError::StaleEpoch {
                producer_id: batch.producer_id,
                current: state.epoch,
                got: batch.producer_epoch,
            });
        }
        if batch.producer_epoch > state.epoch {
            // A new epoch (a new transactional session, or KIP-360's bump of an
            // idempotent producer) starts its sequences again at 0.
            return if first == 0 {
                Ok(SequenceCheck::Append)
            } else {
                Err(out_of_order(0))
            };
        }
        let last = batch.last_sequence();
        if let Some(w) = state
            .recent
            .iter()
            .find(|w| w.first_sequence == first && w.last_sequence == last)
        {
            return Ok(SequenceCheck::Duplicate {
                base_offset: w.base_offset,
            });
        }
        let expected = state
            .recent
            .back()
            .map_or(0, |w| add_sequence(w.last_sequence, 1));
        if first == expected {
            Ok(SequenceCheck::Append)
        } else {
            Err(out_of_order(expected))
        }
    }

    /// Records a batch written at `base_offset` (after [`Self::check`] said `Append`).
    pub(super) fn record(&mut self, batch: &BatchHeader, base_offset: i64) {
        if batch.producer_epoch != self.epoch {
            self.epoch = batch.producer_epoch;
            self.recent.clear();
        }
        if self.recent.len() == REMEMBERED_BATCHES {
            self.recent.pop_front();
        }
        self.recent.push_back(Written {
            first_sequence: batch.base_sequence,
            last_sequence: batch.last_sequence(),
            base_offset,
        });
    }

    /// Records a transaction marker written with `epoch` (a fencing bump moves the
    /// producer to the new epoch, whose sequences start at 0).
    pub(super) fn record_marker(&mut self, epoch: i16) {
        if epoch > self.epoch {
            self.epoch = epoch;
            self.recent.clear();
        }
    }

    /// A fresh state for a producer whose first write here is a marker.
    pub(super) fn at_epoch(epoch: i16) -> ProducerSequences {
        ProducerSequences {
            epoch,
            recent: VecDeque::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(epoch: i16, base_sequence: i32, records: i32) -> BatchHeader {
        BatchHeader {
            last_offset_delta: records - 1,
            max_timestamp: 0,
            producer_id: 1,
            producer_epoch: epoch,
            base_sequence,
            transactional: false,
            control: false,
        }
    }

    #[test]
    fn first_batch_must_start_at_zero() {
        assert_eq!(
            ProducerSequences::check(None, &header(0, 0, 3)),
            Ok(SequenceCheck::Append)
        );
        assert!(matches!(
            ProducerSequences::check(None, &header(0, 4, 3)),
            Err(SequenceError::OutOfOrder { expected: 0, .. })
        ));
    }

    #[test]
    fn in_order_duplicate_and_gap() {
        let mut s = ProducerSequences::default();
        s.record(&header(0, 0, 3), 10);
        s.record(&header(0, 3, 2), 13);
        assert_eq!(
            ProducerSequences::check(Some(&s), &header(0, 5, 1)),
            Ok(SequenceCheck::Append)
        );
        assert_eq!(
            ProducerSequences::check(Some(&s), &header(0, 0, 3)),
            Ok(SequenceCheck::Duplicate { base_offset: 10 })
        );
        assert_eq!(
            ProducerSequences::check(Some(&s), &header(0, 3, 2)),
            Ok(SequenceCheck::Duplicate { base_offset: 13 })
        );
        assert_eq!(
            ProducerSequences::check(Some(&s), &header(0, 7, 1)),
            Err(SequenceError::OutOfOrder {
                producer_id: 1,
                expected: 5,
                got: 7
            })
        );
    }

    #[test]
    fn remembers_only_the_last_five_batches() {
        let mut s = ProducerSequences::default();
        for i in 0..6 {
            s.record(&header(0, i, 1), i64::from(i));
        }
        assert!(ProducerSequences::check(Some(&s), &header(0, 0, 1)).is_err());
        assert_eq!(
            ProducerSequences::check(Some(&s), &header(0, 1, 1)),
            Ok(SequenceCheck::Duplicate { base_offset: 1 })
        );
    }

    #[test]
    fn new_epoch_restarts_at_zero_and_old_epoch_is_refused() {
        let mut s = ProducerSequences::default();
        s.record(&header(1, 0, 4), 0);
        assert_eq!(
            ProducerSequences::check(Some(&s), &header(2, 0, 1)),
            Ok(SequenceCheck::Append)
        );
        assert!(matches!(
            ProducerSequences::check(Some(&s), &header(2, 4, 1)),
            Err(SequenceError::OutOfOrder { expected: 0, .. })
        ));
        assert!(matches!(
            ProducerSequences::check(Some(&s), &header(0, 4, 1)),
            Err(SequenceError::StaleEpoch {
                current: 1,
                got: 0,
                ..
            })
        ));
        s.record_marker(3);
        assert!(matches!(
            ProducerSequences::check(Some(&s), &header(2, 4, 1)),
            Err(SequenceError::StaleEpoch { .. })
        ));
    }

    #[test]
    fn sequences_wrap() {
        let mut s = ProducerSequences::default();
        s.record(&header(0, i32::MAX - 1, 2), 0);
        assert_eq!(
            ProducerSequences::check(Some(&s), &header(0, 0, 1)),
            Ok(SequenceCheck::Append)
        );
    }
}
