//! The server side: [`ServerTls`] (a rustls server config that reloads
//! when its files change) and [`incoming`], the accepted connections of a
//! gRPC server, plain or TLS, each with a [`PeerInfo`].

use std::io;
use std::path::Path;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Context;
use std::task::Poll;
use std::time::Duration;

use futures::Stream;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::UnixTime;
use rustls::server::danger::ClientCertVerified;
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;
use tokio::io::AsyncRead;
use tokio::io::AsyncWrite;
use tokio::io::ReadBuf;
use tokio::net::TcpListener;
use tokio::net::TcpStream;
use tonic::transport::server::Connected;
use tonic::transport::server::TcpConnectInfo;
use tracing::warn;

use crate::logtext::clean;
use crate::logtext::Clean;
use crate::logtext::LogSummary;

use crate::admission::accept_error_kind;
use crate::admission::AcceptBackoff;
use crate::admission::Admission;
use crate::admission::AdmissionLimits;
use crate::admission::Refusal;
use crate::admission::Ticket;
use crate::admission::HTTP2_PREFACE;
use crate::error::TlsError;
use crate::files::load_certified_key;
use crate::files::load_roots;
use crate::files::KeyPairFiles;
use crate::identity::identity_of_cert;
use crate::identity::Identity;

/// Whether a TLS server asks callers for a certificate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientAuth {
    /// Every caller must present a certificate from the authority (mutual
    /// TLS); a handshake without one fails.
    Required,
    /// A certificate is asked for and checked when given; a caller without
    /// one may still connect and prove who it is with a bearer token.
    Optional,
}

impl ClientAuth {
    pub fn parse(s: &str) -> Result<ClientAuth, String> {
        match s {
            "required" => Ok(ClientAuth::Required),
            "optional" => Ok(ClientAuth::Optional),
            _ => Err(format!("client_auth {s:?}: expected \"required\" or \"optional\"")),
        }
    }
}

/// What a server's TLS is made of: its certificate and key, the authority
/// its callers' certificates must come from, and whether they must have one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerTlsFiles {
    pub own: KeyPairFiles,
    pub ca: PathBuf,
    pub client_auth: ClientAuth,
}

/// A server's TLS settings, reloaded from their files while the process
/// runs: new connections use the newest good files, open connections keep
/// theirs, and a reload that fails (a half-written file, an expired
/// certificate) keeps the previous settings and says why.
pub struct ServerTls {
    files: ServerTlsFiles,
    current: crate::files::Reloading<Built>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").field("files", &self.files).finish()
    }
}

/// A server's rustls config and the verifier that judges its callers'
/// certificates after the handshake.
struct Built {
    config: Arc<ServerConfig>,
    verifier: Arc<dyn ClientCertVerifier>,
}

fn build_server_config(files: &ServerTlsFiles) -> Result<Built, TlsError> {
    let key = load_certified_key(&files.own)?;
    let roots = load_roots(&files.ca)?;
    let verifier = WebPkiClientVerifier::builder_with_provider(roots, crate::crypto::provider())
        .allow_unauthenticated()
        .build()
        .map_err(|e| TlsError::Config(format!("client certificate verifier: {e}")))?;
    let mut cfg = ServerConfig::builder_with_provider(crate::crypto::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_client_cert_verifier(Arc::new(JudgedLater(verifier.clone())))
        .with_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(key)));
    cfg.alpn_protocols = vec![crate::crypto::ALPN_H2.to_vec()];
    Ok(Built {
        config: Arc::new(cfg),
        verifier,
    })
}

/// The client-certificate verifier the handshake runs: it asks for a
/// certificate, checks that the caller holds the certificate's private key
/// (the handshake signature, delegated), but lets the chain be judged
/// after the handshake ([`judge`]), so a caller with no certificate, an
/// expired one or one from another authority gets an `UNAUTHENTICATED`
/// answer that says why, instead of a handshake failure whose alert its
/// TLS library may or may not report. Until [`judge`] passes it, a
/// connection has no identity: the edge layer refuses every call on it.
#[derive(Debug)]
struct JudgedLater(Arc<dyn ClientCertVerifier>);

