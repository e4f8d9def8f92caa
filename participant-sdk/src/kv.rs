//! The participant store's engine (docs/adr/0024-participant-store-files.md):
//! every key in memory, in order; every atomic batch appended as one record
//! to a log of files (`dtx_durable::wal`, the same files as the Raft log's)
//! and made durable by one `fdatasync` per group of writers (`sync`); now
//! and then a checkpoint of the whole map, after which the log files it
//! covers are deleted.
//!
//! Why not sled: sled 0.34 copies a tree node for every key a batch
//! inserts, writes two log buffers per batch and wakes its seven I/O
//! threads for each, and its flush needs an `fdatasync` after its own
//! `sync_file_range` (ADR 0002): 57 % of the banks' CPU in a 64-client
//! transfer profile. Here a batch is one encoding, one `pwrite` into space
//! the file already has, and inserts into a `BTreeMap`.
//!
//! Layout in the store's directory: `log/<first sequence number>.wal`
//! (record = one batch, numbered 1, 2, ... in the order they were written)
//! and `checkpoint` (every key and value as of sequence number S, with a
//! checksum; written to `checkpoint.tmp`, synced, renamed, the directory
//! synced). Opening reads the checkpoint, then the log's records after S.
//! A torn last record of the log (a crash during its write: nothing there
//! was acknowledged) is cut; anything else that does not read back is
//! damage, and opening fails rather than forget acknowledged writes.
//!
//! Format versions (docs/adr/0042-storage-engines.md): the checkpoint
//! starts with a header (`dtx_durable::format::file_header`: magic
//! [`CHECKPOINT_MAGIC`], [`KV_FORMAT_VERSION`]), every batch with a
//! [`KV_FORMAT_VERSION`] byte, every log file with the log's own header
//! (`dtx_durable::wal`). Opening dispatches on each: this build's version
//! reads; another one (a newer build's, or a pre-release layout, such as a
//! checkpoint without a header) is refused by name, and nothing is changed.
//!
//! The price: the whole data set lives in memory (as it did in sled's
//! cache for the bank's working set); a resource too large for memory
//! belongs in PostgreSQL (`postgres::PgParticipant`).

use std::collections::BTreeMap;
use std::io::Write;
use std::ops::Bound;
use std::path::Path;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering;
use std::sync::Mutex;
use std::sync::RwLock;

use dtx_durable::wal::Wal;
use dtx_durable::wal::WalError;

/// The log's directory inside the store's directory.
pub(crate) const KV_LOG_DIR: &str = "log";
/// The checkpoint's file name inside the store's directory.
pub(crate) const KV_CHECKPOINT_FILE: &str = "checkpoint";
const KV_CHECKPOINT_TMP_FILE: &str = "checkpoint.tmp";
/// A new log file is started when the current one reaches this size.
pub(crate) const KV_LOG_SEGMENT_BYTES_MAX: u64 = 16 << 20;
/// A checkpoint is written once the log has grown by this much since the
/// last one, and by at least the last checkpoint's size (so the data is
/// rewritten at most about once per its own size of writes).
pub(crate) const KV_CHECKPOINT_LOG_BYTES_MIN: u64 = 32 << 20;
/// The first bytes of the checkpoint's header.
pub(crate) const CHECKPOINT_MAGIC: &[u8; 8] = b"DTX-PKV\n";
/// What a checkpoint of the pre-release layout (no header) starts with.
const UNVERSIONED_CHECKPOINT_MAGIC: &[u8; 6] = b"DTXPKV";
/// The format of the engine's checkpoint and batches (and of the key layout
/// and values the participant store keeps in it) this build writes, and the
/// only one it reads.
pub(crate) const KV_FORMAT_VERSION: u8 = 1;
const OP_PUT: u8 = 1;
const OP_REMOVE: u8 = 2;

/// Every key and its value, in order.
type Map = BTreeMap<Vec<u8>, Vec<u8>>;

/// One atomic write: keys set (`Some`) or removed (`None`), in order; a
/// later write of a key replaces an earlier one.
pub(crate) type KvBatch = Vec<(Vec<u8>, Option<Vec<u8>>)>;

/// A failed write, sync or checkpoint: the engine refuses every write
/// after it (reopening reads what is on disk).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct KvError {
    pub disk_full: bool,
    pub detail: String,
}

impl std::fmt::Display for KvError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

