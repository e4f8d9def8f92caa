//! The SDK's saga step service (`participant_sdk::saga`), served on 127.0.0.1
//! and called through a real tonic client. A forward action runs once per
//! operation id (a repeat answers the first reply and changes nothing); a
//! FAILED answer is recorded too; a compensation of a forward action that
//! never happened here is a NOOP without running the handler; a resource that
//! moved on answers STALE and nothing changes; expired rights answer FAILED
//! and nothing changes (nor is recorded); Status tells what an operation id
//! did; the outbox is delivered at least once (retried after a sink error,
//! removed after success); everything survives reopening the store.

use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_step_service_client::SagaStepServiceClient;
use dtx_tls::dev::DevCa;
use dtx_tls::dev::Host;
use dtx_tls::dev::DEV_LIFETIME;
use dtx_tls::Role;
use dtx_transport::channel::Channel;
use participant_sdk::outbox::spawn_relay;
use participant_sdk::outbox::Envelope;
use participant_sdk::outbox::OutboxMessage;
use participant_sdk::outbox::Publisher;
use participant_sdk::outbox::RelaySettings;
use participant_sdk::saga::Authorization;
use participant_sdk::saga::StepCall;
use participant_sdk::saga::StepHandler;
use participant_sdk::saga::StepResult;
use participant_sdk::saga::StepServer;
use participant_sdk::saga::StepStaged;
use participant_sdk::saga::StepStore;
use participant_sdk::saga::StepView;

/// A stock of 10 units with a version counter. Forward `take` (input: a
/// quantity) takes units (FAILED "out of stock" when short), records what
/// it took under its operation id and emits an event; `bump` changes the
/// version only (someone else touching the resource). Compensation
/// `give_back` returns what the forward operation took, unless the version
/// moved on since.
#[derive(Default)]
struct Stock {
    forwards: AtomicUsize,
    compensations: AtomicUsize,
}

fn num(view: &StepView<'_>, key: &str) -> u64 {
    view.get(key.as_bytes())
        .unwrap()
        .map(|v| String::from_utf8(v).unwrap().parse().unwrap())
        .unwrap_or(0)
}

fn put_num(staged: &mut StepStaged, key: &str, n: u64) {
    staged.put(key.as_bytes(), n.to_string().as_bytes());
}

impl StepHandler for Stock {
    fn forward(&self, view: &StepView<'_>, call: &StepCall, staged: &mut StepStaged) -> StepResult {
        self.forwards.fetch_add(1, Ordering::SeqCst);
        let version = num(view, "version") + 1;
        match call.action.as_str() {
            "take" => {
                let qty: u64 = std::str::from_utf8(&call.input).unwrap().parse().unwrap();
                let stock = num(view, "stock");
                if stock < qty {
                    // Staged, then refused: must not be kept.
                    put_num(staged, "stock", 0);
                    return StepResult::failed("out of stock");
                }
                put_num(staged, "stock", stock - qty);
                put_num(staged, "version", version);
                put_num(staged, &format!("taken/{}", call.operation_id), qty);
                staged.emit(OutboxMessage::new(
                    "stock",
                    "took",
                    format!("took {qty} for {}", call.operation_id),
                ));
                StepResult::ok(version.to_string())
            }
            "bump" => {
                put_num(staged, "version", version);
                StepResult::ok(version.to_string())
            }
            other => StepResult::failed(format!("unknown action {other}")),
        }
    }

    fn compensate(&self, view: &StepView<'_>, call: &StepCall, staged: &mut StepStaged) -> StepResult {
        self.compensations.fetch_add(1, Ordering::SeqCst);
        let version = num(view, "version");
        if let Err(stale) = call.check_precondition(&version.to_string()) {
            staged.emit(OutboxMessage::new("stock", "stale", "must not be kept"));
            return stale;
        }
        let taken_key = format!("taken/{}", call.forward_operation_id);
        let qty = num(view, &taken_key);
        put_num(staged, "stock", num(view, "stock") + qty);
        put_num(staged, "version", version + 1);
        staged.delete(taken_key.as_bytes());
        StepResult::ok((version + 1).to_string())
    }

