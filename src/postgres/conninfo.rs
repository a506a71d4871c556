//! libpq-style connection URLs, shared by the metadata and the replication connection.
//!
//! The relay is configured with one URL (`postgres.url`) in the form libpq and `psql`
//! accept (<https://www.postgresql.org/docs/current/libpq-connect.html#LIBPQ-CONNSTRING-URIS>):
//!
//! ```text
//! postgresql://user:password@host:port/dbname?sslmode=verify-full&sslrootcert=/path/ca.crt
//! ```
//!
//! [`ConnInfo::parse`] turns it into a typed value that both connections use, so the
//! metadata connection ([`ConnInfo::tokio_postgres_config`],
//! [`connect_metadata`](super::connect_metadata)) and
//! the hand-written replication connection
//! ([`ReplicationConnection::connect`](super::replication::ReplicationConnection::connect))
//! can never disagree about where to connect or how to secure it.
//!
//! Supported:
//! - schemes `postgresql://` and `postgres://`; percent-decoding of every component;
//! - one host: a name, an IPv4 address, a bracketed IPv6 address (`[::1]`), or a Unix
//!   socket directory (a host starting with `/`, e.g. `?host=/var/run/postgresql`);
//! - query parameters `host`, `hostaddr`, `port`, `user`, `password`, `dbname`,
//!   `sslmode`, `sslrootcert`, `channel_binding`, `application_name`,
//!   `connect_timeout`, `keepalives`, `keepalives_idle`, `keepalives_interval`,
//!   `keepalives_count`, `tcp_user_timeout` and `options`. As in libpq, `hostaddr`
//!   is the IP address to connect to while `host` stays the name the server
//!   certificate is checked against.
//!
//! Differences from libpq, all in the direction of failing loudly:
//! - unknown parameters, several hosts, `sslmode=allow` and client certificates are
//!   rejected with a [`ConnInfoError`] instead of being ignored;
//! - a missing host means `localhost` over TCP (libpq uses the default Unix socket);
//! - a missing user is taken from `PGUSER`, else the operating-system user (`USER`,
//!   `LOGNAME`), as libpq, else `postgres`; no other `PG*` variable is read;
//! - `verify-ca`/`verify-full` without `sslrootcert` (or with `sslrootcert=system`)
//!   verify against the operating system's trust store (libpq reads
//!   `~/.postgresql/root.crt`);
//! - a `?` in the password must be percent-encoded like a `/` (libpq tolerates it),
//!   and an `@` in the database name as `%40` (else `relay:12/ab@db/app`, a password
//!   with a `/`, would be taken for host `relay`, port 12 and database `ab@db/app`,
//!   and `relay:@/ab@db/app` for an empty password and database `ab@db/app`).
//!
//! Three defaults differ from libpq's, because a relay runs unattended: the
//! `connect_timeout` is [`DEFAULT_CONNECT_TIMEOUT`] (libpq waits as long as the
//! kernel does), TCP keepalives probe after 30 s of silence, every 10 s, 3 times
//! ([`Keepalives`]; libpq keeps the system's two hours), and `tcp_user_timeout` is
//! [`DEFAULT_TCP_USER_TIMEOUT`] (libpq keeps the system's ~15 minutes of
//! retransmissions), so a half-open connection fails within about a minute, idle or
//! not, instead of hanging a writer for hours. They apply to the metadata and the
//! replication connection alike.
//!
//! # The password
//!
//! It is never printed: [`ConnInfo`]'s `Debug` and `Display` leave it out, and no
//! [`ConnInfoError`] contains it or any part of it, even when it is what breaks the
//! URL (see [`ConnInfo::parse`]). [`ConnInfo::may_send_password_in_clear`] tells
//! when the connection could expose it to an active attacker.

use std::fmt;
use std::net::IpAddr;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use crate::config::redact_url;

/// Default `application_name`, visible in `pg_stat_activity` and `pg_stat_replication`.
pub const DEFAULT_APPLICATION_NAME: &str = "outbox-relay";

/// Default server port.
pub const DEFAULT_PORT: u16 = 5432;

/// How (and whether) the connection is encrypted and the server authenticated.
///
/// The same semantics as libpq's `sslmode`
/// (<https://www.postgresql.org/docs/current/libpq-ssl.html#LIBPQ-SSL-PROTECTION>):
///
/// | mode | encrypted | certificate chain checked | host name checked |
/// |---|---|---|---|
/// | `disable` | no | no | no |
/// | `prefer` (default) | if the server supports it | no | no |
/// | `require` | yes | no (yes when `sslrootcert` is given, as libpq) | no |
/// | `verify-ca` | yes | yes | no |
/// | `verify-full` | yes | yes | yes |
///
/// TLS is never used on Unix-domain sockets (as libpq).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Plain TCP only.
    Disable,
    /// Try TLS; continue unencrypted if the server answers the `SSLRequest` with `N`.
    #[default]
    Prefer,
    /// TLS or nothing; the certificate is not verified (unless `sslrootcert` is set).
    Require,
    /// TLS; the certificate must chain to a trusted root; any host name.
    VerifyCa,
    /// TLS; the certificate must chain to a trusted root and name the host.
    VerifyFull,
}

impl SslMode {
    /// The libpq spelling.
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// True when a server without TLS must be refused.
    #[must_use]
    pub const fn requires_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SslMode {
    type Err = ConnInfoError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "disable" => Ok(SslMode::Disable),
            "prefer" => Ok(SslMode::Prefer),
            "require" => Ok(SslMode::Require),
            "verify-ca" => Ok(SslMode::VerifyCa),
            "verify-full" => Ok(SslMode::VerifyFull),
            "allow" => Err(ConnInfoError::new(
                "sslmode=allow is not supported: use prefer, require or disable",
            )),
            other => Err(ConnInfoError::new(format!(
                "invalid sslmode {other:?}: expected disable, prefer, require, verify-ca or verify-full"
            ))),
        }
    }
}

/// Whether SCRAM channel binding (`SCRAM-SHA-256-PLUS`, `tls-server-end-point`) is used.
///
/// libpq's `channel_binding`: with `prefer` (default) it is used when the connection
/// is encrypted and the server offers it; `require` refuses to authenticate without
/// it (which also rules out `trust`, `password` and `md5`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChannelBindingMode {
    /// Never use channel binding.
    Disable,
    /// Use it when possible.
    #[default]
    Prefer,
    /// Fail unless the server authenticates with channel binding.
    Require,
}

