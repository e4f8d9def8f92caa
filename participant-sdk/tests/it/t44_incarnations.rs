//! Cluster incarnations (ADR 0033) at the participant: a transaction is
//! (incarnation, txid), so the same txid number handed out by two clusters
//! (or by a cluster before and after a restore) is two independent
//! transactions with their own records, terms and tombstones; recovery asks
//! the cluster once per incarnation and presumes nothing about a txid the
//! cluster says it did not hand out in that incarnation; and a durable term
//! floor per incarnation refuses a Prepare or CommitOnePhase of a txid
//! without a record from a term below the highest one recorded, so a
//! deposed leader's re-sent one-phase commit cannot apply the work again
//! once its record was garbage-collected (invariants 5, 8, 9).

use std::net::IpAddr;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;

use dtx_client::DecisionAnswer;
use dtx_client::DecisionRead;
use dtx_proto::v1 as pb;
use dtx_proto::v1::coordinator_server::Coordinator;
use dtx_proto::v1::coordinator_server::CoordinatorServer;
use dtx_proto::v1::participant_service_server::ParticipantService;
use participant_sdk::log::LocalState;
use participant_sdk::log::Message;
use participant_sdk::log::Refusal;
use participant_sdk::log::Vote;
use participant_sdk::server::gc_safe;
use participant_sdk::server::ParticipantServer;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Reply;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::StoreError;
use participant_sdk::store::View;
use participant_sdk::GlobalTxid;
use tonic::Request;
use tonic::Response;
use tonic::Status;

const A: u64 = 0x0a0a_0a0a_0a0a_0a0a;
const B: u64 = 0x0b0b_0b0b_0b0b_0b0b;

/// Stages the payload under `staged/<transaction>` and applies it under
/// `applied/<transaction>`, counting its calls.
#[derive(Clone, Default)]
struct Probe {
    prepares: Arc<AtomicUsize>,
    commits: Arc<AtomicUsize>,
}

fn k(prefix: &str, txid: GlobalTxid) -> Vec<u8> {
    format!("{prefix}/{txid}").into_bytes()
}

impl Resource for Probe {
    fn prepare(&self, _view: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
        self.prepares.fetch_add(1, Ordering::SeqCst);
        staged.put(&k("staged", txid), payload);
        Vote::Yes
    }

    fn commit(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        self.commits.fetch_add(1, Ordering::SeqCst);
        let v = view.get(&k("staged", txid)).unwrap().unwrap_or_default();
        staged.delete(&k("staged", txid));
        staged.put(&k("applied", txid), &v);
    }

    fn abort(&self, _view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        staged.delete(&k("staged", txid));
    }
}

fn g(incarnation: u64, txid: u64) -> GlobalTxid {
    GlobalTxid::new(incarnation, txid)
}

