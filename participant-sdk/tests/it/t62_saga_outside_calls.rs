//! Outside calls in flight (ADR 0034): a saga step that calls a system
//! outside its service. The sled step store, served on 127.0.0.1 and called
//! through a real tonic client, in front of a stand-in payment provider
//! (`common/outside.rs`): the call is recorded IN FLIGHT before it leaves,
//! with the operation id as the provider's idempotency key; an UNKNOWN (a
//! lost reply, a request that never arrived) is settled only by asking the
//! provider; nothing the provider may have done is ever fenced or FAILED.
//!
//! The scenario of ADR 0034: the provider charges, the reply is lost,
//! the call errors; after the last attempt the orchestrator fences the
//! operation. Before ADR 0034 a step service had recorded nothing (the
//! handler's error rolled its call back), so the fence recorded FAILED,
//! the saga compensated and the card stayed charged. Now the fence asks
//! the provider, which says charged: the step is OK, charged once.

use crate::common::outside;

use std::sync::Arc;
use std::time::Duration;

use crate::common::outside::Provider;
use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_step_service_client::SagaStepServiceClient;
use dtx_transport::channel::Channel;
use participant_sdk::saga::CallKind;
use participant_sdk::saga::OutsideSystem;
use participant_sdk::saga::StepCall;
use participant_sdk::saga::StepHandler;
use participant_sdk::saga::StepResult;
use participant_sdk::saga::StepServer;
use participant_sdk::saga::StepStaged;
use participant_sdk::saga::StepStore;
use participant_sdk::saga::StepView;
use std::sync::atomic::Ordering;

/// Checkout: forward `charge` (input `who:amount`) charges at the
/// provider, compensation `refund` refunds there (both outside calls),
/// forward `note` is local only. Status queries: `charge_status` for
/// charge and refund, `note_status` for note.
struct Checkout {
    provider: Arc<Provider>,
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

impl StepHandler for Checkout {
    fn forward(&self, _view: &StepView<'_>, call: &StepCall, staged: &mut StepStaged) -> StepResult {
        match call.action.as_str() {
            "note" => {
                staged.put(format!("notes/{}", call.operation_id).as_bytes(), &call.input);
                StepResult::ok("")
            }
            other => StepResult::failed(format!("no local action {other}")),
        }
    }

    fn compensate(&self, _view: &StepView<'_>, call: &StepCall, _staged: &mut StepStaged) -> StepResult {
        StepResult::failed(format!("no local compensation {}", call.action))
    }

    fn knows_query(&self, query: &str) -> bool {
        query == "charge_status" || query == "note_status"
    }

    fn query_answers(&self, query: &str, action: &str) -> bool {
        match action {
            "charge" | "refund" => query == "charge_status",
            "note" => query == "note_status",
            _ => false,
        }
    }

    fn outside(&self) -> Option<&dyn OutsideSystem> {
        Some(self.provider.as_ref())
    }

    fn outside_request(
        &self,
        _view: &StepView<'_>,
        kind: CallKind,
        call: &StepCall,
    ) -> Result<Option<Vec<u8>>, StepResult> {
        match (kind, call.action.as_str()) {
            (CallKind::Forward, "charge") => Ok(Some(format!("charge:{}", text(&call.input)).into_bytes())),
            (CallKind::Compensate, "refund") => Ok(Some(format!("refund:{}", call.forward_operation_id).into_bytes())),
            _ => Ok(None),
        }
    }

    fn finish_outside(
        &self,
        _view: &StepView<'_>,
        kind: CallKind,
        call: &StepCall,
        answer: &[u8],
        staged: &mut StepStaged,
    ) -> StepResult {
        let answer = text(answer);
        match kind {
            CallKind::Forward if answer.starts_with("charged:") => {
                staged.put(format!("charges/{}", call.operation_id).as_bytes(), answer.as_bytes());
                StepResult::ok("")
            }
            CallKind::Compensate if answer.starts_with("refunded:") => {
                staged.delete(format!("charges/{}", call.forward_operation_id).as_bytes());
                StepResult::ok("")
            }
            CallKind::Compensate if answer == "nothing to refund" => StepResult::noop(answer),
            _ => StepResult::failed(format!("the provider answered {answer:?}")),
        }
    }
}

struct Service {
    store: Arc<StepStore<Checkout>>,
    client: SagaStepServiceClient<Channel>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>>,
}

impl Service {
    async fn start(dir: &std::path::Path, provider: Arc<Provider>) -> Service {
        let store = StepStore::open(dir, Checkout { provider }).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(participant_sdk::saga::serve_steps(
            StepServer::new(store.clone()),
            listener,
            async {
                let _ = stopped.await;
            },
        ));
        let ch = dtx_transport::channel::channel_with(&addr, None, Duration::from_secs(2), None).unwrap();
        Service {
            store,
            client: SagaStepServiceClient::new(ch),
            stop: Some(stop),
            served: Some(served),
        }
    }

