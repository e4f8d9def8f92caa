//! Carrying the transaction id across gRPC calls without hand work.
//!
//! A transaction id travels in the gRPC metadata key
//! [`dtx_proto::TXID_METADATA_KEY`] (`x-dtx-txid`). Rather than attaching it
//! to every request by hand ([`dtx_proto::attach_txid`]), run the code that
//! works for a transaction *inside* it:
//!
//! - **Calling side.** [`scope`]`(txid, future)` makes `txid` the *current
//!   transaction* of everything that future does (a tokio task-local; read
//!   it with [`current`]). Every call made through a channel wrapped by
//!   [`OutboundTxidLayer`] (a tower layer: [`OutboundTxid::new`]`(channel)`)
//!   or a generated client built `with_interceptor(channel,
//!   `[`TxidInterceptor`]`)` carries the current txid. A txid the request
//!   already carries is kept. Outside any scope nothing is added.
//! - **Serving side.** [`InboundTxidLayer`], installed with
//!   `tonic::transport::Server::builder().layer(InboundTxidLayer)`, reads
//!   the txid of each incoming request and exposes it to the handler twice:
//!   as a [`Txid`] in the request's extensions (read it with
//!   [`request_txid`]), and as the current transaction while the handler
//!   runs. So a handler that calls further services through wrapped
//!   channels passes the txid on by itself.
//!
//! A task-local does not follow `tokio::spawn`: wrap a spawned future with
//! [`with_current`] to keep the caller's transaction.
//!
//! The same layers carry the W3C trace context ([`crate::trace`]): the
//! outbound side adds the current [`TraceContext`] as `traceparent` and
//! `tracestate` (unless the request has a `traceparent` already); the
//! inbound side continues the caller's trace (a new one when the request
//! carries none that is valid) in a `tracing` span named `rpc` with the
//! fields `rpc` (the gRPC path), `txid`, `trace_id` and `span_id`, entered
//! while the handler runs (across its awaits), makes that span's context
//! current for the handler, and puts it into the request's extensions.
//!
//! # Example: a service that enlists itself
//!
//! A service receives a call made inside a transaction and enlists itself
//! in it before doing its work ([`crate::enlist`]). The coordinator here is
//! a stand-in that records Enlist calls, and the service's own API is
//! played by the generated `Admin` stub of `dtx.v1` (its `ClusterStatus`
//! request is empty: the txid comes in the metadata only).
//!
//! ```
//! use std::time::Duration;
//!
//! use dtx_client::propagate::{self, InboundTxidLayer, OutboundTxid};
//! use dtx_proto::v1 as pb;
//! use dtx_proto::v1::admin_client::AdminClient;
//! use dtx_proto::v1::admin_server::{Admin, AdminServer};
//! use tonic::{Request, Response, Status};
//! # use std::sync::{Arc, Mutex};
//! # use dtx_proto::v1::coordinator_server::{Coordinator, CoordinatorServer};
//! #
//! # /// Records every Enlist; nothing else.
//! # #[derive(Default)]
//! # struct FakeCoordinator {
//! #     enlisted: Arc<Mutex<Vec<(u64, String, Vec<u8>)>>>,
//! # }
//! #
//! # #[tonic::async_trait]
//! # impl Coordinator for FakeCoordinator {
//! #     async fn enlist(&self, r: Request<pb::EnlistRequest>) -> Result<Response<pb::EnlistResponse>, Status> {
//! #         let r = r.into_inner();
//! #         let mut e = self.enlisted.lock().unwrap();
//! #         e.push((r.txid, r.participant_id, r.payload));
//! #         Ok(Response::new(pb::EnlistResponse { participant_count: e.len() as u32 }))
//! #     }
//! #     async fn begin(&self, _: Request<pb::BeginRequest>) -> Result<Response<pb::BeginResponse>, Status> {
//! #         Err(Status::unimplemented("fake"))
//! #     }
//! #     async fn begin_and_commit(&self, _: Request<pb::BeginAndCommitRequest>) -> Result<Response<pb::BeginAndCommitResponse>, Status> {
//! #         Err(Status::unimplemented("fake"))
//! #     }
//! #     async fn commit(&self, _: Request<pb::CommitRequest>) -> Result<Response<pb::CommitResponse>, Status> {
//! #         Err(Status::unimplemented("fake"))
//! #     }
//! #     async fn abort(&self, _: Request<pb::AbortRequest>) -> Result<Response<pb::AbortResponse>, Status> {
//! #         Err(Status::unimplemented("fake"))
//! #     }
//! #     async fn status(&self, _: Request<pb::StatusRequest>) -> Result<Response<pb::StatusResponse>, Status> {
//! #         Err(Status::unimplemented("fake"))
//! #     }
//! #     async fn get_decision(&self, _: Request<pb::GetDecisionRequest>) -> Result<Response<pb::GetDecisionResponse>, Status> {
//! #         Err(Status::unimplemented("fake"))
//! #     }
//! #     async fn get_decisions(&self, _: Request<pb::GetDecisionsRequest>) -> Result<Response<pb::GetDecisionsResponse>, Status> {
//! #         Err(Status::unimplemented("fake"))
//! #     }
//! #     async fn register_branch(&self, _: Request<pb::RegisterBranchRequest>) -> Result<Response<pb::RegisterBranchResponse>, Status> {
//! #         Err(Status::unimplemented("fake"))
//! #     }
//! #     async fn get_branch_decision(&self, _: Request<pb::GetBranchDecisionRequest>) -> Result<Response<pb::GetBranchDecisionResponse>, Status> {
//! #         Err(Status::unimplemented("fake"))
//! #     }
//! # }
//!
//! /// The inventory service: each call reserves stock under the caller's
//! /// transaction.
//! struct Inventory {
//!     coordinators: Vec<String>,
//!     /// Where the coordinator reaches this service's ParticipantService.
//!     participant_addr: String,
//! }
//!
//! #[tonic::async_trait]
//! impl Admin for Inventory {
//!     async fn cluster_status(
//!         &self,
//!         req: Request<pb::ClusterStatusRequest>,
//!     ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
//!         // Put there by InboundTxidLayer (propagate::current() says the same).
//!         let txid = propagate::request_txid(&req)
//!             .ok_or_else(|| Status::failed_precondition("call this inside a transaction"))?;
//!         dtx_client::enlist::enlist_self(
//!             &self.coordinators,
//!             txid,
//!             "inventory",
//!             &self.participant_addr,
//!             b"reserve sku-42 x1",
//!         )
//!         .await
//!         .map_err(|e| Status::unavailable(format!("could not enlist in transaction {txid}: {e}")))?;
//!         // The reservation itself happens at Prepare, from the payload.
//!         Ok(Response::new(pb::ClusterStatusResponse::default()))
//!     }
//! #   async fn add_node(&self, _: Request<pb::AddNodeRequest>) -> Result<Response<pb::AddNodeResponse>, Status> {
//! #       Err(Status::unimplemented("not here"))
//! #   }
//! #   async fn remove_node(&self, _: Request<pb::RemoveNodeRequest>) -> Result<Response<pb::RemoveNodeResponse>, Status> {
//! #       Err(Status::unimplemented("not here"))
//! #   }
//! #   async fn trigger_snapshot(&self, _: Request<pb::TriggerSnapshotRequest>) -> Result<Response<pb::TriggerSnapshotResponse>, Status> {
//! #       Err(Status::unimplemented("not here"))
//! #   }
//! #   async fn resolve(&self, _: Request<pb::ResolveRequest>) -> Result<Response<pb::ResolveResponse>, Status> {
//! #       Err(Status::unimplemented("not here"))
//! #   }
//! #   async fn list_transactions(&self, _: Request<pb::ListTransactionsRequest>) -> Result<Response<pb::ListTransactionsResponse>, Status> {
//! #       Err(Status::unimplemented("not here"))
//! #   }
//! #   async fn drop_participant(&self, _: Request<pb::DropParticipantRequest>) -> Result<Response<pb::DropParticipantResponse>, Status> {
//! #       Err(Status::unimplemented("not here"))
//! #   }
//! #   async fn forget_transaction(&self, _: Request<pb::ForgetTransactionRequest>) -> Result<Response<pb::ForgetTransactionResponse>, Status> {
//! #       Err(Status::unimplemented("not here"))
//! #   }
//! #   async fn settle_other(&self, _: Request<pb::SettleOtherRequest>) -> Result<Response<pb::SettleOtherResponse>, Status> {
//! #       Err(Status::unimplemented("not here"))
//! #   }
//! #   type BackupStream = tonic::codegen::BoxStream<pb::BackupChunk>;
//! #   async fn backup(&self, _: Request<pb::BackupRequest>) -> Result<Response<Self::BackupStream>, Status> {
//! #       Err(Status::unimplemented("not here"))
//! #   }
//! }
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! #   let coordinator = FakeCoordinator::default();
//! #   let enlisted = coordinator.enlisted.clone();
//! #   let coordinator_listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//! #   let coordinator_addr = coordinator_listener.local_addr()?.to_string();
//! #   tokio::spawn(
//! #       tonic::transport::Server::builder()
//! #           .add_service(CoordinatorServer::new(coordinator))
//! #           .serve_with_incoming(dtx_transport::incoming(coordinator_listener)),
//! #   );
//!     // The service: the layer hands every handler the caller's txid.
//!     let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
//!     let inventory_addr = listener.local_addr()?.to_string();
//!     let inventory = Inventory {
//!         coordinators: vec![coordinator_addr],
//!         participant_addr: "127.0.0.1:7300".into(),
//!     };
//!     tokio::spawn(
//!         tonic::transport::Server::builder()
//!             .layer(InboundTxidLayer)
//!             .add_service(AdminServer::new(inventory))
//!             .serve_with_incoming(dtx_transport::incoming(listener)),
//!     );
//!
//!     // The caller: every call through the wrapped channel made inside the
//!     // scope carries transaction 42 (begun with Client::begin in real use).
//!     let channel = dtx_transport::channel::channel(&inventory_addr, None, Duration::from_secs(2))?;
//!     let mut inventory = AdminClient::new(OutboundTxid::new(channel));
//!     propagate::scope(42, async {
//!         inventory.cluster_status(pb::ClusterStatusRequest {}).await
//!     })
//!     .await?;
//! #   assert_eq!(*enlisted.lock().unwrap(), [(42, "inventory".to_string(), b"reserve sku-42 x1".to_vec())]);
//!
//!     // Outside a transaction the service refuses the call.
//!     let refused = inventory.cluster_status(pb::ClusterStatusRequest {}).await.unwrap_err();
//!     assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
//!     Ok(())
//! }
//! ```

