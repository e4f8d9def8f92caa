//! Crash windows of the fault points of docs/design.md, with the `failpoints`
//! feature: a node or participant process aborts (like kill -9) at the named
//! point.
//! Run with `cargo test -p dtx-devtools --test it -- t85_crash_points::`.

use crate::common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::participants::Svc;
use common::TestCluster;
use dtx_client::DecisionRead;
use dtx_client::ParticipantSpec;
use dtx_client::TxOutcome;
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

/// A bank participant process (`dtx-dev bank-serve`) with its own data
/// directory, optionally armed to abort once at a crash point.
struct BankProc {
    proc_: dtx_testkit::cluster::BankProcess,
    id: &'static str,
    prefix: &'static str,
    addr: String,
    log: std::path::PathBuf,
    once: std::path::PathBuf,
}

impl BankProc {
    fn new(c: &TestCluster, id: &'static str, prefix: &'static str) -> BankProc {
        let port = dtx_testkit::cluster::free_port("127.0.0.1").unwrap();
        let proc_ = dtx_testkit::cluster::BankProcess::new(
            common::bin(),
            c.dir.path(),
            id,
            prefix,
            "127.0.0.1",
            port,
            c.procs.api_addrs(),
            10,
            1000,
        );
        BankProc {
            id,
            prefix,
            addr: proc_.addr.clone(),
            log: proc_.log_path.clone(),
            once: c.dir.path().join(format!("{id}-fired")),
            proc_,
        }
    }

    async fn start(&mut self, armed_at: Option<&str>) {
        let mut env = vec![("RUST_LOG".to_string(), "warn".to_string())];
        if let Some(point) = armed_at {
            env.push(("DTX_FAILPOINT".into(), point.into()));
            env.push(("DTX_FAILPOINT_ONCE".into(), self.once.display().to_string()));
        }
        self.proc_.start(&env).unwrap();
        let listening = dtx_testkit::cluster::wait_listening(&self.addr, Duration::from_secs(10)).await;
        assert!(listening, "{} did not start listening", self.id);
    }

    /// Waits up to 30 s for the process to end by itself (at its crash
    /// point).
    async fn wait_crashed(&mut self) {
        let status = self.crashed_within(Duration::from_secs(30)).await;
        let status = status.unwrap_or_else(|| panic!("{}: still running 30 s after its crash point was due", self.id));
        assert!(!status.success(), "{} should have aborted at its crash point", self.id);
        assert!(self.once.exists(), "{}: crash point not reached", self.id);
    }

    async fn crashed_within(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        self.proc_.wait_for_exit(timeout).await
    }

    fn kill9(&mut self) {
        self.proc_.kill9();
    }

    fn stop(&mut self) {
        self.proc_.stop(Duration::from_secs(10));
    }

    /// Opens the (stopped) bank's store: (entry state of txid, total, locked, in doubt).
    async fn audit(&self, txid: u64) -> (Option<LocalState>, i64, usize, usize) {
        let store = dtx_bank::open_bank(&self.proc_.data_dir, self.prefix, 10, 1000)
            .await
            .unwrap();
        let (total, _, locked) = dtx_bank::audit(&store).unwrap();
        let doubt = store.in_doubt().unwrap().len();
        // In whichever incarnation the cluster handed `txid` out.
        let state = store.entries_for_txid(txid).unwrap().first().map(|(_, e)| e.state);
        (state, total, locked, doubt)
    }

    fn spec(&self, payload: &str) -> ParticipantSpec {
        ParticipantSpec {
            participant_id: self.id.to_string(),
            address: self.addr.clone(),
            payload: payload.as_bytes().to_vec(),
        }
    }
}

