//! API behaviour on a healthy cluster: idempotent Begin (same key + same
//! request = same txid; same key + other request refused), documented limits
//! answered with INVALID_ARGUMENT naming the limit, write forwarding from
//! followers (whose answers name the leader), the deadline reaper (invariant 7), write-once Abort/Commit
//! (invariant 1), operator COMMIT needing every participant (invariant 2),
//! and Forget after the retention period (invariant 10).

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::TestCluster;
use coordinator::limits;
use dtx_client::ClientError;
use dtx_client::DecisionRead;
use dtx_client::TxOutcome;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t40_begin_is_idempotent_by_key_and_fingerprint() {
    let mut c = TestCluster::start("t40a");
    let leader = c.leader().await;
    let follower = (1..=3).find(|i| *i != leader).unwrap();

    let first = c.client().begin("order-17", 5_000, b"transfer 10").await.unwrap();
    assert!(!first.existing);
    // Retried through a follower, and concurrently from many clients.
    let again = c
        .client_at(follower)
        .begin("order-17", 5_000, b"transfer 10")
        .await
        .unwrap();
    assert_eq!((again.txid, again.existing), (first.txid, true));
    // A forwarded answer names the leader, so a client that lists every
    // node goes straight there next time (dtx_client::Client does).
    let mut raw = dtx_proto::v1::coordinator_client::CoordinatorClient::connect(format!("http://{}", c.api(follower)))
        .await
        .unwrap();
    let answer = raw
        .status(dtx_proto::v1::StatusRequest { txid: first.txid })
        .await
        .unwrap();
    assert_eq!(answer.get_ref().txid, first.txid);
    assert_eq!(
        dtx_proto::metadata::leader_addr_in(answer.metadata()),
        Some(c.api(leader)),
        "the follower's forwarded answer names the leader"
    );
    let mut tasks = Vec::new();
    for i in 0..16 {
        let cl = Arc::new(c.client_at(i % 3 + 1));
        tasks.push(tokio::spawn(async move {
            cl.begin("order-18", 5_000, b"x").await.unwrap().txid
        }));
    }
    let mut ids = Vec::new();
    for t in tasks {
        ids.push(t.await.unwrap());
    }
    assert!(
        ids.windows(2).all(|w| w[0] == w[1]),
        "concurrent Begins with one key got {ids:?}"
    );
    assert_ne!(ids[0], first.txid);

    // Same key, other request: refused, and says why.
    for (timeout, desc) in [(5_000, &b"transfer 11"[..]), (6_000, &b"transfer 10"[..])] {
        match c.client().begin("order-17", timeout, desc).await {
            Err(ClientError::AlreadyExists(m)) => assert!(m.contains("order-17"), "{m}"),
            other => panic!("expected AlreadyExists, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t40_limits_are_invalid_argument_naming_the_limit() {
    let mut c = TestCluster::start("t40b");
    c.leader().await;
    let cl = c.client();
    let long_key = "k".repeat(limits::ID_BYTES_MAX + 1);
    let cases: Vec<(Result<(), ClientError>, &str)> = vec![
        (
            cl.begin("", 0, b"").await.map(|_| ()),
            "idempotency_key must not be empty",
        ),
        (
            cl.begin(&long_key, 0, b"").await.map(|_| ()),
            "idempotency_key is 129 bytes; the limit is 128",
        ),
        (
            cl.begin("d", 0, &vec![0u8; limits::DESCRIPTION_BYTES_MAX + 1])
                .await
                .map(|_| ()),
            "description is 4097 bytes; the limit is 4096",
        ),
        (cl.begin("t", 4_000_000, b"").await.map(|_| ()), "txn.max_timeout_ms"),
    ];
    for (res, want) in cases {
        match res {
            Err(ClientError::InvalidArgument(m)) => assert!(m.contains(want), "{m:?} should mention {want:?}"),
            other => panic!("expected InvalidArgument mentioning {want:?}, got {other:?}"),
        }
    }
    let t = cl.begin("limits", 0, b"").await.unwrap().txid;
    let big = vec![0u8; limits::PAYLOAD_BYTES_MAX + 1];
    match cl.enlist(t, "p", "127.0.0.1:1", &big).await {
        Err(ClientError::InvalidArgument(m)) => {
            assert!(m.contains("payload is 65537 bytes; the limit is 65536"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    for i in 0..limits::PARTICIPANTS_MAX {
        cl.enlist(t, &format!("p{i}"), "127.0.0.1:1", b"").await.unwrap();
    }
    match cl.enlist(t, "one-too-many", "127.0.0.1:1", b"").await {
        Err(ClientError::InvalidArgument(m)) => assert!(m.contains("participants_max"), "{m}"),
        other => panic!("{other:?}"),
    }
    let many: Vec<u64> = (0..limits::DECISION_BATCH_TXIDS_MAX as u64 + 1).collect();
    match cl.decisions(&many).await {
        Err(ClientError::InvalidArgument(m)) => assert!(m.contains("limit is 1024"), "{m}"),
        other => panic!("{other:?}"),
    }
    // Nothing was lost by the refusals: the transaction is intact.
    let st = cl.status(t).await.unwrap();
    assert_eq!(st.participants.len(), limits::PARTICIPANTS_MAX);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t40_reaper_aborts_through_raft_and_decisions_are_write_once() {
    let mut c = TestCluster::start_with("t40c", 3, |cfg| {
        cfg.txn.retention_ms = 1_000;
    });
    c.leader().await;
    let cl = c.client();

    // Invariant 7: undecided past its deadline -> ABORT recorded by the reaper.
    let t = cl.begin("short", 300, b"").await.unwrap().txid;
    cl.enlist(t, "p", "127.0.0.1:1", b"").await.unwrap();
    let mut d = DecisionRead::Pending;
    for _ in 0..100 {
        d = cl.decision(t).await.unwrap();
        if d != DecisionRead::Pending {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(d, DecisionRead::Aborted);
    let st = cl.status(t).await.unwrap();
    let dec = st.decision.expect("decision recorded");
    assert_eq!(dec.source, dtx_proto::v1::DecisionSource::Reaper as i32);

    // Invariant 1: a later COMMIT cannot override it.
    let (o, recorded) = cl.resolve(t, true, &["p".into()], "op", "late").await.unwrap();
    assert_eq!((o, recorded), (TxOutcome::Aborted, false));

    // Invariant 2: an operator COMMIT without every participant is refused.
    let t2 = cl.begin("op-commit", 600_000, b"").await.unwrap().txid;
    cl.enlist(t2, "a", "127.0.0.1:1", b"").await.unwrap();
    cl.enlist(t2, "b", "127.0.0.1:1", b"").await.unwrap();
    match cl.resolve(t2, true, &["a".into()], "op", "missing b").await {
        Err(ClientError::FailedPrecondition(m)) => assert!(m.contains("differ from enlisted"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(cl.decision(t2).await.unwrap(), DecisionRead::Pending);
    // The driver cannot reach a or b (nothing listens there): ABORT, with
    // the reason recorded.
    assert_eq!(cl.commit(t2).await.unwrap(), TxOutcome::Aborted);
    let st = cl.status(t2).await.unwrap();
    assert_eq!(st.state, dtx_proto::v1::TxState::Decided as i32);
    assert_eq!(
        st.decision.unwrap().source,
        dtx_proto::v1::DecisionSource::Driver as i32
    );

    // Zero participants: commit is decided at once; abort afterwards is a no-op.
    let t3 = cl.begin("empty", 600_000, b"").await.unwrap().txid;
    assert_eq!(cl.commit(t3).await.unwrap(), TxOutcome::Committed);
    assert_eq!(cl.abort(t3, "too late").await.unwrap(), TxOutcome::Committed);
    // Enlist after the decision is refused.
    assert!(matches!(
        cl.enlist(t3, "late", "127.0.0.1:1", b"").await,
        Err(ClientError::FailedPrecondition(_))
    ));

    // Invariant 10: fully acked (no participants) + retention passed ->
    // forgotten; reads say "unknown: presumed abort"; the id is not reused.
    let mut forgotten = false;
    for _ in 0..100 {
        if cl.decision(t3).await.unwrap() == DecisionRead::UnknownPresumedAbort {
            forgotten = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        forgotten,
        "decided transaction without participants was not forgotten after retention"
    );
    // t (one participant that never acked) must NOT be forgotten.
    assert_eq!(cl.decision(t).await.unwrap(), DecisionRead::Aborted);
    let fresh = cl.begin("empty", 600_000, b"").await.unwrap();
    assert!(
        !fresh.existing && fresh.txid > t3,
        "txid reused or key not released: {fresh:?}"
    );
}