use std::future::Future;
use std::task::Context;
use std::task::Poll;

use dtx_proto::INCARNATION_METADATA_KEY;
use dtx_proto::TXID_METADATA_KEY;
use tokio::task::futures::TaskLocalFuture;
use tower_layer::Layer;
use tower_service::Service;
use tracing::instrument::Instrumented;
use tracing::Instrument;

pub use crate::trace::TraceContext;

tokio::task_local! {
    /// The transaction the running code works for (`None`: explicitly none).
    static CURRENT: Option<Current>;
}

/// The current transaction: its txid and, when known, the incarnation
/// that handed it out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Current {
    /// The transaction id.
    pub txid: u64,
    /// The cluster incarnation that handed it out, when the code that
    /// began it passed it on (`x-dtx-incarnation`).
    pub incarnation: Option<u64>,
}

/// Runs `fut` with `txid` as its current transaction ([`current`]): calls
/// it makes through wrapped channels carry `txid`. Scopes nest: the
/// innermost wins.
pub async fn scope<F: Future>(txid: u64, fut: F) -> F::Output {
    CURRENT
        .scope(
            Some(Current {
                txid,
                incarnation: None,
            }),
            fut,
        )
        .await
}

/// [`scope`] with the incarnation that handed `txid` out
/// (`Began::incarnation`): calls carry both, so a service that joins as a
/// branch keeps its work under the name the cluster's phase-two messages
/// use.
pub async fn scope_in<F: Future>(txid: u64, incarnation: u64, fut: F) -> F::Output {
    CURRENT
        .scope(
            Some(Current {
                txid,
                incarnation: Some(incarnation),
            }),
            fut,
        )
        .await
}

