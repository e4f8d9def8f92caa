//! The participant's durable store: its log records and the resource's own
//! data live in one engine (`kv`, ADR 0024: every key in memory, each
//! atomic batch one record in a log of files), so a resource change and the
//! log transition that goes with it are ONE atomic write; a reply (vote or
//! ack) is sent only after an fsync that covers it. Concurrent requests
//! share fsyncs through one flusher thread (group commit at the
//! participant), and the decisions one `ApplyDecisions` message delivers
//! are applied in one atomic write and one fsync (`apply_decisions`), and so
//! are the prepares of one `PrepareMany` message (`prepare_many`).
//!
//! Every file of the store carries its format version (`kv`), and so does
//! every log record (`encode_entry`); opening dispatches on them and
//! refuses another version by name, as it refuses a directory of the
//! pre-release layout in sled (docs/adr/0042-storage-engines.md).
//!
//! Key layout, a transaction being named by its [`GlobalTxid`] bytes
//! (`GlobalTxid::key_bytes`: the txid, big-endian, for incarnation 0; the
//! incarnation and then the txid, both big-endian, otherwise):
//! `l` + transaction -> encoded `LogEntry`;
//! `d` + key -> the resource's value; `g` + decided time (ms since the Unix
//! epoch, big-endian) + transaction -> empty: the records that may one day be
//! garbage-collected (decided ones, and READ_ONLY votes, which never change
//! again), in the order they became so (`gc_candidates`, `forget_records`);
//! `i` + transaction -> empty: the in-doubt records (YES vote, no decision), so
//! recovery finds them without reading the whole log. Both indexes are
//! written in the same atomic batch as the record they index.
//! `t` + incarnation (big-endian) -> the term floor of that incarnation
//! (8 bytes, big-endian): the highest leader term of any record written
//! for it, raised in the same atomic batch as the record, never lowered
//! (garbage collection leaves it), so a Prepare or CommitOnePhase of a
//! transaction without a record from an older term is refused
//! (`log::step`, invariant 9). `m` + name -> store metadata.
//! `r` + transaction -> participant id: a branch that prepared here and
//! whose registration with the cluster is not known to be recorded
//! (`prepare_branch`, written with its YES record, removed once settled).

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::Arc;
use std::sync::Mutex;

use tokio::sync::oneshot;

use crate::kv::KvBatch;
use crate::kv::KvError;
use crate::kv::KvFiles;
use crate::kv::KvOpenError;

use crate::log::step;
use crate::log::Action;
pub use crate::log::GlobalTxid;
use crate::log::LocalState;
use crate::log::LogEntry;
use crate::log::Message;
use crate::log::Vote;
use crate::participant::AcksAndVerdicts;
use crate::participant::Answer;
use crate::participant::InDoubtSummary;
use crate::participant::InspectQuery;
use crate::participant::InspectedRecord;
use crate::participant::Inspection;
use crate::participant::Participant;
pub use crate::participant::PhaseTwo;
pub use crate::participant::Reply;
pub use crate::participant::StoreError;
pub use crate::participant::StoreFailure;
use crate::participant::Verdict;

const LOG_PREFIX: u8 = b'l';
const DATA_PREFIX: u8 = b'd';
const GC_PREFIX: u8 = b'g';
const DOUBT_PREFIX: u8 = b'i';
const FLOOR_PREFIX: u8 = b't';
/// The format version of an encoded log record (`encode_entry`): the one
/// this build writes and the only one it reads.
const ENTRY_FORMAT: u8 = 1;
/// Most GC index entries one `inspect` looks through (newest first) for
/// the times of decided records; an older record's time is not reported.
const INSPECT_TIME_SCAN_KEYS_MAX: usize = 100_000;

/// True when `e` says the file system is full or over quota.
pub(crate) fn sled_disk_full(e: &sled::Error) -> bool {
    matches!(
        e,
        sled::Error::Io(io) if dtx_durable::is_no_space_io(io)
    )
}

/// A short description of `e` (sled's copies of an I/O error nest the
/// original's debug form).
fn sled_detail(e: &sled::Error) -> String {
    match e {
        sled::Error::Io(io) if io.kind() == std::io::ErrorKind::StorageFull => "no space left on device".into(),
        sled::Error::Io(io) if io.kind() == std::io::ErrorKind::QuotaExceeded => "disk quota exceeded".into(),
        other => other.to_string(),
    }
}

/// The first failed write or fsync of a store (the participant store, the
/// saga step store): once it is set the store stops, refusing every later
/// request, since its engine refuses every later write anyway (sled, and
/// `kv` by design) and reads could show writes that never reached the disk.
pub(crate) struct FailureLatch {
    /// The store's directory (or tree name), for messages.
    path: String,
    failure: tokio::sync::watch::Sender<Option<StoreFailure>>,
}

impl FailureLatch {
    pub(crate) fn new(path: String) -> FailureLatch {
        FailureLatch {
            path,
            failure: tokio::sync::watch::Sender::new(None),
        }
    }

    /// Records `e` unless a failure was recorded before; the failure that
    /// stopped the store, and whether it is `e` (to log and count once).
    pub(crate) fn record_sled(&self, e: &sled::Error) -> (StoreFailure, bool) {
        self.record(sled_disk_full(e), sled_detail(e))
    }

    /// Records a failure (`disk_full` when for lack of space) unless one
    /// was recorded before; as `record_sled`.
    pub(crate) fn record(&self, disk_full: bool, detail: String) -> (StoreFailure, bool) {
        let failure = StoreFailure {
            path: self.path.clone(),
            disk_full,
            detail,
        };
        let first = self.failure.send_if_modified(|f| {
            if f.is_none() {
                *f = Some(failure.clone());
                true
            } else {
                false
            }
        });
        (self.get().unwrap_or(failure), first)
    }

    /// Why the store stopped, if it has.
    pub(crate) fn get(&self) -> Option<StoreFailure> {
        self.failure.borrow().clone()
    }

    /// `Stopped` once a failure was recorded.
    pub(crate) fn check(&self) -> Result<(), StoreError> {
        match self.get() {
            Some(f) => Err(StoreError::Stopped(f)),
            None => Ok(()),
        }
    }

    /// Waits until a failure is recorded and says which.
    pub(crate) async fn stopped(&self) -> StoreFailure {
        let mut rx = self.failure.subscribe();
        let failure = match rx.wait_for(|f| f.is_some()).await {
            Ok(f) => f.clone(),
            // The sender lives as long as the latch.
            Err(_) => None,
        };
        failure.expect("the store's failure is set before it is signalled")
    }
}

/// Writes a resource stages during prepare, commit or abort. They become
/// durable together with the log record, or not at all.
#[derive(Default, Debug)]
pub struct Staged {
    ops: StagedOps,
    /// Why the resource votes NO (`refuse`).
    reason: Option<String>,
}

/// The reason a NO vote gives when the resource named none.
const NO_REASON_DEFAULT: &str = "the resource refused";
/// The reason of a NO vote that repeats what the log holds.
const ABORTED_HERE_BEFORE: &str =
    "this transaction was aborted here before (a NO vote, an abort or a tombstone is recorded)";

impl Staged {
    /// Votes NO for `reason` (sent to the coordinator with the vote, for
    /// its log and the operator): discards what was staged so far and
    /// returns `Vote::No`, for `Resource::prepare` to return.
    pub fn refuse(&mut self, reason: impl Into<String>) -> Vote {
        self.ops.clear();
        self.reason = Some(reason.into());
        Vote::No
    }

    /// The reason of a NO vote: the one given to `refuse`, else a default.
    fn no_reason(&self) -> String {
        self.reason.clone().unwrap_or_else(|| NO_REASON_DEFAULT.to_string())
    }

    pub fn put(&mut self, key: &[u8], value: &[u8]) {
        self.ops.push((key.to_vec(), Some(value.to_vec())));
    }

    pub fn delete(&mut self, key: &[u8]) {
        self.ops.push((key.to_vec(), None));
    }

    /// What this batch wrote last for `key` so far: `Some(Some(v))` set,
    /// `Some(None)` removed, `None` untouched (the outbox and inbox read
    /// their own writes of the same call through it).
    pub(crate) fn latest(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        latest_in(&self.ops, key)
    }

    /// Adds `other`'s writes after this batch's.
    pub(crate) fn extend(&mut self, other: Staged) {
        self.ops.extend(other.ops);
    }

    /// How many keys starting with `prefix` this batch sets so far.
    pub(crate) fn count_set_with_prefix(&self, prefix: &[u8]) -> usize {
        count_set_in(&self.ops, prefix)
    }

    /// Adds the staged writes, on the resource's key space, to `overlay`.
    fn into_overlay(self, overlay: &mut Overlay) {
        for (k, v) in self.ops {
            overlay.insert(data_key(&k), v);
        }
    }

    /// The staged writes as a batch on the resource's key space.
    fn into_batch(self) -> KvBatch {
        self.ops.into_iter().map(|(k, v)| (data_key(&k), v)).collect()
    }
}

/// Staged writes in order: a key and its new value, `None` to remove it
/// (the participant store's `Staged`, the saga step store's `StepStaged`).
pub(crate) type StagedOps = Vec<(Vec<u8>, Option<Vec<u8>>)>;

/// What `ops` wrote last for `key`: `Some(Some(v))` set, `Some(None)`
/// removed, `None` untouched.
pub(crate) fn latest_in<'a>(ops: &'a StagedOps, key: &[u8]) -> Option<Option<&'a [u8]>> {
    ops.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.as_deref())
}

