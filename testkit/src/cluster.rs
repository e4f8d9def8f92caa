//! A supervisor for local node *processes*: writes one config per node,
//! starts `coordinator serve` children, kills them with SIGKILL or stops them
//! with SIGTERM, and finds the leader. Used by `dtx-dev dev`, the bench
//! and the integration tests, so all of them run real processes on real
//! sockets. `BankProcess` does the same for the example bank's participant
//! services (`dtx-dev bank-serve`): demo, bench, tests and jepsen-tests.

use std::fs;
use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;

use tokio::time::Instant;

use coordinator::config::Config;
use coordinator::config::Member;
use dtx_client::cluster_status_as;

/// One bank participant service: `dtx-dev bank-serve` on its own
/// loopback address and data directory, or (built with
/// [`BankProcess::new_postgres`]) on a PostgreSQL database.
pub struct BankProcess {
    /// The process: its id, address, log, and start / kill / stop.
    pub service: ServiceProcess,
    pub prefix: String,
    pub ip: String,
    /// The sled store's directory (unused, never created, for a PostgreSQL
    /// bank).
    pub data_dir: PathBuf,
    /// The PostgreSQL connection string of a PostgreSQL bank.
    pub postgres: Option<String>,
    /// The Python SDK's example bank (`sdk/python/examples/bank.py`, built
    /// with [`BankProcess::python`]): its SQLite file is `bank.db` in
    /// `data_dir`.
    pub python: Option<PythonBank>,
    bin: PathBuf,
    pub accounts: usize,
    pub initial: i64,
}

impl std::ops::Deref for BankProcess {
    type Target = ServiceProcess;
    fn deref(&self) -> &ServiceProcess {
        &self.service
    }
}

impl std::ops::DerefMut for BankProcess {
    fn deref_mut(&mut self) -> &mut ServiceProcess {
        &mut self.service
    }
}

/// How a bank written in Python is run: the interpreter and the script.
#[derive(Clone, Debug)]
pub struct PythonBank {
    pub python: PathBuf,
    pub script: PathBuf,
}

