//! dtx coordinator node: a two-phase-commit transaction registry whose
//! decisions are replicated by a three-node Raft group, and the leader's
//! 2PC driver. This crate is the node alone: it imports neither the client
//! applications embed (`dtx-client`) nor the participant side
//! (`participant-sdk`); what it shares with the client is in `dtx-common`,
//! the wire contract in `dtx-proto`, the transport in `dtx-transport`, and
//! the `coordinator` binary is built by `dtx-cli` (docs/architecture.md,
//! "Crates"). What the node must guarantee is docs/design.md.
//!
//! Module map (data flows top to bottom; imports run one way):
//! - `node`     wires a node together: storage, Raft, servers, leader loops.
//! - `fatal_exit` a node process stopped on a fatal error exits within a
//!   bound, with its error (`coordinator serve`).
//! - `api`      gRPC services (Coordinator, Admin, SagaService): they
//!   translate requests into state-machine commands or calls on the
//!   `Driver`; error -> status mapping in one place (`api::error`).
//! - `console`  the read-only web console on the metrics port.
//! - `backup`   backups of a running node and restores into a new cluster.
//! - `security` TLS, identities and who may call what, for both ports.
//! - `metrics`  the metric names and the metrics port's HTTP listener.
//! - `driver`   the leader's 2PC driver: an async shell doing the I/O
//!   (prepare, decide, deliver, ack, re-drive; `driver::fast`, the one-write
//!   commit path) around one owner task (`driver::owner`) that alone holds
//!   its state, the pure `driver::book`; `driver::health` per participant
//!   address (docs/adr/0043-driver-owner.md).
//! - `orchestrator` the leader's saga orchestrator: drives every running
//!   saga by the pure plan and journal of `sm::saga`; one scan task owns
//!   which sagas run.
//! - `ctx`      `NodeCtx`, what the API and the driver share: Raft, the
//!   state machine, the batcher, channels; propose and linearizable reads.
//! - `batcher`  group commit: many concurrent commands -> one Raft entry.
//! - `raft`     openraft type config, network client, transport service.
//! - `store`    the Raft log in log files of its own (`store::log_store`, on
//!   `dtx_durable::wal`), the state machine in sled (`store::sm_store`,
//!   `store::engine`); every stored value carries a format version
//!   (docs/adr/0042-storage-engines.md).
//! - `sm`       the pure transaction state machine and saga journal (no
//!   I/O, no clock).
//! - `codec`    every binary encoding: format version byte + bincode 2.
//! - `config`   TOML configuration with defaults and `validate()`, one
//!   section at a time.
//! - `participant_policy` the operators' participant address policy
//!   (ADR 0041), checked by the API before an enlistment is proposed.
//! - `saga_policy` the operators' saga recovery rules (`saga.policy_rules`),
//!   the leader orchestrator's `RecoveryPolicy`.
//! - `limits`   documented request limits (from `dtx_proto::limits`).

// openraft's StorageError is large and is the error type its storage traits
// require; boxing it at our boundary would only add allocations.
#![allow(clippy::result_large_err)]

pub mod api;
pub mod backup;
pub mod batcher;
pub mod codec;
pub mod config;
pub mod console;
pub mod ctx;
pub mod driver;
pub mod fatal_exit;
pub mod metrics;
pub mod node;
pub mod orchestrator;
pub mod participant_policy;
pub mod raft;
pub mod saga_policy;
pub mod security;
pub mod sm;
pub mod store;

/// The request limits live with the wire contract (`dtx_proto::limits`).
pub use dtx_proto::limits;
