//! Backup and restore end to end: a loaded three-node cluster (committed,
//! aborted, operator-resolved and active transactions, a COMMIT not yet
//! delivered to a participant that refuses phase two, an ABORT not yet
//! delivered to a bank that is down) is backed up through the `coordinator`
//! binary, killed with SIGKILL, and restored into a fresh three-node cluster
//! on new ports and data directories with `coordinator restore`. Every txid
//! of the old cluster has the identical record in the new one (decision:
//! outcome, source, term, time, note; participants), NOT_FOUND where the old
//! one said NOT_FOUND; a new transaction gets a txid above every old one; and
//! the new cluster's leader delivers the undelivered decisions once their
//! participants are back (its terms are above the old cluster's, so the
//! participants' term fencing takes them).

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;
use std::path::PathBuf;
use std::process::Output;
use std::time::Duration;

use common::bin;
use common::participants::Svc;
use common::TestCluster;
use coordinator::config::Config;
use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::ClientError;
use dtx_client::TxOutcome;
use dtx_proto::v1 as pb;
use dtx_testkit::cluster::start_bank;
use dtx_testkit::cluster::ProcessCluster;
use participant_sdk::log::LocalState;
use participant_sdk::log::Vote;

const ACCOUNTS: usize = 5;
const INITIAL: i64 = 100;

fn tune(c: &mut Config) {
    // Small txid reservations: every txid up to next_txid is compared.
    c.txn.txid_reserve_count = 16;
    c.txn.prepare_timeout_ms = 1_000;
    c.txn.delivery_retry_max_ms = 500;
}

fn run(args: &[&std::ffi::OsStr]) -> Output {
    std::process::Command::new(bin())
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run coordinator")
}

/// Every txid below `next_txid`: its record, or None for NOT_FOUND, with the
/// leader-local delivery bookkeeping (not replicated) cleared.
async fn records(cl: &Client, next_txid: u64) -> BTreeMap<u64, Option<pb::StatusResponse>> {
    let mut out = BTreeMap::new();
    for t in 1..next_txid {
        let r = match cl.status(t).await {
            Ok(s) => Some(common::replicated(s)),
            Err(ClientError::NotFound(_)) => None,
            Err(e) => panic!("status of {t}: {e}"),
        };
        out.insert(t, r);
    }
    out
}

