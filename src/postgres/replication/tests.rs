//! Unit tests of the replication connection: command texts, message framing and
//! parsing, error classification, and the startup and streaming phases against a
//! scripted in-memory server (`tokio::io::duplex`).

use std::collections::BTreeMap;
use std::io;

use bytes::{BufMut, Bytes, BytesMut};
use postgres_protocol::authentication::md5_hash;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

use super::commands::{
    TimelineSwitch, create_slot_command, creates_failover_slot, parse_major_version,
    parse_timeline_history, publication_names_option, quote_literal, start_replication_command,
};
use super::frames::{PRIMARY_KEEPALIVE, ServerFrame, StandbyStatus, XLOG_DATA};
use super::messages::{
    AUTHENTICATION, BACKEND_KEY_DATA, COMMAND_COMPLETE, COPY_DATA, COPY_DONE, DATA_ROW,
    ERROR_RESPONSE, NOTICE_RESPONSE, PARAMETER_STATUS, READY_FOR_QUERY, message_buffered,
    parse_data_row, parse_error_fields, server_error, startup_error, take_message,
};
use super::transport::{Conn, Transport, low_water_signals};
use super::*;
use crate::config::quote_ident;
use crate::delivery::ErrorClass;
use crate::lsn::Lsn;
use crate::postgres::conninfo::ConnInfo;

fn message(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut m = vec![tag];
    m.extend_from_slice(&u32::try_from(body.len() + 4).unwrap().to_be_bytes());
    m.extend_from_slice(body);
    m
}

fn error_body(fields: &[(u8, &str)]) -> Vec<u8> {
    let mut b = Vec::new();
    for (k, v) in fields {
        b.push(*k);
        b.extend_from_slice(v.as_bytes());
        b.push(0);
    }
    b.push(0);
    b
}

fn xlog(lsn: u64, data: &[u8]) -> Vec<u8> {
    let mut body = vec![XLOG_DATA];
    body.extend_from_slice(&lsn.to_be_bytes());
    body.extend_from_slice(&lsn.to_be_bytes());
    body.extend_from_slice(&7i64.to_be_bytes());
    body.extend_from_slice(data);
    message(COPY_DATA, &body)
}

fn keepalive(lsn: u64, reply: bool) -> Vec<u8> {
    let mut body = vec![PRIMARY_KEEPALIVE];
    body.extend_from_slice(&lsn.to_be_bytes());
    body.extend_from_slice(&9i64.to_be_bytes());
    body.push(u8::from(reply));
    message(COPY_DATA, &body)
}

fn mock_stream() -> (ReplicationStream, DuplexStream) {
    let (client, server) = tokio::io::duplex(1 << 20);
    let stream = ReplicationStream {
        conn: Conn::new(Transport::Mock(client), "mock".to_owned()),
        done: false,
    };
    (stream, server)
}

#[test]
fn quotes_identifiers_and_literals() {
    assert_eq!(quote_ident("slot"), "\"slot\"");
    assert_eq!(quote_ident("we\"ird"), "\"we\"\"ird\"");
    assert_eq!(quote_literal("it's"), "'it''s'");
    assert_eq!(quote_literal(r"back\slash"), r"'back\slash'");
    assert_eq!(
        publication_names_option(&["outbox_relay_pub", "Other \"one\""]),
        "\"outbox_relay_pub\",\"Other \"\"one\"\"\""
    );
}

#[test]
fn builds_start_replication() {
    let pubs = publication_names_option(&["outbox_relay_pub", "o'brien"]);
    let cmd = start_replication_command(
        "relay_slot",
        Lsn(0x16_B374_D848),
        &[("proto_version", "1"), ("publication_names", &pubs)],
    );
    assert_eq!(
        cmd,
        "START_REPLICATION SLOT \"relay_slot\" LOGICAL 16/B374D848 \
         (\"proto_version\" '1', \"publication_names\" '\"outbox_relay_pub\",\"o''brien\"')"
    );
    assert_eq!(
        start_replication_command("s", Lsn::ZERO, &[]),
        "START_REPLICATION SLOT \"s\" LOGICAL 0/0"
    );
}

