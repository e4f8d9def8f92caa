//! Backup and restore (ADR 0017): a consistent copy of a running cluster's
//! replicated state in one self-describing file, and a new node's data
//! directory written from it (`coordinator restore`, like `etcdctl snapshot
//! restore`). Pure library: no command-line concerns.
//!
//! The file (all integers big-endian):
//!
//! ```text
//! magic           8 bytes   "DTXBACK\n"
//! format version  u16       BACKUP_FORMAT_VERSION
//! header length   u32       H
//! header          H bytes   BackupHeader, in the codec (version byte + bincode)
//! snapshot length u64       S
//! snapshot        S bytes   the state machine's snapshot, exactly as the
//!                           node's snapshot builder encodes it
//! checksum        32 bytes  SHA-256 of every byte before it
//! ```
//!
//! The snapshot is the one openraft ships to a lagging follower (records,
//! next txid, retired node ids, owners, drops, sagas, incarnations,
//! settlements), taken at one applied log index; the header names that
//! index, its term, the membership then, and the cluster. A truncated or
//! damaged file is refused before anything is decoded. The header and the
//! snapshot decode in this build's codec format version only: a state of
//! another version (a newer build's, or a pre-release layout) is refused
//! naming both versions, never decoded as another layout
//! (docs/adr/0042-storage-engines.md).

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::fs::File;
use std::io::Cursor;
use std::io::Read;
use std::io::Write;
use std::path::Path;
use std::path::PathBuf;

use openraft::storage::RaftLogStorage;
use openraft::storage::RaftStateMachine;
use openraft::Membership;
use serde::Deserialize;
use serde::Serialize;
use sha2::Digest;
use sha2::Sha256;

use crate::codec;
use crate::config::Member;
use crate::raft::LogId;
use crate::raft::NodeId;
use crate::raft::NodeInfo;
use crate::raft::SnapshotMeta;
use crate::raft::StoredMembership;
use crate::raft::Vote;
use crate::sm::Phase;
use crate::sm::TxTable;
use crate::store;
use crate::store::LogStore;
use crate::store::StateMachineStore;

/// The first bytes of every backup file. The newline catches a transfer
/// that rewrote line ends.
pub const MAGIC: &[u8; 8] = b"DTXBACK\n";
/// The layout above. Bumped when it changes; a file of another version is
/// refused by name.
pub const BACKUP_FORMAT_VERSION: u16 = 1;
/// Bytes of backup file per streamed `BackupChunk` (256 KiB): well under
/// gRPC's default 4 MiB message limit of any client.
pub const BACKUP_CHUNK_BYTES: usize = 256 * 1024;
/// Largest backup file read or received, in bytes: the largest snapshot the
/// codec decodes (`limits::DECODE_BYTES_MAX`) plus 1 MiB for the rest.
pub const BACKUP_BYTES_MAX: u64 = crate::limits::DECODE_BYTES_MAX as u64 + 1024 * 1024;
/// Largest encoded header, in bytes.
const HEADER_BYTES_MAX: usize = 1024 * 1024;
const CHECKSUM_BYTES: usize = 32;
/// magic + version + header length + snapshot length + checksum.
const FIXED_BYTES: usize = MAGIC.len() + 2 + 4 + 8 + CHECKSUM_BYTES;

/// What a backup says about itself, before the state.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct BackupHeader {
    /// The cluster backed up.
    pub cluster_id: String,
    /// The node that answered.
    pub node_id: NodeId,
    /// That node's clock when it took the backup, ms since the Unix epoch.
    pub created_unix_ms: u64,
    /// True when the node was the leader and confirmed it with a quorum
    /// (read-index) first: the backup holds every decision applied anywhere
    /// before the call. False: the node's own applied state, unconfirmed.
    pub confirmed: bool,
    /// The highest Raft term the answering node knew. A restored cluster
    /// starts above it, so participants, which refuse messages of older
    /// terms than they saw (invariant 9), take its deliveries.
    pub term: u64,
    /// The applied log id the state is the state of.
    pub last_applied: LogId,
    /// The membership applied at that point.
    pub membership: StoredMembership,
    /// Summary of the state (also in the snapshot): the next txid handed out.
    pub next_txid: u64,
    /// Summary: transaction records held.
    pub transactions: u64,
    /// The version of the coordinator that wrote it.
    pub coordinator_version: String,
}

