//! Two-phase commit end to end: coordinator node processes and participant
//! services (the SDK's gRPC server on its durable store, in this test's
//! process, on real sockets). Invariants 2 and 3 (every participant applies
//! the one decision), 4 (a COMMIT reaches every participant even when the
//! leader dies before delivering it), and 10 (records are forgotten once
//! every participant acked).

use crate::common;

use std::time::Duration;

use common::participants::Svc;
use common::TestCluster;
use dtx_client::DecisionRead;
use dtx_client::ParticipantSpec;
use dtx_client::TxOutcome;
use dtx_proto::metadata::RefusalKind;
use participant_sdk::log::LocalState;
use participant_sdk::log::Vote;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_commit_abort_and_unreachable_participant() {
    let mut c = TestCluster::start_with("t80a", 3, |cfg| {
        cfg.txn.retention_ms = 500;
        cfg.txn.prepare_timeout_ms = 1_000;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;

    // Both YES: COMMIT, applied at both, acked, then forgotten.
    let t = cl.begin("tx-commit", 30_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"debit 5").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"credit 5").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert!(a.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);
    assert!(b.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);
    assert_eq!(
        a.store
            .view()
            .get(format!("applied/{t}").as_bytes())
            .unwrap()
            .as_deref(),
        Some(&b"1"[..])
    );
    let mut forgotten = false;
    for _ in 0..100 {
        if cl.decision(t).await.unwrap() == DecisionRead::UnknownPresumedAbort {
            forgotten = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(forgotten, "a fully acked transaction was not forgotten after retention");

    // One NO: ABORT; the YES participant's prepared work is rolled back.
    let t = cl.begin("tx-no", 30_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"debit 5").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"no").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Aborted);
    assert!(
        a.wait_state(t, LocalState::Aborted { tombstone: false }, Duration::from_secs(10))
            .await
    );
    assert_eq!(a.store.view().get(format!("staged/{t}").as_bytes()).unwrap(), None);
    let st = cl.status(t).await.unwrap();
    // The note names every participant's part, the YES voter's too, not only
    // the refusal.
    let note = st.decision.unwrap().note;
    assert!(note.contains("bank-b voted NO"), "{note}");
    assert!(note.contains("YES from bank-a"), "{note}");

    // A participant that cannot be reached at prepare: ABORT.
    let t = cl.begin("tx-unreachable", 30_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"debit 5").await.unwrap();
    cl.enlist(t, "ghost", "127.0.0.1:1", b"").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Aborted);
    let note = cl.status(t).await.unwrap().decision.unwrap().note;
    assert!(note.starts_with("ghost: "), "{note}");
    assert!(note.contains("YES from bank-a"), "{note}");
    assert!(
        a.wait_state(t, LocalState::Aborted { tombstone: false }, Duration::from_secs(10))
            .await
    );

    // Client Abort before any Prepare: participants get a tombstone, so a
    // late Prepare would vote NO (invariant 8).
    let t = cl.begin("tx-client-abort", 30_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    assert_eq!(cl.abort(t, "changed my mind").await.unwrap(), TxOutcome::Aborted);
    assert!(
        a.wait_state(t, LocalState::Aborted { tombstone: true }, Duration::from_secs(10))
            .await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_new_leader_delivers_a_commit_the_old_leader_could_not() {
    let mut c = TestCluster::start_with("t80b", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
    });
    let leader = c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;

    let t = cl.begin("tx-failover", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"debit").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"credit").await.unwrap();
    // b votes YES but refuses phase two for now: it stays in doubt.
    b.hold_decisions.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert!(a.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        b.state(t),
        Some(LocalState::Prepared { vote: Vote::Yes }),
        "b must be in doubt"
    );
    assert_eq!(b.store.in_doubt().unwrap().len(), 1);

    // The leader dies with the decision applied but not delivered to b.
    c.procs.kill9(leader);
    b.hold_decisions.store(false, std::sync::atomic::Ordering::SeqCst);
    // A new leader's scan finds the decided, unacked transaction and
    // delivers it (invariant 4), in about an election plus a retry
    // (invariant 6).
    let started = std::time::Instant::now();
    assert!(
        b.wait_state(t, LocalState::Committed, Duration::from_secs(20)).await,
        "b never learned the COMMIT: {:?}",
        b.state(t)
    );
    eprintln!("b resolved {:?} after the leader was killed", started.elapsed());
    assert_eq!(
        b.store
            .view()
            .get(format!("applied/{t}").as_bytes())
            .unwrap()
            .as_deref(),
        Some(&b"1"[..])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_participant_recovery_asks_the_cluster() {
    let mut c = TestCluster::start_with("t80c", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
        // One participant: keep two phases, so it can be left in doubt.
        cfg.txn.one_phase_commit = false;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let t = cl.begin("tx-recover", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    a.hold_decisions.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert_eq!(a.state(t), Some(LocalState::Prepared { vote: Vote::Yes }));
    // Recovery (what the SDK runs on start and periodically) learns the
    // decision from the cluster itself, even with deliveries still refused.
    let n = participant_sdk::server::recover_once(&a.store, &c.procs.api_addrs())
        .await
        .unwrap();
    assert_eq!(n, 1);
    assert_eq!(a.state(t), Some(LocalState::Committed));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_participant_restarted_without_quorum_waits_then_resolves() {
    let mut c = TestCluster::start_with("t80d", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
        // One participant: keep two phases, so it can be left in doubt.
        cfg.txn.one_phase_commit = false;
    });
    let leader = c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let t = cl.begin("tx-noquorum", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"locked work").await.unwrap();
    a.hold_decisions.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);

    // The cluster loses its quorum: two of three nodes die.
    let others: Vec<u64> = (1..=3).filter(|i| *i != leader).collect();
    c.procs.kill9(leader);
    c.procs.kill9(others[0]);
    // The participant "restarts": its recovery loop runs against the cluster.
    let recovery = participant_sdk::server::spawn_recovery(
        a.store.clone(),
        c.procs.api_addrs(),
        &a.id,
        Duration::from_millis(500),
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Invariant 5: still in doubt, work (and its locks) still held.
    assert_eq!(a.state(t), Some(LocalState::Prepared { vote: Vote::Yes }));
    assert!(a.store.view().get(format!("staged/{t}").as_bytes()).unwrap().is_some());

    // Quorum returns.
    c.procs.start(leader).unwrap();
    c.procs.start(others[0]).unwrap();
    c.leader().await;
    let back = std::time::Instant::now();
    assert!(
        a.wait_state(t, LocalState::Committed, Duration::from_secs(20)).await,
        "recovery never resolved the in-doubt transaction"
    );
    eprintln!("resolved {:?} after a leader was back", back.elapsed());
    recovery.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_client_retry_with_same_key_is_one_transaction_and_old_terms_are_fenced() {
    let mut c = TestCluster::start_with("t80e", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    // The client "times out" after Begin and Enlist and runs the whole
    // transaction again with the same key: one transaction, one decision.
    let t = cl.begin("order-1", 60_000, b"req").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"w").await.unwrap();
    let again = cl.begin("order-1", 60_000, b"req").await.unwrap();
    assert_eq!((again.txid, again.existing), (t, true));
    cl.enlist(t, &a.id, &a.addr, b"w").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert!(a.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);

    // A late Prepare and an Abort from an older term reach the participant:
    // both are refused (invariant 9) and the commit stands (invariant 8).
    // The record under the incarnation the cluster handed `t` out in.
    let (g, e) = a.store.entries_for_txid(t).unwrap()[0];
    let (term, incarnation) = (e.term, g.incarnation);
    let ch = coordinator::raft::network::channel(&a.addr, None, Duration::from_secs(1)).unwrap();
    let mut p = dtx_proto::v1::participant_service_client::ParticipantServiceClient::new(ch);
    if term > 0 {
        let late = p
            .abort(dtx_proto::v1::ParticipantDecisionRequest {
                txid: t,
                term: term - 1,
                participant_id: a.id.clone(),
                incarnation,
            })
            .await;
        let late = late.unwrap_err();
        assert_eq!(late.code(), tonic::Code::FailedPrecondition);
        // The kind travels as a type (x-dtx-refusal), not only as text.
        assert_eq!(
            dtx_proto::metadata::refusal(&late),
            Some(RefusalKind::StaleTerm),
            "{late:?}"
        );
    }
    let dup = p
        .abort(dtx_proto::v1::ParticipantDecisionRequest {
            txid: t,
            term,
            participant_id: a.id.clone(),
            incarnation,
        })
        .await;
    let dup = dup.unwrap_err();
    assert_eq!(
        dup.code(),
        tonic::Code::FailedPrecondition,
        "abort after commit must be refused"
    );
    assert_eq!(
        dtx_proto::metadata::refusal(&dup),
        Some(RefusalKind::AbortAfterCommit),
        "{dup:?}"
    );
    assert_eq!(a.state(t), Some(LocalState::Committed));
    // A Commit for a transaction this participant never prepared is a
    // protocol violation, refused.
    let never = p
        .commit(dtx_proto::v1::ParticipantDecisionRequest {
            txid: 999_999,
            term,
            participant_id: a.id.clone(),
            incarnation,
        })
        .await;
    let never = never.unwrap_err();
    assert_eq!(never.code(), tonic::Code::FailedPrecondition);
    assert_eq!(
        dtx_proto::metadata::refusal(&never),
        Some(RefusalKind::CommitWithoutPrepare),
        "{never:?}"
    );
    assert_eq!(a.state(999_999), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_service_enlists_itself_from_the_txid_in_metadata() {
    let mut c = TestCluster::start_with("t80f", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let t = cl.begin("carried", 60_000, b"").await.unwrap().txid;
    // The client calls a service with the txid in metadata...
    let mut call = tonic::Request::new(());
    dtx_proto::attach_txid(&mut call, t);
    // ...and the service, seeing it, enlists itself before doing its work.
    let seen = dtx_proto::txid_of(&call).expect("txid carried in metadata");
    assert_eq!(seen, t);
    let n = dtx_client::enlist::enlist_self(&c.procs.api_addrs(), seen, &a.id, &a.addr, b"work")
        .await
        .unwrap();
    assert_eq!(n, 1);
    // The client commits without ever having named the participant.
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert!(a.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);
}

/// The txid of the transaction `participant` is enlisted in, on a fresh
/// cluster (ids 1 to 10), for a caller that got UNKNOWN without a txid.
async fn txid_enlisting(cl: &dtx_client::Client, participant: &str) -> u64 {
    for id in 1..=10 {
        if let Ok(s) = cl.status(id).await {
            if s.participants.iter().any(|p| p.id == participant) {
                return id;
            }
        }
    }
    panic!("no transaction enlisting {participant} was recorded");
}

/// Reads the decision of `t` until it is no longer PENDING (up to 10 s).
async fn settled_decision(cl: &dtx_client::Client, t: u64) -> DecisionRead {
    let mut decided = DecisionRead::Pending;
    for _ in 0..100 {
        decided = cl.decision(t).await.unwrap();
        if decided != DecisionRead::Pending {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    decided
}

fn one(svc: &Svc, payload: &[u8]) -> Vec<ParticipantSpec> {
    vec![ParticipantSpec {
        participant_id: svc.id.clone(),
        address: svc.addr.clone(),
        payload: payload.to_vec(),
    }]
}

/// A transfer's two participants: `a` with payload `x`, `b` with `y`.
fn both(a: &Svc, b: &Svc) -> Vec<ParticipantSpec> {
    let mut v = one(a, b"x");
    v.extend(one(b, b"y"));
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_one_phase_commit_and_begin_and_commit() {
    let mut c = TestCluster::start_with("t80g", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
        cfg.txn.reaper_interval_ms = 100;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;

    // One participant: committed in one phase; its answer is also its ack.
    let r = cl.begin_and_commit("one-1", 30_000, b"", &one(&a, b"w")).await.unwrap();
    assert_eq!(r.outcome, TxOutcome::Committed);
    let t = r.txid.unwrap();
    assert_eq!(a.state(t), Some(LocalState::Committed), "applied before the answer");
    let st = cl.status(t).await.unwrap();
    assert!(st.participants.iter().all(|p| p.acked), "{st:?}");
    // The same key again: the same transaction and outcome, nothing re-applied.
    let again = cl.begin_and_commit("one-1", 30_000, b"", &one(&a, b"w")).await.unwrap();
    assert_eq!((again.txid, again.outcome), (Some(t), TxOutcome::Committed));
    // The same key with another request is refused, not merged.
    let err = cl.begin_and_commit("one-1", 30_000, b"", &one(&a, b"other")).await;
    assert!(err.is_err(), "{err:?}");

    // The resource refuses: ABORT, nothing left staged.
    let r = cl
        .begin_and_commit("one-no", 30_000, b"", &one(&a, b"no"))
        .await
        .unwrap();
    assert_eq!(r.outcome, TxOutcome::Aborted);
    let t = r.txid.unwrap();
    assert_eq!(a.state(t), Some(LocalState::Aborted { tombstone: false }));

    // Two participants through BeginAndCommit: ordinary two-phase commit.
    let mut both = one(&a, b"x");
    both.extend(one(&b, b"y"));
    let r = cl.begin_and_commit("two-1", 30_000, b"", &both).await.unwrap();
    assert_eq!(r.outcome, TxOutcome::Committed);
    let t = r.txid.unwrap();
    assert!(a.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);
    assert!(b.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);

    // Bad input: no participants is refused with a message that says so.
    let err = cl.begin_and_commit("none", 30_000, b"", &[]).await.unwrap_err();
    assert!(err.to_string().contains("participant"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_inv7_unanswered_one_phase_commit_is_not_reaped_but_re_driven() {
    let mut c = TestCluster::start_with("t80h", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 500;
        cfg.txn.reaper_interval_ms = 100;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    // The participant does not answer: the outcome is UNKNOWN, not ABORTED
    // (it alone decides, and it may have committed).
    a.hold_decisions.store(true, std::sync::atomic::Ordering::SeqCst);
    let r = cl
        .begin_and_commit("one-held", 1_000, b"", &one(&a, b"w"))
        .await
        .unwrap();
    assert_eq!(r.outcome, TxOutcome::Unknown);
    // The txid was not returned with UNKNOWN: find it (a fresh cluster).
    let t = txid_enlisting(&cl, &a.id).await;
    // Well past its 1 s deadline: still undecided (no reaper ABORT).
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(cl.decision(t).await.unwrap(), DecisionRead::Pending);
    // The participant answers again: the leader's re-drive commits it.
    a.hold_decisions.store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(settled_decision(&cl, t).await, DecisionRead::Committed);
    assert_eq!(a.state(t), Some(LocalState::Committed));
}

/// A client that gives up (its call cancelled) while the leader waits for a
/// slow one-phase participant does not leave the transaction stuck: the
/// drive finishes on its own and the decision is recorded (found by the
/// jepsen harness: the "being driven" mark outlived a cancelled call, so
/// the transaction was never re-driven).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_cancelled_client_call_does_not_strand_a_one_phase_commit() {
    let mut c = TestCluster::start_with("t80i", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 5_000;
        cfg.txn.reaper_interval_ms = 100;
    });
    c.leader().await;
    let a = Svc::new("bank-a").await;
    a.one_phase_delay_ms.store(1_500, std::sync::atomic::Ordering::SeqCst);
    let mut cfg = dtx_client::ClientConfig::new(c.procs.api_addrs());
    cfg.attempt_timeout = Duration::from_millis(300);
    cfg.call_deadline = Duration::from_millis(300);
    let impatient = dtx_client::Client::new(cfg).unwrap();
    let r = impatient
        .begin_and_commit("slow", 60_000, b"", &one(&a, b"w"))
        .await
        .unwrap();
    assert_eq!(r.outcome, TxOutcome::Unknown, "the client gave up first");
    let cl = c.client();
    let t = txid_enlisting(&cl, &a.id).await;
    assert_eq!(settled_decision(&cl, t).await, DecisionRead::Committed);
    assert_eq!(a.state(t), Some(LocalState::Committed));
}

/// Acks in groups (ADR 0007): the phase-two acks of several transactions wait
/// up to `txn.ack_batch_wait_ms` and go through Raft in one entry, instead of
/// costing a Raft entry each (which at low load also made the next client
/// write wait for them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_acks_of_several_transactions_share_a_raft_entry() {
    let mut c = TestCluster::start_with("t80k", 3, |cfg| {
        cfg.txn.ack_batch_wait_ms = 3_000;
    });
    let leader = c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;
    // Settle: the leader's first entry (and any membership entry) is in,
    // and the first one-write commit of the term has reserved its txids.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut both = one(&a, b"x");
    both.extend(one(&b, b"y"));
    cl.begin_and_commit("acks-warm-up", 30_000, b"", &both).await.unwrap();
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    let before = c.status_of(leader).await.last_log_index;
    let started = std::time::Instant::now();
    let mut txids = Vec::new();
    for i in 0..5 {
        let mut both = one(&a, b"x");
        both.extend(one(&b, b"y"));
        let r = cl
            .begin_and_commit(&format!("acks-{i}"), 30_000, b"", &both)
            .await
            .unwrap();
        assert_eq!(r.outcome, TxOutcome::Committed);
        txids.push(r.txid.unwrap());
    }
    let commits_took = started.elapsed();
    let mut all_acked = false;
    for _ in 0..200 {
        let mut acked = true;
        for t in &txids {
            let st = cl.status(*t).await.unwrap();
            acked &= st.participants.iter().all(|p| p.acked);
        }
        if acked {
            all_acked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(all_acked, "the acks were not all recorded within 10 s");
    let entries = c.status_of(leader).await.last_log_index - before;
    // One entry per transaction (BeginAndDecide, ADR 0012); the ten acks
    // take one more, or two if the commits outlasted one batching window.
    let ack_entries = entries.saturating_sub(txids.len() as u64);
    let windows = 1 + commits_took.as_millis() as u64 / 3_000;
    assert!(
        (1..=windows + 1).contains(&ack_entries),
        "{entries} Raft entries for 5 transactions and their 10 acks: {ack_entries} for acks (commits took {commits_took:?})"
    );
}

/// Invariant 2 with a READ_ONLY vote, end to end: it counts as agreement
/// (COMMIT with the other participant's YES), it needs no phase two, and it
/// is acked by the leader from the vote itself: the read-only participant
/// refuses every delivery here, so its ack cannot have come from one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_inv2_read_only_vote_commits_without_phase_two() {
    let mut c = TestCluster::start_with("t80r", 3, |cfg| {
        cfg.txn.ack_batch_wait_ms = 20;
    });
    c.leader().await;
    let cl = c.client();
    let reader = Svc::new("reader").await;
    let writer = Svc::new("writer").await;
    reader.hold_decisions.store(true, std::sync::atomic::Ordering::SeqCst);

    let mut both = one(&reader, b"ro");
    both.extend(one(&writer, b"w"));
    let r = cl.begin_and_commit("ro-1", 30_000, b"", &both).await.unwrap();
    assert_eq!(r.outcome, TxOutcome::Committed);
    let t = r.txid.unwrap();
    assert!(
        writer
            .wait_state(t, LocalState::Committed, Duration::from_secs(10))
            .await
    );
    assert_eq!(reader.state(t), Some(LocalState::Prepared { vote: Vote::ReadOnly }));
    let mut acked = (false, false);
    for _ in 0..100 {
        let st = cl.status(t).await.unwrap();
        let of = |id: &str| st.participants.iter().any(|p| p.id == id && p.acked);
        acked = (of("reader"), of("writer"));
        if acked == (true, true) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(acked, (true, true), "(reader, writer) acked");
    assert!(
        reader.store.in_doubt().unwrap().is_empty(),
        "a READ_ONLY vote is never in doubt"
    );
}

/// Invariant 8 across log garbage collection: a participant that committed
/// in one phase but whose answer never reached the coordinator keeps its
/// record past retention while the transaction reads PENDING (a re-sent
/// `CommitOnePhase` must find it, or the work would be applied again), and
/// collects it once the decision is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_inv8_log_gc_keeps_a_one_phase_record_the_coordinator_has_not_recorded() {
    let mut c = TestCluster::start_with("t80l", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 500;
        cfg.txn.reaper_interval_ms = 100;
    });
    c.leader().await;
    let cl = c.client();
    let endpoints = c.procs.api_addrs();
    let a = Svc::new("bank-a").await;
    a.lose_one_phase_answers
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let r = cl
        .begin_and_commit("one-lost", 30_000, b"", &one(&a, b"w"))
        .await
        .unwrap();
    assert_eq!(r.outcome, TxOutcome::Unknown, "the answer was lost");
    let t = txid_enlisting(&cl, &a.id).await;
    assert!(a.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);
    assert_eq!(cl.decision(t).await.unwrap(), DecisionRead::Pending);

    // Retention 0: the record is a candidate, but the cluster has no
    // decision yet, so it stays.
    let n = participant_sdk::server::collect_decided(&a.store, &endpoints, &a.id, u64::MAX, 100, None)
        .await
        .unwrap();
    assert_eq!(n, 0, "collected a record whose one-phase answer is not recorded");
    assert_eq!(a.state(t), Some(LocalState::Committed));

    // The answers get through: the re-drive records COMMIT; now it goes.
    a.lose_one_phase_answers
        .store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(settled_decision(&cl, t).await, DecisionRead::Committed);
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

/// Invariant 1 under races on one transaction: a client Abort that arrives
/// while the leader's driver waits for a slow vote, and the reaper's ABORT
/// at a deadline that passes while the driver waits. Whoever wins, there is
/// one decision: every caller is told the same outcome, every node's read
/// agrees, and both participants apply it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_inv1_driver_racing_client_abort_and_reaper_gives_one_decision() {
    let mut c = TestCluster::start_with("t80m", 3, |cfg| {
        cfg.txn.reaper_interval_ms = 50;
        cfg.txn.one_phase_commit = false;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;
    a.prepare_delay_ms.store(1_500, std::sync::atomic::Ordering::SeqCst);

    // Case 1: client Abort while Commit waits for bank-a's vote.
    let t = cl.begin("race-abort", 30_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"y").await.unwrap();
    let committer = {
        let cl = c.client();
        tokio::spawn(async move { cl.commit(t).await })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    let aborted = cl.abort(t, "racing the driver").await.unwrap();
    let committed = committer.await.unwrap().unwrap();
    assert_eq!(aborted, committed, "the two callers were told different outcomes");
    assert_eq!(
        aborted,
        TxOutcome::Aborted,
        "the Abort came first: the vote was still outstanding"
    );
    check_one_decision(&c, t, DecisionRead::Aborted, &[&a, &b]).await;

    // Case 2: the deadline passes while the driver waits for the vote: the
    // reaper and the driver both decide ABORT, once.
    let t = cl.begin("race-reaper", 300, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"y").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Aborted);
    check_one_decision(&c, t, DecisionRead::Aborted, &[&a, &b]).await;
}

/// The decision of `t` read from every node equals `want`, and every
/// participant ends in it (an ABORT may reach a participant whose vote was
/// still on its way as a tombstone or as an abort of its prepared work).
async fn check_one_decision(c: &TestCluster, t: u64, want: DecisionRead, svcs: &[&Svc]) {
    for id in 1..=3 {
        let mut read = DecisionRead::Pending;
        for _ in 0..50 {
            read = c.client_at(id).decision(t).await.unwrap();
            if read != DecisionRead::Pending {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(read, want, "node {id}");
    }
    for s in svcs {
        let ok = match want {
            DecisionRead::Committed => s.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await,
            _ => {
                let until = tokio::time::Instant::now() + Duration::from_secs(10);
                loop {
                    if matches!(s.state(t), Some(LocalState::Aborted { .. })) {
                        break true;
                    }
                    if tokio::time::Instant::now() > until {
                        break false;
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        assert!(ok, "{} ended in {:?}, not {want:?}", s.id, s.state(t));
    }
}

/// The one-write commit (ADR 0012): a two-participant BeginAndCommit costs
/// ONE Raft entry between the votes and the answer (the record and its
/// decision together), where the two-write path costs two (BeginAndCommit,
/// Decide). Acks are held back (10 s batching window, the longest allowed,
/// begun by the warm-up's acks) so only the commit path is counted; the txid
/// range is reserved by the warm-up transaction first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_one_write_commit_takes_one_raft_entry_per_transaction() {
    for (one_write, per_tx) in [(true, 1), (false, 2)] {
        let mut c = TestCluster::start_with(&format!("t80ow-{one_write}"), 3, |cfg| {
            cfg.txn.ack_batch_wait_ms = 10_000;
            cfg.txn.one_write_commit = one_write;
        });
        let leader = c.leader().await;
        let cl = c.client();
        let a = Svc::new("bank-a").await;
        let b = Svc::new("bank-b").await;
        let both = || both(&a, &b);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let warm = cl.begin_and_commit("warm-up", 30_000, b"", &both()).await.unwrap();
        assert_eq!(warm.outcome, TxOutcome::Committed);
        let before = c.status_of(leader).await.last_log_index;
        let mut txids = Vec::new();
        for i in 0..5 {
            let r = cl
                .begin_and_commit(&format!("ow-{i}"), 30_000, b"", &both())
                .await
                .unwrap();
            assert_eq!(r.outcome, TxOutcome::Committed);
            txids.push(r.txid.unwrap());
        }
        let entries = c.status_of(leader).await.last_log_index - before;
        assert_eq!(
            entries,
            per_tx * txids.len() as u64,
            "one_write_commit = {one_write}: {entries} Raft entries for {} transactions",
            txids.len()
        );
        // Every txid that exists is below the cluster's next_txid (the
        // harness reads decisions up to it; with ranges the ids are sparse).
        let next = c.status_of(leader).await.next_txid;
        assert!(txids.iter().all(|t| *t < next), "next_txid {next}, txids {txids:?}");
        // Both participants apply every decision (invariant 3).
        for t in &txids {
            for s in [&a, &b] {
                assert!(s.wait_state(*t, LocalState::Committed, Duration::from_secs(10)).await);
            }
            assert_eq!(cl.decision(*t).await.unwrap(), DecisionRead::Committed);
        }
    }
}

/// ADR 0012's window seen by an operator: between a one-write commit's
/// Prepares and its write the cluster has no record of the txid, yet Status
/// must not say "not found" (a participant already holds it prepared). The
/// leader answers PREPARING with the participants the Prepares went to;
/// once the write is applied, the record answers (DECIDED, COMMIT).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t80_status_of_a_one_write_commit_before_its_write_is_preparing() {
    let mut c = TestCluster::start_with("t80sp", 3, |cfg| {
        cfg.txn.one_write_commit = true;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;
    let both = || both(&a, &b);
    // The first transaction of the term reserves the txid range.
    let warm = cl.begin_and_commit("sp-warm-up", 30_000, b"", &both()).await.unwrap();
    assert_eq!(warm.outcome, TxOutcome::Committed);
    a.prepare_delay_ms.store(3_000, std::sync::atomic::Ordering::SeqCst);
    let committing = {
        let (cl, both) = (c.client(), both());
        tokio::spawn(async move { cl.begin_and_commit("sp-slow", 30_000, b"", &both).await })
    };
    // bank-b votes at once: the txid is in its log, in doubt.
    let mut txid = None;
    for _ in 0..100 {
        txid = b
            .store
            .in_doubt()
            .unwrap()
            .iter()
            .map(|(t, _)| t.txid)
            .find(|t| Some(*t) != warm.txid);
        if txid.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let txid = txid.expect("bank-b prepared the slow transaction");
    // Through the leader and through a follower (forwarded).
    for node in 1..=3 {
        let s = c
            .client_at(node)
            .status(txid)
            .await
            .expect("not NOT_FOUND while in flight");
        assert_eq!(s.txid, txid);
        assert_eq!(s.state, dtx_proto::v1::TxState::Preparing as i32, "node {node}: {s:?}");
        let ids: Vec<&str> = s.participants.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids, ["bank-a", "bank-b"], "node {node}");
        assert_eq!(s.participants[0].address, a.addr);
        assert!(s.decision.is_none());
        assert!(s.deadline_unix_ms > s.begun_unix_ms && s.begun_unix_ms > 0, "{s:?}");
    }
    let done = committing.await.unwrap().unwrap();
    assert_eq!(done.outcome, TxOutcome::Committed);
    assert_eq!(done.txid, Some(txid));
    let s = cl.status(txid).await.unwrap();
    assert_eq!(s.state, dtx_proto::v1::TxState::Decided as i32);
    // A txid nobody handed out is still not found.
    let leader = c.leader().await;
    let next = c.status_of(leader).await.next_txid;
    assert!(matches!(
        cl.status(next + 1_000_000).await,
        Err(dtx_client::ClientError::NotFound(_))
    ));
}
