//! A leader cut off from its followers but not from its participants acts on
//! no participant (invariant 13, quorum before action; ADR 0033). openraft
//! 0.9 has no check-quorum: the cut-off leader stays leader in its old term
//! for as long as the cut lasts, while the majority elects another and
//! decides. The partition is made by the TCP proxies in front of each node's
//! Raft and API ports; participants are reached directly, so the old leader
//! can still reach them.
//!
//! - Its fast path hands out no txid and sends no Prepare (a BeginAndCommit
//!   there would lock the participants, and the client's retry at the real
//!   leader would vote NO against those locks).
//! - A one-phase commit it started, which the new leader then commits and
//!   forgets, and which the participant then garbage-collects, is never
//!   sent again by the old leader: before, its re-drive ran the work a
//!   second time once the participant's record was gone (the participant
//!   refused it as stale only while it kept the record). The participant's
//!   durable highest term (`log::step`'s floor) refuses such a message too.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::participants::Svc;
use common::TestCluster;
use dtx_client::DecisionRead;
use participant_sdk::log::LocalState;

fn quick(c: &mut coordinator::config::Config) {
    c.txn.retention_ms = 300;
    c.txn.reaper_interval_ms = 100;
    c.txn.delivery_retry_max_ms = 300;
    c.txn.prepare_timeout_ms = 1_000;
}

/// A client of the nodes other than `but`.
fn majority_client(c: &TestCluster, but: u64) -> dtx_client::Client {
    let addrs = (1..=3).filter(|i| *i != but).map(|i| c.api(i)).collect();
    dtx_client::Client::new(dtx_client::ClientConfig::new(addrs)).unwrap()
}

/// Prepares and one-phase commits that reached `s`.
fn calls(s: &Svc) -> u32 {
    s.prepares_received.load(Ordering::SeqCst) + s.one_phase_received.load(Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t61_inv13_a_cut_off_leader_hands_out_no_txid_and_prepares_nothing() {
    let mut c = TestCluster::start_partitionable("t61a", quick).await;
    let leader = c.leader().await;
    let a = Svc::new("a").await;
    let b = Svc::new("b").await;
    let at_leader = c.client_at(leader);
    // One transfer first: the leader now holds a reserved txid range, so
    // the next BeginAndCommit needs no Raft write before its Prepares.
    let r = at_leader
        .begin_and_commit("warm", 60_000, b"", &[a.spec(b"w"), b.spec(b"w")])
        .await
        .expect("a transfer through the healthy leader");
    assert_eq!(r.outcome, dtx_client::TxOutcome::Committed);

    c.isolate(leader);
    // Past the serving limit (election_timeout_max_ms, 500 ms by default).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let before = (calls(&a), calls(&b));
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        at_leader.begin_and_commit("cut-off", 60_000, b"", &[a.spec(b"x"), b.spec(b"x")]),
    )
    .await;
    match &answer {
        Ok(Ok(r)) if r.outcome == dtx_client::TxOutcome::Committed => panic!("a cut-off leader committed {r:?}"),
        Ok(Ok(r)) => eprintln!("the cut-off leader answered {r:?}"),
        Ok(Err(e)) => eprintln!("the cut-off leader refused: {e}"),
        Err(_) => eprintln!("the cut-off leader gave no answer within 5 s"),
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        (calls(&a), calls(&b)),
        before,
        "invariant 13: a leader that has not heard from a quorum sent Prepares to participants"
    );
    // The participants hold no locks of it: the majority's leader commits
    // a transaction on the same participants.
    let maj = majority_client(&c, leader);
    let r = maj
        .begin_and_commit_retrying(
            "after",
            60_000,
            b"",
            &[a.spec(b"y"), b.spec(b"y")],
            20,
            Duration::from_millis(200),
        )
        .await
        .expect("a transfer through the new leader");
    assert_eq!(r.outcome, dtx_client::TxOutcome::Committed);
    c.heal();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t61_inv8_inv13_a_one_phase_commit_is_applied_once_when_its_old_leader_is_cut_off() {
    let mut c = TestCluster::start_partitionable("t61b", quick).await;
    let old = c.leader().await;
    let p = Svc::new("p").await;
    let at_old = c.client_at(old);

    // The old leader records the one-phase commit and sends it; the
    // participant commits, but its answer is lost: the transaction stays
    // PREPARING at the old leader, which keeps re-sending it.
    p.lose_one_phase_answers.store(true, Ordering::SeqCst);
    let x = at_old.begin("x", 60_000, b"").await.unwrap().txid;
    at_old.enlist(x, &p.id, &p.addr, b"work").await.unwrap();
    let told = at_old.commit(x).await;
    assert!(
        matches!(told, Ok(dtx_client::TxOutcome::Unknown) | Err(_)),
        "the answer was lost, so the outcome is unknown: {told:?}"
    );
    assert!(p.wait_state(x, LocalState::Committed, Duration::from_secs(10)).await);

    // Cut off from its followers, not from the participant: it keeps
    // re-sending x (every answer is lost). The majority's leader re-drives
    // x in a later term; once the participant recorded that term for x,
    // answers get through again: the old leader's re-sends are refused as
    // stale (older term), the new leader's is answered, and the new leader
    // records COMMIT and the ack, and forgets x after the (short)
    // retention.
    c.isolate(old);
    let first_term = p.store.entries_for_txid(x).unwrap()[0].1.term;
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while p.store.entries_for_txid(x).unwrap()[0].1.term <= first_term {
        assert!(
            tokio::time::Instant::now() < until,
            "the majority's leader never re-drove x to the participant"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    p.lose_one_phase_answers.store(false, Ordering::SeqCst);
    let maj = majority_client(&c, old);
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        match maj.decision(x).await {
            Ok(DecisionRead::UnknownPresumedAbort) => break,
            Ok(_) | Err(_) if tokio::time::Instant::now() < until => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            other => panic!("x was not committed and forgotten by the new leader: {other:?}"),
        }
    }
    assert_eq!(p.state(x), Some(LocalState::Committed));
    // The participant's garbage collection asks the majority: forgotten,
    // so the record goes.
    let endpoints: Vec<String> = (1..=3).filter(|i| *i != old).map(|i| c.api(i)).collect();
    let removed = participant_sdk::server::collect_decided(&*p.store, &endpoints, &p.id, u64::MAX, 100, None)
        .await
        .unwrap();
    assert!(removed >= 1, "x's record was not collected");
    assert_eq!(p.state(x), None);

    // The old leader, still cut off, must not run x's work again (before,
    // its next re-send, a few hundred ms later, found no record and ran
    // it).
    let before = calls(&p);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        p.state(x),
        None,
        "invariant 8: the cut-off old leader's re-sent one-phase commit ran x's work a second time"
    );
    assert_eq!(
        calls(&p),
        before,
        "invariant 13: the cut-off old leader still sent CommitOnePhase"
    );
    c.heal();
    // Healed, the old leader learns the new term and steps down; x stays
    // forgotten and applied once.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(p.state(x), None);
}
