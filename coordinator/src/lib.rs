//! dtx coordinator node: a two-phase-commit transaction registry whose
//! decisions are replicated by a three-node Raft group, and the leader's
//! 2PC driver. This crate is the node alone; the client applications embed
//! is `dtx-client`, the wire contract `dtx-proto`, the participant side
//! `participant-sdk`, and the `coordinator` command is built by `dtx-cli`.
//!
//! Module map (data flows top to bottom; imports run one way):
//! - `node`     wires a node together: storage, Raft, servers, leader loops.
//! - `fatal_exit` a node process stopped on a fatal error exits within a
//!   bound, with its error (`coordinator serve`).
//! - `api`      gRPC services (Coordinator, Admin, SagaService): they translate requests
//!   into state-machine commands or calls on the `Driver`; error -> status
//!   mapping in one place (`api::error`).
//! - `driver`   the leader's 2PC driver (`Driver`, one owner): prepare,
//!   decide, deliver, the ack queue, re-drive; `driver::health` per
//!   participant address.
//! - `orchestrator` the leader's saga orchestrator: drives every running
//!   saga by the pure plan and journal of `sm::saga` (issue 14).
//! - `ctx`      `NodeCtx`, what the API and the driver share: Raft, the
//!   state machine, the batcher, channels; propose and linearizable reads.
//! - `batcher`  group commit: many concurrent commands -> one Raft entry.
//! - `raft`     openraft type config, network client, transport service.
//! - `store`    `KvEngine` (sled) plus the log store and state-machine store.
//! - `sm`       the pure transaction state machine and saga journal (no
//!   I/O, no clock).
//! - `codec`    every binary encoding: version byte + bincode 2.
//! - `config`   TOML configuration with defaults and `validate()`.
//! - `participant_policy` the operators' participant address policy
//!   (ADR 0041), checked by the API before an enlistment is proposed.
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
pub mod security;
pub mod sm;
pub mod store;

/// The request limits live with the wire contract (`dtx_proto::limits`).
pub use dtx_proto::limits;
