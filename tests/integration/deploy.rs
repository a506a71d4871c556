//! The deployment examples (`Dockerfile`, `deploy/kubernetes`, `deploy/systemd`) are
//! read by the real parsers that matter for them: the YAML by a YAML parser, the
//! command lines by the binary's own CLI parser, the environment by the config
//! loader, the unit by `systemd-analyze verify` where the machine has it; and the
//! probe paths are asked of the relay's real metrics server. An example that drifts
//! from the binary (a renamed flag, a misspelt key, a path the relay does not serve)
//! fails here. Whether the image builds is `scripts/container-check`'s job (CI).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use outbox_relay::cli::{Cli, Command};
use outbox_relay::config::Config;
use yaml_rust2::{Yaml, YamlLoader};

fn repo_file(path: &str) -> String {
    let full = Path::new(env!("CARGO_MANIFEST_DIR")).join(path);
    std::fs::read_to_string(&full).unwrap_or_else(|e| panic!("read {}: {e}", full.display()))
}

/// Parses a command line as the binary would (argv[0] first).
fn cli(args: &[&str]) -> Cli {
    Cli::try_parse_from(std::iter::once("outbox-relay").chain(args.iter().copied()))
        .unwrap_or_else(|e| panic!("the binary would refuse {args:?}: {e}"))
}

/// A config from environment pairs alone (no file), as a container gets it.
fn config_from_env(env: &BTreeMap<String, String>) -> Config {
    Config::from_sources("environment", "", env.clone())
        .unwrap_or_else(|e| panic!("the environment {env:?} is not a valid config: {e}"))
}

fn str_of<'a>(y: &'a Yaml, what: &str) -> &'a str {
    y.as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {y:?}"))
}

/// The port of a `host:port` listen address.
fn port_of(listen: &str) -> u16 {
    listen
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("{listen:?} has no port"))
}

/// Asks the relay's real endpoint for `path` and returns the status code.
async fn served_status(path: &str) -> String {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .build_recorder()
        .handle();
    let addr = outbox_relay::cdc::metrics::serve(
        "127.0.0.1:0",
        handle,
        outbox_relay::cdc::metrics::Health::default(),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    response
        .split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .to_owned()
}

/// The Dockerfile's instructions (continuations joined, comments dropped).
fn dockerfile() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in repo_file("Dockerfile").lines() {
        let line = line.trim();
        if line.starts_with('#') || (current.is_empty() && line.is_empty()) {
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            current.push_str(head);
            current.push(' ');
            continue;
        }
        current.push_str(line);
        let (keyword, args) = current.split_once(' ').unwrap_or((&current, ""));
        out.push((keyword.to_ascii_uppercase(), args.trim().to_owned()));
        current.clear();
    }
    out
}

/// The runtime stage: non-root, the relay as entry point with a command line the
/// binary accepts, a health check that is the binary's own probe of `/healthz` on
/// the port the image's environment makes the relay listen on, and an environment
/// that is a valid config once the two required keys are added.
#[tokio::test]
async fn the_image_runs_the_relay_as_non_root_with_its_own_health_check() {
    let instructions = dockerfile();
    let stages = instructions.iter().filter(|(k, _)| k == "FROM").count();
    assert!(stages >= 2, "multi-stage build");
    let last_from = instructions.iter().rposition(|(k, _)| k == "FROM").unwrap();
    let runtime = &instructions[last_from..];
    let get = |keyword: &str| -> Vec<&str> {
        runtime
            .iter()
            .filter(|(k, _)| k == keyword)
            .map(|(_, a)| a.as_str())
            .collect()
    };
    let user = get("USER");
    let user = user.last().expect("a USER in the runtime stage");
    assert!(!["root", "0", "0:0"].contains(user), "runs as {user}");

    let json = |text: &str| -> Vec<String> {
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not exec form {text:?}: {e}"))
    };
    let entrypoint = json(get("ENTRYPOINT")[0]);
    let cmd = json(get("CMD")[0]);
    assert_eq!(entrypoint, ["/usr/local/bin/outbox-relay"]);
    let cmd: Vec<&str> = cmd.iter().map(String::as_str).collect();
    assert!(matches!(cli(&cmd).command, Command::Run(_)));

    let healthcheck = get("HEALTHCHECK")[0];
    let probe = json(&healthcheck[healthcheck.find("CMD ").expect("CMD form") + 4..]);
    assert_eq!(probe[0], entrypoint[0]);
    let probe: Vec<&str> = probe[1..].iter().map(String::as_str).collect();
    let Command::Health { args, .. } = cli(&probe).command else {
        panic!("the health check is not `outbox-relay health`: {probe:?}");
    };
    assert!(!args.ready, "liveness is /healthz");
    assert_eq!(served_status("/healthz").await, "200");

    let mut env: BTreeMap<String, String> = BTreeMap::new();
    for line in get("ENV") {
        for pair in line.split_whitespace() {
            let (name, value) = pair.split_once('=').expect("ENV name=value");
            env.insert(name.to_owned(), value.to_owned());
        }
    }
    env.insert(
        "OUTBOX_RELAY__POSTGRES__URL".into(),
        "postgresql://h/db".into(),
    );
    env.insert("OUTBOX_RELAY__KAFKA__BROKERS".into(), "k:9092".into());
    let config = config_from_env(&env);
    let port = port_of(&config.metrics.listen);
    assert_eq!(port_of(args.addr.as_deref().expect("--addr")), port);
    assert_eq!(get("EXPOSE"), [port.to_string().as_str()]);
}

