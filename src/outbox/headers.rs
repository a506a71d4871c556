//! The row's `headers` column: a JSON object whose entries become Kafka headers.
//!
//! This is the only JSON parsed per event, and only when the column is non-NULL.
//! Entries follow the relay's own headers in document order: a string value as its
//! unescaped string, any other value as its JSON text (`1.50` stays `1.50`, a nested
//! object stays as written), sliced from the column's bytes without copying unless
//! the string has escapes. Kafka headers may repeat a name and consumers usually read
//! the last one, so the names the relay sets itself ([`RESERVED_HEADERS`]) are
//! refused rather than letting a row override its own `idempotency_key`.
//!
//! Validation is left to `serde_json` (`IgnoredAny`: no allocation); the scanner
//! below then only has to find token boundaries of text known to be valid JSON,
//! and still checks every index it uses. `jsonb` output is normalised by the server
//! (one space after `:` and `,`); `json` keeps the application's spacing, which
//! the scanner skips (RFC 8259 whitespace).

use std::borrow::Cow;
use std::string::FromUtf8Error;

use bytes::Bytes;

use super::record::{HEADER_REPUBLISH, HeaderName, RESERVED_HEADERS, is_reserved_header};

/// Why the `headers` column cannot become Kafka headers.
#[derive(Debug, thiserror::Error)]
pub(super) enum HeadersError {
    /// The text is not JSON at all.
    #[error("not valid JSON: {0}")]
    InvalidJson(#[source] serde_json::Error),
    /// Valid JSON, but not an object (the value names what it is).
    #[error("must be a JSON object, is {0}")]
    NotAnObject(&'static str),
    /// A key whose unescaped text is not UTF-8.
    #[error("key is not UTF-8: {0}")]
    KeyNotUtf8(#[source] FromUtf8Error),
    /// A key the relay sets itself.
    #[error(
        "key {0:?} is a header the relay sets itself (reserved: {reserved}, {republish})",
        reserved = RESERVED_HEADERS.join(", "),
        republish = HEADER_REPUBLISH
    )]
    Reserved(String),
    /// No `:` after a key.
    #[error("expected ':' at byte {0}")]
    ExpectedColon(usize),
    /// No `,` or `}` after a value.
    #[error("expected ',' or '}}' at byte {0}")]
    ExpectedCommaOrEnd(usize),
    /// No string where a key must start.
    #[error("expected a string at byte {0}")]
    ExpectedString(usize),
    /// A string without its closing quote.
    #[error("unterminated string")]
    UnterminatedString,
    /// A string token whose bounds are not inside the text.
    #[error("bad string bounds")]
    StringBounds,
    /// A string token `serde_json` cannot unescape.
    #[error("bad string: {0}")]
    BadString(#[source] serde_json::Error),
    /// A value without its end.
    #[error("unterminated value")]
    UnterminatedValue,
}

/// Appends the entries of a JSON object as headers, in document order: string
/// values as their (unescaped) string, other values as their JSON text, sliced
/// from the input without copying.
///
/// # Errors
///
/// [`HeadersError`]: not a JSON object, or a reserved or non-UTF-8 key.
pub(super) fn parse_header_object(
    text: &Bytes,
    out: &mut Vec<(HeaderName, Bytes)>,
) -> Result<(), HeadersError> {
    // serde_json validates (no allocation); the scan below then only has to find
    // token boundaries, and still checks every index it uses.
    serde_json::from_slice::<serde::de::IgnoredAny>(text).map_err(HeadersError::InvalidJson)?;
    let b: &[u8] = text;
    let mut i = skip_ws(b, 0);
    match b.get(i) {
        Some(b'{') => i += 1,
        other => {
            let kind = match other {
                Some(b'[') => "an array",
                Some(b'"') => "a string",
                Some(b'n') => "null",
                Some(b't' | b'f') => "a boolean",
                _ => "a number",
            };
            return Err(HeadersError::NotAnObject(kind));
        }
    }
    i = skip_ws(b, i);
    if b.get(i) == Some(&b'}') {
        return Ok(());
    }
    loop {
        let (key_end, key_escaped) = scan_string(b, i)?;
        let name = json_string_value(text, i, key_end, key_escaped)?;
        let name = String::from_utf8(name.to_vec()).map_err(HeadersError::KeyNotUtf8)?;
        if is_reserved_header(&name) {
            return Err(HeadersError::Reserved(name));
        }
        i = skip_ws(b, key_end);
        if b.get(i) != Some(&b':') {
            return Err(HeadersError::ExpectedColon(i));
        }
        i = skip_ws(b, i + 1);
        let value = if b.get(i) == Some(&b'"') {
            let (end, escaped) = scan_string(b, i)?;
            let v = json_string_value(text, i, end, escaped)?;
            i = end;
            v
        } else {
            let (end, next) = skip_value(b, i)?;
            let v = text.slice(i..end);
            i = next;
            v
        };
        out.push((Cow::Owned(name), value));
        i = skip_ws(b, i);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => return Ok(()),
            _ => return Err(HeadersError::ExpectedCommaOrEnd(i)),
        }
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// `b[start]` is `"`; returns the index just past the closing quote and whether
/// the string has escapes.
fn scan_string(b: &[u8], start: usize) -> Result<(usize, bool), HeadersError> {
    if b.get(start) != Some(&b'"') {
        return Err(HeadersError::ExpectedString(start));
    }
    let mut i = start + 1;
    let mut escaped = false;
    loop {
        match b.get(i) {
            None => return Err(HeadersError::UnterminatedString),
            Some(b'\\') => {
                escaped = true;
                i += 2;
            }
            Some(b'"') => return Ok((i + 1, escaped)),
            Some(_) => i += 1,
        }
    }
}

/// The value of the string token `text[start..end]`: a zero-copy slice unless it
/// has escapes.
fn json_string_value(
    text: &Bytes,
    start: usize,
    end: usize,
    escaped: bool,
) -> Result<Bytes, HeadersError> {
    if !escaped {
        return text
            .get(start + 1..end - 1)
            .map(|_| text.slice(start + 1..end - 1))
            .ok_or(HeadersError::StringBounds);
    }
    let token = text.get(start..end).ok_or(HeadersError::StringBounds)?;
    serde_json::from_slice::<String>(token)
        .map(Bytes::from)
        .map_err(HeadersError::BadString)
}

/// Skips a non-string JSON value starting at `start`; returns the end of the
/// value (trailing whitespace excluded) and the index of the `,` or `}` after it.
fn skip_value(b: &[u8], start: usize) -> Result<(usize, usize), HeadersError> {
    let mut depth = 0usize;
    let mut i = start;
    let mut end = start;
    loop {
        match b.get(i) {
            None => return Err(HeadersError::UnterminatedValue),
            Some(b'"') => {
                i = scan_string(b, i)?.0;
                end = i;
                continue;
            }
            Some(b'{' | b'[') => depth += 1,
            Some(b'}' | b']') if depth == 0 => return Ok((end, i)),
            Some(b'}' | b']') => depth -= 1,
            Some(b',') if depth == 0 => return Ok((end, i)),
            Some(b' ' | b'\t' | b'\n' | b'\r') => {
                i += 1;
                continue;
            }
            Some(_) => {}
        }
        i += 1;
        end = i;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_relays_own_header_names_are_refused_the_republish_mark_too() {
        for name in RESERVED_HEADERS.iter().chain([&HEADER_REPUBLISH]) {
            let text = Bytes::from(format!(r#"{{"{name}": "x"}}"#));
            let err = parse_header_object(&text, &mut Vec::new()).unwrap_err();
            assert!(
                matches!(err, HeadersError::Reserved(ref n) if n == name),
                "{err}"
            );
        }
        let mut out = Vec::new();
        parse_header_object(&Bytes::from_static(br#"{"republish": "x"}"#), &mut out).unwrap();
        assert_eq!(out.len(), 1);
    }

    #[test]
    fn unescaped_header_strings_are_slices() {
        let text = Bytes::from_static(br#"{"a": "value", "b": [1]}"#);
        let mut out = Vec::new();
        parse_header_object(&text, &mut out).unwrap();
        for (_, v) in &out {
            let start = text.as_ptr() as usize;
            assert!(
                v.as_ptr() as usize >= start && v.as_ptr() as usize + v.len() <= start + text.len()
            );
        }
        assert_eq!(out[0].1, "value");
        assert_eq!(out[1].1, "[1]");
    }

    fn arb_json() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::Value;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            // Quarters are exact in binary and short in decimal, so serde_json (the
            // oracle) reads them back exactly.
            any::<i32>().prop_map(|q| Value::from(f64::from(q) / 4.0)),
            "[a-z \"\\\\\n\u{e9}]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 16, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z]{0,4}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn header_objects_match_serde_json(
            entries in proptest::collection::vec(("[a-z\"\\\\\u{e9}\n]{0,6}", arb_json()), 0..6),
        ) {
            let object = serde_json::Value::Object(entries.iter().cloned().collect());
            let text = Bytes::from(serde_json::to_vec_pretty(&object).unwrap());
            let mut out = Vec::new();
            parse_header_object(&text, &mut out).map_err(|e| TestCaseError::fail(e.to_string()))?;
            let expected: Vec<(String, serde_json::Value)> = object.as_object().unwrap().clone().into_iter().collect();
            prop_assert_eq!(out.len(), expected.len());
            for ((name, value), (want_name, want)) in out.iter().zip(&expected) {
                prop_assert_eq!(name.as_ref(), want_name.as_str());
                match want {
                    serde_json::Value::String(s) => prop_assert_eq!(&value[..], s.as_bytes()),
                    other => prop_assert_eq!(&serde_json::from_slice::<serde_json::Value>(value).unwrap(), other),
                }
            }
        }

        #[test]
        fn header_parser_never_panics(s in "[{}\\[\\]\",: a-z0-9\\\\]{0,40}") {
            let mut out = Vec::new();
            let _ = parse_header_object(&Bytes::from(s), &mut out);
        }
    }
}