/// Polls until the coordinator has recorded every participant's ack.
async fn all_acked(c: &TestCluster, txid: u64, timeout: Duration) -> bool {
    let until = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < until {
        if let Ok(s) = c.client().status(txid).await {
            if s.participants.iter().all(|p| p.acked) {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t85_participant_dies_after_durable_prepare_resolves_after_restart() {
    let mut c = TestCluster::start_with("t85c", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
        // One participant: keep two phases, so Prepare hits the crash point.
        cfg.txn.one_phase_commit = false;
    });
    c.leader().await;
    let mut bank = BankProc::new(&c, "bank-b", "b");
    bank.start(Some("participant_after_prepare_before_reply")).await;
    let cl = c.client();
    let t = cl.begin("k", 60_000, b"").await.unwrap().txid;
    cl.enlist(t, "bank-b", &bank.addr, b"b1:-10").await.unwrap();
    // The participant dies after its durable YES, before replying: the
    // coordinator never got a vote, so it decides ABORT.
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Aborted);
    bank.wait_crashed().await;
    // Restarted, it finds the transaction in doubt and asks the cluster.
    bank.start(None).await;
    let resolved = all_acked(&c, t, Duration::from_secs(10)).await;
    bank.stop();
    // ABORT applied, b1 unlocked, balance intact.
    let (state, total, locked, doubt) = bank.audit(t).await;
    assert_eq!(state, Some(LocalState::Aborted { tombstone: false }));
    assert_eq!((total, locked, doubt), (10_000, 0, 0));
    assert!(resolved, "the coordinator never recorded bank-b's ack");
    assert_eq!(cl.decision(t).await.unwrap(), DecisionRead::Aborted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t85_participant_process_restarted_without_quorum_holds_locks_then_resolves() {
    let mut c = TestCluster::start_with("t85d", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
        cfg.txn.delivery_retry_max_ms = 200;
    });
    let leader = c.leader().await;
    let mut bank = BankProc::new(&c, "bank-a", "a");
    bank.start(Some("participant_after_prepare_before_reply")).await;
    let b = Svc::new("bank-b").await;
    let cl = c.client();
    let parts = [
        bank.spec("a0:-5"),
        ParticipantSpec {
            participant_id: b.id.clone(),
            address: b.addr.clone(),
            payload: b"b0:5".to_vec(),
        },
    ];
    let r = cl.begin_and_commit("t", 60_000, b"", &parts).await.unwrap();
    assert_eq!(r.outcome, TxOutcome::Aborted, "no vote from bank-a");
    let t = r.txid.unwrap();
    bank.wait_crashed().await;

    // The cluster loses its quorum; then the participant restarts.
    let others: Vec<u64> = (1..=3).filter(|i| *i != leader).collect();
    c.procs.kill9(leader);
    c.procs.kill9(others[0]);
    bank.start(None).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // Invariant 5: it waits, in doubt, with a0 locked, and says so in its log.
    bank.kill9();
    let (state, total, locked, doubt) = bank.audit(t).await;
    assert_eq!(
        state,
        Some(participant_sdk::log::LocalState::Prepared {
            vote: participant_sdk::log::Vote::Yes
        })
    );
    assert_eq!((total, locked, doubt), (10_000, 1, 1));
    let log = std::fs::read_to_string(&bank.log).unwrap();
    assert!(log.contains("holding locks and waiting"), "no progress logged:\n{log}");
    // Restarted again, still without quorum; then the quorum returns.
    bank.start(None).await;
    c.procs.start(leader).unwrap();
    c.procs.start(others[0]).unwrap();
    c.leader().await;
    let back = std::time::Instant::now();
    let resolved = all_acked(&c, t, Duration::from_secs(20)).await;
    let took = back.elapsed();
    bank.stop();
    assert!(resolved, "never resolved after the quorum returned");
    eprintln!("in-doubt participant resolved {took:?} after a leader was back");
    let (state, total, locked, doubt) = bank.audit(t).await;
    assert_eq!(state, Some(LocalState::Aborted { tombstone: false }));
    assert_eq!((total, locked, doubt), (10_000, 0, 0));
    assert!(
        took <= Duration::from_secs(2),
        "resolved {took:?} after quorum returned (bound: 2 s)"
    );
}

/// Participant crash points: whatever the crash, the transfer ends with one
/// outcome applied once (invariants 3, 4 and 8), and the bank's money is
/// conserved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t85_participant_crash_points_before_prepare_and_before_ack() {
    let mut c = TestCluster::start_with("t85e", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 1_000;
        cfg.txn.delivery_retry_max_ms = 200;
    });
    c.leader().await;
    let b = Svc::new("bank-b").await;
    let cl = c.client();
    for (i, point) in [
        "participant_before_durable_prepare",
        "participant_after_decision_before_ack",
    ]
    .into_iter()
    .enumerate()
    {
        let mut bank = BankProc::new(&c, if i == 0 { "bank-p0" } else { "bank-p1" }, "a");
        bank.start(Some(point)).await;
        let parts = [
            bank.spec("a1:-10"),
            ParticipantSpec {
                participant_id: b.id.clone(),
                address: b.addr.clone(),
                payload: b"x".to_vec(),
            },
        ];
        let key = format!("k-{point}");
        let mut r = cl.begin_and_commit(&key, 60_000, b"", &parts).await.unwrap();
        // On a loaded machine a write before the first Prepare (the txid
        // reservation, ADR 0012) may time out: UNKNOWN, and no Prepare
        // reached the armed bank. Ask again with the same key until one did.
        for _ in 0..20 {
            if r.outcome != TxOutcome::Unknown || bank.crashed_within(Duration::from_millis(500)).await.is_some() {
                break;
            }
            r = cl.begin_and_commit(&key, 60_000, b"", &parts).await.unwrap();
        }
        if bank.proc_.pid().is_some() {
            bank.wait_crashed().await;
        } else {
            assert!(bank.once.exists(), "{point}: crash point not reached");
        }
        bank.start(None).await;
        // Ask again with the same key until the outcome is known.
        let mut shot = r;
        for _ in 0..20 {
            if shot.outcome != TxOutcome::Unknown {
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            shot = cl.begin_and_commit(&key, 60_000, b"", &parts).await.unwrap();
        }
        let t = shot.txid.unwrap();
        assert!(
            all_acked(&c, t, Duration::from_secs(20)).await,
            "{point}: not all acked"
        );
        bank.stop();
        let (state, total, locked, doubt) = bank.audit(t).await;
        let (want_state, want_total) = match shot.outcome {
            TxOutcome::Committed => (LocalState::Committed, 9_990),
            TxOutcome::Aborted => (LocalState::Aborted { tombstone: false }, 10_000),
            TxOutcome::Unknown => panic!("{point}: outcome still unknown"),
        };
        if point == "participant_before_durable_prepare" {
            assert_eq!(shot.outcome, TxOutcome::Aborted, "{point}: no vote was sent");
            // The undurable prepare may or may not have reached the disk.
            assert!(
                matches!(state, None | Some(LocalState::Aborted { .. })),
                "{point}: {state:?}"
            );
        } else {
            assert_eq!(shot.outcome, TxOutcome::Committed, "{point}");
            assert_eq!(state, Some(want_state), "{point}");
        }
        assert_eq!(
            (total, locked, doubt),
            (want_total, 0, 0),
            "{point}: applied once, nothing locked"
        );
        let other = b.state(t);
        let other_ok = match shot.outcome {
            TxOutcome::Committed => other == Some(LocalState::Committed),
            _ => matches!(other, Some(LocalState::Aborted { .. })),
        };
        assert!(other_ok, "{point}: bank-b ended {other:?}");
    }
}

/// Coordinator crash points not covered above: whatever the crash, one
/// decision, applied by both participants (invariants 1, 3, 4).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t85_coordinator_crash_points_leave_one_decision_everywhere() {
    for point in [
        "coordinator_after_reserve",
        "coordinator_after_begin",
        "coordinator_before_prepare",
        "coordinator_votes_in_before_decide",
        "coordinator_mid_delivery",
    ] {
        let mut c = cluster_crashing_at(&format!("t85f-{point}"), point);
        c.leader().await;
        let (a, b) = (Svc::new("bank-a").await, Svc::new("bank-b").await);
        let parts: Vec<ParticipantSpec> = [&a, &b]
            .iter()
            .map(|s| ParticipantSpec {
                participant_id: s.id.clone(),
                address: s.addr.clone(),
                payload: b"w".to_vec(),
            })
            .collect();
        let mut shot = None;
        for _ in 0..30 {
            match c.client().begin_and_commit("k", 60_000, b"", &parts).await {
                Ok(r) if r.outcome != TxOutcome::Unknown => {
                    shot = Some(r);
                    break;
                }
                _ => tokio::time::sleep(Duration::from_millis(300)).await,
            }
        }
        let shot = shot.unwrap_or_else(|| panic!("{point}: no outcome"));
        let t = shot.txid.unwrap();
        let want = match shot.outcome {
            TxOutcome::Committed => LocalState::Committed,
            _ => LocalState::Aborted { tombstone: false },
        };
        for s in [&a, &b] {
            assert!(
                s.wait_state(t, want, Duration::from_secs(20)).await,
                "{point}: {} ended {:?}, decision {:?}",
                s.id,
                s.state(t),
                shot.outcome
            );
        }
        // Delivery runs after the answer, and its crash point comes after the
        // participant applied and its ack was recorded: wait for it.
        let fired = c.dir.path().join("failpoint-fired");
        for _ in 0..100 {
            if fired.exists() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(fired.exists(), "{point}: not reached");
        let read = c.client().decision(t).await.unwrap();
        let agrees = matches!(
            (read, shot.outcome),
            (DecisionRead::Committed, TxOutcome::Committed)
                | (DecisionRead::Aborted, TxOutcome::Aborted)
                | (DecisionRead::UnknownPresumedAbort, _)
        );
        assert!(agrees, "{point}: read {read:?} vs told {:?}", shot.outcome);
    }
}

/// ADR 0012, the one-write commit's own crash window: the leader dies after
/// the votes are in and before its one write (the transaction's record and
/// decision together). The cluster never recorded the transaction; both
/// banks hold YES votes and locks for it. Their own recovery passes ask the
/// new leader, are told "unknown: presumed abort" (never COMMIT) and apply
/// ABORT, which frees the locks: a later transfer of the same accounts
/// commits. No money moves twice, nothing stays locked (invariants 1, 3,
/// 5, 7). A retry with the same key right after the crash starts a new
/// transaction, which may vote NO on the first one's locks: ABORTED, which
/// is true (the money did not move).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t85_one_write_leader_dies_before_its_write_participants_presume_abort() {
    let mut c = cluster_crashing_at("t85g", "coordinator_votes_in_before_decide");
    c.leader().await;
    let mut a = BankProc::new(&c, "bank-a", "a");
    let mut b = BankProc::new(&c, "bank-b", "b");
    a.start(None).await;
    b.start(None).await;
    let parts = [a.spec("a0:-7"), b.spec("b0:7")];
    // Same key until an outcome is known; then, if that was the ABORT of
    // a retry that met the first attempt's locks, new keys until the banks
    // have freed them by themselves (their recovery pass) and one commits.
    let mut told = Vec::new();
    let mut key = "move-7".to_string();
    for i in 0..80 {
        match c.client().begin_and_commit(&key, 60_000, b"", &parts).await {
            Ok(r) if r.outcome == TxOutcome::Committed => {
                told.push((r.txid.unwrap(), r.outcome));
                break;
            }
            Ok(r) if r.outcome == TxOutcome::Aborted => {
                told.push((r.txid.unwrap(), r.outcome));
                key = format!("move-7-again-{i}");
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        c.dir.path().join("failpoint-fired").exists(),
        "the crash point was not reached"
    );
    eprintln!("outcomes told after the crash: {told:?}");
    let &(t_ok, last) = told.last().expect("no outcome");
    assert_eq!(
        last,
        TxOutcome::Committed,
        "the banks never freed the first attempt's locks: {told:?}"
    );
    a.kill9();
    b.kill9();
    let endpoints = c.procs.api_addrs();
    let mut unrecorded = BTreeSet::new();
    for (bank, moved) in [(&a, -7), (&b, 7)] {
        let store = dtx_bank::open_bank(&bank.proc_.data_dir, bank.prefix, 10, 1000)
            .await
            .unwrap();
        // The last transfer's phase two may not have reached the bank
        // before it was killed: one more recovery pass applies it from the
        // cluster's answer.
        participant_sdk::server::recover_once(&store, &endpoints).await.unwrap();
        let entries = store.entries().unwrap();
        assert!(
            store.in_doubt().unwrap().is_empty(),
            "{}: still in doubt: {entries:?}",
            bank.id
        );
        for (txid, e) in entries {
            let txid = txid.txid;
            match told.iter().find(|(t, _)| *t == txid) {
                Some((_, TxOutcome::Committed)) => assert_eq!(e.state, LocalState::Committed, "{}: {txid}", bank.id),
                _ => {
                    assert!(
                        matches!(e.state, LocalState::Aborted { .. }),
                        "{}: {txid} {:?}",
                        bank.id,
                        e.state
                    );
                    if !told.iter().any(|(t, _)| *t == txid) {
                        unrecorded.insert(txid);
                    }
                }
            }
        }
        let (total, _, locked) = dtx_bank::audit(&store).unwrap();
        assert_eq!(
            (total, locked),
            (10_000 + moved, 0),
            "{}: moved once, nothing locked",
            bank.id
        );
    }
    assert_eq!(
        unrecorded.len(),
        1,
        "one first attempt nobody was told of: {unrecorded:?}"
    );
    let t1 = *unrecorded.first().unwrap();
    assert_eq!(
        c.client().decision(t1).await.unwrap(),
        DecisionRead::UnknownPresumedAbort,
        "the unrecorded first attempt"
    );
    assert_eq!(c.client().decision(t_ok).await.unwrap(), DecisionRead::Committed);
}