/// The Kubernetes example: a Secret and a Deployment of 2 replicas, one active
/// (the standby waits for the slot), configured by environment alone with the URL
/// from the Secret, probes on paths the relay serves, non-root as in the image.
#[tokio::test]
async fn the_kubernetes_example_is_two_replicas_one_active_configured_by_env() {
    let docs = YamlLoader::load_from_str(&repo_file("deploy/kubernetes/outbox-relay.yaml"))
        .expect("valid YAML");
    let kind = |k: &str| {
        docs.iter()
            .find(|d| d["kind"].as_str() == Some(k))
            .unwrap_or_else(|| panic!("no {k} in the example"))
    };
    let (secret, deployment) = (kind("Secret"), kind("Deployment"));
    let spec = &deployment["spec"];
    assert_eq!(spec["replicas"].as_i64(), Some(2));
    assert_eq!(spec["strategy"]["type"].as_str(), Some("Recreate"));
    let pod = &spec["template"]["spec"];
    let labels = &spec["template"]["metadata"]["labels"];
    for (k, v) in spec["selector"]["matchLabels"].as_hash().expect("selector") {
        assert_eq!(&labels[str_of(k, "label")], v, "selector matches the pod");
    }
    let container = &pod["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_vec()
        .expect("args")
        .iter()
        .map(|a| str_of(a, "arg"))
        .collect();
    assert!(matches!(cli(&args).command, Command::Run(_)));

    // The environment, with the Secret's value where the manifest refers to it.
    let mut env = BTreeMap::new();
    let mut from_secret = Vec::new();
    for var in container["env"].as_vec().expect("env") {
        let name = str_of(&var["name"], "env name").to_owned();
        let value = match var["value"].as_str() {
            Some(v) => v.to_owned(),
            None => {
                let key = &var["valueFrom"]["secretKeyRef"];
                assert_eq!(key["name"], secret["metadata"]["name"], "{name}");
                from_secret.push(name.clone());
                str_of(&secret["stringData"][str_of(&key["key"], "key")], "secret").to_owned()
            }
        };
        env.insert(name, value);
    }
    assert_eq!(
        from_secret,
        ["OUTBOX_RELAY__POSTGRES__URL"],
        "the password is in the Secret only"
    );
    let config = config_from_env(&env);
    assert!(
        config.relay.slot_busy_timeout_secs >= 86_400,
        "the second replica is a standby, not a crash loop"
    );
    let grace = pod["terminationGracePeriodSeconds"]
        .as_i64()
        .expect("grace period");
    assert!(
        u64::try_from(grace).unwrap() > config.relay.shutdown_timeout_secs,
        "SIGTERM drains before the kill"
    );

    let ports = container["ports"].as_vec().expect("ports");
    for (probe, path, status) in [
        ("livenessProbe", "/healthz", "200"),
        // Not streaming yet: 503, a path the relay serves (not 404).
        ("readinessProbe", "/readyz", "503"),
    ] {
        let get = &container[probe]["httpGet"];
        assert_eq!(get["path"].as_str(), Some(path), "{probe}");
        let port = ports
            .iter()
            .find(|p| p["name"] == get["port"])
            .unwrap_or_else(|| panic!("{probe} names no declared port"));
        let port = u16::try_from(port["containerPort"].as_i64().unwrap()).unwrap();
        assert_eq!(port, port_of(&config.metrics.listen), "{probe} port");
        assert_eq!(served_status(path).await, status, "{path}");
    }
    assert!(
        config.metrics.listen.starts_with("0.0.0.0:"),
        "the kubelet reaches the pod IP"
    );

    let uid = pod["securityContext"]["runAsUser"]
        .as_i64()
        .expect("runAsUser");
    let image_user = dockerfile()
        .into_iter()
        .rfind(|(k, _)| k == "USER")
        .unwrap()
        .1;
    assert_eq!(image_user.split(':').next(), Some(uid.to_string().as_str()));
    assert_eq!(pod["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
}

/// The unit's `[Section]` → key → values (a key may repeat, e.g. `Environment=`).
fn unit_file(text: &str) -> BTreeMap<String, BTreeMap<String, Vec<String>>> {
    let mut sections: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    let mut current = None;
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            current = Some(name.to_owned());
            sections.entry(name.to_owned()).or_default();
            continue;
        }
        let section = current
            .clone()
            .unwrap_or_else(|| panic!("line {}: a key before any section", n + 1));
        let (key, value) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("line {}: not key=value: {line}", n + 1));
        sections
            .entry(section)
            .or_default()
            .entry(key.trim().to_owned())
            .or_default()
            .push(value.trim().to_owned());
    }
    sections
}

