//! `dtx-dev dev`: a local three-node cluster of real node processes on
//! loopback. Prints where its data lives and where to connect, reports leader
//! changes, reports a node that exits (once) and starts exited nodes again
//! when Enter is pressed, and stops every node cleanly on Ctrl-C.

use std::future::Future;
use std::path::Path;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use dtx_testkit::cluster::NodePlan;
use dtx_testkit::cluster::ProcessCluster;
use dtx_testkit::pki::DevPki;
use dtx_tls::files::KeyPairFiles;
use dtx_tls::Role;

/// Prints a line to stdout, ignoring a closed stdout: the supervisor must
/// still stop its nodes in order when whoever read its output went away
/// (`println!` would panic on the broken pipe and leave them running).
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($t)*);
    }};
}

#[derive(clap::Args, Debug)]
pub struct DevArgs {
    /// Data directory of the dev cluster (kept between runs).
    #[arg(long, default_value = ".dtx-dev")]
    pub data_dir: PathBuf,
    /// Node i listens on 127.0.0.1:(base_port+i) for Raft,
    /// 127.0.0.1:(base_port+100+i) for the API and
    /// 127.0.0.1:(base_port+200+i) for Prometheus metrics.
    #[arg(long, default_value_t = 7100)]
    pub base_port: u16,
    /// Delete the data directory first.
    #[arg(long)]
    pub fresh: bool,
    /// TLS on every port and link, with a throwaway certificate authority
    /// made in <data-dir>/tls (kept between runs; never for production):
    /// a certificate per node, an operator's and an application's, and an
    /// application token (the API port takes a certificate or a token).
    #[arg(long)]
    pub tls: bool,
}

/// The TLS material of a dev cluster, in `<data-dir>/tls`.
pub struct DevTls {
    pub pki_dir: PathBuf,
    pub ca: PathBuf,
    pub operator: KeyPairFiles,
    pub application: KeyPairFiles,
    pub token_file: PathBuf,
    pub token_sha256: String,
}

impl DevTls {
    /// The node certificate files of node `id` (made by [`DevTls::make`]).
    pub fn node(&self, id: u64) -> KeyPairFiles {
        KeyPairFiles {
            cert: self.pki_dir.join(format!("node-{id}.pem")),
            key: self.pki_dir.join(format!("node-{id}.key")),
        }
    }

    /// Sets a node's TLS and token settings.
    pub fn apply(&self, c: &mut coordinator::config::Config) {
        let n = self.node(c.node_id);
        c.tls.cert = Some(n.cert);
        c.tls.key = Some(n.key);
        c.tls.ca = Some(self.ca.clone());
        c.tls.client_auth = "optional".into();
        c.auth.tokens = vec![coordinator::config::TokenConfig {
            role: "application".into(),
            name: "dev-token-app".into(),
            sha256: self.token_sha256.clone(),
        }];
    }

    /// Makes the authority and every certificate in `pki_dir` unless they
    /// are there already from an earlier run, for nodes 1..=`nodes`.
    pub fn make(pki_dir: &Path, nodes: u64) -> anyhow::Result<DevTls> {
        let token_file = pki_dir.join("application.token");
        let files = |role: Role, name: &str| KeyPairFiles {
            cert: pki_dir.join(format!("{role}-{name}.pem")),
            key: pki_dir.join(format!("{role}-{name}.key")),
        };
        let operator = files(Role::Operator, "dev");
        let application = files(Role::Application, "dev-app");
        let complete = [&pki_dir.join("ca.pem"), &operator.cert, &application.cert, &token_file]
            .iter()
            .all(|p| p.exists())
            && (1..=nodes).all(|i| pki_dir.join(format!("node-{i}.pem")).exists());
        if !complete {
            let pki = DevPki::create(pki_dir, "dtx dev cluster")?;
            for i in 1..=nodes {
                pki.issue(Role::Node, &i.to_string(), &[])?;
            }
            pki.issue(Role::Operator, "dev", &[])?;
            pki.issue(Role::Application, "dev-app", &[])?;
            dtx_tls::dev::write_file(&token_file, dtx_tls::identity::new_token().as_bytes(), true)?;
        }
        let token =
            std::fs::read_to_string(&token_file).with_context(|| format!("cannot read {}", token_file.display()))?;
        Ok(DevTls {
            pki_dir: pki_dir.to_path_buf(),
            ca: pki_dir.join("ca.pem"),
            operator,
            application,
            token_file,
            token_sha256: dtx_tls::identity::token_sha256_hex(token.trim()),
        })
    }

    /// The flags of a command using `own`.
    pub fn flags(&self, own: &KeyPairFiles) -> String {
        format!(
            "--tls-ca {} --tls-cert {} --tls-key {}",
            self.ca.display(),
            own.cert.display(),
            own.key.display()
        )
    }
}

pub fn dev_plans(base_port: u16) -> Vec<NodePlan> {
    (1..=3u16)
        .map(|i| {
            let raft = format!("127.0.0.1:{}", base_port + i);
            let api = format!("127.0.0.1:{}", base_port + 100 + i);
            NodePlan {
                id: i as u64,
                raft_listen: raft.clone(),
                api_listen: api.clone(),
                raft_advertise: raft,
                api_advertise: api,
            }
        })
        .collect()
}

