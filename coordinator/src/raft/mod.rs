//! Raft plumbing: the openraft type configuration, the network client and the
//! transport service. Raft words only here (append, replicate, apply, term);
//! the transaction words live in `sm`.

pub mod deferred_commit;
pub mod log_durability;
pub mod network;
pub mod quorum_probe;
pub mod service;
pub mod serving;

use std::fmt;
use std::io::Cursor;

use serde::Deserialize;
use serde::Serialize;

use crate::sm::Command;
use crate::sm::CommandResult;

pub type NodeId = u64;

/// What every member advertises: where its peers reach its Raft transport,
/// and where clients reach its API.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeInfo {
    pub raft_addr: String,
    pub api_addr: String,
}

/// The members of a configuration (bootstrap, restore) as Raft's nodes.
pub fn nodes_of(members: &[crate::config::Member]) -> std::collections::BTreeMap<NodeId, NodeInfo> {
    members
        .iter()
        .map(|m| {
            (
                m.id,
                NodeInfo {
                    raft_addr: m.raft_addr.clone(),
                    api_addr: m.api_addr.clone(),
                },
            )
        })
        .collect()
}

impl fmt::Display for NodeInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "raft={} api={}", self.raft_addr, self.api_addr)
    }
}

/// The application payload of one Raft entry: a batch of state-machine
/// commands grouped by the batcher (group commit).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub commands: Vec<Command>,
}

/// One result per command of the batch, in order.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct BatchResult {
    pub results: Vec<CommandResult>,
}

openraft::declare_raft_types!(
    /// Type configuration of the coordinator's Raft group.
    pub TypeConfig:
        D = Batch,
        R = BatchResult,
        NodeId = NodeId,
        Node = NodeInfo,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

pub type Raft = openraft::Raft<TypeConfig>;
pub type LogId = openraft::LogId<NodeId>;
pub type Vote = openraft::Vote<NodeId>;
pub type Entry = openraft::Entry<TypeConfig>;
pub type StoredMembership = openraft::StoredMembership<NodeId, NodeInfo>;
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, NodeInfo>;
pub type Snapshot = openraft::Snapshot<TypeConfig>;
pub type StorageError = openraft::StorageError<NodeId>;