#[test]
fn builds_create_slot_for_each_server_generation() {
    assert_eq!(
        create_slot_command("s", false, SnapshotAction::NoExport, Some(15), false),
        "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'nothing')"
    );
    assert_eq!(
        create_slot_command("s", true, SnapshotAction::Export, Some(17), false),
        "CREATE_REPLICATION_SLOT \"s\" TEMPORARY LOGICAL pgoutput (SNAPSHOT 'export')"
    );
    assert_eq!(
        create_slot_command("s", false, SnapshotAction::Use, None, false),
        "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'use')"
    );
    assert_eq!(
        create_slot_command("s", true, SnapshotAction::NoExport, Some(14), false),
        "CREATE_REPLICATION_SLOT \"s\" TEMPORARY LOGICAL pgoutput NOEXPORT_SNAPSHOT"
    );
    assert_eq!(
        create_slot_command("s", false, SnapshotAction::Use, Some(13), false),
        "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput USE_SNAPSHOT"
    );
}

#[test]
fn a_permanent_slot_on_postgres_17_is_a_failover_slot() {
    assert_eq!(
        create_slot_command("s", false, SnapshotAction::NoExport, Some(17), false),
        "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'nothing', FAILOVER true)"
    );
    assert_eq!(
        create_slot_command("o'brien", false, SnapshotAction::Export, Some(18), false),
        "CREATE_REPLICATION_SLOT \"o'brien\" LOGICAL pgoutput (SNAPSHOT 'export', FAILOVER true)"
    );
    assert_eq!(
        create_slot_command("s", false, SnapshotAction::Use, Some(17), false),
        "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'use', FAILOVER true)"
    );
    // The server refuses FAILOVER for a temporary slot.
    assert_eq!(
        create_slot_command("s", true, SnapshotAction::NoExport, Some(17), false),
        "CREATE_REPLICATION_SLOT \"s\" TEMPORARY LOGICAL pgoutput (SNAPSHOT 'nothing')"
    );
    // 15 and 16 do not know the option; an unknown version gets none either.
    assert_eq!(
        create_slot_command("s", false, SnapshotAction::Export, Some(16), false),
        "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'export')"
    );
    assert_eq!(
        create_slot_command("s", false, SnapshotAction::NoExport, None, false),
        "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'nothing')"
    );
    // Before 15 the keyword syntax is unchanged.
    assert_eq!(
        create_slot_command("s", false, SnapshotAction::NoExport, Some(14), false),
        "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput NOEXPORT_SNAPSHOT"
    );
    assert!(creates_failover_slot(false, Some(17), false));
    assert!(!creates_failover_slot(true, Some(17), false));
    assert!(!creates_failover_slot(false, Some(16), false));
    assert!(!creates_failover_slot(false, None, false));
}

#[test]
fn a_slot_on_a_standby_is_never_a_failover_slot() {
    // PostgreSQL refuses FAILOVER for a slot created on a standby.
    assert_eq!(
        create_slot_command("s", false, SnapshotAction::NoExport, Some(17), true),
        "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'nothing')"
    );
    assert_eq!(
        create_slot_command("s", false, SnapshotAction::Export, Some(18), true),
        "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'export')"
    );
    assert!(!creates_failover_slot(false, Some(17), true));
}

#[test]
fn parses_major_versions() {
    assert_eq!(
        parse_major_version("15.18 (Debian 15.18-0+deb12u1)"),
        Some(15)
    );
    assert_eq!(parse_major_version("9.6.24"), Some(9));
    assert_eq!(parse_major_version("17devel"), Some(17));
    assert_eq!(parse_major_version("beta"), None);
}