pub async fn run(args: DevArgs, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    if args.fresh && args.data_dir.exists() {
        std::fs::remove_dir_all(&args.data_dir)
            .with_context(|| format!("cannot remove {}", args.data_dir.display()))?;
    }
    std::fs::create_dir_all(&args.data_dir)?;
    let dir = args.data_dir.canonicalize()?;
    let bin = std::env::current_exe().context("cannot find the coordinator binary")?;
    let base = args.base_port;
    let tls = if args.tls {
        Some(DevTls::make(&dir.join("tls"), 3)?)
    } else {
        None
    };
    let mut cluster = ProcessCluster::new(&bin, &dir, "dtx-dev", dev_plans(base), |c| {
        c.metrics_addr = Some(format!("127.0.0.1:{}", base as u64 + 200 + c.node_id));
        if let Some(t) = &tls {
            t.apply(c);
        }
    })?;
    if let Some(t) = &tls {
        cluster.client_tls = dtx_tls::args::TlsArgs {
            tls_cert: Some(t.operator.cert.clone()),
            tls_key: Some(t.operator.key.clone()),
            tls_ca: Some(t.ca.clone()),
            ..Default::default()
        }
        .client()?;
    }
    cluster.start_all()?;
    say!("dtx dev cluster: 3 nodes");
    say!("  data directory: {}", dir.display());
    for n in &cluster.nodes {
        say!(
            "  node {}: api {}  raft {}  metrics http://{}/metrics  log {}",
            n.plan.id,
            n.plan.api_listen,
            n.plan.raft_listen,
            n.config.metrics_addr.as_deref().unwrap_or("-"),
            n.log_path.display()
        );
    }
    let leader = cluster.wait_for_leader(Duration::from_secs(30)).await;
    // The commands printed below work once the cluster serves (a leader
    // that heard from a majority, members that know the membership), a
    // moment after the leader is known; `admin status` exits 6 before.
    let serving = match leader {
        Some(id) => cluster.wait_serving(id, Duration::from_secs(30)).await,
        None => false,
    };
    match (leader, serving) {
        (Some(id), true) => say!("leader: node {id}. Serving until Ctrl-C."),
        (Some(id), false) => say!("leader: node {id}, but the cluster does not serve yet; see the node logs."),
        (None, _) => say!("no leader yet; see the node logs. Serving until Ctrl-C."),
    }
    match &tls {
        None => say!("try: coordinator admin --addr {} status", cluster.api_addrs().join(",")),
        Some(t) => {
            say!(
                "TLS on every port (authority {}, throwaway: never for production)",
                t.ca.display()
            );
            say!(
                "try: coordinator admin --addr {} {} status",
                cluster.api_addrs().join(","),
                t.flags(&t.operator)
            );
            say!("  an application's certificate: {}", t.flags(&t.application));
            say!(
                "  or its token (API port, no certificate): --tls-ca {} --token-file {}",
                t.ca.display(),
                t.token_file.display()
            );
        }
    }
    // Enter on stdin starts exited nodes again. A node that exits is not
    // restarted by itself: it may have been stopped on purpose (to watch a
    // failover), or it may fail again at once (a port in use, a full disk),
    // and a restart loop would hide that.
    let mut enter = Some(stdin_lines());
    let mut reported = std::collections::BTreeSet::new();
    tokio::pin!(shutdown);
    let mut last = leader;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            line = async { enter.as_mut().expect("guarded").recv().await }, if enter.is_some() => {
                if line.is_none() {
                    // stdin closed (not a terminal): nothing more to read.
                    enter = None;
                    continue;
                }
                let mut started = false;
                let exited: Vec<u64> = cluster
                    .nodes
                    .iter_mut()
                    .filter_map(|n| (!n.is_running()).then_some(n.plan.id))
                    .collect();
                for n in exited {
                    match cluster.start(n) {
                        Ok(()) => say!("node {n}: started again"),
                        Err(e) => say!("node {n}: cannot start it again: {e}"),
                    }
                    reported.remove(&n);
                    started = true;
                }
                if !started {
                    say!("every node is running");
                }
            }
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                for n in cluster.nodes.iter_mut() {
                    if !n.is_running() && reported.insert(n.plan.id) {
                        say!(
                            "node {} exited; its log is {}. Press Enter here to start it again (its data is kept).",
                            n.plan.id,
                            n.log_path.display()
                        );
                    }
                }
                let now = cluster.current_leader().await;
                if now != last {
                    say!("leader: {}", now.map(|i| format!("node {i}")).unwrap_or_else(|| "none".into()));
                    last = now;
                }
            }
        }
    }
    say!("stopping the dev cluster...");
    cluster.stop_all(Duration::from_secs(10));
    say!("stopped; data kept in {}", dir.display());
    Ok(())
}

/// Lines typed on stdin, read on a thread of their own (stdin has no async
/// reader that can be cancelled); the channel closes at end of input.
fn stdin_lines() -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        loop {
            line.clear();
            match std::io::stdin().read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if tx.send(line.clone()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    rx
}
