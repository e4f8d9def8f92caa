//! The leader as a port scanner (ADR 0041), with real
//! `coordinator serve` processes and participant services on real sockets:
//!
//! - `participants.allowed_addresses`: Enlist and BeginAndCommit with an
//!   address outside the operators' policy are PERMISSION_DENIED before
//!   anything is proposed, naming the key and not the policy;
//! - the application's Status shows a participant's last delivery error as
//!   a class ("unreachable"), the same for a refused connection and a
//!   server that speaks no gRPC, and the decision's note says no more; the
//!   operator's ListTransactions keeps the error's text;
//! - an address that never answered this leader is called for at most
//!   `txn.never_answered_give_up_ms` per transaction (an ABORT's delivery,
//!   a one-phase commit's re-sending), shown to operators; a participant
//!   that answered once is never given up; a one-phase commit given up is
//!   never decided by it (its participant committed, the record stays
//!   PREPARING) and goes on once the address answers again.

use crate::common;

use std::time::Duration;

use common::participants::Svc;
use common::TestCluster;
use dtx_client::ClientError;
use dtx_client::ParticipantSpec;
use dtx_client::TxOutcome;
use dtx_proto::v1 as pb;
use dtx_proto::v1::coordinator_client::CoordinatorClient;
use participant_sdk::log::LocalState;
use participant_sdk::log::Vote;

/// An address nothing listens on (connection refused).
fn closed_address() -> String {
    let port = dtx_testkit::cluster::free_port("127.0.0.1").unwrap();
    format!("127.0.0.1:{port}")
}

/// An address where a server accepts connections and answers with text
/// that is not HTTP/2 (another kind of failure than a refused connection).
async fn garbage_address() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok((mut s, _)) = listener.accept().await {
            let _ = s.write_all(b"SSH-2.0-OpenSSH_9.6\r\nProtocol mismatch.\r\n").await;
        }
    });
    addr
}

fn denied<T: std::fmt::Debug>(r: Result<T, ClientError>, what: &str) -> String {
    match r {
        Err(ClientError::PermissionDenied(m)) => {
            assert!(
                m.contains("participants.allowed_addresses"),
                "{what}: the refusal should name the policy's key: {m}"
            );
            assert!(
                !m.contains("127.0.0.0/8") && !m.contains("bank-*"),
                "{what}: the refusal must not tell the policy: {m}"
            );
            m
        }
        other => panic!("{what}: expected PERMISSION_DENIED, got {other:?}"),
    }
}

/// Part 1: an address outside `participants.allowed_addresses` is refused
/// PERMISSION_DENIED by Enlist and BeginAndCommit, through the leader and
/// a follower, before anything is proposed (no participant recorded, the
/// BeginAndCommit's key and txid unused); addresses inside it are taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t118_addresses_outside_the_policy_are_refused_before_anything_is_proposed() {
    let mut c = TestCluster::start_with("t118a", 3, |cfg| {
        cfg.participants.allowed_addresses = vec!["127.0.0.0/8".into(), "bank-*.svc.internal".into()];
    });
    let leader = c.leader().await;
    let follower = (1..=3).find(|&id| id != leader).unwrap();
    let cl = c.client();
    let via_follower = c.client_at(follower);
    let txid = cl.begin("t118a-1", 60_000, b"").await.unwrap().txid;

    for addr in [
        "10.0.0.7:7000",
        "[::1]:7000",
        "db.svc.internal:5432",
        "localhost:22",
        "127.1:22",
    ] {
        let m = denied(cl.enlist(txid, "bank-a", addr, b"").await, addr);
        assert!(m.contains(addr), "{addr}: the refusal should quote the address: {m}");
        denied(via_follower.enlist(txid, "bank-a", addr, b"").await, addr);
    }
    let st = cl.status(txid).await.unwrap();
    assert!(
        st.participants.is_empty(),
        "a refused Enlist left a participant: {st:?}"
    );
    // Inside the policy: taken (names are not resolved at enlistment).
    for (id, addr) in [("ok-1", "127.0.0.1:7000"), ("ok-2", "http://bank-eu.svc.internal:7000")] {
        cl.enlist(txid, id, addr, b"")
            .await
            .unwrap_or_else(|e| panic!("{addr}: {e:?}"));
    }

    let specs = |addr: &str| {
        vec![
            ParticipantSpec {
                participant_id: "ok".into(),
                address: "127.0.0.1:7000".into(),
                payload: Vec::new(),
            },
            ParticipantSpec {
                participant_id: "outside".into(),
                address: addr.into(),
                payload: Vec::new(),
            },
        ]
    };
    denied(
        cl.begin_and_commit("t118a-2", 60_000, b"", &specs("192.168.1.1:443"))
            .await,
        "BeginAndCommit",
    );
    denied(
        via_follower
            .begin_and_commit("t118a-2", 60_000, b"", &specs("192.168.1.1:443"))
            .await,
        "BeginAndCommit through a follower",
    );
    let b = cl.begin("t118a-2", 60_000, b"").await.unwrap();
    assert!(!b.existing, "a refused BeginAndCommit used its key");
    assert_eq!(b.txid, txid + 1, "a refused BeginAndCommit used a txid");
}

