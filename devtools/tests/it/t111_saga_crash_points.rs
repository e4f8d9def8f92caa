//! The saga's crash windows (ADR 0019), with the `failpoints` feature: a node
//! or a step service aborts (like kill -9) at the named point, once; the saga
//! ends as if nothing had happened, and the step services' audits show every
//! business effect applied at most once.
//! Run with `cargo test -p dtx-devtools --test it -- t111_saga_crash_points::`.

use crate::common;

use std::time::Duration;

use common::sagas;
use common::sagas::SagaShop;
use common::sagas::ShopFlags;
use common::sagas::ENDED;
use common::TestCluster;
use dtx_proto::v1 as pb;

const ORDER: &str = dtx_saga_shop::ORDER_SAGA;

fn armed(point: &str, once: &std::path::Path) -> Vec<(String, String)> {
    vec![
        ("DTX_FAILPOINT".into(), point.into()),
        ("DTX_FAILPOINT_ONCE".into(), once.display().to_string()),
    ]
}

/// A three-node cluster whose step calls wait up to 30 s for an answer.
/// These tests count every call and status query: with the default 2 s, a
/// call that a loaded machine answers late is UNKNOWN, is asked about and
/// called again, and the counts are one higher than the fault alone makes
/// them (seen with six tests at a time). A crash still ends its call at
/// once: the connection closes.
fn cluster(name: &str) -> TestCluster {
    TestCluster::start_with(name, 3, |cfg| cfg.saga.call_timeout_ms = 30_000)
}

/// A three-node cluster whose nodes abort once (in total) at `point`.
async fn cluster_crashing_at(name: &str, point: &str) -> TestCluster {
    let mut c = cluster(name);
    c.procs.stop_all(Duration::from_secs(5));
    c.procs.env = armed(point, &c.dir.path().join("failpoint-fired"));
    c.procs.start_all().unwrap();
    c.leader().await;
    c
}

fn fired(c: &TestCluster) -> bool {
    c.dir.path().join("failpoint-fired").exists()
}

