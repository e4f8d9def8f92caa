//! A power cut, not a kill -9 (invariant 4: nothing acknowledged is lost;
//! ADR 0032). `kill -9` keeps the page cache, so a write that reached the
//! kernel and was never fsynced still reads back after a restart: the kill
//! tests cannot tell a missing sync from a present one. Here every data
//! directory lives on `dtx-lossyfs`, a FUSE filesystem served by this test
//! process that, at `power_cut()`, throws away every write not yet made
//! durable by an fsync of its file (and every directory entry not made
//! durable by an fsync of its directory), sled's files and our own log files
//! alike.
//!
//! - `t26_inv4_a_power_cut_with_the_leaders_sync_held_loses_no_acknowledged_write`
//!   (with the crash points every test build has): three `coordinator serve` processes,
//!   each with its data directory on the mount. Decisions are written and
//!   acknowledged; then the leader's log fsync is held (the `raft_log_flush`
//!   refusal point, as in t24) and one more Commit is sent: its entry
//!   reaches both followers (durable there), not the leader's disk (ADR
//!   0028's crash table: the leader's entries are reported to followers
//!   before their sync). Every node is SIGKILLed, the power is cut, and the
//!   old leader's directory (read with `coordinator inspect`) no longer
//!   holds that entry: the cut really dropped its unsynced tail. The old
//!   leader is restarted first, then the two others. Checks: the cluster
//!   elects a leader in a later term and serves a new write; every Commit a
//!   client was told COMMITTED reads back COMMITTED; and the held entry,
//!   which two of three nodes held durably, is decided COMMIT (an entry on
//!   a majority is never lost, whatever the leader's disk kept).
//! - `t26_inv5_a_participant_cut_after_its_yes_still_holds_it`: a
//!   `dtx-dev bank-serve` process with its store on the mount is sent
//!   Prepares (one committed, one voting YES) and is SIGKILLed the moment
//!   the YES reply arrives; the power is cut and it is restarted on what
//!   is left. It still holds the YES (PREPARED_YES, its account locked: a
//!   conflicting Prepare votes NO), and the committed transfer: the vote is
//!   sent only once it is durable.
//!
//! Mounting needs /dev/fuse and root (CI has both); without them each test
//! says so and passes, unless `DTX_REQUIRE_FUSE=1`, where it fails.
//!
//! Run with `cargo test -p dtx-devtools --test it -- t26_power_cut::`.

// The participant messages below take `..Default::default()`: fields added
// to them later (the cluster incarnation of ADR 0033, being written) are
// sent as their defaults, which this test does not depend on.
#![allow(clippy::needless_update)]

use crate::common;

use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::time::Duration;

use dtx_lossyfs::mount_or_skip;
use dtx_lossyfs::LossyFs;
use dtx_proto::v1 as pb;
use dtx_proto::v1::participant_service_client::ParticipantServiceClient;
use tonic::transport::Channel;

/// The lossy mount on a directory of its own; the mount goes first when
/// dropped (fields drop in order), then the directory.
struct Mounted {
    fs: LossyFs,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for Mounted {
    type Target = LossyFs;
    fn deref(&self) -> &LossyFs {
        &self.fs
    }
}

fn mount(test: &str) -> Option<Mounted> {
    let dir = tempfile::tempdir().unwrap();
    let fs = mount_or_skip(test, dir.path())?;
    Some(Mounted { fs, _dir: dir })
}

mod node {
    use super::*;

    use common::replicated;
    use common::TestCluster;
    use dtx_client::TxOutcome;
    use dtx_testkit::cluster::ProcessCluster;

    /// The refusal file of node `id`: each node reads its own (t24).
    fn refuse_file(c: &TestCluster, id: u64) -> PathBuf {
        c.dir.path().join(format!("refuse-node{id}"))
    }

    fn start_node(c: &mut TestCluster, id: u64) {
        let file = refuse_file(c, id).display().to_string();
        c.procs.env = vec![("DTX_FAILPOINT_REFUSE".into(), file)];
        c.procs.start(id).unwrap();
    }

    async fn status(c: &TestCluster, id: u64) -> Option<pb::ClusterStatusResponse> {
        dtx_client::cluster_status_at(&c.api(id), Duration::from_millis(500))
            .await
            .ok()
    }

