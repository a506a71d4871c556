//! `outbox-relay check`: everything a deploy needs, checked in one run, one line
//! per check (`ok`, `warn`, `problem` with its fix), and the same checks at the
//! start of `run`.
//!
//! # Why
//!
//! Before this, `run` found a missing prerequisite at the moment it needed it, one
//! at a time: fix `wal_level`, restart, learn the role lacks `REPLICATION`, fix,
//! restart, learn the publication publishes updates only… and a missing `INSERT`
//! on the poison table surfaced only at the first poisoned event, in production.
//! Here every check runs whatever the others found (a check that needs a
//! connection the deploy cannot open is left out, and the connection's own
//! problem says so), so one run lists every problem.
//!
//! # Layout
//!
//! One file per area: `server.rs` (connection, TLS, `wal_level`, free slots and
//! senders, slot state, `max_slot_wal_keep_size`), `privileges.rs` (the role),
//! `publication.rs`, `migrations.rs`, `kafka.rs` (broker, topics), `standby.rs`
//! (a slot on a standby, `postgres.slot_url`: the slot-side checks of `server.rs`
//! are then made on the standby, the rest on the primary). This file holds
//! the result types, the order of the checks, the text and JSON renderings, and
//! [`RunChecks`], the [`StartChecks`] that `run` is given by the binary.
//!
//! # Exit codes and `run`
//!
//! `check` exits 0 when no check is a `problem` (warnings allowed), else with the
//! code `run` would have stopped with for the first problem: 2 configuration,
//! 3 PostgreSQL, 4 Kafka (`docs/architecture.md#exit-codes`). `run` stops on the
//! problems of the checks that would stop it anyway or lose events (not the slot's
//! state, which its start logic handles, nor missing topics, whose events wait
//! under `relay.on_config_error = "block"`, nor unrecorded migrations: `run` checks
//! the tables it uses itself, and tables created from the migrations' SQL without
//! `migrate`, as `bench` does for its throwaway names, serve it as well), names
//! them all in one error with that
//! same exit code, and logs the rest as warnings.

mod kafka;
mod migrations;
mod privileges;
mod publication;
mod resync;
mod server;
mod standby;

use serde::Serialize;
use tokio_postgres::Client;

use crate::cdc::start_checks::{CheckFuture, StartChecks};
use crate::config::{Config, ConfigError};
use crate::error::{Error, FailedCheck};
use crate::kafka::Publisher;
use crate::postgres::conninfo::ConnInfo;

/// `check`'s own flags.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct CheckArgs {
    /// Print one JSON document (`docs/architecture.md#json-output`) instead of lines.
    #[arg(long)]
    pub json: bool,
}

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    /// Works, but something deserves attention (the detail says what).
    Warn,
    /// The relay cannot run (or would lose or block events) until it is fixed.
    Problem,
}

/// One check's result: the JSON object of `docs/architecture.md#json-output`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Stable name, `area.what` (`config`, `postgres.wal_level`, `kafka.topics`).
    pub name: &'static str,
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do (`None` when there is nothing to do).
    pub fix: Option<String>,
}