/// A double apply at the participant: CommitOnePhase(x) at
/// term T+1 commits; x's record is garbage-collected; the deposed leader of
/// term T re-sends CommitOnePhase(x): refused as stale, the resource not
/// asked again. The floor survives a reopen, and another incarnation's
/// floor is its own.
#[tokio::test]
async fn inv9_a_one_phase_commit_resent_from_an_older_term_after_gc_is_refused_not_applied_again() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let x = g(A, 7);
    {
        let s = ParticipantStore::open(dir.path(), probe.clone()).unwrap();
        assert_eq!(s.term_floor(A), 0);
        let r = s.handle(x, Message::CommitOnePhase { term: 4 }, b"pay").await.unwrap();
        assert_eq!(r, Reply::Ack);
        assert_eq!(probe.commits.load(Ordering::SeqCst), 1);
        assert_eq!(s.term_floor(A), 4, "raised with the record");
        // The log GC forgets x (the cluster acked it).
        let c = s.gc_candidates(u64::MAX, 10).unwrap();
        assert_eq!(c.iter().map(|(_, t)| *t).collect::<Vec<_>>(), vec![x]);
        assert_eq!(s.forget_records(&c).unwrap(), 1);
        assert_eq!(s.entry(x).unwrap(), None);
        assert_eq!(s.term_floor(A), 4, "GC of records never lowers the floor");
        // The deposed leader of term 3 re-sends it.
        let err = s
            .handle(x, Message::CommitOnePhase { term: 3 }, b"pay")
            .await
            .unwrap_err();
        assert!(
            matches!(err, StoreError::Refused(Refusal::StaleTerm { got: 3, seen: 4 })),
            "{err:?}"
        );
        let err = s.handle(g(A, 8), Message::Prepare { term: 3 }, b"p").await.unwrap_err();
        assert!(matches!(
            err,
            StoreError::Refused(Refusal::StaleTerm { got: 3, seen: 4 })
        ));
        assert_eq!(
            probe.prepares.load(Ordering::SeqCst),
            1,
            "the resource was not asked again"
        );
        assert_eq!(probe.commits.load(Ordering::SeqCst), 1, "applied once");
        assert_eq!(s.entry(x).unwrap(), None, "a refusal records nothing");
        assert_eq!(s.entry(g(A, 8)).unwrap(), None);
    }
    // Durable: after a reopen the floor still refuses.
    let s = ParticipantStore::open(dir.path(), probe.clone()).unwrap();
    assert_eq!(s.term_floor(A), 4);
    let err = s
        .handle(x, Message::CommitOnePhase { term: 3 }, b"pay")
        .await
        .unwrap_err();
    assert!(matches!(
        err,
        StoreError::Refused(Refusal::StaleTerm { got: 3, seen: 4 })
    ));
    assert_eq!(probe.commits.load(Ordering::SeqCst), 1);
    // Another incarnation (another cluster, or the cluster after a
    // restore) has its own floor: its term 3 is not stale.
    assert_eq!(s.term_floor(B), 0);
    assert_eq!(
        s.handle(g(B, 7), Message::CommitOnePhase { term: 3 }, b"other")
            .await
            .unwrap(),
        Reply::Ack
    );
    assert_eq!(s.term_floor(B), 3);
    assert_eq!(s.term_floor(A), 4);
    assert_eq!(s.term_floor(0), 0, "incarnation 0 untouched");
    // An Abort of an unknown txid below the floor still leaves its
    // tombstone; a Commit of one is still a commit without prepare.
    assert_eq!(
        s.handle(g(A, 9), Message::Abort { term: 1 }, b"").await.unwrap(),
        Reply::Ack
    );
    assert_eq!(
        s.entry(g(A, 9)).unwrap().unwrap().state,
        LocalState::Aborted { tombstone: true }
    );
    let err = s.handle(g(A, 10), Message::Commit { term: 1 }, b"").await.unwrap_err();
    assert!(matches!(err, StoreError::Refused(Refusal::CommitWithoutPrepare)));
}

/// The floor in a group (PrepareMany): an item raising the floor makes a
/// later fresh item of a lower term stale, as single calls would.
#[tokio::test]
async fn inv9_the_term_floor_holds_inside_one_group() {
    let dir = tempfile::tempdir().unwrap();
    let s = ParticipantStore::open(dir.path(), Probe::default()).unwrap();
    let items: Vec<(GlobalTxid, u64, &[u8])> = vec![
        (g(A, 1), 5, b"a"),
        (g(A, 2), 4, b"b"), // below A's floor, now 5: refused
        (g(B, 2), 4, b"b"), // B's floor is 0: prepared
    ];
    let got = s.prepare_many(&items).await.unwrap();
    assert!(matches!(got[0], Ok(Vote::Yes)));
    assert!(matches!(
        got[1],
        Err(StoreError::Refused(Refusal::StaleTerm { got: 4, seen: 5 }))
    ));
    assert!(matches!(got[2], Ok(Vote::Yes)));
    assert_eq!(s.entry(g(A, 2)).unwrap(), None);
    assert_eq!((s.term_floor(A), s.term_floor(B)), (5, 4));
}

