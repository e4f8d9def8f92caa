//! Retained records (ADR 0050): a decided transaction whose participants
//! all acked changes no more until it is forgotten, after the retention.
//! The store keeps it on disk only, out of the in-memory table, so a
//! node's memory and its start time do not grow with how many such
//! records the retention holds:
//!
//! - `r<txid>`: the record with its owner, drops and branches
//!   (`RetainedRecord`);
//! - `k<idempotency key>`: its txid, so a Begin with the same key finds it.
//!
//! The forget loop reads `r` in txid order, which is nearly the order of
//! the decisions, and takes those decided before the retention's cutoff
//! (`forgettable`): no third key per record (each key costs sled memory
//! and a write, docs/benchmarks.md). Written together when the record
//! leaves memory, deleted together when it is forgotten, and counted under `m/retained_count`. A command about a
//! retained record brings it back into the table for that apply
//! (`sm_store`); readers see it through `SmState`'s reads (`store::state`),
//! which look at the writes not yet in the engine first (`Unwritten`).

use std::collections::BTreeMap;
use std::sync::Arc;

use super::engine::EngineError;
use super::engine::KvEngine;
use super::engine::KvPair;
use super::engine::Space;
use super::engine::WriteBatch;
use super::unwritten::Unwritten;
use crate::codec;
use crate::sm::RetainedRecord;
use crate::sm::Txid;

pub(super) const RETAINED_PREFIX: &[u8] = b"r";
const RETAINED_END: &[u8] = b"s";
const KEY_PREFIX: &[u8] = b"k";
/// `f<decided_ms><txid>`: a forget index of the first build of ADR 0050,
/// no longer written; a start deletes what is left of it.
const OLD_FORGET_PREFIX: &[u8] = b"f";
const OLD_FORGET_END: &[u8] = b"g";
/// Retained records the forget loop looks at in one call, at most: past
/// as many records decided after the cutoff (a few decided late, at low
/// txids), the rest wait for the next round.
pub const FORGET_SCAN_RECORDS_MAX: usize = 16_384;
/// Retained records the forget loop reads at a time.
const FORGET_CHUNK_RECORDS: usize = 1024;
/// `z<txid>`: the record `r<txid>` is forgotten, its delete put off while
/// a snapshot reads the retained records (`SnapshotRead`); readers treat
/// it as deleted. Removed with the record when the read ends, or at start.
const FORGOTTEN_PREFIX: &[u8] = b"z";
const FORGOTTEN_END: &[u8] = b"{";
/// How many records are retained, a key of its own: absent = 0.
pub(super) const RETAINED_COUNT_KEY: &[u8] = b"m/retained_count";

pub(super) fn retained_key(txid: Txid) -> Vec<u8> {
    let mut k = RETAINED_PREFIX.to_vec();
    k.extend_from_slice(&txid.to_be_bytes());
    k
}

fn key_index_key(key: &str) -> Vec<u8> {
    let mut k = KEY_PREFIX.to_vec();
    k.extend_from_slice(key.as_bytes());
    k
}

/// Adds to `b` the writes that retain `r` (its record and its key's index).
pub(super) fn put(b: &mut WriteBatch, r: &RetainedRecord) -> Result<(), codec::CodecError> {
    let txid = r.record.txid;
    b.put(retained_key(txid), codec::encode(r)?);
    if !r.record.idempotency_key.is_empty() {
        b.put(key_index_key(&r.record.idempotency_key), codec::encode(&txid)?);
    }
    Ok(())
}

fn forgotten_key(txid: Txid) -> Vec<u8> {
    let mut k = FORGOTTEN_PREFIX.to_vec();
    k.extend_from_slice(&txid.to_be_bytes());
    k
}

/// Adds to `b` the deletes of what `put` wrote for `r`. While a snapshot
/// reads the retained records (`snapshot_reading`), the record itself
/// stays for it, marked forgotten (`z<txid>`); its indexes go at once.
pub(super) fn delete(b: &mut WriteBatch, r: &RetainedRecord, snapshot_reading: bool) {
    let txid = r.record.txid;
    if snapshot_reading {
        b.put(forgotten_key(txid), Vec::new());
    } else {
        b.delete(retained_key(txid));
    }
    if !r.record.idempotency_key.is_empty() {
        b.delete(key_index_key(&r.record.idempotency_key));
    }
}

/// The deletes that finish what `delete` put off: every record marked
/// forgotten, and its mark (`reader`: the unwritten writes included).
pub(super) fn finish_deletes(reader: &RetainedReader) -> Result<WriteBatch, RetainedReadError> {
    let mut b = WriteBatch::default();
    for (k, _) in reader.range(FORGOTTEN_PREFIX, FORGOTTEN_END, usize::MAX)? {
        if let Some(txid) = k.get(1..9).and_then(|x| x.try_into().ok()).map(Txid::from_be_bytes) {
            b.delete(retained_key(txid));
            b.delete(k);
        }
    }
    Ok(b)
}

/// Deletes what is left of the old forget index (`OLD_FORGET_PREFIX`); at
/// start, before anything is read.
pub(super) fn drop_old_forget_index(engine: &dyn KvEngine) -> Result<(), EngineError> {
    engine.delete_range(Space::StateMachine, OLD_FORGET_PREFIX, Some(OLD_FORGET_END))
}

/// Everything in the engine's retained records (not the unwritten
/// writes), read without the state lock by a snapshot: the records
/// retained when it started are all there (their deletes are put off),
/// with some retained since, which the caller leaves out.
pub(super) fn read_all(engine: &dyn KvEngine) -> Result<Vec<RetainedRecord>, RetainedReadError> {
    engine
        .scan(Space::StateMachine, RETAINED_PREFIX, Some(RETAINED_END))?
        .into_iter()
        .map(|(k, v)| decode(&k, &v))
        .collect()
}

