//! The restore drill of docs/operations.md as tests, and two clusters sharing
//! one participant id (invariant 10: a txid is never reused, not across a
//! restore from backup, not by another cluster that shares a participant;
//! invariants 3 and 4: no split transaction, a COMMIT told to a client is
//! applied; ADR 0033, cluster incarnations).
//!
//! - `t107_inv10_a_restore_done_by_the_runbook_reuses_no_txid_a_participant_holds`:
//!   the numbered steps of docs/operations.md "Restoring a cluster", no
//!   `--skip-txids`. An old three-node cluster moves money between two bank
//!   processes, is backed up, and goes on: its later transfers take txids
//!   past the backup's next txid, and one more leaves bank-b holding a YES
//!   vote with no decision (the other participant's Prepare is held, then
//!   every node is SIGKILLed). A new cluster is restored from the backup
//!   and the banks are pointed at it. Its transfers get txid numbers the
//!   banks already hold from the old cluster (the test checks that they
//!   overlap, so the case is really exercised): every one of them is
//!   applied (balances and apply logs count every transfer of both
//!   clusters exactly once), and bank-b's in-doubt vote of the old cluster
//!   is kept, not presumed aborted, after its recovery asked the new
//!   cluster about it. Before incarnations the new transfers on reused
//!   numbers were answered from the banks' old records and never applied
//!   (a COMMIT reported but not applied, or applied by one bank only), and
//!   the in-doubt vote was rolled back as "unknown: presumed abort".
//!   Then step 8's procedure (ADR 0040, invariant 5: a participant leaves
//!   PREPARED YES only on a recorded decision): `admin txn settle-other`
//!   refuses the new cluster's own txid, incarnation 0 and a COMMIT
//!   without evidence, records ABORT for the old incarnation's txid (its
//!   participants asked first), reads it back on a repeat and refuses a
//!   conflicting COMMIT (exit 3); bank-b's recovery applies it, so the
//!   vote is no longer in doubt (`admin participant --in-doubt` is empty)
//!   and its lock is released (a transfer on that account, refused before,
//!   commits after). Before this the vote and its lock were held for ever:
//!   no command recorded a verdict for another incarnation's txid.
//! - `t107_inv10_two_clusters_sharing_a_participant_id_keep_their_txids_apart`:
//!   two independent clusters (staging and production, say) both enlist the
//!   same bank process, `bank-a`, each with a bank of its own on the other
//!   side. Both count txids from the start, so they hand out the same
//!   numbers; every transfer of each is applied at bank-a once.

use crate::common;

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use common::bin;
use common::participants::Svc;
use common::TestCluster;
use coordinator::config::Config;
use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::DecisionRead;
use dtx_client::TxOutcome;
use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use dtx_testkit::cluster::start_bank;
use dtx_testkit::cluster::BankProcess;
use dtx_testkit::cluster::ProcessCluster;
use participant_sdk::store::ParticipantStore;

const ACCOUNTS: usize = 5;
/// Accounts 0..MOVED_ACCOUNTS carry the transfers; the last one is left
/// for the in-doubt transaction, whose lock it keeps.
const MOVED_ACCOUNTS: usize = 4;
const INITIAL: i64 = 100;

fn tune(c: &mut Config) {
    // Small txid reservations, so a few dozen transfers after the backup
    // carry the old cluster past the backup's next txid.
    c.txn.txid_reserve_count = 16;
    // Long enough that the Prepare held below is still outstanding (no
    // ABORT decided) when the old cluster is killed.
    c.txn.prepare_timeout_ms = 60_000;
    c.txn.delivery_retry_max_ms = 500;
}

fn run(args: &[&std::ffi::OsStr]) -> Output {
    std::process::Command::new(bin())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run coordinator")
}

