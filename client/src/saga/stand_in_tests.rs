//! The saga client against stand-in SagaService nodes on 127.0.0.1: a
//! refusal naming the leader is followed, an unanswered start is UNKNOWN
//! (never a failure) and a repeat finds the same saga, a wait that runs out
//! or reaches no node is "still running", and an operator's action whose
//! answer was lost is recognised in the journal.

use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;

use dtx_proto::v1::saga_service_server::SagaService;
use dtx_proto::v1::saga_service_server::SagaServiceServer;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use super::*;
use crate::ClientConfig;

type Res<T> = Result<Response<T>, Status>;

/// A stand-in node.
#[derive(Default)]
struct Node {
    /// Refuse every call UNAVAILABLE, not applied, naming this leader.
    follower_of: Mutex<Option<String>>,
    /// Answer nothing to this many StartSaga calls (each attempt times
    /// out), having "applied" them.
    start_silent: AtomicU32,
    /// Refuse every call UNAVAILABLE (may have been applied: no hint).
    down: bool,
    starts: AtomicU32,
    gets: AtomicU32,
    /// GetSaga answers RUNNING this many times, then COMPLETED.
    running_for: AtomicU32,
    /// The saga's operator actions (an OperateSaga records one, and a
    /// repeat of it is refused: the saga is no longer PARKED).
    actions: Mutex<Vec<pb::SagaOperatorActionView>>,
    /// Every OperateSaga is answered UNAVAILABLE after it was recorded,
    /// this many times.
    operate_lost: AtomicU32,
    /// GetSaga is refused (PERMISSION_DENIED).
    get_refused: std::sync::atomic::AtomicBool,
}

struct Served(Arc<Node>);

impl Served {
    fn gate(&self) -> Result<(), Status> {
        if self.0.down {
            return Err(Status::unavailable("node down"));
        }
        if let Some(l) = self.0.follower_of.lock().unwrap().clone() {
            let mut s = Status::unavailable("not the leader");
            s.metadata_mut()
                .insert(dtx_proto::metadata::NOT_APPLIED_HEADER, "1".parse().unwrap());
            s.metadata_mut()
                .insert(dtx_proto::metadata::LEADER_ADDR_HEADER, l.parse().unwrap());
            return Err(s);
        }
        Ok(())
    }

    fn view(&self, state: pb::SagaState) -> pb::SagaView {
        pb::SagaView {
            saga_id: 7,
            state: state as i32,
            operator_actions: self.0.actions.lock().unwrap().clone(),
            ..Default::default()
        }
    }
}

#[tonic::async_trait]
impl SagaService for Served {
    async fn register_definition(
        &self,
        _: Request<pb::RegisterSagaDefinitionRequest>,
    ) -> Res<pb::RegisterSagaDefinitionResponse> {
        self.gate()?;
        Ok(Response::new(pb::RegisterSagaDefinitionResponse { created: true }))
    }

    async fn start_saga(&self, r: Request<pb::StartSagaRequest>) -> Res<pb::StartSagaResponse> {
        self.gate()?;
        let n = self.0.starts.fetch_add(1, Ordering::SeqCst);
        if self.0.start_silent.load(Ordering::SeqCst) > n {
            tokio::time::sleep(Duration::from_secs(30)).await;
        }
        assert_eq!(r.get_ref().deadline_ms, 2_000);
        Ok(Response::new(pb::StartSagaResponse {
            saga_id: 7,
            created: n == 0,
        }))
    }

    async fn get_saga(&self, _: Request<pb::GetSagaRequest>) -> Res<pb::SagaView> {
        self.gate()?;
        if self.0.get_refused.load(Ordering::SeqCst) {
            return Err(Status::permission_denied("not yours"));
        }
        let n = self.0.gets.fetch_add(1, Ordering::SeqCst);
        let state = if n < self.0.running_for.load(Ordering::SeqCst) {
            pb::SagaState::Running
        } else {
            pb::SagaState::Completed
        };
        Ok(Response::new(self.view(state)))
    }

    async fn list_sagas(&self, _: Request<pb::ListSagasRequest>) -> Res<pb::ListSagasResponse> {
        Err(Status::unimplemented("not in this stand-in"))
    }

    async fn operate_saga(&self, r: Request<pb::OperateSagaRequest>) -> Res<pb::SagaView> {
        self.gate()?;
        let r = r.into_inner();
        let mut actions = self.0.actions.lock().unwrap();
        if !actions.is_empty() {
            return Err(Status::failed_precondition(
                "saga 7 is RUNNING: only a PARKED saga takes this",
            ));
        }
        actions.push(pb::SagaOperatorActionView {
            action: "retry".into(),
            who: r.operator,
            why: r.why,
            at_ms: 1,
            step: 0,
        });
        drop(actions);
        if self.0.operate_lost.load(Ordering::SeqCst) > 0 {
            self.0.operate_lost.fetch_sub(1, Ordering::SeqCst);
            return Err(Status::unavailable("leader lost after proposing"));
        }
        Ok(Response::new(self.view(pb::SagaState::Running)))
    }

    async fn list_definitions(
        &self,
        _: Request<pb::ListSagaDefinitionsRequest>,
    ) -> Res<pb::ListSagaDefinitionsResponse> {
        Err(Status::unimplemented("not in this stand-in"))
    }

    async fn complete_step(&self, _: Request<pb::CompleteStepRequest>) -> Res<pb::SagaView> {
        Err(Status::unimplemented("not in this stand-in"))
    }
}

