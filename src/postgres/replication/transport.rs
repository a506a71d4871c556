//! The byte stream under a replication connection, and its buffered reads and writes.
//!
//! # TLS
//!
//! `sslmode` follows libpq (see [`crate::postgres::tls`]): an `SSLRequest` first, then a rustls
//! handshake on `S`, plain on `N` only under `prefer`
//! (<https://www.postgresql.org/docs/current/protocol-flow.html#PROTOCOL-FLOW-SSL>).
//! The one-byte answer is read straight from the socket, so nothing the server (or a
//! man in the middle) sends after it can be taken as plaintext (CVE-2021-23222). The
//! TLS session's `tls-server-end-point` data is handed to SCRAM for channel binding.
//!
//! # Keepalives
//!
//! The TCP socket gets the URL's keepalives ([`Keepalives`], on by default: probes
//! after 30 s of silence) and `tcp_user_timeout`, as libpq sets them, through
//! `socket2` because tokio's `TcpStream` only knows on and off. The walsender's own
//! keepalive messages cover a live server that stops sending; these cover a peer
//! that vanished without closing the connection.
//!
//! # Buffers and cancel safety
//!
//! [`Conn`] owns the read and write buffers, so a future dropped by `tokio::select!`
//! loses nothing: bytes are read into the connection's buffer (`read_buf` is
//! cancel-safe) and a message is taken out of it only when it is complete; unsent
//! bytes of a cancelled write stay buffered and go out before the next message.
//!
//! Reading is batched: one `read` fills up to 64 KiB (more for a larger message) and
//! every complete message in it is handed out without another system call; XLogData
//! payloads are zero-copy slices of that buffer.
//!
//! Under TLS the socket has a read buffer of its own ([`TlsSocket`]): rustls asks
//! its transport for at most 4 KiB per read (`READ_SIZE` in its deframer), so
//! without one every 4 KiB of WAL cost a `recvfrom`. In backlog drains that system
//! call and its wake-ups were a fifth of the relay's CPU.

use std::collections::BTreeMap;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::BytesMut;
use postgres_protocol::message::frontend;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, ReadBuf};
use tokio::net::TcpStream;

use crate::postgres::conninfo::{ConnInfo, Host, Keepalives, SslMode};
use crate::postgres::tls::{TlsConnector, rustls_error, session_channel_binding};

use super::error::ReplicationError;
use super::messages::{Cursor, RawMessage, message_buffered, tag_name, take_message};

/// Bytes asked of the socket per read (more when a message is larger).
const READ_CHUNK: usize = 64 * 1024;

/// A TLS session over a TCP socket read in chunks of [`READ_CHUNK`] (see the module
/// doc). Writes pass straight through the reader.
type TlsSocket = tokio_rustls::client::TlsStream<BufReader<TcpStream>>;

/// The byte stream under a connection.
pub(super) enum Transport {
    Tcp(TcpStream),
    Tls(Box<TlsSocket>),
    #[cfg(unix)]
    Unix(tokio::net::UnixStream),
    #[cfg(test)]
    Mock(tokio::io::DuplexStream),
}

impl Transport {
    pub(super) fn is_tls(&self) -> bool {
        matches!(self, Transport::Tls(_))
    }

    /// The TCP socket underneath, if there is one.
    fn tcp(&self) -> Option<&TcpStream> {
        match self {
            Transport::Tcp(tcp) => Some(tcp),
            Transport::Tls(tls) => Some(tls.get_ref().0.get_ref()),
            #[cfg(unix)]
            Transport::Unix(_) => None,
            #[cfg(test)]
            Transport::Mock(_) => None,
        }
    }
}

