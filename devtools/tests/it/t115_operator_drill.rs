//! What an operator's drill from docs/operations.md found, against real
//! node processes.
//!
//! - A write the cluster refused (`x-dtx-not-applied: 1`) during majority
//!   loss is a refusal (exit 3), not an unknown outcome (exit 4), even when
//!   some of `--addr` are dead (nothing was sent there).
//! - `admin status` does not look healthy when it is not: exit 6 without a
//!   quorum, `--addr X --json` describes X, a member paused since the leader
//!   was elected has an unknown lag (not the whole log), and `status --check
//!   serving|quorum` answers scripts with exit codes.
//! - Bulk repairs: `txn drop-participant --participant X --all` and `txn
//!   forget --participant X --all`, each with `--dry-run` and a count.
//! - `--operator` with an empty `$USER`, `txn show` after an operator's
//!   forget, a backup into a missing folder, and every key of the example
//!   configuration documented in docs/operations.md.
//!
//! Every wait polls with a generous bound; nothing depends on timing.

use crate::common;

use std::process::Output;
use std::time::Duration;
use std::time::Instant;

use common::admin::json;
use common::admin::ok;
use common::participants::Svc;
use common::TestCluster;
use dtx_client::TxOutcome;
use serde_json::Value;

/// Far above an election (about 1 s) on a loaded machine.
const WAIT: Duration = Duration::from_secs(60);

/// `coordinator admin --addr <addrs> <args>` with `env` set.
fn admin_at(addrs: &[String], args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = std::process::Command::new(common::bin());
    cmd.args(["admin", "--addr", &addrs.join(",")])
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env("USER", "t115-operator");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run coordinator admin")
}

