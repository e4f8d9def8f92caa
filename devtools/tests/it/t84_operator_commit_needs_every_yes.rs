//! Invariants 2 and 3: `admin txn resolve --commit` is refused unless every
//! participant holds a durable YES vote. The leader asks each one what its
//! log holds (the read-only `Inquire` call). It used to compare only the
//! voter list with the enlisted set, so an operator could commit a
//! transaction in which a participant had not voted (and then voted NO): the
//! others committed, that one refused: a split.

use crate::common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::participants::Svc;
use common::TestCluster;
use dtx_client::TxOutcome;
use participant_sdk::log::LocalState;

/// Runs `coordinator admin ... txn resolve`; (success, stdout, stderr).
fn resolve_cli(c: &TestCluster, txid: u64, extra: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(common::bin())
        .args(["admin", "--addr", &c.procs.api_addrs().join(","), "txn", "resolve"])
        .arg(txid.to_string())
        .args(extra)
        .args(["--operator", "alice", "--reason", "drill"])
        .output()
        .expect("run coordinator admin");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn wait_aborted(s: &Svc, t: u64) -> bool {
    for _ in 0..200 {
        if matches!(s.state(t), Some(LocalState::Aborted { .. })) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t84_inv2_inv3_operator_commit_refused_unless_every_participant_holds_yes() {
    let mut c = TestCluster::start_with("t84", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 10_000;
        cfg.txn.one_phase_commit = false;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;

    // ACTIVE: nobody was asked to prepare. Refused.
    let t = cl.begin("active", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    let (ok, _, err) = resolve_cli(&c, t, &["--commit", "--voters", "bank-a"]);
    assert!(!ok, "operator COMMIT of an ACTIVE transaction was accepted");
    assert!(err.contains("bank-a"), "{err}");

    // PREPARING: bank-a holds a durable YES, bank-b has not voted yet (its
    // Prepare is slow, and it will vote NO). Refused, naming bank-b.
    b.prepare_delay_ms.store(2_000, Ordering::SeqCst);
    let t = cl.begin("split", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"no").await.unwrap();
    let committer = {
        let cl = c.client();
        tokio::spawn(async move { cl.commit(t).await })
    };
    let mut a_voted = false;
    for _ in 0..100 {
        if a.state(t).is_some() {
            a_voted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(a_voted, "bank-a never prepared");
    let (ok, out, err) = resolve_cli(&c, t, &["--commit", "--voters", "bank-a,bank-b"]);
    assert!(!ok, "operator COMMIT accepted without bank-b's vote: {out}");
    assert!(err.contains("bank-b") && err.contains("no YES vote"), "{err}");
    assert!(!err.contains("bank-a holds"), "bank-a does hold a YES: {err}");
    // The driver decides ABORT on bank-b's NO; both end aborted.
    assert_eq!(committer.await.unwrap().unwrap(), TxOutcome::Aborted);
    assert!(wait_aborted(&a, t).await, "bank-a: {:?}", a.state(t));
    assert!(wait_aborted(&b, t).await, "bank-b: {:?}", b.state(t));
    b.prepare_delay_ms.store(0, Ordering::SeqCst);

    // Both hold a durable YES (bank-b's vote is recorded, its reply slow):
    // the operator's COMMIT is recorded, with what the inquiry found, and
    // the driver's own decision reads it back.
    b.prepare_reply_delay_ms.store(4_000, Ordering::SeqCst);
    let t = cl.begin("both-yes", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"x").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"y").await.unwrap();
    let committer = {
        let cl = c.client();
        tokio::spawn(async move { cl.commit(t).await })
    };
    let mut both_voted = false;
    for _ in 0..100 {
        if a.state(t).is_some() && b.state(t).is_some() {
            both_voted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(both_voted);
    let (ok, out, err) = resolve_cli(&c, t, &["--commit"]);
    assert!(ok, "operator COMMIT with every YES refused: {err}");
    assert!(out.contains("recorded"), "{out}");
    assert_eq!(committer.await.unwrap().unwrap(), TxOutcome::Committed);
    assert!(a.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);
    assert!(b.wait_state(t, LocalState::Committed, Duration::from_secs(10)).await);
    let note = cl.status(t).await.unwrap().decision.unwrap().note;
    assert!(note.contains("alice") && note.contains("bank-b=YES"), "{note}");
}
