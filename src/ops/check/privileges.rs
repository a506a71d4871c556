//! The role's rights: `REPLICATION` (or superuser) for the replication
//! connection, and on each table what `run` does with it — the list of
//! `config/least-privilege.sql` (docs/operations.md#least-privilege):
//!
//! | table | rights | why |
//! |---|---|---|
//! | the outbox | `SELECT` | start-up checks, `status`, `audit`, the cutover's backlog |
//! | the poison table | `SELECT, INSERT` | poison rows |
//! | `outbox_relay_position` | `SELECT, INSERT, UPDATE` | the saved position |
//! | `outbox_relay_cutover` | `SELECT, INSERT, UPDATE` | with `relay.cutover = "auto"`: the slots it creates |
//! | `outbox_relay_parked_key` | `SELECT` (and `INSERT, UPDATE` with `relay.on_poison = "park-key"`) | parked keys are loaded at start |
//!
//! `outbox_relay_checkpoint` is not in the list: `run` never touches it
//! (`retention` and the poller write it, under a role of their own). A table that
//! does not exist yet is left to the migrations check.

use tokio_postgres::Client;

use super::Check;
use crate::config::{Config, CutoverMode, PoisonKeyMode, qualified_name, quote_ident};

/// `postgres.role`: `REPLICATION` or superuser.
pub(super) async fn role(client: &Client) -> Check {
    const NAME: &str = "postgres.role";
    let row = match client
        .query_one(
            "SELECT current_user::text, rolsuper, rolreplication FROM pg_roles
             WHERE rolname = current_user",
            &[],
        )
        .await
    {
        Ok(row) => row,
        Err(e) => return Check::query_failed(NAME, "cannot read the role", &e),
    };
    let (user, superuser, replication): (String, bool, bool) = (row.get(0), row.get(1), row.get(2));
    if superuser {
        Check::ok(NAME, format!("{user} is a superuser"))
    } else if replication {
        Check::ok(NAME, format!("{user} has REPLICATION"))
    } else {
        Check::problem(
            NAME,
            format!(
                "{user} has neither REPLICATION nor superuser: it cannot open the replication \
                 connection"
            ),
            format!(
                "as a superuser: ALTER ROLE {} REPLICATION (config/least-privilege.sql)",
                quote_ident(&user)
            ),
        )
    }
}

/// One table the relay uses: its quoted name, the rights it needs and why.
struct Need {
    table: String,
    rights: &'static [&'static str],
    why: &'static str,
}

/// The tables and rights `run` needs under this config (module doc).
fn needs(config: &Config) -> Vec<Need> {
    let schema =
        qualified_name(&config.outbox.table).map_or_else(|_| "public".to_owned(), |(s, _)| s);
    let own = |name: &str| format!("{}.{}", quote_ident(&schema), quote_ident(name));
    let mut out = vec![
        Need {
            table: crate::config::quote_qualified(&config.outbox.table),
            rights: &["SELECT"],
            why: "the outbox",
        },
        Need {
            table: crate::config::quote_qualified(&config.outbox.poison_table),
            rights: &["SELECT", "INSERT"],
            why: "poison rows",
        },
        Need {
            table: own("outbox_relay_position"),
            rights: &["SELECT", "INSERT", "UPDATE"],
            why: "the saved position",
        },
    ];
    if config.relay.cutover == CutoverMode::Auto {
        out.push(Need {
            table: own("outbox_relay_cutover"),
            rights: &["SELECT", "INSERT", "UPDATE"],
            why: "relay.cutover = \"auto\" records the slots it creates",
        });
    }
    out.push(Need {
        table: own("outbox_relay_parked_key"),
        rights: if config.relay.on_poison == PoisonKeyMode::ParkKey {
            &["SELECT", "INSERT", "UPDATE"]
        } else {
            &["SELECT"]
        },
        why: "parked keys",
    });
    out
}

/// `postgres.privileges`: the table rights of the module doc, and `USAGE` on the
/// outbox's schema.
pub(super) async fn tables(client: &Client, config: &Config) -> Check {
    const NAME: &str = "postgres.privileges";
    let user: String = match client.query_one("SELECT current_user::text", &[]).await {
        Ok(row) => row.get(0),
        Err(e) => return Check::query_failed(NAME, "cannot read the role", &e),
    };
    let mut missing: Vec<String> = Vec::new();
    let mut grants: Vec<String> = Vec::new();
    let mut absent = 0;
    let schema =
        qualified_name(&config.outbox.table).map_or_else(|_| "public".to_owned(), |(s, _)| s);
    match client
        .query_opt(
            "SELECT has_schema_privilege(oid, 'USAGE') FROM pg_namespace WHERE nspname = $1",
            &[&schema],
        )
        .await
    {
        Ok(Some(row)) if !row.get::<_, bool>(0) => {
            missing.push(format!("USAGE on schema {schema}"));
            grants.push(format!(
                "GRANT USAGE ON SCHEMA {} TO {}",
                quote_ident(&schema),
                quote_ident(&user)
            ));
        }
        Ok(_) => {}
        Err(e) => return Check::query_failed(NAME, "cannot read the schema's privileges", &e),
    }
    for need in needs(config) {
        let mut lacking = Vec::new();
        for right in need.rights {
            let held: Option<bool> = match client
                .query_one(
                    "SELECT has_table_privilege(to_regclass($1), $2)",
                    &[&need.table, right],
                )
                .await
            {
                Ok(row) => row.get(0),
                Err(e) => return Check::query_failed(NAME, "cannot read table privileges", &e),
            };
            match held {
                None => {
                    absent += 1;
                    break;
                }
                Some(false) => lacking.push(*right),
                Some(true) => {}
            }
        }
        if !lacking.is_empty() {
            missing.push(format!(
                "{} on {} ({})",
                lacking.join(", "),
                need.table,
                need.why
            ));
            grants.push(format!(
                "GRANT {} ON {} TO {}",
                lacking.join(", "),
                need.table,
                quote_ident(&user)
            ));
        }
    }
    let not_yet = if absent > 0 {
        format!(" ({absent} of the relay's tables do not exist yet: see postgres.migrations)")
    } else {
        String::new()
    };
    if missing.is_empty() {
        Check::ok(NAME, format!("{user} holds what the relay needs{not_yet}"))
    } else {
        Check::problem(
            NAME,
            format!("{user} lacks {}{not_yet}", missing.join("; ")),
            format!(
                "as the tables' owner: {} (config/least-privilege.sql lists every right)",
                grants.join("; ")
            ),
        )
    }
}
