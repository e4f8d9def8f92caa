//! The Raft log (openraft `RaftLogStorage`, storage-v2): entries in the
//! log files of `dtx_durable::wal` (directory `raft-log/` in the data
//! directory), vote, committed and purged log ids in the engine's
//! `RaftMeta` space.
//!
//! Durability rules (openraft's contract): an append is reported flushed only
//! after the fsync of the log files returned; `save_vote` flushes the engine
//! before it returns; a purge is durable in the engine before files go.
//!
//! Appends do not wait for their fsync: they write the entries, hand the
//! completion callback to one flusher thread and return. The flusher
//! takes every callback queued so far, syncs ONCE, then completes them in
//! order: concurrent appends share one fsync (group commit at the disk).
//!
//! One exception (ADR 0028, `raft::log_durability`): the leader's own
//! entries of its term are reported flushed at once, so openraft sends them
//! to the followers while the flusher syncs them; what openraft then counts
//! committed is acted on only up to the synced end (applies wait for it,
//! the committed index saved and sent is clamped to it), and a restarted
//! leader does not resume its term (`open_for_node`).
//!
//! Every stored value carries its format version: the log files their
//! header's (`dtx_durable::wal`), each entry and each metadata value the
//! codec's. Reading dispatches on it and names what it refuses
//! (docs/adr/0042-storage-engines.md).

use std::fmt::Debug;
use std::ops::Bound;
use std::ops::RangeBounds;
use std::sync::Arc;

use dtx_durable::wal::Wal;
use dtx_durable::wal::WalError;
use openraft::storage::LogFlushed;
use openraft::storage::RaftLogStorage;
use openraft::AnyError;
use openraft::EntryPayload;
use openraft::LogState;
use openraft::RaftLogId;
use openraft::RaftLogReader;
use openraft::StorageIOError;

use super::engine::EngineError;
use super::engine::KvEngine;
use super::engine::Space;
use super::engine::WriteBatch;
use crate::codec;
use crate::raft::log_durability::LogDurability;
use crate::raft::Entry;
use crate::raft::LogId;
use crate::raft::NodeId;
use crate::raft::StorageError;
use crate::raft::TypeConfig;
use crate::raft::Vote;

/// The log files' directory inside a node's data directory.
pub const WAL_DIR: &str = "raft-log";
/// A new log file is started when the current one reaches this size.
pub const WAL_SEGMENT_BYTES_MAX: u64 = 64 << 20;

pub(crate) const VOTE_KEY: &[u8] = b"vote";
const COMMITTED_KEY: &[u8] = b"committed";
const PURGED_KEY: &[u8] = b"purged";

/// What a metadata key holds, for messages.
fn meta_name(key: &[u8]) -> &'static str {
    match key {
        VOTE_KEY => "raft vote",
        COMMITTED_KEY => "raft committed log id",
        PURGED_KEY => "raft purged log id",
        _ => "raft metadata",
    }
}

/// What starts the log's error messages and log lines.
pub const WAL_NAME: &str = "raft log";

/// Opens (creating) the log files of the node whose data directory is
/// `data_dir`.
pub fn open_wal(data_dir: &std::path::Path) -> Result<Wal, WalError> {
    Wal::open(&data_dir.join(WAL_DIR), WAL_NAME, WAL_SEGMENT_BYTES_MAX)
}

/// Log store handle; cheap to clone (it is also its own log reader).
#[derive(Clone)]
pub struct LogStore {
    engine: Arc<dyn KvEngine>,
    wal: Arc<Wal>,
    /// A callback to complete after the next sync, or None: only sync
    /// (an append already reported, `raft::log_durability`).
    flusher: std::sync::mpsc::Sender<Option<LogFlushed<TypeConfig>>>,
    durability: Arc<LogDurability>,
}

