//! Crash windows of a PostgreSQL participant (ADR 0015), with the
//! `failpoints` feature: a real PostgreSQL server started by the test, a
//! three-node cluster, and the three shop services of `demo --postgres`
//! (`dtx-dev shop-serve`, real processes). The payment service aborts (like
//! kill -9) at each participant fault point of docs/design.md, and once in
//! the middle of recovery; each case ends with the three databases matching
//! the decision, no prepared transaction left, nothing applied twice
//! (`dtx_shop::audit`), and the crash point having fired.
//!
//! Run with `cargo test -p dtx-devtools --test it --
//! t88_postgres_crash_points::`. Without the PostgreSQL server binaries it
//! says so and passes, unless `DTX_REQUIRE_POSTGRES=1` (CI) makes that a
//! failure.

use crate::common;

use std::collections::BTreeMap;

use common::shop::order;
use common::shop::postgres_or_skip;
use common::shop::settle;
use common::shop::shop;
use common::TestCluster;
use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use dtx_shop::Role;

/// The participant fault points of docs/design.md, at the payment service:
/// - before the durable prepare (its work done, `PREPARE TRANSACTION` not
///   issued): no vote, so ABORT; PostgreSQL drops the open transaction with
///   the connection; the other two roll back their prepared work;
/// - after `PREPARE TRANSACTION`, before the vote reaches the coordinator:
///   ABORT (no YES vote arrived), and the prepared transaction the crash
///   left is found in `pg_prepared_xacts` by the restarted service's
///   recovery and rolled back;
/// - after `COMMIT PREPARED`, before the ack: COMMIT, and the redelivered
///   Commit finds the commit marker and acks without applying twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t88_postgres_participant_crash_points_end_with_the_decision_applied_once() {
    let Some(pg) = postgres_or_skip("t88 crash points") else {
        return;
    };
    let mut c = TestCluster::start("t88a");
    c.leader().await;
    let mut shop = shop(&c, pg).await;
    let client = c.client();
    let mut told = BTreeMap::new();
    let cases = [
        ("participant_before_durable_prepare", Some(false)),
        ("participant_after_prepare_before_reply", Some(false)),
        ("participant_after_decision_before_ack", Some(true)),
    ];
    for (i, (point, expect)) in cases.into_iter().enumerate() {
        let once = c.dir.path().join(format!("fired-{i}"));
        shop.arm_payment(point, &once).await;
        let env = vec![
            ("DTX_FAILPOINT".to_string(), point.to_string()),
            ("DTX_FAILPOINT_ONCE".to_string(), once.display().to_string()),
        ];
        let o = order(i);
        let (txid, outcome) = dtx_shop::place_order(&client, &o.id, &o, &shop.endpoints()).await;
        let txid = txid.unwrap_or_else(|| panic!("{point}: no txid ({outcome:?})"));
        let committed = settle(&c, &mut shop, &env, txid, &o.id).await;
        assert!(once.exists(), "{point}: the crash point never fired");
        if let Some(expect) = expect {
            assert_eq!(committed, expect, "{point}: decision");
        }
        told.insert(o.id.clone(), committed);
    }
    // An order after all that goes through normally.
    let o = order(10);
    let (txid, outcome) = dtx_shop::place_order(&client, &o.id, &o, &shop.endpoints()).await;
    assert_eq!(outcome.unwrap(), dtx_client::TxOutcome::Committed);
    // The answer comes with the decision; phase two may still be on its way.
    assert!(settle(&c, &mut shop, &[], txid.unwrap(), &o.id).await);
    told.insert(o.id, true);
    shop.audit(&told).await;
    drop(shop.pg);
}

/// A crash in the middle of recovery: the payment service holds two
/// prepared transactions whose decision (ABORT) it missed while down; on
/// restart its recovery rolls back the first and dies before the second;
/// restarted again, the second is rolled back. Nothing prepared is left,
/// nothing was applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t88_postgres_participant_crash_mid_recovery_resolves_the_rest_after_restart() {
    let Some(pg) = postgres_or_skip("t88 mid-recovery") else {
        return;
    };
    // Recovery at the service's start must be what applies the decisions
    // (the crash point fires in the middle of it), not the leader's
    // delivery: after its first attempt fails on the stopped service, the
    // next one waits 10 to 20 s. With the default 50 ms backoff the
    // delivery sometimes reached the restarted service first and recovery
    // found nothing in doubt (seen once in CI).
    let mut c = TestCluster::start_with("t88b", 3, |cfg| {
        cfg.txn.delivery_retry_base_ms = 20_000;
        cfg.txn.delivery_retry_max_ms = 20_000;
    });
    // The leader's term, as its own Prepare would carry.
    let term = c.leader_term().await;
    let mut shop = shop(&c, pg).await;
    let client = c.client();
    let payment_addr = shop.services[&Role::Payment].addr.clone();
    let mut participant = ParticipantServiceClient::connect(format!("http://{payment_addr}"))
        .await
        .unwrap();

    // Two transactions enlisting the payment service, prepared there by
    // this test acting as the coordinator would.
    let mut txids = Vec::new();
    for i in 0..2 {
        let o = order(20 + i);
        let t = client.begin(&o.id, 60_000, b"").await.unwrap().txid;
        // As the coordinator's Prepare: with the cluster's incarnation.
        let incarnation = client.status(t).await.unwrap().incarnation;
        client
            .enlist(t, Role::Payment.id(), &payment_addr, &o.payload())
            .await
            .unwrap();
        let vote = participant
            .prepare(pb::PrepareRequest {
                txid: t,
                term,
                participant_id: Role::Payment.id().into(),
                payload: o.payload(),
                incarnation,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(vote.vote, pb::Vote::Yes as i32, "{}", vote.reason);
        txids.push((t, o.id));
    }
    assert_eq!(shop.prepared_left().await, 2);

    // The service goes down; the decisions (ABORT) are made without it.
    shop.services.get_mut(&Role::Payment).unwrap().kill9();
    for (t, _) in &txids {
        client.abort(*t, "t88 mid-recovery").await.unwrap();
    }
    // Restarted with the crash point armed: recovery asks about both on
    // start, applies the first and dies.
    let once = c.dir.path().join("fired-mid");
    let env = vec![
        ("DTX_FAILPOINT".to_string(), "participant_mid_recovery".to_string()),
        ("DTX_FAILPOINT_ONCE".to_string(), once.display().to_string()),
    ];
    shop.services.get_mut(&Role::Payment).unwrap().start(&env).unwrap();
    let mut told = BTreeMap::new();
    for (t, o) in &txids {
        assert!(!settle(&c, &mut shop, &env, *t, o).await, "{o}: ABORT expected");
        told.insert(o.clone(), false);
    }
    assert!(once.exists(), "the crash point in the middle of recovery never fired");
    shop.audit(&told).await;
    drop(shop.pg);
}
