//! CloudEvents 1.0 records, in the binary or the structured mode of the Kafka
//! protocol binding.
//!
//! Gateways, serverless platforms and many consumers expect events as CloudEvents
//! (a CNCF specification). The Kafka binding
//! (<https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/bindings/kafka-protocol-binding.md>)
//! has two modes:
//!
//! * **binary**: the record value is the event's data, untouched (here: the payload
//!   exactly as PostgreSQL gave it), and every context attribute is a header named
//!   `ce_<attribute>` whose value is the attribute's string form; `datacontenttype`
//!   is the `content-type` header. Consumers that know nothing of CloudEvents read
//!   the payload as before, so this mode changes nothing for them.
//! * **structured**: the value is the whole event in the JSON event format
//!   (<https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/formats/json-format.md>)
//!   with `content-type: application/cloudevents+json; charset=UTF-8`. A JSON payload
//!   is spliced in as `data` verbatim (never re-encoded, as in `envelope.rs`), a text
//!   payload becomes a JSON string, a `bytea` payload `data_base64`.
//!
//! The attributes come from the outbox row: `id` is the idempotency key (what a
//! consumer deduplicates on, and with `source` what identifies a CloudEvent), `type`
//! the event type (required by the specification: a row without one cannot become a
//! CloudEvent and is poisoned), `time` the row's `created_at` (RFC 3339, when the
//! table has one), `source` the configured URI-reference, and `datacontenttype` the
//! payload column's kind (`application/json` for `json`/`jsonb`, `text/plain;
//! charset=utf-8` for text, `application/octet-stream` for `bytea`). The relay's own
//! headers (`idempotency_key`, `event_type`, …) stay, in both modes.

use std::borrow::Cow;
use std::str::Utf8Error;

use base64::Engine as _;
use bytes::{BufMut, Bytes, BytesMut};

use super::json::put_json_string;
use super::record::{HeaderName, PayloadFormat};
use crate::config::{CloudEventsConfig, CloudEventsMode};

/// The `specversion` the relay writes.
const SPEC_VERSION: &str = "1.0";

/// The `content-type` of a structured-mode record.
const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json; charset=UTF-8";

/// The binding's header for `datacontenttype` (binary mode) and for the event
/// format (structured mode).
pub(super) const HEADER_CONTENT_TYPE: &str = "content-type";

/// The configured CloudEvents form, with its constant parts encoded once.
#[derive(Debug, Clone)]
pub(super) struct CloudEvents {
    mode: CloudEventsMode,
    /// `source` as header value.
    source: Bytes,
    /// `source` as a JSON string literal.
    source_json: Bytes,
}