    async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.served.take().unwrap().await.unwrap().unwrap();
    }

    async fn forward(&mut self, call: &StepCall) -> Result<pb::StepReply, tonic::Status> {
        self.client
            .forward(pb::StepCall::from(call.clone()))
            .await
            .map(|r| r.into_inner())
    }

    async fn compensate(&mut self, call: &StepCall) -> Result<pb::StepReply, tonic::Status> {
        self.client
            .compensate(pb::StepCall::from(call.clone()))
            .await
            .map(|r| r.into_inner())
    }

    async fn status(&mut self, op: &str, query: &str) -> Result<pb::StepStatusReply, tonic::Status> {
        let req = pb::StepStatusRequest {
            operation_id: op.into(),
            query: query.into(),
        };
        self.client.status(req).await.map(|r| r.into_inner())
    }

    async fn fence(&mut self, op: &str) -> Result<pb::StepStatusReply, tonic::Status> {
        let req = pb::StepStatusRequest {
            operation_id: op.into(),
            query: "charge_status".into(),
        };
        self.client.fence(req).await.map(|r| r.into_inner())
    }

    fn charges_here(&self) -> usize {
        self.store.view().scan(b"charges/").unwrap().len()
    }
}

fn charge(op: &str, input: &str) -> StepCall {
    StepCall {
        saga_id: 1,
        step: 1,
        operation_id: op.into(),
        action: "charge".into(),
        input: input.as_bytes().to_vec(),
        fingerprint: format!("fp-{op}"),
        ..StepCall::default()
    }
}

fn refund(op: &str, forward_op: &str) -> StepCall {
    StepCall {
        forward_operation_id: forward_op.into(),
        action: "refund".into(),
        ..charge(op, "")
    }
}

fn outcome(r: &pb::StepReply) -> pb::StepOutcome {
    pb::StepOutcome::try_from(r.outcome).unwrap()
}

/// An error that leaves the operation in flight: UNAVAILABLE, saying so.
fn assert_in_flight(r: Result<impl std::fmt::Debug, tonic::Status>) {
    let e = r.expect_err("an in-flight operation answers an error (UNKNOWN)");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains("in flight"), "{e:?}");
}

/// ADR 0034's scenario: the provider charges, its reply is lost, the call
/// errors; repeated attempts lose their replies too; after the last one
/// the orchestrator fences the operation. The fence asks the provider:
/// charged, so the step is OK (never FAILED), the card charged once, and
/// the charge recorded here once.
#[tokio::test]
async fn t62_a_charge_whose_reply_is_lost_is_settled_by_the_provider_never_fenced_failed() {
    let dir = tempfile::tempdir().unwrap();
    let provider = Arc::new(Provider::with_accounts(&[("alice", 100)]));
    let mut s = Service::start(dir.path(), provider.clone()).await;
    provider.lose_replies.store(true, Ordering::SeqCst);
    let op = "1.1.f0@00000000000000aa";
    for _ in 0..3 {
        assert_in_flight(s.forward(&charge(op, "alice:30")).await);
    }
    assert_eq!(provider.charges(), 1, "one key, one charge, however often it is sent");
    assert_eq!(provider.balance("alice"), 70);
    assert_eq!(s.store.stats().unwrap().in_flight, 1);
    assert_eq!(s.charges_here(), 0, "nothing finished here yet");

    // The orchestrator's last word: the fence. It must not answer "not
    // applied" (that would compensate with the card charged).
    let f = s.fence(op).await.unwrap();
    assert!(f.applied, "the fence found the charge through the provider: {f:?}");
    assert_eq!(outcome(f.reply.as_ref().unwrap()), pb::StepOutcome::Ok);
    assert_eq!(s.store.stats().unwrap().in_flight, 0);
    assert_eq!(s.charges_here(), 1);

    // From now on the inbox answers: the same OK, nothing sent again.
    let arrived = provider.arrived.load(Ordering::SeqCst);
    provider.lose_replies.store(false, Ordering::SeqCst);
    let again = s.forward(&charge(op, "alice:30")).await.unwrap();
    assert_eq!(outcome(&again), pb::StepOutcome::Ok);
    let st = s.status(op, "charge_status").await.unwrap();
    assert!(st.applied);
    assert_eq!(provider.arrived.load(Ordering::SeqCst), arrived);
    assert_eq!(
        (provider.charges(), provider.balance("alice"), s.charges_here()),
        (1, 70, 1)
    );
    s.stop().await;
}