fn admin(c: &TestCluster, args: &[&str]) -> Output {
    admin_at(&c.procs.api_addrs(), args, &[])
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn code(o: &Output) -> Option<i32> {
    o.status.code()
}

/// Runs `f` until it returns `Some` (at most [`WAIT`]).
async fn until<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < WAIT, "never: {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Refusals and `admin status`: a healthy cluster, a paused leader, then
/// majority loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t115_status_checks_lag_and_refused_writes_through_a_pause_and_majority_loss() {
    let mut c = TestCluster::start("t115a");
    let first = c.leader().await;
    let cl = c.client();
    for i in 0..5 {
        cl.begin(&format!("a{i}"), 600_000, b"").await.unwrap();
    }
    let all = c.procs.api_addrs();

    // Healthy: both checks hold (polled: a new leader serves once it has
    // heard from a majority), and plain status exits 0 saying so.
    until("the cluster has a quorum", || {
        (code(&admin(&c, &["status", "--check", "quorum"])) == Some(0)).then_some(())
    })
    .await;
    until("every node serves", || {
        (code(&admin(&c, &["status", "--check", "serving"])) == Some(0)).then_some(())
    })
    .await;
    let table = ok(&admin(&c, &["status"]));
    let head = table.lines().next().unwrap();
    assert!(
        head.starts_with("cluster t115a ") && head.contains("quorum: yes"),
        "{table}"
    );

    // `--addr X --json`: the top level is X's own view, not the leader's.
    let follower = (1..=3).find(|i| *i != first).unwrap();
    let v = json(&admin_at(&[c.api(follower)], &["status", "--json"], &[]));
    assert_eq!(v["node_id"], follower, "--addr names node {follower}: {v:#}");
    assert_eq!(v["role"], "Follower", "{v:#}");
    assert_eq!(v["leader_id"], first, "{v:#}");
    assert_eq!(v["quorum"], true, "{v:#}");

    // Pause the leader (SIGSTOP): the others elect a new one, which has
    // never heard from the paused node, so its lag is not known: `?` and
    // null, not the whole log.
    c.procs.signal(first, libc::SIGSTOP);
    let others: Vec<String> = (1..=3).filter(|i| *i != first).map(|i| c.api(i)).collect();
    let second = until("a new leader serves", || {
        let o = admin_at(
            &others,
            &["status", "--check", "quorum", "--json", "--timeout-s", "3"],
            &[],
        );
        let v: Value = serde_json::from_slice(&o.stdout).ok()?;
        v["leader_id"].as_u64().filter(|l| *l != first)
    })
    .await;
    let oc = dtx_client::Client::new(dtx_client::ClientConfig::new(others.clone())).unwrap();
    for i in 0..5 {
        oc.begin(&format!("b{i}"), 600_000, b"").await.unwrap();
    }
    let v = json(&admin_at(
        &[c.api(second)],
        &["status", "--json", "--timeout-s", "3"],
        &[],
    ));
    let paused = v["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["node_id"] == first)
        .unwrap_or_else(|| panic!("{v:#}"))
        .clone();
    assert!(
        paused["lag_entries"].is_null(),
        "the paused node's lag is not known to the new leader, not the whole log: {paused:#} (last log index {})",
        v["last_log_index"]
    );
    let table = ok(&admin_at(&[c.api(second)], &["status", "--timeout-s", "3"], &[]));
    let row = table
        .lines()
        .find(|l| l.starts_with(&first.to_string()) && l.contains(&c.api(first)))
        .unwrap_or_else(|| panic!("no row for node {first}: {table}"));
    let cells: Vec<&str> = row.split_whitespace().collect();
    // NODE API KIND ROLE SERVING TERM APPLIED LAG ...: a member that does
    // not answer shows "NO ANSWER" (two words) as SERVING.
    assert!(cells.contains(&"?"), "LAG of the paused node is ?: {row}");
    // The paused node is not serving as far as a script can tell (it does
    // not answer: exit 5), while the others serve.
    let o = admin_at(
        &[c.api(first)],
        &["status", "--check", "serving", "--timeout-s", "2"],
        &[],
    );
    assert_eq!(code(&o), Some(5), "{}", common::output_text(&o));
    c.procs.signal(first, libc::SIGCONT);

    // Majority loss: kill the leader and one other; the survivor stops
    // serving (it may still name the dead leader: a node that reaches no
    // quorum does not campaign, so nothing replaces it).
    let leader = c.leader().await;
    let other = (1..=3).find(|i| *i != leader).unwrap();
    let survivor = (1..=3).find(|i| *i != leader && *i != other).unwrap();
    c.procs.kill9(leader);
    c.procs.kill9(other);
    until("the survivor does not serve", || {
        let o = admin_at(&[c.api(survivor)], &["status", "--json", "--timeout-s", "2"], &[]);
        let v: Value = serde_json::from_slice(&o.stdout).ok()?;
        (v["serving"] == false).then_some(())
    })
    .await;

    // Status says so, and exits 6 (it exited 0).
    let o = admin_at(&all, &["status", "--timeout-s", "3"], &[]);
    assert_eq!(code(&o), Some(6), "{}", common::output_text(&o));
    let head = stdout(&o).lines().next().unwrap_or("").to_string();
    assert!(head.contains("NO QUORUM"), "first line: {}", common::output_text(&o));
    // The first line never presents the dead leader as the leader.
    assert!(
        !head.contains(&format!("leader {leader} ")) || head.contains("does not answer"),
        "first line: {head}"
    );
    assert!(stderr(&o).contains("NO QUORUM"), "{}", common::output_text(&o));
    let o = admin_at(&all, &["status", "--check", "quorum", "--timeout-s", "3"], &[]);
    assert_eq!(code(&o), Some(6), "{}", common::output_text(&o));
    let o = admin_at(
        &[c.api(survivor)],
        &["status", "--check", "serving", "--timeout-s", "3"],
        &[],
    );
    assert_eq!(code(&o), Some(6), "{}", common::output_text(&o));
    assert!(stdout(&o).contains("does NOT serve"), "{}", common::output_text(&o));

    // Writes the survivor refuses as not applied are refusals (exit 3),
    // although the dead nodes come first in --addr and were never reached.
    let o = admin_at(&all, &["txn", "begin", "--key", "refused", "--timeout-s", "4"], &[]);
    assert_eq!(code(&o), Some(3), "a refused write: {}", common::output_text(&o));
    assert!(stderr(&o).contains("not applied"), "{}", common::output_text(&o));
    assert_eq!(stderr(&o).trim_end().lines().count(), 1, "{}", common::output_text(&o));
    let o = admin_at(
        &all,
        &[
            "add-node",
            "--node-id",
            "9",
            "--raft-addr",
            "127.0.0.1:1",
            "--api-addr",
            "127.0.0.1:2",
            "--timeout-s",
            "4",
        ],
        &[],
    );
    assert_eq!(
        code(&o),
        Some(3),
        "a refused membership change: {}",
        common::output_text(&o)
    );
    // The client library: a definite refusal, not UNKNOWN.
    let mut cfg = dtx_client::ClientConfig::new(all.clone());
    cfg.call_deadline = Duration::from_secs(4);
    let refused = dtx_client::Client::new(cfg)
        .unwrap()
        .begin("refused-2", 60_000, b"")
        .await;
    assert!(
        matches!(refused, Err(dtx_client::ClientError::NotApplied(_))),
        "{refused:?}"
    );
    c.procs.stop_all(Duration::from_secs(5));
}

/// The txids `txn list --json` printed.
fn txids(v: &Value) -> Vec<u64> {
    v["transactions"]
        .as_array()
        .expect("transactions")
        .iter()
        .map(|t| t["txid"].as_u64().unwrap())
        .collect()
}

/// Bulk repair, `--operator` with an empty `$USER`, and `txn show` after an
/// operator's forget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t115_one_command_drops_and_forgets_every_transaction_stuck_on_a_dead_participant() {
    let mut c = TestCluster::start_with("t115b", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
        cfg.txn.delivery_retry_max_ms = 500;
    });
    c.leader().await;
    let cl = c.client();
    let live = Svc::new("live").await;
    // Nothing listens there: the participant is gone for good.
    let gone = format!("127.0.0.1:{}", dtx_testkit::cluster::free_port("127.0.0.1").unwrap());
    let mut stuck = Vec::new();
    for i in 0..4 {
        let t = cl.begin(&format!("stuck-{i}"), 60_000, b"").await.unwrap().txid;
        cl.enlist(t, "live", &live.addr, b"x").await.unwrap();
        cl.enlist(t, "gone", &gone, b"x").await.unwrap();
        assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Aborted);
        stuck.push(t);
    }
    // One without the dead participant: never selected.
    let fine = cl.begin("fine", 60_000, b"").await.unwrap().txid;
    cl.enlist(fine, "live", &live.addr, b"x").await.unwrap();
    cl.commit(fine).await.unwrap();
    // The live participant acks every ABORT; "gone" never does.
    until("the live participant acked", || {
        let v = json(&admin(&c, &["txn", "list", "--participant", "gone", "--json"]));
        v["transactions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| {
                t["participants"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|p| p["id"] == "live" && p["acked"] == true)
            })
            .then_some(())
    })
    .await;

    // A dry run counts and changes nothing.
    let v = json(&admin(
        &c,
        &[
            "txn",
            "drop-participant",
            "--participant",
            "gone",
            "--all",
            "--dry-run",
            "--reason",
            "drill",
            "--json",
        ],
    ));
    assert_eq!(v["count"], stuck.len(), "{v:#}");
    assert_eq!(v["dry_run"], true);
    let mut listed: Vec<u64> = v["txids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    listed.sort();
    assert_eq!(listed, stuck);
    assert!(txids(&json(&admin(&c, &["txn", "list", "--dropped", "--json"]))).is_empty());

    // One command drops "gone" from all of them, recorded with who and why.
    let out = ok(&admin(
        &c,
        &[
            "txn",
            "drop-participant",
            "--participant",
            "gone",
            "--all",
            "--reason",
            "bank gone for good",
        ],
    ));
    assert!(
        out.contains(&format!("from phase two of {} transaction(s)", stuck.len())),
        "{out}"
    );
    let mut dropped = txids(&json(&admin(&c, &["txn", "list", "--dropped", "--json"])));
    dropped.sort();
    assert_eq!(dropped, stuck);
    // Again: nothing left to drop.
    let v = json(&admin(
        &c,
        &[
            "txn",
            "drop-participant",
            "--participant",
            "gone",
            "--all",
            "--reason",
            "again",
            "--json",
        ],
    ));
    assert_eq!(v["count"], 0, "{v:#}");

    // Forget them all in one command, with an empty $USER and no
    // --operator (this used to fail).
    let v = json(&admin(
        &c,
        &[
            "txn",
            "forget",
            "--participant",
            "gone",
            "--all",
            "--dry-run",
            "--reason",
            "drill",
            "--json",
        ],
    ));
    assert_eq!(v["count"], stuck.len(), "{v:#}");
    let o = admin_at(
        &c.procs.api_addrs(),
        &[
            "txn",
            "forget",
            "--participant",
            "gone",
            "--all",
            "--reason",
            "reconciled by hand",
        ],
        &[("USER", ""), ("LOGNAME", "")],
    );
    let out = ok(&o);
    assert!(out.contains(&format!("forgot {} transaction(s)", stuck.len())), "{out}");
    let left = json(&admin(&c, &["txn", "list", "--participant", "gone", "--json"]));
    assert!(txids(&left).is_empty(), "{left:#}");
    let kept = json(&admin(&c, &["txn", "show", &fine.to_string(), "--json"]));
    assert_eq!(kept["txid"], fine);

    // `txn show` of a transaction an operator forgot does not say
    // every participant acked ("gone" never did).
    let o = admin(&c, &["txn", "show", &stuck[0].to_string()]);
    assert_eq!(code(&o), Some(3), "{}", common::output_text(&o));
    assert!(
        stderr(&o).contains("by an operator") && !stderr(&o).contains("forgotten after every participant acked"),
        "{}",
        common::output_text(&o)
    );
    // An empty $USER with --operator given works too.
    let o = admin_at(
        &c.procs.api_addrs(),
        &[
            "txn",
            "forget",
            &stuck[0].to_string(),
            "--operator",
            "alice",
            "--reason",
            "again",
        ],
        &[("USER", "")],
    );
    assert!(ok(&o).contains("no record"), "{}", common::output_text(&o));
    c.procs.stop_all(Duration::from_secs(5));
}

