//! Shared harness for the integration tests: real node processes (the
//! `coordinator` binary), real sockets, SIGKILL, and a userspace TCP proxy
//! that cuts chosen nodes off from each other.
#![allow(dead_code)]

pub mod admin;
pub mod bank_run;
pub mod branch_bank;
pub mod participants;
pub mod proxy;
pub mod raw_codec;
pub mod sagas;
pub mod shop;
pub mod tls;

use std::path::Path;
use std::time::Duration;

use coordinator::config::Config;
use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_testkit::cluster::free_port;
use dtx_testkit::cluster::NodePlan;
use dtx_testkit::cluster::ProcessCluster;
use tempfile::TempDir;

pub use self::proxy::Proxy;

/// A temporary directory for a test cluster; kept after the test when
/// `DTX_KEEP_TEST_DIRS` is set (for reading node logs after a failure).
pub fn test_dir() -> TempDir {
    let mut dir = TempDir::new().expect("tempdir");
    if std::env::var_os("DTX_KEEP_TEST_DIRS").is_some() {
        dir.disable_cleanup(true);
        eprintln!("test data kept in {}", dir.path().display());
    }
    dir
}

pub fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_dtx-dev"))
}

/// Loopback IP of node `id` in a test cluster: each node has its own source
/// address, so the proxies can tell who is calling.
/// Held by each `dtx-dev demo` run (`run_demo_audited`): tests of every
/// module run in this one process, and demos must not run together.
pub static DEMO_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `dtx-dev demo` with `args` in a fresh directory (RUST_LOG=warn)
/// and checks what every demo run must show: it exits 0, prints
/// "audit: OK", and committed more than 20 transfers. Returns its stdout.
pub fn run_demo(args: &[&str]) -> String {
    let stdout = run_demo_audited(args);
    let committed = summary_count(&stdout, "committed");
    assert!(
        committed > 20,
        "too few transfers committed to mean anything: {committed}"
    );
    stdout
}

/// Runs `dtx-dev demo` with `args` in a fresh directory (RUST_LOG=warn)
/// and checks that it exits 0 and prints "audit: OK" (what any demo,
/// 2PC or saga, must show). Returns its stdout.
pub fn run_demo_audited(args: &[&str]) -> String {
    // One demo at a time (t90, t96, t112): each was in a test file of its
    // own so that two demos, of several processes each, never ran at once;
    // in the one test binary they share this lock instead. A demo that
    // failed (panicked) while holding it does not stop the next one.
    let _one_demo = DEMO_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = test_dir();
    let out = std::process::Command::new(bin())
        .arg("demo")
        .args(args)
        .arg("--dir")
        .arg(dir.path().join("demo"))
        .env("RUST_LOG", "warn")
        .output()
        .expect("run the demo");
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    eprintln!("{stdout}");
    assert!(
        out.status.success(),
        "demo {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("audit: OK"), "{stdout}");
    stdout
}

/// The number on a demo summary's line that starts with `label`
/// (`  committed   123`, `  completed   45 (...)`).
pub fn summary_count(stdout: &str, label: &str) -> u64 {
    stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix(label))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("the summary has no {label:?} count: {stdout}"))
}

pub fn node_ip(id: u64) -> String {
    format!("127.0.0.{}", 10 + id)
}

/// Nodes 1..=n, each on its own loopback IP (`node_ip`) with free ports,
/// no proxies.
pub fn local_plans(n: u64) -> Vec<NodePlan> {
    (1..=n)
        .map(|id| {
            let ip = node_ip(id);
            let raft = format!("{ip}:{}", free_port(&ip).unwrap());
            let api = format!("{ip}:{}", free_port(&ip).unwrap());
            NodePlan {
                id,
                raft_listen: raft.clone(),
                api_listen: api.clone(),
                raft_advertise: raft,
                api_advertise: api,
            }
        })
        .collect()
}

/// The replicated part of a Status answer: without the leader's own
/// delivery attempts, which start over with every leader.
pub fn replicated(mut s: dtx_proto::v1::StatusResponse) -> dtx_proto::v1::StatusResponse {
    for p in &mut s.participants {
        p.delivery_attempts = 0;
        p.last_delivery_error.clear();
        p.next_delivery_unix_ms = 0;
    }
    s
}

/// A finished command's exit code, stdout and stderr, for assertion
/// messages.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

pub struct TestCluster {
    pub dir: TempDir,
    pub procs: ProcessCluster,
    /// Present when the cluster was built with proxies (index = node id - 1):
    /// (raft proxy, api proxy).
    pub proxies: Vec<(Proxy, Proxy)>,
}

impl TestCluster {
    /// Three nodes with default settings on their own loopback IPs.
    pub fn start(name: &str) -> TestCluster {
        Self::start_with(name, 3, |_| {})
    }

    pub fn start_with(name: &str, n: u64, tune: impl Fn(&mut Config)) -> TestCluster {
        let dir = test_dir();
        let plans = local_plans(n);
        let mut procs = ProcessCluster::new(bin(), dir.path(), name, plans, tune).expect("cluster config");
        procs.start_all().expect("start nodes");
        TestCluster {
            dir,
            procs,
            proxies: Vec::new(),
        }
    }

