//! An append-only log of numbered records in segment files
//! (docs/adr/0022-raft-log-files.md): the coordinator's Raft log
//! (`coordinator/src/store/log_store.rs`, named "raft log") and the
//! participant store's log (named "participant log") are each one [`Wal`].
//!
//! Why not sled: a sled flush is two device round trips in series (sled's
//! `sync_file_range` of its buffer, then our `fdatasync`) plus a hop to
//! sled's I/O threads; openraft 0.9 waits for the leader's flush before it
//! replicates, so that cost was paid twice per write at one client.
//! Here an append is a `write` into the page cache and a flush is one
//! `fdatasync` of the files written since the last one.
//!
//! Layout: the log's own directory (the caller's choice, for example
//! `raft-log/` in a coordinator's data directory), files
//! `<first index, 20 digits>.wal`. Each file starts with a header
//! (`dtx_durable::format::file_header`: magic [`WAL_FILE_MAGIC`], the
//! format version [`WAL_FORMAT_VERSION`], a crc32 of both), then records:
//! `[payload length: u32 LE][crc32 of index and payload: u32 LE][index: u64 LE][payload]`;
//! the payload is the caller's encoded record (which carries its own
//! format version). Indexes are contiguous across the files. Opening
//! dispatches on each file's version (docs/adr/0042-storage-engines.md): a
//! file of another version, or one without a header (the layout before
//! it, a pre-release one), is refused by name. Only the tail of the last
//! file may be torn (a crash during a write, before its fsync, so nothing
//! there was acknowledged; the header goes out with the file's first
//! records): opening cuts it off. Nothing is written into a new file
//! before the file before it and the directory are synced, so a crash
//! leaves no other shape. Anything else that does not read back is damage,
//! and opening fails rather than forget acknowledged records.
//!
//! The log only holds records: what its user keeps beside them (the Raft
//! vote, committed and purged log ids in the coordinator's engine) is the
//! user's own.

use std::collections::VecDeque;
use std::fs::File;
use std::fs::OpenOptions;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;

/// Files grow by this much zeroed space ahead of the writes: an `fdatasync`
/// of data written into space a file already has needs no metadata commit
/// (about 30 % faster on our disks than one that grows the file).
pub const WAL_ZEROED_AHEAD_BYTES: u64 = 1 << 20;
/// The first bytes of every log file's header.
pub const WAL_FILE_MAGIC: &[u8; 8] = b"DTX-WAL\n";
/// The format of the log files (their header and record framing) this
/// build writes and the only one it reads.
pub const WAL_FORMAT_VERSION: u32 = 1;
/// The header at the start of every log file.
pub const WAL_FILE_HEADER_BYTES: usize = crate::format::FILE_HEADER_BYTES;
/// A record's header.
const HEADER_BYTES: usize = 16;
/// No record is this large (the Raft message limit is far below); a larger
/// length in a header is damage, not a reason to allocate.
const RECORD_PAYLOAD_BYTES_MAX: u32 = 1 << 30;