/// The first ListTransactions record of `txid`.
async fn admin_record(c: &TestCluster, txid: u64) -> pb::StatusResponse {
    let page = c
        .client()
        .list_transactions(pb::ListTransactionsRequest {
            after_txid: txid - 1,
            limit: 1,
            ..Default::default()
        })
        .await
        .unwrap();
    let r = page.transactions.into_iter().next().expect("a record");
    assert_eq!(r.txid, txid);
    r
}

fn participant<'a>(s: &'a pb::StatusResponse, id: &str) -> &'a pb::ParticipantInfo {
    s.participants.iter().find(|p| p.id == id).unwrap()
}

/// Part 2: a refused connection and a server that speaks no gRPC look the
/// same in the application's Status ("unreachable"), and the decision's
/// note names no transport error; the operator's ListTransactions shows
/// each delivery error's text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t118_status_shows_the_application_only_the_class_of_a_delivery_error() {
    let mut c = TestCluster::start_with("t118b", 1, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
        cfg.txn.delivery_retry_max_ms = 200;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let (closed, garbage) = (closed_address(), garbage_address().await);

    let t = cl.begin("t118b", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"debit 5").await.unwrap();
    cl.enlist(t, "closed", &closed, b"").await.unwrap();
    cl.enlist(t, "garbage", &garbage, b"").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Aborted);

    let mut seen = None;
    for _ in 0..200 {
        let st = cl.status(t).await.unwrap();
        if ["closed", "garbage"].iter().all(|id| {
            let p = participant(&st, id);
            p.delivery_attempts > 0 && !p.last_delivery_error.is_empty()
        }) {
            seen = Some(st);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let st = seen.expect("Status shows the failing deliveries");
    for id in ["closed", "garbage"] {
        assert_eq!(
            participant(&st, id).last_delivery_error,
            "unreachable",
            "{id}: the application sees the class only"
        );
    }
    let note = st.decision.clone().unwrap().note;
    assert!(
        note.contains("closed: no usable vote") && note.contains("garbage: no usable vote"),
        "{note}"
    );
    for transport in [
        "Unavailable",
        "connect",
        "refused",
        "os error",
        "transport",
        "h2",
        "protocol",
    ] {
        assert!(
            !note.contains(transport),
            "the decision's note tells the transport error ({transport}): {note}"
        );
    }

    // The operator sees the text.
    let r = admin_record(&c, t).await;
    for id in ["closed", "garbage"] {
        let e = &participant(&r, id).last_delivery_error;
        assert!(
            e.len() > "unreachable".len() && e != "unreachable",
            "{id}: ListTransactions should show the error's text: {e:?}"
        );
        eprintln!("{id}: operator sees {e:?}");
    }
}

/// Part 3: with `txn.never_answered_give_up_ms` small, the ABORT's
/// delivery to an address that never answered stops (shown to the
/// operator, no more attempts), while a participant that answered once
/// (its Prepare) is still called past the bound and acks once it answers;
/// a one-phase commit whose participant never answers stops being
/// re-sent, is not decided (that participant had committed), and goes on
/// once the address answers another call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t118_an_address_that_never_answered_is_given_up_after_the_bound() {
    const BOUND_MS: u64 = 1_500;
    let mut c = TestCluster::start_with("t118c", 1, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
        cfg.txn.delivery_retry_max_ms = 200;
        cfg.txn.never_answered_give_up_ms = BOUND_MS;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;
    let ghost = closed_address();

    // bank-b votes YES, then refuses every decision as if unreachable.
    let t = cl.begin("t118c-abort", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"debit 5").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"credit 5").await.unwrap();
    cl.enlist(t, "ghost", &ghost, b"").await.unwrap();
    b.hold_decisions.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Aborted);
    assert_eq!(b.state(t), Some(LocalState::Prepared { vote: Vote::Yes }));

    let mut stopped = None;
    for _ in 0..300 {
        let r = admin_record(&c, t).await;
        if participant(&r, "ghost")
            .last_delivery_error
            .starts_with("stopped delivering the ABORT")
        {
            stopped = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let r = stopped.unwrap_or_else(|| {
        c.dump_logs();
        panic!("the ABORT's delivery to an address that never answered did not stop")
    });
    let g = participant(&r, "ghost").clone();
    assert!(g.last_delivery_error.contains("txn.never_answered_give_up_ms"), "{g:?}");
    assert_eq!(g.next_delivery_unix_ms, 0, "no next attempt: {g:?}");
    assert!(!g.acked);
    // The application still sees only the class.
    assert_eq!(
        participant(&cl.status(t).await.unwrap(), "ghost").last_delivery_error,
        "unreachable"
    );
    // No more attempts: 5 times the longest backoff later, the count is
    // the same, while bank-b (it answered its Prepare) is still called.
    let b_calls = b.decisions_received.load(std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(5 * 200 + BOUND_MS)).await;
    let r = admin_record(&c, t).await;
    assert_eq!(
        participant(&r, "ghost").delivery_attempts,
        g.delivery_attempts,
        "attempts went on after the delivery stopped"
    );
    let rb = participant(&r, "bank-b");
    assert!(
        !rb.last_delivery_error.starts_with("stopped"),
        "bank-b answered once and must not be given up: {rb:?}"
    );
    assert!(
        b.decisions_received.load(std::sync::atomic::Ordering::SeqCst) > b_calls,
        "bank-b is not called any more"
    );
    assert!(participant(&r, "bank-a").acked);
    b.hold_decisions.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(
        b.wait_state(t, LocalState::Aborted { tombstone: false }, Duration::from_secs(20))
            .await,
        "bank-b never got the ABORT"
    );

    // One-phase: bank-c commits every one-phase commit it gets, but its
    // answers are lost: it never answered this leader.
    let cc = Svc::new("bank-c").await;
    cc.lose_one_phase_answers
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let leader = c.leader().await;
    let ch = coordinator::raft::network::channel(&c.api(leader), None, Duration::from_secs(2)).unwrap();
    let _ = tokio::time::timeout(
        Duration::from_secs(10),
        CoordinatorClient::new(ch).begin_and_commit(pb::BeginAndCommitRequest {
            idempotency_key: "t118c-one-phase".into(),
            timeout_ms: 60_000,
            description: Vec::new(),
            participants: vec![pb::ParticipantSpec {
                participant_id: cc.id.clone(),
                address: cc.addr.clone(),
                payload: b"x".to_vec(),
            }],
        }),
    )
    .await;
    let t1 = {
        let page = cl
            .list_transactions(pb::ListTransactionsRequest {
                participant: cc.id.clone(),
                ..Default::default()
            })
            .await
            .unwrap();
        page.transactions.first().expect("the one-phase commit's record").txid
    };
    let mut stopped = false;
    for _ in 0..300 {
        let r = admin_record(&c, t1).await;
        if participant(&r, "bank-c")
            .last_delivery_error
            .starts_with("stopped re-sending the one-phase commit")
        {
            stopped = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if !stopped {
        c.dump_logs();
    }
    assert!(
        stopped,
        "the one-phase commit to an address that never answered is still re-sent"
    );
    // Never decided by the give-up: bank-c committed, the record waits.
    let r = admin_record(&c, t1).await;
    assert_eq!(r.state, pb::TxState::Preparing as i32, "{r:?}");
    assert!(r.decision.is_none());
    assert_eq!(cc.state(t1), Some(LocalState::Committed));
    let sent = cc.one_phase_received.load(std::sync::atomic::Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(5 * 200 + BOUND_MS)).await;
    assert_eq!(
        cc.one_phase_received.load(std::sync::atomic::Ordering::SeqCst),
        sent,
        "one-phase commits still sent after the give-up"
    );

    // bank-c answers again, and answers another transaction's Prepare:
    // the given-up commit is re-sent and recorded as bank-c's COMMIT.
    cc.lose_one_phase_answers
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let t2 = cl.begin("t118c-wake", 60_000, b"").await.unwrap().txid;
    cl.enlist(t2, &a.id, &a.addr, b"x").await.unwrap();
    cl.enlist(t2, &cc.id, &cc.addr, b"y").await.unwrap();
    assert_eq!(cl.commit(t2).await.unwrap(), TxOutcome::Committed);
    let mut decided = None;
    for _ in 0..300 {
        if let Some(d) = cl.status(t1).await.unwrap().decision {
            decided = Some(d);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let d = decided.expect("the given-up one-phase commit went on once its address answered");
    assert_eq!(d.outcome, pb::Outcome::Commit as i32, "{d:?}");
}
