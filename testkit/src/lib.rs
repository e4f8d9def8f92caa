//! Tooling shared by the `coordinator` command's developer commands (dev,
//! demo), the integration tests, the fault-injection harness and the
//! benchmark (`dtx-bench`), kept out of the node library:
//!
//! - [`cluster`]: a supervisor of local node processes (`coordinator serve`)
//!   and of the example bank's services (`dtx-dev bank-serve`): configs,
//!   start, SIGKILL, SIGTERM, finding the leader, free ports.
//! - [`node_metrics`]: a node's Prometheus text, and the leader's Raft
//!   entries and handler time over a measured phase.
//! - [`pki`]: certificates for a local cluster with TLS.
//!
//! The benchmark itself (`dtx-dev bench`, with its etcd and PostgreSQL
//! comparisons and its plots) is the `dtx-bench` crate
//! (docs/adr/0044-crate-lines.md).

pub mod cluster;
pub mod node_metrics;
pub mod pki;
