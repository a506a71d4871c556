//! A test encoder, the mirror of the decoder, and proptest generators of every
//! message kind: the unit tests round-trip through them.

use bytes::{BufMut, Bytes, BytesMut};
use proptest::prelude::*;

use super::*;
use crate::lsn::Lsn;

pub(super) fn put_cstr(out: &mut BytesMut, s: &[u8]) {
    out.put_slice(s);
    out.put_u8(0);
}

pub(super) fn put_xid(out: &mut BytesMut, xid: Option<u32>) {
    if let Some(xid) = xid {
        out.put_u32(xid);
    }
}

pub(super) fn put_tuple(out: &mut BytesMut, tuple: &TupleData) {
    let count = i16::try_from(tuple.columns.len()).expect("test tuples are small");
    out.put_i16(count);
    for value in &tuple.columns {
        out.put_u8(value.kind());
        if let Some(bytes) = value.bytes() {
            out.put_i32(i32::try_from(bytes.len()).expect("test values are small"));
            out.put_slice(bytes);
        }
    }
}

pub(super) fn put_prepare(out: &mut BytesMut, p: &Prepare) {
    out.put_u8(p.flags);
    out.put_u64(p.prepare_lsn.0);
    out.put_u64(p.end_lsn.0);
    out.put_i64(p.prepare_time);
    out.put_u32(p.xid);
    put_cstr(out, p.gid.as_bytes());
}

pub(crate) fn encode(msg: &LogicalReplicationMessage) -> Bytes {
    use LogicalReplicationMessage as M;
    let mut out = BytesMut::new();
    out.put_u8(msg.tag());
    match msg {
        M::Begin(b) => {
            out.put_u64(b.final_lsn.0);
            out.put_i64(b.commit_time);
            out.put_u32(b.xid);
        }
        M::Commit(c) => {
            out.put_u8(c.flags);
            out.put_u64(c.commit_lsn.0);
            out.put_u64(c.end_lsn.0);
            out.put_i64(c.commit_time);
        }
        M::Origin(o) => {
            out.put_u64(o.commit_lsn.0);
            put_cstr(&mut out, o.name.as_bytes());
        }
        M::Relation(r) => {
            put_xid(&mut out, r.xid);
            out.put_u32(r.id);
            put_cstr(&mut out, r.namespace.as_bytes());
            put_cstr(&mut out, r.name.as_bytes());
            out.put_u8(r.replica_identity);
            out.put_i16(i16::try_from(r.columns.len()).expect("few columns"));
            for c in &r.columns {
                out.put_u8(c.flags);
                put_cstr(&mut out, c.name.as_bytes());
                out.put_u32(c.type_oid);
                out.put_i32(c.type_modifier);
            }
        }
        M::Type(t) => {
            put_xid(&mut out, t.xid);
            out.put_u32(t.type_oid);
            put_cstr(&mut out, t.namespace.as_bytes());
            put_cstr(&mut out, t.name.as_bytes());
        }
        M::Insert(i) => {
            put_xid(&mut out, i.xid);
            out.put_u32(i.relation_id);
            out.put_u8(TUPLE_NEW);
            put_tuple(&mut out, &i.tuple);
        }
        M::Update(u) => {
            put_xid(&mut out, u.xid);
            out.put_u32(u.relation_id);
            if let Some(old) = &u.old {
                out.put_u8(old.marker());
                put_tuple(&mut out, old.tuple());
            }
            out.put_u8(TUPLE_NEW);
            put_tuple(&mut out, &u.new);
        }
        M::Delete(d) => {
            put_xid(&mut out, d.xid);
            out.put_u32(d.relation_id);
            out.put_u8(d.old.marker());
            put_tuple(&mut out, d.old.tuple());
        }
        M::Truncate(t) => {
            put_xid(&mut out, t.xid);
            out.put_i32(i32::try_from(t.relation_ids.len()).expect("few relations"));
            out.put_u8(t.options);
            for id in &t.relation_ids {
                out.put_u32(*id);
            }
        }
        M::Message(m) => {
            put_xid(&mut out, m.xid);
            out.put_u8(m.flags);
            out.put_u64(m.lsn.0);
            put_cstr(&mut out, m.prefix.as_bytes());
            out.put_i32(i32::try_from(m.content.len()).expect("small content"));
            out.put_slice(&m.content);
        }
        M::StreamStart(s) => {
            out.put_u32(s.xid);
            out.put_u8(u8::from(s.first_segment));
        }
        M::StreamStop => {}
        M::StreamCommit(c) => {
            out.put_u32(c.xid);
            out.put_u8(c.flags);
            out.put_u64(c.commit_lsn.0);
            out.put_u64(c.end_lsn.0);
            out.put_i64(c.commit_time);
        }
        M::StreamAbort(a) => {
            out.put_u32(a.xid);
            out.put_u32(a.subxid);
            if let Some(info) = a.abort {
                out.put_u64(info.abort_lsn.0);
                out.put_i64(info.abort_time);
            }
        }
        M::BeginPrepare(b) => {
            out.put_u64(b.prepare_lsn.0);
            out.put_u64(b.end_lsn.0);
            out.put_i64(b.prepare_time);
            out.put_u32(b.xid);
            put_cstr(&mut out, b.gid.as_bytes());
        }
        M::Prepare(p) | M::StreamPrepare(p) => put_prepare(&mut out, p),
        M::CommitPrepared(c) => {
            out.put_u8(c.flags);
            out.put_u64(c.commit_lsn.0);
            out.put_u64(c.end_lsn.0);
            out.put_i64(c.commit_time);
            out.put_u32(c.xid);
            put_cstr(&mut out, c.gid.as_bytes());
        }
        M::RollbackPrepared(r) => {
            out.put_u8(r.flags);
            out.put_u64(r.prepare_end_lsn.0);
            out.put_u64(r.rollback_end_lsn.0);
            out.put_i64(r.prepare_time);
            out.put_i64(r.rollback_time);
            out.put_u32(r.xid);
            put_cstr(&mut out, r.gid.as_bytes());
        }
    }
    out.freeze()
}

