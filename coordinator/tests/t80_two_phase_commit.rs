//! Two-phase commit end to end: coordinator node processes and participant
//! services (the SDK's gRPC server on its durable store, in this test's
//! process, on real sockets). Invariants 2 and 3 (every participant applies
//! the one decision), 4 (a COMMIT reaches every participant even when the
//! leader dies before delivering it), and 10 (records are forgotten once
//! every participant acked).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::TestCluster;
use coordinator::client::DecisionRead;
use coordinator::client::TxOutcome;
use dtx_proto::v1::participant_service_server::ParticipantServiceServer;
use participant_sdk::log::LocalState;
use participant_sdk::log::Vote;
use participant_sdk::server::ParticipantServer;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::View;

/// Stages the payload on prepare, applies it on commit; payload "no" votes NO.
struct Stage;

impl Resource for Stage {
    fn prepare(&self, _v: &View<'_>, txid: u64, payload: &[u8], staged: &mut Staged) -> Vote {
        if payload == b"no" {
            return Vote::No;
        }
        staged.put(format!("staged/{txid}").as_bytes(), payload);
        Vote::Yes
    }
    fn commit(&self, _v: &View<'_>, txid: u64, staged: &mut Staged) {
        staged.delete(format!("staged/{txid}").as_bytes());
        staged.put(format!("applied/{txid}").as_bytes(), b"1");
    }
    fn abort(&self, _v: &View<'_>, txid: u64, staged: &mut Staged) {
        staged.delete(format!("staged/{txid}").as_bytes());
    }
}

/// Wraps the SDK server; while `hold_decisions` is set, Commit and Abort
/// deliveries are refused as if the participant were unreachable.
struct Gated {
    inner: ParticipantServer<Stage>,
    hold_decisions: Arc<std::sync::atomic::AtomicBool>,
}

type R<T> = Result<tonic::Response<T>, tonic::Status>;

#[tonic::async_trait]
impl dtx_proto::v1::participant_service_server::ParticipantService for Gated {
    async fn prepare(&self, req: tonic::Request<dtx_proto::v1::PrepareRequest>) -> R<dtx_proto::v1::PrepareResponse> {
        self.inner.prepare(req).await
    }
    async fn commit(
        &self,
        req: tonic::Request<dtx_proto::v1::ParticipantDecisionRequest>,
    ) -> R<dtx_proto::v1::ParticipantDecisionResponse> {
        if self.hold_decisions.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tonic::Status::unavailable("held by the test"));
        }
        self.inner.commit(req).await
    }
    async fn abort(
        &self,
        req: tonic::Request<dtx_proto::v1::ParticipantDecisionRequest>,
    ) -> R<dtx_proto::v1::ParticipantDecisionResponse> {
        if self.hold_decisions.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tonic::Status::unavailable("held by the test"));
        }
        self.inner.abort(req).await
    }
}

