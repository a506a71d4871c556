//! TLS for both PostgreSQL connections, on rustls (ring provider, no OpenSSL).
//!
//! PostgreSQL negotiates TLS in-band: the client sends an `SSLRequest`, the server
//! answers one byte, `S` (go ahead) or `N` (no TLS here), and only after `S` does the
//! TLS handshake start on the same socket
//! (<https://www.postgresql.org/docs/current/protocol-flow.html#PROTOCOL-FLOW-SSL>).
//! The replication connection does this itself
//! ([`ReplicationConnection::connect`](super::replication::ReplicationConnection::connect));
//! the metadata connection lets `tokio-postgres` do it and plugs [`MakeRustlsConnect`]
//! in. Both end up in [`TlsConnector`], so `sslmode` means the same on both.
//!
//! # `sslmode` versus libpq
//!
//! libpq's modes (<https://www.postgresql.org/docs/current/libpq-ssl.html>) map to
//! rustls certificate verifiers:
//!
//! - `require`: encrypt, accept any certificate (rustls still checks that the server
//!   holds the certificate's key). As in libpq, giving `sslrootcert` upgrades
//!   `require` to `verify-ca`.
//! - `verify-ca`: the chain must lead to a trusted root
//!   ([`rustls::client::verify_server_cert_signed_by_trust_anchor`]); the host name
//!   is not looked at, so a certificate for another host of the same CA passes.
//! - `verify-full`: chain and host name (DNS or IP subject alternative name), the
//!   standard [`WebPkiServerVerifier`].
//! - `prefer`: like `require` when the server says `S`; plain when it says `N`.
//!   (libpq additionally retries without TLS when the handshake itself fails; we
//!   report the failure instead.)
//!
//! Trusted roots come from `sslrootcert` (a PEM file) or, with `sslrootcert=system`
//! or none, from the operating system's store (`rustls-native-certs`).
//!
//! # Channel binding
//!
//! With TLS, SCRAM can bind the authentication to the TLS session
//! (`SCRAM-SHA-256-PLUS`, RFC 5802 / RFC 5929 `tls-server-end-point`): the client
//! proves it saw the same server certificate as the server presented, which defeats a
//! man in the middle even under `require`. `tls_server_end_point` computes the
//! binding data: a hash of the server's certificate, with the certificate's own
//! signature hash (SHA-256 for MD5/SHA-1 signatures), as PostgreSQL's
//! `be_tls_get_certificate_hash` does.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::conninfo::{ConnInfo, RootCerts, SslMode};

/// ALPN protocol name PostgreSQL 17+ expects (ignored by older servers).
pub(crate) const ALPN_POSTGRESQL: &[u8] = b"postgresql";

/// The TLS settings could not be turned into a client configuration (for example
/// `sslrootcert` names a missing file). A configuration problem: retrying won't help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("TLS configuration: {0}")]
pub struct TlsConfigError(String);

impl TlsConfigError {
    /// The message without the prefix.
    #[must_use]
    pub fn message(&self) -> &str {
        &self.0
    }
}

/// Performs the TLS handshake for one `sslmode`; cheap to clone, shared by both
/// connections.
#[derive(Clone)]
pub struct TlsConnector {
    inner: tokio_rustls::TlsConnector,
    /// The mode actually enforced (`require` + `sslrootcert` becomes `verify-ca`).
    mode: SslMode,
}

impl fmt::Debug for TlsConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConnector")
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

impl TlsConnector {
    /// The connector for `info`, or `None` when no TLS will be attempted
    /// (`sslmode=disable` or a Unix socket).
    ///
    /// # Errors
    ///
    /// [`TlsConfigError`] when the trusted roots cannot be loaded.
    pub fn from_conninfo(info: &ConnInfo) -> Result<Option<TlsConnector>, TlsConfigError> {
        if !info.attempts_tls() {
            return Ok(None);
        }
        TlsConnector::new(info.sslmode(), info.sslrootcert()).map(Some)
    }

