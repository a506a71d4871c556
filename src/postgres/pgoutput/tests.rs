//! Unit tests of the `pgoutput` decoder: round trips of every message kind, the
//! streamed-transaction xid, every error variant, and property tests that no input
//! makes the decoder panic.

use bytes::{BufMut, Bytes, BytesMut};
use proptest::prelude::*;

use super::testkit::*;
use super::*;
use crate::lsn::Lsn;

// ---- round trips ----

#[test]
fn every_sample_round_trips() {
    let samples = samples();
    // Every message kind is covered.
    let mut tags: Vec<u8> = samples.iter().map(|(m, _)| m.tag()).collect();
    tags.sort_unstable();
    tags.dedup();
    assert_eq!(tags.len(), 19);
    for (msg, ctx) in samples {
        let bytes = encode(&msg);
        assert_eq!(decode(bytes, ctx).as_ref(), Ok(&msg), "{}", msg.name());
    }
}

#[test]
fn newer_versions_decode_older_messages() {
    for (msg, _) in samples() {
        let bytes = encode(&msg);
        for version in min_version(&msg)..=PROTO_STREAM_PARALLEL {
            let ctx = ctx_for(&msg, version);
            assert_eq!(decode(bytes.clone(), ctx).as_ref(), Ok(&msg), "v{version}");
        }
    }
}

#[test]
fn insert_decodes_from_hand_built_bytes() {
    let mut buf = BytesMut::new();
    buf.put_u8(b'I');
    buf.put_u32(16_384);
    buf.put_u8(b'N');
    buf.put_i16(3);
    buf.put_u8(b't');
    buf.put_i32(2);
    buf.put_slice(b"42");
    buf.put_u8(b'n');
    buf.put_u8(b'b');
    buf.put_i32(1);
    buf.put_u8(0xAB);
    let buf = buf.freeze();
    let msg = decode(buf.clone(), DecodeContext::default()).expect("valid Insert");
    let LogicalReplicationMessage::Insert(insert) = msg else {
        panic!("expected Insert, got {msg:?}");
    };
    assert_eq!(insert.relation_id, 16_384);
    assert_eq!(insert.xid, None);
    assert_eq!(insert.tuple.len(), 3);
    assert_eq!(insert.tuple.get(0), Some(&ColumnValue::Text(b("42"))));
    assert_eq!(insert.tuple.get(1), Some(&ColumnValue::Null));
    assert_eq!(
        insert.tuple.get(2),
        Some(&ColumnValue::Binary(Bytes::from_static(&[0xAB])))
    );
    assert_eq!(insert.tuple.get(3), None);
}

#[test]
fn values_and_names_are_zero_copy() {
    let msg = LogicalReplicationMessage::Insert(Insert {
        xid: None,
        relation_id: 1,
        tuple: outbox_tuple(),
    });
    let bytes = encode(&msg);
    let range = bytes.as_ptr_range();
    let decoded = decode(bytes.clone(), DecodeContext::default()).expect("valid");
    let LogicalReplicationMessage::Insert(insert) = decoded else {
        panic!("expected Insert");
    };
    for value in insert.tuple.columns.iter().filter_map(ColumnValue::bytes) {
        if !value.is_empty() {
            assert!(range.contains(&value.as_ptr()), "value copied: {value:?}");
        }
    }

    let origin = LogicalReplicationMessage::Origin(Origin {
        commit_lsn: Lsn(1),
        name: pgstr("node_a"),
    });
    let bytes = encode(&origin);
    let range = bytes.as_ptr_range();
    let Ok(LogicalReplicationMessage::Origin(o)) = decode(bytes.clone(), DecodeContext::default())
    else {
        panic!("expected Origin");
    };
    assert!(range.contains(&o.name.as_bytes().as_ptr()));
    assert_eq!(o.name, "node_a");
    assert_eq!(o.name.as_str(), Ok("node_a"));
}

// ---- the v2 streamed-transaction xid ----

