//! kill -9 a process while it prepares and commits: every vote or ack it
//! reported before dying is found in the store after reopening (a reply is
//! sent only after the fsync that covers it). The test re-runs its own binary
//! as the child that does the work.

use std::io::BufRead;
use std::io::BufReader;
use std::path::Path;
use std::process::Command;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use participant_sdk::log::LocalState;
use participant_sdk::log::Message;
use participant_sdk::log::Vote;
use participant_sdk::store::ParticipantStore;
use participant_sdk::store::Resource;
use participant_sdk::store::Staged;
use participant_sdk::store::View;
use participant_sdk::GlobalTxid;

struct Stage;

impl Resource for Stage {
    fn prepare(&self, _v: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
        staged.put(format!("staged/{txid}").as_bytes(), payload);
        Vote::Yes
    }
    fn commit(&self, _v: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        staged.delete(format!("staged/{txid}").as_bytes());
        staged.put(format!("applied/{txid}").as_bytes(), b"1");
    }
    fn abort(&self, _v: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
        staged.delete(format!("staged/{txid}").as_bytes());
    }
}

/// Child mode: prepares txids 1.., commits the even ones, prints each reply
/// as soon as `handle` returned it ("P <txid>" or "C <txid>"). Runs until
/// killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_worker() {
    let Some(dir) = std::env::var_os("DTX_CRASH_CHILD_DIR") else {
        return; // Only meaningful when started by the parent test below.
    };
    let s = ParticipantStore::open(Path::new(&dir), Stage).unwrap();
    let start: u64 = std::env::var("DTX_CRASH_CHILD_START").unwrap().parse().unwrap();
    let mut tasks = Vec::new();
    for w in 0..8u64 {
        let s: Arc<ParticipantStore<Stage>> = s.clone();
        tasks.push(tokio::spawn(async move {
            let mut txid = start + w;
            loop {
                s.handle(txid, Message::Prepare { term: 1 }, b"work").await.unwrap();
                println!("P {txid}");
                if txid.is_multiple_of(2) {
                    s.handle(txid, Message::Commit { term: 1 }, b"").await.unwrap();
                    println!("C {txid}");
                }
                txid += 8;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

#[test]
fn kill9_loop_loses_no_reported_vote_or_ack() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let mut prepared = Vec::new();
    let mut committed = Vec::new();
    for round in 0..5u64 {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "t20_store_crash::child_worker",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env("DTX_CRASH_CHILD_DIR", dir.path())
            .env("DTX_CRASH_CHILD_START", (1 + round * 1_000_000).to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut lines = Vec::new();
            for l in BufReader::new(out).lines() {
                let Ok(l) = l else { break };
                lines.push(l);
            }
            lines
        });
        std::thread::sleep(Duration::from_millis(300 + round * 100));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        for l in reader.join().unwrap() {
            if let Some(t) = l.strip_prefix("P ") {
                prepared.push(t.parse::<u64>().unwrap());
            } else if let Some(t) = l.strip_prefix("C ") {
                committed.push(t.parse::<u64>().unwrap());
            }
        }
    }
    assert!(
        prepared.len() > 50,
        "too little work to mean anything: {}",
        prepared.len()
    );
    let s = ParticipantStore::open(dir.path(), Stage).unwrap();
    for t in &prepared {
        let e = s
            .entry(*t)
            .unwrap()
            .unwrap_or_else(|| panic!("reported YES vote for {t} lost"));
        assert!(
            matches!(
                e.state,
                LocalState::Prepared { vote: Vote::Yes } | LocalState::Committed
            ),
            "{t}: {e:?}"
        );
        if e.state == (LocalState::Prepared { vote: Vote::Yes }) {
            assert!(
                s.view().get(format!("staged/{t}").as_bytes()).unwrap().is_some(),
                "{t}: staged work lost"
            );
        }
    }
    for t in &committed {
        assert_eq!(
            s.entry(*t).unwrap().unwrap().state,
            LocalState::Committed,
            "reported ack for {t} lost"
        );
        assert!(s.view().get(format!("applied/{t}").as_bytes()).unwrap().is_some());
    }
    eprintln!(
        "{} votes and {} acks reported before kill -9; all found",
        prepared.len(),
        committed.len()
    );
}
