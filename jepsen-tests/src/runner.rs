//! One run: start three coordinator nodes and the bank services, run
//! concurrent transfer clients and a decision reader while the nemesis
//! injects faults, heal everything, measure how long in-doubt transactions
//! take to resolve, read every decision from every node and every bank's
//! apply log and balances, then check the history and write the results.

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
use coordinator::client::Client;
use coordinator::client::ClientConfig;
use coordinator::client::ClientError;
use coordinator::client::ParticipantSpec;
use coordinator::client::TxOutcome;
use coordinator::cluster::wait_listening;
use coordinator::cluster::BankProcess as BankProc;
use coordinator::cluster::NodePlan;
use coordinator::cluster::ProcessCluster;
use dtx_proto::v1 as pb;
use rand::rngs::StdRng;
use rand::Rng;
use rand::SeedableRng;

use crate::checker;
use crate::history::Account;
use crate::history::Applied;
use crate::history::ApplyEntry;
use crate::history::Body;
use crate::history::DecisionSeen;
use crate::history::FaultPhase;
use crate::history::Op;
use crate::history::OpType;
use crate::msgproxy;
use crate::nemesis::Fault;
use crate::nemesis::Schedule;
use crate::plot;
use crate::procs::check_bindable;
use crate::procs::Net;

/// Where libfaketime lives on Debian (package `faketime`).
pub const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// Everything a run needs to know.
#[derive(Clone, Debug)]
pub struct RunOptions {
    pub time_s: u64,
    pub faults: Vec<Fault>,
    pub seed: u64,
    pub clients: usize,
    pub coordinator_bin: PathBuf,
    pub out_dir: PathBuf,
    pub base_port: u16,
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
    fn new(path: &Path) -> anyhow::Result<Recorder> {
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

    fn snapshot(&self) -> Vec<Op> {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let _ = g.file.flush();
        g.ops.clone()
    }

    fn elapsed_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }
}

/// The processes of a run.
struct World {
    cluster: ProcessCluster,
    banks: Vec<BankProc>,
    /// Where clients tell the coordinator each bank is: its message proxy.
    proxy_addrs: Vec<String>,
    chaos: Arc<msgproxy::Chaos>,
    net: Option<Net>,
    node_ips: Vec<String>,
    /// Run-time crash point files (see participant_sdk::failpoint).
    fp_nodes: PathBuf,
    fp_banks: PathBuf,
}

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
        let mut votes: BTreeMap<u64, usize> = BTreeMap::new();
        for addr in self.api_addrs() {
            if let Ok(s) = coordinator::client::cluster_status_at(&addr, Duration::from_millis(500)).await {
                if s.leader_id != 0 {
                    *votes.entry(s.leader_id).or_default() += 1;
                }
            }
        }
        votes.into_iter().max_by_key(|(_, n)| *n).map(|(id, _)| id)
    }

    async fn wait_leader(&self, timeout: Duration) -> Option<u64> {
        let until = Instant::now() + timeout;
        while Instant::now() < until {
            if let Some(l) = self.leader().await {
                return Some(l);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    fn restart_node(&mut self, id: u64, extra: &[(String, String)]) -> anyhow::Result<()> {
        let mut env = self.node_env();
        env.extend_from_slice(extra);
        self.cluster.env = env;
        let r = self.cluster.start(id);
        self.cluster.env = self.node_env();
        Ok(r?)
    }

    /// Heals everything: network whole, every process running, unpaused,
    /// with a true clock and no crash point armed.
    fn heal_all(&mut self) -> anyhow::Result<()> {
        if let Some(n) = &self.net {
            n.heal()?;
        }
        let _ = std::fs::remove_file(&self.fp_nodes);
        let _ = std::fs::remove_file(&self.fp_banks);
        for id in 1..=3u64 {
            self.cluster.signal(id, libc::SIGCONT);
            if !self.cluster.node(id).is_running() {
                self.restart_node(id, &[])?;
            }
        }
        let env = self.bank_env();
        for b in &mut self.banks {
            b.signal(libc::SIGCONT);
            b.start(&env)?;
        }
        Ok(())
    }
}

/// What a started fault must undo.
enum Undo {
    RestartNode(u64),
    RestartBank(usize),
    Cont(u64),
    HealNet,
    Unskew(u64),
    Disarm { file: PathBuf, point: &'static str },
    ChaosOff,
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
        Fault::KillParticipant => {
            let i = s.rng().random_range(0..w.banks.len());
            w.banks[i].kill9();
            (w.banks[i].id.clone(), Undo::RestartBank(i))
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
            let (point, in_bank) = s.next_crash_point();
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
            ("coordinator -> banks".to_string(), Undo::ChaosOff)
        }
    })
}

fn net(w: &World) -> anyhow::Result<&Net> {
    w.net
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("partition faults need nftables"))
}

