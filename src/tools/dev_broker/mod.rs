//! `outbox-relay dev-broker`: a single-node, in-memory Kafka-protocol broker that
//! implements transactions, for trying and testing `kafka.delivery = "exactly-once"`.
//!
//! # Why it exists
//!
//! Exactly-once delivery writes the events and a progress record in one Kafka
//! transaction, and consumers read with `isolation.level=read_committed`. Testing
//! that needs a broker whose transactions are real, and none of those at hand is:
//! - Tansu 0.6 reports no aborted transactions in Fetch (read_committed consumers
//!   see aborted records) and panics on producer epochs it did not issue;
//! - librdkafka's mock cluster (the bundled 2.12.1, and every release through 2.16)
//!   writes no control batches on the regular Fetch path, reports the high watermark
//!   as the last stable offset, an empty aborted-transactions list, and never fences
//!   an older producer of the same `transactional.id`.
//!
//! # What it does
//!
//! Speaks the Kafka protocol (codecs from the kafka-protocol crate) to librdkafka
//! 2.12 clients over plain TCP, with the APIs and versions in
//! `handlers::SUPPORTED`: metadata and topic admin, idempotent produce (sequence
//! checks, duplicate detection), the transaction coordinator (producer ids and
//! epochs, fencing, AddPartitionsToTxn, EndTxn with COMMIT/ABORT control batches,
//! timeouts), read_committed and read_uncommitted fetches (LSO, aborted-transaction
//! lists, long polling), ListOffsets, and the committed offsets a consumer that
//! `assign()`s partitions uses.
//!
//! With `--control HOST:PORT` it also listens for plain-text commands that make
//! it misbehave on purpose, as a real cluster does during a rolling restart, a
//! coordinator failover or a stall: errors on chosen partitions, late or lost
//! acknowledgements, a paused broker, aborted transactions, coordinator errors
//! (`faults.rs` has the commands, and what librdkafka does with each).
//!
//! # What it does not do
//!
//! No replication (one node, id 1, leader epoch 0), no persistence beyond the
//! process, no retention or compaction (the log start offset is always 0), no
//! consumer groups beyond committed offsets (no JoinGroup, so no `subscribe()`), no
//! SASL or TLS, no quotas, no ACLs, no fetch sessions, no topic ids in Fetch
//! (versions ≤ 12). Timestamp lookups are answered at batch granularity.
//!
//! # Layout
//!
//! ```text
//!  TCP ──► server (frames, decode, dispatch, long-poll Fetch)
//!             │  one lock
//!             ▼
//!          handlers (one function per API) ──► state::Broker
//!                                               ├─ topics ── log (per partition)
//!                                               │             ├─ batch (v2 headers, markers)
//!                                               │             └─ sequence (idempotence)
//!                                               ├─ txn (producer ids, transactions)
//!                                               ├─ groups (committed offsets)
//!  control TCP ──► server ──► faults::parse ──► └─ faults (armed; spent by handlers,
//!                                                  and by server for acks and stalls)
//! ```

mod batch;
mod faults;
mod groups;
mod handlers;
mod log;
mod sequence;
mod server;
mod state;
mod topics;
mod txn;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{ArgAction, Args};
use tokio::net::TcpListener;

use self::server::Shared;
use self::state::{Broker, Settings};

/// How often open transactions are checked against their timeout.
const TIMEOUT_CHECK: Duration = Duration::from_millis(100);

/// `dev-broker` options.
#[derive(Debug, Clone, Args)]
pub struct DevBrokerArgs {
    /// Address to listen on (port 0 picks a free port); clients are told to connect
    /// to the bound address (127.0.0.1 when listening on all interfaces).
    #[arg(long, default_value = "127.0.0.1:9092")]
    pub listen: String,
    /// Partitions of an auto-created topic.
    #[arg(long, default_value_t = 1)]
    pub partitions: i32,
    /// Create a topic when a producer or consumer asks for its metadata
    /// (`--auto-create-topics false` to turn off).
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    pub auto_create_topics: bool,
    /// The coordinator's `transaction.max.timeout.ms` (Kafka's default): a producer
    /// asking for a longer transaction timeout is refused, as a cluster configured
    /// lower than the relay's `kafka.transaction_timeout_ms` refuses it.
    #[arg(long, default_value_t = 900_000)]
    pub transaction_max_timeout_ms: i32,
    /// Also listen here (port 0 picks a free port) for fault-injection commands,
    /// one a line (`fail-produce`, `delay-acks`, `drop-acks`, `stall`,
    /// `abort-transactions`, `coordinator-error`, `end-txn-error`, `reset`); prints
    /// `control on <host:port>` after the first line. For tests: no
    /// authentication, so keep it on loopback.
    #[arg(long, value_name = "HOST:PORT")]
    pub control: Option<String>,
}

