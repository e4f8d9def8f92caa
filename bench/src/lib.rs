//! `dtx-dev bench` (dtx-cli calls [`bench`]): throughput and latency of
//! the registry and of end-to-end transfers, next to this disk's fsync
//! rate, with the CPU time per committed transfer summed over every
//! process, and the same write-once workload against etcd in the same run.
//! The local processes are supervised by `dtx_testkit::cluster`.
//!
//! - [`args`]: the command's arguments, the node settings they override
//!   and the value each transaction carries.
//! - [`bench`]: the command: its phases and results.
//! - [`disk`]: the disk's fsync rate, measured in the same run.
//! - [`closed_loop`]: closed-loop transfers through the example banks.
//! - [`cpu`]: CPU time of this process and of child processes.
//! - [`leader_watch`]: which node leads, in which term, around each
//!   measured phase (a phase whose leader changed is not judged).
//! - [`machine`]: the machine's facts a bench records beside its numbers
//!   (CPUs, kernel, how idle vCPUs wait).
//! - [`etcd`]: a supervisor of a local etcd cluster and a minimal gRPC
//!   client of its KV API, for the bench's side-by-side comparison.
//! - [`verify`]: the bench's correctness checks (no acknowledged write
//!   lost, none accepted twice), pure.
//! - [`report`]: the comparison with etcd: table, ratios, goals, pure.
//! - [`pgbench`]: `dtx-dev bench --postgres`: transfers between two
//!   banks on PostgreSQL beside pgbench on the same server.
//! - [`plot`]: the bench's SVG plots.
//! - [`tlsbench`]: `dtx-dev bench --tls`: the transfers again with
//!   mutual TLS on every link, beside the plain-text ones
//!   (docs/adr/0016-tls-and-identities.md).
//! - [`retained`]: `dtx-dev bench --retained 0,1m,5m`: memory, disk,
//!   Decide/s, snapshot, restart and catch-up against the number of
//!   retained transactions (issue 43).

pub mod args;
pub mod bench;
pub mod closed_loop;
pub mod cpu;
pub mod disk;
pub mod etcd;
pub mod leader_watch;
pub mod machine;
pub mod pgbench;
pub mod plot;
pub mod report;
pub mod retained;
pub mod tlsbench;
pub mod verify;