/// Why a row cannot become a CloudEvent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum CloudEventsError {
    /// `type` is required.
    #[error("a CloudEvent needs a type, and the event type is NULL or empty")]
    NoType,
    /// `id` must be a string.
    #[error("the idempotency key (the CloudEvent id) is not UTF-8: {0}")]
    Id(#[source] Utf8Error),
    /// `type` must be a string.
    #[error("the event type (the CloudEvent type) is not UTF-8: {0}")]
    Type(#[source] Utf8Error),
    /// A text payload must be UTF-8 to be a JSON string.
    #[error("the text payload is not UTF-8, so the CloudEvent cannot carry it as data: {0}")]
    Data(#[source] Utf8Error),
}

/// What the CloudEvents form adds to one record.
#[derive(Debug)]
pub(super) struct Formed {
    /// The record value (the payload itself in binary mode).
    pub(super) value: Bytes,
    /// Headers to add after the relay's own.
    pub(super) headers: Vec<(HeaderName, Bytes)>,
}

impl CloudEvents {
    pub(super) fn new(config: &CloudEventsConfig) -> CloudEvents {
        let mut source_json = BytesMut::with_capacity(config.source.len() + 2);
        put_json_string(&mut source_json, &config.source);
        CloudEvents {
            mode: config.mode,
            source: Bytes::copy_from_slice(config.source.as_bytes()),
            source_json: source_json.freeze(),
        }
    }

    /// Forms one event: `id` the idempotency key, `event_type` its type, `time` the
    /// RFC 3339 `occurred_at`, `data` the payload (in `format`).
    ///
    /// # Errors
    ///
    /// [`CloudEventsError`]: no type, or a string attribute that is not UTF-8.
    pub(super) fn form(
        &self,
        id: &Bytes,
        event_type: Option<&Bytes>,
        time: Option<&Bytes>,
        data: Bytes,
        format: PayloadFormat,
    ) -> Result<Formed, CloudEventsError> {
        let event_type = event_type
            .filter(|t| !t.is_empty())
            .ok_or(CloudEventsError::NoType)?;
        let id_text = std::str::from_utf8(id).map_err(CloudEventsError::Id)?;
        let type_text = std::str::from_utf8(event_type).map_err(CloudEventsError::Type)?;
        match self.mode {
            CloudEventsMode::Binary => {
                let mut headers = vec![
                    (
                        Cow::Borrowed("ce_specversion"),
                        Bytes::from_static(SPEC_VERSION.as_bytes()),
                    ),
                    (Cow::Borrowed("ce_id"), Bytes::clone(id)),
                    (Cow::Borrowed("ce_source"), Bytes::clone(&self.source)),
                    (Cow::Borrowed("ce_type"), Bytes::clone(event_type)),
                ];
                if let Some(time) = time {
                    headers.push((Cow::Borrowed("ce_time"), Bytes::clone(time)));
                }
                headers.push((
                    Cow::Borrowed(HEADER_CONTENT_TYPE),
                    Bytes::from_static(content_type(format).as_bytes()),
                ));
                Ok(Formed {
                    value: data,
                    headers,
                })
            }
            CloudEventsMode::Structured => {
                let value = self.structured(id_text, type_text, time, &data, format)?;
                Ok(Formed {
                    value,
                    headers: vec![(
                        Cow::Borrowed(HEADER_CONTENT_TYPE),
                        Bytes::from_static(STRUCTURED_CONTENT_TYPE.as_bytes()),
                    )],
                })
            }
        }
    }

    /// The JSON event format, `data` spliced in as PostgreSQL gave it.
    fn structured(
        &self,
        id: &str,
        event_type: &str,
        time: Option<&Bytes>,
        data: &[u8],
        format: PayloadFormat,
    ) -> Result<Bytes, CloudEventsError> {
        let mut out = BytesMut::with_capacity(
            160 + id.len() + event_type.len() + self.source_json.len() + data.len() * 4 / 3,
        );
        out.put_slice(b"{\"specversion\":\"1.0\",\"id\":");
        put_json_string(&mut out, id);
        out.put_slice(b",\"source\":");
        out.put_slice(&self.source_json);
        out.put_slice(b",\"type\":");
        put_json_string(&mut out, event_type);
        if let Some(time) = time {
            // The relay's own RFC 3339 text: ASCII, nothing to escape.
            out.put_slice(b",\"time\":\"");
            out.put_slice(time);
            out.put_u8(b'"');
        }
        out.put_slice(b",\"datacontenttype\":");
        put_json_string(&mut out, content_type(format));
        match format {
            PayloadFormat::Json => {
                out.put_slice(b",\"data\":");
                out.put_slice(data);
            }
            PayloadFormat::Text | PayloadFormat::ByteaText => {
                let text = std::str::from_utf8(data).map_err(CloudEventsError::Data)?;
                out.put_slice(b",\"data\":");
                put_json_string(&mut out, text);
            }
            PayloadFormat::Raw => {
                out.put_slice(b",\"data_base64\":\"");
                out.put_slice(
                    base64::engine::general_purpose::STANDARD
                        .encode(data)
                        .as_bytes(),
                );
                out.put_u8(b'"');
            }
        }
        out.put_u8(b'}');
        Ok(out.freeze())
    }
}

/// `datacontenttype` of a payload column's kind.
fn content_type(format: PayloadFormat) -> &'static str {
    match format {
        PayloadFormat::Json => "application/json",
        PayloadFormat::Text | PayloadFormat::ByteaText => "text/plain; charset=utf-8",
        PayloadFormat::Raw => "application/octet-stream",
    }
}

/// Whether a header would shadow a CloudEvents header (config validation asks it of
/// placed headers, the mapper of a row's own).
pub(super) use crate::config::is_cloudevents_header;

#[cfg(test)]
mod tests {
    use super::*;

    fn ce(mode: CloudEventsMode) -> CloudEvents {
        CloudEvents::new(&CloudEventsConfig {
            mode,
            source: "/orders \"svc\"".into(),
        })
    }

    fn header<'a>(formed: &'a Formed, name: &str) -> Option<&'a [u8]> {
        formed
            .headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| &v[..])
    }

    #[test]
    fn binary_mode_leaves_the_payload_and_puts_attributes_in_headers() {
        let payload = Bytes::from_static(br#"{"total": 1.10}"#);
        let formed = ce(CloudEventsMode::Binary)
            .form(
                &Bytes::from_static(b"k-1"),
                Some(&Bytes::from_static(b"OrderCreated")),
                Some(&Bytes::from_static(b"2026-12-04T10:00:00.123456Z")),
                payload.clone(),
                PayloadFormat::Json,
            )
            .unwrap();
        assert_eq!(formed.value, payload);
        assert_eq!(header(&formed, "ce_specversion"), Some(&b"1.0"[..]));
        assert_eq!(header(&formed, "ce_id"), Some(&b"k-1"[..]));
        assert_eq!(header(&formed, "ce_source"), Some(&b"/orders \"svc\""[..]));
        assert_eq!(header(&formed, "ce_type"), Some(&b"OrderCreated"[..]));
        assert_eq!(
            header(&formed, "ce_time"),
            Some(&b"2026-12-04T10:00:00.123456Z"[..])
        );
        assert_eq!(
            header(&formed, "content-type"),
            Some(&b"application/json"[..])
        );
    }

    #[test]
    fn structured_mode_is_the_json_event_format() {
        let form = |data: &'static [u8], format| {
            ce(CloudEventsMode::Structured)
                .form(
                    &Bytes::from_static(b"k-\"2\""),
                    Some(&Bytes::from_static(b"T")),
                    None,
                    Bytes::from_static(data),
                    format,
                )
                .unwrap()
        };
        let json = form(
            br#"{"n": 123456789012345678901234567890}"#,
            PayloadFormat::Json,
        );
        assert_eq!(
            std::str::from_utf8(&json.value).unwrap(),
            r#"{"specversion":"1.0","id":"k-\"2\"","source":"/orders \"svc\"","type":"T","datacontenttype":"application/json","data":{"n": 123456789012345678901234567890}}"#
        );
        assert_eq!(
            header(&json, "content-type"),
            Some(STRUCTURED_CONTENT_TYPE.as_bytes())
        );
        let parsed: serde_json::Value = serde_json::from_slice(&json.value).unwrap();
        assert_eq!(parsed["id"], "k-\"2\"");

        let text = form(b"line\n\"two\"", PayloadFormat::Text);
        let parsed: serde_json::Value = serde_json::from_slice(&text.value).unwrap();
        assert_eq!(parsed["data"], "line\n\"two\"");
        assert_eq!(parsed["datacontenttype"], "text/plain; charset=utf-8");

        let raw = form(&[0, 159, 146, 150], PayloadFormat::Raw);
        let parsed: serde_json::Value = serde_json::from_slice(&raw.value).unwrap();
        assert_eq!(parsed["data_base64"], "AJ+Slg==");
        assert!(parsed.get("data").is_none());
    }

    #[test]
    fn a_row_without_a_type_or_with_non_utf8_strings_is_refused() {
        let c = ce(CloudEventsMode::Structured);
        let id = Bytes::from_static(b"k");
        let data = Bytes::from_static(b"{}");
        let refused = |t: Option<&Bytes>, id: &Bytes, data: &Bytes, f| {
            c.form(id, t, None, data.clone(), f).unwrap_err()
        };
        assert_eq!(
            refused(None, &id, &data, PayloadFormat::Json),
            CloudEventsError::NoType
        );
        assert_eq!(
            refused(Some(&Bytes::new()), &id, &data, PayloadFormat::Json),
            CloudEventsError::NoType
        );
        let bad = Bytes::from_static(&[0xff]);
        assert!(matches!(
            refused(Some(&id), &bad, &data, PayloadFormat::Json),
            CloudEventsError::Id(_)
        ));
        assert!(matches!(
            refused(Some(&bad), &id, &data, PayloadFormat::Json),
            CloudEventsError::Type(_)
        ));
        assert!(matches!(
            refused(Some(&id), &id, &bad, PayloadFormat::Text),
            CloudEventsError::Data(_)
        ));
    }

    #[test]
    fn cloudevents_headers_are_recognised() {
        assert!(is_cloudevents_header("ce_id"));
        assert!(is_cloudevents_header("CE_Type"));
        assert!(!is_cloudevents_header("ce"));
        assert!(is_cloudevents_header("Content-Type"));
        assert!(!is_cloudevents_header("trace_id"));
    }
}
