//! The participant's durable log against a real three-node cluster: what its
//! garbage collection may remove, with the recovery pass and the collection
//! driven by hand (deterministic: no retention timer runs). Invariants 4 and
//! 8 (a redelivered COMMIT must find the record that makes it a repeat) and
//! 10 (forget only what is safe: here, a participant forgets its record only
//! once the cluster no longer awaits its ack).

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::participants::Svc;
use common::TestCluster;
use dtx_client::DecisionRead;
use dtx_client::ParticipantSpec;
use dtx_client::TxOutcome;
use participant_sdk::log::LocalState;
use participant_sdk::log::Vote;

/// Waits (up to 20 s) until the cluster has recorded `participant`'s ack
/// of `t`, or has forgotten `t` (which needs every ack).
async fn wait_acked(cl: &dtx_client::Client, t: u64, participant: &str) -> bool {
    for _ in 0..200 {
        match cl.status(t).await {
            Ok(st) if st.participants.iter().any(|p| p.id == participant && p.acked) => return true,
            Ok(_) => {}
            Err(_) if cl.decision(t).await.ok() == Some(DecisionRead::UnknownPresumedAbort) => return true,
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

fn spec(svc: &Svc, payload: &[u8]) -> ParticipantSpec {
    ParticipantSpec {
        participant_id: svc.id.clone(),
        address: svc.addr.clone(),
        payload: payload.to_vec(),
    }
}

/// Invariants 4, 8 and 10 at the participant: recovery applies a COMMIT that
/// the leader could not deliver yet; the record must then outlive log
/// retention until the cluster has this participant's ack, because the leader
/// keeps delivering the COMMIT and only the record makes that delivery a
/// repeat (acked) instead of a "commit without prepare" (refused, never
/// acked, never forgotten).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t81_inv10_log_gc_keeps_a_recovered_commit_until_the_cluster_has_this_participants_ack() {
    let mut c = TestCluster::start_with("t81a", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
        // One participant: keep two phases, so it can be left in doubt.
        cfg.txn.one_phase_commit = false;
    });
    c.leader().await;
    let cl = c.client();
    let endpoints = c.procs.api_addrs();
    let a = Svc::new("bank-a").await;
    let t = cl.begin("t81-held", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    a.hold_decisions.store(true, Ordering::SeqCst);
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert_eq!(a.state(t), Some(LocalState::Prepared { vote: Vote::Yes }));

    // Recovery learns COMMIT from the cluster while deliveries are held.
    let n = participant_sdk::server::recover_once(&a.store, &endpoints)
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert_eq!(a.state(t), Some(LocalState::Committed));

    // Retention 0: the record is a candidate, and the cluster has decided,
    // but it still awaits bank-a's ack, so the record stays.
    let n = participant_sdk::server::collect_decided(&a.store, &endpoints, &a.id, u64::MAX, 100, None)
        .await
        .unwrap();
    assert_eq!(n, 0, "collected a record whose ack the leader still awaits");
    assert_eq!(a.state(t), Some(LocalState::Committed));

    // Deliveries get through: the leader's COMMIT finds the record, is
    // acked, and the cluster records the ack.
    a.hold_decisions.store(false, Ordering::SeqCst);
    assert!(
        wait_acked(&cl, t, &a.id).await,
        "the leader's COMMIT was never acked: {:?}",
        cl.status(t).await
    );
    // Now nothing more will be sent for it: collected.
    let n = participant_sdk::server::collect_decided(&a.store, &endpoints, &a.id, u64::MAX, 100, None)
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert_eq!(a.state(t), None);
    assert_eq!(
        a.store
            .view()
            .get(format!("applied/{t}").as_bytes())
            .unwrap()
            .as_deref(),
        Some(&b"1"[..]),
        "the work stays applied"
    );
}

/// Invariant 10 at the participant: a READ_ONLY vote's record is
/// garbage-collected like a decided one, so read-only traffic does not grow
/// the log without bound; and, by the same rule, not while the transaction is
/// still undecided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t81_inv10_read_only_records_are_collected_once_the_cluster_decided() {
    let mut c = TestCluster::start_with("t81b", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 5_000;
    });
    c.leader().await;
    let cl = c.client();
    let endpoints = c.procs.api_addrs();
    let reader = Svc::new("reader").await;
    let writer = Svc::new("writer").await;

    // While the writer is slow to vote, the transaction is undecided: the
    // reader's READ_ONLY record stays.
    writer.prepare_delay_ms.store(3_000, Ordering::SeqCst);
    let t = cl.begin("t81-ro", 30_000, b"").await.unwrap().txid;
    cl.enlist(t, &reader.id, &reader.addr, b"ro").await.unwrap();
    cl.enlist(t, &writer.id, &writer.addr, b"w").await.unwrap();
    let commit = {
        let cl = c.client();
        tokio::spawn(async move { cl.commit(t).await })
    };
    assert!(
        reader
            .wait_state(
                t,
                LocalState::Prepared { vote: Vote::ReadOnly },
                Duration::from_secs(10)
            )
            .await
    );
    assert_eq!(cl.decision(t).await.unwrap(), DecisionRead::Pending);
    let n = participant_sdk::server::collect_decided(&reader.store, &endpoints, &reader.id, u64::MAX, 100, None)
        .await
        .unwrap();
    assert_eq!(n, 0, "collected a READ_ONLY record of an undecided transaction");
    assert_eq!(reader.state(t), Some(LocalState::Prepared { vote: Vote::ReadOnly }));

    // Decided (the reader's ack is recorded with the decision): collected.
    assert_eq!(commit.await.unwrap().unwrap(), TxOutcome::Committed);
    assert!(wait_acked(&cl, t, &reader.id).await);
    let n = participant_sdk::server::collect_decided(&reader.store, &endpoints, &reader.id, u64::MAX, 100, None)
        .await
        .unwrap();
    assert_eq!(n, 1, "the READ_ONLY record was not collected");
    assert_eq!(reader.state(t), None);

    // Many read-only transactions leave no record behind.
    writer.prepare_delay_ms.store(0, Ordering::SeqCst);
    for i in 0..20 {
        let r = cl
            .begin_and_commit(
                &format!("t81-ro-{i}"),
                30_000,
                b"",
                &[spec(&reader, b"ro"), spec(&writer, b"w")],
            )
            .await
            .unwrap();
        assert_eq!(r.outcome, TxOutcome::Committed);
        assert!(wait_acked(&cl, r.txid.unwrap(), &reader.id).await);
    }
    let n = participant_sdk::server::collect_decided(&reader.store, &endpoints, &reader.id, u64::MAX, 100, None)
        .await
        .unwrap();
    assert_eq!(n, 20);
    assert!(
        reader.store.entries().unwrap().is_empty(),
        "{:?}",
        reader.store.entries()
    );
}

