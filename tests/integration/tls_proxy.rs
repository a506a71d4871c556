//! Harness for the Kafka security tests: a throwaway PKI made with the `openssl`
//! command and a real TLS listener in front of a Tansu broker.
//!
//! Why a proxy: Tansu 0.6's own TLS listener is not usable here (its CLI refuses
//! `--cert` together with `--key`, and with a combined PEM a TLS client got no
//! metadata), so `stunnel` (Debian's `stunnel4`, installed by `scripts/dev-env`)
//! terminates TLS and forwards plain Kafka to the broker, which advertises the
//! proxy's address. To the relay it is a TLS broker like any other: the handshake,
//! the certificate checks (server name, CA) and, with `require_client_cert`, mutual
//! TLS are real OpenSSL on both sides. Keys and certificates are made per test,
//! never committed.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A CA, a server certificate for `127.0.0.1`/`localhost` signed by it, a client
/// certificate signed by it, and a second CA that signed nothing of the broker's.
#[derive(Debug)]
pub struct TestPki {
    dir: PathBuf,
}

impl TestPki {
    /// Makes every key and certificate in `dir`.
    pub fn create(dir: &Path) -> TestPki {
        std::fs::create_dir_all(dir).expect("pki dir");
        let pki = TestPki {
            dir: dir.to_path_buf(),
        };
        pki.self_signed("ca", "outbox-relay test CA");
        pki.self_signed("other-ca", "some other CA");
        pki.signed(
            "server",
            "127.0.0.1",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        );
        pki.signed("client", "relay", "extendedKeyUsage=clientAuth\n");
        pki
    }

    /// The file `name` of this PKI (`ca.crt`, `server.key`, …).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The path as a `&str` for a config value.
    pub fn file(&self, name: &str) -> String {
        self.path(name).to_str().expect("utf-8 path").to_owned()
    }

    fn openssl(&self, args: &[&str]) {
        let out = Command::new("openssl")
            .current_dir(&self.dir)
            .args(args)
            .output()
            .expect("the openssl command (Debian's openssl package) is needed");
        assert!(
            out.status.success(),
            "openssl {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn self_signed(&self, name: &str, cn: &str) {
        let (key, crt, subj) = (
            format!("{name}.key"),
            format!("{name}.crt"),
            format!("/CN={cn}"),
        );
        self.openssl(&[
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", &subj,
            "-keyout", &key, "-out", &crt,
        ]);
    }

    fn signed(&self, name: &str, cn: &str, extensions: &str) {
        let ext = format!("{name}.ext");
        std::fs::write(self.dir.join(&ext), extensions).expect("write extensions");
        let (key, csr, crt, subj) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.crt"),
            format!("/CN={cn}"),
        );
        self.openssl(&[
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", &subj, "-keyout", &key, "-out", &csr,
        ]);
        self.openssl(&[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &crt,
        ]);
    }
}

/// `stunnel` accepting TLS on a loopback port and forwarding to a plain port.
#[derive(Debug)]
pub struct TlsProxy {
    port: u16,
    child: Child,
}

impl TlsProxy {
    /// Listens on `port` with the PKI's server certificate and forwards to
    /// `target_port`. With `require_client_cert`, a client must present a
    /// certificate signed by the PKI's CA (mutual TLS).
    pub async fn start(
        pki: &TestPki,
        port: u16,
        target_port: u16,
        require_client_cert: bool,
    ) -> TlsProxy {
        let mut conf = format!(
            "foreground = yes\npid =\ndebug = 4\n[kafka]\naccept = 127.0.0.1:{port}\n\
             connect = 127.0.0.1:{target_port}\ncert = {}\nkey = {}\n",
            pki.file("server.crt"),
            pki.file("server.key"),
        );
        if require_client_cert {
            conf.push_str(&format!(
                "verifyChain = yes\nrequireCert = yes\nCAfile = {}\n",
                pki.file("ca.crt")
            ));
        }
        let conf_path = pki.path(&format!("stunnel-{port}.conf"));
        std::fs::write(&conf_path, conf).expect("write stunnel config");
        let log =
            std::fs::File::create(pki.path(&format!("stunnel-{port}.log"))).expect("stunnel log");
        let child = Command::new(stunnel_bin())
            .arg(&conf_path)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn stunnel (Debian's stunnel4; `scripts/dev-env up` installs it)");
        let proxy = TlsProxy { port, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(
                Instant::now() < deadline,
                "stunnel did not listen on {port}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        proxy
    }

    /// `host:port` of the TLS listener, for `bootstrap.servers`.
    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for TlsProxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Debian's binary is `stunnel4` (with `stunnel` as an alternative link).
fn stunnel_bin() -> &'static str {
    let found = |name: &str| {
        Command::new(name)
            .arg("-version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok()
    };
    if found("stunnel4") {
        "stunnel4"
    } else {
        "stunnel"
    }
}