/// A backup read and checked: header, the snapshot's bytes and what they
/// decode to.
pub struct Backup {
    pub header: BackupHeader,
    pub snapshot: Vec<u8>,
    pub table: TxTable,
    /// SHA-256 of the file (its last 32 bytes).
    pub checksum: [u8; 32],
    /// Size of the file, bytes.
    pub size: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "not a dtx backup file: it does not start with the backup magic bytes {:?}",
        String::from_utf8_lossy(MAGIC)
    )]
    NotABackup,
    #[error("backup file format version {found} is not supported (this build reads version {BACKUP_FORMAT_VERSION}); use the coordinator that wrote it")]
    Version { found: u16 },
    #[error("the backup is truncated or damaged and is refused: {0}")]
    Damaged(String),
    /// Intact, but its state is in another data format version (the codec's).
    #[error("the backup's state is in data format version {found}, which this build cannot read (it reads version {}); use a coordinator of the version that wrote it ({written_by})", codec::FORMAT_VERSION)]
    DataVersion { found: u8, written_by: String },
    #[error("the backup is {size} bytes, more than the {BACKUP_BYTES_MAX} bytes this build reads")]
    TooLarge { size: u64 },
    #[error("{path} exists; refusing to overwrite it (pass --force to replace it)")]
    Exists { path: String },
    #[error("cannot encode the backup: {0}")]
    Encode(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> BackupError + '_ {
    move |source| BackupError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// The bytes of a backup file of `header` and `snapshot` (the state
/// machine's snapshot encoding).
pub fn encode_backup(header: &BackupHeader, snapshot: &[u8]) -> Result<Vec<u8>, BackupError> {
    let h = codec::encode(header).map_err(|e| BackupError::Encode(e.to_string()))?;
    if h.len() > HEADER_BYTES_MAX {
        return Err(BackupError::Encode(format!("header of {} bytes", h.len())));
    }
    let mut out = Vec::with_capacity(FIXED_BYTES + h.len() + snapshot.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&BACKUP_FORMAT_VERSION.to_be_bytes());
    out.extend_from_slice(&(h.len() as u32).to_be_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(&(snapshot.len() as u64).to_be_bytes());
    out.extend_from_slice(snapshot);
    let sum = Sha256::digest(&out);
    out.extend_from_slice(&sum);
    if out.len() as u64 > BACKUP_BYTES_MAX {
        return Err(BackupError::TooLarge { size: out.len() as u64 });
    }
    Ok(out)
}

/// Reads a backup from its bytes: magic, version, lengths, checksum, then
/// header and snapshot, each refused with the reason.
pub fn decode_backup(bytes: &[u8]) -> Result<Backup, BackupError> {
    let size = bytes.len() as u64;
    if size > BACKUP_BYTES_MAX {
        return Err(BackupError::TooLarge { size });
    }
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err(BackupError::NotABackup);
    }
    if bytes.len() < FIXED_BYTES {
        return Err(BackupError::Damaged(format!(
            "it is {size} bytes, shorter than the smallest backup ({FIXED_BYTES} bytes)"
        )));
    }
    let mut at = MAGIC.len();
    let version = u16::from_be_bytes([bytes[at], bytes[at + 1]]);
    at += 2;
    if version != BACKUP_FORMAT_VERSION {
        return Err(BackupError::Version { found: version });
    }
    let header_len = u32::from_be_bytes(bytes[at..at + 4].try_into().expect("4 bytes")) as u64;
    at += 4;
    // The lengths say how long the file must be; a truncated file (or a
    // damaged length) shows here, before the checksum.
    let expected_min = FIXED_BYTES as u64 + header_len;
    if expected_min > size {
        return Err(BackupError::Damaged(format!(
            "its header length says at least {expected_min} bytes, but the file is {size} bytes"
        )));
    }
    let header_end = at + header_len as usize;
    let snap_len = u64::from_be_bytes(bytes[header_end..header_end + 8].try_into().expect("8 bytes"));
    let expected = expected_min.saturating_add(snap_len);
    if expected != size {
        return Err(BackupError::Damaged(format!(
            "its lengths say {expected} bytes, but the file is {size} bytes"
        )));
    }
    let body_end = bytes.len() - CHECKSUM_BYTES;
    let sum = Sha256::digest(&bytes[..body_end]);
    let mut checksum = [0u8; 32];
    checksum.copy_from_slice(&bytes[body_end..]);
    if sum.as_slice() != checksum {
        return Err(BackupError::Damaged(format!(
            "SHA-256 mismatch: the file says {}, its content hashes to {}",
            hex(&checksum),
            hex(&sum)
        )));
    }
    // The checksum held: a part that does not decode was written by
    // another build, or by a bug.
    let header: BackupHeader = codec::decode(&bytes[at..header_end]).map_err(|e| match e {
        codec::CodecError::Version { found } => BackupError::DataVersion {
            found,
            written_by: "see its header".into(),
        },
        e => BackupError::Damaged(format!("the header does not decode: {e}")),
    })?;
    let snapshot = bytes[header_end + 8..body_end].to_vec();
    let table = store::sm_store::decode_snapshot_table(&snapshot).map_err(|e| match e {
        codec::CodecError::Version { found } => BackupError::DataVersion {
            found,
            written_by: format!("coordinator {}", header.coordinator_version),
        },
        e => BackupError::Damaged(format!("the state does not decode: {e}")),
    })?;
    if table.next_txid() != header.next_txid || table.len() as u64 != header.transactions {
        return Err(BackupError::Damaged(format!(
            "the header says next txid {} and {} transactions, the state holds {} and {}",
            header.next_txid,
            header.transactions,
            table.next_txid(),
            table.len()
        )));
    }
    Ok(Backup {
        header,
        snapshot,
        table,
        checksum,
        size,
    })
}

/// Reads and checks the backup file at `path`.
pub fn read_backup(path: &Path) -> Result<Backup, BackupError> {
    let f = File::open(path).map_err(io_err(path))?;
    let size = f.metadata().map_err(io_err(path))?.len();
    if size > BACKUP_BYTES_MAX {
        return Err(BackupError::TooLarge { size });
    }
    let mut bytes = Vec::with_capacity(size as usize);
    f.take(BACKUP_BYTES_MAX + 1)
        .read_to_end(&mut bytes)
        .map_err(io_err(path))?;
    decode_backup(&bytes)
}

/// Lower-case hex of `b`.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Writes a backup file as its bytes arrive: into a temporary file beside
/// the target, which `finish` checks (read back from disk and decoded),
/// syncs and only then moves to the target's name. Dropped unfinished, it
/// removes the temporary file: no half-written backup is ever found under
/// the target's name.
pub struct BackupWriter {
    target: PathBuf,
    temp: PathBuf,
    file: Option<File>,
    written: u64,
    force: bool,
    done: bool,
}

impl BackupWriter {
    /// Refuses an existing `target` unless `force`.
    pub fn create(target: &Path, force: bool) -> Result<BackupWriter, BackupError> {
        if !force && target.symlink_metadata().is_ok() {
            return Err(BackupError::Exists {
                path: target.display().to_string(),
            });
        }
        let name = target
            .file_name()
            .ok_or_else(|| BackupError::Io {
                path: target.display().to_string(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a file name"),
            })?
            .to_string_lossy()
            .to_string();
        let dir = parent_dir(target);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let temp = dir.join(format!(".{name}.partial-{}-{nanos}", std::process::id()));
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
            .map_err(io_err(&temp))?;
        Ok(BackupWriter {
            target: target.to_path_buf(),
            temp,
            file: Some(file),
            written: 0,
            force,
            done: false,
        })
    }

    /// Appends the next bytes.
    pub fn write(&mut self, data: &[u8]) -> Result<(), BackupError> {
        self.written += data.len() as u64;
        if self.written > BACKUP_BYTES_MAX {
            return Err(BackupError::TooLarge { size: self.written });
        }
        let file = self.file.as_mut().expect("not finished");
        file.write_all(data).map_err(io_err(&self.temp))
    }

    /// Syncs, checks the file as written (a backup that does not read back
    /// is refused and removed), and gives it the target's name.
    pub fn finish(mut self) -> Result<Backup, BackupError> {
        let file = self.file.take().expect("finished once");
        file.sync_all().map_err(io_err(&self.temp))?;
        drop(file);
        let backup = read_backup(&self.temp)?;
        if self.force {
            std::fs::rename(&self.temp, &self.target).map_err(io_err(&self.target))?;
        } else {
            // A hard link fails if the target appeared meanwhile: never
            // replaced without --force. A filesystem without hard links
            // gets a rename after one more look.
            match std::fs::hard_link(&self.temp, &self.target) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    return Err(BackupError::Exists {
                        path: self.target.display().to_string(),
                    })
                }
                Err(_) if self.target.symlink_metadata().is_ok() => {
                    return Err(BackupError::Exists {
                        path: self.target.display().to_string(),
                    })
                }
                Err(_) => {
                    std::fs::rename(&self.temp, &self.target).map_err(io_err(&self.target))?;
                }
            }
            if self.temp.symlink_metadata().is_ok() {
                std::fs::remove_file(&self.temp).map_err(io_err(&self.temp))?;
            }
        }
        self.done = true;
        sync_dir(&parent_dir(&self.target)).map_err(io_err(&self.target))?;
        Ok(backup)
    }
}

