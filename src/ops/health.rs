//! `outbox-relay health`: asks a running relay's `/healthz` (or `/readyz`) and exits
//! 0 on `200`, 1 otherwise.
//!
//! **Why a subcommand.** A container's health check runs a command inside the
//! container, and the runtime image is kept small: it has no `curl` or `wget`. The
//! relay's own binary is always there, so it is the probe. It speaks just enough
//! HTTP/1.1 for one `GET` to the relay's own endpoint (status line only) over a
//! plain socket, with a deadline, rather than pulling in an HTTP client crate.
//!
//! The address is `--addr`, else the config's `metrics.listen` (the same environment
//! the relay runs with, so the probe finds the port the relay bound); a wildcard bind
//! address (`0.0.0.0`, `[::]`) is probed on loopback.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::config::{Config, ConfigError};

/// Flags of `outbox-relay health`.
#[derive(Debug, Clone, clap::Args)]
pub struct HealthArgs {
    /// Ask `/readyz` (streaming and making progress) instead of `/healthz` (alive).
    #[arg(long)]
    pub ready: bool,
    /// `host:port` of the relay's endpoint; default: the config's `metrics.listen`.
    #[arg(long, value_name = "HOST:PORT")]
    pub addr: Option<String>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 3, value_name = "SECS")]
    pub timeout_secs: u64,
}

/// Why the probe did not get a `200`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HealthError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(
        "metrics.listen is empty: the relay serves no health endpoint (set it, or pass --addr)"
    )]
    NotServed,
    #[error("cannot reach {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("no answer from {addr} within {timeout:?}")]
    Timeout { addr: String, timeout: Duration },
    #[error("{path} on {addr} answered {status:?}")]
    Unhealthy {
        addr: String,
        path: &'static str,
        status: String,
    },
}

/// The address to probe: `--addr`, else `metrics.listen` (loaded only then).
pub fn target(
    args: &HealthArgs,
    config: impl FnOnce() -> Result<Config, ConfigError>,
) -> Result<String, HealthError> {
    let listen = match &args.addr {
        Some(addr) => addr.trim().to_owned(),
        None => config()?.metrics.listen.trim().to_owned(),
    };
    if listen.is_empty() {
        return Err(HealthError::NotServed);
    }
    Ok(loopback_for_wildcard(&listen))
}

/// `0.0.0.0:P` → `127.0.0.1:P` and `[::]:P` → `[::1]:P`: a wildcard is where a
/// server binds, not where a client connects.
fn loopback_for_wildcard(listen: &str) -> String {
    match listen.rsplit_once(':') {
        Some(("0.0.0.0", port)) => format!("127.0.0.1:{port}"),
        Some(("[::]", port)) => format!("[::1]:{port}"),
        _ => listen.to_owned(),
    }
}

/// One `GET` of `/healthz` (or `/readyz`) on `addr`; `Ok` with the status line when
/// it is `200`.
pub async fn probe(addr: &str, args: &HealthArgs) -> Result<String, HealthError> {
    let path = if args.ready { "/readyz" } else { "/healthz" };
    let timeout = Duration::from_secs(args.timeout_secs.max(1));
    let status = tokio::time::timeout(timeout, status_line(addr, path))
        .await
        .map_err(|_| HealthError::Timeout {
            addr: addr.to_owned(),
            timeout,
        })?
        .map_err(|source| HealthError::Connect {
            addr: addr.to_owned(),
            source,
        })?;
    if status.split_whitespace().nth(1) == Some("200") {
        Ok(status)
    } else {
        Err(HealthError::Unhealthy {
            addr: addr.to_owned(),
            path,
            status,
        })
    }
}

/// The status line of `GET path` (`HTTP/1.1 200 OK`), or empty on a closed socket.
async fn status_line(addr: &str, path: &str) -> std::io::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await?;
    // The status line is in the first bytes; the body (a few bytes) is not needed.
    let mut head = [0_u8; 256];
    let mut len = 0;
    loop {
        let n = stream.read(&mut head[len..]).await?;
        len += n;
        if n == 0 || len == head.len() || head[..len].contains(&b'\n') {
            break;
        }
    }
    let text = String::from_utf8_lossy(&head[..len]);
    Ok(text.lines().next().unwrap_or_default().trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdc::metrics::{Health, serve};
    use metrics_exporter_prometheus::PrometheusBuilder;

    fn args(ready: bool) -> HealthArgs {
        HealthArgs {
            ready,
            addr: None,
            timeout_secs: 2,
        }
    }

    #[test]
    fn wildcards_are_probed_on_loopback() {
        assert_eq!(loopback_for_wildcard("0.0.0.0:9187"), "127.0.0.1:9187");
        assert_eq!(loopback_for_wildcard("[::]:9187"), "[::1]:9187");
        assert_eq!(loopback_for_wildcard("10.0.0.5:9187"), "10.0.0.5:9187");
    }

    #[test]
    fn the_address_comes_from_the_flag_or_the_config() {
        let from_flag = HealthArgs {
            addr: Some("127.0.0.1:1".into()),
            ..args(false)
        };
        let unused = || -> Result<Config, ConfigError> { panic!("config loaded") };
        assert_eq!(target(&from_flag, unused).unwrap(), "127.0.0.1:1");
        let config = |listen: &'static str| {
            move || {
                Config::from_sources(
                    "test",
                    "[postgres]\nurl = \"postgresql://h/db\"\n[kafka]\nbrokers = \"k\"\n",
                    [("OUTBOX_RELAY__METRICS__LISTEN".into(), listen.into())],
                )
            }
        };
        assert_eq!(
            target(&args(false), config("0.0.0.0:9187")).unwrap(),
            "127.0.0.1:9187"
        );
        assert!(matches!(
            target(&args(false), config("")),
            Err(HealthError::NotServed)
        ));
    }

    /// The real endpoint: alive answers 200 on `/healthz` while `/readyz` is 503
    /// (not streaming); a closed port is an error, not a hang.
    #[tokio::test]
    async fn probes_the_relays_endpoint() {
        let handle = PrometheusBuilder::new().build_recorder().handle();
        let addr = serve(
            "127.0.0.1:0",
            handle,
            Health::default(),
            Duration::from_secs(60),
        )
        .await
        .unwrap()
        .to_string();
        assert_eq!(probe(&addr, &args(false)).await.unwrap(), "HTTP/1.1 200 OK");
        let err = probe(&addr, &args(true)).await.unwrap_err();
        assert!(err.to_string().contains("503"), "{err}");
        let closed = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().to_string()
        };
        assert!(matches!(
            probe(&closed, &args(false)).await,
            Err(HealthError::Connect { .. })
        ));
    }
}
