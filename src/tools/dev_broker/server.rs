//! Connections: size-prefixed frames in, one response per request out, in order
//! (as Kafka does, a connection's requests are handled one at a time, so a
//! long-polling Fetch holds back the requests behind it on that connection).
//!
//! A frame that cannot be decoded, an unknown API or an unsupported version closes
//! the connection with a log line (ApiVersions excepted: an unsupported version gets
//! UNSUPPORTED_VERSION and the list, so the client can pick another). Nothing a
//! client sends can panic the broker: lengths are checked before any slicing and the
//! codecs return errors.
//!
//! The control listener (`--control`) takes one text command a line and answers
//! one line each (see [`super::faults`]); a stall holds every broker connection
//! but not the control ones.
//!
//! One known hole, upstream's: kafka-protocol 0.18 reserves a decoded array's
//! capacity from the element count on the wire before checking that the bytes are
//! there (kafka-protocol-rs pull requests #152, #161, #200, open), so a crafted
//! frame declaring billions of elements makes the allocator abort the process. No
//! Kafka client sends such a frame; the broker listens on loopback by default.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use kafka_protocol::messages::add_offsets_to_txn_request::AddOffsetsToTxnRequest;
use kafka_protocol::messages::add_partitions_to_txn_request::AddPartitionsToTxnRequest;
use kafka_protocol::messages::create_topics_request::CreateTopicsRequest;
use kafka_protocol::messages::delete_topics_request::DeleteTopicsRequest;
use kafka_protocol::messages::describe_configs_request::DescribeConfigsRequest;
use kafka_protocol::messages::end_txn_request::EndTxnRequest;
use kafka_protocol::messages::fetch_request::FetchRequest;
use kafka_protocol::messages::fetch_response::FetchResponse;
use kafka_protocol::messages::find_coordinator_request::FindCoordinatorRequest;
use kafka_protocol::messages::init_producer_id_request::InitProducerIdRequest;
use kafka_protocol::messages::list_offsets_request::ListOffsetsRequest;
use kafka_protocol::messages::metadata_request::MetadataRequest;
use kafka_protocol::messages::offset_commit_request::OffsetCommitRequest;
use kafka_protocol::messages::offset_fetch_request::OffsetFetchRequest;
use kafka_protocol::messages::offset_for_leader_epoch_request::OffsetForLeaderEpochRequest;
use kafka_protocol::messages::produce_request::ProduceRequest;
use kafka_protocol::messages::txn_offset_commit_request::TxnOffsetCommitRequest;
use kafka_protocol::messages::{ApiKey, ResponseHeader};
use kafka_protocol::protocol::{Decodable, Encodable, decode_request_header_from_buffer};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use super::faults::{self, Ack};
use super::handlers;
use super::state::Broker;

/// The largest request accepted (Kafka's `socket.request.max.bytes` default).
const MAX_REQUEST_BYTES: i32 = 100 * 1024 * 1024;
/// The longest a Fetch waits for data, whatever it asks for.
const MAX_FETCH_WAIT: Duration = Duration::from_secs(30);

/// Why a connection was closed.
#[derive(Debug, thiserror::Error)]
pub(super) enum ConnectionError {
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("frame length {0} outside 8..={MAX_REQUEST_BYTES}")]
    FrameLength(i32),
    #[error("unknown API key {0}")]
    UnknownApi(i16),
    #[error("{api:?} v{version} is not implemented")]
    UnsupportedVersion { api: ApiKey, version: i16 },
    #[error("cannot decode {api:?} v{version}: {message}")]
    Decode {
        api: ApiKey,
        version: i16,
        message: String,
    },
    #[error("cannot encode the {api:?} v{version} response: {message}")]
    Encode {
        api: ApiKey,
        version: i16,
        message: String,
    },
}

/// The state shared by all connections, the signal that wakes waiting fetches,
/// and the one that wakes requests held by a stall when the faults change.
#[derive(Debug)]
pub(super) struct Shared {
    broker: Mutex<Broker>,
    changes: watch::Sender<u64>,
    faults_changed: watch::Sender<u64>,
}

impl Shared {
    pub(super) fn new(broker: Broker) -> Shared {
        Shared {
            broker: Mutex::new(broker),
            changes: watch::Sender::new(0),
            faults_changed: watch::Sender::new(0),
        }
    }

    /// Runs `f` with the state locked, then wakes waiting fetches if a log changed.
    pub(super) fn with<T>(&self, f: impl FnOnce(&mut Broker) -> T) -> T {
        let mut broker = self.broker.lock().unwrap_or_else(PoisonError::into_inner);
        let before = broker.changes();
        let out = f(&mut broker);
        let after = broker.changes();
        drop(broker);
        if after != before {
            self.changes.send_replace(after);
        }
        out
    }
}

