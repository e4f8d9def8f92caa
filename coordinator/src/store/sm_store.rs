//! The state-machine store: applies Raft entries to the pure `TxTable`, keeps
//! the table in memory for reads, and persists every changed record together
//! with the last-applied log id in ONE atomic engine batch per `apply` call,
//! so a restart finds the state of a whole prefix of the log: no gap and no
//! double application. Snapshots serialize the whole table, and the ids of
//! nodes removed from the cluster (never to be reused).
//!
//! Beside each record, under keys of their own, live its owner (`o<txid>`)
//! and the participants an operator dropped from it (`d<txid>`): written
//! with the record, deleted with it, absent when there are none.
//! Settlements of another incarnation's txids (`x<incarnation><txid>`,
//! ADR 0040) live beside the incarnations, never deleted.
//!
//! Every stored value (records, the `m/...` metadata, the snapshot and its
//! meta) is a codec value: its format version byte dispatches, and one of
//! another version is refused, named (`SmOpenError`, `install_snapshot`;
//! docs/adr/0042-storage-engines.md). A snapshot has one layout
//! (`SnapshotData`).

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::io::Cursor;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::RwLock;

use dtx_tls::logtext::Clean;
use openraft::storage::RaftStateMachine;
use openraft::AnyError;
use openraft::EntryPayload;
use openraft::RaftSnapshotBuilder;
use openraft::StorageIOError;
use serde::Deserialize;
use serde::Serialize;
use tracing::info;

use super::engine::KvEngine;
use super::engine::Space;
use super::engine::WriteBatch;
use super::retained;
use super::retained::key_text;
use super::retained::RetainedReadError;
use super::retained::RetainedReader;
pub use super::state::SmState;
use super::unwritten::Ops;
use super::unwritten::PendingWrites;
use super::unwritten::Unwritten;
use crate::codec;
use crate::raft::log_durability::LogDurability;
use crate::raft::BatchResult;
use crate::raft::Entry;
use crate::raft::LogId;
use crate::raft::Snapshot;
use crate::raft::SnapshotMeta;
use crate::raft::StorageError;
use crate::raft::StoredMembership;
use crate::raft::TypeConfig;
use crate::sm::command_key;
use crate::sm::command_txid;
use crate::sm::incarnation::Incarnations;
use crate::sm::saga::Definition;
use crate::sm::saga::SagaBook;
use crate::sm::saga::SagaBookData;
use crate::sm::saga::SagaEffect;
use crate::sm::saga::SagaId;
use crate::sm::saga::SagaRecord;
use crate::sm::settlement::Settlements;
use crate::sm::Branches;
use crate::sm::Command;
use crate::sm::CommandError;
use crate::sm::CommandOk;
use crate::sm::CommandResult;
use crate::sm::Drops;
use crate::sm::Effect;
use crate::sm::RetainedRecord;
use crate::sm::Settlement;
use crate::sm::TxRecord;
use crate::sm::TxTable;
use crate::sm::Txid;

const RECORD_PREFIX: &[u8] = b"t";
const NEXT_TXID_KEY: &[u8] = b"m/next_txid";
const APPLIED_KEY: &[u8] = b"m/applied";
const MEMBERSHIP_KEY: &[u8] = b"m/membership";
/// The retired node ids (`Command::RetireNodeId`), a key of its own,
/// written when they change: absent = none retired.
const RETIRED_NODE_IDS_KEY: &[u8] = b"m/retired_node_ids";
/// The owner of a transaction (`Command::As`), beside its record: absent =
/// no owner.
const OWNER_PREFIX: &[u8] = b"o";
/// The participants an operator dropped from a transaction
/// (`Command::DropParticipant`), beside its record: absent = none dropped.
const DROPS_PREFIX: &[u8] = b"d";
/// The branches of a transaction: registrations and fences
/// (`Command::RegisterBranch`, `Command::ExcludeBranch`, ADR 0046), beside
/// its record: absent = none.
const BRANCHES_PREFIX: &[u8] = b"b";
/// Saga records (`s<saga id>`), definitions (`g<name>\0<version>`) and the
/// next saga id: absent = none.
const SAGA_PREFIX: &[u8] = b"s";
const DEFINITION_PREFIX: &[u8] = b"g";
const NEXT_SAGA_ID_KEY: &[u8] = b"m/next_saga_id";
/// A saga's count of status queries failed in a row
/// (`JournalEvent::QueryFailed`), beside its record while not 0: absent = 0.
const QUERY_FAILURES_PREFIX: &[u8] = b"q";
/// The history of cluster incarnations (ADR 0033), written when it
/// changes: absent = none opened yet.
const INCARNATIONS_KEY: &[u8] = b"m/incarnations";
/// An operator's settlement of another incarnation's txid
/// (`Command::SettleOther`, ADR 0040), under `x<incarnation><txid>` (both
/// big-endian): absent = none settled.
const SETTLEMENT_PREFIX: &[u8] = b"x";
const SNAPSHOT_META_KEY: &[u8] = b"meta";
const SNAPSHOT_DATA_KEY: &[u8] = b"data";

/// Batches handed to the writer thread and not yet written, at most; an
/// apply that would pass it waits (the writer has fallen behind).
const SM_WRITER_QUEUE_BATCHES_MAX: usize = 4;

fn record_key(txid: Txid) -> Vec<u8> {
    let mut k = RECORD_PREFIX.to_vec();
    k.extend_from_slice(&txid.to_be_bytes());
    k
}

fn owner_key(txid: Txid) -> Vec<u8> {
    let mut k = OWNER_PREFIX.to_vec();
    k.extend_from_slice(&txid.to_be_bytes());
    k
}

fn txid_of_owner_key(k: &[u8]) -> Option<Txid> {
    txid_after(OWNER_PREFIX, k)
}

fn drops_key(txid: Txid) -> Vec<u8> {
    let mut k = DROPS_PREFIX.to_vec();
    k.extend_from_slice(&txid.to_be_bytes());
    k
}

fn branches_key(txid: Txid) -> Vec<u8> {
    let mut k = BRANCHES_PREFIX.to_vec();
    k.extend_from_slice(&txid.to_be_bytes());
    k
}

fn settlement_key(incarnation: u64, txid: Txid) -> Vec<u8> {
    let mut k = SETTLEMENT_PREFIX.to_vec();
    k.extend_from_slice(&incarnation.to_be_bytes());
    k.extend_from_slice(&txid.to_be_bytes());
    k
}

fn settlement_of_key(k: &[u8]) -> Option<(u64, Txid)> {
    let b: [u8; 16] = k.strip_prefix(SETTLEMENT_PREFIX)?.try_into().ok()?;
    let (i, t) = b.split_at(8);
    Some((
        u64::from_be_bytes(i.try_into().ok()?),
        Txid::from_be_bytes(t.try_into().ok()?),
    ))
}

fn saga_key(id: SagaId) -> Vec<u8> {
    let mut k = SAGA_PREFIX.to_vec();
    k.extend_from_slice(&id.to_be_bytes());
    k
}

fn query_failures_key(id: SagaId) -> Vec<u8> {
    let mut k = QUERY_FAILURES_PREFIX.to_vec();
    k.extend_from_slice(&id.to_be_bytes());
    k
}

fn definition_key(name: &str, version: u32) -> Vec<u8> {
    let mut k = DEFINITION_PREFIX.to_vec();
    k.extend_from_slice(name.as_bytes());
    k.push(0);
    k.extend_from_slice(&version.to_be_bytes());
    k
}

fn txid_after(prefix: &[u8], k: &[u8]) -> Option<Txid> {
    let b: [u8; 8] = k.strip_prefix(prefix)?.try_into().ok()?;
    Some(Txid::from_be_bytes(b))
}

/// The encoded form of a snapshot: its one layout in the codec's format
/// version (`decode_snapshot`).
#[derive(Serialize, Deserialize)]
struct SnapshotData {
    next_txid: Txid,
    records: Vec<TxRecord>,
    last_applied: Option<LogId>,
    membership: StoredMembership,
    retired_node_ids: BTreeSet<u64>,
    owners: BTreeMap<Txid, String>,
    drops: BTreeMap<Txid, Drops>,
    branches: BTreeMap<Txid, Branches>,
    sagas: SagaBookData,
    incarnations: Incarnations,
    settlements: Settlements,
}

/// Decodes a snapshot's bytes. The codec dispatches on their format
/// version: this build's decodes, any other is refused
/// (`codec::CodecError::Version`).
fn decode_snapshot(bytes: &[u8]) -> Result<SnapshotData, codec::CodecError> {
    codec::decode(bytes)
}

#[derive(Clone)]
pub struct StateMachineStore {
    engine: Arc<dyn KvEngine>,
    state: Arc<RwLock<SmState>>,
    /// Applied writes not in the engine yet (pending, and in flight to
    /// the writer thread).
    unwritten: Unwritten,
    /// A snapshot reading the retained records (ADR 0050).
    snapshot_read: Arc<SnapshotRead>,
    /// The writer thread's queue (see `run_writer`).
    writer: std::sync::mpsc::SyncSender<ToWriter>,
    /// The first write the writer thread could not do, if any: every later
    /// apply and barrier reports it (the state in memory is ahead of what
    /// can be stored; the log still holds the entries).
    write_failed: Arc<Mutex<Option<String>>>,
    /// The node's Raft log, whose entries are applied only once on its
    /// disk (`raft::log_durability`); None in tools that only read.
    log_durability: Option<Arc<LogDurability>>,
}

/// A snapshot reading the retained records from the engine without the
/// state lock (`StateMachineStore::snapshot_now`, ADR 0050).
#[derive(Debug, Default)]
struct SnapshotRead {
    /// Held by a snapshot's build and by an install, one at a time.
    one_at_a_time: Mutex<()>,
    /// While a build reads: the txids retained since it started, which it
    /// leaves out (None: no build is reading).
    released_since: Mutex<Option<BTreeSet<Txid>>>,
}

impl SnapshotRead {
    fn released_since(&self) -> std::sync::MutexGuard<'_, Option<BTreeSet<Txid>>> {
        self.released_since.lock().expect("snapshot read lock poisoned")
    }
}

/// What the writer thread is handed.
enum ToWriter {
    /// Pending writes, in the order the applies made them (also in
    /// `Unwritten`'s batches in flight, until written).
    Batch(Arc<Ops>),
    /// Answered once every batch handed over before it is written.
    Barrier(std::sync::mpsc::SyncSender<()>),
}

/// Writes the state machine's batches to the engine off the apply path,
/// in the order they were handed over, merging those that queue up into
/// one engine batch; then flushes the engine. An apply that found its
/// writes due only hands them over, so it no longer holds up the applies
/// behind it while sled works (ADR 0021's p99 cost). The flush: the Raft
/// log lives in files of its own (`dtx_durable::wal`), so nothing else
/// flushes the engine often; without it unwritten data would grow until a
/// purge or a vote, which would then wait for all of it (ADR 0022). Nothing waits for
/// these flushes; a failure is logged and the next flush that something
/// does wait for reports it. Ends when every store handle is dropped.
fn run_writer(
    engine: Arc<dyn KvEngine>,
    rx: std::sync::mpsc::Receiver<ToWriter>,
    failed: Arc<Mutex<Option<String>>>,
    unwritten: Unwritten,
) {
    while let Ok(first) = rx.recv() {
        let mut merged = WriteBatch::default();
        let mut barriers = Vec::new();
        let mut batches = 0;
        for m in std::iter::once(first).chain(std::iter::from_fn(|| rx.try_recv().ok())) {
            match m {
                ToWriter::Batch(b) => {
                    batches += 1;
                    merged.ops.extend(b.iter().map(|(k, v)| (k.clone(), v.clone())));
                }
                ToWriter::Barrier(done) => barriers.push(done),
            }
        }
        let wrote = !merged.ops.is_empty();
        // Nothing is written after a failed batch (it would store later
        // writes over the gap). The lock is not held while sled writes:
        // applies check it.
        let failed_before = failed.lock().expect("state-machine writer lock poisoned").is_some();
        if wrote && !failed_before {
            match engine.write_batch(Space::StateMachine, merged) {
                // Readers find these in the engine from now on.
                Ok(()) => unwritten.written(batches),
                Err(e) => {
                    tracing::error!("the state machine's writes could not be stored: {e}");
                    *failed.lock().expect("state-machine writer lock poisoned") = Some(e.to_string());
                }
            }
        }
        for done in barriers {
            let _ = done.send(());
        }
        if wrote {
            if let Err(e) = engine.flush() {
                tracing::warn!("background flush of the state machine's writes failed: {e}");
            }
        }
    }
}

impl Drop for StateMachineStore {
    /// A store that stops on purpose leaves nothing to apply again. (Every
    /// clone writes what is pending when dropped; after the first, nothing
    /// is.)
    fn drop(&mut self) {
        if let Err(e) = self.write_pending() {
            tracing::warn!("state-machine writes not stored at close (the log applies them again at start): {e}");
        }
    }
}