/// Why the log could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum LogOpenError {
    #[error(transparent)]
    Wal(#[from] WalError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A stored value does not decode: named, with the format version
    /// found and the one this build reads when that is why.
    #[error(transparent)]
    Decode(#[from] codec::NamedCodecError),
}

impl LogOpenError {
    pub fn is_no_space(&self) -> bool {
        match self {
            LogOpenError::Wal(e) => e.is_no_space(),
            LogOpenError::Engine(e) => e.is_no_space(),
            LogOpenError::Decode(_) => false,
        }
    }
}

/// The flusher thread: waits for callbacks, syncs once per group, completes
/// them in arrival order. Ends when every `LogStore` handle is dropped.
/// A log error as the node reports it: a full disk in the words of every
/// other store of the node (free space on the data directory's filesystem,
/// what to do), anything else as the log says it.
fn log_error(wal: &Wal, e: &WalError) -> AnyError {
    match e {
        WalError::NoSpace { name, detail, .. } => {
            let data_dir = wal.dir().parent().unwrap_or(wal.dir());
            AnyError::new(&super::engine::no_space(data_dir, format!("in the {name}: {detail}")))
        }
        other => AnyError::new(other),
    }
}

fn run_flusher(
    wal: Arc<Wal>,
    durability: Arc<LogDurability>,
    rx: std::sync::mpsc::Receiver<Option<LogFlushed<TypeConfig>>>,
) {
    while let Ok(first) = rx.recv() {
        let mut group = vec![first];
        while let Ok(more) = rx.try_recv() {
            group.push(more);
        }
        // Tests hold the sync here (a slow or stalled disk) to see that
        // nothing is applied or told committed past it.
        while dtx_failpoint::refused("raft_log_flush") {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let (covered, epoch) = durability.before_sync();
        let started = std::time::Instant::now();
        // Tests make the sync fail as ENOSPC at fsync does (`failpoints`
        // only: t53); the log's own files stay as they are.
        let res = if dtx_failpoint::refused("raft_log_sync_no_space") {
            Err(WalError::NoSpace {
                name: WAL_NAME,
                path: wal.dir().display().to_string(),
                detail: "failpoint raft_log_sync_no_space: no space left on device at fsync".to_string(),
            })
        } else {
            wal.sync()
        };
        match &res {
            Ok(_) => durability.synced(covered, epoch),
            Err(_) => durability.failed(),
        }
        metrics::histogram!("dtx_storage_flush_seconds").record(started.elapsed().as_secs_f64());
        metrics::counter!("dtx_log_flushes_total").increment(1);
        metrics::histogram!("dtx_log_flush_group_appends").record(group.len() as f64);
        for cb in group.into_iter().flatten() {
            let r = match &res {
                Ok(_) => Ok(()),
                Err(e) => Err(std::io::Error::other(log_error(&wal, e).to_string())),
            };
            cb.log_io_completed(r);
        }
    }
}

impl LogStore {
    /// Opens the log of the node whose data directory is `data_dir` and
    /// whose engine is `engine` (opened on that directory, so its lock is
    /// held), and forgets the entries a purge covered.
    pub fn open(engine: Arc<dyn KvEngine>, data_dir: &std::path::Path) -> Result<Self, LogOpenError> {
        let wal = Arc::new(open_wal(data_dir)?);
        let purged: Option<LogId> = load_meta(engine.as_ref(), PURGED_KEY)?.flatten();
        if let Some(p) = purged {
            wal.purge_upto(p.index)?;
        }
        // What the files hold counts as durable from here on: sync it (a
        // process killed before its sync leaves writes the disk may still
        // lose).
        wal.sync()?;
        let last = load_last_log_id(&wal, purged)?;
        let vote: Option<Vote> = load_meta(engine.as_ref(), VOTE_KEY)?;
        let durability = Arc::new(LogDurability::new(last, vote));
        let (flusher, rx) = std::sync::mpsc::channel();
        let (w, d) = (wal.clone(), durability.clone());
        std::thread::Builder::new()
            .name("dtx-log-flusher".into())
            .spawn(move || run_flusher(w, d, rx))
            .expect("spawn the log flusher thread");
        Ok(LogStore {
            engine,
            wal,
            flusher,
            durability,
        })
    }

    /// Makes this the log of node `id` as it starts: a committed vote for
    /// itself is stored back as uncommitted, so the node does not resume
    /// leading its old term (it may have lost entries it had sent to its
    /// followers before their sync; a new entry at such an index in the
    /// same term would carry the log id of the lost one), and from now on
    /// its own appends as the leader are reported before their sync.
    /// Returns the vote as stored now.
    pub async fn open_for_node(&mut self, id: NodeId) -> Result<Option<Vote>, StorageError> {
        let mut vote: Option<Vote> = self.read_meta(VOTE_KEY)?;
        if let Some(v) = vote.filter(|v| v.is_committed() && v.leader_id().voted_for() == Some(id)) {
            let resigned = Vote::new(v.leader_id().get_term(), id);
            self.save_vote(&resigned).await?;
            tracing::info!(
                term = v.leader_id().get_term(),
                "this node led term {} before it stopped; it runs for a new term instead of resuming that one",
                v.leader_id().get_term()
            );
            vote = Some(resigned);
        }
        self.durability.set_node_id(id);
        Ok(vote)
    }

    /// What of the log is on disk (for the state machine and the
    /// transport, `raft::log_durability`).
    pub fn durability(&self) -> Arc<LogDurability> {
        self.durability.clone()
    }

    /// The first and last index the log holds (after its purge point).
    pub fn bounds(&self) -> Option<(u64, u64)> {
        self.wal.range()
    }

    fn read_meta<T: serde::de::DeserializeOwned>(&self, key: &[u8]) -> Result<Option<T>, StorageError> {
        read_meta_of(self.engine.as_ref(), key)
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
        let end = end.unwrap_or(u64::MAX);
        if start >= end {
            return Ok(Vec::new());
        }
        // The index of the first record read, to name one that does not
        // decode.
        let first = self.wal.range().map_or(start, |(first, _)| first.max(start));
        self.wal
            .read(start, end)
            .map_err(|e| StorageIOError::read_logs(AnyError::new(&e)))?
            .into_iter()
            .zip(first..)
            .map(|(v, index)| decode_entry(index, &v).map_err(|e| StorageIOError::read_logs(AnyError::new(&e)).into()))
            .collect()
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id: Option<LogId> = self.read_meta(PURGED_KEY)?.flatten();
        let last_log_id = last_log_id(&self.wal, last_purged_log_id)?;
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
        self.durability.vote_saved(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, StorageError> {
        self.read_meta(VOTE_KEY)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        // Not flushed on purpose: losing it only delays re-applying entries
        // until a quorum confirms the log again. (A leader that restarts in
        // its old term must not answer reads before that: openraft's read
        // index came from this value, ADR 0023, until ADR 0028.) Never past
        // the synced end of the log: a restart re-applies up to it.
        self.write_meta(COMMITTED_KEY, &self.durability.clamp_commit(committed))
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.read_meta::<Option<LogId>>(COMMITTED_KEY)?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let mut encoded = Vec::new();
        let mut last = None;
        let mut membership = false;
        for entry in entries {
            let bytes = codec::encode(&entry).map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
            encoded.push((entry.get_log_id().index, bytes));
            membership |= matches!(entry.payload, EntryPayload::Membership(_));
            last = Some(*entry.get_log_id());
        }
        let Some(last) = last else {
            callback.log_io_completed(Ok(()));
            return Ok(());
        };
        self.wal
            .append(&encoded)
            .map_err(|e| StorageIOError::write_logs(log_error(&self.wal, &e)))?;
        if self.durability.appended(last, membership) {
            // The leader's own entries: reported now, so openraft sends
            // them to the followers while the flusher syncs them; nothing
            // acts on their commit before that sync (`raft::log_durability`).
            metrics::counter!("dtx_log_appends_reported_before_sync_total").increment(1);
            callback.log_io_completed(Ok(()));
            if self.flusher.send(None).is_err() {
                self.durability.failed();
            }
            return Ok(());
        }
        // Durable before openraft may count this append: the flusher calls
        // back only after an fsync that covers these writes.
        if let Err(e) = self.flusher.send(Some(callback)) {
            if let Some(cb) = e.0 {
                cb.log_io_completed(Err(std::io::Error::other("the log flusher thread stopped")));
            }
        }
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.wal
            .truncate_from(log_id.index)
            .map_err(|e| StorageIOError::write_logs(log_error(&self.wal, &e)))?;
        // What is kept is made durable here, so the log's durable end is
        // simply the entry before the cut (`raft::log_durability`).
        if let Err(e) = self.wal.sync() {
            self.durability.failed();
            return Err(StorageIOError::write_logs(log_error(&self.wal, &e)).into());
        }
        let purged: Option<LogId> = self.read_meta(PURGED_KEY)?.flatten();
        self.durability.truncated(last_log_id(&self.wal, purged)?);
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        // Flush first: every state-machine write up to the snapshot that
        // allowed this purge becomes durable before the entries go away, so a
        // restart never finds applied state behind the first log entry.
        self.flush()
            .await
            .map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
        // The purge is durable before any entry file goes: a restart never
        // finds the log starting after a gap its purged record does not
        // cover.
        self.write_meta(PURGED_KEY, &Some(log_id))?;
        self.flush()
            .await
            .map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
        self.wal
            .purge_upto(log_id.index)
            .map_err(|e| StorageIOError::write_logs(log_error(&self.wal, &e)))?;
        self.durability.purged(log_id);
        Ok(())
    }
}

/// Decodes the log entry at `index`, naming it in the error.
fn decode_entry(index: u64, bytes: &[u8]) -> Result<Entry, codec::NamedCodecError> {
    codec::decode(bytes).map_err(|e| e.named(format!("raft log entry {index}")))
}

/// The id of the last entry the log holds, or the purge point when it holds
/// none.
fn load_last_log_id(wal: &Wal, purged: Option<LogId>) -> Result<Option<LogId>, LogOpenError> {
    let Some((_, last)) = wal.range() else {
        return Ok(purged);
    };
    match wal.read(last, last + 1)?.first() {
        Some(b) => Ok(Some(*decode_entry(last, b)?.get_log_id())),
        None => Ok(purged),
    }
}

fn last_log_id(wal: &Wal, purged: Option<LogId>) -> Result<Option<LogId>, StorageError> {
    load_last_log_id(wal, purged).map_err(|e| StorageIOError::read_logs(AnyError::new(&e)).into())
}

/// The metadata value under `key` (`None`: not written yet), decoded and
/// named.
fn load_meta<T: serde::de::DeserializeOwned>(engine: &dyn KvEngine, key: &[u8]) -> Result<Option<T>, LogOpenError> {
    match engine.get(Space::RaftMeta, key)? {
        None => Ok(None),
        Some(b) => Ok(Some(codec::decode(&b).map_err(|e| e.named(meta_name(key)))?)),
    }
}

fn read_meta_of<T: serde::de::DeserializeOwned>(engine: &dyn KvEngine, key: &[u8]) -> Result<Option<T>, StorageError> {
    load_meta(engine, key).map_err(|e| StorageIOError::read(AnyError::new(&e)).into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::EntryPayload;

    fn entry(index: u64) -> Entry {
        Entry {
            log_id: LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Blank,
        }
    }

    /// Writes entries to the log files without openraft's callback (which
    /// cannot be made outside openraft; the storage suite covers `append`).
    fn write_entries(log: &LogStore, range: std::ops::RangeInclusive<u64>) {
        let encoded: Vec<(u64, Vec<u8>)> = range.map(|i| (i, codec::encode(&entry(i)).unwrap())).collect();
        log.wal.append(&encoded).unwrap();
    }

    async fn indexes(log: &mut LogStore) -> Vec<u64> {
        log.try_get_log_entries(0..u64::MAX)
            .await
            .unwrap()
            .iter()
            .map(|e| e.log_id.index)
            .collect()
    }

    /// The purged record is read at open: entries up to it are never
    /// served again, even where their file is still on disk.
    #[tokio::test]
    async fn purged_entries_stay_purged_across_a_reopen() {
        let d = tempfile::tempdir().unwrap();
        let engine = crate::store::open_data_dir(d.path(), "c", 1).unwrap();
        let mut log = LogStore::open(engine.clone(), d.path()).unwrap();
        write_entries(&log, 1..=6);
        log.wal.sync().unwrap();
        log.purge(entry(3).log_id).await.unwrap();
        assert_eq!(indexes(&mut log).await, vec![4, 5, 6]);
        drop(log);
        let mut log = LogStore::open(engine.clone(), d.path()).unwrap();
        assert_eq!(indexes(&mut log).await, vec![4, 5, 6]);
        let state = log.get_log_state().await.unwrap();
        assert_eq!(state.last_purged_log_id.map(|l| l.index), Some(3));
        assert_eq!(state.last_log_id.map(|l| l.index), Some(6));
    }

    /// ADR 0028, rule 3: a node that led a term before it stopped does not
    /// resume it (it may have lost entries its followers kept); another
    /// node's leadership or a candidate's vote is left as it is.
    #[tokio::test]
    async fn a_restarted_leader_stores_its_vote_back_as_uncommitted() {
        let d = tempfile::tempdir().unwrap();
        let engine = crate::store::open_data_dir(d.path(), "c", 1).unwrap();
        let mut log = LogStore::open(engine.clone(), d.path()).unwrap();
        log.save_vote(&Vote::new_committed(7, 1)).await.unwrap();
        assert_eq!(log.open_for_node(1).await.unwrap(), Some(Vote::new(7, 1)));
        drop(log);
        let mut log = LogStore::open(engine.clone(), d.path()).unwrap();
        assert_eq!(
            log.read_vote().await.unwrap(),
            Some(Vote::new(7, 1)),
            "stored, not only returned"
        );

        log.save_vote(&Vote::new_committed(8, 2)).await.unwrap();
        assert_eq!(log.open_for_node(1).await.unwrap(), Some(Vote::new_committed(8, 2)));
        log.save_vote(&Vote::new(9, 1)).await.unwrap();
        assert_eq!(log.open_for_node(1).await.unwrap(), Some(Vote::new(9, 1)));
    }

    /// ADR 0028, rule 2: the committed index saved (which a restart
    /// re-applies up to) never passes the synced end of the log, though
    /// openraft counted the leader's unsynced copy.
    #[tokio::test]
    async fn the_committed_index_saved_never_passes_the_synced_log() {
        let d = tempfile::tempdir().unwrap();
        let engine = crate::store::open_data_dir(d.path(), "c", 1).unwrap();
        let mut log = LogStore::open(engine.clone(), d.path()).unwrap();
        log.save_vote(&Vote::new_committed(1, 1)).await.unwrap();
        log.durability.set_node_id(1);
        write_entries(&log, 1..=2);
        log.wal.sync().unwrap();
        log.durability
            .synced(Some(entry(2).log_id), log.durability.before_sync().1);
        write_entries(&log, 3..=5);
        assert!(
            log.durability.appended(entry(5).log_id, false),
            "the leader's own entries go early"
        );
        log.save_committed(Some(entry(5).log_id)).await.unwrap();
        assert_eq!(log.read_committed().await.unwrap(), Some(entry(2).log_id));
        let (covered, epoch) = log.durability.before_sync();
        log.wal.sync().unwrap();
        log.durability.synced(covered, epoch);
        log.save_committed(Some(entry(5).log_id)).await.unwrap();
        assert_eq!(log.read_committed().await.unwrap(), Some(entry(5).log_id));
    }

    /// A truncation makes what it keeps durable and is the new durable end:
    /// a follower applies nothing of the entries cut (which another leader
    /// replaces).
    #[tokio::test]
    async fn a_truncation_is_the_new_durable_end() {
        let d = tempfile::tempdir().unwrap();
        let engine = crate::store::open_data_dir(d.path(), "c", 1).unwrap();
        let mut log = LogStore::open(engine.clone(), d.path()).unwrap();
        write_entries(&log, 1..=6);
        log.durability.appended(entry(6).log_id, false);
        log.truncate(entry(4).log_id).await.unwrap();
        assert_eq!(
            log.durability.durable(),
            crate::raft::log_durability::Durable::UpTo(Some(entry(3).log_id))
        );
    }
    /// A log this build wrote reads back after a reopen: its files, its
    /// entries and its metadata, each in this build's format version.
    #[tokio::test]
    async fn a_log_written_by_this_version_reads_back() {
        let d = tempfile::tempdir().unwrap();
        let engine = crate::store::open_data_dir(d.path(), "c", 1).unwrap();
        let log = LogStore::open(engine.clone(), d.path()).unwrap();
        write_entries(&log, 1..=5);
        log.wal.sync().unwrap();
        drop(log);
        // Reopened: what the files hold counts as durable.
        let mut log = LogStore::open(engine.clone(), d.path()).unwrap();
        log.save_vote(&Vote::new(4, 2)).await.unwrap();
        log.save_committed(Some(entry(3).log_id)).await.unwrap();
        drop(log);
        let mut log = LogStore::open(engine.clone(), d.path()).unwrap();
        assert_eq!(indexes(&mut log).await, vec![1, 2, 3, 4, 5]);
        assert_eq!(log.read_vote().await.unwrap(), Some(Vote::new(4, 2)));
        assert_eq!(log.read_committed().await.unwrap(), Some(entry(3).log_id));
        let vote = engine.get(Space::RaftMeta, VOTE_KEY).unwrap().unwrap();
        assert_eq!(vote[0], codec::FORMAT_VERSION);
        let file = std::fs::read(d.path().join(WAL_DIR).join(format!("{:020}.wal", 1))).unwrap();
        assert_eq!(
            dtx_durable::format::read_file_header(dtx_durable::wal::WAL_FILE_MAGIC, &file),
            Some(dtx_durable::wal::WAL_FORMAT_VERSION)
        );
    }

    /// What a newer build wrote is refused at open, named, with the format
    /// version found and the one this build reads: a log file, an entry,
    /// the vote.
    #[tokio::test]
    async fn values_of_a_newer_format_version_are_refused_by_name() {
        let newer = codec::FORMAT_VERSION + 1;
        let refusal = |what: &str| {
            format!(
                "{what} format version {newer} is newer than this build reads ({}): upgrade the binary",
                codec::FORMAT_VERSION
            )
        };
        let written = || {
            let d = tempfile::tempdir().unwrap();
            let engine = crate::store::open_data_dir(d.path(), "c", 1).unwrap();
            let log = LogStore::open(engine.clone(), d.path()).unwrap();
            write_entries(&log, 1..=2);
            log.wal.sync().unwrap();
            (d, engine, log)
        };

        // An entry.
        let (d, engine, log) = written();
        let mut bytes = codec::encode(&entry(3)).unwrap();
        bytes[0] = newer;
        log.wal.append(&[(3, bytes)]).unwrap();
        log.wal.sync().unwrap();
        drop(log);
        let err = LogStore::open(engine.clone(), d.path()).err().expect("refused");
        assert_eq!(err.to_string(), refusal("raft log entry 3"));
        assert!(!err.is_no_space());

        // The vote.
        let (d, engine, mut log) = written();
        log.save_vote(&Vote::new(2, 1)).await.unwrap();
        drop(log);
        let mut vote = engine.get(Space::RaftMeta, VOTE_KEY).unwrap().unwrap();
        vote[0] = newer;
        let mut b = WriteBatch::default();
        b.put(VOTE_KEY.to_vec(), vote);
        engine.write_batch(Space::RaftMeta, b).unwrap();
        let err = LogStore::open(engine.clone(), d.path()).err().expect("refused");
        assert_eq!(err.to_string(), refusal("raft vote"));

        // A log file.
        let (d, engine, log) = written();
        drop(log);
        let path = d.path().join(WAL_DIR).join(format!("{:020}.wal", 1));
        let mut file = std::fs::read(&path).unwrap();
        let wal_newer = dtx_durable::wal::WAL_FORMAT_VERSION + 1;
        file[..dtx_durable::wal::WAL_FILE_HEADER_BYTES].copy_from_slice(&dtx_durable::format::file_header(
            dtx_durable::wal::WAL_FILE_MAGIC,
            wal_newer,
        ));
        std::fs::write(&path, &file).unwrap();
        let err = LogStore::open(engine.clone(), d.path()).err().expect("refused");
        assert_eq!(
            err.to_string(),
            format!(
                "raft log file {} format version {wal_newer} is newer than this build reads ({}): upgrade the binary",
                path.display(),
                dtx_durable::wal::WAL_FORMAT_VERSION
            )
        );
        assert_eq!(std::fs::read(&path).unwrap(), file, "left as it was");
    }
}