#[test]
fn stream_xid_changes_the_layout() {
    let msg = LogicalReplicationMessage::Insert(Insert {
        xid: Some(7),
        relation_id: 16_384,
        tuple: outbox_tuple(),
    });
    let bytes = encode(&msg);
    let in_stream = DecodeContext::new(2).with_in_stream(true);
    assert_eq!(decode(bytes.clone(), in_stream).as_ref(), Ok(&msg));
    // Read as a non-streamed Insert, the xid becomes the relation id and the
    // relation id's first byte is taken for the tuple marker.
    assert_eq!(
        decode(bytes.clone(), DecodeContext::new(2)),
        Err(DecodeError::UnexpectedTupleMarker {
            message: "Insert",
            expected: "'N'",
            found: 0,
        })
    );
    // In protocol v1 the in_stream flag is ignored: no xid is read.
    let plain = LogicalReplicationMessage::Insert(Insert {
        xid: None,
        relation_id: 16_384,
        tuple: outbox_tuple(),
    });
    let v1_in_stream = DecodeContext::new(1).with_in_stream(true);
    assert!(!v1_in_stream.has_stream_xid());
    assert_eq!(decode(encode(&plain), v1_in_stream), Ok(plain));
}

#[test]
fn decoder_tracks_stream_blocks() {
    use LogicalReplicationMessage as M;
    let mut decoder = Decoder::new(2);
    let start = encode(&M::StreamStart(StreamStart {
        xid: 10,
        first_segment: true,
    }));
    let streamed = M::Insert(Insert {
        xid: Some(10),
        relation_id: 1,
        tuple: outbox_tuple(),
    });
    let plain = M::Insert(Insert {
        xid: None,
        relation_id: 1,
        tuple: outbox_tuple(),
    });
    let stop = encode(&M::StreamStop);

    assert!(!decoder.context().in_stream);
    assert!(matches!(
        decoder.decode(start.clone()),
        Ok(M::StreamStart(_))
    ));
    assert!(decoder.context().in_stream);
    assert_eq!(decoder.decode(encode(&streamed)), Ok(streamed));
    assert_eq!(
        decoder.decode(start.clone()),
        Err(DecodeError::StreamBoundary {
            tag: STREAM_START,
            in_stream: true
        })
    );
    assert!(
        decoder.context().in_stream,
        "a failed decode changes nothing"
    );
    assert_eq!(decoder.decode(stop.clone()), Ok(M::StreamStop));
    assert!(!decoder.context().in_stream);
    assert_eq!(decoder.decode(encode(&plain)), Ok(plain));
    assert_eq!(
        decoder.decode(stop),
        Err(DecodeError::StreamBoundary {
            tag: STREAM_STOP,
            in_stream: false
        })
    );
    let err = DecodeError::StreamBoundary {
        tag: STREAM_STOP,
        in_stream: false,
    };
    assert_eq!(
        err.to_string(),
        "pgoutput Stream Stop message outside a stream block"
    );
}

// ---- errors ----

#[test]
fn every_truncation_of_an_insert_is_an_error() {
    for xid in [None, Some(77)] {
        let msg = LogicalReplicationMessage::Insert(Insert {
            xid,
            relation_id: 16_384,
            tuple: outbox_tuple(),
        });
        let ctx = ctx_for(&msg, 1);
        let full = encode(&msg);
        for len in 0..full.len() {
            let result = decode(full.slice(..len), ctx);
            assert!(result.is_err(), "prefix of {len} bytes decoded: {result:?}");
        }
    }
}

#[test]
fn every_truncation_of_every_message_is_an_error() {
    for (msg, ctx) in samples() {
        let full = encode(&msg);
        for len in 0..full.len() {
            // A v4 Stream Abort without its optional tail is itself valid.
            let optional_tail = matches!(
                msg,
                LogicalReplicationMessage::StreamAbort(StreamAbort { abort: Some(_), .. })
            ) && len == 9;
            let result = decode(full.slice(..len), ctx);
            assert_eq!(
                result.is_ok(),
                optional_tail,
                "{} prefix of {len} bytes: {result:?}",
                msg.name()
            );
        }
    }
}

