//! gRPC services. Handlers validate input against `limits`, turn requests
//! into state-machine commands or, for everything that drives a transaction
//! (commit, BeginAndCommit, abort, resolve), into calls on the one
//! `driver::Driver`, and either run them here (leader) or forward them to
//! the leader once (followers).

pub mod admin;
mod admin_settle;
mod admin_txn;
pub mod backup;
pub mod coordinator;
pub mod error;
pub mod saga;

use std::any::Any;
use std::future::Future;
use std::sync::Arc;

use dtx_common::trace;
use dtx_common::trace::TraceContext;
use dtx_proto::v1 as pb;
use dtx_transport::channel::Channel;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use self::error::ApiError;
use self::error::FORWARDED_HEADER;
use crate::ctx::NodeCtx;

/// The transaction a request is about, from its body (the request types
/// that name one), else from its `x-dtx-txid` metadata.
fn request_txid<Req: Any>(req: &Request<Req>) -> Option<u64> {
    let body: &dyn Any = req.get_ref();
    macro_rules! txid_field {
        ($($t:ty),*) => {
            $(if let Some(r) = body.downcast_ref::<$t>() {
                return Some(r.txid);
            })*
        };
    }
    txid_field!(
        pb::EnlistRequest,
        pb::CommitRequest,
        pb::AbortRequest,
        pb::StatusRequest,
        pb::GetDecisionRequest,
        pb::ResolveRequest,
        pb::DropParticipantRequest,
        pb::ForgetTransactionRequest
    );
    dtx_proto::txid_of(req)
}

/// The transaction an answer names (Begin and BeginAndCommit learn theirs
/// from it).
fn response_txid<Resp: Any>(resp: &Response<Resp>) -> Option<u64> {
    let body: &dyn Any = resp.get_ref();
    if let Some(r) = body.downcast_ref::<pb::BeginResponse>() {
        return Some(r.txid);
    }
    body.downcast_ref::<pb::BeginAndCommitResponse>().map(|r| r.txid)
}

/// Runs `local` here; when this node is not the leader and the request was
/// not forwarded already, sends it once to the leader with `remote`.
///
/// Every request runs in a `request` span with the fields `rpc`, `txid`
/// (from the body, or from the answer for Begin and BeginAndCommit),
/// `forwarded`, `trace_id` and `span_id`: the span continues the caller's
/// W3C trace (`traceparent`; a new trace without one), and its trace
/// context is current while the request is served, so the driver's calls
/// to participants and a forward to the leader carry it on.
pub(crate) async fn serve_or_forward<Req, Resp, L, LFut, R, RFut>(
    ctx: &Arc<NodeCtx>,
    req: Request<Req>,
    local: L,
    remote: R,
) -> Result<Response<Resp>, Status>
where
    Req: Clone + Any,
    Resp: Any,
    L: FnOnce(Req) -> LFut,
    LFut: Future<Output = Result<Resp, ApiError>>,
    R: FnOnce(Channel, Request<Req>) -> RFut,
    RFut: Future<Output = Result<Response<Resp>, Status>>,
{
    use tracing::Instrument;
    let started = std::time::Instant::now();
    let method = crate::metrics::grpc_method::<Req>();
    let span = tracing::info_span!(
        "request",
        rpc = method,
        txid = tracing::field::Empty,
        forwarded = req.metadata().get(FORWARDED_HEADER).is_some(),
        trace_id = tracing::field::Empty,
        span_id = tracing::field::Empty,
    );
    if let Some(txid) = request_txid(&req) {
        span.record("txid", txid);
    }
    let trace_ctx = trace::continue_in(&span, TraceContext::from_metadata(req.metadata()).as_ref());
    let result = trace::scope(trace_ctx, serve_or_forward_inner(ctx, req, local, remote))
        .instrument(span.clone())
        .await;
    if let Some(txid) = result.as_ref().ok().and_then(response_txid) {
        span.record("txid", txid);
    }
    // Per-call metrics, labelled by gRPC method (Begin, Commit, ...) and code.
    let code = match &result {
        Ok(_) => "Ok".to_string(),
        Err(s) => format!("{:?}", s.code()),
    };
    metrics::counter!("dtx_api_requests_total", "method" => method, "code" => code.clone()).increment(1);
    metrics::histogram!("dtx_api_request_seconds", "method" => method, "code" => code)
        .record(started.elapsed().as_secs_f64());
    result
}