impl AsyncRead for Transport {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Transport::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_read(cx, buf),
            #[cfg(test)]
            Transport::Mock(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Transport {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Transport::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_write(cx, buf),
            #[cfg(test)]
            Transport::Mock(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_flush(cx),
            Transport::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_flush(cx),
            #[cfg(test)]
            Transport::Mock(s) => Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Transport::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Transport::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
            #[cfg(unix)]
            Transport::Unix(s) => Pin::new(s).poll_shutdown(cx),
            #[cfg(test)]
            Transport::Mock(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// Opens the socket and, per `sslmode`, TLS. Returns the transport and the
/// channel-binding data of the TLS session, if any.
pub(super) async fn open_transport(
    info: &ConnInfo,
) -> Result<(Transport, Option<Vec<u8>>), ReplicationError> {
    let host = match info.host() {
        Host::Tcp(h) => h,
        #[cfg(unix)]
        Host::Unix(dir) => {
            let path = dir.join(format!(".s.PGSQL.{}", info.port()));
            let stream = tokio::net::UnixStream::connect(&path).await.map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!("cannot connect to {}: {e}", path.display()),
                )
            })?;
            return Ok((Transport::Unix(stream), None));
        }
        #[cfg(not(unix))]
        Host::Unix(_) => {
            return Err(ReplicationError::Config(
                "Unix-domain sockets are not supported on this platform".to_owned(),
            ));
        }
    };
    let connected = match info.hostaddr() {
        Some(addr) => TcpStream::connect((addr, info.port())).await,
        None => TcpStream::connect((host.as_str(), info.port())).await,
    };
    let mut tcp = connected
        .map_err(|e| io::Error::new(e.kind(), format!("cannot connect to {info}: {e}")))?;
    // Status updates are tiny and must leave at once.
    tcp.set_nodelay(true)?;
    set_tcp_timeouts(&tcp, info)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot set TCP keepalives: {e}")))?;
    let Some(connector) = TlsConnector::from_conninfo(info)? else {
        return Ok((Transport::Tcp(tcp), None));
    };
    let server_name = connector.server_name(host)?;

    let mut request = BytesMut::with_capacity(8);
    frontend::ssl_request(&mut request);
    tcp.write_all(&request).await?;
    tcp.flush().await?;
    // Exactly one byte, read straight from the socket: nothing the server (or a man
    // in the middle) sends after it may be taken as plaintext (CVE-2021-23222).
    let mut answer = [0u8; 1];
    tcp.read_exact(&mut answer).await.map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            ReplicationError::ConnectionClosed
        } else {
            ReplicationError::Io(e)
        }
    })?;
    match answer[0] {
        b'S' => {
            // Buffered only now: the answer byte above came straight off the socket.
            let buffered = BufReader::with_capacity(READ_CHUNK, tcp);
            let tls = connector
                .handshake(server_name, buffered)
                .await
                .map_err(|e| match rustls_error(&e) {
                    Some(tls_err) => {
                        ReplicationError::Tls(format!("handshake with {info} failed: {tls_err}"))
                    }
                    None => ReplicationError::Io(io::Error::new(
                        e.kind(),
                        format!("TLS handshake with {info} failed: {e}"),
                    )),
                })?;
            let binding = session_channel_binding(tls.get_ref().1);
            Ok((Transport::Tls(Box::new(tls)), binding))
        }
        b'N' if info.sslmode() == SslMode::Prefer => Ok((Transport::Tcp(tcp), None)),
        b'N' => Err(ReplicationError::Tls(format!(
            "the server at {info} does not support TLS, but sslmode={} requires it",
            info.sslmode()
        ))),
        b'E' => Err(ReplicationError::Protocol(
            "the server answered the SSLRequest with an error (PostgreSQL too old?)".to_owned(),
        )),
        other => Err(ReplicationError::Protocol(format!(
            "unexpected answer {} to SSLRequest",
            tag_name(other)
        ))),
    }
}

/// The URL's keepalives and `tcp_user_timeout` on a connected socket.
fn set_tcp_timeouts(tcp: &TcpStream, info: &ConnInfo) -> io::Result<()> {
    let socket = socket2::SockRef::from(tcp);
    match info.keepalives() {
        Some(keepalives) => socket.set_tcp_keepalive(&tcp_keepalive(keepalives))?,
        None => socket.set_keepalive(false)?,
    }
    // Only Linux has TCP_USER_TIMEOUT; libpq ignores the setting elsewhere too.
    #[cfg(any(target_os = "linux", target_os = "android", target_os = "fuchsia"))]
    if let Some(timeout) = info.tcp_user_timeout() {
        socket.set_tcp_user_timeout(Some(timeout))?;
    }
    Ok(())
}

