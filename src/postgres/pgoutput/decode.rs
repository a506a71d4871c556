//! The decoder: [`decode`] for one message given its context, [`Decoder`] for a
//! stream that tracks Stream Start / Stream Stop itself.
//!
//! # Decoding without lengths
//!
//! Nothing in a `pgoutput` message says how long it is or how long its fields are
//! (only strings are terminated, only tuples and arrays are counted), so the decoder
//! must know every layout, per tag and per protocol version. It consumes the whole
//! buffer (one XLogData frame) and treats bytes left over as an error, because a
//! silent mismatch would mean it misread the fields before them.
//!
//! Some layouts depend on state the bytes do not carry: inside a v2 stream block the
//! data messages have an extra leading xid. [`DecodeContext`] carries that state for
//! the stateless [`decode`]; [`Decoder`] keeps it up to date from Stream Start and
//! Stream Stop and refuses a Stream Start inside a block or a Stream Stop outside one.
//!
//! # Zero copy, no panics
//!
//! Column values, names and message contents are [`Bytes`] slices of the input
//! buffer: decoding an `Insert` allocates exactly one `Vec` (its columns) and copies
//! no data. `Relation` messages are rare, so their names are validated once into
//! owned `String`s. Every read goes through a bounds-checked cursor that returns a
//! [`DecodeError`]; no input can make the decoder panic or overflow.

use bytes::Bytes;

use crate::lsn::Lsn;

use super::error::DecodeError;
use super::types::{
    BEGIN, BEGIN_PREPARE, Begin, BeginPrepare, COLUMN_BINARY, COLUMN_NULL, COLUMN_TEXT,
    COLUMN_UNCHANGED_TOAST, COMMIT, COMMIT_PREPARED, ColumnValue, Commit, CommitPrepared, DELETE,
    Delete, INSERT, Insert, LogicalDecodingMessage, LogicalReplicationMessage, MESSAGE, ORIGIN,
    OldTuple, Origin, PREPARE, PROTO_STREAM_PARALLEL, PROTO_STREAMING, PROTO_TWO_PHASE, PgStr,
    Prepare, RELATION, ROLLBACK_PREPARED, Relation, RelationColumn, RollbackPrepared, STREAM_ABORT,
    STREAM_COMMIT, STREAM_PREPARE, STREAM_START, STREAM_STOP, StreamAbort, StreamAbortInfo,
    StreamCommit, StreamStart, TRUNCATE, TUPLE_KEY, TUPLE_NEW, TUPLE_OLD, TYPE, Truncate,
    TupleData, Type, UPDATE, Update, message_name,
};

/// What the decoder must know that the bytes do not say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeContext {
    /// The `proto_version` requested in `START_REPLICATION` (1..=4; 0 is not a
    /// version and decodes nothing).
    pub protocol_version: u8,
    /// True between a Stream Start and its Stream Stop: data messages then carry a
    /// leading xid. Ignored for protocol versions below 2.
    pub in_stream: bool,
}

impl DecodeContext {
    /// A context for `protocol_version`, outside any stream block.
    #[must_use]
    pub const fn new(protocol_version: u8) -> Self {
        DecodeContext {
            protocol_version,
            in_stream: false,
        }
    }

    /// The same context, inside (`true`) or outside a stream block.
    #[must_use]
    pub const fn with_in_stream(self, in_stream: bool) -> Self {
        DecodeContext {
            protocol_version: self.protocol_version,
            in_stream,
        }
    }

    /// Whether data messages carry the streamed-transaction xid.
    #[must_use]
    pub const fn has_stream_xid(self) -> bool {
        self.in_stream && self.protocol_version >= PROTO_STREAMING
    }
}

impl Default for DecodeContext {
    /// Protocol version 1, not streaming.
    fn default() -> Self {
        DecodeContext::new(1)
    }
}

