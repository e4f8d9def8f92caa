//! One run: start three coordinator nodes and the bank services, run
//! concurrent transfer clients and a decision reader while the nemesis
//! injects faults, heal everything, measure how long in-doubt transactions
//! take to resolve, look for transactions still unacked after that, read
//! every decision from every node and every bank's apply log, balances and
//! in-doubt list, then check the history and write the results.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use std::time::Instant;

use anyhow::Context;
use dtx_client::Client;
use dtx_client::ClientConfig;
use dtx_client::ClientError;
use dtx_client::ParticipantSpec;
use dtx_client::TxOutcome;
use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;
use dtx_proto::v1 as pb;
use dtx_testkit::cluster::wait_listening;
use dtx_testkit::cluster::BankProcess as BankProc;
use dtx_testkit::cluster::NodePlan;
use dtx_testkit::cluster::ProcessCluster;
use dtx_testkit::pki::DevPki;
use dtx_tls::ClientTls;
use dtx_tls::Role;
use rand::rngs::StdRng;
use rand::Rng;
use rand::SeedableRng;

use crate::checker;
use crate::disk;
use crate::disk::SmallFs;
use crate::history::Account;
use crate::history::Applied;
use crate::history::ApplyEntry;
use crate::history::Body;
use crate::history::DecisionSeen;
use crate::history::DiskFullSeen;
use crate::history::FaultPhase;
use crate::history::InDoubtEntry;
use crate::history::Op;
use crate::history::OpType;
use crate::msgproxy;
use crate::nemesis::Fault;
use crate::nemesis::Schedule;
use crate::plot;
use crate::power::PowerMounts;
use crate::procs::check_bindable;
use crate::procs::Net;

/// Where libfaketime lives on Debian (package `faketime`).
pub const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// What the banks keep their accounts in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// The example bank on its sled participant store (one data directory
    /// per bank).
    Sled,
    /// The example bank on PostgreSQL (`bank-serve --postgres`): one
    /// PostgreSQL server started by the run, one database per bank.
    Postgres,
    /// No banks: the order saga over its three step services (inventory,
    /// payment, email), sagas started by the clients and driven by the
    /// leader's orchestrator (see `crate::saga`).
    Saga,
    /// The sled banks joined as branches: each transfer is a Begin, a
    /// `bank.v1.Bank.Change` at each bank with the txid and incarnation
    /// (the bank prepares and registers itself with its vote from its
    /// handler, `bank-serve --app-listen`), then Commit or Abort.
    Branches,
}

/// Where the saga workload's inventory service keeps its stock
/// (`--inventory-store`; the other workloads ignore it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InventoryStore {
    /// A database on a PostgreSQL server the run starts (`saga-step-serve
    /// --postgres`, the SDK's `saga_pg` store): the run takes
    /// `kill-postgres` and `partition-postgres`.
    #[default]
    Postgres,
    /// Its sled data directory (the SDK's `saga` store), as the payment
    /// and e-mail services.
    Sled,
}

impl InventoryStore {
    pub fn name(self) -> &'static str {
        match self {
            InventoryStore::Postgres => "postgres",
            InventoryStore::Sled => "sled",
        }
    }
}

impl Workload {
    pub fn name(self) -> &'static str {
        match self {
            Workload::Sled => "sled",
            Workload::Postgres => "postgres",
            Workload::Saga => "saga",
            Workload::Branches => "branches",
        }
    }

    /// The faults this workload can inject (the saga workload with its
    /// inventory on PostgreSQL, the default), and a note for each one left
    /// out; see [`Workload::faults_with`].
    pub fn faults(self, faults: &[Fault]) -> (Vec<Fault>, Vec<String>) {
        self.faults_with(faults, InventoryStore::default())
    }

    /// The faults this workload can inject, and a note for each one left
    /// out: `kill-postgres` and `partition-postgres` need the PostgreSQL
    /// server (the PostgreSQL workload has one, and the saga workload when
    /// its inventory is on PostgreSQL). `disk-full` fills a node's disk and
    /// the disk of what keeps a participant's data: a bank's store, or in
    /// the PostgreSQL workload the server's.
    pub fn faults_with(self, faults: &[Fault], inventory: InventoryStore) -> (Vec<Fault>, Vec<String>) {
        let saga_pg = inventory == InventoryStore::Postgres;
        let skip = |f: Fault| match (self, f) {
            (Workload::Sled, Fault::KillPostgres) => Some("the sled workload has no PostgreSQL server"),
            (Workload::Branches, Fault::KillPostgres | Fault::PartitionPostgres) => {
                Some("the branch workload has no PostgreSQL server (its banks are on their own stores)")
            }
            (Workload::Saga, Fault::KillPostgres) if !saga_pg => {
                Some("the saga workload's inventory is on sled (--inventory-store sled): no PostgreSQL server")
            }
            (Workload::Sled, Fault::PartitionPostgres) => Some("the sled workload has no PostgreSQL server"),
            (Workload::Saga, Fault::PartitionPostgres) if !saga_pg => {
                Some("the saga workload's inventory is on sled (--inventory-store sled): no PostgreSQL server")
            }
            (Workload::Saga, Fault::PowerCut) => {
                Some("the saga workload does not keep its nodes' and step services' data on lossy filesystems")
            }
            _ => None,
        };
        let kept = faults.iter().copied().filter(|f| skip(*f).is_none()).collect();
        let notes = faults
            .iter()
            .filter_map(|f| skip(*f).map(|why| format!("{} skipped: {why}", f.name())))
            .collect();
        (kept, notes)
    }
}

/// Everything a run needs to know.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub time_s: u64,
    /// What the banks keep their accounts in.
    pub workload: Workload,
    pub faults: Vec<Fault>,
    pub seed: u64,
    pub clients: usize,
    pub coordinator_bin: PathBuf,
    /// The development binary: the example services and their audits.
    pub tools_bin: PathBuf,
    pub out_dir: PathBuf,
    pub base_port: u16,
    /// The first three parts of every address of the run (default
    /// `127.0.0`): nodes on `<prefix>.11-13`, banks on `<prefix>.21..`.
    pub ip_prefix: String,
    pub banks: usize,
    pub accounts: usize,
    pub initial: i64,
    /// How long each fault lasts, and the quiet time between faults.
    pub fault_s: (u64, u64),
    pub quiet_s: (u64, u64),
    /// Invariant 6's bound, in ms after the final heal.
    pub liveness_bound_ms: u64,
    /// How long to wait for in-doubt transactions after the final heal.
    pub settle_s: u64,
    /// TLS and identities on every link (`--tls`): an authority in the
    /// run's folder, a certificate per node, bank, message proxy and
    /// harness client.
    pub tls: bool,
    /// The saga workload: where the inventory keeps its stock.
    pub inventory_store: InventoryStore,
    /// The first N banks written in Python (`--python-banks`), and how to
    /// run them.
    pub python_banks: Option<(usize, dtx_testkit::cluster::PythonBank)>,
    /// The command line, for the reproduce file.
    pub command: String,
}

/// Appends ops to the in-memory history and streams them to disk, so an
/// interrupted run keeps what it has.
#[derive(Clone)]
pub struct Recorder {
    inner: Arc<Mutex<RecorderInner>>,
    start: Instant,
}

struct RecorderInner {
    ops: Vec<Op>,
    file: std::io::BufWriter<std::fs::File>,
}

impl Recorder {
    pub(crate) fn new(path: &Path) -> anyhow::Result<Recorder> {
        let file = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Recorder {
            inner: Arc::new(Mutex::new(RecorderInner {
                ops: Vec::new(),
                file: std::io::BufWriter::new(file),
            })),
            start: Instant::now(),
        })
    }

    pub fn record(&self, process: &str, kind: OpType, txid: Option<u64>, body: Body, error: Option<String>) {
        let time_ns = self.start.elapsed().as_nanos() as u64;
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let op = Op {
            index: g.ops.len() as u64,
            time_ns,
            process: process.to_string(),
            kind,
            txid,
            body,
            error,
        };
        if serde_json::to_writer(&mut g.file, &op).is_ok() {
            let _ = g.file.write_all(b"\n");
        }
        g.ops.push(op);
    }

    pub(crate) fn snapshot(&self) -> Vec<Op> {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let _ = g.file.flush();
        g.ops.clone()
    }

    pub(crate) fn elapsed_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
}

/// The processes of a run.
struct World {
    cluster: ProcessCluster,
    banks: Vec<BankProc>,
    /// Where clients tell the coordinator each bank is: its message proxy.
    proxy_addrs: Vec<String>,
    /// The branch workload: each bank's own API (`--app-listen`), where
    /// the clients call `Change`; empty otherwise.
    app_addrs: Vec<String>,
    /// How transfers are made (`BeginAndCommit`, or branches).
    via: Via,
    chaos: Arc<msgproxy::Chaos>,
    net: Option<Net>,
    node_ips: Vec<String>,
    /// Run-time crash point files (see the dtx-failpoint crate).
    fp_nodes: PathBuf,
    fp_banks: PathBuf,
    rec: Recorder,
    /// The message proxies, one per bank (dropping one stops it).
    proxies: Vec<msgproxy::ProxyHandle>,
    /// The bank gone for good (`participant-gone`), once it is.
    gone: Option<usize>,
    /// The same, for the clients.
    gone_tx: tokio::sync::watch::Sender<Option<usize>>,
    /// Probe transfers made so far (for their unique keys).
    probes: Arc<std::sync::atomic::AtomicU64>,
    /// `disk-full`: the node and bank on small filesystems. Last, so the
    /// processes are stopped (fields drop in order) before the unmount.
    disk: Option<DiskTargets>,
    /// `power-cut`: the lossy filesystems on every node's and sled bank's
    /// data directory (after `disk`, which may hold two of them; unmounted
    /// when dropped, after the processes).
    power: Option<PowerMounts>,
    /// `power-cut`: the folder of each node's refusal file
    /// (`DTX_FAILPOINT_REFUSE`, `refuse-n<id>`), through which a cut holds
    /// the leader's log sync first.
    refuse_dir: Option<PathBuf>,
    /// Power cuts made so far (their kinds rotate: `power_cut_kind`).
    power_cuts: u64,
    /// The PostgreSQL server of the PostgreSQL workload (dropped after the
    /// banks: it is killed then).
    pg: Option<PgServer>,
    /// With `--tls`: the harness's identities. `app` (an application) for
    /// what the workload does: transfers, probes, the decision reader;
    /// `op` (an operator) for what the harness looks at: cluster status,
    /// transaction status, the final reads.
    app_tls: Option<Arc<ClientTls>>,
    op_tls: Option<Arc<ClientTls>>,
}

/// The processes whose data directories are on small filesystems.
struct DiskTargets {
    node: u64,
    holder: DataHolder,
    node_fs: SmallFs,
    holder_fs: SmallFs,
}

/// Beside a node, the process `disk-full` fills the disk of: the one that
/// keeps a participant's data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DataHolder {
    /// A bank's own store (the sled workload).
    Bank(usize),
    /// The PostgreSQL server every bank keeps its accounts in (the
    /// postgres workload).
    Postgres,
}

/// How long a process whose disk was filled has to serve again after space
/// is freed (and after it is restarted, if it had exited): a node restart,
/// catching up with the leader, a bank restart and its recovery pass.
const DISK_RECOVERY_WAIT: Duration = Duration::from_secs(10);

/// PostgreSQL's settings when `disk-full` fills its disk. WAL segments are
/// created sparse and never recycled, so a full disk stops the next WAL
/// write at once (a zero-filled or recycled segment would take 16 MiB of
/// writes first); and the WAL is kept small on its small filesystem.
const PG_SMALL_DISK_SETTINGS: &[(&str, &str)] = &[
    ("wal_init_zero", "off"),
    ("wal_recycle", "off"),
    ("min_wal_size", "'32MB'"),
    ("max_wal_size", "'96MB'"),
];

impl World {
    fn api_addrs(&self) -> Vec<String> {
        self.cluster.api_addrs()
    }

    fn node_env(&self) -> Vec<(String, String)> {
        vec![("DTX_FAILPOINT_FILE".into(), self.fp_nodes.display().to_string())]
    }

    fn bank_env(&self) -> Vec<(String, String)> {
        vec![
            ("DTX_FAILPOINT_FILE".into(), self.fp_banks.display().to_string()),
            ("RUST_LOG".into(), "warn".into()),
        ]
    }

    /// The leader as most running nodes report it.
    async fn leader(&self) -> Option<u64> {
        majority_leader(&self.api_addrs(), self.op_tls.as_ref()).await
    }

    async fn wait_leader(&self, timeout: Duration) -> Option<u64> {
        wait_majority_leader(&self.api_addrs(), self.op_tls.as_ref(), timeout).await
    }

    fn restart_node(&mut self, id: u64, extra: &[(String, String)]) -> anyhow::Result<()> {
        let env = self.node_env();
        let mut extra = extra.to_vec();
        if let Some(f) = self.refuse_file(id) {
            extra.push(("DTX_FAILPOINT_REFUSE".into(), f.display().to_string()));
        }
        restart_node_with(&mut self.cluster, id, env, &extra)
    }

    /// Node `id`'s refusal file, with `power-cut` in the run.
    fn refuse_file(&self, id: u64) -> Option<PathBuf> {
        self.refuse_dir.as_ref().map(|d| d.join(format!("refuse-n{id}")))
    }

    /// Lets every node's log sync go again (`power-cut`'s hold).
    fn release_syncs(&self) {
        for id in 1..=3 {
            if let Some(f) = self.refuse_file(id) {
                let _ = std::fs::remove_file(f);
            }
        }
    }

    /// Heals everything: network whole, every process running, unpaused,
    /// with a true clock and no crash point armed.
    fn heal_all(&mut self) -> anyhow::Result<()> {
        if let Some(n) = &self.net {
            n.heal()?;
        }
        if let Some(pg) = self.pg.as_mut() {
            if !pg.is_running() {
                pg.restart()
                    .map_err(|e| anyhow::anyhow!("restarting PostgreSQL: {e}"))?;
            }
        }
        let _ = std::fs::remove_file(&self.fp_nodes);
        let _ = std::fs::remove_file(&self.fp_banks);
        self.release_syncs();
        for id in 1..=3u64 {
            self.cluster.signal(id, libc::SIGCONT);
            if !self.cluster.node(id).is_running() {
                self.restart_node(id, &[])?;
            }
        }
        let env = self.bank_env();
        for (i, b) in self.banks.iter_mut().enumerate() {
            if self.gone == Some(i) {
                continue; // gone for good
            }
            b.signal(libc::SIGCONT);
            b.start(&env)?;
        }
        Ok(())
    }

    /// The name of a data holder in the history: the bank's id, or
    /// `postgres`.
    fn holder_name(&self, h: DataHolder) -> String {
        match h {
            DataHolder::Bank(i) => self.banks[i].id.clone(),
            DataHolder::Postgres => "postgres".into(),
        }
    }

    fn holder_log(&self, h: DataHolder) -> PathBuf {
        match h {
            DataHolder::Bank(i) => self.banks[i].log_path.clone(),
            DataHolder::Postgres => self.pg.as_ref().map(|p| p.log_path()).unwrap_or_default(),
        }
    }