/// The current transaction: set by [`scope`], by [`with_current`], or by
/// [`InboundTxidLayer`] for a handler serving a call that carried a txid.
/// `None` outside any of them.
pub fn current() -> Option<u64> {
    current_tx().map(|c| c.txid)
}

/// The current transaction with its incarnation, if known.
pub fn current_tx() -> Option<Current> {
    CURRENT.try_with(|t| *t).ok().flatten()
}

/// `fut` bound to the transaction current *now* (none if there is none),
/// wherever it is later polled: for `tokio::spawn(with_current(fut))`, since
/// a spawned task does not inherit the spawner's current transaction.
pub fn with_current<F: Future>(fut: F) -> impl Future<Output = F::Output> {
    CURRENT.scope(current_tx(), fut)
}

/// The transaction id a request carries, as [`InboundTxidLayer`] puts it
/// into the request's extensions (`req.extensions().get::<Txid>()`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Txid(pub u64);

/// The transaction a request was made in: the [`Txid`] extension that
/// [`InboundTxidLayer`] set, else the request's metadata (a server without
/// the layer), else none. Malformed values count as none.
pub fn request_txid<T>(req: &tonic::Request<T>) -> Option<u64> {
    req.extensions()
        .get::<Txid>()
        .map(|t| t.0)
        .or_else(|| dtx_proto::txid_of(req))
}