#[test]
fn frames_messages_across_reads() {
    let mut wire = message(PARAMETER_STATUS, b"a\0b\0");
    wire.extend(message(READY_FOR_QUERY, b"I"));
    let mut buf = BytesMut::new();
    for (i, byte) in wire.iter().enumerate() {
        buf.put_u8(*byte);
        let got = take_message(&mut buf).unwrap();
        match i {
            8 => assert_eq!(
                got.map(|m| (m.tag, m.body)),
                Some((b'S', Bytes::from_static(b"a\0b\0")))
            ),
            14 => assert_eq!(
                got.map(|m| (m.tag, m.body)),
                Some((b'Z', Bytes::from_static(b"I")))
            ),
            _ => assert!(got.is_none(), "byte {i}"),
        }
    }
    assert!(buf.is_empty());
}

#[test]
fn rejects_impossible_lengths() {
    let mut buf = BytesMut::from(&[b'd', 0, 0, 0, 3][..]);
    assert!(matches!(
        take_message(&mut buf),
        Err(ReplicationError::Protocol(_))
    ));
    let mut buf = BytesMut::from(&[b'd', 0x7f, 0xff, 0xff, 0xff][..]);
    assert!(matches!(
        take_message(&mut buf),
        Err(ReplicationError::Protocol(_))
    ));
}

#[test]
fn parses_error_responses() {
    let body = error_body(&[
        (b'S', "FEHLER"),
        (b'V', "ERROR"),
        (b'C', "55006"),
        (b'M', "replication slot \"s\" is active for PID 42"),
        (b'D', "some detail"),
    ]);
    let err = server_error(&body);
    assert!(err.is_slot_in_use());
    assert!(!err.is_undefined_object());
    assert_eq!(err.classify(), ErrorClass::Fatal);
    assert_eq!(
        err.to_string(),
        "replication slot \"s\" is active for PID 42 (SQLSTATE 55006); detail: some detail"
    );
    // Truncated or garbage bodies never panic.
    for cut in 0..body.len() {
        let _ = parse_error_fields(&body[..cut]);
    }
    assert_eq!(parse_error_fields(b"").code, "XX000");
}

#[test]
fn startup_errors_of_class_28_are_authentication_failures() {
    let body = error_body(&[
        (b'V', "FATAL"),
        (b'C', "28P01"),
        (b'M', "password authentication failed for user \"u\""),
    ]);
    let err = startup_error(&body, "scram-sha-256");
    assert!(
        matches!(&err, ReplicationError::Auth { method, code: Some(c), .. }
        if method == "scram-sha-256" && c == "28P01")
    );
    assert_eq!(err.code(), Some("28P01"));
    assert_eq!(err.classify(), ErrorClass::Fatal);
    let other = startup_error(&error_body(&[(b'C', "3D000"), (b'M', "no db")]), "trust");
    assert!(matches!(other, ReplicationError::Server { .. }));
}

#[test]
fn classifies_errors() {
    let server = |code: &str| ReplicationError::Server {
        code: code.to_owned(),
        message: String::new(),
        detail: None,
        hint: None,
    };
    for code in [
        "57P01", "57P02", "57P03", "08006", "53300", "58030", "XX000", "40001",
    ] {
        assert_eq!(server(code).classify(), ErrorClass::Transient, "{code}");
    }
    for code in [
        "28P01", "28000", "55000", "55006", "42704", "42501", "3D000", "57P04",
    ] {
        assert_eq!(server(code).classify(), ErrorClass::Fatal, "{code}");
    }
    assert!(ReplicationError::ConnectionClosed.is_transient());
    assert!(ReplicationError::Io(io::Error::from(io::ErrorKind::ConnectionReset)).is_transient());
    assert!(!ReplicationError::Config(String::new()).is_transient());
    assert!(!ReplicationError::Tls(String::new()).is_transient());
    assert!(!ReplicationError::Protocol(String::new()).is_transient());
    assert!(server("42704").is_undefined_object());
    assert!(server("42710").is_duplicate_object());
}