/// The same txid number of two incarnations (and of incarnation
/// 0) is three transactions, each with its own record, term, tombstone and
/// resource work; incarnation 0 keeps the keys of before incarnations.
#[tokio::test]
async fn inv8_the_same_txid_in_two_incarnations_is_two_independent_transactions() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let s = ParticipantStore::open(dir.path(), probe.clone()).unwrap();
    let server = ParticipantServer::new(s.clone(), "p");
    let prepare = |incarnation: u64, term: u64, payload: &[u8]| pb::PrepareRequest {
        txid: 42,
        term,
        participant_id: "p".into(),
        payload: payload.to_vec(),
        incarnation,
    };
    for (inc, term, payload) in [(0, 1, &b"old"[..]), (A, 2, b"a"), (B, 9, b"b")] {
        let r = server.prepare(Request::new(prepare(inc, term, payload))).await.unwrap();
        assert_eq!(r.into_inner().vote, pb::Vote::Yes as i32);
    }
    assert_eq!(
        probe.prepares.load(Ordering::SeqCst),
        3,
        "three transactions, three prepares"
    );
    // Commit A's: B's and the old one stay in doubt, with their own terms.
    server
        .commit(Request::new(pb::ParticipantDecisionRequest {
            txid: 42,
            term: 2,
            participant_id: "p".into(),
            incarnation: A,
        }))
        .await
        .unwrap();
    assert_eq!(s.entry(g(A, 42)).unwrap().unwrap().state, LocalState::Committed);
    assert_eq!(
        s.entry(g(B, 42)).unwrap().unwrap().state,
        LocalState::Prepared { vote: Vote::Yes }
    );
    assert_eq!(s.entry(g(B, 42)).unwrap().unwrap().term, 9);
    assert_eq!(s.entry(42).unwrap().unwrap().term, 1, "incarnation 0's own term");
    assert_eq!(
        s.view().get(b"applied/42@0a0a0a0a0a0a0a0a").unwrap(),
        Some(b"a".to_vec())
    );
    assert_eq!(
        s.view().get(b"staged/42@0b0b0b0b0b0b0b0b").unwrap(),
        Some(b"b".to_vec())
    );
    assert_eq!(s.view().get(b"staged/42").unwrap(), Some(b"old".to_vec()));
    // An Abort of B's rolls back B's work only, A's commit untouched; an
    // Abort in a third incarnation leaves a tombstone of its own.
    server
        .abort(Request::new(pb::ParticipantDecisionRequest {
            txid: 42,
            term: 9,
            participant_id: "p".into(),
            incarnation: B,
        }))
        .await
        .unwrap();
    let c = 0x0c0c_0c0c_0c0c_0c0c;
    server
        .abort(Request::new(pb::ParticipantDecisionRequest {
            txid: 42,
            term: 1,
            participant_id: "p".into(),
            incarnation: c,
        }))
        .await
        .unwrap();
    assert_eq!(
        s.entry(g(c, 42)).unwrap().unwrap().state,
        LocalState::Aborted { tombstone: true }
    );
    assert_eq!(s.entry(g(A, 42)).unwrap().unwrap().state, LocalState::Committed);
    // Inquire and Inspect answer per incarnation, naming it.
    let inq = |incarnation: u64| pb::InquireRequest {
        txid: 42,
        participant_id: "p".into(),
        incarnation,
    };
    let r = server.inquire(Request::new(inq(A))).await.unwrap().into_inner();
    assert_eq!((r.record, r.term), (pb::LocalRecord::Committed as i32, 2));
    let r = server.inquire(Request::new(inq(0))).await.unwrap().into_inner();
    assert_eq!((r.record, r.term), (pb::LocalRecord::PreparedYes as i32, 1));
    let r = server.inquire(Request::new(inq(0x0d))).await.unwrap().into_inner();
    assert_eq!(r.record, pb::LocalRecord::None as i32);
    let r = server
        .inspect(Request::new(pb::InspectParticipantRequest {
            txids: vec![42],
            in_doubt: true,
            recent: 10,
            incarnation: B,
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.records[0].incarnation, B);
    assert_eq!(r.records[0].record, pb::LocalRecord::Aborted as i32);
    assert_eq!(r.records_total, 4);
    assert_eq!(
        r.in_doubt.iter().map(|x| (x.incarnation, x.txid)).collect::<Vec<_>>(),
        vec![(0, 42)]
    );
    let mut recent: Vec<(u64, u64)> = r.recent.iter().map(|x| (x.incarnation, x.txid)).collect();
    recent.sort();
    assert_eq!(recent, vec![(0, 42), (A, 42), (B, 42), (c, 42)]);
    // Storage: incarnation 0 keeps the key of before incarnations.
    let mut old_key = vec![b'l'];
    old_key.extend_from_slice(&42u64.to_be_bytes());
    assert!(s.raw().get(&old_key).is_some());
    let mut a_key = vec![b'l'];
    a_key.extend_from_slice(&A.to_be_bytes());
    a_key.extend_from_slice(&42u64.to_be_bytes());
    assert!(s.raw().get(&a_key).is_some());
    let ids: Vec<GlobalTxid> = s.entries().unwrap().iter().map(|(t, _)| *t).collect();
    assert_eq!(ids, vec![g(0, 42), g(A, 42), g(B, 42), g(c, 42)]);
    // Reopened: the same.
    drop(server);
    drop(s);
    let s = ParticipantStore::open(dir.path(), probe).unwrap();
    assert_eq!(
        s.in_doubt().unwrap().iter().map(|(t, _)| *t).collect::<Vec<_>>(),
        vec![g(0, 42)]
    );
    assert_eq!(s.entries().unwrap().len(), 4);
}

/// A stand-in coordinator node: answers GetDecisions by incarnation, as
/// `outcomes` says (unlisted incarnations: OTHER_INCARNATION), and keeps
/// what it was asked.
#[derive(Default)]
struct FakeNode {
    /// (incarnation, outcome for every txid asked with it).
    outcomes: Vec<(u64, pb::Outcome)>,
    /// Each GetDecisions: (incarnation, txids, participant id).
    asked: Mutex<Vec<(u64, Vec<u64>, String)>>,
}

struct Served(Arc<FakeNode>);

type Res<T> = Result<Response<T>, Status>;

#[tonic::async_trait]
impl Coordinator for Served {
    async fn register_branch(
        &self,
        _r: Request<pb::RegisterBranchRequest>,
    ) -> Result<Response<pb::RegisterBranchResponse>, Status> {
        Err(Status::unimplemented("not in this stand-in"))
    }
    async fn get_branch_decision(
        &self,
        _r: Request<pb::GetBranchDecisionRequest>,
    ) -> Result<Response<pb::GetBranchDecisionResponse>, Status> {
        Err(Status::unimplemented("not in this stand-in"))
    }
    async fn get_decisions(&self, r: Request<pb::GetDecisionsRequest>) -> Res<pb::GetDecisionsResponse> {
        let r = r.into_inner();
        self.0
            .asked
            .lock()
            .unwrap()
            .push((r.incarnation, r.txids.clone(), r.participant_id.clone()));
        let outcome = self
            .0
            .outcomes
            .iter()
            .find(|(i, _)| *i == r.incarnation)
            .map(|(_, o)| *o)
            .unwrap_or(pb::Outcome::OtherIncarnation);
        let decisions = r
            .txids
            .iter()
            .map(|&txid| pb::GetDecisionResponse {
                txid,
                outcome: outcome as i32,
                awaiting_ack: false,
                settled_by: String::new(),
            })
            .collect();
        Ok(Response::new(pb::GetDecisionsResponse { decisions }))
    }
    async fn enlist(&self, _: Request<pb::EnlistRequest>) -> Res<pb::EnlistResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn begin(&self, _: Request<pb::BeginRequest>) -> Res<pb::BeginResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn begin_and_commit(&self, _: Request<pb::BeginAndCommitRequest>) -> Res<pb::BeginAndCommitResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn commit(&self, _: Request<pb::CommitRequest>) -> Res<pb::CommitResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn abort(&self, _: Request<pb::AbortRequest>) -> Res<pb::AbortResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn status(&self, _: Request<pb::StatusRequest>) -> Res<pb::StatusResponse> {
        Err(Status::unimplemented("fake"))
    }
    async fn get_decision(&self, _: Request<pb::GetDecisionRequest>) -> Res<pb::GetDecisionResponse> {
        Err(Status::unimplemented("fake"))
    }
}

async fn serve(node: Arc<FakeNode>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(CoordinatorServer::new(Served(node)))
            .serve_with_incoming(dtx_transport::incoming(listener)),
    );
    addr
}

