//! `dtx-dev bank-serve` (the example participant) whose disk fills up, on a
//! small tmpfs of the test's own (mounting needs root, as CI runs). Found by
//! filling a bank's file system under load: the bank stayed up answering
//! INTERNAL to every call and never recovered once space was freed (sled
//! 0.34.7 refuses every write after a failed one until it is reopened; see
//! participant-sdk/tests/it/t30_disk_full.rs).
//!
//! Now: the call whose write failed, and every later one, is refused as
//! RESOURCE_EXHAUSTED saying the disk is full; the process exits non-zero
//! with that message so a supervisor restarts it; a restart while the disk
//! is still full exits saying the same (not "corrupted"); once space is
//! freed a restart serves again with everything acknowledged before.
//! Invariants 4 (nothing acknowledged is lost) and 5 (an in-doubt
//! vote and its locks survive until a decision).

use crate::common;

use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::time::Duration;

use dtx_failpoint::disk::SmallFs;
use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use tonic::transport::Channel;

/// One `bank-serve` process; killed on drop if still running.
struct Bank {
    child: Child,
    log: PathBuf,
}

impl Drop for Bank {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Bank {
    fn start(data_dir: &Path, listen: &str, log: PathBuf) -> Bank {
        let child = Command::new(common::bin())
            .args(["bank-serve", "--id", "bank-a", "--prefix", "a", "--listen", listen])
            .arg("--data-dir")
            .arg(data_dir)
            // Nothing listens there: recovery never learns a decision, so
            // the in-doubt vote below stays in doubt (invariant 5).
            .args(["--cluster", "127.0.0.1:1", "--accounts", "4", "--initial", "1000"])
            .env("RUST_BACKTRACE", "0")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Bank { child, log }
    }

    fn stderr(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (up to `limit`) for the process to exit by itself.
    async fn exited(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let until = tokio::time::Instant::now() + limit;
        while tokio::time::Instant::now() < until {
            if let Some(st) = self.child.try_wait().unwrap() {
                return Some(st);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// Connects once it listens (up to 20 s).
    async fn client(&mut self, addr: &str) -> ParticipantServiceClient<Channel> {
        for _ in 0..400 {
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!("bank-serve exited ({st}): {}", self.stderr());
            }
            if let Ok(ch) = dtx_proto::endpoint(addr).unwrap().connect().await {
                return ParticipantServiceClient::new(ch);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("bank-serve never listened on {addr}: {}", self.stderr());
    }
}

/// The lines of a log that say the disk is full.
fn disk_full_lines(log: &str) -> String {
    log.lines()
        .filter(|l| l.contains("disk is full"))
        .collect::<Vec<_>>()
        .join("\n")
}

fn prepare(txid: u64, payload: &str) -> pb::PrepareRequest {
    pb::PrepareRequest {
        txid,
        term: 1,
        participant_id: "bank-a".into(),
        payload: payload.as_bytes().to_vec(),
        incarnation: 0,
    }
}

fn decision(txid: u64) -> pb::ParticipantDecisionRequest {
    pb::ParticipantDecisionRequest {
        txid,
        term: 1,
        participant_id: "bank-a".into(),
        incarnation: 0,
    }
}

async fn record(c: &mut ParticipantServiceClient<Channel>, txid: u64) -> pb::LocalRecord {
    let r = c
        .inquire(pb::InquireRequest {
            txid,
            participant_id: "bank-a".into(),
            incarnation: 0,
        })
        .await
        .unwrap()
        .into_inner();
    pb::LocalRecord::try_from(r.record).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t52_inv4_bank_on_a_full_disk_says_so_exits_and_restarts_with_every_ack_once_space_is_freed() {
    let fs = SmallFs::new(16 << 20);
    let logs = tempfile::tempdir().unwrap();
    let data = fs.path().join("bank-a");
    let port = dtx_testkit::cluster::free_port("127.0.0.1").unwrap();
    let addr = format!("127.0.0.1:{port}");

    let mut bank = Bank::start(&data, &addr, logs.path().join("1.log"));
    let mut c = bank.client(&addr).await;
    // Acknowledged before the disk fills: a committed transfer, and a YES
    // vote still in doubt (its account locked).
    let v = c.prepare(prepare(1, "a0:-5")).await.unwrap().into_inner();
    assert_eq!(v.vote, pb::Vote::Yes as i32);
    c.commit(decision(1)).await.unwrap();
    let v = c.prepare(prepare(2, "a1:-7")).await.unwrap().into_inner();
    assert_eq!(v.vote, pb::Vote::Yes as i32);

    fs.fill();
    // Every call writes a record; the first that cannot be made durable
    // fails, saying why, and is not acknowledged.
    let mut refused = None;
    for t in 3..20_000u64 {
        match c.abort(decision(t)).await {
            Ok(_) => {}
            Err(s) => {
                refused = Some((t, s));
                break;
            }
        }
    }
    let (t, s) = refused.expect("the disk never filled up");
    assert_eq!(s.code(), tonic::Code::ResourceExhausted, "txid {t}: {s:?}");
    assert!(s.message().contains("disk is full"), "txid {t}: {}", s.message());

    // The service stops by itself, saying so, for its supervisor to restart.
    let st = bank
        .exited(Duration::from_secs(30))
        .await
        .unwrap_or_else(|| panic!("bank-serve kept running with a stopped store: {}", bank.stderr()));
    assert!(!st.success(), "{st}");
    assert!(bank.stderr().contains("disk is full"), "{}", bank.stderr());
    eprintln!("bank-serve ended with:\n{}", disk_full_lines(&bank.stderr()));

    // Restarted while the disk is still full: it exits at once, saying the
    // disk is full (not that its data is damaged), twice.
    for i in 2..=3 {
        let mut again = Bank::start(&data, &addr, logs.path().join(format!("{i}.log")));
        let st = again
            .exited(Duration::from_secs(30))
            .await
            .unwrap_or_else(|| panic!("start {i} on a full disk kept running: {}", again.stderr()));
        assert!(!st.success());
        let err = again.stderr();
        assert!(err.contains("disk is full"), "start {i}: {err}");
        assert!(!err.to_lowercase().contains("corrupt"), "start {i}: {err}");
        eprintln!("start {i} on a full disk said:\n{}", disk_full_lines(&err));
    }

    // Space is freed: it serves again, with everything acknowledged.
    fs.free();
    let mut bank = Bank::start(&data, &addr, logs.path().join("4.log"));
    let mut c = bank.client(&addr).await;
    assert_eq!(record(&mut c, 1).await, pb::LocalRecord::Committed);
    assert_eq!(
        record(&mut c, 2).await,
        pb::LocalRecord::PreparedYes,
        "the in-doubt vote"
    );
    // Its lock is still held: a transfer from that account votes NO.
    let v = c.prepare(prepare(100, "a1:-1")).await.unwrap().into_inner();
    assert_eq!(v.vote, pb::Vote::No as i32);
    c.commit(decision(2)).await.unwrap();
    drop(c);
    drop(bank);

    let store = dtx_bank::open_bank(&data, "a", 4, 1000).await.unwrap();
    let balances: std::collections::BTreeMap<String, i64> = dtx_bank::balances(&store).unwrap().into_iter().collect();
    assert_eq!(balances["a0"], 995);
    assert_eq!(balances["a1"], 993);
    let (total, n, locked) = dtx_bank::audit(&store).unwrap();
    assert_eq!((total, n, locked), (4000 - 12, 4, 0));
}
