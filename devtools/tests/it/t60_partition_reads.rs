//! A node cut off from the majority never answers a decision read
//! (invariant 7: decision reads are linearizable). The partition is made from
//! outside the nodes by TCP proxies that drop their traffic.

use crate::common;

use std::time::Duration;
use std::time::Instant;

use common::TestCluster;
use dtx_client::decision_at;
use dtx_client::DecisionRead;
use dtx_client::TxOutcome;

async fn assert_never_answers(c: &TestCluster, id: u64, txid: u64, for_how_long: Duration) {
    let until = Instant::now() + for_how_long;
    let mut attempts = 0;
    while Instant::now() < until {
        match decision_at(&c.api(id), txid, Duration::from_millis(2500)).await {
            Ok(d) => panic!("isolated node {id} answered a decision read for tx {txid}: {d:?}"),
            Err(s) => {
                assert!(
                    matches!(s.code(), tonic::Code::Unavailable | tonic::Code::DeadlineExceeded),
                    "unexpected refusal {s:?}"
                );
            }
        }
        attempts += 1;
    }
    assert!(attempts > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t60_isolated_leader_and_follower_do_not_answer_reads() {
    let mut c = TestCluster::start_partitionable("t60", |_| {}).await;
    let old_leader = c.leader().await;
    let cl = c.client();
    let t = cl.begin("p1", 600_000, b"").await.unwrap().txid;
    assert_eq!(cl.decision(t).await.unwrap(), DecisionRead::Pending);

    // Cut the leader off. The majority elects a new one and decides t.
    c.isolate(old_leader);
    let majority: Vec<u64> = (1..=3).filter(|i| *i != old_leader).collect();
    let maj_client = dtx_client::Client::new(dtx_client::ClientConfig::new(
        majority.iter().map(|i| c.api(*i)).collect(),
    ))
    .unwrap();
    assert_eq!(maj_client.abort(t, "partition test").await.unwrap(), TxOutcome::Aborted);
    assert_eq!(maj_client.decision(t).await.unwrap(), DecisionRead::Aborted);
    // The old leader still has the old state, but must not answer from it.
    assert_never_answers(&c, old_leader, t, Duration::from_secs(3)).await;

    // Heal: it rejoins and answers the majority's decision.
    c.heal();
    let mut healed = None;
    for _ in 0..100 {
        if let Ok(d) = decision_at(&c.api(old_leader), t, Duration::from_millis(1000)).await {
            healed = Some(d);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(healed, Some(DecisionRead::Aborted));

    // Now cut off a follower: it must not answer either.
    let leader = c.leader().await;
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let t2 = cl.begin("p2", 600_000, b"").await.unwrap().txid;
    c.isolate(follower);
    let others: Vec<String> = (1..=3).filter(|i| *i != follower).map(|i| c.api(i)).collect();
    let cl2 = dtx_client::Client::new(dtx_client::ClientConfig::new(others)).unwrap();
    assert_eq!(cl2.abort(t2, "partition test").await.unwrap(), TxOutcome::Aborted);
    assert_never_answers(&c, follower, t2, Duration::from_secs(3)).await;
    c.heal();
}

/// A leader cut off from the majority refuses writes at once (certainly not
/// applied) instead of letting them wait out their timeout as UNKNOWN, so
/// clients move on to the majority's new leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t60_isolated_leader_refuses_writes_as_not_applied() {
    let mut c = TestCluster::start_partitionable("t60w", |_| {}).await;
    let old_leader = c.leader().await;
    c.isolate(old_leader);
    // Longer than twice the election timeout (500 ms max by default).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut cfg = dtx_client::ClientConfig::new(vec![c.api(old_leader)]);
    cfg.call_deadline = Duration::from_secs(3);
    let only_old = dtx_client::Client::new(cfg).unwrap();
    let res = only_old.begin("w1", 60_000, b"").await;
    match res {
        Err(dtx_client::ClientError::NotApplied(msg)) => {
            assert!(msg.contains("no quorum"), "{msg}")
        }
        other => panic!("expected a not-applied refusal, got {other:?}"),
    }
    // The majority serves writes meanwhile.
    let majority: Vec<String> = (1..=3).filter(|i| *i != old_leader).map(|i| c.api(i)).collect();
    let maj = dtx_client::Client::new(dtx_client::ClientConfig::new(majority)).unwrap();
    maj.begin("w2", 60_000, b"").await.unwrap();
    c.heal();
}
