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
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

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

/// The state shared by all connections, and the signal that wakes waiting fetches.
#[derive(Debug)]
pub(super) struct Shared {
    broker: Mutex<Broker>,
    changes: watch::Sender<u64>,
}

impl Shared {
    pub(super) fn new(broker: Broker) -> Shared {
        Shared {
            broker: Mutex::new(broker),
            changes: watch::Sender::new(0),
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
        if let Some(response) = handle(shared, Bytes::from(frame)).await? {
            write.write_all(&response).await?;
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

/// Handles one request frame; `None` when no response is due (Produce, acks=0).
async fn handle(shared: &Shared, frame: Bytes) -> Result<Option<Bytes>, ConnectionError> {
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
        return encode(api, 0, id, &handlers::api_versions(false)).map(Some);
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
            let response = shared.with(|b| handlers::produce(b, req));
            if acks == 0 {
                return Ok(None);
            }
            encode(api, v, id, &response)?
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
    Ok(Some(response))
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
    async fn api_versions_in_any_version() {
        let s = shared();
        let v3 = handle(&s, frame(ApiKey::ApiVersions as i16, 3, &[0, 1, 1, 0]))
            .await
            .expect("v3")
            .expect("a response");
        assert_eq!(&v3[4..8], &7i32.to_be_bytes(), "correlation id");
        // A version from the future gets an answer in v0 (error 35).
        let v9 = handle(&s, frame(ApiKey::ApiVersions as i16, 9, &[0]))
            .await
            .expect("v9")
            .expect("a response");
        assert_eq!(&v9[8..10], &35i16.to_be_bytes());
    }
}