    /// A connector for an encrypting `mode` (`prefer`, `require`, `verify-ca`,
    /// `verify-full`); `disable` is treated like `prefer` here, since the caller
    /// decides whether to ask for TLS at all.
    ///
    /// # Errors
    ///
    /// [`TlsConfigError`] when the trusted roots cannot be loaded.
    pub fn new(mode: SslMode, roots: Option<&RootCerts>) -> Result<TlsConnector, TlsConfigError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mode = match (mode, roots) {
            // libpq: "if a root CA file exists, the behavior of sslmode=require will
            // be the same as that of verify-ca".
            (SslMode::Require, Some(RootCerts::File(_))) => SslMode::VerifyCa,
            (m, _) => m,
        };
        let verifier: Arc<dyn ServerCertVerifier> = match mode {
            SslMode::Disable | SslMode::Prefer | SslMode::Require => Arc::new(EncryptOnly {
                provider: Arc::clone(&provider),
            }),
            SslMode::VerifyCa => Arc::new(ChainOnly {
                roots: Arc::new(load_roots(roots)?),
                provider: Arc::clone(&provider),
            }),
            SslMode::VerifyFull => WebPkiServerVerifier::builder_with_provider(
                Arc::new(load_roots(roots)?),
                Arc::clone(&provider),
            )
            .build()
            .map_err(|e| TlsConfigError(format!("cannot build the certificate verifier: {e}")))?,
        };
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsConfigError(format!("no usable TLS protocol version: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        config.alpn_protocols = vec![ALPN_POSTGRESQL.to_vec()];
        Ok(TlsConnector {
            inner: tokio_rustls::TlsConnector::from(Arc::new(config)),
            mode,
        })
    }

    /// The mode this connector enforces.
    #[must_use]
    pub fn mode(&self) -> SslMode {
        self.mode
    }

    /// The rustls server name for `host`: the host itself (DNS name or IP literal);
    /// for modes that do not check names, a placeholder when `host` is not a valid
    /// name (no SNI is sent for IP addresses).
    ///
    /// # Errors
    ///
    /// [`TlsConfigError`] under `verify-full` when `host` is not a DNS name or IP.
    pub fn server_name(&self, host: &str) -> Result<ServerName<'static>, TlsConfigError> {
        match ServerName::try_from(host.to_owned()) {
            Ok(name) => Ok(name),
            Err(_) if self.mode != SslMode::VerifyFull => Ok(ServerName::IpAddress(
                std::net::IpAddr::from([0, 0, 0, 0]).into(),
            )),
            Err(e) => Err(TlsConfigError(format!(
                "host {host:?} cannot be checked against a certificate: {e}"
            ))),
        }
    }

    /// Runs the TLS handshake over `stream` (after the server answered `S`).
    ///
    /// # Errors
    ///
    /// The handshake's `io::Error`; certificate and protocol failures carry a
    /// [`rustls::Error`] inside (see `rustls_error`).
    pub async fn handshake<S>(
        &self,
        server_name: ServerName<'static>,
        stream: S,
    ) -> io::Result<tokio_rustls::client::TlsStream<S>>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        self.inner.connect(server_name, stream).await
    }
}

/// The rustls error inside a handshake `io::Error`, if that is what failed (as
/// opposed to the socket).
#[must_use]
pub(crate) fn rustls_error(e: &io::Error) -> Option<&rustls::Error> {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
}

/// `tls-server-end-point` channel-binding data of an established session, `None`
/// when the server sent no certificate or its signature algorithm has no defined
/// binding hash.
#[must_use]
pub(crate) fn session_channel_binding(conn: &rustls::ClientConnection) -> Option<Vec<u8>> {
    conn.peer_certificates()
        .and_then(|certs| certs.first())
        .and_then(|leaf| tls_server_end_point(leaf.as_ref()))
}

/// RFC 5929 `tls-server-end-point`: the hash of the DER certificate with the hash
/// function of its signature algorithm, SHA-256 when that is MD5 or SHA-1. `None` for
/// algorithms without a single hash (RSASSA-PSS, EdDSA), which PostgreSQL cannot bind
/// to either, and for malformed input.
#[must_use]
pub(crate) fn tls_server_end_point(cert_der: &[u8]) -> Option<Vec<u8>> {
    let algorithm = signature_hash(cert_der)?;
    Some(ring::digest::digest(algorithm, cert_der).as_ref().to_vec())
}

