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
use crate::cdc::ports::clock;
use crate::cdc::ports::database::SessionDatabase;
use crate::cdc::ports::database::postgres::Postgres;
use crate::cdc::ports::producer::librdkafka::KafkaProducers;
use crate::cdc::progress::{Core, CoreConfig, Records, TransactionLimits};
use crate::cdc::start_checks::{Prerequisites as StartPrerequisites, StartChecks};
use crate::cdc::traces::EventTraces;
use crate::config::Config;
use crate::delivery::ErrorClass;
use crate::error::Result;
use crate::kafka;
use crate::lifecycle::{Backoff, Shutdown, millis, sleep_or_shutdown};
use crate::lsn::Lsn;
use crate::outbox::OutboxMapper;
use crate::outbox::position::PositionTable;
use crate::poison::{PoisonOutcome, PoisonRequest, PoisonWriter};
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

    let (poison_tx, poison_rx) = mpsc::channel(config.relay.max_in_flight_events.max(1));
    let (outcome_tx, outcomes) = mpsc::channel(config.relay.max_in_flight_events.max(1));
    let writer = PoisonWriter::new(primary.clone().unwrap_or_else(|| conninfo.clone()), &config);
    tokio::spawn(crate::poison::run_writer(writer, poison_rx, outcome_tx));

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
    let database = Postgres::new(config.clone(), conninfo, primary, positions.clone());
    let ports = Ports {
        database: Box::new(database),
        delivery,
        poison: (poison_tx, outcomes),
    };
    let facts = ServerFacts {
        wal_sender_timeout: prerequisites.wal_sender_timeout,
        status_interval: prerequisites.status_interval(),
        server_version_num: prerequisites.server_version_num,
    };
    let mut relay = assemble(config, ports, &facts, exactly_once, policy, health)?;
    relay.run(shutdown).await
}

/// The relay's world: PostgreSQL, the producer and the poison writer's channels
/// (`cdc::ports`).
pub(crate) struct Ports {
    pub(crate) database: Box<dyn SessionDatabase>,
    pub(super) delivery: Delivery,
    /// Requests to the poison writer, and its outcomes.
    pub(crate) poison: (mpsc::Sender<PoisonRequest>, mpsc::Receiver<PoisonOutcome>),
}

/// What the server said at start that the relay is built with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServerFacts {
    pub(crate) wal_sender_timeout: Duration,
    pub(crate) status_interval: Duration,
    pub(crate) server_version_num: u32,
}

/// The relay on `ports`, with the core, the reader and the parts made from the
/// configuration and the server's facts.
fn assemble(
    config: Config,
    ports: Ports,
    facts: &ServerFacts,
    exactly_once: Option<ExactlyOnce>,
    policy: PoisonPolicy,
    health: Health,
) -> Result<Relay> {
    let mapper = OutboxMapper::for_config(&config)?;
    let core_config = CoreConfig {
        max_in_flight_events: config.relay.max_in_flight_events,
        max_in_flight_bytes: config.relay.max_in_flight_bytes,
        max_attempts: config.relay.max_attempts,
        status_interval: facts.status_interval,
        transactions: exactly_once.as_ref().map(|_| TransactionLimits {
            max_events: config.kafka.transaction_max_events,
            interval: Duration::from_millis(config.kafka.transaction_interval_ms),
        }),
        ..CoreConfig::default()
    };
    let binary_decoding =
        config.postgres.binary_decoding && facts.server_version_num >= BINARY_OPTION_SINCE;
    let reader = StreamReader::new(
        &config,
        mapper,
        BinaryDecoding::new(binary_decoding),
        facts.server_version_num >= MESSAGES_OPTION_SINCE,
        facts.wal_sender_timeout,
    );
    let transactions = TransactionDriver::new(
        exactly_once,
        Duration::from_millis(config.kafka.transaction_timeout_ms),
    );
    let (poison_tx, outcomes) = ports.poison;
    // Bad `OTEL_*` settings are a configuration error (exit code 2).
    let traces = EventTraces::start(&config.traces)
        .map_err(|e| crate::config::ConfigError::Invalid(e.to_string()))?;
    Ok(Relay {
        core: Core::new(core_config, Lsn::ZERO, clock::now()),
        records: Records::default(),
        confirmation: Confirmation::default(),
        opening: Opening::new(ports.database, facts.wal_sender_timeout),
        reader,
        delivery: ports.delivery,
        transactions,
        poison: PoisonPath::new(policy, poison_tx, outcomes),
        telemetry: Telemetry::new(health, traces),
        config,
    })
}

/// Runs the relay on ports other than the real ones (the simulation of
/// `cdc::simulation`): no start-up checks, no heartbeat; `progress` reads
/// exactly-once's progress record back.
///
/// # Errors
///
/// As [`run`].
#[cfg(test)]
pub(crate) async fn run_on_ports(
    config: Config,
    ports: SimulatedPorts,
    facts: &ServerFacts,
    shutdown: Shutdown,
    health: Health,
) -> Result<RunSummary> {
    let mut producer_config = rdkafka::ClientConfig::new();
    let mut exactly_once = ExactlyOnce::new(&config, &mut producer_config)?;
    if let Some(eo) = &mut exactly_once {
        eo.read_progress_with(ports.progress);
    }
    let first = ports.producers.make()?;
    let delivery = Delivery::with_producers(
        ports.producers,
        first,
        crate::kafka::TopicLimits::unasked(),
        crate::kafka::IdleGate::new(Duration::ZERO),
        &config.relay,
        exactly_once.is_some(),
    );
    let policy = PoisonPolicy::new(config.relay.on_poison, crate::hashing::HashSet::default());
    let ports = Ports {
        database: ports.database,
        delivery,
        poison: ports.poison,
    };
    let mut relay = assemble(config, ports, facts, exactly_once, policy, health)?;
    relay.run(shutdown).await
}

/// The simulation's ports (see [`run_on_ports`]).
#[cfg(test)]
pub(crate) struct SimulatedPorts {
    pub(crate) database: Box<dyn SessionDatabase>,
    pub(crate) producers: Box<dyn crate::cdc::ports::producer::Producers>,
    pub(crate) progress: Box<dyn crate::cdc::ports::producer::ProgressReader>,
    pub(crate) poison: (mpsc::Sender<PoisonRequest>, mpsc::Receiver<PoisonOutcome>),
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
