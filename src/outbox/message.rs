//! The message outbox: events written with `pg_logical_emit_message`, never as rows.
//!
//! # Why
//!
//! The walsender is the relay's ceiling, and most of what it spends per row-outbox
//! event is decoding a heap tuple and running the columns' output functions
//! (`jsonb_out` above all). A *transactional* logical decoding message is queued in
//! its transaction's reorder buffer and sent at commit, in commit order, like a row
//! — and dropped with the transaction if it rolls back — but the walsender forwards
//! its bytes untouched: no tuple, no output function, no index entry, no dead tuple
//! for vacuum, no retention job (PostgreSQL docs, "Logical Decoding Output Plugins",
//! the `message_cb` callback; pgoutput sends it as the `M` message when the
//! `messages` option is on, PostgreSQL 14+).
//!
//! # The frame
//!
//! `outbox_emit(…)` (`migrations/0011_message_outbox.sql`) writes the event as the
//! message content, with the prefix [`prefix_of`] the outbox's `schema.table`:
//!
//! ```text
//! version (1 byte) = 1
//! payload format (1 byte): 'j' json text, 't' text, 'b' raw bytes
//! 8 × field: int4 big-endian byte length (-1 = NULL), then the bytes
//!   idempotency key, aggregate type, aggregate id, event type, topic,
//!   headers (JSON object), payload, created_at (PostgreSQL ISO text)
//! ```
//!
//! Length-prefixed binary, not JSON: SQL builds it with `int4send` and `||`, and
//! [`decode_frame`] slices every field out of the message's [`Bytes`] without a
//! copy, so a message costs the relay what a row does and the payload is never
//! re-encoded. The decoded [`OutboxRow`] goes through the same mapping rules as a
//! row (`OutboxMapper::map_message`), so topic, headers, envelope, CloudEvents and
//! poison rules cannot drift apart.
//!
//! # What a message cannot do
//!
//! There is no row to go back to: a message is in the WAL and nowhere else. A
//! poisoned message keeps all of its fields in the poison table (replayable); an
//! unreadable frame keeps its whole content there. A slot lost while messages were
//! written loses them for good: a resync re-reads tables, and messages were never in
//! one (`check` says so). `audit` counts them per entity in
//! `outbox_relay_message_ledger`, which `outbox_emit` updates in the same
//! transaction.

use bytes::Bytes;
use thiserror::Error;

use super::record::{Mapped, OutboxRow, PayloadFormat};
pub use super::record::{POISON_MARKER, poison_marker};

/// What [`OutboxMapper::map_message`](crate::outbox::OutboxMapper::map_message)
/// made of a logical decoding message.
// Returned and matched at once, never stored: boxing the event would cost an
// allocation per message for nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MessageMapped {
    /// A transactional message of one of the relay's outboxes: an event, or an
    /// unmappable one for the poison table.
    Outbox(Mapped),
    /// Not an outbox message (another prefix): ignored.
    Foreign,
    /// An outbox message of an outbox this relay does not serve (another relay
    /// with its own slot does): ignored.
    OtherOutbox,
    /// An outbox message written with `transactional = false`: it is decoded even
    /// when its transaction rolls back and outside commit order, so it is never
    /// an event; counted and ignored.
    NotTransactional,
}

/// What every outbox message prefix starts with; the rest names the outbox.
pub const PREFIX_START: &str = "outbox-relay:";

/// The frame version [`decode_frame`] reads.
pub const FRAME_VERSION: u8 = 1;

/// The prefix `outbox_emit` writes for the outbox `schema.table`.
#[must_use]
pub fn prefix_of(outbox: &str) -> String {
    format!("{PREFIX_START}{outbox}")
}

/// Whether a prefix is an outbox message's (of any outbox), not another
/// application's or the relay's heartbeat (`outbox-relay`, without the colon).
#[must_use]
pub fn is_outbox_prefix(prefix: &[u8]) -> bool {
    prefix.starts_with(PREFIX_START.as_bytes())
}

