//! The edge of every server of ours: one tower layer in front of its gRPC
//! services that authenticates and authorises each call, limits the rate
//! of each identity, and answers requests that cannot be decoded with
//! `INVALID_ARGUMENT`.
//!
//! The caller's identity is its client certificate's (see
//! [`crate::identity`]) or, when it presented none, the one its bearer
//! token (`authorization: Bearer <token>`) stands for. The policy says
//! which roles may call each method (by its gRPC path). A call without an
//! identity is refused `UNAUTHENTICATED`, a call whose role may not call
//! the method `PERMISSION_DENIED`; both are counted
//! (`dtx_auth_refusals_total`, by server and code) and logged in summary:
//! the first refusal of each caller address and code in full, then one
//! line per [`crate::logtext::SUMMARY_INTERVAL`] with how many more were
//! refused (invariant 12: a caller who cannot authenticate must not be able
//! to fill the log). The method path, like all caller-chosen text, is
//! escaped and cut to [`crate::logtext::CALLER_TEXT_BYTES_MAX`] bytes in
//! the log and in the refusal's message. An admitted call carries its
//! [`Identity`] in the request's extensions.
//!
//! A node identity is honoured only where the [`NodeCheck`] given to
//! [`EdgeLayer::with_node_check`] admits its name (a coordinator: a current
//! member's id); a certificate that was presented and refused is refused
//! `UNAUTHENTICATED` even when a bearer token comes with it.
//!
//! With [`RateLimit`] set, each identity (nodes excepted: a follower's
//! forwarded calls were counted where they arrived) may make that many
//! calls per second, with bursts up to `burst`; a call over it is refused
//! `RESOURCE_EXHAUSTED` before anything runs (counted in
//! `dtx_rate_limited_total`). Without authentication there is no identity
//! and no rate limit.
//!
//! Every refusal made here carries the server's "not applied" marker
//! (given to [`EdgeLayer::marking_not_applied`]), so a client knows the
//! call had no effect.
//!
//! tonic answers a request whose body is not a valid message of its type
//! with `INTERNAL` ("failed to decode Protobuf message"), which a client
//! must read as "may have been applied". The layer turns that answer into
//! `INVALID_ARGUMENT` with the not-applied marker: nothing ran.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::task::Context;
use std::task::Poll;
use std::time::Instant;

use tracing::warn;

use crate::identity::Identity;
use crate::identity::Role;
use crate::identity::Tokens;
use crate::logtext::Clean;
use crate::logtext::LogSummary;
use crate::server::PeerInfo;

/// Who may call one method.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Anyone, without proving who they are (health checks).
    Open,
    /// Callers with one of these roles.
    Roles(&'static [Role]),
}

/// A server's method table: the access of each gRPC path
/// (`/package.Service/Method`). Paths it does not know should map to
/// `Access::Roles(&[])`, refused for everyone.
pub type AuthPolicy = fn(&str) -> Access;

/// Whether a node identity (its name, a node id) is honoured now: Ok, or
/// why not (for example "node 9 is not a member of this cluster"). A
/// coordinator node answers from its current membership.
pub type NodeCheck = Arc<dyn Fn(&str) -> Result<(), String> + Send + Sync>;

/// Calls per second each identity may make.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateLimit {
    /// Sustained calls per second.
    pub per_s: f64,
    /// Calls that may come at once after a quiet time.
    pub burst: f64,
}

/// The layer; see the module documentation.
#[derive(Clone)]
pub struct EdgeLayer {
    inner: Arc<Checker>,
}

struct Checker {
    server: &'static str,
    tokens: Tokens,
    policy: AuthPolicy,
    rate: Option<RateLimit>,
    not_applied_header: Option<&'static str>,
    node_check: Option<NodeCheck>,
    /// Per identity label: tokens left and when they were counted.
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
    /// Refusals logged per caller address and code (see the module
    /// documentation); its summary task starts with the first refusal.
    refusals: Arc<LogSummary>,
    summaries_started: std::sync::Once,
}

/// Identities whose buckets are kept at most; past it, full idle buckets
/// are dropped (a full bucket is what a new one would be).
const RATE_BUCKETS_MAX: usize = 10_000;

impl EdgeLayer {
    /// `server` names the port in logs and metrics ("api", "raft",
    /// "participant").
    pub fn new(server: &'static str, tokens: Tokens, policy: AuthPolicy) -> EdgeLayer {
        EdgeLayer {
            inner: Arc::new(Checker {
                server,
                tokens,
                policy,
                rate: None,
                not_applied_header: None,
                node_check: None,
                buckets: Mutex::new(HashMap::new()),
                refusals: Arc::new(LogSummary::default()),
                summaries_started: std::sync::Once::new(),
            }),
        }
    }