#[test]
fn parses_data_rows() {
    let mut body = 3i16.to_be_bytes().to_vec();
    body.extend_from_slice(&2i32.to_be_bytes());
    body.extend_from_slice(b"ab");
    body.extend_from_slice(&(-1i32).to_be_bytes());
    body.extend_from_slice(&0i32.to_be_bytes());
    assert_eq!(
        parse_data_row(&body).unwrap(),
        vec![Some("ab".to_owned()), None, Some(String::new())]
    );
    for cut in 0..body.len() {
        assert!(parse_data_row(&body[..cut]).is_err());
    }
    let mut huge = 1i16.to_be_bytes().to_vec();
    huge.extend_from_slice(&i32::MAX.to_be_bytes());
    assert!(parse_data_row(&huge).is_err());
}

#[tokio::test]
async fn a_walsender_exiting_at_shutdown_ends_the_stream() {
    // pg_ctl stop -m fast: "COPY 0" CommandComplete, no CopyDone, then EOF.
    let (mut stream, mut server) = mock_stream();
    let mut wire = keepalive(0x20, false);
    wire.extend(message(COMMAND_COMPLETE, b"COPY 0\0"));
    server.write_all(&wire).await.unwrap();
    assert!(matches!(
        stream.next_frame().await.unwrap(),
        Some(ServerFrame::Keepalive { .. })
    ));
    assert_eq!(stream.next_frame().await.unwrap(), None);
    assert_eq!(stream.next_frame().await.unwrap(), None, "stays ended");
}

#[tokio::test]
async fn streams_frames_and_ends_on_copy_done() {
    let (mut stream, mut server) = mock_stream();
    let mut wire = xlog(0x10, b"Bbegin");
    wire.extend(message(
        NOTICE_RESPONSE,
        &error_body(&[(b'V', "NOTICE"), (b'C', "00000"), (b'M', "hi")]),
    ));
    wire.extend(message(PARAMETER_STATUS, b"TimeZone\0UTC\0"));
    wire.extend(keepalive(0x20, true));
    wire.extend(message(COPY_DONE, b""));
    server.write_all(&wire).await.unwrap();

    match stream.next_frame().await.unwrap() {
        Some(ServerFrame::XLogData {
            wal_start, data, ..
        }) => {
            assert_eq!(wal_start, Lsn(0x10));
            assert_eq!(&data[..], b"Bbegin");
        }
        other => panic!("expected XLogData, got {other:?}"),
    }
    assert_eq!(
        stream.next_frame().await.unwrap(),
        Some(ServerFrame::Keepalive {
            wal_end: Lsn(0x20),
            send_time: 9,
            reply_requested: true
        })
    );
    assert_eq!(stream.server_parameter("TimeZone"), Some("UTC"));
    assert_eq!(stream.next_frame().await.unwrap(), None);
    assert_eq!(stream.next_frame().await.unwrap(), None, "stays ended");
}

#[tokio::test]
async fn reports_server_errors_and_eof() {
    let (mut stream, mut server) = mock_stream();
    let err = error_body(&[
        (b'V', "ERROR"),
        (b'C', "42704"),
        (b'M', "publication \"p\" does not exist"),
    ]);
    server
        .write_all(&message(ERROR_RESPONSE, &err))
        .await
        .unwrap();
    let e = stream.next_frame().await.unwrap_err();
    assert!(e.is_undefined_object(), "{e}");

    let (mut stream, server) = mock_stream();
    drop(server);
    assert!(matches!(
        stream.next_frame().await,
        Err(ReplicationError::ConnectionClosed)
    ));

    let (mut stream, mut server) = mock_stream();
    server.write_all(&message(DATA_ROW, b"\0\0")).await.unwrap();
    assert!(matches!(
        stream.next_frame().await,
        Err(ReplicationError::Protocol(_))
    ));
}

