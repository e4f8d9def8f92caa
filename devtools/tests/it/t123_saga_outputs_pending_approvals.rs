//! Sagas for application developers (docs/sagas.md "Outputs, pending
//! steps and approvals"), against a real three-node cluster and a step
//! service on the SDK's store over a real socket:
//! - a step's output reaches the later steps (a READ_ONLY quote and a
//!   reservation read by the charge) and its own compensation, durably in
//!   the journal; a page of sagas leaves outputs out;
//! - a step that answers PENDING holds the saga, across a leader kill,
//!   until it is completed by operation id (a wrong id refused, the same
//!   completion again harmless); a cancel of a PENDING step compensates it
//!   and a late completion is refused; past a step's completion timeout
//!   the saga parks, and a late completion still ends the step;
//! - a high-impact compensation waits for an operator's approval, and
//!   nothing is undone before it;
//! - the node's configured policy rules (`saga.policy_rules`): a failure
//!   parks with the rule's escalation instead of compensating, and a
//!   compensation the definition did not mark waits for an approval.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::sagas;
use common::sagas::ends;
use common::sagas::wait_for;
use common::TestCluster;
use coordinator::config::SagaPolicyRule;
use dtx_client::saga::SagaAction;
use dtx_client::saga::SagaEnd;
use dtx_client::saga::StartSaga;
use dtx_client::saga::StepEnd;
use dtx_client::ClientError;
use dtx_proto::v1 as pb;
use participant_sdk::saga::StepCall;
use participant_sdk::saga::StepHandler;
use participant_sdk::saga::StepResult;
use participant_sdk::saga::StepServer;
use participant_sdk::saga::StepStaged;
use participant_sdk::saga::StepStore;
use participant_sdk::saga::StepView;

/// The lab's step service: what each action does, and what it saw.
struct Lab;

fn key(what: &str, call: &StepCall) -> Vec<u8> {
    format!("{what}/{}", call.saga_id).into_bytes()
}

impl StepHandler for Lab {
    fn forward(&self, _: &StepView<'_>, call: &StepCall, staged: &mut StepStaged) -> StepResult {
        match call.action.as_str() {
            // READ_ONLY: changes nothing, answers a price.
            "quote" => StepResult::ok("").with_output(format!("price-{}", 40 + call.input.len())),
            "reserve" => {
                staged.put(&key("reserved", call), b"1");
                StepResult::ok("").with_output(format!("r-{}", call.saga_id))
            }
            // Accepted; a person completes it later.
            "approval" => {
                staged.put(&key("asked", call), b"1");
                StepResult::pending("waiting for a person")
            }
            // Records every earlier output it was handed.
            "charge" => {
                let seen: Vec<String> = call
                    .outputs
                    .iter()
                    .map(|o| format!("{}:{}={}", o.step, o.name, String::from_utf8_lossy(&o.output)))
                    .collect();
                staged.put(&key("charged", call), seen.join(";").as_bytes());
                StepResult::ok("").with_output(format!("c-{}", call.saga_id))
            }
            "decline" => StepResult::failed("card declined by the issuer"),
            other => StepResult::failed(format!("no action {other:?}")),
        }
    }

    fn compensate(&self, _: &StepView<'_>, call: &StepCall, staged: &mut StepStaged) -> StepResult {
        match call.action.as_str() {
            // Undoes the reservation its own forward output names.
            "release" => {
                let r = call.output_of("reserve").unwrap_or(b"(no output)").to_vec();
                staged.put(&key("released", call), &r);
                StepResult::ok("")
            }
            "withdraw" => {
                staged.put(&key("withdrawn", call), b"1");
                StepResult::ok("")
            }
            other => StepResult::failed(format!("no compensation {other:?}")),
        }
    }

    fn knows_query(&self, query: &str) -> bool {
        query == "status"
    }
}

struct LabService {
    store: Arc<StepStore<Lab>>,
    addr: String,
}

impl LabService {
    async fn start(dir: &std::path::Path) -> LabService {
        let store = StepStore::open(&dir.join("lab"), Lab).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(participant_sdk::saga::serve_steps(
            StepServer::new(store.clone()),
            listener,
            std::future::pending::<()>(),
        ));
        LabService { store, addr }
    }