#[test]
fn trailing_bytes_are_an_error() {
    for (msg, ctx) in samples() {
        let mut long = BytesMut::from(&encode(&msg)[..]);
        long.put_u8(0);
        let result = decode(long.freeze(), ctx);
        let ok = match &result {
            Err(DecodeError::TrailingBytes { extra: 1, .. }) => true,
            // A v4 Stream Abort reads a following byte as the start of its tail.
            Err(DecodeError::Truncated { message, .. }) => *message == "Stream Abort",
            _ => false,
        };
        assert!(ok, "{}: {result:?}", msg.name());
    }
}

#[test]
fn empty_and_unknown_tags() {
    let ctx = DecodeContext::new(4);
    assert_eq!(decode(Bytes::new(), ctx), Err(DecodeError::Empty));
    assert_eq!(
        decode(Bytes::from_static(b"Z\x00\x00"), ctx),
        Err(DecodeError::UnknownTag { tag: b'Z' })
    );
    assert_eq!(
        DecodeError::UnknownTag { tag: b'Z' }.to_string(),
        "unknown pgoutput message tag 0x5a ('Z')"
    );
}

#[test]
fn messages_newer_than_the_protocol_are_rejected() {
    for (msg, _) in samples() {
        let required = min_version(&msg);
        // The stream xid is a context matter, not a message-kind one.
        if stream_xid(&msg).is_some() || required == PROTO_STREAM_PARALLEL {
            continue;
        }
        for version in 0..required {
            assert_eq!(
                decode(encode(&msg), DecodeContext::new(version)),
                Err(DecodeError::UnsupportedMessage {
                    tag: msg.tag(),
                    protocol_version: version,
                    required,
                }),
                "{} in v{version}",
                msg.name()
            );
        }
    }
    // A v3 decoder reads the v4 Stream Abort tail as trailing bytes.
    let abort = LogicalReplicationMessage::StreamAbort(StreamAbort {
        xid: 1,
        subxid: 2,
        abort: Some(StreamAbortInfo {
            abort_lsn: Lsn(3),
            abort_time: 4,
        }),
    });
    assert_eq!(
        decode(encode(&abort), DecodeContext::new(3)),
        Err(DecodeError::TrailingBytes {
            message: "Stream Abort",
            extra: 16
        })
    );
}

/// An Insert header (`'I'`, relation id, `'N'`) followed by `tail`.
fn insert_with(tail: &[u8]) -> Bytes {
    let mut buf = BytesMut::new();
    buf.put_u8(INSERT);
    buf.put_u32(1);
    buf.put_u8(TUPLE_NEW);
    buf.put_slice(tail);
    buf.freeze()
}

#[test]
fn tuple_errors() {
    let ctx = DecodeContext::default();
    // Unknown column kind.
    assert_eq!(
        decode(insert_with(&[0, 1, b'x']), ctx),
        Err(DecodeError::UnknownColumnKind {
            message: "Insert",
            kind: b'x'
        })
    );
    // Negative column count.
    assert_eq!(
        decode(insert_with(&[0xff, 0xff]), ctx),
        Err(DecodeError::InvalidLength {
            message: "Insert",
            field: "tuple column count",
            value: -1
        })
    );
    // Negative value length.
    assert_eq!(
        decode(insert_with(&[0, 1, b't', 0xff, 0xff, 0xff, 0xfe]), ctx),
        Err(DecodeError::InvalidLength {
            message: "Insert",
            field: "column length",
            value: -2
        })
    );
    // Length past the end of the message.
    assert_eq!(
        decode(
            insert_with(&[0, 1, b't', 0x7f, 0xff, 0xff, 0xff, b'a']),
            ctx
        ),
        Err(DecodeError::Truncated {
            message: "Insert",
            field: "column value",
            needed: 0x7fff_ffff,
            remaining: 1
        })
    );
    // A huge column count with no columns behind it.
    assert!(matches!(
        decode(insert_with(&[0x7f, 0xff]), ctx),
        Err(DecodeError::Truncated {
            field: "column kind",
            ..
        })
    ));
}