impl ClientCertVerifier for JudgedLater {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        false
    }

    fn root_hint_subjects(&self) -> &[rustls::DistinguishedName] {
        self.0.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        // Judged after the handshake (see the type's documentation).
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The identity a connection's client certificate chain proves, checked
/// against the authority now; or why it proves none.
fn judge(
    verifier: &dyn ClientCertVerifier,
    chain: Option<&[CertificateDer<'static>]>,
) -> (Option<Identity>, Option<String>) {
    let Some((leaf, intermediates)) = chain.and_then(|c| c.split_first()) else {
        return (None, None);
    };
    if let Err(e) = verifier.verify_client_cert(leaf, intermediates, UnixTime::now()) {
        let why = match &e {
            rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer) => {
                "the client certificate is not from this server's certificate authority (UnknownIssuer)".to_string()
            }
            _ => format!("the client certificate was refused: {e}"),
        };
        return (None, Some(clean(&why)));
    }
    match identity_of_cert(leaf) {
        Ok(id) => (Some(id), None),
        // The reason may quote the certificate's subject or names, which
        // its holder chose: escaped and bounded.
        Err(why) => (None, Some(clean(&why))),
    }
}

impl ServerTls {
    /// Reads and checks every file (see [`crate::files`]).
    pub fn load(files: ServerTlsFiles) -> Result<Arc<ServerTls>, TlsError> {
        let current = crate::files::Reloading::build(&Self::paths(&files), || build_server_config(&files))?;
        Ok(Arc::new(ServerTls { current, files }))
    }

    fn paths(files: &ServerTlsFiles) -> [&Path; 3] {
        [&files.own.cert, &files.own.key, &files.ca]
    }

    pub fn files(&self) -> &ServerTlsFiles {
        &self.files
    }

    pub fn client_auth(&self) -> ClientAuth {
        self.files.client_auth
    }

    /// The settings new connections get.
    pub fn config(&self) -> Arc<ServerConfig> {
        self.built().config.clone()
    }

    fn built(&self) -> Arc<Built> {
        self.current.current()
    }

    /// Reads the files again if any changed since the last load. Returns
    /// Ok(true) when new settings were taken, Ok(false) when nothing
    /// changed, and the error (settings kept) when the new files are bad.
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        self.current
            .reload_if_changed(&Self::paths(&self.files), || build_server_config(&self.files))
    }

    /// Checks the files every `interval` and takes new ones (see
    /// [`ServerTls::reload_if_changed`]), until the returned task is
    /// aborted or the last other reference to `self` is gone.
    pub fn spawn_reloader(self: &Arc<Self>, interval: Duration, what: &'static str) -> tokio::task::JoinHandle<()> {
        crate::files::spawn_reload_loop(Arc::downgrade(self), interval, what, "server", |t| {
            t.reload_if_changed()
        })
    }
}

/// Who is on the other end of an accepted connection; handlers and layers
/// read it from the request's extensions.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub tcp: TcpConnectInfo,
    /// The connection is TLS.
    pub tls: bool,
    /// The identity its client certificate names, if it presented one and
    /// the certificate names one.
    pub identity: Option<Identity>,
    /// Why a presented certificate proves no identity (not from the
    /// authority, expired, no `dtx://` name).
    pub certificate_problem: Option<String>,
    /// The port requires a client certificate (a bearer token does not
    /// do instead).
    pub certificate_required: bool,
}

/// One accepted connection: its stream, who is calling, the bytes read
/// ahead to check it speaks HTTP/2 (given to the server first), and its
/// place in the server's connection counts (given back when the server
/// drops it).
pub struct Conn {
    io: ConnIo,
    peer: PeerInfo,
    replay: Vec<u8>,
    replay_at: usize,
    _ticket: Option<Ticket>,
}