/// The streamed-transaction xid of a data message, if it has one.
pub(super) fn stream_xid(msg: &LogicalReplicationMessage) -> Option<u32> {
    use LogicalReplicationMessage as M;
    match msg {
        M::Relation(m) => m.xid,
        M::Type(m) => m.xid,
        M::Insert(m) => m.xid,
        M::Update(m) => m.xid,
        M::Delete(m) => m.xid,
        M::Truncate(m) => m.xid,
        M::Message(m) => m.xid,
        _ => None,
    }
}

/// The lowest protocol version that can carry `msg` as built.
pub(super) fn min_version(msg: &LogicalReplicationMessage) -> u8 {
    use LogicalReplicationMessage as M;
    match msg {
        M::StreamAbort(StreamAbort { abort: Some(_), .. }) => PROTO_STREAM_PARALLEL,
        M::StreamStart(_) | M::StreamStop | M::StreamCommit(_) | M::StreamAbort(_) => {
            PROTO_STREAMING
        }
        M::BeginPrepare(_)
        | M::Prepare(_)
        | M::CommitPrepared(_)
        | M::RollbackPrepared(_)
        | M::StreamPrepare(_) => PROTO_TWO_PHASE,
        _ if stream_xid(msg).is_some() => PROTO_STREAMING,
        _ => 1,
    }
}

/// The context `msg` must be decoded with (at least `version`).
pub(super) fn ctx_for(msg: &LogicalReplicationMessage, version: u8) -> DecodeContext {
    DecodeContext::new(version.max(min_version(msg))).with_in_stream(stream_xid(msg).is_some())
}

pub(super) fn b(s: &'static str) -> Bytes {
    Bytes::from_static(s.as_bytes())
}

pub(super) fn pgstr(s: &'static str) -> PgStr {
    PgStr(b(s))
}

