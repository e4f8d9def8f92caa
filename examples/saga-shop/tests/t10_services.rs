//! The order saga's three step services, each served on 127.0.0.1 as
//! `saga-step-serve` runs it, driven through their gRPC API directly (no
//! cluster): reserve, charge and send for one order; reserve then release for
//! another; a release on a stale version; a payment API that loses every
//! reply, reconciled through Status; a mail server that is busy half of the
//! time, retried under new operation ids; then the audit of each stopped
//! service. The payment provider and the e-mail sender (the outside world the
//! payment and e-mail services call, ADR 0034) are served in-process on their
//! own sockets, as `outside-serve` runs them; a provider that loses every
//! reply never turns a charge into FAILED.

use std::path::Path;
use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_step_service_client::SagaStepServiceClient;
use dtx_saga_shop::OrderInput;
use dtx_saga_shop::OutsideRole;
use dtx_saga_shop::OutsideServeArgs;
use dtx_saga_shop::Role;
use dtx_saga_shop::StepServeArgs;
use dtx_transport::channel::Channel;

/// An outside process, in-process on its own socket.
struct World {
    addr: String,
    data: std::path::PathBuf,
    role: OutsideRole,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl World {
    async fn start(role: OutsideRole, data: &Path, lose_replies_percent: u32) -> World {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let args = OutsideServeArgs {
            lose_replies_percent,
            ..OutsideServeArgs::new(role, "-", data)
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(dtx_saga_shop::serve_outside_listener(args, listener, async {
            let _ = stopped.await;
        }));
        World {
            addr,
            data: data.to_path_buf(),
            role,
            stop,
            served,
        }
    }

    /// Stops it and audits its log.
    async fn audit(self) -> dtx_saga_shop::Audit {
        let _ = self.stop.send(());
        self.served.await.unwrap().unwrap();
        let a = dtx_saga_shop::outside_audit(self.role, &self.data).unwrap();
        println!("{}", serde_json::to_string_pretty(&a).unwrap());
        assert!(a.ok(), "{a:#?}");
        a
    }
}

struct Svc {
    client: SagaStepServiceClient<Channel>,
    query: &'static str,
    stop: tokio::sync::oneshot::Sender<()>,
    served: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Svc {
    async fn start(args: StepServeArgs) -> Svc {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let query = match args.role {
            Role::Inventory => dtx_saga_shop::RESERVATION,
            Role::Payment => dtx_saga_shop::CHARGE_STATUS,
            Role::Email => dtx_saga_shop::EMAIL_STATUS,
        };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = tokio::spawn(dtx_saga_shop::serve_listener(args, listener, async {
            let _ = stopped.await;
        }));
        let ch = dtx_transport::channel::channel_with(&addr, None, Duration::from_secs(2), None).unwrap();
        Svc {
            client: SagaStepServiceClient::new(ch),
            query,
            stop,
            served,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.served.await.unwrap().unwrap();
    }

    async fn forward(&mut self, call: pb::StepCall) -> Result<pb::StepReply, tonic::Status> {
        self.client.forward(call).await.map(|r| r.into_inner())
    }

    async fn compensate(&mut self, call: pb::StepCall) -> pb::StepReply {
        self.client.compensate(call).await.unwrap().into_inner()
    }

    async fn status(&mut self, op: &str) -> pb::StepStatusReply {
        self.client
            .status(pb::StepStatusRequest {
                operation_id: op.into(),
                query: self.query.into(),
            })
            .await
            .unwrap()
            .into_inner()
    }

    /// What an orchestrator does: call; on an error (UNKNOWN) ask Status;
    /// not applied: call again under the same operation id.
    async fn forward_reconciled(&mut self, call: pb::StepCall) -> (pb::StepReply, u32) {
        let mut reconciliations = 0;
        for _ in 0..20 {
            match self.forward(call.clone()).await {
                Ok(r) => return (r, reconciliations),
                Err(st) => {
                    assert_eq!(st.code(), tonic::Code::Unavailable, "{st:?}");
                    reconciliations += 1;
                    let s = self.status(&call.operation_id).await;
                    if s.applied {
                        return (s.reply.unwrap(), reconciliations);
                    }
                }
            }
        }
        panic!("no answer for {}", call.operation_id);
    }
}

fn order(order: &str, qty: u64, amount: u64) -> OrderInput {
    OrderInput {
        order: order.into(),
        sku: "sku-3".into(),
        qty,
        customer: "c-5".into(),
        amount,
    }
}

fn call(op: &str, action: &str, input: &OrderInput) -> pb::StepCall {
    pb::StepCall {
        saga_id: 1,
        step: 0,
        operation_id: op.into(),
        action: action.into(),
        input: input.to_json(),
        fingerprint: "f".into(),
        authorization: Some(pb::SagaAuthorization {
            principal: "shop".into(),
            ..Default::default()
        }),
        term: 1,
        ..Default::default()
    }
}

fn release(op: &str, forward_op: &str, precondition: &str, input: &OrderInput) -> pb::StepCall {
    pb::StepCall {
        forward_operation_id: forward_op.into(),
        precondition: precondition.into(),
        ..call(op, dtx_saga_shop::RELEASE, input)
    }
}

fn outcome(r: &pb::StepReply) -> pb::StepOutcome {
    pb::StepOutcome::try_from(r.outcome).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_three_services_run_the_order_saga_steps_once_and_audit_clean() {
    let dir = tempfile::tempdir().unwrap();
    let (inv_dir, pay_dir, mail_dir) = (dir.path().join("inv"), dir.path().join("pay"), dir.path().join("mail"));
    let provider = World::start(OutsideRole::Payment, &dir.path().join("provider"), 0).await;
    let sender = World::start(OutsideRole::Email, &dir.path().join("sender"), 0).await;
    let mut inv = Svc::start(StepServeArgs::new(Role::Inventory, "-", &inv_dir)).await;
    let mut pay = Svc::start(StepServeArgs {
        lose_replies_percent: 100,
        provider: Some(provider.addr.clone()),
        ..StepServeArgs::new(Role::Payment, "-", &pay_dir)
    })
    .await;
    let mut mail = Svc::start(StepServeArgs {
        fail_first_percent: 50,
        sender: Some(sender.addr.clone()),
        ..StepServeArgs::new(Role::Email, "-", &mail_dir)
    })
    .await;

    // Order o-1: reserve, charge (every reply lost), send the confirmation.
    let o1 = order("o-1", 2, 1200);
    let r = inv.forward(call("1.0.f", dtx_saga_shop::RESERVE, &o1)).await.unwrap();
    assert_eq!(outcome(&r), pb::StepOutcome::Ok, "{r:?}");
    assert_eq!(r.resource_version, "1", "sku-3's first change");
    let st = pay
        .forward(call("1.1.f", dtx_saga_shop::CHARGE, &o1))
        .await
        .unwrap_err();
    assert_eq!((st.code(), st.message()), (tonic::Code::Unavailable, "reply lost"));
    let (charged, reconciliations) = pay.forward_reconciled(call("1.1.f", dtx_saga_shop::CHARGE, &o1)).await;
    assert_eq!(outcome(&charged), pb::StepOutcome::Ok, "{charged:?}");
    assert_eq!(reconciliations, 1, "the repeat's reply was lost too; Status settled it");
    let mut attempts = 0;
    let sent = loop {
        attempts += 1;
        assert!(attempts <= 40, "the mail server stays busy");
        let op = format!("1.2.f.{attempts}");
        let r = mail
            .forward(call(&op, dtx_saga_shop::SEND_CONFIRMATION, &o1))
            .await
            .unwrap();
        match outcome(&r) {
            pb::StepOutcome::Ok => break r,
            pb::StepOutcome::Failed => {
                assert_eq!(r.reason, "mail server busy");
                assert_eq!(mail.status(&op).await.reply, Some(r), "a FAILED answer is recorded");
            }
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(mail.status(&format!("1.2.f.{attempts}")).await.reply, Some(sent));

    // Order o-2: reserved, then released (a repeat answers the same).
    let o2 = order("o-2", 3, 500);
    let r = inv.forward(call("2.0.f", dtx_saga_shop::RESERVE, &o2)).await.unwrap();
    assert_eq!(r.resource_version, "2");
    let rel = inv
        .compensate(release("2.0.c", "2.0.f", &r.resource_version, &o2))
        .await;
    assert_eq!(outcome(&rel), pb::StepOutcome::Ok, "{rel:?}");
    assert_eq!(
        inv.compensate(release("2.0.c", "2.0.f", &r.resource_version, &o2))
            .await,
        rel
    );
    // Released again under another operation id: nothing is held any more.
    let again = inv
        .compensate(release("2.0.c.2", "2.0.f", &r.resource_version, &o2))
        .await;
    assert_eq!(outcome(&again), pb::StepOutcome::Noop, "{again:?}");

    // Order o-3: a release whose precondition is not the reservation's
    // version is STALE and changes nothing.
    let o3 = order("o-3", 2, 100);
    let r = inv.forward(call("3.0.f", dtx_saga_shop::RESERVE, &o3)).await.unwrap();
    assert_eq!(r.resource_version, "4");
    let stale = inv.compensate(release("3.0.c", "3.0.f", "999", &o3)).await;
    assert_eq!(outcome(&stale), pb::StepOutcome::Stale, "{stale:?}");
    assert!(stale.residual.contains("2 of sku-3"), "{stale:?}");
    // Another order's reserve moves the sku on, not o-1's reservation.
    let r1 = inv.compensate(release("1.0.c", "1.0.f", "1", &o1)).await;
    assert_eq!(outcome(&r1), pb::StepOutcome::Ok, "{r1:?}");

    // Refusals: out of stock, insufficient funds (its reply lost too).
    let o4 = order("o-4", 1000, 1_000_000_000);
    let r = inv.forward(call("4.0.f", dtx_saga_shop::RESERVE, &o4)).await.unwrap();
    assert_eq!(
        (outcome(&r), r.reason.as_str()),
        (pb::StepOutcome::Failed, "out of stock")
    );
    let (r, _) = pay.forward_reconciled(call("4.1.f", dtx_saga_shop::CHARGE, &o4)).await;
    assert_eq!(
        (outcome(&r), r.reason.as_str()),
        (pb::StepOutcome::Failed, "declined: insufficient funds")
    );
    // A compensation whose forward action never happened here.
    let noop = inv.compensate(release("5.0.c", "5.0.f", "", &order("o-5", 1, 1))).await;
    assert_eq!(outcome(&noop), pb::StepOutcome::Noop, "{noop:?}");
    // The status queries are the registered ones.
    let st = inv
        .client
        .status(pb::StepStatusRequest {
            operation_id: "1.0.f".into(),
            query: dtx_saga_shop::CHARGE_STATUS.into(),
        })
        .await
        .unwrap_err();
    assert_eq!(st.code(), tonic::Code::InvalidArgument);
    // The pivot has no compensation.
    let r = pay
        .client
        .compensate(release("1.1.c", "1.1.f", "", &o1))
        .await
        .unwrap_err();
    assert_eq!(r.code(), tonic::Code::Unavailable, "its replies are lost too");
    let s = pay.status("1.1.c").await;
    assert_eq!(s.reply.map(|r| outcome(&r)), Some(pb::StepOutcome::Failed));

    inv.stop().await;
    pay.stop().await;
    mail.stop().await;

    let a = dtx_saga_shop::audit(Role::Inventory, &inv_dir).unwrap();
    println!("{}", serde_json::to_string_pretty(&a).unwrap());
    assert!(a.ok(), "{a:#?}");
    let sku = &a.skus["sku-3"];
    assert_eq!((sku.initial, sku.stock, sku.reserved), (100, 98, 2), "{a:#?}");
    assert!(sku.conserved);
    assert_eq!(a.skus.len(), 10);
    assert_eq!(a.reservations["o-1"].reserves_applied, 1);
    assert_eq!(a.reservations["o-1"].releases_applied, 1);
    assert_eq!(a.reservations["o-1"].reserved_qty, 0);
    assert_eq!(a.reservations["o-2"].releases_applied, 1);
    assert_eq!(a.reservations["o-3"].reserved_qty, 2, "the stale release left it");
    // 4 forward calls, and the fence a NOOP release left for the forward
    // operation it never saw (a late call of it answers FAILED).
    assert_eq!((a.inbox_forward, a.inbox_compensate), (5, 5), "{a:#?}");
    assert_eq!(a.compensate_duplicates_seen, 1);
    assert_eq!(a.duplicate_forward_actions, 0);

    let a = dtx_saga_shop::audit(Role::Payment, &pay_dir).unwrap();
    println!("{}", serde_json::to_string_pretty(&a).unwrap());
    assert!(a.ok(), "{a:#?}");
    assert_eq!(a.charges.len(), 1, "{a:#?}");
    assert_eq!((a.charges["o-1"].charges_applied, a.charges["o-1"].amount), (1, 1200));
    assert_eq!(a.forward_duplicates_seen, 1, "the repeat of 1.1.f");
    assert_eq!((a.inbox_forward, a.inbox_compensate, a.in_flight), (2, 1, 0));

    let a = dtx_saga_shop::audit(Role::Email, &mail_dir).unwrap();
    println!("{}", serde_json::to_string_pretty(&a).unwrap());
    assert!(a.ok(), "{a:#?}");
    assert_eq!(a.confirmations["o-1"].applied, 1, "{a:#?}");
    assert_eq!(a.inbox_forward, attempts as u64, "every FAILED attempt is recorded too");

    // The outside world: one card charge and one e-mail; the balances
    // are the provider's.
    let a = provider.audit().await;
    assert_eq!((a.charges["o-1"].charges_applied, a.charges["o-1"].amount), (1, 1200));
    assert_eq!(a.charges.len(), 1);
    assert_eq!(a.balances["c-5"].balance, 100_000 - 1200);
    assert_eq!(a.balances["c-0"].balance, 100_000);
    assert_eq!(a.outside_declined, 1, "o-4's charge");
    let a = sender.audit().await;
    assert_eq!(a.confirmations["o-1"].applied, 1, "{a:#?}");
    assert_eq!(a.confirmations.len(), 1);
}

/// The lost reply of ADR 0034, at the payment service: the provider charges
/// and every reply to the payment service is lost. The charge stays in
/// flight (UNAVAILABLE, UNKNOWN to the orchestrator), however often it is
/// sent; the fence the orchestrator sends after its last attempt asks the
/// provider and answers OK: the card is charged once, the step never
/// FAILED. A charge that never reached a provider that was down is fenced
/// only after the provider voided its key; a provider whose log is reopened
/// (a restart) answers the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_that_loses_every_reply_never_turns_a_charge_into_failed() {
    let dir = tempfile::tempdir().unwrap();
    let provider = World::start(OutsideRole::Payment, &dir.path().join("provider"), 100).await;
    let pay_dir = dir.path().join("pay");
    let mut pay = Svc::start(StepServeArgs {
        provider: Some(provider.addr.clone()),
        ..StepServeArgs::new(Role::Payment, "-", &pay_dir)
    })
    .await;
    let o = order("o-1", 1, 700);
    for _ in 0..3 {
        let e = pay.forward(call("1.1.f", dtx_saga_shop::CHARGE, &o)).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!(e.message().contains("in flight"), "{e:?}");
    }
    let f = pay
        .client
        .fence(pb::StepStatusRequest {
            operation_id: "1.1.f".into(),
            query: dtx_saga_shop::CHARGE_STATUS.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(f.applied, "{f:?}");
    let reply = f.reply.unwrap();
    assert_eq!(outcome(&reply), pb::StepOutcome::Ok);
    assert!(reply.downstream_operation_id.starts_with("ch-"), "{reply:?}");

    // The provider goes away (its address refuses connections): a new
    // charge is in flight and nothing can settle it, so Status and Fence
    // are errors and nothing is fenced.
    let provider_data = provider.data.clone();
    let a = provider.audit().await;
    assert_eq!(a.charges["o-1"].charges_applied, 1);
    let o2 = order("o-2", 1, 300);
    let e = pay
        .forward(call("2.1.f", dtx_saga_shop::CHARGE, &o2))
        .await
        .unwrap_err();
    assert!(e.message().contains("in flight"), "{e:?}");
    let q = |op: &str| pb::StepStatusRequest {
        operation_id: op.into(),
        query: dtx_saga_shop::CHARGE_STATUS.into(),
    };
    assert_eq!(
        pay.client.fence(q("2.1.f")).await.unwrap_err().code(),
        tonic::Code::Unavailable
    );
    assert_eq!(
        pay.client.status(q("2.1.f")).await.unwrap_err().code(),
        tonic::Code::Unavailable
    );
    pay.stop().await;
    let a = dtx_saga_shop::audit(Role::Payment, &pay_dir).unwrap();
    assert_eq!((a.in_flight, a.charges["o-1"].charges_applied), (1, 1), "{a:#?}");

    // Back (same log, a new address): the fence asks it, the key never
    // arrived, it is voided there and FAILED here.
    let provider = World::start(OutsideRole::Payment, &provider_data, 0).await;
    let mut pay = Svc::start(StepServeArgs {
        provider: Some(provider.addr.clone()),
        ..StepServeArgs::new(Role::Payment, "-", &pay_dir)
    })
    .await;
    let f = pay.client.fence(q("2.1.f")).await.unwrap().into_inner();
    assert!(!f.applied, "{f:?}");
    let r = pay.forward(call("2.1.f", dtx_saga_shop::CHARGE, &o2)).await.unwrap();
    assert_eq!(outcome(&r), pb::StepOutcome::Failed, "{r:?}");
    let again = pay.forward(call("1.1.f", dtx_saga_shop::CHARGE, &o)).await.unwrap();
    assert_eq!(again, reply, "the inbox answers the first reply");
    pay.stop().await;
    let a = provider.audit().await;
    assert_eq!((a.charges.len(), a.outside_voided), (1, 1), "{a:#?}");
    assert_eq!(a.balances["c-5"].balance, 100_000 - 700);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_directory_is_seeded_once_and_a_duplicate_effect_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("inv");
    let mut inv = Svc::start(StepServeArgs {
        skus: 2,
        stock: 5,
        ..StepServeArgs::new(Role::Inventory, "-", &data)
    })
    .await;
    let o = OrderInput {
        sku: "sku-1".into(),
        ..order("o-9", 2, 0)
    };
    let r = inv.forward(call("9.0.f", dtx_saga_shop::RESERVE, &o)).await.unwrap();
    assert_eq!(outcome(&r), pb::StepOutcome::Ok);
    inv.stop().await;
    // Restarted with another seed: the data stays as it is.
    let mut inv = Svc::start(StepServeArgs::new(Role::Inventory, "-", &data)).await;
    assert_eq!(inv.forward(call("9.0.f", dtx_saga_shop::RESERVE, &o)).await.unwrap(), r);
    // The same order reserved under a second operation id (what a broken
    // orchestrator would do): applied, and reported by the audit.
    let r = inv
        .forward(call("9.0.f.bis", dtx_saga_shop::RESERVE, &o))
        .await
        .unwrap();
    assert_eq!(outcome(&r), pb::StepOutcome::Ok);
    let r = inv
        .forward(call("9.0.f.ter", dtx_saga_shop::RESERVE, &o))
        .await
        .unwrap();
    assert_eq!(
        (outcome(&r), r.reason.as_str()),
        (pb::StepOutcome::Failed, "out of stock")
    );
    inv.stop().await;
    let a = dtx_saga_shop::audit(Role::Inventory, &data).unwrap();
    assert_eq!(a.skus.len(), 2, "{a:#?}");
    assert_eq!((a.skus["sku-1"].stock, a.skus["sku-1"].reserved), (1, 4));
    assert!(a.problems.is_empty(), "{a:#?}");
    assert_eq!(a.duplicate_forward_actions, 1);
    assert!(!a.ok());
    assert_eq!(a.forward_duplicates_seen, 1);
}

#[test]
fn the_order_saga_definition() {
    let d = dtx_saga_shop::order_saga_definition("inv:1", "pay:2", "mail:3");
    assert_eq!((d.name.as_str(), d.version), ("order", 1));
    let steps: Vec<_> = d
        .steps
        .iter()
        .map(|s| {
            (
                s.name.as_str(),
                pb::StepKind::try_from(s.kind).unwrap(),
                s.service.as_str(),
                s.action.as_str(),
                s.compensation.as_str(),
                s.status_query.as_str(),
                s.versioned,
            )
        })
        .collect();
    assert_eq!(
        steps,
        [
            (
                "reserve_stock",
                pb::StepKind::Compensable,
                "inv:1",
                "reserve",
                "release",
                "reservation",
                true
            ),
            (
                "charge_card",
                pb::StepKind::Pivot,
                "pay:2",
                "charge",
                "",
                "charge_status",
                false
            ),
            (
                "send_confirmation",
                pb::StepKind::Retriable,
                "mail:3",
                "send_confirmation",
                "",
                "email_status",
                false
            ),
        ]
    );
    let retry = d.steps[0].retry.unwrap();
    assert_eq!(
        (retry.max_attempts, retry.backoff_initial_ms, retry.backoff_max_ms),
        (8, 50, 1000)
    );
}

/// The same inventory calls, in order: reserves (two skus, one out of
/// stock, one unknown sku), a repeat, releases (OK, a repeat, NOOP for a
/// released and a never-made reservation), an amend then a STALE release.
async fn inventory_script(inv: &mut Svc) -> Vec<pb::StepReply> {
    let o1 = order("o-1", 2, 100);
    let o2 = OrderInput {
        sku: "sku-4".into(),
        ..order("o-2", 3, 100)
    };
    let o3 = order("o-3", 1, 100);
    let mut out = Vec::new();
    out.push(inv.forward(call("1.0.f", dtx_saga_shop::RESERVE, &o1)).await.unwrap());
    out.push(inv.forward(call("1.0.f", dtx_saga_shop::RESERVE, &o1)).await.unwrap());
    out.push(inv.forward(call("2.0.f", dtx_saga_shop::RESERVE, &o2)).await.unwrap());
    out.push(
        inv.forward(call("4.0.f", dtx_saga_shop::RESERVE, &order("o-4", 1_000, 1)))
            .await
            .unwrap(),
    );
    let unknown = OrderInput {
        sku: "sku-99".into(),
        ..order("o-5", 1, 1)
    };
    out.push(
        inv.forward(call("5.0.f", dtx_saga_shop::RESERVE, &unknown))
            .await
            .unwrap(),
    );
    let v2 = out[2].resource_version.clone();
    out.push(inv.compensate(release("2.0.c", "2.0.f", &v2, &o2)).await);
    out.push(inv.compensate(release("2.0.c", "2.0.f", &v2, &o2)).await);
    out.push(inv.compensate(release("2.0.c.2", "2.0.f", &v2, &o2)).await);
    // A release of a reserve never made: NOOP, and the reserve is fenced.
    out.push(inv.compensate(release("6.0.c", "6.0.f", "", &order("o-6", 1, 1))).await);
    out.push(
        inv.forward(call("6.0.f", dtx_saga_shop::RESERVE, &order("o-6", 1, 1)))
            .await
            .unwrap(),
    );
    out.push(inv.forward(call("3.0.f", dtx_saga_shop::RESERVE, &o3)).await.unwrap());
    let v3 = out.last().unwrap().resource_version.clone();
    out.push(
        inv.forward(call("3.0.a", dtx_saga_shop::AMEND, &order("o-3", 2, 100)))
            .await
            .unwrap(),
    );
    out.push(inv.compensate(release("3.0.c", "3.0.f", &v3, &o3)).await);
    out
}

/// What a reply says, without what differs between stores by design.
fn said(r: &pb::StepReply) -> (pb::StepOutcome, String, String, String) {
    (
        outcome(r),
        r.resource_version.clone(),
        r.reason.clone(),
        r.residual.clone(),
    )
}

/// The inventory on PostgreSQL (`saga-step-serve --postgres`, the SDK's
/// `saga_pg` store) answers every call as the sled one does, and its audit
/// reads the same from its tables; PostgreSQL killed with SIGKILL makes a
/// call an error (UNKNOWN to the orchestrator), never FAILED, and nothing
/// is recorded until the server is back; the seed is written once. Without
/// the PostgreSQL server binaries it says so and passes, unless
/// `DTX_REQUIRE_POSTGRES=1` (CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inventory_on_postgres_answers_as_the_sled_one_and_a_postgres_kill_is_unknown() {
    let opts = dtx_pg_server::PgServerOptions {
        kill_with_parent_thread: true,
        ..dtx_pg_server::PgServerOptions::default()
    };
    let Some(mut pg) = dtx_pg_server::start_or_skip("t10 inventory on PostgreSQL", opts) else {
        return;
    };
    pg.create_database("inventory").unwrap();
    let conn = pg.conn_string("inventory");
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("inv");
    let mut sled = Svc::start(StepServeArgs::new(Role::Inventory, "-", &data)).await;
    let on_sled = inventory_script(&mut sled).await;
    sled.stop().await;
    let mut inv = Svc::start(StepServeArgs::new_postgres("-", &conn)).await;
    let on_pg = inventory_script(&mut inv).await;
    assert_eq!(
        on_pg.iter().map(said).collect::<Vec<_>>(),
        on_sled.iter().map(said).collect::<Vec<_>>()
    );
    let expected = [
        pb::StepOutcome::Ok,
        pb::StepOutcome::Ok,
        pb::StepOutcome::Ok,
        pb::StepOutcome::Failed,
        pb::StepOutcome::Failed,
        pb::StepOutcome::Ok,
        pb::StepOutcome::Ok,
        pb::StepOutcome::Noop,
        pb::StepOutcome::Noop,
        pb::StepOutcome::Failed,
        pb::StepOutcome::Ok,
        pb::StepOutcome::Ok,
        pb::StepOutcome::Stale,
    ];
    assert_eq!(on_pg.iter().map(outcome).collect::<Vec<_>>(), expected, "{on_pg:#?}");
    assert_eq!(on_pg[3].reason, "out of stock");
    assert!(on_pg[12].residual.contains("2 of sku-3"), "{:?}", on_pg[12]);

    // PostgreSQL crashes: a call is an error, not an answer.
    pg.kill9();
    let o7 = order("o-7", 1, 1);
    let st = inv
        .forward(call("7.0.f", dtx_saga_shop::RESERVE, &o7))
        .await
        .expect_err("no answer without PostgreSQL");
    assert_ne!(st.code(), tonic::Code::Ok);
    pg.restart().unwrap();
    let st = inv.status("7.0.f").await;
    assert!(!st.applied, "nothing recorded while PostgreSQL was down: {st:?}");
    let r = inv.forward(call("7.0.f", dtx_saga_shop::RESERVE, &o7)).await.unwrap();
    assert_eq!(outcome(&r), pb::StepOutcome::Ok, "{r:?}");
    inv.stop().await;

    // Started again with another seed: the stock stays as it is.
    let mut inv = Svc::start(StepServeArgs {
        skus: 2,
        stock: 5,
        ..StepServeArgs::new_postgres("-", &conn)
    })
    .await;
    assert_eq!(
        inv.forward(call("7.0.f", dtx_saga_shop::RESERVE, &o7)).await.unwrap(),
        r
    );
    inv.stop().await;

    let a = dtx_saga_shop::pg::audit_pg(&conn).await.unwrap();
    let s = dtx_saga_shop::audit(Role::Inventory, &data).unwrap();
    assert_eq!(a.store, "postgres");
    assert!(a.ok(), "{a:#?}");
    assert_eq!(a.skus.len(), 10, "{a:#?}");
    assert_eq!((a.skus["sku-3"].stock, a.skus["sku-3"].reserved), (100 - 2 - 2 - 1, 5));
    assert!(a.skus.values().all(|s| s.conserved));
    assert_eq!(a.reservations["o-1"], s.reservations["o-1"]);
    assert_eq!(a.reservations["o-2"], s.reservations["o-2"]);
    assert_eq!(a.reservations["o-3"], s.reservations["o-3"]);
    assert_eq!(
        (
            a.reservations["o-2"].reserves_applied,
            a.reservations["o-2"].releases_applied
        ),
        (1, 1)
    );
    assert_eq!(a.inbox_forward, s.inbox_forward + 1, "o-7's reserve as well");
    // The repeats of the script (as on sled), and o-7's after the restart.
    assert_eq!(a.forward_duplicates_seen, s.forward_duplicates_seen + 1);
    assert_eq!(a.compensate_duplicates_seen, s.compensate_duplicates_seen);

    // A second reserve of o-1 under another operation id (a broken
    // orchestrator): applied, and the audit says so.
    let mut inv = Svc::start(StepServeArgs::new_postgres("-", &conn)).await;
    let r = inv
        .forward(call("1.0.f.bis", dtx_saga_shop::RESERVE, &order("o-1", 2, 100)))
        .await
        .unwrap();
    assert_eq!(outcome(&r), pb::StepOutcome::Ok);
    inv.stop().await;
    let a = dtx_saga_shop::pg::audit_pg(&conn).await.unwrap();
    assert_eq!((a.duplicate_forward_actions, a.problems.len()), (1, 0), "{a:#?}");
    assert!(!a.ok());
}
