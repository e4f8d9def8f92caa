//! Tooling shared by the `coordinator` command's developer commands (dev,
//! demo, bench), the integration tests and the fault-injection harness,
//! kept out of the node library:
//!
//! - [`cluster`]: a supervisor of local node processes (`coordinator serve`)
//!   and of the example bank's services (`coordinator bank-serve`): configs,
//!   start, SIGKILL, SIGTERM, finding the leader, free ports.
//! - [`bench`]: `coordinator bench`, throughput and latency of the registry
//!   and of end-to-end transfers, next to this disk's fsync rate, with
//!   the CPU time per committed transfer summed over every process, and
//!   the same write-once workload against etcd in the same run.
//! - [`cpu`]: CPU time of this process and of child processes.
//! - [`leader_watch`]: which node leads, in which term, around each
//!   measured phase (a phase whose leader changed is not judged).
//! - [`node_metrics`]: a node's Prometheus text, and the leader's Raft
//!   entries and handler time over a measured phase.
//! - [`machine`]: the machine's facts a bench records beside its numbers
//!   (CPUs, kernel, how idle vCPUs wait).
//! - [`etcd`]: a supervisor of a local etcd cluster and a minimal gRPC
//!   client of its KV API, for the bench's side-by-side comparison.
//! - [`verify`]: the bench's correctness checks (no acknowledged write
//!   lost, none accepted twice), pure.
//! - [`report`]: the comparison with etcd: table, ratios, goals, pure.
//! - [`pgbench`]: `coordinator bench --postgres`: transfers between two
//!   banks on PostgreSQL beside pgbench on the same server (issue 11).
//! - [`plot`]: the bench's SVG plots.
//! - [`pki`]: certificates for a local cluster with TLS.
//! - [`tlsbench`]: `coordinator bench --tls`: the transfers again with
//!   mutual TLS on every link, beside the plain-text ones (issue 12).

pub mod bench;
pub mod closed_loop;
pub mod cluster;
pub mod cpu;
pub mod etcd;
pub mod leader_watch;
pub mod machine;
pub mod node_metrics;
pub mod pgbench;
pub mod pki;
pub mod plot;
pub mod report;
pub mod tlsbench;
pub mod verify;
