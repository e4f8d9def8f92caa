//! TLS to PostgreSQL (cargo feature `postgres`; ADR 0035): the connection
//! string's `sslmode`, `sslrootcert`, `sslcert` and `sslkey`, as libpq
//! users write them, carried out with rustls on the ring provider (the
//! workspace's TLS stack, dtx-tls), never without verifying the server.
//!
//! tokio-postgres knows only `sslmode=disable|prefer|require` and no
//! certificate options, so [`parse`] takes these four keys out of the
//! connection string (key/value form or `postgresql://` URL), hands the
//! rest to tokio-postgres, and builds the TLS connector ([`PgTls`], a
//! tokio-postgres `MakeTlsConnect` over tokio-rustls) from them:
//!
//! | `sslmode` | what happens |
//! |---|---|
//! | absent, `disable` | plain text, as before this module |
//! | `prefer` | TLS when the server offers it (chain checked as `verify-ca`), else plain text |
//! | `require`, `verify-ca` | TLS or no connection; the certificate chain is checked against `sslrootcert` |
//! | `verify-full` | the same, and the certificate must name the host connected to (`host=`; DNS name or IP address) |
//! | `allow` | refused (it prefers plain text) |
//!
//! Every mode but `disable` needs `sslrootcert` (a PEM file of the
//! authorities that may sign the server's certificate): libpq's `require`
//! without a root certificate encrypts without checking who answers, which
//! this SDK never does. `sslcert` and `sslkey` (both or neither) add a
//! client certificate. A certificate problem is reported at once with what
//! was wrong ([`describe_connect_error`]), not retried as an unreachable
//! server. Channel binding is not offered (`channel_binding=require` is
//! refused): the server is authenticated by its certificate instead.

use std::future::Future;
use std::io;
use std::path::Path;
use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::task::Context;
use std::task::Poll;

use rustls::client::danger::HandshakeSignatureValid;
use rustls::client::danger::ServerCertVerified;
use rustls::client::danger::ServerCertVerifier;
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::ServerName;
use rustls::pki_types::UnixTime;
use rustls::CertificateError;
use rustls::ClientConfig;
use rustls::DigitallySignedStruct;
use rustls::SignatureScheme;
use tokio::io::AsyncRead;
use tokio::io::AsyncWrite;
use tokio::io::ReadBuf;
use tokio_postgres::config::ChannelBinding as ChannelBindingMode;
use tokio_postgres::config::Host;
use tokio_postgres::config::SslMode as PgSslMode;
use tokio_postgres::tls::ChannelBinding;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::tls::TlsConnect;
use tokio_postgres::tls::TlsStream;

/// The `sslmode` values this SDK carries out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// A connection string split into what tokio-postgres reads and how TLS is
/// done.
#[derive(Clone)]
pub struct ConnSettings {
    pub config: tokio_postgres::Config,
    pub tls: PgTls,
    pub mode: SslMode,
    /// `sslrootcert`, for messages.
    pub root: Option<PathBuf>,
}

impl ConnSettings {
    /// `sslmode=..., sslrootcert=...`, for messages.
    pub fn describe(&self) -> String {
        match &self.root {
            Some(r) => format!("sslmode={}, sslrootcert={}", self.mode.as_str(), r.display()),
            None => format!("sslmode={}", self.mode.as_str()),
        }
    }
}

/// The TLS keys this module takes out of a connection string.
const OURS: [&str; 4] = ["sslmode", "sslrootcert", "sslcert", "sslkey"];