    fn knows_query(&self, query: &str) -> bool {
        query == "taken"
    }
}

struct Service {
    store: Arc<StepStore<Stock>>,
    client: SagaStepServiceClient<Channel>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>>,
}

impl Service {
    async fn start(dir: &std::path::Path) -> Service {
        let store = StepStore::open(dir, Stock::default()).unwrap();
        if store.view().get(b"stock").unwrap().is_none() {
            store
                .write_data(|_, s| {
                    put_num(s, "stock", 10);
                    put_num(s, "version", 0);
                })
                .await
                .unwrap();
        }
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

    fn stock(&self) -> u64 {
        num(&self.store.view(), "stock")
    }

    fn version(&self) -> u64 {
        num(&self.store.view(), "version")
    }

    fn forwards(&self) -> usize {
        self.store.handler().forwards.load(Ordering::SeqCst)
    }

    fn compensations(&self) -> usize {
        self.store.handler().compensations.load(Ordering::SeqCst)
    }

    async fn forward(&mut self, call: StepCall) -> pb::StepReply {
        self.client
            .forward(pb::StepCall::from(call))
            .await
            .unwrap()
            .into_inner()
    }

    async fn compensate(&mut self, call: StepCall) -> pb::StepReply {
        self.client
            .compensate(pb::StepCall::from(call))
            .await
            .unwrap()
            .into_inner()
    }

    async fn status(&mut self, op: &str) -> pb::StepStatusReply {
        self.client
            .status(pb::StepStatusRequest {
                operation_id: op.into(),
                query: "taken".into(),
            })
            .await
            .unwrap()
            .into_inner()
    }
}

fn take(op: &str, qty: u64) -> StepCall {
    StepCall {
        saga_id: 1,
        step: 0,
        operation_id: op.into(),
        action: "take".into(),
        input: qty.to_string().into_bytes(),
        fingerprint: "fp".into(),
        authorization: Authorization {
            principal: "alice".into(),
            ..Authorization::default()
        },
        term: 3,
        ..StepCall::default()
    }
}

fn give_back(op: &str, forward_op: &str, precondition: &str) -> StepCall {
    StepCall {
        operation_id: op.into(),
        action: "give_back".into(),
        forward_operation_id: forward_op.into(),
        precondition: precondition.into(),
        ..take(op, 0)
    }
}

fn outcome(r: &pb::StepReply) -> pb::StepOutcome {
    pb::StepOutcome::try_from(r.outcome).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_action_runs_once_per_operation_id() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Service::start(dir.path()).await;
    let first = s.forward(take("1.0.f", 3)).await;
    assert_eq!(outcome(&first), pb::StepOutcome::Ok, "{first:?}");
    assert_eq!(first.resource_version, "1");
    assert_eq!(
        first.downstream_operation_id, "1.0.f",
        "filled in with the operation id"
    );
    for _ in 0..3 {
        let again = s.forward(take("1.0.f", 3)).await;
        assert_eq!(again, first, "a repeat answers the first reply");
    }
    // Even with another input: the operation id decides.
    assert_eq!(s.forward(take("1.0.f", 5)).await, first);
    assert_eq!(s.forwards(), 1, "the handler ran once");
    assert_eq!(s.stock(), 7, "the business change happened once");
    assert_eq!(s.version(), 1);
    assert_eq!(s.store.stats().unwrap().outbox_pending, 1, "one message");
    let stats = s.store.stats().unwrap();
    assert_eq!(stats.forward_records, 1);
    assert_eq!(stats.forward_duplicates, 4);
    // Concurrent repeats of a new operation id: still once.
    let calls: Vec<_> = (0..8)
        .map(|_| {
            let mut c = s.client.clone();
            tokio::spawn(async move {
                c.forward(pb::StepCall::from(take("1.1.f", 2)))
                    .await
                    .unwrap()
                    .into_inner()
            })
        })
        .collect();
    let mut replies = Vec::new();
    for c in calls {
        replies.push(c.await.unwrap());
    }
    assert!(replies.iter().all(|r| *r == replies[0]), "{replies:?}");
    assert_eq!(s.forwards(), 2);
    assert_eq!(s.stock(), 5);
    s.stop().await;
}

/// A repeated operation id with another fingerprint is other work under the
/// same id (another saga's, another cluster's, a cluster's from before a
/// restore): refused with FAILED_PRECONDITION naming the id, the handler not
/// run, nothing recorded; the recorded request's repeats still answer its
/// reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_operation_id_with_another_fingerprint_is_refused_not_answered() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Service::start(dir.path()).await;
    let first = s.forward(take("1.0.f", 3)).await;
    assert_eq!(outcome(&first), pb::StepOutcome::Ok, "{first:?}");
    let other = StepCall {
        fingerprint: "another".into(),
        ..take("1.0.f", 3)
    };
    let e = s.client.forward(pb::StepCall::from(other.clone())).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("\"1.0.f\""), "names the operation id: {e:?}");
    assert!(e.message().contains("fingerprint"), "{e:?}");
    // The store's own call says the same.
    assert!(matches!(
        s.store.forward(&other).await,
        Err(participant_sdk::saga::StepError::Conflict(m)) if m.contains("1.0.f")
    ));
    assert_eq!(s.forwards(), 1, "the handler ran once");
    assert_eq!(s.stock(), 7);
    assert_eq!(
        s.forward(take("1.0.f", 3)).await,
        first,
        "the recorded request's repeat"
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_answer_is_recorded_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Service::start(dir.path()).await;
    let failed = s.forward(take("2.0.f", 50)).await;
    assert_eq!(outcome(&failed), pb::StepOutcome::Failed, "{failed:?}");
    assert_eq!(failed.reason, "out of stock");
    assert_eq!(s.stock(), 10, "what it staged was discarded");
    assert_eq!(
        s.forward(take("2.0.f", 1)).await,
        failed,
        "a repeat answers FAILED again"
    );
    assert_eq!(s.forwards(), 1, "without running the handler");
    let st = s.status("2.0.f").await;
    assert!(st.applied);
    assert_eq!(st.reply, Some(failed));
    // The orchestrator retries under a new operation id.
    let ok = s.forward(take("2.0.f.2", 1)).await;
    assert_eq!(outcome(&ok), pb::StepOutcome::Ok);
    assert_eq!(s.stock(), 9);
    // An unknown action is a FAILED answer too.
    let mut bad = take("2.9.f", 1);
    bad.action = "nope".into();
    assert_eq!(outcome(&s.forward(bad).await), pb::StepOutcome::Failed);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compensation_without_its_forward_action_is_a_noop_and_runs_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Service::start(dir.path()).await;
    let noop = s.compensate(give_back("3.0.c", "3.0.f", "")).await;
    assert_eq!(outcome(&noop), pb::StepOutcome::Noop, "{noop:?}");
    assert!(noop.reason.contains("never happened here"), "{noop:?}");
    assert_eq!(s.compensations(), 0, "the handler did not run");
    let st = s.status("3.0.c").await;
    assert!(st.applied, "the NOOP is recorded under the compensation's id");
    assert_eq!(st.reply.as_ref(), Some(&noop));
    // The NOOP fenced the forward operation: arriving late (a deposed
    // leader's call, a delayed request), it answers FAILED and never runs,
    // so the NOOP stays true.
    let forwards = s.store.handler().forwards.load(Ordering::SeqCst);
    let late = s.forward(take("3.0.f", 2)).await;
    assert_eq!(outcome(&late), pb::StepOutcome::Failed, "{late:?}");
    assert!(late.reason.contains("fenced"), "{late:?}");
    assert_eq!(
        s.store.handler().forwards.load(Ordering::SeqCst),
        forwards,
        "the handler did not run"
    );
    assert_eq!(s.stock(), 10);
    assert_eq!(s.compensate(give_back("3.0.c", "3.0.f", "")).await, noop);
    assert_eq!(s.compensations(), 0);
    let fwd = s.forward(take("3.3.f", 2)).await;
    assert_eq!(outcome(&fwd), pb::StepOutcome::Ok);
    // A forward action that FAILED: nothing to undo either.
    assert_eq!(outcome(&s.forward(take("3.1.f", 99)).await), pb::StepOutcome::Failed);
    let noop = s.compensate(give_back("3.1.c", "3.1.f", "")).await;
    assert_eq!(outcome(&noop), pb::StepOutcome::Noop, "{noop:?}");
    assert!(noop.reason.contains("out of stock"), "{noop:?}");
    assert_eq!(s.compensations(), 0);
    assert_eq!(s.stock(), 8);
    // A real compensation: runs once, undoes the forward action.
    let done = s.compensate(give_back("3.2.c", "3.3.f", &fwd.resource_version)).await;
    assert_eq!(outcome(&done), pb::StepOutcome::Ok, "{done:?}");
    assert_eq!(
        s.compensate(give_back("3.2.c", "3.3.f", &fwd.resource_version)).await,
        done
    );
    assert_eq!(s.compensations(), 1);
    assert_eq!(s.stock(), 10);
    assert_eq!(s.store.stats().unwrap().compensate_duplicates, 2);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resource_that_moved_on_answers_stale_and_nothing_changes() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Service::start(dir.path()).await;
    let fwd = s.forward(take("4.0.f", 4)).await;
    assert_eq!(fwd.resource_version, "1");
    let mut bump = take("4.5.f", 0);
    bump.action = "bump".into();
    assert_eq!(outcome(&s.forward(bump).await), pb::StepOutcome::Ok);
    let messages = s.store.stats().unwrap().outbox_pending;
    let stale = s.compensate(give_back("4.0.c", "4.0.f", &fwd.resource_version)).await;
    assert_eq!(outcome(&stale), pb::StepOutcome::Stale, "{stale:?}");
    assert!(stale.reason.contains("moved on"), "{stale:?}");
    assert_eq!(s.stock(), 6, "nothing undone");
    assert_eq!(s.version(), 2);
    assert_eq!(s.store.stats().unwrap().outbox_pending, messages, "no message kept");
    assert_eq!(s.status("4.0.c").await.reply, Some(stale));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_rights_answer_failed_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Service::start(dir.path()).await;
    let expired = Authorization {
        principal: "alice".into(),
        expires_at_ms: 1,
        ..Authorization::default()
    };
    let mut call = take("5.0.f", 2);
    call.authorization = expired.clone();
    let refused = s.forward(call.clone()).await;
    assert_eq!(outcome(&refused), pb::StepOutcome::Failed, "{refused:?}");
    assert!(refused.reason.contains("authorization refused"), "{refused:?}");
    assert_eq!((s.forwards(), s.stock()), (0, 10), "nothing ran, nothing changed");
    assert!(!s.status("5.0.f").await.applied, "a refusal is not recorded");
    // Rights renewed: the same operation id runs.
    call.authorization.expires_at_ms = participant_sdk::store::unix_ms() + 60_000;
    let fwd = s.forward(call).await;
    assert_eq!(outcome(&fwd), pb::StepOutcome::Ok, "{fwd:?}");
    assert_eq!(s.stock(), 8);
    // A compensation re-checks the rights.
    let mut comp = give_back("5.0.c", "5.0.f", &fwd.resource_version);
    comp.authorization = expired;
    let refused = s.compensate(comp).await;
    assert_eq!(outcome(&refused), pb::StepOutcome::Failed, "{refused:?}");
    assert!(refused.reason.contains("expired"), "{refused:?}");
    assert_eq!((s.compensations(), s.stock()), (0, 8));
    assert!(!s.status("5.0.c").await.applied);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_makes_not_applied_final_and_answers_an_applied_call() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Service::start(dir.path()).await;
    let ask = |op: &str| pb::StepStatusRequest {
        operation_id: op.into(),
        query: "taken".into(),
    };
    // Nothing there: fenced, and a late call never runs.
    let f = s.client.fence(ask("5.0.f1")).await.unwrap().into_inner();
    assert!(!f.applied, "{f:?}");
    let late = s.forward(take("5.0.f1", 1)).await;
    assert_eq!(outcome(&late), pb::StepOutcome::Failed, "{late:?}");
    assert!(late.reason.contains("fenced"), "{late:?}");
    assert_eq!(
        s.store.handler().forwards.load(Ordering::SeqCst),
        0,
        "the handler never ran"
    );
    assert_eq!(s.stock(), 10);
    // Applied before: the fence answers what it did and changes nothing.
    let fwd = s.forward(take("5.1.f1", 3)).await;
    assert_eq!(outcome(&fwd), pb::StepOutcome::Ok);
    let f = s.client.fence(ask("5.1.f1")).await.unwrap().into_inner();
    assert!(f.applied);
    assert_eq!(f.reply.as_ref(), Some(&fwd));
    assert_eq!(s.stock(), 7);
    // The fence survives reopening the store.
    s.stop().await;
    let mut s = Service::start(dir.path()).await;
    let again = s.forward(take("5.0.f1", 1)).await;
    assert_eq!(again, late);
    assert_eq!(s.stock(), 7);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_tells_what_an_operation_id_did_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Service::start(dir.path()).await;
    let before = s.status("6.0.f").await;
    assert!(!before.applied);
    assert_eq!(before.reply, None);
    assert_eq!(s.forwards(), 0);
    assert_eq!(s.store.stats().unwrap().forward_records, 0, "status recorded nothing");
    let fwd = s.forward(take("6.0.f", 1)).await;
    let after = s.status("6.0.f").await;
    assert!(after.applied);
    assert_eq!(after.reply, Some(fwd));
    assert_eq!(s.forwards(), 1);
    // An unknown status query is refused; malformed calls too.
    let st = s
        .client
        .status(pb::StepStatusRequest {
            operation_id: "6.0.f".into(),
            query: "nope".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
    let st = s.client.forward(pb::StepCall::from(take("", 1))).await.unwrap_err();
    assert_eq!(st.code(), tonic::Code::InvalidArgument, "{st:?}");
    let st = s
        .client
        .compensate(pb::StepCall::from(give_back("6.0.f", "6.0.x", "")))
        .await
        .unwrap_err();
    assert_eq!(
        st.code(),
        tonic::Code::FailedPrecondition,
        "a forward's id reused for a compensation: {st:?}"
    );
    assert_eq!(s.stock(), 9);
    s.stop().await;
}

/// Fails its first `fail_first` publishes, then keeps what it gets
/// (version, payload).
#[derive(Default)]
struct Sink {
    fail_first: usize,
    calls: AtomicUsize,
    seen: Mutex<Vec<(u64, Vec<u8>)>>,
}

impl Publisher for Sink {
    async fn publish(&self, m: &Envelope) -> Result<(), String> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        self.seen.lock().unwrap().push((m.version, m.payload.clone()));
        if n < self.fail_first {
            return Err("mail server busy".into());
        }
        Ok(())
    }
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(std::time::Instant::now() < until, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Relay settings that retry at once (tests wait for them).
fn quick() -> RelaySettings {
    RelaySettings {
        name: "stock".into(),
        retry_backoff_ms: 10,
        retry_backoff_max_ms: 10,
        idle_poll_ms: 10,
        ..RelaySettings::default()
    }
}

/// The step store's outbox is the SDK's general one (the same pieces as
/// every service's): published at least once, in version order per
/// aggregate, retried after a failure, removed once published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_is_delivered_at_least_once_and_removed_after_success() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = Service::start(dir.path()).await;
    for i in 0..3 {
        assert_eq!(
            outcome(&s.forward(take(&format!("7.{i}.f"), 1)).await),
            pb::StepOutcome::Ok
        );
    }
    assert_eq!(s.store.stats().unwrap().outbox_pending, 3);
    let sink = Arc::new(Sink {
        fail_first: 2,
        ..Sink::default()
    });
    let relay = spawn_relay(s.store.relay("relay-1", sink.clone(), quick()));
    wait_until("the outbox to drain", || s.store.stats().unwrap().outbox_pending == 0).await;
    assert_eq!(sink.calls.load(Ordering::SeqCst), 5, "two errors, then three publishes");
    let seen = sink.seen.lock().unwrap().clone();
    let took = |v: u64, op: &str| (v, format!("took 1 for {op}").into_bytes());
    assert_eq!(
        seen,
        [
            took(1, "7.0.f"),
            took(1, "7.0.f"),
            took(1, "7.0.f"),
            took(2, "7.1.f"),
            took(3, "7.2.f")
        ],
        "the first retried as it was, then the rest in version order"
    );
    // A later message gets the next version, and is published too.
    assert_eq!(outcome(&s.forward(take("7.9.f", 1)).await), pb::StepOutcome::Ok);
    wait_until("the new message", || sink.seen.lock().unwrap().len() == 6).await;
    assert_eq!(sink.seen.lock().unwrap().last().cloned().unwrap(), took(4, "7.9.f"));
    wait_until("the outbox to drain", || s.store.stats().unwrap().outbox_pending == 0).await;
    relay.abort();
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_the_business_change_and_the_outbox_survive_reopening() {
    let dir = tempfile::tempdir().unwrap();
    let (fwd, failed, seq) = {
        let mut s = Service::start(dir.path()).await;
        let fwd = s.forward(take("8.0.f", 3)).await;
        let failed = s.forward(take("8.1.f", 30)).await;
        assert_eq!(s.store.stats().unwrap().outbox_pending, 1);
        s.stop().await;
        (fwd, failed, 1u64)
    };
    // The server task is gone; the last handle of the store goes with `s`.
    let mut s = Service::start(dir.path()).await;
    assert_eq!(s.stock(), 7, "the business change survived");
    assert_eq!(s.status("8.0.f").await.reply, Some(fwd.clone()));
    assert_eq!(s.forward(take("8.0.f", 3)).await, fwd, "still answered from the inbox");
    assert_eq!(s.forward(take("8.1.f", 30)).await, failed);
    assert_eq!(s.forwards(), 0, "the handler did not run again");
    assert_eq!(s.stock(), 7);
    assert_eq!(s.store.stats().unwrap().outbox_pending, 1, "the message survived");
    let sink = Arc::new(Sink::default());
    let mut relay = s.store.relay("relay-1", sink.clone(), quick());
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    assert_eq!(outcome(&s.forward(take("8.2.f", 1)).await), pb::StepOutcome::Ok);
    assert_eq!(relay.run_once().await.unwrap().published, 1);
    let versions: Vec<u64> = sink.seen.lock().unwrap().iter().map(|(v, _)| *v).collect();
    assert_eq!(versions, [seq, seq + 1], "versions go on across a reopen");
    s.stop().await;
}

/// With TLS only the cluster's nodes may run steps; an operator may ask
/// Status; anyone else is refused before the service sees the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_tls_only_nodes_run_steps() {
    let dir = tempfile::tempdir().unwrap();
    let ca = DevCa::new("t60").unwrap();
    let ca_path = ca.write_ca(dir.path()).unwrap();
    let hosts = [Host::parse("127.0.0.1")];
    let issue = |role: Role, name: &str| {
        ca.issue_to(dir.path(), &format!("{role}-{name}"), role, name, &hosts, DEV_LIFETIME)
            .unwrap()
    };
    let server_tls = dtx_tls::ServerTls::load(dtx_tls::server::ServerTlsFiles {
        own: issue(Role::Participant, "stock"),
        ca: ca_path.clone(),
        client_auth: dtx_tls::ClientAuth::Required,
    })
    .unwrap();
    let store = StepStore::open(&dir.path().join("store"), Stock::default()).unwrap();
    store.write_data(|_, s| put_num(s, "stock", 10)).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(participant_sdk::saga::serve_steps_with_tls(
        StepServer::new(store.clone()),
        listener,
        Some(server_tls),
        async {
            let _ = stopped.await;
        },
    ));
    let client = |role: Role, name: &str| {
        let tls = dtx_tls::ClientTls::load(dtx_tls::client::ClientTlsFiles {
            ca: ca_path.clone(),
            own: Some(issue(role, name)),
            server_name: None,
        })
        .unwrap();
        let ch = dtx_transport::channel::channel_with(&addr, None, Duration::from_secs(2), Some(&tls)).unwrap();
        SagaStepServiceClient::new(ch)
    };
    for (role, name) in [(Role::Operator, "alice"), (Role::Application, "shop")] {
        let st = client(role, name)
            .forward(pb::StepCall::from(take("9.0.f", 1)))
            .await
            .unwrap_err();
        assert_eq!(st.code(), tonic::Code::PermissionDenied, "{role}: {st:?}");
    }
    assert_eq!(store.handler().forwards.load(Ordering::SeqCst), 0);
    let r = client(Role::Node, "1")
        .forward(pb::StepCall::from(take("9.0.f", 1)))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(outcome(&r), pb::StepOutcome::Ok);
    let st = client(Role::Operator, "alice")
        .status(pb::StepStatusRequest {
            operation_id: "9.0.f".into(),
            query: "taken".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(st.applied);
    let _ = stop.send(());
    served.await.unwrap().unwrap();
}

/// The step-service crash window of docs/design.md#fault-points: the process
/// dies after the durable batch, before the reply
/// (`step_forward_after_commit_before_reply`,
/// `step_compensation_after_commit_before_reply`; a child process aborts
/// there). After the restart Status says applied with the answer, a repeat
/// answers it without running the handler, and the business change happened
/// once. `cargo test -p participant-sdk --features failpoints
/// --test it -- t60_saga_steps::`.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_the_durable_batch_before_the_reply_leaves_the_answer_in_the_inbox() {
    for point in [
        "step_forward_after_commit_before_reply",
        "step_compensation_after_commit_before_reply",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let child = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "t60_saga_steps::crash_child", "--ignored", "--nocapture"])
            .env("DTX_FAILPOINT", point)
            .env("T60_CRASH_DIR", dir.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&child.stderr);
        assert!(!child.status.success(), "{point}: the child did not die: {stderr}");
        assert!(stderr.contains(&format!("failpoint {point}")), "{point}: {stderr}");
        let mut s = Service::start(dir.path()).await;
        let fwd = s.status("c.f").await;
        assert!(fwd.applied, "{point}");
        assert_eq!(outcome(fwd.reply.as_ref().unwrap()), pb::StepOutcome::Ok);
        assert_eq!(s.forward(take("c.f", 3)).await, fwd.reply.unwrap(), "{point}");
        let comp = s.status("c.c").await;
        if point == "step_forward_after_commit_before_reply" {
            assert!(!comp.applied, "the child died before compensating");
            assert_eq!(s.stock(), 7, "taken once");
        } else {
            assert!(comp.applied, "{point}");
            assert_eq!(outcome(comp.reply.as_ref().unwrap()), pb::StepOutcome::Ok);
            assert_eq!(s.compensate(give_back("c.c", "c.f", "1")).await, comp.reply.unwrap());
            assert_eq!(s.stock(), 10, "taken and given back once");
        }
        assert_eq!((s.forwards(), s.compensations()), (0, 0), "{point}: nothing ran again");
        s.stop().await;
    }
}

/// The child of the crash test: takes 3, gives them back; dies at the
/// armed point.
#[cfg(feature = "failpoints")]
#[ignore = "run by a_crash_after_the_durable_batch_before_the_reply_leaves_the_answer_in_the_inbox"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_child() {
    let Some(dir) = std::env::var_os("T60_CRASH_DIR") else {
        return;
    };
    let s = Service::start(std::path::Path::new(&dir)).await;
    let r = s.store.forward(&take("c.f", 3)).await.unwrap();
    assert!(r.is_ok());
    s.store.compensate(&give_back("c.c", "c.f", "1")).await.unwrap();
    panic!("no failpoint fired");
}
