//! The client side of authentication: cleartext, MD5 and SCRAM-SHA-256, with TLS
//! channel binding when possible.
//!
//! The server picks the method (`pg_hba.conf`) and sends an `Authentication*`
//! request; [`Authenticator::on_request`] answers each one until `AuthenticationOk`
//! (<https://www.postgresql.org/docs/current/protocol-flow.html#PROTOCOL-FLOW-START-UP>,
//! <https://www.postgresql.org/docs/current/sasl-authentication.html>).
//! `postgres-protocol` computes the MD5 hash and the SCRAM exchange; what is ours is
//! the policy around them:
//!
//! - SCRAM uses channel binding (`SCRAM-SHA-256-PLUS`, `tls-server-end-point`, RFC
//!   5929) when the session is encrypted and the server offers it; when we could bind
//!   but the server does not offer it, the client-first message says so (`y`), which
//!   lets the server detect a downgrade by a man in the middle.
//! - `AuthenticationOk` before the server proved it knows the password (SCRAM's
//!   server signature) is refused: a server that skips the last step could be anyone.
//! - `channel_binding=require` (libpq) refuses every method but `SCRAM-SHA-256-PLUS`,
//!   trust included.
//! - Kerberos, GSSAPI, SSPI and SCM credentials are not supported and say so, naming
//!   the method, instead of failing obscurely.

use std::io;

use bytes::BytesMut;
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{
    ChannelBinding, SCRAM_SHA_256, SCRAM_SHA_256_PLUS, ScramSha256,
};
use postgres_protocol::message::frontend;

use crate::postgres::conninfo::{ChannelBindingMode, ConnInfo};

use super::error::ReplicationError;
use super::messages::Cursor;

const AUTH_OK: i32 = 0;
const AUTH_KERBEROS_V5: i32 = 2;
const AUTH_CLEARTEXT_PASSWORD: i32 = 3;
const AUTH_MD5_PASSWORD: i32 = 5;
const AUTH_SCM_CREDENTIAL: i32 = 6;
const AUTH_GSS: i32 = 7;
const AUTH_GSS_CONTINUE: i32 = 8;
const AUTH_SSPI: i32 = 9;
const AUTH_SASL: i32 = 10;
const AUTH_SASL_CONTINUE: i32 = 11;
const AUTH_SASL_FINAL: i32 = 12;

/// The client side of the authentication exchange.
pub(super) struct Authenticator<'a> {
    info: &'a ConnInfo,
    binding: Option<Vec<u8>>,
    pub(super) method: &'static str,
    scram: Option<ScramSha256>,
    scram_finished: bool,
    used_channel_binding: bool,
}

impl<'a> Authenticator<'a> {
    pub(super) fn new(info: &'a ConnInfo, binding: Option<Vec<u8>>) -> Self {
        let binding = match info.channel_binding() {
            ChannelBindingMode::Disable => None,
            ChannelBindingMode::Prefer | ChannelBindingMode::Require => binding,
        };
        Authenticator {
            info,
            binding,
            method: "none",
            scram: None,
            scram_finished: false,
            used_channel_binding: false,
        }
    }

