//! Branches that prepare where they run (docs/protocol.md, "Branches";
//! docs/adr/0046): a service joins a transaction from its own request
//! handler, prepared and registered with its vote in one call, and gets no
//! Prepare at commit time.
//!
//! The first tests run the branch in this test's process (the SDK's
//! `branch::join` on a participant store whose service is on a real socket)
//! against real node processes; the crash windows run the bank as its own
//! process (`dtx-dev bank-serve --app-listen`, its `bank.v1.Bank` API) and
//! abort it, like kill -9, at the SDK's crash points. Invariants 2 and 3
//! (one decision, applied by every member), 5 (a YES vote is held until the
//! decision) and 8 (no commit without every member's YES), for members that
//! joined as branches; a branch that is not a member never commits.
//! Run with `cargo test -p dtx-devtools --test it -- t120_branches::`.

use crate::common;

use std::time::Duration;

use common::branch_bank::commit_outcome;
use common::branch_bank::BranchBank;
use common::participants::Svc;
use common::TestCluster;
use dtx_bank::branch::pb;
use dtx_client::BranchDecision;
use dtx_client::BranchVote;
use dtx_client::ClientError;
use dtx_client::TxOutcome;
use dtx_proto::metadata::BranchRefusalKind;
use dtx_proto::v1::LocalRecord;
use participant_sdk::branch::BranchError;
use participant_sdk::branch::BranchIdentity;
use participant_sdk::log::LocalState;
use participant_sdk::log::Vote;
use participant_sdk::GlobalTxid;

fn who(s: &Svc) -> BranchIdentity {
    BranchIdentity {
        participant_id: s.id.clone(),
        address: s.addr.clone(),
    }
}

fn staged(s: &Svc, txid: u64) -> Option<Vec<u8>> {
    s.store.view().get(format!("staged/{txid}").as_bytes()).unwrap()
}

fn applied(s: &Svc, txid: u64) -> bool {
    s.store
        .view()
        .get(format!("applied/{txid}").as_bytes())
        .unwrap()
        .is_some()
}

fn member_ids(st: &dtx_proto::v1::StatusResponse) -> Vec<String> {
    st.participants.iter().map(|p| p.id.clone()).collect()
}

