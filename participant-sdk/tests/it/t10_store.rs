//! The durable participant store on a real sled directory, reopened to show
//! what survived (invariants 5, 8 and 9 at the participant).

use std::path::Path;
use std::sync::atomic::AtomicUsize;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use participant_sdk::log::LocalState;
use participant_sdk::log::Message;
use participant_sdk::log::Refusal;
use participant_sdk::log::Vote;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Reply;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::StoreError;
use participant_sdk::store::View;
use participant_sdk::GlobalTxid;

/// Stages `payload` under `staged/<txid>` on prepare; commit moves it to
/// `applied/<txid>`; abort drops it. Payload "no" votes NO. Counts calls.
#[derive(Default, Clone)]
struct Probe {
    prepares: Arc<AtomicUsize>,
    commits: Arc<AtomicUsize>,
    aborts: Arc<AtomicUsize>,
}

fn k(prefix: &str, txid: impl std::fmt::Display) -> Vec<u8> {
    format!("{prefix}/{txid}").into_bytes()
}

impl Resource for Probe {
    fn prepare(&self, _view: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
        self.prepares.fetch_add(1, Ordering::SeqCst);
        staged.put(&k("staged", txid), payload);
        if payload == b"no" {
            Vote::No
        } else {
            Vote::Yes
        }
    }

    fn commit(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        self.commits.fetch_add(1, Ordering::SeqCst);
        let v = view.get(&k("staged", txid)).unwrap().expect("prepared work is staged");
        staged.delete(&k("staged", txid));
        staged.put(&k("applied", txid), &v);
    }

    fn abort(&self, _view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        self.aborts.fetch_add(1, Ordering::SeqCst);
        staged.delete(&k("staged", txid));
    }
}

fn open(dir: &Path, probe: &Probe) -> Arc<ParticipantStore<Probe>> {
    ParticipantStore::open(dir, probe.clone()).unwrap()
}

#[tokio::test]
async fn yes_vote_is_durable_with_its_staged_work_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    {
        let s = open(dir.path(), &probe);
        assert_eq!(
            s.handle(7, Message::Prepare { term: 1 }, b"debit 5").await.unwrap(),
            Reply::Vote(Vote::Yes)
        );
    }
    let s = open(dir.path(), &probe);
    assert_eq!(
        s.entry(7).unwrap().unwrap().state,
        LocalState::Prepared { vote: Vote::Yes }
    );
    assert_eq!(s.view().get(b"staged/7").unwrap().as_deref(), Some(&b"debit 5"[..]));
    assert_eq!(
        s.in_doubt().unwrap().iter().map(|(t, _)| t.txid).collect::<Vec<_>>(),
        vec![7]
    );
}

