//! The OTLP/HTTP receiver `cdc-traced` exports its spans to: it takes every
//! request to `/v1/traces`, counts it and its bytes, and answers 200, so that the
//! mode measures what tracing costs the relay, not a collector's speed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::error::BenchError;

/// A running sink (stops when dropped).
pub(crate) struct OtlpSink {
    /// The base URL for `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub(crate) endpoint: String,
    requests: Arc<AtomicU64>,
    bytes: Arc<AtomicU64>,
    server: tokio::task::JoinHandle<()>,
}

impl OtlpSink {
    /// Listens on a free loopback port.
    pub(crate) async fn start() -> Result<OtlpSink, BenchError> {
        let requests = Arc::new(AtomicU64::new(0));
        let bytes = Arc::new(AtomicU64::new(0));
        let (r, b) = (requests.clone(), bytes.clone());
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                r.fetch_add(1, Ordering::Relaxed);
                b.fetch_add(body.len() as u64, Ordering::Relaxed);
                // An empty ExportTraceServiceResponse.
                async { ([("content-type", "application/x-protobuf")], "") }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|source| BenchError::Spawn {
                what: "the OTLP sink".into(),
                source,
            })?;
        let address = listener.local_addr().map_err(|source| BenchError::Spawn {
            what: "the OTLP sink".into(),
            source,
        })?;
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::warn!(error = %e, "the bench's OTLP sink stopped");
            }
        });
        Ok(OtlpSink {
            endpoint: format!("http://{address}"),
            requests,
            bytes,
            server,
        })
    }

    /// Says on stderr what the relay exported for `events` events.
    pub(crate) fn report(&self, events: u64) {
        let (requests, bytes) = (
            self.requests.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        );
        eprintln!(
            "bench: cdc-traced exported {requests} OTLP request(s), {bytes} bytes ({} bytes per event)",
            bytes / events.max(1)
        );
    }
}

impl Drop for OtlpSink {
    fn drop(&mut self) {
        self.server.abort();
    }
}
