//! A participant whose disk fills up, on a small tmpfs of each test's own
//! (mounting needs root, as CI runs).
//!
//! The store's engine (ADR 0024) stops at its first failed write or sync:
//! it refuses every request from then on and acknowledges nothing more, and
//! the service must be restarted once space is freed (`coordinator
//! bank-serve` exits). A start with less than 4 MiB free is refused,
//! saying the disk is full, and changes nothing. sled still backs the saga
//! step store (`sled_0_34_7_stays_failed_after_enospc_until_reopened`).
//!
//! Invariant 4 (nothing acknowledged is lost) and 5 (an in-doubt
//! vote stays until a decision): the store never acknowledges what it did
//! not persist, and a restart after space is freed finds every
//! acknowledged record.

use std::path::Path;

use dtx_failpoint::disk::SmallFs;
use participant_sdk::log::LocalState;
use participant_sdk::log::Message;
use participant_sdk::log::Vote;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Reply;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::View;
use participant_sdk::GlobalTxid;

/// A store directory as a service leaves it after some work and a restart.
async fn used_store(dir: &Path) {
    for round in 0..2u64 {
        let s = ParticipantStore::open(dir, Kv).unwrap();
        for t in round * 10 + 1..=round * 10 + 10 {
            s.handle(t, Message::Prepare { term: 1 }, b"w").await.unwrap();
            s.handle(t, Message::Commit { term: 1 }, b"").await.unwrap();
        }
    }
}

/// Stages the payload on prepare; commit moves it to `applied/<txid>`.
struct Kv;

impl Resource for Kv {
    fn prepare(&self, _: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
        staged.put(format!("staged/{txid}").as_bytes(), payload);
        Vote::Yes
    }
    fn commit(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        let k = format!("staged/{txid}");
        let v = view.get(k.as_bytes()).unwrap().unwrap_or_default();
        staged.delete(k.as_bytes());
        staged.put(format!("applied/{txid}").as_bytes(), &v);
    }
    fn abort(&self, _: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        staged.delete(format!("staged/{txid}").as_bytes());
    }
}

/// What the store's behaviour is built on: sled 0.34.7, after a write
/// fails for lack of space, refuses every later write and flush, even once
/// space is back, while reads still see the unflushed write; a reopen
/// writes again and holds exactly what was flushed. If a sled upgrade
/// changes this, this test says so and the store's stop-on-failure can be
/// revisited.
#[test]
fn sled_0_34_7_stays_failed_after_enospc_until_reopened() {
    let fs = SmallFs::new(4 << 20);
    let dir = fs.path().join("db");
    {
        let db = sled::Config::new().path(&dir).flush_every_ms(None).open().unwrap();
        db.insert("flushed", "1").unwrap();
        db.flush().unwrap();
        fs.fill();
        let mut failed = None;
        for i in 0..1000 {
            db.insert(format!("k{i}"), vec![1u8; 1000]).unwrap();
            if let Err(e) = db.flush() {
                failed = Some((i, e));
                break;
            }
        }
        let (i, e) = failed.expect("sled never reported the full disk");
        match &e {
            sled::Error::Io(io) => assert_eq!(io.kind(), std::io::ErrorKind::StorageFull, "{e}"),
            other => panic!("a full disk as {other:?}"),
        }
        fs.free();
        assert!(db.insert("after", "1").is_err(), "sled wrote again after ENOSPC");
        assert!(db.flush().is_err(), "sled flushed again after ENOSPC");
        assert!(
            db.get(format!("k{i}")).unwrap().is_some(),
            "reads see the write that never reached the disk"
        );
    }
    let db = reopen_when_unlocked(&dir);
    assert!(db.get("flushed").unwrap().is_some());
    db.insert("after", "1").unwrap();
    db.flush().unwrap();
}

/// Opens sled on `dir` again right after this process dropped it: sled's
/// background threads may hold the directory's lock for a moment after the
/// drop (the store's own open waits for the same reason), so a lock error
/// is retried for up to 3 s; any other error fails.
fn reopen_when_unlocked(dir: &Path) -> sled::Db {
    open_when_unlocked(dir).unwrap()
}

/// sled's refusal because another instance holds the directory's lock.
fn is_lock_error(e: &sled::Error) -> bool {
    e.to_string().contains("could not acquire lock")
}

/// sled's open of `dir` once no earlier instance in this process holds its
/// lock (lock errors retried for up to 3 s), with any other outcome as it
/// is: a test that expects the open to fail (a full disk) must see it fail
/// for that reason, not because the last instance was still closing.
fn open_when_unlocked(dir: &Path) -> sled::Result<sled::Db> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
    loop {
        match sled::Config::new().path(dir).flush_every_ms(None).open() {
            Err(e) if is_lock_error(&e) && std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            other => return other,
        }
    }
}