/// How many keys starting with `prefix` `ops` sets.
pub(crate) fn count_set_in(ops: &StagedOps, prefix: &[u8]) -> usize {
    ops.iter().filter(|(k, v)| v.is_some() && k.starts_with(prefix)).count()
}

/// A key and its value.
pub type KvPair = (Vec<u8>, Vec<u8>);

/// For tests and tools: the store's engine under its key layout (log
/// records, indexes, the resource's data with its prefix), read and
/// written behind the store's back. Not part of the SDK's API.
#[doc(hidden)]
#[derive(Clone)]
pub struct RawStore(Arc<KvFiles>);

impl RawStore {
    pub fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.0.get(key)
    }

    /// Every key and value, in key order.
    pub fn dump(&self) -> Vec<KvPair> {
        self.0.dump()
    }

    /// Sets (`Some`) or removes (`None`) keys in one durable write.
    pub fn write(&self, batch: Vec<(Vec<u8>, Option<Vec<u8>>)>) -> Result<(), String> {
        self.0
            .apply(batch)
            .and_then(|_| self.0.sync())
            .map_err(|e| e.to_string())
    }
}

/// Read access to the resource's data as written so far: what is in the
/// tree, and, while a group of decisions is applied in one write
/// (`ParticipantStore::apply_decisions`), the writes of the group's earlier
/// items over it, so each item sees the ones before it as if each had been
/// written on its own.
pub struct View<'a> {
    tree: &'a KvFiles,
    overlay: Option<&'a Overlay>,
}

impl View<'_> {
    pub fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        let key = data_key(key);
        if let Some(v) = self.overlay.and_then(|o| o.get(&key)) {
            return Ok(v.clone());
        }
        Ok(self.tree.get(&key))
    }

    /// Every (key, value) whose key starts with `prefix`, in key order.
    pub fn scan(&self, prefix: &[u8]) -> Result<Vec<KvPair>, StoreError> {
        let prefix = data_key(prefix);
        let from_tree = self
            .tree
            .scan_prefix(&prefix)
            .into_iter()
            .map(|(mut k, v)| (k.split_off(1), v));
        let Some(overlay) = self.overlay else {
            return Ok(from_tree.collect());
        };
        let mut merged: std::collections::BTreeMap<Vec<u8>, Vec<u8>> = from_tree.collect();
        for (k, v) in overlay
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
        {
            match v {
                Some(v) => merged.insert(k[1..].to_vec(), v.clone()),
                None => merged.remove(&k[1..]),
            };
        }
        Ok(merged.into_iter().collect())
    }
}

/// Writes not yet in the tree, by tree key (`None`: removed), later writes
/// replacing earlier ones, as in one batch.
type Overlay = std::collections::BTreeMap<Vec<u8>, Option<Vec<u8>>>;

/// What a service implements for its resource. Calls are serialized by the
/// store (one at a time), so a resource may check and take its locks without
/// its own synchronization. A call must not block on the network.
pub trait Resource: Send + Sync + 'static {
    /// Checks and stages the work of `txid`. YES: the staged writes become
    /// durable with the PREPARED record (hold what must stay locked until
    /// the decision). NO: the staged writes are discarded. READ_ONLY: nothing
    /// to commit or abort later.
    ///
    /// `txid` names the transaction with its incarnation: two transactions
    /// with the same txid number and different incarnations are different
    /// transactions, so a resource that keys its own data by transaction
    /// (pending work, an apply log) keys it by the whole [`GlobalTxid`]
    /// (its `Display`, or `GlobalTxid::key_bytes`, which for incarnation 0
    /// give what the txid alone gave before incarnations).
    fn prepare(&self, view: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote;
    /// Makes the prepared work of `txid` visible and releases its locks.
    fn commit(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged);
    /// Rolls back the prepared work of `txid` and releases its locks.
    fn abort(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged);
}

pub struct ParticipantStore<R: Resource> {
    /// Set by the first failed write; then every request is refused.
    latch: FailureLatch,
    tree: Arc<KvFiles>,
    resource: R,
    /// Serializes read-step-write; never held across the fsync.
    serial: Mutex<()>,
    /// When this process recorded each YES vote still in doubt. Records from
    /// before the process started are absent and count as old.
    prepared_at: Mutex<HashMap<GlobalTxid, std::time::Instant>>,
    /// When this process opened the store: the least age of a vote from
    /// before (for the in-doubt age gauge).
    opened: std::time::Instant,
    /// The wall clock at `opened`, in ms since the Unix epoch: a vote's
    /// time is `opened_unix_ms` plus its offset from `opened`, the same
    /// number at every read (deriving it from `now` at each read rounded
    /// differently from one read to the next).
    opened_unix_ms: u64,
    /// Branches whose handler flow runs in this process now (prepared,
    /// registration under way): recovery leaves them to it.
    branches_running: Mutex<std::collections::HashSet<GlobalTxid>>,
    /// In-doubt index entries already reported as inconsistent.
    inconsistent: Mutex<std::collections::HashSet<Vec<u8>>>,
    /// `None` only while dropping.
    flusher: Option<mpsc::Sender<oneshot::Sender<Result<(), KvError>>>>,
    flusher_thread: Option<std::thread::JoinHandle<()>>,
    /// Asks the checkpoint thread for a checkpoint (`None` only while
    /// dropping).
    checkpointer: Option<mpsc::SyncSender<()>>,
    checkpoint_thread: Option<std::thread::JoinHandle<()>>,
    /// The directory's lock, held as long as the store (dropped last).
    _lock: std::fs::File,
}

impl<R: Resource> Drop for ParticipantStore<R> {
    fn drop(&mut self) {
        // Stop the flusher and wait for it, so the directory's lock is
        // released when the store is gone (a restart can reopen it).
        self.flusher.take();
        if let Some(t) = self.flusher_thread.take() {
            let _ = t.join();
        }
        self.checkpointer.take();
        if let Some(t) = self.checkpoint_thread.take() {
            let _ = t.join();
        }
    }
}

/// `prefix` + the transaction's key bytes (8 for incarnation 0, 16 else).
fn tx_key(prefix: u8, txid: GlobalTxid) -> Vec<u8> {
    let mut k = Vec::with_capacity(17);
    k.push(prefix);
    k.extend_from_slice(&txid.key_bytes());
    k
}

fn log_key(txid: GlobalTxid) -> Vec<u8> {
    tx_key(LOG_PREFIX, txid)
}

fn doubt_key(txid: GlobalTxid) -> Vec<u8> {
    tx_key(DOUBT_PREFIX, txid)
}

/// `r` + transaction -> the participant id of a branch prepared here
/// whose registration is not known to be recorded (`prepare_branch`).
const BRANCH_PREFIX: &[u8] = b"r";

fn branch_key(txid: GlobalTxid) -> Vec<u8> {
    let mut k = BRANCH_PREFIX.to_vec();
    k.extend_from_slice(&txid.key_bytes());
    k
}

/// What `ParticipantStore::prepare_branch` did.
#[derive(Debug)]
pub enum BranchPrepare {
    /// Prepared now: the vote (a YES is marked unregistered).
    Answered(Answer),
    /// The transaction has a record here already: nothing was done.
    Exists(LogEntry),
}

fn floor_key(incarnation: u64) -> [u8; 9] {
    let mut k = [FLOOR_PREFIX; 9];
    k[1..].copy_from_slice(&incarnation.to_be_bytes());
    k
}

/// The transaction a log or in-doubt index key names (`None`: a key of
/// another length).
fn key_txid(k: &[u8]) -> Option<GlobalTxid> {
    GlobalTxid::from_key_bytes(k.get(1..)?)
}

/// A term floor's stored value.
fn decode_floor(b: &[u8]) -> u64 {
    <[u8; 8]>::try_from(b).map(u64::from_be_bytes).unwrap_or(0)
}

/// Adds `txid`'s record `e` to `batch`, with the index changes that go with
/// moving from `before` to `e`, and the floor's raise when `e.term` is
/// above `floor`.
fn put_record(batch: &mut KvBatch, txid: GlobalTxid, before: Option<&LogEntry>, e: &LogEntry, floor: u64) {
    batch.extend(record_writes(txid, before, e, floor));
}

/// The tree writes that record `e` for `txid`, coming from `before`: the
/// record itself, the index changes that go with it, and the term floor
/// of its incarnation raised to `e.term` when that is above `floor` (the
/// floor as written so far), in the same batch.
fn record_writes(
    txid: GlobalTxid,
    before: Option<&LogEntry>,
    e: &LogEntry,
    floor: u64,
) -> Vec<(Vec<u8>, Option<Vec<u8>>)> {
    let mut out = vec![(log_key(txid), Some(encode_entry(e).to_vec()))];
    let was_in_doubt = before.is_some_and(crate::log::in_doubt);
    match (was_in_doubt, crate::log::in_doubt(e)) {
        (false, true) => out.push((doubt_key(txid), Some(Vec::new()))),
        (true, false) => out.push((doubt_key(txid), None)),
        _ => {}
    }
    if is_collectable(e) && !before.is_some_and(is_collectable) {
        out.push((gc_key(unix_ms(), txid), Some(Vec::new())));
    }
    if e.term > floor {
        out.push((
            floor_key(txid.incarnation).to_vec(),
            Some(e.term.to_be_bytes().to_vec()),
        ));
    }
    out
}

