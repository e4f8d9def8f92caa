//! Phase one in groups at the participant (`PrepareMany`, ADR 0014): many
//! prepares in one durable write, each item with exactly the vote (or the
//! refusal) and the effect its own Prepare would have had (invariants 8 and
//! 9 per item), durable once the call returns (a YES vote only after the
//! fsync that covers it).

use crate::common;

use std::path::Path;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use dtx_proto::metadata::RefusalKind;
use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_server::ParticipantService;
use participant_sdk::log::LocalState;
use participant_sdk::log::Message;
use participant_sdk::log::Refusal;
use participant_sdk::log::Vote;
use participant_sdk::server::ParticipantServer;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Reply;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::StoreError;
use participant_sdk::store::View;
use participant_sdk::GlobalTxid;
use rand::rngs::StdRng;
use rand::Rng;
use rand::SeedableRng;

/// An account-lock resource: the payload names an account; prepare votes
/// YES and takes the account's lock (`lock/<account>` = txid) when it is
/// free, NO when another transaction holds it (read through the view: a
/// second prepare of one account in one group must see the first's lock);
/// commit adds one to `balance/<account>` and frees the lock; abort frees
/// it. Payload "no" votes NO, "ro" READ_ONLY.
#[derive(Default, Clone)]
struct Locks {
    prepares: Arc<AtomicUsize>,
}

fn key(prefix: &str, name: &[u8]) -> Vec<u8> {
    let mut k = prefix.as_bytes().to_vec();
    k.push(b'/');
    k.extend_from_slice(name);
    k
}

fn holder_key(txid: impl std::fmt::Display) -> Vec<u8> {
    format!("holds/{txid}").into_bytes()
}

impl Resource for Locks {
    fn prepare(&self, view: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
        self.prepares.fetch_add(1, Ordering::SeqCst);
        match payload {
            b"no" => return Vote::No,
            b"ro" => return Vote::ReadOnly,
            _ => {}
        }
        if view.get(&key("lock", payload)).unwrap().is_some() {
            return Vote::No;
        }
        staged.put(&key("lock", payload), &txid.key_bytes());
        staged.put(&holder_key(txid), payload);
        Vote::Yes
    }

    fn commit(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        let account = view
            .get(&holder_key(txid))
            .unwrap()
            .expect("a prepared transaction holds a lock");
        let balance = view
            .get(&key("balance", &account))
            .unwrap()
            .map(|v| u64::from_be_bytes(v.try_into().unwrap()))
            .unwrap_or(0);
        staged.put(&key("balance", &account), &(balance + 1).to_be_bytes());
        staged.delete(&key("lock", &account));
        staged.delete(&holder_key(txid));
    }

    fn abort(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        if let Some(account) = view.get(&holder_key(txid)).unwrap() {
            staged.delete(&key("lock", &account));
            staged.delete(&holder_key(txid));
        }
    }
}

fn open(dir: &Path, r: &Locks) -> Arc<ParticipantStore<Locks>> {
    ParticipantStore::open(dir, r.clone()).unwrap()
}

fn state(s: &ParticipantStore<Locks>, txid: u64) -> Option<LocalState> {
    s.entry(txid).unwrap().map(|e| e.state)
}

/// `handle`'s answer to a Prepare, as `prepare_many` answers an item.
fn as_vote(r: Result<Reply, StoreError>) -> Result<Vote, StoreError> {
    match r {
        Ok(Reply::Vote(v)) => Ok(v),
        Ok(Reply::Ack) => panic!("a prepare answered with an ack"),
        Err(e) => Err(e),
    }
}

/// The setup both stores of the mixed test get, through single calls:
/// txid 1 prepared YES at term 1, txid 2 aborted before any prepare (a
/// tombstone), txid 3 prepared at term 5, txid 7 committed. In term order:
/// a Prepare of an unknown txid from below the term floor is refused
/// (invariant 9).
async fn setup(s: &ParticipantStore<Locks>) {
    for (txid, term, account) in [(1, 1, &b"a"[..]), (7, 1, b"d"), (3, 5, b"c")] {
        assert_eq!(
            s.handle(txid, Message::Prepare { term }, account).await.unwrap(),
            Reply::Vote(Vote::Yes)
        );
    }
    assert_eq!(s.handle(2, Message::Abort { term: 1 }, b"").await.unwrap(), Reply::Ack);
    assert_eq!(s.handle(7, Message::Commit { term: 1 }, b"").await.unwrap(), Reply::Ack);
}

