//! Durable storage: the Raft log store (entries in the log files of
//! `dtx_durable::wal`, its vote and log ids in the engine) and the
//! state-machine store (in the engine), both implementing openraft's
//! storage-v2 traits; the `KvEngine` trait with sled behind it. Every stored
//! value and file carries a format version, read by one rule
//! (docs/adr/0042-storage-engines.md).

pub mod engine;
pub mod log_store;
pub mod retained;
pub mod sm_store;
pub mod state;
mod unwritten;
// Stands on the stores and on the Raft transport, so it lives here, above
// `raft`, not inside it.
#[cfg(test)]
mod read_index_rounds;

use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde::Serialize;
use tracing::warn;

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
    Engine(EngineError),
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
    #[error("{dir} is not a node's data directory (it holds no sled data file `db`); give the data_dir of a node")]
    NotDataDir { dir: String },
    #[error("data directory {dir} is in use by another process (its lock is held); stop that process first")]
    InUse { dir: String },
    /// Written in another format version: a newer build's (upgrade the
    /// binary) or a pre-release layout (start on a new data directory).
    /// Nothing in the directory is changed.
    #[error("data directory {dir}: {}; it was left as it was", other_format_advice(*found, *supported))]
    OtherFormat { dir: String, found: u8, supported: u8 },
    /// A file of the directory is in a format version this build does not
    /// read (its Raft log files: `log_store::WAL_DIR`), named. Nothing in
    /// the directory is changed.
    #[error("data directory {dir}: {error}; it was left as it was")]
    FileFormat {
        dir: String,
        error: dtx_durable::format::VersionError,
    },
    #[error("data directory {dir} is damaged: {message}; the node does not start on it and never resets or repairs it: copy it aside and keep it for inspection")]
    Damaged { dir: String, message: String },
    /// Not damage: the directory is intact, and the node starts once there
    /// is room again.
    #[error("disk full: {what}; data directory {dir} has {free} on its filesystem and is not damaged. Free space there (or move the directory to a larger filesystem), then start the node again: what it acknowledged is on disk, and it catches up from the leader")]
    DiskFull { dir: String, free: String, what: String },
    /// `inspect` could not make its private copy.
    #[error("inspect reads a private copy of {dir} ({needed}) and could not make it in {scratch}: {message}; nothing in {dir} was changed. Point TMPDIR at a directory with room for the copy")]
    Scratch {
        dir: String,
        scratch: String,
        needed: String,
        message: String,
    },
}

impl From<EngineError> for OpenError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::NoSpace {
                path,
                free_bytes,
                message,
            } => OpenError::DiskFull {
                dir: path,
                free: free_text(free_bytes),
                what: format!("a write to the data directory failed ({message})"),
            },
            EngineError::Locked { path, .. } => OpenError::InUse { dir: path },
            e => OpenError::Engine(e),
        }
    }
}

/// What `OpenError::OtherFormat` says of the version found.
fn other_format_advice(found: u8, supported: u8) -> String {
    let description = dtx_durable::format::describe(found.into(), supported.into());
    if found > supported {
        description
    } else {
        format!("{description}: start this build on a new data directory")
    }
}

fn free_text(free_bytes: Option<u64>) -> String {
    match free_bytes {
        Some(b) => format!("{} free", engine::human_bytes(b)),
        None => "an unknown amount of space free".to_string(),
    }
}

/// A node does not start on a filesystem with less room than this. sled's
/// own start-up recovery may write up to one 512 KiB log segment and a
/// snapshot file before the node writes anything, and a node started on a
/// nearly full disk would stop again at its first Raft append.
pub const START_FREE_BYTES_MIN: u64 = 4 * 1024 * 1024;

const IDENTITY_KEY: &[u8] = b"identity";

fn lock_error(dir: &str, e: EngineError) -> OpenError {
    match e {
        EngineError::Locked { .. } => OpenError::InUse { dir: dir.to_string() },
        other => OpenError::from(other),
    }
}

/// Removes sled's incomplete snapshot files from `dir` (nothing else) and
/// logs each one.
fn remove_incomplete_snapshots(dir: &Path, when: &str) -> Result<(), OpenError> {
    for (name, bytes) in engine::remove_incomplete_snapshots(dir)? {
        warn!(
            data_dir = %dir.display(),
            file = %name,
            bytes,
            "removed sled's incomplete snapshot file {name} ({bytes} bytes) {when}: sled renames a snapshot once it is complete, so a .generating file is never valid (a write that failed, for example on a full disk); nothing else in the directory was changed"
        );
    }
    Ok(())
}