/// What went wrong; every message starts with the log's name (the `name`
/// given to [`Wal::open`]).
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("{name} {path}: {source}")]
    Io {
        name: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A write or sync found no room (ENOSPC or EDQUOT,
    /// [`crate::is_no_space_io`]); says "disk full", the words operators
    /// and tests look for.
    #[error("{name} {path}: disk full ({detail})")]
    NoSpace {
        name: &'static str,
        path: String,
        detail: String,
    },
    #[error("{name} {path} is damaged: {message}")]
    Damaged {
        name: &'static str,
        path: String,
        message: String,
    },
    #[error("{name}: {message}")]
    Gap { name: &'static str, message: String },
    /// A file in a format this build does not read (a newer build's, or a
    /// pre-release one): named, with the version found and the one read.
    #[error(transparent)]
    Format(#[from] crate::format::VersionError),
    /// A write or sync failed before; the log refuses everything after it
    /// (its user stops and reopens it, which cuts a torn tail). `no_space`:
    /// that failure was [`WalError::NoSpace`].
    #[error("{name} stopped after an earlier failure: {message}")]
    Stopped {
        name: &'static str,
        message: String,
        no_space: bool,
    },
}

impl WalError {
    /// A full disk: this failure, or the earlier one a stopped log refuses
    /// everything after.
    pub fn is_no_space(&self) -> bool {
        matches!(
            self,
            WalError::NoSpace { .. } | WalError::Stopped { no_space: true, .. }
        )
    }
}

struct Segment {
    first: u64,
    path: PathBuf,
    file: Arc<File>,
    /// Where the records end (the next write goes here).
    bytes: u64,
    /// The file's size: records, then zeros.
    allocated: u64,
}

#[derive(Clone, Copy)]
struct Loc {
    offset: u64,
    len: u32,
}

/// The first failed write or sync, which stops the log.
struct Failure {
    message: String,
    /// It was a full disk ([`WalError::NoSpace`]).
    no_space: bool,
}

struct Inner {
    segments: Vec<Segment>,
    /// Where record `first_index + i` is (in the segment holding it).
    locs: VecDeque<Loc>,
    first_index: u64,
    /// Files written since the last sync, and whether the directory
    /// changed (a new or removed file).
    unsynced: Vec<Arc<File>>,
    dir_dirty: bool,
    failed: Option<Failure>,
}

/// One log in its own directory. Every method takes `&self`; one lock
/// orders them (a `sync` does its `fdatasync`s outside it).
pub struct Wal {
    dir: PathBuf,
    name: &'static str,
    segment_bytes_max: u64,
    inner: Mutex<Inner>,
    /// Held by a `sync` from start to end: one that finds the files taken
    /// by another still running waits for it, rather than returning before
    /// the writes it must cover are on disk.
    syncing: Mutex<()>,
}

fn io_err<'a>(name: &'static str, path: &'a Path) -> impl Fn(std::io::Error) -> WalError + 'a {
    move |source| {
        if crate::is_no_space_io(&source) {
            WalError::NoSpace {
                name,
                path: path.display().to_string(),
                detail: source.to_string(),
            }
        } else {
            WalError::Io {
                name,
                path: path.display().to_string(),
                source,
            }
        }
    }
}

impl Inner {
    /// The log refuses everything after a failed write or sync.
    fn check_running(&self, name: &'static str) -> Result<(), WalError> {
        match &self.failed {
            Some(f) => Err(WalError::Stopped {
                name,
                message: f.message.clone(),
                no_space: f.no_space,
            }),
            None => Ok(()),
        }
    }

    /// Stops the log on the failure `e` of a write or sync.
    fn fail(&mut self, e: &WalError) {
        self.failed = Some(Failure {
            message: e.to_string(),
            no_space: e.is_no_space(),
        });
    }
}

/// Whether `dir`, a log's own directory, holds log files (before opening
/// anything there). A directory that is not there holds none.
pub fn has_entry_files(dir: &Path) -> bool {
    std::fs::read_dir(dir)
        .map(|mut d| d.any(|e| e.is_ok_and(|e| e.file_name().to_string_lossy().ends_with(".wal"))))
        .unwrap_or(false)
}

fn segment_name(first: u64) -> String {
    format!("{first:020}.wal")
}

fn record_crc(index: u64, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&index.to_le_bytes());
    h.update(payload);
    h.finalize()
}

fn encode_record(index: u64, payload: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&record_crc(index, payload).to_le_bytes());
    out.extend_from_slice(&index.to_le_bytes());
    out.extend_from_slice(payload);
}

fn sync_dir(name: &'static str, dir: &Path) -> Result<(), WalError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(name, dir))
}

/// What reading one file found: its records' places, and where the valid
/// part ends (shorter than the file when its tail is torn).
struct Scan {
    locs: Vec<Loc>,
    valid_bytes: u64,
    file_bytes: u64,
    /// Why reading stopped before the end of the file, if it did.
    stopped: Option<String>,
}

/// Whether `data`, a log file without a header, starts with a whole
/// record of the layout before headers (a pre-release one) holding index
/// `first`: a record header, a payload that fits, a checksum that holds.
fn is_unversioned_log_file(data: &[u8], first: u64) -> bool {
    let Some(h) = data.get(..HEADER_BYTES) else {
        return false;
    };
    let len = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
    let crc = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
    let index = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    if len == 0 || len > RECORD_PAYLOAD_BYTES_MAX || index != first {
        return false;
    }
    data.get(HEADER_BYTES..HEADER_BYTES + len as usize)
        .is_some_and(|payload| record_crc(index, payload) == crc)
}

/// The dispatch on a log file's format version, over its first bytes
/// (`start`: the whole file, or at least its header and, when it has none,
/// its first record): `true` for a header of this build's version, `false`
/// for none (a torn one, or damage); refused for a header of another
/// version, or a file of the layout before headers.
fn has_header_of_this_version(start: &[u8], first: u64, what: impl FnOnce() -> String) -> Result<bool, WalError> {
    match crate::format::read_file_header(WAL_FILE_MAGIC, start) {
        Some(version) => {
            crate::format::check(what, version.into(), WAL_FORMAT_VERSION.into())?;
            Ok(true)
        }
        None if is_unversioned_log_file(start, first) => Err(crate::format::VersionError::Unversioned {
            what: what(),
            reads: WAL_FORMAT_VERSION.into(),
        }
        .into()),
        None => Ok(false),
    }
}

/// Checks the format version of every log file in `dir`, a log's own
/// directory, reading only the files' first bytes and changing nothing:
/// [`WalError::Format`] for a file of a version this build does not read
/// (as [`Wal::open`] refuses it), `Ok` otherwise (whatever else is wrong,
/// a torn tail or damage, is for [`Wal::open`] to find). For a caller that
/// refuses such a directory before it opens anything else in it.
pub fn check_format(dir: &Path, name: &'static str) -> Result<(), WalError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(name, dir)(e)),
    };
    for e in entries {
        let e = e.map_err(io_err(name, dir))?;
        let file_name = e.file_name().to_string_lossy().to_string();
        let Some(first) = file_name.strip_suffix(".wal").and_then(|s| s.parse::<u64>().ok()) else {
            continue;
        };
        let path = e.path();
        let file = File::open(&path).map_err(io_err(name, &path))?;
        let len = file.metadata().map_err(io_err(name, &path))?.len();
        let header_bytes = WAL_FILE_HEADER_BYTES.max(HEADER_BYTES);
        let mut start = vec![0u8; len.min(header_bytes as u64) as usize];
        file.read_exact_at(&mut start, 0).map_err(io_err(name, &path))?;
        if crate::format::read_file_header(WAL_FILE_MAGIC, &start).is_none() && start.len() == header_bytes {
            // No header: the first record, if it is one, says whether this
            // is the layout before headers.
            let payload = u32::from_le_bytes(start[0..4].try_into().expect("4 bytes")).min(RECORD_PAYLOAD_BYTES_MAX);
            let record = (HEADER_BYTES as u64 + u64::from(payload)).min(len);
            start.resize(record as usize, 0);
            file.read_exact_at(&mut start, 0).map_err(io_err(name, &path))?;
        }
        has_header_of_this_version(&start, first, || format!("{name} file {}", path.display()))?;
    }
    Ok(())
}

fn scan_segment(name: &'static str, path: &Path, first: u64) -> Result<Scan, WalError> {
    let mut data = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut data))
        .map_err(io_err(name, path))?;
    let what = || format!("{name} file {}", path.display());
    let mut locs = Vec::new();
    if data.iter().all(|b| *b == 0) {
        // Nothing written yet (a file started just before a crash).
        return Ok(Scan {
            locs,
            valid_bytes: 0,
            file_bytes: data.len() as u64,
            stopped: None,
        });
    }
    if !has_header_of_this_version(&data, first, what)? {
        // Torn when it is the last file (its header went out with its
        // first records, which no sync covered yet); damage otherwise.
        return Ok(Scan {
            locs,
            valid_bytes: 0,
            file_bytes: data.len() as u64,
            stopped: Some("its file header does not read back".to_string()),
        });
    }
    let mut at = WAL_FILE_HEADER_BYTES;
    let mut expect = first;
    let stopped = loop {
        if at == data.len() || data[at..].iter().all(|b| *b == 0) {
            // The end, or the zeroed space ahead of the writes.
            break None;
        }
        if data.len() - at < HEADER_BYTES {
            break Some(format!(
                "{} bytes at offset {at}: shorter than a record header",
                data.len() - at
            ));
        }
        let h = &data[at..at + HEADER_BYTES];
        let len = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
        let crc = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
        let index = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
        if len == 0 || len > RECORD_PAYLOAD_BYTES_MAX {
            break Some(format!("record at offset {at} has length {len}"));
        }
        let end = at + HEADER_BYTES + len as usize;
        if end > data.len() {
            break Some(format!(
                "record at offset {at} of {len} bytes runs past the end of the file"
            ));
        }
        let payload = &data[at + HEADER_BYTES..end];
        if record_crc(index, payload) != crc {
            break Some(format!("record at offset {at} fails its checksum"));
        }
        if index != expect {
            break Some(format!("record at offset {at} holds index {index}, expected {expect}"));
        }
        locs.push(Loc {
            offset: (at + HEADER_BYTES) as u64,
            len,
        });
        expect += 1;
        at = end;
    };
    Ok(Scan {
        locs,
        valid_bytes: at as u64,
        file_bytes: data.len() as u64,
        stopped,
    })
}