/// Why a state machine could not be loaded from its engine at start.
#[derive(Debug, thiserror::Error)]
pub enum SmOpenError {
    /// The engine could not read; a full disk is one cause
    /// (`EngineError::NoSpace`).
    #[error("{0}")]
    Engine(#[from] super::engine::EngineError),
    /// A stored value does not decode, named: written in another format
    /// version (the versions are said), or damaged.
    #[error("{0}")]
    Decode(#[from] codec::NamedCodecError),
}

/// Decodes the state-machine value stored under `key`, naming it when it
/// does not decode.
fn decode_value<T: serde::de::DeserializeOwned>(key: &[u8], bytes: &[u8]) -> Result<T, SmOpenError> {
    Ok(codec::decode(bytes).map_err(|e| e.named(format!("state-machine value {}", key_text(key))))?)
}

impl SmOpenError {
    /// The filesystem had no room (the node says so, rather than calling
    /// the directory damaged).
    pub fn is_no_space(&self) -> bool {
        matches!(self, SmOpenError::Engine(e) if e.is_no_space())
    }
}

fn read_err(e: impl std::error::Error + 'static) -> StorageError {
    StorageIOError::read_state_machine(AnyError::new(&e)).into()
}

fn write_err(e: impl std::error::Error + 'static) -> StorageError {
    StorageIOError::write_state_machine(AnyError::new(&e)).into()
}

fn writer_stopped() -> StorageError {
    write_err(std::io::Error::other("the state machine's writer thread has stopped"))
}

fn snap_err(e: impl std::error::Error + 'static) -> StorageError {
    StorageIOError::write_snapshot(None, AnyError::new(&e)).into()
}

/// Adds to `b` the writes of record `r` of `table` kept in memory: the
/// record, and its owner, drops and branches where it has them.
fn put_in_memory(b: &mut WriteBatch, table: &TxTable, r: &TxRecord) -> Result<(), codec::CodecError> {
    let t = r.txid;
    b.put(record_key(t), codec::encode(r)?);
    if let Some(o) = table.owner(t) {
        b.put(owner_key(t), codec::encode(&o.to_string())?);
    }
    if let Some(d) = table.dropped(t) {
        b.put(drops_key(t), codec::encode(d)?);
    }
    if let Some(br) = table.branches_of(t) {
        b.put(branches_key(t), codec::encode(br)?);
    }
    Ok(())
}

/// Moves the decided, fully acked records `done` (`TxTable::done_txids`)
/// out of `st`'s table into the retained records (ADR 0050), adding the writes to `b`: the record's
/// keys in memory deleted, its retained keys written, the count updated.
/// A record in `admitted` was read from the retained records for this
/// apply: unless it is in `changed` too, it only leaves memory again.
/// Returns the txids retained anew (not those admitted).
fn release_done(
    st: &mut SmState,
    done: &BTreeSet<Txid>,
    admitted: &BTreeSet<Txid>,
    changed: &BTreeSet<Txid>,
    b: &mut WriteBatch,
) -> Result<Vec<Txid>, codec::CodecError> {
    let mut newly = Vec::new();
    for txid in done {
        let Some(r) = st.table.release(*txid) else { continue };
        let was_retained = admitted.contains(txid);
        // No command changes a retained record (it is decided, every
        // participant acked; only its removal is left): one that did
        // would be written again below.
        debug_assert!(
            !(was_retained && changed.contains(txid)),
            "a command changed the retained record of txid {txid}"
        );
        if was_retained && !changed.contains(txid) {
            continue;
        }
        // Only the keys it had in memory: each delete costs the engine a
        // look-up, even of a key it never held.
        b.delete(record_key(*txid));
        if r.owner.is_some() {
            b.delete(owner_key(*txid));
        }
        if r.drops.is_some() {
            b.delete(drops_key(*txid));
        }
        if r.branches.is_some() {
            b.delete(branches_key(*txid));
        }
        retained::put(b, &r)?;
        if !was_retained {
            st.retained_count += 1;
            newly.push(*txid);
        }
    }
    Ok(newly)
}

/// Brings into `st`'s table the retained records `cmd` is about (its txid,
/// the transaction its idempotency key belongs to), so the pure table
/// applies it as if they had never left memory. Not one removed in this
/// apply (`removed`); each brought in is kept in `admitted` as it was.
fn admit_retained(
    st: &mut SmState,
    cmd: &Command,
    removed: &BTreeSet<Txid>,
    admitted: &mut BTreeMap<Txid, RetainedRecord>,
) -> Result<(), RetainedReadError> {
    let SmState { table, retained, .. } = st;
    let Some(reader) = retained.as_ref() else {
        return Ok(());
    };
    let mut wanted = Vec::with_capacity(2);
    wanted.extend(command_txid(cmd));
    if let Some(key) = command_key(cmd) {
        if table.txid_of_key(key).is_none() {
            wanted.extend(reader.txid_of_key(key)?);
        }
    }
    for t in wanted {
        if table.get(t).is_some() || removed.contains(&t) {
            continue;
        }
        if let Some(r) = reader.get(t)? {
            admitted.insert(t, r.clone());
            table.admit(r);
        }
    }
    Ok(())
}

/// Engine batches of a snapshot's install hold at most this many writes:
/// sled applies one huge batch far more slowly than many of this size.
const INSTALL_BATCH_WRITES_MAX: usize = 10_000;
/// In the snapshot space while an install replaces the state machine's
/// keys (several batches): a start that finds it installs the saved
/// snapshot again before it reads anything.
const INSTALLING_KEY: &[u8] = b"installing";

/// Replaces everything the state machine stored by the snapshot `data` of
/// `meta` (saved first by the caller), in batches of at most
/// `INSTALL_BATCH_WRITES_MAX` writes under `INSTALLING_KEY`: the done
/// records retained (ADR 0050), the others in `into.table`, as `open`
/// would load them.
fn install_into(
    engine: &dyn KvEngine,
    meta: &SnapshotMeta,
    data: &SnapshotData,
    into: &mut SmState,
) -> Result<(), InstallError> {
    let mut marker = WriteBatch::default();
    marker.put(INSTALLING_KEY.to_vec(), codec::encode(&meta.snapshot_id)?);
    engine.write_batch(Space::Snapshot, marker)?;
    engine.delete_range(Space::StateMachine, b"", None)?;
    let mut b = WriteBatch::default();
    let flush = |b: &mut WriteBatch, at_least: usize| -> Result<(), InstallError> {
        if b.ops.len() >= at_least {
            engine.write_batch(Space::StateMachine, std::mem::take(b))?;
        }
        Ok(())
    };
    let mut hot = Vec::new();
    let mut retained_count = 0u64;
    for r in &data.records {
        let done = r.decision().is_some() && r.all_acked();
        if !done {
            hot.push(r.clone());
            continue;
        }
        let t = r.txid;
        let kept = RetainedRecord {
            record: r.clone(),
            owner: data.owners.get(&t).cloned(),
            drops: data.drops.get(&t).cloned(),
            branches: data.branches.get(&t).cloned(),
        };
        retained::put(&mut b, &kept)?;
        retained_count += 1;
        flush(&mut b, INSTALL_BATCH_WRITES_MAX)?;
    }
    let hot_txids: BTreeSet<Txid> = hot.iter().map(|r| r.txid).collect();
    let pick = |t: &Txid| hot_txids.contains(t);
    into.table = TxTable::from_parts(data.next_txid, hot)
        .with_retired_node_ids(data.retired_node_ids.clone())
        .with_owners(
            data.owners
                .iter()
                .filter(|(t, _)| pick(t))
                .map(|(t, o)| (*t, o.clone())),
        )
        .with_drops(data.drops.iter().filter(|(t, _)| pick(t)).map(|(t, d)| (*t, d.clone())))
        .with_branches(
            data.branches
                .iter()
                .filter(|(t, _)| pick(t))
                .map(|(t, x)| (*t, x.clone())),
        );
    into.retained_count = retained_count;
    for r in into.table.records() {
        put_in_memory(&mut b, &into.table, r)?;
        flush(&mut b, INSTALL_BATCH_WRITES_MAX)?;
    }
    for r in &data.sagas.sagas {
        b.put(saga_key(r.id), codec::encode(r)?);
        flush(&mut b, INSTALL_BATCH_WRITES_MAX)?;
    }
    for d in &data.sagas.definitions {
        b.put(definition_key(&d.name, d.version), codec::encode(d)?);
    }
    for (id, n) in &data.sagas.query_failures {
        b.put(query_failures_key(*id), codec::encode(n)?);
    }
    for ((incarnation, txid), x) in data.settlements.iter() {
        b.put(settlement_key(*incarnation, *txid), codec::encode(x)?);
        flush(&mut b, INSTALL_BATCH_WRITES_MAX)?;
    }
    // The metadata last: with it the state reads as installed.
    b.put(retained::RETAINED_COUNT_KEY.to_vec(), codec::encode(&retained_count)?);
    b.put(NEXT_SAGA_ID_KEY.to_vec(), codec::encode(&data.sagas.next_saga_id)?);
    b.put(NEXT_TXID_KEY.to_vec(), codec::encode(&data.next_txid)?);
    b.put(APPLIED_KEY.to_vec(), codec::encode(&meta.last_log_id)?);
    b.put(MEMBERSHIP_KEY.to_vec(), codec::encode(&meta.last_membership)?);
    b.put(RETIRED_NODE_IDS_KEY.to_vec(), codec::encode(&data.retired_node_ids)?);
    b.put(INCARNATIONS_KEY.to_vec(), codec::encode(&data.incarnations)?);
    flush(&mut b, 0)?;
    let mut done = WriteBatch::default();
    done.delete(INSTALLING_KEY.to_vec());
    engine.write_batch(Space::Snapshot, done)?;
    Ok(())
}

/// Why a snapshot's install could not write the state.
#[derive(Debug, thiserror::Error)]
enum InstallError {
    #[error("{0}")]
    Engine(#[from] super::engine::EngineError),
    #[error("{0}")]
    Encode(#[from] codec::CodecError),
}

/// At start: an install that a stop cut short is done again from the
/// saved snapshot, before anything is read.
fn finish_cut_install(engine: &dyn KvEngine) -> Result<(), SmOpenError> {
    if engine.get(Space::Snapshot, INSTALLING_KEY)?.is_none() {
        return Ok(());
    }
    let meta: SnapshotMeta = match engine.get(Space::Snapshot, SNAPSHOT_META_KEY)? {
        Some(m) => decode_value(SNAPSHOT_META_KEY, &m)?,
        None => return Ok(()),
    };
    let bytes = engine.get(Space::Snapshot, SNAPSHOT_DATA_KEY)?.unwrap_or_default();
    let data = decode_snapshot(&bytes).map_err(|e| e.named("the saved snapshot"))?;
    tracing::warn!(
        snapshot = %meta.snapshot_id,
        "the install of a snapshot was cut short by a stop; installing it again"
    );
    install_into(engine, &meta, &data, &mut SmState::default()).map_err(|e| match e {
        InstallError::Engine(e) => SmOpenError::Engine(e),
        InstallError::Encode(e) => SmOpenError::Decode(e.named("a snapshot's record")),
    })
}

impl StateMachineStore {
    /// Loads the persisted state machine (empty on a new data directory).
    pub fn open(engine: Arc<dyn KvEngine>) -> Result<Self, SmOpenError> {
        finish_cut_install(&*engine)?;
        retained::drop_old_forget_index(&*engine)?;
        let mut records = Vec::new();
        for (k, v) in engine.scan_prefix(Space::StateMachine, RECORD_PREFIX)? {
            records.push(decode_value::<TxRecord>(&k, &v)?);
        }
        let get = |key: &[u8]| -> Result<Option<Vec<u8>>, SmOpenError> { Ok(engine.get(Space::StateMachine, key)?) };
        let next_txid: Txid = match get(NEXT_TXID_KEY)? {
            Some(b) => decode_value(NEXT_TXID_KEY, &b)?,
            None => 1,
        };
        let last_applied: Option<LogId> = match get(APPLIED_KEY)? {
            Some(b) => decode_value(APPLIED_KEY, &b)?,
            None => None,
        };
        let membership: StoredMembership = match get(MEMBERSHIP_KEY)? {
            Some(b) => decode_value(MEMBERSHIP_KEY, &b)?,
            None => StoredMembership::default(),
        };
        let retired: BTreeSet<u64> = match get(RETIRED_NODE_IDS_KEY)? {
            Some(b) => decode_value(RETIRED_NODE_IDS_KEY, &b)?,
            None => BTreeSet::new(),
        };
        let mut owners = Vec::new();
        for (k, v) in engine.scan_prefix(Space::StateMachine, OWNER_PREFIX)? {
            if let Some(t) = txid_of_owner_key(&k) {
                owners.push((t, decode_value::<String>(&k, &v)?));
            }
        }
        let mut drops = Vec::new();
        for (k, v) in engine.scan_prefix(Space::StateMachine, DROPS_PREFIX)? {
            if let Some(t) = txid_after(DROPS_PREFIX, &k) {
                drops.push((t, decode_value::<Drops>(&k, &v)?));
            }
        }
        let mut branches = Vec::new();
        for (k, v) in engine.scan_prefix(Space::StateMachine, BRANCHES_PREFIX)? {
            if let Some(t) = txid_after(BRANCHES_PREFIX, &k) {
                branches.push((t, decode_value::<Branches>(&k, &v)?));
            }
        }
        let mut sagas = Vec::new();
        for (k, v) in engine.scan_prefix(Space::StateMachine, SAGA_PREFIX)? {
            sagas.push(decode_value::<SagaRecord>(&k, &v)?);
        }
        let mut definitions = Vec::new();
        for (k, v) in engine.scan_prefix(Space::StateMachine, DEFINITION_PREFIX)? {
            definitions.push(decode_value::<Definition>(&k, &v)?);
        }
        let next_saga_id: SagaId = match get(NEXT_SAGA_ID_KEY)? {
            Some(b) => decode_value(NEXT_SAGA_ID_KEY, &b)?,
            None => 1,
        };
        let mut query_failures = Vec::new();
        for (k, v) in engine.scan_prefix(Space::StateMachine, QUERY_FAILURES_PREFIX)? {
            if let Some(id) = txid_after(QUERY_FAILURES_PREFIX, &k) {
                query_failures.push((id, decode_value::<u32>(&k, &v)?));
            }
        }
        let incarnations: Incarnations = match get(INCARNATIONS_KEY)? {
            Some(b) => decode_value(INCARNATIONS_KEY, &b)?,
            None => Incarnations::default(),
        };
        let mut settlements = Vec::new();
        for (k, v) in engine.scan_prefix(Space::StateMachine, SETTLEMENT_PREFIX)? {
            if let Some(id) = settlement_of_key(&k) {
                settlements.push((id, decode_value::<Settlement>(&k, &v)?));
            }
        }
        let retained_count: u64 = match get(retained::RETAINED_COUNT_KEY)? {
            Some(b) => decode_value(retained::RETAINED_COUNT_KEY, &b)?,
            None => 0,
        };
        let unwritten = Unwritten::default();
        let mut state = SmState {
            table: TxTable::from_parts(next_txid, records)
                .with_retired_node_ids(retired)
                .with_owners(owners)
                .with_drops(drops)
                .with_branches(branches),
            sagas: SagaBook::from_parts(next_saga_id, definitions, sagas).with_query_failures(query_failures),
            last_applied,
            membership,
            incarnations,
            settlements: Settlements::from_parts(settlements),
            retained: Some(RetainedReader::new(engine.clone(), unwritten.clone())),
            retained_count,
        };
        // Records a build before ADR 0050 kept in memory (or that were
        // done when it stopped) are retained now, and the deletes a
        // snapshot put off before a stop are done, in one batch.
        let mut b = match &state.retained {
            Some(reader) => retained::finish_deletes(reader).map_err(|e| match e {
                RetainedReadError::Engine(e) => SmOpenError::Engine(e),
                RetainedReadError::Decode(e) => SmOpenError::Decode(e),
            })?,
            None => WriteBatch::default(),
        };
        let done: BTreeSet<Txid> = state.table.done_txids().into_iter().collect();
        if !release_done(&mut state, &done, &BTreeSet::new(), &BTreeSet::new(), &mut b)
            .map_err(|e| e.named("a retained record"))?
            .is_empty()
        {
            b.put(
                retained::RETAINED_COUNT_KEY.to_vec(),
                codec::encode(&state.retained_count).map_err(|e| e.named("the retained count"))?,
            );
        }
        if !b.is_empty() {
            engine.write_batch(Space::StateMachine, b)?;
        }
        let (writer, rx) = std::sync::mpsc::sync_channel(SM_WRITER_QUEUE_BATCHES_MAX);
        let write_failed = Arc::new(Mutex::new(None));
        let (e, f, u) = (engine.clone(), write_failed.clone(), unwritten.clone());
        std::thread::Builder::new()
            .name("dtx-sm-writer".into())
            .spawn(move || run_writer(e, rx, f, u))
            .map_err(|e| {
                SmOpenError::Engine(crate::store::engine::EngineError::Io {
                    space: "sm",
                    message: format!("cannot start the state machine's writer thread: {e}"),
                })
            })?;
        Ok(StateMachineStore {
            engine,
            state: Arc::new(RwLock::new(state)),
            unwritten,
            snapshot_read: Arc::new(SnapshotRead::default()),
            writer,
            write_failed,
            log_durability: None,
        })
    }

    /// From now on an entry is applied only once `log` has it on disk
    /// (ADR 0028: the leader's entries reach the followers before its own
    /// sync; a client is answered only when both copies are synced).
    pub fn applying_only_durable(mut self, log: Arc<LogDurability>) -> Self {
        self.log_durability = Some(log);
        self
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, PendingWrites> {
        self.unwritten.pending()
    }

    /// Gives the waiting state-machine writes to the engine (one atomic
    /// batch; durable at the engine's next flush) and returns once they
    /// and every batch handed over before are written.
    pub fn write_pending(&self) -> Result<(), StorageError> {
        self.hand_over(&mut self.pending())?;
        self.written()
    }

    /// Hands what `p` holds to the writer thread as one batch (waiting if
    /// its queue is full); the caller holds the pending lock, so batches
    /// queue in the order of the applies.
    fn hand_over(&self, p: &mut PendingWrites) -> Result<(), StorageError> {
        self.check_writes()?;
        if p.ops.is_empty() {
            return Ok(());
        }
        self.writer
            .send(ToWriter::Batch(self.unwritten.start_writing(p)))
            .map_err(|_| writer_stopped())
    }

    /// Returns once every batch handed over so far is written.
    fn written(&self) -> Result<(), StorageError> {
        let (done, wait) = std::sync::mpsc::sync_channel(1);
        self.writer
            .send(ToWriter::Barrier(done))
            .map_err(|_| writer_stopped())?;
        wait.recv().map_err(|_| writer_stopped())?;
        self.check_writes()
    }

    /// The writer thread's first failure, if any.
    fn check_writes(&self) -> Result<(), StorageError> {
        match &*self.write_failed.lock().expect("state-machine writer lock poisoned") {
            Some(e) => Err(write_err(std::io::Error::other(format!(
                "an earlier batch of state-machine writes could not be stored: {e}"
            )))),
            None => Ok(()),
        }
    }

    /// Shared read access to the in-memory state. Callers that need
    /// linearizability run openraft's read-index first.
    pub fn state(&self) -> std::sync::RwLockReadGuard<'_, SmState> {
        self.state.read().expect("state machine lock poisoned")
    }

    /// The snapshot of the state applied now (ADR 0050): what is in
    /// memory is copied under the state lock, after the pending writes are
    /// in the engine (the log may be purged up to this snapshot next: the
    /// stored state must not be behind it); the retained records are read
    /// from the engine after the lock is released, so applies go on
    /// meanwhile. Their deletes are put off while it reads, and those
    /// retained since it started are left out: it reads exactly the ones
    /// retained at its entry.
    fn snapshot_now(&self) -> Result<(SnapshotMeta, Vec<u8>), StorageError> {
        let _one = self.snapshot_read.one_at_a_time.lock().expect("snapshot lock poisoned");
        let mut data = {
            let st = self.state();
            self.write_pending()?;
            *self.snapshot_read.released_since() = Some(BTreeSet::new());
            SnapshotData {
                next_txid: st.table.next_txid(),
                records: st.table.records().cloned().collect(),
                last_applied: st.last_applied,
                membership: st.membership.clone(),
                retired_node_ids: st.table.retired_node_ids().clone(),
                owners: st.table.owners().clone(),
                drops: st.table.drops().clone(),
                branches: st.table.branches().clone(),
                sagas: st.sagas.data(),
                incarnations: st.incarnations.clone(),
                settlements: st.settlements.clone(),
            }
        };
        let read = retained::read_all(&*self.engine);
        let since = self.snapshot_read.released_since().take().unwrap_or_default();
        self.finish_deletes()?;
        let mut records: BTreeMap<Txid, TxRecord> = std::mem::take(&mut data.records)
            .into_iter()
            .map(|r| (r.txid, r))
            .collect();
        for r in read.map_err(read_err)? {
            let txid = r.record.txid;
            if since.contains(&txid) {
                continue;
            }
            if let Some(o) = r.owner {
                data.owners.insert(txid, o);
            }
            if let Some(d) = r.drops {
                data.drops.insert(txid, d);
            }
            if let Some(br) = r.branches {
                data.branches.insert(txid, br);
            }
            records.insert(txid, r.record);
        }
        data.records = records.into_values().collect();
        let bytes = codec::encode(&data).map_err(snap_err)?;
        let snapshot_id = match data.last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id.term, l.index, bytes.len()),
            None => format!("empty-{}", bytes.len()),
        };
        let meta = SnapshotMeta {
            last_log_id: data.last_applied,
            last_membership: data.membership,
            snapshot_id,
        };
        Ok((meta, bytes))
    }

    /// Deletes the retained records forgotten while a snapshot read them
    /// (`retained::delete`), with the next writes.
    fn finish_deletes(&self) -> Result<(), StorageError> {
        let st = self.state.write().expect("state machine lock poisoned");
        let Some(reader) = &st.retained else { return Ok(()) };
        let b = retained::finish_deletes(reader).map_err(read_err)?;
        if !b.is_empty() {
            self.pending().add(b, 0);
        }
        Ok(())
    }

    fn save_snapshot(&self, meta: &SnapshotMeta, bytes: &[u8]) -> Result<(), StorageError> {
        let mut b = WriteBatch::default();
        b.put(SNAPSHOT_META_KEY.to_vec(), codec::encode(meta).map_err(snap_err)?);
        b.put(SNAPSHOT_DATA_KEY.to_vec(), bytes.to_vec());
        self.engine.write_batch(Space::Snapshot, b).map_err(snap_err)
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachineStore {
    async fn build_snapshot(&mut self) -> Result<Snapshot, StorageError> {
        let started = std::time::Instant::now();
        let (meta, bytes) = self.snapshot_now()?;
        self.save_snapshot(&meta, &bytes)?;
        metrics::counter!("dtx_snapshots_built_total").increment(1);
        metrics::gauge!("dtx_snapshot_last_build_seconds").set(started.elapsed().as_secs_f64());
        metrics::gauge!("dtx_snapshot_last_bytes").set(bytes.len() as f64);
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(bytes)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let st = self.state();
        Ok((st.last_applied, st.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<BatchResult>, StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        if let (Some(log), Some(last)) = (&self.log_durability, entries.last()) {
            let started = std::time::Instant::now();
            log.wait_durable(last.log_id.index)
                .await
                .map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
            metrics::histogram!("dtx_apply_wait_for_log_sync_seconds").record(started.elapsed().as_secs_f64());
        }
        let mut st = self.state.write().expect("state machine lock poisoned");
        let mut responses = Vec::new();
        let mut effects = Vec::new();
        let mut saga_effects = Vec::new();
        let mut membership_changed = false;
        let mut incarnations_changed = false;
        let mut settled: Vec<(u64, Txid, crate::sm::Outcome)> = Vec::new();
        // Retained records this apply brought back into the table, as they
        // were, and the txids it removed (ADR 0050).
        let mut admitted: BTreeMap<Txid, RetainedRecord> = BTreeMap::new();
        let mut removed: BTreeSet<Txid> = BTreeSet::new();
        let retained_before = st.retained_count;
        // Under the state lock: a snapshot starts reading only between
        // applies.
        let snapshot_reading = self.snapshot_read.released_since().is_some();
        for entry in entries {
            st.last_applied = Some(entry.log_id);
            let mut out = BatchResult::default();
            match entry.payload {
                EntryPayload::Blank => {}
                EntryPayload::Normal(batch) => {
                    // The entry's term: a BeginAndDecide is held to the term
                    // its txid was handed out in (ADR 0012).
                    let term = entry.log_id.leader_id.term;
                    for cmd in &batch.commands {
                        let result = match cmd {
                            Command::Saga(c) => st
                                .sagas
                                .apply(c, &mut saga_effects)
                                .map(CommandOk::Saga)
                                .map_err(CommandError::Saga),
                            Command::OpenIncarnation { incarnation } => {
                                let st = &mut *st;
                                let opened =
                                    st.incarnations
                                        .open(*incarnation, st.table.next_txid(), st.sagas.next_saga_id());
                                if opened == Ok(true) {
                                    // Every node says so as it applies it
                                    // (outside any request's span).
                                    tracing::info!(
                                        incarnation = format!("{incarnation:016x}"),
                                        first_txid = st.table.next_txid(),
                                        "a new cluster incarnation is open (ADR 0033)"
                                    );
                                    incarnations_changed = true;
                                }
                                opened
                                    .map(|newly| CommandOk::IncarnationOpened {
                                        incarnation: st.incarnations.current().unwrap_or(0),
                                        newly,
                                    })
                                    .map_err(CommandError::Invalid)
                            }
                            Command::SettleOther {
                                incarnation,
                                txid,
                                outcome,
                                term,
                                now_ms,
                                note,
                            } => {
                                let st = &mut *st;
                                let settlement = Settlement {
                                    outcome: *outcome,
                                    note: note.clone(),
                                    settled_ms: *now_ms,
                                    term: *term,
                                };
                                let r = st.settlements.settle(&st.incarnations, *incarnation, *txid, settlement);
                                if matches!(r, Ok(CommandOk::Settled { recorded: true, .. })) {
                                    settled.push((*incarnation, *txid, *outcome));
                                }
                                r
                            }
                            _ => {
                                admit_retained(&mut st, cmd, &removed, &mut admitted).map_err(read_err)?;
                                let first = effects.len();
                                let r = st.table.apply_in_term(term, cmd, &mut effects);
                                removed.extend(effects[first..].iter().filter_map(|e| match e {
                                    Effect::Remove(t) => Some(*t),
                                    _ => None,
                                }));
                                r
                            }
                        };
                        log_operator_change(cmd, &result);
                        out.results.push(result);
                    }
                }
                EntryPayload::Membership(m) => {
                    st.membership = StoredMembership::new(Some(entry.log_id), m);
                    membership_changed = true;
                }
            }
            responses.push(out);
        }
        // One atomic batch: the changed records plus the new last-applied.
        let mut b = WriteBatch::default();
        let mut seen = BTreeSet::new();
        // Those done now leave memory below (`release_done`).
        let releasing: BTreeSet<Txid> = st.table.done_txids().into_iter().collect();
        for e in effects.iter().rev() {
            let (Effect::Put(txid) | Effect::Remove(txid)) = e else {
                continue;
            };
            if !seen.insert(*txid) || releasing.contains(txid) {
                continue;
            }
            match st.table.get(*txid) {
                Some(r) => put_in_memory(&mut b, &st.table, r).map_err(write_err)?,
                None => {
                    b.delete(record_key(*txid));
                    b.delete(owner_key(*txid));
                    b.delete(drops_key(*txid));
                    b.delete(branches_key(*txid));
                    if let Some(r) = admitted.get(txid) {
                        retained::delete(&mut b, r, snapshot_reading);
                        st.retained_count = st.retained_count.saturating_sub(1);
                    }
                }
            }
        }
        // After the deletes above: a key a removed record held may belong
        // to a record retained now.
        let changed: BTreeSet<Txid> = effects
            .iter()
            .filter_map(|e| match e {
                Effect::Put(t) => Some(*t),
                _ => None,
            })
            .collect();
        let admitted_txids: BTreeSet<Txid> = admitted.keys().copied().collect();
        let newly = release_done(&mut st, &releasing, &admitted_txids, &changed, &mut b).map_err(write_err)?;
        if snapshot_reading {
            if let Some(since) = self.snapshot_read.released_since().as_mut() {
                since.extend(newly);
            }
        }
        if st.retained_count != retained_before {
            b.put(
                retained::RETAINED_COUNT_KEY.to_vec(),
                codec::encode(&st.retained_count).map_err(write_err)?,
            );
        }
        for e in &saga_effects {
            match e {
                SagaEffect::Put(id) => {
                    if let Some(r) = st.sagas.get(*id) {
                        b.put(saga_key(*id), codec::encode(r).map_err(write_err)?);
                    }
                    match st.sagas.query_failures(*id) {
                        0 => b.delete(query_failures_key(*id)),
                        n => b.put(query_failures_key(*id), codec::encode(&n).map_err(write_err)?),
                    }
                }
                SagaEffect::Remove(id) => {
                    b.delete(saga_key(*id));
                    b.delete(query_failures_key(*id));
                }
                SagaEffect::Definition(name, version) => {
                    if let Some(d) = st.sagas.definition(name, *version) {
                        b.put(definition_key(name, *version), codec::encode(d).map_err(write_err)?);
                    }
                }
            }
        }
        if !saga_effects.is_empty() {
            b.put(
                NEXT_SAGA_ID_KEY.to_vec(),
                codec::encode(&st.sagas.next_saga_id()).map_err(write_err)?,
            );
        }
        b.put(
            NEXT_TXID_KEY.to_vec(),
            codec::encode(&st.table.next_txid()).map_err(write_err)?,
        );
        b.put(
            APPLIED_KEY.to_vec(),
            codec::encode(&st.last_applied).map_err(write_err)?,
        );
        if incarnations_changed {
            b.put(
                INCARNATIONS_KEY.to_vec(),
                codec::encode(&st.incarnations).map_err(write_err)?,
            );
        }
        for (incarnation, txid, _) in &settled {
            if let Some(x) = st.settlements.get(*incarnation, *txid) {
                b.put(
                    settlement_key(*incarnation, *txid),
                    codec::encode(x).map_err(write_err)?,
                );
            }
        }
        if membership_changed {
            b.put(
                MEMBERSHIP_KEY.to_vec(),
                codec::encode(&st.membership).map_err(write_err)?,
            );
        }
        if effects.contains(&Effect::RetiredNodeIdsChanged) {
            b.put(
                RETIRED_NODE_IDS_KEY.to_vec(),
                codec::encode(st.table.retired_node_ids()).map_err(write_err)?,
            );
        }
        let entries = responses.len() as u64;
        let mut pending = self.pending();
        pending.add(b, entries);
        // Readers need not wait for the engine; a snapshot does (it takes
        // the pending lock, held until the batch is written).
        drop(st);
        // Not due while a test holds the stored state behind the log, as a
        // kill can find it (tests only, `failpoints`: t23).
        if pending.due() && !dtx_failpoint::refused("sm_batch_write") {
            self.hand_over(&mut pending)?;
        }
        drop(pending);
        for e in &effects {
            if let Effect::Decided(_, outcome) = e {
                metrics::counter!("dtx_decisions_total", "outcome" => outcome.to_string()).increment(1);
            }
        }
        for (_, _, outcome) in &settled {
            metrics::counter!("dtx_settlements_total", "outcome" => outcome.to_string()).increment(1);
        }
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), StorageError> {
        let started = std::time::Instant::now();
        // Not while a build reads the retained records this replaces.
        let _one = self.snapshot_read.one_at_a_time.lock().expect("snapshot lock poisoned");
        let bytes = snapshot.into_inner();
        let data: SnapshotData = decode_snapshot(&bytes)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), AnyError::new(&e.named("snapshot"))))?;
        let mut st = self.state.write().expect("state machine lock poisoned");
        // What waits to be written belongs to the state being replaced;
        // what the writer has yet to write must land before the
        // replacement, not after it.
        let _dropped = self.pending().take();
        self.written()?;
        // Saved first: a stop during the replacement redoes it at start.
        self.save_snapshot(meta, &bytes)?;
        let mut fresh = SmState::default();
        install_into(&*self.engine, meta, &data, &mut fresh).map_err(write_err)?;
        st.table = fresh.table;
        st.retained_count = fresh.retained_count;
        st.sagas = SagaBook::from_data(data.sagas);
        st.incarnations = data.incarnations;
        st.settlements = data.settlements;
        st.last_applied = meta.last_log_id;
        st.membership = meta.last_membership.clone();
        drop(st);
        metrics::counter!("dtx_snapshots_installed_total").increment(1);
        metrics::gauge!("dtx_snapshot_last_install_seconds").set(started.elapsed().as_secs_f64());
        metrics::gauge!("dtx_snapshot_last_bytes").set(bytes.len() as f64);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot>, StorageError> {
        let meta = self.engine.get(Space::Snapshot, SNAPSHOT_META_KEY).map_err(read_err)?;
        let data = self.engine.get(Space::Snapshot, SNAPSHOT_DATA_KEY).map_err(read_err)?;
        match (meta, data) {
            (Some(m), Some(d)) => Ok(Some(Snapshot {
                meta: codec::decode_named("snapshot meta", &m).map_err(read_err)?,
                snapshot: Box::new(Cursor::new(d)),
            })),
            _ => Ok(None),
        }
    }
}

/// For backups: the snapshot of the state applied now, encoded
/// exactly as `build_snapshot` encodes it, WITHOUT saving it as this node's
/// current snapshot (openraft keeps track of that one).
impl StateMachineStore {
    pub fn snapshot_for_backup(&self) -> Result<(SnapshotMeta, Vec<u8>), StorageError> {
        self.snapshot_now()
    }
}

/// For backups: the table a snapshot's bytes hold, decoded as
/// `install_snapshot` decodes them.
pub fn decode_snapshot_table(bytes: &[u8]) -> Result<TxTable, codec::CodecError> {
    let data = decode_snapshot(bytes)?;
    Ok(TxTable::from_parts(data.next_txid, data.records)
        .with_retired_node_ids(data.retired_node_ids)
        .with_owners(data.owners)
        .with_drops(data.drops)
        .with_branches(data.branches))
}

/// The incarnations a snapshot's bytes hold.
pub fn decode_snapshot_incarnations(bytes: &[u8]) -> Result<Incarnations, codec::CodecError> {
    Ok(decode_snapshot(bytes)?.incarnations)
}

/// The settlements a snapshot's bytes hold.
pub fn decode_snapshot_settlements(bytes: &[u8]) -> Result<Settlements, codec::CodecError> {
    Ok(decode_snapshot(bytes)?.settlements)
}

/// For restores: a snapshot's bytes with its next txid
/// raised to at least `next_txid` and its open incarnation ended where the
/// backup's ids end (ADR 0033: the restored cluster's first leader opens a
/// new one, so no id it hands out is taken for one the old cluster handed
/// out after the backup), re-encoded.
pub fn snapshot_for_restore(bytes: &[u8], next_txid: Txid) -> Result<Vec<u8>, codec::CodecError> {
    let mut data = decode_snapshot(bytes)?;
    data.incarnations.close(data.next_txid, data.sagas.next_saga_id);
    data.next_txid = data.next_txid.max(next_txid);
    codec::encode(&data)
}

/// Every node logs the operator's changes to transactions when it applies
/// them: who and why are in the note.
fn log_operator_change(cmd: &Command, result: &CommandResult) {
    match (cmd, result) {
        (
            Command::DropParticipant {
                txid,
                participant_id,
                note,
                ..
            },
            Ok(CommandOk::ParticipantDropped { recorded: true }),
        ) => {
            info!(txid, participant = %Clean(participant_id), note = %Clean(note), "participant dropped from phase two by an operator: the decision must be reconciled there by hand");
        }
        (Command::ForgetByOperator { txid, note }, Ok(CommandOk::ForgottenByOperator { outcome: Some(outcome) })) => {
            info!(txid, outcome = %outcome, note = %Clean(note), "transaction forgotten by an operator");
        }
        (
            Command::SettleOther {
                incarnation,
                txid,
                outcome,
                note,
                ..
            },
            Ok(CommandOk::Settled { recorded: true, .. }),
        ) => {
            info!(
                incarnation = format!("{incarnation:016x}"),
                txid,
                outcome = %outcome,
                note = %Clean(note),
                "another incarnation's transaction settled by an operator: participants' recovery reads this outcome (ADR 0040)"
            );
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use openraft::CommittedLeaderId;
    use openraft::Entry as RaftEntry;

    use super::*;
    use crate::raft::Batch;
    use crate::sm::DecisionView;
    use crate::store::engine::EngineError;
    use crate::store::engine::KvPair;
    use crate::store::unwritten::SM_PENDING_ENTRIES_MAX;

    fn entry(index: u64, commands: Vec<Command>) -> Entry {
        RaftEntry {
            log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
            payload: EntryPayload::Normal(Batch { commands }),
        }
    }

    fn fresh() -> (tempfile::TempDir, Arc<dyn KvEngine>, StateMachineStore) {
        let dir = tempfile::tempdir().unwrap();
        let engine = crate::store::open_data_dir(dir.path(), "c", 1).unwrap();
        let sm = StateMachineStore::open(engine.clone()).unwrap();
        (dir, engine, sm)
    }

    fn entry_in_term(term: u64, index: u64, commands: Vec<Command>) -> Entry {
        RaftEntry {
            log_id: LogId::new(CommittedLeaderId::new(term, 1), index),
            payload: EntryPayload::Normal(Batch { commands }),
        }
    }

    fn one_write(txid: u64, alloc_term: u64, key: &str) -> Command {
        Command::BeginAndDecide {
            txid,
            alloc_term,
            idempotency_key: key.into(),
            fingerprint: [2; 32],
            begun_ms: 1,
            deadline_ms: 10_000,
            participants: vec![crate::sm::Enlistment {
                participant_id: "a".into(),
                address: "127.0.0.1:1".into(),
                payload: vec![],
            }],
            outcome: crate::sm::Outcome::Commit,
            voters: vec!["a".into()],
            acked: vec![],
            now_ms: 2,
            note: String::new(),
        }
    }

    /// A one-write COMMIT whose one participant acked with the decision
    /// (READ_ONLY), decided at `decided_ms`: decided and fully acked at
    /// once, so retained.
    fn done_write_at(txid: u64, key: &str, decided_ms: u64) -> Command {
        let mut c = one_write(txid, 1, key);
        if let Command::BeginAndDecide { acked, now_ms, .. } = &mut c {
            *acked = vec!["a".into()];
            *now_ms = decided_ms;
        }
        c
    }

    fn done_write(txid: u64, key: &str) -> Command {
        done_write_at(txid, key, 2)
    }

    /// What every reader learns of `txid` from `sm`: its outcome (the
    /// decision read, `GetDecision`), the txid its key belongs to, and
    /// whether the forget loop would take it.
    fn reads(sm: &StateMachineStore, txid: Txid, key: &str) -> (DecisionView, Option<Txid>, bool) {
        let st = sm.state();
        (
            st.with_txid(txid, |t| t.decision_view(txid)).unwrap(),
            st.txid_of_key(key).unwrap(),
            st.forgettable(u64::MAX, 100).unwrap().contains(&txid),
        )
    }

    /// ADR 0050 with invariants 1 and 10: a decided, fully acked record
    /// leaves memory (retained on disk only) and answers as before: its
    /// decision (write-once: a later ABORT reads the COMMIT back), its key
    /// (the same Begin finds it), the forget loop; before its writes reach
    /// the engine, after, and after a restart. Forgotten, it is gone from
    /// every read, its key is free and its txid is never handed out again.
    #[tokio::test]
    async fn retained_records_leave_memory_and_answer_every_read() {
        let (_dir, engine, mut sm) = fresh();
        let commit = DecisionView::Decided(crate::sm::Outcome::Commit);
        sm.apply(vec![entry(1, vec![Command::ReserveTxids { count: 10 }])])
            .await
            .unwrap();
        sm.apply(vec![entry(2, vec![done_write(1, "k1"), done_write(2, "k2")])])
            .await
            .unwrap();
        {
            let st = sm.state();
            assert_eq!((st.table.len(), st.retained_count, st.transactions()), (0, 2, 2));
            assert!(st.table.get(1).is_none(), "out of memory");
            let r = st.record(1).unwrap().expect("still read");
            assert_eq!(r.decision().map(|d| d.outcome), Some(crate::sm::Outcome::Commit));
        }
        // Still unwritten (pending): read from memory's unwritten writes.
        assert_eq!(reads(&sm, 1, "k1"), (commit.clone(), Some(1), true));
        // The same one-write commit again, and an ABORT of it: the record
        // and its decision stand (invariant 1).
        let out = sm
            .apply(vec![entry(
                3,
                vec![
                    done_write(1, "k1"),
                    Command::Decide {
                        txid: 1,
                        outcome: crate::sm::Outcome::Abort,
                        voters: vec![],
                        source: crate::sm::DecisionSource::Client,
                        term: 1,
                        now_ms: 5,
                        note: String::new(),
                    },
                ],
            )])
            .await
            .unwrap();
        match &out[0].results[1] {
            Ok(CommandOk::Decided { decision, recorded }) => {
                assert_eq!((decision.outcome, *recorded), (crate::sm::Outcome::Commit, false));
            }
            other => panic!("the retained decision must read back, got {other:?}"),
        }
        assert_eq!(sm.state().retained_count, 2, "read back, not retained twice");
        sm.write_pending().unwrap();
        assert_eq!(reads(&sm, 1, "k1"), (commit.clone(), Some(1), true));
        // A Begin with the key of a retained transaction finds it.
        let out = sm
            .apply(vec![entry(
                4,
                vec![Command::Begin {
                    idempotency_key: "k1".into(),
                    fingerprint: [2; 32],
                    now_ms: 6,
                    timeout_ms: 1_000,
                }],
            )])
            .await
            .unwrap();
        assert!(
            matches!(
                &out[0].results[0],
                Ok(CommandOk::Began {
                    txid: 1,
                    existing: true,
                    ..
                })
            ),
            "the key belongs to txid 1: {:?}",
            out[0].results[0]
        );
        // A restart loads nothing of them into memory and reads them all.
        drop(sm);
        let mut sm = StateMachineStore::open(engine.clone()).unwrap();
        {
            let st = sm.state();
            assert_eq!((st.table.len(), st.retained_count), (0, 2));
        }
        assert_eq!(reads(&sm, 1, "k1"), (commit.clone(), Some(1), true));
        assert_eq!(sm.state().with_txid(2, |t| t.decision_view(2)).unwrap(), commit);
        // Forgotten (invariant 10): gone from every read; the key begins a
        // new transaction with a new txid.
        sm.apply(vec![entry(5, vec![Command::Forget { txid: 1 }, begin("k1")])])
            .await
            .unwrap();
        assert_eq!(reads(&sm, 1, "k1").0, DecisionView::Unknown);
        let new = sm
            .state()
            .txid_of_key("k1")
            .unwrap()
            .expect("the new transaction's key");
        assert!(new > 10, "a txid never handed out before: {new}");
        assert_eq!(sm.state().retained_count, 1);
        sm.write_pending().unwrap();
        drop(sm);
        let sm = StateMachineStore::open(engine).unwrap();
        let st = sm.state();
        assert_eq!(
            (st.retained_count, st.table.len()),
            (1, 1),
            "txid 2 retained, the new Begin in memory"
        );
        assert!(st.record(1).unwrap().is_none());
        assert_eq!(st.forgettable(u64::MAX, 100).unwrap(), vec![2]);
        assert_eq!(st.all_txids().unwrap(), vec![2, new]);
    }

    /// ADR 0050: a snapshot carries the retained records; the node that
    /// installs it retains them in turn (none in its memory), and a data
    /// directory written before ADR 0050 (a done record kept in memory)
    /// retains it at its next start.
    #[tokio::test]
    async fn snapshots_carry_retained_records_and_old_directories_retain_theirs() {
        let (_dir, _engine, mut leader) = fresh();
        leader
            .apply(vec![entry(1, vec![Command::ReserveTxids { count: 10 }])])
            .await
            .unwrap();
        leader
            .apply(vec![entry(
                2,
                vec![done_write(1, "a"), done_write(2, "b"), one_write(3, 1, "c")],
            )])
            .await
            .unwrap();
        let snap = leader.build_snapshot().await.unwrap();
        let table = decode_snapshot_table(snap.snapshot.get_ref()).unwrap();
        assert_eq!(table.len(), 3, "every record is in the snapshot");
        let (_d2, engine2, mut follower) = fresh();
        follower.install_snapshot(&snap.meta, snap.snapshot).await.unwrap();
        {
            let st = follower.state();
            assert_eq!((st.table.len(), st.retained_count), (1, 2), "txid 3 awaits its ack");
            assert_eq!(st.txid_of_key("b").unwrap(), Some(2));
        }
        drop(follower);
        let follower = StateMachineStore::open(engine2).unwrap();
        assert_eq!(reads(&follower, 2, "b").1, Some(2));
        // An old directory: the done record under the key of a record in
        // memory.
        let (_d3, engine3, sm3) = fresh();
        drop(sm3);
        let mut b = WriteBatch::default();
        let old = table.get(1).unwrap().clone();
        b.put(record_key(1), codec::encode(&old).unwrap());
        // And a key of the first build's forget index, gone at start.
        let mut old_forget = b"f".to_vec();
        old_forget.extend_from_slice(&2u64.to_be_bytes());
        old_forget.extend_from_slice(&1u64.to_be_bytes());
        b.put(old_forget.clone(), Vec::new());
        engine3.write_batch(Space::StateMachine, b).unwrap();
        let sm3 = StateMachineStore::open(engine3.clone()).unwrap();
        assert_eq!((sm3.state().table.len(), sm3.state().retained_count), (0, 1));
        assert!(engine3.get(Space::StateMachine, &old_forget).unwrap().is_none());
        drop(sm3);
        assert!(engine3.get(Space::StateMachine, &record_key(1)).unwrap().is_none());
        let sm3 = StateMachineStore::open(engine3).unwrap();
        assert_eq!(sm3.state().record(1).unwrap().map(|r| r.into_owned()), Some(old));
    }

    /// ADR 0050: a snapshot reads the retained records without the state
    /// lock. While it reads, a forgotten record stays in the engine for it
    /// (marked, and gone for every other reader) and one retained since
    /// is left out of it: it holds exactly the records of its entry. The
    /// deletes put off are done after it, or at the next start after a
    /// stop in between.
    #[tokio::test]
    async fn a_snapshot_reads_the_retained_records_of_its_entry_while_applies_go_on() {
        let (_dir, engine, mut sm) = fresh();
        sm.apply(vec![entry(1, vec![Command::ReserveTxids { count: 10 }])])
            .await
            .unwrap();
        sm.apply(vec![entry(2, vec![done_write(1, "a"), done_write(2, "b")])])
            .await
            .unwrap();
        sm.write_pending().unwrap();
        // As `snapshot_now` leaves it between its two halves.
        *sm.snapshot_read.released_since() = Some(BTreeSet::new());
        sm.apply(vec![entry(3, vec![Command::Forget { txid: 1 }, done_write(3, "c")])])
            .await
            .unwrap();
        sm.write_pending().unwrap();
        {
            let st = sm.state();
            assert!(st.record(1).unwrap().is_none(), "forgotten for every reader");
            assert_eq!(st.txid_of_key("a").unwrap(), None);
            assert_eq!(st.all_txids().unwrap(), vec![2, 3]);
            assert_eq!(st.forgettable(u64::MAX, 10).unwrap(), vec![2, 3]);
            assert_eq!(st.retained_count, 2);
        }
        let read: Vec<Txid> = retained::read_all(&*engine)
            .unwrap()
            .iter()
            .map(|r| r.record.txid)
            .collect();
        assert_eq!(read, vec![1, 2, 3], "the engine still holds txid 1 for the snapshot");
        let since = sm.snapshot_read.released_since().take().unwrap();
        assert_eq!(since, BTreeSet::from([3]), "retained after the snapshot's entry");
        sm.finish_deletes().unwrap();
        sm.write_pending().unwrap();
        assert!(engine
            .get(Space::StateMachine, &retained::retained_key(1))
            .unwrap()
            .is_none());
        // A stop while a snapshot reads: the next start does the delete.
        *sm.snapshot_read.released_since() = Some(BTreeSet::new());
        sm.apply(vec![entry(4, vec![Command::Forget { txid: 2 }])])
            .await
            .unwrap();
        sm.write_pending().unwrap();
        assert!(engine
            .get(Space::StateMachine, &retained::retained_key(2))
            .unwrap()
            .is_some());
        std::mem::forget(sm);
        let sm = StateMachineStore::open(engine.clone()).unwrap();
        assert!(engine
            .get(Space::StateMachine, &retained::retained_key(2))
            .unwrap()
            .is_none());
        assert_eq!(sm.state().all_txids().unwrap(), vec![3]);
        // And the snapshot a build makes now holds exactly txid 3.
        let (_, bytes) = sm.snapshot_now().unwrap();
        let table = decode_snapshot_table(&bytes).unwrap();
        assert_eq!(table.records().map(|r| r.txid).collect::<Vec<_>>(), vec![3]);
    }

    /// An install replaces the state in several engine batches: a stop in
    /// the middle (its mark left, some keys of the old state deleted, some
    /// of the new written) is finished at the next start from the saved
    /// snapshot, so the node reads exactly the snapshot's state.
    #[tokio::test]
    async fn an_install_cut_short_by_a_stop_is_done_again_at_start() {
        let (_dir, _engine, mut leader) = fresh();
        leader
            .apply(vec![entry(1, vec![Command::ReserveTxids { count: 10 }])])
            .await
            .unwrap();
        leader
            .apply(vec![entry(2, vec![done_write(1, "a"), one_write(2, 1, "b")])])
            .await
            .unwrap();
        let snap = leader.build_snapshot().await.unwrap();
        let (_d2, engine2, follower) = fresh();
        drop(follower);
        // What a stop after the first batches leaves: the snapshot saved,
        // the mark, an old record still there and a new one half written.
        let mut saved = WriteBatch::default();
        saved.put(SNAPSHOT_META_KEY.to_vec(), codec::encode(&snap.meta).unwrap());
        saved.put(SNAPSHOT_DATA_KEY.to_vec(), snap.snapshot.get_ref().clone());
        saved.put(INSTALLING_KEY.to_vec(), codec::encode(&snap.meta.snapshot_id).unwrap());
        engine2.write_batch(Space::Snapshot, saved).unwrap();
        let mut old = WriteBatch::default();
        let mut stale = TxTable::new();
        stale.apply(&begin("old"), &mut Vec::new()).unwrap();
        old.put(record_key(1), codec::encode(stale.get(1).unwrap()).unwrap());
        old.put(retained::retained_key(7), vec![1, 2, 3]);
        engine2.write_batch(Space::StateMachine, old).unwrap();
        let follower = StateMachineStore::open(engine2.clone()).unwrap();
        assert!(engine2.get(Space::Snapshot, INSTALLING_KEY).unwrap().is_none());
        let st = follower.state();
        assert_eq!(st.all_txids().unwrap(), vec![1, 2]);
        assert_eq!((st.table.len(), st.retained_count), (1, 1));
        assert_eq!(st.txid_of_key("a").unwrap(), Some(1));
        assert_eq!(st.last_applied, snap.meta.last_log_id);
        assert_eq!(
            st.with_txid(1, |t| t.decision_view(1)).unwrap(),
            DecisionView::Decided(crate::sm::Outcome::Commit)
        );
    }

    /// Invariant 10's retention, for retained records (ADR 0050): the
    /// forget loop takes, by ascending txid, exactly those decided at or
    /// before the cutoff, passing over a low txid decided late rather than
    /// waiting behind it; and finds nothing when nothing is old enough.
    #[tokio::test]
    async fn the_forget_loop_takes_retained_records_past_the_cutoff_and_passes_over_late_ones() {
        let (_dir, _engine, mut sm) = fresh();
        let at = |txid: u64, decided_ms: u64| done_write_at(txid, &format!("k{txid}"), decided_ms);
        sm.apply(vec![entry(1, vec![Command::ReserveTxids { count: 10 }])])
            .await
            .unwrap();
        // txid 1 decided late (at 900), 2 to 5 early (100 to 400).
        sm.apply(vec![entry(
            2,
            vec![at(1, 900), at(2, 100), at(3, 200), at(4, 300), at(5, 400)],
        )])
        .await
        .unwrap();
        sm.write_pending().unwrap();
        let st = sm.state();
        assert_eq!(st.retained_count, 5);
        assert_eq!(st.forgettable(50, 10).unwrap(), Vec::<Txid>::new());
        assert_eq!(st.forgettable(250, 10).unwrap(), vec![2, 3]);
        assert_eq!(st.forgettable(400, 2).unwrap(), vec![2, 3], "at most max");
        assert_eq!(st.forgettable(1_000, 10).unwrap(), vec![1, 2, 3, 4, 5]);
    }

    /// The store hands each command the term of the log entry that carries
    /// it: a one-write commit whose txid was handed out in another term is
    /// recorded as ABORT (ADR 0012), and the reserved range survives a
    /// restart (txids are never handed out twice, invariant 10).
    #[tokio::test]
    async fn one_write_commits_are_held_to_their_entrys_term() {
        let (_dir, engine, mut sm) = fresh();
        sm.apply(vec![entry_in_term(3, 1, vec![Command::ReserveTxids { count: 10 }])])
            .await
            .unwrap();
        sm.apply(vec![
            entry_in_term(3, 2, vec![one_write(1, 3, "same-term")]),
            entry_in_term(4, 3, vec![one_write(2, 3, "older-term")]),
        ])
        .await
        .unwrap();
        drop(sm);
        let sm = StateMachineStore::open(engine).unwrap();
        let st = sm.state();
        let outcome = |t| st.table.get(t).and_then(|r| r.decision()).map(|d| d.outcome);
        assert_eq!(outcome(1), Some(crate::sm::Outcome::Commit));
        assert_eq!(outcome(2), Some(crate::sm::Outcome::Abort));
        assert_eq!(st.table.next_txid(), 11, "the reserved range stays reserved");
    }

    /// Retired node ids are persisted with the apply that records them, and
    /// are there after a restart (ids are never reused).
    #[tokio::test]
    async fn retired_node_ids_survive_a_restart() {
        let (_dir, engine, mut sm) = fresh();
        sm.apply(vec![entry(1, vec![Command::RetireNodeId { node_id: 4 }])])
            .await
            .unwrap();
        sm.apply(vec![entry(2, vec![Command::RetireNodeId { node_id: 2 }])])
            .await
            .unwrap();
        drop(sm);
        let sm = StateMachineStore::open(engine).unwrap();
        let st = sm.state();
        assert_eq!(st.table.retired_node_ids(), &BTreeSet::from([2, 4]));
        assert_eq!(st.last_applied.map(|l| l.index), Some(2));
    }

    /// The state machine's writes wait in memory (`PendingWrites`). A node
    /// killed before they are stored reopens at an older stored state, never
    /// a mix; applying the log's entries after its last-applied id again
    /// gives the state it had (invariant 10: the reserved txid range is not
    /// handed out twice). A snapshot stores what is pending first, so the
    /// stored state is never behind a snapshot the log may be purged to.
    #[tokio::test]
    async fn a_crash_before_the_pending_writes_loses_nothing_the_log_cannot_apply_again() {
        let (_dir, engine, mut sm) = fresh();
        let entries = vec![
            entry_in_term(1, 1, vec![Command::ReserveTxids { count: 10 }]),
            entry_in_term(1, 2, vec![one_write(1, 1, "k1")]),
            entry_in_term(1, 3, vec![one_write(2, 1, "k2"), Command::RetireNodeId { node_id: 7 }]),
        ];
        sm.apply(entries.clone()).await.unwrap();
        let want = {
            let st = sm.state();
            (st.table.next_txid(), st.table.len(), st.last_applied)
        };
        assert_eq!(want.1, 2);
        // kill -9: no drop, nothing written.
        std::mem::forget(sm);
        let mut sm = StateMachineStore::open(engine.clone()).unwrap();
        {
            let st = sm.state();
            assert_eq!(st.last_applied, None, "the writes were still pending");
            assert_eq!(st.table.len(), 0);
        }
        // openraft applies the entries after the stored last-applied id.
        sm.apply(entries).await.unwrap();
        {
            let st = sm.state();
            assert_eq!((st.table.next_txid(), st.table.len(), st.last_applied), want);
            assert!(st.table.retired_node_ids().contains(&7));
        }
        // A snapshot stores the pending writes before it is taken.
        let snap = sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
        assert_eq!(snap.meta.last_log_id, want.2);
        std::mem::forget(sm);
        let sm = StateMachineStore::open(engine).unwrap();
        let st = sm.state();
        assert_eq!((st.table.next_txid(), st.table.len(), st.last_applied), want);
    }

    /// An engine whose state-machine batches fail once `fail` is set (the
    /// writer thread's failure path); everything else goes through.
    struct FailingWrites {
        inner: Arc<dyn KvEngine>,
        fail: std::sync::atomic::AtomicBool,
    }

    impl KvEngine for FailingWrites {
        fn get(&self, space: Space, key: &[u8]) -> Result<Option<Vec<u8>>, EngineError> {
            self.inner.get(space, key)
        }
        fn write_batch(&self, space: Space, batch: WriteBatch) -> Result<(), EngineError> {
            if space == Space::StateMachine && self.fail.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(EngineError::Io {
                    space: "sm",
                    message: "injected write failure".into(),
                });
            }
            self.inner.write_batch(space, batch)
        }
        fn scan(&self, space: Space, from: &[u8], to: Option<&[u8]>) -> Result<Vec<KvPair>, EngineError> {
            self.inner.scan(space, from, to)
        }
        fn scan_prefix(&self, space: Space, prefix: &[u8]) -> Result<Vec<KvPair>, EngineError> {
            self.inner.scan_prefix(space, prefix)
        }
        fn first(&self, space: Space) -> Result<Option<KvPair>, EngineError> {
            self.inner.first(space)
        }
        fn last(&self, space: Space) -> Result<Option<KvPair>, EngineError> {
            self.inner.last(space)
        }
        fn delete_range(&self, space: Space, from: &[u8], to: Option<&[u8]>) -> Result<(), EngineError> {
            self.inner.delete_range(space, from, to)
        }
        fn flush(&self) -> Result<(), EngineError> {
            self.inner.flush()
        }
    }

    /// A batch the writer thread cannot store is not lost in silence: the
    /// next apply that hands writes over, and every barrier, fail with the
    /// engine's words (openraft then stops the node; the log still holds
    /// the entries), and nothing after it is written over the gap.
    #[tokio::test]
    async fn a_write_the_writer_thread_could_not_do_fails_later_applies() {
        let dir = tempfile::tempdir().unwrap();
        let inner = crate::store::open_data_dir(dir.path(), "c", 1).unwrap();
        let engine = Arc::new(FailingWrites {
            inner: inner.clone(),
            fail: false.into(),
        });
        let mut sm = StateMachineStore::open(engine.clone()).unwrap();
        sm.apply(vec![entry(1, vec![Command::RetireNodeId { node_id: 1 }])])
            .await
            .unwrap();
        sm.write_pending().unwrap();
        engine.fail.store(true, std::sync::atomic::Ordering::SeqCst);
        sm.apply(vec![entry(2, vec![Command::RetireNodeId { node_id: 2 }])])
            .await
            .unwrap();
        let err = sm.write_pending().unwrap_err().to_string();
        assert!(err.contains("injected write failure"), "{err}");
        // Even with the engine well again, the gap stays reported.
        engine.fail.store(false, std::sync::atomic::Ordering::SeqCst);
        let mut later = Vec::new();
        for i in 3..3 + SM_PENDING_ENTRIES_MAX {
            later.push(entry(i, vec![Command::RetireNodeId { node_id: i }]));
        }
        let err = sm.apply(later).await.unwrap_err().to_string();
        assert!(err.contains("injected write failure"), "{err}");
        std::mem::forget(sm);
        let stored = StateMachineStore::open(inner).unwrap();
        assert_eq!(stored.state().last_applied.map(|l| l.index), Some(1));
    }

    /// Writes wait for at most `SM_PENDING_ENTRIES_MAX` applied entries.
    #[tokio::test]
    async fn pending_writes_are_stored_after_enough_entries() {
        let (_dir, engine, mut sm) = fresh();
        for i in 1..=SM_PENDING_ENTRIES_MAX {
            // Never old enough to be due by age (a slow debug build on a
            // busy machine takes more than SM_PENDING_AGE_MAX_MS for the
            // loop): only the count may make them due here.
            if sm.pending().since.is_some() {
                sm.pending().since = Some(std::time::Instant::now());
            }
            sm.apply(vec![entry(i, vec![Command::RetireNodeId { node_id: i }])])
                .await
                .unwrap();
        }
        // Handed to the writer thread by the last apply, not written
        // pending: the barrier adds nothing of its own.
        assert!(sm.pending().ops.is_empty());
        sm.written().unwrap();
        std::mem::forget(sm);
        let sm = StateMachineStore::open(engine).unwrap();
        assert_eq!(sm.state().last_applied.map(|l| l.index), Some(SM_PENDING_ENTRIES_MAX));
    }

    /// A node that catches up by snapshot learns the retired ids too, and
    /// keeps them across its own restart.
    #[tokio::test]
    async fn snapshots_carry_retired_node_ids() {
        let (_d1, _e1, mut leader) = fresh();
        leader
            .apply(vec![entry(
                1,
                vec![
                    Command::RetireNodeId { node_id: 3 },
                    Command::Begin {
                        idempotency_key: "k".into(),
                        fingerprint: [1; 32],
                        now_ms: 1,
                        timeout_ms: 1_000,
                    },
                ],
            )])
            .await
            .unwrap();
        let snap = leader.build_snapshot().await.unwrap();
        let (_d2, e2, mut follower) = fresh();
        follower.install_snapshot(&snap.meta, snap.snapshot).await.unwrap();
        assert!(follower.state().table.is_retired_node_id(3));
        assert_eq!(follower.state().table.len(), 1);
        drop(follower);
        let reopened = StateMachineStore::open(e2).unwrap();
        assert!(reopened.state().table.is_retired_node_id(3));
    }

    fn begin(key: &str) -> Command {
        Command::Begin {
            idempotency_key: key.into(),
            fingerprint: [1; 32],
            now_ms: 1,
            timeout_ms: 1_000,
        }
    }

    /// Invariant 10 across restores (ADR 0033): the incarnation a leader
    /// opens is persisted, carried by snapshots and backups, and names the
    /// txids handed out from then on; a snapshot made for a restore ends it
    /// where the backup's txids end, so the old cluster's later txids are
    /// another incarnation's; the restored cluster's next incarnation
    /// starts there.
    #[tokio::test]
    async fn inv10_incarnations_survive_restarts_snapshots_and_end_at_a_restore() {
        let (_d1, e1, mut sm) = fresh();
        sm.apply(vec![entry(1, vec![begin("before")])]).await.unwrap();
        let out = sm
            .apply(vec![entry(
                2,
                vec![
                    Command::OpenIncarnation { incarnation: 0xa1 },
                    Command::OpenIncarnation { incarnation: 0xb2 },
                    Command::OpenIncarnation { incarnation: 0 },
                ],
            )])
            .await
            .unwrap();
        assert_eq!(
            out[0].results[0],
            Ok(CommandOk::IncarnationOpened {
                incarnation: 0xa1,
                newly: true
            })
        );
        assert_eq!(
            out[0].results[1],
            Ok(CommandOk::IncarnationOpened {
                incarnation: 0xa1,
                newly: false
            }),
            "a second leader's attempt finds the first"
        );
        assert_eq!(
            out[0].results[2],
            Ok(CommandOk::IncarnationOpened {
                incarnation: 0xa1,
                newly: false
            })
        );
        sm.apply(vec![entry(3, vec![begin("after")])]).await.unwrap();
        sm.write_pending().unwrap();
        drop(sm);
        let mut sm = StateMachineStore::open(e1).unwrap();
        {
            let st = sm.state();
            assert_eq!(st.incarnations.current(), Some(0xa1));
            assert_eq!(st.incarnations.of_txid(1), Some(0), "begun before any incarnation");
            assert_eq!(st.incarnations.of_txid(2), Some(0xa1));
        }
        let snap = sm.build_snapshot().await.unwrap();
        let bytes = snap.snapshot.into_inner();
        let (_d2, _e2, mut follower) = fresh();
        follower
            .install_snapshot(&snap.meta, Box::new(Cursor::new(bytes.clone())))
            .await
            .unwrap();
        assert_eq!(follower.state().incarnations, sm.state().incarnations);

        // A restore ends 0xa1 at the backup's next txid (3) and raises the
        // next txid as asked.
        let restored = snapshot_for_restore(&bytes, 10).unwrap();
        let (_d3, e3, mut r) = fresh();
        r.install_snapshot(&snap.meta, Box::new(Cursor::new(restored)))
            .await
            .unwrap();
        {
            let st = r.state();
            assert_eq!(st.incarnations.current(), None, "the restored cluster opens its own");
            assert_eq!(st.incarnations.of_txid(2), Some(0xa1), "in the backup");
            assert_eq!(st.incarnations.of_txid(3), None, "the old cluster's after the backup");
            assert_eq!(st.table.next_txid(), 10);
        }
        let out = r
            .apply(vec![entry(
                9,
                vec![
                    Command::OpenIncarnation { incarnation: 0xa1 },
                    Command::OpenIncarnation { incarnation: 0xc3 },
                ],
            )])
            .await
            .unwrap();
        assert!(
            out[0].results[0].is_err(),
            "an incarnation of the history is never opened again"
        );
        r.apply(vec![entry(10, vec![begin("restored")])]).await.unwrap();
        r.write_pending().unwrap();
        drop(r);
        let r = StateMachineStore::open(e3).unwrap();
        {
            let st = r.state();
            assert_eq!(st.incarnations.current(), Some(0xc3));
            assert_eq!(st.incarnations.of_txid(10), Some(0xc3));
            assert_eq!(st.incarnations.of_txid(2), Some(0xa1));
            assert_eq!(
                st.incarnations.belonging(0xa1, 10),
                crate::sm::incarnation::Belonging::Other,
                "txid 10 of the old cluster is not the restored cluster's txid 10"
            );
        }
    }

    /// ADR 0040 (invariants 1, 5 and 10): an operator's settlement of
    /// another incarnation's txid is applied beside the table (refusals
    /// and write-once as `Settlements::settle`), persisted with its apply,
    /// there after a restart, carried by snapshots and by the re-encoding a
    /// restore makes of a backup.
    #[tokio::test]
    async fn invariant_5_settlements_survive_restarts_snapshots_and_restores() {
        use crate::sm::Outcome;
        use crate::sm::SettlementRefusal;
        let settle = |incarnation: u64, txid: Txid, outcome: Outcome, note: &str| Command::SettleOther {
            incarnation,
            txid,
            outcome,
            term: 4,
            now_ms: 99,
            note: note.into(),
        };
        let (_d1, e1, mut sm) = fresh();
        // 0xa1 handed out txid 1 here, then a restore ended it at 2 (the
        // old cluster went on with 2, 3, ...).
        sm.apply(vec![entry(
            1,
            vec![Command::OpenIncarnation { incarnation: 0xa1 }, begin("k")],
        )])
        .await
        .unwrap();
        sm.state.write().unwrap().incarnations.close(2, 1);
        let out = sm
            .apply(vec![entry(
                2,
                vec![
                    settle(0xa1, 5, Outcome::Abort, "operator o: bank-b alone, held never voted"),
                    settle(0xa1, 5, Outcome::Commit, "operator p: conflicting"),
                    settle(0xa1, 1, Outcome::Commit, "operator o: own"),
                    settle(0, 5, Outcome::Commit, "operator o: zero"),
                    settle(0xbb, 1, Outcome::Commit, "operator o: another cluster's 1"),
                ],
            )])
            .await
            .unwrap();
        let first = crate::sm::Settlement {
            outcome: Outcome::Abort,
            note: "operator o: bank-b alone, held never voted".into(),
            settled_ms: 99,
            term: 4,
        };
        assert_eq!(
            out[0].results[0],
            Ok(CommandOk::Settled {
                settlement: first.clone(),
                recorded: true
            })
        );
        assert_eq!(
            out[0].results[1],
            Ok(CommandOk::Settled {
                settlement: first.clone(),
                recorded: false
            }),
            "write-once: the conflicting one reads the first back"
        );
        assert!(matches!(
            out[0].results[2],
            Err(CommandError::SettlementRefused(SettlementRefusal::OwnTxid { .. }))
        ));
        assert!(matches!(
            out[0].results[3],
            Err(CommandError::SettlementRefused(
                SettlementRefusal::IncarnationZero { .. }
            ))
        ));
        assert!(matches!(
            out[0].results[4],
            Ok(CommandOk::Settled { recorded: true, .. })
        ));
        assert_eq!(
            sm.state().table.len(),
            1,
            "the table is untouched: txid 1 is still its own record"
        );
        let check = |sm: &StateMachineStore, what: &str| {
            let st = sm.state();
            assert_eq!(st.settlements.get(0xa1, 5), Some(&first), "{what}");
            assert_eq!(
                st.settlements.get(0xbb, 1).map(|s| s.outcome),
                Some(Outcome::Commit),
                "{what}"
            );
            assert_eq!(st.settlements.len(), 2, "{what}");
        };
        check(&sm, "applied");
        sm.write_pending().unwrap();
        drop(sm);
        let mut sm = StateMachineStore::open(e1).unwrap();
        check(&sm, "reopened");

        let snap = sm.build_snapshot().await.unwrap();
        let bytes = snap.snapshot.into_inner();
        let (_d2, e2, mut follower) = fresh();
        follower
            .install_snapshot(&snap.meta, Box::new(Cursor::new(bytes.clone())))
            .await
            .unwrap();
        check(&follower, "installed");
        drop(follower);
        check(&StateMachineStore::open(e2).unwrap(), "installed and reopened");
        assert_eq!(
            decode_snapshot_settlements(&bytes).unwrap().len(),
            2,
            "a backup's bytes"
        );

        // A restore of a backup with them keeps them.
        let restored = snapshot_for_restore(&bytes, 0).unwrap();
        let (_d3, _e3, mut r) = fresh();
        r.install_snapshot(&snap.meta, Box::new(Cursor::new(restored)))
            .await
            .unwrap();
        check(&r, "restored");
    }

    fn begin_as(caller: &str, key: &str) -> Command {
        Command::As {
            caller: caller.into(),
            command: Box::new(Command::Begin {
                idempotency_key: key.into(),
                fingerprint: [1; 32],
                now_ms: 1,
                timeout_ms: 1_000,
            }),
        }
    }

    /// The owner of a transaction begun on behalf of an application is
    /// persisted with the record, carried by snapshots, and removed with
    /// the record.
    #[tokio::test]
    async fn owners_survive_restarts_and_snapshots_and_go_with_their_record() {
        let (_d1, e1, mut leader) = fresh();
        leader
            .apply(vec![entry(1, vec![begin_as("shop", "k1"), begin_as("billing", "k2")])])
            .await
            .unwrap();
        // The same key again on behalf of another application: the record
        // and its owner stay as they were.
        leader
            .apply(vec![entry(2, vec![begin_as("mallory", "k1")])])
            .await
            .unwrap();
        let snap = leader.build_snapshot().await.unwrap();
        drop(leader);
        let leader = StateMachineStore::open(e1.clone()).unwrap();
        assert_eq!(leader.state().table.owner(1), Some("shop"));
        assert_eq!(leader.state().table.owner(2), Some("billing"));

        let (_d2, e2, mut follower) = fresh();
        follower.install_snapshot(&snap.meta, snap.snapshot).await.unwrap();
        assert_eq!(follower.state().table.owner(1), Some("shop"));
        drop(follower);
        let mut follower = StateMachineStore::open(e2.clone()).unwrap();
        assert_eq!(follower.state().table.owner(2), Some("billing"));

        // Decided, acked (no participants) and forgotten: the owner goes.
        let decide = Command::Decide {
            txid: 1,
            outcome: crate::sm::Outcome::Abort,
            voters: vec![],
            source: crate::sm::DecisionSource::Client,
            term: 1,
            now_ms: 2,
            note: String::new(),
        };
        follower
            .apply(vec![entry(3, vec![decide, Command::Forget { txid: 1 }])])
            .await
            .unwrap();
        assert_eq!(follower.state().table.owner(1), None);
        drop(follower);
        let reopened = StateMachineStore::open(e2.clone()).unwrap();
        assert_eq!(reopened.state().table.owner(1), None);
        assert!(e2.get(Space::StateMachine, &owner_key(1)).unwrap().is_none());
        assert_eq!(reopened.state().table.owner(2), Some("billing"));
    }

    fn enlist(txid: Txid, id: &str) -> Command {
        Command::Enlist {
            txid,
            participant_id: id.into(),
            address: format!("127.0.0.1:{}", 9000 + txid),
            payload: vec![],
        }
    }

    fn abort(txid: Txid) -> Command {
        Command::Decide {
            txid,
            outcome: crate::sm::Outcome::Abort,
            voters: vec![],
            source: crate::sm::DecisionSource::Client,
            term: 1,
            now_ms: 2,
            note: String::new(),
        }
    }

    fn drop_b(txid: Txid, note: &str) -> Command {
        Command::DropParticipant {
            txid,
            participant_id: "b".into(),
            note: note.into(),
            now_ms: 7,
        }
    }

    /// Two aborted transactions with participants a and b: in the first a
    /// acked and b is dropped, in the second only b is dropped (a is still
    /// owed phase two).
    async fn two_with_drops(sm: &mut StateMachineStore) {
        let begin = |key: &str| Command::Begin {
            idempotency_key: key.into(),
            fingerprint: [1; 32],
            now_ms: 1,
            timeout_ms: 1_000,
        };
        sm.apply(vec![entry(
            1,
            vec![
                begin("k1"),
                enlist(1, "a"),
                enlist(1, "b"),
                begin("k2"),
                enlist(2, "a"),
                enlist(2, "b"),
            ],
        )])
        .await
        .unwrap();
        let acked_a = Command::Ack {
            txid: 1,
            participant_id: "a".into(),
        };
        sm.apply(vec![entry(
            2,
            vec![
                abort(1),
                abort(2),
                acked_a,
                drop_b(1, "operator o: one"),
                drop_b(2, "operator o: two"),
            ],
        )])
        .await
        .unwrap();
    }

    /// Branch registrations and fences (ADR 0046) are persisted with the
    /// apply that records them, carried by snapshots, there after a
    /// restart (a fenced branch stays fenced, a registered vote stays
    /// counted), and removed with their record (invariant 10).
    #[tokio::test]
    async fn invariant_10_branches_survive_restarts_and_snapshots_and_go_with_their_record() {
        use crate::sm::BranchVote;
        let (_d1, e1, mut leader) = fresh();
        let begin = |key: &str| Command::Begin {
            idempotency_key: key.into(),
            fingerprint: [1; 32],
            now_ms: 1,
            timeout_ms: 1_000,
        };
        let register = |txid: Txid, id: &str, vote: BranchVote| Command::RegisterBranch {
            txid,
            participant_id: id.into(),
            address: "127.0.0.1:7000".into(),
            vote,
            reason: String::new(),
            now_ms: 2,
        };
        leader
            .apply(vec![entry(
                1,
                vec![
                    begin("k1"),
                    register(1, "pay", BranchVote::Yes),
                    Command::ExcludeBranch {
                        txid: 1,
                        participant_id: "stock".into(),
                    },
                    begin("k2"),
                    register(2, "pay", BranchVote::ReadOnly),
                ],
            )])
            .await
            .unwrap();
        let check = |sm: &StateMachineStore, what: &str| {
            let st = sm.state();
            assert_eq!(st.table.registered_vote(1, "pay"), Some(BranchVote::Yes), "{what}");
            assert!(st.table.is_fenced(1, "stock"), "{what}");
            assert_eq!(st.table.registered_vote(2, "pay"), Some(BranchVote::ReadOnly), "{what}");
        };
        check(&leader, "applied");
        let snap = leader.build_snapshot().await.unwrap();
        drop(leader);
        let leader = StateMachineStore::open(e1).unwrap();
        check(&leader, "reopened");
        let (_d2, e2, mut follower) = fresh();
        follower.install_snapshot(&snap.meta, snap.snapshot).await.unwrap();
        check(&follower, "installed");
        // Transaction 2 decided, acked and forgotten: its branches go.
        let decide = Command::Decide {
            txid: 2,
            outcome: crate::sm::Outcome::Commit,
            voters: vec!["pay".into()],
            source: crate::sm::DecisionSource::Driver,
            term: 1,
            now_ms: 3,
            note: String::new(),
        };
        let ack = Command::Ack {
            txid: 2,
            participant_id: "pay".into(),
        };
        follower
            .apply(vec![entry(2, vec![decide, ack, Command::Forget { txid: 2 }])])
            .await
            .unwrap();
        follower.write_pending().unwrap();
        assert!(e2.get(Space::StateMachine, &branches_key(2)).unwrap().is_none());
        assert!(e2.get(Space::StateMachine, &branches_key(1)).unwrap().is_some());
        drop(follower);
        let reopened = StateMachineStore::open(e2).unwrap();
        let st = reopened.state();
        assert!(st.table.branches_of(2).is_none());
        assert!(st.table.is_fenced(1, "stock"));
    }

    /// The participants an operator dropped are persisted with
    /// the apply that records them, carried by snapshots, there after a
    /// restart (so a dropped participant is still owed no delivery, and the
    /// record still awaits an operator), and removed with their record.
    #[tokio::test]
    async fn invariant_10_drops_survive_restarts_and_snapshots_and_go_with_their_record() {
        let (_d1, e1, mut leader) = fresh();
        two_with_drops(&mut leader).await;
        let check = |sm: &StateMachineStore, what: &str| {
            let st = sm.state();
            assert_eq!(
                st.table.drop_of(1, "b").map(|d| (d.note.as_str(), d.dropped_ms)),
                Some(("operator o: one", 7)),
                "{what}"
            );
            assert!(st.table.needs_reconciliation(1), "{what}");
            assert!(st.table.is_dropped(2, "b"), "{what}");
            assert_eq!(
                st.table.undelivered(10),
                vec![2],
                "{what}: only 2 still owes a delivery (to a)"
            );
            assert_eq!(st.table.forgettable(u64::MAX, 10), Vec::<Txid>::new(), "{what}");
        };
        check(&leader, "applied");
        let snap = leader.build_snapshot().await.unwrap();
        drop(leader);
        let leader = StateMachineStore::open(e1).unwrap();
        check(&leader, "reopened");

        let (_d2, e2, mut follower) = fresh();
        follower.install_snapshot(&snap.meta, snap.snapshot).await.unwrap();
        check(&follower, "installed");
        drop(follower);
        let mut follower = StateMachineStore::open(e2.clone()).unwrap();
        check(&follower, "installed and reopened");

        // Forgotten by an operator (an ABORT): the drops go with it; the
        // txid stays used.
        let forget = Command::ForgetByOperator {
            txid: 1,
            note: "operator o: reconciled".into(),
        };
        let out = follower.apply(vec![entry(3, vec![forget])]).await.unwrap();
        assert_eq!(
            out[0].results,
            vec![Ok(CommandOk::ForgottenByOperator {
                outcome: Some(crate::sm::Outcome::Abort)
            })]
        );
        assert!(follower.state().table.dropped(1).is_none());
        follower.write_pending().unwrap();
        assert!(e2.get(Space::StateMachine, &drops_key(1)).unwrap().is_none());
        assert!(e2.get(Space::StateMachine, &drops_key(2)).unwrap().is_some());
        drop(follower);
        let reopened = StateMachineStore::open(e2).unwrap();
        let st = reopened.state();
        assert!(st.table.get(1).is_none() && st.table.dropped(1).is_none());
        assert!(st.table.is_dropped(2, "b"));
        assert_eq!(st.table.next_txid(), 3, "a forgotten txid is never handed out again");
    }

    /// Sagas: the journal is persisted with the apply that
    /// writes it and is there after re-opening the store from its engine; a
    /// snapshot carries definitions, journals and the next saga id (build,
    /// install, re-open).
    #[tokio::test]
    async fn sagas_survive_restarts_and_snapshots() {
        use crate::sm::saga::CallOutcome;
        use crate::sm::saga::JournalEvent;
        use crate::sm::saga::Reply;
        use crate::sm::saga::RetryPolicy;
        use crate::sm::saga::SagaCommand;
        use crate::sm::saga::SagaError;
        use crate::sm::saga::SagaOk;
        use crate::sm::saga::SagaState;
        use crate::sm::saga::StepDef;
        use crate::sm::saga::StepKind;

        let step = |name: &str, kind: StepKind| StepDef {
            name: name.into(),
            kind,
            service: "127.0.0.1:7000".into(),
            action: format!("do_{name}"),
            compensation: (kind == StepKind::Compensable).then(|| format!("undo_{name}")),
            status_query: format!("status_{name}"),
            versioned: true,
            retry: RetryPolicy::default(),
            on_failure: vec![],
            high_impact: false,
            completion_timeout_ms: 0,
        };
        let def = Definition {
            name: "shop".into(),
            version: 1,
            steps: vec![
                step("reserve", StepKind::Compensable),
                step("charge", StepKind::Pivot),
                step("ship", StepKind::Retriable),
            ],
        };
        let start = |key: &str| {
            Command::Saga(SagaCommand::Start {
                idempotency_key: key.into(),
                fingerprint: [3; 32],
                definition: "shop".into(),
                version: 1,
                input: b"order".to_vec(),
                authorization: Default::default(),
                owner: Some("shop-app".into()),
                now_ms: 5,
                deadline_ms: 0,
            })
        };
        let journal = |saga_id: SagaId, seq: u64, event: JournalEvent| {
            Command::Saga(SagaCommand::Journal {
                saga_id,
                seq,
                now_ms: 10 + seq,
                event,
            })
        };
        let started = |saga_id: SagaId, created: bool| Ok(CommandOk::Saga(SagaOk::Started { saga_id, created }));

        let (_d1, e1, mut leader) = fresh();
        let out = leader
            .apply(vec![entry(
                1,
                vec![
                    Command::Saga(SagaCommand::Register {
                        definition: def.clone(),
                    }),
                    start("a"),
                    start("b"),
                    Command::Begin {
                        idempotency_key: "tx".into(),
                        fingerprint: [1; 32],
                        now_ms: 1,
                        timeout_ms: 1_000,
                    },
                ],
            )])
            .await
            .unwrap();
        assert_eq!(
            out[0].results[..3],
            [
                Ok(CommandOk::Saga(SagaOk::Registered { created: true })),
                started(1, true),
                started(2, true)
            ]
        );
        let mut ok = Reply::of(CallOutcome::Ok, "reserved");
        ok.resource_version = "v1".into();
        let out = leader
            .apply(vec![entry(
                2,
                vec![
                    journal(1, 0, JournalEvent::ForwardIntent { step: 0 }),
                    journal(1, 1, JournalEvent::ForwardOutcome { step: 0, reply: ok }),
                    journal(2, 0, JournalEvent::ForwardIntent { step: 0 }),
                    // Planned on a journal that has moved on: refused.
                    journal(2, 0, JournalEvent::ForwardIntent { step: 0 }),
                ],
            )])
            .await
            .unwrap();
        assert_eq!(
            out[0].results[1],
            Ok(CommandOk::Saga(SagaOk::Journaled {
                seq: 2,
                state: SagaState::Running
            }))
        );
        assert!(matches!(
            out[0].results[3],
            Err(CommandError::Saga(SagaError::StaleJournal {
                saga_id: 2,
                planned: 0,
                actual: 1
            }))
        ));
        let check = |sm: &StateMachineStore, what: &str| {
            let st = sm.state();
            let s = &st.sagas;
            assert_eq!(s.definition("shop", 1), Some(&def), "{what}");
            let a = s.get(1).expect(what);
            assert_eq!((a.seq, a.current, a.state), (2, 1, SagaState::Running), "{what}");
            assert_eq!(a.steps[0].precondition, "v1", "{what}");
            let f = a.steps[0].forward.as_ref().expect(what);
            assert_eq!(
                (f.operation_id.as_str(), f.outcome()),
                ("1.0.f1", CallOutcome::Ok),
                "{what}"
            );
            assert_eq!(a.owner.as_deref(), Some("shop-app"), "{what}");
            let b = s.get(2).expect(what);
            assert_eq!(b.seq, 1, "{what}: the refused write changed nothing");
            assert_eq!(
                b.steps[0].forward.as_ref().map(|c| (c.attempts, c.outcome())),
                Some((1, CallOutcome::Intended)),
                "{what}"
            );
            assert_eq!(st.table.len(), 1, "{what}: the transaction table is beside it");
        };
        check(&leader, "applied");
        let applied = leader.state().sagas.clone();
        drop(leader);
        let mut leader = StateMachineStore::open(e1.clone()).unwrap();
        check(&leader, "reopened");
        assert_eq!(leader.state().sagas, applied);
        // The next saga id and the idempotency keys survived too.
        let out = leader
            .apply(vec![entry(3, vec![start("c"), start("a")])])
            .await
            .unwrap();
        assert_eq!(out[0].results, vec![started(3, true), started(1, false)]);

        // A snapshot with sagas: built, installed, re-opened.
        let snap = leader.build_snapshot().await.unwrap();
        let snapped = leader.state().sagas.clone();
        assert_eq!(snapped.sagas().count(), 3);
        let (_d2, e2, mut follower) = fresh();
        follower.install_snapshot(&snap.meta, snap.snapshot).await.unwrap();
        check(&follower, "installed");
        assert_eq!(follower.state().sagas, snapped);
        drop(follower);
        let mut follower = StateMachineStore::open(e2.clone()).unwrap();
        check(&follower, "installed and reopened");
        assert_eq!(follower.state().sagas, snapped);
        // The follower goes on from the same journal.
        let out = follower
            .apply(vec![entry(
                4,
                vec![journal(1, 2, JournalEvent::ForwardIntent { step: 1 })],
            )])
            .await
            .unwrap();
        assert_eq!(
            out[0].results,
            vec![Ok(CommandOk::Saga(SagaOk::Journaled {
                seq: 3,
                state: SagaState::Running
            }))]
        );
    }

    /// The count of failed status queries of a saga
    /// (`JournalEvent::QueryFailed`) is kept beside its record (`q<id>`):
    /// it survives a restart and a snapshot, and its key goes when another
    /// write resets it.
    #[tokio::test]
    async fn query_failure_counts_survive_restarts_and_snapshots() {
        use crate::sm::saga::CallOutcome;
        use crate::sm::saga::JournalEvent;
        use crate::sm::saga::Reply;
        use crate::sm::saga::RetryPolicy;
        use crate::sm::saga::SagaCommand;
        use crate::sm::saga::StepDef;
        use crate::sm::saga::StepKind;

        let def = Definition {
            name: "pay".into(),
            version: 1,
            steps: vec![StepDef {
                name: "charge".into(),
                kind: StepKind::Pivot,
                service: "127.0.0.1:7000".into(),
                action: "charge".into(),
                compensation: None,
                status_query: "charge_status".into(),
                versioned: false,
                retry: RetryPolicy::default(),
                on_failure: vec![],
                high_impact: false,
                completion_timeout_ms: 0,
            }],
        };
        let journal = |seq: u64, event: JournalEvent| {
            Command::Saga(SagaCommand::Journal {
                saga_id: 1,
                seq,
                now_ms: 10 + seq,
                event,
            })
        };
        let failed = |seq: u64| {
            journal(
                seq,
                JournalEvent::QueryFailed {
                    step: 0,
                    error: "unavailable".into(),
                },
            )
        };
        let (_d1, e1, mut sm) = fresh();
        sm.apply(vec![entry(
            1,
            vec![
                Command::Saga(SagaCommand::Register { definition: def }),
                Command::Saga(SagaCommand::Start {
                    idempotency_key: "k".into(),
                    fingerprint: [1; 32],
                    definition: "pay".into(),
                    version: 1,
                    input: vec![],
                    authorization: Default::default(),
                    owner: None,
                    now_ms: 5,
                    deadline_ms: 0,
                }),
                journal(0, JournalEvent::ForwardIntent { step: 0 }),
                journal(
                    1,
                    JournalEvent::ForwardOutcome {
                        step: 0,
                        reply: Reply::of(CallOutcome::Unknown, "no answer"),
                    },
                ),
                failed(2),
                failed(3),
                failed(4),
            ],
        )])
        .await
        .unwrap();
        assert_eq!(sm.state().sagas.query_failures(1), 3);
        drop(sm);
        let mut sm = StateMachineStore::open(e1.clone()).unwrap();
        assert_eq!(sm.state().sagas.query_failures(1), 3, "reopened");

        // A snapshot carries it.
        let snap = sm.build_snapshot().await.unwrap();
        let (_d2, e2, mut follower) = fresh();
        follower.install_snapshot(&snap.meta, snap.snapshot).await.unwrap();
        assert_eq!(follower.state().sagas.query_failures(1), 3, "installed");
        drop(follower);
        let follower = StateMachineStore::open(e2.clone()).unwrap();
        assert_eq!(follower.state().sagas.query_failures(1), 3, "installed and reopened");

        // Another write resets the count, and its key goes.
        assert!(e1.get(Space::StateMachine, &query_failures_key(1)).unwrap().is_some());
        sm.apply(vec![entry(
            2,
            vec![journal(
                5,
                JournalEvent::ForwardOutcome {
                    step: 0,
                    reply: Reply::of(CallOutcome::Ok, "charged"),
                },
            )],
        )])
        .await
        .unwrap();
        assert_eq!(sm.state().sagas.query_failures(1), 0);
        sm.write_pending().unwrap();
        assert!(e1.get(Space::StateMachine, &query_failures_key(1)).unwrap().is_none());
    }
    /// docs/adr/0042-storage-engines.md: a state this build wrote reads
    /// back (records, metadata, the snapshot and its meta, in this build's
    /// format version); what a newer build wrote is refused, named, with
    /// the version found and the one this build reads, and nothing of it is
    /// installed.
    #[tokio::test]
    async fn this_versions_state_reads_back_and_a_newer_format_version_is_refused_by_name() {
        let (_d1, e1, mut sm) = fresh();
        sm.apply(vec![entry(1, vec![begin("k"), Command::RetireNodeId { node_id: 5 }])])
            .await
            .unwrap();
        let snap = sm.build_snapshot().await.unwrap();
        let bytes = snap.snapshot.into_inner();
        assert_eq!(bytes[0], codec::FORMAT_VERSION);
        drop(sm);
        let mut sm = StateMachineStore::open(e1.clone()).unwrap();
        assert_eq!(sm.state().table.len(), 1);
        assert!(sm.state().table.is_retired_node_id(5));
        assert_eq!(sm.state().last_applied.map(|l| l.index), Some(1));
        let current = sm.get_current_snapshot().await.unwrap().expect("saved");
        assert_eq!(current.meta, snap.meta);
        assert_eq!(current.snapshot.into_inner(), bytes);
        let (_d2, _e2, mut follower) = fresh();
        follower
            .install_snapshot(&snap.meta, Box::new(Cursor::new(bytes.clone())))
            .await
            .unwrap();
        assert_eq!(follower.state().table.len(), 1);
        assert!(follower.state().table.is_retired_node_id(5));

        let newer = codec::FORMAT_VERSION + 4;
        let refusal = |what: &str| {
            format!(
                "{what} format version {newer} is newer than this build reads ({}): upgrade the binary",
                codec::FORMAT_VERSION
            )
        };
        let put = |space: Space, key: &[u8], value: Vec<u8>| {
            let mut b = WriteBatch::default();
            b.put(key.to_vec(), value);
            e1.write_batch(space, b).unwrap();
        };

        // A snapshot (from a leader, or a backup's).
        let mut future = bytes.clone();
        future[0] = newer;
        let (_d3, _e3, mut other) = fresh();
        let err = other
            .install_snapshot(&snap.meta, Box::new(Cursor::new(future.clone())))
            .await
            .unwrap_err();
        assert!(err.to_string().contains(&refusal("snapshot")), "{err}");
        assert_eq!(other.state().table.len(), 0, "nothing installed");
        assert!(matches!(
            decode_snapshot_table(&future),
            Err(codec::CodecError::Version { found }) if found == newer
        ));

        // The saved snapshot's meta.
        let mut meta = e1.get(Space::Snapshot, SNAPSHOT_META_KEY).unwrap().unwrap();
        meta[0] = newer;
        put(Space::Snapshot, SNAPSHOT_META_KEY, meta);
        let err = sm.get_current_snapshot().await.expect_err("refused");
        assert!(err.to_string().contains(&refusal("snapshot meta")), "{err}");
        drop(sm);

        // State-machine metadata and records, at open.
        for (key, what) in [
            (APPLIED_KEY.to_vec(), "state-machine value m/applied".to_string()),
            (record_key(1), format!("state-machine value t{:016x}", 1)),
        ] {
            let good = e1.get(Space::StateMachine, &key).unwrap().unwrap();
            let mut bad = good.clone();
            bad[0] = newer;
            put(Space::StateMachine, &key, bad);
            let err = StateMachineStore::open(e1.clone()).err().expect("refused");
            assert!(matches!(err, SmOpenError::Decode(_)), "{err}");
            assert_eq!(err.to_string(), refusal(&what));
            put(Space::StateMachine, &key, good);
        }
        assert_eq!(StateMachineStore::open(e1).unwrap().state().table.len(), 1);
    }
}