impl Drop for BackupWriter {
    fn drop(&mut self) {
        if !self.done {
            self.file.take();
            let _ = std::fs::remove_file(&self.temp);
        }
    }
}

/// The directory `path` is in ("." for a bare name).
fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// What `restore_data_dir` writes: one node of a NEW cluster.
#[derive(Clone, Debug)]
pub struct RestorePlan {
    /// The new cluster's id; must differ from the backed-up cluster's.
    pub cluster_id: String,
    /// This node's id, one of `members`.
    pub node_id: NodeId,
    /// Every voter of the new cluster, as advertised (as in
    /// `bootstrap.members`).
    pub members: Vec<Member>,
    /// An empty or absent directory.
    pub data_dir: PathBuf,
    /// Txids to skip: the new cluster's next txid is the backup's plus
    /// this. For a backup older than the old cluster's last work: txids it
    /// handed out after the backup are then not handed out again
    /// (invariant 10). 0: exactly the backed-up state. Every node of the
    /// new cluster must get the same number (the restore id says so).
    pub skip_txids: u64,
}

/// What a restore wrote.
#[derive(Clone, Debug)]
pub struct RestoreSummary {
    pub data_dir: PathBuf,
    pub cluster_id: String,
    pub node_id: NodeId,
    pub last_applied: LogId,
    /// The vote written: the new cluster's first election is above it.
    pub term: u64,
    pub next_txid: u64,
    pub transactions: u64,
    /// Same on every node restored from the same backup into the same
    /// cluster: compare it across the new cluster's nodes before starting
    /// them.
    pub restore_id: String,
}

