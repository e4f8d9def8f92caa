//! PostgreSQL itself crashes: the three shop services of `demo --postgres`
//! hold a prepared transaction each when their PostgreSQL server is killed
//! with SIGKILL and started again. The prepared transactions survive the
//! crash (they are PostgreSQL's durable YES votes), the services reconnect by
//! themselves, and the transaction is then committed through the cluster:
//! applied once in every database, nothing prepared left. A second order,
//! prepared the same way and then aborted after a second crash, is rolled
//! back everywhere.
//!
//! Real processes throughout (PostgreSQL, three nodes, three services).
//! Without the PostgreSQL server binaries it says so and passes, unless
//! `DTX_REQUIRE_POSTGRES=1` (CI) makes that a failure.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::shop::order;
use common::shop::postgres_or_skip;
use common::shop::settle;
use common::shop::shop;
use common::shop::Shop;
use common::TestCluster;
use dtx_client::TxOutcome;
use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use dtx_shop::Order;

/// Begins a transaction for `o` at the cluster with the three services
/// enlisted, and prepares it at each of them (as the coordinator's Prepare
/// would): three prepared transactions in PostgreSQL, no decision yet.
async fn prepared_everywhere(c: &mut TestCluster, shop: &Shop, o: &Order) -> u64 {
    // The leader's term, as its own Prepare would carry (never a fixed 1:
    // the participants refuse a new txid below the highest term seen).
    let term = c.leader_term().await;
    let client = c.client();
    let txid = client.begin(&o.id, 120_000, b"").await.unwrap().txid;
    // The cluster's incarnation, which its own Prepare will carry: the
    // same transaction only with it.
    let incarnation = client.status(txid).await.unwrap().incarnation;
    for (role, addr) in shop.endpoints() {
        client.enlist(txid, role.id(), &addr, &o.payload()).await.unwrap();
        let mut p = ParticipantServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
        let vote = p
            .prepare(pb::PrepareRequest {
                txid,
                term,
                participant_id: role.id().into(),
                payload: o.payload(),
                incarnation,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(vote.vote, pb::Vote::Yes as i32, "{role}: {}", vote.reason);
    }
    txid
}

/// SIGKILL to the PostgreSQL server and every backend, then a start on the
/// same data directory (crash recovery); the prepared transactions must
/// still be there.
async fn crash_postgres(shop: &mut Shop, expect_prepared: i64) {
    shop.pg.kill9();
    shop.pg.restart().unwrap();
    // The test's own connections died with the server.
    shop.reconnect().await;
    assert_eq!(
        shop.prepared_left().await,
        expect_prepared,
        "prepared transactions after PostgreSQL's crash recovery"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t89_inv4_prepared_transactions_survive_a_postgres_crash_and_are_resolved() {
    let Some(pg) = postgres_or_skip("t89 PostgreSQL crash") else {
        return;
    };
    let mut c = TestCluster::start("t89");
    c.leader().await;
    let mut shop = shop(&c, pg).await;
    let client = c.client();
    let mut told = BTreeMap::new();

    // COMMIT after the crash: the coordinator's Prepare finds each
    // prepared transaction again (an idempotent YES), the decision is
    // COMMIT and COMMIT PREPARED applies it.
    let o = order(1);
    let txid = prepared_everywhere(&mut c, &shop, &o).await;
    crash_postgres(&mut shop, 3).await;
    let mut outcome = client.commit(txid).await;
    for _ in 0..20 {
        match &outcome {
            Ok(TxOutcome::Unknown) | Err(_) => {
                tokio::time::sleep(Duration::from_millis(500)).await;
                outcome = client.commit(txid).await;
            }
            _ => break,
        }
    }
    assert_eq!(outcome.unwrap(), TxOutcome::Committed);
    assert!(settle(&c, &mut shop, &[], txid, &o.id).await, "COMMIT expected");
    told.insert(o.id.clone(), true);

    // ABORT while PostgreSQL is down: delivery fails until it is back,
    // then ROLLBACK PREPARED (by delivery or by the services' recovery).
    let o = order(2);
    let txid = prepared_everywhere(&mut c, &shop, &o).await;
    shop.pg.kill9();
    assert_eq!(
        client
            .abort(txid, "t89: aborted while PostgreSQL is down")
            .await
            .unwrap(),
        TxOutcome::Aborted
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    shop.pg.restart().unwrap();
    shop.reconnect().await;
    assert!(!settle(&c, &mut shop, &[], txid, &o.id).await, "ABORT expected");
    told.insert(o.id.clone(), false);

    shop.audit(&told).await;
}
