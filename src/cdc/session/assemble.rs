//! Building the relay from its configuration and running it: the start-up checks,
//! the first connection (waiting while PostgreSQL is unreachable), the producer, the
//! position saver, the poison writer and the heartbeat, then the loop of
//! [`Relay::run`](super::Relay).

use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::{
    Delivery, Opening, PoisonPath, RECONNECT_BACKOFF_INITIAL, RECONNECT_BACKOFF_MAX, Relay,
    RunSummary, StreamReader, Telemetry, TransactionDriver,
};
use crate::cdc::binary::BinaryDecoding;
use crate::cdc::confirmation::Confirmation;
use crate::cdc::exactly_once::ExactlyOnce;
use crate::cdc::heartbeat::{self, HeartbeatConfig};
use crate::cdc::metrics::Health;
use crate::cdc::poison_policy::PoisonPolicy;
use crate::cdc::ports::database::Postgres;
use crate::cdc::ports::producer::KafkaProducers;
use crate::cdc::progress::{Core, CoreConfig, Records, TransactionLimits};
use crate::cdc::start_checks::{Prerequisites as StartPrerequisites, StartChecks};
use crate::config::Config;
use crate::delivery::ErrorClass;
use crate::error::Result;
use crate::kafka;
use crate::lifecycle::{Backoff, Shutdown, millis, sleep_or_shutdown};
use crate::lsn::Lsn;
use crate::outbox::OutboxMapper;
use crate::outbox::position::PositionTable;
use crate::poison::PoisonWriter;
use crate::postgres::conninfo::ConnInfo;
use crate::postgres::prerequisite::Prerequisite;
use crate::postgres::slot;

/// pgoutput sends logical-decoding messages (our heartbeats) from this server
/// version on (`messages` option).
const MESSAGES_OPTION_SINCE: u32 = 140_000;
/// pgoutput's `binary` option exists since PostgreSQL 14.
const BINARY_OPTION_SINCE: u32 = 140_000;

/// Slot sampling period when the heartbeat itself is off.
const SLOT_SAMPLE_INTERVAL: Duration = Duration::from_secs(10);

/// Runs the CDC relay until `shutdown` completes or a fatal error occurs.
pub async fn run(config: Config, shutdown: Shutdown) -> Result<RunSummary> {
    Box::pin(run_with_health(config, shutdown, Health::default())).await
}

/// [`run`], reporting streaming state and progress to `health` (for `/readyz`).
pub async fn run_with_health(
    config: Config,
    shutdown: Shutdown,
    health: Health,
) -> Result<RunSummary> {
    run_checked(config, shutdown, health, &StartPrerequisites).await
}