/// The identity record is the first thing read from a data directory, so
/// a newer format or a pre-release one shows there first.
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
///
/// Before sled opens it, and holding its lock, this removes sled's
/// incomplete snapshot files (`snap.*.generating`, never valid: see
/// `engine::is_incomplete_snapshot_name`) and nothing else, logging each
/// one; then it refuses a filesystem with less than `START_FREE_BYTES_MIN`
/// free as a full disk, having changed nothing more. If sled then fails to
/// open, the incomplete snapshot file of that attempt is removed too, so a
/// failed start never leaves a file that breaks the next one.
pub fn open_data_dir(dir: &Path, cluster_id: &str, node_id: u64) -> Result<Arc<dyn KvEngine>, OpenError> {
    let dir_s = dir.display().to_string();
    let lock_wait = Duration::from_millis(engine::OPEN_LOCK_WAIT_MS);
    let lock = engine::DirLock::acquire(dir, false, lock_wait).map_err(|e| lock_error(&dir_s, e))?;
    if lock.is_some() {
        remove_incomplete_snapshots(dir, "before opening the directory")?;
    }
    let free = engine::free_bytes(dir).map_err(|e| {
        OpenError::Engine(EngineError::Open {
            path: dir_s.clone(),
            message: format!("cannot read the free space of its filesystem: {e}"),
        })
    })?;
    if free < START_FREE_BYTES_MIN {
        return Err(OpenError::DiskFull {
            dir: dir_s,
            free: free_text(Some(free)),
            what: format!(
                "a node needs at least {} free to start, so it did not open the directory",
                engine::human_bytes(START_FREE_BYTES_MIN)
            ),
        });
    }
    // sled takes the lock itself; a process that takes it in between is
    // reported as "in use" below.
    drop(lock);
    let engine = SledEngine::open(dir).map_err(|e| {
        // Whatever went wrong, sled may have left the incomplete snapshot
        // of this attempt behind (on a full disk it does): remove it now,
        // unless another process holds the lock (then the file may be that
        // process's snapshot in the making).
        if let Ok(Some(_lock)) = engine::DirLock::acquire(dir, false, Duration::from_secs(1)) {
            if let Err(e2) = remove_incomplete_snapshots(dir, "after sled failed to open the directory") {
                warn!(data_dir = %dir_s, "{e2}");
            }
        }
        match e {
            EngineError::Locked { .. } => OpenError::InUse { dir: dir_s.clone() },
            EngineError::Open { message, .. } => OpenError::Damaged {
                dir: dir_s.clone(),
                message,
            },
            other => OpenError::from(other),
        }
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
            let has_data = dtx_durable::wal::has_entry_files(&dir.join(log_store::WAL_DIR))
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
    // The Raft log's files carry a format version of their own: one this
    // build does not read is said here, before anything opens them.
    check_log_format(dir, &dir_s)?;
    Ok(Arc::new(engine))
}

/// `OpenError::FileFormat` when a Raft log file in the data directory
/// `dir` (named `dir_s` in messages) is in a format version this build
/// does not read. Anything else wrong with the files is for the log store
/// to find when it opens them.
fn check_log_format(dir: &Path, dir_s: &str) -> Result<(), OpenError> {
    match dtx_durable::wal::check_format(&dir.join(log_store::WAL_DIR), log_store::WAL_NAME) {
        Err(dtx_durable::wal::WalError::Format(error)) => Err(OpenError::FileFormat {
            dir: dir_s.to_string(),
            error,
        }),
        _ => Ok(()),
    }
}

/// A directory of `inspect`'s own under TMPDIR, removed with everything in
/// it on drop.
struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    fn create() -> std::io::Result<ScratchDir> {
        let base = std::env::temp_dir();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let mut attempt = 0;
        loop {
            let path = base.join(format!("dtx-inspect-{}-{nanos}-{attempt}", std::process::id()));
            match std::fs::create_dir(&path) {
                Ok(()) => return Ok(ScratchDir { path }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 100 => attempt += 1,
                Err(e) => return Err(e),
            }
        }
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.path) {
            warn!("cannot remove inspect's private copy {}: {e}", self.path.display());
        }
    }
}

/// A read-only look at a stopped node's data directory, for operators and
/// tests (`coordinator inspect`).
///
/// sled writes to every directory it opens (start-up recovery writes a
/// snapshot file, zeroes a torn log tail, writes its config), so this never
/// opens sled on `dir`: it copies `dir` to a private directory under TMPDIR
/// while holding the directory's lock (shared, so no node runs on it and
/// none starts meanwhile), leaves out sled's incomplete snapshot files, and
/// reads the copy. Nothing in `dir` is written, created or removed.
pub fn inspect(dir: &Path) -> Result<serde_json::Value, OpenError> {
    let dir_s = dir.display().to_string();
    if !dir.exists() {
        return Err(OpenError::Missing { dir: dir_s });
    }
    if !engine::is_data_dir(dir) {
        return Err(OpenError::NotDataDir { dir: dir_s });
    }
    let lock_wait = Duration::from_millis(engine::OPEN_LOCK_WAIT_MS);
    let lock = engine::DirLock::acquire(dir, true, lock_wait).map_err(|e| lock_error(&dir_s, e))?;
    // What a node would refuse, refused in the same words (this reads the
    // log files' first bytes only).
    check_log_format(dir, &dir_s)?;
    let needed = engine::tree_bytes(dir).unwrap_or(0);
    let scratch_err = |e: std::io::Error| {
        let base = std::env::temp_dir();
        let message = if engine::is_no_space_io(&e) {
            let free = engine::free_bytes(&base).map(engine::human_bytes);
            format!(
                "disk full there ({} free): {e}",
                free.unwrap_or_else(|_| "unknown".to_string())
            )
        } else {
            e.to_string()
        };
        OpenError::Scratch {
            dir: dir_s.clone(),
            scratch: base.display().to_string(),
            needed: engine::human_bytes(needed),
            message,
        }
    };
    // Declared before the engine: removed after it is closed.
    let scratch = ScratchDir::create().map_err(scratch_err)?;
    let copy = scratch.path.join("data");
    std::fs::create_dir(&copy).map_err(scratch_err)?;
    let ignored = engine::copy_data_dir(dir, &copy).map_err(scratch_err)?;
    drop(lock);
    let engine: Arc<dyn KvEngine> = Arc::new(SledEngine::open(&copy).map_err(|e| match e {
        EngineError::NoSpace { message, .. } => {
            scratch_err(std::io::Error::new(std::io::ErrorKind::StorageFull, message))
        }
        other => OpenError::Damaged {
            dir: dir_s.clone(),
            message: format!("{other} (seen on a private copy; {dir_s} itself was not changed)"),
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
    // The log as a node opening the copy would see it (a torn tail cut).
    let log = LogStore::open(engine.clone(), &copy).map_err(|e| damaged(e.to_string()))?;
    let bounds = log.bounds();
    drop(log);
    let (first_log, last_log) = (bounds.map(|b| b.0), bounds.map(|b| b.1));
    let sm = StateMachineStore::open(engine.clone()).map_err(|e| damaged(e.to_string()))?;
    let st = sm.state();
    // The same fields and names as `coordinator admin txn show --json`
    // (and the API's StatusResponse), plus the idempotency key.
    // The records in memory and the retained ones (ADR 0050), by txid.
    let txids = st.all_txids().map_err(|e| damaged(e.to_string()))?;
    let mut records: Vec<serde_json::Value> = Vec::with_capacity(txids.len());
    for txid in txids {
        let one = st.with_txid(txid, |t| {
            let r = t.get(txid)?;
            Some(serde_json::json!({
                "txid": r.txid,
                "idempotency_key": r.idempotency_key,
                "state": r.phase.name(),
                "begun_unix_ms": r.begun_ms,
                "deadline_unix_ms": r.deadline_ms,
                "one_phase": r.one_phase,
                "owner": t.owner(r.txid).unwrap_or(""),
                "decision": r.decision().map(|d| serde_json::json!({
                    "outcome": d.outcome.to_string(),
                    "source": d.source.name(),
                    "term": d.term,
                    "decided_unix_ms": d.decided_ms,
                    "note": d.note,
                })),
                "participants": r.participants.iter().map(|p| {
                    let dropped = t.drop_of(r.txid, &p.id);
                    serde_json::json!({
                        "id": p.id,
                        "address": p.address,
                        "acked": p.acked,
                        "dropped": dropped.is_some(),
                        "dropped_note": dropped.map(|d| d.note.as_str()).unwrap_or(""),
                        "dropped_unix_ms": dropped.map(|d| d.dropped_ms).unwrap_or(0),
                    })
                }).collect::<Vec<_>>(),
            }))
        });
        records.extend(one.map_err(|e| damaged(e.to_string()))?);
    }
    Ok(serde_json::json!({
        "data_dir": dir_s,
        "cluster_id": identity.as_ref().map(|i| i.cluster_id.clone()),
        "node_id": identity.as_ref().map(|i| i.node_id),
        "log_first_index": first_log,
        "log_last_index": last_log,
        "last_applied_index": st.last_applied.map(|l| l.index),
        "next_txid": st.table.next_txid(),
        "ignored_incomplete_snapshots": ignored,
        "transactions": records,
        // Operators' settlements of other incarnations' txids (ADR 0040).
        "settlements": st.settlements.iter().map(|((incarnation, txid), x)| serde_json::json!({
            "incarnation": format!("{incarnation:016x}"),
            "txid": txid,
            "outcome": x.outcome.to_string(),
            "note": x.note,
            "settled_unix_ms": x.settled_ms,
            "term": x.term,
        })).collect::<Vec<_>>(),
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

    /// A data directory of this build's format version opens again; one a
    /// newer build wrote is refused with the version found, the one this
    /// build reads and what to do, and left as it was.
    #[test]
    fn a_newer_format_version_is_refused_by_name_and_this_one_reopens() {
        let dir = tempfile::tempdir().unwrap();
        drop(open_data_dir(dir.path(), "c", 1).unwrap());
        let engine = open_data_dir(dir.path(), "c", 1).expect("this build's directory reopens");
        let mut identity = engine.get(Space::NodeMeta, IDENTITY_KEY).unwrap().unwrap();
        assert_eq!(identity[0], codec::FORMAT_VERSION);
        identity[0] = codec::FORMAT_VERSION + 4;
        let mut b = engine::WriteBatch::default();
        b.put(IDENTITY_KEY.to_vec(), identity.clone());
        engine.write_batch(Space::NodeMeta, b).unwrap();
        engine.flush().unwrap();
        drop(engine);

        let err = open_data_dir(dir.path(), "c", 1).err().expect("refused");
        assert!(matches!(err, OpenError::OtherFormat { .. }), "{err}");
        assert_eq!(
            err.to_string(),
            format!(
                "data directory {}: format version {} is newer than this build reads ({}): upgrade the binary; it was left as it was",
                dir.path().display(),
                codec::FORMAT_VERSION + 4,
                codec::FORMAT_VERSION
            )
        );
        let engine = SledEngine::open(dir.path()).unwrap();
        assert_eq!(engine.get(Space::NodeMeta, IDENTITY_KEY).unwrap(), Some(identity));
    }

    fn digest(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                out.extend(digest(&p));
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
        out.sort();
        out
    }

    /// A node's data directory with a few writes, closed again.
    fn stopped_data_dir() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let engine = open_data_dir(dir.path(), "c", 3).unwrap();
        let mut b = engine::WriteBatch::default();
        b.put(b"k".to_vec(), vec![7; 100]);
        engine.write_batch(Space::StateMachine, b).unwrap();
        engine.flush().unwrap();
        drop(engine);
        dir
    }

    /// What sled 0.34 leaves when its start-up snapshot write fails (for
    /// example on a full disk): an empty `snap.<lsn>.generating` that sorts
    /// after every complete snapshot.
    fn plant_sled_leftover(dir: &Path) -> String {
        let newest = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| {
                let n = e.unwrap().file_name().to_string_lossy().to_string();
                u64::from_str_radix(n.strip_prefix("snap.")?, 16).ok()
            })
            .max()
            .unwrap_or(0);
        let name = format!("snap.{:016X}.generating", newest + 1);
        std::fs::File::create(dir.join(&name)).unwrap();
        name
    }

    #[test]
    fn only_sleds_incomplete_snapshot_names_match() {
        assert!(engine::is_incomplete_snapshot_name("snap.00000000000A3F10.generating"));
        assert!(engine::is_incomplete_snapshot_name("snap.00000000000a3f10.generating"));
        for other in [
            "snap.00000000000A3F10",
            "snap.A3F10.generating",
            "snap.00000000000A3F1G.generating",
            "xsnap.00000000000A3F10.generating",
            "snap.00000000000A3F10.generating.bak",
            "notes.generating",
            "db",
            "conf",
        ] {
            assert!(!engine::is_incomplete_snapshot_name(other), "{other}");
        }
    }

    /// Invariant 4 (a node must come back with what it
    /// acknowledged): an empty `.generating` file made sled refuse the
    /// directory as corrupt forever. Start-up removes it, and only it.
    #[test]
    fn start_up_removes_sleds_incomplete_snapshot_and_nothing_else() {
        let dir = stopped_data_dir();
        let leftover = plant_sled_leftover(dir.path());
        std::fs::write(dir.path().join("notes.generating"), b"an operator's file").unwrap();
        // The bug this guards against: sled itself cannot open it now.
        let err = SledEngine::open(dir.path())
            .err()
            .expect("sled takes the empty file for its newest snapshot");
        assert!(!err.is_no_space(), "{err}");

        let before: Vec<_> = digest(dir.path())
            .into_iter()
            .filter(|(p, _)| !p.ends_with(&leftover))
            .collect();
        let engine = open_data_dir(dir.path(), "c", 3).expect("opens once the leftover is gone");
        assert!(!dir.path().join(&leftover).exists());
        assert_eq!(engine.get(Space::StateMachine, b"k").unwrap(), Some(vec![7; 100]));
        drop(engine);
        let after = digest(dir.path());
        assert!(after
            .iter()
            .any(|(p, b)| p.ends_with("notes.generating") && b == b"an operator's file"));
        // Every other file is still there (sled rewrites its own).
        for (p, _) in &before {
            assert!(after.iter().any(|(q, _)| q == p), "{} disappeared", p.display());
        }
    }

    /// `inspect` is read-only: not a byte of the directory changes, even
    /// with sled's leftover in it (which it ignores and names).
    #[test]
    fn inspect_writes_nothing_and_ignores_incomplete_snapshots() {
        let dir = stopped_data_dir();
        let leftover = plant_sled_leftover(dir.path());
        let before = digest(dir.path());
        let v = inspect(dir.path()).expect("inspect");
        assert_eq!(digest(dir.path()), before, "inspect changed the directory");
        assert_eq!(v["node_id"], serde_json::json!(3));
        assert_eq!(v["cluster_id"], serde_json::json!("c"));
        assert_eq!(v["ignored_incomplete_snapshots"], serde_json::json!([leftover]));
        // Twice in a row, same answer, still nothing written.
        assert_eq!(inspect(dir.path()).unwrap(), v);
        assert_eq!(digest(dir.path()), before);
    }

    /// A directory that holds no node data is refused by name, and no sled
    /// database is created in it.
    #[test]
    fn inspect_refuses_a_directory_without_node_data() {
        let dir = tempfile::tempdir().unwrap();
        let err = inspect(dir.path()).expect_err("refused");
        assert!(matches!(err, OpenError::NotDataDir { .. }), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        let err = inspect(&dir.path().join("nope")).expect_err("refused");
        assert!(matches!(err, OpenError::Missing { .. }), "{err}");
    }

    /// A full disk is never reported as damage; the message says what is
    /// free and what to do.
    #[test]
    fn disk_full_is_reported_as_disk_full() {
        let e = OpenError::from(EngineError::NoSpace {
            path: "/data/n1".into(),
            free_bytes: Some(8192),
            message: "IO error: No space left on device (os error 28)".into(),
        });
        let text = e.to_string();
        assert!(matches!(e, OpenError::DiskFull { .. }), "{text}");
        assert!(text.starts_with("disk full"), "{text}");
        assert!(text.contains("8192 bytes (8.0 KiB) free"), "{text}");
        assert!(text.contains("Free space there"), "{text}");
        assert!(!text.contains("is damaged"), "{text}");
    }

    /// A directory another open holds is reported as in use (a typed
    /// `EngineError::Locked` from the engine), never as damaged.
    #[test]
    fn a_directory_held_by_another_open_is_in_use_not_damaged() {
        let dir = tempfile::tempdir().unwrap();
        let _held = open_data_dir(dir.path(), "c1", 1).expect("first open");
        let err = open_data_dir(dir.path(), "c1", 1).err().expect("second open refused");
        assert!(matches!(err, OpenError::InUse { .. }), "{err}");
    }
}
