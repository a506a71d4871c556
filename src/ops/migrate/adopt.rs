//! `migrate` on an outbox table that already exists: a poller's, Debezium's, or any
//! table named by `[outbox.columns]`.
//!
//! **Why.** People replacing a polling relay or Debezium have an outbox already, and
//! its columns are not ours: no `topic` or `headers`, no `created_at`, an id of
//! another type, a `json`, `text` or `bytea` payload. The mapper reads such tables
//! (absent optional columns are NULL), so `migrate` must not be what refuses them.
//! The migrations that touch the outbox itself are the only ones concerned:
//!
//! - `0001` creates the table (a no-op when it exists) and the poller's index on
//!   `(created_at, id) WHERE sent_at IS NULL`. On a table without those columns only
//!   the UUID v7 function runs; the index is left out, with a note.
//! - `0004` installs the writer helper `outbox_enqueue(…)`, which inserts into the
//!   configured columns. On another layout it is generated for the columns the table
//!   has (same signature, so callers and [`crate::outbox::enqueue`] do not change):
//!   the payload cast to the column's type, a generated id where the table has no
//!   default, and an error, not silence, when a caller passes headers or a key the
//!   table cannot store. Where no such function can work (no entity-id column, an
//!   integer id without a default, a payload type it cannot cast to) it is skipped
//!   with the reason, and the rest of the schema is still applied.
//!
//! Whenever the table has what a migration's own SQL needs, that SQL runs unchanged,
//! so tables `migrate` created keep the checksums recorded for them.

use std::collections::HashMap;

use tokio_postgres::Client;

use crate::config::{Config, ConfigError, quote_ident, quote_qualified};
use crate::error::Result;

/// A column of the existing outbox table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Column {
    /// `pg_type.typname`, e.g. `jsonb`, `int8`, `uuid`.
    pub(super) type_name: String,
    /// Has a default or is an identity column: an insert may leave it out.
    pub(super) has_default: bool,
}

/// The outbox table as `migrate` finds it before applying anything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Existing {
    pub(super) columns: HashMap<String, Column>,
}

/// How a migration runs against the outbox as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Step {
    /// The migration's own SQL.
    Standard,
    /// SQL generated for this table instead, and what differs.
    Adapted { sql: String, note: String },
    /// Not applied, and why (not recorded, so a later `migrate` decides again).
    Skipped(String),
}

/// Reads the outbox table's columns; `None` when it does not exist.
pub(super) async fn inspect(client: &Client, cfg: &Config) -> Result<Option<Existing>> {
    let table = quote_qualified(&cfg.outbox.table);
    if !crate::postgres::table_exists(client, &table).await? {
        return Ok(None);
    }
    let rows = client
        .query(
            "SELECT a.attname::text, t.typname::text, a.atthasdef OR a.attidentity <> ''
             FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
             WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped",
            &[&table],
        )
        .await?;
    let mut columns = HashMap::new();
    for row in rows {
        let name: String = row.try_get(0)?;
        let column = Column {
            type_name: row.try_get(1)?,
            has_default: row.try_get(2)?,
        };
        columns.insert(name, column);
    }
    Ok(Some(Existing { columns }))
}

