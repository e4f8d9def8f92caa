//! The project's own storage trait. Everything durable goes through
//! `KvEngine`, so sled can be replaced without touching Raft or the state
//! machine (docs/adr/0002-sled.md).

use std::fs::File;
use std::path::Path;
use std::path::PathBuf;
use std::time::Duration;
use std::time::Instant;

/// Independent key spaces. Writes within one space can be made atomic with
/// `write_batch`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    /// Raft vote, committed log id, last purged log id (the entries are in
    /// the log files, `log_store`).
    RaftMeta,
    /// Transaction records and state-machine metadata.
    StateMachine,
    /// The latest snapshot (meta and data).
    Snapshot,
    /// Node identity: cluster id, node id, format version.
    NodeMeta,
}

impl Space {
    pub const ALL: [Space; 4] = [Space::RaftMeta, Space::StateMachine, Space::Snapshot, Space::NodeMeta];

    pub fn name(self) -> &'static str {
        match self {
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
    /// Another process (or, for a moment after a close, this one) holds
    /// the directory's lock.
    #[error("data directory {path} is locked by another process: {message}")]
    Locked { path: String, message: String },
    /// The filesystem holding `path` has no room for a write. Always says
    /// "disk full" (operators and tests grep for it), how much is free, and
    /// what to do.
    #[error("disk full: no space left for data directory {path} ({}): {message}; free space on that filesystem (or move the directory to a larger one), then start the node again: what it acknowledged is on disk, and it catches up from the leader", describe_free(*free_bytes))]
    NoSpace {
        path: String,
        free_bytes: Option<u64>,
        message: String,
    },
}

impl EngineError {
    pub fn is_no_space(&self) -> bool {
        matches!(self, EngineError::NoSpace { .. })
    }
}

/// The words every disk-full message carries.
pub const DISK_FULL: &str = "disk full";

fn describe_free(free_bytes: Option<u64>) -> String {
    match free_bytes {
        Some(b) => format!("{} free on its filesystem", human_bytes(b)),
        None => "free space unknown".to_string(),
    }
}

/// `12345678` -> `"12345678 bytes (11.8 MiB)"`.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if b < 1024 {
        return format!("{b} bytes");
    }
    let mut v = b as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    format!("{b} bytes ({v:.1} {})", UNITS[unit])
}

/// Bytes an unprivileged writer can still use on the filesystem holding
/// `path` (what `df` shows as available).
pub use dtx_durable::free_bytes;

/// True for an I/O error that means "no space left": ENOSPC or EDQUOT,
/// also after sled has re-wrapped the error (its `Clone` keeps only the
/// kind and the debug text). The one test the Raft log's files use too.
pub use dtx_durable::is_no_space_io;