async fn serve_or_forward_inner<Req, Resp, L, LFut, R, RFut>(
    ctx: &Arc<NodeCtx>,
    req: Request<Req>,
    local: L,
    remote: R,
) -> Result<Response<Resp>, Status>
where
    Req: Clone,
    L: FnOnce(Req) -> LFut,
    LFut: Future<Output = Result<Resp, ApiError>>,
    R: FnOnce(Channel, Request<Req>) -> RFut,
    RFut: Future<Output = Result<Response<Resp>, Status>>,
{
    let forwarded = req.metadata().get(FORWARDED_HEADER).is_some();
    let on_behalf_of = crate::security::caller(&req).map(|id| id.label());
    // A caller that proved itself with a token: the leader checks the same
    // token (without TLS a node has no identity of its own to vouch with).
    let authorization = req.metadata().get("authorization").cloned();
    let deadline = req.metadata().get("grpc-timeout").cloned();
    let body = req.into_inner();
    match local(body.clone()).await {
        Ok(resp) => Ok(Response::new(resp)),
        Err(ApiError::NotLeader {
            leader_id: Some(leader),
            leader_api_addr: Some(addr),
            proposed,
        }) if !forwarded && leader != ctx.id => {
            metrics::counter!("dtx_api_forwarded_total").increment(1);
            let channel = ctx.api_channel(&addr)?;
            let mut fwd = Request::new(body);
            fwd.metadata_mut().insert(FORWARDED_HEADER, "1".parse().expect("ascii"));
            if let Some(v) = on_behalf_of.and_then(|l| l.parse().ok()) {
                fwd.metadata_mut().insert(crate::security::ON_BEHALF_OF_HEADER, v);
            }
            if let Some(v) = authorization {
                fwd.metadata_mut().insert("authorization", v);
            }
            if let Some(t) = deadline {
                fwd.metadata_mut().insert("grpc-timeout", t);
            }
            // The leader's span is a child of this node's request span.
            if let Some(t) = trace::current() {
                t.attach(fwd.metadata_mut());
            }
            let mut answer = remote(channel, fwd)
                .await
                .map_err(|s| forwarded_error(s, leader, &addr, proposed))?;
            // The caller may go to the leader itself next time.
            if let Ok(v) = addr.parse() {
                answer.metadata_mut().insert(dtx_proto::metadata::LEADER_ADDR_HEADER, v);
            }
            Ok(answer)
        }
        Err(e) => Err(e.into()),
    }
}

/// The error a node returns for a request it forwarded to `leader` (at
/// `addr`) after its own attempt, which may have `proposed` the command.
/// A transport failure keeps the leader hint so the client can go there
/// itself. A command this node proposed may still be applied (by the new
/// leader, from the log), so the leader's "certainly not applied" does not
/// speak for it and is dropped: the caller then treats the call as
/// possibly applied, UNKNOWN if nothing definite follows.
fn forwarded_error(s: Status, leader: crate::raft::NodeId, addr: &str, proposed: bool) -> Status {
    let transport_failed = matches!(s.code(), tonic::Code::Cancelled | tonic::Code::Unknown);
    if transport_failed || (s.code() == tonic::Code::Unavailable && dtx_proto::metadata::leader_hint(&s).is_none()) {
        return Status::from(ApiError::NotLeader {
            leader_id: Some(leader),
            leader_api_addr: Some(addr.to_string()),
            // Not connected to the leader: nothing reached it, so only
            // this node's own attempt can have been applied.
            proposed: proposed || !(dtx_proto::metadata::not_applied(&s) || dtx_transport::unary::nothing_sent(&s)),
        });
    }
    let mut s = s;
    if proposed {
        s.metadata_mut().remove(error::NOT_APPLIED_HEADER);
    }
    s
}

/// The decision an operator's request asks for: `OUTCOME_COMMIT` or
/// `OUTCOME_ABORT`, anything else `INVALID_ARGUMENT`.
pub(crate) fn operator_outcome(v: i32) -> Result<crate::sm::Outcome, ApiError> {
    match pb::Outcome::try_from(v) {
        Ok(pb::Outcome::Commit) => Ok(crate::sm::Outcome::Commit),
        Ok(pb::Outcome::Abort) => Ok(crate::sm::Outcome::Abort),
        _ => Err(ApiError::InvalidArgument(
            "outcome must be OUTCOME_COMMIT or OUTCOME_ABORT".into(),
        )),
    }
}

pub(crate) fn check_id(field: &str, v: &str) -> Result<(), ApiError> {
    crate::sm::check_id(field, v).map_err(ApiError::from)
}

pub(crate) fn check_len(field: &str, len: usize, max: usize) -> Result<(), ApiError> {
    crate::sm::check_len(field, len, max).map_err(ApiError::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A follower that proposed the command before it learned it
    /// is not the leader forwards it; the leader's "not applied" answer
    /// covers only the leader's own attempt, so it must not reach the
    /// client, or the client would report a failure for a command that may
    /// still be applied.
    #[test]
    fn forwarded_refusal_keeps_may_have_been_applied_when_this_node_proposed() {
        let leader_says = || {
            Status::from(ApiError::NotLeader {
                leader_id: Some(3),
                leader_api_addr: Some("127.0.0.1:9".into()),
                proposed: false,
            })
        };
        assert!(dtx_proto::metadata::not_applied(&leader_says()));
        let s = forwarded_error(leader_says(), 2, "127.0.0.1:8", true);
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert!(
            !dtx_proto::metadata::not_applied(&s),
            "this node proposed: may be applied"
        );
        assert_eq!(
            dtx_proto::metadata::leader_hint(&s).as_deref(),
            Some("127.0.0.1:9"),
            "hint kept"
        );
        // Nothing proposed here: the leader's word stands.
        let s = forwarded_error(leader_says(), 2, "127.0.0.1:8", false);
        assert!(dtx_proto::metadata::not_applied(&s));
        // A definite refusal by the leader (bad input) stays definite.
        let s = forwarded_error(Status::from(ApiError::InvalidArgument("bad".into())), 2, "a:1", true);
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        // A broken forward: the hint to the leader, possibly applied.
        let s = forwarded_error(Status::unknown("stream reset"), 2, "127.0.0.1:8", true);
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert!(!dtx_proto::metadata::not_applied(&s));
        assert_eq!(dtx_proto::metadata::leader_hint(&s).as_deref(), Some("127.0.0.1:8"));
        let s = forwarded_error(Status::unknown("stream reset"), 2, "127.0.0.1:8", false);
        assert!(
            !dtx_proto::metadata::not_applied(&s),
            "a lost reply may have been applied"
        );
    }
}
