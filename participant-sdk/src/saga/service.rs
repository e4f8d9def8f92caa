//! The gRPC service `dtx.v1.SagaStepService` on a step store
//! ([`StepServer`] over a [`StepBackend`]), who may call it
//! ([`step_policy`]), and serving it on a listener ([`serve_steps`] and
//! its TLS and guarded variants).

use std::sync::Arc;

use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_step_service_server::SagaStepService;
use dtx_proto::v1::saga_step_service_server::SagaStepServiceServer;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use super::types::StepCall;
use super::types::StepError;
use super::types::StepRecord;
use super::types::StepResult;
use crate::participant::StoreError;

/// What [`StepServer`] serves: a step store (the sled
/// [`StepStore`](super::StepStore), or the PostgreSQL
/// `saga_pg::PgStepStore` with the `postgres` feature).
#[tonic::async_trait]
pub trait StepBackend: Send + Sync + 'static {
    /// A forward call, once per operation id.
    async fn forward(&self, call: &StepCall) -> Result<StepResult, StepError>;
    /// A compensation, once per operation id (NOOP when the forward action
    /// did not happen here).
    async fn compensate(&self, call: &StepCall) -> Result<StepResult, StepError>;
    /// What an operation id did here (None: nothing yet), for status query
    /// `query` (refused when it does not answer for the operation's
    /// action); an operation in flight is settled by the outside system's
    /// status hook (ADR 0034).
    async fn status(&self, operation_id: &str, query: &str) -> Result<Option<StepRecord>, StepError>;
    /// As `status`, making "nothing" permanent (fenced); an operation in
    /// flight is fenced only when the outside system says it did not
    /// happen and never will.
    async fn fence(&self, operation_id: &str, query: &str) -> Result<Option<StepRecord>, StepError>;
    /// Whether `query` names a status query of this service.
    fn knows_query(&self, query: &str) -> bool;
}

/// `dtx.v1.SagaStepService` on a step store ([`StepBackend`]).
pub struct StepServer<B: StepBackend> {
    store: Arc<B>,
}

impl<B: StepBackend> StepServer<B> {
    pub fn new(store: Arc<B>) -> Self {
        StepServer { store }
    }

    pub fn store(&self) -> &Arc<B> {
        &self.store
    }
}

/// The gRPC status of a call that got no reply: never an OK reply, so the
/// orchestrator takes the outcome as UNKNOWN (a stopped store or an I/O
/// error: UNAVAILABLE, asked again later; a malformed call:
/// INVALID_ARGUMENT or FAILED_PRECONDITION).
pub fn step_error_status(e: StepError) -> Status {
    match e {
        StepError::Invalid(m) if m.contains(" call here, not a ") => Status::failed_precondition(m),
        StepError::Invalid(m) => Status::invalid_argument(m),
        StepError::Conflict(m) => Status::failed_precondition(m),
        StepError::InFlight(m) => Status::unavailable(m),
        StepError::Store(StoreError::Stopped(f)) => Status::unavailable(f.to_string()),
        StepError::Store(StoreError::Io(m) | StoreError::Unavailable(m)) => Status::unavailable(m),
        StepError::Store(other) => Status::internal(other.to_string()),
    }
}

#[tonic::async_trait]
impl<B: StepBackend> SagaStepService for StepServer<B> {
    async fn forward(&self, req: Request<pb::StepCall>) -> Result<Response<pb::StepReply>, Status> {
        let call = StepCall::from(req.into_inner());
        let r = self.store.forward(&call).await.map_err(step_error_status)?;
        Ok(Response::new(r.to_reply()))
    }

    async fn compensate(&self, req: Request<pb::StepCall>) -> Result<Response<pb::StepReply>, Status> {
        let call = StepCall::from(req.into_inner());
        let r = self.store.compensate(&call).await.map_err(step_error_status)?;
        Ok(Response::new(r.to_reply()))
    }

    async fn fence(&self, req: Request<pb::StepStatusRequest>) -> Result<Response<pb::StepStatusReply>, Status> {
        let r = self.known_query(req)?;
        let rec = self
            .store
            .fence(&r.operation_id, &r.query)
            .await
            .map_err(step_error_status)?;
        Ok(Response::new(status_reply(rec)))
    }

    async fn status(&self, req: Request<pb::StepStatusRequest>) -> Result<Response<pb::StepStatusReply>, Status> {
        let r = self.known_query(req)?;
        let rec = self
            .store
            .status(&r.operation_id, &r.query)
            .await
            .map_err(step_error_status)?;
        Ok(Response::new(status_reply(rec)))
    }
}

