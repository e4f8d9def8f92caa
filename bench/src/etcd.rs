//! etcd beside us in `dtx-dev bench`: a supervisor of a local three-member
//! etcd cluster ([`EtcdCluster`]), started from the system's `etcd` binary
//! (Debian's `etcd-server`) on loopback with its data on the same disk as our
//! nodes', and a minimal gRPC client of etcd's v3 KV API ([`EtcdKv`]): the
//! messages in `bench/proto/etcd_kv.proto`, compiled at build time,
//! wire-compatible with etcd.
//!
//! The workload is etcd's write-once register: a `Txn` that puts a key only
//! if it does not exist yet (compare `create_revision == 0`), the same
//! primitive our `Decide` is.

use std::fs;
use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;
use std::time::Instant;

use anyhow::Context;
use dtx_transport::channel::Channel;

use dtx_testkit::cluster::free_port;

/// The generated messages and client stubs (package `etcdserverpb`).
pub mod pb {
    tonic::include_proto!("etcdserverpb");
}

use pb::kv_client::KvClient;
use pb::maintenance_client::MaintenanceClient;

/// The `etcd` binary to run: `explicit` if given, else `etcd` on `PATH`;
/// `None` when there is none.
pub fn find_binary(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return p.is_file().then(|| p.to_path_buf());
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("etcd"))
        .find(|p| p.is_file())
}

/// `etcd --version`'s first line ("etcd Version: 3.4.23").
pub fn binary_version(bin: &Path) -> anyhow::Result<String> {
    let out = Command::new(bin)
        .arg("--version")
        .output()
        .with_context(|| format!("cannot run {} --version", bin.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text.lines().next().unwrap_or("").trim().to_string())
}

/// One etcd member: its name, loopback client and peer addresses, data
/// directory and log.
pub struct EtcdMember {
    pub name: String,
    /// `127.0.0.1:port` where clients connect (gRPC).
    pub client_addr: String,
    pub peer_addr: String,
    pub data_dir: PathBuf,
    pub log_path: PathBuf,
    child: Option<Child>,
}

impl EtcdMember {
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }
}

/// A local etcd cluster of real `etcd` processes, like
/// [`dtx_testkit::cluster::ProcessCluster`] is for our nodes: every member on
/// 127.0.0.1 with free ports, its data directory and log under one
/// directory. Stopping it (or dropping it, which a failed or interrupted
/// run does) kills every member and removes their data directories; the
/// logs stay.
pub struct EtcdCluster {
    pub dir: PathBuf,
    pub bin: PathBuf,
    pub members: Vec<EtcdMember>,
}

impl EtcdCluster {
    /// Plans `n` members under `dir` (created) on free loopback ports.
    pub fn plan_local(bin: &Path, dir: &Path, n: usize) -> std::io::Result<EtcdCluster> {
        fs::create_dir_all(dir)?;
        let ip = "127.0.0.1";
        let members = (1..=n)
            .map(|i| {
                let name = format!("etcd{i}");
                Ok(EtcdMember {
                    client_addr: format!("{ip}:{}", free_port(ip)?),
                    peer_addr: format!("{ip}:{}", free_port(ip)?),
                    data_dir: dir.join(&name),
                    log_path: dir.join(format!("{name}.log")),
                    name,
                    child: None,
                })
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(EtcdCluster {
            dir: dir.to_path_buf(),
            bin: bin.to_path_buf(),
            members,
        })
    }

    /// `--initial-cluster`: every member's name and peer URL.
    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://{}", m.name, m.peer_addr))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Starts every member (a fresh cluster: any old data directory is
    /// removed first). Defaults otherwise, so fsync on every WAL write, as
    /// ours does on every Raft append.
    pub fn start_all(&mut self) -> std::io::Result<()> {
        use std::os::unix::process::CommandExt;
        let initial = self.initial_cluster();
        for m in &mut self.members {
            let _ = fs::remove_dir_all(&m.data_dir);
            let log = fs::OpenOptions::new().create(true).append(true).open(&m.log_path)?;
            let client_url = format!("http://{}", m.client_addr);
            let peer_url = format!("http://{}", m.peer_addr);
            let mut cmd = Command::new(&self.bin);
            // Settings come from the command line only, not from ETCD_*
            // variables of whoever runs the bench.
            for (k, _) in std::env::vars_os() {
                if k.to_string_lossy().starts_with("ETCD_") {
                    cmd.env_remove(k);
                }
            }
            let child = cmd
                // Its own process group, as our nodes: a Ctrl-C reaches the
                // bench only, which then stops everything it started.
                .process_group(0)
                .args(["--name", &m.name])
                .arg("--data-dir")
                .arg(&m.data_dir)
                .args(["--listen-client-urls", &client_url])
                .args(["--advertise-client-urls", &client_url])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &initial])
                .args(["--initial-cluster-token", "dtx-bench-etcd"])
                .args(["--initial-cluster-state", "new"])
                .args(["--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn"])
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()?;
            m.child = Some(child);
        }
        Ok(())
    }