/// Recovery asks once per incarnation, with it; an in-doubt record the
/// cluster says another incarnation handed out stays PREPARED YES with its
/// locks (nothing presumed, never rolled back), while the same txid of the
/// incarnation the cluster knows is resolved; and GC keeps a record
/// answered OTHER_INCARNATION.
#[tokio::test]
async fn inv5_recovery_asks_per_incarnation_and_presumes_nothing_about_another_incarnations_txid() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let s = ParticipantStore::open(dir.path(), probe.clone()).unwrap();
    for inc in [A, B] {
        assert_eq!(
            s.handle(g(inc, 5), Message::Prepare { term: 1 }, b"w").await.unwrap(),
            Reply::Vote(Vote::Yes)
        );
    }
    // The cluster asked is incarnation B; A's txid 5 is another cluster's
    // (or from after the backup B was restored from).
    let node = Arc::new(FakeNode {
        outcomes: vec![(B, pb::Outcome::Commit)],
        ..FakeNode::default()
    });
    let addr = serve(node.clone()).await;
    let resolved = participant_sdk::server::recover_once(s.as_ref(), std::slice::from_ref(&addr))
        .await
        .unwrap();
    assert_eq!(resolved, 1);
    assert_eq!(s.entry(g(B, 5)).unwrap().unwrap().state, LocalState::Committed);
    assert_eq!(
        s.entry(g(A, 5)).unwrap().unwrap().state,
        LocalState::Prepared { vote: Vote::Yes },
        "never presumed aborted: still in doubt"
    );
    assert_eq!(s.view().get(b"staged/5@0a0a0a0a0a0a0a0a").unwrap(), Some(b"w".to_vec()));
    assert_eq!(
        s.in_doubt().unwrap().iter().map(|(t, _)| *t).collect::<Vec<_>>(),
        vec![g(A, 5)]
    );
    let mut asked: Vec<(u64, Vec<u64>)> = node
        .asked
        .lock()
        .unwrap()
        .iter()
        .map(|(i, t, _)| (*i, t.clone()))
        .collect();
    asked.sort();
    assert_eq!(asked, vec![(A, vec![5]), (B, vec![5])], "once per incarnation, with it");
    // Again: still kept.
    participant_sdk::server::recover_once(s.as_ref(), std::slice::from_ref(&addr))
        .await
        .unwrap();
    assert!(s
        .entry(g(A, 5))
        .unwrap()
        .is_some_and(|e| participant_sdk::log::in_doubt(&e)));

    // GC: a decided record of another incarnation is kept; one of the
    // cluster's own, acked, is collected.
    s.handle(g(A, 6), Message::Abort { term: 1 }, b"").await.unwrap();
    let removed = participant_sdk::server::collect_decided(
        s.as_ref(),
        std::slice::from_ref(&addr),
        "p",
        u64::MAX,
        100,
        None::<IpAddr>,
    )
    .await
    .unwrap();
    assert_eq!(removed, 1, "B's committed 5 only");
    assert!(s.entry(g(A, 6)).unwrap().is_some(), "kept: another incarnation's");
    assert!(s.entry(g(B, 5)).unwrap().is_none());
}

#[test]
fn gc_is_never_safe_for_another_incarnations_txid() {
    let answer = |decision| DecisionAnswer {
        txid: 1,
        decision: Some(decision),
        awaiting_ack: false,
        settled_by: String::new(),
    };
    assert!(!gc_safe(&answer(DecisionRead::OtherIncarnation)));
    assert!(gc_safe(&answer(DecisionRead::UnknownPresumedAbort)));
    assert!(gc_safe(&answer(DecisionRead::Committed)));
}
