//! `outbox-relay check` and the same checks at the start of `run`, against real
//! PostgreSQL clusters (a private one per test, so that its settings can be broken)
//! and the real broker.
//!
//! The misconfigured deploy breaks one thing per check: `wal_level = replica`,
//! `max_replication_slots = 1` with that one slot taken, `max_wal_senders = 0`, a
//! role without `REPLICATION` and without `INSERT` on the poison table, a
//! publication with `publish = 'update'`, a migration not applied, and a topic
//! that does not exist (or, in a second run, no broker at all). One `check --json`
//! must name every one of them; `run` must name the PostgreSQL ones in one error.

use std::time::Duration;

use crate::harness::{self, PrivateCluster, RelayProcess, TestDb};

/// The broken deploy of the module doc: the cluster, the test database, and the
/// `--set` overrides that point the relay at it as the weak role.
async fn misconfigured() -> (PrivateCluster, TestDb, Vec<String>) {
    let cluster = PrivateCluster::start("replica").await;
    let admin = harness::connect(&cluster.url).await;
    // One statement each: ALTER SYSTEM refuses to run in a (multi-statement) block.
    for setting in ["max_replication_slots = 1", "max_wal_senders = 0"] {
        admin
            .batch_execute(&format!("ALTER SYSTEM SET {setting}"))
            .await
            .expect("alter system");
    }
    drop(admin);
    cluster.restart("fast").await;
    let admin = harness::connect(&cluster.url).await;
    admin
        .execute(
            "SELECT pg_create_physical_replication_slot('someone_elses')",
            &[],
        )
        .await
        .expect("take the only slot");
    let db = TestDb::create_in(&cluster.url, "check_bad", 1, "").await;
    let role = harness::unique("weak");
    db.client
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN;
             GRANT SELECT ON outbox TO {role};
             GRANT SELECT ON poison_outbox TO {role};
             GRANT SELECT, INSERT, UPDATE ON outbox_relay_position, outbox_relay_cutover,
                   outbox_relay_parked_key TO {role};
             GRANT SELECT ON outbox_relay_migrations TO {role};
             ALTER PUBLICATION outbox_relay_pub SET (publish = 'update');
             DELETE FROM outbox_relay_migrations WHERE version = 9;"
        ))
        .await
        .expect("break the role, the publication and the migrations");
    let url = db.url.replacen("://postgres@", &format!("://{role}@"), 1);
    assert_ne!(url, db.url, "test URLs name the postgres user");
    let sets = vec![
        format!("postgres.url={url}"),
        format!("kafka.topic_template={}.nowhere", db.name),
    ];
    (cluster, db, sets)
}