/// `socket2`'s form of [`Keepalives`]; what a platform cannot set keeps its default.
fn tcp_keepalive(keepalives: Keepalives) -> socket2::TcpKeepalive {
    let mut out = socket2::TcpKeepalive::new();
    if let Some(idle) = keepalives.idle {
        out = out.with_time(idle);
    }
    #[cfg(not(any(
        target_os = "aix",
        target_os = "haiku",
        target_os = "openbsd",
        target_os = "redox",
        target_os = "solaris"
    )))]
    if let Some(interval) = keepalives.interval {
        out = out.with_interval(interval);
    }
    #[cfg(not(any(
        target_os = "aix",
        target_os = "haiku",
        target_os = "openbsd",
        target_os = "redox",
        target_os = "solaris",
        target_os = "windows"
    )))]
    if let Some(count) = keepalives.count {
        out = out.with_retries(count);
    }
    out
}

/// Socket plus read/write buffers, shared by both phases.
pub(super) struct Conn {
    pub(super) io: Transport,
    pub(super) rbuf: BytesMut,
    pub(super) wbuf: BytesMut,
    pub(super) params: BTreeMap<String, String>,
    pub(super) backend_pid: Option<i32>,
    pub(super) target: String,
    pub(super) auth_method: &'static str,
}

impl Conn {
    pub(super) fn new(io: Transport, target: String) -> Self {
        Conn {
            io,
            rbuf: BytesMut::with_capacity(READ_CHUNK),
            wbuf: BytesMut::with_capacity(256),
            params: BTreeMap::new(),
            backend_pid: None,
            target,
            auth_method: "none",
        }
    }

    pub(super) fn server_parameter(&self, name: &str) -> Option<&str> {
        self.params.get(name).map(String::as_str)
    }

    pub(super) fn take_message(&mut self) -> Result<Option<RawMessage>, ReplicationError> {
        take_message(&mut self.rbuf)
    }

    /// Whether a whole message is buffered (or an invalid header, whose error the
    /// next [`Self::take_message`] returns).
    pub(super) fn message_buffered(&self) -> bool {
        message_buffered(&self.rbuf)
    }

    /// Reads what the socket holds right now into the buffer, without waiting:
    /// `Ok(true)` if bytes were read, `Ok(false)` if there were none. The read is
    /// polled once with a waker that does nothing, so no task is woken for it later;
    /// the next real read registers its own.
    pub(super) fn fill_now(&mut self) -> Result<bool, ReplicationError> {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        match std::pin::pin!(self.fill()).poll(&mut cx) {
            Poll::Ready(result) => result.map(|()| true),
            Poll::Pending => Ok(false),
        }
    }

    /// Whether the kernel holds bytes of this connection not read yet (`FIONREAD`
    /// on TCP). Tokio's view can lag: it clears readiness after a short read and
    /// learns of new bytes only when its driver next polls epoll, so a read polled
    /// now may say "nothing" while bytes wait. `false` where it cannot tell.
    pub(super) fn kernel_has_bytes(&self) -> bool {
        self.io.tcp().is_some_and(queued_bytes_nonzero)
    }

