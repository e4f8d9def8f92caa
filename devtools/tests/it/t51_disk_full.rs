//! Disk full on a coordinator node (ADR 0010). Invariant 4 (durability):
//! nothing a caller was told COMMITTED is lost when one node's filesystem
//! fills up, and that node never damages its own data directory by being
//! restarted or inspected while the disk is still full.
//!
//! Each node's data directory sits on a small tmpfs of its own (mounted by
//! the test, which must run as root, as CI does). The leader's filesystem is
//! filled while clients write. The test then checks, in order:
//! 1. the leader stops, logging the alert line `raft stopped on a fatal
//!    error` with a message that says the disk is full;
//! 2. restarted (as a supervisor would) with 0 bytes free and at several
//!    levels below what a node needs, it refuses to start with a disk-full
//!    message (not "damaged") and changes no byte of its directory;
//! 3. `coordinator inspect` on it works and changes no byte either, also
//!    with the empty `snap.*.generating` file sled leaves when its snapshot
//!    write fails on a full disk (which it ignores and names);
//! 4. once space is freed it removes that file (and logs it), starts, catches
//!    up, and every transaction acknowledged COMMITTED before, during and
//!    after the fault reads COMMIT, from the cluster and from its own
//!    directory.

use crate::common;

use std::path::Path;
use std::process::Command;
use std::sync::atomic::AtomicBool;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use common::bin;
use common::dir_digest;
use common::test_dir;
use common::walk;
use common::TestCluster;
use coordinator::store::START_FREE_BYTES_MIN;
use dtx_client::DecisionRead;
use dtx_client::TxOutcome;
use dtx_failpoint::disk::free_bytes;
use dtx_failpoint::disk::SmallFs;

/// Size of each node's filesystem: room for the test's writes many times
/// over, small enough to fill in a moment.
const DISK_BYTES: u64 = 48 * 1024 * 1024;

fn sizes(digest: &[(String, Vec<u8>)]) -> Vec<(&str, usize)> {
    digest.iter().map(|(p, b)| (p.as_str(), b.len())).collect()
}

/// Runs `coordinator serve` once in the foreground (as a supervisor would
/// restart a node); returns (exited successfully, stderr). A node still
/// running after `limit` is killed and reported as started.
fn serve_once(config: &Path, stderr_path: &Path, limit: Duration) -> (Option<bool>, String) {
    let err = std::fs::File::create(stderr_path).unwrap();
    let mut child = Command::new(bin())
        .arg("serve")
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "info,openraft=warn")
        .stdout(std::process::Stdio::null())
        .stderr(err)
        .spawn()
        .expect("run coordinator");
    let until = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break Some(st.success());
        }
        if std::time::Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    (status, std::fs::read_to_string(stderr_path).unwrap_or_default())
}