/// Waits for saga `id` to end, starting again any node that died at its
/// crash point (as a supervisor would) and any step service likewise.
async fn wait_ended(c: &mut TestCluster, shop: &mut SagaShop, id: u64) -> pb::SagaView {
    let until = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        for n in 1..=3 {
            if !c.procs.node(n).is_running() {
                c.procs.start(n).unwrap();
            }
        }
        shop.restart_dead().await;
        let v = sagas::get(c, id).await;
        if ENDED.contains(&sagas::state(&v)) {
            return v;
        }
        assert!(std::time::Instant::now() < until, "saga {id} did not end: {v:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One good order through a cluster that crashes at `point`: it completes,
/// and each service applied its effect exactly once.
async fn one_order_completes_through(name: &str, point: &str) -> pb::SagaView {
    let mut c = cluster_crashing_at(name, point).await;
    let mut shop = SagaShop::start(c.dir.path(), ShopFlags::default()).await;
    sagas::register(&c, shop.definition()).await;
    let o = sagas::order(1, 1, 2, 1, 100);
    let id = sagas::start(&c, ORDER, &o, None).await;
    let v = wait_ended(&mut c, &mut shop, id).await;
    assert!(fired(&c), "the crash point {point} was not reached");
    assert_eq!(sagas::state(&v), pb::SagaState::Completed, "{v:#?}");
    let audits = shop.audit_all();
    assert_eq!(audits[0].reservations[&o.order].reserves_applied, 1);
    assert_eq!(audits[1].charges[&o.order].charges_applied, 1);
    assert_eq!(audits[2].confirmations[&o.order].applied, 1);
    v
}

/// One order that cannot be paid: the reservation is compensated.
async fn one_order_compensated(c: &mut TestCluster, shop: &mut SagaShop) -> pb::SagaView {
    sagas::register(c, shop.definition()).await;
    let o = sagas::order(1, 1, 2, 1, 10_000_000);
    let id = sagas::start(c, ORDER, &o, None).await;
    let v = wait_ended(c, shop, id).await;
    assert_eq!(sagas::state(&v), pb::SagaState::Compensated, "{v:#?}");
    assert_eq!(
        sagas::outcome(v.steps[0].compensation.as_ref()),
        pb::StepOutcome::Ok,
        "{v:#?}"
    );
    let audits = shop.audit_all();
    let r = &audits[0].reservations[&o.order];
    assert_eq!(
        (r.reserves_applied, r.releases_applied, r.reserved_qty),
        (1, 1, 0),
        "{r:?}"
    );
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t111_leader_dies_before_the_forward_call() {
    // The intent is journaled, nothing was called: the new leader asks the
    // status query (not applied) and calls under the same operation id.
    let v = one_order_completes_through("t111a", "saga_before_forward_call").await;
    let reserve = v.steps[0].forward.as_ref().unwrap();
    assert_eq!(reserve.operation_id, "1.0.f1");
    assert!(reserve.reconciliations >= 1, "{v:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t111_leader_dies_after_the_reply_before_the_journal() {
    // The service applied and answered; the new leader learns it from the
    // status query: no second call.
    let v = one_order_completes_through("t111b", "saga_after_reply_before_journal").await;
    let reserve = v.steps[0].forward.as_ref().unwrap();
    assert_eq!((reserve.attempts, reserve.reconciliations), (1, 1), "{v:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t111_leader_dies_right_after_the_pivot() {
    let v = one_order_completes_through("t111c", "saga_after_pivot").await;
    assert!(v.past_pivot);
    assert!(v.steps.iter().all(|s| s.compensation.is_none()), "{v:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t111_service_dies_after_committing_before_its_reply() {
    // The payment service charges durably and dies before replying: the
    // call is UNKNOWN, the status query (after its restart) says charged.
    let mut c = cluster("t111d");
    c.leader().await;
    let mut shop = SagaShop::start(
        c.dir.path(),
        ShopFlags {
            hold_back: vec!["payment"],
            ..ShopFlags::default()
        },
    )
    .await;
    let once = c.dir.path().join("failpoint-fired");
    shop.env[1] = armed("step_forward_after_commit_before_reply", &once);
    shop.start_role("payment").await;
    sagas::register(&c, shop.definition()).await;
    let o = sagas::order(1, 1, 2, 1, 100);
    let id = sagas::start(&c, ORDER, &o, None).await;
    let v = wait_ended(&mut c, &mut shop, id).await;
    assert!(once.exists(), "the crash point was not reached");
    assert!(shop.restarts >= 1);
    assert_eq!(sagas::state(&v), pb::SagaState::Completed, "{v:#?}");
    let charge = v.steps[1].forward.as_ref().unwrap();
    assert_eq!((charge.attempts, charge.reconciliations), (1, 1), "{v:#?}");
    let audits = shop.audit_all();
    assert_eq!(audits[1].charges[&o.order].charges_applied, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t111_leader_dies_in_the_middle_of_a_compensation() {
    // The compensation's intent is journaled and the forward action
    // confirmed; the leader dies before calling it. The new leader asks
    // (not applied) and calls it once.
    let mut c = cluster_crashing_at("t111e", "saga_mid_compensation").await;
    let mut shop = SagaShop::start(c.dir.path(), ShopFlags::default()).await;
    let v = one_order_compensated(&mut c, &mut shop).await;
    assert!(fired(&c), "the crash point was not reached");
    assert!(v.steps[0].compensation.as_ref().unwrap().reconciliations >= 1, "{v:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t111_service_dies_after_its_compensation_committed_before_its_reply() {
    let mut c = cluster("t111f");
    c.leader().await;
    let mut shop = SagaShop::start(
        c.dir.path(),
        ShopFlags {
            hold_back: vec!["inventory"],
            ..ShopFlags::default()
        },
    )
    .await;
    let once = c.dir.path().join("failpoint-fired");
    shop.env[0] = armed("step_compensation_after_commit_before_reply", &once);
    shop.start_role("inventory").await;
    let v = one_order_compensated(&mut c, &mut shop).await;
    assert!(once.exists(), "the crash point was not reached");
    let comp = v.steps[0].compensation.as_ref().unwrap();
    assert_eq!((comp.attempts, comp.reconciliations), (1, 1), "{v:#?}");
}
