use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_proto::v1::admin_client::AdminClient;
use dtx_proto::v1::admin_server::Admin;
use dtx_proto::v1::admin_server::AdminServer;
use tonic::service::Interceptor;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use super::*;

/// What a service saw of one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Seen {
    header: Option<u64>,
    extension: Option<u64>,
    current_at_call: Option<u64>,
    current_in_future: Option<u64>,
}

/// A service that records what each request carried.
#[derive(Clone, Default)]
struct Recorder {
    seen: Arc<Mutex<Vec<Seen>>>,
}

type BoxFut = Pin<Box<dyn Future<Output = Result<(), Infallible>> + Send>>;

impl Service<http::Request<()>> for Recorder {
    type Response = ();
    type Error = Infallible;
    type Future = BoxFut;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<()>) -> BoxFut {
        let mut seen = Seen {
            header: header_number(req.headers(), TXID_METADATA_KEY),
            extension: req.extensions().get::<Txid>().map(|t| t.0),
            current_at_call: current(),
            current_in_future: None,
        };
        let log = self.seen.clone();
        Box::pin(async move {
            tokio::task::yield_now().await;
            seen.current_in_future = current();
            log.lock().unwrap().push(seen);
            Ok(())
        })
    }
}

async fn send<S: Service<http::Request<()>>>(svc: &mut S, req: http::Request<()>) -> Result<S::Response, S::Error> {
    std::future::poll_fn(|cx| svc.poll_ready(cx)).await?;
    svc.call(req).await
}

fn with_header(txid: &str) -> http::Request<()> {
    let mut req = http::Request::new(());
    req.headers_mut()
        .insert(TXID_METADATA_KEY, http::HeaderValue::from_str(txid).unwrap());
    req
}

#[tokio::test]
async fn scope_sets_the_current_transaction_and_nests() {
    assert_eq!(current(), None);
    scope(7, async {
        assert_eq!(current(), Some(7));
        scope(8, async { assert_eq!(current(), Some(8)) }).await;
        assert_eq!(current(), Some(7));
        // A spawned task does not inherit it, unless bound with with_current.
        assert_eq!(tokio::spawn(async { current() }).await.unwrap(), None);
        assert_eq!(tokio::spawn(with_current(async { current() })).await.unwrap(), Some(7));
    })
    .await;
    assert_eq!(current(), None);
    assert_eq!(with_current(async { current() }).await, None);
}

#[tokio::test]
async fn the_interceptor_adds_the_current_txid_and_keeps_an_explicit_one() {
    let mut i = TxidInterceptor;
    let out = i.call(Request::new(())).unwrap();
    assert_eq!(dtx_proto::txid_of(&out), None, "outside a scope nothing is added");
    scope(5, async {
        let out = i.call(Request::new(())).unwrap();
        assert_eq!(dtx_proto::txid_of(&out), Some(5));
        let mut explicit = Request::new(());
        dtx_proto::attach_txid(&mut explicit, 6);
        let out = i.call(explicit).unwrap();
        assert_eq!(dtx_proto::txid_of(&out), Some(6), "an explicit txid wins");
    })
    .await;
}

#[tokio::test]
async fn the_outbound_layer_adds_the_current_txid_and_keeps_an_explicit_one() {
    let rec = Recorder::default();
    let mut svc = OutboundTxidLayer.layer(rec.clone());
    send(&mut svc, http::Request::new(())).await.unwrap();
    scope(11, async {
        send(&mut svc, http::Request::new(())).await.unwrap();
        send(&mut svc, with_header("12")).await.unwrap();
    })
    .await;
    let headers: Vec<Option<u64>> = rec.seen.lock().unwrap().iter().map(|s| s.header).collect();
    assert_eq!(headers, [None, Some(11), Some(12)]);
}

#[tokio::test]
async fn the_inbound_layer_exposes_the_txid_to_the_handler_and_only_for_its_request() {
    let rec = Recorder::default();
    let mut svc = InboundTxidLayer.layer(rec.clone());
    send(&mut svc, with_header("21")).await.unwrap();
    // No txid, or a malformed one: the handler runs with none, even where
    // the serving task has one.
    scope(99, async {
        send(&mut svc, http::Request::new(())).await.unwrap();
        send(&mut svc, with_header("not-a-number")).await.unwrap();
    })
    .await;
    let seen = rec.seen.lock().unwrap().clone();
    let some = Seen {
        header: Some(21),
        extension: Some(21),
        current_at_call: Some(21),
        current_in_future: Some(21),
    };
    let none = Seen::default();
    assert_eq!(seen, [some, none, none]);
}