impl FromStr for ChannelBindingMode {
    type Err = ConnInfoError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "disable" => Ok(ChannelBindingMode::Disable),
            "prefer" => Ok(ChannelBindingMode::Prefer),
            "require" => Ok(ChannelBindingMode::Require),
            other => Err(ConnInfoError::new(format!(
                "invalid channel_binding {other:?}: expected disable, prefer or require"
            ))),
        }
    }
}

/// Where the server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    /// A host name or IP address literal, reached over TCP; also the name the server
    /// certificate is checked against under `verify-full`.
    Tcp(String),
    /// A directory holding the server's Unix-domain socket (`.s.PGSQL.<port>`).
    Unix(PathBuf),
}

impl fmt::Display for Host {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Host::Tcp(h) if h.contains(':') => write!(f, "[{h}]"),
            Host::Tcp(h) => f.write_str(h),
            Host::Unix(p) => write!(f, "{}", p.display()),
        }
    }
}

/// Which certificate authorities are trusted under `verify-ca`/`verify-full`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCerts {
    /// A PEM file with one or more CA certificates (`sslrootcert=/path`).
    File(PathBuf),
    /// The operating system's trust store (`sslrootcert=system`, or no `sslrootcert`).
    System,
}

/// `connect_timeout` when the URL gives none: ample for TCP, TLS and SCRAM over a
/// slow link, short enough that an unreachable server is reported (and retried)
/// within seconds rather than after the kernel's TCP timeout of minutes.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// `tcp_user_timeout` when the URL gives none: how long sent data may stay
/// unacknowledged before the kernel drops the connection. Keepalive probes run only
/// on an idle connection, and the replication connection is never idle from the
/// kernel's view (the relay sends a status update every few seconds), so without it
/// a server that stops answering (a silent network partition) would keep the
/// connection open for the kernel's ~15 minutes of retransmissions. The same
/// minute as [`Keepalives::default`].
pub const DEFAULT_TCP_USER_TIMEOUT: Duration = Duration::from_secs(60);

/// TCP keepalive probes (libpq's `keepalives_idle`, `keepalives_interval`,
/// `keepalives_count`).
///
/// A peer that vanishes without a FIN or RST (a crashed host, a dropped NAT or
/// firewall entry) leaves a half-open connection: a client waiting for an answer
/// waits until the kernel's keepalive gives up, two hours and more by default. With
/// [`Keepalives::default`] a silent peer is dropped after 30 s + 3 × 10 s. `None`
/// keeps the system's default for that setting (libpq's `0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalives {
    /// Idle time before the first probe (`keepalives_idle`).
    pub idle: Option<Duration>,
    /// Time between unanswered probes (`keepalives_interval`).
    pub interval: Option<Duration>,
    /// Unanswered probes before the connection is dropped (`keepalives_count`).
    pub count: Option<u32>,
}

impl Default for Keepalives {
    fn default() -> Self {
        Keepalives {
            idle: Some(Duration::from_secs(30)),
            interval: Some(Duration::from_secs(10)),
            count: Some(3),
        }
    }
}

/// A parsed connection URL. `Debug` and `Display` never show the password.
#[derive(Clone, PartialEq, Eq)]
pub struct ConnInfo {
    host: Host,
    hostaddr: Option<IpAddr>,
    port: u16,
    user: String,
    password: Option<String>,
    dbname: String,
    sslmode: SslMode,
    sslrootcert: Option<RootCerts>,
    channel_binding: ChannelBindingMode,
    application_name: String,
    connect_timeout: Option<Duration>,
    keepalives: Option<Keepalives>,
    tcp_user_timeout: Option<Duration>,
    options: Option<String>,
}

/// Why a connection URL was rejected. The message never contains the password, nor
/// any part of it (see [`ConnInfo::parse`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid PostgreSQL connection URL: {message}")]
pub struct ConnInfoError {
    message: String,
}

impl ConnInfoError {
    fn new(message: impl Into<String>) -> Self {
        ConnInfoError {
            message: message.into(),
        }
    }

    /// What is wrong, without the "invalid PostgreSQL connection URL" prefix.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// The error for a URL that parses once its password is hidden: the password itself
/// breaks it, so it is named but not shown.
const UNPARSABLE_PASSWORD: &str = "the password (not shown) cannot be parsed: \
     percent-encode '/', '?', '&' and '%' in it (as %2F, %3F, %26 and %25)";

impl ConnInfo {
    /// Parses a `postgresql://` (or `postgres://`) URL.
    ///
    /// No error contains the password or a piece of it. That takes more than
    /// leaving the password out of the messages: an unencoded `/` or `?` in it
    /// ends the user info early, and its halves would then be quoted as a host, a
    /// port or a query parameter. So when the URL has a password-like part (see
    /// [`redact_url`]), the error is computed from the redacted URL instead, and if
    /// that one parses, the password is what breaks it and the error says so without
    /// showing it.
    ///
    /// # Errors
    ///
    /// [`ConnInfoError`] for another scheme, bad percent-encoding, a bad port,
    /// several hosts, an unknown or invalid query parameter.
    pub fn parse(url: &str) -> Result<ConnInfo, ConnInfoError> {
        parse_revealing(url).map_err(|err| without_secrets(url, err))
    }

    /// The host to connect to (and, over TCP, to check the certificate against).
    #[must_use]
    pub fn host(&self) -> &Host {
        &self.host
    }

    /// `hostaddr`: the IP address to connect to instead of resolving [`Self::host`].
    #[must_use]
    pub fn hostaddr(&self) -> Option<IpAddr> {
        self.hostaddr
    }

    /// The TCP port (or the Unix socket's number).
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The role to log in as.
    #[must_use]
    pub fn user(&self) -> &str {
        &self.user
    }

    /// The password, if one was given. Handle with care: never log it.
    #[must_use]
    pub fn password(&self) -> Option<&str> {
        self.password.as_deref()
    }

    /// The database (defaults to the user name, as libpq).
    #[must_use]
    pub fn dbname(&self) -> &str {
        &self.dbname
    }

    /// The TLS mode.
    #[must_use]
    pub fn sslmode(&self) -> SslMode {
        self.sslmode
    }

    /// The trusted roots given with `sslrootcert`, if any.
    #[must_use]
    pub fn sslrootcert(&self) -> Option<&RootCerts> {
        self.sslrootcert.as_ref()
    }

    /// The SCRAM channel-binding policy.
    #[must_use]
    pub fn channel_binding(&self) -> ChannelBindingMode {
        self.channel_binding
    }

