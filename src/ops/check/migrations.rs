//! `postgres.migrations`: every migration `migrate` would apply to this database
//! is recorded in `outbox_relay_migrations` (an adopted outbox skips what does not
//! fit it, see `ops::migrate`). This covers the tables `run` needs: the outbox, an
//! upgraded poison table, the position, cutover and parked-key tables.
//!
//! A role that may not read `outbox_relay_migrations` (the least-privilege role
//! needs no right on it) gets a warning, not a problem: `run` then still checks
//! that each table it uses exists.

use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

use super::Check;
use crate::config::Config;
use crate::error::Error;
use crate::ops::migrate;

const NAME: &str = "postgres.migrations";

/// `postgres.migrations`.
pub(super) async fn check(client: &Client, config: &Config) -> Check {
    match migrate::pending(client, config).await {
        Ok(pending) if pending.is_empty() => Check::ok(NAME, "every migration is applied"),
        Ok(pending) => Check::problem(
            NAME,
            format!("not applied: {}", pending.join(", ")),
            "run `outbox-relay migrate` as the tables' owner (idempotent)",
        ),
        Err(Error::Postgres(e)) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            Check::warn(
                NAME,
                format!(
                    "cannot read outbox_relay_migrations: {}",
                    crate::postgres::describe_error(&e)
                ),
                "run `outbox-relay check` as the tables' owner to see pending migrations, or \
                 GRANT SELECT ON outbox_relay_migrations to this role",
            )
        }
        Err(Error::Postgres(e)) => Check::query_failed(NAME, "cannot read the migrations", &e),
        Err(e) => Check::problem(
            NAME,
            e.to_string(),
            "fix [outbox] / [outbox.columns] to describe the existing outbox (docs/configuration.md)",
        ),
    }
}
