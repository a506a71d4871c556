//! The CopyData payloads of the streaming replication protocol.
//!
//! After `START_REPLICATION SLOT … LOGICAL …` the server answers `CopyBothResponse`
//! and from then on both directions carry `CopyData` messages whose payload starts
//! with a one-byte tag. This module parses what the walsender sends and encodes what
//! the relay sends back; it does no I/O and never panics on any input.
//!
//! Server → client ([`ServerFrame`]):
//!
//! | tag | frame | body |
//! |---|---|---|
//! | `'w'` | XLogData | Int64 `wal_start`, Int64 `wal_end`, Int64 send time, then the data |
//! | `'k'` | Primary keepalive | Int64 `wal_end`, Int64 send time, Byte1 reply requested |
//!
//! Client → server ([`StandbyStatus`]):
//!
//! | tag | frame | body |
//! |---|---|---|
//! | `'r'` | Standby status update | Int64 write, Int64 flush, Int64 apply, Int64 client time, Byte1 reply requested |
//!
//! All integers are big-endian; times are microseconds since the PostgreSQL epoch,
//! 2000-01-01 00:00:00 UTC (see [`pg_epoch_micros`]).
//!
//! # What the LSNs mean for *logical* replication
//!
//! - **XLogData** carries exactly one output-plugin message (for `pgoutput`, one
//!   message decoded by [`crate::postgres::pgoutput`]). For logical walsenders `wal_start` and
//!   `wal_end` are both the position the plugin is writing for — a change's LSN, the
//!   transaction's first LSN for Begin, its end LSN for Commit — or `0/0` for a write
//!   that is not the last for that position (pgoutput's Relation and Type messages,
//!   sent ahead of a change). They are *not* a position to confirm: the relay confirms
//!   a transaction's Commit `end_lsn` once every event in it is resolved.
//! - **Keepalive** `wal_end` is how far the walsender has read and decoded the WAL.
//!   When nothing is in flight, confirming it lets an idle slot advance so it does not
//!   pin WAL. `reply_requested` means the server is about to hit
//!   `wal_sender_timeout` and wants a status update now.
//! - **Standby status update** positions are "last byte + 1", i.e. the position just
//!   past what was handled — exactly the Commit `end_lsn`. For a logical slot the
//!   server uses `flush` to advance `confirmed_flush_lsn`; the relay never reports a
//!   smaller value than it reported before.
//!
//! References:
//! - <https://www.postgresql.org/docs/current/protocol-replication.html>
//!   (section "Streaming Replication Protocol", `START_REPLICATION`)
//! - `src/backend/replication/walsender.c` (`WalSndPrepareWrite`, `WalSndKeepalive`)

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::lsn::Lsn;

/// Tag of an XLogData frame (server → client).
pub const XLOG_DATA: u8 = b'w';
/// Tag of a primary keepalive frame (server → client).
pub const PRIMARY_KEEPALIVE: u8 = b'k';
/// Tag of a standby status update frame (client → server).
pub const STANDBY_STATUS_UPDATE: u8 = b'r';

/// Seconds from the Unix epoch (1970-01-01) to the PostgreSQL epoch (2000-01-01).
pub const PG_EPOCH_UNIX_SECS: u64 = 946_684_800;

/// Microseconds from the Unix epoch to the PostgreSQL epoch.
const PG_EPOCH_UNIX_MICROS: i128 = 946_684_800_000_000;

/// Length of the XLogData header: tag + three Int64.
const XLOG_DATA_HEADER_LEN: usize = 1 + 8 + 8 + 8;
/// Length of a keepalive frame: tag + two Int64 + Byte1.
const KEEPALIVE_LEN: usize = 1 + 8 + 8 + 1;