    /// `application_name` (default [`DEFAULT_APPLICATION_NAME`]).
    #[must_use]
    pub fn application_name(&self) -> &str {
        &self.application_name
    }

    /// The time allowed to establish a connection (TCP, TLS, authentication),
    /// `None` for no limit.
    #[must_use]
    pub fn connect_timeout(&self) -> Option<Duration> {
        self.connect_timeout
    }

    /// TCP keepalive probes, `None` when turned off (`keepalives=0`); on with
    /// [`Keepalives::default`] unless the URL says otherwise.
    #[must_use]
    pub fn keepalives(&self) -> Option<Keepalives> {
        self.keepalives
    }

    /// How long sent data may stay unacknowledged before the connection is dropped
    /// (`tcp_user_timeout`, Linux only): [`DEFAULT_TCP_USER_TIMEOUT`] unless the URL
    /// says otherwise; `None` (`tcp_user_timeout=0`) keeps the system's default.
    #[must_use]
    pub fn tcp_user_timeout(&self) -> Option<Duration> {
        self.tcp_user_timeout
    }

    /// True when the password could cross the network unencrypted: there is one, the
    /// connection is TCP, and `sslmode` is `disable`, or `prefer`, which an active
    /// attacker downgrades to plain text by answering the `SSLRequest` with `N`. The
    /// server then chooses the method, and `password` sends it in clear while `md5`
    /// sends a hash open to offline guessing.
    #[must_use]
    pub fn may_send_password_in_clear(&self) -> bool {
        self.password.is_some()
            && matches!(self.host, Host::Tcp(_))
            && matches!(self.sslmode, SslMode::Disable | SslMode::Prefer)
    }

    /// Extra server options (`options=-c name=value …`), sent at startup.
    #[must_use]
    pub fn options(&self) -> Option<&str> {
        self.options.as_deref()
    }

    /// A copy with another `application_name`.
    #[must_use]
    pub fn with_application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = name.into();
        self
    }

    /// A copy with another database.
    #[must_use]
    pub fn with_dbname(mut self, dbname: impl Into<String>) -> Self {
        self.dbname = dbname.into();
        self
    }

    /// A copy with another password (`None` removes it).
    #[must_use]
    pub fn with_password(mut self, password: Option<String>) -> Self {
        self.password = password;
        self
    }

    /// A copy with another TLS mode.
    #[must_use]
    pub fn with_sslmode(mut self, sslmode: SslMode) -> Self {
        self.sslmode = sslmode;
        self
    }

    /// The name checked against the server certificate and sent as SNI, `None`
    /// for Unix sockets (no TLS there).
    #[must_use]
    pub fn tls_server_name(&self) -> Option<&str> {
        match &self.host {
            Host::Tcp(h) => Some(h),
            Host::Unix(_) => None,
        }
    }

    /// True when this connection will attempt TLS at all.
    #[must_use]
    pub fn attempts_tls(&self) -> bool {
        matches!(self.host, Host::Tcp(_)) && self.sslmode != SslMode::Disable
    }

    /// `tokio-postgres` configuration for an ordinary (metadata) connection with the
    /// same target, credentials, TLS mode and `application_name`. Use it with
    /// [`MakeRustlsConnect`](super::tls::MakeRustlsConnect), which applies the `verify-ca`/`verify-full` checks
    /// (tokio-postgres itself only knows disable/prefer/require).
    #[must_use]
    pub fn tokio_postgres_config(&self) -> tokio_postgres::Config {
        use tokio_postgres::config::{ChannelBinding, SslMode as TpSslMode};
        let mut config = tokio_postgres::Config::new();
        config.user(&self.user).dbname(&self.dbname).port(self.port);
        config.application_name(&self.application_name);
        if let Some(password) = &self.password {
            config.password(password.as_bytes());
        }
        match &self.host {
            Host::Tcp(h) => {
                config.host(h);
            }
            #[cfg(unix)]
            Host::Unix(p) => {
                config.host_path(p);
            }
            #[cfg(not(unix))]
            Host::Unix(p) => {
                config.host(p.to_string_lossy().as_ref());
            }
        }
        if let Some(addr) = self.hostaddr {
            config.hostaddr(addr);
        }
        if let Some(timeout) = self.connect_timeout {
            config.connect_timeout(timeout);
        }
        self.apply_tcp_settings(&mut config);
        if let Some(options) = &self.options {
            config.options(options);
        }
        config.ssl_mode(match self.sslmode {
            SslMode::Disable => TpSslMode::Disable,
            SslMode::Prefer => TpSslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => TpSslMode::Require,
        });
        config.channel_binding(match self.channel_binding {
            ChannelBindingMode::Disable => ChannelBinding::Disable,
            ChannelBindingMode::Prefer => ChannelBinding::Prefer,
            ChannelBindingMode::Require => ChannelBinding::Require,
        });
        config
    }
}

impl ConnInfo {
    /// Keepalives and `tcp_user_timeout` on a `tokio-postgres` configuration
    /// (whose own default is keepalives after two hours of silence).
    fn apply_tcp_settings(&self, config: &mut tokio_postgres::Config) {
        config.keepalives(self.keepalives.is_some());
        if let Some(keepalives) = self.keepalives {
            if let Some(idle) = keepalives.idle {
                config.keepalives_idle(idle);
            }
            if let Some(interval) = keepalives.interval {
                config.keepalives_interval(interval);
            }
            if let Some(count) = keepalives.count {
                config.keepalives_retries(count);
            }
        }
        if let Some(timeout) = self.tcp_user_timeout {
            config.tcp_user_timeout(timeout);
        }
    }
}

impl FromStr for ConnInfo {
    type Err = ConnInfoError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ConnInfo::parse(s)
    }
}

impl fmt::Debug for ConnInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnInfo")
            .field("host", &self.host)
            .field("hostaddr", &self.hostaddr)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("dbname", &self.dbname)
            .field("sslmode", &self.sslmode)
            .field("sslrootcert", &self.sslrootcert)
            .field("channel_binding", &self.channel_binding)
            .field("application_name", &self.application_name)
            .field("connect_timeout", &self.connect_timeout)
            .field("keepalives", &self.keepalives)
            .field("tcp_user_timeout", &self.tcp_user_timeout)
            .field("options", &self.options)
            .finish()
    }
}

