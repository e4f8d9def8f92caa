//! Invariant 11 (ADR 0009): a transaction stuck for good never delays the
//! delivery or re-drive of any other. The leader's loop used to take the
//! lowest `txn.reaper_batch_max` txids every round; with that many stuck at
//! the bottom (a participant gone for good, a one-phase participant that
//! never answers), nothing above them was ever delivered or re-driven by a
//! new leader. Both tests run with `reaper_batch_max = 1`, so one stuck
//! transaction is enough to starve everything else.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::participants::Svc;
use common::TestCluster;
use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::DecisionRead;
use dtx_client::ParticipantSpec;
use dtx_client::TxOutcome;
use participant_sdk::log::LocalState;
use participant_sdk::log::Vote;

/// An address on which nothing listens (a participant gone for good).
fn gone_address() -> String {
    format!("127.0.0.1:{}", dtx_testkit::cluster::free_port("127.0.0.1").unwrap())
}

/// Decided transactions whose participant is gone for good sit at the
/// lowest txids (300 of them); the leader dies after a second transaction's
/// COMMIT, before one of its participants got it. The new leader still
/// delivers the second one (invariants 4, 6, 11), and a stuck one shows why
/// in Status. (Taking `reaper_batch_max` = 1 per 100 ms round from a cursor
/// would reach the second only after 30 s: the first round of a new leader
/// must not cost a turn per stuck transaction either.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t82_inv11_stuck_delivery_does_not_starve_a_new_leaders_delivery() {
    let mut c = TestCluster::start_with("t82a", 3, |cfg| {
        cfg.txn.reaper_batch_max = 1;
        cfg.txn.reaper_interval_ms = 100;
        cfg.txn.prepare_timeout_ms = 1_000;
        cfg.txn.one_phase_commit = false;
    });
    let leader = c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;

    // Stuck for good: ABORT decided (the ghost never voted), and the ghost
    // never acks it.
    let stuck = cl.begin("stuck", 60_000, b"").await.unwrap().txid;
    let ghost_addr = gone_address();
    cl.enlist(stuck, &a.id, &a.addr, b"x").await.unwrap();
    cl.enlist(stuck, "ghost", &ghost_addr, b"").await.unwrap();
    assert_eq!(cl.commit(stuck).await.unwrap(), TxOutcome::Aborted);
    // 299 more like it, 20 at a time.
    let specs = vec![
        dtx_client::ParticipantSpec {
            participant_id: a.id.clone(),
            address: a.addr.clone(),
            payload: b"x".to_vec(),
        },
        dtx_client::ParticipantSpec {
            participant_id: "ghost".into(),
            address: ghost_addr.clone(),
            payload: Vec::new(),
        },
    ];
    for chunk in (0..299).collect::<Vec<u32>>().chunks(20) {
        let calls = chunk.iter().map(|i| {
            let (cl, specs) = (&cl, &specs);
            async move { cl.begin_and_commit(&format!("stuck-{i}"), 60_000, b"", specs).await }
        });
        for r in futures::future::join_all(calls).await {
            assert_eq!(r.unwrap().outcome, TxOutcome::Aborted);
        }
    }

    // The second transaction commits; bank-b refuses phase two for now.
    b.hold_decisions.store(true, Ordering::SeqCst);
    let t = cl.begin("second", 60_000, b"").await.unwrap().txid;
    assert!(t > stuck);
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"y").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert!(a.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);
    assert_eq!(b.state(t), Some(LocalState::Prepared { vote: Vote::Yes }));

    // The leader dies; bank-b answers again. Only the new leader's loop can
    // deliver to it now.
    c.procs.kill9(leader);
    b.hold_decisions.store(false, Ordering::SeqCst);
    let ok = b.wait_state(t, LocalState::Committed, Duration::from_secs(20)).await;
    if !ok {
        c.dump_logs();
    }
    assert!(ok, "the new leader never delivered COMMIT of {t}: {:?}", b.state(t));

    // The stuck one is visible with its reason: the new leader keeps trying
    // the ghost and says what went wrong.
    let mut shown = None;
    for _ in 0..100 {
        let st = cl.status(stuck).await.unwrap();
        let ghost = st.participants.iter().find(|p| p.id == "ghost").cloned().unwrap();
        assert!(!ghost.acked);
        if ghost.delivery_attempts > 0 && !ghost.last_delivery_error.is_empty() {
            shown = Some(ghost);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let ghost = shown.expect("Status shows the stuck delivery's attempts and last error");
    eprintln!(
        "stuck delivery shown: {} attempts, last error {:?}",
        ghost.delivery_attempts, ghost.last_delivery_error
    );
}

/// A one-phase commit whose participant never answers stays PREPARING for
/// good (only its participant may decide it, invariant 7) at the lowest
/// txid. A second one-phase commit whose answer was lost must still be
/// re-driven and recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t82_inv11_stuck_one_phase_commit_does_not_starve_other_redrives() {
    let mut c = TestCluster::start_with("t82b", 3, |cfg| {
        cfg.txn.reaper_batch_max = 1;
        cfg.txn.reaper_interval_ms = 100;
        cfg.txn.prepare_timeout_ms = 500;
    });
    c.leader().await;
    let mut cfg = ClientConfig::new(c.procs.api_addrs());
    cfg.call_deadline = Duration::from_secs(2);
    let cl = Client::new(cfg).unwrap();
    let spec = |id: &str, addr: &str| {
        vec![ParticipantSpec {
            participant_id: id.to_string(),
            address: addr.to_string(),
            payload: b"w".to_vec(),
        }]
    };

    let ghost = cl
        .begin_and_commit("ghost-1pc", 60_000, b"", &spec("ghost", &gone_address()))
        .await
        .unwrap();
    assert_eq!(ghost.outcome, TxOutcome::Unknown, "no answer is not a NO");

    let a = Svc::new("bank-a").await;
    a.lose_one_phase_answers.store(true, Ordering::SeqCst);
    let lost = cl
        .begin_and_commit("lost-1pc", 60_000, b"", &spec(&a.id, &a.addr))
        .await
        .unwrap();
    assert_eq!(lost.outcome, TxOutcome::Unknown, "the answer was lost");
    // Ids on a fresh cluster: the ghost's is 1, bank-a's 2.
    let t = 2;
    assert!(cl.status(t).await.unwrap().participants.iter().any(|p| p.id == a.id));
    assert!(a.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);

    // Answers get through again: the leader's re-drive records COMMIT even
    // though the ghost's commit is still stuck below it.
    a.lose_one_phase_answers.store(false, Ordering::SeqCst);
    let mut read = DecisionRead::Pending;
    for _ in 0..100 {
        read = c.client().decision(t).await.unwrap();
        if read != DecisionRead::Pending {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        read,
        DecisionRead::Committed,
        "the lost one-phase answer was never asked again"
    );
    assert_eq!(
        c.client().decision(1).await.unwrap(),
        DecisionRead::Pending,
        "the ghost's stays undecided"
    );
}