impl From<WalError> for KvError {
    fn from(e: WalError) -> KvError {
        KvError {
            disk_full: e.is_no_space(),
            detail: e.to_string(),
        }
    }
}

fn io_error(what: &str, path: &Path, e: std::io::Error) -> KvError {
    KvError {
        disk_full: dtx_durable::is_no_space_io(&e),
        detail: format!("{what} {}: {e}", path.display()),
    }
}

struct State {
    map: Map,
    /// The sequence number of the last batch applied.
    seq: u64,
}

pub(crate) struct KvFiles {
    dir: PathBuf,
    state: RwLock<State>,
    log: Wal,
    /// Log bytes appended since the last checkpoint.
    log_bytes_since_checkpoint: AtomicU64,
    /// The size of the last checkpoint written or read.
    checkpoint_bytes: AtomicU64,
    /// The first failure; every later write, sync and checkpoint returns it.
    failed: Mutex<Option<KvError>>,
    /// One checkpoint at a time.
    checkpointing: Mutex<()>,
}

/// The range of keys that start with `prefix`: from `prefix` itself up to
/// (without) the first key after every such key, which is `prefix` with
/// its trailing 0xff bytes dropped and its last other byte increased; none
/// when `prefix` is empty or all 0xff (the range is then open above).
fn prefix_bounds(prefix: &[u8]) -> (Bound<Vec<u8>>, Bound<Vec<u8>>) {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return (Bound::Included(prefix.to_vec()), Bound::Excluded(end));
        }
    }
    (Bound::Included(prefix.to_vec()), Bound::Unbounded)
}

/// `version (KV_FORMAT_VERSION), (op, key length u32 LE, key[, value
/// length u32 LE, value]) * n`.
fn encode_batch(batch: &KvBatch) -> Vec<u8> {
    let mut out = Vec::with_capacity(
        1 + batch
            .iter()
            .map(|(k, v)| 9 + k.len() + v.as_ref().map_or(0, Vec::len))
            .sum::<usize>(),
    );
    out.push(KV_FORMAT_VERSION);
    for (k, v) in batch {
        match v {
            Some(v) => {
                out.push(OP_PUT);
                out.extend_from_slice(&(k.len() as u32).to_le_bytes());
                out.extend_from_slice(k);
                out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                out.extend_from_slice(v);
            }
            None => {
                out.push(OP_REMOVE);
                out.extend_from_slice(&(k.len() as u32).to_le_bytes());
                out.extend_from_slice(k);
            }
        }
    }
    out
}

/// Reads `n` bytes at `*at`, moving it on.
fn take<'a>(b: &'a [u8], at: &mut usize, n: usize) -> Result<&'a [u8], String> {
    let end = at
        .checked_add(n)
        .filter(|e| *e <= b.len())
        .ok_or_else(|| format!("{n} bytes wanted at offset {at} of {}", b.len()))?;
    let s = &b[*at..end];
    *at = end;
    Ok(s)
}

fn take_u32(b: &[u8], at: &mut usize) -> Result<usize, String> {
    Ok(u32::from_le_bytes(take(b, at, 4)?.try_into().expect("4 bytes")) as usize)
}

/// The operations of the encoded batch `b`, once its format version is
/// this build's (`what` names it otherwise).
fn batch_operations(b: &[u8], what: impl FnOnce() -> String) -> Result<&[u8], KvOpenError> {
    let Some((&version, ops)) = b.split_first() else {
        return Err(KvOpenError::Damaged(format!("{}: an empty record", what())));
    };
    dtx_durable::format::check(what, version.into(), KV_FORMAT_VERSION.into())?;
    Ok(ops)
}

/// Applies the operations of a batch (`batch_operations`).
fn apply_encoded(map: &mut Map, b: &[u8]) -> Result<(), String> {
    let mut at = 0;
    while at < b.len() {
        let op = take(b, &mut at, 1)?[0];
        let klen = take_u32(b, &mut at)?;
        let k = take(b, &mut at, klen)?.to_vec();
        match op {
            OP_PUT => {
                let vlen = take_u32(b, &mut at)?;
                map.insert(k, take(b, &mut at, vlen)?.to_vec());
            }
            OP_REMOVE => {
                map.remove(&k);
            }
            other => return Err(format!("unknown operation {other} at offset {}", at - klen - 5)),
        }
    }
    Ok(())
}

fn apply_batch(map: &mut Map, batch: KvBatch) {
    for (k, v) in batch {
        match v {
            Some(v) => map.insert(k, v),
            None => map.remove(&k),
        };
    }
}

