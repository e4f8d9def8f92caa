//! The operator's CLI against a real three-node cluster (node processes, bank
//! participant processes, kill -9). A participant gone for good is found with
//! `txn list --unacknowledged`, explained by `txn show` and cleared with
//! `txn drop-participant` (invariant 11: stuck work is visible with its
//! reason; invariant 12: repairs record who and why); forgetting is refused
//! where it would break invariant 10; every command has a table and `--json`,
//! and exit codes tell refused (3), unknown (4) and unreachable (5) apart.

use crate::common;

use std::process::Output;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use common::admin::json;
use common::admin::ok;
use common::admin::refused;
use common::participants::Svc;
use common::TestCluster;
use dtx_client::ParticipantSpec;
use dtx_client::TxOutcome;
use dtx_testkit::cluster::start_bank;
use serde_json::Value;

const ACCOUNTS: usize = 10;
const INITIAL: i64 = 1_000;

/// `coordinator admin --addr <all nodes> <args>` as operator t100-operator.
fn admin(c: &TestCluster, args: &[&str]) -> Output {
    common::admin::admin_as(c, "t100-operator", args)
}

fn txids(v: &Value) -> Vec<u64> {
    v["transactions"]
        .as_array()
        .expect("transactions")
        .iter()
        .map(|t| t["txid"].as_u64().unwrap())
        .collect()
}

fn participant<'a>(t: &'a Value, id: &str) -> &'a Value {
    t["participants"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == id)
        .unwrap_or_else(|| panic!("no participant {id} in {t}"))
}

