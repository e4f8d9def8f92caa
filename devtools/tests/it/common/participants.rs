//! In-process participant services for tests: the SDK's gRPC server on a
//! durable store, on a real socket, with a switch that refuses phase-two
//! deliveries (to keep a participant in doubt).
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use dtx_proto::v1::participant_service_server::ParticipantServiceServer;
use participant_sdk::log::LocalState;
use participant_sdk::log::Vote;
use participant_sdk::server::ParticipantServer;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::View;
use participant_sdk::GlobalTxid;

/// Stages the payload on prepare, applies it on commit; payload "no" votes
/// NO, payload "ro" votes READ_ONLY (nothing to commit). Keys carry the
/// txid number alone (`staged/<txid>`, `applied/<txid>`): a test runs one
/// cluster, so one incarnation.
pub struct Stage;

impl Resource for Stage {
    fn prepare(&self, _v: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
        match payload {
            b"no" => return Vote::No,
            b"ro" => return Vote::ReadOnly,
            _ => {}
        }
        staged.put(format!("staged/{}", txid.txid).as_bytes(), payload);
        Vote::Yes
    }
    fn commit(&self, _v: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        staged.delete(format!("staged/{}", txid.txid).as_bytes());
        staged.put(format!("applied/{}", txid.txid).as_bytes(), b"1");
    }
    fn abort(&self, _v: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        staged.delete(format!("staged/{}", txid.txid).as_bytes());
    }
}