/// Dropping `next_frame` at every possible point never loses or splits a frame.
#[tokio::test]
async fn next_frame_is_cancel_safe() {
    let (mut stream, mut server) = mock_stream();
    let frames: Vec<Vec<u8>> = (0..200u64)
        .map(|i| {
            xlog(
                i + 1,
                &vec![u8::try_from(i % 251).unwrap(); usize::try_from(i * 37 % 3000).unwrap()],
            )
        })
        .collect();
    let wire: Vec<u8> = frames.concat();
    let writer = tokio::spawn(async move {
        // Dribble the bytes in odd-sized pieces with yields between them.
        for chunk in wire.chunks(777) {
            server.write_all(chunk).await.unwrap();
            tokio::task::yield_now().await;
        }
        server
    });
    let mut seen = 0u64;
    let mut cancelled = 0u32;
    while seen < 200 {
        tokio::select! {
            biased;
            () = tokio::task::yield_now() => { cancelled += 1; }
            frame = stream.next_frame() => match frame.unwrap() {
                Some(ServerFrame::XLogData { wal_start, data, .. }) => {
                    seen += 1;
                    assert_eq!(wal_start, Lsn(seen));
                    let i = seen - 1;
                    assert_eq!(data.len(), usize::try_from(i * 37 % 3000).unwrap());
                    assert!(data.iter().all(|&b| u64::from(b) == i % 251));
                }
                other => panic!("unexpected {other:?}"),
            },
        }
    }
    assert!(cancelled > 0, "the test must actually cancel reads");
    let _server = writer.await.unwrap();
}

#[tokio::test]
async fn sends_status_updates_as_copy_data() {
    let (mut stream, mut server) = mock_stream();
    let status = StandbyStatus {
        write: Lsn(3),
        flush: Lsn(2),
        apply: Lsn(1),
        client_time_micros: 5,
        reply_requested: false,
    };
    stream.send_status(&status).await.unwrap();
    let mut got = vec![0u8; 1 + 4 + StandbyStatus::ENCODED_LEN];
    server.read_exact(&mut got).await.unwrap();
    assert_eq!(got[0], COPY_DATA);
    assert_eq!(
        u32::from_be_bytes([got[1], got[2], got[3], got[4]]),
        u32::try_from(4 + StandbyStatus::ENCODED_LEN).unwrap()
    );
    assert_eq!(StandbyStatus::parse(&got[5..]).unwrap(), status);

    // The server reads CopyDone + Terminate, then closes (as a walsender does).
    let server_task = tokio::spawn(async move {
        let mut tail = [0u8; 10];
        server.read_exact(&mut tail).await.unwrap();
        tail
    });
    stream.finish().await.unwrap();
    assert_eq!(
        server_task.await.unwrap(),
        [b'c', 0, 0, 0, 4, b'X', 0, 0, 0, 4]
    );
}

/// What a scripted startup exchange produced.
struct Startup {
    result: Result<(), ReplicationError>,
    params: BTreeMap<String, String>,
    backend_pid: Option<i32>,
    /// Everything the client sent.
    received: Vec<u8>,
}

/// Runs the client's startup against a scripted server.
async fn run_startup(url: &str, script: Vec<Vec<u8>>) -> Startup {
    let info = ConnInfo::parse(url).unwrap();
    let (client, mut server) = tokio::io::duplex(1 << 16);
    let server_task = tokio::spawn(async move {
        for m in script {
            server.write_all(&m).await.unwrap();
        }
        server.shutdown().await.unwrap();
        let mut received = Vec::new();
        let _ = server.read_to_end(&mut received).await;
        received
    });
    let mut conn = Conn::new(Transport::Mock(client), info.to_string());
    let result = conn.startup(&info, None).await;
    let Conn {
        io,
        params,
        backend_pid,
        ..
    } = conn;
    drop(io);
    let received = server_task.await.unwrap();
    Startup {
        result,
        params,
        backend_pid,
        received,
    }
}

