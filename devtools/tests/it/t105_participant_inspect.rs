//! A participant's view, from the operator's command line. A real three-node
//! cluster and a real bank participant process; a transaction is left in
//! doubt at the bank (it voted YES, and the other participant is slow to
//! vote, so no decision exists yet: the bank holds its locks and may not
//! decide alone, invariant 5). `coordinator admin participant --address
//! <bank> --in-doubt --json` shows it, with its vote and the term it saw;
//! `--txid` shows a record in any state and a txid the bank never saw as NONE
//! (without leaving a tombstone there, invariant 8); once the decision is
//! delivered the bank no longer holds it in doubt. Limits are refused (exit
//! 3, naming the limit), and a participant that does not answer is
//! unreachable (exit 5).

use crate::common;

use std::process::Output;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use common::participants::Svc;
use common::TestCluster;
use dtx_testkit::cluster::start_bank;
use serde_json::Value;

const ACCOUNTS: usize = 10;
const INITIAL: i64 = 1_000;
/// How long the slow voter's Prepare waits: the bank stays in doubt that
/// long.
const SLOW_VOTE_MS: u64 = 10_000;

/// `coordinator admin participant --address <addr> <args>`.
fn inspect(addr: &str, args: &[&str]) -> Output {
    std::process::Command::new(common::bin())
        .args(["admin", "participant", "--address", addr])
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .expect("run coordinator admin participant")
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn ok(o: &Output) -> String {
    assert_eq!(o.status.code(), Some(0), "{}", text(o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json(o: &Output) -> Value {
    serde_json::from_str(&ok(o)).unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(o)))
}

/// The entry of `txid` in the list `key` of an answer.
fn entry<'a>(v: &'a Value, key: &str, txid: u64) -> Option<&'a Value> {
    v[key].as_array().expect(key).iter().find(|r| r["txid"] == txid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t105_inv5_a_transaction_in_doubt_at_a_real_bank_is_shown_by_admin_participant() {
    let mut c = TestCluster::start_with("t105", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 4 * SLOW_VOTE_MS;
    });
    c.leader().await;
    let api = c.procs.api_addrs();
    let mut bank = start_bank(common::bin(), c.dir.path(), "bank-a", "a", &api, ACCOUNTS, INITIAL).unwrap();
    bank.wait_started().await.unwrap();
    let bank_addr = bank.addr.clone();
    let slow = Svc::new("slow").await;
    slow.prepare_delay_ms.store(SLOW_VOTE_MS, Ordering::SeqCst);

    // Before any transaction: nothing in doubt; the default is --in-doubt.
    let v = json(&inspect(&bank_addr, &["--json"]));
    assert_eq!(v["participant_id"], "bank-a", "{v:#}");
    assert_eq!(v["in_doubt_count"], 0, "{v:#}");
    assert_eq!(v["in_doubt"], Value::Array(vec![]), "{v:#}");

    // A transaction on the bank and the slow voter: the bank votes YES at
    // once and then waits for a decision that cannot exist before the
    // slow vote.
    let cl = c.client();
    let txid = cl.begin("t105", 4 * SLOW_VOTE_MS, b"").await.unwrap().txid;
    cl.enlist(txid, "bank-a", &bank_addr, b"a0:-5").await.unwrap();
    cl.enlist(txid, "slow", &slow.addr, b"x").await.unwrap();
    let committing = {
        let cl = c.client();
        tokio::spawn(async move { cl.commit(txid).await })
    };
    let asked = Instant::now();
    let v = loop {
        let v = json(&inspect(&bank_addr, &["--in-doubt", "--json"]));
        if entry(&v, "in_doubt", txid).is_some() {
            break v;
        }
        assert!(
            asked.elapsed() < Duration::from_millis(SLOW_VOTE_MS / 2),
            "transaction {txid} never shown in doubt at the bank: {v:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let e = entry(&v, "in_doubt", txid).unwrap();
    assert_eq!(e["state"], "PREPARED_YES", "{v:#}");
    assert_eq!(e["vote"], "YES", "{v:#}");
    assert_eq!(e["in_doubt"], true, "{v:#}");
    assert!(e["term"].as_u64().unwrap() >= 1, "the leader's term: {v:#}");
    assert!(e["recorded_unix_ms"].as_u64().is_some(), "voted by this process: {v:#}");
    assert_eq!(v["in_doubt_count"], 1, "{v:#}");
    assert!(v["records_total"].as_u64().unwrap() >= 1, "{v:#}");
    let term = e["term"].as_u64().unwrap();
    // The incarnation the cluster handed the txid out in: a participant
    // keys its records by (incarnation, txid).
    let incarnation = e["incarnation"].as_str().unwrap().to_string();
    assert_eq!(incarnation.len(), 16, "{v:#}");

    // The same as a table, and by txid (with one the bank never saw).
    let table = ok(&inspect(&bank_addr, &["--in-doubt"]));
    assert!(
        table.contains("participant bank-a") && table.contains("PREPARED_YES") && table.contains("yes (locks held)"),
        "{table}"
    );
    let never = txid + 1_000_000;
    let v = json(&inspect(
        &bank_addr,
        &[
            "--txid",
            &txid.to_string(),
            "--txid",
            &never.to_string(),
            "--incarnation",
            &incarnation,
            "--json",
        ],
    ));
    assert_eq!(entry(&v, "records", txid).unwrap()["state"], "PREPARED_YES", "{v:#}");
    let unseen = entry(&v, "records", never).unwrap();
    assert_eq!(unseen["state"], "NONE", "{v:#}");
    assert_eq!(unseen["vote"], Value::Null, "{v:#}");
    assert_eq!(unseen["recorded_unix_ms"], Value::Null, "{v:#}");

    // Limits are refused, naming the limit; a participant that does not
    // answer is unreachable.
    let o = inspect(&bank_addr, &["--recent", "1001"]);
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("INSPECT_RECORDS_MAX"),
        "{}",
        text(&o)
    );
    let nobody = format!("127.0.0.1:{}", dtx_testkit::cluster::free_port("127.0.0.1").unwrap());
    let o = inspect(&nobody, &["--json", "--timeout-s", "3"]);
    assert_eq!(o.status.code(), Some(5), "{}", text(&o));

    // The slow voter votes; the decision reaches the bank, which no
    // longer holds the transaction in doubt.
    let outcome = tokio::time::timeout(Duration::from_millis(4 * SLOW_VOTE_MS), committing)
        .await
        .expect("the commit call returns")
        .unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    let v = loop {
        let v = json(&inspect(
            &bank_addr,
            &[
                "--txid",
                &txid.to_string(),
                "--incarnation",
                &incarnation,
                "--recent",
                "5",
                "--json",
            ],
        ));
        if v["in_doubt_count"] == 0 {
            break v;
        }
        assert!(Instant::now() < until, "the decision never reached the bank: {v:#}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let r = entry(&v, "records", txid).unwrap();
    assert_eq!(r["in_doubt"], false, "{v:#}");
    // The commit call may have given up waiting (UNKNOWN): then either.
    let expected: &[&str] = match outcome {
        Ok(dtx_client::TxOutcome::Committed) => &["COMMITTED"],
        Ok(dtx_client::TxOutcome::Aborted) => &["ABORTED"],
        _ => &["COMMITTED", "ABORTED"],
    };
    assert!(
        expected.iter().any(|s| r["state"] == *s),
        "expected {expected:?}: {v:#}"
    );
    assert!(r["term"].as_u64().unwrap() >= term, "{v:#}");
    assert!(entry(&v, "recent", txid).is_some(), "the newest record: {v:#}");
    // Asking about a txid left no record for it (no tombstone).
    let v = json(&inspect(
        &bank_addr,
        &["--txid", &never.to_string(), "--incarnation", &incarnation, "--json"],
    ));
    assert_eq!(entry(&v, "records", never).unwrap()["state"], "NONE", "{v:#}");
    bank.stop(Duration::from_secs(5));
}