/// Reads `conn_string` (see the module documentation); an error says what
/// is wrong and what to write instead.
pub fn parse(conn_string: &str) -> Result<ConnSettings, String> {
    let (rest, ours) = if conn_string.starts_with("postgres://") || conn_string.starts_with("postgresql://") {
        split_url(conn_string)?
    } else {
        split_key_values(conn_string)?
    };
    let get = |k: &str| ours.iter().rev().find(|(key, _)| key == k).map(|(_, v)| v.clone());
    let mut config =
        tokio_postgres::Config::from_str(&rest).map_err(|e| format!("PostgreSQL connection string: {e}"))?;
    let root = get("sslrootcert").map(PathBuf::from);
    let client = match (get("sslcert"), get("sslkey")) {
        (Some(c), Some(k)) => Some((PathBuf::from(c), PathBuf::from(k))),
        (None, None) => None,
        (Some(_), None) => {
            return Err("sslcert is set without sslkey: name both (the client certificate and its key)".into())
        }
        (None, Some(_)) => {
            return Err("sslkey is set without sslcert: name both (the client certificate and its key)".into())
        }
    };
    let mode = match get("sslmode").as_deref() {
        None if root.is_some() || client.is_some() => {
            return Err(
                "sslrootcert, sslcert or sslkey without sslmode: say sslmode=verify-full (or verify-ca); without \
                 sslmode the connection is plain text"
                    .into(),
            )
        }
        None | Some("disable") => SslMode::Disable,
        Some("prefer") => SslMode::Prefer,
        Some("require") => SslMode::Require,
        Some("verify-ca") => SslMode::VerifyCa,
        Some("verify-full") => SslMode::VerifyFull,
        Some("allow") => {
            return Err(
                "sslmode=allow is not supported (it prefers plain text): use verify-full (or verify-ca, require, \
                 prefer, disable)"
                    .into(),
            )
        }
        Some(other) => {
            return Err(format!(
                "sslmode={other:?} is not one of disable, prefer, require, verify-ca, verify-full (verify-full checks \
                 the server's certificate and name)"
            ))
        }
    };
    if mode == SslMode::Disable {
        if root.is_some() || client.is_some() {
            return Err(
                "sslrootcert, sslcert or sslkey with sslmode=disable: the connection would be plain text; \
                        say sslmode=verify-full or drop them"
                    .into(),
            );
        }
        config.ssl_mode(PgSslMode::Disable);
        return Ok(ConnSettings {
            config,
            tls: PgTls { config: None },
            mode,
            root: None,
        });
    }
    let Some(root) = root else {
        return Err(format!(
            "sslmode={} needs sslrootcert=<PEM file of the authority that signed the server's certificate>: this SDK \
             never makes a TLS connection it does not verify (libpq's require without a root certificate does not \
             check who answers)",
            mode.as_str()
        ));
    };
    if root.as_os_str() == "system" {
        return Err("sslrootcert=system is not supported: name a PEM file of the authorities to trust".into());
    }
    if config.get_channel_binding() == ChannelBindingMode::Require {
        return Err(
            "channel_binding=require is not supported with this SDK's TLS: the server is authenticated by its \
             certificate (sslmode=verify-full) instead"
                .into(),
        );
    }
    if let Some(Host::Unix(p)) = config.get_hosts().iter().find(|h| matches!(h, Host::Unix(_))) {
        return Err(format!(
            "host {} is a unix socket, where PostgreSQL uses no TLS: use a TCP host with sslmode={}, or \
             sslmode=disable",
            p.display(),
            mode.as_str()
        ));
    }
    let tls = client_config(mode, &root, client.as_ref().map(|(c, k)| (c.as_path(), k.as_path())))?;
    config.ssl_mode(if mode == SslMode::Prefer {
        PgSslMode::Prefer
    } else {
        PgSslMode::Require
    });
    Ok(ConnSettings {
        config,
        tls: PgTls {
            config: Some(Arc::new(tls)),
        },
        mode,
        root: Some(root),
    })
}

/// The rustls client configuration of `mode`.
fn client_config(mode: SslMode, root: &Path, client: Option<(&Path, &Path)>) -> Result<ClientConfig, String> {
    let roots = dtx_tls::files::load_roots(root).map_err(|e| format!("sslrootcert: {e}"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| format!("sslrootcert {}: {e}", root.display()))?;
    let verifier: Arc<dyn ServerCertVerifier> = if mode == SslMode::VerifyFull {
        verifier
    } else {
        Arc::new(ChainOnly(verifier))
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS settings: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let mut config = match client {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = dtx_tls::files::load_certs("sslcert certificate", cert).map_err(|e| format!("sslcert: {e}"))?;
            let key = dtx_tls::files::load_key(key).map_err(|e| format!("sslkey: {e}"))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("sslcert {} and sslkey: {e}", cert.display()))?
        }
    };
    // PostgreSQL 17's direct TLS negotiation asks for it; others ignore it.
    config.alpn_protocols = vec![b"postgresql".to_vec()];
    Ok(config)
}

/// `verify-ca`: the chain is checked, the name is not. rustls checks the
/// name only after the chain (WebPkiServerVerifier), so a name error means
/// the chain passed.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// A tokio-postgres TLS connector over rustls (none when `sslmode=disable`:
/// tokio-postgres then never asks it for a connection).
#[derive(Clone)]
pub struct PgTls {
    config: Option<Arc<ClientConfig>>,
}

/// A TLS handshake that failed, with rustls's reason when it has one.
#[derive(Debug)]
pub struct PgTlsError {
    pub rustls: Option<rustls::Error>,
    message: String,
}

impl std::fmt::Display for PgTlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PgTlsError {}