/// Why a message's content is not a frame.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FrameError {
    #[error("the message is empty")]
    Empty,
    #[error("frame version {0} is not known (this relay reads version {FRAME_VERSION})")]
    Version(u8),
    #[error("payload format byte {0:#04x} is not 'j', 't' or 'b'")]
    PayloadFormat(u8),
    #[error("the frame ends inside field {field} ({needed} more bytes needed)")]
    Truncated { field: &'static str, needed: usize },
    #[error("field {field} has length {length}")]
    Length { field: &'static str, length: i32 },
    #[error("{0} bytes follow the last field")]
    Trailing(usize),
}

/// Reads a frame into an outbox row whose fields are slices of `content`.
///
/// # Errors
///
/// [`FrameError`] for anything but a complete version-1 frame.
pub fn decode_frame(content: &Bytes) -> Result<OutboxRow, FrameError> {
    let (&version, rest) = content.split_first().ok_or(FrameError::Empty)?;
    if version != FRAME_VERSION {
        return Err(FrameError::Version(version));
    }
    let (&format, _) = rest.split_first().ok_or(FrameError::Truncated {
        field: "payload format",
        needed: 1,
    })?;
    let payload_format = match format {
        b'j' => PayloadFormat::Json,
        b't' => PayloadFormat::Text,
        b'b' => PayloadFormat::Raw,
        other => return Err(FrameError::PayloadFormat(other)),
    };
    let mut frame = Fields { content, at: 2 };
    // Struct fields are evaluated in the order written: the frame's order.
    let row = OutboxRow {
        id: None,
        idempotency_key: frame.next("idempotency_key")?,
        aggregate_type: frame.next("aggregate_type")?,
        aggregate_id: frame.next("aggregate_id")?,
        event_type: frame.next("event_type")?,
        topic: frame.next("topic")?,
        headers: frame.next("headers")?,
        payload: frame.next("payload")?,
        payload_format,
        created_at: frame.next("created_at")?,
        extra: Vec::new(),
    };
    if frame.at != content.len() {
        return Err(FrameError::Trailing(content.len() - frame.at));
    }
    Ok(row)
}

/// The length-prefixed fields of a frame, read in order from `at`.
struct Fields<'a> {
    content: &'a Bytes,
    at: usize,
}

impl Fields<'_> {
    /// The next field (`None` for NULL).
    fn next(&mut self, field: &'static str) -> Result<Option<Bytes>, FrameError> {
        let (content, at) = (self.content, self.at);
        let header = content
            .get(at..at + 4)
            .ok_or_else(|| FrameError::Truncated {
                field,
                needed: at + 4 - content.len().min(at + 4),
            })?;
        let length = i32::from_be_bytes([header[0], header[1], header[2], header[3]]);
        let start = at + 4;
        if length == -1 {
            self.at = start;
            return Ok(None);
        }
        let len = usize::try_from(length).map_err(|_| FrameError::Length { field, length })?;
        let end = start
            .checked_add(len)
            .filter(|&end| end <= content.len())
            .ok_or(FrameError::Truncated {
                field,
                needed: start.saturating_add(len).saturating_sub(content.len()),
            })?;
        self.at = end;
        Ok(Some(content.slice(start..end)))
    }
}

/// Encodes a frame, as `outbox_emit` builds it in SQL (for tests); `None` is NULL.
#[cfg(test)]
#[must_use]
pub(crate) fn encode_frame(format: PayloadFormat, fields: [Option<&[u8]>; 8]) -> Vec<u8> {
    let format = match format {
        PayloadFormat::Json => b'j',
        PayloadFormat::Text => b't',
        PayloadFormat::Raw | PayloadFormat::ByteaText => b'b',
    };
    let mut out = vec![FRAME_VERSION, format];
    for value in fields {
        match value {
            None => out.extend_from_slice(&(-1i32).to_be_bytes()),
            Some(v) => {
                // A field past 2 GiB cannot be a logical message (1 GiB limit).
                let len = i32::try_from(v.len()).unwrap_or(i32::MAX);
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(v);
            }
        }
    }
    out
}

