//! Operator commands beside `run`: [`check`] (is this deploy ready?), [`migrate`] (schema), [`status`] (slot and
//! backlog), [`replay`] (poisoned events back to Kafka), [`republish`] (chosen outbox
//! rows sent again), [`retention`] (deleting
//! delivered rows), [`audit`] (what reached the topic, compared with the outbox) and
//! [`health`] (a container's probe of a running relay).

pub mod audit;
pub mod check;
pub mod health;
pub(crate) mod meter;
pub mod migrate;
pub mod replay;
pub mod republish;
pub mod retention;
pub mod status;

use crate::config::{Config, ConfigError, same_table};

/// The config of the one outbox a command works on: the only one, or the one
/// `--outbox TABLE` names. `what` completes "say which one's …" (e.g. "poison rows
/// to replay").
///
/// # Errors
///
/// [`ConfigError::Invalid`] (exit code 2) when several outboxes leave it open or
/// `--outbox` names none of them.
pub(crate) fn chosen_outbox(
    config: &Config,
    outbox: Option<&str>,
    what: &str,
) -> Result<Config, ConfigError> {
    let tables = || {
        config
            .outboxes()
            .map(|o| o.table.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match outbox {
        None if config.has_several_outboxes() => Err(ConfigError::Invalid(format!(
            "the config has several outboxes: say which one's {what} with --outbox TABLE \
             (one of {})",
            tables()
        ))),
        None => Ok(config.clone()),
        Some(name) => config
            .per_outbox()
            .into_iter()
            .find(|view| same_table(&view.outbox.table, name))
            .ok_or_else(|| {
                ConfigError::Invalid(format!(
                    "--outbox {name:?} is not an outbox of the config (one of {})",
                    tables()
                ))
            }),
    }
}

/// Takes the session-level advisory lock named `key` without waiting (released by
/// [`advisory_unlock`] or when the connection closes): whether it was free. One
/// run at a time of `replay` and `republish` per table.
pub(crate) async fn try_advisory_lock(
    client: &tokio_postgres::Client,
    key: &str,
) -> Result<bool, tokio_postgres::Error> {
    client
        .query_one("SELECT pg_try_advisory_lock(hashtext($1))", &[&key])
        .await?
        .try_get(0)
}

/// Releases a lock of [`try_advisory_lock`]; best effort, as it also ends with the
/// session.
pub(crate) async fn advisory_unlock(client: &tokio_postgres::Client, key: &str) {
    let _ = client
        .execute("SELECT pg_advisory_unlock(hashtext($1))", &[&key])
        .await;
}
