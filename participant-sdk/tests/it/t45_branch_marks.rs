//! A branch's marks in the participant's own store (docs/protocol.md,
//! "Branches"): a YES prepared in a handler is written with a mark "not
//! known to be registered" in the same durable write; the mark is listed
//! for recovery only while no flow in this process is registering it; and
//! recovery drops, without asking the cluster (which would fence the
//! branch), a mark whose work is already decided here (invariant 5: the
//! vote is held until a decision; a decided record is never asked about
//! again).

use participant_sdk::log::LocalState;
use participant_sdk::log::Message;
use participant_sdk::log::Vote;
use participant_sdk::store::BranchPrepare;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Reply;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::View;
use participant_sdk::GlobalTxid;

const INC: u64 = 0x0c0c_0c0c_0c0c_0c0c;

/// Stages the payload; "no" votes NO.
struct Stage;

impl Resource for Stage {
    fn prepare(&self, _v: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
        if payload == b"no" {
            return staged.refuse("no, said the payload".to_string());
        }
        staged.put(format!("staged/{}", txid.txid).as_bytes(), payload);
        Vote::Yes
    }
    fn commit(&self, _v: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        staged.delete(format!("staged/{}", txid.txid).as_bytes());
        staged.put(format!("applied/{}", txid.txid).as_bytes(), b"1");
    }
    fn abort(&self, _v: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        staged.delete(format!("staged/{}", txid.txid).as_bytes());
    }
}

fn vote_of(p: &BranchPrepare) -> Option<Vote> {
    match p {
        BranchPrepare::Answered(a) => match a.reply {
            Reply::Vote(v) => Some(v),
            Reply::Ack => None,
        },
        BranchPrepare::Exists(_) => None,
    }
}

#[tokio::test]
async fn t45_marks_follow_the_branch_flow_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let t1 = GlobalTxid::new(INC, 1);
    let t2 = GlobalTxid::new(INC, 2);
    {
        let store = ParticipantStore::open(dir.path(), Stage).unwrap();
        let p = store.prepare_branch(t1, "svc", b"work").await.unwrap();
        assert_eq!(vote_of(&p), Some(Vote::Yes));
        assert_eq!(
            store.entry(t1).unwrap().map(|e| e.state),
            Some(LocalState::Prepared { vote: Vote::Yes })
        );
        // Its flow is running here: recovery leaves it alone.
        assert!(store.unregistered_branches().unwrap().is_empty());
        // A second prepare of the same transaction does nothing.
        let again = store.prepare_branch(t1, "svc", b"other").await.unwrap();
        assert!(matches!(again, BranchPrepare::Exists(_)), "{again:?}");
        assert!(store.unregistered_branches().unwrap().is_empty());
        // The flow ends without an answer from the cluster: recovery's now.
        store.finish_branch(t1, false).unwrap();
        assert_eq!(store.unregistered_branches().unwrap(), [(t1, "svc".to_string())]);

        // A NO holds nothing and leaves no mark.
        let p = store.prepare_branch(t2, "svc", b"no").await.unwrap();
        assert_eq!(vote_of(&p), Some(Vote::No));
        assert_eq!(store.unregistered_branches().unwrap().len(), 1);
        store.flush().await.unwrap();
    }
    // After a restart (no flow runs any more) the mark is still there.
    let store = ParticipantStore::open(dir.path(), Stage).unwrap();
    assert_eq!(store.unregistered_branches().unwrap(), [(t1, "svc".to_string())]);
    store.finish_branch(t1, true).unwrap();
    assert!(store.unregistered_branches().unwrap().is_empty());
}

