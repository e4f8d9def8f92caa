//! Authentication and authorisation of every call, as a tower layer in
//! front of a gRPC server's services.
//!
//! The caller's identity is its client certificate's (see
//! [`crate::identity`]) or, when it presented none, the one its bearer
//! token (`authorization: Bearer <token>`) stands for. The policy says
//! which roles may call each method (by its gRPC path). A call without an
//! identity is refused `UNAUTHENTICATED`, a call whose role may not call
//! the method `PERMISSION_DENIED`; both are logged and counted
//! (`dtx_auth_refusals_total`, by server and code). An admitted call
//! carries its [`Identity`] in the request's extensions.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Context;
use std::task::Poll;

use tracing::warn;

use crate::identity::Identity;
use crate::identity::Role;
use crate::identity::Tokens;
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

/// The layer; see the module documentation.
#[derive(Clone)]
pub struct AuthLayer {
    inner: Arc<Checker>,
}

struct Checker {
    server: &'static str,
    tokens: Tokens,
    policy: AuthPolicy,
}

impl AuthLayer {
    /// `server` names the port in logs and metrics ("api", "raft",
    /// "participant").
    pub fn new(server: &'static str, tokens: Tokens, policy: AuthPolicy) -> AuthLayer {
        AuthLayer {
            inner: Arc::new(Checker { server, tokens, policy }),
        }
    }
}

impl<S> tower_layer::Layer<S> for AuthLayer {
    type Service = AuthService<S>;

    fn layer(&self, inner: S) -> AuthService<S> {
        AuthService {
            inner,
            checker: self.inner.clone(),
        }
    }
}

#[derive(Clone)]
pub struct AuthService<S> {
    inner: S,
    checker: Arc<Checker>,
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
        let path = req.uri().path();
        let access = (self.policy)(path);
        let roles = match access {
            Access::Open => return Ok(None),
            Access::Roles(r) => r,
        };
        let peer = req.extensions().get::<PeerInfo>();
        let identity = match peer.and_then(|p| p.identity.clone()) {
            Some(id) => id,
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
            let allowed: Vec<&str> = roles.iter().map(|r| r.as_str()).collect();
            return Err(tonic::Status::permission_denied(format!(
                "{identity} may not call {path} (allowed roles: {})",
                if allowed.is_empty() {
                    "none".to_string()
                } else {
                    allowed.join(", ")
                }
            )));
        }
        Ok(Some(identity))
    }
}

impl<S, B, RB> tower_service::Service<http::Request<B>> for AuthService<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<RB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
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
                Box::pin(ready.call(req))
            }
            Err(status) => {
                let code = match status.code() {
                    tonic::Code::Unauthenticated => "unauthenticated",
                    _ => "permission_denied",
                };
                metrics::counter!("dtx_auth_refusals_total", "server" => self.checker.server, "code" => code)
                    .increment(1);
                let remote = req.extensions().get::<PeerInfo>().and_then(|p| p.tcp.remote_addr);
                warn!(
                    server = self.checker.server,
                    ?remote,
                    method = req.uri().path(),
                    "call refused: {}",
                    status.message()
                );
                let resp = status.into_http::<RB>();
                Box::pin(async move { Ok(resp) })
            }
        }
    }
}

/// The identity a layer admitted the call with (None when authentication
/// is off or the method is open).
pub fn caller<T>(req: &tonic::Request<T>) -> Option<&Identity> {
    req.extensions().get::<Identity>()
}