impl Check {
    pub(crate) fn ok(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            status: Status::Ok,
            detail: detail.into(),
            fix: None,
        }
    }

    pub(crate) fn warn(
        name: &'static str,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Check {
        Check {
            name,
            status: Status::Warn,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    pub(crate) fn problem(
        name: &'static str,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Check {
        Check {
            name,
            status: Status::Problem,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }

    /// A check whose query failed: the server's explanation as the detail.
    pub(crate) fn query_failed(name: &'static str, what: &str, e: &tokio_postgres::Error) -> Check {
        Check::problem(
            name,
            format!("{what}: {}", crate::postgres::describe_error(e)),
            "see the error; the other checks may say more",
        )
    }

    /// The exit code of this check's side: 2 config, 3 PostgreSQL, 4 Kafka.
    fn exit_code(&self) -> u8 {
        if self.name.starts_with("postgres.") {
            3
        } else if self.name.starts_with("kafka.") {
            4
        } else {
            2
        }
    }

    /// Whether a problem of this check stops `run` at start (see the module doc).
    fn stops_run(&self) -> bool {
        self.status == Status::Problem
            && !matches!(
                self.name,
                "postgres.tls"
                    | "postgres.slot"
                    | "postgres.standby.hot_standby_feedback"
                    | "postgres.standby.physical_slot"
                    | "postgres.max_slot_wal_keep_size"
                    | "postgres.migrations"
                    | "kafka.topics"
            )
    }
}

/// Every check of one run, in a fixed order: config, PostgreSQL, Kafka.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    /// No check is a `problem`.
    pub ready: bool,
    pub checks: Vec<Check>,
}

impl Report {
    fn new(checks: Vec<Check>) -> Report {
        Report {
            ready: checks.iter().all(|c| c.status != Status::Problem),
            checks,
        }
    }

    /// 0 when ready, else the code of the first problem's side (module doc).
    #[must_use]
    pub fn exit_code(&self) -> std::process::ExitCode {
        let code = self
            .checks
            .iter()
            .find(|c| c.status == Status::Problem)
            .map_or(0, Check::exit_code);
        std::process::ExitCode::from(code)
    }

    /// One line per check, then a summary line.
    #[must_use]
    pub fn render(&self) -> String {
        let mut out = String::new();
        for c in &self.checks {
            let status = match c.status {
                Status::Ok => "ok",
                Status::Warn => "warn",
                Status::Problem => "problem",
            };
            out.push_str(&format!("{status:<8} {}: {}", c.name, c.detail));
            if let Some(fix) = &c.fix {
                out.push_str(&format!(" -- fix: {fix}"));
            }
            out.push('\n');
        }
        let count = |s| self.checks.iter().filter(|c| c.status == s).count();
        if self.ready {
            out.push_str(&format!(
                "ready to run ({} warning{})\n",
                count(Status::Warn),
                if count(Status::Warn) == 1 { "" } else { "s" }
            ));
        } else {
            out.push_str(&format!(
                "not ready: {} problem{}, {} warning{}\n",
                count(Status::Problem),
                if count(Status::Problem) == 1 { "" } else { "s" },
                count(Status::Warn),
                if count(Status::Warn) == 1 { "" } else { "s" }
            ));
        }
        out
    }

    /// The JSON document of `docs/architecture.md#json-output`.
    #[must_use]
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| {
            // Plain strings and enums always serialise; keep the contract anyway.
            format!(r#"{{"ready":false,"checks":[],"error":"{e}"}}"#)
        })
    }
}

/// `check`: loads nothing itself (the CLI passes the outcome of loading the
/// config), runs every check and returns the report; never fails.
pub async fn run(config: Result<Config, ConfigError>) -> Report {
    let config = match config {
        Ok(config) => config,
        Err(e) => {
            return Report::new(vec![Check::problem(
                "config",
                e.to_string(),
                "fix the configuration (docs/configuration.md); no other check can run without it",
            )]);
        }
    };
    let (mut checks, producer) = config_checks(&config);
    let postgres = async {
        match connect(&config).await {
            Ok((client, info)) => {
                let mut out = vec![server::connection(&client, &info).await];
                match slot_server(&config).await {
                    Ok(standby) => {
                        let slot_client = standby.as_ref().unwrap_or(&client);
                        out.extend(
                            Box::pin(postgres_checks(&client, slot_client, &info, &config)).await,
                        );
                    }
                    Err(problem) => out.push(problem),
                }
                (out, Some(client))
            }
            Err(problem) => (vec![problem], None),
        }
    };
    let broker = async {
        let publisher = producer.and_then(|p| {
            Publisher::new(p, crate::kafka::report_capacity(&config.relay))
                .ok()
                .map(|(publisher, _reports)| publisher)
        });
        match publisher {
            Some(publisher) => {
                let check = kafka::broker(&publisher, &config).await;
                (vec![check], Some(publisher))
            }
            None => (Vec::new(), None),
        }
    };
    let ((pg_checks, client), (broker_checks, publisher)) = tokio::join!(postgres, broker);
    checks.extend(pg_checks);
    let broker_ok = broker_checks.iter().all(|c| c.status != Status::Problem);
    checks.extend(broker_checks);
    if let (Some(publisher), true) = (&publisher, broker_ok) {
        let client = client.as_ref();
        checks.push(
            per_outbox(&config, |view| async move {
                kafka::topics(publisher, &view, kafka::Sample::Recent(client)).await
            })
            .await,
        );
        checks.push(kafka::delivery(publisher, &config).await);
    }
    Report::new(checks)
}

