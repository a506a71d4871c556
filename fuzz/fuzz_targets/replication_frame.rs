//! Fuzzes the replication-protocol CopyData payloads: `ServerFrame::parse` (what the
//! walsender sends) and `StandbyStatus::parse` (what the relay sends back).
//!
//! The whole input is one CopyData payload, given to both parsers. An XLogData body
//! is then decoded as a `pgoutput` v1 message, as the relay does.
//!
//! Checks beyond "no panic": the parsed fields are the big-endian fields at their
//! documented offsets, the XLogData body is exactly the bytes after the 25-byte
//! header, and a parsed standby status update re-encodes to the same bytes.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use outbox_relay::postgres::replication::frames::{
    ServerFrame, StandbyStatus, pg_epoch_micros, system_time_from_pg_micros,
};
use outbox_relay::postgres::pgoutput::{DecodeContext, decode};

fn be_u64(data: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&data[at..at + 8]);
    u64::from_be_bytes(b)
}

fuzz_target!(|data: &[u8]| {
    match ServerFrame::parse(Bytes::copy_from_slice(data)) {
        Ok(ServerFrame::XLogData {
            wal_start,
            wal_end,
            send_time,
            data: body,
        }) => {
            assert!(data.len() >= 25 && data[0] == b'w');
            assert_eq!(wal_start.as_u64(), be_u64(data, 1));
            assert_eq!(wal_end.as_u64(), be_u64(data, 9));
            assert_eq!(send_time as u64, be_u64(data, 17));
            assert_eq!(&body[..], &data[25..]);
            // The time helpers must not panic on any send time either.
            if let Some(t) = system_time_from_pg_micros(send_time) {
                let _ = pg_epoch_micros(t);
            }
            let _ = decode(body, DecodeContext::new(1));
        }
        Ok(ServerFrame::Keepalive {
            wal_end,
            send_time,
            reply_requested,
        }) => {
            assert!(data.len() == 18 && data[0] == b'k');
            assert_eq!(wal_end.as_u64(), be_u64(data, 1));
            assert_eq!(send_time as u64, be_u64(data, 9));
            assert_eq!(reply_requested, data[17] != 0);
            if let Some(t) = system_time_from_pg_micros(send_time) {
                let _ = pg_epoch_micros(t);
            }
        }
        Ok(other) => {
            let _ = other.tag();
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }

    match StandbyStatus::parse(data) {
        Ok(status) => {
            assert_eq!(data.len(), StandbyStatus::ENCODED_LEN);
            let encoded = status.to_bytes();
            if data[33] <= 1 {
                assert_eq!(&encoded[..], data, "standby status does not round-trip");
            } else {
                // Any non-zero reply byte means "reply requested"; it re-encodes as 1.
                assert_eq!(&encoded[..33], &data[..33]);
                assert_eq!(encoded[33], 1);
            }
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