/// What each hop saw: (the request's txid, the current transaction).
type SeenLog = Arc<Mutex<Vec<(Option<u64>, Option<u64>)>>>;

/// An Admin service that records the txid of each ClusterStatus call and,
/// when it has a `next` hop, calls it (through a wrapped channel, with no
/// hand work).
struct Hop {
    seen: SeenLog,
    next: Option<AdminClient<OutboundTxid<dtx_transport::channel::Channel>>>,
}

#[tonic::async_trait]
impl Admin for Hop {
    async fn cluster_status(
        &self,
        req: Request<pb::ClusterStatusRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        self.seen.lock().unwrap().push((request_txid(&req), current()));
        if let Some(next) = &self.next {
            next.clone().cluster_status(pb::ClusterStatusRequest {}).await?;
        }
        Ok(Response::new(pb::ClusterStatusResponse::default()))
    }
    async fn add_node(&self, _: Request<pb::AddNodeRequest>) -> Result<Response<pb::AddNodeResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    async fn remove_node(&self, _: Request<pb::RemoveNodeRequest>) -> Result<Response<pb::RemoveNodeResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    async fn trigger_snapshot(
        &self,
        _: Request<pb::TriggerSnapshotRequest>,
    ) -> Result<Response<pb::TriggerSnapshotResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    async fn resolve(&self, _: Request<pb::ResolveRequest>) -> Result<Response<pb::ResolveResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    async fn list_transactions(
        &self,
        _: Request<pb::ListTransactionsRequest>,
    ) -> Result<Response<pb::ListTransactionsResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    async fn drop_participant(
        &self,
        _: Request<pb::DropParticipantRequest>,
    ) -> Result<Response<pb::DropParticipantResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    async fn forget_transaction(
        &self,
        _: Request<pb::ForgetTransactionRequest>,
    ) -> Result<Response<pb::ForgetTransactionResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    async fn settle_other(
        &self,
        _: Request<pb::SettleOtherRequest>,
    ) -> Result<Response<pb::SettleOtherResponse>, Status> {
        Err(Status::unimplemented("test"))
    }
    type BackupStream = tonic::codegen::BoxStream<pb::BackupChunk>;
    async fn backup(&self, _: Request<pb::BackupRequest>) -> Result<Response<Self::BackupStream>, Status> {
        Err(Status::unimplemented("test"))
    }
}

/// Serves `hop` on 127.0.0.1:0 with the inbound layer; its address.
async fn serve(hop: Hop) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .layer(InboundTxidLayer)
            .add_service(AdminServer::new(hop))
            .serve_with_incoming(dtx_transport::incoming(listener)),
    );
    addr
}

fn channel(addr: &str) -> dtx_transport::channel::Channel {
    dtx_transport::channel::channel(addr, None, Duration::from_secs(2)).unwrap()
}

#[tokio::test]
async fn a_txid_travels_from_a_scope_through_a_service_to_the_next_one() {
    let back_seen = SeenLog::default();
    let back = serve(Hop {
        seen: back_seen.clone(),
        next: None,
    })
    .await;
    let front_seen = SeenLog::default();
    let front = serve(Hop {
        seen: front_seen.clone(),
        next: Some(AdminClient::new(OutboundTxid::new(channel(&back)))),
    })
    .await;

    // Through the tower layer, through the interceptor, and outside a scope.
    let mut layered = AdminClient::new(OutboundTxidLayer.layer(channel(&front)));
    let mut intercepted = AdminClient::with_interceptor(channel(&front), TxidInterceptor);
    scope(31, layered.cluster_status(pb::ClusterStatusRequest {}))
        .await
        .unwrap();
    scope(32, intercepted.cluster_status(pb::ClusterStatusRequest {}))
        .await
        .unwrap();
    layered.cluster_status(pb::ClusterStatusRequest {}).await.unwrap();

    let expected = [(Some(31), Some(31)), (Some(32), Some(32)), (None, None)];
    assert_eq!(*front_seen.lock().unwrap(), expected);
    assert_eq!(*back_seen.lock().unwrap(), expected, "the front service passed it on");
}

/// The trace context across the layers: what the inbound layer hands the
/// handler and what a call made in its context carries on.
mod trace_context {
    use std::future::Future;