    fn holder_running(&mut self, h: DataHolder) -> bool {
        match h {
            DataHolder::Bank(i) => self.banks[i].is_running(),
            DataHolder::Postgres => self.pg.as_mut().is_some_and(|p| p.is_running()),
        }
    }

    fn holder_pid(&self, h: DataHolder) -> Option<u32> {
        match h {
            DataHolder::Bank(i) => self.banks[i].pid(),
            DataHolder::Postgres => self.pg.as_ref().and_then(|p| p.pid()),
        }
    }

    /// The bank whose probe transfers go through the holder's data: the
    /// bank itself, or (PostgreSQL) the first bank not gone for good.
    fn holder_probe_bank(&self, h: DataHolder) -> usize {
        match h {
            DataHolder::Bank(i) => i,
            DataHolder::Postgres => (0..self.banks.len()).find(|i| self.gone != Some(*i)).unwrap_or(0),
        }
    }

    /// Starts the holder again, as a supervisor would: the bank, or
    /// PostgreSQL (crash recovery included) and then every bank that
    /// exited meanwhile.
    fn restart_holder(&mut self, h: DataHolder) -> anyhow::Result<()> {
        match h {
            DataHolder::Bank(i) => {
                let env = self.bank_env();
                self.banks[i].start(&env)?;
                Ok(())
            }
            DataHolder::Postgres => {
                if let Some(pg) = self.pg.as_mut() {
                    pg.restart()
                        .map_err(|e| anyhow::anyhow!("restarting PostgreSQL: {e}"))?;
                }
                self.restart_banks()
            }
        }
    }

    /// Starts every bank that is not running, except the one gone for good.
    fn restart_banks(&mut self) -> anyhow::Result<()> {
        let env = self.bank_env();
        for (i, b) in self.banks.iter_mut().enumerate() {
            if self.gone != Some(i) {
                b.start(&env)?;
            }
        }
        Ok(())
    }

    /// The transfer clients' view of bank `i`: (id, proxy address, prefix);
    /// in the branch workload the address is the bank's own API.
    fn bank_entry(&self, i: usize) -> (String, String, String) {
        let addr = match self.via {
            Via::Coordinator => self.proxy_addrs[i].clone(),
            Via::Branches(_) => self.app_addrs[i].clone(),
        };
        (self.banks[i].id.clone(), addr, self.banks[i].prefix.clone())
    }
}

/// What a started fault must undo.
enum Undo {
    RestartNode(u64),
    /// Every node, this one (the old leader) first.
    RestartAllNodes(u64),
    /// After a power cut: every node, this one (the old leader) first and
    /// alone until it listens, then the banks.
    PowerOn(u64),
    RestartBank(usize),
    Cont(u64),
    HealNet,
    Unskew(u64),
    Disarm {
        file: PathBuf,
        point: &'static str,
    },
    ChaosOff,
    RestartPostgres,
    /// Nothing to undo: the participant stays gone.
    Gone,
    FreeDisk(Box<DiskFault>),
}

/// A `disk-full` fault in force: when it filled, where the logs stood, and
/// the tasks watching the filled processes.
struct DiskFault {
    filled_at: Instant,
    node_filled: u64,
    holder_filled: u64,
    node_log_from: u64,
    holder_log_from: u64,
    stop: tokio::sync::watch::Sender<bool>,
    node_watch: tokio::task::JoinHandle<NodeWatch>,
    /// Probe transfers through the holder's data: (committed, not).
    holder_watch: tokio::task::JoinHandle<(u64, u64)>,
}

/// What the node watch saw while the disk was full.
#[derive(Default)]
struct NodeWatch {
    /// Raft log entries the node appended while full.
    appended: u64,
    /// Status polls it did not answer, or answered as shut down.
    refused: u64,
}

/// What `stop_fault` hands back for the work after the stop is recorded.
struct DiskFreed {
    fault: DiskFault,
    freed_at: Instant,
    node_exited: bool,
    holder_exited: bool,
}

async fn start_fault(w: &mut World, s: &mut Schedule, f: Fault) -> anyhow::Result<(String, Undo)> {
    let leader = w.leader().await.unwrap_or(1);
    let followers: Vec<u64> = (1..=3).filter(|i| *i != leader).collect();
    let random_node = s.rng().random_range(1..=3u64);
    let ip = |id: u64| w.node_ips[(id - 1) as usize].clone();
    let bank_ips: Vec<String> = w.banks.iter().map(|b| b.ip.clone()).collect();
    Ok(match f {
        Fault::KillLeader => {
            w.cluster.kill9(leader);
            (format!("n{leader}"), Undo::RestartNode(leader))
        }
        Fault::KillNode => {
            w.cluster.kill9(random_node);
            (format!("n{random_node}"), Undo::RestartNode(random_node))
        }
        Fault::KillAllNodes => {
            for id in 1..=3 {
                w.cluster.kill9(id);
            }
            (format!("n1+n2+n3 (n{leader} led)"), Undo::RestartAllNodes(leader))
        }
        Fault::PowerCut => cut_power(w, s, leader).await?,
        Fault::KillParticipant => {
            let live: Vec<usize> = (0..w.banks.len()).filter(|i| w.gone != Some(*i)).collect();
            let i = live[s.rng().random_range(0..live.len())];
            w.banks[i].kill9();
            (w.banks[i].id.clone(), Undo::RestartBank(i))
        }
        Fault::ParticipantGone => {
            if let Some(g) = w.gone {
                anyhow::bail!("{} is already gone (one participant per run); skipped", w.banks[g].id);
            }
            // Not the bank on the small filesystem: disk-full needs it.
            let disk_bank = w.disk.as_ref().map(|d| d.holder);
            let mut candidates: Vec<usize> = (0..w.banks.len())
                .filter(|i| disk_bank != Some(DataHolder::Bank(*i)))
                .collect();
            // Nor a bank written in Python, while another can go: a run
            // with --python-banks is there to watch it under the faults.
            if candidates.iter().any(|&i| w.banks[i].python.is_none()) {
                candidates.retain(|&i| w.banks[i].python.is_none());
            }
            let i = candidates[s.rng().random_range(0..candidates.len())];
            w.banks[i].kill9();
            w.proxies[i].go_away();
            w.gone = Some(i);
            w.gone_tx.send_replace(Some(i));
            (w.banks[i].id.clone(), Undo::Gone)
        }
        Fault::DiskFull => {
            let fault = fill_disk(w).await?;
            let d = w.disk.as_ref().expect("disk-full has its filesystems");
            (
                format!(
                    "n{}+{}: full (filler {} KiB + {} KiB)",
                    d.node,
                    w.holder_name(d.holder),
                    fault.node_filled >> 10,
                    fault.holder_filled >> 10
                ),
                Undo::FreeDisk(Box::new(fault)),
            )
        }
        Fault::PauseLeader => {
            w.cluster.signal(leader, libc::SIGSTOP);
            (format!("n{leader}"), Undo::Cont(leader))
        }
        Fault::PartitionIsolate => {
            let others: Vec<(String, String)> = (1..=3)
                .filter(|i| *i != random_node)
                .map(|o| (ip(random_node), ip(o)))
                .collect();
            net(w)?.cut(&others)?;
            (format!("n{random_node} | rest"), Undo::HealNet)
        }
        Fault::PartitionMajority => {
            let bi = s.rng().random_range(0..w.banks.len());
            let minority = [ip(random_node), bank_ips[bi].clone()];
            let majority: Vec<String> = (1..=3)
                .filter(|i| *i != random_node)
                .map(ip)
                .chain(
                    bank_ips
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| *i != bi)
                        .map(|(_, b)| b.clone()),
                )
                .collect();
            let pairs: Vec<(String, String)> = minority
                .iter()
                .flat_map(|a| majority.iter().map(move |b| (a.clone(), b.clone())))
                .collect();
            net(w)?.cut(&pairs)?;
            (format!("n{random_node}+{} | rest", w.banks[bi].id), Undo::HealNet)
        }
        Fault::PartitionBridge => {
            let (a, b) = (followers[0], followers[1]);
            net(w)?.cut(&[(ip(a), ip(b))])?;
            (format!("n{a} x n{b}, bridge n{leader}"), Undo::HealNet)
        }
        Fault::PartitionLeaderParticipants => {
            let pairs: Vec<(String, String)> = bank_ips.iter().map(|b| (ip(leader), b.clone())).collect();
            net(w)?.cut(&pairs)?;
            (format!("n{leader} x banks"), Undo::HealNet)
        }
        Fault::PartitionLeaderFollowers => {
            let pairs: Vec<(String, String)> = followers.iter().map(|f| (ip(leader), ip(*f))).collect();
            net(w)?.cut(&pairs)?;
            (format!("n{leader} x followers"), Undo::HealNet)
        }
        Fault::ClockSkew => {
            let skew_s: i64 = if s.rng().random_bool(0.5) { 1 } else { -1 } * s.rng().random_range(5..=120i64);
            w.cluster.kill9(random_node);
            let env = vec![
                ("LD_PRELOAD".to_string(), LIBFAKETIME.to_string()),
                ("FAKETIME".to_string(), format!("{skew_s:+}s")),
                // Timers (Raft elections) keep real time; the wall clock
                // (deadlines, decision times) is skewed.
                ("FAKETIME_DONT_FAKE_MONOTONIC".to_string(), "1".to_string()),
            ];
            w.restart_node(random_node, &env)?;
            (format!("n{random_node} {skew_s:+}s"), Undo::Unskew(random_node))
        }
        Fault::CrashPoint => {
            let (point, in_bank) = match w.via {
                Via::Coordinator => s.next_crash_point(),
                Via::Branches(_) => s.next_branch_crash_point(),
            };
            let file = if in_bank {
                w.fp_banks.clone()
            } else {
                w.fp_nodes.clone()
            };
            std::fs::write(&file, point)?;
            (point.to_string(), Undo::Disarm { file, point })
        }
        Fault::MessageChaos => {
            w.chaos.set(true);
            let target = match w.via {
                Via::Coordinator => "coordinator -> banks",
                // A branch registered the bank's own address: the
                // coordinator's Commit and Abort to it bypass the proxies.
                Via::Branches(_) => "clients' Change calls -> banks",
            };
            (target.to_string(), Undo::ChaosOff)
        }
        Fault::KillPostgres => {
            let pg =
                w.pg.as_mut()
                    .ok_or_else(|| anyhow::anyhow!("kill-postgres needs the PostgreSQL workload"))?;
            let pid = pg.pid().unwrap_or(0);
            pg.kill9();
            (format!("postgres (pid {pid})"), Undo::RestartPostgres)
        }
        Fault::PartitionPostgres => {
            let port =
                w.pg.as_ref()
                    .ok_or_else(|| anyhow::anyhow!("partition-postgres needs the PostgreSQL workload"))?
                    .port();
            net(w)?.cut_port(dtx_pg_server::HOST, port)?;
            (
                format!("postgres ({}:{port}) x banks", dtx_pg_server::HOST),
                Undo::HealNet,
            )
        }
    })
}

fn net(w: &World) -> anyhow::Result<&Net> {
    w.net
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("partition faults need nftables"))
}

/// How long a held power cut holds the leader's log sync before the power
/// goes: the clients' commits keep coming, the leader sends their entries
/// to its followers beside its own held sync (ADR 0028), and they reach the
/// followers' disks and not its own.
const POWER_CUT_HOLD: Duration = Duration::from_millis(500);

/// The `power-cut` fault: (held) every node and every bank with a store
/// of its own killed with SIGKILL at once, then the cut on every lossy
/// mount. The target names who lost how much; a held cut also says how far
/// each node's log reached before the kill and, read from its data
/// directory after the cut (`coordinator inspect`), how far it reaches now.
async fn cut_power(w: &mut World, s: &mut Schedule, leader: u64) -> anyhow::Result<(String, Undo)> {
    anyhow::ensure!(
        w.power.is_some(),
        "power-cut has no lossy filesystems (they are mounted at the start of a run)"
    );
    let (hold, torn) = crate::nemesis::power_cut_kind(w.power_cuts);
    w.power_cuts += 1;
    let torn_seed: u64 = s.rng().random();
    let mut held = String::new();
    if hold {
        if let Some(f) = w.refuse_file(leader) {
            std::fs::write(&f, "raft_log_flush\n")?;
            tokio::time::sleep(POWER_CUT_HOLD).await;
            let logs = node_log_indexes(w).await;
            held = format!(
                "; n{leader}'s log sync held {} ms, last log index before the kill {logs}",
                POWER_CUT_HOLD.as_millis()
            );
        }
    }
    let p = w.power.as_ref().expect("checked above");
    let unsynced = p.unsynced();
    // Everything on the mounts at once: the signal to each process first,
    // then each is reaped.
    let on_mounts: Vec<usize> = (0..w.banks.len()).filter(|i| w.banks[*i].postgres.is_none()).collect();
    for id in 1..=3 {
        w.cluster.signal(id, libc::SIGKILL);
    }
    for i in &on_mounts {
        w.banks[*i].signal(libc::SIGKILL);
    }
    for id in 1..=3 {
        w.cluster.kill9(id);
    }
    for i in &on_mounts {
        w.banks[*i].kill9();
    }
    let cut = p.cut(torn.then_some(torn_seed), &unsynced);
    let lost: u64 = cut.iter().map(|c| c.report.bytes_lost).sum();
    let mut after = String::new();
    if hold {
        let mut ends = Vec::new();
        for id in 1..=3 {
            let dir = w.cluster.node(id).config.data_dir.clone();
            ends.push(match inspect_last_index(&w.cluster.bin, &dir) {
                Ok(i) => format!("n{id} {}", i.map_or("none".to_string(), |i| i.to_string())),
                Err(e) => format!("n{id} unreadable ({e})"),
            });
        }
        after = format!("; log ends after the cut: {}", ends.join(", "));
    }
    let who = p.holders().join("+");
    Ok((
        format!(
            "{who} (n{leader} led){held}; {} cut, {lost} B lost: {}{after}",
            if torn { "torn" } else { "clean" },
            crate::power::describe(&cut)
        ),
        Undo::PowerOn(leader),
    ))
}

/// Each node's last log index as it reports it (`n1 57, n2 60, n3 ?`).
async fn node_log_indexes(w: &World) -> String {
    let mut out = Vec::new();
    for (i, addr) in w.api_addrs().iter().enumerate() {
        let s = dtx_client::cluster_status_with(addr, Duration::from_millis(300), w.op_tls.as_ref()).await;
        out.push(match s {
            Ok(s) => format!("n{} {}", i + 1, s.last_log_index),
            Err(_) => format!("n{} ?", i + 1),
        });
    }
    out.join(", ")
}