///
/// Column values, strings and message content are zero-copy slices of `buf`.
///
/// # Errors
///
/// [`DecodeError`] for an empty buffer, an unknown tag, a message newer than
/// `ctx.protocol_version`, a truncated or over-long message, or invalid field values.
pub fn decode(buf: Bytes, ctx: DecodeContext) -> Result<LogicalReplicationMessage, DecodeError> {
    let Some(&tag) = buf.first() else {
        return Err(DecodeError::Empty);
    };
    let required = match tag {
        STREAM_START | STREAM_STOP | STREAM_COMMIT | STREAM_ABORT => PROTO_STREAMING,
        BEGIN_PREPARE | PREPARE | COMMIT_PREPARED | ROLLBACK_PREPARED | STREAM_PREPARE => {
            PROTO_TWO_PHASE
        }
        _ => 1,
    };
    if ctx.protocol_version < required {
        return Err(DecodeError::UnsupportedMessage {
            tag,
            protocol_version: ctx.protocol_version,
            required,
        });
    }
    let mut cur = Cursor {
        buf,
        pos: 1,
        message: message_name(tag),
    };
    let msg = match tag {
        BEGIN => LogicalReplicationMessage::Begin(Begin {
            final_lsn: cur.get_lsn("final_lsn")?,
            commit_time: cur.get_i64("commit_time")?,
            xid: cur.get_u32("xid")?,
        }),
        COMMIT => LogicalReplicationMessage::Commit(Commit {
            flags: cur.get_u8("flags")?,
            commit_lsn: cur.get_lsn("commit_lsn")?,
            end_lsn: cur.get_lsn("end_lsn")?,
            commit_time: cur.get_i64("commit_time")?,
        }),
        ORIGIN => LogicalReplicationMessage::Origin(Origin {
            commit_lsn: cur.get_lsn("commit_lsn")?,
            name: cur.get_pgstr("name")?,
        }),
        RELATION => LogicalReplicationMessage::Relation(decode_relation(&mut cur, ctx)?),
        TYPE => LogicalReplicationMessage::Type(Type {
            xid: cur.get_stream_xid(ctx)?,
            type_oid: cur.get_u32("type_oid")?,
            namespace: cur.get_pgstr("namespace")?,
            name: cur.get_pgstr("name")?,
        }),
        INSERT => LogicalReplicationMessage::Insert(decode_insert(&mut cur, ctx)?),
        UPDATE => LogicalReplicationMessage::Update(decode_update(&mut cur, ctx)?),
        DELETE => LogicalReplicationMessage::Delete(decode_delete(&mut cur, ctx)?),
        TRUNCATE => LogicalReplicationMessage::Truncate(decode_truncate(&mut cur, ctx)?),
        MESSAGE => LogicalReplicationMessage::Message(decode_message(&mut cur, ctx)?),
        STREAM_START => LogicalReplicationMessage::StreamStart(StreamStart {
            xid: cur.get_u32("xid")?,
            first_segment: cur.get_u8("first_segment")? == 1,
        }),
        STREAM_STOP => LogicalReplicationMessage::StreamStop,
        STREAM_COMMIT => LogicalReplicationMessage::StreamCommit(StreamCommit {
            xid: cur.get_u32("xid")?,
            flags: cur.get_u8("flags")?,
            commit_lsn: cur.get_lsn("commit_lsn")?,
            end_lsn: cur.get_lsn("end_lsn")?,
            commit_time: cur.get_i64("commit_time")?,
        }),
        STREAM_ABORT => LogicalReplicationMessage::StreamAbort(decode_stream_abort(&mut cur, ctx)?),
        BEGIN_PREPARE => LogicalReplicationMessage::BeginPrepare(BeginPrepare {
            prepare_lsn: cur.get_lsn("prepare_lsn")?,
            end_lsn: cur.get_lsn("end_lsn")?,
            prepare_time: cur.get_i64("prepare_time")?,
            xid: cur.get_u32("xid")?,
            gid: cur.get_pgstr("gid")?,
        }),
        PREPARE => LogicalReplicationMessage::Prepare(decode_prepare(&mut cur)?),
        STREAM_PREPARE => LogicalReplicationMessage::StreamPrepare(decode_prepare(&mut cur)?),
        COMMIT_PREPARED => LogicalReplicationMessage::CommitPrepared(CommitPrepared {
            flags: cur.get_u8("flags")?,
            commit_lsn: cur.get_lsn("commit_lsn")?,
            end_lsn: cur.get_lsn("end_lsn")?,
            commit_time: cur.get_i64("commit_time")?,
            xid: cur.get_u32("xid")?,
            gid: cur.get_pgstr("gid")?,
        }),
        ROLLBACK_PREPARED => LogicalReplicationMessage::RollbackPrepared(RollbackPrepared {
            flags: cur.get_u8("flags")?,
            prepare_end_lsn: cur.get_lsn("prepare_end_lsn")?,
            rollback_end_lsn: cur.get_lsn("rollback_end_lsn")?,
            prepare_time: cur.get_i64("prepare_time")?,
            rollback_time: cur.get_i64("rollback_time")?,
            xid: cur.get_u32("xid")?,
            gid: cur.get_pgstr("gid")?,
        }),
        other => return Err(DecodeError::UnknownTag { tag: other }),
    };
    cur.finish()?;
    Ok(msg)
}