#[tokio::test]
async fn t45_recovery_drops_the_mark_of_work_decided_here_without_asking() {
    let dir = tempfile::tempdir().unwrap();
    let store = ParticipantStore::open(dir.path(), Stage).unwrap();
    let t = GlobalTxid::new(INC, 7);
    store.prepare_branch(t, "svc", b"work").await.unwrap();
    store.finish_branch(t, false).unwrap();
    // Phase two reached it before recovery did.
    let term = store.entry(t).unwrap().unwrap().term;
    store.handle(t, Message::Commit { term }, b"").await.unwrap();
    assert_eq!(store.unregistered_branches().unwrap().len(), 1);
    // No cluster listens there: a question would fail the pass.
    let settled = participant_sdk::server::recover_once(store.as_ref(), &["127.0.0.1:1".to_string()])
        .await
        .unwrap();
    assert_eq!(settled, 0);
    assert!(store.unregistered_branches().unwrap().is_empty());
    assert_eq!(store.entry(t).unwrap().map(|e| e.state), Some(LocalState::Committed));

    // A mark of work still held does ask, and says it could not.
    let held = GlobalTxid::new(INC, 8);
    store.prepare_branch(held, "svc", b"work").await.unwrap();
    store.finish_branch(held, false).unwrap();
    let err = participant_sdk::server::recover_once(store.as_ref(), &["127.0.0.1:1".to_string()])
        .await
        .unwrap_err();
    assert!(err.contains("branch svc"), "{err}");
    assert_eq!(store.unregistered_branches().unwrap(), [(held, "svc".to_string())]);
    assert_eq!(
        store.entry(held).unwrap().map(|e| e.state),
        Some(LocalState::Prepared { vote: Vote::Yes })
    );
}

/// A branch whose flow is still registering it is not known to be a
/// member: a recovery pass asks nothing about it, not even in its
/// in-doubt pass, where the decision of its transaction (read by txid
/// alone) may be a COMMIT without it. Before, a flow registering for
/// longer than the in-doubt age was asked about there and could commit a
/// non-member's work.
#[tokio::test]
async fn t45_a_branch_still_registering_is_not_asked_about_by_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let store = ParticipantStore::open(dir.path(), Stage).unwrap();
    let t = GlobalTxid::new(INC, 9);
    store.prepare_branch(t, "svc", b"work").await.unwrap();
    // No cluster listens there: any question would fail the pass.
    let settled = participant_sdk::server::recover_once(store.as_ref(), &["127.0.0.1:1".to_string()])
        .await
        .unwrap();
    assert_eq!(settled, 0);
    assert_eq!(
        store.entry(t).unwrap().map(|e| e.state),
        Some(LocalState::Prepared { vote: Vote::Yes })
    );
    // Its flow ends without an answer: now recovery asks, by branch.
    store.finish_branch(t, false).unwrap();
    let err = participant_sdk::server::recover_once(store.as_ref(), &["127.0.0.1:1".to_string()])
        .await
        .unwrap_err();
    assert!(err.contains("branch svc"), "{err}");
}

/// A caller that goes away while its branch registers (the handler's
/// future dropped) leaves the mark to recovery, not a flow counted as
/// running for good.
#[tokio::test]
async fn t45_a_join_dropped_while_registering_leaves_its_mark_to_recovery() {
    let dir = tempfile::tempdir().unwrap();
    let store = ParticipantStore::open(dir.path(), Stage).unwrap();
    // A "cluster" that accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((c, _)) = listener.accept().await {
            conns.push(c);
        }
    });
    let client = dtx_client::Client::new(dtx_client::ClientConfig::new(vec![addr])).unwrap();
    let who = participant_sdk::branch::BranchIdentity {
        participant_id: "svc".into(),
        address: "127.0.0.1:2".into(),
    };
    let t = GlobalTxid::new(INC, 10);
    let join = participant_sdk::branch::join(&store, &client, &who, t, b"work");
    let gone = tokio::time::timeout(std::time::Duration::from_millis(300), join).await;
    assert!(
        gone.is_err(),
        "the registration got an answer from a silent cluster: {gone:?}"
    );
    held.abort();
    assert_eq!(store.unregistered_branches().unwrap(), [(t, "svc".to_string())]);
    assert_eq!(
        store.entry(t).unwrap().map(|e| e.state),
        Some(LocalState::Prepared { vote: Vote::Yes })
    );
}
