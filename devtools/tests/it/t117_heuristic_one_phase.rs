//! Heuristic decisions and abort notes (ADR 0039), against three real node
//! processes and the operator's CLI:
//! - a one-phase commit whose one participant is gone for good: `txn show`
//!   says what is failing (the leader's attempts and last error), a plain
//!   `txn resolve` is refused naming the way out, and
//!   `txn resolve --participant-lost` records the operator's heuristic
//!   decision, shown as the operator's and never as the participant's
//!   answer (invariant 1: written once; invariant 12: who and why
//!   recorded); the transaction can then be forgotten;
//! - the ABORT of a two-phase transaction shows each participant's vote.

use crate::common;

use std::process::Output;
use std::time::Duration;
use std::time::Instant;

use common::admin::json;
use common::admin::ok;
use common::admin::refused;
use common::participants::Svc;
use common::TestCluster;
use dtx_client::TxOutcome;
use dtx_proto::v1 as pb;
use serde_json::Value;

fn admin(c: &TestCluster, args: &[&str]) -> Output {
    common::admin::admin_as(c, "t117-operator", args)
}

/// Polls `txn show --json` until `pred` holds (at most `within`).
fn show_until(c: &TestCluster, txid: u64, within: Duration, pred: impl Fn(&Value) -> bool) -> Value {
    let until = Instant::now() + within;
    loop {
        let v = json(&admin(c, &["txn", "show", &txid.to_string(), "--json"]));
        if pred(&v) {
            return v;
        }
        assert!(Instant::now() < until, "condition not met within {within:?}: {v:#}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t117_inv1_inv12_a_lost_one_phase_participant_is_ended_by_a_heuristic_decision() {
    let mut c = TestCluster::start_with("t117a", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 500;
    });
    c.leader().await;
    let cl = c.client();

    // A one-phase commit whose participant is gone before it answers.
    let x = Svc::new("bank-x").await;
    let t = cl.begin("one-phase-lost", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, &x.id, &x.addr, b"debit 5").await.unwrap();
    drop(x);
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Unknown);
    let ts = t.to_string();

    // Explained: the leader's attempts and its last error.
    let v = show_until(&c, t, Duration::from_secs(30), |v| {
        let p = &v["participants"][0];
        p["delivery_attempts"].as_u64().unwrap_or(0) >= 1 && !p["last_delivery_error"].as_str().unwrap_or("").is_empty()
    });
    assert_eq!(v["state"], "PREPARING", "{v:#}");
    assert_eq!(v["one_phase"], true, "{v:#}");

    // A plain resolve is refused, naming the way out.
    refused(
        &admin(&c, &["txn", "resolve", &ts, "--abort", "--reason", "gone"]),
        "--participant-lost",
    );
    // Declaring it lost needs a reason.
    let o = admin(
        &c,
        &["txn", "resolve", &ts, "--abort", "--participant-lost", "--reason", ""],
    );
    assert_ne!(o.status.code(), Some(0), "{}", common::output_text(&o));

    // The operator's heuristic decision, recorded once.
    let out = ok(&admin(
        &c,
        &[
            "txn",
            "resolve",
            &ts,
            "--abort",
            "--participant-lost",
            "--reason",
            "bank-x's disk was destroyed",
        ],
    ));
    assert!(out.contains("recorded ABORT"), "{out}");
    let again = admin(
        &c,
        &[
            "txn",
            "resolve",
            &ts,
            "--commit",
            "--participant-lost",
            "--reason",
            "second thoughts",
        ],
    );
    refused(&again, "already decided ABORT");

    // Shown as the operator's, never as the participant's answer.
    let st = cl.status(t).await.unwrap();
    let d = st.decision.clone().expect("decided");
    assert_eq!(d.source, pb::DecisionSource::OperatorHeuristic as i32);
    assert_eq!(d.outcome, pb::Outcome::Abort as i32);
    assert!(
        d.note.contains("operator t117-operator: bank-x's disk was destroyed"),
        "{}",
        d.note
    );
    assert!(d.note.contains("not the participant's answer"), "{}", d.note);
    let v = json(&admin(&c, &["txn", "show", &ts, "--json"]));
    assert_eq!(v["decision"]["source"], "operator-heuristic", "{v:#}");
    let p = &v["participants"][0];
    assert_eq!(p["acked"], false, "{v:#}");
    assert_eq!(p["dropped"], true, "{v:#}");
    let text = ok(&admin(&c, &["txn", "show", &ts]));
    assert!(text.contains("heuristically (not the participant's answer)"), "{text}");
    assert!(!text.contains("prepared and committed in one phase"), "{text}");

    // Nothing left to deliver: it can be forgotten now.
    ok(&admin(
        &c,
        &["txn", "forget", &ts, "--reason", "reconciled with bank-x's owner"],
    ));
    let o = admin(&c, &["txn", "show", &ts]);
    assert_ne!(o.status.code(), Some(0), "{}", common::output_text(&o));

    // Only for a one-phase commit: a two-phase transaction is resolved.
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;
    let t2 = cl.begin("two-phase", 60_000, b"").await.unwrap().txid;
    cl.enlist(t2, &a.id, &a.addr, b"debit").await.unwrap();
    cl.enlist(t2, &b.id, &b.addr, b"credit").await.unwrap();
    let refused_two = admin(
        &c,
        &[
            "txn",
            "resolve",
            &t2.to_string(),
            "--abort",
            "--participant-lost",
            "--reason",
            "x",
        ],
    );
    refused(&refused_two, "not a one-phase commit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t117_inv2_an_abort_shows_every_participants_vote() {
    let mut c = TestCluster::start_with("t117b", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;
    let t = cl.begin("one-no", 30_000, b"").await.unwrap().txid;
    cl.enlist(t, &a.id, &a.addr, b"debit 5").await.unwrap();
    cl.enlist(t, &b.id, &b.addr, b"no").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Aborted);
    let text = ok(&admin(&c, &["txn", "show", &t.to_string()]));
    let votes = text
        .lines()
        .find(|l| l.contains("votes:"))
        .unwrap_or_else(|| panic!("no votes line: {text}"));
    assert!(votes.contains("bank-b voted NO"), "{votes}");
    assert!(votes.contains("YES from bank-a"), "{votes}");
}