/// The last index of the Raft log in a stopped node's data directory, as
/// a node opening it would see it (`coordinator inspect`, which reads a
/// copy).
fn inspect_last_index(bin: &Path, data_dir: &Path) -> anyhow::Result<Option<u64>> {
    let out = std::process::Command::new(bin)
        .args(["inspect", "--data-dir"])
        .arg(data_dir)
        .output()?;
    if !out.status.success() {
        // Its `Error: ...` line (the log lines before it say how it got there).
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        let line = err
            .lines()
            .find(|l| l.starts_with("Error:"))
            .or_else(|| err.lines().rev().find(|l| !l.trim().is_empty()))
            .unwrap_or("no message");
        anyhow::bail!("{}", line.chars().take(300).collect::<String>());
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(v["log_last_index"].as_u64())
}

/// After a power cut: no sync held any more; the old leader `first` is
/// started alone and given until it listens (at most 5 s, then 300 ms
/// more), then the other nodes, then every bank (not one gone for good).
/// Then every one of them must listen within [`POWER_ON_WAIT`]: one that
/// exited instead (a data directory it will not start on) or does not
/// listen is named in the note, `NOT BACK`, with the last line of its log.
fn power_on(w: &mut World, first: u64) -> anyhow::Result<String> {
    w.release_syncs();
    let started = Instant::now();
    let mut note = String::new();
    for (k, id) in crate::nemesis::restart_order(first).enumerate() {
        w.restart_node(id, &[])?;
        if k == 0 {
            let addr: std::net::SocketAddr = w.cluster.node(id).plan.api_listen.parse()?;
            let until = Instant::now() + Duration::from_secs(5);
            let mut up = false;
            while Instant::now() < until && !up {
                up = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok();
                if !up {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            note = if up {
                format!(
                    "n{id} listening after {} ms, then the others",
                    started.elapsed().as_millis()
                )
            } else {
                format!("n{id} not listening after 5 s; the others started anyway")
            };
            std::thread::sleep(Duration::from_millis(300));
        }
    }
    w.restart_banks()?;
    let mut procs: Vec<(String, String, PathBuf)> = (1..=3u64)
        .map(|id| {
            let n = w.cluster.node(id);
            (format!("n{id}"), n.plan.api_listen.clone(), n.log_path.clone())
        })
        .collect();
    for (i, b) in w.banks.iter().enumerate() {
        if w.gone != Some(i) {
            procs.push((b.id.clone(), b.addr.clone(), b.log_path.clone()));
        }
    }
    let until = Instant::now() + POWER_ON_WAIT;
    let mut not_back = Vec::new();
    for (who, addr, log) in procs {
        let Ok(sa) = addr.parse::<std::net::SocketAddr>() else {
            continue;
        };
        let mut up = false;
        loop {
            up = up || std::net::TcpStream::connect_timeout(&sa, Duration::from_millis(200)).is_ok();
            if up || Instant::now() >= until {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if !up {
            let last = disk::last_line(&log).unwrap_or_default();
            eprintln!("jepsen: power-cut: {who} is NOT BACK after the cut: {last}");
            not_back.push(format!("{who} ({last})"));
        }
    }
    if !not_back.is_empty() {
        note.push_str(&format!(
            "; NOT BACK within {} s: {}",
            POWER_ON_WAIT.as_secs(),
            not_back.join("; ")
        ));
    }
    Ok(note)
}

/// How long every process restarted after a power cut has to listen again.
const POWER_ON_WAIT: Duration = Duration::from_secs(10);

/// Undoes one fault; returns a note for the history (crash points: fired or
/// not) and, for `disk-full`, what the recovery check after the recorded
/// stop needs.
fn stop_fault(w: &mut World, undo: Undo) -> anyhow::Result<(String, Option<DiskFreed>)> {
    if let Undo::FreeDisk(fault) = undo {
        return free_disk(w, *fault).map(|(note, freed)| (note, Some(freed)));
    }
    Ok((
        match undo {
            Undo::RestartNode(id) => {
                w.restart_node(id, &[])?;
                String::new()
            }
            Undo::RestartAllNodes(first) => {
                for id in crate::nemesis::restart_order(first) {
                    w.restart_node(id, &[])?;
                }
                String::new()
            }
            Undo::PowerOn(first) => power_on(w, first)?,
            Undo::RestartBank(i) => {
                let env = w.bank_env();
                w.banks[i].start(&env)?;
                String::new()
            }
            Undo::Gone => "gone for good (not restarted)".to_string(),
            Undo::FreeDisk(_) => unreachable!("handled above"),
            Undo::Cont(id) => {
                w.cluster.signal(id, libc::SIGCONT);
                String::new()
            }
            Undo::HealNet => {
                net(w)?.heal()?;
                String::new()
            }
            Undo::Unskew(id) => {
                w.cluster.kill9(id);
                w.restart_node(id, &[])?;
                String::new()
            }
            Undo::ChaosOff => {
                w.chaos.set(false);
                w.chaos.summary()
            }
            Undo::RestartPostgres => {
                // Crash recovery runs here (this blocks the nemesis, not
                // the clients). Banks that exited meanwhile are started
                // again, as a supervisor would.
                let started = Instant::now();
                let pg = w.pg.as_mut().expect("kill-postgres has its server");
                pg.restart()
                    .map_err(|e| anyhow::anyhow!("restarting PostgreSQL: {e}"))?;
                let up_ms = started.elapsed().as_millis();
                let gone = w.gone;
                let mut exited = Vec::new();
                for (i, b) in w.banks.iter_mut().enumerate() {
                    if gone != Some(i) && !b.is_running() {
                        exited.push(b.id.clone());
                    }
                }
                w.restart_banks()?;
                if exited.is_empty() {
                    format!("restarted, accepting connections after {up_ms} ms")
                } else {
                    format!(
                        "restarted, accepting connections after {up_ms} ms; {} had exited, restarted",
                        exited.join(", ")
                    )
                }
            }
            Undo::Disarm { file, point } => {
                let fired = !file.exists();
                let _ = std::fs::remove_file(&file);
                // Restart whichever process the crash point took down.
                for id in 1..=3u64 {
                    if !w.cluster.node(id).is_running() {
                        w.restart_node(id, &[])?;
                    }
                }
                w.restart_banks()?;
                if fired {
                    format!("{point} fired")
                } else {
                    format!("{point} not reached")
                }
            }
        },
        None,
    ))
}

fn account(w: &World, bank: usize, acct: usize) -> Account {
    Account {
        service: w.banks[bank].id.clone(),
        account: format!("{}{acct}", w.banks[bank].prefix),
    }
}

/// How a transfer is made.
#[derive(Clone)]
enum Via {
    /// One `BeginAndCommit` naming both banks (their message proxies): the
    /// coordinator prepares them (the sled and postgres workloads).
    Coordinator,
    /// Branches (the branch workload): `Begin`, then `bank.v1.Bank.Change`
    /// at each bank's own API with the txid and incarnation, then Commit if
    /// every Change answered OK, else Abort.
    Branches(Arc<BankApis>),
}

/// The branch workload's calls to the banks' own APIs: one channel per
/// bank address (shared by the clients; it reconnects after a bank
/// restart), and `message-chaos`, which the clients apply to their own
/// `Change` calls (the coordinator's messages to a branch go to the
/// address it registered, the bank's own, not through its proxy).
pub(crate) struct BankApis {
    chaos: Arc<msgproxy::Chaos>,
    channels: Mutex<BTreeMap<String, tonic::transport::Channel>>,
}

impl BankApis {
    fn new(chaos: Arc<msgproxy::Chaos>) -> BankApis {
        BankApis {
            chaos,
            channels: Mutex::new(BTreeMap::new()),
        }
    }

    fn channel(&self, addr: &str) -> Result<tonic::transport::Channel, String> {
        let mut map = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(ch) = map.get(addr) {
            return Ok(ch.clone());
        }
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("bank API address {addr}: {e}"))?
            .connect_timeout(Duration::from_secs(1))
            .timeout(BRANCH_CHANGE_TIMEOUT)
            .connect_lazy();
        map.insert(addr.to_string(), ch.clone());
        Ok(ch)
    }
}

/// How long a client waits for a bank's `Change` (its prepare and its
/// registration through the cluster) before it aborts the transfer.
const BRANCH_CHANGE_TIMEOUT: Duration = Duration::from_secs(5);

/// The transaction deadline of a branch transfer (as `BeginAndCommit`'s).
const BRANCH_TX_TIMEOUT_MS: u64 = 10_000;

/// One `Change` call to a bank's own API inside transaction
/// (`incarnation`, `txid`). With `message-chaos` on, the call is delayed
/// (0-250 ms, half the time), also sent twice at once (a quarter) and sent
/// again 1-4 s later (one in six); the copies' answers are dropped.
async fn change_call(
    apis: &Arc<BankApis>,
    addr: &str,
    (incarnation, txid): (u64, u64),
    changes: Vec<(String, i64)>,
    rng: &mut StdRng,
) -> Result<(), tonic::Status> {
    use dtx_bank::branch::pb;
    use std::sync::atomic::Ordering;
    let channel = apis.channel(addr).map_err(tonic::Status::internal)?;
    let request = move || {
        let mut req = tonic::Request::new(pb::ChangeRequest {
            changes: changes
                .iter()
                .map(|(account, delta)| pb::AccountChange {
                    account: account.clone(),
                    delta: *delta,
                })
                .collect(),
        });
        dtx_proto::attach_txid(&mut req, txid);
        dtx_proto::attach_incarnation(&mut req, incarnation);
        req
    };
    let chaos = &apis.chaos;
    if chaos.is_on() {
        if rng.random_bool(0.5) {
            chaos.changes_delayed.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep(Duration::from_millis(rng.random_range(0..=250))).await;
        }
        if rng.random_ratio(1, 4) {
            chaos.changes_duplicated.fetch_add(1, Ordering::Relaxed);
            let (ch, req) = (channel.clone(), request());
            tokio::spawn(async move {
                let _ = pb::bank_client::BankClient::new(ch).change(req).await;
            });
        }
        if rng.random_ratio(1, 6) {
            chaos.changes_late.fetch_add(1, Ordering::Relaxed);
            let (ch, req) = (channel.clone(), request());
            let late = Duration::from_millis(rng.random_range(1_000..=4_000));
            tokio::spawn(async move {
                tokio::time::sleep(late).await;
                let _ = pb::bank_client::BankClient::new(ch).change(req).await;
            });
        }
    }
    pb::bank_client::BankClient::new(channel)
        .change(request())
        .await
        .map(drop)
}

/// One bank's part of a branch transfer: (bank id, its API's address,
/// the account changes asked of it).
type Leg = (String, String, Vec<(String, i64)>);

/// A transfer made of branches: `Begin` under `key`, then `Change` at the
/// debit bank and at the credit bank in parallel (one `Change` of both
/// accounts when they are at one bank), then `Commit` if every `Change`
/// answered OK, else `Abort`. The completion is what the Commit or Abort
/// answered: COMMITTED `ok`, ABORTED `fail`, UNKNOWN or no answer `info`
/// (a Begin refused as invalid: `fail`, nothing began; any other Begin
/// error: `info`). Returns the completion's type.
#[allow(clippy::too_many_arguments)]
async fn branch_transfer(
    rec: &Recorder,
    process: &str,
    client: &Client,
    apis: &Arc<BankApis>,
    key: &str,
    legs: Vec<Leg>,
    body: Body,
) -> OpType {
    rec.record(process, OpType::Invoke, None, body.clone(), None);
    let began = match client.begin(key, BRANCH_TX_TIMEOUT_MS, b"jepsen-branches").await {
        Ok(b) => b,
        Err(e @ ClientError::InvalidArgument(_)) => {
            rec.record(process, OpType::Fail, None, body, Some(e.to_string()));
            return OpType::Fail;
        }
        Err(e) => {
            rec.record(process, OpType::Info, None, body, Some(format!("begin: {e}")));
            return OpType::Info;
        }
    };
    let g = (began.incarnation, began.txid);
    let mut seed_of_key = 0xB4A2_C4E5u64;
    for b in key.bytes() {
        seed_of_key = seed_of_key.wrapping_mul(0x100_0000_01B3).wrapping_add(b as u64);
    }
    let calls = legs.into_iter().enumerate().map(|(i, (bank, addr, changes))| {
        let mut rng = StdRng::seed_from_u64(seed_of_key ^ i as u64);
        async move {
            let r = change_call(apis, &addr, g, changes, &mut rng).await;
            (bank, r)
        }
    });
    let answers = futures::future::join_all(calls).await;
    let refused: Vec<String> = answers
        .iter()
        .filter_map(|(bank, r)| {
            r.as_ref()
                .err()
                .map(|st| format!("{bank}: {:?}: {}", st.code(), st.message()))
        })
        .collect();
    let (res, asked) = if refused.is_empty() {
        (client.commit(began.txid).await, "commit".to_string())
    } else {
        let reason = format!("a Change did not answer OK: {}", refused.join("; "));
        (client.abort(began.txid, &reason).await, format!("abort ({reason})"))
    };
    let (kind, err) = match res {
        Ok(TxOutcome::Committed) => (OpType::Ok, None),
        Ok(TxOutcome::Aborted) => (OpType::Fail, (!refused.is_empty()).then_some(asked)),
        Ok(TxOutcome::Unknown) => (OpType::Info, Some(format!("{asked}: outcome unknown"))),
        // The Commit or Abort may or may not have been recorded.
        Err(e) => (OpType::Info, Some(format!("{asked}: {e}"))),
    };
    rec.record(process, kind, Some(began.txid), body, err);
    kind
}

/// One client: transfers until `stop`, each its own transaction with a
/// unique key. 1 in 5 moves money between two accounts of one bank (a
/// single participant: one-phase commit).
#[allow(clippy::too_many_arguments)]
async fn client_loop(
    id: usize,
    seed: u64,
    rec: Recorder,
    client: Client,
    via: Via,
    banks: Vec<(String, String, String)>,
    accounts: usize,
    gone: tokio::sync::watch::Receiver<Option<usize>>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let process = format!("client-{id}");
    let mut n = 0u64;
    // A one-phase transfer at a gone bank can only stay undecided (only the
    // participant could decide it), and the call waits out its deadline:
    // each client sends one, then moves such picks to two banks.
    let mut one_phase_to_gone = false;
    while !*stop.borrow() {
        n += 1;
        let fb = rng.random_range(0..banks.len());
        let mut same = rng.random_ratio(1, 5);
        let other = (fb + rng.random_range(1..banks.len())) % banks.len();
        if same && *gone.borrow() == Some(fb) {
            same = !one_phase_to_gone;
            one_phase_to_gone = true;
        }
        let tb = if same { fb } else { other };
        let fa = rng.random_range(0..accounts);
        let mut ta = rng.random_range(0..accounts);
        if same && ta == fa {
            ta = (fa + 1) % accounts;
        }
        let amount = rng.random_range(1..=5i64);
        let key = format!("c{id}-{n}");
        let kind = transfer(
            &rec,
            &process,
            &client,
            &via,
            &key,
            (&banks[fb], fa),
            (&banks[tb], ta),
            amount,
        )
        .await;
        if kind != OpType::Ok {
            tokio::time::sleep(Duration::from_millis(rng.random_range(20..100))).await;
        }
    }
}

/// A bank as the clients see it: (id, proxy address, account prefix).
type BankEntry = (String, String, String);

/// One transfer of `amount` from account `from.1` of bank `from.0` to
/// account `to.1` of bank `to.0`, as one transaction with idempotency key
/// `key`: one participant (one-phase commit) when both are at one bank.
/// Recorded as an invoke and its completion; returns the completion's type.
/// In the branch workload (`via`), the same transfer made of branches
/// (`branch_transfer`).
#[allow(clippy::too_many_arguments)]
async fn transfer(
    rec: &Recorder,
    process: &str,
    client: &Client,
    via: &Via,
    key: &str,
    from: (&BankEntry, usize),
    to: (&BankEntry, usize),
    amount: i64,
) -> OpType {
    let ((fb, fa), (tb, ta)) = (from, to);
    let from = Account {
        service: fb.0.clone(),
        account: format!("{}{fa}", fb.2),
    };
    let to = Account {
        service: tb.0.clone(),
        account: format!("{}{ta}", tb.2),
    };
    let body = Body::Transfer {
        from: from.clone(),
        to: to.clone(),
        amount,
    };
    if let Via::Branches(apis) = via {
        let legs = if fb.0 == tb.0 {
            vec![(
                fb.0.clone(),
                fb.1.clone(),
                vec![(from.account.clone(), -amount), (to.account.clone(), amount)],
            )]
        } else {
            vec![
                (fb.0.clone(), fb.1.clone(), vec![(from.account.clone(), -amount)]),
                (tb.0.clone(), tb.1.clone(), vec![(to.account.clone(), amount)]),
            ]
        };
        return branch_transfer(rec, process, client, apis, key, legs, body).await;
    }
    let parts: Vec<ParticipantSpec> = if fb.0 == tb.0 {
        vec![ParticipantSpec {
            participant_id: fb.0.clone(),
            address: fb.1.clone(),
            payload: format!("{}:-{amount};{}:{amount}", from.account, to.account).into_bytes(),
        }]
    } else {
        vec![
            ParticipantSpec {
                participant_id: fb.0.clone(),
                address: fb.1.clone(),
                payload: format!("{}:-{amount}", from.account).into_bytes(),
            },
            ParticipantSpec {
                participant_id: tb.0.clone(),
                address: tb.1.clone(),
                payload: format!("{}:{amount}", to.account).into_bytes(),
            },
        ]
    };
    rec.record(process, OpType::Invoke, None, body.clone(), None);
    let res = client.begin_and_commit(key, 10_000, b"jepsen", &parts).await;
    let (kind, txid, err) = match res {
        Ok(r) => match r.outcome {
            TxOutcome::Committed => (OpType::Ok, r.txid, None),
            TxOutcome::Aborted => (OpType::Fail, r.txid, None),
            TxOutcome::Unknown => (OpType::Info, r.txid, Some("outcome unknown".to_string())),
        },
        // Refused before anything began: certainly no effect.
        Err(e @ ClientError::InvalidArgument(_)) => (OpType::Fail, None, Some(e.to_string())),
        // Anything else may or may not have happened.
        Err(e) => (OpType::Info, None, Some(e.to_string())),
    };
    rec.record(process, kind, txid, body, err);
    kind
}

/// A client like the transfer clients', for the harness's own probes.
fn probe_client(w: &World) -> anyhow::Result<Client> {
    let mut cfg = ClientConfig::new(w.api_addrs());
    cfg.attempt_timeout = Duration::from_secs(3);
    cfg.call_deadline = Duration::from_secs(6);
    cfg.tls = w.app_tls.clone();
    Client::new(cfg).map_err(|e| anyhow::anyhow!("client: {e}"))
}

/// Probe transfers through the bank on the small filesystem (process
/// `disk-probe` in the history; ordinary transfers to every checker):
/// 1 from its account to the same account of another live bank, or to its
/// next account when there is no other.
struct Prober {
    rec: Recorder,
    client: Client,
    via: Via,
    from: BankEntry,
    to: BankEntry,
    accounts: usize,
    count: Arc<std::sync::atomic::AtomicU64>,
}

impl Prober {
    fn new(w: &World, bank: usize) -> anyhow::Result<Prober> {
        let other = (0..w.banks.len())
            .find(|i| *i != bank && w.gone != Some(*i))
            .unwrap_or(bank);
        Ok(Prober {
            rec: w.rec.clone(),
            client: probe_client(w)?,
            via: w.via.clone(),
            from: w.bank_entry(bank),
            to: w.bank_entry(other),
            accounts: w.banks[bank].accounts,
            count: w.probes.clone(),
        })
    }

    /// One probe; true if it was committed.
    async fn once(&self) -> bool {
        let n = self.count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let a = (n as usize) % self.accounts;
        let b = if self.from.0 == self.to.0 {
            (a + 1) % self.accounts
        } else {
            a
        };
        let key = format!("disk-probe-{n}");
        transfer(
            &self.rec,
            "disk-probe",
            &self.client,
            &self.via,
            &key,
            (&self.from, a),
            (&self.to, b),
            1,
        )
        .await
            == OpType::Ok
    }
}

/// Fills both small filesystems and starts watching the filled processes:
/// a task that keeps the filesystems full and polls the node, and probe
/// transfers through the holder's data (the bank, or a bank on PostgreSQL)
/// every half second.
async fn fill_disk(w: &mut World) -> anyhow::Result<DiskFault> {
    let (node, holder) = match &w.disk {
        Some(d) => (d.node, d.holder),
        None => anyhow::bail!("disk-full has no small filesystems (they are mounted at the start of a run)"),
    };
    let node_api = w.cluster.node(node).plan.api_listen.clone();
    let node_log_from = disk::file_len(&w.cluster.node(node).log_path);
    let holder_log_from = disk::file_len(&w.holder_log(holder));
    let prober = Prober::new(w, w.holder_probe_bank(holder))?;
    let d = w.disk.as_mut().expect("checked above");
    let node_filled = d.node_fs.fill()?;
    let holder_filled = match d.holder_fs.fill() {
        Ok(b) => b,
        Err(e) => {
            let _ = d.node_fs.free();
            let _ = d.holder_fs.free();
            return Err(e);
        }
    };
    let filled_at = Instant::now();
    let paths = [d.node_fs.path.clone(), d.holder_fs.path.clone()];
    let (stop, stop_rx) = tokio::sync::watch::channel(false);

    let mut rx = stop_rx.clone();
    let op_tls = w.op_tls.clone();
    let node_watch = tokio::spawn(async move {
        let status = |addr: String| {
            let tls = op_tls.clone();
            async move {
                dtx_client::cluster_status_with(&addr, Duration::from_millis(300), tls.as_ref())
                    .await
                    .ok()
                    .filter(|s| s.role != "Shutdown")
            }
        };
        let first = status(node_api.clone()).await.map(|s| s.last_log_index);
        let mut seen = NodeWatch::default();
        if first.is_none() {
            seen.refused += 1;
        }
        let mut highest = first;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                _ = rx.wait_for(|s| *s) => break,
            }
            for p in &paths {
                let _ = disk::top_up(p);
            }
            match status(node_api.clone()).await {
                Some(s) => highest = highest.max(Some(s.last_log_index)),
                None => seen.refused += 1,
            }
        }
        if let (Some(a), Some(b)) = (first, highest) {
            seen.appended = b.saturating_sub(a);
        }
        seen
    });

    let mut rx = stop_rx;
    let holder_watch = tokio::spawn(async move {
        let (mut ok, mut refused) = (0u64, 0u64);
        while !*rx.borrow() {
            let committed = prober.once().await;
            // Only what completed while the disk was still full counts.
            if *rx.borrow() {
                break;
            }
            if committed {
                ok += 1;
            } else {
                refused += 1;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                _ = rx.wait_for(|s| *s) => break,
            }
        }
        (ok, refused)
    });
    Ok(DiskFault {
        filled_at,
        node_filled,
        holder_filled,
        node_log_from,
        holder_log_from,
        stop,
        node_watch,
        holder_watch,
    })
}

/// Frees the small filesystems (the watch stops first) and notes which
/// filled process had exited.
fn free_disk(w: &mut World, fault: DiskFault) -> anyhow::Result<(String, DiskFreed)> {
    let _ = fault.stop.send(true);
    let d = w.disk.as_ref().expect("a disk fault has its filesystems");
    let (node, holder) = (d.node, d.holder);
    let node_exited = !w.cluster.node(node).is_running();
    let holder_exited = !w.holder_running(holder);
    let d = w.disk.as_mut().expect("checked above");
    d.node_fs.free()?;
    d.holder_fs.free()?;
    let freed_at = Instant::now();
    let state = |exited: bool| if exited { "had exited" } else { "still running" };
    let note = format!(
        "freed after {} ms; n{node} {}, {} {}",
        fault.filled_at.elapsed().as_millis(),
        state(node_exited),
        w.holder_name(holder),
        state(holder_exited)
    );
    Ok((
        note,
        DiskFreed {
            fault,
            freed_at,
            node_exited,
            holder_exited,
        },
    ))
}

/// After space is freed: restarts whichever filled process is not running
/// (as a supervisor would; for PostgreSQL, also the banks that exited
/// meanwhile), waits until each serves again (the node caught up with the
/// others, a probe transfer through the holder's data committed) and
/// records what each did while its disk was full.
async fn disk_recovery(w: &mut World, freed: DiskFreed) {
    let DiskFreed {
        fault,
        freed_at,
        node_exited,
        holder_exited,
    } = freed;
    let full_ms = freed_at.duration_since(fault.filled_at).as_millis() as u64;
    let node_seen = fault.node_watch.await.unwrap_or_default();
    let (holder_ok, holder_refused) = fault.holder_watch.await.unwrap_or_default();
    let Some(d) = w.disk.as_ref() else { return };
    let (node, holder) = (d.node, d.holder);
    let holder_name = w.holder_name(holder);
    let node_log = w.cluster.node(node).log_path.clone();
    let holder_log = w.holder_log(holder);
    let (node_msgs, node_first) = disk::disk_full_lines(&node_log, fault.node_log_from);
    let (holder_msgs, holder_first) = disk::disk_full_lines(&holder_log, fault.holder_log_from);

    // The supervisor: whatever is not running now is started again.
    let mut node_restarted = !w.cluster.node(node).is_running();
    if node_restarted {
        if let Err(e) = w.restart_node(node, &[]) {
            eprintln!("jepsen: could not restart n{node}: {e}");
        }
    }
    let mut holder_restarted = !w.holder_running(holder);
    if holder_restarted {
        if let Err(e) = w.restart_holder(holder) {
            eprintln!("jepsen: could not restart {holder_name}: {e}");
        }
    } else if holder == DataHolder::Postgres {
        // PostgreSQL stayed up; a bank may still have given up on it.
        if let Err(e) = w.restart_banks() {
            eprintln!("jepsen: could not restart a bank: {e}");
        }
    }

    // Back: the node applied as far as the other nodes had when space was
    // freed, under a known leader; the bank committed a probe transfer.
    let others: Vec<String> = w
        .cluster
        .nodes
        .iter()
        .filter(|n| n.plan.id != node)
        .map(|n| n.plan.api_listen.clone())
        .collect();
    let op_tls = w.op_tls.clone();
    let mut target = 0;
    for a in &others {
        if let Ok(s) = dtx_client::cluster_status_with(a, Duration::from_millis(500), op_tls.as_ref()).await {
            target = target.max(s.last_applied_index);
        }
    }
    let node_api = w.cluster.node(node).plan.api_listen.clone();
    let node_serves = || {
        let (api, tls) = (node_api.clone(), op_tls.clone());
        async move {
            matches!(
                dtx_client::cluster_status_with(&api, Duration::from_millis(300), tls.as_ref()).await,
                Ok(s) if s.leader_id != 0 && s.role != "Shutdown" && s.last_applied_index >= target
            )
        }
    };
    // A process on its way out when space was freed counted as running
    // above: a node whose Raft had stopped (it exits within a second), a
    // bank stopping on its full store ("bank service stopping"), a
    // PostgreSQL whose crash recovery was failing. Its pid is watched, and
    // the wait for it ends once it is gone (it is restarted below, as a
    // supervisor would).
    let node_pid = w.cluster.node(node).pid();
    let holder_pid = w.holder_pid(holder);
    let until = freed_at + DISK_RECOVERY_WAIT;
    let prober = Prober::new(w, w.holder_probe_bank(holder));
    let holder_back = async {
        let Ok(p) = &prober else { return None };
        wait_serving(freed_at, until, holder_pid, Duration::from_millis(300), || p.once()).await
    };
    let (mut node_back, mut holder_back) = tokio::join!(
        wait_serving(freed_at, until, node_pid, Duration::from_millis(200), node_serves),
        holder_back
    );
    if node_back.is_none() && !w.cluster.node(node).is_running() {
        // It exited after the check above: restart it and give it the same
        // time to come back, counted from the restart.
        node_restarted = true;
        if let Err(e) = w.restart_node(node, &[]) {
            eprintln!("jepsen: could not restart n{node}: {e}");
        }
        let until = Instant::now() + DISK_RECOVERY_WAIT;
        node_back = wait_serving(freed_at, until, None, Duration::from_millis(200), node_serves).await;
    }
    if holder_back.is_none() && !w.holder_running(holder) {
        // The same for the holder.
        holder_restarted = true;
        if let Err(e) = w.restart_holder(holder) {
            eprintln!("jepsen: could not restart {holder_name}: {e}");
        }
        let until = Instant::now() + DISK_RECOVERY_WAIT;
        if let Ok(p) = Prober::new(w, w.holder_probe_bank(holder)) {
            holder_back = wait_serving(freed_at, until, None, Duration::from_millis(300), || p.once()).await;
        }
    }

    let seen = [
        DiskFullSeen {
            process: format!("n{node}"),
            filled_bytes: fault.node_filled,
            full_ms,
            exited: node_exited,
            disk_messages: node_msgs,
            first_message: node_first,
            writes_while_full: node_seen.appended,
            refused_while_full: node_seen.refused,
            restarted: node_restarted,
            back_after_ms: node_back,
            recovery_wait_ms: DISK_RECOVERY_WAIT.as_millis() as u64,
            last_log_line: disk::last_line(&node_log),
        },
        DiskFullSeen {
            process: holder_name,
            filled_bytes: fault.holder_filled,
            full_ms,
            exited: holder_exited,
            disk_messages: holder_msgs,
            first_message: holder_first,
            writes_while_full: holder_ok,
            refused_while_full: holder_refused,
            restarted: holder_restarted,
            back_after_ms: holder_back,
            recovery_wait_ms: DISK_RECOVERY_WAIT.as_millis() as u64,
            last_log_line: disk::last_line(&holder_log),
        },
    ];
    for s in seen {
        println!(
            "[{:>7.1} s] disk-full: {}: {}, {} disk message(s), {} write(s) and {} refusal(s) while full, {}{}",
            w.rec.elapsed_s(),
            s.process,
            if s.exited { "exited" } else { "stayed up" },
            s.disk_messages,
            s.writes_while_full,
            s.refused_while_full,
            if s.restarted { "restarted, " } else { "" },
            match s.back_after_ms {
                Some(ms) => format!("back after {ms} ms"),
                None => format!("NOT back within {} ms", s.recovery_wait_ms),
            }
        );
        w.rec.record("nemesis", OpType::Ok, None, Body::DiskFull(s), None);
    }
}

/// Asks `serves` every `every` until it says yes (then: ms since `since`),
/// the process `pid` (when given) is gone, or `until` passes (then: None).
async fn wait_serving<F, Fut>(
    since: Instant,
    until: Instant,
    pid: Option<u32>,
    every: Duration,
    serves: F,
) -> Option<u64>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    while Instant::now() < until {
        if pid.is_some_and(|p| !dtx_pg_server::process_running(p)) {
            return None;
        }
        if serves().await {
            return Some(since.elapsed().as_millis() as u64);
        }
        tokio::time::sleep(every).await;
    }
    None
}

/// Reads decisions of recently seen txids from a random node, once a
/// second, so a decision that changes over time would show.
async fn reader_loop(
    rec: Recorder,
    addrs: Vec<String>,
    tls: Option<Arc<ClientTls>>,
    seed: u64,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xDEC1);
    while !*stop.borrow() {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let known: Vec<u64> = {
            let ops = rec.inner.lock().unwrap_or_else(|e| e.into_inner());
            ops.ops.iter().rev().filter_map(|o| o.txid).take(500).collect()
        };
        if known.is_empty() {
            continue;
        }
        let picks: BTreeSet<u64> = (0..20).map(|_| known[rng.random_range(0..known.len())]).collect();
        let node = rng.random_range(0..addrs.len());
        if let Ok(ds) = read_decisions(&addrs[node], &picks.into_iter().collect::<Vec<_>>(), tls.as_ref()).await {
            for (txid, d) in ds {
                rec.record(
                    "reader",
                    OpType::Ok,
                    Some(txid),
                    Body::DecisionRead {
                        node: format!("n{}", node + 1),
                        decision: d,
                    },
                    None,
                );
            }
        }
    }
}

