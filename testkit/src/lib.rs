//! Tooling shared by the `coordinator` command's developer commands (dev,
//! demo, bench), the integration tests and the fault-injection harness,
//! kept out of the node library:
//!
//! - [`cluster`]: a supervisor of local node processes (`coordinator serve`)
//!   and of the example bank's services (`coordinator bank-serve`): configs,
//!   start, SIGKILL, SIGTERM, finding the leader, free ports.
//! - [`bench`]: `coordinator bench`, throughput and latency of the registry
//!   and of end-to-end transfers, next to this disk's fsync rate, with
//!   the CPU time per committed transfer summed over every process.
//! - [`cpu`]: CPU time of this process and of child processes.

pub mod bench;
pub mod cluster;
pub mod cpu;