#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    #[error("{0}")]
    Invalid(String),
    #[error("data directory {dir} is not empty ({entries} entries); restore writes a new node's data directory and never touches an existing one: give an empty or absent directory")]
    NotEmpty { dir: String, entries: usize },
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write the restored state: {0}")]
    Write(String),
}

fn check_plan(backup: &Backup, plan: &RestorePlan) -> Result<(), RestoreError> {
    let bad = |m: String| Err(RestoreError::Invalid(m));
    let c = &plan.cluster_id;
    if c.is_empty() || c.len() > 64 || !c.chars().all(|ch| ch.is_ascii_alphanumeric() || "-_.".contains(ch)) {
        return bad(format!(
            "cluster id {c:?} must be 1..=64 characters of ASCII letters, digits, '-', '_' or '.'"
        ));
    }
    if *c == backup.header.cluster_id {
        return bad(format!(
            "the new cluster's id must differ from the backed-up cluster's ({c:?}): nodes of the old cluster that \
             still run, or come back, would otherwise be taken for members of the new one"
        ));
    }
    if plan.members.is_empty() {
        return bad("the new cluster needs its members (id, raft address, api address of each)".into());
    }
    let mut ids = BTreeSet::new();
    for m in &plan.members {
        if m.id == 0 || !ids.insert(m.id) {
            return bad(format!("member node id {} is 0 or repeated", m.id));
        }
        for (field, v) in [("raft address", &m.raft_addr), ("api address", &m.api_addr)] {
            v.parse::<std::net::SocketAddr>()
                .map_err(|e| RestoreError::Invalid(format!("member {}: {field} {v:?} is not IP:port: {e}", m.id)))?;
        }
        if backup.table.is_retired_node_id(m.id) {
            return bad(format!(
                "node id {} belonged to a node removed from the backed-up cluster, and node ids are never reused; \
                 give the new member another id",
                m.id
            ));
        }
    }
    if backup.header.next_txid.checked_add(plan.skip_txids).is_none() {
        return bad(format!("cannot skip {} txids: past the largest txid", plan.skip_txids));
    }
    if !ids.contains(&plan.node_id) {
        return bad(format!(
            "this node's id {} is not one of the members {:?}",
            plan.node_id, ids
        ));
    }
    Ok(())
}