/// Bad input gets a clear error: `GetDecisions` with a participant id over
/// the id limit is INVALID_ARGUMENT naming the field, at every node (a
/// follower forwards it); without an id it answers decisions only, with
/// `awaiting_ack` false; with one, `awaiting_ack` says whether the leader
/// still owes that participant the decision (invariant 10).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t81_get_decisions_with_participant_id_validates_it_and_reports_awaiting_ack() {
    use dtx_proto::v1 as pb;
    let mut c = TestCluster::start_with("t81c", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
        cfg.txn.one_phase_commit = false;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let t = cl.begin("t81-api", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    a.hold_decisions.store(true, Ordering::SeqCst);
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);

    let ask = |addr: String, participant_id: String| async move {
        let ch = dtx_proto::endpoint(&addr).unwrap().connect().await.unwrap();
        let mut req = tonic::Request::new(pb::GetDecisionsRequest {
            txids: vec![t],
            participant_id,
            incarnation: 0,
        });
        req.set_timeout(Duration::from_secs(5));
        pb::coordinator_client::CoordinatorClient::new(ch)
            .get_decisions(req)
            .await
            .map(|r| r.into_inner().decisions)
    };
    for id in 1..=3 {
        let err = ask(c.api(id), "x".repeat(dtx_proto::limits::ID_BYTES_MAX + 1))
            .await
            .expect_err("an overlong participant id was accepted");
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "node {id}: {err:?}");
        assert!(err.message().contains("participant_id"), "node {id}: {}", err.message());
    }
    let leader = c.leader().await;
    let d = ask(c.api(leader), String::new()).await.unwrap();
    assert_eq!((d[0].outcome, d[0].awaiting_ack), (pb::Outcome::Commit as i32, false));
    let d = ask(c.api(leader), "bank-a".into()).await.unwrap();
    assert_eq!((d[0].outcome, d[0].awaiting_ack), (pb::Outcome::Commit as i32, true));
    let d = ask(c.api(leader), "someone-else".into()).await.unwrap();
    assert!(!d[0].awaiting_ack, "not enlisted: nothing is owed to it");
    a.hold_decisions.store(false, Ordering::SeqCst);
    assert!(wait_acked(&cl, t, &a.id).await);
    let d = ask(c.api(leader), "bank-a".into()).await.unwrap();
    assert!(!d[0].awaiting_ack, "acked");
}