    use crate::trace::current;
    use crate::trace::scope;
    use crate::trace::TraceContext;

    /// What a handler behind `InboundTxidLayer` sees: (the context in the
    /// extensions, the current context, in the handler's future).
    type Seen = (Option<TraceContext>, Option<TraceContext>);

    #[derive(Clone, Default)]
    struct Handler {
        seen: std::sync::Arc<std::sync::Mutex<Vec<Seen>>>,
    }

    impl tower_service::Service<http::Request<()>> for Handler {
        type Response = ();
        type Error = std::convert::Infallible;
        type Future = std::pin::Pin<Box<dyn Future<Output = Result<(), Self::Error>> + Send>>;

        fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Ok(()))
        }

        fn call(&mut self, req: http::Request<()>) -> Self::Future {
            let ext = req.extensions().get::<TraceContext>().cloned();
            let seen = self.seen.clone();
            Box::pin(async move {
                tokio::task::yield_now().await;
                seen.lock().unwrap().push((ext, current()));
                Ok(())
            })
        }
    }

    async fn serve(h: &Handler, headers: &[(&'static str, &str)]) -> Seen {
        use tower_layer::Layer;
        use tower_service::Service;
        let mut svc = crate::propagate::InboundTxidLayer.layer(h.clone());
        let mut req = http::Request::new(());
        for (k, v) in headers {
            req.headers_mut().append(*k, http::HeaderValue::from_str(v).unwrap());
        }
        svc.call(req).await.unwrap();
        h.seen.lock().unwrap().pop().unwrap()
    }

    #[tokio::test]
    async fn the_inbound_layer_continues_the_callers_trace_and_ignores_a_malformed_one() {
        let h = Handler::default();
        let sent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let (ext, cur) = serve(&h, &[("traceparent", sent), ("tracestate", "rojo=1")]).await;
        let ext = ext.expect("a context for the handler");
        assert_eq!(cur, Some(ext.clone()), "current across the handler's awaits");
        assert_eq!(ext.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_ne!(ext.span_id, 0x00f067aa0ba902b7, "a span of its own");
        assert_eq!(ext.state.as_deref(), Some("rojo=1"), "tracestate passed through");
        // A malformed traceparent is ignored: with a txid the handler gets
        // a new trace, without one no span and no context.
        let (ext, _) = serve(&h, &[("traceparent", "00-zz"), ("x-dtx-txid", "7")]).await;
        assert_ne!(ext.expect("a new trace").trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!(serve(&h, &[("traceparent", "00-zz")]).await, (None, None));
        // Outbound: a call made in the handler's context carries it on.
        let out = scope(TraceContext::from_traceparent(sent, None).unwrap(), async {
            use tonic::service::Interceptor;
            crate::propagate::TxidInterceptor.call(tonic::Request::new(())).unwrap()
        })
        .await;
        let md = out.metadata();
        assert_eq!(md.get("traceparent").unwrap().to_str().unwrap(), sent);
    }
}

/// The incarnation travels beside the txid when the scope knows it, and
/// never beside a txid the request named itself (it would be another
/// transaction's).
#[tokio::test]
async fn the_incarnation_travels_beside_the_txid_and_only_with_it() {
    let mut both = http::HeaderMap::new();
    scope_in(7, 42, async { add_current(&mut both) }).await;
    assert_eq!(header_number(&both, TXID_METADATA_KEY), Some(7));
    assert_eq!(header_number(&both, INCARNATION_METADATA_KEY), Some(42));
    let mut txid_only = http::HeaderMap::new();
    scope(7, async { add_current(&mut txid_only) }).await;
    assert_eq!(header_number(&txid_only, TXID_METADATA_KEY), Some(7));
    assert_eq!(header_number(&txid_only, INCARNATION_METADATA_KEY), None);
    let mut own = http::HeaderMap::new();
    own.insert(TXID_METADATA_KEY, http::HeaderValue::from(9u64));
    scope_in(7, 42, async { add_current(&mut own) }).await;
    assert_eq!(header_number(&own, TXID_METADATA_KEY), Some(9));
    assert_eq!(header_number(&own, INCARNATION_METADATA_KEY), None);
    assert_eq!(
        scope_in(7, 42, async { current_tx() }).await,
        Some(Current {
            txid: 7,
            incarnation: Some(42)
        })
    );
    assert_eq!(with_current(async { current_tx() }).await, None);
}