/// Entries in `dir` (0 for an absent one).
fn entries_in(dir: &Path) -> Result<usize, RestoreError> {
    match std::fs::read_dir(dir) {
        Ok(rd) => Ok(rd.count()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
        Err(e) => Err(RestoreError::Io {
            what: "cannot read data directory",
            path: dir.display().to_string(),
            source: e,
        }),
    }
}

/// The restore id: the backup's checksum, the new cluster, the txids
/// skipped and the members.
fn restore_id(backup: &Backup, plan: &RestorePlan) -> String {
    let mut h = Sha256::new();
    h.update(backup.checksum);
    h.update(plan.cluster_id.as_bytes());
    h.update([0]);
    h.update(plan.skip_txids.to_be_bytes());
    let mut members = plan.members.clone();
    members.sort_by_key(|m| m.id);
    for m in &members {
        h.update(m.id.to_be_bytes());
        h.update(m.raft_addr.as_bytes());
        h.update([0]);
        h.update(m.api_addr.as_bytes());
        h.update([0]);
    }
    hex(&h.finalize()[..8])
}

/// Writes the data directory of node `plan.node_id` of a new cluster that
/// holds exactly the backed-up state: the state machine and a snapshot of
/// it at the backed-up log id (with the new membership), the log purged up
/// to there, and a vote at the backed-up term (so the first election of the
/// new cluster is in a higher term than any the old one used). `coordinator
/// serve` then starts on it without `--bootstrap`.
///
/// It is built in a temporary directory beside `plan.data_dir` and renamed
/// to it when complete: a restore that fails leaves no half-written data
/// directory.
pub async fn restore_data_dir(backup: &Backup, plan: &RestorePlan) -> Result<RestoreSummary, RestoreError> {
    check_plan(backup, plan)?;
    let dir = &plan.data_dir;
    let entries = entries_in(dir)?;
    if entries > 0 {
        return Err(RestoreError::NotEmpty {
            dir: dir.display().to_string(),
            entries,
        });
    }
    let parent = parent_dir(dir);
    std::fs::create_dir_all(&parent).map_err(|source| RestoreError::Io {
        what: "cannot create",
        path: parent.display().to_string(),
        source,
    })?;
    let name = dir
        .file_name()
        .ok_or_else(|| RestoreError::Invalid(format!("{} does not name a directory", dir.display())))?
        .to_string_lossy()
        .to_string();
    let temp = parent.join(format!(".{name}.restoring-{}", std::process::id()));
    if temp.exists() {
        std::fs::remove_dir_all(&temp).map_err(|source| RestoreError::Io {
            what: "cannot remove a leftover of an earlier restore",
            path: temp.display().to_string(),
            source,
        })?;
    }
    std::fs::create_dir(&temp).map_err(|source| RestoreError::Io {
        what: "cannot create",
        path: temp.display().to_string(),
        source,
    })?;
    let written = write_state(backup, plan, &temp).await;
    let summary = match written {
        Ok(s) => s,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&temp);
            return Err(e);
        }
    };
    // An empty directory is replaced by the rename (rename(2)); an absent
    // one is created by it.
    if let Err(source) = std::fs::rename(&temp, dir) {
        let _ = std::fs::remove_dir_all(&temp);
        return Err(RestoreError::Io {
            what: "cannot move the restored directory into place (a mount point cannot be replaced: restore into a directory below it)",
            path: dir.display().to_string(),
            source,
        });
    }
    let _ = sync_dir(&parent);
    Ok(RestoreSummary {
        data_dir: dir.clone(),
        ..summary
    })
}

async fn write_state(backup: &Backup, plan: &RestorePlan, dir: &Path) -> Result<RestoreSummary, RestoreError> {
    let werr = |e: &dyn std::fmt::Display| RestoreError::Write(e.to_string());
    let h = &backup.header;
    let last_applied = h.last_applied;
    let voters: BTreeSet<NodeId> = plan.members.iter().map(|m| m.id).collect();
    let nodes: BTreeMap<NodeId, NodeInfo> = crate::raft::nodes_of(&plan.members);
    let membership = StoredMembership::new(Some(last_applied), Membership::new(vec![voters], nodes));
    let id = restore_id(backup, plan);
    let meta = SnapshotMeta {
        last_log_id: Some(last_applied),
        last_membership: membership,
        snapshot_id: format!("restore-{id}"),
    };
    let term = h.term.max(last_applied.leader_id.term);
    let want_next_txid = h.next_txid + plan.skip_txids;
    // Always re-encoded: the backed-up incarnation ends here (ADR 0033),
    // so txids from the backup's next one on are the new cluster's, never
    // taken for those the old cluster handed out after the backup.
    let snapshot = store::sm_store::snapshot_for_restore(&backup.snapshot, want_next_txid).map_err(|e| werr(&e))?;
    let engine = store::open_data_dir(dir, &plan.cluster_id, plan.node_id).map_err(|e| werr(&e))?;
    let mut sm = StateMachineStore::open(engine.clone()).map_err(|e| werr(&e))?;
    // The state machine's own snapshot installation: the same decoding and
    // the same atomic replacement a follower does.
    sm.install_snapshot(&meta, Box::new(Cursor::new(snapshot)))
        .await
        .map_err(|e| werr(&e))?;
    let mut log = LogStore::open(engine.clone(), dir).map_err(|e| werr(&e))?;
    log.save_vote(&Vote::new(term, plan.node_id))
        .await
        .map_err(|e| werr(&e))?;
    log.purge(last_applied).await.map_err(|e| werr(&e))?;
    log.save_committed(Some(last_applied)).await.map_err(|e| werr(&e))?;
    engine.flush().map_err(|e| werr(&e))?;
    let (next_txid, transactions) = {
        let st = sm.state();
        (st.table.next_txid(), st.transactions())
    };
    if next_txid != want_next_txid || transactions != h.transactions || sm.state().last_applied != Some(last_applied) {
        return Err(RestoreError::Write(format!(
            "the restored state does not read back as backed up (next txid {next_txid}, {transactions} transactions)"
        )));
    }
    Ok(RestoreSummary {
        data_dir: dir.to_path_buf(),
        cluster_id: plan.cluster_id.clone(),
        node_id: plan.node_id,
        last_applied,
        term,
        next_txid,
        transactions,
        restore_id: id,
    })
}