/// The config check: it loaded, and the producer settings and the topic template
/// are usable (what `run` would refuse with exit code 2). Returns the producer
/// settings when they are.
fn config_checks(config: &Config) -> (Vec<Check>, Option<rdkafka::ClientConfig>) {
    let mut problems = Vec::new();
    let producer = match crate::kafka::producer_config(&config.kafka, &config.relay) {
        Ok(p) => Some(p),
        Err(e) => {
            problems.push(e.to_string());
            None
        }
    };
    if let Err(e) = crate::outbox::OutboxMapper::for_config(config) {
        problems.push(e.to_string());
    }
    let check = if problems.is_empty() {
        Check::ok(
            "config",
            format!(
                "loaded: outbox {}, publication {}, slot {}, brokers {}",
                config
                    .outboxes()
                    .map(|o| o.table.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                config.postgres.publication_name(),
                config.postgres.slot_name(),
                config.kafka.brokers
            ),
        )
    } else {
        Check::problem(
            "config",
            problems.join("; "),
            "fix the configuration (docs/configuration.md)",
        )
    };
    (vec![check], producer)
}

/// Opens the metadata connection, or the `postgres.connection` problem.
async fn connect(config: &Config) -> Result<(Client, ConnInfo), Check> {
    let info = crate::postgres::parse_url(&config.postgres.url).map_err(|e| {
        Check::problem(
            "postgres.connection",
            e.to_string(),
            "fix postgres.url (docs/configuration.md)",
        )
    })?;
    match crate::postgres::connect_info(&info).await {
        Ok(client) => Ok((client, info)),
        Err(e) => Err(Check::problem(
            "postgres.connection",
            format!("{e} (the other PostgreSQL checks need a connection and were not run)"),
            "check postgres.url (host, port, user, password, sslmode, sslrootcert), that \
             the server accepts this host in pg_hba.conf, and that it is running",
        )),
    }
}

/// The standby the slot lives on (`postgres.slot_url`), connected; `None` when
/// the slot is on `postgres.url`'s server; the `postgres.standby.connection`
/// problem when it cannot be reached.
async fn slot_server(config: &Config) -> Result<Option<Client>, Check> {
    const NAME: &str = "postgres.standby.connection";
    let Some(url) = &config.postgres.slot_url else {
        return Ok(None);
    };
    let info = crate::postgres::parse_url(url).map_err(|e| {
        Check::problem(
            NAME,
            e.to_string(),
            "fix postgres.slot_url (docs/configuration.md)",
        )
    })?;
    match crate::postgres::connect_info(&info).await {
        Ok(client) => Ok(Some(client)),
        Err(e) => Err(Check::problem(
            NAME,
            format!("{e} (the standby's checks need a connection and were not run)"),
            "check postgres.slot_url (host, port, user, password, sslmode), that the standby \
             accepts this host in pg_hba.conf, and that it is running",
        )),
    }
}

/// Every PostgreSQL check but the connection's own, concurrently (tokio-postgres
/// pipelines them): on `client`, and those of the slot on `slot_client`, the same
/// server or the standby of `postgres.slot_url` (with the standby's own checks).
async fn postgres_checks(
    client: &Client,
    slot_client: &Client,
    info: &ConnInfo,
    config: &Config,
) -> Vec<Check> {
    let (tls, wal, slots, senders, role, grants, publication, slot, keep, migrations, resync) = tokio::join!(
        server::tls(client, info),
        server::wal_level(client),
        server::free_slots(slot_client, config),
        server::free_senders(slot_client, config),
        privileges::role(client),
        per_outbox(config, |view| async move {
            privileges::tables(client, &view).await
        }),
        async {
            let each = per_outbox(config, |view| async move {
                publication::check(client, &view).await
            })
            .await;
            publication::unserved(client, config, each).await
        },
        server::slot(slot_client, config),
        server::max_slot_wal_keep_size(slot_client, config),
        per_outbox(config, |view| async move {
            migrations::check(client, &view).await
        }),
        per_outbox(
            config,
            |view| async move { resync::check(client, &view).await }
        ),
    );
    let mut checks = vec![
        tls,
        wal,
        slots,
        senders,
        role,
        grants,
        publication,
        slot,
        keep,
        migrations,
        resync,
    ];
    if config.kafka.delivery == crate::config::DeliveryMode::ExactlyOnce {
        checks.push(resync::restore_detection(client).await);
    }
    if config.postgres.slot_elsewhere() {
        checks.extend(standby::checks(client, slot_client).await);
    }
    checks
}

/// A check of one outbox table, made for each of several `[[outbox]]` entries and
/// reported as one: the worst status, each table's detail, the fixes of those not
/// ok (just the check itself with one outbox).
async fn per_outbox<F, Fut>(config: &Config, check: F) -> Check
where
    F: Fn(Config) -> Fut,
    Fut: std::future::Future<Output = Check>,
{
    // Boxed: each future holds a whole config.
    if !config.has_several_outboxes() {
        return Box::pin(check(config.clone())).await;
    }
    let mut checks = Vec::new();
    for view in config.per_outbox() {
        let table = view.outbox.table.clone();
        checks.push((table, Box::pin(check(view)).await));
    }
    merge_checks(checks)
}

/// One check out of the same check of several outbox tables (see [`per_outbox`]).
fn merge_checks(checks: Vec<(String, Check)>) -> Check {
    let rank = |s: Status| match s {
        Status::Ok => 0,
        Status::Warn => 1,
        Status::Problem => 2,
    };
    let mut merged: Option<Check> = None;
    let mut details = Vec::new();
    let mut fixes = Vec::new();
    for (table, check) in checks {
        details.push(format!("{table}: {}", check.detail));
        if let Some(fix) = &check.fix {
            fixes.push(format!("{table}: {fix}"));
        }
        match &mut merged {
            Some(m) if rank(check.status) > rank(m.status) => m.status = check.status,
            Some(_) => {}
            None => merged = Some(check),
        }
    }
    let mut merged = merged.unwrap_or_else(|| Check::ok("config", "no outbox"));
    merged.detail = details.join("; ");
    merged.fix = (!fixes.is_empty()).then(|| fixes.join("; "));
    merged
}

/// The checks of `outbox-relay check`, made by `run` at start: on the connection
/// and producer `run` opened; topics only when the template names one.
#[derive(Debug, Clone, Copy, Default)]
pub struct RunChecks;

impl RunChecks {
    async fn report(client: &Client, publisher: &Publisher, config: &Config) -> Report {
        let info = crate::postgres::parse_url(&config.postgres.url);
        let postgres = async {
            match (&info, slot_server(config).await) {
                (Ok(info), Ok(standby)) => {
                    let slot_client = standby.as_ref().unwrap_or(client);
                    Box::pin(postgres_checks(client, slot_client, info, config)).await
                }
                (Ok(_), Err(problem)) => vec![problem],
                (Err(e), _) => vec![Check::problem(
                    "postgres.connection",
                    e.to_string(),
                    "fix postgres.url",
                )],
            }
        };
        let broker = kafka::broker(publisher, config);
        let (mut checks, broker) = tokio::join!(postgres, broker);
        let broker_ok = broker.status != Status::Problem;
        checks.push(broker);
        if broker_ok {
            checks.push(
                per_outbox(config, |view| async move {
                    kafka::topics(publisher, &view, kafka::Sample::TemplateOnly).await
                })
                .await,
            );
            checks.push(kafka::delivery(publisher, config).await);
        }
        Report::new(checks)
    }
}

impl StartChecks for RunChecks {
    fn check<'a>(
        &'a self,
        client: &'a Client,
        publisher: &'a Publisher,
        config: &'a Config,
    ) -> CheckFuture<'a> {
        Box::pin(async move {
            let report = Box::pin(RunChecks::report(client, publisher, config)).await;
            let mut failed = Vec::new();
            let mut exit_code = 0;
            for c in report.checks {
                if c.stops_run() {
                    if failed.is_empty() {
                        exit_code = c.exit_code();
                    }
                    failed.push(FailedCheck {
                        name: c.name.to_owned(),
                        detail: c.detail,
                        fix: c.fix,
                    });
                } else if c.status != Status::Ok {
                    tracing::warn!(
                        check = c.name,
                        fix = c.fix.as_deref().unwrap_or(""),
                        "{}",
                        c.detail
                    );
                }
            }
            if failed.is_empty() {
                Ok(())
            } else {
                Err(Error::ChecksFailed { failed, exit_code })
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_problem_decides_the_exit_code() {
        let report = Report::new(vec![
            Check::ok("config", "loaded"),
            Check::warn("postgres.tls", "not encrypted", "sslmode"),
            Check::problem("kafka.broker", "down", "start it"),
        ]);
        assert!(!report.ready);
        assert_eq!(report.exit_code(), std::process::ExitCode::from(4));
        let report = Report::new(vec![
            Check::problem("postgres.wal_level", "replica", "logical"),
            Check::problem("kafka.broker", "down", "start it"),
        ]);
        assert_eq!(report.exit_code(), std::process::ExitCode::from(3));
        let report = Report::new(vec![Check::warn("postgres.tls", "plain", "tls")]);
        assert!(report.ready);
        assert_eq!(report.exit_code(), std::process::ExitCode::SUCCESS);
    }

    #[test]
    fn json_has_the_documented_shape() {
        let report = Report::new(vec![
            Check::ok("config", "loaded"),
            Check::problem("postgres.wal_level", "replica", "set it"),
        ]);
        let v: serde_json::Value = serde_json::from_str(&report.to_json()).unwrap();
        assert_eq!(v["ready"], false);
        assert_eq!(v["checks"][0]["status"], "ok");
        assert!(v["checks"][0]["fix"].is_null());
        assert_eq!(v["checks"][1]["name"], "postgres.wal_level");
        assert_eq!(v["checks"][1]["status"], "problem");
        assert_eq!(v["checks"][1]["fix"], "set it");
        let keys: Vec<&String> = v["checks"][1].as_object().unwrap().keys().collect();
        assert_eq!(keys.len(), 4);
    }

    #[test]
    fn the_slot_and_topics_do_not_stop_run() {
        assert!(Check::problem("postgres.privileges", "x", "y").stops_run());
        assert!(!Check::problem("postgres.slot", "lost", "y").stops_run());
        assert!(!Check::problem("kafka.topics", "missing", "y").stops_run());
        assert!(!Check::problem("postgres.migrations", "not applied", "y").stops_run());
        assert!(!Check::warn("postgres.role", "x", "y").stops_run());
    }

    #[test]
    fn one_line_per_check() {
        let report = Report::new(vec![
            Check::ok("config", "loaded"),
            Check::problem("kafka.broker", "down", "start it"),
        ]);
        let text = report.render();
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(
            text.contains("problem  kafka.broker: down -- fix: start it"),
            "{text}"
        );
        assert!(
            text.ends_with("not ready: 1 problem, 0 warnings\n"),
            "{text}"
        );
    }
}
