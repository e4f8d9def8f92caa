//! Durable storage: the `KvEngine` trait (sled behind it), the Raft log store
//! and the state-machine store, both implementing openraft's storage-v2
//! traits on top of the engine.

pub mod engine;
pub mod log_store;
pub mod sm_store;

use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use serde::Serialize;

pub use engine::EngineError;
pub use engine::KvEngine;
pub use engine::SledEngine;
pub use engine::Space;
pub use log_store::LogStore;
pub use sm_store::StateMachineStore;

use crate::codec;

/// Identity recorded in a data directory the first time a node starts on it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct NodeIdentity {
    pub cluster_id: String,
    pub node_id: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("data directory {dir} belongs to cluster {found:?}, but this node is configured for cluster {expected:?}; refusing to start (use the right data_dir or cluster_id)")]
    OtherCluster {
        dir: String,
        found: String,
        expected: String,
    },
    #[error("data directory {dir} belongs to node {found}, but this node is configured as node {expected}; refusing to start (node ids must not change)")]
    OtherNode { dir: String, found: u64, expected: u64 },
    #[error("data directory {dir} is damaged: {message}; the node stops and leaves it untouched for inspection (never reset it silently)")]
    Damaged { dir: String, message: String },
}

const IDENTITY_KEY: &[u8] = b"identity";

/// Opens (or creates) a node's data directory and checks its identity.
pub fn open_data_dir(dir: &Path, cluster_id: &str, node_id: u64) -> Result<Arc<dyn KvEngine>, OpenError> {
    let dir_s = dir.display().to_string();
    let engine = SledEngine::open(dir).map_err(|e| match e {
        EngineError::Open { message, .. } => OpenError::Damaged {
            dir: dir_s.clone(),
            message,
        },
        other => OpenError::Engine(other),
    })?;
    let want = NodeIdentity {
        cluster_id: cluster_id.to_string(),
        node_id,
    };
    match engine.get(Space::NodeMeta, IDENTITY_KEY)? {
        Some(bytes) => {
            let found: NodeIdentity = codec::decode(&bytes).map_err(|e| OpenError::Damaged {
                dir: dir_s.clone(),
                message: format!("node identity record unreadable: {e}"),
            })?;
            if found.cluster_id != want.cluster_id {
                return Err(OpenError::OtherCluster {
                    dir: dir_s,
                    found: found.cluster_id,
                    expected: want.cluster_id,
                });
            }
            if found.node_id != want.node_id {
                return Err(OpenError::OtherNode {
                    dir: dir_s,
                    found: found.node_id,
                    expected: want.node_id,
                });
            }
        }
        None => {
            let has_data = engine.last(Space::Log)?.is_some()
                || engine.last(Space::StateMachine)?.is_some()
                || engine.get(Space::RaftMeta, log_store::VOTE_KEY)?.is_some();
            if has_data {
                return Err(OpenError::Damaged {
                    dir: dir_s,
                    message: "it holds Raft data but no node identity record".to_string(),
                });
            }
            let mut b = engine::WriteBatch::default();
            b.put(IDENTITY_KEY.to_vec(), codec::encode(&want).expect("identity encodes"));
            engine.write_batch(Space::NodeMeta, b)?;
            engine.flush()?;
        }
    }
    Ok(Arc::new(engine))
}