impl PgTlsError {
    fn from_io(e: io::Error) -> PgTlsError {
        let rustls = e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
            .cloned();
        PgTlsError {
            message: e.to_string(),
            rustls,
        }
    }
}

impl<S> MakeTlsConnect<S> for PgTls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = PgTlsStream<S>;
    type TlsConnect = PgTlsConnect;
    type Error = PgTlsError;

    /// tokio-postgres asks for a connector before it knows whether TLS is
    /// used (never with `sslmode=disable`), so problems wait until
    /// [`TlsConnect::connect`].
    fn make_tls_connect(&mut self, domain: &str) -> Result<PgTlsConnect, PgTlsError> {
        let target = match &self.config {
            None => Err("TLS is off (sslmode=disable)".to_string()),
            Some(config) => match ServerName::try_from(domain.to_string()) {
                Ok(name) => Ok((config.clone(), name)),
                Err(e) => Err(format!(
                    "{domain:?} is not a host name or IP address TLS can check: {e}"
                )),
            },
        };
        Ok(PgTlsConnect { target })
    }
}

/// One handshake's connector.
pub struct PgTlsConnect {
    target: Result<(Arc<ClientConfig>, ServerName<'static>), String>,
}

impl<S> TlsConnect<S> for PgTlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = PgTlsStream<S>;
    type Error = PgTlsError;
    type Future = Pin<Box<dyn Future<Output = Result<PgTlsStream<S>, PgTlsError>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let (config, name) = self.target.map_err(|message| PgTlsError { rustls: None, message })?;
            tokio_rustls::TlsConnector::from(config)
                .connect(name, stream)
                .await
                .map(PgTlsStream)
                .map_err(PgTlsError::from_io)
        })
    }
}

/// A TLS connection to PostgreSQL.
pub struct PgTlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for PgTlsStream<S> {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for PgTlsStream<S> {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> TlsStream for PgTlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

/// What a failed connection's TLS problem was, in words, when it is one
/// that trying again cannot fix (the server's certificate, TLS refused by
/// the server); `None` for anything else.
pub fn describe_connect_error(
    e: &(dyn std::error::Error + 'static),
    settings: &ConnSettings,
    host: &str,
) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    let mut tls_failed = false;
    while let Some(err) = cur {
        if let Some(t) = err.downcast_ref::<PgTlsError>() {
            return Some(describe_tls(t, settings, host));
        }
        let text = err.to_string();
        if text.contains("server does not support TLS") {
            return Some(format!(
                "PostgreSQL at {host} does not accept TLS (ssl = off in its postgresql.conf?) but {} requires it: \
                 turn ssl on there, or connect with sslmode=disable (plain text)",
                settings.describe()
            ));
        }
        tls_failed |= text.starts_with("error performing TLS handshake");
        cur = err.source();
    }
    tls_failed.then(|| format!("TLS with PostgreSQL at {host} failed ({}): {e}", settings.describe()))
}

fn describe_tls(t: &PgTlsError, settings: &ConnSettings, host: &str) -> String {
    let root = settings
        .root
        .as_ref()
        .map(|r| r.display().to_string())
        .unwrap_or_default();
    let what = match &t.rustls {
        Some(rustls::Error::InvalidCertificate(c)) => match c {
            CertificateError::UnknownIssuer => format!(
                "its certificate is not issued by an authority in sslrootcert={root} (UnknownIssuer): name the \
                 authority that signed the server's certificate"
            ),
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => format!(
                "its certificate is not valid for {host} ({c:?}); sslmode=verify-full checks that the certificate \
                 names the host connected to: connect by a name the certificate holds, or reissue it"
            ),
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                format!("its certificate has expired ({c:?}): renew it")
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                format!("its certificate is not valid yet ({c:?}): check the clocks")
            }
            other => format!("its certificate was refused: {other:?}"),
        },
        Some(rustls::Error::AlertReceived(a)) => format!(
            "the server ended the handshake ({a:?}); if it asks for a client certificate, give sslcert and sslkey"
        ),
        Some(other) => format!("the TLS handshake failed: {other}"),
        None => format!("the TLS handshake failed: {}", t.message),
    };
    format!(
        "TLS with PostgreSQL at {host} refused ({}): {what}",
        settings.describe()
    )
}

/// Splits a key/value connection string into the part tokio-postgres reads
/// (re-quoted) and this module's keys.
fn split_key_values(s: &str) -> Result<(String, Vec<(String, String)>), String> {
    let mut rest = Vec::new();
    let mut ours = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') {
            return Err(format!(
                "PostgreSQL connection string: {key:?} has no value (key=value expected)"
            ));
        }
        while chars.peek().is_some_and(|c| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'\'') {
            chars.next();
            loop {
                match chars.next() {
                    None => {
                        return Err(format!(
                            "PostgreSQL connection string: the value of {key} is not closed"
                        ))
                    }
                    Some('\'') => break,
                    Some('\\') => value.push(chars.next().unwrap_or('\\')),
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                chars.next();
                if c == '\\' {
                    value.push(chars.next().unwrap_or('\\'));
                } else {
                    value.push(c);
                }
            }
        }
        if OURS.contains(&key.as_str()) {
            ours.push((key, value));
        } else {
            rest.push(format!("{key}='{}'", value.replace('\\', "\\\\").replace('\'', "\\'")));
        }
    }
    Ok((rest.join(" "), ours))
}

