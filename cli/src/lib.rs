//! The node's commands (package dtx-cli): `serve`, `admin`, `inspect` and
//! `restore`, for the `coordinator` binary (src/main.rs), which is what a
//! production host runs, and for the development binary (`dtx-dev`,
//! package dtx-devtools), which adds the demos, the bench and the example
//! services on top of the same commands. This crate only parses
//! arguments; the libraries (`coordinator`, `dtx-client`) do the work. It
//! links no example service, bench or PostgreSQL client
//! (docs/adr/0045-server-and-development-binaries.md).

/// `println!` for a command's output: a reader that went away (`admin
/// txn in-doubt | head`) ends the command quietly (exit 0) where
/// `println!` would panic.
macro_rules! outln {
    ($($t:tt)*) => {
        $crate::admin_ctx::write_out(format_args!($($t)*))
    };
}

mod admin;
mod admin_bulk;
mod admin_ctx;
mod admin_participant;
mod admin_saga;
mod admin_view;
mod backup;
pub mod conformance;
mod exit_codes;
mod log_levels;
#[cfg(feature = "otel")]
mod otel;

use std::path::PathBuf;

use anyhow::Context;
use clap::Subcommand;
use coordinator::config::Config;

/// What `--version` prints after the binary's name: the package version and,
/// in a build with crash points (the `failpoints` feature, for the
/// fault-injection harness), `dtx_failpoint::VERSION_MARK`, which the
/// harness looks for before it trusts a binary with its crash points.
pub const VERSION: &str = if dtx_failpoint::COMPILED {
    concat!(env!("CARGO_PKG_VERSION"), " (with crash points)")
} else {
    env!("CARGO_PKG_VERSION")
};

/// Options every command of both binaries takes.
#[derive(clap::Args)]
pub struct GlobalArgs {
    /// Log format: text or json.
    #[arg(long, global = true, default_value = "text", env = "DTX_LOG_FORMAT")]
    pub log_format: String,
}

/// The node's commands.
#[derive(Subcommand)]
pub enum NodeCmd {
    /// Run one node.
    Serve(ServeArgs),
    /// Print what a stopped node's data directory holds, as JSON. Writes
    /// nothing there: it reads a private copy under TMPDIR (works on a full
    /// disk; needs room for the copy in TMPDIR).
    Inspect {
        #[arg(long)]
        data_dir: PathBuf,
    },
    /// Operator commands against a running cluster: status, transactions
    /// (list, show, in-doubt, repairs), membership, snapshots, backups.
    /// Exit codes: 0 done, 1 other error, 2 usage, 3 refused, 4 outcome
    /// unknown, 5 unreachable.
    Admin(admin::AdminArgs),
    /// Write one node's data directory of a NEW cluster from a backup
    /// (`admin backup --out FILE`), like `etcdctl snapshot restore`: run it
    /// once per node (same backup, same members), then `serve` each node
    /// without --bootstrap. `--verify` only checks the file and shows it.
    Restore(backup::RestoreArgs),
    /// The participant conformance kit (docs/conformance.md): drive a
    /// participant service, in any language, through the protocol's rules
    /// and report each. Exit codes: 0 every rule passed or was skipped, 1
    /// one failed, 4 one went unanswered (unknown), 2 usage.
    #[command(subcommand)]
    Conformance(conformance::ConformanceCmd),
}

#[derive(clap::Args)]
pub struct ServeArgs {
    /// TOML configuration file (see etc/coordinator.example.toml).
    #[arg(long, short)]
    config: Option<PathBuf>,
    #[arg(long)]
    node_id: Option<u64>,
    #[arg(long)]
    cluster_id: Option<String>,
    #[arg(long)]
    data_dir: Option<PathBuf>,
    #[arg(long)]
    raft_addr: Option<String>,
    #[arg(long)]
    api_addr: Option<String>,
    #[arg(long)]
    metrics_addr: Option<String>,
    /// Initialize a new cluster from the config's bootstrap.members.
    #[arg(long)]
    bootstrap: bool,
    /// This node's certificate (PEM, naming dtx://node/<node-id>); with
    /// --tls-key and --tls-ca, TLS on every port and call (tls.cert).
    #[arg(long)]
    tls_cert: Option<PathBuf>,
    /// Its private key (tls.key).
    #[arg(long)]
    tls_key: Option<PathBuf>,
    /// The certificate authority of every peer (tls.ca).
    #[arg(long)]
    tls_ca: Option<PathBuf>,
    /// The API port: required (mutual TLS) or optional (tokens for callers
    /// without a certificate) (tls.client_auth).
    #[arg(long)]
    tls_client_auth: Option<String>,
}