    /// Holds back the socket's readiness until `bytes` are queued (`SO_RCVLOWAT`), or
    /// with 1 signals it again at once if anything is queued. While it is raised, the
    /// segments the server sends wake nobody; see `cdc::read_pacing`. `Ok(false)`
    /// (nothing done) on sockets other than TCP and where the kernel would not
    /// signal readiness again when the mark is lowered ([`low_water_signals`]).
    pub(super) fn set_read_threshold(&self, bytes: i32) -> io::Result<bool> {
        match self.io.tcp() {
            Some(tcp) if kernel_signals_low_water() => {
                set_receive_low_water(tcp, bytes)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Reads more bytes into the buffer (cancel-safe). EOF is `ConnectionClosed`.
    pub(super) async fn fill(&mut self) -> Result<(), ReplicationError> {
        if self.rbuf.capacity() - self.rbuf.len() < READ_CHUNK / 4 {
            self.rbuf.reserve(READ_CHUNK);
        }
        let n = self.io.read_buf(&mut self.rbuf).await?;
        if n == 0 {
            return Err(ReplicationError::ConnectionClosed);
        }
        Ok(())
    }

    /// The next complete message (cancel-safe).
    pub(super) async fn read_message(&mut self) -> Result<RawMessage, ReplicationError> {
        loop {
            if let Some(msg) = self.take_message()? {
                return Ok(msg);
            }
            self.fill().await?;
        }
    }

    /// Writes everything buffered and flushes; on cancellation the rest stays
    /// buffered for the next call.
    pub(super) async fn flush_writes(&mut self) -> Result<(), ReplicationError> {
        while !self.wbuf.is_empty() {
            let n = self.io.write_buf(&mut self.wbuf).await?;
            if n == 0 {
                return Err(ReplicationError::Io(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "the connection accepts no more data",
                )));
            }
        }
        self.io.flush().await?;
        Ok(())
    }

    pub(super) fn record_parameter(&mut self, body: &[u8]) -> Result<(), ReplicationError> {
        let mut cursor = Cursor::new(body, "ParameterStatus");
        let name = String::from_utf8_lossy(cursor.cstr()?).into_owned();
        let value = String::from_utf8_lossy(cursor.cstr()?).into_owned();
        self.params.insert(name, value);
        Ok(())
    }

    pub(super) async fn send_query(&mut self, sql: &str) -> Result<(), ReplicationError> {
        frontend::query(sql, &mut self.wbuf)
            .map_err(|e| ReplicationError::Config(format!("cannot send query: {e}")))?;
        self.flush_writes().await
    }
}

/// Whether this kernel honours `SO_RCVLOWAT` in TCP's epoll readiness and signals
/// readiness again when the mark is lowered over bytes already queued (Linux 4.18,
/// `tcp_set_rcvlowat` calling `tcp_data_ready`). Before, lowering it would leave
/// those bytes unannounced until the next segment arrives.
fn kernel_signals_low_water() -> bool {
    static SIGNALS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SIGNALS.get_or_init(|| {
        cfg!(target_os = "linux")
            && std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .is_ok_and(|release| low_water_signals(&release))
    })
}

/// [`kernel_signals_low_water`] for a Linux release string (`6.1.0-18-amd64`).
pub(super) fn low_water_signals(release: &str) -> bool {
    let mut numbers = release
        .trim()
        .split(|c: char| !c.is_ascii_digit())
        .map(str::parse::<u32>);
    match (numbers.next(), numbers.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => (major, minor) >= (4, 18),
        _ => false,
    }
}

/// `setsockopt(SO_RCVLOWAT)`. On Linux (since 4.18 for TCP) epoll reports a socket
/// readable only once this many bytes are queued (`tcp_data_ready`), and setting it
/// signals readiness at once if enough already is (`tcp_set_rcvlowat`).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn set_receive_low_water(tcp: &TcpStream, bytes: i32) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let value: libc::c_int = bytes;
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>())
        .map_err(|_| io::Error::other("socklen_t too small for an int"))?;
    // SAFETY: the descriptor belongs to `tcp`, which is borrowed for the call, and
    // the option value points at a live `c_int` whose size is passed with it;
    // `setsockopt` only reads it.
    let rc = unsafe {
        libc::setsockopt(
            tcp.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw const value).cast(),
            len,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `ioctl(FIONREAD)`: bytes received and not yet read. An error counts as none.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn queued_bytes_nonzero(tcp: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut queued: libc::c_int = 0;
    // SAFETY: the descriptor belongs to `tcp`, borrowed for the call; FIONREAD
    // writes one `c_int` through the pointer, which points at a live local.
    let rc = unsafe { libc::ioctl(tcp.as_raw_fd(), libc::FIONREAD, &raw mut queued) };
    rc == 0 && queued > 0
}

#[cfg(not(target_os = "linux"))]
fn queued_bytes_nonzero(_tcp: &TcpStream) -> bool {
    false
}

#[cfg(not(target_os = "linux"))]
fn set_receive_low_water(_tcp: &TcpStream, _bytes: i32) -> io::Result<()> {
    Ok(())
}