fn inspect(data_dir: &Path) -> (bool, String, String) {
    let out = Command::new(bin())
        .args(["inspect", "--data-dir"])
        .arg(data_dir)
        .output()
        .expect("run inspect");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t51_full_disk_stops_the_node_which_restarts_cleanly_once_space_is_freed() {
    // Declared first, dropped last: the mounts outlive the node processes.
    let disks = test_dir();
    let mounts: Vec<SmallFs> = (1..=3u64)
        .map(|id| SmallFs::mount(&disks.path().join(format!("disk{id}")), DISK_BYTES))
        .collect();
    let disk_of = |id: u64| mounts[(id - 1) as usize].path().to_path_buf();

    let disks_path = disks.path().to_path_buf();
    let mut c = TestCluster::start_with("t51", 3, |c| {
        c.data_dir = disks_path.join(format!("disk{}", c.node_id)).join("data");
        // Nothing is forgotten while the test runs.
        c.txn.retention_ms = 3_600_000;
    });

    let full = c.leader().await;
    let full_data = c.procs.node(full).config.data_dir.clone();
    let full_cfg = c.procs.node(full).config_path.clone();

    // Writers: Begin then Commit (no participants, so the decision is
    // COMMIT at once); a txid counts only when the client was told
    // COMMITTED.
    let committed: Arc<Mutex<Vec<u64>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..3 {
        let client = c.client();
        let committed = committed.clone();
        let stop = stop.clone();
        writers.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                i += 1;
                let Ok(b) = client.begin(&format!("t51-{w}-{i}"), 3_600_000, b"").await else {
                    continue;
                };
                if let Ok(TxOutcome::Committed) = client.commit(b.txid).await {
                    committed.lock().unwrap().push(b.txid);
                }
            }
        }));
    }
    let count = |c: &Arc<Mutex<Vec<u64>>>| c.lock().unwrap().len();
    let wait_count = |n: usize, what: &'static str| {
        let committed = committed.clone();
        async move {
            let until = tokio::time::Instant::now() + Duration::from_secs(60);
            while count(&committed) < n {
                assert!(
                    tokio::time::Instant::now() < until,
                    "{what}: only {} commits",
                    count(&committed)
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    wait_count(30, "before the fault").await;

    // (1) Fill the leader's filesystem while the writers run.
    let ballast = mounts[(full - 1) as usize].fill();
    assert!(free_bytes(&disk_of(full)) < 4096, "the disk was not filled");
    let until = std::time::Instant::now() + Duration::from_secs(60);
    while c.procs.node(full).is_running() {
        if std::time::Instant::now() > until {
            c.dump_logs();
            panic!("node {full} kept running for 60 s on a full disk");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = std::fs::read_to_string(&c.procs.node(full).log_path).unwrap();
    let tail: String = log.lines().rev().take(30).collect::<Vec<_>>().join("\n");
    assert!(
        log.contains("raft stopped on a fatal error"),
        "the alert line is missing from node {full}'s log:\n{tail}"
    );
    assert!(
        log.contains("disk full"),
        "node {full} did not say its disk is full:\n{tail}"
    );
    // The other two go on; then the writers stop.
    let before = count(&committed);
    wait_count(before + 20, "after the fault").await;
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        w.await.unwrap();
    }
    let committed: Vec<u64> = committed.lock().unwrap().clone();

    // (2) and (3): restarted (as a supervisor would) and inspected while the
    // disk is full, or nearly: each level is below what a node needs.
    let ballast_len = std::fs::metadata(&ballast).unwrap().len();
    let levels = [0, 64 << 10, 1 << 20, START_FREE_BYTES_MIN - (1 << 20)];
    for (attempt, free) in levels.into_iter().enumerate() {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&ballast)
            .unwrap()
            .set_len(ballast_len - free)
            .unwrap();
        let before = dir_digest(&full_data);
        let (status, err) = serve_once(
            &full_cfg,
            &c.dir.path().join(format!("restart{attempt}.err")),
            Duration::from_secs(60),
        );
        assert_eq!(
            status,
            Some(false),
            "with {free} bytes free the node did not refuse to start:\n{err}"
        );
        assert!(
            err.contains("disk full"),
            "with {free} bytes free: no disk-full message:\n{err}"
        );
        assert!(
            !err.contains("is damaged"),
            "with {free} bytes free: a full disk is not damage:\n{err}"
        );
        let after = dir_digest(&full_data);
        assert!(
            before == after,
            "with {free} bytes free a refused start changed the data directory: {:?} -> {:?}",
            sizes(&before),
            sizes(&after)
        );

        let (ok, out, err) = inspect(&full_data);
        let after = dir_digest(&full_data);
        assert!(
            before == after,
            "with {free} bytes free inspect changed the data directory: {:?} -> {:?}",
            sizes(&before),
            sizes(&after)
        );
        assert!(ok, "with {free} bytes free inspect failed: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).expect("inspect prints JSON");
        assert_eq!(v["node_id"], serde_json::json!(full), "{out}");
    }

    // What sled 0.34 leaves when its start-up snapshot write fails on a
    // full disk (spacejam/sled#1527), as earlier builds let it: an empty
    // `snap.<lsn>.generating` that sorts after every complete snapshot, so
    // sled takes it for the newest and calls the directory corrupt.
    let next = walk(&full_data)
        .iter()
        .filter_map(|p| {
            let n = p.file_name()?.to_string_lossy().to_string();
            u64::from_str_radix(n.strip_prefix("snap.")?, 16).ok()
        })
        .max()
        .map_or(1, |newest| newest + 1);
    let leftover = full_data.join(format!("snap.{next:016X}.generating"));
    std::fs::File::create(&leftover).unwrap();
    // inspect ignores it, says so, and leaves it where it is.
    let before = dir_digest(&full_data);
    let (ok, out, err) = inspect(&full_data);
    assert!(ok, "inspect with sled's leftover snapshot file: {err}");
    assert!(before == dir_digest(&full_data), "inspect changed the data directory");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        v["ignored_incomplete_snapshots"],
        serde_json::json!([leftover.file_name().unwrap().to_string_lossy()]),
        "{out}"
    );

    // (4) Space freed: the node removes the leftover (and says so), starts,
    // catches up, and nothing acknowledged is lost.
    std::fs::remove_file(&ballast).unwrap();
    c.procs.start(full).unwrap();
    let others: Vec<u64> = (1..=3).filter(|&i| i != full).collect();
    let mut target = 0;
    for &o in &others {
        target = target.max(c.status_of(o).await.last_applied_index);
    }
    if !c.wait_applied(full, target, Duration::from_secs(60)).await {
        c.dump_logs();
        panic!("node {full} did not catch up to index {target} after space was freed");
    }
    let st = c.status_of(full).await;
    assert!(st.leader_id != 0, "node {full} knows no leader: {st:?}");
    assert!(!leftover.exists(), "start-up kept sled's incomplete snapshot file");
    let log = std::fs::read_to_string(&c.procs.node(full).log_path).unwrap();
    assert!(
        log.contains("removed sled's incomplete snapshot file"),
        "start-up did not log the file it removed"
    );

    let client = c.client();
    for chunk in committed.chunks(1000) {
        for (txid, d) in client.decisions(chunk).await.unwrap() {
            assert_eq!(d, DecisionRead::Committed, "txid {txid} was acknowledged COMMITTED");
        }
    }
    // The node's own directory holds every acknowledged decision.
    assert!(
        c.procs.stop(full, Duration::from_secs(10)).is_some_and(|s| s.success()),
        "node {full} did not stop cleanly"
    );
    let (ok, out, err) = inspect(&full_data);
    assert!(ok, "inspect after recovery: {err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let decided: std::collections::HashMap<u64, String> = v["transactions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["txid"].as_u64().unwrap(),
                t["decision"]["outcome"].as_str().unwrap_or("none").to_string(),
            )
        })
        .collect();
    for txid in &committed {
        assert_eq!(
            decided.get(txid).map(String::as_str),
            Some("COMMIT"),
            "txid {txid} acknowledged COMMITTED is not COMMIT in node {full}'s directory"
        );
    }
    drop(c);
    drop(mounts);
}