/// The least a checkpoint holds: its header, seq, count and checksum.
const CHECKPOINT_BYTES_MIN: usize = dtx_durable::format::FILE_HEADER_BYTES + 8 + 8 + 4;

/// `header (magic, KV_FORMAT_VERSION), seq u64 LE, count u64 LE, (klen u32
/// LE, vlen u32 LE, key, value) * count, crc32 of everything before u32 LE`.
fn encode_checkpoint(seq: u64, map: &Map) -> Vec<u8> {
    let size: usize = map.iter().map(|(k, v)| 8 + k.len() + v.len()).sum();
    let mut out = Vec::with_capacity(CHECKPOINT_BYTES_MIN + size);
    out.extend_from_slice(&dtx_durable::format::file_header(
        CHECKPOINT_MAGIC,
        KV_FORMAT_VERSION.into(),
    ));
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(map.len() as u64).to_le_bytes());
    for (k, v) in map {
        out.extend_from_slice(&(k.len() as u32).to_le_bytes());
        out.extend_from_slice(&(v.len() as u32).to_le_bytes());
        out.extend_from_slice(k);
        out.extend_from_slice(v);
    }
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// Decodes the checkpoint at `path` (its bytes `b`), dispatching on its
/// header's format version.
fn decode_checkpoint(path: &Path, b: &[u8]) -> Result<(u64, Map), KvOpenError> {
    let what = || format!("participant store checkpoint {}", path.display());
    match dtx_durable::format::read_file_header(CHECKPOINT_MAGIC, b) {
        Some(version) => dtx_durable::format::check(what, version.into(), KV_FORMAT_VERSION.into())?,
        None if b.starts_with(UNVERSIONED_CHECKPOINT_MAGIC) => {
            return Err(dtx_durable::format::VersionError::Unversioned {
                what: what(),
                reads: KV_FORMAT_VERSION.into(),
            }
            .into())
        }
        None => {
            return Err(KvOpenError::Damaged(format!(
                "{}: {} bytes, no checkpoint header",
                what(),
                b.len()
            )))
        }
    }
    decode_checkpoint_body(b).map_err(|m| KvOpenError::Damaged(format!("{}: {m}", what())))
}

/// The seq and map of a checkpoint of this build's format version.
fn decode_checkpoint_body(b: &[u8]) -> Result<(u64, Map), String> {
    if b.len() < CHECKPOINT_BYTES_MIN {
        return Err(format!("{} bytes, shorter than a checkpoint", b.len()));
    }
    let (body, crc) = b.split_at(b.len() - 4);
    if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
        return Err("fails its checksum".into());
    }
    let at = dtx_durable::format::FILE_HEADER_BYTES;
    let seq = u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
    let count = u64::from_le_bytes(body[at + 8..at + 16].try_into().expect("8 bytes"));
    let mut at = at + 16;
    let mut map = BTreeMap::new();
    for _ in 0..count {
        let klen = take_u32(body, &mut at)?;
        let vlen = take_u32(body, &mut at)?;
        let k = take(body, &mut at, klen)?.to_vec();
        map.insert(k, take(body, &mut at, vlen)?.to_vec());
    }
    if at != body.len() {
        return Err(format!("{} bytes after the last of {count} keys", body.len() - at));
    }
    Ok((seq, map))
}

fn sync_dir(dir: &Path) -> Result<(), KvError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error("cannot sync the directory", dir, e))
}

/// Makes `encoded` the checkpoint in `dir`, durably: written to
/// `checkpoint.tmp` and synced, renamed, the directory synced. A crash
/// leaves the previous checkpoint or this one, never a part.
fn write_checkpoint_file(dir: &Path, encoded: &[u8]) -> Result<(), KvError> {
    let tmp = dir.join(KV_CHECKPOINT_TMP_FILE);
    let path = dir.join(KV_CHECKPOINT_FILE);
    let mut f = std::fs::File::create(&tmp).map_err(|e| io_error("cannot create", &tmp, e))?;
    f.write_all(encoded)
        .and_then(|_| f.sync_all())
        .map_err(|e| io_error("cannot write", &tmp, e))?;
    drop(f);
    std::fs::rename(&tmp, &path).map_err(|e| io_error("cannot rename to checkpoint", &tmp, e))?;
    sync_dir(dir)
}