#[tokio::test]
async fn startup_sends_replication_parameters_and_collects_server_parameters() {
    let script = vec![
        message(AUTHENTICATION, &0i32.to_be_bytes()),
        message(PARAMETER_STATUS, b"server_version\x0015.4\0"),
        message(BACKEND_KEY_DATA, &[0, 0, 0, 42, 0, 0, 0, 1]),
        message(READY_FOR_QUERY, b"I"),
    ];
    let run = run_startup("postgresql://relay@h/app?options=-c%20x%3Dy", script).await;
    run.result.unwrap();
    assert_eq!(
        run.params.get("server_version").map(String::as_str),
        Some("15.4")
    );
    assert_eq!(run.backend_pid, Some(42));
    let text = String::from_utf8_lossy(&run.received);
    for needle in [
        "user\0relay\0",
        "database\0app\0",
        "replication\0database\0",
        "application_name\0outbox-relay\0",
        "client_encoding\0UTF8\0",
        "options\0-c DateStyle=ISO -c TimeZone=UTC -c extra_float_digits=3 -c x=y\0",
    ] {
        assert!(
            text.contains(needle),
            "startup packet lacks {needle:?}: {text:?}"
        );
    }
}

#[tokio::test]
async fn startup_answers_md5_and_cleartext() {
    let mut md5 = 5i32.to_be_bytes().to_vec();
    md5.extend_from_slice(&[1, 2, 3, 4]);
    let script = vec![
        message(AUTHENTICATION, &md5),
        message(AUTHENTICATION, &0i32.to_be_bytes()),
        message(READY_FOR_QUERY, b"I"),
    ];
    let run = run_startup("postgresql://u:pw@h/db", script).await;
    run.result.unwrap();
    let expected = md5_hash(b"u", b"pw", [1, 2, 3, 4]);
    assert!(String::from_utf8_lossy(&run.received).contains(&expected));

    let script = vec![message(AUTHENTICATION, &3i32.to_be_bytes())];
    match run_startup("postgresql://u@h/db", script).await.result {
        Err(ReplicationError::Auth {
            method,
            code: None,
            message,
        }) => {
            assert_eq!(method, "password");
            assert!(message.contains("requires a password"), "{message}");
        }
        other => panic!("expected a missing-password error, got {other:?}"),
    }
}

#[tokio::test]
async fn startup_rejects_unsupported_methods_and_surprises() {
    let result = run_startup(
        "postgresql://u:p@h/db",
        vec![message(AUTHENTICATION, &7i32.to_be_bytes())],
    )
    .await
    .result;
    assert!(matches!(result, Err(ReplicationError::Auth { ref method, .. }) if method == "gss"));

    let mut sasl = 10i32.to_be_bytes().to_vec();
    sasl.extend_from_slice(b"SCRAM-SHA-1\0\0");
    let result = run_startup(
        "postgresql://u:p@h/db",
        vec![message(AUTHENTICATION, &sasl)],
    )
    .await
    .result;
    assert!(
        matches!(result, Err(ReplicationError::Auth { .. })),
        "{result:?}"
    );

    let result = run_startup("postgresql://u:p@h/db", vec![message(DATA_ROW, b"")])
        .await
        .result;
    assert!(matches!(result, Err(ReplicationError::Protocol(_))));

    let result = run_startup("postgresql://u:p@h/db", vec![]).await.result;
    assert!(matches!(result, Err(ReplicationError::ConnectionClosed)));

    // channel_binding=require refuses trust.
    let result = run_startup(
        "postgresql://u:p@h/db?channel_binding=require",
        vec![message(AUTHENTICATION, &0i32.to_be_bytes())],
    )
    .await
    .result;
    assert!(
        matches!(result, Err(ReplicationError::Auth { .. })),
        "{result:?}"
    );
}

/// Opens the transport to a local listener that accepts and says nothing.
async fn tcp_transport(query: &str) -> (Transport, tokio::net::TcpListener) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let info = ConnInfo::parse(&format!(
        "postgresql://u@127.0.0.1:{port}/db?sslmode=disable{query}"
    ))
    .unwrap();
    let (transport, binding) = super::transport::open_transport(&info).await.unwrap();
    assert!(binding.is_none());
    (transport, listener)
}

