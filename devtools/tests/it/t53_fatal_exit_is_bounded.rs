//! A node that stops on a fatal storage error exits on its own, within a
//! bound, with its error. Found by filling an ext4 filesystem whose backing
//! store ran out, so ENOSPC came at fsync: the node logged
//! `raft stopped on a fatal error: ... disk full` and
//! `final flush failed: not finished within 1s`, then never printed its final
//! error and never exited (every thread waited on a futex; SIGTERM did
//! nothing), and a supervisor never restarts a process that does not exit.
//!
//! The same situation, made with `failpoints` refusal points in one
//! follower's refusal file (`DTX_FAILPOINT_REFUSE`; each node reads its
//! own): `sm_batch_write` keeps its state machine's last writes pending (so
//! closing the store has something to write), then `engine_flush` holds
//! every flush of its store (an fsync that never returns) and
//! `raft_log_sync_no_space` makes its next Raft log sync fail as ENOSPC at
//! fsync does, which stops its Raft on a fatal error. The flush stays held
//! to the end: the store's writer thread, handed the pending writes as the
//! store closes, waits in it for ever, and so does whatever waits for that
//! thread. The tests check:
//!
//! - the node exits by itself within 10 s of the first line saying its Raft
//!   stopped, with a non-zero status, and its last words are the error
//!   (`Error: raft stopped on a fatal error: ... disk full`): fails if any
//!   step of the way out (the final flush, the drops of its stores, the
//!   runtime's shutdown) waits for the held flush without bound, as closing
//!   the state-machine store did;
//! - SIGTERM sent as soon as the node logs `raft stopped on a fatal error`
//!   ends it within 3 s, also with a non-zero status and its error: fails
//!   if the signal is lost while the node is on its way out.
//!
//! Run with `cargo test -p dtx-devtools --test it -- t53_fatal_exit_is_bounded::`.

use crate::common;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use common::TestCluster;
use dtx_client::TxOutcome;
use dtx_testkit::cluster::ProcessCluster;

/// How long after its Raft stopped on a fatal error a node may take to
/// exit.
const EXIT_BOUND: Duration = Duration::from_secs(10);

/// The node's own alert line.
const ALERT: &str = "raft stopped on a fatal error";
/// openraft's line as its core quits on the error (the earliest sign; the
/// alert line may never come when the node hangs).
const CORE_QUIT: &str = "quit RaftCore::main on error";

/// The refusal file of node `id`: each node reads its own.
fn refuse_file(c: &TestCluster, id: u64) -> PathBuf {
    c.dir.path().join(format!("refuse-node{id}"))
}

fn log_of(c: &mut TestCluster, id: u64) -> String {
    std::fs::read_to_string(&c.procs.node(id).log_path).unwrap_or_default()
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().filter(|l| !l.contains("decision recorded")).collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// A running three-node cluster, one follower of which (`node`) has just
/// logged one of `signs` (its Raft stopped on a failed log sync, as on a
/// full disk) while every flush of its store is held; writers still run.
struct Stopped {
    c: TestCluster,
    node: u64,
    stop_writers: Arc<AtomicBool>,
    writers: Vec<tokio::task::JoinHandle<()>>,
}

impl Stopped {
    async fn finish(mut self) {
        self.stop_writers.store(true, Ordering::SeqCst);
        for w in self.writers.drain(..) {
            let _ = w.await;
        }
        let _ = std::fs::remove_file(refuse_file(&self.c, self.node));
    }
}

async fn stop_a_follower_on_a_fatal_error_behind_a_held_flush(name: &str, signs: &[&str]) -> Stopped {
    let dir = common::test_dir();
    let procs =
        ProcessCluster::new(common::bin(), dir.path(), name, common::local_plans(3), |_| {}).expect("cluster config");
    let mut c = TestCluster {
        dir,
        procs,
        proxies: Vec::new(),
    };
    for id in 1..=3 {
        let file = refuse_file(&c, id);
        std::fs::write(&file, "").unwrap();
        c.procs.env = vec![("DTX_FAILPOINT_REFUSE".into(), file.display().to_string())];
        c.procs.start(id).unwrap();
    }
    let leader = c.leader().await;
    let node = (1..=3).find(|id| *id != leader).unwrap();

    // The follower keeps what it applies pending from here on (the node
    // re-reads the file within 50 ms).
    std::fs::write(refuse_file(&c, node), "sm_batch_write\n").unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let client = c.client();
    for i in 0..10u64 {
        let b = client.begin(&format!("warm{i}"), 600_000, b"").await.unwrap();
        assert_eq!(client.commit(b.txid).await.unwrap(), TxOutcome::Committed);
    }
    let last = c.status_of(leader).await.last_log_index;
    assert!(
        c.wait_applied(node, last, Duration::from_secs(20)).await,
        "premise: node {node} applied index {last}"
    );
    // Quiet, then the faults at once: every flush of its store hangs from
    // now on, and its next log sync fails as ENOSPC at fsync does.
    // (Holding the flush under a steady stream of applies would fill its
    // state machine writer's queue and stop the node before any fatal
    // error: a hung disk, not this defect.)
    std::fs::write(
        refuse_file(&c, node),
        "sm_batch_write\nengine_flush\nraft_log_sync_no_space\n",
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Writers for the rest of the test: the next entry reaches the
    // follower's log, whose sync fails.
    let stop_writers = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..2 {
        let client = c.client();
        let stop = stop_writers.clone();
        writers.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                i += 1;
                if let Ok(b) = client.begin(&format!("w{w}-{i}"), 600_000, b"").await {
                    let _ = client.commit(b.txid).await;
                }
            }
        }));
    }
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let log = log_of(&mut c, node);
        if signs.iter().any(|s| log.contains(s)) {
            break;
        }
        if Instant::now() > until {
            panic!(
                "node {node} logged none of {signs:?} within 30 s of the failed log sync:\n{}",
                tail(&log)
            );
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Stopped {
        c,
        node,
        stop_writers,
        writers,
    }
}