/// A stateful decoder that tracks stream blocks, so callers need not.
///
/// It sets [`DecodeContext::in_stream`] after a Stream Start and clears it after a
/// Stream Stop, and rejects a Stream Start inside a block or a Stream Stop outside
/// one. A failed decode leaves the state unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Decoder {
    ctx: DecodeContext,
}

impl Decoder {
    /// A decoder for `protocol_version`, outside any stream block.
    #[must_use]
    pub const fn new(protocol_version: u8) -> Self {
        Decoder {
            ctx: DecodeContext::new(protocol_version),
        }
    }

    /// The context the next message will be decoded with.
    #[must_use]
    pub const fn context(&self) -> DecodeContext {
        self.ctx
    }

    /// Decodes the next message of the stream and updates the stream-block state.
    ///
    /// # Errors
    ///
    /// Everything [`decode`] returns, plus [`DecodeError::StreamBoundary`].
    pub fn decode(&mut self, buf: Bytes) -> Result<LogicalReplicationMessage, DecodeError> {
        let msg = decode(buf, self.ctx)?;
        let in_stream = self.ctx.in_stream;
        match (&msg, in_stream) {
            (LogicalReplicationMessage::StreamStart(_), false) => self.ctx.in_stream = true,
            (LogicalReplicationMessage::StreamStop, true) => self.ctx.in_stream = false,
            (
                LogicalReplicationMessage::StreamStart(_) | LogicalReplicationMessage::StreamStop,
                _,
            ) => {
                return Err(DecodeError::StreamBoundary {
                    tag: msg.tag(),
                    in_stream,
                });
            }
            _ => {}
        }
        Ok(msg)
    }
}

fn decode_insert(cur: &mut Cursor, ctx: DecodeContext) -> Result<Insert, DecodeError> {
    let xid = cur.get_stream_xid(ctx)?;
    let relation_id = cur.get_u32("relation_id")?;
    cur.expect_new_marker("tuple marker")?;
    Ok(Insert {
        xid,
        relation_id,
        tuple: cur.get_tuple()?,
    })
}

fn decode_update(cur: &mut Cursor, ctx: DecodeContext) -> Result<Update, DecodeError> {
    let xid = cur.get_stream_xid(ctx)?;
    let relation_id = cur.get_u32("relation_id")?;
    let old = match cur.get_u8("tuple marker")? {
        TUPLE_KEY => Some(OldTuple::Key(cur.get_tuple()?)),
        TUPLE_OLD => Some(OldTuple::Full(cur.get_tuple()?)),
        TUPLE_NEW => None,
        other => return Err(cur.unexpected_marker("'K', 'O' or 'N'", other)),
    };
    if old.is_some() {
        cur.expect_new_marker("new tuple marker")?;
    }
    Ok(Update {
        xid,
        relation_id,
        old,
        new: cur.get_tuple()?,
    })
}

fn decode_delete(cur: &mut Cursor, ctx: DecodeContext) -> Result<Delete, DecodeError> {
    let xid = cur.get_stream_xid(ctx)?;
    let relation_id = cur.get_u32("relation_id")?;
    let old = match cur.get_u8("tuple marker")? {
        TUPLE_KEY => OldTuple::Key(cur.get_tuple()?),
        TUPLE_OLD => OldTuple::Full(cur.get_tuple()?),
        other => return Err(cur.unexpected_marker("'K' or 'O'", other)),
    };
    Ok(Delete {
        xid,
        relation_id,
        old,
    })
}

fn decode_truncate(cur: &mut Cursor, ctx: DecodeContext) -> Result<Truncate, DecodeError> {
    let xid = cur.get_stream_xid(ctx)?;
    let count = cur.get_count_i32("relation count")?;
    let options = cur.get_u8("options")?;
    let mut relation_ids = Vec::with_capacity(cur.capacity_for(count, 4));
    for _ in 0..count {
        relation_ids.push(cur.get_u32("relation_id")?);
    }
    Ok(Truncate {
        xid,
        options,
        relation_ids,
    })
}