    /// The method that authenticated us, `-plus` when channel binding was used.
    pub(super) fn completed_method(&self) -> &'static str {
        if self.used_channel_binding {
            "scram-sha-256-plus"
        } else {
            self.method
        }
    }

    fn fail(&self, message: impl Into<String>) -> ReplicationError {
        ReplicationError::Auth {
            method: self.method.to_owned(),
            code: None,
            message: message.into(),
        }
    }

    fn password(&self) -> Result<&'a str, ReplicationError> {
        self.info.password().ok_or_else(|| {
            self.fail(format!(
                "the server requires a password for user {:?} but the URL has none",
                self.info.user()
            ))
        })
    }

    /// Handles one `Authentication*` message, appending any answer to `out`.
    /// Returns true on `AuthenticationOk`.
    pub(super) fn on_request(
        &mut self,
        body: &[u8],
        out: &mut BytesMut,
    ) -> Result<bool, ReplicationError> {
        let mut cursor = Cursor::new(body, "Authentication");
        let code = cursor.i32()?;
        let io_err = |e: io::Error| ReplicationError::Config(format!("cannot encode: {e}"));
        match code {
            AUTH_OK => {
                if self.method == "none" {
                    self.method = "trust";
                }
                if self.scram.is_some() && !self.scram_finished {
                    return Err(
                        self.fail("the server ended SCRAM without proving it knows the password")
                    );
                }
                if self.info.channel_binding() == ChannelBindingMode::Require
                    && !self.used_channel_binding
                {
                    return Err(self.fail(format!(
                        "channel_binding=require, but the server authenticated with {} \
                         without channel binding",
                        self.method
                    )));
                }
                Ok(true)
            }
            AUTH_CLEARTEXT_PASSWORD => {
                self.method = "password";
                self.require_no_channel_binding()?;
                let password = self.password()?;
                frontend::password_message(password.as_bytes(), out).map_err(io_err)?;
                Ok(false)
            }
            AUTH_MD5_PASSWORD => {
                self.method = "md5";
                self.require_no_channel_binding()?;
                let salt = cursor.bytes(4)?;
                let salt = [salt[0], salt[1], salt[2], salt[3]];
                let password = self.password()?;
                let hash = md5_hash(self.info.user().as_bytes(), password.as_bytes(), salt);
                frontend::password_message(hash.as_bytes(), out).map_err(io_err)?;
                Ok(false)
            }
            AUTH_SASL => {
                self.method = "scram-sha-256";
                let mut mechanisms = Vec::new();
                loop {
                    let m = cursor.cstr()?;
                    if m.is_empty() {
                        break;
                    }
                    mechanisms.push(String::from_utf8_lossy(m).into_owned());
                }
                let offers = |name: &str| mechanisms.iter().any(|m| m == name);
                let (channel_binding, mechanism) = match self.binding.take() {
                    Some(data) if offers(SCRAM_SHA_256_PLUS) => {
                        self.used_channel_binding = true;
                        (
                            ChannelBinding::tls_server_end_point(data),
                            SCRAM_SHA_256_PLUS,
                        )
                    }
                    // We could bind, the server does not offer it: say so ('y').
                    Some(_) if offers(SCRAM_SHA_256) => {
                        (ChannelBinding::unrequested(), SCRAM_SHA_256)
                    }
                    None if offers(SCRAM_SHA_256) => (ChannelBinding::unsupported(), SCRAM_SHA_256),
                    _ => {
                        return Err(
                            self.fail(format!("no supported SASL mechanism among {mechanisms:?}"))
                        );
                    }
                };
                if mechanism != SCRAM_SHA_256_PLUS {
                    self.require_no_channel_binding()?;
                }
                let password = self.password()?;
                let scram = ScramSha256::new(password.as_bytes(), channel_binding);
                frontend::sasl_initial_response(mechanism, scram.message(), out).map_err(io_err)?;
                self.scram = Some(scram);
                Ok(false)
            }
            AUTH_SASL_CONTINUE => {
                let scram = self.scram.as_mut().ok_or_else(|| {
                    ReplicationError::Protocol("SASLContinue without SASL".to_owned())
                })?;
                scram
                    .update(cursor.rest())
                    .map_err(|e| ReplicationError::Auth {
                        method: "scram-sha-256".to_owned(),
                        code: None,
                        message: format!("invalid SCRAM server-first message: {e}"),
                    })?;
                frontend::sasl_response(scram.message(), out).map_err(io_err)?;
                Ok(false)
            }
            AUTH_SASL_FINAL => {
                let scram = self.scram.as_mut().ok_or_else(|| {
                    ReplicationError::Protocol("SASLFinal without SASL".to_owned())
                })?;
                scram
                    .finish(cursor.rest())
                    .map_err(|e| ReplicationError::Auth {
                        method: "scram-sha-256".to_owned(),
                        code: None,
                        message: format!("server signature verification failed: {e}"),
                    })?;
                self.scram_finished = true;
                Ok(false)
            }
            AUTH_KERBEROS_V5 => self.unsupported("kerberos-v5"),
            AUTH_SCM_CREDENTIAL => self.unsupported("scm-credential"),
            AUTH_GSS | AUTH_GSS_CONTINUE => self.unsupported("gss"),
            AUTH_SSPI => self.unsupported("sspi"),
            other => {
                self.method = "unknown";
                Err(self.fail(format!("unknown authentication request {other}")))
            }
        }
    }

    fn unsupported(&mut self, method: &'static str) -> Result<bool, ReplicationError> {
        self.method = method;
        Err(self.fail(format!(
            "the server asks for {method} authentication, which the relay does not support; \
             use scram-sha-256 in pg_hba.conf"
        )))
    }

    fn require_no_channel_binding(&self) -> Result<(), ReplicationError> {
        if self.info.channel_binding() == ChannelBindingMode::Require {
            Err(self.fail(format!(
                "channel_binding=require, but the server asks for {}",
                self.method
            )))
        } else {
            Ok(())
        }
    }
}