/// Why a store directory could not be opened.
#[derive(Debug)]
pub(crate) enum KvOpenError {
    /// Reading or writing failed (`disk_full` for lack of space).
    Io(KvError),
    /// Something on disk does not read back: the store refuses to start
    /// rather than forget acknowledged writes.
    Damaged(String),
    /// Something on disk is in a format version this build does not read
    /// (a newer build's, or a pre-release layout): named, nothing changed.
    Format(dtx_durable::format::VersionError),
}

impl From<dtx_durable::format::VersionError> for KvOpenError {
    fn from(e: dtx_durable::format::VersionError) -> KvOpenError {
        KvOpenError::Format(e)
    }
}

impl KvFiles {
    /// Opens (creating) the engine in `dir`: the checkpoint, then the log
    /// after it.
    pub(crate) fn open(dir: &Path) -> Result<KvFiles, KvOpenError> {
        Self::open_with_log_segment_bytes(dir, KV_LOG_SEGMENT_BYTES_MAX)
    }

    /// `open`, starting a new log file when the current one reaches
    /// `log_segment_bytes_max` (tests rotate the log with a tiny size).
    fn open_with_log_segment_bytes(dir: &Path, log_segment_bytes_max: u64) -> Result<KvFiles, KvOpenError> {
        if !dir.exists() {
            std::fs::create_dir_all(dir).map_err(|e| KvOpenError::Io(io_error("cannot create", dir, e)))?;
            if let Some(parent) = dir.parent() {
                sync_dir(parent).map_err(KvOpenError::Io)?;
            }
        }
        let tmp = dir.join(KV_CHECKPOINT_TMP_FILE);
        if tmp.exists() {
            // A checkpoint cut short by a crash; the previous one and the
            // log after it are complete.
            std::fs::remove_file(&tmp).map_err(|e| KvOpenError::Io(io_error("cannot remove", &tmp, e)))?;
        }
        let path = dir.join(KV_CHECKPOINT_FILE);
        let (seq, mut map, checkpoint_bytes) = match std::fs::read(&path) {
            Ok(b) => {
                let (seq, map) = decode_checkpoint(&path, &b)?;
                (seq, map, b.len() as u64)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (0, BTreeMap::new(), 0),
            Err(e) => return Err(KvOpenError::Io(io_error("cannot read", &path, e))),
        };
        let log_dir = dir.join(KV_LOG_DIR);
        let log = Wal::open(&log_dir, "participant log", log_segment_bytes_max).map_err(|e| match e {
            WalError::Damaged { .. } | WalError::Gap { .. } => KvOpenError::Damaged(e.to_string()),
            WalError::Format(v) => KvOpenError::Format(v),
            other => KvOpenError::Io(other.into()),
        })?;
        let mut last = seq;
        let mut replayed_bytes = 0u64;
        if let Some((first, end)) = log.range() {
            if first > seq + 1 {
                return Err(KvOpenError::Damaged(format!(
                    "the log in {} starts at batch {first}, but the checkpoint holds only up to {seq}",
                    log_dir.display()
                )));
            }
            let from = seq + 1;
            // In steps, so a long log is not read into memory at once.
            let mut at = from;
            while at <= end {
                let to = (at + 4096).min(end + 1);
                let records = log.read(at, to).map_err(|e| KvOpenError::Io(e.into()))?;
                for (i, r) in records.iter().enumerate() {
                    let what = || format!("batch {} of the log in {}", at + i as u64, log_dir.display());
                    let ops = batch_operations(r, what)?;
                    apply_encoded(&mut map, ops).map_err(|m| KvOpenError::Damaged(format!("{}: {m}", what())))?;
                    replayed_bytes += r.len() as u64;
                }
                at = to;
            }
            last = last.max(end);
        }
        Ok(KvFiles {
            dir: dir.to_path_buf(),
            state: RwLock::new(State { map, seq: last }),
            log,
            log_bytes_since_checkpoint: AtomicU64::new(replayed_bytes),
            checkpoint_bytes: AtomicU64::new(checkpoint_bytes),
            failed: Mutex::new(None),
            checkpointing: Mutex::new(()),
        })
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().expect("participant store map lock")
    }

    pub(crate) fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.read().map.get(key).cloned()
    }

    pub(crate) fn contains_key(&self, key: &[u8]) -> bool {
        self.read().map.contains_key(key)
    }