/// A frame the walsender sends inside `CopyData` during `START_REPLICATION`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ServerFrame {
    /// `'w'`: one chunk of output-plugin data.
    XLogData {
        /// Position the output plugin wrote this data for (`0/0` for non-final writes).
        wal_start: Lsn,
        /// For logical replication, equal to `wal_start`; not a confirmable position.
        wal_end: Lsn,
        /// Server clock at transmission, microseconds since 2000-01-01.
        send_time: i64,
        /// The output-plugin message, a zero-copy slice of the frame.
        data: Bytes,
    },
    /// `'k'`: a keepalive, possibly asking for an immediate status update.
    Keepalive {
        /// How far the walsender has read the WAL.
        wal_end: Lsn,
        /// Server clock at transmission, microseconds since 2000-01-01.
        send_time: i64,
        /// The server wants a standby status update as soon as possible.
        reply_requested: bool,
    },
}

impl ServerFrame {
    /// Parses one `CopyData` payload received from the walsender.
    ///
    /// The XLogData body is returned as a slice of `buf`, without copying.
    ///
    /// # Errors
    ///
    /// [`FrameError`] when the payload is empty, has an unknown tag, is shorter than
    /// its fixed layout, or (keepalive) has bytes past its end.
    pub fn parse(buf: Bytes) -> Result<ServerFrame, FrameError> {
        let Some(&tag) = buf.first() else {
            return Err(FrameError::Empty);
        };
        match tag {
            XLOG_DATA => {
                let mut r = Reader::new(&buf, "XLogData", XLOG_DATA_HEADER_LEN)?;
                r.skip_tag();
                let wal_start = Lsn(r.u64()?);
                let wal_end = Lsn(r.u64()?);
                let send_time = r.i64()?;
                // The body is the rest of the frame: drop the header in place (a
                // pointer bump, no copy). `Reader::new` proved the length; the
                // check keeps `advance` panic-free regardless.
                let mut data = buf;
                if data.len() >= XLOG_DATA_HEADER_LEN {
                    data.advance(XLOG_DATA_HEADER_LEN);
                } else {
                    data = Bytes::new();
                }
                Ok(ServerFrame::XLogData {
                    wal_start,
                    wal_end,
                    send_time,
                    data,
                })
            }
            PRIMARY_KEEPALIVE => {
                let mut r = Reader::new(&buf, "keepalive", KEEPALIVE_LEN)?;
                r.skip_tag();
                let frame = ServerFrame::Keepalive {
                    wal_end: Lsn(r.u64()?),
                    send_time: r.i64()?,
                    reply_requested: r.u8()? != 0,
                };
                r.finish()?;
                Ok(frame)
            }
            other => Err(FrameError::UnknownTag { tag: other }),
        }
    }

    /// The frame's tag byte.
    #[must_use]
    pub const fn tag(&self) -> u8 {
        match self {
            ServerFrame::XLogData { .. } => XLOG_DATA,
            ServerFrame::Keepalive { .. } => PRIMARY_KEEPALIVE,
        }
    }
}

/// A standby status update (`'r'`): the relay's progress report to the walsender.
///
/// For a logical slot only `flush` moves `confirmed_flush_lsn`; `write` and `apply`
/// are shown in `pg_stat_replication`. Each position is "last byte + 1", i.e. a
/// Commit message's `end_lsn`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StandbyStatus {
    /// WAL received (and, for the relay, read) up to here.
    pub write: Lsn,
    /// WAL durably handled up to here: the slot may discard everything before it.
    pub flush: Lsn,
    /// WAL applied up to here.
    pub apply: Lsn,
    /// Client clock, microseconds since 2000-01-01 (see [`pg_epoch_micros`]).
    pub client_time_micros: i64,
    /// Ask the server to answer with a keepalive right away.
    pub reply_requested: bool,
}

impl StandbyStatus {
    /// Encoded size in bytes: tag + four Int64 + Byte1.
    pub const ENCODED_LEN: usize = 1 + 8 * 4 + 1;

    /// Appends the `CopyData` payload (tag included, CopyData header excluded).
    pub fn encode(&self, out: &mut BytesMut) {
        out.reserve(Self::ENCODED_LEN);
        out.put_u8(STANDBY_STATUS_UPDATE);
        out.put_u64(self.write.as_u64());
        out.put_u64(self.flush.as_u64());
        out.put_u64(self.apply.as_u64());
        out.put_i64(self.client_time_micros);
        out.put_u8(u8::from(self.reply_requested));
    }

