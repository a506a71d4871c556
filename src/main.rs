//! The `outbox-relay` binary: parse the CLI, set up logging, run the command, and
//! map errors to the exit codes of `docs/architecture.md#exit-codes`.

use std::process::ExitCode;

use clap::Parser;
use outbox_relay::cdc::{self, cutover};
use outbox_relay::cli::{Cli, Command};
use outbox_relay::config::{LogConfig, LogFormat};
use outbox_relay::ops::{audit, check, health, migrate, replay, republish};
#[cfg(feature = "tools")]
use outbox_relay::tools::bench::BenchError;
#[cfg(feature = "tools")]
use outbox_relay::tools::demo::{self, DemoError};
#[cfg(feature = "tools")]
use outbox_relay::tools::dev_broker::{self, DevBrokerError};
use outbox_relay::{Error, postgres};

/// Why a command failed: the relay's [`Error`], or a developer tool's own error,
/// which wraps the relay's error where one caused it.
#[derive(Debug, thiserror::Error)]
enum Failure {
    #[error(transparent)]
    Relay(#[from] Error),
    #[cfg(feature = "tools")]
    #[error(transparent)]
    Bench(#[from] BenchError),
    #[cfg(feature = "tools")]
    #[error(transparent)]
    Demo(#[from] DemoError),
    #[cfg(feature = "tools")]
    #[error(transparent)]
    DevBroker(#[from] DevBrokerError),
    #[error("{0}")]
    Json(#[from] serde_json::Error),
}

impl From<outbox_relay::config::ConfigError> for Failure {
    fn from(e: outbox_relay::config::ConfigError) -> Failure {
        Failure::Relay(e.into())
    }
}

impl From<outbox_relay::postgres::PgError> for Failure {
    fn from(e: outbox_relay::postgres::PgError) -> Failure {
        Failure::Relay(e.into())
    }
}

impl Failure {
    /// The exit code (`docs/architecture.md#exit-codes`): the relay error's own,
    /// also inside a tool's error; 1 for anything else.
    fn exit_code(&self) -> ExitCode {
        match self {
            Failure::Relay(e) => e.exit_code(),
            #[cfg(feature = "tools")]
            Failure::Bench(e) => e.exit_code(),
            #[cfg(feature = "tools")]
            Failure::Demo(e) => e.exit_code(),
            #[cfg(feature = "tools")]
            Failure::DevBroker(e) => e.exit_code(),
            Failure::Json(_) => ExitCode::from(1),
        }
    }
}

fn init_tracing(log: &LogConfig) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&log.level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colour codes only on a terminal: log files and journald get plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    // A second init (tests calling main logic twice) is harmless: keep the first.
    let _ = match log.format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

/// Completes on SIGINT or SIGTERM.
async fn termination_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        }
        _ => {
            // Without signal handlers the process still stops on the default action.
            std::future::pending::<()>().await;
        }
    }
    tracing::info!("termination signal received");
}

async fn run(cli: Cli) -> Result<ExitCode, Failure> {
    match cli.command {
        Command::Run(args) => {
            let config = args.load()?;
            init_tracing(&config.log);
            let health = outbox_relay::cdc::metrics::Health::default();
            if !config.metrics.listen.trim().is_empty() {
                let handle = outbox_relay::cdc::metrics::install_recorder()?;
                outbox_relay::cdc::metrics::serve(
                    config.metrics.listen.trim(),
                    handle,
                    health.clone(),
                    std::time::Duration::from_secs(config.metrics.ready_stall_secs),
                )
                .await?;
            }
            let summary = cdc::run_checked(
                config,
                Box::pin(termination_signal()),
                health,
                &check::RunChecks,
            )
            .await?;
            tracing::info!(
                delivered = summary.delivered,
                poisoned = summary.poisoned,
                confirmed = %summary.confirmed,
                reconnects = summary.reconnects,
                "relay stopped"
            );
            Ok(ExitCode::SUCCESS)
        }
        Command::Cutover(args) => {
            let config = args.load()?;
            init_tracing(&config.log);
            let outcome = cutover::run_command(&config, Box::pin(termination_signal())).await?;
            println!("{}", cutover::render(&config, &outcome));
            Ok(ExitCode::SUCCESS)
        }
        Command::Status { config, json } => {
            let config = config.load()?;
            init_tracing(&config.log);
            let client = postgres::connect(&config.postgres.url).await?;
            // The slot's numbers where it lives (a standby with postgres.slot_url).
            let standby = match &config.postgres.slot_url {
                Some(url) => Some(postgres::connect(url).await?),
                None => None,
            };
            let slot_client = standby.as_ref().unwrap_or(&client);
            let status = outbox_relay::ops::status::read(&client, slot_client, &config).await?;
            if json {
                println!("{}", serde_json::to_string(&status)?);
            } else {
                print!("{}", status.render());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Migrate(args) => {
            let config = args.load()?;
            init_tracing(&config.log);
            let mut client = postgres::connect(&config.postgres.url).await?;
            let applied = migrate::apply(&mut client, &config).await?;
            print!("{}", applied.render());
            if config.kafka.delivery == outbox_relay::config::DeliveryMode::ExactlyOnce {
                outbox_relay::kafka::create_progress_topic(&config.kafka)
                    .await
                    .map_err(Error::from)?;
                println!(
                    "kafka.progress_topic {} exists (compacted; the exactly-once progress record)",
                    config.kafka.progress_topic
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Check { config, args } => {
            let loaded = config.load();
            match &loaded {
                Ok(config) => init_tracing(&config.log),
                Err(_) => init_tracing(&LogConfig::default()),
            }
            let report = Box::pin(check::run(loaded)).await;
            if args.json {
                println!("{}", report.to_json());
            } else {
                print!("{}", report.render());
            }
            Ok(report.exit_code())
        }
        Command::Poll { config, poll } => {
            let config = config.load()?;
            init_tracing(&config.log);
            let listen = config.metrics.listen.trim();
            if !listen.is_empty() {
                let handle = outbox_relay::cdc::metrics::install_recorder()?;
                outbox_relay::cdc::metrics::serve_poller(listen, handle).await?;
            }
            outbox_relay::poller::run(config, &poll, Box::pin(termination_signal())).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Audit { config, args } => {
            let config = config.load()?;
            init_tracing(&config.log);
            let report = audit::run(&config, &args).await?;
            if args.json {
                // The JSON keeps the contract's six keys; what qualifies them (e.g.
                // a topic not read to its end, whose events then count as lost)
                // goes to stderr.
                for note in &report.notes {
                    eprintln!("outbox-relay audit: note: {note}");
                }
                println!("{}", report.to_json());
            } else {
                print!("{}", report.render_table());
            }
            Ok(if report.is_clean() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        #[cfg(feature = "tools")]
        Command::Demo(args) => {
            init_tracing(&LogConfig {
                level: "warn".into(),
                ..LogConfig::default()
            });
            let summary = demo::run(&args).await?;
            print!("{}", summary.render());
            Ok(if summary.audit.is_clean() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            })
        }
        #[cfg(feature = "tools")]
        Command::DevBroker(args) => {
            init_tracing(&LogConfig {
                level: "info".into(),
                ..LogConfig::default()
            });
            dev_broker::run(&args, termination_signal()).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Retention { config, args } => {
            let config = config.load()?;
            init_tracing(&config.log);
            outbox_relay::ops::retention::run(&config, &args, Box::pin(termination_signal()))
                .await?;
            Ok(ExitCode::SUCCESS)
        }
        #[cfg(feature = "tools")]
        Command::Bench { config, args } => {
            let config = config.load()?;
            init_tracing(&config.log);
            let report = Box::pin(outbox_relay::tools::bench::run(&config, &args)).await?;
            if let Some(path) = &args.plot {
                report.plot(path)?;
            }
            if args.json {
                println!("{}", report.to_json());
            } else {
                print!("{}", report.render_table());
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Health { config, args } => {
            // A health check knows 0 (healthy) and 1 (unhealthy) only: every failure,
            // a config error included, is 1, with the reason on stderr.
            let probed = match health::target(&args, || config.load()) {
                Ok(addr) => health::probe(&addr, &args).await,
                Err(e) => Err(e),
            };
            Ok(match probed {
                Ok(status) => {
                    println!("{status}");
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("outbox-relay health: {e}");
                    ExitCode::from(1)
                }
            })
        }
        Command::Replay { config, args } => {
            let config = config.load()?;
            init_tracing(&config.log);
            let report = replay::run(&config, &args).await?;
            println!("{}", report.render(args.json));
            Ok(report.exit_code())
        }
        Command::Republish { config, args } => {
            let config = config.load()?;
            init_tracing(&config.log);
            let report = republish::run(&config, &args).await?;
            println!("{}", report.render(args.json));
            Ok(report.exit_code())
        }
    }
}

/// The async runtime a command runs on.
///
/// `run` gets a single-threaded runtime. Its work is one task (the replication
/// session) that every wake-up is for: a readable socket or a delivery report
/// from librdkafka's thread. On a multi-threaded runtime the future driven by
/// `block_on` lives on this thread while a worker owns the I/O driver, so each
/// wake-up crossed threads twice; measured on a 2-core machine in backlog drains
/// of 200,000 events (`bench --modes cdc`, three alternating pairs), the relay
/// spent 8.2–10.2 µs of CPU per event that way and 6.3–6.8 µs on one thread, and
/// drained 74–83k against 86–92k events/s. Its blocking calls (metadata checks,
/// dropping a producer) already go to `spawn_blocking`. The other commands keep
/// the multi-threaded runtime: the poller's workers and the tools run tasks in
/// parallel.
fn runtime_for(command: &Command) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = match command {
        Command::Run(_) => tokio::runtime::Builder::new_current_thread(),
        _ => tokio::runtime::Builder::new_multi_thread(),
    };
    builder.enable_all().build()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match runtime_for(&cli.command) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("outbox-relay: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("outbox-relay: {e}");
            e.exit_code()
        }
    }
}
