//! A gRPC client transport that writes each request in one go.
//!
//! tonic's `Channel` sends through hyper's HTTP/2 client, whose body pipe
//! waits for send capacity before it hands the body's DATA to h2, and h2
//! assigns capacity only after the connection task has opened the stream
//! and flushed its HEADERS: so every request leaves in two writes (HEADERS,
//! then DATA), sometimes three (an empty end-of-stream DATA frame), and its
//! receiver wakes up for each (docs/benchmarks.md, 2026-12-03). Every call
//! of ours is unary with a small message, so this transport reads the
//! whole encoded message from tonic's body first and gives h2 the HEADERS
//! and the DATA (with END_STREAM) together; h2 buffers DATA sent before
//! the stream has capacity and writes both in the connection task's next
//! flush.
//!
//! [`UnaryChannel`] is a `tower::Service` that tonic's generated clients
//! take in place of a `Channel`. It connects on first use, keeps one
//! HTTP/2 connection, multiplexes calls on it, and connects again on the
//! next call after the connection failed. A ping every
//! [`KEEP_ALIVE_INTERVAL`] that is not answered within
//! [`KEEP_ALIVE_TIMEOUT`] closes the connection (its calls fail at once,
//! as with tonic's keep-alive). Errors keep tonic's codes: a failed connect
//! is UNAVAILABLE with tonic's `ConnectError` as its source (nothing was
//! sent); an HTTP/2 error is mapped by tonic as it maps hyper's.
//! A request body that is not complete at once (a client stream) is read
//! to its end before anything is sent; none of our calls streams.

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::Context;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use dtx_tls::ClientTls;
use http_body_util::BodyExt;
use tokio::io::AsyncRead;
use tokio::io::AsyncWrite;

/// How often an idle or busy connection is pinged.
pub const KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// How long a ping may go unanswered before the connection is closed.
pub const KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(5);
/// HTTP/2 receive windows, as hyper's client sets them by default.
const STREAM_WINDOW_BYTES: u32 = 2 * 1024 * 1024;
const CONNECTION_WINDOW_BYTES: u32 = 5 * 1024 * 1024;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A lazily connecting HTTP/2 connection for unary gRPC calls (see the
/// module's documentation). Cloning shares the connection.
#[derive(Clone)]
pub struct UnaryChannel {
    inner: Arc<Inner>,
}

struct Inner {
    /// `http://host:port` or `https://host:port`: the `:scheme` and
    /// `:authority` of every request.
    origin: http::Uri,
    host: String,
    port: u16,
    local_ip: Option<IpAddr>,
    connect_timeout: Duration,
    tls: Option<Arc<ClientTls>>,
    conn: tokio::sync::Mutex<Option<Connection>>,
}

/// The request handle of a live connection, and whether its task has ended
/// (then the next call connects again).
struct Connection {
    send: h2::client::SendRequest<Bytes>,
    ended: Arc<AtomicBool>,
}

impl UnaryChannel {
    /// A channel to `origin` (scheme, host and port; over TLS when `tls`
    /// is set). Nothing is connected until the first call.
    pub fn new(
        origin: http::Uri,
        local_ip: Option<IpAddr>,
        connect_timeout: Duration,
        tls: Option<Arc<ClientTls>>,
    ) -> Result<UnaryChannel, String> {
        let host = origin
            .host()
            .ok_or_else(|| format!("address {origin} has no host"))?
            .to_string();
        let port = origin.port_u16().unwrap_or(if tls.is_some() { 443 } else { 80 });
        Ok(UnaryChannel {
            inner: Arc::new(Inner {
                origin,
                host,
                port,
                local_ip,
                connect_timeout,
                tls,
                conn: tokio::sync::Mutex::new(None),
            }),
        })
    }
}

impl Inner {
    /// The connection's request handle, connecting first when there is
    /// none or the last one failed. A failure to connect is tonic's
    /// `ConnectError` (UNAVAILABLE, and callers can tell from the status's
    /// source that nothing was sent), as with tonic's channel.
    async fn sender(&self) -> Result<h2::client::SendRequest<Bytes>, BoxError> {
        let mut conn = self.conn.lock().await;
        if let Some(c) = conn.as_ref() {
            if !c.ended.load(Ordering::Acquire) {
                return Ok(c.send.clone());
            }
        }
        *conn = None;
        let connected = tokio::time::timeout(self.connect_timeout, self.connect())
            .await
            .unwrap_or_else(|_| {
                Err(format!(
                    "connecting to {}:{} took longer than {} ms",
                    self.host,
                    self.port,
                    self.connect_timeout.as_millis()
                )
                .into())
            });
        let c = connected.map_err(|e| {
            let e: BoxError = format!("cannot connect to {}:{}: {e}", self.host, self.port).into();
            Box::new(tonic::ConnectError(e)) as BoxError
        })?;
        let send = c.send.clone();
        *conn = Some(c);
        Ok(send)
    }

    async fn connect(&self) -> Result<Connection, BoxError> {
        match &self.tls {
            None => handshake(dtx_tls::client::connect_tcp(&self.host, self.port, self.local_ip).await?).await,
            Some(tls) => {
                handshake(dtx_tls::client::connect_tls(tls, &self.host, self.port, self.local_ip).await?).await
            }
        }
    }
}

/// The HTTP/2 handshake on `io`; the connection and its keep-alive run in
/// a task of their own until the connection ends.
async fn handshake<T>(io: T) -> Result<Connection, BoxError>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (send, mut connection) = h2::client::Builder::new()
        .initial_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .handshake::<_, Bytes>(io)
        .await?;
    let ping_pong = connection.ping_pong();
    let ended = Arc::new(AtomicBool::new(false));
    let mark = ended.clone();
    tokio::spawn(async move {
        let keep_alive = async move {
            let Some(mut pp) = ping_pong else {
                return std::future::pending::<()>().await;
            };
            loop {
                tokio::time::sleep(KEEP_ALIVE_INTERVAL).await;
                match tokio::time::timeout(KEEP_ALIVE_TIMEOUT, pp.ping(h2::Ping::opaque())).await {
                    Ok(Ok(_)) => {}
                    // Unanswered, or the connection is gone: close it.
                    _ => return,
                }
            }
        };
        tokio::select! {
            _ = &mut connection => {}
            _ = keep_alive => {}
        }
        mark.store(true, Ordering::Release);
    });
    Ok(Connection { send, ended })
}

