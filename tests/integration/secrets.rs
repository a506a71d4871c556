//! The PostgreSQL password never reaches the output: the real binary is started with
//! URLs whose passwords hold each character that breaks a URL (`/ ? @ : #`), or are
//! percent-encoded, or badly encoded, in the user info and as a `password=`
//! parameter, against a closed port and against the real cluster with a wrong
//! password (cleartext, MD5 and SCRAM roles, over plain TCP so the server asks for
//! it). Logs run at `trace`, so every line the relay could print is checked.

use std::process::Output;

use outbox_relay::postgres::conninfo::{ConnInfo, Host};

use crate::harness;

/// Wrong passwords. Their letters occur nowhere else in the URLs or the output.
const SECRETS: &[&str] = &[
    "Kx7/Qz9",
    "Kx7?Qz9",
    "Kx7@Qz9",
    "Kx7:Qz9",
    "Kx7#Qz9",
    "Kx7/?@:#Qz9",
    "Kx7%2FQz9",
    "Kx7%3F%40%3A%23Qz9",
    "Kx7%zzQz9",
];

/// Host and port of the test cluster.
fn cluster() -> (String, u16) {
    let info = ConnInfo::parse(&harness::env().pg_url).expect("harness URL parses");
    match info.host() {
        Host::Tcp(h) => (h.clone(), info.port()),
        Host::Unix(p) => panic!("the test needs TCP, the harness uses {}", p.display()),
    }
}

/// A config whose URL each run replaces with `--set`; logs at `trace`.
fn config_file() -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("{}.toml", harness::unique("secrets")));
    std::fs::write(
        &path,
        "[postgres]\nurl = \"postgresql://postgres@127.0.0.1:1/postgres\"\n\
         [kafka]\nbrokers = \"127.0.0.1:1\"\n[log]\nlevel = \"trace\"\n",
    )
    .expect("write config");
    path
}

/// `outbox-relay status` with `url`; fails the test if the output shows `secret`
/// or a piece of it.
fn status_hides(config: &std::path::Path, url: &str, secret: &str) -> Output {
    let set = format!("postgres.url={url}");
    let out = harness::run_cli(&[
        "status",
        "--config",
        config.to_str().expect("utf-8 path"),
        "--set",
        &set,
    ]);
    let shown = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{url}: status succeeded: {shown}");
    assert!(!shown.trim().is_empty(), "{url}: no output at all");
    for piece in [secret, "Kx7", "Qz9"] {
        assert!(!shown.contains(piece), "{url}: {piece:?} shown:\n{shown}");
    }
    out
}

#[tokio::test]
async fn no_password_appears_in_any_output() {
    let config = config_file();
    let (host, port) = cluster();
    let mut refused = 0;
    let mut warned = 0;
    for secret in SECRETS {
        for (user, at) in [
            ("relay", "127.0.0.1:1".to_owned()),
            ("relay_password", format!("{host}:{port}")),
            ("relay_md5", format!("{host}:{port}")),
            ("relay_scram", format!("{host}:{port}")),
        ] {
            for url in [
                format!("postgresql://{user}:{secret}@{at}/postgres?sslmode=disable"),
                format!("postgresql://{user}@{at}/postgres?password={secret}&sslmode=disable"),
            ] {
                let out = tokio::task::spawn_blocking({
                    let config = config.clone();
                    move || status_hides(&config, &url, secret)
                })
                .await
                .expect("status run");
                let stderr = String::from_utf8_lossy(&out.stderr);
                if stderr.contains("password authentication failed") {
                    refused += 1;
                    assert_eq!(out.status.code(), Some(3), "{stderr}");
                }
                if stderr.contains("REPLICATION credential") {
                    warned += 1;
                }
            }
        }
    }
    let _ = std::fs::remove_file(&config);
    // The URLs that parse reached the server and were refused there, and each of
    // those runs warned that the password could travel in clear.
    assert!(
        refused >= 3 * 2 * 4,
        "only {refused} runs reached the server"
    );
    assert!(
        warned >= refused,
        "{warned} warnings for {refused} refusals"
    );
}