/// A backup into a folder that does not exist is a local error
/// that names no node.
#[test]
fn t115_a_backup_into_a_missing_folder_blames_the_local_path_not_a_node() {
    let dir = common::test_dir();
    let out = dir.path().join("no-such-folder").join("b.dtxbak");
    let addr = format!("127.0.0.1:{}", dtx_testkit::cluster::free_port("127.0.0.1").unwrap());
    let o = admin_at(
        std::slice::from_ref(&addr),
        &["backup", "--out", out.to_str().unwrap()],
        &[],
    );
    assert_eq!(code(&o), Some(1), "{}", common::output_text(&o));
    let err = stderr(&o);
    assert!(!err.contains(&addr), "a local path blamed on node {addr}: {err}");
    assert!(err.contains("does not exist"), "{err}");
    assert!(!err.contains("Some("), "{err}");
}

/// Every key of etc/coordinator.example.toml has a row in its
/// section's table of docs/operations.md ("Configuration reference").
#[test]
fn t115_every_key_of_the_example_configuration_is_documented() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let example = std::fs::read_to_string(root.join("etc/coordinator.example.toml")).unwrap();
    let ops = std::fs::read_to_string(root.join("docs/operations.md")).unwrap();
    let reference = ops
        .split("\n## Configuration reference")
        .nth(1)
        .and_then(|r| r.split("\n## ").next())
        .expect("a Configuration reference chapter");
    // The text of the `### ...` section whose heading contains `heading`.
    let section = |heading: &str| -> String {
        reference
            .split("\n### ")
            .find(|s| s.lines().next().is_some_and(|h| h.contains(heading)))
            .unwrap_or_else(|| panic!("no section {heading} in the configuration reference"))
            .to_string()
    };
    let table: toml::Table = example.parse().expect("the example parses");
    let mut missing = Vec::new();
    for (key, value) in &table {
        match value {
            toml::Value::Table(t) => {
                let s = section(&format!("`[{key}]`"));
                for k in t.keys() {
                    if !s.contains(&format!("| `{k}` |")) {
                        missing.push(format!("{key}.{k}"));
                    }
                }
            }
            _ => {
                if !section("Top level").contains(&format!("| `{key}` |")) {
                    missing.push(key.clone());
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "keys of etc/coordinator.example.toml without a row in docs/operations.md: {missing:?}"
    );
}