/// The incarnation a request carries beside its txid: the
/// [`Incarnation`] extension that [`InboundTxidLayer`] set, else the
/// request's metadata, else none.
pub fn request_incarnation<T>(req: &tonic::Request<T>) -> Option<u64> {
    req.extensions()
        .get::<Incarnation>()
        .map(|t| t.0)
        .or_else(|| dtx_proto::incarnation_of(req))
}

/// The incarnation a request carries beside its txid, as
/// [`InboundTxidLayer`] puts it into the request's extensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Incarnation(pub u64);

/// A number in raw HTTP headers under `key`, parsed as
/// [`dtx_proto::txid_of`] does.
fn header_number(headers: &http::HeaderMap, key: &str) -> Option<u64> {
    headers
        .get(key)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse().ok())
}

/// Puts the current transaction and trace context into outgoing headers,
/// unless the request already names its own.
fn add_current(headers: &mut http::HeaderMap) {
    if let Some(c) = current_tx() {
        let named_own = headers.contains_key(TXID_METADATA_KEY);
        headers
            .entry(TXID_METADATA_KEY)
            .or_insert_with(|| http::HeaderValue::from(c.txid));
        if let (Some(i), false) = (c.incarnation, named_own) {
            headers
                .entry(INCARNATION_METADATA_KEY)
                .or_insert_with(|| http::HeaderValue::from(i));
        }
    }
    if !headers.contains_key(dtx_proto::trace::TRACEPARENT_HEADER) {
        if let Some(ctx) = crate::trace::current() {
            ctx.attach_headers(headers);
        }
    }
}

/// A tonic interceptor that adds the current transaction's id to each
/// request: `SomeServiceClient::with_interceptor(channel, TxidInterceptor)`.
/// The same as [`OutboundTxidLayer`], for code that builds clients with
/// interceptors.
#[derive(Clone, Copy, Debug, Default)]
pub struct TxidInterceptor;

