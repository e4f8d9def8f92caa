//! `coordinator`: the node's binary, what a production host runs (`serve`,
//! `admin`, `inspect`, `restore`). The development tools (`dev`, `demo`,
//! `bench`, the example services) are the `dtx-dev` binary of package
//! dtx-devtools.

use clap::Parser;

/// Every node process allocates through mimalloc: glibc's malloc and free
/// were a sixth of a leader's CPU under load (docs/adr/0029-mimalloc.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "coordinator",
    version = dtx_cli::VERSION,
    about = "dtx: a two-phase-commit coordinator replicated by Raft"
)]
struct Cli {
    #[command(flatten)]
    global: dtx_cli::GlobalArgs,
    #[command(subcommand)]
    cmd: dtx_cli::NodeCmd,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    dtx_cli::init_tracing(&cli.global.log_format);
    dtx_cli::run_node_command(cli.cmd)
}