/// A participant service on its own address over a durable store; it stops
/// when dropped.
struct Svc {
    id: String,
    addr: String,
    store: Arc<ParticipantStore<Stage>>,
    hold_decisions: Arc<std::sync::atomic::AtomicBool>,
    /// Dropping it stops the server.
    _stop: Option<tokio::sync::oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl Svc {
    async fn new(id: &str) -> Svc {
        let dir = tempfile::tempdir().unwrap();
        let store = ParticipantStore::open(dir.path(), Stage).unwrap();
        let port = coordinator::cluster::free_port("127.0.0.1").unwrap();
        let mut s = Svc {
            id: id.to_string(),
            addr: format!("127.0.0.1:{port}"),
            store,
            hold_decisions: Arc::default(),
            _stop: None,
            _dir: dir,
        };
        s.start().await;
        s
    }

    async fn start(&mut self) {
        let listener = tokio::net::TcpListener::bind(&self.addr).await.unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let svc = ParticipantServiceServer::new(Gated {
            inner: ParticipantServer::new(self.store.clone(), &self.id),
            hold_decisions: self.hold_decisions.clone(),
        });
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(listener), async {
                    let _ = rx.await;
                }),
        );
        self._stop = Some(tx);
    }

    fn state(&self, txid: u64) -> Option<LocalState> {
        self.store.entry(txid).unwrap().map(|e| e.state)
    }

    async fn wait_state(&self, txid: u64, want: LocalState, timeout: Duration) -> bool {
        let until = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < until {
            if self.state(txid) == Some(want) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_commit_abort_and_unreachable_participant() {
    let mut c = TestCluster::start_with("t80a", 3, |cfg| {
        cfg.txn.retention_ms = 500;
        cfg.txn.prepare_timeout_ms = 1_000;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;

    // Both YES: COMMIT, applied at both, acked, then forgotten.
    let t = cl.begin("tx-commit", 30_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"debit 5").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"credit 5").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert!(a.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);
    assert!(b.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);
    assert_eq!(
        a.store
            .view()
            .get(format!("applied/{t}").as_bytes())
            .unwrap()
            .as_deref(),
        Some(&b"1"[..])
    );
    let mut forgotten = false;
    for _ in 0..100 {
        if cl.decision(t).await.unwrap() == DecisionRead::UnknownPresumedAbort {
            forgotten = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(forgotten, "a fully acked transaction was not forgotten after retention");

    // One NO: ABORT; the YES participant's prepared work is rolled back.
    let t = cl.begin("tx-no", 30_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"debit 5").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"no").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Aborted);
    assert!(
        a.wait_state(t, LocalState::Aborted { tombstone: false }, Duration::from_secs(10))
            .await
    );
    assert_eq!(a.store.view().get(format!("staged/{t}").as_bytes()).unwrap(), None);
    let st = cl.status(t).await.unwrap();
    assert!(st.decision.unwrap().note.contains("bank-b voted NO"));

    // A participant that cannot be reached at prepare: ABORT.
    let t = cl.begin("tx-unreachable", 30_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"debit 5").await.unwrap();
    cl.enlist(t, "ghost", "127.0.0.1:1", b"").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Aborted);
    assert!(
        a.wait_state(t, LocalState::Aborted { tombstone: false }, Duration::from_secs(10))
            .await
    );

    // Client Abort before any Prepare: participants get a tombstone, so a
    // late Prepare would vote NO (invariant 8).
    let t = cl.begin("tx-client-abort", 30_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    assert_eq!(cl.abort(t, "changed my mind").await.unwrap(), TxOutcome::Aborted);
    assert!(
        a.wait_state(t, LocalState::Aborted { tombstone: true }, Duration::from_secs(10))
            .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_new_leader_delivers_a_commit_the_old_leader_could_not() {
    let mut c = TestCluster::start_with("t80b", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
    });
    let leader = c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;

    let t = cl.begin("tx-failover", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"debit").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"credit").await.unwrap();
    // b votes YES but refuses phase two for now: it stays in doubt.
    b.hold_decisions.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert!(a.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        b.state(t),
        Some(LocalState::Prepared { vote: Vote::Yes }),
        "b must be in doubt"
    );
    assert_eq!(b.store.in_doubt().unwrap().len(), 1);

    // The leader dies with the decision applied but not delivered to b.
    c.procs.kill9(leader);
    b.hold_decisions.store(false, std::sync::atomic::Ordering::SeqCst);
    // A new leader's scan finds the decided, unacked transaction and
    // delivers it (invariant 4), in about an election plus a retry
    // (invariant 6).
    let started = std::time::Instant::now();
    assert!(
        b.wait_state(t, LocalState::Committed, Duration::from_secs(20)).await,
        "b never learned the COMMIT: {:?}",
        b.state(t)
    );
    eprintln!("b resolved {:?} after the leader was killed", started.elapsed());
    assert_eq!(
        b.store
            .view()
            .get(format!("applied/{t}").as_bytes())
            .unwrap()
            .as_deref(),
        Some(&b"1"[..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_participant_recovery_asks_the_cluster() {
    let mut c = TestCluster::start_with("t80c", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let t = cl.begin("tx-recover", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    a.hold_decisions.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert_eq!(a.state(t), Some(LocalState::Prepared { vote: Vote::Yes }));
    // Recovery (what the SDK runs on start and periodically) learns the
    // decision from the cluster itself, even with deliveries still refused.
    let n = participant_sdk::server::recover_once(&a.store, &c.procs.api_addrs())
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert_eq!(a.state(t), Some(LocalState::Committed));
}