impl BankProcess {
    /// The same bank written with the Python SDK: `python script serve`
    /// with the accounts in `<dir>/<id>/bank.db` (the directory made now,
    /// so a filesystem can be mounted on it). It speaks the same payloads
    /// and answers the same audit ([`BankProcess::audit`] converts it).
    #[allow(clippy::too_many_arguments)]
    pub fn python(
        py: &PythonBank,
        dir: &Path,
        id: &str,
        prefix: &str,
        ip: &str,
        port: u16,
        cluster: Vec<String>,
        accounts: usize,
        initial: i64,
    ) -> std::io::Result<BankProcess> {
        let addr = format!("{ip}:{port}");
        let data_dir = dir.join(id);
        fs::create_dir_all(&data_dir)?;
        let args: Vec<std::ffi::OsString> = vec![
            py.script.clone().into_os_string(),
            "serve".into(),
            "--listen".into(),
            addr.clone().into(),
            "--id".into(),
            id.into(),
            "--db".into(),
            data_dir.join("bank.db").into_os_string(),
            "--prefix".into(),
            prefix.into(),
            "--accounts".into(),
            accounts.to_string().into(),
            "--initial".into(),
            initial.to_string().into(),
            "--cluster".into(),
            cluster.join(",").into(),
            // A rollback journal: the harness may mount its power-cut
            // filesystem here, which cannot map WAL's shared memory.
            "--journal-mode".into(),
            "delete".into(),
        ];
        Ok(BankProcess {
            service: ServiceProcess::new(&py.python, dir, id, &addr, args),
            prefix: prefix.to_string(),
            ip: ip.to_string(),
            data_dir,
            postgres: None,
            python: Some(py.clone()),
            bin: py.python.clone(),
            accounts,
            initial,
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn new(
        bin: &Path,
        dir: &Path,
        id: &str,
        prefix: &str,
        ip: &str,
        port: u16,
        cluster: Vec<String>,
        accounts: usize,
        initial: i64,
    ) -> BankProcess {
        Self::build(bin, dir, id, prefix, ip, port, cluster, accounts, initial, None)
    }

    /// `new`, or with `postgres` (a connection string) the same bank on
    /// PostgreSQL: `bank-serve --postgres <conn>` (the database must exist;
    /// the service creates its tables).
    #[allow(clippy::too_many_arguments)]
    pub fn build(
        bin: &Path,
        dir: &Path,
        id: &str,
        prefix: &str,
        ip: &str,
        port: u16,
        cluster: Vec<String>,
        accounts: usize,
        initial: i64,
        postgres: Option<String>,
    ) -> BankProcess {
        let addr = format!("{ip}:{port}");
        let data_dir = dir.join(id);
        let mut args: Vec<std::ffi::OsString> = [
            "bank-serve",
            "--id",
            id,
            "--prefix",
            prefix,
            "--listen",
            &addr,
            "--cluster",
            &cluster.join(","),
            "--accounts",
            &accounts.to_string(),
            "--initial",
            &initial.to_string(),
        ]
        .iter()
        .map(Into::into)
        .collect();
        match &postgres {
            Some(conn) => args.extend(["--postgres".into(), conn.into()]),
            None => args.extend(["--data-dir".into(), data_dir.clone().into_os_string()]),
        }
        BankProcess {
            service: ServiceProcess::new(bin, dir, id, &addr, args),
            prefix: prefix.to_string(),
            ip: ip.to_string(),
            data_dir,
            postgres,
            python: None,
            bin: bin.to_path_buf(),
            accounts,
            initial,
        }
    }

    /// Reads the stopped service's store with `dtx-dev bank-audit
    /// --json`: balances, locks, in-doubt count and apply log (a PostgreSQL
    /// bank: its database, with `bank-audit --json --postgres`, which also
    /// lists the prepared transactions under `prepared`).
    /// `(participant id, address, account prefix)`: how transfers
    /// (`dtx_bank::transfer`) name this bank.
    pub fn spec(&self) -> (String, String, String) {
        (self.id.clone(), self.addr.clone(), self.prefix.clone())
    }

    pub fn audit(&self) -> anyhow::Result<serde_json::Value> {
        if let Some(py) = &self.python {
            return self.python_audit(py);
        }
        let mut cmd = Command::new(&self.bin);
        match &self.postgres {
            Some(conn) => cmd.args(["bank-audit", "--json", "--postgres", conn]),
            None => cmd.args(["bank-audit", "--json", "--data-dir"]).arg(&self.data_dir),
        };
        let out = cmd.output()?;
        anyhow::ensure!(
            out.status.success(),
            "bank-audit of {} failed: {}",
            self.id,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    /// A Python bank's audit (`bank.py audit --db`) in the shape of
    /// `bank-audit --json`: `balances`, `locked`, `in_doubt`, `applied`
    /// (`{txid, outcome}` per decision applied, a txid applied twice shown
    /// twice) and, for its in-doubt list, `prepared_work` (`{txid, work}`:
    /// the payload each prepared transaction holds).
    fn python_audit(&self, py: &PythonBank) -> anyhow::Result<serde_json::Value> {
        let out = Command::new(&py.python)
            .arg(&py.script)
            .args(["audit", "--db"])
            .arg(self.data_dir.join("bank.db"))
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "bank.py audit of {} failed: {}",
            self.id,
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        // "txid" for incarnation 0, "txid@<16 hex>" otherwise: the txid.
        let txid = |tx: &str| tx.split('@').next().and_then(|t| t.parse::<u64>().ok());
        let mut applied = Vec::new();
        for (tx, outcomes) in v["applog"].as_object().into_iter().flatten() {
            let Some(t) = txid(tx) else { continue };
            for o in outcomes.as_array().into_iter().flatten() {
                applied.push(serde_json::json!({"txid": t, "outcome": o}));
            }
        }
        let prepared_work: Vec<serde_json::Value> = v["prepared"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| Some(serde_json::json!({"txid": txid(p["tx"].as_str()?)?, "work": p["work"]})))
            .collect();
        Ok(serde_json::json!({
            "data_dir": self.data_dir.display().to_string(),
            "balances": v["balances"],
            "locked": v["locks"].as_object().map(|m| m.len()).unwrap_or(0),
            "in_doubt": v["in_doubt"],
            "applied": applied,
            "prepared_work": prepared_work,
        }))
    }
}

/// A participant service run as a child process of `bin` with fixed
/// arguments (`dtx-dev bank-serve ...`, `dtx-dev shop-serve ...`),
/// its output appended to `<dir>/<id>.log`, in its own process group;
/// killed with SIGKILL when dropped.
pub struct ServiceProcess {
    pub id: String,
    pub addr: String,
    pub log_path: PathBuf,
    bin: PathBuf,
    args: Vec<std::ffi::OsString>,
    child: Option<Child>,
}

impl ServiceProcess {
    pub fn new(bin: &Path, dir: &Path, id: &str, addr: &str, args: Vec<std::ffi::OsString>) -> ServiceProcess {
        ServiceProcess {
            id: id.to_string(),
            addr: addr.to_string(),
            log_path: dir.join(format!("{id}.log")),
            bin: bin.to_path_buf(),
            args,
            child: None,
        }
    }

    /// The running process's id, if started.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Waits up to 10 s for the started service to listen; an error names
    /// it and its log. A process that exits first is an error at once (it
    /// will not listen); `wait_for_exit` then reaps it (its exit may show
    /// in /proc a moment before `is_running` sees it).
    pub async fn wait_started(&self) -> anyhow::Result<()> {
        let until = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if tokio::net::TcpStream::connect(&self.addr).await.is_ok() {
                return Ok(());
            }
            if self.pid().is_some_and(|p| !dtx_pg_server::process_running(p)) {
                anyhow::bail!(
                    "{} exited before it listened; see its log {}",
                    self.id,
                    self.log_path.display()
                );
            }
            anyhow::ensure!(
                std::time::Instant::now() < until,
                "{} did not start within 10 s; see its log {}",
                self.id,
                self.log_path.display()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the process ends by itself; `None` if none was running.
    pub fn wait(&mut self) -> Option<std::process::ExitStatus> {
        self.child.take().and_then(|mut c| c.wait().ok())
    }

    /// Waits up to `timeout` for the process to end by itself: its exit
    /// status, or `None` if it is still running (or none was).
    pub async fn wait_for_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let until = std::time::Instant::now() + timeout;
        loop {
            let status = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = status {
                self.child = None;
                return Some(status);
            }
            if self.child.is_none() || std::time::Instant::now() >= until {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Adds command-line flags (for example `TlsArgs::to_flags`).
    pub fn add_args(&mut self, more: impl IntoIterator<Item = String>) {
        self.args.extend(more.into_iter().map(Into::into));
    }

    /// Starts the service (no-op if running) with extra environment.
    pub fn start(&mut self, env: &[(String, String)]) -> std::io::Result<()> {
        if self.is_running() {
            return Ok(());
        }
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)?;
        let child = Command::new(&self.bin)
            .process_group(0)
            .args(&self.args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    pub fn signal(&mut self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on a child pid we own; no memory is touched.
            unsafe {
                libc::kill(c.id() as i32, sig);
            }
        }
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGCONT (in case it is paused), SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        self.signal(libc::SIGCONT);
        self.signal(libc::SIGTERM);
        if let Some(mut c) = self.child.take() {
            let until = std::time::Instant::now() + grace;
            while std::time::Instant::now() < until {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Waits until something accepts TCP connections on `addr`.
pub async fn wait_listening(addr: &str, timeout: Duration) -> bool {
    let until = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < until {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// Where one node listens and what it advertises (they differ when a test
/// puts a proxy in front of it).
#[derive(Clone, Debug)]
pub struct NodePlan {
    pub id: u64,
    pub raft_listen: String,
    pub api_listen: String,
    pub raft_advertise: String,
    pub api_advertise: String,
}

pub struct NodeProc {
    pub plan: NodePlan,
    pub config: Config,
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    child: Option<Child>,
}

impl NodeProc {
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }
}

pub struct ProcessCluster {
    pub dir: PathBuf,
    pub bin: PathBuf,
    pub nodes: Vec<NodeProc>,
    /// Extra environment for every node process (e.g. crash points).
    pub env: Vec<(String, String)>,
    /// TLS of the supervisor's own status calls (an operator's
    /// certificate), for a cluster running with TLS.
    pub client_tls: Option<std::sync::Arc<dtx_tls::ClientTls>>,
    /// A bearer token (an operator's) for those calls, for a cluster that
    /// takes tokens.
    pub client_token: Option<String>,
}

/// What a node's log says about why it exited: the error it printed on the
/// way out (`Error: ...` and its causes, without the backtrace that
/// `RUST_BACKTRACE` adds), or else its last five lines.
fn exit_words(log: &str) -> Vec<&str> {
    let lines: Vec<&str> = log.lines().collect();
    match lines.iter().rposition(|l| l.starts_with("Error: ")) {
        Some(at) => lines[at..]
            .iter()
            .take_while(|l| !l.starts_with("Stack backtrace:"))
            .filter(|l| !l.trim().is_empty())
            .take(8)
            .copied()
            .collect(),
        None => lines[lines.len().saturating_sub(5)..].to_vec(),
    }
}

/// A free TCP port on `ip` for a process about to be started, from outside
/// the kernel's ephemeral range (see `dtx_ports` for why).
pub use dtx_ports::free_port;

impl ProcessCluster {
    /// Writes configs for `plans` under `dir`; node 1 bootstraps the cluster.
    /// `tune` may adjust every node's config (timeouts, batch settings).
    pub fn new(
        bin: &Path,
        dir: &Path,
        cluster_id: &str,
        plans: Vec<NodePlan>,
        tune: impl Fn(&mut Config),
    ) -> std::io::Result<ProcessCluster> {
        fs::create_dir_all(dir)?;
        let members: Vec<Member> = plans
            .iter()
            .map(|p| Member {
                id: p.id,
                raft_addr: p.raft_advertise.clone(),
                api_addr: p.api_advertise.clone(),
            })
            .collect();
        let mut nodes = Vec::new();
        for (i, p) in plans.into_iter().enumerate() {
            let mut c = Config {
                node_id: p.id,
                cluster_id: cluster_id.to_string(),
                data_dir: dir.join(format!("node{}", p.id)),
                raft_addr: p.raft_listen.clone(),
                api_addr: p.api_listen.clone(),
                ..Config::default()
            };
            c.bootstrap.enabled = i == 0;
            c.bootstrap.members = members.clone();
            tune(&mut c);
            let config_path = dir.join(format!("node{}.toml", p.id));
            fs::write(&config_path, toml::to_string(&c).map_err(std::io::Error::other)?)?;
            nodes.push(NodeProc {
                log_path: dir.join(format!("node{}.log", p.id)),
                plan: p,
                config: c,
                config_path,
                child: None,
            });
        }
        Ok(ProcessCluster {
            dir: dir.to_path_buf(),
            bin: bin.to_path_buf(),
            nodes,
            env: Vec::new(),
            client_tls: None,
            client_token: None,
        })
    }

    /// Plans `n` nodes on `ip` with free ports, no proxies.
    pub fn plan_local(ip: &str, n: u64) -> std::io::Result<Vec<NodePlan>> {
        (1..=n)
            .map(|id| {
                let raft = format!("{ip}:{}", free_port(ip)?);
                let api = format!("{ip}:{}", free_port(ip)?);
                Ok(NodePlan {
                    id,
                    raft_listen: raft.clone(),
                    api_listen: api.clone(),
                    raft_advertise: raft,
                    api_advertise: api,
                })
            })
            .collect()
    }

    pub fn node(&mut self, id: u64) -> &mut NodeProc {
        self.nodes.iter_mut().find(|n| n.plan.id == id).expect("no such node")
    }

    pub fn api_addrs(&self) -> Vec<String> {
        self.nodes.iter().map(|n| n.plan.api_listen.clone()).collect()
    }

    pub fn start(&mut self, id: u64) -> std::io::Result<()> {
        let bin = self.bin.clone();
        let env = self.env.clone();
        let n = self.node(id);
        if n.is_running() {
            return Ok(());
        }
        let log = fs::OpenOptions::new().create(true).append(true).open(&n.log_path)?;
        use std::os::unix::process::CommandExt;
        let child = Command::new(&bin)
            // Its own process group: a Ctrl-C in the terminal reaches only
            // the supervisor, which then stops the nodes in order.
            .process_group(0)
            .arg("serve")
            .arg("--config")
            .arg(&n.config_path)
            .env(
                "RUST_LOG",
                std::env::var("DTX_NODE_LOG").unwrap_or_else(|_| "info,openraft=warn".into()),
            )
            .envs(env)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        n.child = Some(child);
        Ok(())
    }

    pub fn start_all(&mut self) -> std::io::Result<()> {
        let ids: Vec<u64> = self.nodes.iter().map(|n| n.plan.id).collect();
        for id in ids {
            self.start(id)?;
        }
        Ok(())
    }

    /// SIGKILL, no chance to flush or say goodbye.
    pub fn kill9(&mut self, id: u64) {
        if let Some(mut c) = self.node(id).child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends a signal (SIGSTOP, SIGCONT, SIGTERM, ...) to a node process.
    pub fn signal(&mut self, id: u64, sig: i32) {
        if let Some(pid) = self.node(id).pid() {
            // SAFETY: kill(2) on a child pid we own; no memory is touched.
            unsafe {
                libc::kill(pid as i32, sig);
            }
        }
    }

    /// SIGTERM, then wait up to `grace` before SIGKILL. Returns the exit
    /// status when the node exited by itself.
    pub fn stop(&mut self, id: u64, grace: Duration) -> Option<std::process::ExitStatus> {
        self.signal(id, libc::SIGTERM);
        let n = self.node(id);
        let mut child = n.child.take()?;
        let until = std::time::Instant::now() + grace;
        while std::time::Instant::now() < until {
            if let Ok(Some(st)) = child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    pub fn stop_all(&mut self, grace: Duration) {
        let ids: Vec<u64> = self.nodes.iter().map(|n| n.plan.id).collect();
        for id in ids {
            self.stop(id, grace);
        }
    }

    /// Waits until a node that is running reports itself leader and every
    /// running node agrees on it; returns its id.
    pub async fn wait_for_leader(&mut self, timeout: Duration) -> Option<u64> {
        let until = Instant::now() + timeout;
        while Instant::now() < until {
            let mut seen = Vec::new();
            let addrs: Vec<(u64, String)> = self
                .nodes
                .iter_mut()
                .filter_map(|n| {
                    if n.is_running() {
                        Some((n.plan.id, n.plan.api_listen.clone()))
                    } else {
                        None
                    }
                })
                .collect();
            for (id, addr) in &addrs {
                if let Ok(s) = cluster_status_as(
                    addr,
                    Duration::from_millis(300),
                    self.client_tls.as_ref(),
                    self.client_token.as_deref(),
                )
                .await
                {
                    seen.push((*id, s.leader_id, s.role.clone()));
                }
            }
            if let Some((lid, _, _)) = seen.iter().find(|(id, l, role)| id == l && role == "Leader") {
                if seen.len() == addrs.len() && seen.iter().all(|(_, l, _)| l == lid) {
                    return Some(*lid);
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// Waits until node `id` says it serves (`ClusterStatus.serving`: it
    /// knows a leader that heard from a majority lately) and every running
    /// node holds the cluster's membership: a cluster just bootstrapped has
    /// a leader a moment before it serves, and `admin status` exits 6 until
    /// then. False if not within `timeout`.
    pub async fn wait_serving(&mut self, id: u64, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        while Instant::now() < until {
            let addrs: Vec<String> = self
                .nodes
                .iter_mut()
                .filter_map(|n| n.is_running().then(|| n.plan.api_listen.clone()))
                .collect();
            let Some(addr) = self
                .nodes
                .iter()
                .find(|n| n.plan.id == id)
                .map(|n| n.plan.api_listen.clone())
            else {
                return false;
            };
            let status = |a: String| {
                let tls = self.client_tls.clone();
                let token = self.client_token.clone();
                async move { cluster_status_as(&a, Duration::from_millis(300), tls.as_ref(), token.as_deref()).await }
            };
            let serves = matches!(status(addr).await, Ok(s) if s.serving);
            let mut all_members = serves;
            for a in addrs {
                if !all_members {
                    break;
                }
                all_members = matches!(status(a).await, Ok(s) if !s.members.is_empty());
            }
            if all_members {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        false
    }

    /// [`Self::wait_for_leader`], or an error that says why not: each node
    /// that has exited, with its exit status and the last lines of its log
    /// (a port another process took, a bad configuration), and where the
    /// logs are.
    pub async fn leader_within(&mut self, timeout: Duration) -> anyhow::Result<u64> {
        if let Some(leader) = self.wait_for_leader(timeout).await {
            return Ok(leader);
        }
        let mut why = String::new();
        for n in &mut self.nodes {
            let status = match n.child.as_mut().map(|c| c.try_wait()) {
                Some(Ok(Some(status))) => status.to_string(),
                Some(Ok(None)) => continue,
                Some(Err(e)) => format!("state unknown ({e})"),
                None => "not started".to_string(),
            };
            let log = fs::read_to_string(&n.log_path).unwrap_or_default();
            why.push_str(&format!(
                "\n  node {} is down ({status}); its log ends:\n    {}",
                n.plan.id,
                exit_words(&log).join("\n    ")
            ));
        }
        if why.is_empty() {
            why = "\n  every node is running, but they agree on no leader".to_string();
        }
        anyhow::bail!(
            "no leader within {} s:{why}\n  the node logs are in {}",
            timeout.as_secs(),
            self.dir.display()
        )
    }

    /// The id of a node that currently believes it is the leader.
    pub async fn current_leader(&mut self) -> Option<u64> {
        for n in &self.nodes {
            if let Ok(s) = cluster_status_as(
                &n.plan.api_listen,
                Duration::from_millis(300),
                self.client_tls.as_ref(),
                self.client_token.as_deref(),
            )
            .await
            {
                if s.role == "Leader" && s.leader_id == n.plan.id {
                    return Some(n.plan.id);
                }
            }
        }
        None
    }
}

impl Drop for ProcessCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Starts one bank service on a free loopback port (its log and data under
/// `dir`).
pub fn start_bank(
    bin: &std::path::Path,
    dir: &std::path::Path,
    id: &str,
    prefix: &str,
    cluster: &[String],
    accounts: usize,
    initial: i64,
) -> anyhow::Result<BankProcess> {
    start_bank_with(bin, dir, id, prefix, cluster, accounts, initial, |_| Vec::new())
}

/// As [`start_bank`], with more flags for the bank's address (for
/// example its TLS flags, whose certificate must name that address).
#[allow(clippy::too_many_arguments)]
pub fn start_bank_with(
    bin: &std::path::Path,
    dir: &std::path::Path,
    id: &str,
    prefix: &str,
    cluster: &[String],
    accounts: usize,
    initial: i64,
    flags_for: impl FnOnce(&str) -> Vec<String>,
) -> anyhow::Result<BankProcess> {
    let port = free_port("127.0.0.1")?;
    let mut b = BankProcess::new(
        bin,
        dir,
        id,
        prefix,
        "127.0.0.1",
        port,
        cluster.to_vec(),
        accounts,
        initial,
    );
    let flags = flags_for(&b.addr.clone());
    b.service.add_args(flags);
    b.start(&[])?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nodes_exit_words_are_its_error_without_the_backtrace() {
        let log = "2026-12-02T00:46:09Z  WARN coordinator::security: no TLS\n\
                   Error: cannot listen on raft_addr 127.0.0.1:32200\n\
                   \n\
                   Caused by:\n    Address already in use (os error 98)\n\
                   \n\
                   Stack backtrace:\n   0: anyhow::error::<impl anyhow::Error>::msg\n   1: _start\n";
        assert_eq!(
            exit_words(log),
            [
                "Error: cannot listen on raft_addr 127.0.0.1:32200",
                "Caused by:",
                "    Address already in use (os error 98)"
            ]
        );
        // No error printed (killed, say): the last lines.
        let log: String = (1..=9).map(|i| format!("line {i}\n")).collect();
        assert_eq!(exit_words(&log), ["line 5", "line 6", "line 7", "line 8", "line 9"]);
        assert!(exit_words("").is_empty());
    }
}
