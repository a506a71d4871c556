//! The ack tracker: transactions in commit order, and the watermark they allow.
//!
//! # The watermark rule
//!
//! The slot's `confirmed_flush_lsn` is the only durable progress the relay has. When a
//! walsender (re)starts logical decoding it begins at that LSN and *skips every transaction
//! whose commit record starts before it* (`DecodeTXNNeedSkip` → `SnapBuildXactNeedsSkip(
//! buf->origptr < start_decoding_at)` in `src/backend/replication/logical/decode.c`);
//! everything committed at or after it is sent again. So reporting `flush = X` means "never
//! send me a transaction that committed before X", and the core may only report the
//! `end_lsn` of transaction T once T **and every transaction before it** is resolved.
//!
//! The ack tracker is a queue of transactions in commit order, each `{end_lsn, pending}`:
//! `end_lsn` is unknown while the transaction is open (its `Commit` not read yet), `pending`
//! counts its unresolved events. Acks may arrive in any order; each only decrements a count.
//! The front is popped while it is committed and has nothing pending, and the confirmed LSN
//! becomes its `end_lsn`. A transaction can be larger than the in-flight window: its first
//! events are acked (and leave the window) before its `Commit` is read, but its entry
//! cannot be popped until the `Commit` gives it an `end_lsn`.
//!
//! # Idle advance, and why only when nothing is open or pending
//!
//! If the outbox is quiet but the rest of the cluster writes WAL, the slot would pin all of
//! it (promise 4, `docs/architecture.md#promises`). A primary keepalive carries `wal_end`, for a logical
//! walsender its `sentPtr`: the end of the last WAL record it has decoded (`WalSndKeepalive`
//! in `walsender.c`). The stream is ordered, so every transaction whose commit record lies
//! before that point has already been sent to us ahead of the keepalive, and any
//! transaction not yet sent commits at or after it and would be re-sent after a restart.
//! Hence, when **every** transaction received so far is resolved and none is open, the
//! keepalive's `wal_end` (or an XLogData's `wal_end`, see [`Core::received`]) may become the
//! confirmed LSN. Never otherwise:
//!
//! * with an unresolved event pending, `wal_end` may be past that event's commit, and
//!   confirming it would skip the transaction on restart;
//! * with a transaction open, even one whose rows so far are all acked. An XLogData's
//!   `wal_end` is the position logical decoding wrote the message at (`WalSndPrepareWrite`;
//!   `0/0` when it is not the callback's last write), and for a `Commit` that is the
//!   transaction's `end_lsn`, fed by the shell before `commit()`. The pending check alone
//!   covers the orderings a correct shell produces; refusing while open as well keeps the
//!   rule independent of whether the shell feeds `received()` before or after a payload and
//!   of what a server version puts in `wal_end` mid-transaction, and costs nothing (the
//!   `Commit` itself, or the next keepalive, moves the watermark).

use std::time::Instant;

use super::core::{Core, OpenTx, TxEntry};
use super::error::ProtocolError;
use crate::lsn::Lsn;

impl Core {
    /// pgoutput `Begin`.
    pub fn begin(&mut self, final_lsn: Lsn, xid: u32) -> Result<(), ProtocolError> {
        if let Some(open) = self.open {
            return Err(ProtocolError::BeginInsideTransaction {
                open_xid: open.xid,
                open_final_lsn: open.final_lsn,
                xid,
                final_lsn,
            });
        }
        if let Some(previous_end) = self.last_commit_end
            && final_lsn < previous_end
        {
            return Err(ProtocolError::CommitLsnWentBackwards {
                xid,
                final_lsn,
                previous_end,
            });
        }
        let seq = self.next_tx_seq;
        // 2^64 transactions cannot be read; wrapping keeps this panic-free regardless.
        self.next_tx_seq = self.next_tx_seq.wrapping_add(1);
        self.txs.insert(
            seq,
            TxEntry {
                end_lsn: None,
                pending: 0,
            },
        );
        self.open = Some(OpenTx {
            xid,
            final_lsn,
            seq,
        });
        self.resend.begin(final_lsn);
        Ok(())
    }

    /// pgoutput `Commit`: `commit_lsn` must equal `Begin`'s final LSN; `end_lsn` is what
    /// the watermark becomes once this transaction and all before it are resolved.
    pub fn commit(
        &mut self,
        commit_lsn: Lsn,
        end_lsn: Lsn,
        now: Instant,
    ) -> Result<(), ProtocolError> {
        let Some(open) = self.open else {
            return Err(ProtocolError::CommitWithoutBegin {
                commit_lsn,
                end_lsn,
            });
        };
        if commit_lsn != open.final_lsn {
            return Err(ProtocolError::CommitLsnMismatch {
                xid: open.xid,
                final_lsn: open.final_lsn,
                commit_lsn,
            });
        }
        if end_lsn <= commit_lsn {
            return Err(ProtocolError::CommitEndNotAfterCommit {
                xid: open.xid,
                commit_lsn,
                end_lsn,
            });
        }
        self.open = None;
        self.resend.commit();
        self.last_commit_end = Some(end_lsn);
        self.written = self.written.max(end_lsn);
        self.txs
            .entry(open.seq)
            .or_insert(TxEntry {
                end_lsn: None,
                pending: 0,
            })
            .end_lsn = Some(end_lsn);
        self.settle(open.seq);
        self.poll_status(now);
        Ok(())
    }

    /// A primary keepalive. `wal_end` may become the watermark when nothing is open or
    /// pending (idle advance); `reply_requested` schedules a status update at once.
    pub fn keepalive(&mut self, wal_end: Lsn, reply_requested: bool, now: Instant) {
        self.written = self.written.max(wal_end);
        self.idle_advance(wal_end);
        if reply_requested {
            self.schedule_status(now);
        } else {
            self.poll_status(now);
        }
    }

    /// The `wal_end` of an XLogData message. Call it before processing the message's
    /// payload; it feeds the status `write` field and, when idle, the watermark.
    pub fn received(&mut self, wal_end: Lsn) {
        self.written = self.written.max(wal_end);
        self.idle_advance(wal_end);
    }

    /// If the entry `seq` is committed with nothing pending, folds it away: at the front
    /// the watermark becomes its end; elsewhere the entry before it takes over its end
    /// (that entry is committed, since only the last entry can be open), which keeps every
    /// remaining entry but the open one holding an unresolved event.
    pub(super) fn settle(&mut self, seq: u64) {
        let Some(&TxEntry {
            end_lsn: Some(end),
            pending: 0,
        }) = self.txs.get(&seq)
        else {
            return;
        };
        self.txs.remove(&seq);
        match self.txs.range_mut(..seq).next_back() {
            None => self.advance(end),
            Some((_, before)) => {
                // Unreachable `None` (an open entry before a committed one) would keep the
                // smaller end: a late confirmation, never an early one.
                if let Some(before_end) = before.end_lsn.as_mut() {
                    *before_end = (*before_end).max(end);
                }
            }
        }
    }

    fn idle_advance(&mut self, wal_end: Lsn) {
        if self.open.is_none() && self.txs.is_empty() && self.events.is_empty() {
            self.advance(wal_end);
        }
    }

    /// The watermark moves to `to` (never back); what the resend guard remembers of
    /// the transactions before it is dropped.
    fn advance(&mut self, to: Lsn) {
        if to > self.confirmed {
            self.confirmed = to;
            self.resend.confirmed(to);
        }
    }
}