enum ConnIo {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl Conn {
    /// Who is calling.
    pub fn peer(&self) -> &PeerInfo {
        &self.peer
    }
}

impl Connected for Conn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.peer.clone()
    }
}

impl AsyncRead for ConnIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ConnIo::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ConnIo::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncRead for Conn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        if me.replay_at < me.replay.len() {
            let n = (me.replay.len() - me.replay_at).min(buf.remaining());
            buf.put_slice(&me.replay[me.replay_at..me.replay_at + n]);
            me.replay_at += n;
            if me.replay_at == me.replay.len() {
                me.replay = Vec::new();
                me.replay_at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut me.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            ConnIo::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ConnIo::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            ConnIo::Plain(s) => Pin::new(s).poll_flush(cx),
            ConnIo::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            ConnIo::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ConnIo::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            ConnIo::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            ConnIo::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            ConnIo::Plain(s) => s.is_write_vectored(),
            ConnIo::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// Longest a TLS handshake may take before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections checked but not yet taken by the server.
const ACCEPTED_QUEUE_MAX: usize = 256;

/// [`incoming_with`] with the default [`AdmissionLimits`].
pub fn incoming(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
) -> Pin<Box<dyn Stream<Item = Result<Conn, io::Error>> + Send>> {
    incoming_with(listener, tls, AdmissionLimits::default())
}

/// The accepted connections of a server on `listener`: `TCP_NODELAY` and
/// keep-alive on every socket (tonic sets them only on listeners it binds
/// itself) and, with `tls`, a TLS handshake first. Each connection is
/// admitted within `limits` (crate::admission: in all, per address,
/// anonymous) and must send the HTTP/2 preface within
/// `limits.preface_timeout`; only then does the server get it. Handshakes
/// and prefaces are awaited concurrently (a slow or silent caller holds up
/// no one), each bounded ([`HANDSHAKE_TIMEOUT`]); a failed handshake is
/// logged and counted (`dtx_tls_handshake_failures_total`), a refused
/// connection counted (`dtx_connections_refused_total{reason}`, logged at
/// debug: a caller must not be able to fill the log), and a failing
/// accept (out of file descriptors) backs off instead of spinning
/// (`dtx_accept_errors_total{kind}`, one log line per 10 s).
pub fn incoming_with(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
    limits: AdmissionLimits,
) -> Pin<Box<dyn Stream<Item = Result<Conn, io::Error>> + Send>> {
    use futures::StreamExt;
    let tcp = tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(30)));
    let admission = Admission::new(limits);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Conn>(ACCEPTED_QUEUE_MAX);
    tokio::spawn(async move {
        let mut tcp = tcp;
        let mut backoff = AcceptBackoff::default();
        loop {
            let next = tokio::select! {
                n = tcp.next() => n,
                _ = tx.closed() => return,
            };
            let stream = match next {
                Some(Ok(s)) => {
                    backoff.accepted();
                    s
                }
                Some(Err(e)) => {
                    metrics::counter!("dtx_accept_errors_total", "kind" => accept_error_kind(&e)).increment(1);
                    let (wait, line) = backoff.failed(&e, std::time::Instant::now());
                    if let Some(line) = line {
                        warn!("{line}");
                    }
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = tx.closed() => return,
                    }
                    continue;
                }
                None => return,
            };
            let tcp_info = stream.connect_info();
            let ticket = match tcp_info.remote_addr.map(|a| admission.admit(a.ip())) {
                Some(Ok(t)) => Some(t),
                Some(Err(why)) => {
                    refused(&tcp_info, why);
                    continue;
                }
                None => None,
            };
            let tx = tx.clone();
            let tls = tls.clone();
            let admission = admission.clone();
            tokio::spawn(async move {
                let Some(mut conn) = establish(stream, tcp_info, tls, ticket, &admission).await else {
                    return;
                };
                if read_preface(&mut conn, admission.limits().preface_timeout).await {
                    let _ = tx.send(conn).await;
                }
            });
        }
    });
    Box::pin(futures::stream::poll_fn(move |cx| rx.poll_recv(cx).map(|c| c.map(Ok))))
}