/// Invariants 8 and 9 item by item: one message holding a fresh prepare,
/// a repeat of a recorded YES, a prepare after an abort tombstone, a
/// stale-term prepare, two prepares of one account (the second finds the
/// first's lock and votes NO, as a second message would), a NO by the
/// resource, a READ_ONLY, a repeat of an earlier item of the same message
/// and a prepare of a committed transaction gives each item the answer its
/// own Prepare gives (checked against a second store that got single
/// calls), the refused one changes nothing, and everything is durable once
/// the call returns (reopened).
#[tokio::test]
async fn inv8_inv9_a_mixed_message_gives_each_item_its_single_call_answer_and_is_durable() {
    let (dir, single_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (r, rs) = (Locks::default(), Locks::default());
    let items: Vec<(u64, u64, &[u8])> = vec![
        (4, 5, b"x"),  // fresh: YES, locks x
        (2, 5, b"b"),  // after the abort tombstone: NO, resource not asked
        (3, 4, b"c"),  // stale: the participant saw term 5
        (5, 5, b"x"),  // x is locked by 4, one item before: NO
        (6, 5, b"no"), // the resource refuses: NO
        (8, 5, b"ro"), // READ_ONLY
        (4, 5, b"x"),  // txid 4 again in the same message: its recorded YES
        (7, 5, b"d"),  // already committed: YES
        (1, 6, b"a"),  // repeat of a YES (newer term): YES, resource not asked; last, as it raises the term floor
    ];
    let single = open(single_dir.path(), &rs);
    setup(&single).await;
    let mut want = Vec::new();
    for &(txid, term, payload) in &items {
        want.push(as_vote(single.handle(txid, Message::Prepare { term }, payload).await));
    }
    {
        let s = open(dir.path(), &r);
        setup(&s).await;
        let before = r.prepares.load(Ordering::SeqCst);
        let got = s.prepare_many(&items).await.unwrap();
        assert_eq!(
            format!("{got:?}"),
            format!("{want:?}"),
            "each item answers as its own Prepare"
        );
        let votes: Vec<Option<Vote>> = got.iter().map(|r| r.as_ref().ok().copied()).collect();
        assert_eq!(
            votes,
            vec![
                Some(Vote::Yes),
                Some(Vote::No),
                None,
                Some(Vote::No),
                Some(Vote::No),
                Some(Vote::ReadOnly),
                Some(Vote::Yes),
                Some(Vote::Yes),
                Some(Vote::Yes),
            ]
        );
        assert!(matches!(
            &got[2],
            Err(StoreError::Refused(Refusal::StaleTerm { got: 4, seen: 5 }))
        ));
        assert_eq!(
            r.prepares.load(Ordering::SeqCst) - before,
            4,
            "the resource prepared txids 4, 5, 6 and 8 only"
        );
    }
    // Everything answered is on disk: reopen, and compare with the store
    // that got single calls.
    let s = open(dir.path(), &r);
    assert_eq!(s.entries().unwrap(), single.entries().unwrap());
    assert_eq!(s.view().scan(b"").unwrap(), single.view().scan(b"").unwrap());
    assert_eq!(s.in_doubt().unwrap(), single.in_doubt().unwrap());
    assert_eq!(state(&s, 4), Some(LocalState::Prepared { vote: Vote::Yes }));
    assert_eq!(s.view().get(b"lock/x").unwrap(), Some(4u64.to_be_bytes().to_vec()));
    assert_eq!(
        s.entry(1).unwrap().unwrap().term,
        6,
        "an accepted repeat raises the term"
    );
    assert_eq!(state(&s, 2), Some(LocalState::Aborted { tombstone: true }));
    assert_eq!(s.entry(3).unwrap().unwrap().term, 5, "a stale item changes nothing");
    assert_eq!(state(&s, 5), Some(LocalState::Aborted { tombstone: false }));
    assert_eq!(state(&s, 6), Some(LocalState::Aborted { tombstone: false }));
    assert_eq!(state(&s, 8), Some(LocalState::Prepared { vote: Vote::ReadOnly }));
    let doubt: Vec<u64> = s.in_doubt().unwrap().iter().map(|(t, _)| t.txid).collect();
    assert_eq!(doubt, vec![1, 3, 4], "the YES votes in doubt, 4 among them");
    // The prepared work holds: COMMIT of 4 applies it, then x is free.
    assert_eq!(s.handle(4, Message::Commit { term: 5 }, b"").await.unwrap(), Reply::Ack);
    assert_eq!(s.view().get(b"balance/x").unwrap(), Some(1u64.to_be_bytes().to_vec()));
    assert_eq!(s.view().get(b"lock/x").unwrap(), None);
}

/// The same random prepares, sent one by one with `handle` to one store
/// and in random groups with `prepare_many` to another, between the same
/// random decisions, give the same answers and leave the same log, the
/// same in-doubt index and the same data.
#[tokio::test]
async fn groups_vote_and_prepare_exactly_like_single_prepares() {
    for seed in 0..8u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (ra, rb) = (Locks::default(), Locks::default());
        let (a, b) = (open(da.path(), &ra), open(db.path(), &rb));
        let accounts: [&[u8]; 5] = [b"p", b"q", b"r", b"no", b"ro"];
        for _round in 0..20 {
            // A group of prepares.
            let items: Vec<(u64, u64, &[u8])> = (0..rng.random_range(1..10))
                .map(|_| {
                    (
                        rng.random_range(1..16u64),
                        rng.random_range(1..4u64),
                        accounts[rng.random_range(0..accounts.len())],
                    )
                })
                .collect();
            let mut one_by_one = Vec::new();
            for &(txid, term, payload) in &items {
                one_by_one.push(as_vote(a.handle(txid, Message::Prepare { term }, payload).await));
            }
            let grouped = b.prepare_many(&items).await.unwrap();
            assert_eq!(
                format!("{one_by_one:?}"),
                format!("{grouped:?}"),
                "seed {seed}, items {items:?}"
            );
            // Some decisions, the same at both (they free locks).
            for _ in 0..rng.random_range(0..4) {
                let txid = rng.random_range(1..16u64);
                let term = rng.random_range(1..4u64);
                let msg = if rng.random_bool(0.6) {
                    Message::Commit { term }
                } else {
                    Message::Abort { term }
                };
                let x = a.handle(txid, msg, b"").await;
                let y = b.handle(txid, msg, b"").await;
                assert_eq!(format!("{x:?}"), format!("{y:?}"), "seed {seed}");
            }
        }
        common::assert_stores_agree(&a, &b, &format!("seed {seed}"));
        assert_eq!(ra.prepares.load(Ordering::SeqCst), rb.prepares.load(Ordering::SeqCst));
        // Recovery's view of what is old enough to ask about agrees too.
        let old = |s: &ParticipantStore<Locks>| -> Vec<u64> {
            s.in_doubt_older_than(std::time::Duration::ZERO)
                .unwrap()
                .iter()
                .map(|(t, _)| t.txid)
                .collect()
        };
        assert_eq!(old(&a), old(&b), "seed {seed}");
    }
}