fn decode_message(
    cur: &mut Cursor,
    ctx: DecodeContext,
) -> Result<LogicalDecodingMessage, DecodeError> {
    let xid = cur.get_stream_xid(ctx)?;
    let flags = cur.get_u8("flags")?;
    let lsn = cur.get_lsn("lsn")?;
    let prefix = cur.get_pgstr("prefix")?;
    let len = cur.get_count_i32("content length")?;
    Ok(LogicalDecodingMessage {
        xid,
        flags,
        lsn,
        prefix,
        content: cur.get_bytes(len, "content")?,
    })
}

fn decode_stream_abort(cur: &mut Cursor, ctx: DecodeContext) -> Result<StreamAbort, DecodeError> {
    let xid = cur.get_u32("xid")?;
    let subxid = cur.get_u32("subxid")?;
    // The v4 tail is present only with `streaming 'parallel'`; its absence is valid.
    let abort = if ctx.protocol_version >= PROTO_STREAM_PARALLEL && cur.remaining() > 0 {
        Some(StreamAbortInfo {
            abort_lsn: cur.get_lsn("abort_lsn")?,
            abort_time: cur.get_i64("abort_time")?,
        })
    } else {
        None
    };
    Ok(StreamAbort { xid, subxid, abort })
}

fn decode_relation(cur: &mut Cursor, ctx: DecodeContext) -> Result<Relation, DecodeError> {
    let xid = cur.get_stream_xid(ctx)?;
    let id = cur.get_u32("relation_id")?;
    let namespace = cur.get_string("namespace")?;
    let name = cur.get_string("name")?;
    let replica_identity = cur.get_u8("replica_identity")?;
    let count = cur.get_count_i16("column count")?;
    // flags (1) + name terminator (1) + type OID (4) + type modifier (4).
    let mut columns = Vec::with_capacity(cur.capacity_for(count, 10));
    for _ in 0..count {
        columns.push(RelationColumn {
            flags: cur.get_u8("column flags")?,
            name: cur.get_string("column name")?,
            type_oid: cur.get_u32("column type_oid")?,
            type_modifier: cur.get_i32("column type_modifier")?,
        });
    }
    Ok(Relation {
        xid,
        id,
        namespace,
        name,
        replica_identity,
        columns,
    })
}

fn decode_prepare(cur: &mut Cursor) -> Result<Prepare, DecodeError> {
    Ok(Prepare {
        flags: cur.get_u8("flags")?,
        prepare_lsn: cur.get_lsn("prepare_lsn")?,
        end_lsn: cur.get_lsn("end_lsn")?,
        prepare_time: cur.get_i64("prepare_time")?,
        xid: cur.get_u32("xid")?,
        gid: cur.get_pgstr("gid")?,
    })
}

/// length first and returns [`DecodeError`] instead of panicking; slices share the
/// input buffer.
struct Cursor {
    buf: Bytes,
    pos: usize,
    message: &'static str,
}

impl Cursor {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn truncated(&self, field: &'static str, needed: usize) -> DecodeError {
        DecodeError::Truncated {
            message: self.message,
            field,
            needed,
            remaining: self.remaining(),
        }
    }

    fn unexpected_marker(&self, expected: &'static str, found: u8) -> DecodeError {
        DecodeError::UnexpectedTupleMarker {
            message: self.message,
            expected,
            found,
        }
    }

    /// Reads a tuple marker that must be `'N'` (new tuple follows).
    fn expect_new_marker(&mut self, field: &'static str) -> Result<(), DecodeError> {
        match self.get_u8(field)? {
            TUPLE_NEW => Ok(()),
            other => Err(self.unexpected_marker("'N'", other)),
        }
    }