/// The connection after its TLS handshake (or as it is, on a plain port),
/// with its peer; `None` when the handshake failed or an anonymous caller
/// found no room.
async fn establish(
    stream: TcpStream,
    tcp_info: TcpConnectInfo,
    tls: Option<Arc<ServerTls>>,
    mut ticket: Option<Ticket>,
    admission: &Admission,
) -> Option<Conn> {
    let Some(tls) = tls else {
        return Some(Conn {
            io: ConnIo::Plain(stream),
            peer: PeerInfo {
                tcp: tcp_info,
                tls: false,
                identity: None,
                certificate_problem: None,
                certificate_required: false,
            },
            replay: Vec::new(),
            replay_at: 0,
            _ticket: ticket,
        });
    };
    let built = tls.built();
    let certificate_required = tls.client_auth() == ClientAuth::Required;
    let acceptor = tokio_rustls::TlsAcceptor::from(built.config.clone());
    let s = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
            // Closed before saying anything: a port probe (a health
            // check's TCP connect), not worth a warning.
            metrics::counter!("dtx_tls_handshake_failures_total").increment(1);
            tracing::debug!(remote = ?tcp_info.remote_addr, "connection closed before a TLS handshake: {e}");
            return None;
        }
        Ok(Err(e)) => {
            handshake_failed(&tcp_info, &e.to_string());
            return None;
        }
        Err(_) => {
            handshake_failed(&tcp_info, &format!("no handshake within {HANDSHAKE_TIMEOUT:?}"));
            return None;
        }
    };
    let (identity, certificate_problem) = judge(built.verifier.as_ref(), s.get_ref().1.peer_certificates());
    if let Some(why) = &certificate_problem {
        metrics::counter!("dtx_tls_client_certificates_refused_total").increment(1);
        // Summed up per kind of refusal, so each kind is logged at least
        // once per interval (the kind is ours, never the caller's text).
        let kind = certificate_refusal_kind(why);
        if let Some(held) = note_connection(kind, &tcp_info) {
            warn!(remote = ?tcp_info.remote_addr, held_back = held, "client certificate refused: {why}");
        }
    }
    if identity.is_none() {
        if let Some(t) = ticket.as_mut() {
            if let Err(why) = admission.count_anonymous(t) {
                refused(&tcp_info, why);
                return None;
            }
        }
    }
    Some(Conn {
        io: ConnIo::Tls(Box::new(s)),
        peer: PeerInfo {
            tcp: tcp_info,
            tls: true,
            identity,
            certificate_problem,
            certificate_required,
        },
        replay: Vec::new(),
        replay_at: 0,
        _ticket: ticket,
    })
}

/// Reads the HTTP/2 preface within `timeout` and keeps it for the server;
/// false (the connection is to be dropped, counted) when it does not come
/// in time or is not HTTP/2's.
async fn read_preface(conn: &mut Conn, timeout: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut preface = [0u8; HTTP2_PREFACE.len()];
    match tokio::time::timeout(timeout, conn.io.read_exact(&mut preface)).await {
        Ok(Ok(_)) if &preface == HTTP2_PREFACE => {
            conn.replay = preface.to_vec();
            conn.replay_at = 0;
            true
        }
        Ok(Ok(_)) => {
            refused(&conn.peer.tcp, Refusal::NotHttp2);
            false
        }
        // Closed before a whole preface: nothing to say.
        Ok(Err(_)) => false,
        Err(_) => {
            refused(&conn.peer.tcp, Refusal::NoPreface);
            false
        }
    }
}

/// Counts a connection not admitted; logged at debug only (the count is
/// what an operator watches: a caller must not be able to fill the log).
fn refused(peer: &TcpConnectInfo, why: Refusal) {
    metrics::counter!("dtx_connections_refused_total", "reason" => why.label()).increment(1);
    tracing::debug!(remote = ?peer.remote_addr, reason = why.label(), "connection closed");
}