    /// The encoded payload as a fresh buffer.
    #[must_use]
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(Self::ENCODED_LEN);
        self.encode(&mut out);
        out.freeze()
    }

    /// Parses a standby status update, as a fake walsender in tests would.
    ///
    /// # Errors
    ///
    /// [`FrameError`] when the payload is empty, is not tagged `'r'`, or does not have
    /// exactly [`Self::ENCODED_LEN`] bytes.
    pub fn parse(buf: &[u8]) -> Result<StandbyStatus, FrameError> {
        let Some(&tag) = buf.first() else {
            return Err(FrameError::Empty);
        };
        if tag != STANDBY_STATUS_UPDATE {
            return Err(FrameError::UnknownTag { tag });
        }
        let mut r = Reader::new(buf, "standby status update", Self::ENCODED_LEN)?;
        r.skip_tag();
        let status = StandbyStatus {
            write: Lsn(r.u64()?),
            flush: Lsn(r.u64()?),
            apply: Lsn(r.u64()?),
            client_time_micros: r.i64()?,
            reply_requested: r.u8()? != 0,
        };
        r.finish()?;
        Ok(status)
    }
}

/// Why a replication `CopyData` payload could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The payload had no tag byte.
    #[error("empty CopyData payload in the replication stream")]
    Empty,
    /// The tag is not one this module knows.
    #[error("unknown replication frame tag {tag:#04x} ({:?})", char::from(*tag))]
    UnknownTag {
        /// The tag byte received.
        tag: u8,
    },
    /// The payload is shorter than the frame's fixed layout.
    #[error("truncated {frame} frame: needs {needed} bytes, got {got}")]
    Truncated {
        /// Which frame.
        frame: &'static str,
        /// Bytes the fixed layout needs (tag included).
        needed: usize,
        /// Bytes received.
        got: usize,
    },
    /// The payload continues past the frame's fixed layout.
    #[error("{frame} frame has {extra} unexpected trailing bytes")]
    TrailingBytes {
        /// Which frame.
        frame: &'static str,
        /// Bytes past the end of the frame.
        extra: usize,
    },
}

/// Converts a wall-clock time to microseconds since the PostgreSQL epoch
/// (2000-01-01 00:00:00 UTC), the unit of every timestamp in the replication protocol.
///
/// Saturates at `i64::MIN` / `i64::MAX` (PostgreSQL's `-infinity` / `infinity`)
/// instead of overflowing; never panics.
#[must_use]
pub fn pg_epoch_micros(time: SystemTime) -> i64 {
    let unix_micros: i128 = match time.duration_since(UNIX_EPOCH) {
        Ok(after) => i128::try_from(after.as_micros()).unwrap_or(i128::MAX),
        Err(before) => {
            i128::try_from(before.duration().as_micros()).map_or(i128::MIN, i128::saturating_neg)
        }
    };
    let pg_micros = unix_micros.saturating_sub(PG_EPOCH_UNIX_MICROS);
    i64::try_from(pg_micros).unwrap_or(if pg_micros < 0 { i64::MIN } else { i64::MAX })
}

/// Converts microseconds since the PostgreSQL epoch back to wall-clock time, e.g. a
/// keepalive's `send_time`, to measure replication lag.
///
/// `None` when the platform's `SystemTime` cannot represent the instant.
#[must_use]
pub fn system_time_from_pg_micros(micros: i64) -> Option<SystemTime> {
    let unix_micros = i128::from(micros).checked_add(PG_EPOCH_UNIX_MICROS)?;
    let magnitude = Duration::from_micros(u64::try_from(unix_micros.unsigned_abs()).ok()?);
    if unix_micros >= 0 {
        UNIX_EPOCH.checked_add(magnitude)
    } else {
        UNIX_EPOCH.checked_sub(magnitude)
    }
}