/// Undoes one fault; returns a note for the history (crash points: fired or not).
fn stop_fault(w: &mut World, undo: Undo) -> anyhow::Result<String> {
    Ok(match undo {
        Undo::RestartNode(id) => {
            w.restart_node(id, &[])?;
            String::new()
        }
        Undo::RestartBank(i) => {
            let env = w.bank_env();
            w.banks[i].start(&env)?;
            String::new()
        }
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
        Undo::Disarm { file, point } => {
            let fired = !file.exists();
            let _ = std::fs::remove_file(&file);
            // Restart whichever process the crash point took down.
            for id in 1..=3u64 {
                if !w.cluster.node(id).is_running() {
                    w.restart_node(id, &[])?;
                }
            }
            let env = w.bank_env();
            for b in &mut w.banks {
                b.start(&env)?;
            }
            if fired {
                format!("{point} fired")
            } else {
                format!("{point} not reached")
            }
        }
    })
}

fn account(w: &World, bank: usize, acct: usize) -> Account {
    Account {
        service: w.banks[bank].id.clone(),
        account: format!("{}{acct}", w.banks[bank].prefix),
    }
}

/// One client: transfers until `stop`, each its own transaction with a
/// unique key. 1 in 5 moves money between two accounts of one bank (a
/// single participant: one-phase commit).
async fn client_loop(
    id: usize,
    seed: u64,
    rec: Recorder,
    client: Client,
    banks: Vec<(String, String, String)>,
    accounts: usize,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let process = format!("client-{id}");
    let mut n = 0u64;
    while !*stop.borrow() {
        n += 1;
        let fb = rng.random_range(0..banks.len());
        let same = rng.random_ratio(1, 5);
        let tb = if same {
            fb
        } else {
            (fb + rng.random_range(1..banks.len())) % banks.len()
        };
        let fa = rng.random_range(0..accounts);
        let mut ta = rng.random_range(0..accounts);
        if same && ta == fa {
            ta = (fa + 1) % accounts;
        }
        let amount = rng.random_range(1..=5i64);
        let from = Account {
            service: banks[fb].0.clone(),
            account: format!("{}{fa}", banks[fb].2),
        };
        let to = Account {
            service: banks[tb].0.clone(),
            account: format!("{}{ta}", banks[tb].2),
        };
        let body = Body::Transfer {
            from: from.clone(),
            to: to.clone(),
            amount,
        };
        let parts: Vec<ParticipantSpec> = if same {
            vec![ParticipantSpec {
                participant_id: banks[fb].0.clone(),
                address: banks[fb].1.clone(),
                payload: format!("{}:-{amount};{}:{amount}", from.account, to.account).into_bytes(),
            }]
        } else {
            vec![
                ParticipantSpec {
                    participant_id: banks[fb].0.clone(),
                    address: banks[fb].1.clone(),
                    payload: format!("{}:-{amount}", from.account).into_bytes(),
                },
                ParticipantSpec {
                    participant_id: banks[tb].0.clone(),
                    address: banks[tb].1.clone(),
                    payload: format!("{}:{amount}", to.account).into_bytes(),
                },
            ]
        };
        rec.record(&process, OpType::Invoke, None, body.clone(), None);
        let key = format!("c{id}-{n}");
        let res = client.begin_and_commit(&key, 10_000, b"jepsen", &parts).await;
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
        let failed = kind != OpType::Ok;
        rec.record(&process, kind, txid, body, err);
        if failed {
            tokio::time::sleep(Duration::from_millis(rng.random_range(20..100))).await;
        }
    }
}