const WAIT: Duration = Duration::from_secs(15);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t120_a_branch_and_a_prepared_participant_commit_together() {
    let mut c = TestCluster::start_with("t120a", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 2_000;
    });
    c.leader().await;
    let cl = c.client();
    let branch = Svc::new("branch-a").await;
    let driven = Svc::new("driven-b").await;

    // Mixed: one branch registered with its vote from "its handler", one
    // participant enlisted with a payload and driven by Prepare.
    let began = cl.begin("mixed", 30_000, b"").await.unwrap();
    let t = began.txid;
    let g = GlobalTxid::new(began.incarnation, t);
    let joined = participant_sdk::branch::join(&branch.store, &cl, &who(&branch), g, b"debit 5")
        .await
        .unwrap();
    assert_eq!(joined.vote, Vote::Yes);
    assert!(joined.term >= 1);
    // Prepared and held before the caller hears back (invariant 5).
    assert_eq!(branch.state(t), Some(LocalState::Prepared { vote: Vote::Yes }));
    assert_eq!(staged(&branch, t).as_deref(), Some(&b"debit 5"[..]));
    cl.enlist(t, &driven.id, &driven.addr, b"credit 5").await.unwrap();
    assert_eq!(member_ids(&cl.status(t).await.unwrap()), ["branch-a", "driven-b"]);
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert!(branch.wait_state(t, LocalState::Committed, WAIT).await);
    assert!(driven.wait_state(t, LocalState::Committed, WAIT).await);
    assert!(applied(&branch, t) && applied(&driven, t));
    // The branch's vote came with its registration: no Prepare reached it.
    let prepares = |s: &Svc| s.prepares_received.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(prepares(&branch), 0, "a registered branch was asked to prepare");
    assert_eq!(prepares(&driven), 1);
    // Nothing is left marked for recovery.
    assert!(branch.store.unregistered_branches().unwrap().is_empty());

    // Every member a branch: committed with no Prepare at all.
    let began = cl.begin("branches-only", 30_000, b"").await.unwrap();
    let t = began.txid;
    let g = GlobalTxid::new(began.incarnation, t);
    for s in [&branch, &driven] {
        let j = participant_sdk::branch::join(&s.store, &cl, &who(s), g, b"w")
            .await
            .unwrap();
        assert_eq!(j.vote, Vote::Yes);
    }
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert!(branch.wait_state(t, LocalState::Committed, WAIT).await);
    assert!(driven.wait_state(t, LocalState::Committed, WAIT).await);
    assert_eq!((prepares(&branch), prepares(&driven)), (0, 1));

    // A branch whose handler refused registers NO: the transaction is
    // decided ABORT by that registration; the prepared member rolls back.
    let began = cl.begin("branch-no", 30_000, b"").await.unwrap();
    let t = began.txid;
    cl.enlist(t, &driven.id, &driven.addr, b"credit 5").await.unwrap();
    let j = participant_sdk::branch::join(
        &branch.store,
        &cl,
        &who(&branch),
        GlobalTxid::new(began.incarnation, t),
        b"no",
    )
    .await
    .unwrap();
    assert_eq!(j.vote, Vote::No);
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Aborted);
    let note = cl.status(t).await.unwrap().decision.unwrap().note;
    assert!(note.contains("branch-a"), "the NO branch is named in the note: {note}");
    // driven-b was never asked to prepare (the NO decided first): the
    // ABORT leaves a tombstone, so a late Prepare would vote NO.
    assert!(
        driven
            .wait_state(t, LocalState::Aborted { tombstone: true }, WAIT)
            .await
    );
    assert_eq!(prepares(&driven), 1);
    assert!(!applied(&driven, t));

    // READ_ONLY: registered, nothing held, the others commit.
    let began = cl.begin("branch-ro", 30_000, b"").await.unwrap();
    let t = began.txid;
    let j = participant_sdk::branch::join(
        &branch.store,
        &cl,
        &who(&branch),
        GlobalTxid::new(began.incarnation, t),
        b"ro",
    )
    .await
    .unwrap();
    assert_eq!(j.vote, Vote::ReadOnly);
    cl.enlist(t, &driven.id, &driven.addr, b"credit 1").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    assert!(driven.wait_state(t, LocalState::Committed, WAIT).await);
    assert!(!applied(&branch, t));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t120_late_fenced_and_repeated_registrations() {
    let mut c = TestCluster::start_with("t120b", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 2_000;
    });
    c.leader().await;
    let cl = c.client();
    let branch = Svc::new("branch-a").await;
    let driven = Svc::new("driven-b").await;

    // A registration racing the decision and losing: the transaction was
    // decided without the branch, so it is refused as too late and the
    // branch rolls back its prepared work before its handler answers.
    let began = cl.begin("late", 30_000, b"").await.unwrap();
    let t = began.txid;
    cl.enlist(t, &driven.id, &driven.addr, b"credit 5").await.unwrap();
    assert_eq!(cl.commit(t).await.unwrap(), TxOutcome::Committed);
    let late = participant_sdk::branch::join(
        &branch.store,
        &cl,
        &who(&branch),
        GlobalTxid::new(began.incarnation, t),
        b"debit 5",
    )
    .await;
    assert!(matches!(late, Err(BranchError::RolledBack { .. })), "{late:?}");
    assert_eq!(branch.state(t), Some(LocalState::Aborted { tombstone: false }));
    assert_eq!(staged(&branch, t), None, "a refused branch keeps its work prepared");
    assert!(branch.store.unregistered_branches().unwrap().is_empty());
    assert_eq!(member_ids(&cl.status(t).await.unwrap()), ["driven-b"]);
    assert!(driven.wait_state(t, LocalState::Committed, WAIT).await);

    // Past the transaction's deadline: the cluster aborted it; refused.
    let began = cl.begin("deadline", 1_000, b"").await.unwrap();
    let t = began.txid;
    let until = tokio::time::Instant::now() + WAIT;
    loop {
        match cl.decision(t).await.unwrap() {
            dtx_client::DecisionRead::Aborted => break,
            other => {
                assert!(
                    tokio::time::Instant::now() < until,
                    "not aborted at its deadline: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let late = participant_sdk::branch::join(
        &branch.store,
        &cl,
        &who(&branch),
        GlobalTxid::new(began.incarnation, t),
        b"x",
    )
    .await;
    assert!(matches!(late, Err(BranchError::RolledBack { .. })), "{late:?}");
    assert_eq!(staged(&branch, t), None);

    // A registration whose answer was lost is sent again: the same answer,
    // recorded once. Another vote from the same branch is a conflict and
    // changes nothing.
    let began = cl.begin("repeat", 30_000, b"").await.unwrap();
    let t = began.txid;
    let inc = began.incarnation;
    let first = cl
        .register_branch((inc, t), &driven.id, &driven.addr, BranchVote::Yes, "")
        .await
        .unwrap();
    let again = cl
        .register_branch((inc, t), &driven.id, &driven.addr, BranchVote::Yes, "")
        .await
        .unwrap();
    assert!(!first.existing && again.existing);
    assert_eq!((first.term, first.incarnation), (again.term, again.incarnation));
    assert_eq!(member_ids(&cl.status(t).await.unwrap()), ["driven-b"]);
    let other = cl
        .register_branch((inc, t), &driven.id, &driven.addr, BranchVote::No, "changed my mind")
        .await;
    assert!(
        matches!(
            &other,
            Err(ClientError::BranchRefused {
                kind: BranchRefusalKind::Conflict,
                ..
            })
        ),
        "{other:?}"
    );
    // Another incarnation's registration of this txid belongs elsewhere.
    let stranger = cl
        .register_branch((inc ^ 1, t), &branch.id, &branch.addr, BranchVote::Yes, "")
        .await;
    assert!(
        matches!(
            &stranger,
            Err(ClientError::BranchRefused {
                kind: BranchRefusalKind::TooLate,
                ..
            })
        ),
        "{stranger:?}"
    );
    // Still open: asking as a non-member fences the branch out, and its
    // registration is refused from then on, while the members commit.
    assert_eq!(
        cl.branch_decision(t, &branch.id, inc).await.unwrap(),
        BranchDecision::Abort { member: false }
    );
    let fenced = cl
        .register_branch((inc, t), &branch.id, &branch.addr, BranchVote::Yes, "")
        .await;
    assert!(
        matches!(
            &fenced,
            Err(ClientError::BranchRefused {
                kind: BranchRefusalKind::Fenced,
                ..
            })
        ),
        "{fenced:?}"
    );
    let enlist_fenced = cl.enlist(t, &branch.id, &branch.addr, b"x").await;
    assert!(
        enlist_fenced.is_err(),
        "a fenced branch was enlisted: {enlist_fenced:?}"
    );
    assert_eq!(
        cl.branch_decision(t, &driven.id, inc).await.unwrap(),
        BranchDecision::Pending
    );
    // driven-b registered YES by hand but prepared nothing: the commit is
    // delivered and refused there until an operator steps in; abort instead
    // so that the decision is one it can apply.
    assert_eq!(cl.abort(t, "test").await.unwrap(), TxOutcome::Aborted);
    assert_eq!(
        cl.branch_decision(t, &driven.id, inc).await.unwrap(),
        BranchDecision::Abort { member: true }
    );
}

/// The stopped bank: (balances, locked accounts, in doubt, what its
/// apply log says of `g`, branches still marked).
async fn audit(b: &mut BranchBank, g: GlobalTxid) -> (Vec<(String, i64)>, usize, usize, Vec<String>, usize) {
    b.proc_.stop(Duration::from_secs(10));
    let store = dtx_bank::open_bank(&b.proc_.data_dir, &b.proc_.prefix, 10, 1000)
        .await
        .unwrap();
    let (_, _, locked) = dtx_bank::audit(&store).unwrap();
    let applied = dtx_bank::apply_log_in(&store)
        .unwrap()
        .into_iter()
        .filter(|(t, _)| *t == g)
        .map(|(_, o)| o)
        .collect();
    (
        dtx_bank::balances(&store).unwrap(),
        locked,
        store.in_doubt().unwrap().len(),
        applied,
        store.unregistered_branches().unwrap().len(),
    )
}

fn balance(balances: &[(String, i64)], account: &str) -> i64 {
    balances.iter().find(|(a, _)| a == account).unwrap().1
}

/// The bank's API answers the caller with the new balances; the branch
/// commits with a Prepare-driven bank. Then the bank is killed after its
/// PREPARE-equivalent (the durable YES) and before registering: the
/// caller's call fails, the transaction goes on without it, and the
/// restarted bank's recovery fences it out and rolls its work back, never
/// commits it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t120_bank_killed_between_prepare_and_registration_rolls_back() {
    let mut c = TestCluster::start_with("t120c", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 2_000;
    });
    c.leader().await;
    let cl = c.client();
    let mut a = BranchBank::new(&c, "bank-a", "a", None);
    let mut b = BranchBank::new(&c, "bank-b", "b", None);
    a.start(Some("participant_branch_prepared_before_register")).await;
    b.start(None).await;

    let began = cl.begin("crash-before-register", 30_000, b"").await.unwrap();
    let g = GlobalTxid::new(began.incarnation, began.txid);
    let lost = a.change(g, &[("a0", -30)]).await;
    assert!(lost.is_err(), "bank-a answered past its crash point: {lost:?}");
    a.wait_crashed().await;
    // The caller saw an error: here it goes on with bank-b alone.
    cl.enlist(g.txid, &b.proc_.id, &b.proc_.addr, b"b0:30").await.unwrap();
    // bank-a comes back: recovery finds the marked branch, asks the
    // cluster, is fenced out of the open transaction and rolls back.
    a.start(None).await;
    a.wait_record(g, LocalRecord::Aborted).await;
    let st = cl.status(g.txid).await.unwrap();
    assert_eq!(member_ids(&st), ["bank-b"]);
    let late = cl
        .register_branch((g.incarnation, g.txid), "bank-a", &a.proc_.addr, BranchVote::Yes, "")
        .await;
    assert!(
        matches!(
            &late,
            Err(ClientError::BranchRefused {
                kind: BranchRefusalKind::Fenced,
                ..
            })
        ),
        "{late:?}"
    );
    assert_eq!(commit_outcome(&cl, g.txid, 10).await, TxOutcome::Committed);
    b.wait_record(g, LocalRecord::Committed).await;

    let (bal, locked, doubt, log, marked) = audit(&mut a, g).await;
    assert_eq!(balance(&bal, "a0"), 1000, "bank-a's fenced work was applied");
    assert_eq!((locked, doubt, marked), (0, 0, 0));
    assert_eq!(log, ["ABORT"]);
    let (bal, locked, doubt, log, _) = audit(&mut b, g).await;
    assert_eq!(balance(&bal, "b0"), 1030);
    assert_eq!((locked, doubt), (0, 0));
    assert_eq!(log, ["COMMIT"]);
}