/// `0001`: the standard SQL when it can run, else only its UUID v7 function.
///
/// # Errors
///
/// [`ConfigError::Invalid`] when the table does not exist and a column is configured
/// as absent: `migrate` creates only this relay's full layout.
pub(super) fn outbox_table(
    cfg: &Config,
    existing: Option<&Existing>,
    standard: &str,
) -> std::result::Result<Step, ConfigError> {
    let Some(existing) = existing else {
        let absent: Vec<&str> = cfg
            .outbox
            .columns
            .by_key()
            .into_iter()
            .filter(|(_, name)| name.is_empty())
            .map(|(key, _)| key)
            .collect();
        if absent.is_empty() {
            return Ok(Step::Standard);
        }
        return Err(ConfigError::Invalid(format!(
            "outbox table {} does not exist and outbox.columns.{} {} empty: `migrate` creates \
             only this relay's full layout. Create the table yourself (e.g. Debezium's), or name \
             every column",
            cfg.outbox.table,
            absent.join(", "),
            if absent.len() == 1 { "is" } else { "are" }
        )));
    };
    let c = &cfg.outbox.columns;
    let index_columns = [c.created_at.as_str(), c.id.as_str(), "sent_at"];
    let lacking: Vec<&str> = index_columns
        .into_iter()
        .filter(|name| name.is_empty() || !existing.columns.contains_key(*name))
        .collect();
    // The standard SQL names every configured column (in its CREATE TABLE, a no-op
    // here, but parsed all the same) and the index's.
    let all_named = cfg
        .outbox
        .columns
        .by_key()
        .iter()
        .all(|(_, name)| !name.is_empty());
    if lacking.is_empty() && all_named {
        return Ok(Step::Standard);
    }
    let (function, rest) = standard
        .split_once("\nCREATE TABLE IF NOT EXISTS")
        .unwrap_or((standard, ""));
    let index = rest
        .find("CREATE INDEX IF NOT EXISTS")
        .map_or("", |start| &rest[start..]);
    let (sql, note) = if lacking.is_empty() {
        (
            format!("{function}\n{index}"),
            "the existing table is kept as it is (with the polling relay's index)".to_owned(),
        )
    } else {
        (
            function.to_owned(),
            format!(
                "the existing table is kept as it is; the polling relay's index on \
                 (created_at, id) WHERE sent_at IS NULL is not created: the table has no {} column",
                describe_lacking(&lacking)
            ),
        )
    };
    Ok(Step::Adapted { sql, note })
}