/// `user@host:port/db (sslmode=…)`: what to print in logs and errors.
impl fmt::Display for ConnInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}@{}:{}/{}",
            self.user, self.host, self.port, self.dbname
        )?;
        if let Some(addr) = self.hostaddr {
            write!(f, " (hostaddr={addr})")?;
        }
        write!(f, " (sslmode={})", self.sslmode)
    }
}

/// `err`, unless `url` has a password-like part: then the error its redacted form
/// gives, which cannot quote the password because it is not in there.
fn without_secrets(url: &str, err: ConnInfoError) -> ConnInfoError {
    let redacted = redact_url(url);
    if redacted == url {
        return err;
    }
    match parse_revealing(&redacted) {
        Err(err) => err,
        Ok(_) => ConnInfoError::new(UNPARSABLE_PASSWORD),
    }
}

/// The parser proper. Its errors may quote any part of `url`: only
/// [`ConnInfo::parse`] may call it on a URL that can hold a password.
fn parse_revealing(url: &str) -> Result<ConnInfo, ConnInfoError> {
    let rest = url
        .strip_prefix("postgresql://")
        .or_else(|| url.strip_prefix("postgres://"))
        .ok_or_else(|| {
            ConnInfoError::new("expected a URL starting with postgresql:// or postgres://")
        })?;
    let (before_query, query) = match rest.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (rest, None),
    };
    let (authority, path) = match before_query.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (before_query, None),
    };
    let (userinfo, hostport) = match authority.rsplit_once('@') {
        Some((u, h)) => (Some(u), h),
        None => (None, authority),
    };
    // `relay:12/ab@db/app` or `relay:@/ab@db/app`: a password with a `/` made its
    // tail the database name.
    if path.is_some_and(|p| p.contains('@')) {
        return Err(ConnInfoError::new(
            "unencoded '@' in the database name: percent-encode it as %40",
        ));
    }

    // `relay:?user=x@db/app` or `relay:5432?user=x@db/app`: a password with a `?`
    // made the user name a host and the password's tail the query (and the URL may
    // even parse). A real URL names its database before the query.
    if userinfo.is_none() && path.is_none() && query.is_some_and(|q| q.contains('@')) {
        return Err(ConnInfoError::new(UNPARSABLE_PASSWORD));
    }

    let mut params = Params::default();
    if let Some(userinfo) = userinfo {
        params.userinfo(userinfo)?;
    }
    (params.host, params.port) = parse_hostport(hostport)?;
    if let Some(p) = path.filter(|p| !p.is_empty()) {
        params.dbname = Some(percent_decode(p, "database name")?);
    }
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        params.query_pair(pair)?;
    }
    params.finish()
}

/// What a URL says, on top of libpq's defaults; [`Params::finish`] checks it and
/// fills in what depends on other values.
struct Params {
    host: Option<String>,
    hostaddr: Option<IpAddr>,
    port: Option<u16>,
    user: Option<String>,
    password: Option<String>,
    dbname: Option<String>,
    sslmode: SslMode,
    sslrootcert: Option<RootCerts>,
    channel_binding: ChannelBindingMode,
    application_name: Option<String>,
    connect_timeout: Option<Duration>,
    keepalives: bool,
    keepalive: Keepalives,
    tcp_user_timeout: Option<Duration>,
    options: Option<String>,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            host: None,
            hostaddr: None,
            port: None,
            user: None,
            password: None,
            dbname: None,
            sslmode: SslMode::default(),
            sslrootcert: None,
            channel_binding: ChannelBindingMode::default(),
            application_name: None,
            connect_timeout: Some(DEFAULT_CONNECT_TIMEOUT),
            keepalives: true,
            keepalive: Keepalives::default(),
            tcp_user_timeout: Some(DEFAULT_TCP_USER_TIMEOUT),
            options: None,
        }
    }
}

impl Params {
    /// `user[:password]`, the part before the host's `@`.
    fn userinfo(&mut self, userinfo: &str) -> Result<(), ConnInfoError> {
        let (user, password) = match userinfo.split_once(':') {
            Some((u, p)) => (u, Some(p)),
            None => (userinfo, None),
        };
        if !user.is_empty() {
            self.user = Some(percent_decode(user, "user name")?);
        }
        if let Some(password) = password {
            self.password = Some(percent_decode(password, "password")?);
        }
        Ok(())
    }

    /// One `key=value` of the query.
    fn query_pair(&mut self, pair: &str) -> Result<(), ConnInfoError> {
        let (raw_key, raw_value) = pair.split_once('=').ok_or_else(|| {
            ConnInfoError::new(format!(
                "query parameter {:?} has no value",
                truncate_for_message(pair)
            ))
        })?;
        let key = percent_decode(raw_key, "parameter name")?;
        // Never echo the value of `password` in an error.
        let what = if key == "password" {
            "password".to_owned()
        } else {
            format!("value of {key}")
        };
        let value = percent_decode(raw_value, &what)?;
        self.set(&key, value)
    }

    fn set(&mut self, key: &str, value: String) -> Result<(), ConnInfoError> {
        match key {
            "host" => self.host = Some(value),
            "hostaddr" => {
                self.hostaddr = Some(value.parse::<IpAddr>().map_err(|_| {
                    ConnInfoError::new(format!("hostaddr {value:?} is not a numeric IP address"))
                })?);
            }
            "port" => self.port = Some(parse_port(&value)?),
            "user" => self.user = Some(value),
            "password" => self.password = Some(value),
            "dbname" => self.dbname = Some(value),
            "sslmode" => self.sslmode = value.parse()?,
            "sslrootcert" => {
                self.sslrootcert = Some(if value == "system" {
                    RootCerts::System
                } else {
                    RootCerts::File(PathBuf::from(value))
                });
            }
            "channel_binding" => self.channel_binding = value.parse()?,
            "application_name" => self.application_name = Some(value),
            "connect_timeout" => self.connect_timeout = parse_connect_timeout(&value)?,
            "keepalives" => self.keepalives = parse_int(key, &value)? != 0,
            "keepalives_idle" => self.keepalive.idle = parse_seconds(key, &value)?,
            "keepalives_interval" => self.keepalive.interval = parse_seconds(key, &value)?,
            "keepalives_count" => self.keepalive.count = parse_count(key, &value)?,
            "tcp_user_timeout" => self.tcp_user_timeout = parse_millis(key, &value)?,
            "options" => self.options = Some(value),
            "sslcert" | "sslkey" | "sslpassword" => {
                return Err(ConnInfoError::new(format!(
                    "{key} (TLS client certificates) is not supported"
                )));
            }
            other => {
                return Err(ConnInfoError::new(format!(
                    "unsupported query parameter {other:?} (supported: host, hostaddr, port, \
                     user, password, dbname, sslmode, sslrootcert, channel_binding, \
                     application_name, connect_timeout, keepalives, keepalives_idle, \
                     keepalives_interval, keepalives_count, tcp_user_timeout, options)"
                )));
            }
        }
        Ok(())
    }