/// Waits until every participant of `txid` except those in `but` acked.
async fn wait_acked_but(cl: &Client, txid: u64, but: &[&str], timeout: Duration) -> bool {
    let until = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < until {
        if let Ok(s) = cl.status(txid).await {
            if s.participants.iter().all(|p| p.acked || but.contains(&p.id.as_str())) {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// `coordinator admin --addr ADDR backup --out OUT [MORE]`.
fn backup_to(addr: &str, out: &Path, more: &[&str]) -> Output {
    let mut args: Vec<&std::ffi::OsStr> = vec![
        "admin".as_ref(),
        "--addr".as_ref(),
        addr.as_ref(),
        "backup".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
    ];
    args.extend(more.iter().map(|m| std::ffi::OsStr::new(*m)));
    run(&args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t102_backup_of_a_loaded_cluster_restores_every_decision() {
    let started = std::time::Instant::now();
    let mut old = TestCluster::start_with("t102-old", 3, tune);
    // A few leader changes first: the old cluster's term is well above 1,
    // so a restored cluster that started its terms afresh would be fenced
    // off by the participants (invariant 9).
    for _ in 0..2 {
        let l = old.leader().await;
        old.procs.kill9(l);
        old.procs
            .wait_for_leader(Duration::from_secs(20))
            .await
            .expect("a new leader");
        old.procs.start(l).unwrap();
    }
    let leader = old.leader().await;
    let cl = old.client();
    let work = common::test_dir();
    let addrs = old.procs.api_addrs();
    let mut bank_a = start_bank(bin(), work.path(), "bank-a", "a", &addrs, ACCOUNTS, INITIAL).unwrap();
    let mut bank_b = start_bank(bin(), work.path(), "bank-b", "b", &addrs, ACCOUNTS, INITIAL).unwrap();
    bank_a.wait_started().await.unwrap();
    bank_b.wait_started().await.unwrap();
    let held = Svc::new("held").await;
    let (a_id, a_addr) = (bank_a.id.clone(), bank_a.addr.clone());
    let (b_id, b_addr) = (bank_b.id.clone(), bank_b.addr.clone());

    // Committed, step by step (Begin, Enlist, Commit).
    let mut decided = Vec::new();
    for i in 0..4 {
        let t = cl.begin(&format!("commit-{i}"), 600_000, b"").await.unwrap().txid;
        cl.enlist(t, &a_id, &a_addr, b"a0:-1").await.unwrap();
        cl.enlist(t, &b_id, &b_addr, b"b0:1").await.unwrap();
        assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
        // Delivered before the next one prepares (its accounts are locked
        // until then).
        assert!(wait_acked_but(&cl, t, &[], Duration::from_secs(20)).await);
        decided.push(t);
    }
    // Committed in one call each (BeginAndCommit).
    let banks = [bank_a.spec(), bank_b.spec()];
    for i in 0..4 {
        let (t, r) = dtx_bank::transfer(&cl, &format!("transfer-{i}"), &banks, ACCOUNTS).await;
        assert!(r.is_ok(), "{r:?}");
        let t = t.expect("a txid");
        assert!(wait_acked_but(&cl, t, &[], Duration::from_secs(20)).await);
        decided.push(t);
    }
    // Aborted: a NO vote (overdraft), a client's abort, an operator's.
    let no = cl.begin("no", 600_000, b"").await.unwrap().txid;
    cl.enlist(no, &a_id, &a_addr, b"a1:-1000").await.unwrap();
    cl.enlist(no, &b_id, &b_addr, b"b1:1000").await.unwrap();
    assert_eq!(cl.commit(no).await.unwrap(), TxOutcome::Aborted);
    let client_abort = cl.begin("client-abort", 600_000, b"").await.unwrap().txid;
    cl.enlist(client_abort, &a_id, &a_addr, b"a1:-1").await.unwrap();
    assert_eq!(
        cl.abort(client_abort, "changed my mind").await.unwrap(),
        TxOutcome::Aborted
    );
    let by_operator = cl.begin("operator", 600_000, b"").await.unwrap().txid;
    cl.enlist(by_operator, &a_id, &a_addr, b"a1:-1").await.unwrap();
    cl.resolve(by_operator, false, &[], "alice", "t102 stuck")
        .await
        .unwrap();
    // Active: begun and enlisted, never committed (deadline far away).
    let active = cl.begin("active", 600_000, b"").await.unwrap().txid;
    cl.enlist(active, &a_id, &a_addr, b"a4:-1").await.unwrap();
    // A COMMIT `held` voted YES for but refuses to hear: not delivered.
    held.hold_decisions.store(true, std::sync::atomic::Ordering::SeqCst);
    let undelivered_commit = cl.begin("held-commit", 600_000, b"").await.unwrap().txid;
    cl.enlist(undelivered_commit, &a_id, &a_addr, b"a2:0").await.unwrap();
    cl.enlist(undelivered_commit, &held.id, &held.addr, b"work")
        .await
        .unwrap();
    assert_eq!(cl.commit(undelivered_commit).await.unwrap(), TxOutcome::Committed);
    assert_eq!(
        held.state(undelivered_commit),
        Some(LocalState::Prepared { vote: Vote::Yes })
    );
    // An ABORT bank-b never hears: it is down (kill -9) from the prepare on.
    let undelivered_abort = cl.begin("b-down", 600_000, b"").await.unwrap().txid;
    cl.enlist(undelivered_abort, &a_id, &a_addr, b"a3:-1").await.unwrap();
    cl.enlist(undelivered_abort, &b_id, &b_addr, b"b3:1").await.unwrap();
    bank_b.kill9();
    assert_eq!(cl.commit(undelivered_abort).await.unwrap(), TxOutcome::Aborted);

    // Quiet: everything that can be delivered was (bank-a acked all).
    for t in decided.iter().chain([&no, &client_abort, &by_operator]) {
        assert!(
            wait_acked_but(&cl, *t, &[], Duration::from_secs(20)).await,
            "{t} not acked"
        );
    }
    for (t, but) in [(undelivered_commit, "held"), (undelivered_abort, "bank-b")] {
        assert!(
            wait_acked_but(&cl, t, &[but], Duration::from_secs(20)).await,
            "{t} not acked by bank-a"
        );
    }
    let old_status = old.status_of(leader).await;
    let next_txid = old_status.next_txid;
    let before = records(&cl, next_txid).await;
    let found = before.values().filter(|r| r.is_some()).count();
    assert_eq!(found, 14, "{before:#?}");
    assert!(
        before.values().any(|r| r.is_none()),
        "some txids were reserved, never used"
    );

    // The backup, through a follower (it names the leader, which answers).
    let follower = (1..=3).find(|i| *i != leader).unwrap();
    let file = work.path().join("cluster.dtxbak");
    let o = backup_to(&old.api(follower), &file, &[]);
    assert!(o.status.success(), "{}", common::output_text(&o));
    let said = String::from_utf8_lossy(&o.stdout).to_string();
    eprintln!("backup: {said}");
    // Nothing moved meanwhile: the backup is of this state.
    assert_eq!(records(&cl, next_txid).await, before);
    // An existing file is not replaced without --force (and is kept).
    let kept = std::fs::read(&file).unwrap();
    let o = backup_to(&old.api(leader), &file, &[]);
    assert!(!o.status.success(), "{}", common::output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--force"),
        "{}",
        common::output_text(&o)
    );
    assert_eq!(std::fs::read(&file).unwrap(), kept);
    let again = work.path().join("again.dtxbak");
    std::fs::copy(&file, &again).unwrap();
    let o = backup_to(&old.api(leader), &again, &["--force"]);
    assert!(o.status.success(), "{}", common::output_text(&o));
    let b2 = coordinator::backup::read_backup(&again).unwrap();
    assert_eq!(b2.header.next_txid, next_txid);
    // A follower's own state, unconfirmed, says so.
    let o = backup_to(
        &old.api(follower),
        &work.path().join("follower.dtxbak"),
        &["--unconfirmed"],
    );
    assert!(o.status.success(), "{}", common::output_text(&o));
    let b3 = coordinator::backup::read_backup(&work.path().join("follower.dtxbak")).unwrap();
    assert!(!b3.header.confirmed);
    assert_eq!(b3.header.node_id, follower);
    let b = coordinator::backup::read_backup(&file).unwrap();
    assert_eq!(b.header.cluster_id, "t102-old");
    assert!(b.header.confirmed);
    assert_eq!(b.header.next_txid, next_txid);
    assert_eq!(b.header.transactions, found as u64);
    assert!(b.header.term >= old_status.term);
    assert!(old_status.term >= 3, "old term {}", old_status.term);
    // Checked by the binary too; a truncated copy is refused, saying so.
    let o = run(&[
        "restore".as_ref(),
        "--backup".as_ref(),
        file.as_os_str(),
        "--verify".as_ref(),
    ]);
    assert!(o.status.success(), "{}", common::output_text(&o));
    let shown: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(shown["next_txid"], serde_json::json!(next_txid));
    assert_eq!(shown["decided_not_yet_delivered"], serde_json::json!(2));
    let bytes = std::fs::read(&file).unwrap();
    let cut = work.path().join("cut.dtxbak");
    std::fs::write(&cut, &bytes[..bytes.len() - 7]).unwrap();
    let o = run(&[
        "restore".as_ref(),
        "--backup".as_ref(),
        cut.as_os_str(),
        "--verify".as_ref(),
    ]);
    assert!(!o.status.success(), "{}", common::output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("truncated or damaged"),
        "{}",
        common::output_text(&o)
    );

    // The old cluster is gone for good.
    for id in 1..=3 {
        old.procs.kill9(id);
    }

    // A fresh cluster: new id, new ports, new data directories, no bootstrap.
    let new_dir = work.path().join("new");
    let plans = common::local_plans(3);
    let mut new = ProcessCluster::new(bin(), &new_dir, "t102-new", plans, |c| {
        tune(c);
        // Node 1 keeps the bootstrap flag its config had (an operator's
        // reused config): a restored directory is initialized, so it is
        // ignored; the others start without it.
        c.bootstrap.enabled = c.node_id == 1;
    })
    .unwrap();
    let mut restore_ids = Vec::new();
    for id in 1..=3u64 {
        let n = new.node(id);
        let o = if id < 3 {
            run(&[
                "restore".as_ref(),
                "--backup".as_ref(),
                file.as_os_str(),
                "--config".as_ref(),
                n.config_path.as_os_str(),
            ])
        } else {
            // The same with flags instead of a config file.
            let members: Vec<String> = n
                .config
                .bootstrap
                .members
                .iter()
                .map(|m| format!("{},{},{}", m.id, m.raft_addr, m.api_addr))
                .collect();
            let data_dir: PathBuf = n.config.data_dir.clone();
            let mut args: Vec<std::ffi::OsString> = vec![
                "restore".into(),
                "--backup".into(),
                file.clone().into(),
                "--cluster-id".into(),
                "t102-new".into(),
                "--node-id".into(),
                "3".into(),
                "--data-dir".into(),
                data_dir.into(),
            ];
            for m in members {
                args.push("--member".into());
                args.push(m.into());
            }
            let refs: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
            run(&refs)
        };
        assert!(o.status.success(), "restore of node {id}: {}", common::output_text(&o));
        let out = String::from_utf8_lossy(&o.stdout).to_string();
        eprint!("{out}");
        let rid = out
            .split("restore id ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .expect("a restore id")
            .to_string();
        restore_ids.push(rid);
    }
    assert!(restore_ids.iter().all(|r| *r == restore_ids[0]), "{restore_ids:?}");
    // A data directory that is not empty is refused, and left as it was.
    let o = run(&[
        "restore".as_ref(),
        "--backup".as_ref(),
        file.as_os_str(),
        "--config".as_ref(),
        new.node(1).config_path.as_os_str(),
    ]);
    assert!(!o.status.success(), "{}", common::output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("is not empty"),
        "{}",
        common::output_text(&o)
    );
    // So is the old cluster's id for the new cluster.
    let o = run(&[
        "restore".as_ref(),
        "--backup".as_ref(),
        file.as_os_str(),
        "--config".as_ref(),
        new.node(1).config_path.as_os_str(),
        "--cluster-id".as_ref(),
        "t102-old".as_ref(),
        "--data-dir".as_ref(),
        work.path().join("other").as_os_str(),
    ]);
    assert!(!o.status.success(), "{}", common::output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("must differ"),
        "{}",
        common::output_text(&o)
    );

    new.start_all().unwrap();
    let new_leader = new
        .wait_for_leader(Duration::from_secs(30))
        .await
        .expect("a new leader");
    let cl2 = Client::new(ClientConfig::new(new.api_addrs())).unwrap();
    let st = dtx_client::cluster_status_at(&new.node(new_leader).plan.api_listen, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(st.cluster_id, "t102-new");
    assert_eq!(st.next_txid, next_txid);
    assert!(
        st.term > old_status.term,
        "the new cluster's term {} must be above the old one's {}",
        st.term,
        old_status.term
    );

    // Every txid: the identical record, NOT_FOUND where it was.
    let after = records(&cl2, next_txid).await;
    for (t, was) in &before {
        assert_eq!(after.get(t), Some(was), "txid {t} differs after the restore");
    }

    // New transactions get txids above every old one.
    let fresh = cl2.begin("after-restore", 600_000, b"").await.unwrap().txid;
    assert!(fresh >= next_txid, "txid {fresh} reused (old next_txid {next_txid})");

    // The undelivered decisions reach their participants once they are
    // back, from the new cluster (the old one is dead; bank-b's own
    // recovery still asks the old addresses).
    held.hold_decisions.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(
        held.wait_state(undelivered_commit, LocalState::Committed, Duration::from_secs(20))
            .await,
        "held never learned the COMMIT: {:?}",
        held.state(undelivered_commit)
    );
    bank_b.start(&[]).unwrap();
    bank_b.wait_started().await.unwrap();
    for t in [undelivered_commit, undelivered_abort] {
        assert!(
            wait_acked_but(&cl2, t, &[], Duration::from_secs(30)).await,
            "the new cluster did not deliver {t}: {:?}",
            cl2.status(t).await
        );
    }
    cl2.enlist(fresh, &a_id, &a_addr, b"a0:-1").await.unwrap();
    cl2.enlist(fresh, &b_id, &b_addr, b"b0:1").await.unwrap();
    assert_eq!(cl2.commit(fresh).await.unwrap(), TxOutcome::Committed);
    assert!(wait_acked_but(&cl2, fresh, &[], Duration::from_secs(20)).await);
    // The decisions themselves did not change by being delivered.
    for t in [undelivered_commit, undelivered_abort] {
        let now = cl2.status(t).await.unwrap();
        assert_eq!(now.decision, before[&t].as_ref().unwrap().decision);
    }

    // Money is conserved across both clusters, and nothing is in doubt.
    bank_a.kill9();
    bank_b.kill9();
    let mut total = 0;
    for bank in [&bank_a, &bank_b] {
        let audit = bank.audit().unwrap();
        assert_eq!(audit["in_doubt"], serde_json::json!(0), "{audit}");
        assert_eq!(audit["locked"], serde_json::json!(0), "{audit}");
        total += audit["balances"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_i64().unwrap())
            .sum::<i64>();
    }
    assert_eq!(total, 2 * ACCOUNTS as i64 * INITIAL);
    for id in 1..=3 {
        new.kill9(id);
    }
    eprintln!("t102 took {:?}", started.elapsed());
}

/// Sagas survive a backup and restore (the backup carries the saga journal):
/// a COMPLETED, a COMPENSATED and a PARKED saga read back identical from a
/// fresh cluster restored from the backup, and so do the definitions. The old
/// idempotency key finds its saga (no second one), a new saga gets an id
/// above every old one, and the parked saga, compensated there by an
/// operator, is driven to its end by the new cluster's leader against the
/// same step services.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t102_sagas_survive_a_backup_and_restore() {
    use common::sagas;
    use common::sagas::SagaShop;
    use common::sagas::ShopFlags;
    use common::TestCluster as Tc;

    const ORDER: &str = dtx_saga_shop::ORDER_SAGA;
    let mut old = TestCluster::start("t102s-old");
    let leader = old.leader().await;
    let work = common::test_dir();
    let mut shop = SagaShop::start(work.path(), ShopFlags::default()).await;
    sagas::register(&old, shop.definition()).await;
    sagas::register(&old, shop.parking_definition()).await;
    let good = sagas::order(1, 0, 2, 1, 50);
    let unpayable = sagas::order(2, 1, 1, 2, 10_000_000);
    let parks = sagas::order(3, 2, 3, 3, 10_000_000);
    let a = sagas::start(&old, ORDER, &good, None).await;
    let b = sagas::start(&old, ORDER, &unpayable, None).await;
    let c = sagas::start(&old, "order-parks", &parks, None).await;
    let wait = Duration::from_secs(60);
    let mut before = Vec::new();
    for (id, state) in [
        (a, pb::SagaState::Completed),
        (b, pb::SagaState::Compensated),
        (c, pb::SagaState::Parked),
    ] {
        before.push(sagas::wait_state(&old, &mut shop, id, &[state], wait).await);
    }
    async fn definitions(t: &common::TestCluster) -> Result<pb::ListSagaDefinitionsResponse, tonic::Status> {
        common::sagas::call(t, Duration::from_secs(30), |mut cl| async move {
            cl.list_definitions(pb::ListSagaDefinitionsRequest {}).await
        })
        .await
    }
    let defs_before = definitions(&old).await.unwrap().definitions;
    assert_eq!(defs_before.len(), 2);

    let file = work.path().join("sagas.dtxbak");
    let o = backup_to(&old.api(leader), &file, &[]);
    assert!(o.status.success(), "{}", common::output_text(&o));
    for id in 1..=3 {
        old.procs.kill9(id);
    }

    // A fresh cluster restored from the backup, on new ports.
    let new_dir = common::test_dir();
    let mut procs = ProcessCluster::new(
        bin(),
        &new_dir.path().join("nodes"),
        "t102s-new",
        common::local_plans(3),
        |_| {},
    )
    .unwrap();
    for id in 1..=3u64 {
        let o = run(&[
            "restore".as_ref(),
            "--backup".as_ref(),
            file.as_os_str(),
            "--config".as_ref(),
            procs.node(id).config_path.as_os_str(),
        ]);
        assert!(o.status.success(), "restore of node {id}: {}", common::output_text(&o));
    }
    procs.start_all().unwrap();
    procs
        .wait_for_leader(Duration::from_secs(30))
        .await
        .expect("a leader in the restored cluster");
    let mut new = Tc {
        dir: new_dir,
        procs,
        proxies: Vec::new(),
    };

    for (id, was) in [a, b, c].into_iter().zip(&before) {
        assert_eq!(&sagas::get(&new, id).await, was, "saga {id} differs after the restore");
    }
    assert_eq!(definitions(&new).await.unwrap().definitions, defs_before);
    // The old key finds the old saga.
    let again = pb::StartSagaRequest {
        definition: ORDER.into(),
        version: 1,
        idempotency_key: good.order.clone(),
        input: good.to_json(),
        authorization: None,
        deadline_ms: 0,
    };
    let r = sagas::call(&new, Duration::from_secs(30), |mut cl| {
        let r = again.clone();
        async move { cl.start_saga(r).await }
    })
    .await
    .unwrap();
    assert_eq!((r.saga_id, r.created), (a, false));
    // A new saga: an id above every old one, driven by the new leader.
    let d = sagas::start(&new, ORDER, &sagas::order(4, 3, 1, 4, 20), None).await;
    assert!(d > c, "saga id {d} reused (old ids up to {c})");
    sagas::wait_state(&new, &mut shop, d, &[pb::SagaState::Completed], wait).await;
    // The parked one: an operator compensates it in the new cluster.
    let req = pb::OperateSagaRequest {
        saga_id: c,
        action: pb::SagaOperatorAction::Compensate as i32,
        why: "card declined for good".into(),
        operator: "alice".into(),
    };
    sagas::call(&new, Duration::from_secs(30), |mut cl| {
        let r = req.clone();
        async move { cl.operate_saga(r).await }
    })
    .await
    .unwrap();
    let v = sagas::wait_state(&new, &mut shop, c, &[pb::SagaState::Compensated], wait).await;
    assert_eq!(v.operator_actions.len(), 1, "{v:#?}");

    // The step services saw each effect once, across both clusters.
    let audits = shop.audit_all();
    for au in &audits {
        assert!(au.ok(), "{au:?}");
    }
    let inv = &audits[0];
    assert_eq!(inv.reservations[&good.order].reserved_qty, 2);
    assert_eq!(inv.reservations[&unpayable.order].reserved_qty, 0);
    assert_eq!(inv.reservations[&parks.order].reserved_qty, 0);
    assert_eq!(inv.reservations[&parks.order].releases_applied, 1);
    assert_eq!(audits[1].charges[&good.order].charges_applied, 1);
    for id in 1..=3 {
        new.procs.kill9(id);
    }
}