impl tonic::service::Interceptor for TxidInterceptor {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        add_current(req.metadata_mut().as_mut());
        Ok(req)
    }
}

/// Client-side tower layer: requests sent through the wrapped service (a
/// `tonic::transport::Channel`, say) carry the current transaction's id.
#[derive(Clone, Copy, Debug, Default)]
pub struct OutboundTxidLayer;

impl<S> Layer<S> for OutboundTxidLayer {
    type Service = OutboundTxid<S>;

    fn layer(&self, inner: S) -> OutboundTxid<S> {
        OutboundTxid::new(inner)
    }
}

/// A service (usually a channel) whose requests carry the current
/// transaction's id; see [`OutboundTxidLayer`]. Generated clients take it
/// in place of the channel: `CoordinatorClient::new(OutboundTxid::new(ch))`.
#[derive(Clone, Debug)]
pub struct OutboundTxid<S> {
    inner: S,
}

impl<S> OutboundTxid<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        OutboundTxid { inner }
    }

    /// The wrapped service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B> Service<http::Request<B>> for OutboundTxid<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        // Called from the caller's task (the generated client calls it
        // inside the future the caller awaits), so the task-local is there.
        add_current(req.headers_mut());
        self.inner.call(req)
    }
}

/// Server-side tower layer: for each incoming request that carries a txid,
/// puts a [`Txid`] into its extensions and runs its handler with that txid
/// as the current transaction; for each that carries a txid or a
/// `traceparent`, runs its handler in an `rpc` span that continues the
/// caller's trace (its [`TraceContext`] current and in the extensions).
/// Install it with
/// `tonic::transport::Server::builder().layer(InboundTxidLayer)`.
#[derive(Clone, Copy, Debug, Default)]
pub struct InboundTxidLayer;

impl<S> Layer<S> for InboundTxidLayer {
    type Service = InboundTxid<S>;

    fn layer(&self, inner: S) -> InboundTxid<S> {
        InboundTxid::new(inner)
    }
}

/// A service whose requests' handlers see the txid the request carries;
/// see [`InboundTxidLayer`].
#[derive(Clone, Debug)]
pub struct InboundTxid<S> {
    inner: S,
}

impl<S> InboundTxid<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        InboundTxid { inner }
    }

    /// The wrapped service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, B> Service<http::Request<B>> for InboundTxid<S>
where
    S: Service<http::Request<B>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Instrumented<TaskLocalFuture<Option<TraceContext>, TaskLocalFuture<Option<Current>, S::Future>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        // A request without a txid (or a trace) runs with none, whatever
        // the serving task had.
        let txid = header_number(req.headers(), TXID_METADATA_KEY);
        let incarnation = txid.and(header_number(req.headers(), INCARNATION_METADATA_KEY));
        if let Some(t) = txid {
            req.extensions_mut().insert(Txid(t));
        }
        if let Some(i) = incarnation {
            req.extensions_mut().insert(Incarnation(i));
        }
        let current = txid.map(|txid| Current { txid, incarnation });
        let remote = TraceContext::from_headers(req.headers());
        let (span, trace) = if txid.is_some() || remote.is_some() {
            let span = tracing::info_span!(
                "rpc",
                rpc = %req.uri().path(),
                txid = tracing::field::Empty,
                trace_id = tracing::field::Empty,
                span_id = tracing::field::Empty,
            );
            if let Some(t) = txid {
                span.record("txid", t);
            }
            let ctx = crate::trace::continue_in(&span, remote.as_ref());
            req.extensions_mut().insert(ctx.clone());
            (span, Some(ctx))
        } else {
            (tracing::Span::none(), None)
        };
        let inner = &mut self.inner;
        let fut = span.in_scope(|| {
            crate::trace::sync_scope_opt(trace.clone(), || CURRENT.sync_scope(current, || inner.call(req)))
        });
        crate::trace::scope_opt(trace, CURRENT.scope(current, fut)).instrument(span)
    }
}

#[cfg(test)]
mod tests;