/// Wraps the SDK server; while `hold_decisions` is set, Commit, Abort and
/// ApplyDecisions deliveries are refused as if the participant were
/// unreachable; while `old_sdk` is set, ApplyDecisions and PrepareMany
/// answer UNIMPLEMENTED, as a participant built on an SDK from before them
/// does. PrepareMany gets the delays Prepare gets.
pub struct Gated {
    inner: ParticipantServer<ParticipantStore<Stage>>,
    hold_decisions: Arc<std::sync::atomic::AtomicBool>,
    /// Milliseconds a one-phase commit waits before it is handled (a slow
    /// participant).
    one_phase_delay_ms: Arc<std::sync::atomic::AtomicU64>,
    /// While set, a one-phase commit is handled but its answer is lost.
    lose_one_phase_answers: Arc<std::sync::atomic::AtomicBool>,
    /// Milliseconds a Prepare waits before it is handled (a slow voter).
    prepare_delay_ms: Arc<std::sync::atomic::AtomicU64>,
    /// Milliseconds a handled Prepare waits before its vote is sent (the
    /// vote is durable meanwhile).
    prepare_reply_delay_ms: Arc<std::sync::atomic::AtomicU64>,
    /// Commit and Abort calls, and ApplyDecisions items and decisions
    /// riding in PrepareMany, received (held or not).
    decisions_received: Arc<std::sync::atomic::AtomicU32>,
    /// Decisions that rode in PrepareMany messages (held or not).
    riding_decisions: Arc<std::sync::atomic::AtomicU32>,
    /// While set, decisions riding in PrepareMany are dropped unread and
    /// answered with no results (an SDK from before ADR 0030).
    ignore_riding: Arc<std::sync::atomic::AtomicBool>,
    old_sdk: Arc<std::sync::atomic::AtomicBool>,
    /// ApplyDecisions calls received (held or not; not while `old_sdk`).
    apply_decisions_calls: Arc<std::sync::atomic::AtomicU32>,
    /// Prepare calls, and PrepareMany items, received.
    prepares_received: Arc<std::sync::atomic::AtomicU32>,
    /// PrepareMany calls received (not while `old_sdk`).
    prepare_many_calls: Arc<std::sync::atomic::AtomicU32>,
    /// CommitOnePhase calls received.
    one_phase_received: Arc<std::sync::atomic::AtomicU32>,
    /// (method, `traceparent`) of each call that carried one.
    traceparents: Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

impl Gated {
    fn saw<T>(&self, method: &str, req: &tonic::Request<T>) {
        if let Some(v) = req.metadata().get("traceparent").and_then(|v| v.to_str().ok()) {
            self.traceparents
                .lock()
                .unwrap()
                .push((method.to_string(), v.to_string()));
        }
    }
}

type R<T> = Result<tonic::Response<T>, tonic::Status>;

#[tonic::async_trait]
impl dtx_proto::v1::participant_service_server::ParticipantService for Gated {
    async fn prepare(&self, req: tonic::Request<dtx_proto::v1::PrepareRequest>) -> R<dtx_proto::v1::PrepareResponse> {
        self.saw("Prepare", &req);
        self.prepares_received.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let delay = self.prepare_delay_ms.load(std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        let vote = self.inner.prepare(req).await;
        let delay = self.prepare_reply_delay_ms.load(std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        vote
    }
    /// The same delays as `prepare`, once for the whole message (every item
    /// in it is delayed as a Prepare call would be).
    async fn prepare_many(
        &self,
        req: tonic::Request<dtx_proto::v1::PrepareManyRequest>,
    ) -> R<dtx_proto::v1::PrepareManyResponse> {
        self.saw("PrepareMany", &req);
        if self.old_sdk.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tonic::Status::unimplemented(
                "this participant's SDK predates PrepareMany",
            ));
        }
        self.prepare_many_calls
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.prepares_received
            .fetch_add(req.get_ref().items.len() as u32, std::sync::atomic::Ordering::SeqCst);
        // Decisions riding along (ADR 0030) count as received, and while
        // decisions are held each of them fails as an ApplyDecisions item
        // would, while the prepares go on.
        let riding = req.get_ref().decisions.len();
        self.decisions_received
            .fetch_add(riding as u32, std::sync::atomic::Ordering::SeqCst);
        self.riding_decisions
            .fetch_add(riding as u32, std::sync::atomic::Ordering::SeqCst);
        let mut req = req;
        if self.ignore_riding.load(std::sync::atomic::Ordering::SeqCst) {
            req.get_mut().decisions.clear();
        }
        let held = !req.get_ref().decisions.is_empty() && self.hold_decisions.load(std::sync::atomic::Ordering::SeqCst);
        if held {
            req.get_mut().decisions.clear();
        }
        let delay = self.prepare_delay_ms.load(std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        let mut votes = self.inner.prepare_many(req).await;
        if held {
            if let Ok(r) = votes.as_mut() {
                r.get_mut().decision_results = (0..riding)
                    .map(|_| dtx_proto::v1::DecisionItemResult {
                        applied: false,
                        code: tonic::Code::Unavailable as i32,
                        refusal: String::new(),
                        message: "held by the test".into(),
                    })
                    .collect();
            }
        }
        let delay = self.prepare_reply_delay_ms.load(std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        votes
    }
    async fn commit_one_phase(
        &self,
        req: tonic::Request<dtx_proto::v1::PrepareRequest>,
    ) -> R<dtx_proto::v1::OnePhaseResponse> {
        self.saw("CommitOnePhase", &req);
        self.one_phase_received
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.hold_decisions.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tonic::Status::unavailable("held by the test"));
        }
        let delay = self.one_phase_delay_ms.load(std::sync::atomic::Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(delay)).await;
        let answer = self.inner.commit_one_phase(req).await;
        if self.lose_one_phase_answers.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tonic::Status::unavailable("answer lost by the test"));
        }
        answer
    }
    async fn commit(
        &self,
        req: tonic::Request<dtx_proto::v1::ParticipantDecisionRequest>,
    ) -> R<dtx_proto::v1::ParticipantDecisionResponse> {
        self.saw("Commit", &req);
        self.decisions_received
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.hold_decisions.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tonic::Status::unavailable("held by the test"));
        }
        self.inner.commit(req).await
    }
    async fn abort(
        &self,
        req: tonic::Request<dtx_proto::v1::ParticipantDecisionRequest>,
    ) -> R<dtx_proto::v1::ParticipantDecisionResponse> {
        self.saw("Abort", &req);
        self.decisions_received
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if self.hold_decisions.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tonic::Status::unavailable("held by the test"));
        }
        self.inner.abort(req).await
    }
    async fn apply_decisions(
        &self,
        req: tonic::Request<dtx_proto::v1::ApplyDecisionsRequest>,
    ) -> R<dtx_proto::v1::ApplyDecisionsResponse> {
        self.saw("ApplyDecisions", &req);
        if self.old_sdk.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tonic::Status::unimplemented(
                "this participant's SDK predates ApplyDecisions",
            ));
        }
        self.apply_decisions_calls
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.decisions_received
            .fetch_add(req.get_ref().items.len() as u32, std::sync::atomic::Ordering::SeqCst);
        if self.hold_decisions.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(tonic::Status::unavailable("held by the test"));
        }
        self.inner.apply_decisions(req).await
    }
    async fn inquire(&self, req: tonic::Request<dtx_proto::v1::InquireRequest>) -> R<dtx_proto::v1::InquireResponse> {
        self.inner.inquire(req).await
    }
    async fn inspect(
        &self,
        req: tonic::Request<dtx_proto::v1::InspectParticipantRequest>,
    ) -> R<dtx_proto::v1::InspectParticipantResponse> {
        self.inner.inspect(req).await
    }
}