/// [`run_with_health`], making `checks` at start (the binary passes the full
/// deploy check of `outbox-relay check`, see [`crate::cdc::start_checks`]).
pub async fn run_checked(
    config: Config,
    mut shutdown: Shutdown,
    health: Health,
    checks: &dyn StartChecks,
) -> Result<RunSummary> {
    // The slot's server, and the primary when the slot lives on a standby
    // (`postgres::servers`).
    let conninfo = crate::postgres::parse_url(config.postgres.slot_server_url())?;
    let primary = config
        .postgres
        .slot_elsewhere()
        .then(|| crate::postgres::parse_url(&config.postgres.url))
        .transpose()?;
    let Some(metadata) = connect_when_reachable(&conninfo, &mut shutdown).await? else {
        return Ok(RunSummary::default());
    };
    let primary_client = match &primary {
        Some(info) => match connect_when_reachable(info, &mut shutdown).await? {
            Some(client) => Some(client),
            None => return Ok(RunSummary::default()),
        },
        None => None,
    };
    let writes_client = primary_client.as_ref().unwrap_or(&metadata);
    let mut producer_config = kafka::producer_config(&config.kafka, &config.relay)?;
    let exactly_once = ExactlyOnce::new(&config, &mut producer_config)?;
    let producers = KafkaProducers::new(producer_config, &config.relay);
    let first = producers.publisher()?;
    let checks_started = Instant::now();
    checks.check(writes_client, &first.0, &config).await?;
    let delivery = Delivery::new(producers, first, &config.relay, exactly_once.is_some());
    tracing::info!(
        took_ms = millis(checks_started.elapsed()),
        "start-up checks passed"
    );
    let prerequisites = slot::check_prerequisites(&metadata, &config).await?;
    slot::check_slot_server(&metadata, &config).await?;
    if let Some(primary) = &primary_client {
        slot::check_writes_server(primary).await?;
    }
    let positions = PositionTable::new(&config)?;
    if !positions.exists(writes_client).await? {
        return Err(Prerequisite::PositionTableMissing {
            table: positions.name().to_owned(),
        }
        .into());
    }
    let policy = PoisonPolicy::new(
        config.relay.on_poison,
        crate::cdc::poison_policy::parked_keys(writes_client, &config).await?,
    );
    tracing::info!(
        server_version = %prerequisites.server_version,
        wal_sender_timeout_ms = millis(prerequisites.wal_sender_timeout),
        "connected to PostgreSQL"
    );

    tracing::info!(brokers = %config.kafka.brokers, "connected to Kafka");

    let mapper = OutboxMapper::for_config(&config)?;

    let (poison_tx, poison_rx) = mpsc::channel(config.relay.max_in_flight_events.max(1));
    let (outcome_tx, outcomes) = mpsc::channel(config.relay.max_in_flight_events.max(1));
    let writer = PoisonWriter::new(primary.clone().unwrap_or_else(|| conninfo.clone()), &config);
    tokio::spawn(crate::poison::run_writer(writer, poison_rx, outcome_tx));

    let core_config = CoreConfig {
        max_in_flight_events: config.relay.max_in_flight_events,
        max_in_flight_bytes: config.relay.max_in_flight_bytes,
        max_attempts: config.relay.max_attempts,
        status_interval: prerequisites.status_interval(),
        transactions: exactly_once.as_ref().map(|_| TransactionLimits {
            max_events: config.kafka.transaction_max_events,
            interval: Duration::from_millis(config.kafka.transaction_interval_ms),
        }),
        ..CoreConfig::default()
    };
    drop((metadata, primary_client));
    let heartbeat_secs = config.relay.heartbeat_interval_secs;
    let _heartbeat = AbortOnDrop(tokio::spawn(heartbeat::run(HeartbeatConfig {
        conninfo: conninfo.clone(),
        emit_on: primary.clone(),
        slot: config.postgres.slot_name(),
        interval: if heartbeat_secs == 0 {
            SLOT_SAMPLE_INTERVAL
        } else {
            Duration::from_secs(heartbeat_secs)
        },
        emit: heartbeat_secs > 0,
    })));

    let binary_decoding =
        config.postgres.binary_decoding && prerequisites.server_version_num >= BINARY_OPTION_SINCE;
    let reader = StreamReader::new(
        &config,
        mapper,
        BinaryDecoding::new(binary_decoding),
        prerequisites.server_version_num >= MESSAGES_OPTION_SINCE,
        prerequisites.wal_sender_timeout,
    );
    let transactions = TransactionDriver::new(
        exactly_once,
        Duration::from_millis(config.kafka.transaction_timeout_ms),
    );
    let mut relay = Relay {
        core: Core::new(core_config, Lsn::ZERO, Instant::now()),
        records: Records::default(),
        confirmation: Confirmation::default(),
        opening: Opening::new(
            Box::new(Postgres::new(config.clone(), conninfo, primary, positions)),
            prerequisites.wal_sender_timeout,
        ),
        reader,
        delivery,
        transactions,
        poison: PoisonPath::new(policy, poison_tx, outcomes),
        telemetry: Telemetry::new(health),
        config,
    };
    relay.run(shutdown).await
}

/// Opens the first metadata connection, waiting with backoff while PostgreSQL is
/// unreachable or starting up (a transient condition: the relay may start before
/// its database). Fatal errors (authentication, TLS, missing database) return at
/// once; `None` when shutdown came first.
pub(super) async fn connect_when_reachable(
    conninfo: &ConnInfo,
    shutdown: &mut Shutdown,
) -> Result<Option<tokio_postgres::Client>> {
    let mut backoff = Backoff::new(RECONNECT_BACKOFF_INITIAL, RECONNECT_BACKOFF_MAX);
    let mut logged = false;
    loop {
        match crate::postgres::connect_info(conninfo).await {
            Ok(client) => return Ok(Some(client)),
            Err(e) if e.class() == ErrorClass::Transient => {
                if !logged {
                    tracing::warn!(error = %e, "PostgreSQL unreachable; retrying with backoff");
                    logged = true;
                }
            }
            Err(e) => return Err(e.into()),
        }
        if sleep_or_shutdown(shutdown, backoff.next_pause()).await {
            return Ok(None);
        }
    }
}

/// Aborts a background task when dropped (the heartbeat stops with the relay).
pub(super) struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