/// A retained record could not be read: the caller answers nothing
/// rather than "not found" (which would read as presumed abort).
#[derive(Debug, thiserror::Error)]
pub enum RetainedReadError {
    #[error("a retained transaction record could not be read: {0}")]
    Engine(#[from] EngineError),
    #[error("a retained transaction record does not decode: {0}")]
    Decode(#[from] codec::NamedCodecError),
}

/// Reads the retained records: the unwritten writes first, then the
/// engine.
#[derive(Clone)]
pub struct RetainedReader {
    engine: Arc<dyn KvEngine>,
    unwritten: Unwritten,
}

impl std::fmt::Debug for RetainedReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RetainedReader")
    }
}

impl RetainedReader {
    pub(super) fn new(engine: Arc<dyn KvEngine>, unwritten: Unwritten) -> Self {
        RetainedReader { engine, unwritten }
    }

    fn value(&self, key: &[u8]) -> Result<Option<Vec<u8>>, RetainedReadError> {
        match self.unwritten.get(key) {
            Some(v) => Ok(v),
            None => Ok(self.engine.get(Space::StateMachine, key)?),
        }
    }

    /// The first `max` pairs with `from <= key < to`, unwritten writes
    /// included.
    fn range(&self, from: &[u8], to: &[u8], max: usize) -> Result<Vec<KvPair>, RetainedReadError> {
        let unwritten = self.unwritten.range(from, to);
        let deletes = unwritten.values().filter(|v| v.is_none()).count();
        let mut merged: BTreeMap<Vec<u8>, Vec<u8>> = self
            .engine
            .scan_limit(Space::StateMachine, from, Some(to), max.saturating_add(deletes))?
            .into_iter()
            .collect();
        for (k, v) in unwritten {
            match v {
                Some(v) => merged.insert(k, v),
                None => merged.remove(&k),
            };
        }
        Ok(merged.into_iter().take(max).collect())
    }

    pub fn get(&self, txid: Txid) -> Result<Option<RetainedRecord>, RetainedReadError> {
        let key = retained_key(txid);
        match self.value(&key)? {
            Some(_) if self.value(&forgotten_key(txid))?.is_some() => Ok(None),
            Some(b) => Ok(Some(decode(&key, &b)?)),
            None => Ok(None),
        }
    }

    /// The retained transaction `key` belongs to.
    pub fn txid_of_key(&self, key: &str) -> Result<Option<Txid>, RetainedReadError> {
        let k = key_index_key(key);
        match self.value(&k)? {
            Some(b) => Ok(Some(decode(&k, &b)?)),
            None => Ok(None),
        }
    }

    /// Retained transactions decided at or before `decided_before_ms`, by
    /// ascending txid, at most `max`. Records are read in chunks of
    /// `FORGET_CHUNK_RECORDS` from the lowest txid: one decided after the
    /// cutoff is passed over, not waited for, and the look ends at a chunk
    /// with none to take (txid order is nearly decision order, so what
    /// follows is younger still) or after `FORGET_SCAN_RECORDS_MAX`.
    pub fn forgettable(&self, decided_before_ms: u64, max: usize) -> Result<Vec<Txid>, RetainedReadError> {
        let mut out = Vec::new();
        let (mut after, mut scanned) = (0, 0usize);
        while out.len() < max && scanned < FORGET_SCAN_RECORDS_MAX {
            let chunk = self.after(after, FORGET_CHUNK_RECORDS.min(FORGET_SCAN_RECORDS_MAX - scanned))?;
            let Some(last) = chunk.last() else { break };
            after = last.record.txid;
            scanned += chunk.len();
            let before = out.len();
            out.extend(
                chunk
                    .iter()
                    .filter(|r| r.decided_ms() <= decided_before_ms)
                    .map(|r| r.record.txid)
                    .take(max - before),
            );
            if out.len() == before {
                break;
            }
        }
        Ok(out)
    }

    /// Retained records above `after`, lowest txid first, at most `max`.
    pub fn after(&self, after: Txid, max: usize) -> Result<Vec<RetainedRecord>, RetainedReadError> {
        let from = retained_key(after.saturating_add(1));
        let forgotten = self.range(&forgotten_key(after.saturating_add(1)), FORGOTTEN_END, usize::MAX)?;
        let forgotten: std::collections::BTreeSet<&[u8]> = forgotten.iter().map(|(k, _)| &k[1..]).collect();
        self.range(&from, RETAINED_END, max.saturating_add(forgotten.len()))?
            .into_iter()
            .filter(|(k, _)| !forgotten.contains(&k[1..]))
            .take(max)
            .map(|(k, v)| decode(&k, &v))
            .collect()
    }
}

fn decode<T: serde::de::DeserializeOwned>(key: &[u8], bytes: &[u8]) -> Result<T, RetainedReadError> {
    Ok(codec::decode(bytes).map_err(|e| e.named(format!("state-machine value {}", key_text(key))))?)
}

/// A state-machine key as messages show it: as text when it is (the
/// `m/...` metadata), else its prefix and the rest in hex.
pub(super) fn key_text(k: &[u8]) -> String {
    if k.iter().all(|b| b.is_ascii_graphic()) {
        return String::from_utf8_lossy(k).into_owned();
    }
    let (prefix, rest) = k.split_at(k.len().min(1));
    let hex: String = rest.iter().map(|b| format!("{b:02x}")).collect();
    format!("{}{hex}", String::from_utf8_lossy(prefix))
}