    fn get(&self, what: &str, saga: u64) -> Option<String> {
        self.store
            .view()
            .get(format!("{what}/{saga}").as_bytes())
            .unwrap()
            .map(|v| String::from_utf8(v).unwrap())
    }

    /// The operation id the lab received for step `step`'s forward call of
    /// saga `saga` (with the cluster's incarnation, as a service sees it).
    fn forward_operation(&self, saga: u64, step: u32) -> String {
        self.store
            .records()
            .unwrap()
            .into_iter()
            .find(|(op, r)| r.saga_id == saga && r.step == step && op.contains(".f"))
            .map(|(op, _)| op)
            .unwrap_or_else(|| panic!("saga {saga} step {step}: no forward call recorded"))
    }

    fn step(&self, name: &str, kind: pb::StepKind, compensation: &str) -> pb::SagaStepDefinition {
        pb::SagaStepDefinition {
            name: name.into(),
            kind: kind as i32,
            service: self.addr.clone(),
            action: name.into(),
            compensation: compensation.into(),
            status_query: "status".into(),
            versioned: false,
            retry: Some(pb::RetryPolicy {
                max_attempts: 3,
                backoff_initial_ms: 20,
                backoff_max_ms: 100,
            }),
            on_failure: vec![],
            high_impact: false,
            completion_timeout_ms: 0,
        }
    }
}

fn definition(name: &str, steps: Vec<pb::SagaStepDefinition>) -> pb::SagaDefinition {
    pb::SagaDefinition {
        name: name.into(),
        version: 1,
        steps,
    }
}

