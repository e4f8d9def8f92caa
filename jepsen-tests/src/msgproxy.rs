//! The `message-chaos` nemesis: a gRPC proxy in front of each bank service
//! that, while the fault is on, delays, duplicates and replays late the
//! coordinator's messages to participants (Prepare, CommitOnePhase, Commit,
//! Abort, and PrepareMany and ApplyDecisions, whose every copy carries all
//! its items). This kernel has no netem, and a TCP-level proxy cannot duplicate
//! a gRPC message, so it is done per call: the fault point "duplicate and
//! late messages across txids" of docs/design.md#fault-points.
//!
//! Every participant address the clients hand to the coordinator is the
//! proxy's, on the bank's own IP (so partitions on that IP still cut it).
//! While the fault is off the proxy only relays. While it is on, each call:
//! - waits 0-250 ms first, half of the time (delay, and so reordering
//!   between concurrent calls);
//! - is sent a second time at once, a quarter of the time (duplicate; the
//!   copy's answer is dropped);
//! - is sent again 1-4 s later, one time in six (a late message, usually
//!   after its transaction was decided; its answer is dropped). Late copies
//!   still arrive after the fault ends.
//!
//! The saga workload puts the same proxy in front of each step service
//! ([`spawn_step`], SagaStepService): Forward, Compensate and Fence get the
//! same delay, duplicate and late replay (a Fence is a write: it records an
//! unknown operation as never to run); Status passes straight through.
//!
//! The `participant-gone` nemesis also shuts a proxy down for good
//! ([`ProxyHandle::go_away`]): its address then refuses connections, as the
//! address of a process that is gone does.
//!
//! In a run with `--tls` ([`ProxyTls`]) each proxy is a man in the middle
//! the cluster trusts: it serves TLS with a node certificate
//! (`dtx://node/<PROXY_NODE_ID_BASE + i>`: a node's name is a node id,
//! never a member's here; valid for its IP, which the nodes check when
//! they dial it), requires the caller's certificate from the run's
//! authority (mutual TLS), and calls its bank over TLS with that same
//! certificate, so the bank admits its calls as a node's.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use dtx_proto::v1::participant_service_server::ParticipantService;
use dtx_proto::v1::participant_service_server::ParticipantServiceServer;
use dtx_proto::v1::saga_step_service_client::SagaStepServiceClient;
use dtx_proto::v1::saga_step_service_server::SagaStepService;
use dtx_proto::v1::saga_step_service_server::SagaStepServiceServer;
use dtx_tls::ClientTls;
use dtx_tls::ServerTls;
use dtx_transport::channel::Channel;
use rand::rngs::StdRng;
use rand::Rng;
use rand::SeedableRng;
use tonic::Request;
use tonic::Response;
use tonic::Status;

/// The node ids of the proxies' certificates: bank proxies from here, step
/// proxies from `PROXY_NODE_ID_BASE + 100`, far above the run's members.
pub const PROXY_NODE_ID_BASE: u64 = 1000;

/// Shared by every proxy: whether the fault is on, and what it did.
#[derive(Default)]
pub struct Chaos {
    on: AtomicBool,
    pub delayed: AtomicU64,
    pub duplicated: AtomicU64,
    pub replayed_late: AtomicU64,
    /// The branch workload's `Change` calls (clients to the banks' own
    /// API, made by the clients themselves while the fault is on):
    /// delayed, sent twice at once, sent again late.
    pub changes_delayed: AtomicU64,
    pub changes_duplicated: AtomicU64,
    pub changes_late: AtomicU64,
}

impl Chaos {
    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::SeqCst);
    }

    /// Whether the fault is on.
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }

    /// "delayed D, duplicated U, late L" since the start of the run.
    pub fn summary(&self) -> String {
        let mut s = format!(
            "delayed {}, duplicated {}, late {}",
            self.delayed.load(Ordering::Relaxed),
            self.duplicated.load(Ordering::Relaxed),
            self.replayed_late.load(Ordering::Relaxed)
        );
        let changes =
            [&self.changes_delayed, &self.changes_duplicated, &self.changes_late].map(|c| c.load(Ordering::Relaxed));
        if changes.iter().any(|c| *c > 0) {
            s.push_str(&format!(
                "; Change calls delayed {}, duplicated {}, late {}",
                changes[0], changes[1], changes[2]
            ));
        }
        s
    }
}

/// Per call: what the chaos does to it.
struct Plan {
    delay_ms: u64,
    duplicate: bool,
    late_ms: Option<u64>,
}

/// A proxy in front of one service; `C` is the client of its protocol.
struct Proxy<C> {
    upstream: C,
    chaos: Arc<Chaos>,
    rng: Mutex<StdRng>,
    gone: Arc<AtomicBool>,
}