impl Wal {
    /// Opens the log in its own directory `dir`, cutting a torn tail off
    /// the last file; fails on anything else that does not read back. When
    /// `dir` is not there it is created (and its parent directory synced,
    /// so that it lasts). `name` starts every error message and log line
    /// about it ("raft log", "participant log"). A new file is started when
    /// the current one reaches `segment_bytes_max`.
    pub fn open(dir: &Path, name: &'static str, segment_bytes_max: u64) -> Result<Wal, WalError> {
        let dir = dir.to_path_buf();
        if !dir.exists() {
            std::fs::create_dir(&dir).map_err(io_err(name, &dir))?;
            let parent = match dir.parent() {
                Some(p) if !p.as_os_str().is_empty() => p,
                _ => Path::new("."),
            };
            sync_dir(name, parent)?;
        }
        let mut firsts = Vec::new();
        for e in std::fs::read_dir(&dir).map_err(io_err(name, &dir))? {
            let e = e.map_err(io_err(name, &dir))?;
            let file_name = e.file_name().to_string_lossy().to_string();
            let Some(stem) = file_name.strip_suffix(".wal") else {
                return Err(WalError::Damaged {
                    name,
                    path: dir.display().to_string(),
                    message: format!("unexpected file {file_name:?} (only NNN.wal files belong here)"),
                });
            };
            let first: u64 = stem.parse().map_err(|_| WalError::Damaged {
                name,
                path: dir.display().to_string(),
                message: format!("unexpected file {file_name:?} (its name is not a log index)"),
            })?;
            firsts.push(first);
        }
        firsts.sort_unstable();
        let mut inner = Inner {
            segments: Vec::new(),
            locs: VecDeque::new(),
            first_index: firsts.first().copied().unwrap_or(0),
            unsynced: Vec::new(),
            dir_dirty: false,
            failed: None,
        };
        let count = firsts.len();
        for (i, first) in firsts.into_iter().enumerate() {
            let path = dir.join(segment_name(first));
            let last = i + 1 == count;
            let next = inner.first_index + inner.locs.len() as u64;
            if i > 0 && first != next {
                return Err(WalError::Damaged {
                    name,
                    path: path.display().to_string(),
                    message: format!("starts at index {first}, but the file before it ends before index {next}"),
                });
            }
            let scan = scan_segment(name, &path, first)?;
            if let Some(why) = &scan.stopped {
                if !last {
                    return Err(WalError::Damaged {
                        name,
                        path: path.display().to_string(),
                        message: format!("{why} (not the last file, so this is not a torn write)"),
                    });
                }
                tracing::warn!(
                    file = %path.display(),
                    kept_bytes = scan.valid_bytes,
                    cut_bytes = scan.file_bytes - scan.valid_bytes,
                    "{name}: cutting a torn tail left by a crash during a write ({why}); nothing there was acknowledged"
                );
            }
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .map_err(io_err(name, &path))?;
            let mut allocated = scan.file_bytes;
            if scan.stopped.is_some() {
                file.set_len(scan.valid_bytes).map_err(io_err(name, &path))?;
                file.sync_data().map_err(io_err(name, &path))?;
                allocated = scan.valid_bytes;
            }
            inner.locs.extend(scan.locs);
            inner.segments.push(Segment {
                first,
                path,
                file: Arc::new(file),
                bytes: scan.valid_bytes,
                allocated,
            });
        }
        Ok(Wal {
            dir,
            name,
            segment_bytes_max,
            inner: Mutex::new(inner),
            syncing: Mutex::new(()),
        })
    }