/// Polls `show --json` until `pred` holds (at most `within`).
async fn show_until(c: &TestCluster, txid: u64, within: Duration, pred: impl Fn(&Value) -> bool) -> Value {
    let until = Instant::now() + within;
    loop {
        let v = json(&admin(c, &["txn", "show", &txid.to_string(), "--json"]));
        if pred(&v) {
            return v;
        }
        assert!(Instant::now() < until, "transaction {txid} never got there: {v:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t100_inv11_inv12_a_participant_gone_for_good_is_found_explained_and_dropped() {
    let mut c = TestCluster::start_with("t100a", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
        cfg.txn.delivery_retry_max_ms = 500;
    });
    c.leader().await;
    let api = c.procs.api_addrs();
    let mut a = start_bank(common::bin(), c.dir.path(), "bank-a", "a", &api, ACCOUNTS, INITIAL).unwrap();
    let mut b = start_bank(common::bin(), c.dir.path(), "bank-b", "b", &api, ACCOUNTS, INITIAL).unwrap();
    a.wait_started().await.unwrap();
    b.wait_started().await.unwrap();
    let banks = vec![a.spec(), b.spec()];
    let cl = c.client();

    // Some transfers go through while both banks run.
    let mut committed = Vec::new();
    for i in 0..5 {
        if let (Some(t), Ok(TxOutcome::Committed)) = dtx_bank::transfer(&cl, &format!("ok-{i}"), &banks, ACCOUNTS).await
        {
            committed.push(t);
        }
    }
    assert!(!committed.is_empty(), "no transfer committed with both banks up");
    let all = json(&admin(&c, &["txn", "list", "--all", "--json"]));
    for t in &committed {
        assert!(txids(&all).contains(t), "committed {t} not listed: {all:#}");
    }
    let table = ok(&admin(&c, &["txn", "list", "--state", "decided"]));
    assert!(table.starts_with("TXID") && table.contains("DECIDED COMMIT"), "{table}");

    // bank-b is gone for good (kill -9, never restarted). The next transfer
    // is aborted (bank-b cannot vote), and its ABORT can never reach bank-b.
    b.kill9();
    let (stuck, outcome) = dtx_bank::transfer(&cl, "stuck", &banks, ACCOUNTS).await;
    let stuck = stuck.expect("the transfer has a txid");
    assert_eq!(outcome.unwrap(), TxOutcome::Aborted);

    // Found: listed as unacknowledged and in doubt, waiting on bank-b
    // (once bank-a has acked the ABORT).
    show_until(&c, stuck, Duration::from_secs(30), |v| {
        participant(v, "bank-a")["acked"] == true
    })
    .await;
    let unacked = json(&admin(&c, &["txn", "list", "--unacknowledged", "--json"]));
    assert!(txids(&unacked).contains(&stuck), "{unacked:#}");
    assert!(
        committed.iter().all(|t| !txids(&unacked).contains(t)),
        "acked ones listed: {unacked:#}"
    );
    let doubt = json(&admin(&c, &["txn", "in-doubt", "--json"]));
    let row = doubt["in_doubt"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["txid"] == stuck)
        .unwrap_or_else(|| panic!("{stuck} not in doubt: {doubt:#}"))
        .clone();
    assert_eq!(row["waiting"], serde_json::json!(["bank-b"]), "{row:#}");
    let by_participant = json(&admin(
        &c,
        &["txn", "list", "--participant", "bank-b", "--unacknowledged", "--json"],
    ));
    assert_eq!(txids(&by_participant), vec![stuck], "{by_participant:#}");

    // Explained: the leader's delivery attempts and the last error.
    let shown = show_until(&c, stuck, Duration::from_secs(30), |v| {
        participant(v, "bank-b")["delivery_attempts"].as_u64().unwrap_or(0) >= 1
            && !participant(v, "bank-b")["last_delivery_error"]
                .as_str()
                .unwrap_or("")
                .is_empty()
    })
    .await;
    assert_eq!(shown["state"], "DECIDED");
    assert_eq!(shown["decision"]["outcome"], "ABORT");
    assert_eq!(participant(&shown, "bank-b")["acked"], false);
    let timeline = ok(&admin(&c, &["txn", "show", &stuck.to_string()]));
    for want in [
        "DECIDED ABORT",
        "begin",
        "enlisted bank-",
        "decided ABORT by the driver",
        "bank-b",
        "waiting for ack",
    ] {
        assert!(timeline.contains(want), "show lacks {want:?}:\n{timeline}");
    }

    // Repairs are refused where they would break something.
    refused(
        &admin(&c, &["txn", "forget", &stuck.to_string(), "--reason", "too early"]),
        "bank-b",
    );
    refused(
        &admin(
            &c,
            &[
                "txn",
                "drop-participant",
                &committed[0].to_string(),
                "bank-a",
                "--reason",
                "x",
            ],
        ),
        "acked",
    );
    refused(
        &admin(
            &c,
            &["txn", "drop-participant", &stuck.to_string(), "bank-z", "--reason", "x"],
        ),
        "bank-z",
    );
    refused(
        &admin(&c, &["txn", "drop-participant", "999999", "bank-a", "--reason", "x"]),
        "999999",
    );

    // Cleared: dropped with who and why; no longer waited on, and kept
    // (listed as dropped) until it is forgotten.
    let dropped = ok(&admin(
        &c,
        &[
            "txn",
            "drop-participant",
            &stuck.to_string(),
            "bank-b",
            "--operator",
            "alice",
            "--reason",
            "bank-b decommissioned",
        ],
    ));
    assert!(dropped.contains("dropped"), "{dropped}");
    let again = json(&admin(
        &c,
        &[
            "txn",
            "drop-participant",
            &stuck.to_string(),
            "bank-b",
            "--reason",
            "twice",
            "--json",
        ],
    ));
    assert_eq!(again["recorded"], false, "{again:#}");
    let shown = json(&admin(&c, &["txn", "show", &stuck.to_string(), "--json"]));
    let pb = participant(&shown, "bank-b");
    assert_eq!(pb["dropped"], true);
    let note = pb["dropped_note"].as_str().unwrap();
    assert!(
        note.contains("alice") && note.contains("bank-b decommissioned") && !note.contains("twice"),
        "{note}"
    );
    assert!(pb["dropped_unix_ms"].as_u64().unwrap() >= shown["decision"]["decided_unix_ms"].as_u64().unwrap());
    let unacked = json(&admin(&c, &["txn", "list", "--unacknowledged", "--json"]));
    assert!(
        !txids(&unacked).contains(&stuck),
        "still waited on after the drop: {unacked:#}"
    );
    let with_drops = json(&admin(&c, &["txn", "list", "--dropped", "--json"]));
    assert_eq!(txids(&with_drops), vec![stuck], "{with_drops:#}");
    let doubt = ok(&admin(&c, &["txn", "in-doubt"]));
    assert!(!doubt.contains(&format!("\n{stuck} ")), "{doubt}");

    // An ABORT with a dropped participant may be forgotten: if bank-b ever
    // came back, "unknown: presumed abort" is the decision it was owed.
    let f = json(&admin(
        &c,
        &["txn", "forget", &stuck.to_string(), "--reason", "reconciled", "--json"],
    ));
    assert_eq!(f["forgotten"], true, "{f:#}");
    refused(&admin(&c, &["txn", "show", &stuck.to_string()]), "not found");
    let f = json(&admin(
        &c,
        &["txn", "forget", &stuck.to_string(), "--reason", "again", "--json"],
    ));
    assert_eq!(f["forgotten"], false, "{f:#}");

    a.kill9();
}

/// A COMMIT whose participant is dropped can never be forgotten (invariant
/// 10: the participant, if it came back, would presume abort), and a
/// resolve asking for the other outcome is refused (invariant 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t100_inv1_inv10_a_commit_with_a_dropped_participant_is_never_forgotten() {
    let mut c = TestCluster::start_with("t100b", 3, |cfg| {
        cfg.txn.delivery_retry_max_ms = 500;
        cfg.txn.one_phase_commit = false;
    });
    c.leader().await;
    let cl = c.client();
    let a = Svc::new("bank-a").await;
    let b = Svc::new("bank-b").await;
    // bank-b votes YES, then refuses every decision (unreachable for phase
    // two).
    b.hold_decisions.store(true, Ordering::SeqCst);
    let spec = |s: &Svc| ParticipantSpec {
        participant_id: s.id.clone(),
        address: s.addr.clone(),
        payload: b"x".to_vec(),
    };
    let r = cl
        .begin_and_commit("held", 60_000, b"", &[spec(&a), spec(&b)])
        .await
        .unwrap();
    assert_eq!(r.outcome, TxOutcome::Committed);
    let t = r.txid.unwrap();
    show_until(&c, t, Duration::from_secs(30), |v| {
        participant(v, "bank-a")["acked"] == true
    })
    .await;

    refused(
        &admin(&c, &["txn", "resolve", &t.to_string(), "--abort", "--reason", "wrong"]),
        "already decided COMMIT",
    );
    let same = json(&admin(
        &c,
        &[
            "txn",
            "resolve",
            &t.to_string(),
            "--commit",
            "--reason",
            "same",
            "--json",
        ],
    ));
    assert_eq!(same["recorded"], false, "{same:#}");
    // Neither --commit nor --abort: a usage error that names both.
    let o = admin(&c, &["txn", "resolve", &t.to_string(), "--reason", "x"]);
    assert_eq!(o.status.code(), Some(2), "{}", common::output_text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--commit") && err.contains("--abort"), "{err}");

    ok(&admin(
        &c,
        &["txn", "drop-participant", &t.to_string(), "bank-b", "--reason", "gone"],
    ));
    refused(
        &admin(&c, &["txn", "forget", &t.to_string(), "--reason", "tidy"]),
        "presumed abort",
    );
    let shown = json(&admin(&c, &["txn", "show", &t.to_string(), "--json"]));
    assert_eq!(shown["decision"]["outcome"], "COMMIT", "{shown:#}");
    assert_eq!(participant(&shown, "bank-b")["dropped"], true, "{shown:#}");
    let with_drops = json(&admin(&c, &["txn", "list", "--dropped", "--json"]));
    assert_eq!(txids(&with_drops), vec![t], "kept and listed: {with_drops:#}");
}

/// The cluster commands, the drill commands and the exit codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t100_status_drill_and_exit_codes() {
    let mut c = TestCluster::start("t100c");
    let leader = c.leader().await;

    // A cluster just bootstrapped serves once its leader has heard from a
    // quorum and the others hold its membership; until then `status` exits
    // 6, so wait for that first.
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let o = admin(&c, &["status"]);
        if o.status.code() == Some(0) {
            break;
        }
        assert_eq!(o.status.code(), Some(6), "{}", common::output_text(&o));
        assert!(
            Instant::now() < until,
            "no quorum within 20 s: {}",
            common::output_text(&o)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Status: every member answers, as a table and as JSON.
    let table = ok(&admin(&c, &["status"]));
    assert!(table.starts_with("cluster t100c "), "{table}");
    for id in 1..=3 {
        assert!(table.contains(&c.api(id)), "{table}");
    }
    // Output into a pipe nobody reads any more (`status | head -1` once
    // head has its line): the command ends quietly, exit 0, no panic
    // (before: exit 101 and a backtrace).
    for args in [&["status"][..], &["txn", "list"][..], &["status", "--json"][..]] {
        let mut child = std::process::Command::new(common::bin())
            .args(["admin", "--addr", &c.procs.api_addrs().join(",")])
            .args(args)
            .env("RUST_BACKTRACE", "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let o = child.wait_with_output().unwrap();
        assert_eq!(
            o.status.code(),
            Some(0),
            "admin {args:?} into a closed pipe: {}",
            common::output_text(&o)
        );
        assert!(
            o.stderr.is_empty(),
            "admin {args:?} into a closed pipe: {}",
            common::output_text(&o)
        );
    }
    let st = json(&admin(&c, &["status", "--json"]));
    let nodes = st["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3, "{st:#}");
    assert!(nodes.iter().all(|n| n["status"]["cluster_id"] == "t100c"), "{st:#}");
    assert_eq!(st["leader_id"], leader, "{st:#}");

    // A drill transaction from the CLI: begin, enlist, commit; and an abort.
    let a = Svc::new("drill-a").await;
    let begun = json(&admin(&c, &["txn", "begin", "--key", "drill-1", "--json"]));
    let t = begun["txid"].as_u64().unwrap();
    let again = json(&admin(&c, &["txn", "begin", "--key", "drill-1", "--json"]));
    assert_eq!(
        (again["txid"].as_u64(), again["existing"].as_bool()),
        (Some(t), Some(true))
    );
    ok(&admin(
        &c,
        &[
            "txn",
            "enlist",
            &t.to_string(),
            "--participant",
            "drill-a",
            "--address",
            &a.addr,
        ],
    ));
    let out = ok(&admin(&c, &["txn", "commit", &t.to_string()]));
    assert!(out.contains("COMMITTED"), "{out}");
    let t2 = json(&admin(&c, &["txn", "begin", "--key", "drill-2", "--json"]))["txid"]
        .as_u64()
        .unwrap();
    let out = ok(&admin(&c, &["txn", "abort", &t2.to_string(), "--reason", "drill"]));
    assert!(out.contains("ABORTED"), "{out}");
    refused(
        &admin(
            &c,
            &[
                "txn",
                "enlist",
                &t2.to_string(),
                "--participant",
                "late",
                "--address",
                &a.addr,
            ],
        ),
        "",
    );

    // Snapshot, and the leadership transfer that openraft 0.9.25 lacks.
    let s = json(&admin(&c, &["snapshot", "--json"]));
    assert!(s["snapshot_index"].as_u64().unwrap() > 0, "{s:#}");
    refused(&admin(&c, &["transfer-leader", "--to", "2"]), "not offered");

    // Unreachable: nothing listens there; exit 5 after the timeout, not 30 s.
    let nowhere = format!("127.0.0.1:{}", dtx_testkit::cluster::free_port("127.0.0.1").unwrap());
    let o = std::process::Command::new(common::bin())
        .args(["admin", "--addr", &nowhere, "--timeout-s", "1", "status"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(5), "{}", common::output_text(&o));
}

/// Membership from the CLI: `replace-node` adds a fresh node (caught up,
/// then a voter) and removes the old one; the old id is then refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t100_replace_node_swaps_a_member() {
    let mut c = TestCluster::start("t100d");
    let leader = c.leader().await;
    let old = (1..=3).find(|i| *i != leader).unwrap();
    let cl = c.client();
    let t = cl.begin("before-the-swap", 60_000, b"").await.unwrap().txid;

    // Node 4, empty, not bootstrapping, started before it is added.
    let (mut node4, raft, api) = c.start_extra_node(4).await;
    let ip = common::node_ip(4);
    let out = json(&admin(
        &c,
        &[
            "replace-node",
            "--old-node-id",
            &old.to_string(),
            "--node-id",
            "4",
            "--raft-addr",
            &raft,
            "--api-addr",
            &api,
            "--json",
        ],
    ));
    let mut voters: Vec<u64> = out["voters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    voters.sort_unstable();
    let mut want: Vec<u64> = (1..=4).filter(|i| *i != old).collect();
    want.sort_unstable();
    assert_eq!(voters, want, "{out:#}");
    c.procs.kill9(old);

    // The new member holds the replicated state and answers for it.
    let st = dtx_client::cluster_status_at(&api, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(st.members.iter().any(|m| m.node_id == 4 && m.voter), "{st:?}");
    assert!(st.members.iter().all(|m| m.node_id != old), "{st:?}");
    let o = std::process::Command::new(common::bin())
        .args(["admin", "--addr", &api, "txn", "show", &t.to_string(), "--json"])
        .output()
        .unwrap();
    let shown = json(&o);
    assert_eq!(shown["state"], "ACTIVE", "{shown:#}");
    // The old id is never used again.
    let raft5 = format!("{ip}:{}", dtx_testkit::cluster::free_port(&ip).unwrap());
    let api5 = format!("{ip}:{}", dtx_testkit::cluster::free_port(&ip).unwrap());
    refused(
        &admin(
            &c,
            &[
                "add-node",
                "--node-id",
                &old.to_string(),
                "--raft-addr",
                &raft5,
                "--api-addr",
                &api5,
                "--learner",
            ],
        ),
        "never reused",
    );
    node4.kill9();
}
