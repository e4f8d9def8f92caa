//! The saga workload (`--workload saga`): three coordinator nodes
//! and, instead of banks, the order saga's three step services
//! (`dtx-dev saga-step-serve`: inventory, payment losing some of its
//! replies, email failing some first tries) and the outside world they
//! call (`dtx-dev outside-serve`, ADR 0034: a payment provider that loses
//! [`PROVIDER_LOSE_REPLIES_PERCENT`] of its replies to the payment service
//! after charging, an e-mail sender that loses
//! [`SENDER_LOSE_REPLIES_PERCENT`]), each its own process on its own IP,
//! supervised like the banks (a process that died is started again;
//! `kill-participant` kills the outside processes too), each step service
//! behind a message proxy on its IP ([`crate::msgproxy`]:
//! the `message-chaos` nemesis delays, duplicates and replays late its
//! Forward, Compensate and Fence calls). The order definition is registered
//! once (and again as a new version naming the replacement of a step
//! service gone for good, `participant-gone`); closed-loop clients
//! start order sagas (most good, some out of stock, some unpayable, so
//! compensations happen), each with its order as the idempotency key,
//! retrying an UNKNOWN start with the same key, and wait for it to end
//! before the next. The nemeses of the sled workload that make sense here
//! run meanwhile (see [`crate::runner::Workload::faults`] for those left
//! out); `crash-point` rotates through the six saga crash points.
//!
//! The inventory keeps its stock in PostgreSQL by default
//! (`--inventory-store postgres`: `saga-step-serve --postgres`, the SDK's
//! `saga_pg` store, on a server the run starts as the PostgreSQL workload
//! does), and the run then takes `kill-postgres` and `partition-postgres`
//! too; `--inventory-store sled` keeps it in its data directory.
//!
//! After the workload: everything healed, a bounded wait (`--settle-s`)
//! until every saga the cluster holds is COMPLETED, COMPENSATED or PARKED,
//! the final journals (ListSagas), then the services stopped and audited
//! (`dtx-dev saga-step-audit`), and so is the outside world from its
//! own records (`dtx-dev outside-audit`: the cards charged, the
//! e-mails sent). [`crate::checker::saga`] decides; among other things, no
//! compensated order may have its card charged at the provider.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use std::time::Instant;

use anyhow::Context;
use dtx_pg_server::PgServer;
use dtx_pg_server::PgServerOptions;
use dtx_proto::v1 as pb;
use dtx_proto::v1::saga_service_client::SagaServiceClient;
use dtx_saga_shop::OrderInput;
use dtx_testkit::cluster::wait_listening;
use dtx_testkit::cluster::NodePlan;
use dtx_testkit::cluster::ProcessCluster;
use dtx_testkit::cluster::ServiceProcess;
use dtx_testkit::pki::DevPki;
use dtx_tls::ClientTls;
use dtx_tls::Role;
use dtx_transport::channel::Channel;
use rand::rngs::StdRng;
use rand::Rng;
use rand::SeedableRng;

use crate::checker::saga as saga_checker;
use crate::disk;
use crate::disk::SmallFs;
use crate::history::Body;
use crate::history::FaultPhase;
use crate::history::Op;
use crate::history::OpType;
use crate::history::SagaEvent;
use crate::history::SagaSeen;
use crate::msgproxy;
use crate::msgproxy::Chaos;
use crate::msgproxy::ProxyHandle;
use crate::nemesis::Fault;
use crate::nemesis::Schedule;
use crate::plot;
use crate::procs::check_bindable;
use crate::procs::Net;
use crate::runner::majority_leader;
use crate::runner::node_cluster;
use crate::runner::record_fault;
use crate::runner::restart_node_with;
use crate::runner::wait_majority_leader;
use crate::runner::InventoryStore;
use crate::runner::Recorder;
use crate::runner::RunOptions;
use crate::runner::RunResult;
use crate::runner::RunTls;
use crate::runner::LIBFAKETIME;

/// The step services, in the order of the saga.
pub const ROLES: [&str; 3] = ["inventory", "payment", "email"];
/// Payment loses this share of its Forward/Compensate replies (after
/// applying them): UNKNOWN outcomes the orchestrator must reconcile.
pub const LOSE_REPLIES_PERCENT: u32 = 10;
/// The outside world: the payment provider loses this share of its
/// replies to the payment service after charging (the charge then stays
/// in flight until the provider's status query settles it), the e-mail
/// sender this share of its replies after sending.
pub const PROVIDER_LOSE_REPLIES_PERCENT: u32 = 20;
pub const SENDER_LOSE_REPLIES_PERCENT: u32 = 10;
/// The outside processes, in this order, and their audits' roles.
pub const OUTSIDE: [&str; 2] = ["payment", "email"];
const OUTSIDE_AUDIT_ROLES: [&str; 2] = [saga_checker::PROVIDER, saga_checker::SENDER];
/// Email answers FAILED "mail server busy" this share of first tries.
pub const FAIL_FIRST_PERCENT: u32 = 20;
/// Seed of the services' data: skus and their stock, customers and their
/// balance; large enough that good orders never run out in 30 minutes.
pub const SKUS: u32 = 10;
pub const STOCK: u64 = 1_000_000;
pub const CUSTOMERS: u32 = 10;
pub const BALANCE: u64 = 1_000_000_000;
/// Out of 100 orders: out of stock (a quantity above any sku's stock) and
/// unpayable (an amount above any balance); the rest are good.
pub const OUT_OF_STOCK_PERCENT: u32 = 10;
pub const UNPAYABLE_PERCENT: u32 = 10;
/// Tries of one start (the first and retries of an UNKNOWN answer with the
/// same key), and how long each may look for a node that answers.
const START_TRIES: u32 = 4;
const START_CALL_WAIT: Duration = Duration::from_secs(8);
/// How long a client waits for its saga to end before it starts the next.
const END_WAIT: Duration = Duration::from_secs(20);

/// Port offsets from `--base-port`: the step services, their message
/// proxies (the addresses the definition names), and the same for the
/// replacement of a step service gone for good.
const SERVICE_PORT: u16 = 100;
const PROXY_PORT: u16 = 200;
const REPLACEMENT_SERVICE_PORT: u16 = 110;
const REPLACEMENT_PROXY_PORT: u16 = 210;
/// What an outside process logs for each reply it loses on purpose.
const LOST_REPLY_LINE: &str = "simulated: the reply is lost";
/// The outside processes' ports (on `<prefix>.31` and `.32`).
const OUTSIDE_PORT: u16 = 300;

/// The step service gone for good (`participant-gone`): its process (dead,
/// never restarted) and data, audited offline at the end.
struct Gone {
    slot: usize,
    process: ServiceProcess,
    data: PathBuf,
    /// Its PostgreSQL database (an inventory on PostgreSQL).
    pg_conn: Option<String>,
    /// Whether its replacement is registered (the definition's next version
    /// names it).
    replaced: bool,
}

/// The small filesystems of `disk-full`: one node's data directory and one
/// step service's, fixed for the run by the seed.
struct SagaDisk {
    node: u64,
    node_fs: SmallFs,
    slot: usize,
    svc_fs: SmallFs,
}

/// A filled disk: what its end needs.
struct Filled {
    at: Instant,
    node_log_from: u64,
    svc_log_from: u64,
    stop: tokio::sync::watch::Sender<bool>,
    top_up: tokio::task::JoinHandle<()>,
}

