//! Phase two in groups at the participant (`ApplyDecisions`, ADR 0013): many
//! decisions applied in one durable write, each item with exactly the
//! answer and the effect its own Commit or Abort would have had
//! (invariants 3, 5, 8 and 9 per item), durable once the call returns.

use crate::common;

use std::path::Path;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;

use dtx_proto::metadata::RefusalKind;
use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_server::ParticipantService;
use participant_sdk::log::LocalState;
use participant_sdk::log::Message;
use participant_sdk::log::Refusal;
use participant_sdk::log::Vote;
use participant_sdk::server::ParticipantServer;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::PhaseTwo;
use participant_sdk::store::RawStore;
use participant_sdk::store::Reply;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::StoreError;
use participant_sdk::store::View;
use participant_sdk::GlobalTxid;
use rand::rngs::StdRng;
use rand::Rng;
use rand::SeedableRng;

/// Prepare stages the payload under `staged/<txid>`; commit moves it to
/// `applied/<txid>`, adds one to the shared `total` (read through the view:
/// several commits in one group must see each other) and appends to the
/// apply log `applog/<txid>/<n>` (a scan through the view); abort drops the
/// staged work and appends to the apply log too. Payload "no" votes NO.
#[derive(Default, Clone)]
struct Counter {
    commits: Arc<AtomicUsize>,
    aborts: Arc<AtomicUsize>,
    /// The store's raw keys while set: lets a commit look at what is
    /// really written (not through the view).
    raw: Arc<Mutex<Option<RawStore>>>,
    /// What each commit found in the raw keys: (its txid, the raw log
    /// record of `peek_txid`).
    peek: Arc<Mutex<Peeks>>,
    peek_txid: Arc<Mutex<Option<u64>>>,
}

/// (a commit's txid, the raw log record it found for `peek_txid`).
type Peeks = Vec<(u64, Option<Vec<u8>>)>;

fn k(prefix: &str, txid: impl std::fmt::Display) -> Vec<u8> {
    format!("{prefix}/{txid}").into_bytes()
}

fn total(view: &View<'_>) -> u64 {
    view.get(b"total")
        .unwrap()
        .map(|v| u64::from_be_bytes(v.try_into().unwrap()))
        .unwrap_or(0)
}

fn log_apply(view: &View<'_>, txid: GlobalTxid, what: &str, staged: &mut Staged) {
    let n = view.scan(&k("applog", txid)).unwrap().len();
    staged.put(format!("applog/{txid}/{n}").as_bytes(), what.as_bytes());
}

impl Resource for Counter {
    fn prepare(&self, _view: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
        if payload == b"no" {
            return Vote::No;
        }
        staged.put(&k("staged", txid), payload);
        Vote::Yes
    }

    fn commit(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        self.commits.fetch_add(1, Ordering::SeqCst);
        if let (Some(raw), Some(other)) = (self.raw.lock().unwrap().as_ref(), *self.peek_txid.lock().unwrap()) {
            let mut key = vec![b'l'];
            key.extend_from_slice(&other.to_be_bytes());
            let seen = raw.get(&key);
            self.peek.lock().unwrap().push((txid.txid, seen));
        }
        let v = view.get(&k("staged", txid)).unwrap().expect("prepared work is staged");
        staged.delete(&k("staged", txid));
        staged.put(&k("applied", txid), &v);
        staged.put(b"total", &(total(view) + 1).to_be_bytes());
        log_apply(view, txid, "COMMIT", staged);
    }

    fn abort(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        self.aborts.fetch_add(1, Ordering::SeqCst);
        staged.delete(&k("staged", txid));
        log_apply(view, txid, "ABORT", staged);
    }
}

fn open(dir: &Path, r: &Counter) -> Arc<ParticipantStore<Counter>> {
    ParticipantStore::open(dir, r.clone()).unwrap()
}

fn state(s: &ParticipantStore<Counter>, txid: u64) -> Option<LocalState> {
    s.entry(txid).unwrap().map(|e| e.state)
}

fn refusal(r: &Result<(), StoreError>) -> Option<Refusal> {
    match r {
        Err(StoreError::Refused(r)) => Some(r.clone()),
        _ => None,
    }
}