#[cfg(target_os = "linux")]
#[tokio::test]
async fn the_replication_socket_gets_the_keepalives_of_the_url() {
    use std::time::Duration;
    let (transport, _listener) = tcp_transport("").await;
    let Transport::Tcp(tcp) = &transport else {
        panic!("expected plain TCP");
    };
    let socket = socket2::SockRef::from(tcp);
    assert!(socket.keepalive().unwrap());
    assert_eq!(
        socket.tcp_keepalive_time().unwrap(),
        Duration::from_secs(30)
    );
    assert_eq!(
        socket.tcp_keepalive_interval().unwrap(),
        Duration::from_secs(10)
    );
    assert_eq!(socket.tcp_keepalive_retries().unwrap(), 3);
    assert_eq!(
        socket.tcp_user_timeout().unwrap(),
        Some(crate::postgres::conninfo::DEFAULT_TCP_USER_TIMEOUT)
    );

    let (transport, _listener) = tcp_transport(
        "&keepalives_idle=7&keepalives_interval=2&keepalives_count=5&tcp_user_timeout=4000",
    )
    .await;
    let Transport::Tcp(tcp) = &transport else {
        panic!("expected plain TCP");
    };
    let socket = socket2::SockRef::from(tcp);
    assert_eq!(socket.tcp_keepalive_time().unwrap(), Duration::from_secs(7));
    assert_eq!(
        socket.tcp_keepalive_interval().unwrap(),
        Duration::from_secs(2)
    );
    assert_eq!(socket.tcp_keepalive_retries().unwrap(), 5);
    assert_eq!(
        socket.tcp_user_timeout().unwrap(),
        Some(Duration::from_secs(4))
    );

    let (transport, _listener) = tcp_transport("&keepalives=0").await;
    let Transport::Tcp(tcp) = &transport else {
        panic!("expected plain TCP");
    };
    assert!(!socket2::SockRef::from(tcp).keepalive().unwrap());
}

/// A server that accepts but never answers the startup packet: `connect_timeout`
/// ends the attempt (here the libpq minimum, 2 s).
#[tokio::test]
async fn connect_timeout_bounds_a_silent_server() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let info = ConnInfo::parse(&format!(
        "postgresql://u@127.0.0.1:{port}/db?sslmode=disable&connect_timeout=1"
    ))
    .unwrap();
    let started = std::time::Instant::now();
    let err = ReplicationConnection::connect(&info).await.unwrap_err();
    assert!(
        matches!(&err, ReplicationError::Io(e) if e.kind() == io::ErrorKind::TimedOut),
        "{err:?}"
    );
    assert!(err.to_string().contains("connect_timeout"), "{err}");
    assert!(started.elapsed() < std::time::Duration::from_secs(10));
    assert_eq!(err.classify(), ErrorClass::Transient);
}

#[test]
fn timeline_history_files_parse_as_postgresql_writes_them() {
    // What a server promoted twice writes (timeline.c: "%u\t%X/%X\t%s\n").
    let content = "1\t0/3000158\tno recovery target specified\n\n# a comment\n\
                   2\t0/5000000\tat restore point \"before upgrade\"\n";
    assert_eq!(
        parse_timeline_history(content).unwrap(),
        [
            TimelineSwitch {
                timeline: 1,
                switchpoint: Lsn(0x0300_0158)
            },
            TimelineSwitch {
                timeline: 2,
                switchpoint: Lsn(0x0500_0000)
            },
        ]
    );
    assert!(parse_timeline_history("").unwrap().is_empty());
    for bad in ["x\t0/1\tr", "1\tnot-an-lsn\tr", "1"] {
        assert!(parse_timeline_history(bad).is_err(), "{bad:?}");
    }
}

