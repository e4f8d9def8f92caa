//! `coordinator dev`: a local three-node cluster of real node processes on
//! loopback. Prints where its data lives and where to connect, reports leader
//! changes, reports a node that exits (once) and starts exited nodes again
//! when Enter is pressed, and stops every node cleanly on Ctrl-C.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use dtx_testkit::cluster::NodePlan;
use dtx_testkit::cluster::ProcessCluster;

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
    let mut cluster = ProcessCluster::new(&bin, &dir, "dtx-dev", dev_plans(base), |c| {
        c.metrics_addr = Some(format!("127.0.0.1:{}", base as u64 + 200 + c.node_id));
    })?;
    cluster.start_all()?;
    println!("dtx dev cluster: 3 nodes");
    println!("  data directory: {}", dir.display());
    for n in &cluster.nodes {
        println!(
            "  node {}: api {}  raft {}  metrics http://{}/metrics  log {}",
            n.plan.id,
            n.plan.api_listen,
            n.plan.raft_listen,
            n.config.metrics_addr.as_deref().unwrap_or("-"),
            n.log_path.display()
        );
    }
    let leader = cluster.wait_for_leader(Duration::from_secs(30)).await;
    match leader {
        Some(id) => println!("leader: node {id}. Serving until Ctrl-C."),
        None => println!("no leader yet; see the node logs. Serving until Ctrl-C."),
    }
    println!("try: coordinator admin --addr {} status", cluster.api_addrs().join(","));
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
                        Ok(()) => println!("node {n}: started again"),
                        Err(e) => println!("node {n}: cannot start it again: {e}"),
                    }
                    reported.remove(&n);
                    started = true;
                }
                if !started {
                    println!("every node is running");
                }
            }
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                for n in cluster.nodes.iter_mut() {
                    if !n.is_running() && reported.insert(n.plan.id) {
                        println!(
                            "node {} exited; its log is {}. Press Enter here to start it again (its data is kept).",
                            n.plan.id,
                            n.log_path.display()
                        );
                    }
                }
                let now = cluster.current_leader().await;
                if now != last {
                    println!("leader: {}", now.map(|i| format!("node {i}")).unwrap_or_else(|| "none".into()));
                    last = now;
                }
            }
        }
    }
    println!("stopping the dev cluster...");
    cluster.stop_all(Duration::from_secs(10));
    println!("stopped; data kept in {}", dir.display());
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