async fn wait_acked(cl: &Client, txid: u64, timeout: Duration) -> bool {
    let until = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < until {
        if let Ok(s) = cl.status(txid).await {
            if s.participants.iter().all(|p| p.acked) {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Moves 1 from `from`'s account `acct` to `to`'s, step by step (Begin,
/// Enlist both, Commit: two-phase), and waits until both applied it.
async fn transfer(cl: &Client, key: &str, from: &BankProcess, to: &BankProcess, acct: usize) -> u64 {
    let t = cl.begin(key, 600_000, b"").await.unwrap().txid;
    let debit = format!("{}{acct}:-1", from.prefix);
    let credit = format!("{}{acct}:1", to.prefix);
    cl.enlist(t, &from.id, &from.addr, debit.as_bytes()).await.unwrap();
    cl.enlist(t, &to.id, &to.addr, credit.as_bytes()).await.unwrap();
    assert_eq!(
        cl.commit(t).await.unwrap(),
        TxOutcome::Committed,
        "transfer {key} (txid {t})"
    );
    assert!(
        wait_acked(cl, t, Duration::from_secs(30)).await,
        "transfer {key} (txid {t}) not acked by both banks: {:?}",
        cl.status(t).await
    );
    t
}

/// As `transfer`, but the outcome is returned, not asserted (and nothing
/// is waited for when it is not COMMIT).
async fn try_transfer(cl: &Client, key: &str, from: &BankProcess, to: &BankProcess, acct: usize) -> (u64, TxOutcome) {
    let t = cl.begin(key, 600_000, b"").await.unwrap().txid;
    let debit = format!("{}{acct}:-1", from.prefix);
    let credit = format!("{}{acct}:1", to.prefix);
    cl.enlist(t, &from.id, &from.addr, debit.as_bytes()).await.unwrap();
    cl.enlist(t, &to.id, &to.addr, credit.as_bytes()).await.unwrap();
    (t, cl.commit(t).await.unwrap())
}

/// The incarnation a cluster hands txids out in (asked of the record of
/// one of its own transactions).
async fn incarnation_of(cl: &Client, txid: u64) -> u64 {
    let s = cl.status(txid).await.unwrap();
    assert_ne!(s.incarnation, 0, "txid {txid} of a cluster with no incarnation");
    s.incarnation
}

/// What a bank process answers about its log (Inspect, read-only).
async fn inspect(addr: &str, req: pb::InspectParticipantRequest) -> pb::InspectParticipantResponse {
    let ch = dtx_transport::channel::channel_with(addr, None, Duration::from_secs(2), None).unwrap();
    ParticipantServiceClient::new(ch)
        .inspect(req)
        .await
        .unwrap_or_else(|s| panic!("inspect {addr}: {s}"))
        .into_inner()
}

/// Kills `bank` and starts the same service (same id, address and data
/// directory) asking `cluster` for its recovery: step 7 of the runbook.
fn repoint(bank: &mut BankProcess, dir: &Path, cluster: &[String]) -> BankProcess {
    bank.kill9();
    let port: u16 = bank.addr.rsplit(':').next().unwrap().parse().unwrap();
    let mut b = BankProcess::new(
        bin(),
        dir,
        &bank.id,
        &bank.prefix,
        &bank.ip,
        port,
        cluster.to_vec(),
        ACCOUNTS,
        INITIAL,
    );
    b.start(&[]).unwrap();
    b
}

/// A bank's apply log: each applied decision with its incarnation.
type ApplyLog = Vec<(participant_sdk::GlobalTxid, String)>;

/// A stopped bank's balances and its apply log with incarnations.
fn bank_state(bank: &BankProcess) -> (Vec<(String, i64)>, ApplyLog) {
    let store = ParticipantStore::open(&bank.data_dir, dtx_bank::Bank).unwrap();
    let balances = dtx_bank::balances(&store).unwrap();
    let log = dtx_bank::apply_log_in(&store).unwrap();
    (balances, log)
}

fn balance(balances: &[(String, i64)], acct: &str) -> i64 {
    balances
        .iter()
        .find(|(a, _)| a == acct)
        .unwrap_or_else(|| panic!("no account {acct} in {balances:?}"))
        .1
}

/// Every (incarnation, txid) appears once in the apply log, and the
/// COMMITs are exactly `want` (order aside).
fn assert_applied_once(who: &str, log: &[(participant_sdk::GlobalTxid, String)], want: &[(u64, u64)]) {
    let mut seen = std::collections::BTreeSet::new();
    for (t, _) in log {
        assert!(seen.insert((t.incarnation, t.txid)), "{who} applied {t} twice: {log:?}");
    }
    let mut commits: Vec<(u64, u64)> = log
        .iter()
        .filter(|(_, o)| o == "COMMIT")
        .map(|(t, _)| (t.incarnation, t.txid))
        .collect();
    commits.sort();
    let mut want = want.to_vec();
    want.sort();
    assert_eq!(commits, want, "{who}'s applied COMMITs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t107_inv10_a_restore_done_by_the_runbook_reuses_no_txid_a_participant_holds() {
    let mut old = TestCluster::start_with("t107-old", 3, tune);
    let leader = old.leader().await;
    let cl = old.client();
    let work = common::test_dir();
    let addrs = old.procs.api_addrs();
    let mut bank_a = start_bank(bin(), work.path(), "bank-a", "a", &addrs, ACCOUNTS, INITIAL).unwrap();
    let mut bank_b = start_bank(bin(), work.path(), "bank-b", "b", &addrs, ACCOUNTS, INITIAL).unwrap();
    bank_a.wait_started().await.unwrap();
    bank_b.wait_started().await.unwrap();

    // Work before the backup.
    let mut old_txids = Vec::new();
    for i in 0..4 {
        old_txids.push(transfer(&cl, &format!("before-{i}"), &bank_a, &bank_b, i % MOVED_ACCOUNTS).await);
    }
    let old_inc = incarnation_of(&cl, old_txids[0]).await;

    // The backup (step 2's input).
    let file = work.path().join("cluster.dtxbak");
    let o = run(&[
        "admin".as_ref(),
        "--addr".as_ref(),
        old.api(leader).as_ref(),
        "backup".as_ref(),
        "--out".as_ref(),
        file.as_os_str(),
    ]);
    assert!(o.status.success(), "{}", common::output_text(&o));
    let backed_up_next = coordinator::backup::read_backup(&file).unwrap().header.next_txid;

    // The old cluster goes on after the backup, past the backup's next
    // txid: the numbers a restored cluster counts from again.
    let mut after_backup = Vec::new();
    let mut i = 0;
    while after_backup.iter().filter(|t| **t >= backed_up_next).count() < 6 {
        assert!(
            i < 200,
            "the old cluster never went past txid {backed_up_next}: {after_backup:?}"
        );
        after_backup.push(transfer(&cl, &format!("after-{i}"), &bank_a, &bank_b, i % MOVED_ACCOUNTS).await);
        i += 1;
    }
    old_txids.extend(&after_backup);

    // One more: bank-b votes YES; the other participant's Prepare is held,
    // so no decision is made before every node of the old cluster dies.
    let held = Svc::new("held").await;
    held.prepare_delay_ms
        .store(120_000, std::sync::atomic::Ordering::SeqCst);
    let in_doubt = cl.begin("in-doubt", 600_000, b"").await.unwrap().txid;
    let last = format!("b{}:1", ACCOUNTS - 1);
    cl.enlist(in_doubt, &bank_b.id, &bank_b.addr, last.as_bytes())
        .await
        .unwrap();
    cl.enlist(in_doubt, &held.id, &held.addr, b"work").await.unwrap();
    let cl_commit = std::sync::Arc::new(old.client());
    let committing = tokio::spawn(async move { cl_commit.commit(in_doubt).await });
    let until = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let r = inspect(
            &bank_b.addr,
            pb::InspectParticipantRequest {
                in_doubt: true,
                ..Default::default()
            },
        )
        .await;
        if r.in_doubt
            .iter()
            .any(|x| x.txid == in_doubt && x.incarnation == old_inc)
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "bank-b never voted on {in_doubt}: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Step 1: the old cluster is gone for good.
    for id in 1..=3 {
        old.procs.kill9(id);
    }
    // Its Commit call can only end in an error now (held never voted).
    committing.abort();

    // Steps 2 to 5, as numbered: verify, write the new configurations,
    // restore each node from the same file (no --skip-txids), start
    // without --bootstrap.
    let o = run(&[
        "restore".as_ref(),
        "--backup".as_ref(),
        file.as_os_str(),
        "--verify".as_ref(),
    ]);
    assert!(o.status.success(), "{}", common::output_text(&o));
    let mut new = ProcessCluster::new(
        bin(),
        &work.path().join("new"),
        "t107-new",
        common::local_plans(3),
        |c| {
            tune(c);
            c.bootstrap.enabled = false;
        },
    )
    .unwrap();
    let mut restore_ids = Vec::new();
    for id in 1..=3u64 {
        let o = run(&[
            "restore".as_ref(),
            "--backup".as_ref(),
            file.as_os_str(),
            "--config".as_ref(),
            new.node(id).config_path.as_os_str(),
        ]);
        assert!(o.status.success(), "restore of node {id}: {}", common::output_text(&o));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        restore_ids.push(
            out.split("restore id ")
                .nth(1)
                .and_then(|r| r.split_whitespace().next())
                .expect("a restore id")
                .to_string(),
        );
    }
    assert!(restore_ids.iter().all(|r| *r == restore_ids[0]), "{restore_ids:?}");
    new.start_all().unwrap();
    new.wait_for_leader(Duration::from_secs(30)).await.expect("a leader");
    // Step 6: the backup's decisions are there; what the old cluster did
    // after it is not.
    let cl2 = Client::new(ClientConfig::new(new.api_addrs())).unwrap();
    for t in &old_txids[..4] {
        let s = cl2.status(*t).await.unwrap();
        assert_eq!(
            s.decision.as_ref().map(|d| d.outcome),
            Some(pb::Outcome::Commit as i32),
            "txid {t} of the backup after the restore: {s:?}"
        );
        assert_eq!(s.incarnation, old_inc);
    }

    // Step 7: the participants are pointed at the new cluster.
    let new_addrs = new.api_addrs();
    let mut bank_a = repoint(&mut bank_a, work.path(), &new_addrs);
    let mut bank_b = repoint(&mut bank_b, work.path(), &new_addrs);
    bank_a.wait_started().await.unwrap();
    bank_b.wait_started().await.unwrap();

    // New work on the restored cluster, on txid numbers the banks already
    // hold from the old one.
    let mut new_txids = Vec::new();
    // Up to the in-doubt transaction's number too: bank-b then holds that
    // number twice, once in doubt (old) and once committed (new).
    let old_max = (*old_txids.iter().max().unwrap()).max(in_doubt);
    let mut i = 0;
    while new_txids.last().is_none_or(|t| *t <= old_max) {
        assert!(i < 200, "the new cluster's txids never passed {old_max}: {new_txids:?}");
        new_txids.push(transfer(&cl2, &format!("new-{i}"), &bank_a, &bank_b, i % MOVED_ACCOUNTS).await);
        i += 1;
    }
    let new_inc = incarnation_of(&cl2, new_txids[0]).await;
    assert_ne!(
        new_inc, old_inc,
        "a restored cluster must open an incarnation of its own"
    );
    let reused: Vec<u64> = new_txids.iter().filter(|t| old_txids.contains(t)).copied().collect();
    assert!(
        reused.len() >= 3 && new_txids.contains(&in_doubt),
        "the drill needs txid numbers both clusters handed out: old {old_txids:?}, new {new_txids:?}"
    );

    // bank-b's recovery asked the new cluster about its in-doubt vote of
    // the old cluster, was told another incarnation handed it out, and
    // keeps it: nothing presumed (an ABORT here could split it from a
    // COMMIT the old cluster made, invariant 3).
    let log = work.path().join("bank-b.log");
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("did not hand out in this incarnation")
    {
        assert!(
            tokio::time::Instant::now() < until,
            "bank-b's recovery never reported its old-incarnation vote; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let r = inspect(
        &bank_b.addr,
        pb::InspectParticipantRequest {
            txids: vec![in_doubt],
            incarnation: old_inc,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(
        r.records[0].record,
        pb::LocalRecord::PreparedYes as i32,
        "bank-b's old-incarnation vote on {in_doubt}: {r:?}"
    );

    // Step 8, the procedure (ADR 0040): settle the
    // old incarnation's in-doubt txid with `admin txn settle-other`. First
    // its lock still holds: a transfer on its account is refused there.
    let (blocked, o) = try_transfer(&cl2, "blocked-before", &bank_a, &bank_b, ACCOUNTS - 1).await;
    assert_eq!(o, TxOutcome::Aborted, "txid {blocked}: bank-b's old vote locks b4");
    let answer = cl2.decisions_in(old_inc, &[in_doubt], "").await.unwrap();
    assert_eq!(answer[0].decision, Some(DecisionRead::OtherIncarnation));
    assert!(answer[0].settled_by.is_empty());
    let addr = new_addrs.join(",");
    let old_hex = format!("{old_inc:016x}");
    let in_doubt_s = in_doubt.to_string();
    let b_arg = format!("{}={}", bank_b.id, bank_b.addr);
    let settle = |inc: &str, txid: &str, outcome: &str, others: &[&str]| {
        let mut args = vec![
            "admin",
            "--addr",
            &addr,
            "txn",
            "settle-other",
            "--incarnation",
            inc,
            "--txid",
            txid,
            outcome,
            "--participant",
            &b_arg,
            "--operator",
            "drill",
            "--reason",
            "old cluster gone; held never voted",
        ];
        for o in others {
            args.extend(["--participant", o]);
        }
        run(&args.iter().map(std::ffi::OsStr::new).collect::<Vec<_>>())
    };
    let refused = |o: &Output, want: &str| {
        assert_eq!(o.status.code(), Some(3), "{}", common::output_text(o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "expected {want:?} in: {err}");
    };
    // A txid of the new cluster's own, and incarnation 0: answered from the
    // table, never settled.
    let new_hex = format!("{new_inc:x}");
    refused(
        &settle(&new_hex, &new_txids[0].to_string(), "--abort", &[]),
        "handed out by this cluster",
    );
    refused(&settle("0", &in_doubt_s, "--abort", &[]), "incarnation 0");
    // COMMIT without the evidence: bank-a never voted on it.
    let a_arg = format!("{}={}", bank_a.id, bank_a.addr);
    refused(&settle(&old_hex, &in_doubt_s, "--commit", &[&a_arg]), "COMMIT refused");
    // ABORT, naming both participants: neither holds it COMMITTED.
    let held_arg = format!("{}={}", held.id, held.addr);
    let o = settle(&old_hex, &in_doubt_s, "--abort", &[&held_arg]);
    assert!(o.status.success(), "{}", common::output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("recorded ABORT"),
        "{}",
        common::output_text(&o)
    );
    let answer = cl2.decisions_in(old_inc, &[in_doubt], "").await.unwrap();
    assert_eq!(answer[0].decision, Some(DecisionRead::Aborted), "{answer:?}");
    assert!(
        answer[0].settled_by.contains("operator drill: old cluster gone"),
        "{answer:?}"
    );
    // Write-once: the same settlement again reads it back; a conflicting
    // one is refused.
    let o = settle(&old_hex, &in_doubt_s, "--abort", &[&held_arg]);
    assert!(o.status.success(), "{}", common::output_text(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("already settled ABORT (as asked"));
    refused(
        &settle(&old_hex, &in_doubt_s, "--commit", &[&held_arg]),
        "already settled ABORT",
    );
    // bank-b's recovery reads the settlement and applies it: the vote is
    // no longer in doubt, and its lock is released.
    let until = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let r = inspect(
            &bank_b.addr,
            pb::InspectParticipantRequest {
                txids: vec![in_doubt],
                incarnation: old_inc,
                in_doubt: true,
                ..Default::default()
            },
        )
        .await;
        if r.records[0].record == pb::LocalRecord::Aborted as i32 {
            assert_eq!(r.in_doubt_count, 0, "{r:?}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < until,
            "bank-b's recovery never applied the settlement: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let o = run(&[
        "admin".as_ref(),
        "--json".as_ref(),
        "participant".as_ref(),
        "--address".as_ref(),
        bank_b.addr.as_ref(),
        "--in-doubt".as_ref(),
    ]);
    assert!(o.status.success(), "{}", common::output_text(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["in_doubt_count"], 0, "{v}");
    assert_eq!(v["in_doubt"], serde_json::json!([]), "{v}");
    assert!(std::fs::read_to_string(&log)
        .unwrap_or_default()
        .contains("settled by an operator of the cluster"));
    let unblocked = transfer(&cl2, "unblocked-after", &bank_a, &bank_b, ACCOUNTS - 1).await;

    // Every transfer of both clusters applied once at each bank.
    bank_a.kill9();
    bank_b.kill9();
    let (bal_a, log_a) = bank_state(&bank_a);
    let (bal_b, log_b) = bank_state(&bank_b);
    let want: Vec<(u64, u64)> = old_txids
        .iter()
        .map(|t| (old_inc, *t))
        .chain(new_txids.iter().map(|t| (new_inc, *t)))
        .chain([(new_inc, unblocked)])
        .collect();
    assert_applied_once("bank-a", &log_a, &want);
    assert_applied_once("bank-b", &log_b, &want);
    let per_account = |n: usize, acct: usize| (0..n).filter(|i| i % MOVED_ACCOUNTS == acct).count() as i64;
    let before_backup = 4;
    for acct in 0..MOVED_ACCOUNTS {
        let moved = per_account(before_backup, acct)
            + per_account(after_backup.len(), acct)
            + per_account(new_txids.len(), acct);
        assert_eq!(
            balance(&bal_a, &format!("a{acct}")),
            INITIAL - moved,
            "a{acct}: {bal_a:?}"
        );
        assert_eq!(
            balance(&bal_b, &format!("b{acct}")),
            INITIAL + moved,
            "b{acct}: {bal_b:?}"
        );
    }
    // The in-doubt credit is not applied (settled ABORT), the transfer
    // after the settlement is, and the refused one before it is not.
    assert_eq!(balance(&bal_b, &format!("b{}", ACCOUNTS - 1)), INITIAL + 1, "{bal_b:?}");
    assert_eq!(balance(&bal_a, &format!("a{}", ACCOUNTS - 1)), INITIAL - 1, "{bal_a:?}");
    assert!(
        log_b
            .iter()
            .any(|(t, o)| (t.incarnation, t.txid) == (old_inc, in_doubt) && o == "ABORT"),
        "bank-b applied the settled ABORT: {log_b:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t107_inv10_two_clusters_sharing_a_participant_id_keep_their_txids_apart() {
    let mut staging = TestCluster::start_with("t107-staging", 3, tune);
    let mut prod = TestCluster::start_with("t107-prod", 3, tune);
    staging.leader().await;
    prod.leader().await;
    let work = common::test_dir();
    // The shared bank asks production for its recovery; each cluster has a
    // bank of its own on the other side.
    let mut shared = start_bank(
        bin(),
        work.path(),
        "bank-a",
        "a",
        &prod.procs.api_addrs(),
        ACCOUNTS,
        INITIAL,
    )
    .unwrap();
    let mut s_other = start_bank(
        bin(),
        work.path(),
        "bank-s",
        "s",
        &staging.procs.api_addrs(),
        ACCOUNTS,
        INITIAL,
    )
    .unwrap();
    let mut p_other = start_bank(
        bin(),
        work.path(),
        "bank-p",
        "p",
        &prod.procs.api_addrs(),
        ACCOUNTS,
        INITIAL,
    )
    .unwrap();
    for b in [&shared, &s_other, &p_other] {
        b.wait_started().await.unwrap();
    }
    let (cs, cp) = (staging.client(), prod.client());
    // Interleaved, so both clusters hand out the same numbers while both
    // are at work; staging moves from accounts 0 and 1, production from 2
    // and 3.
    let (mut s_txids, mut p_txids) = (Vec::new(), Vec::new());
    for i in 0..8 {
        s_txids.push(transfer(&cs, &format!("s-{i}"), &shared, &s_other, i % 2).await);
        p_txids.push(transfer(&cp, &format!("p-{i}"), &shared, &p_other, 2 + i % 2).await);
    }
    let (s_inc, p_inc) = (
        incarnation_of(&cs, s_txids[0]).await,
        incarnation_of(&cp, p_txids[0]).await,
    );
    assert_ne!(s_inc, p_inc, "two clusters opened the same incarnation");
    let common_numbers = s_txids.iter().filter(|t| p_txids.contains(t)).count();
    assert!(
        common_numbers >= 4,
        "the clusters must share txid numbers for this test: {s_txids:?} {p_txids:?}"
    );
    for b in [&mut shared, &mut s_other, &mut p_other] {
        b.kill9();
    }
    let (bal, log) = bank_state(&shared);
    let want: Vec<(u64, u64)> = s_txids
        .iter()
        .map(|t| (s_inc, *t))
        .chain(p_txids.iter().map(|t| (p_inc, *t)))
        .collect();
    assert_applied_once("bank-a", &log, &want);
    for acct in 0..4 {
        assert_eq!(balance(&bal, &format!("a{acct}")), INITIAL - 4, "a{acct}: {bal:?}");
    }
    let (bal_s, _) = bank_state(&s_other);
    let (bal_p, _) = bank_state(&p_other);
    for acct in 0..2 {
        assert_eq!(balance(&bal_s, &format!("s{acct}")), INITIAL + 4, "{bal_s:?}");
        assert_eq!(balance(&bal_p, &format!("p{}", 2 + acct)), INITIAL + 4, "{bal_p:?}");
    }
}