/// Invariants 8 and 9 item by item: one group holding a fresh commit, a
/// repeat of an applied commit, an abort before any prepare, a stale-term
/// commit, a commit without prepare, an abort after commit and the fresh
/// commit again gives each item its own answer; the refused ones change
/// nothing; everything is durable once the call returns (reopened).
#[tokio::test]
async fn inv8_inv9_a_mixed_group_gives_each_item_its_own_answer_and_is_durable() {
    let dir = tempfile::tempdir().unwrap();
    let r = Counter::default();
    {
        let s = open(dir.path(), &r);
        // Terms never go down across new txids: a Prepare of an unknown
        // txid from below the term floor is refused (invariant 9).
        for (txid, term) in [(1, 1), (2, 1), (6, 1), (4, 5)] {
            assert_eq!(
                s.handle(txid, Message::Prepare { term }, b"w").await.unwrap(),
                Reply::Vote(Vote::Yes)
            );
        }
        assert_eq!(s.handle(2, Message::Commit { term: 1 }, b"").await.unwrap(), Reply::Ack);
        assert_eq!(r.commits.load(Ordering::SeqCst), 1);
        let items = [
            (1, PhaseTwo::Commit { term: 1 }), // fresh
            (2, PhaseTwo::Commit { term: 2 }), // repeat (newer term)
            (3, PhaseTwo::Abort { term: 1 }),  // before any prepare: tombstone
            (4, PhaseTwo::Commit { term: 3 }), // stale: the participant saw term 5
            (5, PhaseTwo::Commit { term: 1 }), // never prepared here
            (2, PhaseTwo::Abort { term: 2 }),  // after its commit
            (6, PhaseTwo::Abort { term: 1 }),  // fresh abort
            (1, PhaseTwo::Commit { term: 1 }), // the fresh commit again, same group
        ];
        let res = s.apply_decisions(&items).await.unwrap();
        assert_eq!(res.len(), items.len());
        let refusals: Vec<Option<Refusal>> = res.iter().map(refusal).collect();
        assert_eq!(
            refusals,
            vec![
                None,
                None,
                None,
                Some(Refusal::StaleTerm { got: 3, seen: 5 }),
                Some(Refusal::CommitWithoutPrepare),
                Some(Refusal::AbortAfterCommit),
                None,
                None,
            ]
        );
        assert!(res.iter().enumerate().all(|(i, r)| r.is_ok() == refusals[i].is_none()));
        assert_eq!(
            r.commits.load(Ordering::SeqCst),
            2,
            "txid 1 committed once, however often"
        );
        assert_eq!(r.aborts.load(Ordering::SeqCst), 1, "only txid 6 rolled back");
    }
    // Everything the call acked is on disk: reopen.
    let s = open(dir.path(), &r);
    assert_eq!(state(&s, 1), Some(LocalState::Committed));
    assert_eq!(s.view().get(b"applied/1").unwrap().as_deref(), Some(&b"w"[..]));
    assert_eq!(s.view().get(b"staged/1").unwrap(), None);
    assert_eq!(state(&s, 2), Some(LocalState::Committed));
    assert_eq!(
        s.entry(2).unwrap().unwrap().term,
        2,
        "an accepted repeat raises the term"
    );
    assert_eq!(state(&s, 3), Some(LocalState::Aborted { tombstone: true }));
    assert_eq!(
        state(&s, 4),
        Some(LocalState::Prepared { vote: Vote::Yes }),
        "a stale item changes nothing"
    );
    assert_eq!(s.entry(4).unwrap().unwrap().term, 5);
    assert_eq!(state(&s, 5), None, "a refused commit creates no record");
    assert_eq!(state(&s, 6), Some(LocalState::Aborted { tombstone: false }));
    assert_eq!(s.view().get(b"staged/6").unwrap(), None);
    assert_eq!(total(&s.view()), 2);
    // Invariant 5: txid 4 is still in doubt, and nothing else is.
    let doubt: Vec<u64> = s.in_doubt().unwrap().iter().map(|(t, _)| t.txid).collect();
    assert_eq!(doubt, vec![4]);
    // The tombstone holds: a late Prepare votes NO without the resource.
    assert_eq!(
        s.handle(3, Message::Prepare { term: 1 }, b"w").await.unwrap(),
        Reply::Vote(Vote::No)
    );
    assert_eq!(s.view().get(b"staged/3").unwrap(), None);
    // One apply each, in the apply log.
    assert_eq!(s.view().scan(b"applog/").unwrap().len(), 3, "txids 1, 2 and 6");
}