pub(super) fn outbox_tuple() -> TupleData {
    TupleData {
        columns: vec![
            ColumnValue::Text(b("0190f5c2-7d4e-7a3b-9c1d-2e3f4a5b6c7d")),
            ColumnValue::Text(b("order-42")),
            ColumnValue::Null,
            ColumnValue::Text(b(r#"{"total": 12.5}"#)),
            ColumnValue::Binary(Bytes::from_static(&[0, 1, 2, 0xff])),
            ColumnValue::Text(Bytes::new()),
        ],
    }
}

/// One valid instance of every message kind, with the context to decode it.
pub(super) fn samples() -> Vec<(LogicalReplicationMessage, DecodeContext)> {
    use LogicalReplicationMessage as M;
    let msgs = vec![
        M::Begin(Begin {
            final_lsn: Lsn(0x16_B374_D848),
            commit_time: 774_000_000_000_000,
            xid: 771,
        }),
        M::Commit(Commit {
            flags: 0,
            commit_lsn: Lsn(0x16_B374_D848),
            end_lsn: Lsn(0x16_B374_D878),
            commit_time: 774_000_000_000_000,
        }),
        M::Origin(Origin {
            commit_lsn: Lsn(5),
            name: pgstr("pg_16399"),
        }),
        M::Relation(Relation {
            xid: None,
            id: 16_384,
            namespace: "public".into(),
            name: "outbox".into(),
            replica_identity: b'd',
            columns: vec![
                RelationColumn {
                    flags: 1,
                    name: "id".into(),
                    type_oid: 2950,
                    type_modifier: -1,
                },
                RelationColumn {
                    flags: 0,
                    name: "payload".into(),
                    type_oid: 3802,
                    type_modifier: -1,
                },
            ],
        }),
        M::Relation(Relation {
            xid: Some(900),
            id: 1,
            namespace: String::new(),
            name: "t".into(),
            replica_identity: b'f',
            columns: vec![],
        }),
        M::Type(Type {
            xid: None,
            type_oid: 16_500,
            namespace: pgstr("public"),
            name: pgstr("mood"),
        }),
        M::Insert(Insert {
            xid: None,
            relation_id: 16_384,
            tuple: outbox_tuple(),
        }),
        M::Insert(Insert {
            xid: Some(901),
            relation_id: 16_384,
            tuple: TupleData::default(),
        }),
        M::Update(Update {
            xid: None,
            relation_id: 16_384,
            old: None,
            new: TupleData {
                columns: vec![ColumnValue::Text(b("1")), ColumnValue::UnchangedToast],
            },
        }),
        M::Update(Update {
            xid: Some(902),
            relation_id: 16_384,
            old: Some(OldTuple::Key(TupleData {
                columns: vec![ColumnValue::Text(b("1")), ColumnValue::Null],
            })),
            new: TupleData {
                columns: vec![ColumnValue::Text(b("2")), ColumnValue::Text(b("x"))],
            },
        }),
        M::Update(Update {
            xid: None,
            relation_id: 7,
            old: Some(OldTuple::Full(outbox_tuple())),
            new: outbox_tuple(),
        }),
        M::Delete(Delete {
            xid: None,
            relation_id: 16_384,
            old: OldTuple::Key(TupleData {
                columns: vec![ColumnValue::Text(b("1")), ColumnValue::Null],
            }),
        }),
        M::Delete(Delete {
            xid: Some(903),
            relation_id: 16_384,
            old: OldTuple::Full(outbox_tuple()),
        }),
        M::Truncate(Truncate {
            xid: None,
            options: Truncate::CASCADE | Truncate::RESTART_IDENTITY,
            relation_ids: vec![16_384, 16_390],
        }),
        M::Message(LogicalDecodingMessage {
            xid: None,
            flags: 0,
            lsn: Lsn(0x1_0000_0000),
            prefix: pgstr("outbox_relay.heartbeat"),
            content: b("tick"),
        }),
        M::Message(LogicalDecodingMessage {
            xid: Some(904),
            flags: LogicalDecodingMessage::TRANSACTIONAL,
            lsn: Lsn(9),
            prefix: PgStr::default(),
            content: Bytes::new(),
        }),
        M::StreamStart(StreamStart {
            xid: 905,
            first_segment: true,
        }),
        M::StreamStop,
        M::StreamCommit(StreamCommit {
            xid: 905,
            flags: 0,
            commit_lsn: Lsn(100),
            end_lsn: Lsn(148),
            commit_time: 1,
        }),
        M::StreamAbort(StreamAbort {
            xid: 905,
            subxid: 906,
            abort: None,
        }),
        M::StreamAbort(StreamAbort {
            xid: 905,
            subxid: 905,
            abort: Some(StreamAbortInfo {
                abort_lsn: Lsn(200),
                abort_time: -1,
            }),
        }),
        M::BeginPrepare(BeginPrepare {
            prepare_lsn: Lsn(300),
            end_lsn: Lsn(348),
            prepare_time: 2,
            xid: 907,
            gid: pgstr("gid-1"),
        }),
        M::Prepare(Prepare {
            flags: 0,
            prepare_lsn: Lsn(300),
            end_lsn: Lsn(348),
            prepare_time: 2,
            xid: 907,
            gid: pgstr("gid-1"),
        }),
        M::StreamPrepare(Prepare {
            flags: 0,
            prepare_lsn: Lsn(400),
            end_lsn: Lsn(448),
            prepare_time: 3,
            xid: 908,
            gid: pgstr("gid-2"),
        }),
        M::CommitPrepared(CommitPrepared {
            flags: 0,
            commit_lsn: Lsn(500),
            end_lsn: Lsn(548),
            commit_time: 4,
            xid: 907,
            gid: pgstr("gid-1"),
        }),
        M::RollbackPrepared(RollbackPrepared {
            flags: 0,
            prepare_end_lsn: Lsn(448),
            rollback_end_lsn: Lsn(600),
            prepare_time: 3,
            rollback_time: 5,
            xid: 908,
            gid: pgstr("gid-2"),
        }),
    ];
    msgs.into_iter()
        .map(|m| {
            let ctx = ctx_for(&m, 1);
            (m, ctx)
        })
        .collect()
}

// ---- property tests ----

pub(super) fn arb_lsn() -> impl Strategy<Value = Lsn> {
    any::<u64>().prop_map(Lsn)
}

pub(super) fn arb_pgstr() -> impl Strategy<Value = PgStr> {
    proptest::collection::vec(1u8..=255, 0..12).prop_map(|v| PgStr(Bytes::from(v)))
}

pub(super) fn arb_name() -> impl Strategy<Value = String> {
    "[^\u{0}]{0,12}"
}

pub(super) fn arb_bytes() -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), 0..24).prop_map(Bytes::from)
}