/// Accepts connections until the listener fails (the caller drops this future to
/// stop).
pub(super) async fn accept(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                tokio::spawn(connection(stream, peer, Arc::clone(&shared)));
            }
            Err(e) => {
                // E.g. EMFILE: keep serving the open connections, retry shortly.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn connection(stream: TcpStream, peer: SocketAddr, shared: Arc<Shared>) {
    tracing::debug!(%peer, "connection opened");
    let _ = stream.set_nodelay(true);
    match serve(stream, &shared).await {
        Ok(()) => tracing::debug!(%peer, "connection closed by the client"),
        Err(ConnectionError::Io(e)) => tracing::debug!(%peer, error = %e, "connection lost"),
        Err(e) => tracing::warn!(%peer, error = %e, "closing the connection"),
    }
}

async fn serve(stream: TcpStream, shared: &Shared) -> Result<(), ConnectionError> {
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    loop {
        let length = match read.read_i32().await {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        };
        // api key, version, correlation id: 8 bytes at least.
        let Some(size) = usize::try_from(length)
            .ok()
            .filter(|_| (8..=MAX_REQUEST_BYTES).contains(&length))
        else {
            return Err(ConnectionError::FrameLength(length));
        };
        let mut frame = vec![0; size];
        read.read_exact(&mut frame).await?;
        // A stalled broker reads nothing, so handles nothing...
        wait_out_stall(shared).await;
        if let Some(response) = handle(shared, Bytes::from(frame)).await? {
            if !response.delay.is_zero() {
                tokio::time::sleep(response.delay).await;
            }
            // ...and answers nothing, not even what it had handled before.
            wait_out_stall(shared).await;
            write.write_all(&response.bytes).await?;
        }
    }
}

/// Returns once no stall is under way (at once if none is).
async fn wait_out_stall(shared: &Shared) {
    loop {
        // Subscribed before reading: a `reset` after the read is not missed.
        let mut changed = shared.faults_changed.subscribe();
        let Some(until) = shared.with(|b| b.faults.hold(Instant::now())) else {
            return;
        };
        tokio::select! {
            () = tokio::time::sleep_until(until.into()) => {}
            _ = changed.changed() => {}
        }
    }
}