    /// Three nodes whose peers reach each other only through proxies, so a
    /// test can partition them; clients still reach every node directly.
    pub async fn start_partitionable(name: &str, tune: impl Fn(&mut Config)) -> TestCluster {
        let dir = test_dir();
        let mut plans = Vec::new();
        let mut proxies = Vec::new();
        for id in 1..=3u64 {
            let ip = node_ip(id);
            let raft = format!("{ip}:{}", free_port(&ip).unwrap());
            let api = format!("{ip}:{}", free_port(&ip).unwrap());
            let raft_proxy = Proxy::start(&raft).await;
            let api_proxy = Proxy::start(&api).await;
            plans.push(NodePlan {
                id,
                raft_listen: raft,
                api_listen: api,
                raft_advertise: raft_proxy.addr.clone(),
                api_advertise: api_proxy.addr.clone(),
            });
            proxies.push((raft_proxy, api_proxy));
        }
        let mut procs = ProcessCluster::new(bin(), dir.path(), name, plans, tune).expect("cluster config");
        procs.start_all().expect("start nodes");
        TestCluster { dir, procs, proxies }
    }

    /// Cuts node `id` off from every other node, both directions.
    pub fn isolate(&self, id: u64) {
        for other in 1..=self.proxies.len() as u64 {
            if other == id {
                continue;
            }
            let ip_other = node_ip(other).parse().unwrap();
            let ip_id = node_ip(id).parse().unwrap();
            let (r, a) = &self.proxies[(id - 1) as usize];
            r.block(ip_other);
            a.block(ip_other);
            let (r, a) = &self.proxies[(other - 1) as usize];
            r.block(ip_id);
            a.block(ip_id);
        }
    }

    pub fn heal(&self) {
        for (r, a) in &self.proxies {
            r.unblock_all();
            a.unblock_all();
        }
    }

    pub fn api(&self, id: u64) -> String {
        self.procs.nodes[(id - 1) as usize].plan.api_listen.clone()
    }

    pub fn client(&self) -> Client {
        Client::new(ClientConfig::new(self.procs.api_addrs())).unwrap()
    }

    /// A client that talks to one node only (it may still forward).
    pub fn client_at(&self, id: u64) -> Client {
        Client::new(ClientConfig::new(vec![self.api(id)])).unwrap()
    }

    pub async fn leader(&mut self) -> u64 {
        self.procs
            .wait_for_leader(Duration::from_secs(20))
            .await
            .expect("a leader within 20 s")
    }

    /// The term of the current leader, as the leader itself reports it: the
    /// term a Prepare sent by hand must carry to look like the cluster's own.
    /// Participants keep a floor of the highest term seen and refuse a
    /// Prepare of a new txid from below it, so a hand-made Prepare with a
    /// fixed term 1 is refused once the cluster's own messages, from a leader
    /// elected in a later term, have reached the participant.
    pub async fn leader_term(&mut self) -> u64 {
        let leader = self.leader().await;
        self.status_of(leader).await.term
    }

    /// Waits until node `id` has applied at least `index`.
    pub async fn wait_applied(&self, id: u64, index: u64, timeout: Duration) -> bool {
        let until = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < until {
            if let Ok(s) = dtx_client::cluster_status_at(&self.api(id), Duration::from_millis(500)).await {
                if s.last_applied_index >= index {
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    pub async fn status_of(&self, id: u64) -> dtx_proto::v1::ClusterStatusResponse {
        dtx_client::cluster_status_at(&self.api(id), Duration::from_secs(2))
            .await
            .expect("cluster status")
    }

    /// Runs `coordinator inspect` on a stopped node's data directory.
    pub fn inspect(&self, id: u64) -> serde_json::Value {
        let data_dir = &self.procs.nodes[(id - 1) as usize].config.data_dir;
        let out = std::process::Command::new(bin())
            .args(["inspect", "--data-dir"])
            .arg(data_dir)
            .output()
            .expect("run inspect");
        assert!(
            out.status.success(),
            "inspect failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("inspect prints JSON")
    }

    /// Prints every node's log (call on failure paths for diagnosis).
    /// Starts node `id` (not a member yet: empty data directory, no
    /// bootstrap, the cluster's other settings) on its own loopback IP as
    /// a process killed when dropped; its (process, raft_addr, api_addr).
    pub async fn start_extra_node(&self, id: u64) -> (dtx_testkit::cluster::ServiceProcess, String, String) {
        let ip = node_ip(id);
        let raft = format!("{ip}:{}", free_port(&ip).unwrap());
        let api = format!("{ip}:{}", free_port(&ip).unwrap());
        let mut cfg = self.procs.nodes[0].config.clone();
        cfg.node_id = id;
        cfg.data_dir = self.dir.path().join(format!("node{id}"));
        cfg.raft_addr = raft.clone();
        cfg.api_addr = api.clone();
        cfg.bootstrap.enabled = false;
        let cfg_path = self.dir.path().join(format!("node{id}.toml"));
        std::fs::write(&cfg_path, toml::to_string(&cfg).unwrap()).unwrap();
        let mut node = dtx_testkit::cluster::ServiceProcess::new(
            bin(),
            self.dir.path(),
            &format!("node{id}"),
            &api,
            vec!["serve".into(), "--config".into(), cfg_path.into_os_string()],
        );
        node.start(&[]).unwrap();
        node.wait_started().await.unwrap();
        (node, raft, api)
    }

    pub fn dump_logs(&self) {
        for n in &self.procs.nodes {
            if let Ok(s) = std::fs::read_to_string(&n.log_path) {
                let tail: Vec<&str> = s.lines().rev().take(40).collect();
                eprintln!("---- node {} log (last lines) ----", n.plan.id);
                for l in tail.into_iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
    }
}

/// Every file below `dir`, depth first.
pub fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Every file below `dir` with its bytes, sorted by path (directories show
/// through their files' paths): two digests are equal when nothing in the
/// directory changed.
pub fn dir_digest(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = walk(dir)
        .into_iter()
        .map(|p| (p.display().to_string(), std::fs::read(&p).unwrap()))
        .collect();
    v.sort();
    v
}

pub fn tokio_rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}