/// A checked reader over a fixed-layout frame: every read is bounds-checked and
/// reports a typed error instead of panicking.
struct Reader<'a> {
    rest: &'a [u8],
    frame: &'static str,
    needed: usize,
    got: usize,
}

impl<'a> Reader<'a> {
    /// Starts reading `buf`, which must hold at least `needed` bytes.
    fn new(buf: &'a [u8], frame: &'static str, needed: usize) -> Result<Self, FrameError> {
        let reader = Reader {
            rest: buf,
            frame,
            needed,
            got: buf.len(),
        };
        if buf.len() < needed {
            return Err(reader.truncated());
        }
        Ok(reader)
    }

    fn truncated(&self) -> FrameError {
        FrameError::Truncated {
            frame: self.frame,
            needed: self.needed,
            got: self.got,
        }
    }

    /// Steps over the tag byte the caller already matched.
    fn skip_tag(&mut self) {
        if let Some((_, rest)) = self.rest.split_first() {
            self.rest = rest;
        }
    }

    fn u8(&mut self) -> Result<u8, FrameError> {
        let (&byte, rest) = self.rest.split_first().ok_or_else(|| self.truncated())?;
        self.rest = rest;
        Ok(byte)
    }

    fn be8(&mut self) -> Result<[u8; 8], FrameError> {
        let (&head, rest) = self
            .rest
            .split_first_chunk::<8>()
            .ok_or_else(|| self.truncated())?;
        self.rest = rest;
        Ok(head)
    }

    fn u64(&mut self) -> Result<u64, FrameError> {
        self.be8().map(u64::from_be_bytes)
    }

    fn i64(&mut self) -> Result<i64, FrameError> {
        self.be8().map(i64::from_be_bytes)
    }

