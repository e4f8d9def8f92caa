//! The order saga with its inventory on PostgreSQL (`saga-step-serve --role
//! inventory --postgres`, the SDK's `saga_pg` store, ADR 0020) as a real
//! process on a real PostgreSQL server the test starts: orders complete
//! or compensate through a three-node cluster; PostgreSQL killed with
//! SIGKILL under a running saga leaves its reserve UNKNOWN (never FAILED)
//! until the server is back and the status query settles it; the
//! inventory dying after its compensation committed, before its reply
//! (the store's crash point), is settled by the status query once. The
//! audit (`saga-step-audit --postgres`) reads the database: stock
//! conserved, every reserve applied once, compensated orders hold nothing.
//!
//! Without the PostgreSQL server binaries each test says so and passes,
//! unless `DTX_REQUIRE_POSTGRES=1` (CI) makes that a failure.

use crate::common;

use std::time::Duration;

use common::sagas;
use common::sagas::SagaShop;
use common::sagas::ShopFlags;
use common::sagas::ENDED;
use common::TestCluster;
use dtx_pg_server::PgServer;
use dtx_proto::v1 as pb;

const ORDER: &str = dtx_saga_shop::ORDER_SAGA;

/// A PostgreSQL server with the inventory's database, or None (said
/// loudly) when its binaries are missing and not required.
fn postgres(test: &str) -> Option<(PgServer, String)> {
    let pg = dtx_pg_server::start_or_skip(test, dtx_pg_server::PgServerOptions::default())?;
    pg.create_database("inventory").unwrap();
    let conn = pg.conn_string("inventory");
    Some((pg, conn))
}

/// A three-node cluster whose step calls wait up to 30 s for an answer
/// (as t111's: these tests count calls and status queries).
fn cluster(name: &str) -> TestCluster {
    TestCluster::start_with(name, 3, |cfg| cfg.saga.call_timeout_ms = 30_000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t124_orders_on_a_postgres_inventory_end_and_a_postgres_kill_is_unknown_not_failed() {
    let Some((mut pg, conn)) = postgres("t123a") else {
        return;
    };
    let mut c = cluster("t123a");
    c.leader().await;
    let mut shop = SagaShop::start(
        c.dir.path(),
        ShopFlags {
            lose_replies_percent: 30,
            inventory_postgres: Some(conn),
            ..ShopFlags::default()
        },
    )
    .await;
    sagas::register(&c, shop.definition()).await;
    let good: Vec<_> = (1..=4).map(|i| sagas::order(i, i as u32, 2, i as u32, 100)).collect();
    let out_of_stock = sagas::order(5, 5, 1_000, 5, 100);
    let no_funds = sagas::order(6, 6, 3, 6, 10_000_000);
    let mut ids = Vec::new();
    for o in good.iter().chain([&out_of_stock, &no_funds]) {
        ids.push(sagas::start(&c, ORDER, o, None).await);
    }
    let mut views = Vec::new();
    for id in &ids {
        views.push(sagas::wait_state(&c, &mut shop, *id, &ENDED, Duration::from_secs(60)).await);
    }
    for v in &views[..4] {
        assert_eq!(sagas::state(v), pb::SagaState::Completed, "{v:#?}");
        assert!(
            !v.steps[0].precondition.is_empty(),
            "the reserve's version is journaled"
        );
    }
    assert_eq!(sagas::state(&views[4]), pb::SagaState::Compensated);
    assert!(views[4].steps[0]
        .forward
        .as_ref()
        .unwrap()
        .reason
        .contains("out of stock"));
    assert_eq!(sagas::state(&views[5]), pb::SagaState::Compensated);
    assert_eq!(
        sagas::outcome(views[5].steps[0].compensation.as_ref()),
        pb::StepOutcome::Ok,
        "the reservation of the unpayable order was released"
    );

    // PostgreSQL crashes under the inventory: a saga started now finds its
    // reserve failing (UNKNOWN: the status query cannot answer either) and
    // completes once the server is back, reserved once.
    pg.kill9();
    let late = sagas::order(7, 7, 1, 7, 100);
    let id = sagas::start(&c, ORDER, &late, None).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let v = sagas::get(&c, id).await;
    assert_eq!(sagas::state(&v), pb::SagaState::Running, "{v:#?}");
    let reserve = v.steps[0].forward.as_ref().expect("the reserve was tried");
    assert_ne!(
        sagas::outcome(Some(reserve)),
        pb::StepOutcome::Failed,
        "an unreachable PostgreSQL is never FAILED: {v:#?}"
    );
    pg.restart().unwrap();
    let v = sagas::wait_state(&c, &mut shop, id, &ENDED, Duration::from_secs(60)).await;
    assert_eq!(sagas::state(&v), pb::SagaState::Completed, "{v:#?}");

    let audits = shop.audit_all();
    let inv = &audits[0];
    assert_eq!(inv.store, "postgres", "{inv:#?}");
    for o in good.iter().chain([&late]) {
        let r = &inv.reservations[&o.order];
        assert_eq!(
            (r.reserves_applied, r.releases_applied, r.reserved_qty),
            (1, 0, o.qty),
            "{o:?}"
        );
    }
    let r = &inv.reservations[&no_funds.order];
    assert_eq!((r.reserves_applied, r.releases_applied, r.reserved_qty), (1, 1, 0));
    assert!(!inv.reservations.contains_key(&out_of_stock.order));
    let held: u64 = good.iter().chain([&late]).map(|o| o.qty).sum();
    assert_eq!(inv.skus.values().map(|s| s.reserved).sum::<u64>(), held);
    assert!(inv.skus.values().all(|s| s.conserved), "{inv:#?}");
    assert_eq!(audits[1].charges.len(), 5, "five orders charged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t124_a_postgres_inventory_dying_after_its_compensation_committed_is_settled_once() {
    let Some((_pg, conn)) = postgres("t123b") else { return };
    let mut c = cluster("t123b");
    c.leader().await;
    let mut shop = SagaShop::start(
        c.dir.path(),
        ShopFlags {
            hold_back: vec!["inventory"],
            inventory_postgres: Some(conn),
            ..ShopFlags::default()
        },
    )
    .await;
    let once = c.dir.path().join("failpoint-fired");
    shop.env[0] = vec![
        (
            "DTX_FAILPOINT".into(),
            "step_compensation_after_commit_before_reply".into(),
        ),
        ("DTX_FAILPOINT_ONCE".into(), once.display().to_string()),
    ];
    shop.start_role("inventory").await;
    sagas::register(&c, shop.definition()).await;
    let o = sagas::order(1, 1, 2, 1, 10_000_000);
    let id = sagas::start(&c, ORDER, &o, None).await;
    let v = sagas::wait_state(&c, &mut shop, id, &ENDED, Duration::from_secs(90)).await;
    assert!(once.exists(), "the crash point was not reached");
    assert!(shop.restarts >= 1, "the inventory died and was started again");
    assert_eq!(sagas::state(&v), pb::SagaState::Compensated, "{v:#?}");
    let comp = v.steps[0].compensation.as_ref().unwrap();
    assert_eq!((comp.attempts, comp.reconciliations), (1, 1), "{v:#?}");
    let audits = shop.audit_all();
    let r = &audits[0].reservations[&o.order];
    assert_eq!(
        (r.reserves_applied, r.releases_applied, r.reserved_qty),
        (1, 1, 0),
        "{r:?}"
    );
}