/// Linearizable decision reads through one node (it forwards to the
/// leader), over TLS with `tls` as the caller's identity when it is set.
async fn read_decisions(
    addr: &str,
    txids: &[u64],
    tls: Option<&Arc<ClientTls>>,
) -> anyhow::Result<Vec<(u64, DecisionSeen)>> {
    // Connects on the first call (a failure to connect fails it).
    let ch =
        dtx_transport::channel::channel_with(addr, None, Duration::from_secs(1), tls).map_err(anyhow::Error::msg)?;
    let mut out = Vec::new();
    for chunk in txids.chunks(1000) {
        let mut req = tonic::Request::new(pb::GetDecisionsRequest {
            txids: chunk.to_vec(),
            participant_id: String::new(),
            incarnation: 0,
        });
        req.set_timeout(Duration::from_secs(5));
        let r = pb::coordinator_client::CoordinatorClient::new(ch.clone())
            .get_decisions(req)
            .await?;
        for d in r.into_inner().decisions {
            let seen = match pb::Outcome::try_from(d.outcome) {
                Ok(pb::Outcome::Commit) => DecisionSeen::Commit,
                Ok(pb::Outcome::Abort) => DecisionSeen::Abort,
                Ok(pb::Outcome::Pending) => DecisionSeen::Pending,
                _ => DecisionSeen::Unknown,
            };
            out.push((d.txid, seen));
        }
    }
    Ok(out)
}

