//! Fault-injection harness in the manner of Jepsen, against the real
//! `coordinator` binary: real processes, real sockets, real faults.
//!
//! - `history`: the recorded operations (JSON lines).
//! - `checker`: finds anomalies in a history (safety and liveness).
//! - `plot`: latency and throughput over time as SVG (plotters), faults shaded.
//! - `procs`: network rules (nftables); the node and bank processes are
//!   `dtx_testkit::cluster::{ProcessCluster, BankProcess}`, the bank itself
//!   is the reference participant `dtx_bank`.
//! - `nemesis`: the faults and their seeded schedule.
//! - `msgproxy`: the gRPC proxies in front of the banks that delay,
//!   duplicate and replay late the coordinator's messages (`message-chaos`),
//!   and stop answering for a participant gone for good (`participant-gone`).
//! - `disk`: the small filesystems the `disk-full` nemesis fills.
//! - `power`: the lossy FUSE filesystems (`dtx-lossyfs`) on every data
//!   directory that the `power-cut` nemesis cuts.
//! - `runner`: one run: start, workload + nemesis, heal, final reads, check;
//!   the transfer workloads `sled`, `postgres` and `branches` (transfers
//!   made of branches: Begin, the banks' own `Change`, Commit or Abort).
//! - `saga`: the same for the saga workload (`--workload saga`): the order
//!   saga's step services instead of banks; checked by `checker::saga`.

pub mod checker;
pub mod disk;
pub mod history;
pub mod msgproxy;
pub mod nemesis;
pub mod plot;
pub mod power;
pub mod procs;
pub mod runner;
pub mod saga;