    /// The log's own directory (the `dir` it was opened on).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|e| panic!("{} lock: {e:?}", self.name))
    }

    /// The first and last index held, `None` when empty.
    pub fn range(&self) -> Option<(u64, u64)> {
        let g = self.lock();
        (!g.locs.is_empty()).then(|| (g.first_index, g.first_index + g.locs.len() as u64 - 1))
    }

    /// Appends records `(index, encoded)`; the first must follow the last
    /// held (or start an empty log anywhere). Written, not yet durable:
    /// `sync` makes it so.
    pub fn append(&self, entries: &[(u64, Vec<u8>)]) -> Result<(), WalError> {
        if entries.is_empty() {
            return Ok(());
        }
        self.stopping_on_failure(|g| self.append_locked(g, entries))
    }

    /// Runs `f` under the lock if the log is running; a failure of `f`
    /// stops the log (every later call answers `Stopped`).
    fn stopping_on_failure<T>(&self, f: impl FnOnce(&mut Inner) -> Result<T, WalError>) -> Result<T, WalError> {
        let mut g = self.lock();
        g.check_running(self.name)?;
        let res = f(&mut g);
        if let Err(e) = &res {
            g.fail(e);
        }
        res
    }

    fn append_locked(&self, g: &mut Inner, entries: &[(u64, Vec<u8>)]) -> Result<(), WalError> {
        let mut next = g.first_index + g.locs.len() as u64;
        if g.locs.is_empty() {
            // An empty log (new, or purged up to its end) starts anew. The
            // old files are gone from the disk before the new one appears:
            // never a new file beside old ones a crash brought back.
            let old = std::mem::take(&mut g.segments);
            for s in &old {
                std::fs::remove_file(&s.path).map_err(io_err(self.name, &s.path))?;
                g.dir_dirty = true;
            }
            if !old.is_empty() {
                sync_dir(self.name, &self.dir)?;
            }
            next = entries[0].0;
            g.first_index = next;
        }
        let mut buf = Vec::new();
        for (index, payload) in entries {
            if *index != next {
                return Err(WalError::Gap {
                    name: self.name,
                    message: format!("append of index {index} where {next} comes next"),
                });
            }
            let needs_new = match g.segments.last() {
                None => true,
                Some(s) => s.bytes + buf.len() as u64 >= self.segment_bytes_max,
            };
            if needs_new {
                self.write_out(g, &mut buf)?;
                self.start_segment(g, *index)?;
            }
            let seg = g.segments.last().expect("a segment");
            if seg.bytes == 0 && buf.is_empty() {
                // A file's first write starts with its header.
                buf.extend_from_slice(&crate::format::file_header(WAL_FILE_MAGIC, WAL_FORMAT_VERSION));
            }
            let at = seg.bytes + buf.len() as u64;
            encode_record(*index, payload, &mut buf);
            g.locs.push_back(Loc {
                offset: at + HEADER_BYTES as u64,
                len: payload.len() as u32,
            });
            next += 1;
        }
        self.write_out(g, &mut buf)
    }

    /// Starts the file that record `first` opens. Before anything is
    /// written into it, the file before it is synced (`fdatasync`, once per
    /// file, not per append) and so is the directory with the new file's
    /// name: every file but the last is then durable whole, so a crash can
    /// only tear the last file's tail, never leave records in a later file
    /// after a lost tail of an earlier one (which opening must refuse as
    /// damage, since it cannot tell the two apart).
    fn start_segment(&self, g: &mut Inner, first: u64) -> Result<(), WalError> {
        if let Some(prev) = g.segments.last() {
            prev.file.sync_data().map_err(io_err(self.name, &prev.path))?;
            let synced = prev.file.clone();
            g.unsynced.retain(|u| !Arc::ptr_eq(u, &synced));
        }
        let path = self.dir.join(segment_name(first));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .map_err(io_err(self.name, &path))?;
        // The directory sync also covers every earlier change of the
        // directory (files removed by a purge).
        sync_dir(self.name, &self.dir)?;
        g.dir_dirty = false;
        g.segments.push(Segment {
            first,
            path,
            file: Arc::new(file),
            bytes: 0,
            allocated: 0,
        });
        Ok(())
    }

    /// Writes `buf` at the end of the last segment.
    fn write_out(&self, g: &mut Inner, buf: &mut Vec<u8>) -> Result<(), WalError> {
        if buf.is_empty() {
            return Ok(());
        }
        let seg = g.segments.last_mut().expect("a segment to write to");
        let end = seg.bytes + buf.len() as u64;
        if end > seg.allocated {
            let to = end.div_ceil(WAL_ZEROED_AHEAD_BYTES) * WAL_ZEROED_AHEAD_BYTES;
            let zeros = vec![0u8; (to - seg.allocated) as usize];
            seg.file
                .write_all_at(&zeros, seg.allocated)
                .map_err(io_err(self.name, &seg.path))?;
            seg.allocated = to;
        }
        seg.file
            .write_all_at(buf, seg.bytes)
            .map_err(io_err(self.name, &seg.path))?;
        seg.bytes += buf.len() as u64;
        let f = seg.file.clone();
        if !g.unsynced.iter().any(|u| Arc::ptr_eq(u, &f)) {
            g.unsynced.push(f);
        }
        buf.clear();
        Ok(())
    }

    /// Makes every write before the call durable: `fdatasync` of each file
    /// written since the last sync, and of the directory when files came
    /// or went. Returns how many files it synced. Concurrent calls run one
    /// after the other (`syncing`): each returns only once every write
    /// before it is durable, whichever call's `fdatasync` covered it.
    pub fn sync(&self) -> Result<usize, WalError> {
        let _syncing = self.syncing.lock().unwrap_or_else(|e| e.into_inner());
        let (files, dir_dirty) = {
            let mut g = self.lock();
            g.check_running(self.name)?;
            (std::mem::take(&mut g.unsynced), std::mem::take(&mut g.dir_dirty))
        };
        let res = (|| -> Result<usize, WalError> {
            for f in &files {
                f.sync_data().map_err(io_err(self.name, &self.dir))?;
            }
            if dir_dirty {
                sync_dir(self.name, &self.dir)?;
            }
            Ok(files.len())
        })();
        if let Err(e) = &res {
            self.lock().fail(e);
        }
        res
    }

    /// The encoded records in `[start, end)` that the log holds (a range
    /// partly outside it gives the part inside).
    pub fn read(&self, start: u64, end: u64) -> Result<Vec<Vec<u8>>, WalError> {
        let g = self.lock();
        let last_plus_one = g.first_index + g.locs.len() as u64;
        let start = start.max(g.first_index);
        let end = end.min(last_plus_one);
        let mut out = Vec::with_capacity(end.saturating_sub(start) as usize);
        let mut seg_i = 0usize;
        for index in start..end {
            while seg_i + 1 < g.segments.len() && g.segments[seg_i + 1].first <= index {
                seg_i += 1;
            }
            let seg = &g.segments[seg_i];
            let loc = g.locs[(index - g.first_index) as usize];
            let mut b = vec![0u8; loc.len as usize];
            seg.file
                .read_exact_at(&mut b, loc.offset)
                .map_err(io_err(self.name, &seg.path))?;
            out.push(b);
        }
        Ok(out)
    }

    /// Removes every record from `index` on (a conflicting suffix). Durable
    /// when it returns: later appends reuse these indexes. A failure stops
    /// the log, as a failed write does: what the files hold is then no
    /// longer what the log knows of them.
    pub fn truncate_from(&self, index: u64) -> Result<(), WalError> {
        self.stopping_on_failure(|g| self.truncate_locked(g, index))
    }

    fn truncate_locked(&self, g: &mut Inner, index: u64) -> Result<(), WalError> {
        let last_plus_one = g.first_index + g.locs.len() as u64;
        if index >= last_plus_one {
            return Ok(());
        }
        // Whole files from the cut on go first (then the directory is
        // synced), then the file holding the cut is shortened and synced: a
        // crash in between leaves a prefix of the old log, never new
        // records after a gap. A file leaves the log's memory only once it
        // is gone from the disk.
        let mut removed = false;
        while let Some(s) = g.segments.last().filter(|s| s.first >= index) {
            let first = s.first;
            std::fs::remove_file(&s.path).map_err(io_err(self.name, &s.path))?;
            g.segments.pop();
            let held = first.saturating_sub(g.first_index) as usize;
            g.locs.truncate(held);
            removed = true;
        }
        if removed {
            sync_dir(self.name, &self.dir)?;
        }
        let keep = index.saturating_sub(g.first_index) as usize;
        g.locs.truncate(keep);
        // The last file left starts before the cut, so it holds
        // record `index - 1`, the last one kept.
        if let (Some(loc), Some(seg)) = (g.locs.back().copied(), g.segments.last_mut()) {
            let cut = loc.offset + loc.len as u64;
            if cut < seg.bytes {
                // Shortened, not zeroed: later writes zero the space again.
                seg.file.set_len(cut).map_err(io_err(self.name, &seg.path))?;
                seg.file.sync_data().map_err(io_err(self.name, &seg.path))?;
                seg.bytes = cut;
                seg.allocated = cut;
            }
        }
        Ok(())
    }

    /// Forgets every record up to and including `upto`, deleting the files
    /// that hold nothing after it. The caller has made the purge durable
    /// first (the coordinator's `purged` record): a crash before a file is
    /// gone only leaves records that its user skips when it opens the log
    /// again (by purging up to the same point). A file that cannot be
    /// deleted stops the log, as a failed write does.
    pub fn purge_upto(&self, upto: u64) -> Result<(), WalError> {
        self.stopping_on_failure(|g| self.purge_locked(g, upto))
    }

    fn purge_locked(&self, g: &mut Inner, upto: u64) -> Result<(), WalError> {
        let last_plus_one = g.first_index + g.locs.len() as u64;
        let drop_n = (upto.saturating_add(1).min(last_plus_one)).saturating_sub(g.first_index) as usize;
        let drop_n = drop_n.min(g.locs.len());
        g.locs.drain(..drop_n);
        g.first_index = g.first_index.max(upto.saturating_add(1));
        // A file can go when the next one starts at or before the first
        // record kept. The last file stays (appends go there) unless the log
        // is now empty, in which case the next append starts afresh.
        let first_kept = g.first_index;
        while g.segments.len() > 1 && g.segments[1].first <= first_kept {
            std::fs::remove_file(&g.segments[0].path).map_err(io_err(self.name, &g.segments[0].path))?;
            g.segments.remove(0);
            g.dir_dirty = true;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The log's own directory in a test's directory (`open` creates it).
    const DIR: &str = "log";
    const NAME: &str = "test log";
    const SEGMENT_BYTES_MAX: u64 = 64 << 20;

    fn open(d: &Path) -> Result<Wal, WalError> {
        Wal::open(&d.join(DIR), NAME, SEGMENT_BYTES_MAX)
    }

    fn e(i: u64) -> (u64, Vec<u8>) {
        (i, format!("entry {i}").into_bytes())
    }

    fn read_all(w: &Wal) -> Vec<(u64, Vec<u8>)> {
        match w.range() {
            None => vec![],
            Some((a, b)) => (a..=b).zip(w.read(a, b + 1).unwrap()).collect(),
        }
    }

    #[test]
    fn appends_read_back_after_a_reopen() {
        let d = tempfile::tempdir().unwrap();
        let w = open(d.path()).unwrap();
        assert_eq!(w.range(), None);
        w.append(&[e(1), e(2), e(3)]).unwrap();
        w.append(&[e(4)]).unwrap();
        assert_eq!(w.sync().unwrap(), 1);
        assert_eq!(w.sync().unwrap(), 0, "nothing written since");
        assert_eq!(w.read(2, 4).unwrap(), vec![e(2).1, e(3).1]);
        drop(w);
        let w = open(d.path()).unwrap();
        assert_eq!(w.range(), Some((1, 4)));
        assert_eq!(read_all(&w), vec![e(1), e(2), e(3), e(4)]);
        let err = w.append(&[e(6)]).unwrap_err();
        assert!(
            err.to_string().contains("append of index 6 where 5 comes next"),
            "{err}"
        );
    }

    #[test]
    fn a_torn_tail_is_cut_and_anything_else_unreadable_is_damage() {
        let d = tempfile::tempdir().unwrap();
        let w = open(d.path()).unwrap();
        w.append(&[e(1), e(2), e(3)]).unwrap();
        w.sync().unwrap();
        drop(w);
        let path = d.path().join(DIR).join(segment_name(1));
        // The file is its header, records, then zeroed space.
        let records = WAL_FILE_HEADER_BYTES as u64 + 3 * (HEADER_BYTES as u64 + 7);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), WAL_ZEROED_AHEAD_BYTES);
        // A crash in the middle of the third record's write.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(records - 3)
            .unwrap();
        let w = open(d.path()).unwrap();
        assert_eq!(read_all(&w), vec![e(1), e(2)]);
        w.append(&[e(3)]).unwrap();
        w.sync().unwrap();
        drop(w);
        let w = open(d.path()).unwrap();
        assert_eq!(read_all(&w), vec![e(1), e(2), e(3)]);
        // Garbage after the records (not zeros) is a torn write too.
        drop(w);
        let mut b = std::fs::read(&path).unwrap();
        b[records as usize + 5] = 0x77;
        std::fs::write(&path, &b).unwrap();
        let w = open(d.path()).unwrap();
        assert_eq!(read_all(&w), vec![e(1), e(2), e(3)]);
        drop(w);
        // A flipped byte inside a record that is not the last file's tail
        // is reported, not cut: a second file follows it.
        let w = open(d.path()).unwrap();
        w.truncate_from(3).unwrap();
        drop(w);
        let mut b = std::fs::read(&path).unwrap();
        b[WAL_FILE_HEADER_BYTES + HEADER_BYTES + 1] ^= 0xff;
        std::fs::write(&path, &b).unwrap();
        std::fs::write(d.path().join(DIR).join(segment_name(3)), b"").unwrap();
        let err = open(d.path()).err().expect("damage is an error");
        assert!(err.to_string().contains("fails its checksum"), "{err}");
        assert!(err.to_string().contains("not a torn write"), "{err}");
    }

    #[test]
    fn truncate_and_purge_survive_a_reopen() {
        let d = tempfile::tempdir().unwrap();
        let w = open(d.path()).unwrap();
        w.append(&(1..=10).map(e).collect::<Vec<_>>()).unwrap();
        w.truncate_from(7).unwrap();
        assert_eq!(w.range(), Some((1, 6)));
        w.append(&[(7, b"other 7".to_vec())]).unwrap();
        w.purge_upto(3).unwrap();
        assert_eq!(w.range(), Some((4, 7)));
        w.sync().unwrap();
        drop(w);
        let w = open(d.path()).unwrap();
        // Purging keeps the file holding records after the purge point:
        // opening reads 1..=7 and its user skips what it purged (the
        // coordinator's log_store.rs purges up to its purged record).
        assert_eq!(w.range(), Some((1, 7)));
        assert_eq!(w.read(7, 8).unwrap(), vec![b"other 7".to_vec()]);
        // Purging everything, then appending far ahead, starts anew.
        w.purge_upto(7).unwrap();
        assert_eq!(w.range(), None);
        w.append(&[e(100)]).unwrap();
        w.sync().unwrap();
        drop(w);
        let w = open(d.path()).unwrap();
        assert_eq!(read_all(&w), vec![e(100)]);
    }

    #[test]
    fn files_rotate_and_whole_files_go_on_purge_and_truncate() {
        let d = tempfile::tempdir().unwrap();
        const MAX: u64 = 3000;
        let w = Wal::open(&d.path().join(DIR), NAME, MAX).unwrap();
        let big = vec![7u8; (MAX / 3) as usize];
        for i in 1..=7 {
            w.append(&[(i, big.clone())]).unwrap();
        }
        w.sync().unwrap();
        let files = || {
            let mut v: Vec<String> = std::fs::read_dir(d.path().join(DIR))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
                .collect();
            v.sort();
            v
        };
        assert_eq!(files(), vec![segment_name(1), segment_name(4), segment_name(7)]);
        w.purge_upto(4).unwrap();
        assert_eq!(files(), vec![segment_name(4), segment_name(7)]);
        drop(w);
        let w = Wal::open(&d.path().join(DIR), NAME, MAX).unwrap();
        assert_eq!(w.range(), Some((4, 7)));
        w.truncate_from(5).unwrap();
        assert_eq!(files(), vec![segment_name(4)]);
        assert_eq!(w.range(), Some((4, 4)));
        drop(w);
        let w = Wal::open(&d.path().join(DIR), NAME, MAX).unwrap();
        assert_eq!(w.range(), Some((4, 4)));
        assert_eq!(w.read(4, 5).unwrap(), vec![big]);
    }

    /// A power cut after an append crossed into a new file, before any sync
    /// covered it: the later file's blocks reached the disk, and
    /// of every earlier file only what the log had made durable. The log
    /// opens with every record a sync covered, and nothing is refused.
    /// Which files still hold writes no `fdatasync` covered is what the log
    /// itself has left to sync (`unsynced`);
    /// `a_rotation_syncs_the_last_file_before_it_writes_into_the_next`
    /// checks that a file leaves that list at a rotation only through an
    /// `fdatasync` that succeeded.
    #[test]
    fn a_power_cut_after_a_rotation_opens_with_every_synced_record() {
        const MAX: u64 = 200;
        // 16 + 40 bytes a record: four to a file.
        let r = |i: u64| (i, vec![i as u8; 40]);
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(DIR);
        let w = Wal::open(&dir, NAME, MAX).unwrap();
        w.append(&[r(1)]).unwrap();
        w.append(&[r(2)]).unwrap();
        w.sync().unwrap();
        // What a sync made durable, and acknowledged.
        let first_path = dir.join(segment_name(1));
        let synced = std::fs::read(&first_path).unwrap();
        for i in 3..=6 {
            w.append(&[r(i)]).unwrap();
        }
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            2,
            "records 5 and 6 went into a second file"
        );
        let first_unsynced = {
            let g = w.lock();
            let first = &g.segments[0].file;
            g.unsynced.iter().any(|u| Arc::ptr_eq(u, first))
        };
        drop(w);
        // The cut: the second file is whole; the first one is back to what
        // was synced if its later writes were not synced yet.
        if first_unsynced {
            std::fs::write(&first_path, &synced).unwrap();
        }
        let w = Wal::open(&dir, NAME, MAX).unwrap_or_else(|e| panic!("refused after a power cut: {e}"));
        assert_eq!(read_all(&w), (1..=6).map(r).collect::<Vec<_>>());
        w.append(&[r(7)]).unwrap();
        w.sync().unwrap();
        drop(w);
        // The same cut, with the second file's blocks lost instead: the
        // first file holds what it held when the second one was started.
        std::fs::write(dir.join(segment_name(5)), b"").unwrap();
        let w = Wal::open(&dir, NAME, MAX).unwrap();
        assert_eq!(read_all(&w), (1..=4).map(r).collect::<Vec<_>>());
    }

    /// Nothing is written into a new file before the file before it is
    /// durable: when that file's `fdatasync` fails (a handle on
    /// `/dev/null`, where writes succeed and `fdatasync` does not), the
    /// append that would start the next file fails and stops the log, and
    /// the next file is not even created. So a crash never leaves records
    /// in a later file after a lost tail of an earlier one.
    #[test]
    fn a_rotation_syncs_the_last_file_before_it_writes_into_the_next() {
        const MAX: u64 = 200;
        let r = |i: u64| (i, vec![i as u8; 40]);
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(DIR);
        let w = Wal::open(&dir, NAME, MAX).unwrap();
        w.append(&[r(1)]).unwrap();
        w.append(&[r(2)]).unwrap();
        w.lock().segments[0].file = Arc::new(OpenOptions::new().write(true).open("/dev/null").unwrap());
        w.append(&[r(3), r(4)]).unwrap();
        let err = w.append(&[r(5)]).unwrap_err();
        assert!(matches!(err, WalError::Io { name: NAME, .. }), "{err:?}");
        assert!(!dir.join(segment_name(5)).exists(), "{err}");
        assert_stopped(&w, &err);
    }

    /// Where unlinking `name` in the log's directory will fail: the file
    /// moves aside (the log keeps its open handle) and a non-empty directory
    /// takes its name. Returns a closure that puts the file back.
    fn make_unlink_fail(dir: &Path, name: &str) -> impl FnOnce() {
        let path = dir.join(name);
        let aside = dir.with_extension(format!("{name}.aside"));
        std::fs::rename(&path, &aside).unwrap();
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("keep"), b"x").unwrap();
        move || {
            std::fs::remove_dir_all(&path).unwrap();
            std::fs::rename(&aside, &path).unwrap();
        }
    }

    fn assert_stopped(w: &Wal, first_failure: &WalError) {
        let text = format!("{NAME} stopped after an earlier failure: {first_failure}");
        for stopped in [
            w.append(&[e(99)]).unwrap_err(),
            w.sync().unwrap_err(),
            w.truncate_from(1).unwrap_err(),
            w.purge_upto(1).unwrap_err(),
        ] {
            assert!(
                matches!(stopped, WalError::Stopped { no_space: false, .. }),
                "{stopped:?}"
            );
            assert_eq!(stopped.to_string(), text);
        }
    }

    /// A truncate or purge that fails half-way stops the log like a failed
    /// write: nothing is appended after it, and what the log still reads
    /// is what its files hold. After a reopen the log is a prefix of the old
    /// one (truncate) or starts after the purge point (purge).
    #[test]
    fn a_failed_truncate_or_purge_stops_the_log() {
        const MAX: u64 = 3000;
        let big = |i: u64| (i, vec![i as u8; (MAX / 3) as usize]);
        let filled = |d: &Path| {
            let w = Wal::open(&d.join(DIR), NAME, MAX).unwrap();
            for i in 1..=7 {
                w.append(&[big(i)]).unwrap();
            }
            w.sync().unwrap();
            w
        };

        // Truncate: the last file goes, the middle one cannot.
        let d = tempfile::tempdir().unwrap();
        let w = filled(d.path());
        let restore = make_unlink_fail(&d.path().join(DIR), &segment_name(4));
        let err = w.truncate_from(2).unwrap_err();
        assert!(matches!(err, WalError::Io { name: NAME, .. }), "{err:?}");
        assert_eq!(w.range(), Some((1, 6)), "the records of the file still there");
        assert_eq!(w.read(5, 7).unwrap(), vec![big(5).1, big(6).1]);
        assert_stopped(&w, &err);
        drop(w);
        restore();
        let w = Wal::open(&d.path().join(DIR), NAME, MAX).unwrap();
        assert_eq!(w.range(), Some((1, 6)), "a prefix of the old log");
        w.truncate_from(2).unwrap();
        assert_eq!(w.range(), Some((1, 1)));

        // Truncate: the later files go, shortening the one holding the cut
        // fails.
        let d = tempfile::tempdir().unwrap();
        let w = filled(d.path());
        w.lock().segments[0].file = Arc::new(OpenOptions::new().write(true).open("/dev/full").unwrap());
        let err = w.truncate_from(2).unwrap_err();
        assert!(matches!(err, WalError::Io { name: NAME, .. }), "{err:?}");
        assert_stopped(&w, &err);

        // Purge: the first file cannot go.
        let d = tempfile::tempdir().unwrap();
        let w = filled(d.path());
        let restore = make_unlink_fail(&d.path().join(DIR), &segment_name(1));
        let err = w.purge_upto(4).unwrap_err();
        assert!(matches!(err, WalError::Io { name: NAME, .. }), "{err:?}");
        assert_eq!(w.range(), Some((5, 7)));
        assert_eq!(w.read(5, 6).unwrap(), vec![big(5).1]);
        assert_stopped(&w, &err);
        drop(w);
        restore();
        let w = Wal::open(&d.path().join(DIR), NAME, MAX).unwrap();
        w.purge_upto(4).unwrap();
        assert_eq!(w.range(), Some((5, 7)));
    }

    /// Opening creates the log's own directory (its parent must exist);
    /// `has_entry_files` looks in that directory, and finds nothing where
    /// there is no directory or no file yet.
    #[test]
    fn open_creates_the_directory_and_has_entry_files_looks_in_it() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(DIR);
        assert!(!has_entry_files(&dir));
        let w = open(d.path()).unwrap();
        assert_eq!(w.dir(), dir.as_path());
        assert!(dir.is_dir());
        assert!(!has_entry_files(&dir));
        assert!(!has_entry_files(d.path()), "the parent directory is not the log's");
        w.append(&[e(1)]).unwrap();
        w.sync().unwrap();
        assert!(has_entry_files(&dir));
        let err = Wal::open(&d.path().join("no").join(DIR), NAME, SEGMENT_BYTES_MAX)
            .err()
            .expect("a parent that is not there is an error");
        assert!(matches!(err, WalError::Io { name: NAME, .. }), "{err:?}");
        assert!(err.to_string().starts_with("test log "), "{err}");
    }

    /// Every message starts with the name given to `open`; a full disk is
    /// `is_no_space` when it happens and in the `Stopped` error of every
    /// call after it, any other failure in neither.
    #[test]
    fn errors_carry_the_logs_name_and_a_full_disk_stays_one() {
        const PARTICIPANT: &str = "participant log";
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(DIR);

        let w = Wal::open(&dir, PARTICIPANT, SEGMENT_BYTES_MAX).unwrap();
        w.append(&[e(1)]).unwrap();
        let gap = w.append(&[e(3)]).unwrap_err();
        assert!(matches!(gap, WalError::Gap { name: PARTICIPANT, .. }), "{gap:?}");
        assert_eq!(gap.to_string(), "participant log: append of index 3 where 2 comes next");
        assert!(!gap.is_no_space());
        let stopped = w.sync().unwrap_err();
        assert!(
            matches!(stopped, WalError::Stopped { no_space: false, .. }),
            "{stopped:?}"
        );
        assert!(!stopped.is_no_space());
        assert_eq!(
            stopped.to_string(),
            "participant log stopped after an earlier failure: participant log: append of index 3 where 2 comes next"
        );
        drop(w);

        // The same mapping of an I/O error as every write and sync uses.
        let quota = io_err(PARTICIPANT, Path::new("/d/log"))(std::io::ErrorKind::QuotaExceeded.into());
        assert!(quota.is_no_space(), "{quota:?}");
        assert!(
            quota.to_string().starts_with("participant log /d/log: disk full ("),
            "{quota}"
        );
        let other = io_err(PARTICIPANT, Path::new("/d/log"))(std::io::ErrorKind::PermissionDenied.into());
        assert!(matches!(other, WalError::Io { name: PARTICIPANT, .. }), "{other:?}");
        assert!(!other.is_no_space());

        // A real full disk: the last file's writes go to /dev/full, where
        // every write fails with ENOSPC.
        let w = Wal::open(&dir, PARTICIPANT, SEGMENT_BYTES_MAX).unwrap();
        assert_eq!(w.range(), Some((1, 1)));
        {
            let mut g = w.lock();
            let seg = g.segments.last_mut().expect("a file");
            seg.file = Arc::new(OpenOptions::new().write(true).open("/dev/full").unwrap());
        }
        let full = w.append(&[e(2)]).unwrap_err();
        assert!(matches!(full, WalError::NoSpace { name: PARTICIPANT, .. }), "{full:?}");
        assert!(full.is_no_space());
        let text = full.to_string();
        assert!(
            text.starts_with(&format!(
                "participant log {}: disk full (",
                dir.join(segment_name(1)).display()
            )),
            "{text}"
        );
        for stopped in [
            w.sync().unwrap_err(),
            w.append(&[e(2)]).unwrap_err(),
            w.truncate_from(1).unwrap_err(),
            w.purge_upto(1).unwrap_err(),
        ] {
            assert!(
                matches!(stopped, WalError::Stopped { no_space: true, .. }),
                "{stopped:?}"
            );
            assert!(stopped.is_no_space());
            assert_eq!(
                stopped.to_string(),
                format!("participant log stopped after an earlier failure: {text}")
            );
        }
    }
    /// Every file starts with the header naming its format version, the
    /// one this build writes; what was written reads back after a reopen.
    #[test]
    fn every_file_starts_with_the_header_of_this_builds_format_version() {
        const MAX: u64 = 200;
        let r = |i: u64| (i, vec![i as u8; 40]);
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(DIR);
        let w = Wal::open(&dir, NAME, MAX).unwrap();
        for i in 1..=6 {
            w.append(&[r(i)]).unwrap();
        }
        w.sync().unwrap();
        drop(w);
        let header = crate::format::file_header(WAL_FILE_MAGIC, WAL_FORMAT_VERSION);
        for first in [1, 5] {
            let b = std::fs::read(dir.join(segment_name(first))).unwrap();
            assert_eq!(b[..WAL_FILE_HEADER_BYTES], header, "file {first}");
            assert_eq!(
                crate::format::read_file_header(WAL_FILE_MAGIC, &b),
                Some(WAL_FORMAT_VERSION)
            );
        }
        let w = Wal::open(&dir, NAME, MAX).unwrap();
        assert_eq!(read_all(&w), (1..=6).map(r).collect::<Vec<_>>());
        check_format(&dir, NAME).expect("this build's files pass");
        check_format(&d.path().join("none"), NAME).expect("no directory: no files to refuse");
    }

    /// A file of a newer format version is refused by name, with the
    /// version found and the one this build reads, never cut as a torn
    /// tail (even as the last file), and left as it was.
    #[test]
    fn a_file_of_a_newer_format_version_is_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        let w = open(d.path()).unwrap();
        w.append(&[e(1), e(2)]).unwrap();
        w.sync().unwrap();
        drop(w);
        let path = d.path().join(DIR).join(segment_name(1));
        let mut b = std::fs::read(&path).unwrap();
        b[..WAL_FILE_HEADER_BYTES].copy_from_slice(&crate::format::file_header(WAL_FILE_MAGIC, WAL_FORMAT_VERSION + 1));
        std::fs::write(&path, &b).unwrap();
        let err = open(d.path()).err().expect("refused");
        assert!(
            matches!(&err, WalError::Format(v) if v.is_newer() && v.found() == Some(2)),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "test log file {} format version 2 is newer than this build reads (1): upgrade the binary",
                path.display()
            )
        );
        assert_eq!(std::fs::read(&path).unwrap(), b, "left as it was");
        let checked = check_format(&d.path().join(DIR), NAME).unwrap_err();
        assert_eq!(checked.to_string(), err.to_string(), "the same refusal without opening");
    }

    /// A file of the layout before headers (records from its first byte, a
    /// pre-release layout) is refused by name, not read and not cut.
    #[test]
    fn a_file_without_a_header_is_a_pre_release_layout_and_refused() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(DIR);
        std::fs::create_dir(&dir).unwrap();
        let mut b = Vec::new();
        encode_record(7, b"entry 7", &mut b);
        encode_record(8, b"entry 8", &mut b);
        let path = dir.join(segment_name(7));
        std::fs::write(&path, &b).unwrap();
        let err = open(d.path()).err().expect("refused");
        assert!(
            matches!(&err, WalError::Format(crate::format::VersionError::Unversioned { .. })),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "test log file {} carries no format version: a pre-release layout, which this build does not read (it reads format version 1)",
                path.display()
            )
        );
        assert_eq!(std::fs::read(&path).unwrap(), b, "left as it was");
        let checked = check_format(&dir, NAME).unwrap_err();
        assert_eq!(checked.to_string(), err.to_string(), "the same refusal without opening");
    }

    /// The last file's header goes out with its first records: a crash
    /// before their sync can tear it, and opening cuts that file to
    /// nothing (none of it was acknowledged). In any other file a header
    /// that does not read back is damage.
    #[test]
    fn a_torn_header_is_cut_in_the_last_file_and_damage_elsewhere() {
        const MAX: u64 = 200;
        let r = |i: u64| (i, vec![i as u8; 40]);
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join(DIR);
        let w = Wal::open(&dir, NAME, MAX).unwrap();
        for i in 1..=5 {
            w.append(&[r(i)]).unwrap();
        }
        w.sync().unwrap();
        drop(w);
        let second = dir.join(segment_name(5));
        let mut torn = crate::format::file_header(WAL_FILE_MAGIC, WAL_FORMAT_VERSION)[..5].to_vec();
        torn.resize(64, 0);
        std::fs::write(&second, &torn).unwrap();
        let w = Wal::open(&dir, NAME, MAX).unwrap();
        assert_eq!(read_all(&w), (1..=4).map(r).collect::<Vec<_>>());
        w.append(&[r(5)]).unwrap();
        w.sync().unwrap();
        drop(w);
        let w = Wal::open(&dir, NAME, MAX).unwrap();
        assert_eq!(read_all(&w), (1..=5).map(r).collect::<Vec<_>>());
        drop(w);
        // The first file's header damaged, a file after it.
        let first = dir.join(segment_name(1));
        let mut b = std::fs::read(&first).unwrap();
        b[3] ^= 0xff;
        std::fs::write(&first, &b).unwrap();
        let err = Wal::open(&dir, NAME, MAX).err().expect("damage is an error");
        assert!(matches!(err, WalError::Damaged { .. }), "{err:?}");
        assert!(err.to_string().contains("file header does not read back"), "{err}");
        assert!(err.to_string().contains("not a torn write"), "{err}");
    }
}