/// Killed after registering and before answering its caller: the caller
/// does not know, asks to commit, and the decision reaches the restarted
/// bank (its vote was recorded), which applies it once. Also: the bank's
/// answer carries the balance the transaction will leave.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t120_bank_killed_between_registration_and_answer_commits() {
    let mut c = TestCluster::start_with("t120d", 3, |cfg| {
        cfg.txn.prepare_timeout_ms = 2_000;
    });
    c.leader().await;
    let cl = c.client();
    let mut a = BranchBank::new(&c, "bank-a", "a", None);
    let mut b = BranchBank::new(&c, "bank-b", "b", None);
    a.start(Some("participant_branch_registered_before_answer")).await;
    b.start(None).await;

    // bank-b as a branch answers with the balance.
    let began = cl.begin("answered", 30_000, b"").await.unwrap();
    let g1 = GlobalTxid::new(began.incarnation, began.txid);
    let reply = b.change(g1, &[("b1", -100)]).await.unwrap();
    assert_eq!(reply.balances.len(), 1);
    assert_eq!(
        (
            reply.balances[0].account.as_str(),
            reply.balances[0].balance_if_committed
        ),
        ("b1", 900)
    );
    // Too little money: registered NO, the transaction aborts.
    let began = cl.begin("refused", 30_000, b"").await.unwrap();
    let g2 = GlobalTxid::new(began.incarnation, began.txid);
    let refused = b.change(g2, &[("b2", -5_000)]).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("too little"), "{refused:?}");
    assert_eq!(commit_outcome(&cl, g2.txid, 10).await, TxOutcome::Aborted);
    // A call outside any transaction is refused and does nothing.
    let mut api = pb::bank_client::BankClient::connect(format!("http://{}", b.app))
        .await
        .unwrap();
    let bare = api
        .change(pb::ChangeRequest {
            changes: vec![pb::AccountChange {
                account: "b3".into(),
                delta: 1,
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(bare.code(), tonic::Code::InvalidArgument, "{bare:?}");

    // bank-a registers in g1, then dies before answering.
    let lost = a.change(g1, &[("a1", 100)]).await;
    assert!(lost.is_err(), "bank-a answered past its crash point: {lost:?}");
    a.wait_crashed().await;
    assert_eq!(member_ids(&cl.status(g1.txid).await.unwrap()), ["bank-b", "bank-a"]);
    assert_eq!(commit_outcome(&cl, g1.txid, 10).await, TxOutcome::Committed);
    b.wait_record(g1, LocalRecord::Committed).await;
    a.start(None).await;
    a.wait_record(g1, LocalRecord::Committed).await;

    let (bal, locked, doubt, log, marked) = audit(&mut a, g1).await;
    assert_eq!(balance(&bal, "a1"), 1100);
    assert_eq!((locked, doubt, marked), (0, 0, 0));
    assert_eq!(log, ["COMMIT"], "applied once");
    let (bal, locked, doubt, log, _) = audit(&mut b, g1).await;
    assert_eq!(balance(&bal, "b1"), 900);
    assert_eq!(balance(&bal, "b2"), 1000);
    assert_eq!((locked, doubt), (0, 0));
    assert_eq!(log, ["COMMIT"]);
}