    /// Applies the defaults that depend on other values and rejects what no
    /// connection can carry.
    fn finish(self) -> Result<ConnInfo, ConnInfoError> {
        let user = self
            .user
            .filter(|u| !u.is_empty())
            .unwrap_or_else(default_user);
        let host = match self.host {
            Some(h) if h.contains(',') => {
                return Err(ConnInfoError::new(
                    "several hosts are not supported: give exactly one",
                ));
            }
            Some(h) if h.starts_with('/') => Host::Unix(PathBuf::from(h)),
            Some(h) if !h.is_empty() => Host::Tcp(h),
            _ => Host::Tcp("localhost".to_owned()),
        };
        let dbname = self
            .dbname
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| user.clone());
        if contains_nul(&user)
            || contains_nul(&dbname)
            || self.password.as_deref().is_some_and(contains_nul)
            || self.options.as_deref().is_some_and(contains_nul)
            || self.application_name.as_deref().is_some_and(contains_nul)
        {
            return Err(ConnInfoError::new("a parameter contains a NUL byte"));
        }
        Ok(ConnInfo {
            host,
            hostaddr: self.hostaddr,
            port: self.port.unwrap_or(DEFAULT_PORT),
            user,
            password: self.password,
            dbname,
            sslmode: self.sslmode,
            sslrootcert: self.sslrootcert,
            channel_binding: self.channel_binding,
            application_name: self
                .application_name
                .unwrap_or_else(|| DEFAULT_APPLICATION_NAME.to_owned()),
            connect_timeout: self.connect_timeout,
            keepalives: self.keepalives.then_some(self.keepalive),
            tcp_user_timeout: self.tcp_user_timeout,
            options: self.options,
        })
    }
}

/// libpq's default user: `PGUSER`, else the operating-system user, else `postgres`.
fn default_user() -> String {
    ["PGUSER", "USER", "LOGNAME", "USERNAME"]
        .iter()
        .find_map(|var| std::env::var(var).ok().filter(|v| !v.is_empty()))
        .unwrap_or_else(|| "postgres".to_owned())
}

fn contains_nul(s: &str) -> bool {
    s.contains('\0')
}

fn truncate_for_message(s: &str) -> String {
    s.chars().take(40).collect()
}

/// `host`, `host:port`, `[v6]`, `[v6]:port` or empty.
fn parse_hostport(s: &str) -> Result<(Option<String>, Option<u16>), ConnInfoError> {
    if s.is_empty() {
        return Ok((None, None));
    }
    if s.contains(',') {
        return Err(ConnInfoError::new(
            "several hosts are not supported: give exactly one",
        ));
    }
    if let Some(after_bracket) = s.strip_prefix('[') {
        let (v6, after) = after_bracket
            .split_once(']')
            .ok_or_else(|| ConnInfoError::new("unterminated [ in IPv6 host"))?;
        let port = match after {
            "" => None,
            p => Some(parse_port(p.strip_prefix(':').ok_or_else(|| {
                ConnInfoError::new("unexpected characters after ] in IPv6 host")
            })?)?),
        };
        return Ok((Some(percent_decode(v6, "host")?), port));
    }
    match s.rsplit_once(':') {
        Some((h, p)) => {
            let host = if h.is_empty() {
                None
            } else {
                Some(percent_decode(h, "host")?)
            };
            let port = if p.is_empty() {
                None
            } else {
                Some(parse_port(p)?)
            };
            Ok((host, port))
        }
        None => Ok((Some(percent_decode(s, "host")?), None)),
    }
}

fn parse_port(s: &str) -> Result<u16, ConnInfoError> {
    match s.parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(ConnInfoError::new(format!(
            "invalid port {:?}: expected 1..65535",
            truncate_for_message(s)
        ))),
    }
}

/// libpq: zero or negative means no limit; the minimum is 2 seconds.
fn parse_connect_timeout(s: &str) -> Result<Option<Duration>, ConnInfoError> {
    Ok(match u64::try_from(parse_int("connect_timeout", s)?) {
        Ok(0) | Err(_) => None,
        Ok(secs) => Some(Duration::from_secs(secs.max(2))),
    })
}

/// A whole number, white space around it allowed (libpq's `parse_int_param`).
fn parse_int(key: &str, s: &str) -> Result<i64, ConnInfoError> {
    s.trim().parse().map_err(|_| {
        ConnInfoError::new(format!(
            "invalid {key} {:?}: expected a whole number",
            truncate_for_message(s)
        ))
    })
}

/// Whole seconds; zero or negative keeps the system's default (libpq).
fn parse_seconds(key: &str, s: &str) -> Result<Option<Duration>, ConnInfoError> {
    Ok(positive(parse_int(key, s)?).map(Duration::from_secs))
}

/// Milliseconds; zero or negative keeps the system's default (libpq).
fn parse_millis(key: &str, s: &str) -> Result<Option<Duration>, ConnInfoError> {
    Ok(positive(parse_int(key, s)?).map(Duration::from_millis))
}

/// A count; zero or negative keeps the system's default (libpq).
fn parse_count(key: &str, s: &str) -> Result<Option<u32>, ConnInfoError> {
    positive(parse_int(key, s)?)
        .map(|n| {
            u32::try_from(n).map_err(|_| ConnInfoError::new(format!("{key} {n} is too large")))
        })
        .transpose()
}

fn positive(n: i64) -> Option<u64> {
    u64::try_from(n).ok().filter(|&n| n > 0)
}