/// The node's and the development binary exist and carry crash points
/// (every workload's first check), with how to build them when they do not.
/// A binary without crash points would run a valid-looking run in which no
/// crash point ever fired; its `--version` says which it is
/// (`dtx_failpoint::VERSION_MARK`).
pub fn check_binaries(o: &RunOptions) -> anyhow::Result<()> {
    let wanted = [
        (&o.coordinator_bin, "coordinator", "dtx-cli", "--coordinator-bin"),
        (&o.tools_bin, "development", "dtx-devtools", "--tools-bin"),
    ];
    for (bin, what, package, flag) in wanted {
        let build = format!(
            "build it with `cargo build --release -p {package} --features failpoints` \
             (scripts/jepsen does) or pass {flag}"
        );
        anyhow::ensure!(bin.is_file(), "{what} binary not found at {}; {build}", bin.display());
        let out = std::process::Command::new(bin)
            .arg("--version")
            .output()
            .with_context(|| format!("cannot run the {what} binary {} --version", bin.display()))?;
        let says = String::from_utf8_lossy(&out.stdout);
        anyhow::ensure!(
            out.status.success() && says.contains(dtx_failpoint::VERSION_MARK),
            "the {what} binary at {} has no crash points (its --version says {:?}, without {:?}); {build}",
            bin.display(),
            says.trim(),
            dtx_failpoint::VERSION_MARK
        );
    }
    Ok(())
}

/// Checks done before anything starts: binaries, addresses, tools.
pub fn preflight(o: &RunOptions) -> anyhow::Result<()> {
    check_binaries(o)?;
    anyhow::ensure!(o.banks >= 2, "--banks must be at least 2 (transfers cross banks)");
    anyhow::ensure!(o.accounts >= 2, "--accounts must be at least 2");
    anyhow::ensure!(o.clients >= 1, "--clients must be at least 1");
    anyhow::ensure!(o.time_s >= 1, "--time must be at least 1 second");
    anyhow::ensure!(
        !(o.tls && o.workload == Workload::Branches),
        "--workload branches does not take --tls yet: its clients call the banks' own API in plain text"
    );
    for (ip, port) in addrs(o) {
        check_bindable(&format!("{ip}:{port}"))?;
    }
    if o.faults.iter().any(|f| f.is_partition()) {
        Net::new(&format!("dtx_jepsen_probe_{}", o.base_port))
            .context("partition nemeses need nftables (apt-get install nftables) and root")?;
    }
    if o.faults.contains(&Fault::DiskFull) {
        disk::probe(&std::env::temp_dir(), o.base_port)?;
    }
    if o.workload == Workload::Postgres {
        dtx_pg_server::find_binaries()
            .map_err(|e| anyhow::anyhow!("the postgres workload needs a PostgreSQL server: {e}"))?;
    }
    if o.faults.contains(&Fault::ClockSkew) {
        anyhow::ensure!(
            Path::new(LIBFAKETIME).exists(),
            "clock-skew needs libfaketime at {LIBFAKETIME} (apt-get install faketime)"
        );
    }
    Ok(())
}

/// With `--tls`: a throwaway authority in the run's folder, and the
/// harness's two identities: an application (`jepsen-clients`) for what
/// the workload does, an operator (`jepsen`) for what the harness looks at.
/// Without: none of them.
pub(crate) struct RunTls {
    pub pki: Option<DevPki>,
    pub app_tls: Option<Arc<ClientTls>>,
    pub op_tls: Option<Arc<ClientTls>>,
}

impl RunTls {
    pub(crate) fn new(on: bool, dir: &Path, authority: &str) -> anyhow::Result<RunTls> {
        if !on {
            return Ok(RunTls {
                pki: None,
                app_tls: None,
                op_tls: None,
            });
        }
        let pki = DevPki::create(dir, authority).context("creating the run's certificate authority")?;
        Ok(RunTls {
            app_tls: Some(pki.client(&pki.issue(Role::Application, "jepsen-clients", &[])?)?),
            op_tls: Some(pki.client(&pki.issue(Role::Operator, "jepsen", &[])?)?),
            pki: Some(pki),
        })
    }
}

/// The run's three nodes (not started) in `dir`, each config tuned by
/// `tune` and, with `pki`, given its node certificate (valid for its two
/// addresses); the harness looks at them as `op_tls`.
pub(crate) fn node_cluster(
    o: &RunOptions,
    dir: &Path,
    cluster_id: &str,
    plans: Vec<NodePlan>,
    pki: Option<&DevPki>,
    op_tls: Option<Arc<ClientTls>>,
    tune: impl Fn(&mut coordinator::config::Config),
) -> anyhow::Result<ProcessCluster> {
    let node_tls_error: std::cell::RefCell<Option<anyhow::Error>> = std::cell::RefCell::new(None);
    let mut cluster = ProcessCluster::new(&o.coordinator_bin, dir, cluster_id, plans, |c| {
        tune(c);
        if let Some(pki) = pki {
            if let Err(e) = pki.apply_node(c) {
                node_tls_error.borrow_mut().get_or_insert(e);
            }
        }
    })?;
    if let Some(e) = node_tls_error.into_inner() {
        return Err(e.context("issuing the nodes' certificates"));
    }
    cluster.client_tls = op_tls;
    Ok(cluster)
}

/// The leader as most of the nodes at `addrs` that answer report it.
pub(crate) async fn majority_leader(addrs: &[String], tls: Option<&Arc<ClientTls>>) -> Option<u64> {
    let mut votes: BTreeMap<u64, usize> = BTreeMap::new();
    for addr in addrs {
        if let Ok(s) = dtx_client::cluster_status_with(addr, Duration::from_millis(500), tls).await {
            if s.leader_id != 0 {
                *votes.entry(s.leader_id).or_default() += 1;
            }
        }
    }
    votes.into_iter().max_by_key(|(_, n)| *n).map(|(id, _)| id)
}