/// The one-write property: while the group is applied nothing of it is in
/// the tree yet (a commit of a later item finds an earlier item's record
/// still PREPARED on disk, and sees its writes only through the view), and
/// the commits of one group build on each other like separate writes would.
#[tokio::test]
async fn a_group_is_one_write_and_each_item_sees_the_items_before_it() {
    let dir = tempfile::tempdir().unwrap();
    let r = Counter::default();
    let s = open(dir.path(), &r);
    *r.raw.lock().unwrap() = Some(s.raw());
    for txid in 10..15 {
        s.handle(txid, Message::Prepare { term: 1 }, b"w").await.unwrap();
    }
    let prepared_raw = {
        let mut key = vec![b'l'];
        key.extend_from_slice(&10u64.to_be_bytes());
        r.raw.lock().unwrap().as_ref().unwrap().get(&key)
    };
    assert!(prepared_raw.is_some());
    *r.peek_txid.lock().unwrap() = Some(10);
    let items: Vec<(u64, PhaseTwo)> = (10..15).map(|t| (t, PhaseTwo::Commit { term: 1 })).collect();
    let res = s.apply_decisions(&items).await.unwrap();
    assert!(res.iter().all(Result::is_ok), "{res:?}");
    *r.peek_txid.lock().unwrap() = None;
    let peeks = r.peek.lock().unwrap().clone();
    assert_eq!(peeks.len(), 5);
    for (txid, raw) in &peeks {
        assert_eq!(
            raw, &prepared_raw,
            "commit of {txid} found txid 10's record already rewritten on disk: not one write"
        );
    }
    assert_eq!(total(&s.view()), 5, "each commit saw the ones before it");
    assert_eq!(state(&s, 10), Some(LocalState::Committed));
    // Let go of the raw keys (they hold the engine open), then reopen.
    r.raw.lock().unwrap().take();
    drop(s);
    let s = open(dir.path(), &r);
    assert_eq!(total(&s.view()), 5);
    assert!((10..15).all(|t| state(&s, t) == Some(LocalState::Committed)));
}

/// The same random messages, applied one by one with `handle` at one store
/// and in random groups with `apply_decisions` at another, give the same
/// answers and leave the same log and the same data.
#[tokio::test]
async fn groups_answer_and_apply_exactly_like_single_messages() {
    for seed in 0..8u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (ra, rb) = (Counter::default(), Counter::default());
        let (a, b) = (open(da.path(), &ra), open(db.path(), &rb));
        for _round in 0..20 {
            // Some prepares, the same at both.
            for _ in 0..rng.random_range(0..4) {
                let txid = rng.random_range(1..12u64);
                let term = rng.random_range(1..4u64);
                let payload: &[u8] = if rng.random_bool(0.2) { b"no" } else { b"p" };
                let x = a.handle(txid, Message::Prepare { term }, payload).await;
                let y = b.handle(txid, Message::Prepare { term }, payload).await;
                assert_eq!(format!("{x:?}"), format!("{y:?}"), "seed {seed}");
            }
            // A group of decisions.
            let items: Vec<(u64, PhaseTwo)> = (0..rng.random_range(1..10))
                .map(|_| {
                    let txid = rng.random_range(1..12u64);
                    let term = rng.random_range(1..4u64);
                    let d = if rng.random_bool(0.6) {
                        PhaseTwo::Commit { term }
                    } else {
                        PhaseTwo::Abort { term }
                    };
                    (txid, d)
                })
                .collect();
            let mut one_by_one = Vec::new();
            for &(txid, d) in &items {
                one_by_one.push(a.handle(txid, d.into(), b"").await.map(|reply| {
                    assert_eq!(reply, Reply::Ack);
                }));
            }
            let grouped = b.apply_decisions(&items).await.unwrap();
            assert_eq!(
                format!("{one_by_one:?}"),
                format!("{grouped:?}"),
                "seed {seed}, items {items:?}"
            );
        }
        common::assert_stores_agree(&a, &b, &format!("seed {seed}"));
        assert_eq!(ra.commits.load(Ordering::SeqCst), rb.commits.load(Ordering::SeqCst));
        assert_eq!(ra.aborts.load(Ordering::SeqCst), rb.aborts.load(Ordering::SeqCst));
    }
}