fn handshake_failed(peer: &TcpConnectInfo, why: &str) {
    metrics::counter!("dtx_tls_handshake_failures_total").increment(1);
    if let Some(held) = note_connection("TLS handshakes refused", peer) {
        warn!(
            remote = ?peer.remote_addr,
            held_back = held,
            "TLS handshake refused: {}",
            Clean(why)
        );
    }
}

/// The summary key of a refused client certificate: one of a few fixed
/// kinds, so a caller's certificate text cannot make keys without end.
fn certificate_refusal_kind(why: &str) -> &'static str {
    let w = why.to_ascii_lowercase();
    if w.contains("expired") {
        "client certificates refused (expired)"
    } else if w.contains("notvalidyet") || w.contains("not valid yet") || w.contains("not yet valid") {
        "client certificates refused (not yet valid)"
    } else if w.contains("unknownissuer") || w.contains("unknown issuer") {
        "client certificates refused (unknown issuer)"
    } else if w.contains("revoked") {
        "client certificates refused (revoked)"
    } else {
        "client certificates refused"
    }
}

/// Whether to log a refused handshake or client certificate of `peer`
/// now (`Some(lines held back since the last)`): one line per kind and
/// caller address per `logtext::SUMMARY_INTERVAL`, the rest counted and
/// summed up (a caller who does not authenticate must not be able to
/// fill the log; invariant 12). One table for the whole process.
fn note_connection(what: &'static str, peer: &TcpConnectInfo) -> Option<u64> {
    static NOTES: std::sync::OnceLock<Arc<LogSummary>> = std::sync::OnceLock::new();
    let notes = NOTES.get_or_init(|| {
        let n = Arc::new(LogSummary::default());
        n.spawn_flusher(|key, held| {
            warn!(
                held_back = held,
                "{held} more {key} in the last {}s (each counted in its metric)",
                crate::logtext::SUMMARY_INTERVAL.as_secs()
            )
        });
        n
    });
    let who = peer
        .remote_addr
        .map_or_else(|| "an unknown address".to_string(), |a| a.ip().to_string());
    notes.note(&format!("{what} from {who}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dev::DevCa;
    use crate::dev::DEV_LIFETIME;
    use crate::files::KeyPairFiles;
    use crate::identity::Role;

    /// A throwaway authority `name` in `dir`, and a node's server TLS from
    /// it asking for client certificates as `client_auth` says.
    fn authority_and_server(dir: &std::path::Path, name: &str, client_auth: ClientAuth) -> (DevCa, Arc<ServerTls>) {
        let ca = DevCa::new(name).unwrap();
        let ca_path = ca.write_ca(dir).unwrap();
        let own = ca.issue_to(dir, "server", Role::Node, "1", &[], DEV_LIFETIME).unwrap();
        let tls = ServerTls::load(ServerTlsFiles {
            own,
            ca: ca_path,
            client_auth,
        })
        .unwrap();
        (ca, tls)
    }

    /// The post-handshake judgement is the only thing that gives a
    /// connection an identity: a chain from the authority, valid now,
    /// naming one; anything else gets none, and a reason.
    #[test]
    fn only_a_valid_chain_from_the_authority_proves_an_identity() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, tls) = authority_and_server(dir.path(), "judge ca", ClientAuth::Required);
        let v = tls.built().verifier.clone();
        let chain = |files: &KeyPairFiles| crate::files::load_certs("certificate", &files.cert).unwrap();

        let good = ca
            .issue_to(dir.path(), "good", Role::Application, "shop", &[], DEV_LIFETIME)
            .unwrap();
        let (id, why) = judge(v.as_ref(), Some(&chain(&good)));
        assert_eq!(id.map(|i| i.label()).as_deref(), Some("application/shop"), "{why:?}");

        let other = DevCa::new("another").unwrap();
        let stranger = other
            .issue_to(dir.path(), "stranger", Role::Operator, "mallory", &[], DEV_LIFETIME)
            .unwrap();
        let (id, why) = judge(v.as_ref(), Some(&chain(&stranger)));
        assert!(id.is_none());
        assert!(why.unwrap().contains("UnknownIssuer"));

        let old = ca
            .issue_to(
                dir.path(),
                "old",
                Role::Operator,
                "old",
                &[],
                crate::dev::Lifetime::Expired,
            )
            .unwrap();
        let (id, why) = judge(v.as_ref(), Some(&chain(&old)));
        assert!(id.is_none());
        assert!(why.unwrap().contains("expired"));

        assert_eq!(judge(v.as_ref(), None), (None, None));
        assert_eq!(judge(v.as_ref(), Some(&[])), (None, None));
    }

    /// A certificate from the authority whose subject (chosen by its holder)
    /// holds a newline and a long name, and no `dtx://` name: the reason it
    /// proves no identity (logged, and sent back in the refusal) is one line,
    /// escaped and bounded.
    #[test]
    fn inv12_a_refused_certificate_s_subject_is_escaped_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let (ca, tls) = authority_and_server(dir.path(), "subject ca", ClientAuth::Optional);
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        let forged = format!(
            "x\n2030-01-01T00:00:00.000000Z  INFO coordinator: operator/root resolved every transaction {}",
            "A".repeat(3000)
        );
        params.distinguished_name.push(rcgen::DnType::CommonName, forged);
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let (pem, _key) = ca.issue_raw(params);
        let chain: Vec<CertificateDer<'static>> = rustls_pemfile_certs(&pem);
        let (id, why) = judge(tls.built().verifier.as_ref(), Some(&chain));
        assert!(id.is_none());
        let why = why.expect("a reason");
        assert!(why.starts_with("the client certificate (CN=x"), "{why}");
        assert!(
            !why.contains('\n'),
            "a newline from the subject reached the reason: {why}"
        );
        assert!(why.contains("x\\n2030"), "the newline is shown escaped: {why}");
        assert!(
            why.len() <= crate::logtext::CALLER_TEXT_BYTES_MAX + 20,
            "{} bytes: {why}",
            why.len()
        );
    }

    fn rustls_pemfile_certs(pem: &str) -> Vec<CertificateDer<'static>> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.pem");
        std::fs::write(&p, pem).unwrap();
        crate::files::load_certs("certificate", &p).unwrap()
    }

    #[test]
    fn a_changed_certificate_is_taken_and_a_bad_one_keeps_the_old() {
        let dir = tempfile::tempdir().unwrap();
        let ca = DevCa::new("reload ca").unwrap();
        let ca_path = ca.write_ca(dir.path()).unwrap();
        let own = ca
            .issue_to(dir.path(), "node-1", Role::Node, "1", &[], DEV_LIFETIME)
            .unwrap();
        let tls = ServerTls::load(ServerTlsFiles {
            own: own.clone(),
            ca: ca_path,
            client_auth: ClientAuth::Required,
        })
        .unwrap();
        let first = tls.config();
        assert!(!tls.reload_if_changed().unwrap(), "nothing changed");
        assert!(Arc::ptr_eq(&first, &tls.config()));

        // A new certificate from the same authority (a rotation).
        ca.issue_to(dir.path(), "node-1", Role::Node, "1", &[], DEV_LIFETIME)
            .unwrap();
        assert!(tls.reload_if_changed().unwrap(), "the new files are taken");
        let second = tls.config();
        assert!(!Arc::ptr_eq(&first, &second));

        // A half-written (here: empty) certificate is refused and the
        // settings stay; once it is whole again it is taken.
        std::fs::write(&own.cert, b"").unwrap();
        let e = tls.reload_if_changed().unwrap_err();
        assert!(e.to_string().contains("no PEM CERTIFICATE"), "{e}");
        assert!(Arc::ptr_eq(&second, &tls.config()), "the previous settings are kept");
        ca.issue_to(dir.path(), "node-1", Role::Node, "1", &[], DEV_LIFETIME)
            .unwrap();
        assert!(tls.reload_if_changed().unwrap());
        assert!(!Arc::ptr_eq(&second, &tls.config()));
    }
}
