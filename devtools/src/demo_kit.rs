//! What the demos share (`demo`, the banks; `demo --postgres`, the shop;
//! `demo --saga`, the order saga): their arguments and working directory,
//! the 2PC clients' counts and progress line, the leader kills, and the
//! look-up of outcomes the clients did not learn.

use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::time::Duration;
use std::time::Instant;

use anyhow::Context;
use dtx_client::Client;
use dtx_client::DecisionRead;
use dtx_testkit::cluster::ProcessCluster;

#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// Seconds of transfers.
    #[arg(long, default_value_t = 40)]
    pub seconds: u64,
    /// Concurrent transfer clients.
    #[arg(long, default_value_t = 8)]
    pub clients: usize,
    /// Kill -9 the leader this often (0: never); it restarts 2 s later.
    #[arg(long, default_value_t = 10)]
    pub kill_every_secs: u64,
    /// Accounts per bank, and the starting balance of each.
    #[arg(long, default_value_t = 50)]
    pub accounts: usize,
    #[arg(long, default_value_t = 1000)]
    pub initial: i64,
    /// Working directory (recreated on each run).
    #[arg(long, default_value = ".dtx-demo")]
    pub dir: PathBuf,
    /// After the transfers, keep everything serving until Ctrl-C.
    #[arg(long)]
    pub keep_serving: bool,
    /// The textbook example on PostgreSQL instead of the banks: orders,
    /// inventory and payment services, each with its own database on a
    /// PostgreSQL server the demo starts (and removes) itself; the leader
    /// and the services are killed with SIGKILL. Needs the PostgreSQL
    /// server binaries (Debian: apt-get install postgresql).
    #[arg(long)]
    pub postgres: bool,
    /// With --postgres: the shop as the coordinator's callees (clients
    /// enlist the three services with the order as payload and commit;
    /// the coordinator sends Prepare) instead of as branches (clients call
    /// the order service, which calls the others inside its transaction;
    /// each prepares in its own request handler).
    #[arg(long, requires = "postgres")]
    pub prepare_driven: bool,
    /// TLS and identities on every link: a throwaway certificate authority
    /// in the working directory, a certificate per node and bank, the
    /// clients as an application (`dtx://application/demo`).
    #[arg(long, conflicts_with = "postgres")]
    pub tls: bool,
    /// The order saga instead of 2PC: inventory (reserve stock,
    /// compensable), payment (charge the card, the pivot; a simulated API
    /// that loses 20% of its replies) and e-mail (the confirmation,
    /// retriable; busy 20% of the time) step services; clients start order
    /// sagas (some unpayable, some out of stock) while the leader is
    /// killed; the audit reads the three services' data.
    #[arg(long, conflicts_with_all = ["postgres", "tls"])]
    pub saga: bool,
    /// With --saga: where the inventory service keeps its stock. `auto`
    /// (the default): in a PostgreSQL database on a server the demo starts
    /// (and kills with SIGKILL in turn with the services) when the
    /// PostgreSQL server binaries are installed, else in its sled data
    /// directory; `postgres` insists on PostgreSQL, `sled` never uses it.
    #[arg(long, value_enum, default_value_t = InventoryStore::Auto)]
    pub inventory_store: InventoryStore,
}

/// `demo --saga --inventory-store`: where the inventory keeps its stock.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum InventoryStore {
    /// PostgreSQL when its server binaries are installed, else sled.
    Auto,
    /// Its sled data directory (the SDK's `saga` store).
    Sled,
    /// A PostgreSQL database (the SDK's `saga_pg` store) on a server the
    /// demo starts; an error when the binaries are missing.
    Postgres,
}

/// A demo's working directory, emptied (recreated) and made absolute, and
/// the `coordinator` binary every process of the demo runs.
pub(crate) fn fresh_workdir(dir: &Path) -> anyhow::Result<(PathBuf, PathBuf)> {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let dir = dir.canonicalize()?;
    let bin = std::env::current_exe().context("cannot find the coordinator binary")?;
    Ok((dir, bin))
}

/// The decision of `txid` once it has one (true = COMMIT), asked every
/// 500 ms for up to 30 s; `None` if it still has none.
pub(crate) async fn decision_eventually(client: &Client, txid: u64) -> Option<bool> {
    for _ in 0..60 {
        match client.decision(txid).await {
            Ok(DecisionRead::Committed) => return Some(true),
            Ok(DecisionRead::Aborted) | Ok(DecisionRead::UnknownPresumedAbort) => return Some(false),
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    None
}

/// What the demo's clients saw, counted as they go.
#[derive(Default)]
pub(crate) struct Counts {
    pub committed: AtomicU64,
    pub aborted: AtomicU64,
    pub unknown: AtomicU64,
    pub failed_to_start: AtomicU64,
}

impl Counts {
    /// The progress line printed every second.
    pub fn progress(&self, t: u64, leader: u64) -> String {
        format!(
            "  t={t:>3}s  committed {:>6}  aborted {:>5}  unknown {:>3}  not started {:>3}  leader node {leader}",
            self.committed.load(Ordering::Relaxed),
            self.aborted.load(Ordering::Relaxed),
            self.unknown.load(Ordering::Relaxed),
            self.failed_to_start.load(Ordering::Relaxed),
        )
    }
}

/// The demo's leader kills: every `every` seconds (never when 0) the
/// leader gets SIGKILL, and it is started again 2 s later.
pub(crate) struct LeaderKills {
    every: u64,
    next: u64,
    restart_at: Option<(u64, Instant)>,
    pub kills: u64,
}

impl LeaderKills {
    pub fn new(every: u64) -> Self {
        LeaderKills {
            every,
            next: if every > 0 { every } else { u64::MAX },
            restart_at: None,
            kills: 0,
        }
    }

    /// At second `t` of the run: restarts the node killed earlier once it
    /// is due, and kills the leader when it is time.
    pub async fn tick(&mut self, cluster: &mut ProcessCluster, t: u64) -> anyhow::Result<()> {
        if let Some((id, at)) = self.restart_at {
            if Instant::now() >= at {
                cluster.start(id)?;
                println!("  t={t:>3}s  node {id} restarted");
                self.restart_at = None;
            }
        }
        if t >= self.next && self.restart_at.is_none() {
            if let Some(l) = cluster.current_leader().await {
                cluster.kill9(l);
                self.kills += 1;
                println!("  t={t:>3}s  kill -9 leader node {l}");
                self.restart_at = Some((l, Instant::now() + Duration::from_secs(2)));
            }
            self.next = t + self.every;
        }
        Ok(())
    }

    /// Starts the node still down, if any, and waits for a leader.
    pub async fn finish(&mut self, cluster: &mut ProcessCluster) -> anyhow::Result<()> {
        if let Some((id, _)) = self.restart_at.take() {
            cluster.start(id)?;
        }
        cluster.leader_within(Duration::from_secs(30)).await?;
        Ok(())
    }
}