/// Waits up to `bound` for node `id` to exit; its exit status, or None
/// (then it is left to the cluster's drop, which kills it).
async fn exit_within(c: &mut TestCluster, id: u64, bound: Duration) -> Option<std::process::ExitStatus> {
    let until = Instant::now() + bound;
    while c.procs.node(id).is_running() {
        if Instant::now() > until {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Exited: this reaps it (the signal reaches nothing).
    c.procs.stop(id, Duration::from_secs(1))
}

fn check_exit_words(c: &mut TestCluster, id: u64, status: std::process::ExitStatus) {
    let log = log_of(c, id);
    assert!(
        !status.success(),
        "node {id} exited with {status} after a fatal error:\n{}",
        tail(&log)
    );
    let words = log
        .lines()
        .rfind(|l| l.starts_with("Error: "))
        .unwrap_or_else(|| panic!("node {id} exited without printing its error:\n{}", tail(&log)));
    assert!(
        words.contains(ALERT) && words.contains("disk full"),
        "node {id}'s last error is not the fatal one: {words}\n{}",
        tail(&log)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t53_a_node_stopped_on_a_fatal_error_behind_a_hung_flush_exits_with_its_error() {
    let mut s = stop_a_follower_on_a_fatal_error_behind_a_held_flush("t53a", &[CORE_QUIT, ALERT]).await;
    let (c, node) = (&mut s.c, s.node);
    let seen = Instant::now();
    let status = exit_within(c, node, EXIT_BOUND).await;
    let Some(status) = status else {
        panic!(
            "node {node} did not exit within {EXIT_BOUND:?} of its Raft stopping on a fatal error:\n{}",
            tail(&log_of(c, node))
        );
    };
    eprintln!(
        "node {node} exited {:?} after its Raft stopped, {status}",
        seen.elapsed()
    );
    check_exit_words(c, node, status);
    s.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t53_sigterm_ends_a_node_on_its_way_out_after_a_fatal_error() {
    let mut s = stop_a_follower_on_a_fatal_error_behind_a_held_flush("t53b", &[ALERT]).await;
    let (c, node) = (&mut s.c, s.node);
    c.procs.signal(node, libc::SIGTERM);
    let sent = Instant::now();
    let status = exit_within(c, node, Duration::from_secs(3)).await;
    let Some(status) = status else {
        panic!(
            "node {node} did not exit within 3 s of SIGTERM after its fatal error:\n{}",
            tail(&log_of(c, node))
        );
    };
    eprintln!("node {node} exited {:?} after SIGTERM, {status}", sent.elapsed());
    check_exit_words(c, node, status);
    s.finish().await;
}