fn sled_no_space(e: &sled::Error) -> bool {
    match e {
        sled::Error::Io(io) => is_no_space_io(io),
        _ => false,
    }
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
    /// The first `limit` pairs with `from <= key < to` (`to = None`: to
    /// the end), in key order.
    fn scan_limit(
        &self,
        space: Space,
        from: &[u8],
        to: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<KvPair>, EngineError> {
        let mut pairs = self.scan(space, from, to)?;
        pairs.truncate(limit);
        Ok(pairs)
    }
    fn first(&self, space: Space) -> Result<Option<KvPair>, EngineError>;
    fn last(&self, space: Space) -> Result<Option<KvPair>, EngineError>;
    /// Deletes keys with `from <= key < to` (`to = None`: to the end), in
    /// batches of at most `DELETE_RANGE_BATCH_KEYS` (not atomically: a
    /// stop in between leaves the first batches deleted).
    fn delete_range(&self, space: Space, from: &[u8], to: Option<&[u8]>) -> Result<(), EngineError>;
    /// Makes every write issued so far durable (fsync). Blocking.
    fn flush(&self) -> Result<(), EngineError>;
}

/// Keys one batch of `KvEngine::delete_range` deletes, at most: sled
/// applies one huge batch far more slowly than many of this size.
pub const DELETE_RANGE_BATCH_KEYS: usize = 10_000;

/// sled's data file in a data directory; sled locks it (flock) while open.
const DB_FILE: &str = "db";

/// True if `dir` holds a sled database (its data file exists).
pub fn is_data_dir(dir: &Path) -> bool {
    dir.join(DB_FILE).is_file()
}

/// sled 0.34 writes its recovery snapshot to `snap.<16 hex digits>.generating`,
/// syncs it, then renames it to `snap.<16 hex digits>`. A file still called
/// `.generating` was therefore never finished (a failed write, for example
/// on a full disk, or a crash before the rename), and sled never relied on
/// it: the complete snapshot before it and the log are still there. sled
/// does not skip such files when it looks for its newest snapshot, so an
/// empty one makes the directory unopenable as "corrupt" (spacejam/sled#1527).
pub fn is_incomplete_snapshot_name(name: &str) -> bool {
    let Some(mid) = name
        .strip_prefix("snap.")
        .and_then(|rest| rest.strip_suffix(".generating"))
    else {
        return false;
    };
    mid.len() == 16 && mid.bytes().all(|b| b.is_ascii_hexdigit())
}

/// sled's incomplete snapshot files directly in `dir` (where sled keeps
/// its snapshots): name and size of each, in name order.
pub fn incomplete_snapshots(dir: &Path) -> std::io::Result<Vec<(String, u64)>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().to_string();
        let meta = entry.metadata()?;
        if meta.is_file() && is_incomplete_snapshot_name(&name) {
            found.push((name, meta.len()));
        }
    }
    found.sort();
    Ok(found)
}

/// Removes sled's incomplete snapshot files from `dir` and nothing else;
/// returns what it removed. Call it only while holding the directory's lock
/// (`DirLock`), so no sled in another process is writing one right now.
pub fn remove_incomplete_snapshots(dir: &Path) -> Result<Vec<(String, u64)>, EngineError> {
    let open_err = |e: std::io::Error| EngineError::Open {
        path: dir.display().to_string(),
        message: format!("cannot remove sled's incomplete snapshot files: {e}"),
    };
    let found = incomplete_snapshots(dir).map_err(open_err)?;
    for (name, _) in &found {
        match std::fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(open_err(e)),
        }
    }
    Ok(found)
}

/// The lock sled itself takes on a data directory (flock on its data
/// file), taken without opening sled: exclusive to prepare a directory
/// for opening, shared to copy it. Released on drop.
pub struct DirLock {
    _file: File,
}

impl DirLock {
    /// Waits up to `wait` while another process (or a sled instance of this
    /// one that is still closing) holds it. `Ok(None)`: the directory holds
    /// no database yet, so there is nothing to lock.
    pub fn acquire(dir: &Path, shared: bool, wait: Duration) -> Result<Option<DirLock>, EngineError> {
        use std::os::fd::AsRawFd;
        let db = dir.join(DB_FILE);
        let open_err = |message: String| EngineError::Open {
            path: dir.display().to_string(),
            message,
        };
        // Read-only: taking the lock writes nothing.
        let file = match File::open(&db) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(open_err(format!("cannot open {}: {e}", db.display()))),
        };
        let op = if shared { libc::LOCK_SH } else { libc::LOCK_EX } | libc::LOCK_NB;
        let deadline = Instant::now() + wait;
        loop {
            // SAFETY: flock(2) on a descriptor owned by `file`, which lives
            // as long as the lock.
            if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
                return Ok(Some(DirLock { _file: file }));
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                Some(libc::EWOULDBLOCK) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Some(libc::EWOULDBLOCK) => {
                    return Err(EngineError::Locked {
                        path: dir.display().to_string(),
                        message: format!("could not acquire lock on {}: another process holds it", db.display()),
                    })
                }
                _ => return Err(open_err(format!("cannot lock {}: {e}", db.display()))),
            }
        }
    }
}

