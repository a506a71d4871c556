//! Backend messages: framing the byte stream into messages and parsing their bodies.
//!
//! Every backend message is a tag byte and a big-endian `Int32` length that counts
//! itself but not the tag
//! (<https://www.postgresql.org/docs/current/protocol-message-formats.html>).
//! [`take_message`] cuts one complete message off the front of the read buffer, or
//! reports that more bytes are needed; it never trusts a length (less than 4 or more
//! than PostgreSQL's 1 GiB allocation limit is a broken stream) and never panics.
//! Bodies are parsed with a bounds-checked [`Cursor`]. `ErrorResponse` and
//! `NoticeResponse` are parsed leniently, since they must explain a failure, not
//! cause another one.
//!
//! `postgres-protocol` supplies only the frontend encoders we use; its backend parser
//! assumes the regular protocol and knows nothing of `CopyBoth`, so the few backend
//! messages a walsender sends are parsed here.

use bytes::{Buf, Bytes, BytesMut};

use super::error::ReplicationError;

/// Largest message accepted from the server. PostgreSQL builds messages in buffers
/// of at most 1 GiB (`MaxAllocSize`); anything longer is a broken stream.
const MAX_MESSAGE_LEN: usize = 1 << 30;

pub(super) const AUTHENTICATION: u8 = b'R';
pub(super) const BACKEND_KEY_DATA: u8 = b'K';
pub(super) const COMMAND_COMPLETE: u8 = b'C';
pub(super) const COPY_BOTH_RESPONSE: u8 = b'W';
pub(super) const COPY_DATA: u8 = b'd';
pub(super) const COPY_DONE: u8 = b'c';
pub(super) const COPY_IN_RESPONSE: u8 = b'G';
pub(super) const COPY_OUT_RESPONSE: u8 = b'H';
pub(super) const DATA_ROW: u8 = b'D';
pub(super) const EMPTY_QUERY_RESPONSE: u8 = b'I';
pub(super) const ERROR_RESPONSE: u8 = b'E';
pub(super) const NEGOTIATE_PROTOCOL_VERSION: u8 = b'v';
pub(super) const NOTICE_RESPONSE: u8 = b'N';
pub(super) const PARAMETER_STATUS: u8 = b'S';
pub(super) const READY_FOR_QUERY: u8 = b'Z';
pub(super) const ROW_DESCRIPTION: u8 = b'T';

/// One complete backend message: its tag and its body (length word stripped).
#[derive(Debug)]
pub(super) struct RawMessage {
    pub(super) tag: u8,
    pub(super) body: Bytes,
}

/// The header at the front of `buf`: `None` until its 5 bytes are there, else the
/// message's tag and whole length (tag byte included), or the error for a length
/// PostgreSQL never sends.
fn header(buf: &[u8]) -> Option<Result<(u8, usize), ReplicationError>> {
    let header = buf.get(..5)?;
    let tag = header[0];
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    if len < 4 {
        return Some(Err(ReplicationError::Protocol(format!(
            "message {} has invalid length {len}",
            tag_name(tag)
        ))));
    }
    if len > MAX_MESSAGE_LEN {
        return Some(Err(ReplicationError::Protocol(format!(
            "message {} claims {len} bytes, more than PostgreSQL ever sends",
            tag_name(tag)
        ))));
    }
    Some(Ok((tag, len + 1)))
}

/// Whether [`take_message`] would return at once: a whole message is buffered, or
/// the bytes buffered already make an invalid header (the error is then the answer).
pub(super) fn message_buffered(buf: &[u8]) -> bool {
    match header(buf) {
        None => false,
        Some(Err(_)) => true,
        Some(Ok((_, total))) => buf.len() >= total,
    }
}

/// Takes one complete message off the front of `buf`, or `None` when more bytes
/// are needed (then reserves room for the rest of the message).
pub(super) fn take_message(buf: &mut BytesMut) -> Result<Option<RawMessage>, ReplicationError> {
    let Some(header) = header(buf) else {
        return Ok(None);
    };
    let (tag, total) = header?;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let mut frame = buf.split_to(total).freeze();
    frame.advance(5);
    Ok(Some(RawMessage { tag, body: frame }))
}

pub(super) fn tag_name(tag: u8) -> String {
    if tag.is_ascii_graphic() {
        format!("'{}'", char::from(tag))
    } else {
        format!("0x{tag:02x}")
    }
}

pub(super) fn unexpected(tag: u8, phase: &str) -> ReplicationError {
    ReplicationError::Protocol(format!(
        "unexpected message {} during {phase}",
        tag_name(tag)
    ))
}