use common::decision_item as item;

/// The gRPC call: one result per item, in order, each with the code and
/// refusal kind its own Commit or Abort call would have carried; an item
/// for another participant or without an outcome is refused alone; more
/// items than the limit is refused as a whole.
#[tokio::test]
async fn the_rpc_answers_per_item_codes_and_refusal_kinds() {
    let dir = tempfile::tempdir().unwrap();
    let r = Counter::default();
    let s = open(dir.path(), &r);
    // In term order: a Prepare of an unknown txid from below the term
    // floor would be refused (invariant 9).
    s.handle(2, Message::Prepare { term: 1 }, b"w").await.unwrap();
    s.handle(1, Message::Prepare { term: 2 }, b"w").await.unwrap();
    let server = ParticipantServer::new(s.clone(), "bank-a");
    use pb::DecisionOutcome::Abort;
    use pb::DecisionOutcome::Commit;
    let items = vec![
        item(1, "bank-a", Commit, 2),
        item(2, "bank-b", Commit, 1),
        item(2, "", pb::DecisionOutcome::Unspecified, 1),
        item(1, "", Commit, 1),
        item(9, "", Commit, 1),
        item(9, "bank-a", Abort, 1),
        item(9, "bank-a", Commit, 1),
        item(1, "bank-a", Abort, 2),
    ];
    let res = server
        .apply_decisions(tonic::Request::new(pb::ApplyDecisionsRequest { items }))
        .await
        .unwrap()
        .into_inner()
        .results;
    let got: Vec<(bool, tonic::Code, &str)> = res
        .iter()
        .map(|r| (r.applied, tonic::Code::from_i32(r.code), r.refusal.as_str()))
        .collect();
    use tonic::Code::*;
    assert_eq!(
        got,
        vec![
            (true, Ok, ""),
            (false, InvalidArgument, ""),
            (false, InvalidArgument, ""),
            (false, FailedPrecondition, RefusalKind::StaleTerm.as_str()),
            (false, FailedPrecondition, RefusalKind::CommitWithoutPrepare.as_str()),
            (true, Ok, ""),
            (false, FailedPrecondition, RefusalKind::CommitAfterAbort.as_str()),
            (false, FailedPrecondition, RefusalKind::AbortAfterCommit.as_str()),
        ]
    );
    assert!(res.iter().filter(|r| !r.applied).all(|r| !r.message.is_empty()));
    assert_eq!(state(&s, 1), Some(LocalState::Committed));
    assert_eq!(
        state(&s, 2),
        Some(LocalState::Prepared { vote: Vote::Yes }),
        "the refused items left txid 2 in doubt"
    );
    assert_eq!(state(&s, 9), Some(LocalState::Aborted { tombstone: true }));

    let too_many = (0..=dtx_proto::limits::DECISION_DELIVERY_ITEMS_MAX as u64)
        .map(|t| item(100 + t, "", Abort, 1))
        .collect();
    let err = server
        .apply_decisions(tonic::Request::new(pb::ApplyDecisionsRequest { items: too_many }))
        .await
        .unwrap_err();
    assert_eq!(err.code(), InvalidArgument);
    assert_eq!(state(&s, 100), None, "nothing of a refused message is applied");
    let empty = server
        .apply_decisions(tonic::Request::new(pb::ApplyDecisionsRequest { items: vec![] }))
        .await
        .unwrap()
        .into_inner();
    assert!(empty.results.is_empty());
}
