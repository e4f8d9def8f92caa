//! `coordinator dev`: a local three-node cluster of real node processes on
//! loopback. Prints where its data lives and where to connect, reports leader
//! changes, and stops every node cleanly on Ctrl-C.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::cluster::NodePlan;
use crate::cluster::ProcessCluster;

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
    tokio::pin!(shutdown);
    let mut last = leader;
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {
                for n in cluster.nodes.iter_mut() {
                    if !n.is_running() {
                        println!("node {} exited; see {}", n.plan.id, n.log_path.display());
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