    /// Limits each identity's calls (see the module documentation).
    pub fn with_rate_limit(self, rate: Option<RateLimit>) -> EdgeLayer {
        self.map(|c| c.rate = rate)
    }

    /// Honours a node identity only when `check` says so; others are
    /// refused `PERMISSION_DENIED` with its reason. Without it every node
    /// identity from the authority is honoured.
    pub fn with_node_check(self, check: Option<NodeCheck>) -> EdgeLayer {
        self.map(|c| c.node_check = check)
    }

    /// Metadata key (value "1") put on every refusal made here.
    pub fn marking_not_applied(self, header: &'static str) -> EdgeLayer {
        self.map(|c| c.not_applied_header = Some(header))
    }

    fn map(self, f: impl FnOnce(&mut Checker)) -> EdgeLayer {
        let mut c = Arc::try_unwrap(self.inner).unwrap_or_else(|shared| Checker {
            server: shared.server,
            tokens: shared.tokens.clone(),
            policy: shared.policy,
            rate: shared.rate,
            not_applied_header: shared.not_applied_header,
            node_check: shared.node_check.clone(),
            buckets: Mutex::new(HashMap::new()),
            refusals: Arc::new(LogSummary::default()),
            summaries_started: std::sync::Once::new(),
        });
        f(&mut c);
        EdgeLayer { inner: Arc::new(c) }
    }
}

impl<S> tower_layer::Layer<S> for EdgeLayer {
    type Service = EdgeService<S>;

    fn layer(&self, inner: S) -> EdgeService<S> {
        EdgeService {
            inner,
            checker: self.inner.clone(),
        }
    }
}

#[derive(Clone)]
pub struct EdgeService<S> {
    inner: S,
    checker: Arc<Checker>,
}

fn permission_denied(identity: &Identity, path: &str, roles: &[Role]) -> tonic::Status {
    let allowed: Vec<&str> = roles.iter().map(|r| r.as_str()).collect();
    tonic::Status::permission_denied(format!(
        "{identity} may not call {} (allowed roles: {})",
        Clean(path),
        if allowed.is_empty() {
            "none".to_string()
        } else {
            allowed.join(", ")
        }
    ))
}