/// Controls one running proxy; dropping it stops the proxy.
pub struct ProxyHandle {
    gone: Arc<AtomicBool>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl ProxyHandle {
    /// The participant is gone for good: calls still in flight on open
    /// connections fail at once, the listener closes (new connections are
    /// refused) and open connections are told to go away.
    pub fn go_away(&mut self) {
        self.gone.store(true, Ordering::SeqCst);
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// How long a relayed call may take (the coordinator has its own, shorter,
/// timeouts).
const RELAY_TIMEOUT: Duration = Duration::from_secs(10);

impl<C: Clone + Send + 'static> Proxy<C> {
    /// A proxy relaying to `upstream`, and its "gone for good" flag.
    fn new(upstream: C, chaos: Arc<Chaos>, seed: u64) -> (Self, Arc<AtomicBool>) {
        let gone = Arc::new(AtomicBool::new(false));
        let proxy = Proxy {
            upstream,
            chaos,
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            gone: gone.clone(),
        };
        (proxy, gone)
    }

    fn plan(&self) -> Plan {
        if !self.chaos.on.load(Ordering::SeqCst) {
            return Plan {
                delay_ms: 0,
                duplicate: false,
                late_ms: None,
            };
        }
        let mut rng = self.rng.lock().expect("rng");
        Plan {
            delay_ms: if rng.random_bool(0.5) {
                rng.random_range(0..=250)
            } else {
                0
            },
            duplicate: rng.random_bool(0.25),
            late_ms: rng.random_bool(1.0 / 6.0).then(|| rng.random_range(1_000..=4_000)),
        }
    }

    /// Relays `body` with `call`, after applying the chaos plan.
    async fn relay<Q, A, F, Fut>(&self, body: Q, call: F) -> Result<Response<A>, Status>
    where
        Q: Clone + Send + 'static,
        A: Send + 'static,
        F: Fn(C, Request<Q>) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = Result<Response<A>, Status>> + Send + 'static,
    {
        if self.gone.load(Ordering::SeqCst) {
            return Err(Status::unavailable("participant gone"));
        }
        let plan = self.plan();
        let request = |b: Q| {
            let mut r = Request::new(b);
            r.set_timeout(RELAY_TIMEOUT);
            r
        };
        if plan.delay_ms > 0 {
            self.chaos.delayed.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(plan.delay_ms)).await;
        }
        if plan.duplicate {
            self.chaos.duplicated.fetch_add(1, Ordering::Relaxed);
            let (c, b, f) = (self.upstream.clone(), body.clone(), call.clone());
            let r = request(b);
            tokio::spawn(async move {
                let _ = f(c, r).await;
            });
        }
        if let Some(ms) = plan.late_ms {
            self.chaos.replayed_late.fetch_add(1, Ordering::Relaxed);
            let (c, b, f) = (self.upstream.clone(), body.clone(), call.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(ms)).await;
                let _ = f(c, request(b)).await;
            });
        }
        call(self.upstream.clone(), request(body)).await
    }
}

#[tonic::async_trait]
impl ParticipantService for Proxy<ParticipantServiceClient<Channel>> {
    async fn prepare(&self, req: Request<pb::PrepareRequest>) -> Result<Response<pb::PrepareResponse>, Status> {
        self.relay(req.into_inner(), |mut c, r| async move { c.prepare(r).await })
            .await
    }

    async fn commit_one_phase(
        &self,
        req: Request<pb::PrepareRequest>,
    ) -> Result<Response<pb::OnePhaseResponse>, Status> {
        self.relay(req.into_inner(), |mut c, r| async move { c.commit_one_phase(r).await })
            .await
    }

    async fn commit(
        &self,
        req: Request<pb::ParticipantDecisionRequest>,
    ) -> Result<Response<pb::ParticipantDecisionResponse>, Status> {
        self.relay(req.into_inner(), |mut c, r| async move { c.commit(r).await })
            .await
    }

    async fn abort(
        &self,
        req: Request<pb::ParticipantDecisionRequest>,
    ) -> Result<Response<pb::ParticipantDecisionResponse>, Status> {
        self.relay(req.into_inner(), |mut c, r| async move { c.abort(r).await })
            .await
    }

    /// Many prepares in one message, with any decisions riding in it (ADR
    /// 0030): delayed, duplicated and replayed late as a whole, like Prepare
    /// (each copy carries all its items; a repeated prepare answers the
    /// recorded vote, a repeated decision is acked).
    async fn prepare_many(
        &self,
        req: Request<pb::PrepareManyRequest>,
    ) -> Result<Response<pb::PrepareManyResponse>, Status> {
        self.relay(req.into_inner(), |mut c, r| async move { c.prepare_many(r).await })
            .await
    }

    /// Many decisions in one message: delayed, duplicated and replayed late
    /// as a whole, like any other phase-two call.
    async fn apply_decisions(
        &self,
        req: Request<pb::ApplyDecisionsRequest>,
    ) -> Result<Response<pb::ApplyDecisionsResponse>, Status> {
        self.relay(req.into_inner(), |mut c, r| async move { c.apply_decisions(r).await })
            .await
    }

    /// Read-only: passed straight through (no chaos on an inquiry).
    async fn inquire(&self, req: Request<pb::InquireRequest>) -> Result<Response<pb::InquireResponse>, Status> {
        if self.gone.load(Ordering::SeqCst) {
            return Err(Status::unavailable("participant gone"));
        }
        self.upstream.clone().inquire(req.into_inner()).await
    }