/// The processes of a saga run.
struct World {
    cluster: ProcessCluster,
    /// inventory, payment, email (after `participant-gone`, its slot holds
    /// the replacement).
    services: Vec<ServiceProcess>,
    /// Each service's data directory and the message proxy in front of it.
    svc_data: Vec<PathBuf>,
    /// The outside world: the payment provider, the e-mail sender, and
    /// their data directories.
    world: Vec<ServiceProcess>,
    world_data: Vec<PathBuf>,
    proxies: Vec<ProxyHandle>,
    proxy_addrs: Vec<String>,
    chaos: Arc<Chaos>,
    gone: Option<Gone>,
    disk: Option<SagaDisk>,
    /// The order definition's version the clients start (raised when a
    /// replacement is registered).
    version: Arc<AtomicU32>,
    svc_ips: Vec<String>,
    base_port: u16,
    bin: PathBuf,
    svc_dir: PathBuf,
    proxy_seed: u64,
    /// With `--tls`: the run's authority, and the harness's identities (an
    /// application starts and reads its sagas; an operator reads the
    /// cluster's status and every saga, and registers definitions).
    pki: Option<DevPki>,
    app_tls: Option<Arc<ClientTls>>,
    op_tls: Option<Arc<ClientTls>>,
    node_ips: Vec<String>,
    net: Option<Net>,
    /// Run-time crash point files: the nodes', the step services'.
    fp_nodes: PathBuf,
    fp_services: PathBuf,
    rec: Recorder,
    /// Services found dead (a crash point) and started again.
    restarts: u64,
    /// The PostgreSQL server the inventory keeps its stock on
    /// (`--inventory-store postgres`), one database per inventory instance.
    pg: Option<PgServer>,
    /// Each slot's PostgreSQL database (a connection string), when it has
    /// one.
    svc_pg: Vec<Option<String>>,
}

/// The PostgreSQL database of step service instance `name` (`inventory`,
/// `inventory-2`).
fn database_of(name: &str) -> String {
    name.replace('-', "_")
}

impl World {
    fn node_env(&self) -> Vec<(String, String)> {
        vec![("DTX_FAILPOINT_FILE".into(), self.fp_nodes.display().to_string())]
    }

    fn service_env(&self) -> Vec<(String, String)> {
        vec![
            ("DTX_FAILPOINT_FILE".into(), self.fp_services.display().to_string()),
            ("RUST_LOG".into(), "warn".into()),
        ]
    }

    /// The outside processes' environment: their lost replies are logged
    /// (info), counted at the end of the run.
    fn outside_env(&self) -> Vec<(String, String)> {
        vec![("RUST_LOG".into(), "warn,dtx_saga_shop::outside=info".into())]
    }

    async fn leader(&self) -> Option<u64> {
        majority_leader(&self.cluster.api_addrs(), self.op_tls.as_ref()).await
    }

    async fn wait_leader(&self, timeout: Duration) -> Option<u64> {
        wait_majority_leader(&self.cluster.api_addrs(), self.op_tls.as_ref(), timeout).await
    }

    fn restart_node(&mut self, id: u64, extra: &[(String, String)]) -> anyhow::Result<()> {
        let env = self.node_env();
        restart_node_with(&mut self.cluster, id, env, extra)
    }

    /// The supervisor: starts every step service and outside process that
    /// is not running (one that a crash point or a kill took down, or that
    /// stopped on a failed write).
    fn restart_services(&mut self) -> anyhow::Result<()> {
        let env = self.service_env();
        let outside_env = self.outside_env();
        let all = self
            .services
            .iter_mut()
            .map(|s| (s, &env))
            .chain(self.world.iter_mut().map(|s| (s, &outside_env)));
        for (s, env) in all {
            if !s.is_running() {
                if s.pid().is_some() {
                    self.restarts += 1;
                }
                s.start(env)?;
            }
        }
        Ok(())
    }

    fn restart_dead_nodes(&mut self) -> anyhow::Result<()> {
        for id in 1..=3u64 {
            if !self.cluster.node(id).is_running() {
                self.restart_node(id, &[])?;
            }
        }
        Ok(())
    }

    /// Network whole, every process running and unpaused, true clocks, no
    /// crash point armed.
    fn heal_all(&mut self) -> anyhow::Result<()> {
        if let Some(n) = &self.net {
            n.heal()?;
        }
        self.restart_postgres()?;
        let _ = std::fs::remove_file(&self.fp_nodes);
        let _ = std::fs::remove_file(&self.fp_services);
        for id in 1..=3u64 {
            self.cluster.signal(id, libc::SIGCONT);
        }
        self.restart_dead_nodes()?;
        for s in self.services.iter_mut().chain(self.world.iter_mut()) {
            s.signal(libc::SIGCONT);
        }
        self.restart_services()
    }

    fn net(&self) -> anyhow::Result<&Net> {
        self.net
            .as_ref()
            .ok_or_else(|| anyhow::anyhow!("partition faults need nftables"))
    }

    /// A step service process (see [`service_process`]); with `--tls` it
    /// serves TLS with a participant certificate for `addr` (only nodes,
    /// and the proxies standing in for them, may call it).
    ///
    /// The inventory, when the run has PostgreSQL, keeps its stock in a
    /// database of its own there (created here): the third value.
    fn step_service(
        &self,
        role: &str,
        name: &str,
        addr: &str,
    ) -> anyhow::Result<(ServiceProcess, PathBuf, Option<String>)> {
        let outside = match role {
            "payment" => Some(("--provider", self.world[0].addr.as_str())),
            "email" => Some(("--sender", self.world[1].addr.as_str())),
            _ => None,
        };
        let pg_conn = match (&self.pg, role) {
            (Some(pg), "inventory") => {
                let db = database_of(name);
                pg.create_database(&db)
                    .map_err(|e| anyhow::anyhow!("creating database {db}: {e}"))?;
                Some(pg.conn_string(&db))
            }
            _ => None,
        };
        let (mut process, data) =
            service_process(&self.bin, &self.svc_dir, role, name, addr, outside, pg_conn.as_deref());
        if let Some(pki) = &self.pki {
            let files = pki.issue(Role::Participant, name, &[addr])?;
            process.add_args(pki.args(&files).to_flags());
        }
        Ok((process, data, pg_conn))
    }

    /// Starts PostgreSQL again when it is down (crash recovery); the time
    /// it took to accept connections, or None when it was running.
    fn restart_postgres(&mut self) -> anyhow::Result<Option<Duration>> {
        let Some(pg) = self.pg.as_mut() else { return Ok(None) };
        if pg.is_running() {
            return Ok(None);
        }
        let t = Instant::now();
        pg.restart()
            .map_err(|e| anyhow::anyhow!("restarting PostgreSQL: {e}"))?;
        Ok(Some(t.elapsed()))
    }

    /// The message proxy `n` on `listen` in front of the step service at
    /// `upstream`; with `--tls`, with a node certificate for `listen` whose
    /// name is a node id no member has (ADR 0037: a node's name is its id).
    async fn step_proxy(&self, n: u64, listen: &str, upstream: &str, seed: u64) -> anyhow::Result<ProxyHandle> {
        let tls = match &self.pki {
            None => None,
            Some(pki) => {
                let id = crate::msgproxy::PROXY_NODE_ID_BASE + 100 + n;
                let files = pki.issue(Role::Node, &id.to_string(), &[listen])?;
                let args = pki.args(&files);
                Some(msgproxy::ProxyTls {
                    server: args.server()?.expect("a CA is set"),
                    client: args.client()?.expect("a CA is set"),
                })
            }
        };
        msgproxy::spawn_step(listen.parse()?, upstream, self.chaos.clone(), seed, tls).await
    }
}