/// The bearer token of a request, if it carries one.
fn bearer<B>(req: &http::Request<B>) -> Option<&str> {
    let v = req.headers().get(http::header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then_some(token.trim())
}

impl Checker {
    /// The caller's identity, or the status refusing the call.
    fn check<B>(&self, req: &http::Request<B>) -> Result<Option<Identity>, tonic::Status> {
        let raw_path = req.uri().path();
        let access = (self.policy)(raw_path);
        // The path as refusals show it: escaped and bounded (logtext).
        let path = Clean(raw_path);
        let roles = match access {
            Access::Open => return Ok(None),
            Access::Roles(r) => r,
        };
        let peer = req.extensions().get::<PeerInfo>();
        let identity = match peer.and_then(|p| p.identity.clone()) {
            Some(id) => id,
            None if peer.is_some_and(|p| p.certificate_required) => {
                let why = peer
                    .and_then(|p| p.certificate_problem.clone())
                    .unwrap_or_else(|| "no client certificate".to_string());
                return Err(tonic::Status::unauthenticated(format!(
                    "{why}; this port requires a client certificate from its certificate authority ({path})"
                )));
            }
            // A certificate that was presented and refused is refused as
            // such: a token beside it does not stand in for it.
            None if peer.is_some_and(|p| p.certificate_problem.is_some()) => {
                let why = peer.and_then(|p| p.certificate_problem.clone()).unwrap_or_default();
                return Err(tonic::Status::unauthenticated(format!(
                    "{why}; a refused client certificate is not replaced by a bearer token ({path})"
                )));
            }
            None => match bearer(req) {
                Some(t) => self
                    .tokens
                    .check(t)
                    .ok_or_else(|| tonic::Status::unauthenticated("the bearer token is not one this server accepts"))?,
                None => {
                    let why = match peer.and_then(|p| p.certificate_problem.clone()) {
                        Some(problem) => problem,
                        None => "no client certificate and no bearer token".to_string(),
                    };
                    return Err(tonic::Status::unauthenticated(format!(
                        "{why}; {path} needs an identity"
                    )));
                }
            },
        };
        if !roles.contains(&identity.role) {
            return Err(permission_denied(&identity, raw_path, roles));
        }
        if identity.role == Role::Node {
            if let Some(check) = &self.node_check {
                check(&identity.name).map_err(|why| {
                    tonic::Status::permission_denied(format!("{identity} is not honoured here: {why} ({path})"))
                })?;
            }
        }
        if identity.role != Role::Node && !self.admit(&identity.label()) {
            let r = self.rate.expect("admit refuses only with a limit");
            return Err(tonic::Status::resource_exhausted(format!(
                "{identity} is over its limit of {} calls per second (burst {}); slow down and retry",
                r.per_s, r.burst
            )));
        }
        Ok(Some(identity))
    }

    /// Takes one call from `label`'s bucket; false when it is empty.
    fn admit(&self, label: &str) -> bool {
        self.admit_at(label, Instant::now())
    }

    /// [`Checker::admit`] at `now` (pure but for the table).
    fn admit_at(&self, label: &str, now: Instant) -> bool {
        let Some(r) = self.rate else { return true };
        let mut buckets = self.buckets.lock().expect("rate buckets lock");
        if buckets.len() >= RATE_BUCKETS_MAX && !buckets.contains_key(label) {
            buckets.retain(|_, (tokens, at)| {
                let refilled = *tokens + now.saturating_duration_since(*at).as_secs_f64() * r.per_s;
                refilled < r.burst
            });
        }
        let (tokens, at) = buckets.entry(label.to_string()).or_insert((r.burst, now));
        *tokens = (*tokens + now.saturating_duration_since(*at).as_secs_f64() * r.per_s).min(r.burst);
        *at = (*at).max(now);
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Logs a refusal, in summary (see the module documentation): the
    /// key is the caller's IP address and the code.
    fn log_refusal(&self, remote: Option<std::net::SocketAddr>, code: &'static str, path: &str, message: &str) {
        let server = self.server;
        self.summaries_started.call_once(|| {
            self.refusals.spawn_flusher(move |key, held| {
                warn!(
                    server,
                    held_back = held,
                    "{held} more calls refused ({key}) in the last {}s; see dtx_auth_refusals_total",
                    crate::logtext::SUMMARY_INTERVAL.as_secs()
                );
            });
        });
        let who = remote.map_or_else(|| "an unknown address".to_string(), |a| a.ip().to_string());
        let key = format!("{code} from {who}");
        let Some(held) = self.refusals.note(&key) else {
            return;
        };
        let method = Clean(path);
        let message = Clean(message);
        if held == 0 {
            warn!(server, ?remote, %method, "call refused: {message}");
        } else {
            warn!(
                server,
                ?remote,
                %method,
                held_back = held,
                "call refused: {message} ({held} more refusals of {key} were not logged)"
            );
        }
    }

    fn mark(&self, status: &mut tonic::Status) {
        if let Some(h) = self.not_applied_header {
            status
                .metadata_mut()
                .insert(h, tonic::metadata::MetadataValue::from_static("1"));
        }
    }

    /// tonic's answer to an undecodable request, made INVALID_ARGUMENT.
    fn undecodable<RB>(&self, resp: &mut http::Response<RB>) {
        let Some(status) = tonic::Status::from_header_map(resp.headers()) else {
            return;
        };
        let undecodable =
            status.code() == tonic::Code::Internal && status.message().starts_with("failed to decode Protobuf message");
        let too_large =
            status.code() == tonic::Code::OutOfRange && status.message().contains("decoded message length too large");
        let mut s = if undecodable {
            tonic::Status::invalid_argument(format!(
                "the request is not a valid message of its type ({}); nothing was done",
                status.message()
            ))
        } else if too_large {
            tonic::Status::invalid_argument(format!(
                "the request is larger than this server decodes ({}); nothing was done",
                status.message()
            ))
        } else {
            return;
        };
        self.mark(&mut s);
        metrics::counter!("dtx_undecodable_requests_total", "server" => self.server).increment(1);
        let headers = resp.headers_mut();
        headers.remove("grpc-message");
        let _ = s.add_header(headers);
    }
}

/// The most of a refused request's body read before the refusal is sent.
pub const REFUSED_BODY_DRAIN_BYTES_MAX: usize = 64 * 1024;
/// The longest a refused request's body is waited for.
pub const REFUSED_BODY_DRAIN_MS_MAX: u64 = 1_000;

/// Reads (and drops) what is left of a refused request's body, at most
/// [`REFUSED_BODY_DRAIN_BYTES_MAX`] within [`REFUSED_BODY_DRAIN_MS_MAX`].
/// An HTTP/2 answer sent while the caller still sends its request ends the
/// stream under it (RST_STREAM), and a tonic client then sometimes reports
/// "h2 protocol error: user error: inactive stream" (UNKNOWN) instead of
/// the refusal it was sent: a caller with a bad token must see
/// UNAUTHENTICATED. A body larger or slower than the bounds is not waited
/// for (the caller gets whatever its HTTP/2 stack makes of it).
async fn drain<B: http_body::Body + Unpin>(mut body: B)
where
    B::Data: bytes::Buf,
{
    let read = async {
        let mut seen = 0usize;
        while seen <= REFUSED_BODY_DRAIN_BYTES_MAX {
            match std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
                Some(Ok(frame)) => {
                    if let Some(data) = frame.data_ref() {
                        seen += bytes_len(data);
                    }
                }
                _ => break,
            }
        }
    };
    let _ = tokio::time::timeout(std::time::Duration::from_millis(REFUSED_BODY_DRAIN_MS_MAX), read).await;
}

fn bytes_len<D: bytes::Buf>(d: &D) -> usize {
    d.remaining()
}

impl<S, B, RB> tower_service::Service<http::Request<B>> for EdgeService<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Unpin + Send + 'static,
    B::Data: bytes::Buf + Send,
    B::Error: Send,
    RB: Default + Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        match self.checker.check(&req) {
            Ok(id) => {
                if let Some(id) = id {
                    req.extensions_mut().insert(id);
                }
                // The peer's address stays readable through
                // `Request::remote_addr`, which looks for tonic's own type.
                if let Some(tcp) = req.extensions().get::<PeerInfo>().map(|p| p.tcp.clone()) {
                    req.extensions_mut().insert(tcp);
                }
                // The clone that was made ready is the one called.
                let clone = self.inner.clone();
                let mut ready = std::mem::replace(&mut self.inner, clone);
                let checker = self.checker.clone();
                let fut = ready.call(req);
                Box::pin(async move {
                    let mut resp = fut.await?;
                    checker.undecodable(&mut resp);
                    Ok(resp)
                })
            }
            Err(mut status) => {
                self.checker.mark(&mut status);
                let code = match status.code() {
                    tonic::Code::Unauthenticated => "unauthenticated",
                    tonic::Code::ResourceExhausted => {
                        metrics::counter!("dtx_rate_limited_total", "server" => self.checker.server).increment(1);
                        let resp = status.into_http::<RB>();
                        let body = req.into_body();
                        return Box::pin(async move {
                            drain(body).await;
                            Ok(resp)
                        });
                    }
                    _ => "permission_denied",
                };
                metrics::counter!("dtx_auth_refusals_total", "server" => self.checker.server, "code" => code)
                    .increment(1);
                let remote = req.extensions().get::<PeerInfo>().and_then(|p| p.tcp.remote_addr);
                self.checker
                    .log_refusal(remote, code, req.uri().path(), status.message());
                let resp = status.into_http::<RB>();
                let body = req.into_body();
                Box::pin(async move {
                    drain(body).await;
                    Ok(resp)
                })
            }
        }
    }
}