fn describe_lacking(lacking: &[&str]) -> String {
    lacking
        .iter()
        .map(|name| {
            if name.is_empty() {
                "(configured as none)".to_owned()
            } else {
                format!("{name:?}")
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The column of a field in the existing table: the configured name, else (for
/// the three Debezium names) the alias the mapper also accepts.
fn resolve<'a>(
    existing: &'a Existing,
    configured: &'a str,
    alias: Option<&'a str>,
) -> Option<(&'a str, &'a Column)> {
    let find = |name: &'a str| {
        (!name.is_empty())
            .then(|| existing.columns.get(name).map(|c| (name, c)))
            .flatten()
    };
    find(configured).or_else(|| alias.and_then(find))
}

/// `0011`: the message outbox, unless the table's layout would make a message's
/// record differ from a row's: the frame carries the aggregate id as given and a
/// JSON payload, which are a row's only for a text-like id and a json/jsonb payload
/// (a uuid or bigint id is canonicalised by its type, another partition otherwise).
pub(super) fn message_outbox(cfg: &Config, existing: Option<&Existing>) -> Step {
    let Some(existing) = existing else {
        return Step::Standard;
    };
    let c = &cfg.outbox.columns;
    let id = resolve(existing, &c.aggregate_id, Some("aggregateid"));
    let payload = resolve(existing, &c.payload, None);
    let fits = |col: Option<(&str, &Column)>, types: &[&str]| {
        col.is_some_and(|(_, col)| types.contains(&col.type_name.as_str()))
    };
    if fits(id, &["text", "varchar", "bpchar"]) && fits(payload, &["json", "jsonb"]) {
        return Step::Standard;
    }
    Step::Skipped(format!(
        "outbox_emit writes a text aggregate id and a JSON payload, and {} has {} {} and {} {}: \
         a message's record would differ from a row's",
        cfg.outbox.table,
        id.map_or("no aggregate id column", |(name, _)| name),
        id.map_or("", |(_, col)| col.type_name.as_str()),
        payload.map_or("no payload column", |(name, _)| name),
        payload.map_or("", |(_, col)| col.type_name.as_str()),
    ))
}

/// `0004`: the standard writer helper when the table has its columns and types,
/// else one generated for the table, or a reason to skip it.
pub(super) fn enqueue(cfg: &Config, existing: Option<&Existing>) -> Step {
    let Some(existing) = existing else {
        return Step::Standard;
    };
    let c = &cfg.outbox.columns;
    let exact = |name: &str, types: &[&str]| {
        existing
            .columns
            .get(name)
            .is_some_and(|col| types.is_empty() || types.contains(&col.type_name.as_str()))
    };
    let id_ok = existing
        .columns
        .get(&c.id)
        .is_none_or(|col| col.has_default);
    if id_ok
        && [
            &c.aggregate_type,
            &c.aggregate_id,
            &c.event_type,
            &c.idempotency_key,
        ]
        .iter()
        .all(|name| exact(name, &[]))
        && exact(&c.payload, &["jsonb"])
        && exact(&c.headers, &["jsonb"])
    {
        return Step::Standard;
    }
    match generated_enqueue(cfg, existing) {
        Ok((sql, note)) => Step::Adapted { sql, note },
        Err(reason) => Step::Skipped(format!(
            "outbox_enqueue() is not installed: {reason}; write events with your own INSERT"
        )),
    }
}

/// One value of the generated function's INSERT, or a check on an argument the
/// table cannot store.
struct Plan {
    columns: Vec<String>,
    values: Vec<String>,
    checks: Vec<String>,
    notes: Vec<String>,
}

impl Plan {
    fn set(&mut self, column: &str, value: String) {
        self.columns.push(quote_ident(column));
        self.values.push(value);
    }

    /// An argument the table has no column for: an error when given, never dropped.
    fn refuse(&mut self, argument: &str, param: usize, why: &str) {
        // An SQL string literal: quotes doubled.
        let why = why.replace('\'', "''");
        self.checks.push(format!(
            "    IF ${param} IS NOT NULL THEN\n        RAISE EXCEPTION 'outbox_enqueue: {argument} cannot be stored: {why}'\n            USING ERRCODE = 'invalid_parameter_value';\n    END IF;"
        ));
    }
}

/// The generated `outbox_enqueue` for this table, with a note on what differs
/// from the standard one; or why none can work.
fn generated_enqueue(
    cfg: &Config,
    existing: &Existing,
) -> std::result::Result<(String, String), String> {
    let c = &cfg.outbox.columns;
    let (schema, _) =
        crate::config::qualified_name(&cfg.outbox.table).map_err(|e| e.to_string())?;
    let uuid_v7 = format!("{}.outbox_relay_uuid_v7()", quote_ident(&schema));
    let mut plan = Plan {
        columns: Vec::new(),
        values: Vec::new(),
        checks: Vec::new(),
        notes: Vec::new(),
    };
    for (argument, param, configured, alias) in [
        (
            "aggregate_type",
            1,
            &c.aggregate_type,
            Some("aggregatetype"),
        ),
        ("event_type", 3, &c.event_type, Some("type")),
    ] {
        match resolve(existing, configured, alias) {
            Some((name, _)) => plan.set(name, format!("${param}")),
            None => plan.refuse(argument, param, "the outbox table has no such column"),
        }
    }
    let (aggregate_id, _) = resolve(existing, &c.aggregate_id, Some("aggregateid"))
        .ok_or_else(|| format!("the table has no entity-id column {:?}", c.aggregate_id))?;
    plan.set(aggregate_id, "$2".into());
    let (payload, payload_col) = resolve(existing, &c.payload, None)
        .ok_or_else(|| format!("the table has no payload column {:?}", c.payload))?;
    let payload_value = match payload_col.type_name.as_str() {
        "jsonb" => "$4".to_owned(),
        "json" => "$4::json".to_owned(),
        "text" | "varchar" | "bpchar" => "$4::text".to_owned(),
        "bytea" => "convert_to($4::text, 'UTF8')".to_owned(),
        other => return Err(format!("the payload column {payload:?} is of type {other}")),
    };
    plan.set(payload, payload_value);
    if payload_col.type_name != "jsonb" {
        plan.notes
            .push(format!("payload stored as {}", payload_col.type_name));
    }
    match resolve(existing, &c.headers, None) {
        Some((name, col)) if col.type_name == "jsonb" => plan.set(name, "$5".into()),
        Some((name, col)) if col.type_name == "json" => plan.set(name, "$5::json".into()),
        Some((name, col)) => {
            return Err(format!(
                "the headers column {name:?} is of type {}",
                col.type_name
            ));
        }
        None => {
            plan.refuse("headers", 5, "the outbox table has no headers column");
            plan.notes
                .push("no headers column: headers given are refused".into());
        }
    }
    let key_column = idempotency_key(c, existing, &uuid_v7, &mut plan)?;
    if let Some((name, col)) = resolve(existing, &c.created_at, None)
        && !col.has_default
    {
        plan.set(name, "clock_timestamp()".into());
    }
    let sql = format!(
        "-- Generated by `outbox-relay migrate` for an existing outbox table ({notes}).\n\
         CREATE OR REPLACE FUNCTION {schema}.outbox_enqueue(\n    aggregate_type  text,\n    aggregate_id    text,\n    event_type      text,\n    payload         jsonb,\n    headers         jsonb DEFAULT NULL,\n    idempotency_key text  DEFAULT NULL) RETURNS text\n\
         LANGUAGE plpgsql VOLATILE AS $enqueue$\n#variable_conflict use_column\nDECLARE\n    key text;\nBEGIN\n{checks}\n    INSERT INTO {table} AS o ({columns})\n        VALUES ({values})\n        RETURNING o.{key_column}::text INTO key;\n    RETURN key;\nEND\n$enqueue$;\n",
        notes = plan.notes.join("; "),
        schema = quote_ident(&schema),
        checks = plan.checks.join("\n"),
        table = quote_qualified(&cfg.outbox.table),
        columns = plan.columns.join(", "),
        values = plan.values.join(", "),
        key_column = quote_ident(&key_column),
    );
    let note = format!(
        "outbox_enqueue() generated for the existing table: {}",
        plan.notes.join("; ")
    );
    Ok((sql, note))
}

/// Where the idempotency key goes (and comes back from): the `idempotency_key`
/// column, else the id, generated where the table has no default for it.
fn idempotency_key(
    c: &crate::config::Columns,
    existing: &Existing,
    uuid_v7: &str,
    plan: &mut Plan,
) -> std::result::Result<String, String> {
    let id = resolve(existing, &c.id, None);
    // An id without a default must be given by the function.
    let generated_id = |col: &Column, given: Option<&str>| -> std::result::Result<String, String> {
        let fallback = match col.type_name.as_str() {
            "uuid" => uuid_v7.to_owned(),
            "text" | "varchar" | "bpchar" => format!("{uuid_v7}::text"),
            other => {
                return Err(format!(
                    "the id column {:?} is of type {other} and has no default",
                    c.id
                ));
            }
        };
        Ok(match given {
            Some(param) if col.type_name == "uuid" => {
                format!("COALESCE({param}::uuid, {fallback})")
            }
            Some(param) => format!("COALESCE({param}, {fallback})"),
            None => fallback,
        })
    };
    if let Some((name, col)) = resolve(existing, &c.idempotency_key, None) {
        let value = if col.type_name == "uuid" {
            format!("COALESCE($6::uuid, {uuid_v7})")
        } else {
            format!("COALESCE($6, {uuid_v7}::text)")
        };
        plan.set(name, value);
        if let Some((id_name, id_col)) = id
            && !id_col.has_default
        {
            let value = generated_id(id_col, None)?;
            plan.set(id_name, value);
        }
        return Ok(name.to_owned());
    }
    let (id_name, id_col) = id.ok_or_else(|| {
        format!(
            "the table has neither an idempotency-key column {:?} nor an id column {:?}",
            c.idempotency_key, c.id
        )
    })?;
    plan.notes.push(format!(
        "no idempotency_key column: the id {id_name:?} is the key"
    ));
    if id_col.has_default {
        plan.refuse(
            "idempotency_key",
            6,
            "the id is the idempotency key and the table's default generates it",
        );
    } else {
        let value = generated_id(id_col, Some("$6"))?;
        plan.set(id_name, value);
    }
    Ok(id_name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::test_config as cfg;

    fn table(columns: &[(&str, &str, bool)]) -> Existing {
        Existing {
            columns: columns
                .iter()
                .map(|(name, ty, default)| {
                    (
                        (*name).to_owned(),
                        Column {
                            type_name: (*ty).to_owned(),
                            has_default: *default,
                        },
                    )
                })
                .collect(),
        }
    }

    fn debezium() -> Existing {
        table(&[
            ("id", "uuid", false),
            ("aggregatetype", "varchar", false),
            ("aggregateid", "varchar", false),
            ("type", "varchar", false),
            ("payload", "jsonb", false),
        ])
    }

    #[test]
    fn a_new_table_or_one_with_the_index_columns_runs_the_standard_sql() {
        let c = cfg("");
        assert_eq!(outbox_table(&c, None, "x").unwrap(), Step::Standard);
        let poller = table(&[
            ("id", "int8", true),
            ("created_at", "timestamptz", true),
            ("sent_at", "timestamptz", false),
        ]);
        assert_eq!(
            outbox_table(&c, Some(&poller), "x").unwrap(),
            Step::Standard
        );
        // A column configured as absent cannot be named in the CREATE TABLE.
        let no_topic = cfg("[outbox.columns]\ntopic = \"\"\n");
        let standard =
            "F;\nCREATE TABLE IF NOT EXISTS t (\"\" text);\nCREATE INDEX IF NOT EXISTS i;";
        let Step::Adapted { sql, .. } = outbox_table(&no_topic, Some(&poller), standard).unwrap()
        else {
            panic!("not adapted");
        };
        assert_eq!(sql, "F;\nCREATE INDEX IF NOT EXISTS i;");
    }

    #[test]
    fn a_table_without_the_index_columns_gets_only_the_function() {
        let c = cfg("[outbox]\npreset = \"debezium\"\n");
        let standard = "CREATE FUNCTION f();\nCREATE TABLE IF NOT EXISTS t ();\nCREATE INDEX i;";
        let Step::Adapted { sql, note } = outbox_table(&c, Some(&debezium()), standard).unwrap()
        else {
            panic!("not adapted");
        };
        assert_eq!(sql, "CREATE FUNCTION f();");
        assert!(
            note.contains("(configured as none)") && note.contains("\"sent_at\""),
            "{note}"
        );
        let err = outbox_table(&c, None, standard).unwrap_err();
        assert!(
            err.to_string()
                .contains("idempotency_key, topic, headers, created_at are empty"),
            "{err}"
        );
    }

    #[test]
    fn the_standard_helper_runs_on_the_standard_columns() {
        let ours = table(&[
            ("id", "uuid", true),
            ("idempotency_key", "text", true),
            ("aggregate_type", "text", false),
            ("aggregate_id", "text", false),
            ("event_type", "text", false),
            ("topic", "text", false),
            ("headers", "jsonb", false),
            ("payload", "jsonb", false),
            ("created_at", "timestamptz", true),
        ]);
        assert_eq!(enqueue(&cfg(""), Some(&ours)), Step::Standard);
        assert_eq!(enqueue(&cfg(""), None), Step::Standard);
    }

    #[test]
    fn debezium_gets_a_helper_that_generates_the_uuid_id() {
        let Step::Adapted { sql, .. } =
            enqueue(&cfg("[outbox]\npreset = \"debezium\"\n"), Some(&debezium()))
        else {
            panic!("not adapted");
        };
        assert!(
            sql.contains("(\"aggregatetype\", \"type\", \"aggregateid\", \"payload\", \"id\")"),
            "{sql}"
        );
        assert!(
            sql.contains("COALESCE($6::uuid, \"public\".outbox_relay_uuid_v7())"),
            "{sql}"
        );
        assert!(
            sql.contains("IF $5 IS NOT NULL"),
            "headers are refused, not dropped: {sql}"
        );
        assert!(sql.contains("RETURNING o.\"id\"::text"), "{sql}");
    }

    #[test]
    fn payload_types_are_cast_and_unusable_tables_skipped() {
        let c = cfg("[outbox.columns]\nheaders = \"\"\ntopic = \"\"\nidempotency_key = \"\"\n");
        let with_payload = |ty: &str, id: (&'static str, bool)| {
            table(&[
                ("id", id.0, id.1),
                ("aggregate_type", "text", false),
                ("aggregate_id", "text", false),
                ("event_type", "text", false),
                ("payload", ty, false),
            ])
        };
        for (ty, value) in [
            ("bytea", "convert_to($4::text, 'UTF8')"),
            ("text", "$4::text"),
            ("json", "$4::json"),
        ] {
            let Step::Adapted { sql, .. } = enqueue(&c, Some(&with_payload(ty, ("int8", true))))
            else {
                panic!("{ty}");
            };
            assert!(sql.contains(value), "{ty}: {sql}");
            assert!(
                sql.contains("IF $6 IS NOT NULL"),
                "a key cannot be chosen: {sql}"
            );
        }
        let Step::Skipped(why) = enqueue(&c, Some(&with_payload("jsonb", ("int8", false)))) else {
            panic!("an int8 id without a default cannot be generated");
        };
        assert!(why.contains("int8 and has no default"), "{why}");
        let Step::Adapted { sql, .. } = enqueue(&c, Some(&with_payload("jsonb", ("text", false))))
        else {
            panic!("text id");
        };
        assert!(
            sql.contains("COALESCE($6, \"public\".outbox_relay_uuid_v7()::text)"),
            "{sql}"
        );
    }
}