    /// Process ids of the running members (for CPU accounting).
    pub fn pids(&self) -> Vec<u32> {
        self.members.iter().filter_map(|m| m.pid()).collect()
    }

    /// Waits until every member answers and all name the same leader;
    /// returns the leader's client address. An error names a member that
    /// exited and its log.
    pub async fn wait_ready(&mut self, timeout: Duration) -> anyhow::Result<String> {
        let until = Instant::now() + timeout;
        let mut last = String::from("no answer yet");
        while Instant::now() < until {
            for m in &mut self.members {
                anyhow::ensure!(
                    m.is_running(),
                    "etcd member {} exited during start-up; see its log {}",
                    m.name,
                    m.log_path.display()
                );
            }
            let mut seen = Vec::new();
            for m in &self.members {
                match status(&m.client_addr, Duration::from_millis(500)).await {
                    Ok((member_id, leader)) => seen.push((m.client_addr.clone(), member_id, leader)),
                    Err(e) => last = format!("{}: {e}", m.name),
                }
            }
            if seen.len() == self.members.len() {
                let leader = seen[0].2;
                if leader != 0 && seen.iter().all(|s| s.2 == leader) {
                    if let Some(s) = seen.iter().find(|s| s.1 == leader) {
                        return Ok(s.0.clone());
                    }
                }
                last = "members do not agree on a leader yet".into();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!(
            "etcd cluster not ready within {timeout:?} ({last}); see the logs under {}",
            self.dir.display()
        )
    }

    /// The member that answers `Maintenance.Status` naming itself leader,
    /// and its term, asked in turn until
    /// [`crate::leader_watch::FIND_LEADER_WITHIN`]; `None` when none did.
    pub async fn leader(&self) -> Option<crate::leader_watch::Leader> {
        let addrs: Vec<String> = self.members.iter().map(|m| m.client_addr.clone()).collect();
        crate::leader_watch::first_leader(&addrs, |addr| async move {
            let (id, leader, term) = status_and_term(&addr, crate::leader_watch::ASK_TIMEOUT).await.ok()?;
            (id != 0 && id == leader).then_some(crate::leader_watch::Leader { id, term, addr })
        })
        .await
    }

    /// SIGTERM to every member, SIGKILL after `grace`, then removes the
    /// data directories.
    pub fn stop_all(&mut self, grace: Duration) {
        self.stop_members(grace);
        self.remove_data();
    }

    /// SIGTERM to every member, SIGKILL after `grace`; the data stays
    /// until [`EtcdCluster::stop_all`] or the drop. The bench stops etcd
    /// before measuring our transfers but removes its data only after
    /// them: deleting some hundred megabytes of write-ahead log on the
    /// disk our nodes sync to stalled the leader's fsync past the
    /// election timeout once.
    pub fn stop_members(&mut self, grace: Duration) {
        for m in &self.members {
            if let Some(pid) = m.pid() {
                // SAFETY: kill(2) on a child pid we own; no memory is touched.
                unsafe {
                    libc::kill(pid as i32, libc::SIGTERM);
                }
            }
        }
        let until = std::time::Instant::now() + grace;
        for m in &mut self.members {
            if let Some(mut c) = m.child.take() {
                loop {
                    if let Ok(Some(_)) = c.try_wait() {
                        break;
                    }
                    if std::time::Instant::now() >= until {
                        let _ = c.kill();
                        let _ = c.wait();
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    fn remove_data(&self) {
        for m in &self.members {
            let _ = fs::remove_dir_all(&m.data_dir);
        }
    }
}

impl Drop for EtcdCluster {
    /// A run that fails or is interrupted: SIGKILL every member still
    /// running and remove the data.
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut c) = m.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        self.remove_data();
    }
}

/// One attempt at `Maintenance.Status`: (this member's id, the leader's id
/// it believes in).
async fn status(addr: &str, timeout: Duration) -> anyhow::Result<(u64, u64)> {
    status_and_term(addr, timeout).await.map(|(id, leader, _)| (id, leader))
}

/// As [`status`], with the member's Raft term.
async fn status_and_term(addr: &str, timeout: Duration) -> anyhow::Result<(u64, u64, u64)> {
    let ch = dtx_transport::channel::channel(addr, None, timeout).map_err(anyhow::Error::msg)?;
    let mut rq = tonic::Request::new(pb::StatusRequest {});
    rq.set_timeout(timeout);
    let r = tokio::time::timeout(timeout, MaintenanceClient::new(ch).status(rq))
        .await
        .context("no answer")??
        .into_inner();
    Ok((r.header.map(|h| h.member_id).unwrap_or(0), r.leader, r.raft_term))
}

/// What a put-if-absent learned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutIfAbsent {
    /// The key did not exist; this put created it at `revision`.
    Written { revision: i64 },
    /// The key existed; nothing was written.
    Refused,
}

/// A key etcd returned on a read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub create_revision: i64,
    pub mod_revision: i64,
    pub value: Vec<u8>,
}

/// A client of one etcd member's KV service over its own HTTP/2
/// connection, with the channel settings our own client uses
/// ([`dtx_transport::channel::channel`]: TCP_NODELAY, keep-alive).
#[derive(Clone)]
pub struct EtcdKv {
    kv: KvClient<Channel>,
    timeout: Duration,
}

/// The `Txn` of a put-if-absent: if `key`'s create_revision is 0 (it does
/// not exist) put `value`, else nothing.
pub fn put_if_absent_request(key: &[u8], value: &[u8]) -> pb::TxnRequest {
    pb::TxnRequest {
        compare: vec![pb::Compare {
            result: pb::compare::CompareResult::Equal as i32,
            target: pb::compare::CompareTarget::Create as i32,
            key: key.to_vec(),
            target_union: Some(pb::compare::TargetUnion::CreateRevision(0)),
        }],
        success: vec![pb::RequestOp {
            request: Some(pb::request_op::Request::RequestPut(pb::PutRequest {
                key: key.to_vec(),
                value: value.to_vec(),
                lease: 0,
            })),
        }],
        failure: vec![],
    }
}

/// The end of the range of every key that starts with `prefix` (etcd's
/// "prefix plus one"): the last byte below 0xff incremented, the rest cut.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // All 0xff (or empty): every key from `prefix` on.
    vec![0]
}

impl EtcdKv {
    /// A client of the member at `addr` (connects lazily); every call may
    /// take up to `timeout`, then its outcome is UNKNOWN.
    pub fn new(addr: &str, timeout: Duration) -> anyhow::Result<EtcdKv> {
        let ch = dtx_transport::channel::channel(addr, None, timeout).map_err(anyhow::Error::msg)?;
        Ok(EtcdKv {
            kv: KvClient::new(ch),
            timeout,
        })
    }

    /// One put-if-absent `Txn`. An error (timeout, lost connection, an
    /// error from etcd) leaves the outcome unknown: it is never retried.
    pub async fn put_if_absent(&self, key: &[u8], value: &[u8]) -> Result<PutIfAbsent, tonic::Status> {
        let mut rq = tonic::Request::new(put_if_absent_request(key, value));
        rq.set_timeout(self.timeout);
        let r = tokio::time::timeout(self.timeout, self.kv.clone().txn(rq))
            .await
            .map_err(|_| tonic::Status::deadline_exceeded(format!("no answer within {:?}", self.timeout)))??
            .into_inner();
        Ok(if r.succeeded {
            PutIfAbsent::Written {
                revision: r.header.map(|h| h.revision).unwrap_or(0),
            }
        } else {
            PutIfAbsent::Refused
        })
    }

    /// Every key under `prefix` (linearizable reads, `page` keys at a
    /// time).
    pub async fn read_prefix(&self, prefix: &[u8], page: i64) -> anyhow::Result<Vec<(Vec<u8>, Seen)>> {
        let end = prefix_end(prefix);
        let mut from = prefix.to_vec();
        let mut out = Vec::new();
        loop {
            let mut rq = tonic::Request::new(pb::RangeRequest {
                key: from.clone(),
                range_end: end.clone(),
                limit: page,
                revision: 0,
                serializable: false,
            });
            rq.set_timeout(self.timeout);
            let r = self
                .kv
                .clone()
                .range(rq)
                .await
                .context("etcd Range failed during the read-back")?
                .into_inner();
            let more = r.more;
            let Some(last) = r.kvs.last().map(|kv| kv.key.clone()) else {
                break;
            };
            out.extend(r.kvs.into_iter().map(|kv| {
                (
                    kv.key,
                    Seen {
                        create_revision: kv.create_revision,
                        mod_revision: kv.mod_revision,
                        value: kv.value,
                    },
                )
            }));
            if !more {
                break;
            }
            // The next page starts right after the last key seen.
            from = last;
            from.push(0);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn put_if_absent_txn_has_etcds_field_numbers_on_the_wire() {
        // Compare { result EQUAL (0, not sent), target CREATE (field 2 = 1),
        // key (field 3), create_revision (field 5) = 0: sent although 0,
        // because it is a oneof member: without it etcd would not compare
        // the creation revision }.
        let cmp = put_if_absent_request(b"k", b"v").compare[0].encode_to_vec();
        assert_eq!(cmp, vec![0x10, 0x01, 0x1a, 0x01, b'k', 0x28, 0x00]);
        // TxnRequest { compare (1), success (2) = RequestOp { request_put
        // (2) = PutRequest { key (1), value (2) } } }.
        let txn = put_if_absent_request(b"k", b"v").encode_to_vec();
        let put = [0x0a, 0x01, b'k', 0x12, 0x01, b'v'];
        let op = [&[0x12, put.len() as u8][..], &put[..]].concat();
        let expected = [
            &[0x0a, cmp.len() as u8][..],
            &cmp[..],
            &[0x12, op.len() as u8][..],
            &op[..],
        ]
        .concat();
        assert_eq!(txn, expected);
        // TxnResponse { header (1) { revision (3) = 7 }, succeeded (2) }.
        let r = pb::TxnResponse::decode(&[0x0a, 0x02, 0x18, 0x07, 0x10, 0x01][..]).expect("decode");
        assert!(r.succeeded);
        assert_eq!(r.header.map(|h| h.revision), Some(7));
    }

    #[test]
    fn prefix_end_is_the_prefix_plus_one() {
        assert_eq!(prefix_end(b"dtxbench/"), b"dtxbench0".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }
}