#[test]
fn knows_when_a_whole_message_is_buffered() {
    let wire = xlog(1, b"abc");
    for cut in 0..wire.len() {
        assert!(!message_buffered(&wire[..cut]), "{cut} bytes");
    }
    assert!(message_buffered(&wire));
    // An impossible header is an answer too: `take_message` returns its error.
    assert!(message_buffered(&[b'd', 0, 0, 0, 3]));
    assert!(message_buffered(&[b'd', 0x7f, 0xff, 0xff, 0xff]));
}

#[test]
fn reads_which_kernels_signal_a_lowered_low_water_mark() {
    assert!(low_water_signals("6.18.44-fc-v1252"));
    assert!(low_water_signals("4.18.0-553.el8_10.x86_64"));
    assert!(low_water_signals("5.4.0\n"));
    assert!(!low_water_signals("4.17.19"));
    assert!(!low_water_signals("3.10.0-1160.el7.x86_64"));
    assert!(!low_water_signals("unknown"));
    assert!(!low_water_signals(""));
}

#[tokio::test]
async fn frame_ready_never_waits_and_reads_what_is_there() {
    let (mut stream, mut server) = mock_stream();
    assert!(!stream.frame_ready().unwrap(), "nothing sent yet");
    let wire = xlog(1, b"abc");
    server.write_all(&wire[..4]).await.unwrap();
    assert!(
        stream.frame_ready().unwrap(),
        "bytes arrived: a read would not wait"
    );
    assert!(
        !stream.frame_ready().unwrap(),
        "part of a message buffered, nothing more arrived"
    );
    server.write_all(&wire[4..]).await.unwrap();
    server.write_all(&keepalive(2, false)).await.unwrap();
    assert!(stream.frame_ready().unwrap());
    assert!(matches!(
        stream.next_frame().await.unwrap(),
        Some(ServerFrame::XLogData { .. })
    ));
    assert!(stream.frame_ready().unwrap(), "the keepalive is buffered");
    assert!(matches!(
        stream.next_frame().await.unwrap(),
        Some(ServerFrame::Keepalive { .. })
    ));
    assert!(!stream.frame_ready().unwrap());
    drop(server);
    assert!(matches!(
        stream.frame_ready(),
        Err(ReplicationError::ConnectionClosed)
    ));
}

/// Against the kernel's TCP: while readiness is held, bytes that arrive do not make
/// the socket readable; releasing it does, at once, for the bytes already queued.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn held_readiness_wakes_nobody_until_released() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (mut server, _) = listener.accept().await.unwrap();
    let mut stream = ReplicationStream {
        conn: Conn::new(Transport::Tcp(client), "tcp".to_owned()),
        done: false,
    };
    assert!(!stream.frame_ready().unwrap(), "nothing sent yet");
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    if !low_water_signals(&release) {
        assert!(
            !stream.hold_readiness().unwrap(),
            "kernel {release}: never held"
        );
        return;
    }
    assert!(stream.hold_readiness().unwrap(), "TCP on Linux 4.18+");
    server.write_all(&xlog(1, b"abc")).await.unwrap();
    server.flush().await.unwrap();
    let held =
        tokio::time::timeout(std::time::Duration::from_millis(300), stream.read_more()).await;
    assert!(
        held.is_err(),
        "a held socket must not turn readable for a few bytes"
    );
    assert!(
        stream.frame_ready().unwrap(),
        "the kernel's receive queue is seen where epoll says nothing"
    );
    stream.release_readiness().unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(10), stream.read_more())
        .await
        .expect("released: the queued bytes are announced at once")
        .unwrap();
    assert!(matches!(
        stream.next_frame().await.unwrap(),
        Some(ServerFrame::XLogData { .. })
    ));
}

/// Unix sockets are not held (`Ok(false)`): the pause then simply waits.
#[cfg(unix)]
#[tokio::test]
async fn unix_sockets_are_not_held() {
    let (client, _server) = tokio::net::UnixStream::pair().unwrap();
    let stream = ReplicationStream {
        conn: Conn::new(Transport::Unix(client), "unix".to_owned()),
        done: false,
    };
    assert!(!stream.hold_readiness().unwrap());
    stream.release_readiness().unwrap();
}