/// What a started fault must undo.
enum Undo {
    RestartNode(u64),
    /// Every node, this one (the old leader) first.
    RestartAllNodes(u64),
    RestartService(usize),
    RestartOutside(usize),
    Cont(u64),
    HealNet,
    Unskew(u64),
    Disarm {
        file: PathBuf,
        point: &'static str,
    },
    ChaosOff,
    /// A step service gone for good: register its replacement.
    Replace,
    FreeDisk(Filled),
    RestartPostgres,
}

async fn start_fault(w: &mut World, s: &mut Schedule, f: Fault) -> anyhow::Result<(String, Undo)> {
    let leader = w.leader().await.unwrap_or(1);
    let followers: Vec<u64> = (1..=3).filter(|i| *i != leader).collect();
    let random_node = s.rng().random_range(1..=3u64);
    let ip = |id: u64| w.node_ips[(id - 1) as usize].clone();
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
        Fault::KillParticipant => {
            // A step service, or a process of the outside world.
            let i = s.rng().random_range(0..w.services.len() + w.world.len());
            if i < w.services.len() {
                w.services[i].kill9();
                (ROLES[i].to_string(), Undo::RestartService(i))
            } else {
                let j = i - w.services.len();
                w.world[j].kill9();
                (w.world[j].id.clone(), Undo::RestartOutside(j))
            }
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
            w.net()?.cut(&others)?;
            (format!("n{random_node} | rest"), Undo::HealNet)
        }
        Fault::PartitionMajority => {
            let si = s.rng().random_range(0..w.services.len());
            let minority = [ip(random_node), w.svc_ips[si].clone()];
            let majority: Vec<String> = (1..=3)
                .filter(|i| *i != random_node)
                .map(ip)
                .chain(
                    w.svc_ips
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| *i != si)
                        .map(|(_, b)| b.clone()),
                )
                .collect();
            let pairs: Vec<(String, String)> = minority
                .iter()
                .flat_map(|a| majority.iter().map(move |b| (a.clone(), b.clone())))
                .collect();
            w.net()?.cut(&pairs)?;
            (format!("n{random_node}+{} | rest", ROLES[si]), Undo::HealNet)
        }
        Fault::PartitionBridge => {
            let (a, b) = (followers[0], followers[1]);
            w.net()?.cut(&[(ip(a), ip(b))])?;
            (format!("n{a} x n{b}, bridge n{leader}"), Undo::HealNet)
        }
        Fault::PartitionLeaderParticipants => {
            let pairs: Vec<(String, String)> = w.svc_ips.iter().map(|b| (ip(leader), b.clone())).collect();
            w.net()?.cut(&pairs)?;
            (format!("n{leader} x step services"), Undo::HealNet)
        }
        Fault::PartitionLeaderFollowers => {
            let pairs: Vec<(String, String)> = followers.iter().map(|f| (ip(leader), ip(*f))).collect();
            w.net()?.cut(&pairs)?;
            (format!("n{leader} x followers"), Undo::HealNet)
        }
        Fault::ClockSkew => {
            let skew_s: i64 = if s.rng().random_bool(0.5) { 1 } else { -1 } * s.rng().random_range(5..=120i64);
            w.cluster.kill9(random_node);
            let env = vec![
                ("LD_PRELOAD".to_string(), LIBFAKETIME.to_string()),
                ("FAKETIME".to_string(), format!("{skew_s:+}s")),
                ("FAKETIME_DONT_FAKE_MONOTONIC".to_string(), "1".to_string()),
            ];
            w.restart_node(random_node, &env)?;
            (format!("n{random_node} {skew_s:+}s"), Undo::Unskew(random_node))
        }
        Fault::CrashPoint => {
            let (point, in_service) = s.next_saga_crash_point();
            let file = if in_service {
                w.fp_services.clone()
            } else {
                w.fp_nodes.clone()
            };
            std::fs::write(&file, point)?;
            (point.to_string(), Undo::Disarm { file, point })
        }
        Fault::MessageChaos => {
            w.chaos.set(true);
            ("step service calls".to_string(), Undo::ChaosOff)
        }
        Fault::ParticipantGone => {
            if let Some(g) = &w.gone {
                anyhow::bail!("{} is already gone (one step service per run); skipped", ROLES[g.slot]);
            }
            // Not the service on the small filesystem: disk-full needs it.
            let disk_slot = w.disk.as_ref().map(|d| d.slot);
            let candidates: Vec<usize> = (0..w.services.len()).filter(|i| Some(*i) != disk_slot).collect();
            let slot = candidates[s.rng().random_range(0..candidates.len())];
            go_away(w, slot).await?;
            (ROLES[slot].to_string(), Undo::Replace)
        }
        Fault::DiskFull => {
            let filled = fill_disk(w)?;
            let d = w.disk.as_ref().expect("fill_disk checked");
            (format!("n{} + {}", d.node, ROLES[d.slot]), Undo::FreeDisk(filled))
        }
        Fault::KillPostgres => {
            let pg = w.pg.as_mut().ok_or_else(|| {
                anyhow::anyhow!("kill-postgres needs the inventory on PostgreSQL (--inventory-store postgres)")
            })?;
            let pid = pg.pid().unwrap_or(0);
            pg.kill9();
            (format!("postgres (pid {pid})"), Undo::RestartPostgres)
        }
        Fault::PartitionPostgres => {
            let port = w
                .pg
                .as_ref()
                .ok_or_else(|| {
                    anyhow::anyhow!("partition-postgres needs the inventory on PostgreSQL (--inventory-store postgres)")
                })?
                .port();
            w.net()?.cut_port(dtx_pg_server::HOST, port)?;
            (
                format!("postgres ({}:{port}) x inventory", dtx_pg_server::HOST),
                Undo::HealNet,
            )
        }
        Fault::PowerCut => {
            anyhow::bail!("{} is not part of the saga workload", f.name())
        }
    })
}

async fn stop_fault(w: &mut World, undo: Undo) -> anyhow::Result<String> {
    let note = match undo {
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
        Undo::RestartService(i) => {
            let env = w.service_env();
            w.services[i].start(&env)?;
            String::new()
        }
        Undo::RestartOutside(j) => {
            let env = w.outside_env();
            w.world[j].start(&env)?;
            String::new()
        }
        Undo::Cont(id) => {
            w.cluster.signal(id, libc::SIGCONT);
            String::new()
        }
        Undo::HealNet => {
            w.net()?.heal()?;
            String::new()
        }
        Undo::Unskew(id) => {
            w.cluster.kill9(id);
            w.restart_node(id, &[])?;
            String::new()
        }
        Undo::Disarm { file, point } => {
            let fired = !file.exists();
            let _ = std::fs::remove_file(&file);
            if fired {
                format!("{point} fired")
            } else {
                format!("{point} not reached")
            }
        }
        Undo::ChaosOff => {
            w.chaos.set(false);
            w.chaos.summary()
        }
        Undo::Replace => replace_gone(w).await?,
        Undo::FreeDisk(filled) => free_disk(w, filled).await?,
        Undo::RestartPostgres => {
            // Crash recovery runs here (this blocks the nemesis, not the
            // clients); an inventory that exited meanwhile (it gives up
            // connecting at start after a while) is started again below.
            match w.restart_postgres()? {
                Some(t) => format!("restarted, accepting connections after {} ms", t.as_millis()),
                None => "was running".to_string(),
            }
        }
    };
    // The supervisor: whatever died meanwhile (a crash point) is started
    // again.
    w.restart_dead_nodes()?;
    w.restart_services()?;
    Ok(note)
}