/// The digest to use for `tls-server-end-point`, from the certificate's
/// `signatureAlgorithm` OID.
fn signature_hash(cert_der: &[u8]) -> Option<&'static ring::digest::Algorithm> {
    // Certificate ::= SEQUENCE { tbsCertificate, signatureAlgorithm, signatureValue }
    // AlgorithmIdentifier ::= SEQUENCE { algorithm OBJECT IDENTIFIER, parameters ANY }
    const SEQUENCE: u8 = 0x30;
    const OID: u8 = 0x06;
    let (cert, _) = der_tlv(cert_der, SEQUENCE)?;
    let (_tbs, after_tbs) = der_tlv(cert, SEQUENCE)?;
    let (algorithm, _) = der_tlv(after_tbs, SEQUENCE)?;
    let (oid, _) = der_tlv(algorithm, OID)?;
    const RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01]; // 1.2.840.113549.1.1
    const ECDSA_SHA2: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03]; // 1.2.840.10045.4.3
    const ECDSA_SHA1: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01]; // 1.2.840.10045.4.1
    const DSA_SHA1: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x38, 0x04, 0x03]; // 1.2.840.10040.4.3
    const DSA_SHA256: &[u8] = &[0x60, 0x86, 0x48, 0x01, 0x65, 0x03, 0x04, 0x03, 0x02];
    use ring::digest::{SHA256, SHA384, SHA512};
    if let Some(last) = oid.strip_prefix(RSA) {
        return match last {
            // md5, sha1 → SHA-256; sha256; sha384; sha512
            [0x04] | [0x05] | [0x0b] => Some(&SHA256),
            [0x0c] => Some(&SHA384),
            [0x0d] => Some(&SHA512),
            _ => None, // RSASSA-PSS (0x0a), sha224 (0x0e), others
        };
    }
    if let Some(last) = oid.strip_prefix(ECDSA_SHA2) {
        return match last {
            [0x02] => Some(&SHA256),
            [0x03] => Some(&SHA384),
            [0x04] => Some(&SHA512),
            _ => None,
        };
    }
    if oid == ECDSA_SHA1 || oid == DSA_SHA1 || oid == DSA_SHA256 {
        return Some(&SHA256);
    }
    None
}

/// Reads one DER TLV with the expected tag; returns (contents, rest).
fn der_tlv(input: &[u8], expected_tag: u8) -> Option<(&[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    if tag != expected_tag {
        return None;
    }
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let bytes = rest.get(..n)?;
        let len = bytes
            .iter()
            .fold(0usize, |acc, &b| (acc << 8) | usize::from(b));
        (len, rest.get(n..)?)
    };
    let contents = rest.get(..len)?;
    Some((contents, rest.get(len..)?))
}

fn load_roots(roots: Option<&RootCerts>) -> Result<RootCertStore, TlsConfigError> {
    let mut store = RootCertStore::empty();
    match roots {
        Some(RootCerts::File(path)) => {
            let certs = CertificateDer::pem_file_iter(path).map_err(|e| {
                TlsConfigError(format!("cannot read sslrootcert {}: {e}", path.display()))
            })?;
            for cert in certs {
                let cert = cert
                    .map_err(|e| TlsConfigError(format!("sslrootcert {}: {e}", path.display())))?;
                store.add(cert).map_err(|e| {
                    TlsConfigError(format!(
                        "sslrootcert {}: unusable certificate: {e}",
                        path.display()
                    ))
                })?;
            }
            if store.is_empty() {
                return Err(TlsConfigError(format!(
                    "sslrootcert {} holds no PEM certificate",
                    path.display()
                )));
            }
        }
        Some(RootCerts::System) | None => {
            let result = rustls_native_certs::load_native_certs();
            let (added, _ignored) = store.add_parsable_certificates(result.certs);
            if added == 0 {
                let why = result
                    .errors
                    .first()
                    .map_or_else(|| "none found".to_owned(), ToString::to_string);
                return Err(TlsConfigError(format!(
                    "no trusted root certificates in the system store ({why}); \
                     set sslrootcert to a CA file"
                )));
            }
        }
    }
    Ok(store)
}