fn item(txid: u64, participant_id: &str, term: u64, payload: &[u8]) -> pb::PrepareRequest {
    pb::PrepareRequest {
        txid,
        term,
        participant_id: participant_id.into(),
        payload: payload.to_vec(),
        incarnation: 0,
    }
}

/// The gRPC call: one result per item, in order, each the vote and reason
/// its own Prepare answers, or the code and refusal kind its own Prepare
/// fails with; an item for another participant is refused alone; more items
/// than the limit is refused as a whole; an empty message gets no results.
#[tokio::test]
async fn the_rpc_answers_per_item_votes_codes_and_refusal_kinds() {
    let dir = tempfile::tempdir().unwrap();
    let r = Locks::default();
    let s = open(dir.path(), &r);
    s.handle(3, Message::Prepare { term: 5 }, b"c").await.unwrap();
    let server = ParticipantServer::new(s.clone(), "bank-a");
    // Fresh items at the term floor (5): below it they would be refused.
    let items = vec![
        item(1, "bank-a", 5, b"x"),
        item(2, "bank-b", 5, b"y"),
        item(3, "", 4, b"c"),
        item(4, "", 5, b"x"),
        item(5, "bank-a", 5, b"ro"),
    ];
    let single: Vec<Result<pb::PrepareResponse, tonic::Status>> = {
        // What single Prepare calls answer, at a store in the same state.
        let d2 = tempfile::tempdir().unwrap();
        let s2 = open(d2.path(), &Locks::default());
        s2.handle(3, Message::Prepare { term: 5 }, b"c").await.unwrap();
        let server2 = ParticipantServer::new(s2, "bank-a");
        let mut out = Vec::new();
        for it in &items {
            out.push(
                server2
                    .prepare(tonic::Request::new(it.clone()))
                    .await
                    .map(|r| r.into_inner()),
            );
        }
        out
    };
    let res = server
        .prepare_many(tonic::Request::new(pb::PrepareManyRequest {
            items,
            decisions: vec![],
        }))
        .await
        .unwrap()
        .into_inner()
        .results;
    assert_eq!(res.len(), single.len());
    for (i, (got, want)) in res.iter().zip(&single).enumerate() {
        match want {
            Ok(w) => {
                assert_eq!((got.vote, got.reason.as_str()), (w.vote, w.reason.as_str()), "item {i}");
                assert_eq!(got.code, tonic::Code::Ok as i32, "item {i}");
            }
            Err(st) => {
                assert_eq!(tonic::Code::from_i32(got.code), st.code(), "item {i}");
                assert_eq!(got.vote, pb::Vote::Unspecified as i32, "item {i}");
                assert_eq!(
                    got.refusal,
                    dtx_proto::metadata::refusal(st)
                        .map(|k| k.as_str().to_string())
                        .unwrap_or_default(),
                    "item {i}"
                );
                assert!(!got.message.is_empty());
            }
        }
    }
    let got: Vec<(i32, tonic::Code, &str)> = res
        .iter()
        .map(|r| (r.vote, tonic::Code::from_i32(r.code), r.refusal.as_str()))
        .collect();
    use tonic::Code;
    assert_eq!(
        got,
        vec![
            (pb::Vote::Yes as i32, Code::Ok, ""),
            (pb::Vote::Unspecified as i32, Code::InvalidArgument, ""),
            (
                pb::Vote::Unspecified as i32,
                Code::FailedPrecondition,
                RefusalKind::StaleTerm.as_str()
            ),
            (pb::Vote::No as i32, Code::Ok, ""),
            (pb::Vote::ReadOnly as i32, Code::Ok, ""),
        ]
    );
    assert_eq!(res[3].reason, "the resource refused");
    assert_eq!(state(&s, 2), None, "the item for another participant changed nothing");

    let too_many = (0..=dtx_proto::limits::PREPARE_GROUP_ITEMS_MAX as u64)
        .map(|t| item(100 + t, "", 5, b"ro"))
        .collect();
    let err = server
        .prepare_many(tonic::Request::new(pb::PrepareManyRequest {
            items: too_many,
            decisions: vec![],
        }))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(state(&s, 100), None, "nothing of a refused message is prepared");
    let empty = server
        .prepare_many(tonic::Request::new(pb::PrepareManyRequest {
            items: vec![],
            decisions: vec![],
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(empty.results.is_empty());
}

/// `common::decision_item` with the term before the outcome.
fn decision(txid: u64, participant_id: &str, term: u64, outcome: pb::DecisionOutcome) -> pb::DecisionItem {
    common::decision_item(txid, participant_id, outcome, term)
}

/// Decisions riding in a PrepareMany (ADR 0030), invariants 3 and 8 per
/// decision: each is answered as ApplyDecisions answers it (applied, a
/// repeat acked, a refusal with its kind, an item without an outcome or for
/// another participant refused alone), the decisions go to the store before
/// the prepares (a commit frees an account's lock that a prepare of the same
/// message then takes), all of it is durable once the call returns
/// (reopened), and too many decisions refuse the whole message.
#[tokio::test]
async fn inv3_inv8_decisions_riding_in_a_prepare_message_apply_first_and_answer_each_as_apply_decisions() {
    use tonic::Code;
    let dir = tempfile::tempdir().unwrap();
    let r = Locks::default();
    let s = open(dir.path(), &r);
    // txid 1 holds account "a"; txid 2 holds "b"; txid 3 is committed.
    for (txid, account) in [(1, &b"a"[..]), (2, b"b"), (3, b"c")] {
        assert_eq!(
            s.handle(txid, Message::Prepare { term: 1 }, account).await.unwrap(),
            Reply::Vote(Vote::Yes)
        );
    }
    assert_eq!(s.handle(3, Message::Commit { term: 1 }, b"").await.unwrap(), Reply::Ack);
    let server = ParticipantServer::new(s.clone(), "bank-a");
    let mut no_outcome = decision(9, "", 1, pb::DecisionOutcome::Commit);
    no_outcome.outcome = 0;
    let decisions = vec![
        decision(1, "bank-a", 1, pb::DecisionOutcome::Commit),
        decision(2, "", 1, pb::DecisionOutcome::Abort),
        decision(3, "", 1, pb::DecisionOutcome::Commit),
        decision(3, "", 1, pb::DecisionOutcome::Abort),
        decision(4, "bank-b", 1, pb::DecisionOutcome::Commit),
        no_outcome,
    ];
    // The prepares of the same message take the accounts the decisions free.
    let items = vec![item(10, "", 2, b"a"), item(11, "", 2, b"b")];
    let res = server
        .prepare_many(tonic::Request::new(pb::PrepareManyRequest { items, decisions }))
        .await
        .unwrap()
        .into_inner();
    let votes: Vec<i32> = res.results.iter().map(|r| r.vote).collect();
    assert_eq!(votes, vec![pb::Vote::Yes as i32, pb::Vote::Yes as i32]);
    let got: Vec<(bool, Code, &str)> = res
        .decision_results
        .iter()
        .map(|r| (r.applied, Code::from_i32(r.code), r.refusal.as_str()))
        .collect();
    assert_eq!(
        got,
        vec![
            (true, Code::Ok, ""),
            (true, Code::Ok, ""),
            (true, Code::Ok, ""),
            (false, Code::FailedPrecondition, RefusalKind::AbortAfterCommit.as_str()),
            (false, Code::InvalidArgument, ""),
            (false, Code::InvalidArgument, ""),
        ]
    );
    drop(server);
    drop(s);
    // Durable: reopened, the decisions and the new prepares are there.
    let s = open(dir.path(), &r);
    assert_eq!(state(&s, 1), Some(LocalState::Committed));
    assert_eq!(state(&s, 2), Some(LocalState::Aborted { tombstone: false }));
    assert_eq!(state(&s, 3), Some(LocalState::Committed));
    let yes = Some(LocalState::Prepared { vote: Vote::Yes });
    assert_eq!(state(&s, 10), yes);
    assert_eq!(state(&s, 11), yes);
    assert_eq!(
        state(&s, 4),
        None,
        "the decision for another participant changed nothing"
    );

    let server = ParticipantServer::new(s.clone(), "bank-a");
    let too_many = (0..=dtx_proto::limits::DECISION_DELIVERY_ITEMS_MAX as u64)
        .map(|t| decision(200 + t, "", 1, pb::DecisionOutcome::Abort))
        .collect();
    let err = server
        .prepare_many(tonic::Request::new(pb::PrepareManyRequest {
            items: vec![item(20, "", 1, b"z")],
            decisions: too_many,
        }))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(
        err.message().contains("decisions in one PrepareMany message"),
        "{}",
        err.message()
    );
    assert_eq!(state(&s, 20), None, "nothing of a refused message is prepared");
    assert_eq!(state(&s, 200), None, "nor decided");
}
