//! `coordinator`: the command (package dtx-cli). It only parses arguments;
//! the libraries (`coordinator`, `dtx-client`, `dtx-testkit`, `dtx-bank`)
//! does the work.

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
mod demo;
mod demo_kit;
mod demo_pg;
mod demo_saga;
mod dev;
mod exit_codes;
mod log_levels;
#[cfg(feature = "otel")]
mod otel;
mod saga_shop;

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use clap::Subcommand;
use coordinator::config::Config;

/// Every process this binary runs (nodes, the example services, the
/// bench) allocates through mimalloc: glibc's malloc and free were a sixth
/// of a leader's CPU under load (docs/adr/0029-mimalloc.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "coordinator",
    version,
    about = "dtx: a two-phase-commit coordinator replicated by Raft"
)]
struct Cli {
    /// Log format: text or json.
    #[arg(long, global = true, default_value = "text", env = "DTX_LOG_FORMAT")]
    log_format: String,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run one node.
    Serve(ServeArgs),
    /// The main job: cluster + two bank services, transfers while the leader
    /// is killed, live progress, then a summary and an audit.
    Demo(demo_kit::DemoArgs),
    /// Run one bank participant service (the example; used by `demo`).
    BankServe(dtx_bank::BankServeArgs),
    /// Run one shop service on its PostgreSQL database (the example of
    /// `demo --postgres`).
    ShopServe(dtx_shop::ShopServeArgs),
    /// Run one step service of the order saga (the saga example: inventory,
    /// payment or email) until SIGTERM.
    SagaStepServe(dtx_saga_shop::StepServeArgs),
    /// Print what a stopped order-saga step service's data directory holds
    /// (stock, charges, confirmations, duplicates), as JSON.
    SagaStepAudit(dtx_saga_shop::StepAuditArgs),
    /// Run the order saga's outside world: the payment provider or the
    /// e-mail sender the step services call (idempotency keys, a status
    /// query, replies lost on purpose) until SIGTERM.
    OutsideServe(dtx_saga_shop::OutsideServeArgs),
    /// Print what a stopped payment provider's or e-mail sender's log holds
    /// (charges and e-mails per order, accounts), as JSON.
    OutsideAudit(dtx_saga_shop::OutsideAuditArgs),
    /// Sum the balances of stopped bank services' data directories (or of
    /// PostgreSQL banks' databases).
    BankAudit {
        /// Data directories of the bank services (stopped), comma-separated.
        #[arg(long, value_delimiter = ',', required_unless_present = "postgres")]
        data_dir: Vec<PathBuf>,
        /// A PostgreSQL bank's database instead (a tokio-postgres connection
        /// string, as given to `bank-serve --postgres`); repeat for more.
        /// `locked` and `in_doubt` count its prepared dtx transactions,
        /// listed under `prepared`.
        #[arg(long, conflicts_with = "data_dir")]
        postgres: Vec<String>,
        /// Print one JSON object per directory (balances, locks, in-doubt
        /// count and the apply log) instead of the summary.
        #[arg(long)]
        json: bool,
    },
    /// Run a local three-node cluster on loopback until Ctrl-C.
    Dev(dev::DevArgs),
    /// Measure Decide throughput and latency on a local three-node cluster,
    /// and this disk's fsync rate.
    Bench(dtx_testkit::bench::BenchArgs),
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
}