/// A backup's content as JSON (for `coordinator restore --verify` and
/// operators): header, size, checksum and a summary of the state.
pub fn describe(b: &Backup) -> serde_json::Value {
    let h = &b.header;
    let mut phases: BTreeMap<&str, u64> = BTreeMap::new();
    for r in b.table.records() {
        *phases.entry(r.phase.name()).or_default() += 1;
    }
    let undelivered = b
        .table
        .records()
        .filter(|r| matches!(r.phase, Phase::Decided(_)) && !r.all_acked())
        .count();
    let membership = h.membership.membership();
    let voters: BTreeSet<NodeId> = membership.voter_ids().collect();
    serde_json::json!({
        "format_version": BACKUP_FORMAT_VERSION,
        "size_bytes": b.size,
        "sha256": hex(&b.checksum),
        "cluster_id": h.cluster_id,
        "answered_by_node": h.node_id,
        "created_unix_ms": h.created_unix_ms,
        "confirmed_by_quorum": h.confirmed,
        "term": h.term,
        "last_applied": {"term": h.last_applied.leader_id.term, "index": h.last_applied.index},
        "members": membership.nodes().map(|(id, n)| serde_json::json!({
            "node_id": id, "raft_addr": n.raft_addr, "api_addr": n.api_addr, "voter": voters.contains(id)
        })).collect::<Vec<_>>(),
        "next_txid": b.table.next_txid(),
        "transactions": b.table.len(),
        "by_phase": phases,
        "decided_not_yet_delivered": undelivered,
        "retired_node_ids": b.table.retired_node_ids(),
        // Operators' settlements of another incarnation's txids (ADR 0040;
        // none in a backup from before them).
        "settlements": crate::store::sm_store::decode_snapshot_settlements(&b.snapshot).map(|s| s.len()).unwrap_or(0),
        "coordinator_version": h.coordinator_version,
    })
}

/// A one-line summary of a backup.
pub fn summary_line(b: &Backup) -> String {
    let h = &b.header;
    format!(
        "backup of cluster {} at log index {} (term {}{}): {} transactions, next txid {}, {} bytes, sha256 {}",
        h.cluster_id,
        h.last_applied.index,
        h.last_applied.leader_id.term,
        if h.confirmed {
            ""
        } else {
            "; NOT confirmed by a quorum: this node's own applied state"
        },
        b.table.len(),
        b.table.next_txid(),
        b.size,
        hex(&b.checksum)
    )
}

#[cfg(test)]
mod tests {
    use openraft::CommittedLeaderId;
    use openraft::RaftSnapshotBuilder;

    use super::*;
    use crate::sm::Command;

    fn members() -> Vec<Member> {
        (1..=3)
            .map(|id| Member {
                id,
                raft_addr: format!("127.0.0.1:{}", 7100 + id),
                api_addr: format!("127.0.0.1:{}", 7200 + id),
            })
            .collect()
    }