/// While the provider cannot tell, the operation stays in flight: Status,
/// Fence and a compensation of it all answer an error (UNKNOWN), and
/// nothing is recorded; once the provider answers again, Status settles it.
#[tokio::test]
async fn t62_an_unknown_stays_unknown_while_the_provider_cannot_tell() {
    let dir = tempfile::tempdir().unwrap();
    let provider = Arc::new(Provider::with_accounts(&[("bob", 100)]));
    let mut s = Service::start(dir.path(), provider.clone()).await;
    provider.lose_replies.store(true, Ordering::SeqCst);
    provider.status_down.store(true, Ordering::SeqCst);
    let op = "2.1.f0";
    assert_in_flight(s.forward(&charge(op, "bob:10")).await);
    assert_in_flight(s.status(op, "charge_status").await);
    assert_in_flight(s.fence(op).await);
    assert_in_flight(s.compensate(&refund("2.1.c0", op)).await);
    assert_eq!(s.store.stats().unwrap().in_flight, 1, "still in flight, nothing fenced");
    assert!(
        s.store.record("2.1.c0").unwrap().is_none(),
        "the compensation recorded nothing"
    );

    provider.status_down.store(false, Ordering::SeqCst);
    let st = s.status(op, "charge_status").await.unwrap();
    assert!(st.applied);
    assert_eq!(outcome(st.reply.as_ref().unwrap()), pb::StepOutcome::Ok);
    assert_eq!((provider.charges(), s.charges_here()), (1, 1));

    // The compensation now runs (an outside call too: a refund, whose
    // reply is lost and settled by Status the same way).
    assert_in_flight(s.compensate(&refund("2.1.c0", op)).await);
    assert_eq!(provider.balance("bob"), 100, "refunded once");
    let st = s.status("2.1.c0", "charge_status").await.unwrap();
    assert_eq!(outcome(st.reply.as_ref().unwrap()), pb::StepOutcome::Ok);
    assert_eq!(s.charges_here(), 0);
    provider.lose_replies.store(false, Ordering::SeqCst);
    assert_eq!(
        outcome(&s.compensate(&refund("2.1.c0", op)).await.unwrap()),
        pb::StepOutcome::Ok
    );
    assert_eq!(provider.balance("bob"), 100);
    s.stop().await;
}

/// A request that never reached the provider: Status says "not applied"
/// (the record stays in flight) and a repeated call sends it again under
/// the same key. A fence asks the provider to void the key: only then is
/// the step FAILED, and a late copy of the request is refused there.
#[tokio::test]
async fn t62_a_call_that_never_arrived_is_resent_or_fenced_by_the_provider() {
    let dir = tempfile::tempdir().unwrap();
    let provider = Arc::new(Provider::with_accounts(&[("carol", 100)]));
    let mut s = Service::start(dir.path(), provider.clone()).await;
    provider.drop_requests.store(true, Ordering::SeqCst);
    assert_in_flight(s.forward(&charge("3.1.f0", "carol:5")).await);
    let st = s.status("3.1.f0", "charge_status").await.unwrap();
    assert!(!st.applied, "{st:?}");
    assert_eq!(s.store.stats().unwrap().in_flight, 1, "not applied, still in flight");
    provider.drop_requests.store(false, Ordering::SeqCst);
    let r = s.forward(&charge("3.1.f0", "carol:5")).await.unwrap();
    assert_eq!(outcome(&r), pb::StepOutcome::Ok);
    assert_eq!((provider.charges(), provider.balance("carol")), (1, 95));

    // Never arrived, then fenced: FAILED here, voided there.
    provider.drop_requests.store(true, Ordering::SeqCst);
    assert_in_flight(s.forward(&charge("3.1.f1", "carol:7")).await);
    let f = s.fence("3.1.f1").await.unwrap();
    assert!(!f.applied, "{f:?}");
    assert_eq!(provider.answer("3.1.f1").as_deref(), Some(outside::VOIDED));
    // The late copy of the request: refused by the provider, nothing done.
    assert_eq!(provider.arrive("3.1.f1", b"charge:carol:7").unwrap(), outside::VOIDED);
    provider.drop_requests.store(false, Ordering::SeqCst);
    let r = s.forward(&charge("3.1.f1", "carol:7")).await.unwrap();
    assert_eq!(outcome(&r), pb::StepOutcome::Failed);
    assert!(r.reason.contains("fenced"), "{r:?}");
    // A compensation of it has nothing to undo.
    let c = s.compensate(&refund("3.1.c1", "3.1.f1")).await.unwrap();
    assert_eq!(outcome(&c), pb::StepOutcome::Noop);
    assert_eq!((provider.charges(), provider.balance("carol")), (1, 95));
    s.stop().await;
}