/// Logs to stderr in `format` (text or json), filtered by `RUST_LOG`.
pub fn init_tracing(format: &str) {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,openraft=warn,sled=warn,h2=warn,tower=warn"));
    let routine = log_levels::RoutineRaftErrors::default();
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let fmt: Box<dyn Layer<_> + Send + Sync> = if format == "json" {
        Box::new(fmt.json().with_filter(routine.clone()))
    } else {
        Box::new(fmt.with_filter(routine.clone()))
    };
    let registry = tracing_subscriber::registry().with(filter).with(fmt);
    #[cfg(feature = "otel")]
    let registry = registry.with(otel::layer());
    registry.init();
    log_levels::spawn_summary(routine);
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = ctrl_c => {}
        _ = term.recv() => {}
    }
}

fn load_config(a: ServeArgs) -> anyhow::Result<Config> {
    let mut c = match &a.config {
        Some(p) => Config::from_file(p)?,
        None => Config::default(),
    };
    if let Some(v) = a.node_id {
        c.node_id = v;
    }
    if let Some(v) = a.cluster_id {
        c.cluster_id = v;
    }
    if let Some(v) = a.data_dir {
        c.data_dir = v;
    }
    if let Some(v) = a.raft_addr {
        c.raft_addr = v;
    }
    if let Some(v) = a.api_addr {
        c.api_addr = v;
    }
    if let Some(v) = a.metrics_addr {
        c.metrics_addr = Some(v);
    }
    if a.bootstrap {
        c.bootstrap.enabled = true;
    }
    if a.tls_cert.is_some() {
        c.tls.cert = a.tls_cert;
    }
    if a.tls_key.is_some() {
        c.tls.key = a.tls_key;
    }
    if a.tls_ca.is_some() {
        c.tls.ca = a.tls_ca;
    }
    if let Some(v) = a.tls_client_auth {
        c.tls.client_auth = v;
    }
    c.validate()?;
    Ok(c)
}

/// The runtime every command runs on. A node runs on one thread by default
/// (its fsyncs run on their own thread): on small machines this avoids
/// cross-thread wake-ups on every step of a Raft round.
/// DTX_WORKER_THREADS=N selects a thread pool.
fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    let threads: usize = std::env::var("DTX_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if threads == 0 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()
    }
}

/// Runs `work` to its end on the commands' runtime, then stops the
/// runtime: tasks still running (a blocking storage call, a stuck
/// connection) never keep the process from exiting.
pub fn block_on<F>(work: F) -> anyhow::Result<()>
where
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    let rt = runtime()?;
    let outcome = rt.block_on(work);
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    // The last spans go out before the process ends.
    #[cfg(feature = "otel")]
    otel::shutdown();
    outcome
}

/// Runs one of the node's commands to its end. `admin` ends the process
/// with its own exit code (see its help).
pub fn run_node_command(cmd: NodeCmd) -> anyhow::Result<()> {
    if let NodeCmd::Admin(a) = cmd {
        let rt = runtime()?;
        let code = rt.block_on(admin::run(a));
        rt.shutdown_timeout(std::time::Duration::from_secs(2));
        std::process::exit(code);
    }
    if let NodeCmd::Conformance(c) = cmd {
        let rt = runtime()?;
        let code = rt.block_on(conformance::run(c));
        rt.shutdown_timeout(std::time::Duration::from_secs(2));
        std::process::exit(code);
    }
    block_on(run_node(cmd))
}

async fn run_node(cmd: NodeCmd) -> anyhow::Result<()> {
    match cmd {
        NodeCmd::Serve(a) => {
            let config = load_config(a).context("configuration")?;
            // This process is the node: a fatal error of its Raft ends it
            // within a bound, with the error, even if a flush hangs.
            coordinator::fatal_exit::enable();
            coordinator::node::run(config, shutdown_signal()).await
        }
        NodeCmd::Admin(_) => unreachable!("admin runs in run_node_command, for its exit code"),
        NodeCmd::Conformance(_) => unreachable!("conformance runs in run_node_command, for its exit code"),
        NodeCmd::Restore(a) => backup::restore(a).await,
        NodeCmd::Inspect { data_dir } => {
            let v = coordinator::store::inspect(&data_dir)?;
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_version_says_whether_crash_points_are_compiled_in() {
        // The mark is spelled twice (concat! takes only literals): here the
        // two spellings must agree, and the mark must follow the version
        // exactly when this build has crash points.
        assert_eq!(
            super::VERSION.ends_with(dtx_failpoint::VERSION_MARK),
            dtx_failpoint::COMPILED,
            "{}",
            super::VERSION
        );
        assert!(super::VERSION.starts_with(env!("CARGO_PKG_VERSION")));
    }
}