/// `sslmode=require`/`prefer`: any certificate, but the handshake signatures are
/// still checked against the presented certificate.
#[derive(Debug)]
struct EncryptOnly {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// `sslmode=verify-ca`: the chain must lead to a trusted root; the name is ignored.
#[derive(Debug)]
struct ChainOnly {
    roots: Arc<RootCertStore>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

// ---------------------------------------------------------------- tokio-postgres

/// [`tokio_postgres::tls::MakeTlsConnect`] over [`TlsConnector`], for the metadata
/// connection: `config.connect(MakeRustlsConnect::from_conninfo(&info)?)`.
///
/// tokio-postgres sends the `SSLRequest` and handles `prefer`'s fallback; this type
/// supplies the handshake with our `sslmode` verification and the channel binding.
#[derive(Clone, Debug)]
pub struct MakeRustlsConnect {
    connector: TlsConnector,
}

impl MakeRustlsConnect {
    /// Wraps a connector.
    #[must_use]
    pub fn new(connector: TlsConnector) -> Self {
        MakeRustlsConnect { connector }
    }

    /// The connector for `info`. Under `sslmode=disable` tokio-postgres still builds
    /// a connector but never runs it; it gets an inert `require` one.
    ///
    /// # Errors
    ///
    /// [`TlsConfigError`] when the trusted roots cannot be loaded.
    pub fn from_conninfo(info: &ConnInfo) -> Result<Self, TlsConfigError> {
        let connector = match TlsConnector::from_conninfo(info)? {
            Some(connector) => connector,
            None => TlsConnector::new(SslMode::Require, None)?,
        };
        Ok(MakeRustlsConnect { connector })
    }
}

impl<S> tokio_postgres::tls::MakeTlsConnect<S> for MakeRustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = TlsConfigError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnect, TlsConfigError> {
        let connector = self.connector.clone();
        let server_name = connector.server_name(domain)?;
        Ok(RustlsConnect {
            connector,
            server_name,
        })
    }
}

/// One pending handshake for tokio-postgres.
#[derive(Debug)]
pub struct RustlsConnect {
    connector: TlsConnector,
    server_name: ServerName<'static>,
}

impl<S> tokio_postgres::tls::TlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let tls = self.connector.handshake(self.server_name, stream).await?;
            Ok(RustlsStream(Box::new(tls)))
        })
    }
}

/// A TLS session as tokio-postgres wants it (with channel-binding data).
pub struct RustlsStream<S>(Box<tokio_rustls::client::TlsStream<S>>);

impl<S> fmt::Debug for RustlsStream<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RustlsStream").finish_non_exhaustive()
    }
}

impl<S> tokio_postgres::tls::TlsStream for RustlsStream<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    fn channel_binding(&self) -> tokio_postgres::tls::ChannelBinding {
        match session_channel_binding(self.0.get_ref().1) {
            Some(data) => tokio_postgres::tls::ChannelBinding::tls_server_end_point(data),
            None => tokio_postgres::tls::ChannelBinding::none(),
        }
    }
}

