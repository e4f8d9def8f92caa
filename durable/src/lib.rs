//! Durable storage shared by the coordinator and the participant SDK:
//!
//! - [`DirSync`]: the durability that sled 0.34's `flush` does not give on
//!   Linux (below);
//! - [`wal`]: an append-only log of checksummed, numbered records in
//!   segment files, made durable by one `fdatasync` per flush (the
//!   coordinator's Raft log, the participant store's log);
//! - [`is_no_space_io`]: which I/O errors mean a full disk;
//! - [`format`]: the one rule for reading a stored format (its version
//!   dispatches: this build's decodes, any other is refused by name).
//!
//! # `DirSync`
//!
//! sled writes each log buffer with `sync_file_range(WAIT_BEFORE | WRITE |
//! WAIT_AFTER)`: the data pages reach the device, but the file's size (its
//! log grows as segments are added) stays in the filesystem's journal until
//! its next commit, and the disk's write cache is not flushed. It calls
//! `fsync` only from its periodic flush thread, which a store that flushes
//! where it must turns off. Tree nodes larger than a quarter segment (for
//! example a large snapshot value) go to files under `blobs/`, written with
//! no sync at all. A `kill -9` loses none of this (the page cache survives
//! the process), but a power loss or a crash of the machine can lose writes
//! sled reported flushed: a Raft vote or log entry, a participant's YES.
//!
//! [`DirSync::flush`] is sled's `flush` followed by [`DirSync::sync`], which
//! finishes the job: `fdatasync` of the data file, and `fsync` of every blob
//! file not synced before and then of the `blobs` directory, so that its
//! entries last too. Every store flushes through it.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

pub mod format;
pub mod wal;

/// sled's data file in its directory.
const DATA_FILE: &str = "db";
/// sled's configuration file in its directory.
const CONF_FILE: &str = "conf";
/// sled's directory of blob files.
const BLOBS_DIR: &str = "blobs";

/// Syncs one sled directory after sled's `flush`. Open it after sled has
/// opened the directory (sled creates the data file).
#[derive(Debug)]
pub struct DirSync {
    data: File,
    blobs: PathBuf,
    /// Blob files synced already (sled never rewrites one in place: a new
    /// version is a new file, an old one is removed).
    synced_blobs: Mutex<HashSet<OsString>>,
}

impl DirSync {
    /// Opens the data file of the sled directory `dir` and syncs the
    /// directory itself, so that the names sled created in it (the data
    /// file, its configuration, `blobs`) last.
    pub fn open(dir: &Path) -> io::Result<DirSync> {
        let data = File::open(dir.join(DATA_FILE)).map_err(|e| with_path(e, &dir.join(DATA_FILE)))?;
        // sled writes `conf` (a new directory's, or one it found empty)
        // with two writes and no fsync: a power cut could keep half of it,
        // which sled then refuses to open.
        // (A directory without one, as some tests make, has nothing to
        // sync there.)
        let conf = dir.join(CONF_FILE);
        match File::open(&conf) {
            Ok(f) => f.sync_all().map_err(|e| with_path(e, &conf))?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(with_path(e, &conf)),
        }
        sync_dir(dir)?;
        Ok(DirSync {
            data,
            blobs: dir.join(BLOBS_DIR),
            synced_blobs: Mutex::new(HashSet::new()),
        })
    }

    /// sled's flush of the database `tree` belongs to (every tree of it),
    /// then [`DirSync::sync`]: what a store calls before it reports writes
    /// durable.
    pub fn flush(&self, tree: &sled::Tree) -> sled::Result<()> {
        tree.flush()?;
        self.sync().map(|_| ()).map_err(sled::Error::Io)
    }

    /// Makes what sled flushed durable: `fdatasync` of the data file, then
    /// `fsync` of each blob file not synced before and of the blobs
    /// directory when there was one. Returns how many blob files it synced.
    /// Call it after sled's `flush` returned and before reporting the
    /// writes durable.
    pub fn sync(&self) -> io::Result<usize> {
        self.data.sync_data()?;
        self.sync_new_blobs()
    }

    fn sync_new_blobs(&self) -> io::Result<usize> {
        let entries = match std::fs::read_dir(&self.blobs) {
            Ok(e) => e,
            // sled creates the directory on first use.
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(with_path(e, &self.blobs)),
        };
        let mut synced = self.synced_blobs.lock().unwrap_or_else(|p| p.into_inner());
        let mut present = HashSet::new();
        let mut new = 0;
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name();
            if !synced.contains(&name) {
                let path = entry.path();
                match File::open(&path) {
                    Ok(f) => f.sync_all().map_err(|e| with_path(e, &path))?,
                    // Removed by sled's blob GC between the listing and
                    // the open: nothing left to make durable.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(with_path(e, &path)),
                }
                new += 1;
            }
            present.insert(name);
        }
        if new > 0 {
            sync_dir(&self.blobs)?;
        }
        // Forget the names sled removed, so the set stays the size of the
        // directory.
        *synced = present;
        Ok(new)
    }
}