impl tower_service::Service<http::Request<tonic::body::Body>> for UnaryChannel {
    type Response = http::Response<ResponseBody>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let inner = self.inner.clone();
        // As tonic's channel does: the request's own deadline
        // (`grpc-timeout`, `Request::set_timeout`) also bounds the wait
        // here, so a server that stopped answering (paused, cut off)
        // fails the call as CANCELLED when it runs out.
        let deadline = req.headers().get("grpc-timeout").and_then(grpc_timeout);
        let call = Self::send(inner, req);
        match deadline {
            None => Box::pin(call),
            Some(d) => Box::pin(async move {
                match tokio::time::timeout(d, call).await {
                    Ok(r) => r,
                    Err(_) => Err(tonic::TimeoutExpired(()).into()),
                }
            }),
        }
    }
}

/// Whether a failed call's `status` says nothing was sent: a failure to
/// connect, which this transport (as tonic's channel) reports with tonic's
/// `ConnectError`, TCP or TLS, in the status's source chain. Any other
/// failure may have reached the server.
pub fn nothing_sent(status: &tonic::Status) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(c) = cause {
        if c.downcast_ref::<tonic::ConnectError>().is_some() {
            return true;
        }
        cause = c.source();
    }
    false
}

/// A `grpc-timeout` header's duration (at most 8 digits and a unit: H, M,
/// S, m, u, n); `None` when it is malformed (then, as in tonic, no
/// deadline is applied here; the server refuses or ignores it).
pub fn grpc_timeout(v: &http::HeaderValue) -> Option<Duration> {
    let s = v.to_str().ok()?;
    let (digits, unit) = s.split_at(s.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

impl UnaryChannel {
    /// One call: the whole message read from tonic's body, then HEADERS
    /// and DATA handed to h2 together.
    async fn send(
        inner: Arc<Inner>,
        req: http::Request<tonic::body::Body>,
    ) -> Result<http::Response<ResponseBody>, BoxError> {
        let (mut parts, body) = req.into_parts();
        let message = body
            .collect()
            .await
            .map_err(|e| tonic::Status::internal(format!("encoding the request failed: {e}")))?
            .to_bytes();
        let mut uri = http::Uri::builder();
        if let Some(s) = inner.origin.scheme() {
            uri = uri.scheme(s.clone());
        }
        if let Some(a) = inner.origin.authority() {
            uri = uri.authority(a.clone());
        }
        if let Some(pq) = parts.uri.path_and_query() {
            uri = uri.path_and_query(pq.clone());
        }
        parts.uri = uri
            .build()
            .map_err(|e| tonic::Status::internal(format!("request address: {e}")))?;
        let request = http::Request::from_parts(parts, ());
        let sender = inner.sender().await?;
        let mut sender = sender.ready().await?;
        let (response, mut stream) = sender.send_request(request, message.is_empty())?;
        if !message.is_empty() {
            // Queued with the HEADERS: both leave in one write.
            stream.send_data(message, true)?;
        }
        let response = response.await?;
        Ok(response.map(|body| ResponseBody {
            body: Some(body),
            data_done: false,
        }))
    }
}

/// A response's body: its DATA frames, then its trailers (where gRPC puts
/// the status). Received bytes are given back to the flow-control window
/// as they are handed to tonic. The default is an empty body (what an
/// interceptor that refuses a call answers with).
#[derive(Default)]
pub struct ResponseBody {
    body: Option<h2::RecvStream>,
    data_done: bool,
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = h2::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, h2::Error>>> {
        let me = &mut *self;
        let Some(body) = me.body.as_mut() else {
            return Poll::Ready(None);
        };
        if !me.data_done {
            match body.poll_data(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(data))) => {
                    let _ = body.flow_control().release_capacity(data.len());
                    return Poll::Ready(Some(Ok(http_body::Frame::data(data))));
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => me.data_done = true,
            }
        }
        match body.poll_trailers(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Ok(Some(t))) => Poll::Ready(Some(Ok(http_body::Frame::trailers(t)))),
            Poll::Ready(Ok(None)) => Poll::Ready(None),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.body.as_ref().is_none_or(|b| b.is_end_stream())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Option<Duration> {
        grpc_timeout(&http::HeaderValue::from_str(s).unwrap())
    }

    #[test]
    fn grpc_timeout_headers_read_as_tonic_writes_them() {
        assert_eq!(t("5S"), Some(Duration::from_secs(5)));
        assert_eq!(t("250m"), Some(Duration::from_millis(250)));
        assert_eq!(t("1500000u"), Some(Duration::from_micros(1_500_000)));
        assert_eq!(t("99999999n"), Some(Duration::from_nanos(99_999_999)));
        assert_eq!(t("2M"), Some(Duration::from_secs(120)));
        assert_eq!(t("1H"), Some(Duration::from_secs(3600)));
        // Malformed: no deadline from it.
        for bad in ["", "S", "5", "5s", "123456789S", "-1S", "1.5S"] {
            assert_eq!(t(bad), None, "{bad:?}");
        }
    }
}