/// Why the broker could not start.
#[derive(Debug, thiserror::Error)]
pub enum DevBrokerError {
    #[error("cannot listen on {address}: {source}")]
    Listen {
        address: String,
        source: std::io::Error,
    },
    #[error("--partitions must be between 1 and 10000, not {0}")]
    Partitions(i32),
    #[error("--transaction-max-timeout-ms must be between 1 and 900000, not {0}")]
    TransactionMaxTimeout(i32),
}

impl DevBrokerError {
    /// 2 for a usage error, 1 for anything else (`docs/architecture.md#exit-codes`).
    pub fn exit_code(&self) -> std::process::ExitCode {
        match self {
            DevBrokerError::Partitions(_) | DevBrokerError::TransactionMaxTimeout(_) => {
                std::process::ExitCode::from(2)
            }
            DevBrokerError::Listen { .. } => std::process::ExitCode::from(1),
        }
    }
}

/// The host clients are told to connect to for a bound address.
fn advertised(bound: SocketAddr) -> (String, i32) {
    let ip = if bound.ip().is_unspecified() {
        std::net::IpAddr::from([127, 0, 0, 1])
    } else {
        bound.ip()
    };
    (ip.to_string(), i32::from(bound.port()))
}

/// Binds, prints `listening on <host:port>` on stdout (then `control on
/// <host:port>` with `--control`), and serves until `shutdown` completes.
pub async fn run(
    args: &DevBrokerArgs,
    shutdown: impl Future<Output = ()>,
) -> Result<(), DevBrokerError> {
    if !(1..=10_000).contains(&args.partitions) {
        return Err(DevBrokerError::Partitions(args.partitions));
    }
    if !(1..=self::txn::MAX_TRANSACTION_TIMEOUT_MS).contains(&args.transaction_max_timeout_ms) {
        return Err(DevBrokerError::TransactionMaxTimeout(
            args.transaction_max_timeout_ms,
        ));
    }
    let listen_error = |source| DevBrokerError::Listen {
        address: args.listen.clone(),
        source,
    };
    let listener = TcpListener::bind(&args.listen)
        .await
        .map_err(listen_error)?;
    let bound = listener.local_addr().map_err(listen_error)?;
    let control = match &args.control {
        Some(address) => {
            let control_error = |source| DevBrokerError::Listen {
                address: address.clone(),
                source,
            };
            let listener = TcpListener::bind(address).await.map_err(control_error)?;
            let bound = listener.local_addr().map_err(control_error)?;
            Some((listener, bound))
        }
        None => None,
    };
    let (host, port) = advertised(bound);
    let shared = Arc::new(Shared::new(Broker::new(Settings {
        host,
        port,
        default_partitions: args.partitions,
        auto_create_topics: args.auto_create_topics,
        transaction_max_timeout_ms: args.transaction_max_timeout_ms,
    })));
    println!("listening on {bound}");
    tracing::info!(address = %bound, partitions = args.partitions, auto_create_topics = args.auto_create_topics, "dev broker started");
    let control = {
        let shared = Arc::clone(&shared);
        if let Some((_, control_bound)) = &control {
            println!("control on {control_bound}");
            tracing::info!(address = %control_bound, "fault-injection control listener started");
        }
        async move {
            match control {
                Some((listener, _)) => server::accept_control(listener, shared).await,
                None => std::future::pending().await,
            }
        }
    };

    let expiry = {
        let shared = Arc::clone(&shared);
        async move {
            let mut tick = tokio::time::interval(TIMEOUT_CHECK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                shared.with(|b| b.expire_transactions(Instant::now()));
            }
        }
    };
    tokio::select! {
        () = shutdown => {}
        () = server::accept(listener, shared) => {}
        () = control => {}
        () = expiry => {}
    }
    tracing::info!("dev broker stopped");
    Ok(())
}