/// A bounds-checked reader over a message body.
pub(super) struct Cursor<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Cursor<'a> {
    pub(super) fn new(buf: &'a [u8], what: &'static str) -> Self {
        Cursor { buf, what }
    }

    fn truncated(&self) -> ReplicationError {
        ReplicationError::Protocol(format!("truncated {} message", self.what))
    }

    pub(super) fn bytes(&mut self, n: usize) -> Result<&'a [u8], ReplicationError> {
        if self.buf.len() < n {
            return Err(self.truncated());
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    pub(super) fn u8(&mut self) -> Result<u8, ReplicationError> {
        let (&b, rest) = self.buf.split_first().ok_or_else(|| self.truncated())?;
        self.buf = rest;
        Ok(b)
    }

    pub(super) fn i16(&mut self) -> Result<i16, ReplicationError> {
        let (head, rest) = self
            .buf
            .split_first_chunk::<2>()
            .ok_or_else(|| self.truncated())?;
        self.buf = rest;
        Ok(i16::from_be_bytes(*head))
    }

    pub(super) fn i32(&mut self) -> Result<i32, ReplicationError> {
        let (head, rest) = self
            .buf
            .split_first_chunk::<4>()
            .ok_or_else(|| self.truncated())?;
        self.buf = rest;
        Ok(i32::from_be_bytes(*head))
    }

    /// A NUL-terminated string, without the NUL.
    pub(super) fn cstr(&mut self) -> Result<&'a [u8], ReplicationError> {
        let end = self
            .buf
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| self.truncated())?;
        let s = self.bytes(end)?;
        self.u8()?;
        Ok(s)
    }

    pub(super) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.buf)
    }
}

/// The fields of an `ErrorResponse`/`NoticeResponse`.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct ErrorFields {
    pub(super) severity: String,
    pub(super) code: String,
    pub(super) message: String,
    pub(super) detail: Option<String>,
    pub(super) hint: Option<String>,
}

/// Parses error fields leniently: text is decoded lossily (before `client_encoding`
/// applies it may not be UTF-8), a missing code becomes `XX000`.
pub(super) fn parse_error_fields(body: &[u8]) -> ErrorFields {
    let mut fields = ErrorFields::default();
    let mut localized_severity = None;
    let mut cursor = Cursor::new(body, "ErrorResponse");
    while let Ok(kind) = cursor.u8() {
        if kind == 0 {
            break;
        }
        let Ok(value) = cursor.cstr() else { break };
        let value = String::from_utf8_lossy(value).into_owned();
        match kind {
            b'V' => fields.severity = value,
            b'S' => localized_severity = Some(value),
            b'C' => fields.code = value,
            b'M' => fields.message = value,
            b'D' => fields.detail = Some(value),
            b'H' => fields.hint = Some(value),
            _ => {}
        }
    }
    if fields.severity.is_empty() {
        fields.severity = localized_severity.unwrap_or_else(|| "ERROR".to_owned());
    }
    if fields.code.is_empty() {
        fields.code = "XX000".to_owned();
    }
    fields
}

pub(super) fn server_error(body: &[u8]) -> ReplicationError {
    let f = parse_error_fields(body);
    ReplicationError::Server {
        code: f.code,
        message: f.message,
        detail: f.detail,
        hint: f.hint,
    }
}

/// An error during startup: class 28 is an authentication failure.
pub(super) fn startup_error(body: &[u8], method: &str) -> ReplicationError {
    let f = parse_error_fields(body);
    if f.code.starts_with("28") {
        ReplicationError::Auth {
            method: method.to_owned(),
            code: Some(f.code),
            message: f.message,
        }
    } else {
        ReplicationError::Server {
            code: f.code,
            message: f.message,
            detail: f.detail,
            hint: f.hint,
        }
    }
}

pub(super) fn log_notice(body: &[u8]) {
    let f = parse_error_fields(body);
    match f.severity.as_str() {
        "WARNING" => tracing::warn!(
            code = %f.code, detail = ?f.detail, hint = ?f.hint,
            "PostgreSQL: {}", f.message
        ),
        "DEBUG" => tracing::debug!(code = %f.code, detail = ?f.detail, "PostgreSQL: {}", f.message),
        _ => tracing::info!(code = %f.code, detail = ?f.detail, "PostgreSQL: {}", f.message),
    }
}

/// Parses a `DataRow` into text columns.
pub(super) fn parse_data_row(body: &[u8]) -> Result<Vec<Option<String>>, ReplicationError> {
    let mut cursor = Cursor::new(body, "DataRow");
    let count = cursor.i16()?;
    let count = usize::try_from(count)
        .map_err(|_| ReplicationError::Protocol(format!("DataRow with {count} columns")))?;
    let mut row = Vec::with_capacity(count);
    for _ in 0..count {
        let len = cursor.i32()?;
        if len < 0 {
            row.push(None);
            continue;
        }
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        let value = cursor.bytes(len)?;
        let text = std::str::from_utf8(value)
            .map_err(|_| ReplicationError::Protocol("DataRow value is not UTF-8".to_owned()))?;
        row.push(Some(text.to_owned()));
    }
    Ok(row)
}