/// Runs the CLI with `--config` and `--set`s; returns exit code, stdout, stderr.
fn cli(command: &[&str], db: &TestDb, sets: &[String]) -> (Option<i32>, String, String) {
    let mut args: Vec<&str> = command.to_vec();
    args.extend(["--config", db.config_path.to_str().expect("utf-8 path")]);
    for set in sets {
        args.extend(["--set", set.as_str()]);
    }
    let out = harness::run_cli(&args);
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The `check --json` document, and `name → (status, detail, fix)`.
fn checks(stdout: &str) -> (serde_json::Value, Vec<(String, String, String, String)>) {
    let doc: serde_json::Value = serde_json::from_str(stdout.trim())
        .unwrap_or_else(|e| panic!("check --json printed no JSON ({e}): {stdout}"));
    let list = doc["checks"]
        .as_array()
        .unwrap_or_else(|| panic!("no checks array: {doc}"))
        .iter()
        .map(|c| {
            let field = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
            (
                field("name"),
                field("status"),
                field("detail"),
                field("fix"),
            )
        })
        .collect();
    (doc, list)
}

fn find<'a>(
    list: &'a [(String, String, String, String)],
    name: &str,
) -> &'a (String, String, String, String) {
    list.iter()
        .find(|c| c.0 == name)
        .unwrap_or_else(|| panic!("no check {name} in {list:#?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_every_problem_of_a_misconfigured_deploy_in_one_run() {
    let (cluster, db, sets) = misconfigured().await;
    let (code, stdout, stderr) = cli(&["check", "--json"], &db, &sets);
    eprintln!("check --json (misconfigured):\n{stdout}");
    assert_eq!(code, Some(3), "first problem is PostgreSQL's; {stderr}");
    let (doc, list) = checks(&stdout);
    assert_eq!(doc["ready"], false);
    let expect = [
        ("postgres.wal_level", "wal_level is 'replica'"),
        (
            "postgres.replication_slots",
            "1 of max_replication_slots = 1",
        ),
        ("postgres.wal_senders", "max_wal_senders = 0"),
        ("postgres.role", "neither REPLICATION nor superuser"),
        (
            "postgres.privileges",
            "INSERT on \"public\".\"poison_outbox\"",
        ),
        (
            "postgres.publication",
            "publish = 'update' leaves out insert",
        ),
        ("postgres.migrations", "not applied: 0009_parked_keys"),
        ("kafka.topics", "missing: "),
    ];
    for (name, says) in expect {
        let (_, status, detail, fix) = find(&list, name);
        assert_eq!(status, "problem", "{name}: {detail}");
        assert!(detail.contains(says), "{name}: {detail:?} lacks {says:?}");
        assert!(!fix.is_empty(), "{name} has no fix");
    }
    let checked = list.len();
    let problems = list.iter().filter(|c| c.1 == "problem").count();
    assert_eq!(problems, expect.len(), "{list:#?}");
    // Everything else was still checked, and is fine.
    for name in ["config", "postgres.connection", "kafka.broker"] {
        assert_eq!(find(&list, name).1, "ok", "{list:#?}");
    }

    // No broker at all: the broker's problem joins the same PostgreSQL ones (the
    // topics cannot be listed without it, so that check is left out).
    let mut no_broker = sets.clone();
    no_broker.push(format!("kafka.brokers=127.0.0.1:{}", harness::free_port()));
    let (code, stdout, _) = cli(&["check", "--json"], &db, &no_broker);
    assert_eq!(code, Some(3));
    let (_, list) = checks(&stdout);
    assert_eq!(find(&list, "kafka.broker").1, "problem", "{list:#?}");
    assert!(list.iter().all(|c| c.0 != "kafka.topics"), "{list:#?}");
    assert_eq!(
        list.iter().filter(|c| c.1 == "problem").count(),
        expect.len(),
        "7 PostgreSQL problems and the broker: {list:#?}"
    );

    // The text form: one line per check, each problem with its fix.
    let (code, text, _) = cli(&["check"], &db, &sets);
    assert_eq!(code, Some(3));
    assert_eq!(text.lines().count(), checked + 1, "{text}");
    assert!(
        text.lines()
            .filter(|l| l.starts_with("problem"))
            .all(|l| l.contains(" -- fix: ")),
        "{text}"
    );
    assert!(text.contains("\nnot ready: 8 problems, "), "{text}");
    cluster.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_names_every_failing_check_at_once() {
    let (cluster, db, sets) = misconfigured().await;
    let (code, _, stderr) = cli(&["run"], &db, &sets);
    assert_eq!(code, Some(3), "{stderr}");
    assert!(
        stderr.contains("not ready to run: 6 checks failed"),
        "{stderr}"
    );
    for name in [
        "postgres.wal_level",
        "postgres.replication_slots",
        "postgres.wal_senders",
        "postgres.role",
        "postgres.privileges",
        "postgres.publication",
    ] {
        assert!(stderr.contains(&format!("  {name}: ")), "{name}: {stderr}");
    }
    // Unrecorded migrations do not stop `run` (it checks the tables it uses
    // itself): a warning.
    assert!(!stderr.contains("  postgres.migrations: "), "{stderr}");
    assert!(
        stderr.contains("postgres.migrations"),
        "the warning is logged: {stderr}"
    );
    // A missing topic does not stop `run` (its events wait): it is a warning.
    assert!(!stderr.contains("  kafka.topics: "), "{stderr}");
    assert!(
        stderr.contains("kafka.topics"),
        "the warning is logged: {stderr}"
    );
    // Nothing was created.
    let slots: i64 = harness::connect(&cluster.url)
        .await
        .query_one("SELECT count(*) FROM pg_replication_slots", &[])
        .await
        .expect("count slots")
        .get(0);
    assert_eq!(slots, 1, "only the slot the test took");
    cluster.stop();
}

/// A deploy done right: `check` says ok to every check and exits 0, and `run`
/// starts on it, its start-up checks taking a few milliseconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_on_a_good_deploy_is_all_ok_and_run_starts() {
    let cluster = PrivateCluster::start("logical").await;
    let admin = harness::connect(&cluster.url).await;
    for sql in [
        "ALTER SYSTEM SET max_slot_wal_keep_size = '1GB'",
        "SELECT pg_reload_conf()",
    ] {
        admin
            .batch_execute(sql)
            .await
            .expect("bound the slot's WAL");
    }
    let mut db = TestDb::create_in(&cluster.url, "check_good", 1, "").await;
    let url = format!(
        "{}?sslmode=verify-full&sslrootcert={}",
        db.url,
        cluster.ca_file().display()
    );
    let sets = vec![format!("postgres.url={url}")];
    let (code, stdout, stderr) = cli(&["check", "--json"], &db, &sets);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let (doc, list) = checks(&stdout);
    assert_eq!(doc["ready"], true);
    assert_eq!(list.len(), 16, "{list:#?}");
    assert!(
        find(&list, "kafka.delivery").2.starts_with("at-least-once"),
        "{list:#?}"
    );
    for (name, status, detail, _) in &list {
        assert_eq!(status, "ok", "{name}: {detail}");
    }
    let (code, text, _) = cli(&["check"], &db, &sets);
    assert_eq!(code, Some(0));
    assert!(text.ends_with("ready to run (0 warnings)\n"), "{text}");

    let relay = RelayProcess::start(
        &db.config_path,
        &[("OUTBOX_RELAY__POSTGRES__URL", url.as_str())],
    );
    db.wait_streaming(&relay).await;
    let took = relay
        .log()
        .lines()
        .find(|l| l.contains("start-up checks passed"))
        .map(str::to_owned)
        .unwrap_or_else(|| panic!("no start-up checks line:\n{}", relay.log()));
    eprintln!("run: {took}");
    db.insert_event("e1", "Created", r#"{"n": 1}"#).await;
    harness::consume_exactly(&db.topic, 1, Duration::from_secs(60), &relay).await;
    relay.terminate(Duration::from_secs(30)).await;
    db.drop_slot().await;
    cluster.stop();
}

/// A table left in the publication after its outbox was taken out of the config
/// (here: added as an outbox would be, never named in this config). The relay
/// would decode its rows, skip them and confirm past them: every one lost. `check`
/// names the table and both fixes; `run` refuses to start with the prerequisite
/// exit code and creates nothing; once the table is out of the publication both
/// are fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_published_table_no_outbox_names_stops_run() {
    let db = TestDb::create("check_unserved").await;
    db.client
        .batch_execute(
            "CREATE TABLE public.retired_outbox (LIKE public.outbox INCLUDING ALL);
             ALTER PUBLICATION outbox_relay_pub ADD TABLE public.retired_outbox;",
        )
        .await
        .expect("publish a table the config does not name");

    let (code, stdout, stderr) = cli(&["check", "--json"], &db, &[]);
    let (_, list) = checks(&stdout);
    let (_, status, detail, fix) = find(&list, "postgres.publication");
    assert_eq!(
        status, "problem",
        "a published table no outbox names is not reported: {detail}"
    );
    assert!(detail.contains("public.retired_outbox"), "{detail}");
    assert!(
        fix.contains(
            "ALTER PUBLICATION \"outbox_relay_pub\" DROP TABLE \"public\".\"retired_outbox\""
        ),
        "{fix}"
    );
    assert!(fix.contains("[[outbox]]"), "{fix}");
    assert_eq!(code, Some(3), "{stdout}\n{stderr}");

    let mut relay = RelayProcess::start(&db.config_path, &[]);
    let status = relay.wait(Duration::from_secs(60)).await;
    let log = relay.log();
    assert_eq!(status.code(), Some(3), "{log}");
    assert!(
        log.contains("postgres.publication: ") && log.contains("public.retired_outbox"),
        "{log}"
    );
    assert!(!db.slot_exists().await, "run created its slot: {log}");

    db.client
        .batch_execute("ALTER PUBLICATION outbox_relay_pub DROP TABLE public.retired_outbox")
        .await
        .expect("drop the table from the publication");
    let (_, stdout, _) = cli(&["check", "--json"], &db, &[]);
    let (_, list) = checks(&stdout);
    let (_, status, detail, _) = find(&list, "postgres.publication");
    assert_eq!(status, "ok", "{detail}");
}