    fn outcome(s: &pb::StatusResponse) -> Option<i32> {
        s.decision.as_ref().map(|d| d.outcome)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn t26_inv4_a_power_cut_with_the_leaders_sync_held_loses_no_acknowledged_write() {
        let test = "t26_inv4_a_power_cut_with_the_leaders_sync_held_loses_no_acknowledged_write";
        let Some(fs) = mount(test) else {
            return;
        };
        // The nodes' directories are made (and their names made durable)
        // before the nodes start, as provisioning would: `coordinator serve`
        // creates a missing data directory without syncing its parent.
        for id in 1..=3 {
            std::fs::create_dir(fs.path().join(format!("node{id}"))).unwrap();
        }
        std::fs::File::open(fs.path()).unwrap().sync_all().unwrap();

        let dir = common::test_dir();
        let mnt = fs.path().to_path_buf();
        // Long election timeouts (t24): the held fsync must not start an
        // election before the kill.
        let procs = ProcessCluster::new(common::bin(), dir.path(), "t26", common::local_plans(3), |cfg| {
            cfg.data_dir = mnt.join(format!("node{}", cfg.node_id));
            cfg.raft.election_timeout_min_ms = 4_000;
            cfg.raft.election_timeout_max_ms = 5_000;
        })
        .expect("cluster config");
        let mut c = TestCluster {
            dir,
            procs,
            proxies: Vec::new(),
        };
        for id in 1..=3 {
            start_node(&mut c, id);
        }
        let leader = c.leader().await;
        let followers: Vec<u64> = (1..=3).filter(|id| *id != leader).collect();

        // Acknowledged writes: each Commit answered COMMITTED.
        let client = c.client();
        let mut acked = Vec::new();
        for i in 0..12u64 {
            let b = client.begin(&format!("acked{i}"), 600_000, b"").await.unwrap();
            assert_eq!(client.commit(b.txid).await.unwrap(), TxOutcome::Committed);
            acked.push(b.txid);
        }
        let held_txid = client.begin("held", 600_000, b"").await.unwrap().txid;
        let before = c.status_of(leader).await;
        for id in 1..=3 {
            assert!(
                c.wait_applied(id, before.last_log_index, Duration::from_secs(20)).await,
                "node {id} did not apply index {} within 20 s",
                before.last_log_index
            );
        }

        // Hold the leader's log fsync, then send one more Commit: its entry
        // goes to the followers beside the held sync (ADR 0028).
        std::fs::write(refuse_file(&c, leader), "raft_log_flush\n").unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        let held = c.status_of(leader).await;
        assert_eq!(
            (held.role.as_str(), held.term),
            ("Leader", before.term),
            "premise: node {leader} still leads ({held:?})"
        );
        let target = held.last_log_index + 1;
        let committer = c.client_at(leader);
        let write = tokio::spawn(async move { committer.commit(held_txid).await });
        let until = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let mut have = 0;
            for f in &followers {
                if status(&c, *f).await.is_some_and(|s| s.last_log_index >= target) {
                    have += 1;
                }
            }
            if have == followers.len() {
                break;
            }
            assert!(
                tokio::time::Instant::now() < until,
                "premise: the followers {followers:?} did not receive index {target} within 20 s while the leader's \
                 sync was held"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The followers report an entry only once their own log synced it
        // (their sync is not held); the leader's has not.
        assert!(
            !write.is_finished(),
            "premise: the held Commit answered before the leader synced it: {:?}",
            write.await
        );
        let unsynced = fs.unsynced_bytes();

        // The power goes: every node at once, then everything not durable.
        for id in 1..=3 {
            c.procs.kill9(id);
        }
        write.abort();
        let report = fs.power_cut();
        eprintln!(
            "power cut: {report:?} ({unsynced} bytes were unsynced a moment before the kill; leader was node {leader})"
        );
        assert!(report.bytes_lost > 0, "the cut lost nothing: {report:?}");
        let old = c.inspect(leader);
        let old_last = old["log_last_index"].as_u64().unwrap_or(0);
        assert!(
            old_last < target,
            "premise: the old leader's log (node {leader}) still holds index {target} after the power cut (its last \
             index is {old_last}): its held sync let the entry reach the disk, or the cut kept it ({report:?})"
        );
        for f in &followers {
            let v = c.inspect(*f);
            assert!(
                v["log_last_index"].as_u64().unwrap_or(0) >= target,
                "follower {f} lost index {target}, which it had reported durable: {v}"
            );
        }

        // The old leader first, alone, then the others.
        std::fs::remove_file(refuse_file(&c, leader)).unwrap();
        start_node(&mut c, leader);
        assert!(
            dtx_testkit::cluster::wait_listening(&c.api(leader), Duration::from_secs(20)).await,
            "the old leader (node {leader}) did not start on what the power cut left"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        for f in &followers {
            start_node(&mut c, *f);
        }
        let new_leader = c.leader().await;
        let s = c.status_of(new_leader).await;
        assert!(
            s.term > held.term,
            "node {new_leader} leads term {} after the cut, not a term after {}: {s:?}",
            s.term,
            held.term
        );

        // Every acknowledged write reads back.
        let client = c.client();
        for txid in &acked {
            let st = replicated(client.status(*txid).await.unwrap());
            assert_eq!(
                outcome(&st),
                Some(pb::Outcome::Commit as i32),
                "transaction {txid} was acknowledged COMMITTED before the power cut and reads back otherwise: {st:?}"
            );
        }
        // The entry two of three nodes held durably is kept and decided.
        let until = tokio::time::Instant::now() + Duration::from_secs(20);
        let held_state = loop {
            let st = replicated(client.status(held_txid).await.unwrap());
            if st.decision.is_some() || tokio::time::Instant::now() > until {
                break st;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert_eq!(
            outcome(&held_state),
            Some(pb::Outcome::Commit as i32),
            "the Commit of transaction {held_txid}, durable on both followers but not on the old leader, was lost: \
             {held_state:?}"
        );
        // And the cluster serves.
        let b = client.begin("after", 600_000, b"").await.unwrap();
        assert_eq!(client.commit(b.txid).await.unwrap(), TxOutcome::Committed);
        let last = c.status_of(new_leader).await.last_log_index;
        for id in 1..=3 {
            assert!(
                c.wait_applied(id, last, Duration::from_secs(20)).await,
                "node {id} did not apply index {last} after the restart"
            );
        }
        for id in 1..=3 {
            c.procs.kill9(id);
        }
    }
}

/// One `bank-serve` process (t52's); killed on drop if still running.
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
            // the in-doubt vote stays in doubt (invariant 5).
            .args(["--cluster", "127.0.0.1:1", "--accounts", "4", "--initial", "1000"])
            .env("RUST_BACKTRACE", "0")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Bank { child, log }
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    async fn client(&mut self, addr: &str) -> ParticipantServiceClient<Channel> {
        for _ in 0..400 {
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!(
                    "bank-serve exited ({st}): {}",
                    std::fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            if let Ok(ch) = dtx_proto::endpoint(addr).unwrap().connect().await {
                return ParticipantServiceClient::new(ch);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("bank-serve never listened on {addr}");
    }
}

fn prepare(txid: u64, payload: &str) -> pb::PrepareRequest {
    pb::PrepareRequest {
        txid,
        term: 1,
        participant_id: "bank-a".into(),
        payload: payload.as_bytes().to_vec(),
        ..Default::default()
    }
}

fn decision(txid: u64) -> pb::ParticipantDecisionRequest {
    pb::ParticipantDecisionRequest {
        txid,
        term: 1,
        participant_id: "bank-a".into(),
        ..Default::default()
    }
}

async fn record(c: &mut ParticipantServiceClient<Channel>, txid: u64) -> pb::LocalRecord {
    let r = c
        .inquire(pb::InquireRequest {
            txid,
            participant_id: "bank-a".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    pb::LocalRecord::try_from(r.record).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t26_inv5_a_participant_cut_after_its_yes_still_holds_it() {
    let Some(fs) = mount("t26_inv5_a_participant_cut_after_its_yes_still_holds_it") else {
        return;
    };
    let logs = common::test_dir();
    // The store's directory is made (and its name made durable) before the
    // bank starts, as provisioning would. Left to bank-serve, the whole
    // directory, YES vote included, was gone after the cut: the store
    // creates a missing directory (`lock_store_dir`, create_dir_all) without
    // syncing its parent, and the log's own parent sync then finds it there.
    // ext4's journal would usually keep that name; POSIX does not promise it.
    let data = fs.path().join("bank-a");
    std::fs::create_dir(&data).unwrap();
    std::fs::File::open(fs.path()).unwrap().sync_all().unwrap();
    let port = dtx_testkit::cluster::free_port("127.0.0.1").unwrap();
    let addr = format!("127.0.0.1:{port}");

    let mut bank = Bank::start(&data, &addr, logs.path().join("1.log"));
    let mut c = bank.client(&addr).await;
    let v = c.prepare(prepare(1, "a0:-5")).await.unwrap().into_inner();
    assert_eq!(v.vote, pb::Vote::Yes as i32);
    c.commit(decision(1)).await.unwrap();
    let v = c.prepare(prepare(2, "a1:-7")).await.unwrap().into_inner();
    assert_eq!(v.vote, pb::Vote::Yes as i32);
    // Cut the moment the YES is in.
    bank.kill9();
    let report = fs.power_cut();
    eprintln!("power cut: {report:?}");

    let mut bank = Bank::start(&data, &addr, logs.path().join("2.log"));
    let mut c = bank.client(&addr).await;
    assert_eq!(
        record(&mut c, 2).await,
        pb::LocalRecord::PreparedYes,
        "the YES vote sent before the power cut is gone"
    );
    assert_eq!(record(&mut c, 1).await, pb::LocalRecord::Committed);
    // Its lock is still held: a transfer from that account votes NO.
    let v = c.prepare(prepare(100, "a1:-1")).await.unwrap().into_inner();
    assert_eq!(v.vote, pb::Vote::No as i32, "the in-doubt YES's lock was lost");
    // The decision still applies after the cut, and lasts through another.
    c.commit(decision(2)).await.unwrap();
    assert_eq!(record(&mut c, 2).await, pb::LocalRecord::Committed);
    bank.kill9();
    fs.power_cut();
    let mut bank = Bank::start(&data, &addr, logs.path().join("3.log"));
    let mut c = bank.client(&addr).await;
    assert_eq!(record(&mut c, 2).await, pb::LocalRecord::Committed);
    assert_eq!(record(&mut c, 1).await, pb::LocalRecord::Committed);
    bank.kill9();
}