pub(super) fn arb_xid() -> impl Strategy<Value = Option<u32>> {
    proptest::option::of(any::<u32>())
}

pub(super) fn arb_tuple() -> impl Strategy<Value = TupleData> {
    let value = prop_oneof![
        Just(ColumnValue::Null),
        Just(ColumnValue::UnchangedToast),
        arb_bytes().prop_map(ColumnValue::Text),
        arb_bytes().prop_map(ColumnValue::Binary),
    ];
    proptest::collection::vec(value, 0..8).prop_map(|columns| TupleData { columns })
}

pub(super) fn arb_old() -> impl Strategy<Value = OldTuple> {
    prop_oneof![
        arb_tuple().prop_map(OldTuple::Key),
        arb_tuple().prop_map(OldTuple::Full)
    ]
}

pub(super) fn arb_prepare() -> impl Strategy<Value = Prepare> {
    (
        any::<u8>(),
        arb_lsn(),
        arb_lsn(),
        any::<i64>(),
        any::<u32>(),
        arb_pgstr(),
    )
        .prop_map(
            |(flags, prepare_lsn, end_lsn, prepare_time, xid, gid)| Prepare {
                flags,
                prepare_lsn,
                end_lsn,
                prepare_time,
                xid,
                gid,
            },
        )
}