/// Invariant 4: once a write fails for lack of space, the store
/// acknowledges nothing more (not the vote whose write failed, not a new
/// one, not a repeat of an earlier one), reports a full disk as a full
/// disk, and stays stopped after space is freed (it does not write again
/// in place); reopened, it holds every acknowledged record.
#[tokio::test]
async fn inv4_disk_full_stops_the_store_and_it_acknowledges_nothing_it_did_not_persist() {
    let fs = SmallFs::new(8 << 20);
    let dir = fs.path().join("participant");
    let acked_commits: Vec<u64> = (1..=5).collect();
    let mut acked_votes = Vec::new();
    let failed_txid;
    {
        let s = ParticipantStore::open(&dir, Kv).unwrap();
        for &t in &acked_commits {
            s.handle(t, Message::Prepare { term: 1 }, b"w").await.unwrap();
            assert_eq!(s.handle(t, Message::Commit { term: 1 }, b"").await.unwrap(), Reply::Ack);
        }
        fs.fill();
        let mut first_err = None;
        for t in 100..20_000u64 {
            match s.handle(t, Message::Prepare { term: 1 }, &[b'x'; 512]).await {
                Ok(Reply::Vote(Vote::Yes)) => acked_votes.push(t),
                Ok(other) => panic!("txid {t}: {other:?}"),
                Err(e) => {
                    first_err = Some((t, e));
                    break;
                }
            }
        }
        let (t, e) = first_err.expect("the disk never filled up");
        failed_txid = t;
        assert!(e.to_string().contains("disk is full"), "a full disk reported as: {e}");
        assert!(e.is_disk_full(), "{e:?}");
        let failure = s.failure().expect("the store did not stop");
        assert!(failure.disk_full);
        assert_eq!(s.stopped().await, failure, "a service waiting on stopped() learns it");

        // Space is back, but nothing more is acknowledged by this store.
        fs.free();
        for (txid, msg) in [
            (failed_txid, Message::Prepare { term: 1 }),
            (50_000, Message::Prepare { term: 1 }),
            (acked_commits[0], Message::Commit { term: 1 }),
            (
                acked_votes.first().copied().unwrap_or(failed_txid),
                Message::Prepare { term: 1 },
            ),
        ] {
            match s.handle(txid, msg, b"y").await {
                Err(e) => assert!(e.to_string().contains("disk is full"), "{e}"),
                Ok(r) => panic!("acknowledged {msg:?} of {txid} ({r:?}) after a failed write"),
            }
        }
        assert!(s.flush().await.is_err(), "a flush after the failure succeeded");
        assert!(s.write_data(|_, st| st.put(b"k", b"v")).await.is_err());
    }
    let s = ParticipantStore::open(&dir, Kv).unwrap();
    for &t in &acked_commits {
        assert_eq!(
            s.entry(t).unwrap().map(|e| e.state),
            Some(LocalState::Committed),
            "txid {t}"
        );
        assert!(s.view().get(format!("applied/{t}").as_bytes()).unwrap().is_some());
    }
    for &t in &acked_votes {
        assert_eq!(
            s.entry(t).unwrap().map(|e| e.state),
            Some(LocalState::Prepared { vote: Vote::Yes }),
            "acknowledged YES vote of {t} lost"
        );
        assert!(s.view().get(format!("staged/{t}").as_bytes()).unwrap().is_some());
    }
    eprintln!(
        "{} votes acknowledged before the disk was full; {failed_txid} failed",
        acked_votes.len()
    );
    // Writes again.
    s.handle(60_000, Message::Prepare { term: 1 }, b"z").await.unwrap();
}

/// A start while the disk is still full (a supervisor restarting the
/// service) fails saying the disk is full, changes nothing in the
/// directory, and a start after space is freed succeeds with everything
/// acknowledged before.
#[tokio::test]
async fn start_on_a_full_disk_says_so_and_leaves_the_directory_startable() {
    let fs = SmallFs::new(8 << 20);
    let dir = fs.path().join("participant");
    used_store(&dir).await;
    let before = tree_digest(&dir);
    fs.fill();
    for attempt in 0..3 {
        match ParticipantStore::open(&dir, Kv) {
            Ok(_) => panic!("attempt {attempt}: opened on a full disk"),
            Err(e) => {
                assert!(e.to_string().contains("disk is full"), "attempt {attempt}: {e}");
                assert!(e.is_disk_full(), "attempt {attempt}: {e:?}");
            }
        }
        assert_eq!(tree_digest(&dir), before, "attempt {attempt} changed the directory");
    }
    fs.free();
    let s = ParticipantStore::open(&dir, Kv).unwrap_or_else(|e| panic!("start after space was freed: {e}"));
    for t in 1..=20 {
        assert_eq!(s.entry(t).unwrap().map(|e| e.state), Some(LocalState::Committed));
    }
    s.handle(200, Message::Prepare { term: 1 }, b"z").await.unwrap();
}

/// Every file under `dir` (relative path) with its content.
fn tree_digest(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                out.push((rel, std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}