fn gc_key(decided_ms: u64, txid: GlobalTxid) -> Vec<u8> {
    let mut k = Vec::with_capacity(25);
    k.push(GC_PREFIX);
    k.extend_from_slice(&decided_ms.to_be_bytes());
    k.extend_from_slice(&txid.key_bytes());
    k
}

/// (decided ms, transaction) of a GC index key (`None`: another length).
fn parse_gc_key(k: &[u8]) -> Option<(u64, GlobalTxid)> {
    if k.len() < 9 {
        return None;
    }
    let ms = u64::from_be_bytes(k[1..9].try_into().ok()?);
    Some((ms, GlobalTxid::from_key_bytes(&k[9..])?))
}

/// Decided (committed, aborted, tombstone), or a READ_ONLY vote: records
/// that never change again and that the log GC may remove once the cluster
/// will send nothing more for them. An in-doubt YES vote never is.
fn is_collectable(e: &LogEntry) -> bool {
    matches!(
        e.state,
        LocalState::Committed | LocalState::Aborted { .. } | LocalState::Prepared { vote: Vote::ReadOnly }
    )
}

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn data_key(key: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(key.len() + 1);
    k.push(DATA_PREFIX);
    k.extend_from_slice(key);
    k
}

/// `format, state, vote, term (8 bytes BE)`.
pub fn encode_entry(e: &LogEntry) -> [u8; 11] {
    let (state, vote) = match e.state {
        LocalState::Prepared { vote: Vote::Yes } => (1, 1),
        LocalState::Prepared { vote: Vote::No } => (1, 2),
        LocalState::Prepared { vote: Vote::ReadOnly } => (1, 3),
        LocalState::Committed => (2, 0),
        LocalState::Aborted { tombstone: false } => (3, 0),
        LocalState::Aborted { tombstone: true } => (4, 0),
    };
    let mut out = [0u8; 11];
    out[0] = ENTRY_FORMAT;
    out[1] = state;
    out[2] = vote;
    out[3..].copy_from_slice(&e.term.to_be_bytes());
    out
}

/// Decodes a log record, dispatching on its format version: this build's
/// decodes; another one is refused, saying which and what this build reads.
pub fn decode_entry(b: &[u8]) -> Result<LogEntry, String> {
    let Some(&version) = b.first() else {
        return Err("an empty record".to_string());
    };
    dtx_durable::format::check(
        || "participant log record".to_string(),
        version.into(),
        ENTRY_FORMAT.into(),
    )
    .map_err(|e| e.to_string())?;
    if b.len() != 11 {
        return Err(format!("{} bytes, format {version}", b.len()));
    }
    let state = match (b[1], b[2]) {
        (1, 1) => LocalState::Prepared { vote: Vote::Yes },
        (1, 2) => LocalState::Prepared { vote: Vote::No },
        (1, 3) => LocalState::Prepared { vote: Vote::ReadOnly },
        (2, 0) => LocalState::Committed,
        (3, 0) => LocalState::Aborted { tombstone: false },
        (4, 0) => LocalState::Aborted { tombstone: true },
        other => return Err(format!("unknown state {other:?}")),
    };
    let term = u64::from_be_bytes(b[3..11].try_into().expect("8 bytes"));
    Ok(LogEntry { state, term })
}

/// How long `open` waits for a directory lock that is held. sled releases the
/// lock only when its last background I/O task has finished, which can be a
/// moment after the previous store in this process was dropped; a lock held by
/// another live process is still reported, after this wait.
const OPEN_LOCK_WAIT_MS: u64 = 3_000;

/// sled reports a held directory lock as an I/O error of kind `Other`
/// carrying this text.
fn is_lock_error(e: &sled::Error) -> bool {
    e.to_string().contains("could not acquire lock")
}