pub(super) fn arb_message() -> impl Strategy<Value = LogicalReplicationMessage> {
    use LogicalReplicationMessage as M;
    let column = (any::<u8>(), arb_name(), any::<u32>(), any::<i32>()).prop_map(
        |(flags, name, type_oid, type_modifier)| RelationColumn {
            flags,
            name,
            type_oid,
            type_modifier,
        },
    );
    prop_oneof![
        (arb_lsn(), any::<i64>(), any::<u32>()).prop_map(|(final_lsn, commit_time, xid)| {
            M::Begin(Begin {
                final_lsn,
                commit_time,
                xid,
            })
        }),
        (any::<u8>(), arb_lsn(), arb_lsn(), any::<i64>()).prop_map(
            |(flags, commit_lsn, end_lsn, commit_time)| M::Commit(Commit {
                flags,
                commit_lsn,
                end_lsn,
                commit_time,
            })
        ),
        (arb_lsn(), arb_pgstr())
            .prop_map(|(commit_lsn, name)| M::Origin(Origin { commit_lsn, name })),
        (
            arb_xid(),
            any::<u32>(),
            arb_name(),
            arb_name(),
            any::<u8>(),
            proptest::collection::vec(column, 0..6)
        )
            .prop_map(|(xid, id, namespace, name, replica_identity, columns)| {
                M::Relation(Relation {
                    xid,
                    id,
                    namespace,
                    name,
                    replica_identity,
                    columns,
                })
            }),
        (arb_xid(), any::<u32>(), arb_pgstr(), arb_pgstr()).prop_map(
            |(xid, type_oid, namespace, name)| M::Type(Type {
                xid,
                type_oid,
                namespace,
                name,
            })
        ),
        (arb_xid(), any::<u32>(), arb_tuple()).prop_map(|(xid, relation_id, tuple)| {
            M::Insert(Insert {
                xid,
                relation_id,
                tuple,
            })
        }),
        (
            arb_xid(),
            any::<u32>(),
            proptest::option::of(arb_old()),
            arb_tuple()
        )
            .prop_map(|(xid, relation_id, old, new)| M::Update(Update {
                xid,
                relation_id,
                old,
                new,
            })),
        (arb_xid(), any::<u32>(), arb_old()).prop_map(|(xid, relation_id, old)| {
            M::Delete(Delete {
                xid,
                relation_id,
                old,
            })
        }),
        (
            arb_xid(),
            any::<u8>(),
            proptest::collection::vec(any::<u32>(), 0..6)
        )
            .prop_map(|(xid, options, relation_ids)| M::Truncate(Truncate {
                xid,
                options,
                relation_ids,
            })),
        (arb_xid(), any::<u8>(), arb_lsn(), arb_pgstr(), arb_bytes()).prop_map(
            |(xid, flags, lsn, prefix, content)| M::Message(LogicalDecodingMessage {
                xid,
                flags,
                lsn,
                prefix,
                content,
            })
        ),
        (any::<u32>(), any::<bool>()).prop_map(|(xid, first_segment)| {
            M::StreamStart(StreamStart { xid, first_segment })
        }),
        Just(M::StreamStop),
        (
            any::<u32>(),
            any::<u8>(),
            arb_lsn(),
            arb_lsn(),
            any::<i64>()
        )
            .prop_map(|(xid, flags, commit_lsn, end_lsn, commit_time)| {
                M::StreamCommit(StreamCommit {
                    xid,
                    flags,
                    commit_lsn,
                    end_lsn,
                    commit_time,
                })
            }),
        (
            any::<u32>(),
            any::<u32>(),
            proptest::option::of((arb_lsn(), any::<i64>()))
        )
            .prop_map(|(xid, subxid, abort)| M::StreamAbort(StreamAbort {
                xid,
                subxid,
                abort: abort.map(|(abort_lsn, abort_time)| StreamAbortInfo {
                    abort_lsn,
                    abort_time,
                }),
            })),
        (
            arb_lsn(),
            arb_lsn(),
            any::<i64>(),
            any::<u32>(),
            arb_pgstr()
        )
            .prop_map(|(prepare_lsn, end_lsn, prepare_time, xid, gid)| {
                M::BeginPrepare(BeginPrepare {
                    prepare_lsn,
                    end_lsn,
                    prepare_time,
                    xid,
                    gid,
                })
            }),
        arb_prepare().prop_map(M::Prepare),
        arb_prepare().prop_map(M::StreamPrepare),
        (
            any::<u8>(),
            arb_lsn(),
            arb_lsn(),
            any::<i64>(),
            any::<u32>(),
            arb_pgstr()
        )
            .prop_map(|(flags, commit_lsn, end_lsn, commit_time, xid, gid)| {
                M::CommitPrepared(CommitPrepared {
                    flags,
                    commit_lsn,
                    end_lsn,
                    commit_time,
                    xid,
                    gid,
                })
            }),
        (
            any::<u8>(),
            arb_lsn(),
            arb_lsn(),
            any::<i64>(),
            any::<i64>(),
            any::<u32>(),
            arb_pgstr()
        )
            .prop_map(
                |(
                    flags,
                    prepare_end_lsn,
                    rollback_end_lsn,
                    prepare_time,
                    rollback_time,
                    xid,
                    gid,
                )| {
                    M::RollbackPrepared(RollbackPrepared {
                        flags,
                        prepare_end_lsn,
                        rollback_end_lsn,
                        prepare_time,
                        rollback_time,
                        xid,
                        gid,
                    })
                }
            ),
    ]
}

pub(super) fn arb_ctx() -> impl Strategy<Value = DecodeContext> {
    (0u8..=5, any::<bool>()).prop_map(|(v, s)| DecodeContext::new(v).with_in_stream(s))
}

/// Every known tag, to steer random bodies into the message decoders.
pub(super) const TAGS: [u8; 19] = [
    BEGIN,
    COMMIT,
    ORIGIN,
    RELATION,
    TYPE,
    INSERT,
    UPDATE,
    DELETE,
    TRUNCATE,
    MESSAGE,
    STREAM_START,
    STREAM_STOP,
    STREAM_COMMIT,
    STREAM_ABORT,
    BEGIN_PREPARE,
    PREPARE,
    COMMIT_PREPARED,
    ROLLBACK_PREPARED,
    STREAM_PREPARE,
];