#[tokio::test]
async fn inv8_duplicate_prepare_does_not_touch_the_resource_again() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let s = open(dir.path(), &probe);
    for _ in 0..5 {
        assert_eq!(
            s.handle(1, Message::Prepare { term: 1 }, b"x").await.unwrap(),
            Reply::Vote(Vote::Yes)
        );
    }
    assert_eq!(probe.prepares.load(Ordering::SeqCst), 1);
    // A NO vote is remembered too, and its staged writes were discarded.
    assert_eq!(
        s.handle(2, Message::Prepare { term: 1 }, b"no").await.unwrap(),
        Reply::Vote(Vote::No)
    );
    assert_eq!(
        s.handle(2, Message::Prepare { term: 1 }, b"yes now").await.unwrap(),
        Reply::Vote(Vote::No)
    );
    assert_eq!(s.view().get(b"staged/2").unwrap(), None);
    assert_eq!(probe.prepares.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn inv8_abort_before_prepare_tombstone_survives_reopen_and_late_prepare_votes_no() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    {
        let s = open(dir.path(), &probe);
        assert_eq!(s.handle(3, Message::Abort { term: 2 }, b"").await.unwrap(), Reply::Ack);
    }
    let s = open(dir.path(), &probe);
    assert_eq!(
        s.handle(3, Message::Prepare { term: 2 }, b"x").await.unwrap(),
        Reply::Vote(Vote::No)
    );
    assert_eq!(
        probe.prepares.load(Ordering::SeqCst),
        0,
        "a hanging prepare reached the resource"
    );
    assert_eq!(probe.aborts.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn inv8_commit_is_applied_once_across_redeliveries_and_restarts() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    {
        let s = open(dir.path(), &probe);
        s.handle(4, Message::Prepare { term: 1 }, b"v").await.unwrap();
        for _ in 0..3 {
            assert_eq!(s.handle(4, Message::Commit { term: 1 }, b"").await.unwrap(), Reply::Ack);
        }
    }
    let s = open(dir.path(), &probe);
    assert_eq!(s.handle(4, Message::Commit { term: 2 }, b"").await.unwrap(), Reply::Ack);
    assert_eq!(probe.commits.load(Ordering::SeqCst), 1);
    assert_eq!(s.view().get(b"applied/4").unwrap().as_deref(), Some(&b"v"[..]));
    assert_eq!(s.view().get(b"staged/4").unwrap(), None);
    assert!(s.in_doubt().unwrap().is_empty());
    // A conflicting Abort afterwards is refused, not applied (invariant 3).
    match s.handle(4, Message::Abort { term: 2 }, b"").await {
        Err(StoreError::Refused(Refusal::AbortAfterCommit)) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(probe.aborts.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn inv9_stale_term_and_commit_without_prepare_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let s = open(dir.path(), &probe);
    s.handle(5, Message::Prepare { term: 4 }, b"v").await.unwrap();
    match s.handle(5, Message::Commit { term: 3 }, b"").await {
        Err(StoreError::Refused(Refusal::StaleTerm { got: 3, seen: 4 })) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(probe.commits.load(Ordering::SeqCst), 0);
    match s.handle(6, Message::Commit { term: 4 }, b"").await {
        Err(StoreError::Refused(Refusal::CommitWithoutPrepare)) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(s.entry(6).unwrap(), None, "a refused Commit must not create a record");
    // Invariant 5: the prepared transaction is still in doubt; nothing but a
    // decision moves it.
    assert_eq!(s.in_doubt().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_prepares_share_fsyncs_and_all_become_durable() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    {
        let s = open(dir.path(), &probe);
        let mut tasks = Vec::new();
        for t in 0..64u64 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                s.handle(100 + t, Message::Prepare { term: 1 }, b"p").await
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap().unwrap(), Reply::Vote(Vote::Yes));
        }
    }
    let s = open(dir.path(), &probe);
    assert_eq!(s.in_doubt().unwrap().len(), 64);
}

#[tokio::test]
async fn inv8_one_phase_commit_is_durable_and_applied_once() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    {
        let s = open(dir.path(), &probe);
        let r = s.handle(7, Message::CommitOnePhase { term: 1 }, b"debit 5").await;
        assert_eq!(r.unwrap(), Reply::Ack, "Ack = committed");
    }
    let s = open(dir.path(), &probe);
    assert_eq!(s.entry(7).unwrap().unwrap().state, LocalState::Committed);
    assert_eq!(s.view().get(b"applied/7").unwrap().as_deref(), Some(&b"debit 5"[..]));
    assert_eq!(s.view().get(b"staged/7").unwrap(), None);
    assert!(s.in_doubt().unwrap().is_empty());
    // A repeat (a new leader re-sending it) answers the same, applying nothing.
    for term in [1, 2] {
        let r = s.handle(7, Message::CommitOnePhase { term }, b"debit 5").await;
        assert_eq!(r.unwrap(), Reply::Ack);
    }
    assert_eq!(probe.prepares.load(Ordering::SeqCst), 1);
    assert_eq!(probe.commits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn one_phase_refusal_rolls_back_and_stays_refused() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let s = open(dir.path(), &probe);
    let r = s.handle(8, Message::CommitOnePhase { term: 1 }, b"no").await;
    assert_eq!(r.unwrap(), Reply::Vote(Vote::No));
    assert_eq!(s.view().get(b"staged/8").unwrap(), None, "refused work is not kept");
    assert_eq!(
        s.entry(8).unwrap().unwrap().state,
        LocalState::Aborted { tombstone: false }
    );
    // Invariant 8: an Abort tombstone before the one-phase message refuses it.
    s.handle(9, Message::Abort { term: 1 }, b"").await.unwrap();
    let r = s.handle(9, Message::CommitOnePhase { term: 1 }, b"x").await;
    assert_eq!(r.unwrap(), Reply::Vote(Vote::No));
    assert_eq!(
        probe.prepares.load(Ordering::SeqCst),
        1,
        "the tombstone answered, not the resource"
    );
}

#[tokio::test]
async fn recovery_threshold_skips_young_votes_but_not_votes_from_before_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let hour = std::time::Duration::from_secs(3600);
    {
        let s = open(dir.path(), &probe);
        s.handle(3, Message::Prepare { term: 1 }, b"w").await.unwrap();
        assert!(
            s.in_doubt_older_than(hour).unwrap().is_empty(),
            "just voted: not asked yet"
        );
        assert_eq!(s.in_doubt_older_than(std::time::Duration::ZERO).unwrap().len(), 1);
    }
    let s = open(dir.path(), &probe);
    let old: Vec<u64> = s
        .in_doubt_older_than(hour)
        .unwrap()
        .iter()
        .map(|(t, _)| t.txid)
        .collect();
    assert_eq!(old, vec![3], "a vote from before the restart is asked about at once");
}

#[tokio::test]
async fn decided_records_are_garbage_collected_after_retention_but_in_doubt_ones_never() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let s = open(dir.path(), &probe);
    s.handle(1, Message::Prepare { term: 1 }, b"w").await.unwrap();
    s.handle(1, Message::Commit { term: 1 }, b"").await.unwrap();
    s.handle(2, Message::Abort { term: 1 }, b"").await.unwrap();
    s.handle(3, Message::Prepare { term: 1 }, b"w").await.unwrap();
    assert!(
        s.gc_candidates(0, 100).unwrap().is_empty(),
        "nothing decided that long ago"
    );
    assert_eq!(s.entries().unwrap().len(), 3);
    let candidates = s.gc_candidates(u64::MAX, 100).unwrap();
    assert_eq!(candidates.iter().map(|(_, t)| t.txid).collect::<Vec<_>>(), vec![1, 2]);
    assert_eq!(s.forget_records(&candidates).unwrap(), 2);
    let left: Vec<u64> = s.entries().unwrap().iter().map(|(t, _)| t.txid).collect();
    assert_eq!(left, vec![3], "the in-doubt record stays (invariant 5)");
    assert_eq!(
        s.view().get(b"applied/1").unwrap().as_deref(),
        Some(&b"w"[..]),
        "data is kept"
    );
    assert!(s.gc_candidates(u64::MAX, 100).unwrap().is_empty());
    // An in-doubt record handed to forget_records anyway is not removed.
    assert_eq!(s.forget_records(&[(0, 3.into())]).unwrap(), 0);
    assert_eq!(s.entries().unwrap().len(), 1);
}

/// A store reopened in the same process right after the previous one was
/// dropped must open (sled releases its lock from background I/O threads a
/// moment later), while a store that is still open keeps its directory to
/// itself and the second open says why it failed.
#[tokio::test]
async fn reopen_after_drop_succeeds_and_a_held_directory_is_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    for txid in 1..=20u64 {
        let s = open(dir.path(), &probe);
        s.handle(txid, Message::Prepare { term: 1 }, b"v").await.unwrap();
        s.handle(txid, Message::Commit { term: 1 }, b"").await.unwrap();
    }
    assert_eq!(probe.commits.load(Ordering::SeqCst), 20);
    let held = open(dir.path(), &probe);
    match ParticipantStore::open(dir.path(), probe.clone()) {
        Err(StoreError::Open { message, .. }) => {
            assert!(message.contains("in use"), "unclear message: {message}")
        }
        Err(other) => panic!("wrong error: {other:?}"),
        Ok(_) => panic!("a directory held by an open store was opened twice"),
    }
    assert!(held.in_doubt().unwrap().is_empty());
}

fn doubt_txids(s: &ParticipantStore<Probe>) -> Vec<u64> {
    s.in_doubt().unwrap().iter().map(|(t, _)| t.txid).collect()
}

/// The in-doubt gauges' source (`dtx_participant_in_doubt`, the oldest's
/// age): counts the YES votes without a decision, ages them from the vote,
/// and a vote from before a reopen from the reopening at least.
#[tokio::test]
async fn in_doubt_summary_counts_the_votes_and_ages_the_oldest() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    {
        let s = open(dir.path(), &probe);
        assert_eq!(s.in_doubt_summary().unwrap(), Default::default());
        s.handle(1, Message::Prepare { term: 1 }, b"v").await.unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        s.handle(2, Message::Prepare { term: 1 }, b"v").await.unwrap();
        let sum = s.in_doubt_summary().unwrap();
        assert_eq!(sum.count, 2);
        assert!(
            sum.oldest_age.unwrap() >= std::time::Duration::from_millis(50),
            "{sum:?}"
        );
        s.handle(1, Message::Commit { term: 1 }, b"").await.unwrap();
        let sum = s.in_doubt_summary().unwrap();
        assert_eq!(sum.count, 1);
        assert!(sum.oldest_age.unwrap() < std::time::Duration::from_secs(30), "{sum:?}");
        s.flush().await.unwrap();
    }
    let s = open(dir.path(), &probe);
    std::thread::sleep(std::time::Duration::from_millis(20));
    let sum = s.in_doubt_summary().unwrap();
    assert_eq!(sum.count, 1, "txid 2 is still in doubt after the reopen");
    assert!(
        sum.oldest_age.unwrap() >= std::time::Duration::from_millis(20),
        "{sum:?}"
    );
    s.handle(2, Message::Abort { term: 1 }, b"").await.unwrap();
    assert_eq!(s.in_doubt_summary().unwrap(), Default::default());
}