async fn serve(node: Arc<Node>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(SagaServiceServer::new(Served(node)))
            .serve_with_incoming(dtx_transport::incoming(listener)),
    );
    addr
}

fn quick(endpoints: Vec<String>) -> ClientConfig {
    let mut cfg = ClientConfig::new(endpoints);
    cfg.call_deadline = Duration::from_secs(3);
    cfg.attempt_timeout = Duration::from_millis(500);
    cfg.backoff_base = Duration::from_millis(1);
    cfg.backoff_max = Duration::from_millis(10);
    cfg
}

fn start() -> StartSaga {
    StartSaga::new("order", 1, "order-1", b"{}".to_vec()).with_deadline(Duration::from_secs(2))
}

#[tokio::test]
async fn a_start_follows_the_leader_a_refusal_names() {
    let follower = Arc::new(Node::default());
    let leader = Arc::new(Node::default());
    let follower_addr = serve(follower.clone()).await;
    let leader_addr = serve(leader.clone()).await;
    *follower.follower_of.lock().unwrap() = Some(leader_addr.clone());
    let c = Client::new(quick(vec![follower_addr, format!("http://{leader_addr}")])).unwrap();
    let s = c.start_saga(&start()).await.unwrap();
    assert_eq!((s.saga_id, s.created), (7, true));
    assert!(c
        .register_saga_definition(&pb::SagaDefinition::default())
        .await
        .unwrap());
    assert_eq!(leader.starts.load(Ordering::SeqCst), 1);
    assert_eq!(*c.leader.lock().unwrap(), Some(format!("http://{leader_addr}")));
}

#[tokio::test]
async fn an_unanswered_start_is_unknown_and_starting_again_finds_the_same_saga() {
    let node = Arc::new(Node::default());
    node.start_silent.store(100, Ordering::SeqCst);
    let addr = serve(node.clone()).await;
    let mut cfg = quick(vec![addr]);
    cfg.call_deadline = Duration::from_millis(1_200);
    let c = Client::new(cfg).unwrap();
    let e = c.start_saga(&start()).await.unwrap_err();
    assert!(
        matches!(e, ClientError::Unknown(_)),
        "no answer is UNKNOWN, never a failure: {e}"
    );
    let tried = node.starts.load(Ordering::SeqCst);
    assert!(tried >= 2, "attempts within the deadline: {tried}");
    node.start_silent.store(0, Ordering::SeqCst);
    let s = c.start_saga(&start()).await.unwrap();
    assert_eq!((s.saga_id, s.created), (7, false), "the key finds the same saga");
}

#[tokio::test]
async fn a_wait_polls_until_the_end_and_answers_still_running_when_it_runs_out() {
    let node = Arc::new(Node::default());
    node.running_for.store(3, Ordering::SeqCst);
    let addr = serve(node.clone()).await;
    let c = Client::new(quick(vec![addr])).unwrap();
    match c.wait_saga(7, Duration::from_secs(10)).await.unwrap() {
        SagaWait::Ended { end, view } => {
            assert_eq!((end, view.saga_id), (SagaEnd::Completed, 7));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(node.gets.load(Ordering::SeqCst), 4, "three RUNNING reads, then the end");

    // Running for longer than the wait: still running, with the last view.
    node.gets.store(0, Ordering::SeqCst);
    node.running_for.store(u32::MAX, Ordering::SeqCst);
    let t = tokio::time::Instant::now();
    match c.wait_saga(7, Duration::from_millis(400)).await.unwrap() {
        SagaWait::StillRunning { last: Some(v), why } => {
            assert_eq!(v.state, pb::SagaState::Running as i32);
            assert!(why.contains("RUNNING"), "{why}");
        }
        other => panic!("{other:?}"),
    }
    assert!(t.elapsed() < Duration::from_secs(2), "the wait keeps to its time");
    let reads = node.gets.load(Ordering::SeqCst);
    assert!((2..40).contains(&reads), "polled with backoff: {reads} reads");

    // No node answers at all: still running (nothing known), not an error.
    let down = Arc::new(Node {
        down: true,
        ..Node::default()
    });
    let c = Client::new(quick(vec![serve(down).await])).unwrap();
    let t = tokio::time::Instant::now();
    match c.wait_saga(7, Duration::from_millis(500)).await.unwrap() {
        SagaWait::StillRunning { last: None, why } => assert!(why.contains("node down"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "the wait keeps to its time, not the call deadline"
    );
}

#[tokio::test]
async fn an_action_whose_answer_was_lost_is_found_in_the_journal() {
    let node = Arc::new(Node::default());
    node.operate_lost.store(1, Ordering::SeqCst);
    let addr = serve(node.clone()).await;
    let c = Client::new(quick(vec![addr])).unwrap();
    let v = c
        .operate_saga(7, SagaAction::Retry, "bob", "service is back")
        .await
        .unwrap();
    assert_eq!(v.operator_actions.len(), 1, "recorded once");
    // Another action (another why) refused by the same state is refused.
    let e = c
        .operate_saga(7, SagaAction::Retry, "bob", "another reason")
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::FailedPrecondition(_)), "{e}");
    let e = c.cancel_saga(7, "service is back").await.unwrap_err();
    assert!(matches!(e, ClientError::FailedPrecondition(_)), "not a cancel: {e}");
    // The saga cannot be read: the refusal stands, not the read's error.
    node.get_refused.store(true, Ordering::SeqCst);
    let e = c
        .operate_saga(7, SagaAction::Retry, "bob", "service is back")
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::FailedPrecondition(_)), "{e}");
}
