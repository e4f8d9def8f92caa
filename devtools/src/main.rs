//! `dtx-dev`: the development binary (package dtx-devtools). It runs the
//! node's commands exactly as the `coordinator` binary does (they are the
//! same code, from dtx-cli), and adds what a developer and the tests need
//! around them: `dev` (a local cluster), `demo` (the main job), `bench`,
//! and the example services and their audits. `cargo run --release --`
//! from the repository root runs it. A production host runs the
//! `coordinator` binary, which links none of this
//! (docs/adr/0045-server-and-development-binaries.md).

mod demo;
mod demo_kit;
mod demo_pg;
mod demo_saga;
mod dev;
mod saga_shop;

use std::path::PathBuf;

use clap::Parser;
use clap::Subcommand;
use dtx_cli::shutdown_signal;

/// Every process this binary runs (nodes, the example services, the
/// bench) allocates through mimalloc: glibc's malloc and free were a sixth
/// of a leader's CPU under load (docs/adr/0029-mimalloc.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "dtx-dev",
    version = dtx_cli::VERSION,
    about = "dtx: a two-phase-commit coordinator replicated by Raft (the node's commands, and the development tools)"
)]
struct Cli {
    #[command(flatten)]
    global: dtx_cli::GlobalArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    #[command(flatten)]
    Node(dtx_cli::NodeCmd),
    /// The main job: cluster + two bank services, transfers while the leader
    /// is killed, live progress, then a summary and an audit.
    Demo(demo_kit::DemoArgs),
    /// Run one bank participant service (the example; used by `demo`).
    BankServe(dtx_bank::BankServeArgs),
    /// Run one shop service on its PostgreSQL database (the example of
    /// `demo --postgres`).
    ShopServe(dtx_shop::ShopServeArgs),
    /// Run one step service of the order saga (the saga example: inventory,
    /// payment or email) until SIGTERM; the inventory on PostgreSQL with
    /// --postgres.
    SagaStepServe(dtx_saga_shop::StepServeArgs),
    /// Print what a stopped order-saga step service's data directory (or
    /// the inventory's PostgreSQL database, --postgres) holds (stock,
    /// charges, confirmations, duplicates), as JSON.
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
    /// Print one account's committed balance, read from a running bank's
    /// own API (`bank-serve --app-listen`): a number, for scripts (the
    /// conformance kit's `--effect-command`).
    BankBalance {
        /// The bank's API address (its --app-listen).
        #[arg(long)]
        app: String,
        /// The account, e.g. a0.
        #[arg(long)]
        account: String,
    },
    /// Run a local three-node cluster on loopback until Ctrl-C.
    Dev(dev::DevArgs),
    /// Measure Decide throughput and latency on a local three-node cluster,
    /// and this disk's fsync rate.
    Bench(dtx_bench::bench::BenchArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    dtx_cli::init_tracing(&cli.global.log_format);
    match cli.cmd {
        Cmd::Node(cmd) => dtx_cli::run_node_command(cmd),
        tool => dtx_cli::block_on(run(tool)),
    }
}

async fn run(cmd: Cmd) -> anyhow::Result<()> {
    match cmd {
        Cmd::Node(_) => unreachable!("the node's commands run in main"),
        Cmd::Dev(a) => dev::run(a, shutdown_signal()).await,
        Cmd::Demo(a) if a.postgres => demo_pg::run(a, shutdown_signal()).await,
        Cmd::Demo(a) if a.saga => demo_saga::run(a, shutdown_signal()).await,
        Cmd::Demo(a) => demo::run(a, shutdown_signal()).await,
        Cmd::BankServe(a) => dtx_bank::serve(a, shutdown_signal()).await,
        Cmd::BankBalance { app, account } => {
            println!("{}", dtx_bank::branch::committed_balance(&app, &account).await?);
            Ok(())
        }
        Cmd::ShopServe(a) => dtx_shop::serve(a, shutdown_signal()).await,
        Cmd::SagaStepServe(a) => saga_shop::serve(a).await,
        Cmd::SagaStepAudit(a) => saga_shop::audit(a).await,
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
        Cmd::Bench(a) => dtx_bench::bench::run(a).await,
    }
}
