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
    #[error("data directory {dir} does not exist")]
    Missing { dir: String },
    #[error("data directory {dir} is in use by another process (its lock is held); stop that process first")]
    InUse { dir: String },
    #[error("data directory {dir} was written in format version {found}, which this build cannot read (it reads version {supported}); run the build that wrote it, or start this one on a new data directory")]
    OtherFormat { dir: String, found: u8, supported: u8 },
    #[error("data directory {dir} is damaged: {message}; the node stops and leaves it untouched for inspection (never reset it silently)")]
    Damaged { dir: String, message: String },
}

const IDENTITY_KEY: &[u8] = b"identity";

/// sled reports a held directory lock as an I/O error (EWOULDBLOCK).
fn is_lock_error(message: &str) -> bool {
    message.contains("could not acquire lock")
        || message.contains("os error 11")
        || message.contains("WouldBlock")
        || message.contains("temporarily unavailable")
}

/// The identity record is the first thing read from a data directory, so
/// an older or newer format shows there first.
fn identity_unreadable(dir: &str, e: codec::CodecError) -> OpenError {
    match e {
        codec::CodecError::Version { found } => OpenError::OtherFormat {
            dir: dir.to_string(),
            found,
            supported: codec::FORMAT_VERSION,
        },
        e => OpenError::Damaged {
            dir: dir.to_string(),
            message: format!("node identity record unreadable: {e}"),
        },
    }
}

/// Opens (or creates) a node's data directory and checks its identity.
pub fn open_data_dir(dir: &Path, cluster_id: &str, node_id: u64) -> Result<Arc<dyn KvEngine>, OpenError> {
    let dir_s = dir.display().to_string();
    let engine = SledEngine::open(dir).map_err(|e| match e {
        EngineError::Open { message, .. } if is_lock_error(&message) => OpenError::InUse { dir: dir_s.clone() },
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
            let found: NodeIdentity = codec::decode(&bytes).map_err(|e| identity_unreadable(&dir_s, e))?;
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

/// A read-only look at a stopped node's data directory, for operators and
/// tests (`coordinator inspect`). It writes nothing.
pub fn inspect(dir: &Path) -> Result<serde_json::Value, OpenError> {
    let dir_s = dir.display().to_string();
    if !dir.exists() {
        return Err(OpenError::Missing { dir: dir_s });
    }
    let engine: Arc<dyn KvEngine> = Arc::new(SledEngine::open(dir).map_err(|e| match e {
        EngineError::Open { message, .. } if is_lock_error(&message) => OpenError::InUse { dir: dir_s.clone() },
        other => OpenError::Damaged {
            dir: dir_s.clone(),
            message: other.to_string(),
        },
    })?);
    let damaged = |m: String| OpenError::Damaged {
        dir: dir_s.clone(),
        message: m,
    };
    let identity: Option<NodeIdentity> = match engine.get(Space::NodeMeta, IDENTITY_KEY)? {
        Some(b) => Some(codec::decode(&b).map_err(|e| identity_unreadable(&dir_s, e))?),
        None => None,
    };
    let first_log = engine
        .first(Space::Log)?
        .map(|(k, _)| u64::from_be_bytes(k[..8].try_into().unwrap_or([0; 8])));
    let last_log = engine
        .last(Space::Log)?
        .map(|(k, _)| u64::from_be_bytes(k[..8].try_into().unwrap_or([0; 8])));
    let sm = StateMachineStore::open(engine.clone()).map_err(|e| damaged(e.to_string()))?;
    let st = sm.state();
    let records: Vec<serde_json::Value> = st
        .table
        .records()
        .map(|r| {
            serde_json::json!({
                "txid": r.txid,
                "idempotency_key": r.idempotency_key,
                "phase": r.phase.name(),
                "decision": r.decision().map(|d| d.outcome.to_string()),
                "decision_source": r.decision().map(|d| format!("{:?}", d.source)),
                "deadline_ms": r.deadline_ms,
                "participants": r.participants.iter().map(|p| serde_json::json!({
                    "id": p.id, "address": p.address, "acked": p.acked
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    Ok(serde_json::json!({
        "data_dir": dir_s,
        "cluster_id": identity.as_ref().map(|i| i.cluster_id.clone()),
        "node_id": identity.as_ref().map(|i| i.node_id),
        "log_first_index": first_log,
        "log_last_index": last_log,
        "last_applied_index": st.last_applied.map(|l| l.index),
        "next_txid": st.table.next_txid(),
        "transactions": records,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A data directory written in another format version is refused with
    /// a message naming both versions, and left as it was.
    #[test]
    fn other_format_version_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let engine = open_data_dir(dir.path(), "c", 1).unwrap();
        let mut identity = engine.get(Space::NodeMeta, IDENTITY_KEY).unwrap().unwrap();
        identity[0] = codec::FORMAT_VERSION - 1;
        let mut b = engine::WriteBatch::default();
        b.put(IDENTITY_KEY.to_vec(), identity.clone());
        engine.write_batch(Space::NodeMeta, b).unwrap();
        engine.flush().unwrap();
        drop(engine);

        let err = open_data_dir(dir.path(), "c", 1).err().expect("refused");
        assert!(
            matches!(err, OpenError::OtherFormat { found, supported, .. }
                if found == codec::FORMAT_VERSION - 1 && supported == codec::FORMAT_VERSION),
            "{err}"
        );
        assert!(err.to_string().contains("new data directory"), "{err}");
        // Untouched: the old identity record is still there.
        let engine = SledEngine::open(dir.path()).unwrap();
        assert_eq!(engine.get(Space::NodeMeta, IDENTITY_KEY).unwrap(), Some(identity));
    }
}