/// A participant service on its own address over a durable store; it stops
/// when dropped.
pub struct Svc {
    pub id: String,
    pub addr: String,
    pub store: Arc<ParticipantStore<Stage>>,
    pub hold_decisions: Arc<std::sync::atomic::AtomicBool>,
    pub one_phase_delay_ms: Arc<std::sync::atomic::AtomicU64>,
    pub lose_one_phase_answers: Arc<std::sync::atomic::AtomicBool>,
    pub prepare_delay_ms: Arc<std::sync::atomic::AtomicU64>,
    pub prepare_reply_delay_ms: Arc<std::sync::atomic::AtomicU64>,
    /// Commit and Abort calls, and ApplyDecisions items and decisions
    /// riding in PrepareMany, that reached this participant.
    pub decisions_received: Arc<std::sync::atomic::AtomicU32>,
    /// Decisions that reached this participant riding in PrepareMany
    /// messages (ADR 0030).
    pub riding_decisions: Arc<std::sync::atomic::AtomicU32>,
    /// While set, decisions riding in PrepareMany are dropped unread and
    /// answered with no results (an SDK from before ADR 0030).
    pub ignore_riding: Arc<std::sync::atomic::AtomicBool>,
    /// While set, ApplyDecisions and PrepareMany answer UNIMPLEMENTED (an
    /// older SDK).
    pub old_sdk: Arc<std::sync::atomic::AtomicBool>,
    /// ApplyDecisions calls that reached this participant (not while
    /// `old_sdk`).
    pub apply_decisions_calls: Arc<std::sync::atomic::AtomicU32>,
    /// Prepare calls, and PrepareMany items, that reached this participant.
    pub prepares_received: Arc<std::sync::atomic::AtomicU32>,
    /// PrepareMany calls that reached this participant (not while
    /// `old_sdk`).
    pub prepare_many_calls: Arc<std::sync::atomic::AtomicU32>,
    /// CommitOnePhase calls that reached this participant.
    pub one_phase_received: Arc<std::sync::atomic::AtomicU32>,
    /// (method, `traceparent`) of each call that carried one.
    pub traceparents: Arc<std::sync::Mutex<Vec<(String, String)>>>,
    /// Dropping it stops the server.
    _stop: Option<tokio::sync::oneshot::Sender<()>>,
    _dir: tempfile::TempDir,
}

impl Svc {
    pub async fn new(id: &str) -> Svc {
        let dir = tempfile::tempdir().unwrap();
        let store = ParticipantStore::open(dir.path(), Stage).unwrap();
        let port = dtx_testkit::cluster::free_port("127.0.0.1").unwrap();
        let mut s = Svc {
            id: id.to_string(),
            addr: format!("127.0.0.1:{port}"),
            store,
            hold_decisions: Arc::default(),
            one_phase_delay_ms: Arc::default(),
            lose_one_phase_answers: Arc::default(),
            prepare_delay_ms: Arc::default(),
            prepare_reply_delay_ms: Arc::default(),
            decisions_received: Arc::default(),
            riding_decisions: Arc::default(),
            ignore_riding: Arc::default(),
            old_sdk: Arc::default(),
            apply_decisions_calls: Arc::default(),
            prepares_received: Arc::default(),
            prepare_many_calls: Arc::default(),
            one_phase_received: Arc::default(),
            traceparents: Arc::default(),
            _stop: None,
            _dir: dir,
        };
        s.start().await;
        s
    }

    pub async fn start(&mut self) {
        let listener = tokio::net::TcpListener::bind(&self.addr).await.unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let svc = ParticipantServiceServer::new(Gated {
            inner: ParticipantServer::new(self.store.clone(), &self.id),
            hold_decisions: self.hold_decisions.clone(),
            one_phase_delay_ms: self.one_phase_delay_ms.clone(),
            lose_one_phase_answers: self.lose_one_phase_answers.clone(),
            prepare_delay_ms: self.prepare_delay_ms.clone(),
            prepare_reply_delay_ms: self.prepare_reply_delay_ms.clone(),
            decisions_received: self.decisions_received.clone(),
            riding_decisions: self.riding_decisions.clone(),
            ignore_riding: self.ignore_riding.clone(),
            old_sdk: self.old_sdk.clone(),
            apply_decisions_calls: self.apply_decisions_calls.clone(),
            prepares_received: self.prepares_received.clone(),
            prepare_many_calls: self.prepare_many_calls.clone(),
            one_phase_received: self.one_phase_received.clone(),
            traceparents: self.traceparents.clone(),
        });
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(dtx_transport::incoming(listener), async {
                    let _ = rx.await;
                }),
        );
        self._stop = Some(tx);
    }

    /// This participant in a transaction, with `payload`.
    pub fn spec(&self, payload: &[u8]) -> dtx_client::ParticipantSpec {
        dtx_client::ParticipantSpec {
            participant_id: self.id.clone(),
            address: self.addr.clone(),
            payload: payload.to_vec(),
        }
    }

    /// The state of txid `txid`'s record, in whichever incarnation the
    /// cluster handed it out (a test runs one cluster).
    pub fn state(&self, txid: u64) -> Option<LocalState> {
        self.store.entries_for_txid(txid).unwrap().first().map(|(_, e)| e.state)
    }

    pub async fn wait_state(&self, txid: u64, want: LocalState, timeout: Duration) -> bool {
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