/// Copies the data directory `src` into the empty directory `dst` for a
/// private look (`inspect`), leaving out sled's incomplete snapshot files;
/// returns their names. Hold a `DirLock` on `src` while copying.
pub fn copy_data_dir(src: &Path, dst: &Path) -> std::io::Result<Vec<String>> {
    let mut skipped = Vec::new();
    copy_tree(src, dst, true, &mut skipped)?;
    skipped.sort();
    Ok(skipped)
}

fn copy_tree(src: &Path, dst: &Path, top: bool, skipped: &mut Vec<String>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(src)? {
        let entry = entry?;
        let name = entry.file_name();
        let meta = std::fs::symlink_metadata(entry.path())?;
        let to = dst.join(&name);
        if meta.is_dir() {
            std::fs::create_dir(&to)?;
            copy_tree(&entry.path(), &to, false, skipped)?;
        } else if meta.is_file() {
            let name = name.to_string_lossy().to_string();
            if top && is_incomplete_snapshot_name(&name) {
                skipped.push(name);
                continue;
            }
            std::fs::copy(entry.path(), &to)?;
        } else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} is neither a file nor a directory", entry.path().display()),
            ));
        }
    }
    Ok(())
}

/// Total size of the files under `dir`.
pub fn tree_bytes(dir: &Path) -> std::io::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = std::fs::symlink_metadata(entry.path())?;
        total += if meta.is_dir() {
            tree_bytes(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

/// sled 0.34 behind `KvEngine`: one `sled::Db` per node, one tree per space.
pub struct SledEngine {
    db: sled::Db,
    trees: Vec<(Space, sled::Tree)>,
    /// The data directory, to say how much room is left when a write fails.
    path: PathBuf,
    /// What sled's flush leaves out: the fsync of its files.
    sync: dtx_durable::DirSync,
}

/// sled reports a held directory lock as an I/O error whose kind does not
/// say so (it wraps the lock call's error in its own text), so this is the
/// one place that reads sled's words; everything above gets
/// `EngineError::Locked`.
fn sled_lock_held(e: &sled::Error) -> bool {
    if let sled::Error::Io(io) = e {
        if io.kind() == std::io::ErrorKind::WouldBlock || io.raw_os_error() == Some(libc::EWOULDBLOCK) {
            return true;
        }
    }
    let message = e.to_string();
    message.contains("could not acquire lock")
        || message.contains("os error 11")
        || message.contains("WouldBlock")
        || message.contains("temporarily unavailable")
}

/// sled's page cache (its default is 1 GiB): the bound on the memory the
/// engine's cached pages take, whatever the retained records on disk
/// (ADR 0050; the sizing formula in docs/operations.md). Pages beyond it
/// are read again from the file (the kernel's page cache, not ours).
pub const SLED_CACHE_BYTES: u64 = 128 * 1024 * 1024;

/// Longest wait for a held directory lock on open.
pub const OPEN_LOCK_WAIT_MS: u64 = 3_000;

impl SledEngine {
    pub fn open(path: &Path) -> Result<Self, EngineError> {
        let open_err = |e: sled::Error| {
            if sled_no_space(&e) {
                no_space(path, e.to_string())
            } else if sled_lock_held(&e) {
                EngineError::Locked {
                    path: path.display().to_string(),
                    message: e.to_string(),
                }
            } else {
                EngineError::Open {
                    path: path.display().to_string(),
                    message: e.to_string(),
                }
            }
        };
        let config = sled::Config::new()
            .path(path)
            .mode(sled::Mode::HighThroughput)
            .cache_capacity(SLED_CACHE_BYTES)
            // We flush explicitly where durability is required; no timer.
            .flush_every_ms(None);
        // A directory reopened in the same process right after it was closed
        // can still be locked for a moment by sled's background I/O threads;
        // a lock held by another process is reported after this wait.
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(OPEN_LOCK_WAIT_MS);
        let db = loop {
            match config.open() {
                Err(e) if sled_lock_held(&e) && std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                other => break other.map_err(open_err)?,
            }
        };
        let mut trees = Vec::new();
        for s in Space::ALL {
            trees.push((s, db.open_tree(s.name()).map_err(open_err)?));
        }
        // sled's flush does not fsync on Linux; `sync` does after it.
        let sync = dtx_durable::DirSync::open(path).map_err(|e| EngineError::Open {
            path: path.display().to_string(),
            message: format!("cannot open the data file to sync it: {e}"),
        })?;
        Ok(SledEngine {
            db,
            trees,
            path: path.to_path_buf(),
            sync,
        })
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

pub(crate) fn no_space(path: &Path, message: String) -> EngineError {
    EngineError::NoSpace {
        path: path.display().to_string(),
        free_bytes: free_bytes(path).ok(),
        message,
    }
}

impl SledEngine {
    /// Maps a sled error of an operation on `space`; a full disk is said so.
    fn io(&self, space: &'static str) -> impl Fn(sled::Error) -> EngineError + '_ {
        move |e| {
            if sled_no_space(&e) {
                no_space(&self.path, format!("in {space}: {e}"))
            } else {
                EngineError::Io {
                    space,
                    message: e.to_string(),
                }
            }
        }
    }

    fn pairs(
        &self,
        space: Space,
        it: impl Iterator<Item = sled::Result<(sled::IVec, sled::IVec)>>,
    ) -> Result<Vec<KvPair>, EngineError> {
        it.map(|r| r.map(|(k, v)| (k.to_vec(), v.to_vec())).map_err(self.io(space.name())))
            .collect()
    }
}

impl KvEngine for SledEngine {
    fn get(&self, space: Space, key: &[u8]) -> Result<Option<Vec<u8>>, EngineError> {
        Ok(self
            .tree(space)
            .get(key)
            .map_err(self.io(space.name()))?
            .map(|v| v.to_vec()))
    }

    fn write_batch(&self, space: Space, batch: WriteBatch) -> Result<(), EngineError> {
        let mut ops = batch.ops;
        if ops.len() == 1 {
            // One key is atomic on its own. sled 0.34's `apply_batch` seals
            // and writes the current log buffer, then a buffer holding only
            // its batch marker: two more log writes (each a
            // sync_file_range and a wake-up of every idle sled I/O thread)
            // that a single insert does not cost. Raft appends one entry
            // at a time at low load, and saves its commit index alone.
            let (k, v) = ops.pop().expect("one op");
            let t = self.tree(space);
            let res = match v {
                Some(v) => t.insert(k, v).map(|_| ()),
                None => t.remove(k).map(|_| ()),
            };
            return res.map_err(self.io(space.name()));
        }
        let mut b = sled::Batch::default();
        for (k, v) in ops {
            match v {
                Some(v) => b.insert(k, v),
                None => b.remove(k),
            }
        }
        self.tree(space).apply_batch(b).map_err(self.io(space.name()))
    }

    fn scan(&self, space: Space, from: &[u8], to: Option<&[u8]>) -> Result<Vec<KvPair>, EngineError> {
        let t = self.tree(space);
        match to {
            Some(to) => self.pairs(space, t.range(from..to)),
            None => self.pairs(space, t.range(from..)),
        }
    }

    fn scan_prefix(&self, space: Space, prefix: &[u8]) -> Result<Vec<KvPair>, EngineError> {
        self.pairs(space, self.tree(space).scan_prefix(prefix))
    }

    fn scan_limit(
        &self,
        space: Space,
        from: &[u8],
        to: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<KvPair>, EngineError> {
        let t = self.tree(space);
        match to {
            Some(to) => self.pairs(space, t.range(from..to).take(limit)),
            None => self.pairs(space, t.range(from..).take(limit)),
        }
    }

    fn first(&self, space: Space) -> Result<Option<KvPair>, EngineError> {
        Ok(self
            .tree(space)
            .first()
            .map_err(self.io(space.name()))?
            .map(|(k, v)| (k.to_vec(), v.to_vec())))
    }

    fn last(&self, space: Space) -> Result<Option<KvPair>, EngineError> {
        Ok(self
            .tree(space)
            .last()
            .map_err(self.io(space.name()))?
            .map(|(k, v)| (k.to_vec(), v.to_vec())))
    }

    fn delete_range(&self, space: Space, from: &[u8], to: Option<&[u8]>) -> Result<(), EngineError> {
        loop {
            let keys = self.scan_limit(space, from, to, DELETE_RANGE_BATCH_KEYS)?;
            if keys.is_empty() {
                return Ok(());
            }
            let mut batch = WriteBatch::default();
            for (k, _) in keys {
                batch.delete(k);
            }
            self.write_batch(space, batch)?;
        }
    }

    fn flush(&self) -> Result<(), EngineError> {
        let started = std::time::Instant::now();
        // Tests hold the sync here (an fsync that never returns, as on a
        // disk whose backing store ran out) to see that a node stopping on
        // a fatal error still exits (`failpoints` only: t53).
        while dtx_failpoint::refused("engine_flush") {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        self.sync.flush(&self.db).map_err(self.io("db"))?;
        metrics::histogram!("dtx_storage_flush_seconds").record(started.elapsed().as_secs_f64());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ENOSPC and EDQUOT are "no space", also after sled re-wraps the error
    /// (its `Clone` keeps only the kind and the debug text).
    #[test]
    fn no_space_is_recognised_in_every_form() {
        let raw = std::io::Error::from_raw_os_error(libc::ENOSPC);
        assert!(is_no_space_io(&raw));
        assert!(is_no_space_io(&std::io::Error::from_raw_os_error(libc::EDQUOT)));
        let rewrapped = std::io::Error::new(raw.kind(), format!("{raw:?}"));
        assert!(is_no_space_io(&rewrapped));
        assert!(sled_no_space(&sled::Error::Io(rewrapped)));
        assert!(!is_no_space_io(&std::io::Error::from_raw_os_error(libc::EIO)));
        assert!(!sled_no_space(&sled::Error::Unsupported("x".into())));
    }

    /// A batch of one op takes the single-key path (`insert`/`remove`
    /// instead of `apply_batch`); it must write, overwrite and delete as a
    /// batch does, and be durable after `flush` across a reopen.
    #[test]
    fn batches_of_one_op_write_overwrite_and_delete_durably() {
        let dir = tempfile::tempdir().unwrap();
        let one = |k: &[u8], v: Option<&[u8]>| {
            let mut b = WriteBatch::default();
            match v {
                Some(v) => b.put(k.to_vec(), v.to_vec()),
                None => b.delete(k.to_vec()),
            }
            b
        };
        {
            let e = SledEngine::open(dir.path()).unwrap();
            e.write_batch(Space::StateMachine, one(b"a", Some(b"1"))).unwrap();
            e.write_batch(Space::StateMachine, one(b"b", Some(b"2"))).unwrap();
            e.write_batch(Space::StateMachine, one(b"a", Some(b"3"))).unwrap();
            e.write_batch(Space::StateMachine, one(b"b", None)).unwrap();
            // A key in another space is not touched by these.
            e.write_batch(Space::RaftMeta, one(b"b", Some(b"9"))).unwrap();
            // Deleting a key that is not there is not an error.
            e.write_batch(Space::StateMachine, one(b"zz", None)).unwrap();
            let mut two = WriteBatch::default();
            two.put(b"c".to_vec(), b"4".to_vec());
            two.put(b"d".to_vec(), b"5".to_vec());
            e.write_batch(Space::StateMachine, two).unwrap();
            e.flush().unwrap();
        }
        let e = SledEngine::open(dir.path()).unwrap();
        let log = e.scan(Space::StateMachine, b"", None).unwrap();
        let want: Vec<KvPair> = [(b"a", b"3"), (b"c", b"4"), (b"d", b"5")]
            .iter()
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect();
        assert_eq!(log, want);
        assert_eq!(e.get(Space::RaftMeta, b"b").unwrap(), Some(b"9".to_vec()));
    }

    #[test]
    fn sizes_read_well() {
        assert_eq!(human_bytes(0), "0 bytes");
        assert_eq!(human_bytes(1023), "1023 bytes");
        assert_eq!(human_bytes(4 * 1024 * 1024), "4194304 bytes (4.0 MiB)");
    }
}