type Active = (Fault, String, Undo);

async fn end_fault(w: &mut World, f: Fault, target: String, undo: Undo) {
    let note = stop_fault(w, undo)
        .await
        .unwrap_or_else(|e| format!("heal failed: {e}"));
    let target = if note.is_empty() {
        target
    } else {
        format!("{target}: {note}")
    };
    record_fault(&w.rec, f, target, FaultPhase::Stop);
    println!("[{:>7.1} s] nemesis: healed {} {note}", w.rec.elapsed_s(), f.name());
}

async fn begin_fault(w: &mut World, sched: &mut Schedule, f: Fault) -> anyhow::Result<(String, Undo)> {
    let (target, undo) = start_fault(w, sched, f).await.inspect_err(|e| {
        eprintln!("jepsen: could not start {}: {e}", f.name());
    })?;
    record_fault(&w.rec, f, target.clone(), FaultPhase::Start);
    println!("[{:>7.1} s] nemesis: {} {target}", w.rec.elapsed_s(), f.name());
    Ok((target, undo))
}

/// The fault schedule until the time is up or Ctrl-C: whether it was
/// interrupted, and the fault still in force.
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
        let quiet = Duration::from_secs(rng.random_range(o.quiet_s.0..=o.quiet_s.1));
        tokio::select! {
            _ = sleep_until(Instant::now() + quiet) => {}
            _ = &mut ctrl_c => return (true, None),
        }
        if let Err(e) = w.restart_services() {
            eprintln!("jepsen: restarting step services: {e}");
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
        let Ok((target, undo)) = begin_fault(w, &mut sched, f).await else {
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

/// A step service process of `role` named `name` (its log and data
/// directory under `svc_dir`) serving on `addr`, and its data directory.
fn service_process(
    bin: &std::path::Path,
    svc_dir: &std::path::Path,
    role: &str,
    name: &str,
    addr: &str,
    outside: Option<(&str, &str)>,
    pg_conn: Option<&str>,
) -> (ServiceProcess, PathBuf) {
    let data = svc_dir.join(name);
    let store: [std::ffi::OsString; 2] = match pg_conn {
        Some(conn) => ["--postgres".into(), conn.into()],
        None => ["--data".into(), data.clone().into()],
    };
    let mut args: Vec<std::ffi::OsString> = vec![
        "saga-step-serve".into(),
        "--role".into(),
        role.into(),
        "--listen".into(),
        addr.into(),
    ];
    args.extend(store);
    args.extend([
        "--skus".into(),
        SKUS.to_string().into(),
        "--stock".into(),
        STOCK.to_string().into(),
    ]);
    if let Some((flag, to)) = outside {
        args.extend([flag.into(), to.into()]);
    }
    if role == "payment" {
        args.extend(["--lose-replies-percent".into(), LOSE_REPLIES_PERCENT.to_string().into()]);
    }
    if role == "email" {
        args.extend(["--fail-first-percent".into(), FAIL_FIRST_PERCENT.to_string().into()]);
    }
    (ServiceProcess::new(bin, svc_dir, name, addr, args), data)
}

/// An outside process (`dtx-dev outside-serve`) of `role` (payment:
/// the provider, email: the sender) serving on `addr`, its log and data
/// directory under `dir`, and its data directory. Plain text: it stands
/// for a system outside the cluster's TLS.
fn outside_process(bin: &std::path::Path, dir: &std::path::Path, role: &str, addr: &str) -> (ServiceProcess, PathBuf) {
    let name = if role == "payment" {
        saga_checker::PROVIDER
    } else {
        saga_checker::SENDER
    };
    let data = dir.join(name);
    let mut args: Vec<std::ffi::OsString> = vec![
        "outside-serve".into(),
        "--role".into(),
        role.into(),
        "--listen".into(),
        addr.into(),
        "--data".into(),
        data.clone().into(),
    ];
    let lose = if role == "payment" {
        args.extend([
            "--customers".into(),
            CUSTOMERS.to_string().into(),
            "--balance".into(),
            BALANCE.to_string().into(),
        ]);
        PROVIDER_LOSE_REPLIES_PERCENT
    } else {
        SENDER_LOSE_REPLIES_PERCENT
    };
    args.extend(["--lose-replies-percent".into(), lose.to_string().into()]);
    (ServiceProcess::new(bin, dir, name, addr, args), data)
}

/// `participant-gone`: the step service in `slot` is killed (-9) and its
/// proxy closed for good (its address refuses connections); sagas that need
/// it park. The operator's replacement (`<role>-2`, fresh data, new ports on
/// the same IP, behind a proxy of its own) starts at once, and is
/// registered when the fault ends ([`replace_gone`]).
async fn go_away(w: &mut World, slot: usize) -> anyhow::Result<()> {
    let role = ROLES[slot];
    let ip = w.svc_ips[slot].clone();
    let addr = format!("{ip}:{}", w.base_port + REPLACEMENT_SERVICE_PORT + slot as u16);
    let proxy_addr = format!("{ip}:{}", w.base_port + REPLACEMENT_PROXY_PORT + slot as u16);
    let name = format!("{role}-2");
    // First (it may create the replacement's database): a failure leaves
    // the service as it was.
    let (process, data, pg_conn) = w.step_service(role, &name, &addr)?;
    w.services[slot].kill9();
    w.proxies[slot].go_away();
    let seed = w.proxy_seed ^ 0x60_4E ^ slot as u64;
    // Replacements' proxies after the first ones' ids.
    let proxy = w.step_proxy(50 + slot as u64, &proxy_addr, &addr, seed).await?;
    let old = std::mem::replace(&mut w.services[slot], process);
    let old_data = std::mem::replace(&mut w.svc_data[slot], data);
    let old_pg = std::mem::replace(&mut w.svc_pg[slot], pg_conn);
    w.proxies[slot] = proxy;
    w.proxy_addrs[slot] = proxy_addr;
    w.gone = Some(Gone {
        slot,
        process: old,
        data: old_data,
        pg_conn: old_pg,
        replaced: false,
    });
    w.restart_services()
}

/// The operator's runbook for a step service gone for good: the order
/// definition's next version names its replacement; new orders start on
/// it. Sagas parked at the gone service stay parked for an operator.
async fn replace_gone(w: &mut World) -> anyhow::Result<String> {
    let Some(slot) = w.gone.as_ref().filter(|g| !g.replaced).map(|g| g.slot) else {
        return Ok(String::new());
    };
    let version = w.version.load(Ordering::SeqCst) + 1;
    let mut def = dtx_saga_shop::order_saga_definition(&w.proxy_addrs[0], &w.proxy_addrs[1], &w.proxy_addrs[2]);
    def.version = version;
    register(&channels(&w.cluster.api_addrs(), w.op_tls.as_ref())?, def).await?;
    w.version.store(version, Ordering::SeqCst);
    if let Some(g) = w.gone.as_mut() {
        g.replaced = true;
    }
    Ok(format!(
        "replaced by {} at {}; order saga v{version} registered",
        w.services[slot].id, w.proxy_addrs[slot]
    ))
}

/// Registers a saga definition (any node; retried while none answers).
async fn register(chans: &[Channel], def: pb::SagaDefinition) -> anyhow::Result<()> {
    let name = format!("{}@{}", def.name, def.version);
    call(chans, Duration::from_secs(30), |mut c| {
        let d = def.clone();
        async move {
            c.register_definition(pb::RegisterSagaDefinitionRequest { definition: Some(d) })
                .await
        }
    })
    .await
    .map(|_| ())
    .map_err(|e| anyhow::anyhow!("registering {name}: {e}"))
}

/// `disk-full`: fills the node's and the step service's small filesystems
/// and keeps them full (space a process frees is taken again) until
/// [`free_disk`].
fn fill_disk(w: &mut World) -> anyhow::Result<Filled> {
    let Some(d) = w.disk.as_mut() else {
        anyhow::bail!("disk-full has no small filesystems (they are mounted at the start of a run)");
    };
    let node_log_from = disk::file_len(&w.cluster.node(d.node).log_path);
    let svc_log_from = disk::file_len(&w.services[d.slot].log_path);
    d.node_fs.fill()?;
    if let Err(e) = d.svc_fs.fill() {
        let _ = d.node_fs.free();
        let _ = d.svc_fs.free();
        return Err(e);
    }
    let paths = [d.node_fs.path.clone(), d.svc_fs.path.clone()];
    let (stop, mut rx) = tokio::sync::watch::channel(false);
    let top_up = tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                _ = rx.wait_for(|s| *s) => break,
            }
            for p in &paths {
                let _ = disk::top_up(p);
            }
        }
    });
    Ok(Filled {
        at: Instant::now(),
        node_log_from,
        svc_log_from,
        stop,
        top_up,
    })
}