/// Accepts control connections until the listener fails (the caller drops this
/// future to stop).
pub(super) async fn accept_control(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let shared = Arc::clone(&shared);
                tokio::spawn(async move {
                    if let Err(e) = control(stream, &shared).await {
                        tracing::debug!(%peer, error = %e, "control connection closed");
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed on the control listener");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// One control connection: a reply line for every command line, until the
/// client closes it (or sends a line longer than [`faults::MAX_LINE`]).
async fn control(stream: TcpStream, shared: &Shared) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    let mut line = Vec::new();
    loop {
        line.clear();
        let limit = u64::try_from(faults::MAX_LINE).unwrap_or(u64::MAX);
        let n = (&mut read).take(limit).read_until(b'\n', &mut line).await?;
        if n == 0 {
            return Ok(());
        }
        if line.last() != Some(&b'\n') && line.len() >= faults::MAX_LINE {
            write
                .write_all(
                    format!("error line longer than {} bytes\n", faults::MAX_LINE).as_bytes(),
                )
                .await?;
            return Ok(());
        }
        let reply = control_reply(shared, &line);
        write.write_all(reply.as_bytes()).await?;
    }
}

/// The reply line (with its newline) to one control line.
fn control_reply(shared: &Shared, line: &[u8]) -> String {
    let Ok(text) = std::str::from_utf8(line) else {
        return "error not UTF-8\n".to_owned();
    };
    match faults::parse(text) {
        Ok(command) => {
            let detail = shared.with(|b| b.control(command, Instant::now()));
            shared
                .faults_changed
                .send_modify(|n| *n = n.wrapping_add(1));
            if detail.is_empty() {
                "ok\n".to_owned()
            } else {
                format!("ok {detail}\n")
            }
        }
        Err(e) => {
            tracing::info!(command = %text.trim(), error = %e, "control command refused");
            format!("error {e}\n")
        }
    }
}

/// Encodes a response frame: length, header (in the header version the API and
/// version call for), body.
fn encode<R: Encodable>(
    api: ApiKey,
    version: i16,
    correlation_id: i32,
    body: &R,
) -> Result<Bytes, ConnectionError> {
    let fail = |e: &dyn std::fmt::Display| ConnectionError::Encode {
        api,
        version,
        message: e.to_string(),
    };
    let mut buf = BytesMut::new();
    buf.put_i32(0);
    ResponseHeader::default()
        .with_correlation_id(correlation_id)
        .encode(&mut buf, api.response_header_version(version))
        .map_err(|e| fail(&e))?;
    body.encode(&mut buf, version).map_err(|e| fail(&e))?;
    let length = i32::try_from(buf.len() - 4).map_err(|e| fail(&e))?;
    buf[0..4].copy_from_slice(&length.to_be_bytes());
    Ok(buf.freeze())
}

fn decode<R: Decodable>(api: ApiKey, version: i16, body: &mut Bytes) -> Result<R, ConnectionError> {
    R::decode(body, version).map_err(|e| ConnectionError::Decode {
        api,
        version,
        message: format!("{e:#}"),
    })
}

/// A response frame, and how long to hold it before writing it (`delay-acks`).
#[derive(Debug)]
struct Response {
    bytes: Bytes,
    delay: Duration,
}

impl From<Bytes> for Response {
    fn from(bytes: Bytes) -> Response {
        Response {
            bytes,
            delay: Duration::ZERO,
        }
    }
}

/// Handles one request frame; `None` when no response is due (Produce with acks=0,
/// or one whose ack `drop-acks` drops).
async fn handle(shared: &Shared, frame: Bytes) -> Result<Option<Response>, ConnectionError> {
    // The frame is at least 8 bytes long (checked by the caller).
    let raw_key = i16::from_be_bytes([frame[0], frame[1]]);
    let version = i16::from_be_bytes([frame[2], frame[3]]);
    let api = ApiKey::try_from(raw_key).map_err(|()| ConnectionError::UnknownApi(raw_key))?;
    let mut body = frame;
    let header =
        decode_request_header_from_buffer(&mut body).map_err(|e| ConnectionError::Decode {
            api,
            version,
            message: format!("request header: {e:#}"),
        })?;
    let id = header.correlation_id;
    tracing::trace!(?api, version, correlation_id = id, "request");
    if api == ApiKey::ApiVersions && !handlers::supported(api, version) {
        // KIP-511: answer in v0 so that any client can read the supported range.
        return encode(api, 0, id, &handlers::api_versions(false)).map(|b| Some(b.into()));
    }
    if !handlers::supported(api, version) {
        return Err(ConnectionError::UnsupportedVersion { api, version });
    }
    let now = Instant::now();
    let v = version;
    let response = match api {
        ApiKey::ApiVersions => encode(api, v, id, &handlers::api_versions(true))?,
        ApiKey::Metadata => {
            let req: MetadataRequest = decode(api, v, &mut body)?;
            encode(api, v, id, &shared.with(|b| handlers::metadata(b, req, v)))?
        }
        ApiKey::Produce => {
            let req: ProduceRequest = decode(api, v, &mut body)?;
            let acks = req.acks;
            let (response, ack) = shared.with(|b| {
                let response = handlers::produce(b, req);
                // acks=0 wants no response: nothing to drop or delay.
                (response, (acks != 0).then(|| b.faults.produce_ack()))
            });
            return match ack {
                None | Some(Ack::Drop) => Ok(None),
                Some(Ack::Send { delay }) => Ok(Some(Response {
                    bytes: encode(api, v, id, &response)?,
                    delay,
                })),
            };
        }
        ApiKey::Fetch => {
            let req: FetchRequest = decode(api, v, &mut body)?;
            encode(api, v, id, &fetch(shared, &req).await)?
        }
        ApiKey::ListOffsets => {
            let req: ListOffsetsRequest = decode(api, v, &mut body)?;
            encode(api, v, id, &shared.with(|b| handlers::list_offsets(b, req)))?
        }
        ApiKey::OffsetForLeaderEpoch => {
            let req: OffsetForLeaderEpochRequest = decode(api, v, &mut body)?;
            let response = shared.with(|b| handlers::offset_for_leader_epoch(b, req));
            encode(api, v, id, &response)?
        }
        ApiKey::FindCoordinator => {
            let req: FindCoordinatorRequest = decode(api, v, &mut body)?;
            encode(
                api,
                v,
                id,
                &shared.with(|b| handlers::find_coordinator(b, &req)),
            )?
        }
        ApiKey::InitProducerId => {
            let req: InitProducerIdRequest = decode(api, v, &mut body)?;
            let response = shared.with(|b| handlers::init_producer_id(b, &req, v));
            encode(api, v, id, &response)?
        }
        ApiKey::AddPartitionsToTxn => {
            let req: AddPartitionsToTxnRequest = decode(api, v, &mut body)?;
            let response = shared.with(|b| handlers::add_partitions_to_txn(b, req, v, now));
            encode(api, v, id, &response)?
        }
        ApiKey::AddOffsetsToTxn => {
            let req: AddOffsetsToTxnRequest = decode(api, v, &mut body)?;
            let response = shared.with(|b| handlers::add_offsets_to_txn(b, &req, v, now));
            encode(api, v, id, &response)?
        }
        ApiKey::TxnOffsetCommit => {
            let req: TxnOffsetCommitRequest = decode(api, v, &mut body)?;
            let response = shared.with(|b| handlers::txn_offset_commit(b, req, v));
            encode(api, v, id, &response)?
        }
        ApiKey::EndTxn => {
            let req: EndTxnRequest = decode(api, v, &mut body)?;
            encode(api, v, id, &shared.with(|b| handlers::end_txn(b, &req, v)))?
        }
        ApiKey::OffsetCommit => {
            let req: OffsetCommitRequest = decode(api, v, &mut body)?;
            encode(
                api,
                v,
                id,
                &shared.with(|b| handlers::offset_commit(b, req)),
            )?
        }
        ApiKey::OffsetFetch => {
            let req: OffsetFetchRequest = decode(api, v, &mut body)?;
            encode(api, v, id, &shared.with(|b| handlers::offset_fetch(b, req)))?
        }
        ApiKey::CreateTopics => {
            let req: CreateTopicsRequest = decode(api, v, &mut body)?;
            encode(
                api,
                v,
                id,
                &shared.with(|b| handlers::create_topics(b, req)),
            )?
        }
        ApiKey::DeleteTopics => {
            let req: DeleteTopicsRequest = decode(api, v, &mut body)?;
            encode(
                api,
                v,
                id,
                &shared.with(|b| handlers::delete_topics(b, req)),
            )?
        }
        ApiKey::DescribeConfigs => {
            let req: DescribeConfigsRequest = decode(api, v, &mut body)?;
            encode(
                api,
                v,
                id,
                &shared.with(|b| handlers::describe_configs(b, req)),
            )?
        }
        // `supported` admits no other key.
        _ => return Err(ConnectionError::UnsupportedVersion { api, version }),
    };
    Ok(Some(response.into()))
}

/// Fetch with long polling: answers once `min_bytes` are available, a partition
/// has an error, or `max_wait_ms` has passed; in between it sleeps until a log
/// changes (an append, a marker), never polling on a timer.
async fn fetch(shared: &Shared, req: &FetchRequest) -> FetchResponse {
    let wait =
        Duration::from_millis(u64::try_from(req.max_wait_ms).unwrap_or(0)).min(MAX_FETCH_WAIT);
    let deadline = tokio::time::Instant::now() + wait;
    let min_bytes = usize::try_from(req.min_bytes).unwrap_or(0);
    loop {
        // Subscribed before reading: a change after the read is not missed.
        let mut changes = shared.changes.subscribe();
        let fetched = shared.with(|b| handlers::fetch(b, req));
        if fetched.errors || fetched.bytes >= min_bytes || tokio::time::Instant::now() >= deadline {
            return fetched.response;
        }
        match tokio::time::timeout_at(deadline, changes.changed()).await {
            Ok(Ok(())) | Err(_) => {}
            Ok(Err(_)) => return fetched.response,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::state::Settings;
    use super::*;

    fn shared() -> Shared {
        Shared::new(Broker::new(Settings {
            host: "127.0.0.1".into(),
            port: 9092,
            default_partitions: 1,
            auto_create_topics: true,
            transaction_max_timeout_ms: super::super::txn::MAX_TRANSACTION_TIMEOUT_MS,
        }))
    }

    fn frame(api: i16, version: i16, rest: &[u8]) -> Bytes {
        let mut b = BytesMut::new();
        b.put_i16(api);
        b.put_i16(version);
        b.put_i32(7);
        b.put_i16(-1); // null client id
        b.extend_from_slice(rest);
        b.freeze()
    }

    #[tokio::test]
    async fn garbage_is_an_error_not_a_panic() {
        let s = shared();
        assert!(matches!(
            handle(&s, frame(999, 0, &[])).await,
            Err(ConnectionError::UnknownApi(999))
        ));
        assert!(matches!(
            handle(&s, frame(ApiKey::JoinGroup as i16, 0, &[])).await,
            Err(ConnectionError::UnsupportedVersion { .. })
        ));
        // Every implemented API and version, with truncated and short random bodies.
        // Not longer random ones: kafka-protocol 0.18 reserves an array's capacity
        // from the count on the wire before checking the bytes left, so a random
        // 4-byte count can make the allocator abort (see the module doc).
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        for &(api, min, max) in handlers::SUPPORTED {
            for version in min..=max {
                for len in [0usize, 1, 2, 3] {
                    let body: Vec<u8> = (0..len)
                        .map(|_| {
                            seed ^= seed << 13;
                            seed ^= seed >> 7;
                            seed ^= seed << 17;
                            seed.to_be_bytes()[0]
                        })
                        .collect();
                    let _ = handle(&s, frame(api as i16, version, &body)).await;
                }
                for len in [1usize, 9, 40, 200] {
                    let _ = handle(&s, frame(api as i16, version, &vec![0; len])).await;
                }
            }
        }
    }

    #[tokio::test]
    async fn drop_acks_and_delay_acks_shape_produce_responses() {
        // Produce v3 by hand (the crate encodes no requests here): null
        // transactional id, acks -1, timeout, topic "t", partition 0, null records.
        let s = shared();
        let mut body = BytesMut::new();
        body.put_i16(-1);
        body.put_i16(-1);
        body.put_i32(1000);
        body.put_i32(1);
        body.put_i16(1);
        body.put_slice(b"t");
        body.put_i32(1);
        body.put_i32(0);
        body.put_i32(-1);
        let produce = || frame(ApiKey::Produce as i16, 3, &body);
        assert_eq!(control_reply(&s, b"drop-acks 1\n"), "ok x1\n");
        assert_eq!(control_reply(&s, b"delay-acks 250\n"), "ok 250 ms\n");
        assert!(
            handle(&s, produce()).await.expect("handled").is_none(),
            "the first ack is dropped"
        );
        let answered = handle(&s, produce())
            .await
            .expect("handled")
            .expect("the second is answered");
        assert_eq!(answered.delay, Duration::from_millis(250));
        assert_eq!(&answered.bytes[4..8], &7i32.to_be_bytes(), "correlation id");
        // Other APIs are never delayed.
        let versions = handle(&s, frame(ApiKey::ApiVersions as i16, 3, &[0, 1, 1, 0]))
            .await
            .expect("v3")
            .expect("a response");
        assert_eq!(versions.delay, Duration::ZERO);
    }

    #[tokio::test]
    async fn a_stall_holds_until_it_ends_or_is_reset() {
        let s = shared();
        // No stall: at once.
        tokio::time::timeout(Duration::from_secs(1), wait_out_stall(&s))
            .await
            .expect("not stalled");
        assert_eq!(control_reply(&s, b"stall 150\n"), "ok 150 ms\n");
        let started = Instant::now();
        wait_out_stall(&s).await;
        assert!(started.elapsed() >= Duration::from_millis(140));

        assert_eq!(control_reply(&s, b"stall 60000\n"), "ok 60000 ms\n");
        let held = wait_out_stall(&s);
        tokio::pin!(held);
        assert!(
            tokio::time::timeout(Duration::from_millis(50), &mut held)
                .await
                .is_err(),
            "held while stalled"
        );
        assert_eq!(control_reply(&s, b"reset\n"), "ok\n");
        tokio::time::timeout(Duration::from_secs(1), held)
            .await
            .expect("released by reset");
    }

    #[test]
    fn control_replies_to_garbage_with_an_error() {
        let s = shared();
        for line in [
            &b"\n"[..],
            b"nope\n",
            b"\xff\xfe\n",
            b"stall\n",
            b"stall 1 2\n",
        ] {
            let reply = control_reply(&s, line);
            assert!(
                reply.starts_with("error ") && reply.ends_with('\n') && reply.lines().count() == 1,
                "{line:?}: {reply:?}"
            );
        }
    }

    #[tokio::test]
    async fn api_versions_in_any_version() {
        let s = shared();
        let v3 = handle(&s, frame(ApiKey::ApiVersions as i16, 3, &[0, 1, 1, 0]))
            .await
            .expect("v3")
            .expect("a response");
        assert_eq!(&v3.bytes[4..8], &7i32.to_be_bytes(), "correlation id");
        // A version from the future gets an answer in v0 (error 35).
        let v9 = handle(&s, frame(ApiKey::ApiVersions as i16, 9, &[0]))
            .await
            .expect("v9")
            .expect("a response");
        assert_eq!(&v9.bytes[8..10], &35i16.to_be_bytes());
    }
}
