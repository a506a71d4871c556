//! Why a `pgoutput` message could not be decoded.
//!
//! Every way the bytes can disagree with the documented layout has its own variant,
//! naming the message and the field, so that a corrupt or misread stream is reported
//! precisely (the relay stops: a message it cannot read is never skipped, since
//! skipping could lose an event). No decode error is ever a panic.

use std::fmt;

use super::types::message_name;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The XLogData body was empty.
    #[error("empty pgoutput message")]
    Empty,
    /// The tag is not a `pgoutput` message.
    #[error("unknown pgoutput message tag {}", TagDisplay(*tag))]
    UnknownTag {
        /// The tag byte received.
        tag: u8,
    },
    /// The message exists only in a newer protocol version than the one decoded.
    #[error(
        "pgoutput {} message needs protocol version {required}, stream uses {protocol_version}",
        message_name(*tag)
    )]
    UnsupportedMessage {
        /// The tag byte received.
        tag: u8,
        /// The context's protocol version.
        protocol_version: u8,
        /// The first version that defines the message.
        required: u8,
    },
    /// The message ended before a field.
    #[error(
        "truncated pgoutput {message} message: {field} needs {needed} bytes, {remaining} remain"
    )]
    Truncated {
        /// Message name.
        message: &'static str,
        /// Field being read.
        field: &'static str,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes left in the message.
        remaining: usize,
    },
    /// A string field has no NUL terminator before the end of the message.
    #[error("pgoutput {message} message: string {field} is not NUL-terminated")]
    UnterminatedString {
        /// Message name.
        message: &'static str,
        /// Field being read.
        field: &'static str,
    },
    /// A name that is kept as `String` is not UTF-8.
    #[error("pgoutput {message} message: {field} is not valid UTF-8")]
    InvalidUtf8 {
        /// Message name.
        message: &'static str,
        /// Field being read.
        field: &'static str,
    },
    /// A count or length is negative.
    #[error("pgoutput {message} message: invalid {field} {value}")]
    InvalidLength {
        /// Message name.
        message: &'static str,
        /// Field being read.
        field: &'static str,
        /// The value received.
        value: i64,
    },
    /// A tuple column kind is not `'n'`, `'u'`, `'t'` or `'b'`.
    #[error("pgoutput {message} message: unknown tuple column kind {}", TagDisplay(*kind))]
    UnknownColumnKind {
        /// Message name.
        message: &'static str,
        /// The kind byte received.
        kind: u8,
    },
    /// A tuple marker (`'N'`, `'K'`, `'O'`) is missing or wrong.
    #[error(
        "pgoutput {message} message: expected tuple marker {expected}, found {}",
        TagDisplay(*found)
    )]
    UnexpectedTupleMarker {
        /// Message name.
        message: &'static str,
        /// What was acceptable, e.g. `'K', 'O' or 'N'`.
        expected: &'static str,
        /// The byte received.
        found: u8,
    },
    /// Bytes remain after a complete message.
    #[error("pgoutput {message} message has {extra} trailing bytes")]
    TrailingBytes {
        /// Message name.
        message: &'static str,
        /// Bytes left over.
        extra: usize,
    },
    /// Stream Start inside a stream block, or Stream Stop outside one
    /// ([`Decoder`](super::Decoder)).
    #[error("pgoutput {} message {} a stream block", message_name(*tag), if *in_stream { "inside" } else { "outside" })]
    StreamBoundary {
        /// The tag byte received.
        tag: u8,
        /// Whether the decoder was inside a stream block.
        in_stream: bool,
    },
}

/// Shows a tag byte as `0x42 ('B')`.
struct TagDisplay(u8);

impl fmt::Display for TagDisplay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#04x} ({:?})", self.0, char::from(self.0))
    }
}