/// Bytes an unprivileged writer can still use on the filesystem holding
/// `path` (what `df` shows as available).
pub fn free_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "path contains a NUL byte"))?;
    // SAFETY: statvfs(3) only writes into the zeroed struct we pass; `c` is
    // a valid NUL-terminated path for the duration of the call.
    let (rc, st) = unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        let rc = libc::statvfs(c.as_ptr(), &mut st);
        (rc, st)
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // The field types differ between platforms (u32 on some 32-bit ones).
    #[allow(clippy::unnecessary_cast)]
    let (blocks, block_size) = (st.f_bavail as u64, st.f_frsize as u64);
    Ok(blocks.saturating_mul(block_size))
}

/// True for an I/O error that means "no space left": ENOSPC or EDQUOT
/// (std gives them the kinds `StorageFull` and `QuotaExceeded`), also after
/// sled has re-wrapped the error (its `Clone` keeps only the kind and the
/// debug text).
pub fn is_no_space_io(e: &io::Error) -> bool {
    if matches!(e.kind(), io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded) {
        return true;
    }
    let text = format!("{e:?}");
    text.contains("No space left on device") || text.contains("Disk quota exceeded")
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| with_path(e, dir))
}

fn with_path(e: io::Error, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Linux's ENOSPC (28) and EDQUOT (122) as the OS reports them, the
    /// kinds std gives them, and their text in an error that kept only
    /// that; nothing else.
    #[test]
    fn no_space_is_recognised_by_kind_and_by_text() {
        #[cfg(target_os = "linux")]
        {
            assert!(is_no_space_io(&io::Error::from_raw_os_error(28)));
            assert!(is_no_space_io(&io::Error::from_raw_os_error(122)));
            assert!(!is_no_space_io(&io::Error::from_raw_os_error(5)));
        }
        assert!(is_no_space_io(&io::ErrorKind::StorageFull.into()));
        assert!(is_no_space_io(&io::ErrorKind::QuotaExceeded.into()));
        let rewrapped = io::Error::other("Os { code: 28, kind: StorageFull, message: \"No space left on device\" }");
        assert!(is_no_space_io(&rewrapped));
        assert!(!is_no_space_io(&io::Error::other("Disk quota")));
        assert!(!is_no_space_io(&io::ErrorKind::PermissionDenied.into()));
    }

    #[test]
    fn a_directory_without_a_data_file_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let e = DirSync::open(dir.path()).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(e.to_string().contains(DATA_FILE), "{e}");
    }

    #[test]
    fn each_blob_file_is_synced_once_and_removed_ones_are_forgotten() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(DATA_FILE), b"x").unwrap();
        let s = DirSync::open(dir.path()).unwrap();
        // No blobs directory yet.
        assert_eq!(s.sync().unwrap(), 0);
        let blobs = dir.path().join(BLOBS_DIR);
        std::fs::create_dir(&blobs).unwrap();
        std::fs::write(blobs.join("1"), b"a").unwrap();
        std::fs::write(blobs.join("2"), b"b").unwrap();
        assert_eq!(s.sync().unwrap(), 2);
        assert_eq!(s.sync().unwrap(), 0);
        std::fs::remove_file(blobs.join("1")).unwrap();
        std::fs::write(blobs.join("3"), b"c").unwrap();
        assert_eq!(s.sync().unwrap(), 1);
        assert_eq!(s.synced_blobs.lock().unwrap().len(), 2);
    }

    /// The layout this crate relies on: sled 0.34 keeps its log in `db`
    /// and writes a large value's node to a file under `blobs/`, which
    /// its flush does not sync.
    #[test]
    fn sled_writes_a_large_value_to_a_blob_file_that_sync_then_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::Config::new()
            .path(dir.path())
            .flush_every_ms(None)
            .open()
            .unwrap();
        let s = DirSync::open(dir.path()).unwrap();
        db.insert(b"small", &b"v"[..]).unwrap();
        db.flush().unwrap();
        assert_eq!(s.sync().unwrap(), 0, "a small value is not a blob");
        db.insert(b"large", vec![7u8; 1 << 20]).unwrap();
        db.flush().unwrap();
        assert!(s.sync().unwrap() >= 1, "a 1 MiB value is written to a blob file");
        assert_eq!(s.sync().unwrap(), 0);
        // `flush` is sled's flush and then `sync`: the next blob is synced
        // by it (a later `sync` finds nothing new), and it is there.
        let blobs = || -> HashSet<OsString> {
            std::fs::read_dir(dir.path().join(BLOBS_DIR))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect()
        };
        let before = blobs();
        db.insert(b"larger", vec![8u8; 1 << 20]).unwrap();
        s.flush(&db).unwrap();
        assert!(!blobs().is_subset(&before), "the second large value is a new blob file");
        assert_eq!(s.sync().unwrap(), 0, "flush synced it already");
    }
}