/// [`majority_leader`], asked every 100 ms for up to `timeout`.
pub(crate) async fn wait_majority_leader(
    addrs: &[String],
    tls: Option<&Arc<ClientTls>>,
    timeout: Duration,
) -> Option<u64> {
    let until = Instant::now() + timeout;
    while Instant::now() < until {
        if let Some(l) = majority_leader(addrs, tls).await {
            return Some(l);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// Starts node `id` with `env` plus `extra` (a fault's, such as a skewed
/// clock); the cluster's environment for later starts stays `env`.
pub(crate) fn restart_node_with(
    cluster: &mut ProcessCluster,
    id: u64,
    env: Vec<(String, String)>,
    extra: &[(String, String)],
) -> anyhow::Result<()> {
    let mut with = env.clone();
    with.extend_from_slice(extra);
    cluster.env = with;
    let r = cluster.start(id);
    cluster.env = env;
    Ok(r?)
}

/// Every address a run listens on: nodes on 127.0.0.11-13 (raft, api),
/// banks on 127.0.0.21.. (another `--ip-prefix` than 127.0.0 moves them).
pub(crate) fn addrs(o: &RunOptions) -> Vec<(String, u16)> {
    let mut v = Vec::new();
    for id in 1..=3u16 {
        v.push((format!("{}.{}", o.ip_prefix, 10 + id), o.base_port + id * 10));
        v.push((format!("{}.{}", o.ip_prefix, 10 + id), o.base_port + id * 10 + 1));
    }
    for i in 0..o.banks as u16 {
        v.push((format!("{}.{}", o.ip_prefix, 21 + i), o.base_port + 100 + i));
    }
    // The message proxies, each on its bank's IP (see msgproxy).
    for i in 0..o.banks as u16 {
        v.push((format!("{}.{}", o.ip_prefix, 21 + i), o.base_port + 200 + i));
    }
    // The branch workload: each bank's own API (`--app-listen`), on its
    // IP, so the partitions that cut the bank cut it too.
    if o.workload == Workload::Branches {
        for i in 0..o.banks as u16 {
            v.push((
                format!("{}.{}", o.ip_prefix, 21 + i),
                o.base_port + BANK_APP_PORT_OFFSET + i,
            ));
        }
    }
    v
}

/// The branch workload's bank APIs listen on base port + this + i (the
/// banks' participant ports are at +100, their proxies at +200, the saga
/// workload's outside world at +300).
pub(crate) const BANK_APP_PORT_OFFSET: u16 = 400;

/// The outcome of a run.
pub struct RunResult {
    pub dir: PathBuf,
    /// The verdict (of the transfer checkers, or of the saga checker).
    pub valid: checker::Validity,
}

/// A run of the transfer workloads (sled, postgres); the saga workload
/// is `saga::run` (main picks).
pub async fn run(o: RunOptions) -> anyhow::Result<RunResult> {
    anyhow::ensure!(
        o.workload != Workload::Saga,
        "the saga workload runs through saga::run, not runner::run"
    );
    preflight(&o)?;
    // Ctrl-C from here on stops the run in order (the schedule ends, every
    // process is stopped, the small filesystems are unmounted) instead of
    // killing this program halfway.
    let (interrupt_tx, interrupt) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("jepsen: interrupted; stopping in order");
            let _ = interrupt_tx.send(true);
        }
    });
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let dir = o.out_dir.join(format!("{stamp}-seed{}", o.seed));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let dir = dir.canonicalize()?;
    std::fs::write(dir.join("repro.sh"), format!("#!/usr/bin/env bash\n{}\n", o.command))?;
    let rec = Recorder::new(&dir.join("history.jsonl"))?;

    // Processes.
    let a = addrs(&o);
    let plans: Vec<NodePlan> = (0..3)
        .map(|i| {
            let raft = format!("{}:{}", a[2 * i].0, a[2 * i].1);
            let api = format!("{}:{}", a[2 * i + 1].0, a[2 * i + 1].1);
            NodePlan {
                id: i as u64 + 1,
                raft_listen: raft.clone(),
                api_listen: api.clone(),
                raft_advertise: raft,
                api_advertise: api,
            }
        })
        .collect();
    let node_ips: Vec<String> = (1..=3).map(|id| format!("{}.{}", o.ip_prefix, 10 + id)).collect();
    // With a participant gone for good, its transactions stay undelivered
    // (and its one-phase ones undecided) for good: a small batch makes any
    // starvation of the other transactions by them show (invariant 11).
    let gone_enabled = o.faults.contains(&Fault::ParticipantGone);
    let RunTls { pki, app_tls, op_tls } = RunTls::new(o.tls, &dir.join("tls"), "dtx jepsen run")?;
    let cluster = node_cluster(
        &o,
        &dir.join("nodes"),
        "dtx-jepsen",
        plans,
        pki.as_ref(),
        op_tls.clone(),
        |c| {
            c.txn.prepare_timeout_ms = 2_000;
            c.txn.delivery_retry_max_ms = 500;
            c.txn.retention_ms = 120_000;
            c.txn.txid_reserve_count = RUN_TXID_RESERVE_COUNT;
            if gone_enabled {
                c.txn.reaper_batch_max = GONE_REAPER_BATCH_MAX;
            }
        },
    )?;
    let net = if o.faults.iter().any(|f| f.is_partition()) {
        // One table per base port: runs on other ports keep their rules.
        Some(Net::new(&format!("dtx_jepsen_{}", o.base_port))?)
    } else {
        None
    };
    let banks_dir = dir.join("banks");
    std::fs::create_dir_all(&banks_dir)?;
    let api = cluster.api_addrs();
    // The PostgreSQL workload: one server for the run, one database per
    // bank (bank_a, ...).
    let disk_full = o.faults.contains(&Fault::DiskFull);
    let power_cut = o.faults.contains(&Fault::PowerCut);
    if disk_full || power_cut {
        // Before anything is mounted for this run.
        disk::unmount_stale(o.base_port);
    }
    let mut pg_fs = None;
    let pg = match o.workload {
        Workload::Sled | Workload::Saga | Workload::Branches => None,
        Workload::Postgres => {
            let mut pg = PgServer::new(PgServerOptions {
                max_prepared_transactions: 128,
                max_connections: 200,
                extra_settings: if disk_full { PG_SMALL_DISK_SETTINGS } else { &[] }
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
                ..PgServerOptions::default()
            })
            .map_err(|e| anyhow::anyhow!("starting PostgreSQL: {e}"))?;
            if disk_full {
                // disk-full fills PostgreSQL's disk (the banks keep nothing
                // of their own): its data directory is on a small
                // filesystem from initdb on.
                let fs = SmallFs::mount(&pg.data_dir(), o.base_port)?;
                println!(
                    "jepsen: disk-full: PostgreSQL's data ({}) on a small filesystem (tmpfs)",
                    fs.path.display()
                );
                pg_fs = Some(fs);
            }
            pg.init_and_start()
                .map_err(|e| anyhow::anyhow!("starting PostgreSQL: {e}"))?;
            for i in 0..o.banks {
                let db = format!("bank_{}", (b'a' + i as u8) as char);
                pg.create_database(&db)
                    .map_err(|e| anyhow::anyhow!("creating database {db}: {e}"))?;
            }
            println!(
                "jepsen: PostgreSQL on 127.0.0.1:{} (pid {}), databases bank_a..; log {}",
                pg.port(),
                pg.pid().unwrap_or(0),
                pg.log_path().display()
            );
            Some(pg)
        }
    };
    if let Some((n, py)) = &o.python_banks {
        anyhow::ensure!(
            *n <= o.banks,
            "--python-banks {n} is more than the {} banks of the run",
            o.banks
        );
        anyhow::ensure!(
            !o.tls && o.workload == Workload::Sled,
            "--python-banks runs with the bank workload on the banks' own stores, in plain text (the Python bank \
             has no TLS, PostgreSQL store or branch API yet)"
        );
        anyhow::ensure!(
            py.script.exists(),
            "--python-bank-script {} does not exist (run from the repository's root)",
            py.script.display()
        );
    }
    let mut banks: Vec<BankProc> = (0..o.banks)
        .map(|i| -> anyhow::Result<BankProc> {
            let (ip, port) = a[6 + i].clone();
            let prefix = ((b'a' + i as u8) as char).to_string();
            if let Some((_, py)) = o.python_banks.as_ref().filter(|(n, _)| i < *n) {
                return Ok(BankProc::python(
                    py,
                    &banks_dir,
                    &format!("bank-{prefix}"),
                    &prefix,
                    &ip,
                    port,
                    api.clone(),
                    o.accounts,
                    o.initial,
                )?);
            }
            Ok(BankProc::build(
                &o.tools_bin,
                &banks_dir,
                &format!("bank-{prefix}"),
                &prefix,
                &ip,
                port,
                api.clone(),
                o.accounts,
                o.initial,
                pg.as_ref().map(|pg| pg.conn_string(&format!("bank_{prefix}"))),
            ))
        })
        .collect::<anyhow::Result<_>>()?;
    // With --tls each bank serves TLS (mutual: only nodes may send it the
    // protocol's calls) and calls the cluster with a participant
    // certificate valid for its IP.
    if let Some(pki) = &pki {
        for b in &mut banks {
            let files = pki.issue(Role::Participant, &b.id, &[&b.addr])?;
            let flags = pki.args(&files).to_flags();
            b.add_args(flags);
        }
    }
    // The branch workload: every bank also serves its own API, where the
    // clients call Change (its registrations go to the cluster from the
    // bank's own address, as its recovery does).
    let app_addrs: Vec<String> = if o.workload == Workload::Branches {
        let at = 6 + 2 * o.banks;
        banks
            .iter_mut()
            .enumerate()
            .map(|(i, b)| {
                let (ip, port) = a[at + i].clone();
                let app = format!("{ip}:{port}");
                b.add_args(["--app-listen".to_string(), app.clone()]);
                app
            })
            .collect()
    } else {
        Vec::new()
    };
    let chaos = Arc::new(msgproxy::Chaos::default());
    let via = match o.workload {
        Workload::Branches => Via::Branches(Arc::new(BankApis::new(chaos.clone()))),
        _ => Via::Coordinator,
    };
    let mut proxy_addrs = Vec::new();
    let mut proxies = Vec::new();
    for (i, b) in banks.iter().enumerate() {
        let (ip, port) = a[6 + o.banks + i].clone();
        let listen: std::net::SocketAddr = format!("{ip}:{port}").parse()?;
        // With --tls the proxy stands in for the nodes towards the bank and
        // for the bank towards the nodes: a node certificate valid for its
        // IP (see msgproxy).
        let proxy_tls = match &pki {
            None => None,
            Some(pki) => {
                // A node's name is its node id (ADR 0037): ids from
                // PROXY_NODE_ID_BASE, never a member's. Banks admit any
                // node of the run's authority.
                let id = msgproxy::PROXY_NODE_ID_BASE + i as u64;
                let files = pki.issue(Role::Node, &id.to_string(), &[&listen.to_string()])?;
                let args = pki.args(&files);
                Some(msgproxy::ProxyTls {
                    server: args.server()?.expect("a CA is set"),
                    client: args.client()?.expect("a CA is set"),
                })
            }
        };
        proxies.push(msgproxy::spawn(listen, &b.addr, chaos.clone(), o.seed ^ (0xC4A0 + i as u64), proxy_tls).await?);
        proxy_addrs.push(listen.to_string());
    }
    let mut w = World {
        cluster,
        banks,
        proxy_addrs,
        app_addrs,
        via,
        chaos,
        net,
        node_ips,
        fp_nodes: dir.join("failpoint-nodes"),
        fp_banks: dir.join("failpoint-banks"),
        rec: rec.clone(),
        proxies,
        gone: None,
        gone_tx: tokio::sync::watch::channel(None).0,
        probes: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        disk: None,
        power: None,
        refuse_dir: power_cut.then(|| dir.clone()),
        power_cuts: 0,
        pg,
        app_tls,
        op_tls,
    };
    // power-cut: every node's data directory, and every bank's that keeps
    // a store of its own (not on PostgreSQL), is a lossy filesystem of its
    // own, mounted before the process first starts.
    let mut lossy = BTreeMap::new();
    if power_cut {
        let mut p = PowerMounts::new(o.base_port);
        for id in 1..=3u64 {
            let d = w.cluster.node(id).config.data_dir.clone();
            lossy.insert(format!("n{id}"), p.mount(&format!("n{id}"), &d)?);
        }
        for b in w.banks.iter().filter(|b| b.postgres.is_none()) {
            lossy.insert(b.id.clone(), p.mount(&b.id, &b.data_dir)?);
        }
        println!(
            "jepsen: power-cut: the data directories of {} on lossy filesystems (dtx-lossyfs, served by this process)",
            p.holders().join(", ")
        );
        w.power = Some(p);
    }
    if disk_full {
        // One node and one bank (or PostgreSQL, mounted above), fixed for
        // the run by the seed, get a small filesystem of their own before
        // they first start.
        let mut rng = StdRng::seed_from_u64(o.seed ^ 0xD15C);
        let node = rng.random_range(1..=3u64);
        let bank = rng.random_range(0..o.banks);
        // With power-cut they are already lossy mounts: those are filled.
        let node_dir = w.cluster.node(node).config.data_dir.clone();
        let node_fs = match lossy.get(&format!("n{node}")) {
            Some(fs) => SmallFs::on_lossy(fs.clone()),
            None => SmallFs::mount(&node_dir, o.base_port)?,
        };
        let (holder, holder_fs) = match pg_fs.take() {
            Some(fs) => (DataHolder::Postgres, fs),
            None => (
                DataHolder::Bank(bank),
                match lossy.get(&w.banks[bank].id) {
                    Some(fs) => SmallFs::on_lossy(fs.clone()),
                    None => SmallFs::mount(&w.banks[bank].data_dir, o.base_port)?,
                },
            ),
        };
        let kind = |fs: &SmallFs| {
            if fs.is_lossy() {
                "its lossy filesystem"
            } else {
                "a tmpfs"
            }
        };
        println!(
            "jepsen: disk-full: n{node} ({}, {}) and {} ({}, {}) on small filesystems",
            node_dir.display(),
            kind(&node_fs),
            w.holder_name(holder),
            holder_fs.path.display(),
            kind(&holder_fs)
        );
        w.disk = Some(DiskTargets {
            node,
            holder,
            node_fs,
            holder_fs,
        });
    }
    drop(lossy);
    w.cluster.env = w.node_env();
    for id in 1..=3u64 {
        w.restart_node(id, &[])?;
    }
    let env = w.bank_env();
    for b in &mut w.banks {
        b.start(&env)?;
    }
    anyhow::ensure!(
        w.wait_leader(Duration::from_secs(30)).await.is_some(),
        "the cluster elected no leader within 30 s (see {}/nodes/*.log)",
        dir.display()
    );
    for (i, b) in w.banks.iter().enumerate() {
        for addr in std::iter::once(&b.addr).chain(w.app_addrs.get(i)) {
            anyhow::ensure!(
                wait_listening(addr, Duration::from_secs(20)).await,
                "{} is not listening on {} after 20 s (see {})",
                b.id,
                addr,
                b.log_path.display()
            );
        }
    }
    let mut setup = BTreeMap::new();
    for (bi, b) in w.banks.iter().enumerate() {
        let accts: BTreeMap<String, i64> = (0..o.accounts)
            .map(|i| (account(&w, bi, i).account, b.initial))
            .collect();
        setup.insert(b.id.clone(), accts);
    }
    rec.record("setup", OpType::Ok, None, Body::BankSetup { balances: setup }, None);
    println!(
        "jepsen: 3 nodes, {} banks ({}), {} clients, {} s, nemeses [{}], seed {}{}; results in {}",
        o.banks,
        o.workload.name(),
        o.clients,
        o.time_s,
        o.faults.iter().map(|f| f.name()).collect::<Vec<_>>().join(","),
        o.seed,
        if o.tls { ", TLS on every link" } else { "" },
        dir.display()
    );

    // Workload.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let bank_list: Vec<(String, String, String)> = (0..w.banks.len()).map(|i| w.bank_entry(i)).collect();
    let mut tasks = Vec::new();
    for id in 0..o.clients {
        let mut cfg = ClientConfig::new(w.api_addrs());
        cfg.attempt_timeout = Duration::from_secs(3);
        cfg.call_deadline = Duration::from_secs(6);
        cfg.tls = w.app_tls.clone();
        let client = Client::new(cfg).map_err(|e| anyhow::anyhow!("client: {e}"))?;
        tasks.push(tokio::spawn(client_loop(
            id,
            o.seed,
            rec.clone(),
            client,
            w.via.clone(),
            bank_list.clone(),
            o.accounts,
            w.gone_tx.subscribe(),
            stop_rx.clone(),
        )));
    }
    tasks.push(tokio::spawn(reader_loop(
        rec.clone(),
        w.api_addrs(),
        w.app_tls.clone(),
        o.seed,
        stop_rx.clone(),
    )));

    // Nemesis, in this task, until the time is up or Ctrl-C. A fault still
    // active then is healed only after the clients stopped, so the final
    // heal can leave participants in doubt and liveness measures something.
    let (interrupted, mut active) = nemesis_loop(&mut w, &o, interrupt.clone()).await;
    // The last stretch (when that partition is enabled): whatever fault is
    // in force is healed, then the leader is cut off from every participant
    // while the clients still run, so transactions that got their YES votes
    // cannot learn their decision; healing it then gives liveness something
    // to measure (invariant 6).
    if !interrupted && o.faults.contains(&Fault::PartitionLeaderParticipants) {
        if let Some((f, target, undo)) = active.take() {
            end_fault(&mut w, f, target, undo).await;
        }
        let _ = w.wait_leader(Duration::from_secs(10)).await;
        let mut sched = Schedule::new(o.seed, &[]);
        let f = Fault::PartitionLeaderParticipants;
        if let Ok((target, undo)) = begin_fault(&mut w, &mut sched, f, "nemesis (final)").await {
            tokio::time::sleep(Duration::from_secs(o.fault_s.0)).await;
            active = Some((f, target, undo));
        }
    }
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    // With every node down nobody can say who is in doubt (each of the
    // scan's status calls would wait out its deadline): the nodes come
    // back first, the old leader first as the fault's end does.
    if active
        .as_ref()
        .is_some_and(|(f, _, _)| matches!(f, Fault::KillAllNodes | Fault::PowerCut))
    {
        if let Some((f, target, undo)) = active.take() {
            end_fault(&mut w, f, target, undo).await;
        }
        let _ = w.wait_leader(Duration::from_secs(10)).await;
    }
    // With a participant gone for good, the leader is then killed: a new
    // leader must deliver (and re-drive) everything the old one left, past
    // the gone participant's transactions that stay stuck (invariant 11).
    let mut final_kill = None;
    if !interrupted && w.gone.is_some() {
        // Another node down or cut off as well would leave no quorum.
        if active
            .as_ref()
            .is_some_and(|(f, _, _)| *f != Fault::PartitionLeaderParticipants)
        {
            if let Some((f, target, undo)) = active.take() {
                end_fault(&mut w, f, target, undo).await;
            }
        }
        let mut sched = Schedule::new(o.seed, &[]);
        let f = Fault::KillLeader;
        if let Ok((target, undo)) = begin_fault(&mut w, &mut sched, f, "nemesis (final)").await {
            if let Undo::RestartNode(old) = undo {
                let until = Instant::now() + Duration::from_secs(10);
                while Instant::now() < until && w.leader().await.is_none_or(|l| l == old) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            final_kill = Some((f, target, undo));
        }
    }
    // Who is in doubt before the heal: every participant that has not
    // acked its transaction's decision (or that has none yet).
    let max_txid = rec.snapshot().iter().filter_map(|op| op.txid).max().unwrap_or(0) + 50;
    let mut in_doubt = unacked(&w, max_txid).await;
    // A gone participant's own stay in doubt for good: not measured.
    let gone_id = w.gone.map(|g| w.banks[g].id.clone());
    let before = in_doubt.len();
    in_doubt.retain(|(_, p)| Some(p) != gone_id.as_ref());
    println!(
        "jepsen: workload stopped; {} participant(s) in doubt{}; healing everything",
        in_doubt.len(),
        match &gone_id {
            Some(g) => format!(" (and {} of {g}, gone for good)", before - in_doubt.len()),
            None => String::new(),
        }
    );
    if let Some((f, target, undo)) = active {
        end_fault(&mut w, f, target, undo).await;
    }
    if let Some((f, target, undo)) = final_kill {
        end_fault(&mut w, f, target, undo).await;
    }

    // Final heal, then liveness: how long until every in-doubt participant
    // has applied (acked) its decision.
    w.heal_all()?;
    let healed = Instant::now();
    let settle = if interrupted { 10 } else { o.settle_s };
    if w.wait_leader(Duration::from_secs(settle)).await.is_none() {
        eprintln!("jepsen: no leader {settle} s after the final heal");
    }
    measure_liveness(&w, &rec, in_doubt, healed, Duration::from_secs(settle)).await;
    // Anything still unacked the bound after the heal (also older than the
    // in-doubt scan reached) is stuck (invariants 6, 11).
    let until = healed + Duration::from_millis(o.liveness_bound_ms);
    tokio::time::sleep_until(tokio::time::Instant::from_std(until)).await;
    stuck_scan(&w, &rec, max_txid, healed, gone_id.as_deref()).await;

    // Final reads: every decision from every node; then each bank's store.
    // Up to the highest txid any node has handed out or reserved, not only
    // the highest the history saw: one-write commits take txids from
    // ranges (ADR 0012), so a transaction whose caller learned nothing may
    // sit far above every id the history mentions. Unknown answers above
    // the history's ids are not recorded (unused ids of those ranges).
    let mut read_to = max_txid;
    for addr in w.api_addrs() {
        if let Ok(s) = dtx_client::cluster_status_with(&addr, Duration::from_secs(2), w.op_tls.as_ref()).await {
            read_to = read_to.max(s.next_txid.saturating_sub(1));
        }
    }
    let all: Vec<u64> = (1..=read_to).collect();
    for (i, addr) in w.api_addrs().iter().enumerate() {
        match read_decisions(addr, &all, w.op_tls.as_ref()).await {
            Ok(ds) => {
                for (txid, d) in ds {
                    if d == DecisionSeen::Unknown && txid > max_txid - 50 {
                        continue; // never begun: beyond the last id handed out
                    }
                    rec.record(
                        "final",
                        OpType::Ok,
                        Some(txid),
                        Body::DecisionRead {
                            node: format!("n{}", i + 1),
                            decision: d,
                        },
                        None,
                    );
                }
            }
            Err(e) => eprintln!("jepsen: final decision reads from n{} failed: {e}", i + 1),
        }
    }
    for b in &mut w.banks {
        b.stop(Duration::from_secs(5));
    }
    for b in &w.banks {
        let audit = b.audit();
        match &audit {
            Ok(v) => record_audit(&rec, &b.id, v),
            Err(e) => eprintln!("jepsen: {e}"),
        }
        let list = match (&b.postgres, audit) {
            (None, Ok(v)) if b.python.is_some() => Ok(python_in_doubt_list(&v)),
            (None, Err(e)) if b.python.is_some() => Err(e),
            (None, _) => in_doubt_list(b).await,
            (Some(_), Ok(v)) => Ok(pg_in_doubt_list(&b.id, &v, &rec.snapshot())),
            (Some(_), Err(e)) => Err(e),
        };
        match list {
            Ok(entries) => rec.record(
                "final",
                OpType::Ok,
                None,
                Body::InDoubt {
                    service: b.id.clone(),
                    entries,
                },
                None,
            ),
            Err(e) => eprintln!("jepsen: in-doubt list of {}: {e:#}", b.id),
        }
    }
    w.cluster.stop_all(Duration::from_secs(5));
    // Keep PostgreSQL's log with the banks' logs.
    if let Some(pg) = &w.pg {
        if let Err(e) = std::fs::copy(pg.log_path(), banks_dir.join("postgres.log")) {
            eprintln!("jepsen: could not copy PostgreSQL's log: {e}");
        }
    }
    // Keep what the small filesystems held in the results folder (not
    // PostgreSQL's data directory: its log is kept above).
    if let Some(d) = w.disk.as_mut() {
        if d.holder == DataHolder::Postgres {
            if let Some(pg) = w.pg.as_mut() {
                pg.kill9();
            }
            d.holder_fs.unmount();
        }
        for fs in [&mut d.node_fs, &mut d.holder_fs] {
            if !fs.is_mounted() {
                continue;
            }
            if fs.is_lossy() {
                // Saved with the other lossy mounts below.
                fs.unmount();
                continue;
            }
            let saved = fs.path.with_extension("saved");
            let r = fs.save(&saved);
            fs.unmount();
            match r {
                Ok(()) => {
                    let _ = std::fs::remove_dir(&fs.path);
                    let _ = std::fs::rename(&saved, &fs.path);
                }
                Err(e) => eprintln!("jepsen: could not save {}: {e:#}", fs.path.display()),
            }
        }
    }
    // Keep what the lossy filesystems held (every node's data, the banks').
    if let Some(p) = w.power.as_mut() {
        for b in &mut w.banks {
            b.kill9();
        }
        p.save_and_unmount();
    }
    drop(w);

    // Check and write the results.
    let history = rec.snapshot();
    let opts = checker::CheckOptions {
        liveness_bound_ms: o.liveness_bound_ms,
        time_limit: Duration::from_secs(600),
    };
    let report = checker::check(&history, &opts);
    write_results(&dir, &o, &history, &report, interrupted)?;
    Ok(RunResult {
        dir,
        valid: report.valid,
    })
}

/// A fault that is still in force.
type Active = (Fault, String, Undo);

/// Undoes a fault and records its end (a participant gone for good has no
/// end: its fault lasts to the end of the run). After `disk-full`, checks
/// that the filled processes serve again.
async fn end_fault(w: &mut World, f: Fault, target: String, undo: Undo) {
    let (note, freed) = stop_fault(w, undo).unwrap_or_else(|e| (format!("heal failed: {e}"), None));
    if f == Fault::ParticipantGone {
        println!(
            "[{:>7.1} s] nemesis: {} {target} stays gone",
            w.rec.elapsed_s(),
            f.name()
        );
        return;
    }
    let target = if note.is_empty() {
        target
    } else {
        format!("{target}: {note}")
    };
    record_fault(&w.rec, f, target, FaultPhase::Stop);
    println!("[{:>7.1} s] nemesis: healed {} {note}", w.rec.elapsed_s(), f.name());
    if let Some(freed) = freed {
        disk_recovery(w, freed).await;
    }
}

/// Starts a fault and records its start; a fault that cannot be started is
/// reported and not recorded.
async fn begin_fault(w: &mut World, sched: &mut Schedule, f: Fault, label: &str) -> anyhow::Result<(String, Undo)> {
    let (target, undo) = start_fault(w, sched, f).await.inspect_err(|e| {
        eprintln!("jepsen: could not start {}: {e}", f.name());
    })?;
    record_fault(&w.rec, f, target.clone(), FaultPhase::Start);
    println!("[{:>7.1} s] {label}: {} {target}", w.rec.elapsed_s(), f.name());
    Ok((target, undo))
}

/// One nemesis event in the history.
pub(crate) fn record_fault(rec: &Recorder, f: Fault, target: String, phase: FaultPhase) {
    let body = Body::Nemesis {
        fault: f.name().to_string(),
        target,
        phase,
    };
    rec.record("nemesis", OpType::Info, None, body, None);
}

/// Runs the fault schedule until the time is up or Ctrl-C; returns whether
/// it was interrupted and the fault still in force, if any.
async fn nemesis_loop(
    w: &mut World,
    o: &RunOptions,
    mut interrupt: tokio::sync::watch::Receiver<bool>,
) -> (bool, Option<Active>) {
    let mut sched = Schedule::new(o.seed, &o.faults);
    let end = Instant::now() + Duration::from_secs(o.time_s);
    let ctrl_c = async move {
        let _ = interrupt.wait_for(|i| *i).await;
    };
    tokio::pin!(ctrl_c);
    let sleep_until = |t: Instant| tokio::time::sleep_until(tokio::time::Instant::from_std(t.min(end)));
    let mut rng = StdRng::seed_from_u64(o.seed ^ 0x4E3E);
    loop {
        // Quiet time first, so each fault starts from a healthy cluster.
        let quiet = Duration::from_secs(rng.random_range(o.quiet_s.0..=o.quiet_s.1));
        tokio::select! {
            _ = sleep_until(Instant::now() + quiet) => {}
            _ = &mut ctrl_c => return (true, None),
        }
        if Instant::now() >= end {
            return (false, None);
        }
        let Some(f) = sched.next_fault() else {
            tokio::select! {
                _ = sleep_until(end) => return (false, None),
                _ = &mut ctrl_c => return (true, None),
            }
        };
        let Ok((target, undo)) = begin_fault(w, &mut sched, f, "nemesis").await else {
            continue;
        };
        let hold = Duration::from_secs(rng.random_range(o.fault_s.0..=o.fault_s.1));
        let mut interrupted = false;
        tokio::select! {
            _ = sleep_until(Instant::now() + hold) => {}
            _ = &mut ctrl_c => interrupted = true,
        }
        if interrupted || Instant::now() >= end {
            return (interrupted, Some((f, target, undo)));
        }
        end_fault(w, f, target, undo).await;
    }
}

/// `txn.reaper_batch_max` of the nodes when `participant-gone` is enabled.
pub const GONE_REAPER_BATCH_MAX: usize = 2;

/// `txn.txid_reserve_count` of the nodes (4096 by default). A leader
/// reserves txids for the one-write commit path (ADR 0012) at its term's
/// first transfer and then once per range used up: with the default, about
/// once a minute at this workload's rate, so the crash-point nemesis armed
/// `coordinator_after_reserve` for a 3-8 s fault and the point was seldom
/// reached (in none of the 10-minute runs recorded in docs/jepsen.md).
/// With 64 a reservation falls about every second, inside every fault
/// window, and the leader's range hand-over (current, spare, a new term's
/// first range) runs thousands of times per run instead of a few.
pub const RUN_TXID_RESERVE_COUNT: u64 = 64;

/// A bank's in-doubt list, read from its stopped service's store: every
/// transaction it holds prepared without a decision, with the work it
/// prepared (the example bank keeps it under `pending/<txid>`).
async fn in_doubt_list(b: &BankProc) -> anyhow::Result<Vec<InDoubtEntry>> {
    let store = dtx_bank::open_bank(&b.data_dir, &b.prefix, b.accounts, b.initial).await?;
    let held = store.in_doubt().map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut out = Vec::new();
    for (txid, _) in held {
        let work = store
            .view()
            .get(format!("pending/{txid}").as_bytes())
            .ok()
            .flatten()
            .and_then(|p| dtx_bank::parse_work(&p));
        out.push(InDoubtEntry { txid: txid.txid, work });
    }
    Ok(out)
}

/// A Python bank's in-doubt list: the prepared work its audit shows
/// (`prepared_work` of `BankProcess::audit`).
fn python_in_doubt_list(v: &serde_json::Value) -> Vec<InDoubtEntry> {
    v["prepared_work"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| {
            Some(InDoubtEntry {
                txid: p["txid"].as_u64()?,
                work: p["work"].as_str().and_then(|w| dtx_bank::parse_work(w.as_bytes())),
            })
        })
        .collect()
}

/// A PostgreSQL bank's in-doubt list: the transactions its database holds
/// prepared (`prepared` of `bank-audit --json --postgres`, from
/// `pg_prepared_xacts`). A prepared transaction's writes cannot be read
/// from outside it, so the work is the one the transfer of that txid in
/// the history asked of this bank (`None` when no op knows the txid).
fn pg_in_doubt_list(service: &str, v: &serde_json::Value, history: &[Op]) -> Vec<InDoubtEntry> {
    let txids: BTreeSet<u64> = v["prepared"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter(|e| e["participant"].as_str() == Some(service))
                .filter_map(|e| e["txid"].as_u64())
                .collect()
        })
        .unwrap_or_default();
    let mut work: BTreeMap<u64, Vec<(String, i64)>> = BTreeMap::new();
    for op in history {
        let (Some(txid), Body::Transfer { from, to, amount }) = (op.txid, &op.body) else {
            continue;
        };
        if !txids.contains(&txid) || work.contains_key(&txid) {
            continue;
        }
        let mut w = Vec::new();
        if from.service == service {
            w.push((from.account.clone(), -amount));
        }
        if to.service == service {
            w.push((to.account.clone(), *amount));
        }
        work.insert(txid, w);
    }
    txids
        .into_iter()
        .map(|txid| InDoubtEntry {
            txid,
            work: work.remove(&txid),
        })
        .collect()
}