#[test]
fn tuple_marker_errors() {
    let ctx = DecodeContext::default();
    let mut insert = BytesMut::new();
    insert.put_u8(INSERT);
    insert.put_u32(1);
    insert.put_u8(TUPLE_KEY);
    insert.put_i16(0);
    assert_eq!(
        decode(insert.freeze(), ctx),
        Err(DecodeError::UnexpectedTupleMarker {
            message: "Insert",
            expected: "'N'",
            found: b'K'
        })
    );

    let mut update = BytesMut::new();
    update.put_u8(UPDATE);
    update.put_u32(1);
    update.put_u8(b'X');
    assert!(matches!(
        decode(update.freeze(), ctx),
        Err(DecodeError::UnexpectedTupleMarker { found: b'X', .. })
    ));

    // Old tuple followed by something other than the new tuple.
    let mut update = BytesMut::new();
    update.put_u8(UPDATE);
    update.put_u32(1);
    update.put_u8(TUPLE_OLD);
    update.put_i16(0);
    update.put_u8(TUPLE_KEY);
    update.put_i16(0);
    assert!(matches!(
        decode(update.freeze(), ctx),
        Err(DecodeError::UnexpectedTupleMarker {
            message: "Update",
            found: b'K',
            ..
        })
    ));

    let mut delete = BytesMut::new();
    delete.put_u8(DELETE);
    delete.put_u32(1);
    delete.put_u8(TUPLE_NEW);
    delete.put_i16(0);
    assert!(matches!(
        decode(delete.freeze(), ctx),
        Err(DecodeError::UnexpectedTupleMarker {
            message: "Delete",
            expected: "'K' or 'O'",
            found: b'N'
        })
    ));
}

#[test]
fn string_errors() {
    let ctx = DecodeContext::default();
    // Missing NUL terminator.
    let mut origin = BytesMut::new();
    origin.put_u8(ORIGIN);
    origin.put_u64(1);
    origin.put_slice(b"no-terminator");
    assert_eq!(
        decode(origin.freeze(), ctx),
        Err(DecodeError::UnterminatedString {
            message: "Origin",
            field: "name"
        })
    );

    // Invalid UTF-8 in a relation name.
    let mut rel = BytesMut::new();
    rel.put_u8(RELATION);
    rel.put_u32(1);
    put_cstr(&mut rel, b"public");
    put_cstr(&mut rel, b"bad\xff");
    rel.put_u8(b'd');
    rel.put_i16(0);
    assert_eq!(
        decode(rel.freeze(), ctx),
        Err(DecodeError::InvalidUtf8 {
            message: "Relation",
            field: "name"
        })
    );

    // Non-UTF-8 bytes are fine in a PgStr until someone asks for text.
    let mut ty = BytesMut::new();
    ty.put_u8(TYPE);
    ty.put_u32(1);
    put_cstr(&mut ty, b"ns");
    put_cstr(&mut ty, b"\xfe");
    let Ok(LogicalReplicationMessage::Type(t)) = decode(ty.freeze(), ctx) else {
        panic!("expected Type");
    };
    assert!(t.name.as_str().is_err());
    assert_eq!(t.name.as_bytes(), b"\xfe");
    assert_eq!(format!("{:?}", t.namespace), "\"ns\"");
}