    /// A backup of a state machine with a few transactions (one retired
    /// node id, 4), built as a node builds one.
    async fn sample_backup() -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let engine = store::open_data_dir(dir.path(), "old", 1).unwrap();
        let mut sm = StateMachineStore::open(engine).unwrap();
        let mut cmds = vec![Command::RetireNodeId { node_id: 4 }];
        for i in 0..5 {
            cmds.push(Command::Begin {
                idempotency_key: format!("k{i}"),
                fingerprint: [i; 32],
                now_ms: 1,
                timeout_ms: 1_000_000,
            });
        }
        sm.apply(vec![openraft::Entry {
            log_id: LogId::new(CommittedLeaderId::new(7, 1), 42),
            payload: openraft::EntryPayload::Normal(crate::raft::Batch { commands: cmds }),
        }])
        .await
        .unwrap();
        let (meta, snap) = sm.snapshot_for_backup().unwrap();
        let table = store::sm_store::decode_snapshot_table(&snap).unwrap();
        let header = BackupHeader {
            cluster_id: "old".into(),
            node_id: 1,
            created_unix_ms: 5,
            confirmed: true,
            term: 9,
            last_applied: meta.last_log_id.unwrap(),
            membership: meta.last_membership,
            next_txid: table.next_txid(),
            transactions: table.len() as u64,
            coordinator_version: "test".into(),
        };
        // The same bytes openraft's builder makes.
        let built = sm.build_snapshot().await.unwrap();
        assert_eq!(built.snapshot.into_inner(), snap);
        encode_backup(&header, &snap).unwrap()
    }

    #[tokio::test]
    async fn a_backup_round_trips() {
        let bytes = sample_backup().await;
        let b = decode_backup(&bytes).unwrap();
        assert_eq!(b.header.cluster_id, "old");
        assert_eq!(b.header.last_applied.index, 42);
        assert_eq!(b.table.len(), 5);
        assert!(b.table.is_retired_node_id(4));
        assert_eq!(&bytes[bytes.len() - 32..], &b.checksum[..]);
        assert!(summary_line(&b).contains("5 transactions"));
        assert_eq!(describe(&b)["by_phase"]["ACTIVE"], serde_json::json!(5));
    }

    /// A truncated file, a flipped byte anywhere, another format version and
    /// a file that is no backup are each refused with a message saying so.
    #[tokio::test]
    async fn damaged_or_truncated_backups_are_refused() {
        let bytes = sample_backup().await;
        for cut in [1, 31, 32, 33, bytes.len() / 2, bytes.len() - 20] {
            let err = decode_backup(&bytes[..bytes.len() - cut]).err().expect("refused");
            assert!(matches!(err, BackupError::Damaged(_)), "cut {cut}: {err}");
            assert!(err.to_string().contains("truncated or damaged"), "{err}");
        }
        for at in [12, 20, bytes.len() / 2, bytes.len() - 40, bytes.len() - 1] {
            let mut bad = bytes.clone();
            bad[at] ^= 0x40;
            let err = decode_backup(&bad).err().expect("refused");
            assert!(err.to_string().contains("truncated or damaged"), "byte {at}: {err}");
        }
        let mut other = bytes.clone();
        other[9] = 9;
        let err = decode_backup(&other).err().expect("refused");
        assert!(matches!(err, BackupError::Version { found: 9 }), "{err}");
        let err = decode_backup(b"hello, world, this is not a backup file at all......")
            .err()
            .expect("refused");
        assert!(matches!(err, BackupError::NotABackup), "{err}");
        let err = decode_backup(&[]).err().expect("refused");
        assert!(matches!(err, BackupError::NotABackup), "{err}");
        // Intact, but written in another data format version: named.
        let b = decode_backup(&bytes).unwrap();
        let mut snap = b.snapshot.clone();
        snap[0] = codec::FORMAT_VERSION + 1;
        let other = encode_backup(&b.header, &snap).unwrap();
        let err = decode_backup(&other).err().expect("refused");
        assert!(matches!(err, BackupError::DataVersion { .. }), "{err}");
        assert!(err.to_string().contains("data format version"), "{err}");

        // The same through a file on disk.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b.dtxbak");
        std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
        let err = read_backup(&p).err().expect("refused");
        assert!(err.to_string().contains("truncated or damaged"), "{err}");
    }

    /// The writer never leaves a partial file under the target's name,
    /// refuses to overwrite without force, and refuses (and removes) a
    /// stream that does not make a valid backup.
    #[tokio::test]
    async fn the_writer_is_all_or_nothing() {
        let bytes = sample_backup().await;
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("b.dtxbak");
        let mut w = BackupWriter::create(&target, false).unwrap();
        for c in bytes.chunks(100) {
            w.write(c).unwrap();
            assert!(!target.exists());
        }
        w.finish().unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), bytes);

        let err = BackupWriter::create(&target, false).err().expect("refused");
        assert!(matches!(err, BackupError::Exists { .. }), "{err}");
        assert!(err.to_string().contains("--force"), "{err}");

        // A stream cut short: refused, the old file kept, no temp left.
        let mut w = BackupWriter::create(&target, true).unwrap();
        w.write(&bytes[..bytes.len() - 10]).unwrap();
        let err = w.finish().err().expect("refused");
        assert!(err.to_string().contains("truncated or damaged"), "{err}");
        assert_eq!(std::fs::read(&target).unwrap(), bytes);
        // Dropped unfinished: removed.
        let mut w = BackupWriter::create(&dir.path().join("c.dtxbak"), false).unwrap();
        w.write(&bytes[..10]).unwrap();
        drop(w);
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
            .collect();
        assert_eq!(names, vec!["b.dtxbak".to_string()]);
    }

    fn plan(dir: &Path, node_id: u64) -> RestorePlan {
        RestorePlan {
            cluster_id: "new".into(),
            node_id,
            members: members(),
            data_dir: dir.to_path_buf(),
            skip_txids: 0,
        }
    }

    #[tokio::test]
    async fn a_non_empty_data_dir_is_refused_and_left_alone() {
        let b = decode_backup(&sample_backup().await).unwrap();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("notes"), b"mine").unwrap();
        let err = restore_data_dir(&b, &plan(dir.path(), 1)).await.expect_err("refused");
        assert!(matches!(err, RestoreError::NotEmpty { entries: 1, .. }), "{err}");
        assert!(err.to_string().contains("is not empty"), "{err}");
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1);
        assert_eq!(std::fs::read(dir.path().join("notes")).unwrap(), b"mine");
    }

    #[tokio::test]
    async fn bad_plans_are_refused() {
        let b = decode_backup(&sample_backup().await).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("n1");
        let mut p = plan(&target, 1);
        p.cluster_id = "old".into();
        let err = restore_data_dir(&b, &p).await.expect_err("same cluster id");
        assert!(err.to_string().contains("must differ"), "{err}");
        let mut p = plan(&target, 1);
        p.members[2].id = 4;
        let err = restore_data_dir(&b, &p).await.expect_err("retired id");
        assert!(err.to_string().contains("never reused"), "{err}");
        let err = restore_data_dir(&b, &plan(&target, 5)).await.expect_err("not a member");
        assert!(err.to_string().contains("not one of the members"), "{err}");
        assert!(!target.exists());
    }

    /// A restored directory opens as a node's would: its identity, the
    /// state, a log that starts after the backed-up index, the vote at the
    /// backed-up term and the new membership.
    #[tokio::test]
    async fn a_restored_data_dir_holds_the_backed_up_state() {
        let b = decode_backup(&sample_backup().await).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("n2");
        let s = restore_data_dir(&b, &plan(&target, 2)).await.unwrap();
        assert_eq!(s.term, 9);
        assert_eq!(s.last_applied.index, 42);
        assert_eq!(s.transactions, 5);
        let other = restore_data_dir(&b, &plan(&dir.path().join("n3"), 3)).await.unwrap();
        assert_eq!(other.restore_id, s.restore_id, "same backup, same cluster: same id");
        // Only the restored directories are left beside it.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
        // Skipping txids: the next txid moves up by that many, nothing
        // else changes, and the restore id tells the two restores apart.
        let mut skipping = plan(&dir.path().join("n1"), 1);
        skipping.skip_txids = 1000;
        let skipped = restore_data_dir(&b, &skipping).await.unwrap();
        assert_eq!(skipped.next_txid, b.header.next_txid + 1000);
        assert_eq!(skipped.transactions, 5);
        assert_ne!(skipped.restore_id, s.restore_id);
        std::fs::remove_dir_all(dir.path().join("n1")).unwrap();

        let engine = store::open_data_dir(&target, "new", 2).unwrap();
        let mut sm = StateMachineStore::open(engine.clone()).unwrap();
        let mut log = LogStore::open(engine.clone(), &target).unwrap();
        {
            let st = sm.state();
            assert_eq!(st.table.len(), 5);
            assert!(st.table.is_retired_node_id(4));
            assert_eq!(st.last_applied.map(|l| l.index), Some(42));
            let voters: BTreeSet<u64> = st.membership.membership().voter_ids().collect();
            assert_eq!(voters, BTreeSet::from([1, 2, 3]));
        }
        let vote = log.read_vote().await.unwrap().unwrap();
        assert_eq!(vote.leader_id().term, 9);
        assert!(!vote.is_committed());
        let state = log.get_log_state().await.unwrap();
        assert_eq!(state.last_log_id.map(|l| l.index), Some(42));
        assert_eq!(state.last_purged_log_id.map(|l| l.index), Some(42));
        let snap = sm.get_current_snapshot().await.unwrap().expect("a snapshot to ship");
        assert_eq!(snap.meta.last_log_id.map(|l| l.index), Some(42));
        // Another cluster's or node's identity is refused as for any node.
        drop((sm, log, engine));
        assert!(store::open_data_dir(&target, "old", 2).is_err());
    }
}