/// A crash with a call in flight: the record is durable, the reopened
/// store sends the same request under the same key, the provider answers
/// its first answer, charged once.
#[tokio::test]
async fn t62_an_in_flight_call_survives_a_restart_and_is_sent_again_under_its_key() {
    let dir = tempfile::tempdir().unwrap();
    let provider = Arc::new(Provider::with_accounts(&[("dave", 100)]));
    let mut s = Service::start(dir.path(), provider.clone()).await;
    provider.lose_replies.store(true, Ordering::SeqCst);
    assert_in_flight(s.forward(&charge("4.1.f0", "dave:40")).await);
    s.stop().await;

    let mut s = Service::start(dir.path(), provider.clone()).await;
    let inflight = s.store.in_flight().unwrap();
    assert_eq!(inflight.len(), 1);
    assert_eq!(inflight[0].1.request, b"charge:dave:40");
    provider.lose_replies.store(false, Ordering::SeqCst);
    let r = s.forward(&charge("4.1.f0", "dave:40")).await.unwrap();
    assert_eq!(outcome(&r), pb::StepOutcome::Ok);
    assert_eq!(
        (provider.charges(), provider.balance("dave"), s.charges_here()),
        (1, 60, 1)
    );
    // A repeat with another request under the key is refused, not sent.
    let e = s.forward(&charge("4.1.f0", "dave:41")).await;
    assert!(e.is_ok(), "an answered operation answers its reply: {e:?}");
    let mut other = charge("4.1.f0", "dave:41");
    other.fingerprint = "another".into();
    let e = s.forward(&other).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    s.stop().await;
}

/// A declined charge is a definite answer: FAILED, recorded, nothing
/// charged. A status query must answer for the operation's action: one of
/// another action is refused (INVALID_ARGUMENT) and settles nothing; local
/// actions beside outside ones work as before.
#[tokio::test]
async fn t62_a_decline_is_failed_and_a_status_query_must_answer_for_the_action() {
    let dir = tempfile::tempdir().unwrap();
    let provider = Arc::new(Provider::with_accounts(&[("erin", 10)]));
    let mut s = Service::start(dir.path(), provider.clone()).await;
    let r = s.forward(&charge("5.1.f0", "erin:50")).await.unwrap();
    assert_eq!(outcome(&r), pb::StepOutcome::Failed);
    assert!(r.reason.contains("insufficient funds"), "{r:?}");
    assert_eq!((provider.charges(), provider.balance("erin")), (0, 10));

    provider.lose_replies.store(true, Ordering::SeqCst);
    assert_in_flight(s.forward(&charge("5.1.f1", "erin:5")).await);
    let e = s.status("5.1.f1", "note_status").await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("does not answer"), "{e:?}");
    let e = s.fence("5.1.f1").await;
    assert!(e.unwrap().applied);
    let note = StepCall {
        action: "note".into(),
        ..charge("5.2.f0", "hello")
    };
    assert_eq!(outcome(&s.forward(&note).await.unwrap()), pb::StepOutcome::Ok);
    assert!(s.status("5.2.f0", "note_status").await.unwrap().applied);
    assert_eq!(
        s.status("5.2.f0", "charge_status").await.unwrap_err().code(),
        tonic::Code::InvalidArgument
    );
    s.stop().await;
}
