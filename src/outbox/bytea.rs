//! Decoding `bytea` text output back to the bytes.
//!
//! pgoutput sends every column in its type's text output (the relay does not ask
//! for binary), so a `bytea` payload arrives as text in one of PostgreSQL's two
//! formats (<https://www.postgresql.org/docs/current/datatype-binary.html>): *hex*,
//! `\x` and two hex digits per byte, the default since 9.0; or *escape*, with
//! `bytea_output = 'escape'` on the server, where printable bytes stand for
//! themselves, `\\` is a backslash and `\ooo` an octal byte. The record value is
//! the raw bytes the application stored, not their text, so both are decoded; text
//! that is neither is a poisoned row (`bad_payload`), never a guess.

use bytes::Bytes;

/// Why a `bytea` text is not PostgreSQL's output.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum ByteaError {
    /// Hex format with a character other than `0-9a-fA-F`.
    #[error("{0:?} is not a hex digit")]
    NotHexDigit(char),
    /// Hex format with an odd number of digits.
    #[error("odd number of hex digits")]
    OddHexDigits,
    /// Escape format with a `\` followed by neither `\` nor three octal digits.
    #[error("bad escape sequence at byte {0}")]
    BadEscape(usize),
}

/// Decodes `bytea` text output: hex (`\x0a1b…`, the default) or the escape format
/// (`\\`, `\ooo` octal, other bytes literal).
///
/// # Errors
///
/// [`ByteaError`]: the text is in neither format.
pub(super) fn decode_bytea_text(text: &[u8]) -> Result<Bytes, ByteaError> {
    if let Some(hex) = text.strip_prefix(b"\\x") {
        let digit = |c: u8| -> Result<u8, ByteaError> {
            match c {
                b'0'..=b'9' => Ok(c - b'0'),
                b'a'..=b'f' => Ok(c - b'a' + 10),
                b'A'..=b'F' => Ok(c - b'A' + 10),
                _ => Err(ByteaError::NotHexDigit(char::from(c))),
            }
        };
        if hex.len() % 2 != 0 {
            return Err(ByteaError::OddHexDigits);
        }
        let mut out = Vec::with_capacity(hex.len() / 2);
        for pair in hex.chunks_exact(2) {
            out.push((digit(pair[0])? << 4) | digit(pair[1])?);
        }
        return Ok(Bytes::from(out));
    }
    let mut out = Vec::with_capacity(text.len());
    let mut i = 0;
    while let Some(&c) = text.get(i) {
        if c != b'\\' {
            out.push(c);
            i += 1;
            continue;
        }
        match text.get(i + 1..i + 4) {
            Some(&[b'\\', ..]) => {
                out.push(b'\\');
                i += 2;
            }
            Some(&[a @ b'0'..=b'3', b @ b'0'..=b'7', c @ b'0'..=b'7']) => {
                out.push(((a - b'0') << 6) | ((b - b'0') << 3) | (c - b'0'));
                i += 4;
            }
            _ if text.get(i + 1) == Some(&b'\\') => {
                out.push(b'\\');
                i += 2;
            }
            _ => return Err(ByteaError::BadEscape(i)),
        }
    }
    Ok(Bytes::from(out))
}
