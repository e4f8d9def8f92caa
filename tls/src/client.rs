//! The client side: [`ClientTls`] (a rustls client config that reloads
//! when its files change) and [`Connector`], the TCP-then-TLS connector a
//! tonic `Endpoint` is given.

use std::future::Future;
use std::io;
use std::net::IpAddr;
use std::net::SocketAddr;
use std::path::Path;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Context;
use std::task::Poll;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use tokio::net::TcpSocket;
use tokio::net::TcpStream;

use crate::error::TlsError;
use crate::files::load_certified_key_checking;
use crate::files::load_roots;
use crate::files::KeyPairFiles;

/// What a client's TLS is made of: the authority servers must be
/// certified by, this process's own certificate for mutual TLS (when
/// servers require one), and the name to check servers' certificates for
/// instead of the host of each address (when set).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientTlsFiles {
    pub ca: PathBuf,
    pub own: Option<KeyPairFiles>,
    pub server_name: Option<String>,
}

/// A client's TLS settings, reloaded from their files as
/// [`crate::ServerTls`] is.
pub struct ClientTls {
    files: ClientTlsFiles,
    server_name: Option<ServerName<'static>>,
    current: crate::files::Reloading<ClientConfig>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").field("files", &self.files).finish()
    }
}

#[derive(Debug)]
struct OwnCert(Arc<rustls::sign::CertifiedKey>);

impl rustls::client::ResolvesClientCert for OwnCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

fn build_client_config(files: &ClientTlsFiles, own_validity: bool) -> Result<ClientConfig, TlsError> {
    let roots = load_roots(&files.ca)?;
    let builder = ClientConfig::builder_with_provider(crate::crypto::provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_root_certificates(roots);
    let mut cfg = match &files.own {
        Some(own) => {
            builder.with_client_cert_resolver(Arc::new(OwnCert(load_certified_key_checking(own, own_validity)?)))
        }
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![crate::crypto::ALPN_H2.to_vec()];
    Ok(cfg)
}

impl ClientTls {
    /// Reads and checks every file (see [`crate::files`]).
    pub fn load(files: ClientTlsFiles) -> Result<Arc<ClientTls>, TlsError> {
        Self::load_checking(files, true)
    }

    /// As [`ClientTls::load`] but sends this process's certificate even
    /// when it is expired or not yet valid: for tests that check a
    /// server refuses such a certificate. Never use it elsewhere.
    #[doc(hidden)]
    pub fn load_without_own_validity_check(files: ClientTlsFiles) -> Result<Arc<ClientTls>, TlsError> {
        Self::load_checking(files, false)
    }

    fn load_checking(files: ClientTlsFiles, own_validity: bool) -> Result<Arc<ClientTls>, TlsError> {
        let server_name = match &files.server_name {
            None => None,
            Some(n) => {
                Some(ServerName::try_from(n.clone()).map_err(|e| TlsError::Config(format!("server name {n:?}: {e}")))?)
            }
        };
        let current =
            crate::files::Reloading::build(&Self::paths(&files), || build_client_config(&files, own_validity))?;
        Ok(Arc::new(ClientTls {
            current,
            files,
            server_name,
        }))
    }

    fn paths(files: &ClientTlsFiles) -> Vec<&Path> {
        let mut p: Vec<&Path> = vec![&files.ca];
        if let Some(o) = &files.own {
            p.push(&o.cert);
            p.push(&o.key);
        }
        p
    }

    pub fn files(&self) -> &ClientTlsFiles {
        &self.files
    }

    /// The settings new connections get.
    pub fn config(&self) -> Arc<ClientConfig> {
        self.current.current()
    }

    /// As [`crate::ServerTls::reload_if_changed`].
    pub fn reload_if_changed(&self) -> Result<bool, TlsError> {
        self.current
            .reload_if_changed(&Self::paths(&self.files), || build_client_config(&self.files, true))
    }

    /// As [`crate::ServerTls::spawn_reloader`].
    pub fn spawn_reloader(self: &Arc<Self>, interval: Duration, what: &'static str) -> tokio::task::JoinHandle<()> {
        crate::files::spawn_reload_loop(Arc::downgrade(self), interval, what, "client", |t| {
            t.reload_if_changed()
        })
    }

    /// The name a server at `host` must be certified for.
    fn server_name_for(&self, host: &str) -> io::Result<ServerName<'static>> {
        if let Some(n) = &self.server_name {
            return Ok(n.clone());
        }
        let h = host.trim_start_matches('[').trim_end_matches(']');
        ServerName::try_from(h.to_string())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("server name {h:?}: {e}")))
    }
}

/// Opens TCP connections (optionally from `local_ip`, with `TCP_NODELAY`)
/// and runs the TLS handshake on them; a tonic `Endpoint` is built with it
/// through `connect_with_connector_lazy`.
#[derive(Clone)]
pub struct Connector {
    tls: Arc<ClientTls>,
    local_ip: Option<IpAddr>,
    connect_timeout: Duration,
}

impl Connector {
    pub fn new(tls: Arc<ClientTls>, local_ip: Option<IpAddr>, connect_timeout: Duration) -> Connector {
        Connector {
            tls,
            local_ip,
            connect_timeout,
        }
    }
}

type Connecting = Pin<Box<dyn Future<Output = io::Result<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>> + Send>>;

impl tower_service::Service<http::Uri> for Connector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let me = self.clone();
        Box::pin(async move {
            let host = uri
                .host()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{uri} has no host")))?
                .to_string();
            let port = uri.port_u16().unwrap_or(443);
            match tokio::time::timeout(me.connect_timeout, connect_tls(&me.tls, &host, port, me.local_ip)).await {
                Ok(r) => r.map(TokioIo::new),
                Err(_) => Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("connecting to {host}:{port} took longer than {:?}", me.connect_timeout),
                )),
            }
        })
    }
}

/// A TCP connection to `host:port` (from `local_ip` when set) and the TLS
/// handshake on it, checking the server's name as `tls` says.
pub async fn connect_tls(
    tls: &ClientTls,
    host: &str,
    port: u16,
    local_ip: Option<IpAddr>,
) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let name = tls.server_name_for(host)?;
    let tcp = connect_tcp(host, port, local_ip).await?;
    tokio_rustls::TlsConnector::from(tls.config())
        .connect(name, tcp)
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("TLS handshake with {host}:{port} failed: {e}")))
}

/// A TCP connection to the first address of `host` that answers, from
/// `local_ip` when set, with `TCP_NODELAY`.
pub async fn connect_tcp(host: &str, port: u16, local_ip: Option<IpAddr>) -> io::Result<TcpStream> {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    let mut last = io::Error::new(io::ErrorKind::NotFound, format!("{h}:{port} resolves to no address"));
    for addr in tokio::net::lookup_host((h, port)).await? {
        match connect_one(addr, local_ip).await {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

async fn connect_one(addr: SocketAddr, local_ip: Option<IpAddr>) -> io::Result<TcpStream> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    if let Some(ip) = local_ip {
        socket.bind(SocketAddr::new(ip, 0))?;
    }
    let s = socket.connect(addr).await?;
    s.set_nodelay(true)?;
    Ok(s)
}