/// Invariant 5 (recovery finds every in-doubt vote): the in-doubt index
/// follows every transition and survives a reopen.
#[tokio::test]
async fn inv5_in_doubt_index_follows_every_transition_and_survives_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    {
        let s = open(dir.path(), &probe);
        for t in 1..=4 {
            s.handle(t, Message::Prepare { term: 1 }, b"v").await.unwrap();
        }
        s.handle(5, Message::Prepare { term: 1 }, b"no").await.unwrap();
        s.handle(6, Message::Abort { term: 1 }, b"").await.unwrap();
        s.handle(7, Message::CommitOnePhase { term: 1 }, b"v").await.unwrap();
        assert_eq!(doubt_txids(&s), vec![1, 2, 3, 4]);
        s.handle(1, Message::Commit { term: 1 }, b"").await.unwrap();
        s.handle(2, Message::Abort { term: 2 }, b"").await.unwrap();
        // A repeated Prepare of an in-doubt one leaves it in doubt, once.
        s.handle(3, Message::Prepare { term: 2 }, b"v").await.unwrap();
        assert_eq!(doubt_txids(&s), vec![3, 4]);
    }
    let s = open(dir.path(), &probe);
    assert_eq!(doubt_txids(&s), vec![3, 4], "after a reopen");
    s.handle(4, Message::Commit { term: 3 }, b"").await.unwrap();
    assert_eq!(doubt_txids(&s), vec![3]);
}