/// Frees the small filesystems; the note says how long they were full,
/// which filled process had exited, and how many disk-full lines each
/// logged meanwhile (the supervisor then starts whatever is down).
async fn free_disk(w: &mut World, f: Filled) -> anyhow::Result<String> {
    let _ = f.stop.send(true);
    let _ = f.top_up.await;
    let Some(d) = w.disk.as_mut() else {
        anyhow::bail!("disk-full has no small filesystems");
    };
    let (node, slot) = (d.node, d.slot);
    let node_running = w.cluster.node(node).is_running();
    let svc_running = w.services[slot].is_running();
    d.node_fs.free()?;
    d.svc_fs.free()?;
    let (node_lines, _) = disk::disk_full_lines(&w.cluster.node(node).log_path, f.node_log_from);
    let (svc_lines, _) = disk::disk_full_lines(&w.services[slot].log_path, f.svc_log_from);
    let state = |running: bool| if running { "still running" } else { "had exited" };
    Ok(format!(
        "freed after {} ms; n{node} {} ({node_lines} disk-full log lines), {} {} ({svc_lines} disk-full log \
         lines)",
        f.at.elapsed().as_millis(),
        state(node_running),
        ROLES[slot],
        state(svc_running)
    ))
}

/// Lazy channels to every node's API (they reconnect by themselves), over
/// TLS as `tls` when it is set.
fn channels(addrs: &[String], tls: Option<&Arc<ClientTls>>) -> anyhow::Result<Vec<Channel>> {
    addrs
        .iter()
        .map(|a| {
            dtx_transport::channel::channel_with(a, None, Duration::from_millis(500), tls)
                .map_err(|e| anyhow::anyhow!(e))
        })
        .collect()
}

/// How long one call of the harness may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether an error answer leaves the call's effect unknown (a dead node,
/// an election, a cut connection, a deadline): retry elsewhere.
fn transient(s: &tonic::Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::Unavailable | tonic::Code::DeadlineExceeded | tonic::Code::Unknown | tonic::Code::Cancelled
    )
}