impl<B: StepBackend> StepServer<B> {
    /// A Status or Fence request naming a status query this service has;
    /// INVALID_ARGUMENT otherwise.
    fn known_query(&self, req: Request<pb::StepStatusRequest>) -> Result<pb::StepStatusRequest, Status> {
        let r = req.into_inner();
        if !self.store.knows_query(&r.query) {
            return Err(Status::invalid_argument(format!(
                "this service has no status query {:?}",
                r.query
            )));
        }
        Ok(r)
    }
}

/// What Status and Fence answer for an operation's record (none: not
/// applied).
fn status_reply(rec: Option<StepRecord>) -> pb::StepStatusReply {
    pb::StepStatusReply {
        applied: rec.is_some(),
        reply: rec.map(|rec| rec.result.to_reply()),
    }
}

/// Who may call a step service served with TLS or node tokens: the
/// cluster's nodes (the orchestrator); Status, which changes nothing, also
/// operators. A method missing here is refused for everyone.
pub fn step_policy(path: &str) -> dtx_tls::Access {
    use dtx_tls::Access;
    use dtx_tls::Role;
    match path.strip_prefix("/dtx.v1.SagaStepService/") {
        Some("Status") => Access::Roles(&[Role::Node, Role::Operator]),
        Some("Forward" | "Compensate" | "Fence") => Access::Roles(&[Role::Node]),
        _ => Access::Roles(&[]),
    }
}

/// Serves `service` (a [`StepServer`], or a wrapper of one) on `listener`
/// in plain text until `shutdown` completes. A service whose store can stop
/// by itself makes [`StepStore::stopped`](super::StepStore::stopped) part of
/// `shutdown`.
pub async fn serve_steps<S: SagaStepService>(
    service: S,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    serve_steps_guarded(service, listener, crate::server::Guard::default(), shutdown).await
}

/// As [`serve_steps`], over TLS when `tls` is set (mutual TLS: only the
/// cluster's nodes may call, see [`step_policy`]).
pub async fn serve_steps_with_tls<S: SagaStepService>(
    service: S,
    listener: tokio::net::TcpListener,
    tls: Option<Arc<dtx_tls::ServerTls>>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let guard = crate::server::Guard {
        tls,
        node_tokens: dtx_tls::Tokens::default(),
    };
    serve_steps_guarded(service, listener, guard, shutdown).await
}

/// As [`serve_steps`], with a [`crate::server::Guard`]: TLS, node tokens,
/// or both; then callers are checked against [`step_policy`] (refusals
/// counted in `dtx_auth_refusals_total{server="step"}`) before the service
/// sees the call. With neither, anyone may call.
pub async fn serve_steps_guarded<S: SagaStepService>(
    service: S,
    listener: tokio::net::TcpListener,
    guard: crate::server::Guard,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let crate::server::Guard { tls, node_tokens } = guard;
    let reloader = tls
        .as_ref()
        .map(|t| t.spawn_reloader(crate::server::TLS_RELOAD_INTERVAL, "saga step service"));
    let policy: dtx_tls::AuthPolicy = if tls.is_some() || !node_tokens.is_empty() {
        step_policy
    } else {
        |_| dtx_tls::Access::Open
    };
    let served = tonic::transport::Server::builder()
        .layer(
            dtx_tls::EdgeLayer::new("step", node_tokens, policy)
                .marking_not_applied(dtx_proto::metadata::NOT_APPLIED_HEADER),
        )
        .add_service(SagaStepServiceServer::new(service))
        .serve_with_incoming_shutdown(dtx_tls::incoming(listener, tls), shutdown)
        .await;
    if let Some(r) = reloader {
        r.abort();
    }
    served
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_lets_nodes_call_and_refuses_unknown_methods() {
        use dtx_tls::Access;
        use dtx_tls::Role;
        assert_eq!(
            step_policy("/dtx.v1.SagaStepService/Forward"),
            Access::Roles(&[Role::Node])
        );
        assert_eq!(
            step_policy("/dtx.v1.SagaStepService/Compensate"),
            Access::Roles(&[Role::Node])
        );
        assert_eq!(step_policy("/dtx.v1.SagaStepService/Nope"), Access::Roles(&[]));
        assert_eq!(step_policy("/dtx.v1.ParticipantService/Prepare"), Access::Roles(&[]));
    }
}