/// Invariant 5 (recovery keeps finding every in-doubt vote) under
/// concurrent decisions: `in_doubt()` scans the in-doubt index while Commit
/// and Abort remove entries from it. An entry removed after the scan
/// already read its place in the index is a concurrent decision, not a
/// damaged log, and must never fail the whole scan (which the recovery loop
/// would take as "nothing in doubt"). The scan runs on its own thread as
/// fast as it can while every one of many in-doubt votes is decided, so
/// thousands of scans overlap a removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inv5_in_doubt_scan_is_consistent_under_concurrent_commits() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let s = open(dir.path(), &probe);
    const N: u64 = 600;
    for t in 1..=N {
        s.handle(t, Message::Prepare { term: 1 }, b"v").await.unwrap();
    }
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scanner = {
        let (s, done) = (s.clone(), done.clone());
        std::thread::spawn(move || {
            let (mut scans, mut errors) = (0u64, Vec::new());
            while !done.load(Ordering::SeqCst) {
                match s.in_doubt() {
                    Ok(list) => {
                        // Whatever it lists is really in doubt right now or
                        // was a moment ago; it never lists a txid twice.
                        let mut ids: Vec<u64> = list.iter().map(|(t, _)| t.txid).collect();
                        ids.dedup();
                        assert_eq!(ids.len(), list.len());
                        assert!(list
                            .iter()
                            .all(|(_, e)| e.state == LocalState::Prepared { vote: Vote::Yes }));
                    }
                    Err(e) => errors.push(e.to_string()),
                }
                scans += 1;
            }
            (scans, errors)
        })
    };
    for t in 1..=N {
        let msg = if t % 2 == 0 {
            Message::Commit { term: 1 }
        } else {
            Message::Abort { term: 1 }
        };
        s.handle(t, msg, b"").await.unwrap();
    }
    done.store(true, Ordering::SeqCst);
    let (scans, errors) = scanner.join().unwrap();
    eprintln!("{scans} scans during {N} decisions");
    assert!(
        errors.is_empty(),
        "{} of {scans} scans failed, first: {}",
        errors.len(),
        errors[0]
    );
    assert!(s.in_doubt().unwrap().is_empty());
}