    /// Every (key, value) whose key starts with `prefix`, in key order.
    pub(crate) fn scan_prefix(&self, prefix: &[u8]) -> Vec<(Vec<u8>, Vec<u8>)> {
        let g = self.read();
        g.map
            .range(prefix_bounds(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The keys that start with `prefix`: in key order, or the last `max`
    /// of them, last first (`newest_first`). Either way only the keys
    /// returned are visited, so a short inspection of a long prefix holds
    /// the read lock (and the writers behind it) only for those.
    pub(crate) fn keys_with_prefix(&self, prefix: &[u8], newest_first: bool, max: usize) -> Vec<Vec<u8>> {
        let g = self.read();
        let range = g.map.range(prefix_bounds(prefix)).map(|(k, _)| k);
        if newest_first {
            range.rev().take(max).cloned().collect()
        } else {
            range.take(max).cloned().collect()
        }
    }

    /// How many keys start with `prefix`.
    pub(crate) fn count_prefix(&self, prefix: &[u8]) -> u64 {
        let g = self.read();
        g.map.range(prefix_bounds(prefix)).count() as u64
    }

    /// At most `max` (key, value) from `start` on, in key order.
    pub(crate) fn range_from(&self, start: &[u8], max: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
        let g = self.read();
        g.map
            .range(start.to_vec()..)
            .take(max)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Every key and value (for tests and tools).
    pub(crate) fn dump(&self) -> Vec<(Vec<u8>, Vec<u8>)> {
        self.scan_prefix(&[])
    }

    fn check_running(&self) -> Result<(), KvError> {
        match &*self.failed.lock().expect("participant store failure lock") {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn record_failure(&self, e: KvError) -> KvError {
        let mut f = self.failed.lock().expect("participant store failure lock");
        f.get_or_insert(e).clone()
    }

    /// Writes `batch` atomically: readers see all of it or none, and so
    /// does the disk after a crash. Not yet durable: `sync` makes it so.
    pub(crate) fn apply(&self, batch: KvBatch) -> Result<(), KvError> {
        if batch.is_empty() {
            return Ok(());
        }
        self.check_running()?;
        let encoded = encode_batch(&batch);
        let mut g = self.state.write().expect("participant store map lock");
        let seq = g.seq + 1;
        let n = encoded.len() as u64;
        if let Err(e) = self.log.append(&[(seq, encoded)]) {
            return Err(self.record_failure(e.into()));
        }
        g.seq = seq;
        apply_batch(&mut g.map, batch);
        drop(g);
        self.log_bytes_since_checkpoint.fetch_add(n, Ordering::Relaxed);
        Ok(())
    }

    /// Makes every write applied before the call durable.
    pub(crate) fn sync(&self) -> Result<(), KvError> {
        self.check_running()?;
        self.log.sync().map(|_| ()).map_err(|e| self.record_failure(e.into()))
    }

    /// Whether the log has grown enough since the last checkpoint for
    /// another.
    pub(crate) fn checkpoint_due(&self) -> bool {
        let since = self.log_bytes_since_checkpoint.load(Ordering::Relaxed);
        since >= KV_CHECKPOINT_LOG_BYTES_MIN.max(self.checkpoint_bytes.load(Ordering::Relaxed))
    }

    /// Writes every key and value as of now to a new checkpoint, then
    /// deletes the log files it covers. Writers wait only while the map is
    /// encoded. A failure stops the engine (reopening starts from the
    /// previous checkpoint and the whole log after it).
    pub(crate) fn checkpoint(&self) -> Result<(), KvError> {
        let _one = self.checkpointing.lock().expect("checkpoint lock");
        self.check_running()?;
        let (seq, encoded, since) = {
            let g = self.read();
            (
                g.seq,
                encode_checkpoint(g.seq, &g.map),
                self.log_bytes_since_checkpoint.load(Ordering::Relaxed),
            )
        };
        let res = (|| -> Result<(), KvError> {
            write_checkpoint_file(&self.dir, &encoded)?;
            self.log.purge_upto(seq)?;
            self.log.sync()?;
            Ok(())
        })();
        match res {
            Ok(()) => {
                self.log_bytes_since_checkpoint.fetch_sub(since, Ordering::Relaxed);
                self.checkpoint_bytes.store(encoded.len() as u64, Ordering::Relaxed);
                tracing::debug!(seq, bytes = encoded.len(), "participant store: checkpoint written");
                Ok(())
            }
            Err(e) => Err(self.record_failure(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(k: &str, v: &str) -> (Vec<u8>, Option<Vec<u8>>) {
        (k.as_bytes().to_vec(), Some(v.as_bytes().to_vec()))
    }

    fn del(k: &str) -> (Vec<u8>, Option<Vec<u8>>) {
        (k.as_bytes().to_vec(), None)
    }

    fn strings(v: Vec<(Vec<u8>, Vec<u8>)>) -> Vec<(String, String)> {
        v.into_iter()
            .map(|(k, v)| (String::from_utf8(k).unwrap(), String::from_utf8(v).unwrap()))
            .collect()
    }

    #[test]
    fn batches_read_back_after_a_reopen_and_after_a_checkpoint() {
        let d = tempfile::tempdir().unwrap();
        let kv = KvFiles::open(d.path()).unwrap();
        kv.apply(vec![put("a/1", "x"), put("a/2", "y"), put("b", "z")]).unwrap();
        kv.apply(vec![del("a/1"), put("a/3", "w"), put("b", "z2")]).unwrap();
        kv.sync().unwrap();
        assert_eq!(
            strings(kv.scan_prefix(b"a/")),
            vec![("a/2".into(), "y".into()), ("a/3".into(), "w".into())]
        );
        assert_eq!(kv.keys_with_prefix(b"a/", true, 1), vec![b"a/3".to_vec()]);
        assert_eq!(kv.count_prefix(b"a/"), 2);
        drop(kv);
        let kv = KvFiles::open(d.path()).unwrap();
        assert_eq!(kv.get(b"b"), Some(b"z2".to_vec()));
        assert!(!kv.contains_key(b"a/1"));
        kv.checkpoint().unwrap();
        kv.apply(vec![put("c", "after")]).unwrap();
        kv.sync().unwrap();
        let before = kv.dump();
        drop(kv);
        let kv = KvFiles::open(d.path()).unwrap();
        assert_eq!(kv.dump(), before, "checkpoint plus the log after it");
        assert_eq!(kv.read().seq, 3);
    }

    #[test]
    fn prefix_scans_stop_at_the_prefix_and_read_the_newest_first() {
        let d = tempfile::tempdir().unwrap();
        let kv = KvFiles::open(d.path()).unwrap();
        let keys: [&[u8]; 8] = [
            b"a",
            b"a\x00",
            b"a\xff",
            b"a\xff\xff",
            b"b",
            b"\xff",
            b"\xff\x01",
            b"\xff\xff",
        ];
        kv.apply(keys.iter().map(|k| (k.to_vec(), Some(b"v".to_vec()))).collect())
            .unwrap();
        let ks = |v: &[&[u8]]| v.iter().map(|k| k.to_vec()).collect::<Vec<_>>();
        assert_eq!(kv.keys_with_prefix(b"a", false, 10), ks(&keys[..4]));
        assert_eq!(kv.keys_with_prefix(b"a", true, 2), ks(&[b"a\xff\xff", b"a\xff"]));
        assert_eq!(kv.keys_with_prefix(b"a\xff", true, 10), ks(&[b"a\xff\xff", b"a\xff"]));
        assert_eq!(kv.count_prefix(b"a\xff"), 2);
        assert_eq!(kv.keys_with_prefix(b"\xff", true, 1), ks(&[b"\xff\xff"]));
        assert_eq!(kv.count_prefix(b"\xff"), 3);
        assert_eq!(kv.count_prefix(b"\xff\xff"), 1);
        assert_eq!(kv.scan_prefix(b"b").len(), 1);
        assert_eq!(kv.count_prefix(b""), 8);
        assert_eq!(kv.keys_with_prefix(b"c", true, 5), Vec::<Vec<u8>>::new());
    }

    #[test]
    fn a_checkpoint_deletes_the_log_files_it_covers() {
        let d = tempfile::tempdir().unwrap();
        let kv = KvFiles::open(d.path()).unwrap();
        let big = "v".repeat(1 << 20);
        // More than one log file's worth.
        let n = (KV_LOG_SEGMENT_BYTES_MAX >> 20) * 2;
        for i in 0..n {
            kv.apply(vec![put(&format!("k{}", i % 3), &big)]).unwrap();
        }
        kv.sync().unwrap();
        let files = || std::fs::read_dir(d.path().join(KV_LOG_DIR)).unwrap().count();
        assert!(files() >= 2, "{} files", files());
        kv.checkpoint().unwrap();
        assert_eq!(files(), 1, "only the file appends go to stays");
        kv.apply(vec![put("last", "1")]).unwrap();
        kv.sync().unwrap();
        let before = kv.dump();
        drop(kv);
        let kv = KvFiles::open(d.path()).unwrap();
        assert_eq!(kv.dump(), before);
        assert_eq!(kv.dump().len(), 4);
    }

    #[test]
    fn a_damaged_checkpoint_or_a_log_that_does_not_follow_it_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let kv = KvFiles::open(d.path()).unwrap();
        kv.apply(vec![put("a", "1")]).unwrap();
        kv.checkpoint().unwrap();
        drop(kv);
        let path = d.path().join(KV_CHECKPOINT_FILE);
        let good = std::fs::read(&path).unwrap();
        let mut bad = good.clone();
        bad[30] ^= 0xff;
        std::fs::write(&path, &bad).unwrap();
        match KvFiles::open(d.path()) {
            Err(KvOpenError::Damaged(m)) => assert!(m.contains("fails its checksum"), "{m}"),
            other => panic!("opened a damaged checkpoint: {:?}", other.map(|_| ())),
        }
        // A checkpoint cut short before its rename is ignored.
        std::fs::write(&path, &good).unwrap();
        std::fs::write(d.path().join(KV_CHECKPOINT_TMP_FILE), &bad[..10]).unwrap();
        let kv = KvFiles::open(d.path()).unwrap();
        assert_eq!(kv.get(b"a"), Some(b"1".to_vec()));
        assert!(!d.path().join(KV_CHECKPOINT_TMP_FILE).exists());
        drop(kv);
        // A log that starts after a gap past the checkpoint (batch 5 where 2
        // comes next): acknowledged batches are missing.
        let log = Wal::open(&d.path().join(KV_LOG_DIR), "participant log", KV_LOG_SEGMENT_BYTES_MAX).unwrap();
        log.purge_upto(u64::MAX - 1).unwrap();
        log.append(&[(5, encode_batch(&vec![put("b", "2")]))]).unwrap();
        log.sync().unwrap();
        drop(log);
        match KvFiles::open(d.path()) {
            Err(KvOpenError::Damaged(m)) => assert!(m.contains("starts at batch 5"), "{m}"),
            other => panic!("opened a log with a gap: {:?}", other.map(|_| ())),
        }
    }

    /// A power cut while the log starts a new file: the log
    /// syncs the file before it first writes into the next, so what the cut
    /// can leave is the earlier file whole and the new one whole, torn or
    /// empty. The store opens in each case with every synced batch (a
    /// store that refused would hold its in-doubt locks until someone
    /// edited its files), and with the later batches that survived.
    #[test]
    fn a_power_cut_while_the_log_starts_a_new_file_loses_no_synced_batch() {
        // Four batches to a file.
        const SEGMENT_BYTES_MAX: u64 = 256;
        let d = tempfile::tempdir().unwrap();
        let log_dir = d.path().join(KV_LOG_DIR);
        let open = || KvFiles::open_with_log_segment_bytes(d.path(), SEGMENT_BYTES_MAX).unwrap();
        let value = "v".repeat(40);
        let batch = |i: u64| vec![put(&format!("k{i:02}"), &value)];
        let files = || {
            let mut v: Vec<PathBuf> = std::fs::read_dir(&log_dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            v.sort();
            v
        };
        let kv = open();
        kv.apply(batch(1)).unwrap();
        kv.apply(batch(2)).unwrap();
        kv.sync().unwrap();
        // Unsynced batches until one is in a second file, and one more.
        let mut n = 2;
        while files().len() < 2 {
            n += 1;
            assert!(n < 20, "the log never started a second file");
            kv.apply(batch(n)).unwrap();
        }
        kv.apply(batch(n + 1)).unwrap();
        let all = kv.dump();
        assert_eq!(all.len(), n as usize + 1);
        drop(kv);
        let second = files().pop().unwrap();

        let kv = open();
        assert_eq!(kv.dump(), all, "the second file whole");
        drop(kv);
        let record = 16 + encode_batch(&batch(n)).len();
        let b = std::fs::read(&second).unwrap();
        std::fs::write(&second, &b[..dtx_durable::wal::WAL_FILE_HEADER_BYTES + record + 5]).unwrap();
        let kv = open();
        assert_eq!(
            kv.dump(),
            all[..all.len() - 1],
            "the second file torn in its second batch"
        );
        drop(kv);
        std::fs::write(&second, b"").unwrap();
        let kv = open();
        assert_eq!(kv.dump(), all[..all.len() - 2], "the second file empty");
        assert_eq!(kv.get(b"k02"), Some(value.into_bytes()), "a synced batch");
    }

    #[test]
    fn a_failed_write_stops_every_later_write() {
        let d = tempfile::tempdir().unwrap();
        let kv = KvFiles::open(d.path()).unwrap();
        let e = kv.record_failure(KvError {
            disk_full: true,
            detail: "no space".into(),
        });
        assert!(e.disk_full);
        assert_eq!(kv.apply(vec![put("a", "1")]).unwrap_err(), e);
        assert_eq!(kv.sync().unwrap_err(), e);
        assert_eq!(kv.checkpoint().unwrap_err(), e);
        assert_eq!(kv.get(b"a"), None, "a refused write is not applied");
    }
    fn refused(r: Result<KvFiles, KvOpenError>) -> dtx_durable::format::VersionError {
        match r {
            Err(KvOpenError::Format(v)) => v,
            other => panic!("not refused by its format version: {:?}", other.map(|_| ())),
        }
    }

    /// docs/adr/0042-storage-engines.md: a checkpoint and batches this
    /// build wrote read back, each in this build's format version; a newer
    /// build's checkpoint or batch is refused, named, with the version found
    /// and the one this build reads, and nothing is changed.
    #[test]
    fn this_versions_files_read_back_and_a_newer_format_version_is_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        let kv = KvFiles::open(d.path()).unwrap();
        kv.apply(vec![put("a", "1")]).unwrap();
        kv.checkpoint().unwrap();
        kv.apply(vec![put("b", "2")]).unwrap();
        kv.sync().unwrap();
        drop(kv);
        let kv = KvFiles::open(d.path()).unwrap();
        assert_eq!(
            strings(kv.dump()),
            vec![("a".into(), "1".into()), ("b".into(), "2".into())]
        );
        drop(kv);
        let path = d.path().join(KV_CHECKPOINT_FILE);
        let good = std::fs::read(&path).unwrap();
        assert_eq!(
            dtx_durable::format::read_file_header(CHECKPOINT_MAGIC, &good),
            Some(KV_FORMAT_VERSION.into())
        );

        // A newer checkpoint.
        let mut newer = good.clone();
        newer[..dtx_durable::format::FILE_HEADER_BYTES].copy_from_slice(&dtx_durable::format::file_header(
            CHECKPOINT_MAGIC,
            u32::from(KV_FORMAT_VERSION) + 1,
        ));
        std::fs::write(&path, &newer).unwrap();
        let e = refused(KvFiles::open(d.path()));
        assert_eq!(
            e.to_string(),
            format!(
                "participant store checkpoint {} format version 2 is newer than this build reads (1): upgrade the binary",
                path.display()
            )
        );
        assert_eq!(std::fs::read(&path).unwrap(), newer, "left as it was");
        std::fs::write(&path, &good).unwrap();

        // A newer batch after it.
        let log = Wal::open(&d.path().join(KV_LOG_DIR), "participant log", KV_LOG_SEGMENT_BYTES_MAX).unwrap();
        let mut batch = encode_batch(&vec![put("c", "3")]);
        batch[0] = KV_FORMAT_VERSION + 1;
        log.append(&[(3, batch)]).unwrap();
        log.sync().unwrap();
        drop(log);
        let e = refused(KvFiles::open(d.path()));
        assert_eq!(
            e.to_string(),
            format!(
                "batch 3 of the log in {} format version 2 is newer than this build reads (1): upgrade the binary",
                d.path().join(KV_LOG_DIR).display()
            )
        );
    }

    /// A checkpoint of the pre-release layout (no header, magic
    /// `DTXPKV01`) is refused by name, not read.
    #[test]
    fn a_checkpoint_of_the_pre_release_layout_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join(KV_CHECKPOINT_FILE);
        let mut old = b"DTXPKV01".to_vec();
        old.extend_from_slice(&[0; 20]);
        std::fs::write(&path, &old).unwrap();
        let e = refused(KvFiles::open(d.path()));
        assert_eq!(
            e.to_string(),
            format!(
                "participant store checkpoint {} carries no format version: a pre-release layout, which this build does not read (it reads format version 1)",
                path.display()
            )
        );
        assert_eq!(std::fs::read(&path).unwrap(), old);
    }
}