fn forward(v: &pb::SagaView, step: usize) -> &pb::StepCallView {
    v.steps[step].forward.as_ref().expect("forward call journaled")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t123_outputs_reach_later_steps_and_a_pending_step_waits_for_its_completion() {
    let mut c = TestCluster::start("t123a");
    c.leader().await;
    let lab = LabService::start(c.dir.path()).await;
    let client = c.client();
    use pb::StepKind::*;

    // Outputs: a READ_ONLY quote and a reservation reach the charge; the
    // journal keeps them.
    let outputs = definition(
        "outputs",
        vec![
            lab.step("quote", ReadOnly, ""),
            lab.step("reserve", Compensable, "release"),
            lab.step("charge", Pivot, ""),
        ],
    );
    client.register_saga_definition(&outputs).await.unwrap();
    let a = client
        .start_saga(&StartSaga::new("outputs", 1, "out-1", b"{\"order\":1}".to_vec()))
        .await
        .unwrap()
        .saga_id;
    let v = ends(&client, a, SagaEnd::Completed).await;
    assert_eq!(forward(&v, 0).output, b"price-51", "{v:#?}");
    assert_eq!(forward(&v, 1).output, format!("r-{a}").as_bytes());
    assert_eq!(forward(&v, 2).output, format!("c-{a}").as_bytes());
    assert_eq!(
        lab.get("charged", a).as_deref(),
        Some(format!("0:quote=price-51;1:reserve=r-{a}").as_str()),
        "the charge got both earlier outputs, in step order"
    );
    // A page of sagas leaves the outputs out; GetSaga has them.
    let page = client.list_sagas(&Default::default()).await.unwrap();
    let listed = page.sagas.iter().find(|s| s.saga_id == a).expect("listed");
    assert!(listed
        .steps
        .iter()
        .all(|s| s.forward.as_ref().unwrap().output.is_empty()));

    // PENDING: the saga waits at the step, through a leader kill, until it
    // is completed by operation id.
    let pending = definition(
        "pending",
        vec![
            lab.step("reserve", Compensable, "release"),
            lab.step("approval", Compensable, "withdraw"),
            lab.step("charge", Pivot, ""),
        ],
    );
    client.register_saga_definition(&pending).await.unwrap();
    let b = client
        .start_saga(&StartSaga::new("pending", 1, "pend-1", b"{}".to_vec()))
        .await
        .unwrap()
        .saga_id;
    let is_pending =
        |v: &pb::SagaView| v.steps[1].forward.as_ref().map(|f| f.outcome) == Some(pb::StepOutcome::Pending as i32);
    let v = wait_for(&client, b, Duration::from_secs(30), "step 1 PENDING", is_pending).await;
    assert_eq!(sagas::state(&v), pb::SagaState::Running);
    assert_eq!(
        lab.get("asked", b).as_deref(),
        Some("1"),
        "a PENDING answer keeps its writes"
    );
    let l = c.leader().await;
    c.procs.kill9(l);
    c.procs.start(l).unwrap();
    c.leader().await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let v = client.saga(b).await.unwrap();
    assert!(is_pending(&v) && sagas::state(&v) == pb::SagaState::Running, "{v:#?}");
    assert!(lab.get("charged", b).is_none(), "nothing went past the PENDING step");

    let op = lab.forward_operation(b, 1);
    let e = client
        .complete_step(b, 1, &format!("{b}.1.f9"), StepEnd::Ok { output: vec![] }, "ann")
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::FailedPrecondition(_)), "{e}");
    let done = StepEnd::Ok {
        output: b"approved by ann".to_vec(),
    };
    let v = client.complete_step(b, 1, &op, done.clone(), "ann").await.unwrap();
    assert_eq!(forward(&v, 1).completed_by, "ann", "{v:#?}");
    // The same completion again (an answer lost) is harmless; another end
    // is refused.
    client.complete_step(b, 1, &op, done, "ann").await.unwrap();
    let e = client
        .complete_step(
            b,
            1,
            &op,
            StepEnd::Failed {
                reason: "changed my mind".into(),
            },
            "ann",
        )
        .await
        .unwrap_err();
    assert!(
        matches!(e, ClientError::FailedPrecondition(ref m) if m.contains("completed OK by ann")),
        "{e}"
    );
    ends(&client, b, SagaEnd::Completed).await;
    assert_eq!(
        lab.get("charged", b).as_deref(),
        Some(format!("0:reserve=r-{b};1:approval=approved by ann").as_str())
    );

    // A cancel of a PENDING step compensates it (it may complete), and a
    // late completion is refused.
    let d = client
        .start_saga(&StartSaga::new("pending", 1, "pend-2", b"{}".to_vec()))
        .await
        .unwrap()
        .saga_id;
    wait_for(&client, d, Duration::from_secs(30), "step 1 PENDING", is_pending).await;
    let op = lab.forward_operation(d, 1);
    client.cancel_saga(d, "nobody answered").await.unwrap();
    ends(&client, d, SagaEnd::Compensated).await;
    assert_eq!(
        lab.get("withdrawn", d).as_deref(),
        Some("1"),
        "the PENDING request was withdrawn"
    );
    assert_eq!(
        lab.get("released", d),
        Some(format!("r-{d}")),
        "the compensation got its own forward's output"
    );
    let e = client
        .complete_step(d, 1, &op, StepEnd::Ok { output: vec![] }, "ann")
        .await
        .unwrap_err();
    assert!(matches!(e, ClientError::FailedPrecondition(_)), "{e}");

    // A completion timeout: past it the saga parks for an operator, and
    // a late completion still ends the step.
    let mut approval = lab.step("approval", Compensable, "withdraw");
    approval.completion_timeout_ms = 500;
    let timed = definition(
        "timed",
        vec![
            lab.step("reserve", Compensable, "release"),
            approval,
            lab.step("charge", Pivot, ""),
        ],
    );
    client.register_saga_definition(&timed).await.unwrap();
    let t = client
        .start_saga(&StartSaga::new("timed", 1, "timed-1", b"{}".to_vec()))
        .await
        .unwrap()
        .saga_id;
    let v = wait_for(&client, t, Duration::from_secs(30), "parked past its timeout", |v| {
        sagas::state(v) == pb::SagaState::Parked
    })
    .await;
    assert!(
        v.parked_reason.contains("completion_timeout_ms = 500"),
        "{}",
        v.parked_reason
    );
    let op = lab.forward_operation(t, 1);
    client
        .complete_step(
            t,
            1,
            &op,
            StepEnd::Ok {
                output: b"late".to_vec(),
            },
            "ann",
        )
        .await
        .unwrap();
    ends(&client, t, SagaEnd::Completed).await;
    assert_eq!(
        lab.get("charged", t).as_deref(),
        Some(format!("0:reserve=r-{t};1:approval=late").as_str())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t123_high_impact_compensations_wait_for_an_approval_and_policy_rules_apply() {
    let mut c = TestCluster::start_with("t123b", 3, |cfg| {
        cfg.saga.policy_rules = vec![
            SagaPolicyRule {
                definition: "ruled".into(),
                step: "decline".into(),
                reason_contains: "declined".into(),
                recovery: vec!["PARK".into()],
                escalation: "call the payments desk".into(),
                ..SagaPolicyRule::default()
            },
            SagaPolicyRule {
                definition: "ruled".into(),
                step: "reserve".into(),
                approve_compensation: true,
                ..SagaPolicyRule::default()
            },
        ];
    });
    c.leader().await;
    let lab = LabService::start(c.dir.path()).await;
    let client = c.client();
    use pb::StepKind::*;
    let awaiting = |v: &pb::SagaView| v.awaiting_approval && sagas::state(v) == pb::SagaState::Parked;

    // The definition marks the reservation's compensation high-impact.
    let mut reserve = lab.step("reserve", Compensable, "release");
    reserve.high_impact = true;
    let gated = definition(
        "gated",
        vec![
            reserve,
            lab.step("decline", Compensable, "withdraw"),
            lab.step("charge", Pivot, ""),
        ],
    );
    client.register_saga_definition(&gated).await.unwrap();
    let a = client
        .start_saga(&StartSaga::new("gated", 1, "gated-1", b"{}".to_vec()))
        .await
        .unwrap()
        .saga_id;
    let v = wait_for(&client, a, Duration::from_secs(30), "parked for an approval", awaiting).await;
    assert_eq!(v.current_step, 0, "{v:#?}");
    assert!(v.parked_reason.contains("high-impact"), "{}", v.parked_reason);
    assert!(lab.get("released", a).is_none(), "nothing undone before the approval");
    // A retry would only wait again: refused with what to do.
    let e = client
        .operate_saga(a, SagaAction::Retry, "ops", "try again")
        .await
        .unwrap_err();
    assert!(
        matches!(e, ClientError::FailedPrecondition(ref m) if m.contains("approve")),
        "{e}"
    );
    let v = client
        .operate_saga(a, SagaAction::Approve, "bob", "refund checked with finance")
        .await
        .unwrap();
    assert_eq!(v.steps[0].approved_by, "bob");
    ends(&client, a, SagaEnd::Compensated).await;
    assert_eq!(lab.get("released", a), Some(format!("r-{a}")));

    // The node's rules: the decline parks with the rule's escalation (the
    // step registered COMPENSATE first; the rule ranks PARK first), and
    // the reservation's
    // compensation, not marked in the definition, waits for an approval.
    let mut decline = lab.step("decline", Compensable, "withdraw");
    decline.on_failure = vec![pb::RecoveryOption::Compensate as i32, pb::RecoveryOption::Park as i32];
    let ruled = definition(
        "ruled",
        vec![
            lab.step("reserve", Compensable, "release"),
            decline,
            lab.step("charge", Pivot, ""),
        ],
    );
    client.register_saga_definition(&ruled).await.unwrap();
    let b = client
        .start_saga(&StartSaga::new("ruled", 1, "ruled-1", b"{}".to_vec()))
        .await
        .unwrap()
        .saga_id;
    let v = wait_for(&client, b, Duration::from_secs(30), "parked by the rule", |v| {
        sagas::state(v) == pb::SagaState::Parked
    })
    .await;
    assert_eq!(v.current_step, 1, "{v:#?}");
    assert!(
        v.parked_reason.starts_with("call the payments desk"),
        "the rule's escalation: {}",
        v.parked_reason
    );
    assert!(!v.awaiting_approval);
    assert!(lab.get("released", b).is_none(), "parked, not compensated");
    client
        .operate_saga(b, SagaAction::Compensate, "ops", "customer refunded")
        .await
        .unwrap();
    let v = wait_for(&client, b, Duration::from_secs(30), "parked for an approval", awaiting).await;
    assert_eq!(v.current_step, 0);
    assert!(lab.get("released", b).is_none());
    client
        .operate_saga(b, SagaAction::Approve, "bob", "ok to release")
        .await
        .unwrap();
    ends(&client, b, SagaEnd::Compensated).await;
    assert_eq!(lab.get("released", b), Some(format!("r-{b}")));
}
