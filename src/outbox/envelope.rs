//! The optional JSON envelope around the payload.
//!
//! With `[envelope]` configured, the record value is
//! `{"event_id":…,"event_type":…,"schema_version":…,"occurred_at":…,"producer":…,"payload":…}`
//! instead of the bare payload; keys, headers and poison data are unchanged (the
//! poison row keeps the payload as stored). The constant fields are encoded once,
//! when the mapper is built; per event only the short strings are escaped.
//!
//! # Why the payload is not re-encoded
//!
//! The value is the bytes PostgreSQL's output function produced (`jsonb` and `json`
//! text, `text` as is; `bytea` is decoded from its `\x…` text to the raw bytes).
//! Parsing and re-serialising JSON would cost more than the rest of the mapping
//! together, could change numbers (`1.10` → `1.1`, integers above 2^53), key order
//! or escapes, and would make the value depend on this relay's JSON library instead
//! of on what the application wrote. `jsonb` output is already normalised by the
//! server. In envelope mode the payload is spliced into the envelope verbatim for
//! `json`/`jsonb` (which PostgreSQL guarantees to be valid JSON) and embedded as a
//! JSON string for text-like and `bytea` columns; only the small string fields are
//! escaped. The row's `headers` object is the only JSON parsed per event, and only
//! when the column is non-NULL.

use std::str::Utf8Error;

use bytes::{BufMut, Bytes, BytesMut};

use super::json::{put_json_string, put_json_string_or_null};
use super::record::PayloadFormat;
use super::timestamp::RFC3339_LEN;
use crate::config::EnvelopeConfig;

/// The envelope's constant fields, pre-encoded as JSON strings.
#[derive(Debug, Clone)]
pub(super) struct Envelope {
    producer: Bytes,
    schema_version: Bytes,
}

impl Envelope {
    /// Encodes the configured constant fields.
    pub(super) fn new(config: &EnvelopeConfig) -> Self {
        let encode = |s: &str| {
            let mut b = BytesMut::with_capacity(s.len() + 2);
            put_json_string(&mut b, s);
            b.freeze()
        };
        Envelope {
            producer: encode(&config.producer),
            schema_version: encode(&config.schema_version),
        }
    }
}

/// Why a row's values cannot be put into the envelope.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum EnvelopeError {
    /// The event id is not UTF-8, so it cannot be a JSON string.
    #[error("event id is not UTF-8: {0}")]
    EventId(#[source] Utf8Error),
    /// The event type is not UTF-8.
    #[error("event type is not UTF-8: {0}")]
    EventType(#[source] Utf8Error),
    /// `occurred_at` is not UTF-8 (it is the relay's own RFC 3339 text, so never).
    #[error(transparent)]
    OccurredAt(Utf8Error),
    /// A column placed in the envelope is not UTF-8.
    #[error("a column placed in the envelope is not UTF-8: {0}")]
    Field(#[source] Utf8Error),
    /// A text-like or `bytea` payload that is not UTF-8 cannot be a JSON string.
    #[error("payload is not UTF-8, so the JSON envelope cannot embed it as a string: {0}")]
    Payload(#[source] Utf8Error),
}

/// `{"event_id":…,"event_type":…,"schema_version":…,"occurred_at":…,"producer":…,"payload":…}`
///
/// # Errors
///
/// [`EnvelopeError`]: a value that must be a JSON string is not UTF-8.
pub(super) fn build_envelope(
    envelope: &Envelope,
    event_id: &[u8],
    event_type: Option<&[u8]>,
    occurred_at: Option<&[u8]>,
    fields: &[(&str, Option<&[u8]>)],
    payload: &[u8],
    format: PayloadFormat,
) -> Result<Bytes, EnvelopeError> {
    let strings = event_id.len() + event_type.map_or(4, <[u8]>::len) + RFC3339_LEN;
    let constants = envelope.producer.len() + envelope.schema_version.len();
    let mut out = BytesMut::with_capacity(96 + strings + constants + payload.len());
    out.put_slice(b"{\"event_id\":");
    put_json_string_or_null(&mut out, Some(event_id)).map_err(EnvelopeError::EventId)?;
    out.put_slice(b",\"event_type\":");
    put_json_string_or_null(&mut out, event_type).map_err(EnvelopeError::EventType)?;
    out.put_slice(b",\"schema_version\":");
    out.put_slice(&envelope.schema_version);
    out.put_slice(b",\"occurred_at\":");
    put_json_string_or_null(&mut out, occurred_at).map_err(EnvelopeError::OccurredAt)?;
    out.put_slice(b",\"producer\":");
    out.put_slice(&envelope.producer);
    for (name, value) in fields {
        out.put_u8(b',');
        put_json_string(&mut out, name);
        out.put_u8(b':');
        put_json_string_or_null(&mut out, *value).map_err(EnvelopeError::Field)?;
    }
    out.put_slice(b",\"payload\":");
    match format {
        PayloadFormat::Json => out.put_slice(payload),
        PayloadFormat::Text | PayloadFormat::ByteaText | PayloadFormat::Raw => {
            let text = std::str::from_utf8(payload).map_err(EnvelopeError::Payload)?;
            put_json_string(&mut out, text);
        }
    }
    out.put_u8(b'}');
    Ok(out.freeze())
}
