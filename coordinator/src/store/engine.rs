//! The project's own storage trait. Everything durable goes through
//! `KvEngine`, so sled can be replaced without touching Raft or the state
//! machine (docs/adr/0002-sled.md).

use std::path::Path;

/// Independent key spaces. Writes within one space can be made atomic with
/// `write_batch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    /// Raft log entries, key = log index (big-endian u64).
    Log,
    /// Raft vote, committed log id, last purged log id.
    RaftMeta,
    /// Transaction records and state-machine metadata.
    StateMachine,
    /// The latest snapshot (meta and data).
    Snapshot,
    /// Node identity: cluster id, node id, format version.
    NodeMeta,
}

impl Space {
    pub const ALL: [Space; 5] = [
        Space::Log,
        Space::RaftMeta,
        Space::StateMachine,
        Space::Snapshot,
        Space::NodeMeta,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Space::Log => "log",
            Space::RaftMeta => "raft_meta",
            Space::StateMachine => "sm",
            Space::Snapshot => "snapshot",
            Space::NodeMeta => "node_meta",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("storage engine error in {space}: {message}")]
    Io { space: &'static str, message: String },
    #[error("cannot open data directory {path}: {message}")]
    Open { path: String, message: String },
}

/// One atomic group of writes to one space.
#[derive(Default, Debug)]
pub struct WriteBatch {
    pub ops: Vec<(Vec<u8>, Option<Vec<u8>>)>,
}

impl WriteBatch {
    pub fn put(&mut self, key: impl Into<Vec<u8>>, value: Vec<u8>) {
        self.ops.push((key.into(), Some(value)));
    }
    pub fn delete(&mut self, key: impl Into<Vec<u8>>) {
        self.ops.push((key.into(), None));
    }
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }
}

pub type KvPair = (Vec<u8>, Vec<u8>);

pub trait KvEngine: Send + Sync + 'static {
    fn get(&self, space: Space, key: &[u8]) -> Result<Option<Vec<u8>>, EngineError>;
    /// Applies every op of `batch` atomically (all or none after a crash).
    fn write_batch(&self, space: Space, batch: WriteBatch) -> Result<(), EngineError>;
    /// Pairs with `from <= key < to` (`to = None`: to the end), in key order.
    fn scan(&self, space: Space, from: &[u8], to: Option<&[u8]>) -> Result<Vec<KvPair>, EngineError>;
    /// Pairs whose key starts with `prefix`, in key order.
    fn scan_prefix(&self, space: Space, prefix: &[u8]) -> Result<Vec<KvPair>, EngineError>;
    fn first(&self, space: Space) -> Result<Option<KvPair>, EngineError>;
    fn last(&self, space: Space) -> Result<Option<KvPair>, EngineError>;
    /// Deletes keys with `from <= key < to` (`to = None`: to the end).
    fn delete_range(&self, space: Space, from: &[u8], to: Option<&[u8]>) -> Result<(), EngineError>;
    /// Makes every write issued so far durable (fsync). Blocking.
    fn flush(&self) -> Result<(), EngineError>;
}

/// sled 0.34 behind `KvEngine`: one `sled::Db` per node, one tree per space.
pub struct SledEngine {
    db: sled::Db,
    trees: Vec<(Space, sled::Tree)>,
}

/// Longest wait for a held directory lock on open.
pub const OPEN_LOCK_WAIT_MS: u64 = 3_000;

impl SledEngine {
    pub fn open(path: &Path) -> Result<Self, EngineError> {
        let open_err = |e: sled::Error| EngineError::Open {
            path: path.display().to_string(),
            message: e.to_string(),
        };
        let config = sled::Config::new()
            .path(path)
            .mode(sled::Mode::HighThroughput)
            // We flush explicitly where durability is required; no timer.
            .flush_every_ms(None);
        // A directory reopened in the same process right after it was closed
        // can still be locked for a moment by sled's background I/O threads;
        // a lock held by another process is reported after this wait.
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(OPEN_LOCK_WAIT_MS);
        let db = loop {
            match config.open() {
                Err(e) if super::is_lock_error(&e.to_string()) && std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                other => break other.map_err(open_err)?,
            }
        };
        let mut trees = Vec::new();
        for s in Space::ALL {
            trees.push((s, db.open_tree(s.name()).map_err(open_err)?));
        }
        Ok(SledEngine { db, trees })
    }

    fn tree(&self, space: Space) -> &sled::Tree {
        &self
            .trees
            .iter()
            .find(|(s, _)| *s == space)
            .expect("every space has a tree")
            .1
    }
}

fn io(space: Space) -> impl Fn(sled::Error) -> EngineError {
    move |e| EngineError::Io {
        space: space.name(),
        message: e.to_string(),
    }
}

fn pairs(
    space: Space,
    it: impl Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>>,
) -> Result<Vec<KvPair>, EngineError> {
    it.map(|r| r.map(|(k, v)| (k.to_vec(), v.to_vec())).map_err(io(space)))
        .collect()
}

impl KvEngine for SledEngine {
    fn get(&self, space: Space, key: &[u8]) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(self.tree(space).get(key).map_err(io(space))?.map(|v| v.to_vec()))
    }

    fn write_batch(&self, space: Space, batch: WriteBatch) -> Result<(), EngineError> {
        let mut b = sled::Batch::default();
        for (k, v) in batch.ops {
            match v {
                Some(v) => b.insert(k, v),
                None => b.remove(k),
            }
        }
        self.tree(space).apply_batch(b).map_err(io(space))
    }

    fn scan(&self, space: Space, from: &[u8], to: Option<&[u8]>) -> Result<Vec<KvPair>, EngineError> {
        let t = self.tree(space);
        match to {
            Some(to) => pairs(space, t.range(from..to)),
            None => pairs(space, t.range(from..)),
        }
    }

    fn scan_prefix(&self, space: Space, prefix: &[u8]) -> Result<Vec<KvPair>, EngineError> {
        pairs(space, self.tree(space).scan_prefix(prefix))
    }

    fn first(&self, space: Space) -> Result<Option<KvPair>, EngineError> {
        Ok(self
            .tree(space)
            .first()
            .map_err(io(space))?
            .map(|(k, v)| (k.to_vec(), v.to_vec())))
    }

    fn last(&self, space: Space) -> Result<Option<KvPair>, EngineError> {
        Ok(self
            .tree(space)
            .last()
            .map_err(io(space))?
            .map(|(k, v)| (k.to_vec(), v.to_vec())))
    }

    fn delete_range(&self, space: Space, from: &[u8], to: Option<&[u8]>) -> Result<(), EngineError> {
        let mut batch = WriteBatch::default();
        for (k, _) in self.scan(space, from, to)? {
            batch.delete(k);
        }
        self.write_batch(space, batch)
    }

    fn flush(&self) -> Result<(), EngineError> {
        self.db.flush().map(|_| ()).map_err(|e| EngineError::Io {
            space: "db",
            message: e.to_string(),
        })
    }
}