    /// Rejects bytes past the end of a fixed-size frame.
    fn finish(self) -> Result<(), FrameError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(FrameError::TrailingBytes {
                frame: self.frame,
                extra: self.rest.len(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn xlog_data(wal_start: u64, wal_end: u64, send_time: i64, data: &[u8]) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(XLOG_DATA);
        b.put_u64(wal_start);
        b.put_u64(wal_end);
        b.put_i64(send_time);
        b.put_slice(data);
        b.freeze()
    }

    fn keepalive(wal_end: u64, send_time: i64, reply: u8) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(PRIMARY_KEEPALIVE);
        b.put_u64(wal_end);
        b.put_i64(send_time);
        b.put_u8(reply);
        b.freeze()
    }

    #[test]
    fn parses_xlog_data_without_copying() {
        let buf = xlog_data(0x16_B374_D848, 0x16_B374_D848, 7, b"B\x00payload");
        let frame = ServerFrame::parse(buf.clone()).expect("valid XLogData");
        let ServerFrame::XLogData {
            wal_start,
            wal_end,
            send_time,
            data,
        } = frame
        else {
            panic!("expected XLogData, got {frame:?}");
        };
        assert_eq!(wal_start, Lsn(0x16_B374_D848));
        assert_eq!(wal_end, Lsn(0x16_B374_D848));
        assert_eq!(send_time, 7);
        assert_eq!(&data[..], b"B\x00payload");
        // Zero-copy: the data points into the original buffer.
        assert_eq!(data.as_ptr(), buf[XLOG_DATA_HEADER_LEN..].as_ptr());
    }

    #[test]
    fn parses_xlog_data_with_empty_body() {
        let frame = ServerFrame::parse(xlog_data(1, 2, 3, b"")).expect("valid");
        assert_eq!(
            frame,
            ServerFrame::XLogData {
                wal_start: Lsn(1),
                wal_end: Lsn(2),
                send_time: 3,
                data: Bytes::new(),
            }
        );
        assert_eq!(frame.tag(), XLOG_DATA);
    }

    #[test]
    fn parses_keepalive() {
        let frame = ServerFrame::parse(keepalive(u64::MAX, -5, 1)).expect("valid");
        assert_eq!(
            frame,
            ServerFrame::Keepalive {
                wal_end: Lsn(u64::MAX),
                send_time: -5,
                reply_requested: true,
            }
        );
        assert_eq!(frame.tag(), PRIMARY_KEEPALIVE);
        let quiet = ServerFrame::parse(keepalive(9, 0, 0)).expect("valid");
        assert!(matches!(
            quiet,
            ServerFrame::Keepalive {
                reply_requested: false,
                ..
            }
        ));
    }

    #[test]
    fn rejects_empty_and_unknown_tags() {
        assert_eq!(ServerFrame::parse(Bytes::new()), Err(FrameError::Empty));
        assert_eq!(
            ServerFrame::parse(Bytes::from_static(b"r\x00")),
            Err(FrameError::UnknownTag { tag: b'r' })
        );
        let msg = FrameError::UnknownTag { tag: b'z' }.to_string();
        assert!(msg.contains("0x7a") && msg.contains("'z'"), "{msg}");
    }

    #[test]
    fn every_truncation_is_an_error() {
        for full in [xlog_data(1, 2, 3, b""), keepalive(1, 2, 1)] {
            for len in 1..full.len() {
                let err = ServerFrame::parse(full.slice(..len)).expect_err("truncated");
                assert!(
                    matches!(err, FrameError::Truncated { got, .. } if got == len),
                    "len {len}: {err:?}"
                );
            }
        }
    }

    #[test]
    fn keepalive_with_trailing_bytes_is_an_error() {
        let mut b = BytesMut::from(&keepalive(1, 2, 0)[..]);
        b.put_u8(0);
        assert_eq!(
            ServerFrame::parse(b.freeze()),
            Err(FrameError::TrailingBytes {
                frame: "keepalive",
                extra: 1
            })
        );
    }

    #[test]
    fn standby_status_has_the_documented_layout() {
        let status = StandbyStatus {
            write: Lsn(0x0102_0304_0506_0708),
            flush: Lsn(0x1112_1314_1516_1718),
            apply: Lsn(0x2122_2324_2526_2728),
            client_time_micros: 0x3132_3334_3536_3738,
            reply_requested: true,
        };
        let bytes = status.to_bytes();
        let mut expected = vec![b'r'];
        for v in [
            0x0102_0304_0506_0708_u64,
            0x1112_1314_1516_1718,
            0x2122_2324_2526_2728,
            0x3132_3334_3536_3738,
        ] {
            expected.extend_from_slice(&v.to_be_bytes());
        }
        expected.push(1);
        assert_eq!(&bytes[..], &expected[..]);
        assert_eq!(bytes.len(), StandbyStatus::ENCODED_LEN);
        assert_eq!(StandbyStatus::parse(&bytes), Ok(status));
    }

    #[test]
    fn standby_status_parse_rejects_bad_frames() {
        let good = StandbyStatus {
            write: Lsn(1),
            flush: Lsn(1),
            apply: Lsn(1),
            client_time_micros: 0,
            reply_requested: false,
        }
        .to_bytes();
        assert_eq!(StandbyStatus::parse(&[]), Err(FrameError::Empty));
        assert_eq!(
            StandbyStatus::parse(b"k"),
            Err(FrameError::UnknownTag { tag: b'k' })
        );
        for len in 1..good.len() {
            assert!(StandbyStatus::parse(&good[..len]).is_err());
        }
        let mut long = good.to_vec();
        long.push(0);
        assert!(matches!(
            StandbyStatus::parse(&long),
            Err(FrameError::TrailingBytes { extra: 1, .. })
        ));
    }

    #[test]
    fn pg_epoch_conversion() {
        let pg_epoch = UNIX_EPOCH + Duration::from_secs(PG_EPOCH_UNIX_SECS);
        assert_eq!(pg_epoch_micros(pg_epoch), 0);
        assert_eq!(pg_epoch_micros(pg_epoch + Duration::from_micros(1)), 1);
        assert_eq!(pg_epoch_micros(UNIX_EPOCH), -946_684_800_000_000);
        if let Some(before_unix) = UNIX_EPOCH.checked_sub(Duration::from_secs(1)) {
            assert_eq!(pg_epoch_micros(before_unix), -946_684_801_000_000);
        }
        // 2024-01-01T00:00:00Z is 1_704_067_200 s after the Unix epoch.
        let t = UNIX_EPOCH + Duration::from_secs(1_704_067_200);
        assert_eq!(
            pg_epoch_micros(t),
            (1_704_067_200 - 946_684_800) * 1_000_000
        );
        assert_eq!(system_time_from_pg_micros(pg_epoch_micros(t)), Some(t));
        assert_eq!(system_time_from_pg_micros(0), Some(pg_epoch));
    }

    #[test]
    fn pg_epoch_conversion_saturates() {
        // Far enough in the future that the microsecond count exceeds i64.
        if let Some(far) = UNIX_EPOCH.checked_add(Duration::from_secs(u64::from(u32::MAX) << 21)) {
            assert_eq!(pg_epoch_micros(far), i64::MAX);
        }
        if let Some(far_past) =
            UNIX_EPOCH.checked_sub(Duration::from_secs(u64::from(u32::MAX) << 21))
        {
            assert_eq!(pg_epoch_micros(far_past), i64::MIN);
        }
        // The extremes either convert or report None; they never panic.
        let _ = system_time_from_pg_micros(i64::MAX);
        let _ = system_time_from_pg_micros(i64::MIN);
    }

    proptest! {
        #[test]
        fn parse_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = ServerFrame::parse(Bytes::from(bytes.clone()));
            let _ = StandbyStatus::parse(&bytes);
        }

        #[test]
        fn tagged_garbage_never_panics(
            tag in prop_oneof![Just(XLOG_DATA), Just(PRIMARY_KEEPALIVE), Just(STANDBY_STATUS_UPDATE)],
            body in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let mut b = vec![tag];
            b.extend_from_slice(&body);
            let _ = ServerFrame::parse(Bytes::from(b.clone()));
            let _ = StandbyStatus::parse(&b);
        }

        #[test]
        fn xlog_data_round_trips(
            start in any::<u64>(),
            end in any::<u64>(),
            time in any::<i64>(),
            data in proptest::collection::vec(any::<u8>(), 0..32),
        ) {
            let frame = ServerFrame::parse(xlog_data(start, end, time, &data));
            prop_assert_eq!(frame, Ok(ServerFrame::XLogData {
                wal_start: Lsn(start),
                wal_end: Lsn(end),
                send_time: time,
                data: Bytes::from(data),
            }));
        }

        #[test]
        fn keepalive_round_trips(end in any::<u64>(), time in any::<i64>(), reply in any::<bool>()) {
            let frame = ServerFrame::parse(keepalive(end, time, u8::from(reply)));
            prop_assert_eq!(frame, Ok(ServerFrame::Keepalive {
                wal_end: Lsn(end),
                send_time: time,
                reply_requested: reply,
            }));
        }

        #[test]
        fn standby_status_round_trips(
            write in any::<u64>(),
            flush in any::<u64>(),
            apply in any::<u64>(),
            time in any::<i64>(),
            reply in any::<bool>(),
        ) {
            let status = StandbyStatus {
                write: Lsn(write),
                flush: Lsn(flush),
                apply: Lsn(apply),
                client_time_micros: time,
                reply_requested: reply,
            };
            let mut out = BytesMut::new();
            status.encode(&mut out);
            prop_assert_eq!(out.len(), StandbyStatus::ENCODED_LEN);
            prop_assert_eq!(StandbyStatus::parse(&out), Ok(status));
        }

        #[test]
        fn pg_micros_round_trip(micros in -(1_i64 << 52)..(1_i64 << 52)) {
            // Within ±142 years of 2000 every platform represents the instant.
            let t = system_time_from_pg_micros(micros);
            prop_assert!(t.is_some());
            if let Some(t) = t {
                prop_assert_eq!(pg_epoch_micros(t), micros);
            }
        }
    }
}