/// A client-side interceptor that sends a bearer token with every call
/// (none when empty): how a node proves itself to participants where
/// mutual TLS is not used.
#[derive(Clone, Debug, Default)]
pub struct Bearer(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl Bearer {
    /// `token` as `authorization: Bearer <token>`; refused when it is not
    /// printable ASCII.
    pub fn new(token: Option<&str>) -> Result<Bearer, String> {
        match token {
            None => Ok(Bearer(None)),
            Some(t) => format!("Bearer {t}")
                .parse()
                .map(|v| Bearer(Some(v)))
                .map_err(|_| "a token must be printable ASCII without spaces".to_string()),
        }
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// The identity a layer admitted the call with (None when authentication
/// is off or the method is open).
pub fn caller<T>(req: &tonic::Request<T>) -> Option<&Identity> {
    req.extensions().get::<Identity>()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limited(per_s: f64, burst: f64) -> EdgeLayer {
        EdgeLayer::new("test", Tokens::default(), |_| Access::Open).with_rate_limit(Some(RateLimit { per_s, burst }))
    }

    #[test]
    fn each_identity_gets_its_burst_then_its_rate() {
        let l = limited(1.0, 3.0);
        let c = &l.inner;
        let t0 = Instant::now();
        let at = |ms: u64| t0 + std::time::Duration::from_millis(ms);
        assert!((0..3).all(|_| c.admit_at("application/a", at(0))), "the burst");
        assert!(!c.admit_at("application/a", at(0)), "over the burst");
        assert!(
            c.admit_at("application/b", at(0)),
            "another identity has its own bucket"
        );
        assert!(!c.admit_at("application/a", at(900)), "not a whole call back yet");
        assert!(c.admit_at("application/a", at(1100)), "one call per second comes back");
        assert!(!c.admit_at("application/a", at(1100)));
        assert!(
            (0..3).all(|_| c.admit_at("application/a", at(60_000))),
            "refilled up to the burst"
        );
        assert!(!c.admit_at("application/a", at(60_000)), "never beyond it");
    }

    #[test]
    fn without_a_limit_everything_is_admitted_and_settings_survive_building() {
        let l = EdgeLayer::new("test", Tokens::default(), |_| Access::Open);
        assert!((0..10_000).all(|_| l.inner.admit("x")));
        let l = limited(5.0, 5.0).marking_not_applied("x-test-not-applied");
        assert_eq!(l.inner.rate, Some(RateLimit { per_s: 5.0, burst: 5.0 }));
        assert_eq!(l.inner.not_applied_header, Some("x-test-not-applied"));
    }

    fn peer(identity: Option<Identity>, problem: Option<&str>) -> PeerInfo {
        PeerInfo {
            tcp: tonic::transport::server::TcpConnectInfo {
                local_addr: None,
                remote_addr: None,
            },
            tls: true,
            identity,
            certificate_problem: problem.map(str::to_string),
            certificate_required: false,
        }
    }

    fn request(peer: PeerInfo, token: Option<&str>) -> http::Request<()> {
        let mut b = http::Request::builder().uri("/dtx.v1.Test/Call");
        if let Some(t) = token {
            b = b.header("authorization", format!("Bearer {t}"));
        }
        let mut req = b.body(()).unwrap();
        req.extensions_mut().insert(peer);
        req
    }

    const ANY: &[Role] = &[Role::Application, Role::Participant, Role::Operator, Role::Node];

    /// With `client_auth = "optional"`, a certificate that was presented and
    /// refused is refused as such, even with a valid token beside it; without
    /// a certificate the token is taken.
    #[test]
    fn a_token_does_not_stand_in_for_a_refused_certificate() {
        let token = crate::identity::new_token();
        let entry =
            crate::identity::TokenEntry::new(Role::Application, "shop", &crate::identity::token_sha256_hex(&token))
                .unwrap();
        let l = EdgeLayer::new("test", Tokens::new(vec![entry]), |_| Access::Roles(ANY));
        let refused = l
            .inner
            .check(&request(
                peer(None, Some("the client certificate was refused: certificate expired")),
                Some(&token),
            ))
            .unwrap_err();
        assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
        assert!(
            refused.message().contains("certificate expired"),
            "{}",
            refused.message()
        );
        let id = l
            .inner
            .check(&request(peer(None, None), Some(&token)))
            .unwrap()
            .unwrap();
        assert_eq!(id.label(), "application/shop", "no certificate: the token is taken");
    }

    /// A node identity is honoured only where the node check admits it.
    #[test]
    fn a_node_identity_is_honoured_only_when_the_check_admits_it() {
        let check: NodeCheck = Arc::new(|name: &str| {
            if name == "1" {
                Ok(())
            } else {
                Err(format!("node {name} is not a member of this cluster (members: 1)"))
            }
        });
        let l = EdgeLayer::new("test", Tokens::default(), |_| Access::Roles(ANY)).with_node_check(Some(check));
        let node = |name: &str| {
            Some(Identity {
                role: Role::Node,
                name: name.into(),
                proof: crate::identity::Proof::Certificate,
            })
        };
        let s = l.inner.check(&request(peer(node("9"), None), None)).unwrap_err();
        assert_eq!(s.code(), tonic::Code::PermissionDenied, "{s:?}");
        assert!(s.message().contains("node 9 is not a member"), "{}", s.message());
        assert_eq!(
            l.inner
                .check(&request(peer(node("1"), None), None))
                .unwrap()
                .unwrap()
                .label(),
            "node/1"
        );
    }

    #[test]
    fn many_identities_do_not_grow_the_table_without_bound() {
        let l = limited(1000.0, 1.0);
        let t0 = Instant::now();
        for i in 0..(RATE_BUCKETS_MAX + 500) {
            // 1 ms apart: each earlier bucket has refilled by the next call.
            let now = t0 + std::time::Duration::from_millis(i as u64);
            l.inner.admit_at(&format!("application/{i}"), now);
        }
        assert!(l.inner.buckets.lock().unwrap().len() <= RATE_BUCKETS_MAX + 1);
    }
}