/// After the heal and the bound: every (txid, participant) whose ack the
/// cluster still waits for, among the transactions it still holds (those
/// whose decision reads UNKNOWN were forgotten after every ack). A gone
/// participant's own are counted, not recorded.
async fn stuck_scan(w: &World, rec: &Recorder, max_txid: u64, healed: Instant, gone: Option<&str>) {
    use futures::StreamExt;
    let all: Vec<u64> = (1..=max_txid).collect();
    let mut held = Vec::new();
    let mut read = false;
    for addr in w.api_addrs() {
        if let Ok(ds) = read_decisions(&addr, &all, w.op_tls.as_ref()).await {
            held = ds
                .into_iter()
                .filter(|(_, d)| *d != DecisionSeen::Unknown)
                .map(|(t, _)| t)
                .collect();
            read = true;
            break;
        }
    }
    if !read {
        eprintln!("jepsen: the stuck scan could not read decisions from any node");
        return;
    }
    let mut cfg = ClientConfig::new(w.api_addrs());
    cfg.call_deadline = Duration::from_secs(5);
    cfg.tls = w.op_tls.clone();
    let Ok(client) = Client::new(cfg) else { return };
    let client = &client;
    let statuses: Vec<(u64, Option<pb::StatusResponse>, u64)> = futures::stream::iter(held)
        .map(|t| async move {
            let s = client.status(t).await.ok();
            (t, s, healed.elapsed().as_millis() as u64)
        })
        .buffer_unordered(64)
        .collect()
        .await;
    let (mut stuck, mut gone_own, mut unread) = (0usize, 0usize, 0usize);
    for (t, s, after) in statuses {
        let Some(s) = s else {
            unread += 1;
            continue;
        };
        let decision = match s.decision.as_ref().map(|d| pb::Outcome::try_from(d.outcome)) {
            Some(Ok(pb::Outcome::Commit)) => DecisionSeen::Commit,
            Some(Ok(pb::Outcome::Abort)) => DecisionSeen::Abort,
            _ => DecisionSeen::Pending,
        };
        for p in s.participants.iter().filter(|p| !p.acked) {
            if Some(p.id.as_str()) == gone {
                gone_own += 1;
                continue;
            }
            stuck += 1;
            rec.record(
                "final",
                OpType::Ok,
                Some(t),
                Body::Unacked {
                    service: p.id.clone(),
                    decision,
                    read_after_heal_ms: after,
                    delivery_attempts: p.delivery_attempts,
                },
                None,
            );
        }
    }
    println!(
        "jepsen: {stuck} participant(s) still unacked after the heal and the bound{}{}",
        match gone {
            Some(g) => format!(" (and {gone_own} of {g}, gone for good)"),
            None => String::new(),
        },
        if unread > 0 {
            format!("; {unread} status read(s) failed")
        } else {
            String::new()
        }
    );
}

/// How many of the newest transaction ids the in-doubt scan reads. It must
/// be quick (a snapshot taken while the last fault is in force), and a
/// transaction older than that still unacked would show in the final reads
/// as PENDING or as an acked commit missing at a bank.
const IN_DOUBT_SCAN_TXIDS: u64 = 5_000;