/// Opens the sled database in `path`, waiting up to `OPEN_LOCK_WAIT_MS`
/// for a directory lock still held by a store of this process that is
/// closing (the participant store, the saga step store).
pub(crate) fn open_sled(path: &std::path::Path) -> Result<sled::Db, sled::Error> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(OPEN_LOCK_WAIT_MS);
    loop {
        match sled::Config::new().path(path).flush_every_ms(None).open() {
            Err(e) if is_lock_error(&e) && std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

/// Opens what syncs the files of the sled directory `path` (open sled
/// there first).
pub(crate) fn open_dir_sync(path: &std::path::Path) -> Result<dtx_durable::DirSync, StoreError> {
    dtx_durable::DirSync::open(path).map_err(|e| StoreError::Open {
        path: path.display().to_string(),
        message: format!("cannot open the data file to sync it: {e}"),
        disk_full: false,
    })
}

/// Syncs the engine for each group of waiting writers; asks for a
/// checkpoint when the log has grown enough (`KvFiles::checkpoint_due`).
fn run_flusher(
    kv: Arc<KvFiles>,
    checkpointer: mpsc::SyncSender<()>,
    rx: mpsc::Receiver<oneshot::Sender<Result<(), KvError>>>,
) {
    while let Ok(first) = rx.recv() {
        let mut group = vec![first];
        while let Ok(more) = rx.try_recv() {
            group.push(more);
        }
        let res = kv.sync();
        for w in group {
            let _ = w.send(res.clone());
        }
        if res.is_ok() && kv.checkpoint_due() {
            // Full: one is asked for already.
            let _ = checkpointer.try_send(());
        }
    }
}

/// Writes the checkpoints the flusher asks for, off the write path. A
/// failure stops the engine, so the next sync reports it to the store.
fn run_checkpointer(kv: Arc<KvFiles>, rx: mpsc::Receiver<()>) {
    while rx.recv().is_ok() {
        if let Err(e) = kv.checkpoint() {
            tracing::error!(disk_full = e.disk_full, "participant store: checkpoint failed: {e}");
        }
    }
}

/// sled's data file, which a participant store directory holds only in the
/// pre-release layout (the store in sled, before ADR 0024).
const SLED_DATA_FILE: &str = "db";

/// Refuses a store directory of the pre-release layout in sled: this build
/// does not read it, and changes nothing in it.
fn refuse_sled_layout(path: &std::path::Path) -> Result<(), StoreError> {
    if !path.join(SLED_DATA_FILE).exists() {
        return Ok(());
    }
    Err(StoreError::Open {
        path: path.display().to_string(),
        message: format!(
            "it holds a store written by sled (`{SLED_DATA_FILE}`), a pre-release layout that carries no format version and that this build does not read (it reads participant store format version {}); nothing was changed. Settle its in-doubt transactions with the build that wrote it, then start this one on a new directory",
            crate::kv::KV_FORMAT_VERSION
        ),
        disk_full: false,
    })
}

/// What a failed open of the engine says.
fn kv_open_message(e: &KvError) -> String {
    if e.disk_full {
        format!("the disk is full ({}); start again once space is freed", e.detail)
    } else {
        e.detail.clone()
    }
}

/// Takes the store directory's lock file (`lock`, an exclusive `flock`),
/// waiting up to `OPEN_LOCK_WAIT_MS` for a store of this process that is
/// still closing.
fn lock_store_dir(path: &std::path::Path) -> Result<std::fs::File, StoreError> {
    use std::os::fd::AsRawFd;
    let open_err = |message: String, disk_full: bool| StoreError::Open {
        path: path.display().to_string(),
        message,
        disk_full,
    };
    std::fs::create_dir_all(path)
        .map_err(|e| open_err(format!("cannot create: {e}"), dtx_durable::is_no_space_io(&e)))?;
    let lock_path = path.join(STORE_LOCK_FILE);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&lock_path)
        .map_err(|e| {
            open_err(
                format!("cannot open {}: {e}", lock_path.display()),
                dtx_durable::is_no_space_io(&e),
            )
        })?;
    let until = std::time::Instant::now() + std::time::Duration::from_millis(OPEN_LOCK_WAIT_MS);
    loop {
        // SAFETY: flock(2) on a descriptor owned by `file`; the lock lasts
        // as long as the returned file.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(file);
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EWOULDBLOCK)
            || std::time::Instant::now() >= until
        {
            return Err(open_err(
                format!("in use by another process or store (its lock was still held after {OPEN_LOCK_WAIT_MS} ms); stop that one first"),
                false,
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Least free space on the store's filesystem for a start: a start with
/// less would stop at its first write (or its checkpoint) anyway, so it is
/// refused at once, saying so, and changes nothing (as a node's start,
/// docs/operations.md "Disk full").
pub const OPEN_FREE_BYTES_MIN: u64 = 4 << 20;

/// `Open` with `disk_full` when the filesystem holding `path` has less
/// than `OPEN_FREE_BYTES_MIN` free.
fn refuse_without_room(path: &std::path::Path) -> Result<(), StoreError> {
    match dtx_durable::free_bytes(path) {
        Ok(free) if free < OPEN_FREE_BYTES_MIN => Err(StoreError::Open {
            path: path.display().to_string(),
            message: format!(
                "the disk is full ({free} bytes free, a start needs {OPEN_FREE_BYTES_MIN}); nothing was changed, start again once space is freed"
            ),
            disk_full: true,
        }),
        _ => Ok(()),
    }
}

/// The store directory's lock file.
const STORE_LOCK_FILE: &str = "lock";

impl<R: Resource> ParticipantStore<R> {
    /// Opens (or creates) the store at `path`. A full disk is reported as
    /// such (`StoreError::is_disk_full`). Files in a format version this
    /// build does not read (a newer build's, or a pre-release layout, such
    /// as a store in sled) are refused by name, and nothing is changed.
    pub fn open(path: &std::path::Path, resource: R) -> Result<Arc<Self>, StoreError> {
        refuse_sled_layout(path)?;
        let lock = lock_store_dir(path)?;
        refuse_without_room(path)?;
        let kv = KvFiles::open(path).map_err(|e| match e {
            KvOpenError::Io(e) => StoreError::Open {
                path: path.display().to_string(),
                message: kv_open_message(&e),
                disk_full: e.disk_full,
            },
            KvOpenError::Damaged(m) => StoreError::Open {
                path: path.display().to_string(),
                message: format!("damaged, refusing to start rather than forget acknowledged writes: {m}"),
                disk_full: false,
            },
            KvOpenError::Format(v) => StoreError::Open {
                path: path.display().to_string(),
                message: format!("{v}; nothing was changed"),
                disk_full: false,
            },
        })?;
        let kv = Arc::new(kv);
        let (flusher, rx) = mpsc::channel();
        let (checkpointer, checkpoint_rx) = mpsc::sync_channel(1);
        let spawn_err = |e: std::io::Error| StoreError::Io(e.to_string());
        let k = kv.clone();
        let checkpoint_thread = std::thread::Builder::new()
            .name("dtx-participant-checkpoint".into())
            .spawn(move || run_checkpointer(k, checkpoint_rx))
            .map_err(spawn_err)?;
        let k = kv.clone();
        let c = checkpointer.clone();
        let thread = std::thread::Builder::new()
            .name("dtx-participant-flusher".into())
            .spawn(move || run_flusher(k, c, rx))
            .map_err(spawn_err)?;
        let store = Arc::new(ParticipantStore {
            latch: FailureLatch::new(path.display().to_string()),
            tree: kv,
            resource,
            serial: Mutex::new(()),
            prepared_at: Mutex::new(HashMap::new()),
            opened: std::time::Instant::now(),
            opened_unix_ms: unix_ms(),
            branches_running: Mutex::new(std::collections::HashSet::new()),
            inconsistent: Mutex::new(Default::default()),
            flusher: Some(flusher),
            flusher_thread: Some(thread),
            checkpointer: Some(checkpointer),
            checkpoint_thread: Some(checkpoint_thread),
            _lock: lock,
        });
        Ok(store)
    }

    pub fn resource(&self) -> &R {
        &self.resource
    }

    pub fn view(&self) -> View<'_> {
        View {
            tree: &self.tree,
            overlay: None,
        }
    }

    /// The record of `txid` (a `u64` is a txid of incarnation 0).
    pub fn entry(&self, txid: impl Into<GlobalTxid>) -> Result<Option<LogEntry>, StoreError> {
        let txid = txid.into();
        match self.tree.get(&log_key(txid)) {
            None => Ok(None),
            Some(b) => decode_entry(&b)
                .map(Some)
                .map_err(|message| StoreError::Damaged { txid, message }),
        }
    }

    /// The records of txid number `txid` in every incarnation that has
    /// one (incarnation 0 first): for an operator or a test that knows the
    /// number only. One pass over the record keys.
    pub fn entries_for_txid(&self, txid: u64) -> Result<Vec<(GlobalTxid, LogEntry)>, StoreError> {
        let mut out = Vec::new();
        for (k, v) in self.tree.scan_prefix(&[LOG_PREFIX]) {
            let Some(g) = key_txid(&k).filter(|g| g.txid == txid) else {
                continue;
            };
            let e = decode_entry(&v).map_err(|message| StoreError::Damaged { txid: g, message })?;
            out.push((g, e));
        }
        out.sort_by_key(|(t, _)| *t);
        Ok(out)
    }

    /// The durable term floor of `incarnation`: the highest leader term of
    /// any record written for a transaction of it (0: none). Garbage
    /// collection of records never lowers it.
    pub fn term_floor(&self, incarnation: u64) -> u64 {
        self.tree
            .get(&floor_key(incarnation))
            .map(|b| decode_floor(&b))
            .unwrap_or(0)
    }

    /// The term floor of `incarnation` as written so far, `overlay` (a
    /// group's writes not yet in the tree) over the tree.
    fn term_floor_under(&self, incarnation: u64, overlay: &Overlay) -> u64 {
        match overlay.get(&floor_key(incarnation)[..]) {
            Some(Some(b)) => decode_floor(b),
            Some(None) => 0,
            None => self.term_floor(incarnation),
        }
    }

    /// Every log record (transaction, entry), ordered by transaction
    /// (incarnation, then txid).
    pub fn entries(&self) -> Result<Vec<(GlobalTxid, LogEntry)>, StoreError> {
        let mut out = Vec::new();
        for (k, v) in self.tree.scan_prefix(&[LOG_PREFIX]) {
            let Some(txid) = key_txid(&k) else {
                return Err(StoreError::Io(format!("log record key of {} bytes", k.len())));
            };
            let e = decode_entry(&v).map_err(|message| StoreError::Damaged { txid, message })?;
            out.push((txid, e));
        }
        out.sort_by_key(|(t, _)| *t);
        Ok(out)
    }

    /// Transactions holding a YES vote without a known decision: on start and
    /// periodically, their decisions must be asked of the cluster. Reads the
    /// in-doubt index, so its cost follows the number in doubt, not the
    /// size of the log.
    ///
    /// The scan runs beside concurrent Commit and Abort: an index entry it
    /// yields may have been removed (with its record decided, in one batch)
    /// a moment after the scan read it. So an entry whose record is not in
    /// doubt is looked at again under the store's serialisation: the index
    /// entry gone means a concurrent decision (skipped); still there means
    /// the log is inconsistent, which is logged, counted in
    /// `dtx_participant_log_inconsistencies_total` (once per entry in this
    /// process) and skipped, so the other in-doubt transactions are still
    /// recovered. An error means the index could not be read at all.
    pub fn in_doubt(&self) -> Result<Vec<(GlobalTxid, LogEntry)>, StoreError> {
        let mut out = Vec::new();
        for k in self.tree.keys_with_prefix(&[DOUBT_PREFIX], false, usize::MAX) {
            let Some(txid) = key_txid(&k) else {
                self.report_inconsistency(&k, None, format!("in-doubt index key of {} bytes", k.len()));
                continue;
            };
            match self.entry(txid) {
                Ok(Some(e)) if crate::log::in_doubt(&e) => {
                    out.push((txid, e));
                    continue;
                }
                Err(StoreError::Io(e)) => return Err(StoreError::Io(e)),
                _ => {}
            }
            // Look again, with no decision running: a decision removes the
            // index entry in the same batch that writes its record.
            let _serial = self.serial.lock().expect("participant store lock");
            if !self.tree.contains_key(&doubt_key(txid)) {
                continue;
            }
            match self.entry(txid) {
                Ok(Some(e)) if crate::log::in_doubt(&e) => out.push((txid, e)),
                Ok(other) => self.report_inconsistency(
                    &k,
                    Some(txid),
                    format!("in the in-doubt index, but its record is {other:?}"),
                ),
                Err(StoreError::Damaged { message, .. }) => {
                    self.report_inconsistency(&k, Some(txid), format!("in the in-doubt index, but {message}"))
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Logs and counts one inconsistent in-doubt index entry, once per
    /// entry for the life of this store.
    fn report_inconsistency(&self, index_key: &[u8], txid: Option<GlobalTxid>, what: String) {
        let first = self
            .inconsistent
            .lock()
            .expect("inconsistent lock")
            .insert(index_key.to_vec());
        if first {
            metrics::counter!("dtx_participant_log_inconsistencies_total").increment(1);
            tracing::error!(
                txid = txid.map(|t| t.to_string()),
                "participant log inconsistent: {what}; skipped by recovery (the other in-doubt \
                 transactions are still recovered); check this transaction with the cluster and \
                 repair the record by hand"
            );
        } else {
            tracing::debug!(
                txid = txid.map(|t| t.to_string()),
                "participant log inconsistent (reported before): {what}"
            );
        }
    }

    /// In-doubt transactions whose YES vote is at least `age_min` old (every
    /// one recorded before this process started counts as old): recovery
    /// asks about these, not about votes the coordinator is still collecting.
    pub fn in_doubt_older_than(&self, age_min: std::time::Duration) -> Result<Vec<(GlobalTxid, LogEntry)>, StoreError> {
        let all = self.in_doubt()?;
        let at = self.prepared_at.lock().expect("prepared_at lock");
        Ok(all
            .into_iter()
            .filter(|(t, _)| at.get(t).is_none_or(|when| when.elapsed() >= age_min))
            .collect())
    }

    /// How many transactions the in-doubt index holds and how long the
    /// oldest has held its YES vote (for the gauges; reads the index keys
    /// only). A vote from before this process started is as old as the
    /// store's opening, at least, and is counted so.
    pub fn in_doubt_summary(&self) -> Result<InDoubtSummary, StoreError> {
        let at = self.prepared_at.lock().expect("prepared_at lock");
        let mut count = 0;
        let mut oldest: Option<std::time::Instant> = None;
        for k in self.tree.keys_with_prefix(&[DOUBT_PREFIX], false, usize::MAX) {
            count += 1;
            let since = key_txid(&k).and_then(|t| at.get(&t).copied()).unwrap_or(self.opened);
            oldest = Some(oldest.map_or(since, |o| o.min(since)));
        }
        Ok(InDoubtSummary {
            count,
            oldest_age: oldest.map(|o| o.elapsed()),
        })
    }

    /// What the log holds, for an operator (`Participant::inspect`): reads
    /// only, never the store's lock for long (a look at an inconsistent
    /// in-doubt index entry, as recovery does), and writes nothing. Not one
    /// atomic snapshot: a record that changes during the call may show
    /// before or after. Times: a decided record's (or READ_ONLY vote's) is
    /// its GC index entry's, found among the newest
    /// `INSPECT_TIME_SCAN_KEYS_MAX` entries (older: unknown); a YES vote's
    /// is known only when this process recorded it. Counting the records
    /// reads every record key once. Not synced: the trait's `inspect`
    /// waits for an fsync before answering, as `durable_entry` does.
    pub fn inspect(&self, q: &InspectQuery) -> Result<Inspection, StoreError> {
        // When each YES vote this process recorded was given.
        let voted_ms: HashMap<GlobalTxid, u64> = {
            let at = self.prepared_at.lock().expect("prepared_at lock");
            at.iter()
                .map(|(t, i)| {
                    let since_open = i.saturating_duration_since(self.opened).as_millis() as u64;
                    (*t, self.opened_unix_ms.saturating_add(since_open))
                })
                .collect()
        };
        let asked = q
            .txids
            .iter()
            .map(|&t| Ok((t, self.entry(t)?)))
            .collect::<Result<Vec<(GlobalTxid, Option<LogEntry>)>, StoreError>>()?;
        // Decided times: of the asked records that have one, and of the
        // newest `q.recent` entries of the GC index (newest first).
        let mut wanted: std::collections::HashSet<GlobalTxid> = asked
            .iter()
            .filter(|(_, e)| e.as_ref().is_some_and(is_collectable))
            .map(|(t, _)| *t)
            .collect();
        let mut decided_ms: HashMap<GlobalTxid, u64> = HashMap::new();
        let mut newest: Vec<GlobalTxid> = Vec::new();
        if !wanted.is_empty() || q.recent > 0 {
            for k in self
                .tree
                .keys_with_prefix(&[GC_PREFIX], true, INSPECT_TIME_SCAN_KEYS_MAX)
            {
                let Some((ms, txid)) = parse_gc_key(&k) else {
                    continue;
                };
                if newest.len() < q.recent {
                    newest.push(txid);
                    decided_ms.entry(txid).or_insert(ms);
                }
                if wanted.remove(&txid) {
                    decided_ms.entry(txid).or_insert(ms);
                }
                if wanted.is_empty() && newest.len() >= q.recent {
                    break;
                }
            }
        }
        let time_of = |txid: GlobalTxid, e: &Option<LogEntry>| match e {
            Some(e) if crate::log::in_doubt(e) => voted_ms.get(&txid).copied(),
            Some(e) if is_collectable(e) => decided_ms.get(&txid).copied(),
            _ => None,
        };
        let shown = |txid: GlobalTxid, entry: Option<LogEntry>| InspectedRecord {
            txid,
            entry,
            recorded_unix_ms: time_of(txid, &entry),
        };
        let records = asked.into_iter().map(|(t, e)| shown(t, e)).collect();
        let doubt = if q.in_doubt || q.recent > 0 {
            self.in_doubt()?
        } else {
            Vec::new()
        };
        let mut in_doubt = Vec::new();
        if q.in_doubt {
            in_doubt = doubt.iter().map(|&(t, e)| shown(t, Some(e))).collect::<Vec<_>>();
            // Oldest first; votes from before this process started (no
            // time kept) are the oldest.
            in_doubt.sort_by_key(|r| (r.recorded_unix_ms.is_some(), r.recorded_unix_ms, r.txid));
            in_doubt.truncate(q.list_max);
        }
        let mut recent = Vec::new();
        if q.recent > 0 {
            let mut seen = std::collections::HashSet::new();
            for txid in newest {
                // Forgotten meanwhile: no longer a record.
                if let Some(e) = self.entry(txid)? {
                    if seen.insert(txid) {
                        recent.push(shown(txid, Some(e)));
                    }
                }
            }
            for &(txid, e) in &doubt {
                if seen.insert(txid) {
                    recent.push(shown(txid, Some(e)));
                }
            }
            // Newest first; no time kept: last, by txid, newest first.
            recent.sort_by_key(|r| std::cmp::Reverse((r.recorded_unix_ms.is_some(), r.recorded_unix_ms, r.txid)));
            recent.truncate(q.recent);
        }
        let records_total = self.tree.count_prefix(&[LOG_PREFIX]);
        Ok(Inspection {
            records,
            in_doubt,
            recent,
            in_doubt_summary: self.in_doubt_summary()?,
            records_total,
        })
    }

    /// Records that may be collected (committed, aborted, tombstones, and
    /// READ_ONLY votes) that became so at or before `decided_before_ms` (ms
    /// since the Unix epoch), oldest first, at most `max`: candidates for
    /// `forget_records`, as `(decided_ms, txid)`.
    pub fn gc_candidates(&self, decided_before_ms: u64, max: usize) -> Result<Vec<(u64, GlobalTxid)>, StoreError> {
        self.gc_candidates_after(None, decided_before_ms, max)
    }

    /// `gc_candidates` starting after `after` (a candidate an earlier call
    /// returned), so a caller that moves on through the index never looks
    /// at the same kept records forever: records the cluster still needs
    /// (kept past retention) stay at the front of the index, and a scan
    /// from the start could see nothing else (invariant 11).
    pub fn gc_candidates_after(
        &self,
        after: Option<(u64, GlobalTxid)>,
        decided_before_ms: u64,
        max: usize,
    ) -> Result<Vec<(u64, GlobalTxid)>, StoreError> {
        let start: Vec<u8> = match after {
            // The smallest key above the cursor's.
            Some((ms, txid)) => {
                let mut k = gc_key(ms, txid);
                k.push(0);
                k
            }
            None => vec![GC_PREFIX],
        };
        let mut out = Vec::new();
        for (k, _) in self.tree.range_from(&start, max) {
            if k.first() != Some(&GC_PREFIX) {
                break;
            }
            let Some((decided_ms, txid)) = parse_gc_key(&k) else {
                continue;
            };
            if decided_ms > decided_before_ms {
                break;
            }
            out.push((decided_ms, txid));
        }
        Ok(out)
    }

    /// Removes the given records (from `gc_candidates`); returns how many.
    /// Only safe once the coordinator will send nothing more for them: it
    /// has recorded a decision and this participant's ack, or forgotten the
    /// transaction. A message arriving after its record is gone is taken as
    /// the first: a redelivered Commit would be refused as a commit without
    /// prepare (never acked), a re-sent `CommitOnePhase` would apply the
    /// work again. `server::collect_decided` checks that with the cluster
    /// first. A record that is no longer collectable (in doubt) is left
    /// alone. Not synced: a crash only means collecting them again.
    /// The term floor of the records' incarnations is kept.
    pub fn forget_records(&self, records: &[(u64, GlobalTxid)]) -> Result<usize, StoreError> {
        self.check_running()?;
        let _serial = self.serial.lock().expect("participant store lock");
        let mut batch = KvBatch::new();
        let mut n = 0;
        for &(decided_ms, txid) in records {
            if !self.entry(txid)?.as_ref().is_some_and(is_collectable) {
                continue;
            }
            batch.push((log_key(txid), None));
            // Never in doubt (the record is collectable); removed anyway so no
            // index entry can outlive its record.
            batch.push((doubt_key(txid), None));
            batch.push((gc_key(decided_ms, txid), None));
            n += 1;
        }
        self.tree.apply(batch).map_err(|e| self.fail(&e))?;
        Ok(n)
    }

    /// Handles one coordinator message: decides with `log::step`, runs the
    /// resource, writes the log record and the resource's writes in one
    /// atomic batch, waits for an fsync covering it (and every earlier write),
    /// then returns the reply.
    /// A `u64` txid is one of incarnation 0.
    pub async fn handle(&self, txid: impl Into<GlobalTxid>, msg: Message, payload: &[u8]) -> Result<Reply, StoreError> {
        self.handle_answer(txid, msg, payload).await.map(|a| a.reply)
    }

    /// `handle`, with the reason of a NO vote (`Staged::refuse`).
    pub async fn handle_answer(
        &self,
        txid: impl Into<GlobalTxid>,
        msg: Message,
        payload: &[u8],
    ) -> Result<Answer, StoreError> {
        match self.handle_inner(txid.into(), msg, payload, None).await? {
            BranchPrepare::Answered(a) => Ok(a),
            BranchPrepare::Exists(_) => Err(StoreError::Io("a branch answer to a message".into())),
        }
    }

    /// A branch that prepares where it runs (docs/protocol.md,
    /// "Branches"): the resource prepares `payload` for `txid` as it would
    /// for a Prepare, and a YES is written with a mark that the branch
    /// `participant_id` has not registered yet, in the same atomic write
    /// (fsynced before this returns). Recovery asks the cluster about a
    /// marked branch by (txid, participant), never by the txid alone: the
    /// transaction may commit without it. `Exists` when `txid` has a
    /// record here already (nothing done).
    pub async fn prepare_branch(
        &self,
        txid: GlobalTxid,
        participant_id: &str,
        payload: &[u8],
    ) -> Result<BranchPrepare, StoreError> {
        let floor = self.term_floor(txid.incarnation);
        // Running before the mark is written, so a recovery pass never
        // sees the mark of a branch whose flow has not asked the cluster
        // yet (it would fence the branch out of its transaction).
        let fresh = self.branches_running.lock().expect("branches lock").insert(txid);
        let res = self
            .handle_inner(txid, Message::Prepare { term: floor }, payload, Some(participant_id))
            .await;
        let held = matches!(
            &res,
            Ok(BranchPrepare::Answered(Answer {
                reply: Reply::Vote(Vote::Yes),
                ..
            }))
        );
        if fresh && !held {
            self.branches_running.lock().expect("branches lock").remove(&txid);
        }
        res
    }

    /// The branch flow of `txid` in this process ended: `settled` when the
    /// cluster's answer is known (registered, or refused and rolled back
    /// here), so its mark goes; otherwise the mark stays for recovery.
    pub fn finish_branch(&self, txid: GlobalTxid, settled: bool) -> Result<(), StoreError> {
        self.branches_running.lock().expect("branches lock").remove(&txid);
        if settled {
            self.unmark_branch(txid)?;
        }
        Ok(())
    }

    /// The branches prepared here whose registration is not known to be
    /// recorded and whose flow does not run in this process now:
    /// (transaction, participant id), for recovery.
    pub fn unregistered_branches(&self) -> Result<Vec<(GlobalTxid, String)>, StoreError> {
        let running = self.branches_running.lock().expect("branches lock").clone();
        let mut out = Vec::new();
        for (k, v) in self.tree.scan_prefix(BRANCH_PREFIX) {
            let txid = GlobalTxid::from_key_bytes(&k[BRANCH_PREFIX.len()..]).ok_or_else(|| StoreError::Damaged {
                txid: GlobalTxid::default(),
                message: format!("branch mark key of {} bytes", k.len()),
            })?;
            let id = String::from_utf8(v).map_err(|_| StoreError::Damaged {
                txid,
                message: "branch mark holds no UTF-8 participant id".into(),
            })?;
            if !running.contains(&txid) {
                out.push((txid, id));
            }
        }
        Ok(out)
    }

    /// The branch of `txid` is settled with the cluster (registered, or
    /// resolved): its mark goes. Not synced: a mark that comes back after
    /// a crash makes recovery ask again, which gives the same answer.
    pub fn unmark_branch(&self, txid: GlobalTxid) -> Result<(), StoreError> {
        let batch: KvBatch = vec![(branch_key(txid), None)];
        self.tree.apply(batch).map_err(|e| self.fail(&e))
    }

    async fn handle_inner(
        &self,
        txid: GlobalTxid,
        msg: Message,
        payload: &[u8],
        branch: Option<&str>,
    ) -> Result<BranchPrepare, StoreError> {
        self.check_running()?;
        let mut reason = String::new();
        let (reply, wrote) = {
            let _serial = self.serial.lock().expect("participant store lock");
            let before = self.entry(txid)?;
            if let (Some(_), Some(e)) = (branch, before) {
                return Ok(BranchPrepare::Exists(e));
            }
            let floor = self.term_floor(txid.incarnation);
            let (after, action) = step(before.as_ref(), msg, floor);
            // The record as last written (the one-phase path writes twice).
            let mut prior = before;
            let mut staged = Staged::default();
            let view = self.view();
            let (reply, record) = match action {
                Action::PrepareResource => {
                    let vote = self.resource.prepare(&view, txid, payload, &mut staged);
                    if vote == Vote::No {
                        reason = staged.no_reason();
                    }
                    if vote != Vote::Yes {
                        staged = Staged::default();
                    }
                    (Reply::Vote(vote), Some(crate::log::prepared(msg.term(), vote)))
                }
                Action::OnePhaseResource => {
                    let vote = self.resource.prepare(&view, txid, payload, &mut staged);
                    match vote {
                        Vote::Yes => {
                            // First write: the prepared work with its YES
                            // record, so a crash before the second leaves an
                            // ordinary in-doubt entry, never orphaned locks.
                            let mut batch = std::mem::take(&mut staged).into_batch();
                            let prepared = crate::log::prepared(msg.term(), Vote::Yes);
                            put_record(&mut batch, txid, prior.as_ref(), &prepared, floor);
                            self.tree.apply(batch).map_err(|e| self.fail(&e))?;
                            prior = Some(prepared);
                            self.resource.commit(&view, txid, &mut staged);
                            let committed = LogEntry {
                                state: LocalState::Committed,
                                term: msg.term(),
                            };
                            (Reply::Ack, Some(committed))
                        }
                        Vote::ReadOnly | Vote::No => {
                            // Nothing to keep: read-only work commits as
                            // nothing; refused work is rolled back.
                            if vote == Vote::No {
                                reason = staged.no_reason();
                            }
                            staged = Staged::default();
                            let state = if vote == Vote::No {
                                LocalState::Aborted { tombstone: false }
                            } else {
                                LocalState::Committed
                            };
                            let reply = if vote == Vote::No {
                                Reply::Vote(Vote::No)
                            } else {
                                Reply::Ack
                            };
                            (
                                reply,
                                Some(LogEntry {
                                    state,
                                    term: msg.term(),
                                }),
                            )
                        }
                    }
                }
                Action::CommitResource => {
                    self.resource.commit(&view, txid, &mut staged);
                    (Reply::Ack, after)
                }
                Action::AbortResource => {
                    self.resource.abort(&view, txid, &mut staged);
                    (Reply::Ack, after)
                }
                Action::RecordTombstone | Action::Ack => (Reply::Ack, after),
                Action::Vote(v) => (Reply::Vote(v), after),
                Action::Refuse(r) => return Err(StoreError::Refused(r)),
            };
            let changed = record != before || !staged.ops.is_empty();
            if changed {
                let mut batch = staged.into_batch();
                if let Some(e) = record {
                    put_record(&mut batch, txid, prior.as_ref(), &e, floor);
                }
                if let (Some(id), Reply::Vote(Vote::Yes)) = (branch, reply) {
                    batch.push((branch_key(txid), Some(id.as_bytes().to_vec())));
                }
                self.tree.apply(batch).map_err(|e| self.fail(&e))?;
                let mut at = self.prepared_at.lock().expect("prepared_at lock");
                match record {
                    Some(e) if crate::log::in_doubt(&e) => {
                        at.entry(txid).or_insert_with(std::time::Instant::now);
                    }
                    _ => {
                        at.remove(&txid);
                    }
                }
            }
            (reply, changed)
        };
        if matches!(reply, Reply::Vote(Vote::Yes)) && wrote {
            dtx_failpoint::failpoint!("participant_before_durable_prepare");
        }
        // Always sync before answering: a repeated message may find a record
        // that a concurrent request wrote but whose fsync is still running,
        // and a vote or ack must never get ahead of its record on disk.
        let _ = wrote;
        self.flush().await?;
        match (msg, reply) {
            (Message::Prepare { .. }, Reply::Vote(_)) => {
                dtx_failpoint::failpoint!("participant_after_prepare_before_reply")
            }
            (Message::Commit { .. } | Message::Abort { .. } | Message::CommitOnePhase { .. }, Reply::Ack) => {
                dtx_failpoint::failpoint!("participant_after_decision_before_ack")
            }
            _ => {}
        }
        if reply == Reply::Vote(Vote::No) && reason.is_empty() {
            reason = ABORTED_HERE_BEFORE.into();
        }
        Ok(BranchPrepare::Answered(Answer { reply, reason }))
    }

    /// Applies many phase-two messages (one item per transaction's
    /// decision; the same txid may come more than once) in ONE durable
    /// write: each item is stepped through `log::step` in order and runs
    /// the resource exactly as `handle` would for its own Commit or Abort,
    /// seeing the writes of the items before it, and then every log
    /// transition, index change and resource write of the group goes into
    /// one atomic sled batch, covered by one fsync before this returns.
    ///
    /// Returns one result per item, in order: `Ok(())` is the ack (applied
    /// now, or already applied: a repeat), an error is what `handle` would
    /// have answered that message alone (a refusal: stale term, commit
    /// without prepare, commit after abort, abort after commit; a damaged
    /// record), and such an item changes nothing and never affects the
    /// others. The call fails as a whole only when the store cannot write
    /// or sync (then nothing is acked: the batch may or may not be on disk,
    /// and a redelivery finds whichever it is).
    pub async fn apply_decisions<T: Into<GlobalTxid> + Copy>(
        &self,
        items: &[(T, PhaseTwo)],
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        let items: Vec<(GlobalTxid, PhaseTwo)> = items.iter().map(|&(t, d)| (t.into(), d)).collect();
        Ok(self.apply_then_prepare(&items, &[]).await?.0)
    }

    /// Prepares many transactions (one item per transaction's Prepare: its
    /// txid, the leader's term and the payload; the same txid may come more
    /// than once) in ONE durable write: each item goes in order through
    /// exactly what `handle` does for its own Prepare (`log::step`: a repeat
    /// answers the recorded vote, a tombstone votes NO, a stale term is
    /// refused; otherwise the resource prepares on a view that shows the
    /// writes of the items before it), and every log record, index change
    /// and resource write of the group goes into one atomic sled batch,
    /// covered by one fsync before this returns: no vote, YES above all,
    /// is answered before its record is on disk.
    ///
    /// Returns one result per item, in order: the vote, or the error its
    /// own Prepare would have failed with (a stale-term refusal, a damaged
    /// record); such an item changes nothing and never affects the others.
    /// The call fails as a whole only when the store cannot write or sync
    /// (then no vote is given).
    pub async fn prepare_many<T: Into<GlobalTxid> + Copy>(
        &self,
        items: &[(T, u64, &[u8])],
    ) -> Result<Vec<Result<Vote, StoreError>>, StoreError> {
        let verdicts = self.prepare_many_verdicts(items).await?;
        Ok(verdicts.into_iter().map(|r| r.map(|v| v.vote)).collect())
    }

    /// `prepare_many`, with the reason of each NO vote.
    pub async fn prepare_many_verdicts<T: Into<GlobalTxid> + Copy>(
        &self,
        items: &[(T, u64, &[u8])],
    ) -> Result<Vec<Result<Verdict, StoreError>>, StoreError> {
        let items: Vec<(GlobalTxid, u64, &[u8])> = items.iter().map(|&(t, term, p)| (t.into(), term, p)).collect();
        Ok(self.apply_then_prepare(&[], &items).await?.1)
    }

    /// `apply_decisions` of `decisions` and then `prepare_many_verdicts` of
    /// `prepares`, in ONE durable write (a PrepareMany message that carries
    /// decisions, ADR 0030): the decisions are staged first, then the
    /// prepares, all in one atomic batch covered by one fsync before any
    /// answer. Each result is what that call alone would have answered; the
    /// call fails as a whole only when the store cannot write or sync (then
    /// nothing is acked and no vote given).
    pub async fn apply_then_prepare(
        &self,
        decisions: &[(GlobalTxid, PhaseTwo)],
        prepares: &[(GlobalTxid, u64, &[u8])],
    ) -> Result<AcksAndVerdicts, StoreError> {
        self.check_running()?;
        let msgs: Vec<(GlobalTxid, Message, &[u8])> = decisions
            .iter()
            .map(|&(txid, d)| (txid, d.into(), &b""[..]))
            .chain(
                prepares
                    .iter()
                    .map(|&(txid, term, payload)| (txid, Message::Prepare { term }, payload)),
            )
            .collect();
        let (mut results, wrote_yes) = self.write_group(&msgs)?;
        if wrote_yes {
            dtx_failpoint::failpoint!("participant_before_durable_prepare");
        }
        // As in `handle`: always sync before answering, so no ack or vote
        // gets ahead of its record on disk (a repeat may find a record
        // whose fsync another request is still waiting for).
        self.flush().await?;
        let prepared = results.split_off(decisions.len());
        if results.iter().any(Result::is_ok) {
            dtx_failpoint::failpoint!("participant_after_decision_before_ack");
        }
        if prepared.iter().any(|r| {
            matches!(
                r,
                Ok(Answer {
                    reply: Reply::Vote(_),
                    ..
                })
            )
        }) {
            dtx_failpoint::failpoint!("participant_after_prepare_before_reply");
        }
        let acks = results
            .into_iter()
            .zip(decisions)
            .map(|(r, (txid, d))| match r.map(|a| a.reply) {
                Ok(Reply::Ack) => Ok(()),
                Ok(other) => Err(StoreError::Io(format!(
                    "{d:?} for transaction {txid} answered {other:?}, which is no answer to a decision"
                ))),
                Err(e) => Err(e),
            })
            .collect();
        let votes = prepared
            .into_iter()
            .zip(prepares)
            .map(|(r, (txid, _, _))| match r {
                Ok(Answer {
                    reply: Reply::Vote(vote),
                    reason,
                }) => Ok(Verdict { vote, reason }),
                Ok(Answer { reply: Reply::Ack, .. }) => Err(StoreError::Io(format!(
                    "prepare of transaction {txid} answered with an ack"
                ))),
                Err(e) => Err(e),
            })
            .collect();
        Ok((acks, votes))
    }

    /// The write of `apply_decisions` and `prepare_many`: under the store
    /// lock, stages every item in order (`stage_item`) into one overlay and
    /// writes it as one atomic sled batch (not synced: the caller flushes).
    /// Returns each item's reply, and whether a YES vote was written now.
    fn write_group(
        &self,
        items: &[(GlobalTxid, Message, &[u8])],
    ) -> Result<(Vec<Result<Answer, StoreError>>, bool), StoreError> {
        let _serial = self.serial.lock().expect("participant store lock");
        let mut overlay = Overlay::new();
        let mut wrote_yes = false;
        let results: Vec<Result<Answer, StoreError>> = items
            .iter()
            .map(|&(txid, msg, payload)| {
                let (answer, changed) = self.stage_item(txid, msg, payload, &mut overlay)?;
                wrote_yes |= changed && answer.reply == Reply::Vote(Vote::Yes);
                Ok(answer)
            })
            .collect();
        if overlay.is_empty() {
            return Ok((results, false));
        }
        // What the group leaves in doubt, and what it takes out of doubt,
        // by the last record it writes for each transaction.
        let mut doubt: HashMap<GlobalTxid, bool> = HashMap::new();
        for &(txid, _, _) in items {
            if let Some(Some(b)) = overlay.get(&log_key(txid)) {
                let in_doubt = decode_entry(b).is_ok_and(|e| crate::log::in_doubt(&e));
                doubt.insert(txid, in_doubt);
            }
        }
        let batch: KvBatch = overlay.into_iter().collect();
        self.tree.apply(batch).map_err(|e| self.fail(&e))?;
        let mut at = self.prepared_at.lock().expect("prepared_at lock");
        for (txid, in_doubt) in doubt {
            if in_doubt {
                at.entry(txid).or_insert_with(std::time::Instant::now);
            } else {
                at.remove(&txid);
            }
        }
        Ok((results, wrote_yes))
    }

    /// One item of a group (`write_group`): steps `msg` against `txid`'s
    /// record as written so far (the tree under `overlay`), runs the
    /// resource as `handle` does for a Prepare, Commit or Abort (on a view
    /// that shows the overlay), and adds what changed to `overlay`. Returns
    /// the reply and whether anything changed. A refusal or error adds
    /// nothing.
    fn stage_item(
        &self,
        txid: GlobalTxid,
        msg: Message,
        payload: &[u8],
        overlay: &mut Overlay,
    ) -> Result<(Answer, bool), StoreError> {
        let before = match overlay.get(&log_key(txid)) {
            Some(Some(b)) => Some(decode_entry(b).map_err(|message| StoreError::Damaged { txid, message })?),
            Some(None) => None,
            None => self.entry(txid)?,
        };
        let floor = self.term_floor_under(txid.incarnation, overlay);
        let (after, action) = step(before.as_ref(), msg, floor);
        let mut staged = Staged::default();
        let mut reason = String::new();
        let (reply, record) = {
            let view = View {
                tree: &self.tree,
                overlay: Some(overlay),
            };
            match action {
                Action::PrepareResource => {
                    let vote = self.resource.prepare(&view, txid, payload, &mut staged);
                    if vote == Vote::No {
                        reason = staged.no_reason();
                    }
                    if vote != Vote::Yes {
                        staged = Staged::default();
                    }
                    (Reply::Vote(vote), Some(crate::log::prepared(msg.term(), vote)))
                }
                Action::CommitResource => {
                    self.resource.commit(&view, txid, &mut staged);
                    (Reply::Ack, after)
                }
                Action::AbortResource => {
                    self.resource.abort(&view, txid, &mut staged);
                    (Reply::Ack, after)
                }
                Action::RecordTombstone | Action::Ack => (Reply::Ack, after),
                Action::Vote(v) => (Reply::Vote(v), after),
                Action::Refuse(r) => return Err(StoreError::Refused(r)),
                other @ Action::OnePhaseResource => {
                    return Err(StoreError::Io(format!(
                        "{msg:?} for transaction {txid} stepped to {other:?}, which a group does not carry"
                    )))
                }
            }
        };
        let changed = record != before || !staged.ops.is_empty();
        if changed {
            staged.into_overlay(overlay);
            if let Some(e) = record {
                overlay.extend(record_writes(txid, before.as_ref(), &e, floor));
            }
        }
        if reply == Reply::Vote(Vote::No) && reason.is_empty() {
            reason = ABORTED_HERE_BEFORE.into();
        }
        Ok((Answer { reply, reason }, changed))
    }

    /// Writes the resource's data outside any transaction (for example the
    /// initial accounts of a new service), atomically and durably.
    pub async fn write_data(&self, f: impl FnOnce(&View<'_>, &mut Staged)) -> Result<(), StoreError> {
        self.check_running()?;
        {
            let _serial = self.serial.lock().expect("participant store lock");
            let mut staged = Staged::default();
            f(&self.view(), &mut staged);
            self.tree.apply(staged.into_batch()).map_err(|e| self.fail(&e))?;
        }
        self.flush().await
    }

    /// Waits for an fsync that covers every write issued before the call.
    /// An fsync that fails stops the store (see `stopped`).
    pub async fn flush(&self) -> Result<(), StoreError> {
        self.check_running()?;
        let (tx, rx) = oneshot::channel();
        self.flusher
            .as_ref()
            .ok_or_else(|| StoreError::Io("store is closing".into()))?
            .send(tx)
            .map_err(|_| StoreError::Io("flusher thread stopped".into()))?;
        rx.await
            .map_err(|_| StoreError::Io("flusher thread stopped".into()))?
            .map_err(|e| self.fail(&e))
    }

    /// Records the first failed write (the store stops, see
    /// `FailureLatch`), logs and counts it once, and returns the error to
    /// give the caller.
    fn fail(&self, e: &KvError) -> StoreError {
        let (failure, first) = self.latch.record(e.disk_full, e.detail.clone());
        if first {
            metrics::counter!("dtx_participant_store_failures_total", "disk_full" => failure.disk_full.to_string())
                .increment(1);
            tracing::error!(disk_full = failure.disk_full, "{failure}");
        }
        StoreError::Stopped(failure)
    }

    fn check_running(&self) -> Result<(), StoreError> {
        self.latch.check()
    }

    /// Why the store stopped, if it has (a write or fsync failed).
    pub fn failure(&self) -> Option<StoreFailure> {
        self.latch.get()
    }

    /// Waits until the store stops (a write or fsync failed) and says why.
    /// A service should then stop (exit with this message) so that its
    /// supervisor starts it again: the store refuses every request from
    /// then on, and a restart reopens it on what is on disk, which holds
    /// everything acknowledged. For a full disk the restart fails, saying
    /// so, until space is freed.
    pub async fn stopped(&self) -> StoreFailure {
        self.latch.stopped().await
    }

    /// For tests and tools: the store's keys and values as written,
    /// behind the store's back (`RawStore`).
    #[doc(hidden)]
    pub fn raw(&self) -> RawStore {
        RawStore(self.tree.clone())
    }
}

/// The sled store as a [`Participant`]: its calls, with the reasons of NO
/// votes; `durable_entry` answers only what is on disk (the record read may
/// have been written by a request whose fsync is still running, or failed).
impl<R: Resource> Participant for ParticipantStore<R> {
    async fn handle(&self, txid: GlobalTxid, msg: Message, payload: &[u8]) -> Result<Answer, StoreError> {
        self.handle_answer(txid, msg, payload).await
    }

    async fn unregistered_branches(&self) -> Result<Vec<(GlobalTxid, String)>, StoreError> {
        ParticipantStore::unregistered_branches(self)
    }

    async fn unmark_branch(&self, txid: GlobalTxid) -> Result<(), StoreError> {
        ParticipantStore::unmark_branch(self, txid)
    }

    fn branches_in_flight(&self) -> Vec<GlobalTxid> {
        self.branches_running
            .lock()
            .expect("branches lock")
            .iter()
            .copied()
            .collect()
    }

    async fn prepare_many(
        &self,
        items: &[(GlobalTxid, u64, &[u8])],
    ) -> Result<Vec<Result<Verdict, StoreError>>, StoreError> {
        self.prepare_many_verdicts(items).await
    }

    async fn apply_decisions(
        &self,
        items: &[(GlobalTxid, PhaseTwo)],
    ) -> Result<Vec<Result<(), StoreError>>, StoreError> {
        ParticipantStore::apply_decisions(self, items).await
    }

    async fn apply_then_prepare(
        &self,
        decisions: &[(GlobalTxid, PhaseTwo)],
        prepares: &[(GlobalTxid, u64, &[u8])],
    ) -> Result<AcksAndVerdicts, StoreError> {
        ParticipantStore::apply_then_prepare(self, decisions, prepares).await
    }

    async fn durable_entry(&self, txid: GlobalTxid) -> Result<Option<LogEntry>, StoreError> {
        let entry = self.entry(txid)?;
        self.flush().await?;
        Ok(entry)
    }

    async fn in_doubt_older_than(
        &self,
        age_min: std::time::Duration,
    ) -> Result<Vec<(GlobalTxid, LogEntry)>, StoreError> {
        ParticipantStore::in_doubt_older_than(self, age_min)
    }

    async fn in_doubt_summary(&self) -> Result<InDoubtSummary, StoreError> {
        ParticipantStore::in_doubt_summary(self)
    }

    async fn gc_candidates_after(
        &self,
        after: Option<(u64, GlobalTxid)>,
        decided_before_ms: u64,
        max: usize,
    ) -> Result<Vec<(u64, GlobalTxid)>, StoreError> {
        ParticipantStore::gc_candidates_after(self, after, decided_before_ms, max)
    }

    async fn forget_records(&self, records: &[(u64, GlobalTxid)]) -> Result<usize, StoreError> {
        ParticipantStore::forget_records(self, records)
    }

    fn stopped_because(&self) -> Option<String> {
        self.failure().map(|f| f.to_string())
    }

    async fn inspect(&self, query: &InspectQuery) -> Result<Inspection, StoreError> {
        let found = ParticipantStore::inspect(self, query)?;
        // As `durable_entry`: nothing is answered before it is on disk.
        self.flush().await?;
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Stages the payload on prepare; commit moves it to `applied/<txid>`.
    struct Kv;

    impl Resource for Kv {
        fn prepare(&self, _: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
            staged.put(format!("staged/{txid}").as_bytes(), payload);
            Vote::Yes
        }

        fn commit(&self, view: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
            let v = view
                .get(format!("staged/{txid}").as_bytes())
                .unwrap()
                .unwrap_or_default();
            staged.delete(format!("staged/{txid}").as_bytes());
            staged.put(format!("applied/{txid}").as_bytes(), &v);
        }

        fn abort(&self, _: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
            staged.delete(format!("staged/{txid}").as_bytes());
        }
    }

    /// Every file under `dir` (relative path) with its content.
    fn tree_digest(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
        let mut out = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    let rel = p.strip_prefix(dir).unwrap().display().to_string();
                    out.push((rel, std::fs::read(&p).unwrap()));
                }
            }
        }
        out.sort();
        out
    }

    /// docs/adr/0042-storage-engines.md: a store this build wrote reads
    /// back (its files and records in this build's format versions); a
    /// record or a checkpoint of a newer format version is refused, named,
    /// with the version found and the one this build reads.
    #[tokio::test]
    async fn a_store_of_this_version_reads_back_and_a_newer_version_is_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        {
            let s = ParticipantStore::open(d.path(), Kv).unwrap();
            ParticipantStore::handle(&s, 1, Message::Prepare { term: 2 }, b"one")
                .await
                .unwrap();
            ParticipantStore::handle(&s, 2, Message::Prepare { term: 2 }, b"two")
                .await
                .unwrap();
            ParticipantStore::handle(&s, 2, Message::Commit { term: 2 }, b"")
                .await
                .unwrap();
            s.tree.checkpoint().unwrap();
            ParticipantStore::handle(&s, 3, Message::Prepare { term: 3 }, b"three")
                .await
                .unwrap();
        }
        let s = ParticipantStore::open(d.path(), Kv).unwrap();
        let state = |t: u64| s.entry(t).unwrap().map(|e| (e.state, e.term));
        assert_eq!(state(1), Some((LocalState::Prepared { vote: Vote::Yes }, 2)));
        assert_eq!(state(2), Some((LocalState::Committed, 2)));
        assert_eq!(state(3), Some((LocalState::Prepared { vote: Vote::Yes }, 3)));
        assert_eq!(s.view().get(b"applied/2").unwrap(), Some(b"two".to_vec()));
        assert_eq!(
            s.in_doubt()
                .unwrap()
                .into_iter()
                .map(|(t, _)| t.txid)
                .collect::<Vec<_>>(),
            vec![1, 3]
        );
        assert_eq!(s.term_floor(0), 3);

        // A record of a newer format version.
        let mut newer = encode_entry(&s.entry(1).unwrap().unwrap());
        assert_eq!(newer[0], ENTRY_FORMAT);
        newer[0] = ENTRY_FORMAT + 1;
        let refusal = "participant log record format version 2 is newer than this build reads (1): upgrade the binary";
        assert_eq!(decode_entry(&newer).unwrap_err(), refusal);
        s.raw().write(vec![(log_key(1.into()), Some(newer.to_vec()))]).unwrap();
        match s.entry(1) {
            Err(StoreError::Damaged { message, .. }) => assert_eq!(message, refusal),
            other => panic!("read a record of a newer format version: {other:?}"),
        }
        drop(s);

        // A checkpoint of a newer format version: the store does not open
        // and changes nothing.
        let path = d.path().join(crate::kv::KV_CHECKPOINT_FILE);
        let mut b = std::fs::read(&path).unwrap();
        b[..dtx_durable::format::FILE_HEADER_BYTES].copy_from_slice(&dtx_durable::format::file_header(
            crate::kv::CHECKPOINT_MAGIC,
            u32::from(crate::kv::KV_FORMAT_VERSION) + 1,
        ));
        std::fs::write(&path, &b).unwrap();
        let before = tree_digest(d.path());
        let err = ParticipantStore::open(d.path(), Kv).err().expect("refused");
        assert!(!err.is_disk_full());
        assert_eq!(
            err.to_string(),
            format!(
                "participant store at {}: participant store checkpoint {} format version 2 is newer than this build reads (1): upgrade the binary; nothing was changed",
                d.path().display(),
                path.display()
            )
        );
        assert_eq!(tree_digest(d.path()), before);
    }

    /// A directory of the pre-release layout, the store in sled (which
    /// carries no format version), is refused by name and left as it was:
    /// nothing is read from it, moved or created in it.
    #[test]
    fn a_store_of_the_pre_release_sled_layout_is_refused_and_left_as_it_was() {
        let d = tempfile::tempdir().unwrap();
        {
            let db = open_sled(d.path()).unwrap();
            let tree = db.open_tree("participant").unwrap();
            let e = LogEntry {
                state: LocalState::Prepared { vote: Vote::Yes },
                term: 1,
            };
            tree.insert(log_key(1.into()), &encode_entry(&e)[..]).unwrap();
            db.flush().unwrap();
        }
        let before = tree_digest(d.path());
        let err = ParticipantStore::open(d.path(), Kv)
            .err()
            .expect("a store of the pre-release sled layout is not opened");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!(
                "participant store at {}: it holds a store written by sled",
                d.path().display()
            )),
            "{text}"
        );
        assert!(text.contains("a pre-release layout"), "{text}");
        assert!(text.contains("format version 1"), "{text}");
        assert!(text.contains("nothing was changed"), "{text}");
        assert!(!err.is_disk_full());
        assert_eq!(tree_digest(d.path()), before);
    }
}