/// The same for a `postgresql://` URL: this module's keys are taken out of
/// its query (percent-decoded); the rest is left as written.
fn split_url(s: &str) -> Result<(String, Vec<(String, String)>), String> {
    let Some((base, query)) = s.split_once('?') else {
        return Ok((s.to_string(), Vec::new()));
    };
    let mut rest = Vec::new();
    let mut ours = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if OURS.contains(&k) {
            ours.push((k.to_string(), percent_decode(v)?));
        } else {
            rest.push(pair);
        }
    }
    Ok((
        if rest.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", rest.join("&"))
        },
        ours,
    ))
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = s
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| format!("PostgreSQL connection URL: bad percent escape in {s:?}"))?;
                out.push(hex);
                i += 3;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| format!("PostgreSQL connection URL: {s:?} is not UTF-8 once decoded"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_values_keep_quoting_and_lose_the_tls_keys() {
        let (rest, ours) =
            split_key_values("host=db port = 5432 sslmode=verify-full sslrootcert='/etc/my ca.pem' dbname=a\\ b")
                .unwrap();
        assert_eq!(
            ours,
            vec![
                ("sslmode".to_string(), "verify-full".to_string()),
                ("sslrootcert".to_string(), "/etc/my ca.pem".to_string())
            ]
        );
        assert!(!rest.contains("ssl"), "{rest}");
        let cfg = tokio_postgres::Config::from_str(&rest).unwrap();
        assert_eq!(cfg.get_dbname(), Some("a b"));
        assert_eq!(cfg.get_ports(), &[5432]);
        let (rest, _) = split_key_values(r"password='a\'b\\c'").unwrap();
        let cfg = tokio_postgres::Config::from_str(&rest).unwrap();
        assert_eq!(cfg.get_password(), Some(&b"a'b\\c"[..]));
        assert!(split_key_values("host").is_err());
        assert!(split_key_values("host='db").is_err());
    }

    #[test]
    fn urls_lose_the_tls_keys_from_their_query() {
        let (rest, ours) =
            split_url("postgresql://u@db:5433/app?sslmode=verify-full&application_name=x&sslrootcert=%2Fca%20x.pem")
                .unwrap();
        assert_eq!(rest, "postgresql://u@db:5433/app?application_name=x");
        assert_eq!(ours[1], ("sslrootcert".to_string(), "/ca x.pem".to_string()));
        let (rest, ours) = split_url("postgresql://u@db/app").unwrap();
        assert_eq!(rest, "postgresql://u@db/app");
        assert!(ours.is_empty());
    }

    #[test]
    fn plain_text_unless_told_and_never_unverified() {
        let s = parse("host=db user=u dbname=a").unwrap();
        assert_eq!(s.mode, SslMode::Disable);
        assert_eq!(s.config.get_ssl_mode(), PgSslMode::Disable);
        for (conn, says) in [
            ("host=db sslmode=require", "needs sslrootcert"),
            ("host=db sslmode=prefer", "needs sslrootcert"),
            ("host=db sslmode=allow", "not supported"),
            ("host=db sslmode=on", "not one of"),
            ("host=db sslrootcert=/x", "without sslmode"),
            ("host=db sslmode=disable sslrootcert=/x", "plain text"),
            ("host=db sslmode=verify-full sslrootcert=system", "not supported"),
            (
                "host=db sslmode=verify-full sslrootcert=/nonexistent.pem",
                "/nonexistent.pem",
            ),
            ("host=db sslcert=/c", "without sslkey"),
            ("host=/run/postgresql sslmode=verify-full sslrootcert=/x", "unix socket"),
        ] {
            let e = parse(conn).err().unwrap_or_else(|| panic!("{conn} accepted"));
            assert!(e.contains(says), "{conn}: {e}");
        }
    }
}