#[derive(Parser)]
struct ServeArgs {
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

fn init_tracing(format: &str) {
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

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_tracing(&cli.log_format);
    // A node runs on one thread by default (its fsyncs run on their own
    // thread): on small machines this avoids cross-thread wake-ups on every
    // step of a Raft round. DTX_WORKER_THREADS=N selects a thread pool.
    let threads: usize = std::env::var("DTX_WORKER_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let rt = if threads == 0 {
        tokio::runtime::Builder::new_current_thread().enable_all().build()?
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build()?
    };
    if let Cmd::Admin(a) = cli.cmd {
        let code = rt.block_on(admin::run(a));
        rt.shutdown_timeout(std::time::Duration::from_secs(2));
        std::process::exit(code);
    }
    let outcome = rt.block_on(run(cli));
    // Tasks still running (a blocking storage call, a stuck connection)
    // never keep the process from exiting.
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    // The last spans go out before the process ends.
    #[cfg(feature = "otel")]
    otel::shutdown();
    outcome
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.cmd {
        Cmd::Serve(a) => {
            let config = load_config(a).context("configuration")?;
            // This process is the node: a fatal error of its Raft ends it
            // within a bound, with the error, even if a flush hangs.
            coordinator::fatal_exit::enable();
            coordinator::node::run(config, shutdown_signal()).await
        }
        Cmd::Dev(a) => dev::run(a, shutdown_signal()).await,
        Cmd::Demo(a) if a.postgres => demo_pg::run(a, shutdown_signal()).await,
        Cmd::Demo(a) if a.saga => demo_saga::run(a, shutdown_signal()).await,
        Cmd::Demo(a) => demo::run(a, shutdown_signal()).await,
        Cmd::BankServe(a) => dtx_bank::serve(a, shutdown_signal()).await,
        Cmd::ShopServe(a) => dtx_shop::serve(a, shutdown_signal()).await,
        Cmd::SagaStepServe(a) => saga_shop::serve(a).await,
        Cmd::SagaStepAudit(a) => saga_shop::audit(a),
        Cmd::OutsideServe(a) => saga_shop::serve_outside(a).await,
        Cmd::OutsideAudit(a) => saga_shop::audit_outside(a),
        Cmd::BankAudit { postgres, json, .. } if !postgres.is_empty() => {
            let mut total = 0i64;
            let mut in_doubt = 0;
            for conn in &postgres {
                let db = dtx_bank::connect_pg(conn).await?;
                let balances = dtx_bank::pg::balances(&db).await?;
                let applied = dtx_bank::pg::apply_log(&db).await?;
                let prepared = dtx_bank::pg::prepared(&db).await?;
                if json {
                    let line = serde_json::json!({
                        "postgres": conn,
                        "balances": balances,
                        "locked": prepared.len(),
                        "in_doubt": prepared.len(),
                        "prepared": prepared
                            .iter()
                            .map(|(p, txid, term)| serde_json::json!({"participant": p, "txid": txid, "term": term}))
                            .collect::<Vec<_>>(),
                        "applied": applied
                            .iter()
                            .map(|(txid, outcome)| serde_json::json!({"txid": txid, "outcome": outcome}))
                            .collect::<Vec<_>>(),
                    });
                    println!("{line}");
                } else {
                    let t: i64 = balances.values().sum();
                    println!(
                        "{conn}: {} accounts, total {t}, {} prepared (in doubt)",
                        balances.len(),
                        prepared.len()
                    );
                    total += t;
                    in_doubt += prepared.len();
                }
            }
            if !json {
                println!("total {total}, {in_doubt} in doubt");
            }
            Ok(())
        }
        Cmd::BankAudit {
            data_dir, json: true, ..
        } => {
            for d in &data_dir {
                anyhow::ensure!(d.exists(), "bank data directory {} does not exist", d.display());
                let store = participant_sdk::store::ParticipantStore::open(d, dtx_bank::Bank)?;
                let (_, _, locked) = dtx_bank::audit(&store)?;
                let applied: Vec<serde_json::Value> = dtx_bank::apply_log(&store)?
                    .into_iter()
                    .map(|(txid, outcome)| serde_json::json!({"txid": txid, "outcome": outcome}))
                    .collect();
                let balances: serde_json::Map<String, serde_json::Value> = dtx_bank::balances(&store)?
                    .into_iter()
                    .map(|(k, v)| (k, v.into()))
                    .collect();
                let line = serde_json::json!({
                    "data_dir": d.display().to_string(),
                    "balances": balances,
                    "locked": locked,
                    "in_doubt": store.in_doubt()?.len(),
                    "applied": applied,
                });
                println!("{line}");
            }
            Ok(())
        }
        Cmd::BankAudit {
            data_dir, json: false, ..
        } => {
            let mut total = 0i64;
            let mut locked = 0;
            let mut in_doubt = 0;
            for d in &data_dir {
                anyhow::ensure!(d.exists(), "bank data directory {} does not exist", d.display());
                let store = participant_sdk::store::ParticipantStore::open(d, dtx_bank::Bank)?;
                let (t, n, l) = dtx_bank::audit(&store)?;
                let doubt = store.in_doubt()?.len();
                println!("{}: {n} accounts, total {t}, {l} locked, {doubt} in doubt", d.display());
                total += t;
                locked += l;
                in_doubt += doubt;
            }
            println!("total {total}, {locked} locked, {in_doubt} in doubt");
            Ok(())
        }
        Cmd::Bench(a) => dtx_testkit::bench::run(a).await,
        Cmd::Admin(_) => unreachable!("admin runs in main, for its exit code"),
        Cmd::Restore(a) => backup::restore(a).await,
        Cmd::Inspect { data_dir } => {
            let v = coordinator::store::inspect(&data_dir)?;
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(())
        }
    }
}