/// Calls `f` on each node in turn until one answers something other than
/// a transient error, for up to `wait`. Only for calls that may be
/// repeated: reads, and starts (idempotent by key).
async fn call<T, F, Fut>(chans: &[Channel], wait: Duration, mut f: F) -> Result<T, tonic::Status>
where
    F: FnMut(SagaServiceClient<Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let until = Instant::now() + wait;
    loop {
        for ch in chans {
            let answer = tokio::time::timeout(CALL_TIMEOUT, f(SagaServiceClient::new(ch.clone())))
                .await
                .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer in time")));
            match answer {
                Ok(r) => return Ok(r.into_inner()),
                Err(s) if transient(&s) => {
                    if Instant::now() >= until {
                        return Err(s);
                    }
                }
                Err(s) => return Err(s),
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn state_name(state: i32) -> String {
    pb::SagaState::try_from(state)
        .map(|s| s.as_str_name().trim_start_matches("SAGA_STATE_").to_string())
        .unwrap_or_else(|_| format!("STATE_{state}"))
}

fn ended(state: i32) -> bool {
    matches!(
        pb::SagaState::try_from(state),
        Ok(pb::SagaState::Completed | pb::SagaState::Compensated | pb::SagaState::Parked)
    )
}

/// One closed-loop client: starts an order saga, waits for it to end (up
/// to [`END_WAIT`]), and again, until `stop`.
async fn client_loop(
    id: usize,
    seed: u64,
    rec: Recorder,
    chans: Vec<Channel>,
    version: Arc<AtomicU32>,
    stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut rng = StdRng::seed_from_u64(seed ^ (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5A6A);
    let process = format!("client-{id}");
    let mut n = 0u64;
    while !*stop.borrow() {
        n += 1;
        let roll = rng.random_range(0..100u32);
        let (kind, qty, amount) = if roll < OUT_OF_STOCK_PERCENT {
            ("out-of-stock", STOCK * 10, rng.random_range(1..=100u64))
        } else if roll < OUT_OF_STOCK_PERCENT + UNPAYABLE_PERCENT {
            ("unpayable", rng.random_range(1..=3u64), BALANCE * 10)
        } else {
            ("good", rng.random_range(1..=3u64), rng.random_range(1..=100u64))
        };
        let input = OrderInput {
            order: format!("o-c{id}-{n}"),
            sku: format!("sku-{}", rng.random_range(0..SKUS)),
            qty,
            customer: format!("c-{}", rng.random_range(0..CUSTOMERS)),
            amount,
        };
        let req = pb::StartSagaRequest {
            definition: dtx_saga_shop::ORDER_SAGA.to_string(),
            // Fixed for the order's tries (its key names one request).
            version: version.load(Ordering::SeqCst),
            idempotency_key: input.order.clone(),
            input: input.to_json(),
            authorization: None,
            deadline_ms: 0,
        };
        let mut started = None;
        for attempt in 1..=START_TRIES {
            let ev = |saga_id| {
                Body::Saga(SagaEvent::Start {
                    order: input.order.clone(),
                    kind: kind.to_string(),
                    qty,
                    amount,
                    attempt,
                    saga_id,
                })
            };
            rec.record(&process, OpType::Invoke, None, ev(None), None);
            let r = call(&chans, START_CALL_WAIT, |mut c| {
                let r = req.clone();
                async move { c.start_saga(r).await }
            })
            .await;
            match r {
                Ok(resp) => {
                    rec.record(&process, OpType::Ok, None, ev(Some(resp.saga_id)), None);
                    started = Some(resp.saga_id);
                    break;
                }
                Err(s) if !transient(&s) => {
                    rec.record(&process, OpType::Fail, None, ev(None), Some(s.to_string()));
                    break;
                }
                Err(s) => {
                    rec.record(&process, OpType::Info, None, ev(None), Some(s.to_string()));
                    // The same key again after a pause (idempotent), unless
                    // the workload is over.
                    if *stop.borrow() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(rng.random_range(200..600))).await;
                }
            }
        }
        let Some(saga_id) = started else {
            tokio::time::sleep(Duration::from_millis(rng.random_range(50..200))).await;
            continue;
        };
        // Closed loop: the next order once this one ended.
        let until = Instant::now() + END_WAIT;
        while Instant::now() < until && !*stop.borrow() {
            let v = call(&chans, Duration::from_secs(2), |mut c| async move {
                c.get_saga(pb::GetSagaRequest { saga_id }).await
            })
            .await;
            if v.is_ok_and(|v| ended(v.state)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Every saga the cluster holds (ListSagas, page by page), or None when a
/// page could not be read.
async fn list_all(chans: &[Channel]) -> Option<Vec<pb::SagaView>> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let page = call(chans, Duration::from_secs(10), |mut c| async move {
            c.list_sagas(pb::ListSagasRequest {
                states: vec![],
                definition: String::new(),
                after_saga_id: after,
                limit: 500,
            })
            .await
        })
        .await
        .ok()?;
        out.extend(page.sagas);
        if page.next_after_saga_id == 0 {
            return Some(out);
        }
        after = page.next_after_saga_id;
    }
}

/// What the checker needs of one saga's journal.
pub fn seen(v: &pb::SagaView) -> SagaSeen {
    let mut s = SagaSeen {
        saga_id: v.saga_id,
        key: v.idempotency_key.clone(),
        state: state_name(v.state),
        parked_reason: v.parked_reason.clone(),
        operator_actions: v.operator_actions.len() as u64,
        ..SagaSeen::default()
    };
    for c in v
        .steps
        .iter()
        .flat_map(|st| [st.forward.as_ref(), st.compensation.as_ref()])
        .flatten()
    {
        s.calls += 1;
        let still_unknown = c.outcome == pb::StepOutcome::Unknown as i32;
        if c.unknown_ms > 0 || still_unknown {
            s.unknown_calls += 1;
        }
        s.unknown_ms_sum += c.unknown_ms;
        s.unknown_ms_max = s.unknown_ms_max.max(c.unknown_ms);
        s.reconciliations += u64::from(c.reconciliations);
    }
    s
}

/// The audit of a stopped outside process (`dtx-dev outside-audit`).
fn outside_audit(bin: &std::path::Path, role: &str, data: &std::path::Path) -> Result<dtx_saga_shop::Audit, String> {
    let o = std::process::Command::new(bin)
        .args(["outside-audit", "--role", role, "--data"])
        .arg(data)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    if !o.status.success() {
        return Err(format!(
            "outside-audit --role {role} failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    serde_json::from_slice(&o.stdout).map_err(|e| format!("audit of the outside {role} unreadable: {e}"))
}

/// The audit of a stopped step service (`dtx-dev saga-step-audit`): of
/// its data directory, or of its PostgreSQL database when `pg_conn` names
/// one.
fn audit(
    bin: &std::path::Path,
    role: &str,
    data: &std::path::Path,
    pg_conn: Option<&str>,
) -> Result<dtx_saga_shop::Audit, String> {
    let mut cmd = std::process::Command::new(bin);
    cmd.args(["saga-step-audit", "--role", role]);
    match pg_conn {
        Some(conn) => cmd.args(["--postgres", conn]),
        None => cmd.arg("--data").arg(data),
    };
    let o = cmd.output().map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    if !o.status.success() {
        return Err(format!(
            "saga-step-audit --role {role} failed ({}): {}",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        ));
    }
    serde_json::from_slice(&o.stdout).map_err(|e| format!("audit of {role} unreadable: {e}"))
}

pub async fn run(o: RunOptions) -> anyhow::Result<RunResult> {
    crate::runner::check_binaries(&o)?;
    anyhow::ensure!(o.clients >= 1, "--clients must be at least 1");
    anyhow::ensure!(o.time_s >= 1, "--time must be at least 1 second");
    let node_addrs: Vec<(String, u16)> = crate::runner::addrs(&o).into_iter().take(6).collect();
    let port_set = |offset: u16| -> Vec<(String, u16)> {
        (0..ROLES.len() as u16)
            .map(|i| (format!("{}.{}", o.ip_prefix, 21 + i), o.base_port + offset + i))
            .collect()
    };
    let svc_addrs = port_set(SERVICE_PORT);
    let proxy_addrs = port_set(PROXY_PORT);
    let outside_addrs: Vec<(String, u16)> = (0..OUTSIDE.len() as u16)
        .map(|i| (format!("{}.{}", o.ip_prefix, 31 + i), o.base_port + OUTSIDE_PORT + i))
        .collect();
    let mut listened: Vec<(String, u16)> = node_addrs
        .iter()
        .chain(&svc_addrs)
        .chain(&proxy_addrs)
        .chain(&outside_addrs)
        .cloned()
        .collect();
    if o.faults.contains(&Fault::ParticipantGone) {
        listened.extend(port_set(REPLACEMENT_SERVICE_PORT));
        listened.extend(port_set(REPLACEMENT_PROXY_PORT));
    }
    for (ip, port) in &listened {
        check_bindable(&format!("{ip}:{port}"))?;
    }
    if o.faults.contains(&Fault::DiskFull) {
        disk::probe(&std::env::temp_dir(), o.base_port)?;
    }
    if o.faults.iter().any(|f| f.is_partition()) {
        Net::new(&format!("dtx_jepsen_probe_{}", o.base_port))
            .context("partition nemeses need nftables (apt-get install nftables) and root")?;
    }
    if o.faults.contains(&Fault::ClockSkew) {
        anyhow::ensure!(
            std::path::Path::new(LIBFAKETIME).exists(),
            "clock-skew needs libfaketime at {LIBFAKETIME} (apt-get install faketime)"
        );
    }
    let on_pg = o.inventory_store == InventoryStore::Postgres;
    if on_pg {
        dtx_pg_server::find_binaries().map_err(|e| {
            anyhow::anyhow!(
                "the saga workload keeps its inventory on PostgreSQL (--inventory-store postgres, the default) and \
                 needs a PostgreSQL server: {e}; --inventory-store sled runs without it"
            )
        })?;
    }
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

    let plans: Vec<NodePlan> = (0..3)
        .map(|i| {
            let raft = format!("{}:{}", node_addrs[2 * i].0, node_addrs[2 * i].1);
            let api = format!("{}:{}", node_addrs[2 * i + 1].0, node_addrs[2 * i + 1].1);
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
    // With --tls: a throwaway authority in the run's folder (tls/), the
    // nodes' certificates, and the harness's two identities.
    let RunTls { pki, app_tls, op_tls } = RunTls::new(o.tls, &dir.join("tls"), "dtx jepsen saga run")?;
    let cluster = node_cluster(
        &o,
        &dir.join("nodes"),
        "dtx-jepsen-saga",
        plans,
        pki.as_ref(),
        op_tls.clone(),
        |_| {},
    )?;
    let net = if o.faults.iter().any(|f| f.is_partition()) {
        Some(Net::new(&format!("dtx_jepsen_{}", o.base_port))?)
    } else {
        None
    };
    let svc_dir = dir.join("step-services");
    std::fs::create_dir_all(&svc_dir)?;
    // The inventory's PostgreSQL server (its data directory in a temporary
    // folder, its log copied into step-services/ at the end).
    let pg = if on_pg {
        let pg = PgServer::start(PgServerOptions {
            max_connections: 200,
            ..PgServerOptions::default()
        })
        .map_err(|e| anyhow::anyhow!("starting PostgreSQL: {e}"))?;
        println!(
            "jepsen: PostgreSQL on {}:{} (pid {}) for the inventory; log {}",
            dtx_pg_server::HOST,
            pg.port(),
            pg.pid().unwrap_or(0),
            pg.log_path().display()
        );
        Some(pg)
    } else {
        None
    };
    let chaos = Arc::new(Chaos::default());
    let mut w = World {
        cluster,
        services: Vec::new(),
        svc_data: Vec::new(),
        world: Vec::new(),
        world_data: Vec::new(),
        proxies: Vec::new(),
        proxy_addrs: proxy_addrs.iter().map(|(ip, port)| format!("{ip}:{port}")).collect(),
        chaos: chaos.clone(),
        gone: None,
        disk: None,
        version: Arc::new(AtomicU32::new(dtx_saga_shop::ORDER_SAGA_VERSION)),
        base_port: o.base_port,
        bin: o.tools_bin.clone(),
        svc_dir: svc_dir.clone(),
        proxy_seed: o.seed ^ 0x5A90,
        pki,
        app_tls,
        op_tls,
        svc_ips: svc_addrs.iter().map(|(ip, _)| ip.clone()).collect(),
        node_ips,
        net,
        fp_nodes: dir.join("failpoint-nodes"),
        fp_services: dir.join("failpoint-services"),
        rec: rec.clone(),
        restarts: 0,
        pg,
        svc_pg: Vec::new(),
    };
    // The outside world first: the step services name it.
    let world_dir = dir.join("outside");
    std::fs::create_dir_all(&world_dir)?;
    for (role, (ip, port)) in OUTSIDE.iter().zip(&outside_addrs) {
        let (process, data) = outside_process(&o.tools_bin, &world_dir, role, &format!("{ip}:{port}"));
        w.world.push(process);
        w.world_data.push(data);
    }
    for (i, (role, (ip, port))) in ROLES.iter().zip(&svc_addrs).enumerate() {
        let addr = format!("{ip}:{port}");
        let (process, data, pg_conn) = w.step_service(role, role, &addr)?;
        let listen = format!("{}:{}", proxy_addrs[i].0, proxy_addrs[i].1);
        let proxy = w.step_proxy(i as u64, &listen, &addr, w.proxy_seed ^ i as u64).await?;
        w.services.push(process);
        w.svc_data.push(data);
        w.svc_pg.push(pg_conn);
        w.proxies.push(proxy);
    }
    if o.faults.contains(&Fault::DiskFull) {
        // One node and one step service, fixed for the run by the seed, get
        // a small filesystem of their own before they first start.
        disk::unmount_stale(o.base_port);
        let mut rng = StdRng::seed_from_u64(o.seed ^ 0xD15C);
        let node = rng.random_range(1..=3u64);
        // A service with a data directory: not the inventory on
        // PostgreSQL (whose disk is PostgreSQL's; the postgres workload
        // fills that one).
        let first = usize::from(w.svc_pg[0].is_some());
        let slot = rng.random_range(first..ROLES.len());
        let node_dir = w.cluster.node(node).config.data_dir.clone();
        let node_fs = SmallFs::mount(&node_dir, o.base_port)?;
        let svc_fs = SmallFs::mount(&w.svc_data[slot], o.base_port)?;
        println!(
            "jepsen: disk-full: n{node} ({}) and {} ({}) on small filesystems (tmpfs)",
            node_dir.display(),
            ROLES[slot],
            w.svc_data[slot].display()
        );
        w.disk = Some(SagaDisk {
            node,
            node_fs,
            slot,
            svc_fs,
        });
    }
    w.cluster.env = w.node_env();
    w.cluster.start_all()?;
    w.restart_services()?;
    anyhow::ensure!(
        w.wait_leader(Duration::from_secs(30)).await.is_some(),
        "the cluster elected no leader within 30 s (see {}/nodes/*.log)",
        dir.display()
    );
    for s in w.services.iter().chain(&w.world) {
        anyhow::ensure!(
            wait_listening(&s.addr, Duration::from_secs(20)).await,
            "{} is not listening on {} after 20 s (see {})",
            s.id,
            s.addr,
            s.log_path.display()
        );
    }
    // The operator's channels (registration, the final listing); the
    // clients have the application's.
    let chans = channels(&w.cluster.api_addrs(), w.op_tls.as_ref())?;
    let def = dtx_saga_shop::order_saga_definition(&w.proxy_addrs[0], &w.proxy_addrs[1], &w.proxy_addrs[2]);
    register(&chans, def).await?;
    println!(
        "jepsen: 3 nodes, step services {} (payment loses {LOSE_REPLIES_PERCENT}% of its replies, email fails \
         {FAIL_FIRST_PERCENT}% of first tries), outside world {} (the provider loses \
         {PROVIDER_LOSE_REPLIES_PERCENT}% of its replies after charging, the sender {SENDER_LOSE_REPLIES_PERCENT}%), \
         inventory on {}, {} clients, {} s, nemeses [{}], seed {}{}; results in {}",
        w.services
            .iter()
            .zip(&w.proxy_addrs)
            .map(|(s, p)| format!("{}@{} (proxy {p})", s.id, s.addr))
            .collect::<Vec<_>>()
            .join(", "),
        w.world
            .iter()
            .map(|s| format!("{}@{}", s.id, s.addr))
            .collect::<Vec<_>>()
            .join(", "),
        if on_pg { "PostgreSQL" } else { "sled" },
        o.clients,
        o.time_s,
        o.faults.iter().map(|f| f.name()).collect::<Vec<_>>().join(","),
        o.seed,
        if o.tls { ", TLS on every link" } else { "" },
        dir.display()
    );

    // Workload and nemesis.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    for id in 0..o.clients {
        tasks.push(tokio::spawn(client_loop(
            id,
            o.seed,
            rec.clone(),
            channels(&w.cluster.api_addrs(), w.app_tls.as_ref())?,
            w.version.clone(),
            stop_rx.clone(),
        )));
    }
    let (interrupted, active) = nemesis_loop(&mut w, &o, interrupt).await;
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    println!(
        "[{:>7.1} s] jepsen: workload stopped; healing everything",
        rec.elapsed_s()
    );
    if let Some((f, target, undo)) = active {
        end_fault(&mut w, f, target, undo).await;
    }
    // With a step service gone for good, the leader is then killed: a new
    // leader must resume every saga the old one drove, and leave the
    // parked ones parked.
    if !interrupted && w.gone.is_some() {
        let mut sched = Schedule::new(o.seed, &[]);
        if let Ok((target, undo)) = begin_fault(&mut w, &mut sched, Fault::KillLeader).await {
            if let Undo::RestartNode(old) = undo {
                let until = Instant::now() + Duration::from_secs(10);
                while Instant::now() < until && w.leader().await.is_none_or(|l| l == old) {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
            end_fault(&mut w, Fault::KillLeader, target, undo).await;
        }
    }
    w.heal_all()?;

    // Settle: every saga ended (COMPLETED, COMPENSATED or PARKED), with
    // the services supervised meanwhile.
    let healed = Instant::now();
    let settle = Duration::from_secs(if interrupted { 10 } else { o.settle_s });
    if w.wait_leader(settle).await.is_none() {
        eprintln!("jepsen: no leader {} s after the final heal", settle.as_secs());
    }
    let mut last: Option<Vec<pb::SagaView>> = None;
    let mut all_ended = false;
    loop {
        if let Err(e) = w.restart_services() {
            eprintln!("jepsen: restarting step services: {e}");
        }
        if let Err(e) = w.restart_dead_nodes() {
            eprintln!("jepsen: restarting nodes: {e}");
        }
        if let Some(list) = list_all(&chans).await {
            all_ended = list.iter().all(|v| ended(v.state));
            last = Some(list);
        }
        if all_ended || healed.elapsed() >= settle {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let waited_ms = healed.elapsed().as_millis() as u64;
    let read = last.is_some();
    for v in last.iter().flatten() {
        rec.record("final", OpType::Ok, None, Body::Saga(SagaEvent::Final(seen(v))), None);
    }
    rec.record(
        "final",
        OpType::Ok,
        None,
        Body::Saga(SagaEvent::Settle {
            waited_ms,
            all_ended,
            read,
        }),
        None,
    );
    println!(
        "[{:>7.1} s] jepsen: {} saga(s) held, {} after {waited_ms} ms; step services restarted {} time(s)",
        rec.elapsed_s(),
        last.as_ref().map(Vec::len).unwrap_or(0),
        if !read {
            "the listing could not be read"
        } else if all_ended {
            "all ended"
        } else {
            "NOT all ended"
        },
        w.restarts
    );

    // Audits of the stopped services.
    for s in w.services.iter_mut().chain(w.world.iter_mut()) {
        s.stop(Duration::from_secs(5));
    }
    // Each slot's service, and the one gone for good (its disk outlived it).
    let mut audited: Vec<(&str, PathBuf, Option<String>)> = ROLES
        .iter()
        .copied()
        .zip(w.svc_data.iter().cloned())
        .zip(w.svc_pg.iter().cloned())
        .map(|((r, d), p)| (r, d, p))
        .collect();
    if let Some(g) = &w.gone {
        audited.push((ROLES[g.slot], g.data.clone(), g.pg_conn.clone()));
        println!(
            "jepsen: {} gone for good (log {}); its data audited with its replacement's",
            g.process.id,
            g.process.log_path.display()
        );
    }
    if let Err(e) = w.restart_postgres() {
        eprintln!("jepsen: {e}");
    }
    for (role, data, pg_conn) in audited {
        let (a, error) = match audit(&o.tools_bin, role, &data, pg_conn.as_deref()) {
            Ok(a) => (Some(a), None),
            Err(e) => {
                eprintln!("jepsen: {e}");
                (None, Some(e))
            }
        };
        rec.record(
            "final",
            OpType::Ok,
            None,
            Body::Saga(SagaEvent::Audit {
                role: role.to_string(),
                audit: a,
                error,
            }),
            None,
        );
    }
    // The outside world, from its own records: the cards charged and the
    // e-mails sent.
    for (i, role) in OUTSIDE.iter().enumerate() {
        let (a, error) = match outside_audit(&o.tools_bin, role, &w.world_data[i]) {
            Ok(a) => (Some(a), None),
            Err(e) => {
                eprintln!("jepsen: {e}");
                (None, Some(e))
            }
        };
        rec.record(
            "final",
            OpType::Ok,
            None,
            Body::Saga(SagaEvent::Audit {
                role: OUTSIDE_AUDIT_ROLES[i].to_string(),
                audit: a,
                error,
            }),
            None,
        );
    }
    w.cluster.stop_all(Duration::from_secs(5));
    if let Some(n) = &w.net {
        let _ = n.heal();
    }
    if let Some(mut pg) = w.pg.take() {
        if let Err(e) = std::fs::copy(pg.log_path(), svc_dir.join("postgres.log")) {
            eprintln!("jepsen: could not copy PostgreSQL's log: {e}");
        }
        pg.kill9();
    }
    if o.faults.contains(&Fault::MessageChaos) {
        println!("jepsen: message chaos on step calls: {}", chaos.summary());
    }
    // The small filesystems go away with their mounts: their contents
    // (not the filler) are kept beside them for a post-mortem.
    if let Some(d) = w.disk.as_mut() {
        for fs in [&mut d.node_fs, &mut d.svc_fs] {
            let saved = fs.path.with_extension("saved");
            if let Err(e) = fs.save(&saved) {
                eprintln!("jepsen: could not keep {}: {e}", fs.path.display());
            }
            fs.unmount();
        }
    }
    // How many replies the outside world lost on purpose (its log lines).
    let lost: Vec<(String, u64)> = w
        .world
        .iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p.log_path).unwrap_or_default();
            (p.id.clone(), text.matches(LOST_REPLY_LINE).count() as u64)
        })
        .collect();
    drop(w);

    let history = rec.snapshot();
    let report = saga_checker::check(&history);
    write_results(&dir, &o, &history, &report, interrupted, &lost)?;
    Ok(RunResult {
        dir,
        valid: report.valid,
    })
}

/// Completed start calls as plot samples (completion time, latency,
/// outcome).
fn samples(history: &[Op]) -> Vec<plot::Sample> {
    let mut invoked: BTreeMap<&str, u64> = BTreeMap::new();
    let mut out = Vec::new();
    for op in history {
        if !matches!(op.body, Body::Saga(SagaEvent::Start { .. })) {
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
    dir: &std::path::Path,
    o: &RunOptions,
    history: &[Op],
    report: &saga_checker::SagaReport,
    interrupted: bool,
    lost: &[(String, u64)],
) -> anyhow::Result<()> {
    let end_s = history.last().map(|op| op.time_ns as f64 / 1e9).unwrap_or(0.0);
    let samples = samples(history);
    let faults = crate::runner::fault_intervals(history, end_s);
    let title = format!("dtx jepsen saga seed {} ({} s): StartSaga calls", o.seed, o.time_s);
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
    let results = serde_json::json!({
        "workload": "saga",
        "valid": report.valid,
        "interrupted": interrupted,
        "seed": o.seed,
        "time_s": o.time_s,
        "tls": o.tls,
        "inventory_store": o.inventory_store.name(),
        "nemeses": o.faults.iter().map(|f| f.name()).collect::<Vec<_>>(),
        "command": o.command,
        "crash_points": crash_notes,
        "outside_lost_replies": lost.iter().cloned().collect::<BTreeMap<String, u64>>(),
        "report": report,
    });
    std::fs::write(dir.join("results.json"), serde_json::to_string_pretty(&results)?)?;
    let mut summary = format!(
        "dtx jepsen saga run: seed {}, {} s, inventory on {}, nemeses [{}]{}{}\nreproduce: {}\n\n",
        o.seed,
        o.time_s,
        o.inventory_store.name(),
        o.faults.iter().map(|f| f.name()).collect::<Vec<_>>().join(","),
        if o.tls { ", TLS" } else { "" },
        if interrupted { " (interrupted)" } else { "" },
        o.command
    );
    summary.push_str(&report.summary());
    if !lost.is_empty() {
        let said: Vec<String> = lost.iter().map(|(who, n)| format!("{who} {n}")).collect();
        summary.push_str(&format!(
            "outside world: replies lost on purpose after the work was done: {}\n",
            said.join(", ")
        ));
    }
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