impl<S> AsyncRead for RustlsStream<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl<S> AsyncWrite for RustlsStream<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DER of `SEQUENCE { SEQUENCE {} (tbs), SEQUENCE { OID oid }, BIT STRING {} }`.
    fn fake_cert(oid: &[u8]) -> Vec<u8> {
        let mut alg = vec![0x06, u8::try_from(oid.len()).unwrap()];
        alg.extend_from_slice(oid);
        let mut body = vec![0x30, 0x00, 0x30, u8::try_from(alg.len()).unwrap()];
        body.extend_from_slice(&alg);
        body.extend_from_slice(&[0x03, 0x01, 0x00]);
        let mut cert = vec![0x30, u8::try_from(body.len()).unwrap()];
        cert.extend_from_slice(&body);
        cert
    }

    #[test]
    fn end_point_hash_follows_the_signature_algorithm() {
        let rsa = |last: u8| fake_cert(&[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, last]);
        let ecdsa = |last: u8| fake_cert(&[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, last]);
        let len = |der: Vec<u8>| tls_server_end_point(&der).map(|h| h.len());
        assert_eq!(len(rsa(0x0b)), Some(32), "sha256WithRSAEncryption");
        assert_eq!(
            len(rsa(0x05)),
            Some(32),
            "sha1WithRSAEncryption uses SHA-256"
        );
        assert_eq!(
            len(rsa(0x04)),
            Some(32),
            "md5WithRSAEncryption uses SHA-256"
        );
        assert_eq!(len(rsa(0x0c)), Some(48), "sha384WithRSAEncryption");
        assert_eq!(len(rsa(0x0d)), Some(64), "sha512WithRSAEncryption");
        assert_eq!(len(rsa(0x0a)), None, "RSASSA-PSS has no single hash");
        assert_eq!(len(ecdsa(0x02)), Some(32));
        assert_eq!(len(ecdsa(0x03)), Some(48));
        assert_eq!(len(ecdsa(0x04)), Some(64));
        assert_eq!(len(fake_cert(&[0x2b, 0x65, 0x70])), None, "Ed25519");
        let der = rsa(0x0b);
        assert_eq!(
            tls_server_end_point(&der).unwrap(),
            ring::digest::digest(&ring::digest::SHA256, &der).as_ref()
        );
    }

    #[test]
    fn end_point_hash_never_panics_on_garbage() {
        let der = fake_cert(&[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x0b]);
        for cut in 0..der.len() {
            let _ = tls_server_end_point(&der[..cut]);
        }
        assert_eq!(
            tls_server_end_point(&[0x30, 0x84, 0xff, 0xff, 0xff, 0xff]),
            None
        );
        assert_eq!(tls_server_end_point(&[0x30, 0x80]), None);
        assert_eq!(tls_server_end_point(&[]), None);
    }

    #[test]
    fn reads_long_form_der_lengths() {
        let mut input = vec![0x30, 0x81, 0x80];
        input.extend(std::iter::repeat_n(0u8, 0x80));
        input.push(0xaa);
        let (contents, rest) = der_tlv(&input, 0x30).unwrap();
        assert_eq!(contents.len(), 0x80);
        assert_eq!(rest, &[0xaa]);
    }

    #[test]
    fn require_with_a_root_file_becomes_verify_ca() {
        let ca =
            std::env::temp_dir().join(format!("outbox-relay-tls-test-{}.pem", std::process::id()));
        // A syntactically valid self-signed certificate is not needed for the mode
        // decision, but loading must fail clearly on a file without certificates.
        std::fs::write(&ca, "not a certificate\n").unwrap();
        let err =
            TlsConnector::new(SslMode::Require, Some(&RootCerts::File(ca.clone()))).unwrap_err();
        assert!(err.message().contains("no PEM certificate"), "{err}");
        let _ = std::fs::remove_file(&ca);
        let missing = RootCerts::File("/nonexistent/ca.pem".into());
        let err = TlsConnector::new(SslMode::VerifyFull, Some(&missing)).unwrap_err();
        assert!(err.message().contains("/nonexistent/ca.pem"), "{err}");
        let require = TlsConnector::new(SslMode::Require, None).unwrap();
        assert_eq!(require.mode(), SslMode::Require);
    }

    #[test]
    fn server_names() {
        let require = TlsConnector::new(SslMode::Require, None).unwrap();
        assert!(matches!(
            require.server_name("127.0.0.1").unwrap(),
            ServerName::IpAddress(_)
        ));
        assert!(matches!(
            require.server_name("db.example.com").unwrap(),
            ServerName::DnsName(_)
        ));
        assert!(require.server_name("bad name!").is_ok());
    }
}