#[test]
fn negative_counts_are_errors() {
    let ctx = DecodeContext::default();
    let mut rel = BytesMut::new();
    rel.put_u8(RELATION);
    rel.put_u32(1);
    put_cstr(&mut rel, b"public");
    put_cstr(&mut rel, b"t");
    rel.put_u8(b'd');
    rel.put_i16(-3);
    assert!(matches!(
        decode(rel.freeze(), ctx),
        Err(DecodeError::InvalidLength {
            field: "column count",
            value: -3,
            ..
        })
    ));

    let mut truncate = BytesMut::new();
    truncate.put_u8(TRUNCATE);
    truncate.put_i32(i32::MIN);
    truncate.put_u8(0);
    assert!(matches!(
        decode(truncate.freeze(), ctx),
        Err(DecodeError::InvalidLength {
            field: "relation count",
            value: -2_147_483_648,
            ..
        })
    ));

    let mut message = BytesMut::new();
    message.put_u8(MESSAGE);
    message.put_u8(0);
    message.put_u64(1);
    put_cstr(&mut message, b"p");
    message.put_i32(-1);
    assert!(matches!(
        decode(message.freeze(), ctx),
        Err(DecodeError::InvalidLength {
            field: "content length",
            value: -1,
            ..
        })
    ));
}

#[test]
fn accessors() {
    let col = RelationColumn {
        flags: RelationColumn::FLAG_KEY,
        name: "id".into(),
        type_oid: 23,
        type_modifier: -1,
    };
    assert!(col.is_key());
    let t = Truncate {
        xid: None,
        options: Truncate::RESTART_IDENTITY,
        relation_ids: vec![],
    };
    assert!(!t.cascade() && t.restart_identity());
    assert_eq!(PgStr::new(b("a\0b")), Err(b("a\0b")));
    assert_eq!(PgStr::new(b("ab")).map(|s| s.len()), Ok(2));
    assert_eq!(ColumnValue::UnchangedToast.bytes(), None);
    assert_eq!(
        OldTuple::Full(TupleData::default()).tuple(),
        &TupleData::default()
    );
    assert_eq!(LogicalReplicationMessage::StreamStop.name(), "Stream Stop");
}

proptest! {
    #[test]
    fn decode_never_panics_on_arbitrary_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..128),
        ctx in arb_ctx(),
    ) {
        let _ = decode(Bytes::from(bytes), ctx);
    }

    #[test]
    fn decode_never_panics_on_tagged_garbage(
        tag in proptest::sample::select(TAGS.to_vec()),
        body in proptest::collection::vec(any::<u8>(), 0..96),
        ctx in arb_ctx(),
    ) {
        let mut bytes = vec![tag];
        bytes.extend_from_slice(&body);
        let _ = decode(Bytes::from(bytes), ctx);
    }

    #[test]
    fn decode_never_panics_on_mutated_messages(
        msg in arb_message(),
        version in 1u8..=4,
        flips in proptest::collection::vec((any::<proptest::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<proptest::sample::Index>(),
    ) {
        let ctx = ctx_for(&msg, version);
        let mut bytes = encode(&msg).to_vec();
        for (at, value) in flips {
            let i = at.index(bytes.len());
            if let Some(b) = bytes.get_mut(i) {
                *b = value;
            }
        }
        let len = cut.index(bytes.len().saturating_add(1));
        bytes.truncate(len);
        let _ = decode(Bytes::from(bytes), ctx);
    }

    #[test]
    fn valid_messages_round_trip(msg in arb_message(), version in 1u8..=4) {
        let ctx = ctx_for(&msg, version);
        let bytes = encode(&msg);
        prop_assert_eq!(decode(bytes.clone(), ctx), Ok(msg));
    }

    #[test]
    fn decoder_never_panics_on_arbitrary_sequences(
        frames in proptest::collection::vec(
            (proptest::sample::select(TAGS.to_vec()), proptest::collection::vec(any::<u8>(), 0..32)),
            0..16,
        ),
        version in 0u8..=5,
    ) {
        let mut decoder = Decoder::new(version);
        for (tag, body) in frames {
            let mut bytes = vec![tag];
            bytes.extend_from_slice(&body);
            let _ = decoder.decode(Bytes::from(bytes));
        }
    }
}