    /// Read-only, for operators: passed straight through, as `inquire`.
    async fn inspect(
        &self,
        req: Request<pb::InspectParticipantRequest>,
    ) -> Result<Response<pb::InspectParticipantResponse>, Status> {
        if self.gone.load(Ordering::SeqCst) {
            return Err(Status::unavailable("participant gone"));
        }
        self.upstream.clone().inspect(req.into_inner()).await
    }
}

#[tonic::async_trait]
impl SagaStepService for Proxy<SagaStepServiceClient<Channel>> {
    async fn forward(&self, req: Request<pb::StepCall>) -> Result<Response<pb::StepReply>, Status> {
        self.relay(req.into_inner(), |mut c, r| async move { c.forward(r).await })
            .await
    }

    async fn compensate(&self, req: Request<pb::StepCall>) -> Result<Response<pb::StepReply>, Status> {
        self.relay(req.into_inner(), |mut c, r| async move { c.compensate(r).await })
            .await
    }

    /// Read-only: passed straight through (no chaos on an inquiry).
    async fn status(&self, req: Request<pb::StepStatusRequest>) -> Result<Response<pb::StepStatusReply>, Status> {
        if self.gone.load(Ordering::SeqCst) {
            return Err(Status::unavailable("step service gone"));
        }
        self.upstream.clone().status(req.into_inner()).await
    }

    /// A write (an unknown operation becomes never to run): delayed,
    /// duplicated and replayed late like Forward.
    async fn fence(&self, req: Request<pb::StepStatusRequest>) -> Result<Response<pb::StepStatusReply>, Status> {
        self.relay(req.into_inner(), |mut c, r| async move { c.fence(r).await })
            .await
    }
}

/// A proxy's TLS in a run with `--tls`: what it serves with and what it
/// calls its bank with (one node certificate for both).
pub struct ProxyTls {
    pub server: Arc<ServerTls>,
    pub client: Arc<ClientTls>,
}

/// How long connecting to the bank may take.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// Starts a proxy on `listen` in front of the bank at `upstream`; it
/// connects to the bank from `listen`'s IP. With `tls` it serves TLS and
/// calls the bank over TLS (see the module's notes); without, both sides
/// are plain text. It runs until the process ends or
/// [`ProxyHandle::go_away`].
pub async fn spawn(
    listen: SocketAddr,
    upstream: &str,
    chaos: Arc<Chaos>,
    seed: u64,
    tls: Option<ProxyTls>,
) -> anyhow::Result<ProxyHandle> {
    let (channel, server_tls) = connect(listen, upstream, tls)?;
    let (proxy, gone) = Proxy::new(ParticipantServiceClient::new(channel), chaos, seed);
    let router = tonic::transport::Server::builder().add_service(ParticipantServiceServer::new(proxy));
    serve(listen, router, server_tls, gone).await
}

/// Starts a proxy on `listen` in front of the saga step service at
/// `upstream`, as [`spawn`] does for a bank (with `tls`, as a man in the
/// middle the nodes trust).
pub async fn spawn_step(
    listen: SocketAddr,
    upstream: &str,
    chaos: Arc<Chaos>,
    seed: u64,
    tls: Option<ProxyTls>,
) -> anyhow::Result<ProxyHandle> {
    let (channel, server_tls) = connect(listen, upstream, tls)?;
    let (proxy, gone) = Proxy::new(SagaStepServiceClient::new(channel), chaos, seed);
    let router = tonic::transport::Server::builder().add_service(SagaStepServiceServer::new(proxy));
    serve(listen, router, server_tls, gone).await
}

/// The channel to the service behind a proxy, dialled from `listen`'s IP,
/// and what the proxy serves TLS with.
fn connect(
    listen: SocketAddr,
    upstream: &str,
    tls: Option<ProxyTls>,
) -> anyhow::Result<(Channel, Option<Arc<ServerTls>>)> {
    let (client, server) = match tls {
        None => (None, None),
        Some(t) => (Some(t.client), Some(t.server)),
    };
    let channel = dtx_transport::channel::channel_with(upstream, Some(listen.ip()), CONNECT_TIMEOUT, client.as_ref())
        .map_err(|e| anyhow::anyhow!(e))?;
    Ok((channel, server))
}

/// Serves `router` on `listen` until [`ProxyHandle::go_away`].
async fn serve(
    listen: SocketAddr,
    router: tonic::transport::server::Router,
    server_tls: Option<Arc<ServerTls>>,
    gone: Arc<AtomicBool>,
) -> anyhow::Result<ProxyHandle> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("message proxy cannot listen on {listen}: {e}"))?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        let _ = rx.await;
    };
    match server_tls {
        None => {
            tokio::spawn(router.serve_with_incoming_shutdown(dtx_transport::incoming(listener), shutdown));
        }
        Some(t) => {
            tokio::spawn(router.serve_with_incoming_shutdown(dtx_tls::incoming(listener, Some(t)), shutdown));
        }
    }
    Ok(ProxyHandle {
        gone,
        shutdown: Some(tx),
    })
}
