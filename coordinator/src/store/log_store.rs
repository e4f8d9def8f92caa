//! The Raft log on a `KvEngine` (openraft `RaftLogStorage`, storage-v2).
//!
//! Durability rules (openraft's contract): an append is reported flushed only
//! after `flush` (fsync) returned; `save_vote` flushes before it returns.
//!
//! Appends do not wait for their fsync: they write the entries, hand the
//! completion callback to one flusher thread and return, so openraft keeps
//! working (replicating, accepting writes) while the disk syncs. The flusher
//! takes every callback queued so far, syncs ONCE, then completes them in
//! order: concurrent appends share one fsync (group commit at the disk).

use std::fmt::Debug;
use std::ops::Bound;
use std::ops::RangeBounds;
use std::sync::Arc;

use openraft::storage::LogFlushed;
use openraft::storage::RaftLogStorage;
use openraft::AnyError;
use openraft::LogState;
use openraft::RaftLogId;
use openraft::RaftLogReader;
use openraft::StorageIOError;

use super::engine::KvEngine;
use super::engine::Space;
use super::engine::WriteBatch;
use crate::codec;
use crate::raft::Entry;
use crate::raft::LogId;
use crate::raft::StorageError;
use crate::raft::TypeConfig;
use crate::raft::Vote;

pub(crate) const VOTE_KEY: &[u8] = b"vote";
const COMMITTED_KEY: &[u8] = b"committed";
const PURGED_KEY: &[u8] = b"purged";

fn index_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

/// Log store handle; cheap to clone (it is also its own log reader).
#[derive(Clone)]
pub struct LogStore {
    engine: Arc<dyn KvEngine>,
    flusher: std::sync::mpsc::Sender<LogFlushed<TypeConfig>>,
}

/// The flusher thread: waits for callbacks, syncs once per group, completes
/// them in arrival order. Ends when every `LogStore` handle is dropped.
fn run_flusher(engine: Arc<dyn KvEngine>, rx: std::sync::mpsc::Receiver<LogFlushed<TypeConfig>>) {
    while let Ok(first) = rx.recv() {
        let mut group = vec![first];
        while let Ok(more) = rx.try_recv() {
            group.push(more);
        }
        let res = engine.flush();
        metrics::counter!("dtx_log_flushes_total").increment(1);
        metrics::histogram!("dtx_log_flush_group_appends").record(group.len() as f64);
        for cb in group {
            let r = match &res {
                Ok(()) => Ok(()),
                Err(e) => Err(std::io::Error::other(e.to_string())),
            };
            cb.log_io_completed(r);
        }
    }
}

impl LogStore {
    pub fn new(engine: Arc<dyn KvEngine>) -> Self {
        let (flusher, rx) = std::sync::mpsc::channel();
        let e = engine.clone();
        std::thread::Builder::new()
            .name("dtx-log-flusher".into())
            .spawn(move || run_flusher(e, rx))
            .expect("spawn the log flusher thread");
        LogStore { engine, flusher }
    }

    fn read_meta<T: serde::de::DeserializeOwned>(&self, key: &[u8]) -> Result<Option<T>, StorageError> {
        let bytes = self
            .engine
            .get(Space::RaftMeta, key)
            .map_err(|e| StorageIOError::read(AnyError::new(&e)))?;
        match bytes {
            None => Ok(None),
            Some(b) => codec::decode(&b)
                .map(Some)
                .map_err(|e| StorageIOError::read(AnyError::new(&e)).into()),
        }
    }

    fn write_meta<T: serde::Serialize>(&self, key: &[u8], value: &T) -> Result<(), StorageError> {
        let mut b = WriteBatch::default();
        b.put(
            key.to_vec(),
            codec::encode(value).map_err(|e| StorageIOError::write(AnyError::new(&e)))?,
        );
        self.engine
            .write_batch(Space::RaftMeta, b)
            .map_err(|e| StorageIOError::write(AnyError::new(&e)).into())
    }

    async fn flush(&self) -> Result<(), std::io::Error> {
        let engine = self.engine.clone();
        tokio::task::spawn_blocking(move || engine.flush())
            .await
            .map_err(std::io::Error::other)?
            .map_err(std::io::Error::other)
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let start = match range.start_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(i) => i + 1,
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(i) => i.checked_add(1),
            Bound::Excluded(i) => Some(*i),
            Bound::Unbounded => None,
        };
        let end_key = end.map(index_key);
        let pairs = self
            .engine
            .scan(Space::Log, &index_key(start), end_key.as_ref().map(|k| &k[..]))
            .map_err(|e| StorageIOError::read_logs(AnyError::new(&e)))?;
        pairs
            .into_iter()
            .map(|(_, v)| codec::decode::<Entry>(&v).map_err(|e| StorageIOError::read_logs(AnyError::new(&e)).into()))
            .collect()
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id: Option<LogId> = self.read_meta(PURGED_KEY)?.flatten();
        let last = self
            .engine
            .last(Space::Log)
            .map_err(|e| StorageIOError::read_logs(AnyError::new(&e)))?;
        let last_log_id = match last {
            Some((_, v)) => {
                let e: Entry = codec::decode(&v).map_err(|e| StorageIOError::read_logs(AnyError::new(&e)))?;
                Some(*e.get_log_id())
            }
            None => last_purged_log_id,
        };
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), StorageError> {
        self.write_meta(VOTE_KEY, vote)?;
        self.flush()
            .await
            .map_err(|e| StorageIOError::write_vote(AnyError::new(&e)))?;
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        self.read_meta(VOTE_KEY)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        // Not flushed on purpose: losing it only delays re-applying entries
        // until the leader tells us the committed index again.
        self.write_meta(COMMITTED_KEY, &committed)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.read_meta::<Option<LogId>>(COMMITTED_KEY)?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let mut batch = WriteBatch::default();
        for entry in entries {
            let bytes = codec::encode(&entry).map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
            batch.put(index_key(entry.get_log_id().index).to_vec(), bytes);
        }
        self.engine
            .write_batch(Space::Log, batch)
            .map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
        // Durable before openraft may count this append: the flusher calls
        // back only after an fsync that covers these writes.
        if let Err(e) = self.flusher.send(callback) {
            e.0.log_io_completed(Err(std::io::Error::other("the log flusher thread stopped")));
        }
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.engine
            .delete_range(Space::Log, &index_key(log_id.index), None)
            .map_err(|e| StorageIOError::write_logs(AnyError::new(&e)).into())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        // Flush first: every state-machine write up to the snapshot that
        // allowed this purge becomes durable before the entries go away, so a
        // restart never finds applied state behind the first log entry.
        self.flush()
            .await
            .map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
        self.write_meta(PURGED_KEY, &Some(log_id))?;
        let end = log_id.index.checked_add(1).map(index_key);
        self.engine
            .delete_range(Space::Log, &index_key(0), end.as_ref().map(|k| &k[..]))
            .map_err(|e| StorageIOError::write_logs(AnyError::new(&e)).into())
    }
}
