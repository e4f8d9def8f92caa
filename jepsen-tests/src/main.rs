//! `jepsen-tests run`: one fault-injection run against the real binaries;
//! `jepsen-tests check`: the checkers on a recorded history. See
//! docs/jepsen.md.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use clap::Subcommand;
use jepsen_tests::checker;
use jepsen_tests::checker::Validity;
use jepsen_tests::history;
use jepsen_tests::nemesis;
use jepsen_tests::runner;

#[derive(Parser)]
#[command(about = "Jepsen-style fault injection for the dtx coordinator")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

// Parsed once at start and matched at once: the size of the larger
// variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Start 3 nodes and the bank services, run clients under faults, heal,
    /// read everything back, check it, and write a results folder.
    Run {
        /// Seconds of workload under faults.
        #[arg(long, default_value_t = 60)]
        time: u64,
        /// Faults, comma-separated: kill-leader, kill-node, kill-participant,
        /// pause-leader, partition-isolate, partition-majority,
        /// partition-bridge, partition-leader-participants,
        /// partition-leader-followers, clock-skew, crash-point,
        /// message-chaos, participant-gone, disk-full, power-cut,
        /// kill-postgres, partition-postgres; or the groups all, kill,
        /// partition, none. power-cut needs /dev/fuse and root: named, it
        /// fails the run where it cannot mount; in `all` it is skipped with
        /// a note (an error with DTX_REQUIRE_FUSE=1).
        /// kill-postgres and partition-postgres only in the postgres
        /// workload (skipped, with a note, otherwise); there disk-full
        /// fills PostgreSQL's disk instead of a bank's.
        #[arg(long, default_value = "all")]
        nemesis: String,
        /// What the banks keep their accounts in: sled (their own store) or
        /// postgres (one PostgreSQL server started by the run, a database
        /// per bank); or saga: no banks, the order saga over its three
        /// step services (see docs/jepsen.md, "Saga workload"); or
        /// branches: the sled banks joined as branches through their own
        /// API, `bank.v1.Bank.Change` (see docs/jepsen.md, "Branch
        /// workload").
        #[arg(long, value_enum, default_value_t = runner::Workload::Sled)]
        workload: runner::Workload,
        /// Seed of the fault schedule and the clients' choices.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Concurrent transfer clients.
        #[arg(long, default_value_t = 6)]
        clients: usize,
        /// Bank participant services (at least 2).
        #[arg(long, default_value_t = 3)]
        banks: usize,
        /// Accounts per bank.
        #[arg(long, default_value_t = 5)]
        accounts: usize,
        /// Opening balance of every account.
        #[arg(long, default_value_t = 100)]
        initial: i64,
        /// The node's binary, built with `--features failpoints`
        /// (default: `coordinator` next to this program).
        #[arg(long)]
        coordinator_bin: Option<PathBuf>,
        /// The development binary that runs the example services and
        /// their audits (`bank-serve`, `saga-step-serve`, `outside-serve`,
        /// ...), built with `--features failpoints` (default: `dtx-dev`
        /// next to this program).
        #[arg(long)]
        tools_bin: Option<PathBuf>,
        /// Where the results folder of the run is created.
        #[arg(long, default_value = "jepsen-results")]
        out: PathBuf,
        /// First port; nodes use base+10..base+31, banks base+100.. .
        #[arg(long, default_value_t = 26000)]
        base_port: u16,
        /// The first three parts of the run's loopback addresses: nodes on
        /// <prefix>.11-13, banks on <prefix>.21.. . Another prefix (and
        /// base port) keeps two runs on one machine apart, partitions
        /// included.
        #[arg(long, default_value = "127.0.0")]
        ip_prefix: String,
        /// Shortest and longest fault, seconds.
        #[arg(long, default_value = "3,8")]
        fault_s: String,
        /// Shortest and longest quiet time between faults, seconds.
        #[arg(long, default_value = "1,3")]
        quiet_s: String,
        /// Invariant 6's bound after the final heal, ms: the longest election
        /// timeout (500) + the longest delivery retry delay (500) + the
        /// participant recovery interval (500) + a process restart and the
        /// measurement's own polling (about 1000).
        #[arg(long, default_value_t = 3000)]
        liveness_bound_ms: u64,
        /// How long to wait for in-doubt transactions after the final heal, s.
        #[arg(long, default_value_t = 30)]
        settle_s: u64,
        /// TLS and identities on every link: a throwaway authority in the
        /// run's folder (tls/), a node certificate per node, a participant
        /// certificate per bank (which then serves mutual TLS), a node
        /// certificate per message proxy, and application and operator
        /// certificates for the harness's own calls.
        #[arg(long)]
        tls: bool,
        /// --workload saga: where the inventory service keeps its stock:
        /// `postgres` (a database on a PostgreSQL server the run starts;
        /// adds kill-postgres and partition-postgres) or `sled` (its data
        /// directory, as the other step services).
        #[arg(long, value_enum, default_value_t = runner::InventoryStore::Postgres)]
        inventory_store: runner::InventoryStore,
        /// The first N banks are the Python SDK's example bank
        /// (`sdk/python/examples/bank.py`, run with `python3`; its packages
        /// from scripts/python-deps): a participant in another language
        /// under the same faults and checks. The bank workload only, plain
        /// text only.
        #[arg(long, default_value_t = 0)]
        python_banks: usize,
        /// The Python bank's script.
        #[arg(long, default_value = "sdk/python/examples/bank.py")]
        python_bank_script: PathBuf,
        /// The interpreter for --python-banks.
        #[arg(long, default_value = "python3")]
        python: PathBuf,
    },
    /// Run the checkers on a history file (JSON lines) and print the
    /// summary (the saga checker for a saga workload's history).
    Check {
        history: PathBuf,
        #[arg(long, default_value_t = 3000)]
        liveness_bound_ms: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(Validity::Valid) => ExitCode::SUCCESS,
        Ok(Validity::Invalid) => {
            eprintln!("jepsen: INVALID: anomalies found (see the summary above)");
            ExitCode::from(1)
        }
        Ok(Validity::Unknown) => {
            eprintln!("jepsen: UNKNOWN: the checkers could not decide (see the summary above)");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("jepsen: error: {e:#}");
            ExitCode::from(3)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<Validity> {
    match cli.cmd {
        Cmd::Check {
            history: path,
            liveness_bound_ms,
        } => {
            let f = std::fs::File::open(&path).map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
            let ops = history::read_jsonl(std::io::BufReader::new(f))?;
            // A saga workload's history has its own checker.
            if ops.iter().any(|op| matches!(op.body, history::Body::Saga(_))) {
                let report = checker::saga::check(&ops);
                println!("{}", report.summary());
                return Ok(report.valid);
            }
            let report = checker::check(
                &ops,
                &checker::CheckOptions {
                    liveness_bound_ms,
                    time_limit: Duration::from_secs(600),
                },
            );
            println!("{}", report.summary());
            Ok(report.valid)
        }
        Cmd::Run {
            time,
            nemesis,
            workload,
            seed,
            clients,
            banks,
            accounts,
            initial,
            coordinator_bin,
            tools_bin,
            out,
            base_port,
            ip_prefix,
            fault_s,
            quiet_s,
            liveness_bound_ms,
            settle_s,
            tls,
            inventory_store,
            python_banks,
            python_bank_script,
            python,
        } => {
            let faults = nemesis::parse_list(&nemesis).map_err(anyhow::Error::msg)?;
            let (faults, skipped) = workload.faults_with(&faults, inventory_store);
            for note in skipped {
                println!("jepsen: {note}");
            }
            // power-cut needs FUSE: named on its own it must run; in `all`
            // it is left out, loudly, where it cannot (unless
            // DTX_REQUIRE_FUSE=1, as in CI).
            let explicit = nemesis.split(',').any(|n| n.trim() == "power-cut");
            let (faults, note) = jepsen_tests::power::check_available(faults, explicit, base_port)?;
            if let Some(note) = note {
                println!("\n*** jepsen: {note}\n");
            }
            let beside_this_program = |name: &str| -> anyhow::Result<PathBuf> {
                std::env::current_exe()?
                    .parent()
                    .map(|d| d.join(name))
                    .ok_or_else(|| anyhow::anyhow!("cannot locate this program's directory"))
            };
            let bin = match coordinator_bin {
                Some(b) => b,
                None => beside_this_program("coordinator")?,
            };
            let tools_bin = match tools_bin {
                Some(b) => b,
                None => beside_this_program("dtx-dev")?,
            };
            let pair = |v: &str, what: &str| -> anyhow::Result<(u64, u64)> {
                let bad = || anyhow::anyhow!("--{what} wants MIN,MAX seconds with 0 < MIN <= MAX, got {v:?}");
                let (a, b) = v.split_once(',').ok_or_else(bad)?;
                let (a, b): (u64, u64) = (
                    a.trim().parse().map_err(|_| bad())?,
                    b.trim().parse().map_err(|_| bad())?,
                );
                anyhow::ensure!(a > 0 && a <= b, bad());
                Ok((a, b))
            };
            let opts = runner::RunOptions {
                time_s: time,
                workload,
                faults,
                seed,
                clients,
                coordinator_bin: bin,
                tools_bin,
                out_dir: out,
                base_port,
                ip_prefix,
                banks,
                accounts,
                initial,
                fault_s: pair(&fault_s, "fault-s")?,
                quiet_s: pair(&quiet_s, "quiet-s")?,
                liveness_bound_ms,
                settle_s,
                tls,
                inventory_store,
                python_banks: (python_banks > 0).then_some((
                    python_banks,
                    dtx_testkit::cluster::PythonBank {
                        python,
                        script: python_bank_script,
                    },
                )),
                command: std::env::args()
                    .map(|a| if a.contains(' ') { format!("'{a}'") } else { a })
                    .collect::<Vec<_>>()
                    .join(" "),
            };
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            let r = if opts.workload == runner::Workload::Saga {
                rt.block_on(jepsen_tests::saga::run(opts))?
            } else {
                rt.block_on(runner::run(opts))?
            };
            println!("results: {}", r.dir.display());
            Ok(r.valid)
        }
    }
}