/// Counts increments of one counter (a metrics recorder for this thread).
struct CountOne {
    name: &'static str,
    n: Arc<std::sync::atomic::AtomicU64>,
}

struct CountFn(Arc<std::sync::atomic::AtomicU64>);

impl metrics::CounterFn for CountFn {
    fn increment(&self, v: u64) {
        self.0.fetch_add(v, Ordering::SeqCst);
    }
    fn absolute(&self, v: u64) {
        self.0.store(v, Ordering::SeqCst);
    }
}

impl metrics::Recorder for CountOne {
    fn describe_counter(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_gauge(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn describe_histogram(&self, _: metrics::KeyName, _: Option<metrics::Unit>, _: metrics::SharedString) {}
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        if key.name() == self.name {
            metrics::Counter::from_arc(Arc::new(CountFn(self.n.clone())))
        } else {
            metrics::Counter::noop()
        }
    }
    fn register_gauge(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::noop()
    }
    fn register_histogram(&self, _: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// Invariant 5 with a really inconsistent log: in-doubt index entries whose
/// record is missing, decided, or unreadable are reported (logged, counted
/// in `dtx_participant_log_inconsistencies_total`, once per transaction)
/// and skipped; the real in-doubt transactions are still listed, so
/// recovery of the others goes on.
#[tokio::test]
async fn inv5_inconsistent_in_doubt_entry_is_reported_and_skipped_while_others_are_listed() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let s = open(dir.path(), &probe);
    for t in [2, 5] {
        s.handle(t, Message::Prepare { term: 1 }, b"v").await.unwrap();
    }
    // Behind the store's back: an index entry without any record (1), one
    // whose record is decided (3), and one whose record cannot be read (4).
    let key = |p: u8, t: u64| {
        let mut k = vec![p];
        k.extend_from_slice(&t.to_be_bytes());
        k
    };
    let committed = participant_sdk::log::LogEntry {
        state: LocalState::Committed,
        term: 1,
    };
    s.raw()
        .write(vec![
            (key(b'i', 1), Some(vec![])),
            (key(b'i', 3), Some(vec![])),
            (
                key(b'l', 3),
                Some(participant_sdk::store::encode_entry(&committed).to_vec()),
            ),
            (key(b'i', 4), Some(vec![])),
            (key(b'l', 4), Some(b"garbage".to_vec())),
        ])
        .unwrap();

    let n = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let rec = CountOne {
        name: "dtx_participant_log_inconsistencies_total",
        n: n.clone(),
    };
    for pass in 0..3 {
        let listed = metrics::with_local_recorder(&rec, || s.in_doubt());
        let listed: Vec<u64> = listed
            .unwrap_or_else(|e| panic!("pass {pass}: the scan failed as a whole: {e}"))
            .iter()
            .map(|(t, _)| t.txid)
            .collect();
        assert_eq!(listed, vec![2, 5], "pass {pass}");
    }
    assert_eq!(n.load(Ordering::SeqCst), 3, "each inconsistency counted once");
    // The others are still recovered: deciding them works as usual.
    s.handle(2, Message::Commit { term: 1 }, b"").await.unwrap();
    assert_eq!(doubt_txids(&s), vec![5]);
}

/// Invariant 10 at the participant: a READ_ONLY vote's record never changes
/// again, so it is a garbage-collection candidate like a decided one (the
/// cluster is asked before it goes; see `server::collect_decided`), and the
/// log does not grow without bound under read-only traffic. The index
/// survives a reopen.
#[tokio::test]
async fn inv10_read_only_votes_are_gc_candidates_across_a_reopen() {
    struct ReadOnly;
    impl Resource for ReadOnly {
        fn prepare(&self, _: &View<'_>, _: GlobalTxid, payload: &[u8], _: &mut Staged) -> Vote {
            if payload == b"ro" {
                Vote::ReadOnly
            } else {
                Vote::Yes
            }
        }
        fn commit(&self, _: &View<'_>, _: GlobalTxid, _: &mut Staged) {}
        fn abort(&self, _: &View<'_>, _: GlobalTxid, _: &mut Staged) {}
    }
    let dir = tempfile::tempdir().unwrap();
    {
        let s = ParticipantStore::open(dir.path(), ReadOnly).unwrap();
        for t in 1..=3 {
            assert_eq!(
                s.handle(t, Message::Prepare { term: 1 }, b"ro").await.unwrap(),
                Reply::Vote(Vote::ReadOnly)
            );
        }
        s.handle(4, Message::Prepare { term: 1 }, b"w").await.unwrap();
        // A decision delivered to a READ_ONLY voter changes nothing and
        // does not index it twice.
        s.handle(2, Message::Commit { term: 2 }, b"").await.unwrap();
        let c: Vec<u64> = s
            .gc_candidates(u64::MAX, 100)
            .unwrap()
            .iter()
            .map(|(_, t)| t.txid)
            .collect();
        assert_eq!(c, vec![1, 2, 3], "every READ_ONLY vote, never the in-doubt one");
        let first = s.gc_candidates(u64::MAX, 1).unwrap();
        assert_eq!(s.forget_records(&first).unwrap(), 1);
        let left: Vec<u64> = s.entries().unwrap().iter().map(|(t, _)| t.txid).collect();
        assert_eq!(left, vec![2, 3, 4]);
    }
    let s = ParticipantStore::open(dir.path(), ReadOnly).unwrap();
    let c = s.gc_candidates(u64::MAX, 100).unwrap();
    assert_eq!(
        c.iter().map(|(_, t)| t.txid).collect::<Vec<_>>(),
        vec![2, 3],
        "still candidates after a reopen"
    );
    assert_eq!(s.forget_records(&c).unwrap(), 2);
    let left: Vec<u64> = s.entries().unwrap().iter().map(|(t, _)| t.txid).collect();
    assert_eq!(left, vec![4], "the in-doubt vote stays (invariant 5)");
}

/// Invariant 11 at the participant: records the cluster still needs stay
/// at the front of the garbage-collection index past retention; a scan that
/// always started there would see nothing else once `max` of them pile up.
/// Scans from a cursor move past them, and start over at the end.
#[tokio::test]
async fn inv11_gc_scan_moves_past_kept_records_and_starts_over_at_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let probe = Probe::default();
    let s = open(dir.path(), &probe);
    for txid in 1..=5u64 {
        s.handle(txid, Message::Abort { term: 1 }, b"").await.unwrap();
    }
    let ids = |c: &[(u64, GlobalTxid)]| c.iter().map(|(_, t)| t.txid).collect::<Vec<_>>();
    let mut cursor = participant_sdk::server::GcCursor::default();
    // Say 1 and 2 are kept (the cluster still awaits their acks): a scan
    // from the start with max 2 would return them for ever.
    assert_eq!(ids(&s.gc_candidates(u64::MAX, 2).unwrap()), vec![1, 2]);
    let first = s.gc_candidates_after(None, u64::MAX, 2).unwrap();
    cursor.advance(&first, 2);
    assert_eq!(cursor.after(), Some(first[1]), "a full page: go on after its last");
    let second = s.gc_candidates_after(cursor.after(), u64::MAX, 2).unwrap();
    assert_eq!(ids(&second), vec![3, 4], "the scan goes on past the kept ones");
    let third = s.gc_candidates_after(Some(second[1]), u64::MAX, 2).unwrap();
    assert_eq!(ids(&third), vec![5]);
    // A short page means the end was reached: the next pass starts over.
    let mut c = participant_sdk::server::GcCursor::default();
    c.advance(&third, 2);
    assert_eq!(c.after(), None);
    // The cursor never leaves the index (other key prefixes follow it).
    assert!(s.gc_candidates_after(Some(third[0]), u64::MAX, 10).unwrap().is_empty());
}