/// Reads decisions of recently seen txids from a random node, once a
/// second, so a decision that changes over time would show.
async fn reader_loop(rec: Recorder, addrs: Vec<String>, seed: u64, stop: tokio::sync::watch::Receiver<bool>) {
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
        if let Ok(ds) = read_decisions(&addrs[node], &picks.into_iter().collect::<Vec<_>>()).await {
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

/// Linearizable decision reads through one node (it forwards to the leader).
async fn read_decisions(addr: &str, txids: &[u64]) -> anyhow::Result<Vec<(u64, DecisionSeen)>> {
    let ch = dtx_proto::endpoint(addr)
        .map_err(anyhow::Error::msg)?
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await?;
    let mut out = Vec::new();
    for chunk in txids.chunks(1000) {
        let mut req = tonic::Request::new(pb::GetDecisionsRequest {
            txids: chunk.to_vec(),
            participant_id: String::new(),
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

/// Checks done before anything starts: binary, addresses, tools.
pub fn preflight(o: &RunOptions) -> anyhow::Result<()> {
    anyhow::ensure!(
        o.coordinator_bin.is_file(),
        "coordinator binary not found at {}; build it with `cargo build --release -p coordinator --features failpoints` \
         (scripts/jepsen does) or pass --coordinator-bin",
        o.coordinator_bin.display()
    );
    anyhow::ensure!(o.banks >= 2, "--banks must be at least 2 (transfers cross banks)");
    anyhow::ensure!(o.accounts >= 2, "--accounts must be at least 2");
    anyhow::ensure!(o.clients >= 1, "--clients must be at least 1");
    anyhow::ensure!(o.time_s >= 1, "--time must be at least 1 second");
    for (ip, port) in addrs(o) {
        check_bindable(&format!("{ip}:{port}"))?;
    }
    if o.faults.iter().any(|f| f.is_partition()) {
        Net::new(&format!("dtx_jepsen_probe_{}", o.base_port))
            .context("partition nemeses need nftables (apt-get install nftables) and root")?;
    }
    if o.faults.contains(&Fault::ClockSkew) {
        anyhow::ensure!(
            Path::new(LIBFAKETIME).exists(),
            "clock-skew needs libfaketime at {LIBFAKETIME} (apt-get install faketime)"
        );
    }
    Ok(())
}

/// Every address a run listens on: nodes on 127.0.0.11-13 (raft, api),
/// banks on 127.0.0.21.. .
fn addrs(o: &RunOptions) -> Vec<(String, u16)> {
    let mut v = Vec::new();
    for id in 1..=3u16 {
        v.push((format!("127.0.0.{}", 10 + id), o.base_port + id * 10));
        v.push((format!("127.0.0.{}", 10 + id), o.base_port + id * 10 + 1));
    }
    for i in 0..o.banks as u16 {
        v.push((format!("127.0.0.{}", 21 + i), o.base_port + 100 + i));
    }
    // The message proxies, each on its bank's IP (see msgproxy).
    for i in 0..o.banks as u16 {
        v.push((format!("127.0.0.{}", 21 + i), o.base_port + 200 + i));
    }
    v
}

/// The outcome of a run.
pub struct RunResult {
    pub dir: PathBuf,
    pub report: checker::Report,
}

pub async fn run(o: RunOptions) -> anyhow::Result<RunResult> {
    preflight(&o)?;
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
    let node_ips: Vec<String> = (1..=3).map(|id| format!("127.0.0.{}", 10 + id)).collect();
    let cluster = ProcessCluster::new(&o.coordinator_bin, &dir.join("nodes"), "dtx-jepsen", plans, |c| {
        c.txn.prepare_timeout_ms = 2_000;
        c.txn.delivery_retry_max_ms = 500;
        c.txn.retention_ms = 120_000;
    })?;
    let net = if o.faults.iter().any(|f| f.is_partition()) {
        // One table per base port: runs on other ports keep their rules.
        Some(Net::new(&format!("dtx_jepsen_{}", o.base_port))?)
    } else {
        None
    };
    let banks_dir = dir.join("banks");
    std::fs::create_dir_all(&banks_dir)?;
    let api = cluster.api_addrs();
    let banks: Vec<BankProc> = (0..o.banks)
        .map(|i| {
            let (ip, port) = a[6 + i].clone();
            let prefix = ((b'a' + i as u8) as char).to_string();
            BankProc::new(
                &o.coordinator_bin,
                &banks_dir,
                &format!("bank-{prefix}"),
                &prefix,
                &ip,
                port,
                api.clone(),
                o.accounts,
                o.initial,
            )
        })
        .collect();
    let chaos = Arc::new(msgproxy::Chaos::default());
    let mut proxy_addrs = Vec::new();
    for (i, b) in banks.iter().enumerate() {
        let (ip, port) = a[6 + o.banks + i].clone();
        let listen: std::net::SocketAddr = format!("{ip}:{port}").parse()?;
        msgproxy::spawn(listen, &b.addr, chaos.clone(), o.seed ^ (0xC4A0 + i as u64)).await?;
        proxy_addrs.push(listen.to_string());
    }
    let mut w = World {
        cluster,
        banks,
        proxy_addrs,
        chaos,
        net,
        node_ips,
        fp_nodes: dir.join("failpoint-nodes"),
        fp_banks: dir.join("failpoint-banks"),
    };
    w.cluster.env = w.node_env();
    w.cluster.start_all()?;
    let env = w.bank_env();
    for b in &mut w.banks {
        b.start(&env)?;
    }
    anyhow::ensure!(
        w.wait_leader(Duration::from_secs(30)).await.is_some(),
        "the cluster elected no leader within 30 s (see {}/nodes/*.log)",
        dir.display()
    );
    for b in &w.banks {
        anyhow::ensure!(
            wait_listening(&b.addr, Duration::from_secs(20)).await,
            "{} is not listening on {} after 20 s (see {})",
            b.id,
            b.addr,
            b.log_path.display()
        );
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
        "jepsen: 3 nodes, {} banks, {} clients, {} s, nemeses [{}], seed {}; results in {}",
        o.banks,
        o.clients,
        o.time_s,
        o.faults.iter().map(|f| f.name()).collect::<Vec<_>>().join(","),
        o.seed,
        dir.display()
    );

    // Workload.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let bank_list: Vec<(String, String, String)> = w
        .banks
        .iter()
        .zip(&w.proxy_addrs)
        .map(|(b, proxy)| (b.id.clone(), proxy.clone(), b.prefix.clone()))
        .collect();
    let mut tasks = Vec::new();
    for id in 0..o.clients {
        let mut cfg = ClientConfig::new(w.api_addrs());
        cfg.attempt_timeout = Duration::from_secs(3);
        cfg.call_deadline = Duration::from_secs(6);
        let client = Client::new(cfg).map_err(|e| anyhow::anyhow!("client: {e}"))?;
        tasks.push(tokio::spawn(client_loop(
            id,
            o.seed,
            rec.clone(),
            client,
            bank_list.clone(),
            o.accounts,
            stop_rx.clone(),
        )));
    }
    tasks.push(tokio::spawn(reader_loop(
        rec.clone(),
        w.api_addrs(),
        o.seed,
        stop_rx.clone(),
    )));

    // Nemesis, in this task, until the time is up or Ctrl-C. A fault still
    // active then is healed only after the clients stopped, so the final
    // heal can leave participants in doubt and liveness measures something.
    let (interrupted, mut active) = nemesis_loop(&mut w, &o, &rec).await;
    // The last stretch (when that partition is enabled): whatever fault is
    // in force is healed, then the leader is cut off from every participant
    // while the clients still run, so transactions that got their YES votes
    // cannot learn their decision; healing it then gives liveness something
    // to measure (invariant 6).
    if !interrupted && o.faults.contains(&Fault::PartitionLeaderParticipants) {
        if let Some((f, target, undo)) = active.take() {
            end_fault(&mut w, &rec, f, target, undo);
        }
        let _ = w.wait_leader(Duration::from_secs(10)).await;
        let mut sched = Schedule::new(o.seed, &[]);
        let f = Fault::PartitionLeaderParticipants;
        if let Ok((target, undo)) = begin_fault(&mut w, &mut sched, &rec, f, "nemesis (final)").await {
            tokio::time::sleep(Duration::from_secs(o.fault_s.0)).await;
            active = Some((f, target, undo));
        }
    }
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    // Who is in doubt before the heal: every participant that has not
    // acked its transaction's decision (or that has none yet).
    let max_txid = rec.snapshot().iter().filter_map(|op| op.txid).max().unwrap_or(0) + 50;
    let in_doubt = unacked(&w, max_txid).await;
    println!(
        "jepsen: workload stopped; {} participant(s) in doubt; healing everything",
        in_doubt.len()
    );
    if let Some((f, target, undo)) = active {
        end_fault(&mut w, &rec, f, target, undo);
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

    // Final reads: every decision from every node; then each bank's store.
    let all: Vec<u64> = (1..=max_txid).collect();
    for (i, addr) in w.api_addrs().iter().enumerate() {
        match read_decisions(addr, &all).await {
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
        match b.audit() {
            Ok(v) => record_audit(&rec, &b.id, &v),
            Err(e) => eprintln!("jepsen: {e}"),
        }
    }
    w.cluster.stop_all(Duration::from_secs(5));
    drop(w);

    // Check and write the results.
    let history = rec.snapshot();
    let opts = checker::CheckOptions {
        liveness_bound_ms: o.liveness_bound_ms,
        time_limit: Duration::from_secs(600),
    };
    let report = checker::check(&history, &opts);
    write_results(&dir, &o, &history, &report, interrupted)?;
    Ok(RunResult { dir, report })
}

/// A fault that is still in force.
type Active = (Fault, String, Undo);

/// Undoes a fault and records its end.
fn end_fault(w: &mut World, rec: &Recorder, f: Fault, target: String, undo: Undo) {
    let note = stop_fault(w, undo).unwrap_or_else(|e| format!("heal failed: {e}"));
    let target = if note.is_empty() {
        target
    } else {
        format!("{target}: {note}")
    };
    record_fault(rec, f, target, FaultPhase::Stop);
    println!("[{:>7.1} s] nemesis: healed {} {note}", rec.elapsed_s(), f.name());
}

/// Starts a fault and records its start; a fault that cannot be started is
/// reported and not recorded.
async fn begin_fault(
    w: &mut World,
    sched: &mut Schedule,
    rec: &Recorder,
    f: Fault,
    label: &str,
) -> anyhow::Result<(String, Undo)> {
    let (target, undo) = start_fault(w, sched, f).await.inspect_err(|e| {
        eprintln!("jepsen: could not start {}: {e}", f.name());
    })?;
    record_fault(rec, f, target.clone(), FaultPhase::Start);
    println!("[{:>7.1} s] {label}: {} {target}", rec.elapsed_s(), f.name());
    Ok((target, undo))
}

/// One nemesis event in the history.
fn record_fault(rec: &Recorder, f: Fault, target: String, phase: FaultPhase) {
    let body = Body::Nemesis {
        fault: f.name().to_string(),
        target,
        phase,
    };
    rec.record("nemesis", OpType::Info, None, body, None);
}

/// Runs the fault schedule until the time is up or Ctrl-C; returns whether
/// it was interrupted and the fault still in force, if any.
async fn nemesis_loop(w: &mut World, o: &RunOptions, rec: &Recorder) -> (bool, Option<Active>) {
    let mut sched = Schedule::new(o.seed, &o.faults);
    let end = Instant::now() + Duration::from_secs(o.time_s);
    let ctrl_c = tokio::signal::ctrl_c();
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
        let Ok((target, undo)) = begin_fault(w, &mut sched, rec, f, "nemesis").await else {
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
        end_fault(w, rec, f, target, undo);
    }
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
    if let Err(e) = plot::latency_png(&input, &dir.join("latency.png")) {
        eprintln!("jepsen: latency plot: {e}");
    }
    if let Err(e) = plot::throughput_png(&input, &dir.join("throughput.png")) {
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
    let results = serde_json::json!({
        "valid": report.valid,
        "interrupted": interrupted,
        "seed": o.seed,
        "time_s": o.time_s,
        "nemeses": o.faults.iter().map(|f| f.name()).collect::<Vec<_>>(),
        "command": o.command,
        "crash_points": crash_notes,
        "report": report,
    });
    std::fs::write(dir.join("results.json"), serde_json::to_string_pretty(&results)?)?;
    let mut summary = format!(
        "dtx jepsen run: seed {}, {} s, nemeses [{}]{}\nreproduce: {}\n\n",
        o.seed,
        o.time_s,
        o.faults.iter().map(|f| f.name()).collect::<Vec<_>>().join(","),
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
    std::fs::write(dir.join("summary.txt"), &summary)?;
    println!("{summary}");
    Ok(())
}