/// Whether `outbox_emit` (the message outbox's writer, migration `0011`) is
/// installed in `schema`: events written with it are in no table.
///
/// # Errors
///
/// The query failed.
pub async fn emit_installed(
    client: &impl tokio_postgres::GenericClient,
    schema: &str,
) -> Result<bool, tokio_postgres::Error> {
    client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                             WHERE n.nspname = $1 AND p.proname = 'outbox_emit')",
            &[&schema],
        )
        .await?
        .try_get(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame() -> Vec<u8> {
        encode_frame(
            PayloadFormat::Json,
            [
                Some(b"k-1"),
                Some(b"order"),
                Some(b"42"),
                Some(b"order_created"),
                None,
                Some(br#"{"traceparent":"00-ab"}"#),
                Some(br#"{"total": 10}"#),
                Some(b"2026-12-04 10:00:00.123456+00"),
            ],
        )
    }

    #[test]
    fn a_frame_decodes_to_slices_of_the_message() {
        let content = Bytes::from(frame());
        let row = decode_frame(&content).unwrap();
        assert_eq!(row.idempotency_key.as_deref(), Some(&b"k-1"[..]));
        assert_eq!(row.aggregate_id.as_deref(), Some(&b"42"[..]));
        assert_eq!(row.topic, None);
        assert_eq!(row.payload.as_deref(), Some(&br#"{"total": 10}"#[..]));
        assert_eq!(row.payload_format, PayloadFormat::Json);
        assert_eq!(row.id, None);
        let payload = row.payload.unwrap();
        let base = content.as_ptr() as usize;
        let at = payload.as_ptr() as usize;
        assert!(at > base && at < base + content.len(), "not a slice");
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        let full = frame();
        for cut in 0..full.len() {
            let content = Bytes::copy_from_slice(&full[..cut]);
            assert!(decode_frame(&content).is_err(), "cut at {cut}");
        }
        let mut long = full.clone();
        long.push(0);
        assert_eq!(
            decode_frame(&Bytes::from(long)),
            Err(FrameError::Trailing(1))
        );
    }

    #[test]
    fn bad_version_format_and_lengths_are_named() {
        let mut v = frame();
        v[0] = 2;
        assert_eq!(decode_frame(&Bytes::from(v)), Err(FrameError::Version(2)));
        let mut f = frame();
        f[1] = b'x';
        assert_eq!(
            decode_frame(&Bytes::from(f)),
            Err(FrameError::PayloadFormat(b'x'))
        );
        let mut l = frame();
        l[2..6].copy_from_slice(&(-2i32).to_be_bytes());
        assert!(matches!(
            decode_frame(&Bytes::from(l)),
            Err(FrameError::Length { length: -2, .. })
        ));
        let mut huge = frame();
        huge[2..6].copy_from_slice(&i32::MAX.to_be_bytes());
        assert!(matches!(
            decode_frame(&Bytes::from(huge)),
            Err(FrameError::Truncated { .. })
        ));
    }

    proptest::proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(tail in proptest::collection::vec(proptest::num::u8::ANY, 0..96)) {
            let mut bytes = vec![FRAME_VERSION, b'j'];
            bytes.extend(tail);
            let _ = decode_frame(&Bytes::from(bytes));
        }
    }

    #[test]
    fn prefixes_name_the_outbox() {
        assert_eq!(prefix_of("public.outbox"), "outbox-relay:public.outbox");
        assert!(is_outbox_prefix(b"outbox-relay:app.events"));
        assert!(!is_outbox_prefix(b"outbox-relay"));
        assert!(!is_outbox_prefix(b"debezium"));
    }
}