    /// The next `N` bytes as an array.
    fn take<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let chunk = self
            .buf
            .get(self.pos..)
            .and_then(<[u8]>::first_chunk::<N>)
            .copied()
            .ok_or_else(|| self.truncated(field, N))?;
        self.pos = self.pos.saturating_add(N);
        Ok(chunk)
    }

    fn get_u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        self.take::<1>(field).map(|[b]| b)
    }

    fn get_i16(&mut self, field: &'static str) -> Result<i16, DecodeError> {
        self.take(field).map(i16::from_be_bytes)
    }

    fn get_i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        self.take(field).map(i32::from_be_bytes)
    }

    fn get_u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        self.take(field).map(u32::from_be_bytes)
    }

    fn get_i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        self.take(field).map(i64::from_be_bytes)
    }

    fn get_lsn(&mut self, field: &'static str) -> Result<Lsn, DecodeError> {
        self.take(field).map(|b| Lsn(u64::from_be_bytes(b)))
    }

    /// The streamed-transaction xid, read only when the context says it is present.
    fn get_stream_xid(&mut self, ctx: DecodeContext) -> Result<Option<u32>, DecodeError> {
        if ctx.has_stream_xid() {
            self.get_u32("xid").map(Some)
        } else {
            Ok(None)
        }
    }

    fn invalid_length(&self, field: &'static str, value: i64) -> DecodeError {
        DecodeError::InvalidLength {
            message: self.message,
            field,
            value,
        }
    }

    /// An `Int16` count; negative is an error.
    fn get_count_i16(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let n = self.get_i16(field)?;
        usize::try_from(n).map_err(|_| self.invalid_length(field, i64::from(n)))
    }

    /// An `Int32` count or length; negative is an error.
    fn get_count_i32(&mut self, field: &'static str) -> Result<usize, DecodeError> {
        let n = self.get_i32(field)?;
        usize::try_from(n).map_err(|_| self.invalid_length(field, i64::from(n)))
    }

    /// How many elements of at least `min_size` bytes can still fit, capped at
    /// `count`: a preallocation bound that a hostile count cannot inflate.
    fn capacity_for(&self, count: usize, min_size: usize) -> usize {
        count.min(self.remaining().checked_div(min_size).unwrap_or(0))
    }

    /// The next `len` bytes as a zero-copy slice.
    fn get_bytes(&mut self, len: usize, field: &'static str) -> Result<Bytes, DecodeError> {
        let end = self
            .pos
            .checked_add(len)
            .filter(|&end| end <= self.buf.len())
            .ok_or_else(|| self.truncated(field, len))?;
        let out = self.buf.slice(self.pos..end);
        self.pos = end;
        Ok(out)
    }

    /// A NUL-terminated string as a zero-copy slice, terminator consumed.
    fn get_cstr(&mut self, field: &'static str) -> Result<Bytes, DecodeError> {
        let nul = self
            .buf
            .get(self.pos..)
            .and_then(|rest| rest.iter().position(|&b| b == 0))
            .ok_or(DecodeError::UnterminatedString {
                message: self.message,
                field,
            })?;
        let out = self.get_bytes(nul, field)?;
        self.pos = self.pos.saturating_add(1);
        Ok(out)
    }

    fn get_pgstr(&mut self, field: &'static str) -> Result<PgStr, DecodeError> {
        self.get_cstr(field).map(PgStr)
    }

    /// A NUL-terminated string validated into an owned `String`.
    fn get_string(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let raw = self.get_cstr(field)?;
        std::str::from_utf8(&raw)
            .map(str::to_owned)
            .map_err(|_| DecodeError::InvalidUtf8 {
                message: self.message,
                field,
            })
    }

    /// `TupleData`: an `Int16` column count, then a kind byte (and for text and
    /// binary an `Int32` length and the bytes) per column.
    fn get_tuple(&mut self) -> Result<TupleData, DecodeError> {
        let count = self.get_count_i16("tuple column count")?;
        // Every column takes at least its kind byte.
        let mut columns = Vec::with_capacity(self.capacity_for(count, 1));
        for _ in 0..count {
            let value = match self.get_u8("column kind")? {
                COLUMN_NULL => ColumnValue::Null,
                COLUMN_UNCHANGED_TOAST => ColumnValue::UnchangedToast,
                COLUMN_TEXT => {
                    let len = self.get_count_i32("column length")?;
                    ColumnValue::Text(self.get_bytes(len, "column value")?)
                }
                COLUMN_BINARY => {
                    let len = self.get_count_i32("column length")?;
                    ColumnValue::Binary(self.get_bytes(len, "column value")?)
                }
                kind => {
                    return Err(DecodeError::UnknownColumnKind {
                        message: self.message,
                        kind,
                    });
                }
            };
            columns.push(value);
        }
        Ok(TupleData { columns })
    }

    /// Rejects bytes left after a complete message.
    fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(DecodeError::TrailingBytes {
                message: self.message,
                extra,
            }),
        }
    }
}