/// Every (txid, participant) among the newest transactions whose ack of
/// the decision the cluster has not recorded (or that has no decision yet).
async fn unacked(w: &World, max_txid: u64) -> BTreeSet<(u64, String)> {
    use futures::StreamExt;
    let mut cfg = ClientConfig::new(w.api_addrs());
    cfg.call_deadline = Duration::from_secs(5);
    cfg.tls = w.op_tls.clone();
    let Ok(client) = Client::new(cfg) else {
        return BTreeSet::new();
    };
    let client = &client;
    let first = max_txid.saturating_sub(IN_DOUBT_SCAN_TXIDS).max(1);
    let statuses: Vec<(u64, Option<pb::StatusResponse>)> = futures::stream::iter(first..=max_txid)
        .map(|t| async move { (t, client.status(t).await.ok()) })
        .buffer_unordered(64)
        .collect()
        .await;
    let mut pending = BTreeSet::new();
    for (t, s) in statuses {
        if let Some(s) = s {
            for p in s.participants.iter().filter(|p| !p.acked) {
                pending.insert((t, p.id.clone()));
            }
        }
    }
    pending
}

/// After the final heal: records, per participant in doubt before it, how
/// long after the heal its ack was recorded (it acks only after applying
/// the decision), or that it was still in doubt when the wait ended.
async fn measure_liveness(
    w: &World,
    rec: &Recorder,
    mut pending: BTreeSet<(u64, String)>,
    healed: Instant,
    wait: Duration,
) {
    let mut cfg = ClientConfig::new(w.api_addrs());
    cfg.call_deadline = Duration::from_secs(5);
    cfg.tls = w.op_tls.clone();
    let Ok(client) = Client::new(cfg) else { return };
    while !pending.is_empty() && healed.elapsed() < wait {
        let mut done = Vec::new();
        for (t, pid) in &pending {
            let acked = match client.status(*t).await {
                Ok(s) => s.participants.iter().any(|p| &p.id == pid && p.acked),
                Err(ClientError::NotFound(_)) => true, // forgotten: every participant acked
                Err(_) => false,
            };
            if acked {
                done.push((*t, pid.clone()));
            }
        }
        for (t, pid) in done {
            pending.remove(&(t, pid.clone()));
            rec.record(
                "final",
                OpType::Ok,
                Some(t),
                Body::Resolution {
                    service: pid,
                    resolved_after_ms: Some(healed.elapsed().as_millis() as u64),
                },
                None,
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (t, pid) in pending {
        rec.record(
            "final",
            OpType::Ok,
            Some(t),
            Body::Resolution {
                service: pid,
                resolved_after_ms: None,
            },
            None,
        );
    }
}

fn record_audit(rec: &Recorder, service: &str, v: &serde_json::Value) {
    let entries: Vec<ApplyEntry> = v["applied"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| {
                    let txid = e["txid"].as_u64()?;
                    let outcome = match e["outcome"].as_str()? {
                        "COMMIT" => Applied::Commit,
                        _ => Applied::Abort,
                    };
                    Some(ApplyEntry { txid, outcome })
                })
                .collect()
        })
        .unwrap_or_default();
    rec.record(
        "final",
        OpType::Ok,
        None,
        Body::ApplyLog {
            service: service.to_string(),
            entries,
        },
        None,
    );
    let balances: BTreeMap<String, i64> = v["balances"]
        .as_object()
        .map(|m| m.iter().filter_map(|(k, v)| Some((k.clone(), v.as_i64()?))).collect())
        .unwrap_or_default();
    rec.record(
        "final",
        OpType::Ok,
        None,
        Body::Balances {
            service: service.to_string(),
            balances,
        },
        None,
    );
}

/// Fault intervals from the nemesis ops (start to the matching stop).
pub fn fault_intervals(history: &[Op], end_s: f64) -> Vec<plot::FaultInterval> {
    let mut open: BTreeMap<String, f64> = BTreeMap::new();
    let mut out = Vec::new();
    for op in history {
        if let Body::Nemesis { fault, phase, .. } = &op.body {
            let t = op.time_ns as f64 / 1e9;
            match phase {
                FaultPhase::Start => {
                    open.insert(fault.clone(), t);
                }
                FaultPhase::Stop => {
                    if let Some(s) = open.remove(fault) {
                        out.push(plot::FaultInterval {
                            name: fault.clone(),
                            start_s: s,
                            end_s: t,
                        });
                    }
                }
            }
        }
    }
    for (name, s) in open {
        out.push(plot::FaultInterval {
            name,
            start_s: s,
            end_s,
        });
    }
    out
}

/// Completed transfers as plot samples (completion time, latency, outcome).
pub fn samples(history: &[Op]) -> Vec<plot::Sample> {
    let mut invoked: BTreeMap<&str, u64> = BTreeMap::new();
    let mut out = Vec::new();
    for op in history {
        if !matches!(op.body, Body::Transfer { .. }) {
            continue;
        }
        match op.kind {
            OpType::Invoke => {
                invoked.insert(&op.process, op.time_ns);
            }
            kind => {
                if let Some(t0) = invoked.remove(op.process.as_str()) {
                    out.push(plot::Sample {
                        done_s: op.time_ns as f64 / 1e9,
                        latency_ms: op.time_ns.saturating_sub(t0) as f64 / 1e6,
                        outcome: match kind {
                            OpType::Ok => plot::Outcome::Ok,
                            OpType::Fail => plot::Outcome::Fail,
                            _ => plot::Outcome::Info,
                        },
                    });
                }
            }
        }
    }
    out
}

fn write_results(
    dir: &Path,
    o: &RunOptions,
    history: &[Op],
    report: &checker::Report,
    interrupted: bool,
) -> anyhow::Result<()> {
    let end_s = history.last().map(|op| op.time_ns as f64 / 1e9).unwrap_or(0.0);
    let samples = samples(history);
    let faults = fault_intervals(history, end_s);
    let title = format!("dtx jepsen seed {} ({} s)", o.seed, o.time_s);
    let input = plot::PlotInput {
        title: &title,
        samples: &samples,
        faults: &faults,
        duration_s: end_s,
    };
    if let Err(e) = plot::latency_svg(&input, &dir.join("latency.svg")) {
        eprintln!("jepsen: latency plot: {e}");
    }
    if let Err(e) = plot::throughput_svg(&input, &dir.join("throughput.svg")) {
        eprintln!("jepsen: throughput plot: {e}");
    }
    let crash_notes: Vec<String> = history
        .iter()
        .filter_map(|op| match &op.body {
            Body::Nemesis {
                fault,
                target,
                phase: FaultPhase::Stop,
            } if fault == "crash-point" => Some(target.clone()),
            _ => None,
        })
        .collect();
    // Each power cut: what it threw away (its start) and how everything
    // came back (its stop).
    let power_cuts: Vec<String> = history
        .iter()
        .filter_map(|op| match &op.body {
            Body::Nemesis { fault, target, phase } if fault == "power-cut" => Some(format!(
                "{}: {target}",
                match phase {
                    FaultPhase::Start => "cut",
                    FaultPhase::Stop => "back",
                }
            )),
            _ => None,
        })
        .collect();
    let not_back = power_cuts.iter().filter(|n| n.contains("NOT BACK")).count();
    let results = serde_json::json!({
        "valid": report.valid,
        "interrupted": interrupted,
        "seed": o.seed,
        "time_s": o.time_s,
        "tls": o.tls,
        "nemeses": o.faults.iter().map(|f| f.name()).collect::<Vec<_>>(),
        "command": o.command,
        "crash_points": crash_notes,
        "power_cuts": power_cuts,
        "power_cuts_not_back": not_back,
        "report": report,
    });
    std::fs::write(dir.join("results.json"), serde_json::to_string_pretty(&results)?)?;
    let mut summary = format!(
        "dtx jepsen run: seed {}, {} s, nemeses [{}]{}{}\nreproduce: {}\n\n",
        o.seed,
        o.time_s,
        o.faults.iter().map(|f| f.name()).collect::<Vec<_>>().join(","),
        if o.tls { ", TLS" } else { "" },
        if interrupted { " (interrupted)" } else { "" },
        o.command
    );
    summary.push_str(&report.summary());
    if !crash_notes.is_empty() {
        summary.push_str("\ncrash points:\n");
        for n in &crash_notes {
            summary.push_str(&format!("  {n}\n"));
        }
    }
    if !power_cuts.is_empty() {
        summary.push_str(&format!(
            "\npower cuts ({}; {not_back} with a process NOT BACK after it):\n",
            power_cuts.len().div_ceil(2)
        ));
        for n in &power_cuts {
            summary.push_str(&format!("  {n}\n"));
        }
    }
    std::fs::write(dir.join("summary.txt"), &summary)?;
    println!("{summary}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nemesis::parse_list;

    fn options(workload: Workload, ip_prefix: &str, base_port: u16) -> RunOptions {
        RunOptions {
            time_s: 60,
            workload,
            faults: Vec::new(),
            seed: 1,
            clients: 6,
            coordinator_bin: PathBuf::from("coordinator"),
            tools_bin: PathBuf::from("dtx-dev"),
            out_dir: PathBuf::from("out"),
            base_port,
            ip_prefix: ip_prefix.to_string(),
            banks: 3,
            accounts: 5,
            initial: 100,
            fault_s: (3, 8),
            quiet_s: (1, 3),
            liveness_bound_ms: 3000,
            settle_s: 30,
            tls: false,
            inventory_store: InventoryStore::Postgres,
            python_banks: None,
            command: String::new(),
        }
    }

    #[test]
    fn the_branch_workload_runs_every_nemesis_of_the_sled_workload() {
        let all = parse_list("all").unwrap();
        let (sled, _) = Workload::Sled.faults(&all);
        let (branches, notes) = Workload::Branches.faults(&all);
        assert_eq!(branches, sled);
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(
            notes[0].starts_with("kill-postgres skipped: the branch workload"),
            "{notes:?}"
        );
        assert!(notes[1].starts_with("partition-postgres skipped"), "{notes:?}");
        assert_eq!(Workload::Branches.name(), "branches");
        use clap::ValueEnum;
        assert_eq!(Workload::from_str("branches", false), Ok(Workload::Branches));
    }

    #[test]
    fn the_branch_workload_puts_each_bank_api_on_its_bank_ip() {
        let sled = addrs(&options(Workload::Sled, "127.0.1", 27000));
        let branches = addrs(&options(Workload::Branches, "127.0.1", 27000));
        // The same addresses as the sled workload, then one API per bank.
        assert_eq!(&branches[..sled.len()], &sled[..]);
        let apps = &branches[sled.len()..];
        assert_eq!(
            apps,
            &[
                ("127.0.1.21".to_string(), 27400),
                ("127.0.1.22".to_string(), 27401),
                ("127.0.1.23".to_string(), 27402)
            ]
        );
        // On the bank's own IP (so partitions of the bank cut it), on no
        // port another process of the run uses.
        let bank_ips: Vec<&String> = sled[6..9].iter().map(|(ip, _)| ip).collect();
        for (i, (ip, _)) in apps.iter().enumerate() {
            assert_eq!(ip, bank_ips[i]);
        }
        let mut all: Vec<&(String, u16)> = branches.iter().collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), branches.len(), "every address once: {branches:?}");
    }

    #[test]
    fn workloads_leave_out_the_faults_they_cannot_inject_and_say_so() {
        let all = parse_list("all").unwrap();
        let (sled, notes) = Workload::Sled.faults(&all);
        assert!(!sled.contains(&Fault::KillPostgres));
        assert!(sled.contains(&Fault::DiskFull));
        assert!(sled.contains(&Fault::PowerCut));
        assert_eq!(
            sled.len(),
            all.len() - 2,
            "the sled schedule is the one before kill-postgres and partition-postgres"
        );
        assert_eq!(notes.len(), 2);
        assert!(notes[0].starts_with("kill-postgres skipped"), "{notes:?}");
        assert!(notes[1].starts_with("partition-postgres skipped"), "{notes:?}");
        let (pg, notes) = Workload::Postgres.faults(&all);
        assert!(pg.contains(&Fault::KillPostgres));
        assert!(pg.contains(&Fault::PartitionPostgres));
        // Every nemesis: disk-full fills PostgreSQL's disk there.
        assert_eq!(pg, all, "the postgres workload runs every nemesis");
        assert!(notes.is_empty(), "{notes:?}");
        // The saga workload runs every nemesis but power-cut (its data is
        // not on lossy filesystems); with its inventory on sled, not the
        // PostgreSQL ones either.
        let (saga, notes) = Workload::Saga.faults(&all);
        assert!(saga.contains(&Fault::KillPostgres));
        assert!(saga.contains(&Fault::PartitionPostgres));
        assert!(!saga.contains(&Fault::PowerCut));
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].starts_with("power-cut skipped"), "{notes:?}");
        assert_eq!(saga.len(), all.len() - 1);
        let (saga_sled, notes) = Workload::Saga.faults_with(&all, InventoryStore::Sled);
        assert!(!saga_sled.contains(&Fault::KillPostgres));
        assert!(!saga_sled.contains(&Fault::PartitionPostgres));
        assert_eq!(notes.len(), 3);
        assert!(notes[0].starts_with("kill-postgres skipped"), "{notes:?}");
        assert!(notes[2].starts_with("power-cut skipped"), "{notes:?}");
        assert_eq!(saga_sled.len(), all.len() - 3);
        // The other workloads do not look at the inventory's store.
        assert_eq!(
            Workload::Sled.faults_with(&all, InventoryStore::Sled).0,
            Workload::Sled.faults(&all).0
        );
        for f in [
            Fault::CrashPoint,
            Fault::KillParticipant,
            Fault::DiskFull,
            Fault::MessageChaos,
            Fault::ParticipantGone,
        ] {
            assert!(saga.contains(&f), "{f:?}");
        }
    }

    #[test]
    fn postgres_in_doubt_list_takes_the_work_from_the_history() {
        let transfer = |txid: u64, from: (&str, &str), to: (&str, &str), amount: i64| Op {
            index: txid,
            time_ns: 0,
            process: "client-0".into(),
            kind: OpType::Ok,
            txid: Some(txid),
            body: Body::Transfer {
                from: Account {
                    service: from.0.into(),
                    account: from.1.into(),
                },
                to: Account {
                    service: to.0.into(),
                    account: to.1.into(),
                },
                amount,
            },
            error: None,
        };
        let history = vec![
            transfer(7, ("bank-a", "a1"), ("bank-b", "b2"), 3),
            transfer(8, ("bank-a", "a1"), ("bank-a", "a2"), 4),
        ];
        let audit = serde_json::json!({
            "prepared": [
                {"participant": "bank-a", "txid": 7, "term": 2},
                {"participant": "bank-a", "txid": 8, "term": 2},
                {"participant": "bank-a", "txid": 9, "term": 3},
                {"participant": "bank-b", "txid": 7, "term": 2},
            ]
        });
        let list = pg_in_doubt_list("bank-a", &audit, &history);
        assert_eq!(
            list,
            vec![
                InDoubtEntry {
                    txid: 7,
                    work: Some(vec![("a1".into(), -3)]),
                },
                InDoubtEntry {
                    txid: 8,
                    work: Some(vec![("a1".into(), -4), ("a2".into(), 4)]),
                },
                InDoubtEntry { txid: 9, work: None },
            ]
        );
    }
}
