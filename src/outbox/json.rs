//! Writing JSON string literals without a JSON library.
//!
//! The envelope and its pre-encoded constant fields are assembled byte by byte (see
//! [`super::envelope`]): only the short string fields are escaped, the payload is
//! spliced in as PostgreSQL produced it. A string literal needs exactly the escapes of
//! RFC 8259 §7 — `"` and `\`, and the control characters U+0000–U+001F — so the writer
//! is a single pass that copies runs of plain bytes; everything else, including
//! U+007F and U+2028/U+2029, is valid inside a JSON string and is copied as UTF-8.
//! See <https://www.rfc-editor.org/rfc/rfc8259#section-7>.

use std::str::Utf8Error;

use bytes::BufMut;

/// Writes `s` as a JSON string literal.
pub(super) fn put_json_string<B: BufMut>(out: &mut B, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let bytes = s.as_bytes();
    out.put_u8(b'"');
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0..=0x1f => {
                out.put_slice(&bytes[start..i]);
                out.put_slice(b"\\u00");
                out.put_u8(HEX[usize::from(b >> 4)]);
                out.put_u8(HEX[usize::from(b & 0xf)]);
                start = i + 1;
                continue;
            }
            _ => continue,
        };
        out.put_slice(&bytes[start..i]);
        out.put_slice(escape);
        start = i + 1;
    }
    out.put_slice(&bytes[start..]);
    out.put_u8(b'"');
}

/// Writes `value` as a JSON string literal, or `null` for `None`.
///
/// # Errors
///
/// The value is not UTF-8, so it cannot be a JSON string.
pub(super) fn put_json_string_or_null<B: BufMut>(
    out: &mut B,
    value: Option<&[u8]>,
) -> Result<(), Utf8Error> {
    match value {
        None => out.put_slice(b"null"),
        Some(v) => put_json_string(out, std::str::from_utf8(v)?),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn json_escaping() {
        let mut out = Vec::new();
        put_json_string(&mut out, "a\"\\\n\r\t\u{8}\u{c}\u{1f}\u{7f}é\u{2028}");
        let s = String::from_utf8(out).unwrap();
        assert_eq!(s, "\"a\\\"\\\\\\n\\r\\t\\b\\f\\u001f\u{7f}é\u{2028}\"");
        assert_eq!(
            serde_json::from_str::<String>(&s).unwrap(),
            "a\"\\\n\r\t\u{8}\u{c}\u{1f}\u{7f}é\u{2028}"
        );
    }

    proptest! {
        #[test]
        fn json_strings_round_trip(s in "\\PC*|[\u{0}-\u{1f}\"\\\\]{0,10}") {
            let mut out = Vec::new();
            put_json_string(&mut out, &s);
            prop_assert_eq!(serde_json::from_slice::<String>(&out).unwrap(), s);
        }
    }
}