/// The systemd unit: its `ExecStart` is a command line the binary accepts, its
/// `Environment=` lines with the example config are a valid config, it does not
/// restart on a configuration error (exit 2), it gives the drain time to stop, and
/// `systemd-analyze verify` finds nothing to say about it.
#[test]
fn the_systemd_unit_runs_the_relay_and_verifies() {
    let text = repo_file("deploy/systemd/outbox-relay.service");
    let unit = unit_file(&text);
    let service = &unit["Service"];
    let one = |key: &str| -> &str {
        match service.get(key).map(Vec::as_slice) {
            Some([value]) => value,
            other => panic!("[Service] {key}: expected one value, got {other:?}"),
        }
    };
    let exec: Vec<&str> = one("ExecStart").split_whitespace().collect();
    assert_eq!(exec[0], "/usr/local/bin/outbox-relay");
    let Command::Run(args) = cli(&exec[1..]).command else {
        panic!("ExecStart does not run the relay: {exec:?}");
    };
    let config_file = args.config.expect("the unit names its config file");
    assert_eq!(config_file, PathBuf::from("/etc/outbox-relay/relay.toml"));

    let env = service["Environment"].iter().map(|assignment| {
        let (name, value) = assignment.split_once('=').expect("NAME=value");
        (name.to_owned(), value.to_owned())
    });
    let config = Config::from_sources(
        "config/relay.example.toml",
        &repo_file("config/relay.example.toml"),
        env,
    )
    .unwrap_or_else(|e| panic!("the unit's environment is not valid: {e}"));
    assert!(
        config.relay.slot_busy_timeout_secs >= 86_400,
        "a second host is a standby"
    );
    assert_eq!(one("RestartPreventExitStatus"), "2");
    let stop = one("TimeoutStopSec").trim_end_matches('s');
    assert!(stop.parse::<u64>().unwrap() > config.relay.shutdown_timeout_secs);
    assert_eq!(unit["Install"]["WantedBy"], ["multi-user.target"]);

    systemd_verify(&text);
}

/// `systemd-analyze verify` on the unit, pointed at this build's binary (verify
/// checks that ExecStart exists) and with the secrets file optional. Its warnings
/// (an unknown key, a bad value) fail the test. Machines without systemd's tools
/// skip this part, saying so.
fn systemd_verify(text: &str) {
    let available = std::process::Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !available {
        eprintln!("systemd-analyze not found: the unit was checked by the parser only");
        return;
    }
    let dir = std::env::temp_dir().join(crate::harness::unique("systemd_unit"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("outbox-relay.service");
    let local = text
        .replace(
            "/usr/local/bin/outbox-relay",
            env!("CARGO_BIN_EXE_outbox-relay"),
        )
        .replace("EnvironmentFile=/", "EnvironmentFile=-/");
    std::fs::write(&path, local).unwrap();
    let out = std::process::Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("run systemd-analyze");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success() && stderr.trim().is_empty(),
        "systemd-analyze verify: {stderr}"
    );
}
