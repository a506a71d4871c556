//! Fuzzes the `pgoutput` decoder: the stateless `decode` and the stream-tracking
//! `Decoder`.
//!
//! Input layout: byte 0 is the decode context, the rest is the message data.
//!
//! - `protocol_version = data[0] & 0x07` (0..=7: below, inside and above the
//!   supported 1..=4), `in_stream = data[0] & 0x80 != 0`.
//! - The rest is decoded once as a single message with that context, then split on
//!   [`SEP`] and fed message by message to `Decoder::new(protocol_version)`.
//!
//! Beyond "no panic" it checks the documented contract: a decoded message consumes
//! the whole buffer (one more byte is never also accepted), decoding is
//! deterministic, and a failed `Decoder::decode` leaves its state unchanged.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use outbox_relay::postgres::pgoutput::{DecodeContext, Decoder, LogicalReplicationMessage, decode};

/// Separates the messages of a sequence (not valid UTF-8, so it never occurs in
/// the text columns of real seeds).
const SEP: &[u8] = b"\xff\xfe\xfd\xfc";

/// `FUZZ_DEBUG=1` prints what each input decodes to (for checking seeds with
/// `-runs=0`); read once.
fn debug() -> bool {
    static DEBUG: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *DEBUG.get_or_init(|| std::env::var_os("FUZZ_DEBUG").is_some())
}

fn split(mut data: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut done = false;
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        // Compared as a u32, not a slice: a slice compare is a memcmp call, which
        // libFuzzer intercepts and traces at every position, slowing big inputs.
        let sep = u32::from_le_bytes([SEP[0], SEP[1], SEP[2], SEP[3]]);
        match data
            .windows(SEP.len())
            .position(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) == sep)
        {
            Some(i) => {
                let (head, tail) = data.split_at(i);
                data = &tail[SEP.len()..];
                Some(head)
            }
            None => {
                done = true;
                Some(data)
            }
        }
    })
}

fn check_one(buf: &[u8], ctx: DecodeContext) -> Option<LogicalReplicationMessage> {
    let first = decode(Bytes::copy_from_slice(buf), ctx);
    let again = decode(Bytes::copy_from_slice(buf), ctx);
    assert_eq!(first, again, "decode is not deterministic");
    let msg = first.ok()?;
    // The decoder "consumes the whole buffer and treats bytes left over as an error".
    let mut longer = buf.to_vec();
    longer.push(0);
    let extended = decode(Bytes::from(longer), ctx);
    assert!(
        extended.is_err(),
        "decoded {msg:?} from {} bytes, and also accepted one more byte as {extended:?}",
        buf.len()
    );
    // Exercise the accessors (and Debug, as the relay logs messages).
    let _ = (msg.tag(), msg.name(), format!("{msg:?}"));
    Some(msg)
}

fuzz_target!(|data: &[u8]| {
    let Some((&ctx_byte, rest)) = data.split_first() else {
        return;
    };
    let protocol_version = ctx_byte & 0x07;
    let in_stream = ctx_byte & 0x80 != 0;
    let ctx = DecodeContext {
        protocol_version,
        in_stream,
    };

    // 1. The whole rest as one message, stateless.
    let single = check_one(rest, ctx);
    if debug() {
        eprintln!(
            "single {ctx:?}: {}",
            single.as_ref().map_or("error", |m| m.name())
        );
    }

    // 2. A sequence of messages through the stateful decoder.
    let mut decoder = Decoder::new(protocol_version);
    for msg in split(rest) {
        let before = decoder.clone();
        let result = decoder.decode(Bytes::copy_from_slice(msg));
        if debug() {
            eprintln!(
                "  seq: {}",
                result
                    .as_ref()
                    .map_or_else(|e| e.to_string(), |m| m.name().to_owned())
            );
        }
        match result {
            Ok(m) => {
                let after = decoder.context();
                match m {
                    LogicalReplicationMessage::StreamStart(_) => assert!(after.in_stream),
                    LogicalReplicationMessage::StreamStop => assert!(!after.in_stream),
                    _ => assert_eq!(after, before.context()),
                }
            }
            Err(e) => {
                assert_eq!(decoder, before, "a failed decode changed the decoder state");
                let _ = e.to_string();
            }
        }
    }
});
