//! Crash windows of DESIGN's fault points, with the `failpoints` feature: a
//! node or participant process aborts (like kill -9) at the named point.
//! Run with `cargo test -p coordinator --features failpoints --test t85_crash_points`.
#![cfg(feature = "failpoints")]

mod common;

use std::process::Command;
use std::process::Stdio;
use std::time::Duration;

use common::participants::Svc;
use common::TestCluster;
use coordinator::client::DecisionRead;
use coordinator::client::TxOutcome;
use participant_sdk::log::LocalState;

/// A three-node cluster whose nodes abort once (in total) at `point`.
fn cluster_crashing_at(name: &str, point: &str) -> TestCluster {
    let mut c = TestCluster::start_with(name, 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
    });
    // The nodes are already running; restart them with the crash point armed.
    c.procs.stop_all(Duration::from_secs(5));
    let once = c.dir.path().join("failpoint-fired");
    c.procs.env = vec![
        ("DTX_FAILPOINT".into(), point.into()),
        ("DTX_FAILPOINT_ONCE".into(), once.display().to_string()),
    ];
    c.procs.start_all().unwrap();
    c
}

/// Two participant services and a transaction that enlists both.
async fn two_participant_tx(c: &mut TestCluster) -> (Svc, Svc, u64) {
    c.leader().await;
    let (a, b) = (Svc::new("bank-a").await, Svc::new("bank-b").await);
    let cl = c.client();
    let t = cl.begin("k", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"y").await.unwrap();
    (a, b, t)
}

async fn commit_outcome(c: &TestCluster, txid: u64) -> TxOutcome {
    // The client may see UNKNOWN when the leader dies mid-call; asking again
    // (Commit is idempotent) gives the recorded decision.
    for _ in 0..5 {
        match c.client().commit(txid).await {
            Ok(TxOutcome::Unknown) | Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            Ok(o) => return o,
        }
    }
    panic!("no decision for {txid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t85_leader_dies_after_decision_before_delivery_new_leader_delivers() {
    let mut c = cluster_crashing_at("t85a", "coordinator_decided_before_delivery");
    let (a, b, t) = two_participant_tx(&mut c).await;
    assert_eq!(commit_outcome(&c, t).await, TxOutcome::Committed);
    assert!(
        c.dir.path().join("failpoint-fired").exists(),
        "the crash point was not reached"
    );
    assert!(a.wait_state(t, LocalState::Committed, Duration::from_secs(20)).await);
    assert!(b.wait_state(t, LocalState::Committed, Duration::from_secs(20)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t85_leader_dies_mid_prepare_one_decision_applied_everywhere() {
    let mut c = cluster_crashing_at("t85b", "coordinator_mid_prepare");
    let (a, b, t) = two_participant_tx(&mut c).await;
    let o = commit_outcome(&c, t).await;
    assert!(
        c.dir.path().join("failpoint-fired").exists(),
        "the crash point was not reached"
    );
    // Whatever was decided, both participants end with it (invariant 3).
    let want = match o {
        TxOutcome::Committed => LocalState::Committed,
        _ => LocalState::Aborted { tombstone: false },
    };
    assert!(
        a.wait_state(t, want, Duration::from_secs(20)).await,
        "a: {:?}",
        a.state(t)
    );
    assert!(
        b.wait_state(t, want, Duration::from_secs(20)).await,
        "b: {:?}",
        b.state(t)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t85_participant_dies_after_durable_prepare_resolves_after_restart() {
    let mut c = TestCluster::start_with("t85c", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
    });
    c.leader().await;
    let api = c.procs.api_addrs().join(",");
    let data = c.dir.path().join("bank-b");
    let port = coordinator::cluster::free_port("127.0.0.1").unwrap();
    let addr = format!("127.0.0.1:{port}");
    let once = c.dir.path().join("bank-fired");
    let spawn = |armed: bool| {
        let mut cmd = Command::new(common::bin());
        cmd.args([
            "bank-serve",
            "--id",
            "bank-b",
            "--prefix",
            "b",
            "--listen",
            &addr,
            "--data-dir",
        ])
        .arg(&data)
        .args(["--cluster", &api])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        if armed {
            cmd.env("DTX_FAILPOINT", "participant_after_prepare_before_reply")
                .env("DTX_FAILPOINT_ONCE", &once);
        }
        cmd.spawn().unwrap()
    };
    let mut bank = spawn(true);
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(&addr).await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cl = c.client();
    let t = cl.begin("k", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, "bank-b", &addr, b"b1:-10").await.unwrap();
    // The participant dies after its durable YES, before replying: the
    // coordinator never got a vote, so it decides ABORT.
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Aborted);
    let status = bank.wait().unwrap();
    assert!(!status.success(), "bank-b should have aborted at the crash point");
    assert!(once.exists());
    // Restarted, it finds the transaction in doubt and asks the cluster.
    let mut bank = spawn(false);
    let mut resolved = false;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if cl
            .status(t)
            .await
            .map(|s| s.participants.iter().all(|p| p.acked))
            .unwrap_or(false)
        {
            resolved = true;
            break;
        }
    }
    // Stop it and read its store: ABORT applied, b1 unlocked, balance intact.
    unsafe {
        libc::kill(bank.id() as i32, libc::SIGTERM);
    }
    bank.wait().unwrap();
    let store = coordinator::demo::bank::open_bank(&data, "b", 10, 1000).await.unwrap();
    assert_eq!(
        store.entry(t).unwrap().unwrap().state,
        LocalState::Aborted { tombstone: false }
    );
    let (total, _, locked) = coordinator::demo::bank::audit(&store).unwrap();
    assert_eq!((total, locked), (10_000, 0));
    assert!(resolved, "the coordinator never recorded bank-b's ack");
    assert_eq!(cl.decision(t).await.unwrap(), DecisionRead::Aborted);
}