/// Percent-decodes one URL component to UTF-8 (no `+` → space, as libpq).
fn percent_decode(s: &str, what: &str) -> Result<String, ConnInfoError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| ConnInfoError::new(format!("bad percent-encoding in {what}")))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| ConnInfoError::new(format!("{what} is not UTF-8 after percent-decoding")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(url: &str) -> ConnInfo {
        ConnInfo::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    fn reject(url: &str) -> String {
        match ConnInfo::parse(url) {
            Ok(info) => panic!("{url} must be rejected, parsed as {info:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn parses_a_full_url() {
        let info = parse(
            "postgresql://relay:s3cr%40t@db.example.com:6543/app%20db?sslmode=verify-full\
             &sslrootcert=/etc/ca.pem&application_name=relay-1&connect_timeout=7",
        );
        assert_eq!(info.host(), &Host::Tcp("db.example.com".into()));
        assert_eq!(info.port(), 6543);
        assert_eq!(info.user(), "relay");
        assert_eq!(info.password(), Some("s3cr@t"));
        assert_eq!(info.dbname(), "app db");
        assert_eq!(info.sslmode(), SslMode::VerifyFull);
        assert_eq!(
            info.sslrootcert(),
            Some(&RootCerts::File(PathBuf::from("/etc/ca.pem")))
        );
        assert_eq!(info.application_name(), "relay-1");
        assert_eq!(info.connect_timeout(), Some(Duration::from_secs(7)));
        assert_eq!(info.tls_server_name(), Some("db.example.com"));
    }

    #[test]
    fn a_missing_user_comes_from_the_environment() {
        let info = parse("postgresql://h/db");
        assert!(!info.user().is_empty());
        assert_eq!(info.dbname(), "db");
    }

    #[test]
    fn applies_libpq_defaults() {
        let info = parse("postgres://alice@");
        assert_eq!(info.host(), &Host::Tcp("localhost".into()));
        assert_eq!(info.port(), DEFAULT_PORT);
        assert_eq!(info.dbname(), "alice", "dbname defaults to the user");
        assert_eq!(info.password(), None);
        assert_eq!(info.sslmode(), SslMode::Prefer);
        assert_eq!(info.channel_binding(), ChannelBindingMode::Prefer);
        assert_eq!(info.application_name(), DEFAULT_APPLICATION_NAME);
        assert_eq!(info.connect_timeout(), Some(DEFAULT_CONNECT_TIMEOUT));
        assert_eq!(info.keepalives(), Some(Keepalives::default()));
        assert_eq!(info.tcp_user_timeout(), Some(DEFAULT_TCP_USER_TIMEOUT));
        assert!(info.attempts_tls());
    }

    #[test]
    fn parses_hosts() {
        let v6 = parse("postgresql://u@[::1]:5433/db");
        assert_eq!(v6.host(), &Host::Tcp("::1".into()));
        assert_eq!(v6.port(), 5433);
        assert_eq!(v6.to_string(), "u@[::1]:5433/db (sslmode=prefer)");
        let ip = parse("postgresql://u@127.0.0.1/db");
        assert_eq!(ip.host(), &Host::Tcp("127.0.0.1".into()));
        let unix = parse("postgresql://u@%2Fvar%2Frun%2Fpostgresql/db");
        assert_eq!(unix.host(), &Host::Unix("/var/run/postgresql".into()));
        assert!(!unix.attempts_tls());
        assert_eq!(unix.tls_server_name(), None);
        let query_host = parse("postgresql://u@/db?host=/tmp&port=5999");
        assert_eq!(query_host.host(), &Host::Unix("/tmp".into()));
        assert_eq!(query_host.port(), 5999);
    }

    #[test]
    fn host_parameter_overrides_and_hostaddr_keeps_the_tls_name() {
        let info = parse(
            "postgresql://u@127.0.0.1:54320/db?host=localhost&hostaddr=127.0.0.1&sslmode=verify-full",
        );
        assert_eq!(info.host(), &Host::Tcp("localhost".into()));
        assert_eq!(info.hostaddr(), Some("127.0.0.1".parse().unwrap()));
        assert_eq!(info.tls_server_name(), Some("localhost"));
        assert_eq!(info.port(), 54320);
    }

    #[test]
    fn query_parameters_override_the_authority() {
        let info = parse("postgresql://a:x@h/d1?user=b&password=p%26q&dbname=d2&port=1234");
        assert_eq!(info.user(), "b");
        assert_eq!(info.password(), Some("p&q"));
        assert_eq!(info.dbname(), "d2");
        assert_eq!(info.port(), 1234);
    }

    #[test]
    fn password_may_contain_reserved_characters() {
        // An unencoded '@' in the password: the last '@' ends the user info.
        let info = parse("postgresql://u:p@ss:w0rd@h/db");
        assert_eq!(info.user(), "u");
        assert_eq!(info.password(), Some("p@ss:w0rd"));
        assert_eq!(info.host(), &Host::Tcp("h".into()));
    }

    #[test]
    fn sslmodes_and_rootcerts() {
        for (text, mode) in [
            ("disable", SslMode::Disable),
            ("prefer", SslMode::Prefer),
            ("require", SslMode::Require),
            ("verify-ca", SslMode::VerifyCa),
            ("verify-full", SslMode::VerifyFull),
        ] {
            let info = parse(&format!("postgresql://u@h/db?sslmode={text}"));
            assert_eq!(info.sslmode(), mode);
            assert_eq!(mode.to_string(), text);
        }
        assert!(!parse("postgresql://u@h/db?sslmode=disable").attempts_tls());
        let system = parse("postgresql://u@h/db?sslmode=verify-ca&sslrootcert=system");
        assert_eq!(system.sslrootcert(), Some(&RootCerts::System));
        assert!(reject("postgresql://u@h/db?sslmode=allow").contains("allow"));
        assert!(reject("postgresql://u@h/db?sslmode=bogus").contains("bogus"));
    }

    #[test]
    fn connect_timeout_follows_libpq() {
        let t = |v: &str| parse(&format!("postgresql://u@h?connect_timeout={v}")).connect_timeout();
        assert_eq!(t("0"), None);
        assert_eq!(t("-3"), None);
        assert_eq!(t("1"), Some(Duration::from_secs(2)));
        assert_eq!(t("10"), Some(Duration::from_secs(10)));
        reject("postgresql://u@h?connect_timeout=soon");
    }

    #[test]
    fn rejects_what_it_cannot_honour() {
        reject("mysql://u@h/db");
        reject("postgresql://u@h:notaport/db");
        reject("postgresql://u@h:0/db");
        reject("postgresql://u@h1,h2/db");
        reject("postgresql://u@h/db?host=a,b");
        reject("postgresql://u@h/db?sslcert=/c.pem");
        reject("postgresql://u@h/db?target_session_attrs=any");
        reject("postgresql://u@h/db?hostaddr=localhost");
        reject("postgresql://u@h/d%zzb");
        reject("postgresql://u@h/db?sslmode");
        reject("postgresql://u@h/%00");
        reject("postgresql://u@[::1/db");
        reject("postgresql://h/we@ird");
        reject("postgresql://u:pw@h/we@ird");
        assert_eq!(parse("postgresql://h/we%40ird").dbname(), "we@ird");
        assert_eq!(parse("postgresql://u@h/db?user=me@corp").user(), "me@corp");
    }

    /// Passwords with each character that breaks a URL's structure, and
    /// percent-encoded or badly encoded ones. Their letters occur nowhere else in
    /// the test URLs.
    const SECRETS: &[&str] = &[
        "Kx7/Qz9",
        "Kx7?Qz9",
        "Kx7@Qz9",
        "Kx7:Qz9",
        "Kx7#Qz9",
        "Kx7&Qz9",
        "Kx7/?@:#&Qz9",
        "Kx7%2FQz9",
        "Kx7%3F%40%3A%23Qz9",
        "Kx7%zzQz9",
        "Kx7%00Qz9",
        "Kx7%2",
    ];

    /// The URL forms a password can take: user info (with a valid, an invalid and
    /// no port), a `password=` parameter, libpq's key/value form (not supported,
    /// still never echoed).
    fn urls_with(secret: &str) -> Vec<String> {
        vec![
            format!("postgresql://relay:{secret}@127.0.0.1:1/app"),
            format!("postgres://relay:{secret}@db/app?sslmode=require&connect_timeout=3"),
            format!("postgresql://relay:{secret}@db:99999/app"),
            format!("postgresql://relay:{secret}@db/app?sslmode=bogus"),
            format!("postgresql://relay:12{secret}@db/app"),
            format!("postgresql://relay:/{secret}@db/app"),
            format!("postgresql://relay:@/{secret}@db/app"),
            format!("postgresql://relay@db/app?password={secret}"),
            format!("postgresql://relay@db/app?password={secret}&sslmode=require"),
            format!("postgresql://relay@db/app?password={secret}&bogus=1"),
            format!("host=db user=relay password={secret}"),
        ]
    }

    /// Neither the secret (raw or decoded) nor a run of three or more of its
    /// letters and digits is in `shown`.
    fn assert_hidden(shown: &str, secret: &str, url: &str) {
        let decoded = percent_decode(secret, "test").unwrap_or_default();
        for whole in [secret, decoded.as_str()]
            .into_iter()
            .filter(|s| !s.is_empty())
        {
            assert!(!shown.contains(whole), "{url}: {whole:?} shown in {shown}");
        }
        for run in secret
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter(|r| r.len() >= 3)
        {
            assert!(!shown.contains(run), "{url}: {run:?} shown in {shown}");
        }
    }

    #[test]
    fn no_output_contains_a_password_whatever_it_holds() {
        for secret in SECRETS {
            for url in urls_with(secret) {
                let shown = match ConnInfo::parse(&url) {
                    Ok(info) => format!("{info} {info:?}"),
                    Err(e) => format!("{e} {e:?} {}", e.message()),
                };
                assert_hidden(&shown, secret, &url);
            }
        }
    }

    #[test]
    fn errors_never_contain_the_password() {
        let err = reject("postgresql://u@h/db?password=hunter2%zz");
        assert!(!err.contains("hunter2"), "{err}");
        let err = reject("postgresql://u:hunter2@h:99999/db");
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn a_password_that_breaks_the_url_is_named_not_shown() {
        // Parsed as they stand, these said `invalid port "Kx7"` and `query
        // parameter "Qz9@…" has no value`.
        for url in [
            "postgresql://relay:Kx7/Qz9@127.0.0.1:1/app",
            "postgresql://relay:Kx7?Qz9@127.0.0.1:1/app",
            "postgresql://relay:Kx7%zzQz9@127.0.0.1:1/app",
            "postgresql://relay@127.0.0.1:1/app?password=Kx7&Qz9",
            // These parsed, and showed the password's tail as the user name.
            "postgresql://relay:?user=Kx7Qz9@127.0.0.1:1/app",
            "postgresql://relay:5432?user=Kx7Qz9@127.0.0.1:1/app",
        ] {
            let err = reject(url);
            assert!(err.contains("the password (not shown)"), "{url}: {err}");
            assert!(!err.contains("Kx7") && !err.contains("Qz9"), "{url}: {err}");
        }
        // What is wrong elsewhere is still reported as such.
        let err = reject("postgresql://relay:pa/ss@db/app?sslmode=bogus");
        assert!(err.contains("invalid sslmode \"bogus\""), "{err}");
        let err = reject("postgresql://relay:secret@db:99999/app");
        assert!(err.contains("invalid port \"99999\""), "{err}");
        let err = reject("postgresql://re%zzlay:secret@db/app");
        assert!(err.contains("bad percent-encoding in user name"), "{err}");
    }

    #[test]
    fn unencoded_at_colon_and_hash_are_part_of_the_password() {
        for (url, password) in [
            ("postgresql://u:p@ss@h/db", "p@ss"),
            ("postgresql://u:p:ss@h/db", "p:ss"),
            ("postgresql://u:p#ss@h/db", "p#ss"),
            ("postgresql://u:p%2Fs%3Fs@h/db", "p/s?s"),
            ("postgresql://u@h/db?password=p%26s%3Ds", "p&s=s"),
        ] {
            let info = parse(url);
            assert_eq!(info.password(), Some(password), "{url}");
            assert_eq!(info.host(), &Host::Tcp("h".into()), "{url}");
        }
    }

    #[test]
    fn keepalives_and_timeouts_follow_libpq_parameters() {
        let info = parse(
            "postgresql://u@h/db?keepalives_idle=5&keepalives_interval=2\
             &keepalives_count=4&tcp_user_timeout=1500&connect_timeout=20",
        );
        assert_eq!(
            info.keepalives(),
            Some(Keepalives {
                idle: Some(Duration::from_secs(5)),
                interval: Some(Duration::from_secs(2)),
                count: Some(4),
            })
        );
        assert_eq!(info.tcp_user_timeout(), Some(Duration::from_millis(1500)));
        assert_eq!(info.connect_timeout(), Some(Duration::from_secs(20)));
        // Zero (or less) keeps the system's default, as in libpq.
        let system = parse(
            "postgresql://u@h/db?keepalives_idle=0&keepalives_interval=-1&keepalives_count=0&tcp_user_timeout=0",
        );
        assert_eq!(
            system.keepalives(),
            Some(Keepalives {
                idle: None,
                interval: None,
                count: None,
            })
        );
        assert_eq!(system.tcp_user_timeout(), None);
        assert_eq!(parse("postgresql://u@h/db?keepalives=0").keepalives(), None);
        assert_eq!(
            parse("postgresql://u@h/db?keepalives=1").keepalives(),
            Some(Keepalives::default())
        );
        assert_eq!(
            parse("postgresql://u@h/db?keepalives=0&keepalives_idle=5").keepalives(),
            None
        );
        assert!(reject("postgresql://u@h/db?keepalives=yes").contains("keepalives \"yes\""));
        assert!(reject("postgresql://u@h/db?keepalives_idle=5s").contains("whole number"));
        assert!(reject("postgresql://u@h/db?keepalives_count=99999999999").contains("too large"));
        reject("postgresql://u@h/db?tcp_user_timeout=1.5");
    }

    #[test]
    fn a_password_may_travel_in_clear_only_over_tcp_without_required_tls() {
        let clear = |url: &str| parse(url).may_send_password_in_clear();
        assert!(clear("postgresql://u:pw@db/app"), "prefer is the default");
        assert!(clear("postgresql://u:pw@db/app?sslmode=prefer"));
        assert!(clear("postgresql://u@db/app?sslmode=disable&password=pw"));
        for mode in ["require", "verify-ca", "verify-full"] {
            assert!(
                !clear(&format!("postgresql://u:pw@db/app?sslmode={mode}")),
                "{mode}"
            );
        }
        assert!(
            !clear("postgresql://u@db/app?sslmode=disable"),
            "no password"
        );
        assert!(
            !clear("postgresql://u:pw@/app?host=/run/postgresql"),
            "Unix socket"
        );
    }

    #[test]
    fn debug_and_display_redact_the_password() {
        let info = parse("postgresql://relay:hunter2@h:5433/db?sslmode=require");
        let debug = format!("{info:?}");
        assert!(!debug.contains("hunter2"), "{debug}");
        assert!(debug.contains("password: Some(\"***\")"), "{debug}");
        let display = info.to_string();
        assert!(!display.contains("hunter2"), "{display}");
        assert_eq!(display, "relay@h:5433/db (sslmode=require)");
        let err = ConnInfo::parse("postgresql://relay:hunter2@h/db?bogus=1").unwrap_err();
        assert!(!format!("{err:?}").contains("hunter2"));
    }

    #[test]
    fn builds_a_tokio_postgres_config() {
        let info = parse(
            "postgresql://relay:pw@db:6000/app?sslmode=verify-full&application_name=x&connect_timeout=3&options=-c%20a%3Db",
        );
        let c = info.tokio_postgres_config();
        assert_eq!(c.get_user(), Some("relay"));
        assert_eq!(c.get_password(), Some(&b"pw"[..]));
        assert_eq!(c.get_dbname(), Some("app"));
        assert_eq!(c.get_ports(), &[6000]);
        assert_eq!(
            c.get_hosts(),
            &[tokio_postgres::config::Host::Tcp("db".into())]
        );
        assert_eq!(c.get_application_name(), Some("x"));
        assert_eq!(c.get_connect_timeout(), Some(&Duration::from_secs(3)));
        assert_eq!(c.get_options(), Some("-c a=b"));
        assert_eq!(c.get_ssl_mode(), tokio_postgres::config::SslMode::Require);
        assert!(c.get_keepalives());
        assert_eq!(c.get_keepalives_idle(), Duration::from_secs(30));
        assert_eq!(c.get_keepalives_interval(), Some(Duration::from_secs(10)));
        assert_eq!(c.get_keepalives_retries(), Some(3));
        assert_eq!(c.get_tcp_user_timeout(), Some(&DEFAULT_TCP_USER_TIMEOUT));
        let tuned = parse(
            "postgresql://u@h/db?keepalives_idle=7&keepalives_interval=0&tcp_user_timeout=2500",
        )
        .tokio_postgres_config();
        assert_eq!(tuned.get_keepalives_idle(), Duration::from_secs(7));
        assert_eq!(tuned.get_keepalives_interval(), None);
        assert_eq!(
            tuned.get_tcp_user_timeout(),
            Some(&Duration::from_millis(2500))
        );
        assert_eq!(tuned.get_connect_timeout(), Some(&DEFAULT_CONNECT_TIMEOUT));
        let off =
            parse("postgresql://u@h/db?keepalives=0&connect_timeout=0").tokio_postgres_config();
        assert!(!off.get_keepalives());
        assert_eq!(off.get_connect_timeout(), None);
        let plain = parse("postgresql://u@h/db?sslmode=disable").tokio_postgres_config();
        assert_eq!(
            plain.get_ssl_mode(),
            tokio_postgres::config::SslMode::Disable
        );
    }

    proptest! {
        #[test]
        fn parse_never_panics(s in "(postgres(ql)?://)?.{0,60}") {
            let _ = ConnInfo::parse(&s);
        }

        #[test]
        fn no_output_contains_an_arbitrary_password(password in "[A-Za-z0-9/?@:#&% ]{8,16}") {
            for url in [
                format!("postgresql://relay:{password}@db/app"),
                format!("postgresql://relay@db/app?password={password}&sslmode=disable"),
            ] {
                let shown = match ConnInfo::parse(&url) {
                    Ok(info) => format!("{info} {info:?}"),
                    Err(e) => format!("{e} {e:?}"),
                };
                prop_assert!(!shown.contains(&password), "{} in {}", password, shown);
                for run in password.split(|c: char| !c.is_ascii_alphanumeric()) {
                    prop_assert!(run.len() < 6 || !shown.contains(run), "{} in {}", run, shown);
                }
            }
        }

        #[test]
        fn user_and_password_round_trip_through_percent_encoding(
            user in "[a-zA-Z0-9 @:/?&=%#_.-]{1,12}",
            password in "[a-zA-Z0-9 @:/?&=%#_.-]{0,12}",
        ) {
            let enc = |s: &str| s.bytes().map(|b| format!("%{b:02X}")).collect::<String>();
            let url = format!("postgresql://{}:{}@h/db", enc(&user), enc(&password));
            let info = ConnInfo::parse(&url).unwrap();
            prop_assert_eq!(info.user(), user.as_str());
            prop_assert_eq!(info.password(), Some(password.as_str()));
            let debug = format!("{info:?}");
            prop_assert!(debug.contains("password: Some(\"***\")"));
        }
    }
}
