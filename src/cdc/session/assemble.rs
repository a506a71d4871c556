//! Building the relay from its configuration and running it: the start-up checks,
//! the first connection (waiting while PostgreSQL is unreachable), the producer, the
//! position saver, the poison writer and the heartbeat, then the loop of
//! [`Relay::run`](super::Relay).

use super::*;

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
    let conninfo = crate::postgres::parse_url(&config.postgres.url)?;
    let Some(metadata) = connect_when_reachable(&conninfo, &mut shutdown).await? else {
        return Ok(RunSummary::default());
    };
    let mut producer_config = kafka::producer_config(&config.kafka, &config.relay)?;
    let exactly_once = ExactlyOnce::new(&config, &mut producer_config)?;
    let (publisher, reports) = relay_publisher(&producer_config, &config.relay)?;
    let checks_started = Instant::now();
    checks.check(&metadata, &publisher, &config).await?;
    tracing::info!(
        took_ms = millis(checks_started.elapsed()),
        "start-up checks passed"
    );
    let prerequisites = slot::check_prerequisites(&metadata, &config).await?;
    let positions = PositionTable::new(&config)?;
    if !positions.exists(&metadata).await? {
        return Err(Prerequisite::PositionTableMissing {
            table: positions.name().to_owned(),
        }
        .into());
    }
    let policy = PoisonPolicy::new(
        config.relay.on_poison,
        crate::cdc::poison_policy::parked_keys(&metadata, &config).await?,
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
    let writer = PoisonWriter::new(conninfo.clone(), &config);
    tokio::spawn(crate::poison::run_writer(writer, poison_rx, outcome_tx));

    let pacing = ReadPacing::new(config.relay.read_pause_ms);
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
    drop(metadata);
    let heartbeat_secs = config.relay.heartbeat_interval_secs;
    let _heartbeat = AbortOnDrop(tokio::spawn(heartbeat::run(HeartbeatConfig {
        conninfo: conninfo.clone(),
        slot: config.postgres.slot_name(),
        interval: if heartbeat_secs == 0 {
            SLOT_SAMPLE_INTERVAL
        } else {
            Duration::from_secs(heartbeat_secs)
        },
        emit: heartbeat_secs > 0,
    })));

    let topic_limits = TopicLimits::new(&producer_config);
    let linger = kafka::linger(&producer_config);
    let binary_decoding =
        config.postgres.binary_decoding && prerequisites.server_version_num >= BINARY_OPTION_SINCE;
    let now = Instant::now();
    let mut relay = Relay {
        config,
        conninfo,
        core: Core::new(core_config, Lsn::ZERO, now),
        records: Records::default(),
        mapper,
        publisher,
        producer_config,
        reports,
        confirmation: Confirmation::new(positions),
        history: None,
        server_started: None,
        last_report_at: now,
        producer_fatal: None,
        producer_alerted: false,
        blocked_topics: HashMap::new(),
        streak: FailureStreak::default(),
        poison: PoisonPath::new(policy, poison_tx, outcomes),
        alone: None,
        topic_limits,
        idle_gate: IdleGate::new(linger),
        pacing,
        current_commit_lsn: Lsn::ZERO,
        current_commit_time: 0,
        summary: RunSummary::default(),
        wal_sender_timeout: prerequisites.wal_sender_timeout,
        messages_option: prerequisites.server_version_num >= MESSAGES_OPTION_SINCE,
        binary: BinaryDecoding::new(binary_decoding),
        health,
        instruments: Instruments::new(),
        exactly_once,
        last_status: None,
    };
    relay.run(shutdown).await
}

/// The relay's producer with the relay's settings: configuration errors poisoned or
/// not (`relay.on_config_error`), lingering records sent when the stream goes idle
/// (`relay.flush_when_idle`).
pub(super) fn relay_publisher(
    producer_config: &ClientConfig,
    relay: &RelayConfig,
) -> Result<(Publisher, mpsc::Receiver<DeliveryReport>)> {
    let (publisher, reports) =
        Publisher::new(producer_config.clone(), kafka::report_capacity(relay))?;
    let publisher = publisher.with_configuration_errors_poisoned(relay.on_config_error.poisons());
    let publisher = if relay.flush_when_idle {
        publisher.with_idle_flush()?
    } else {
        publisher
    };
    Ok((publisher, reports))
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
