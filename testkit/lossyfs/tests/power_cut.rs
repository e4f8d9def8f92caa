//! The lossy filesystem on a real mount: what a power cut keeps and what it
//! throws away (the model in the crate docs and ADR 0032), through the
//! ordinary std::fs calls our stores make, and a real `dtx_durable::wal::Wal`
//! reopened after a cut.
//!
//! Each test mounts its own filesystem on a fresh temporary directory. Without
//! /dev/fuse or the right to mount, each says so and passes, unless
//! `DTX_REQUIRE_FUSE=1` (CI), where it fails.

use std::fs::File;
use std::fs::OpenOptions;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use dtx_durable::wal::Wal;
use dtx_lossyfs::mount_or_skip;
use dtx_lossyfs::LossyFs;

/// A mount on a fresh directory; the mount goes first when dropped (fields
/// drop in order), then the directory.
struct Mounted {
    fs: LossyFs,
    _dir: tempfile::TempDir,
}

impl std::ops::Deref for Mounted {
    type Target = LossyFs;
    fn deref(&self) -> &LossyFs {
        &self.fs
    }
}

fn mount(test: &str) -> Option<Mounted> {
    let dir = tempfile::tempdir().unwrap();
    let fs = mount_or_skip(test, dir.path())?;
    Some(Mounted { fs, _dir: dir })
}

fn sync_dir(p: &Path) {
    File::open(p).unwrap().sync_all().unwrap();
}

fn names(p: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(p)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    v.sort();
    v
}

#[test]
fn unsynced_writes_vanish_and_synced_ones_stay() {
    let Some(fs) = mount("unsynced_writes_vanish_and_synced_ones_stay") else {
        return;
    };
    let root = fs.path().to_path_buf();
    let a = root.join("a");
    let mut f = File::create(&a).unwrap();
    sync_dir(&root);
    f.write_all(b"synced ").unwrap();
    f.sync_data().unwrap();
    f.write_all(b"not synced").unwrap();
    // Before the cut everything reads back, from the mount and the handle.
    assert_eq!(std::fs::read(&a).unwrap(), b"synced not synced");
    assert_eq!(fs.unsynced_bytes(), 10);
    drop(f);
    let report = fs.power_cut();
    assert_eq!(report.files_reverted, 1, "{report:?}");
    assert_eq!(report.bytes_lost, 10, "{report:?}");
    assert_eq!(std::fs::read(&a).unwrap(), b"synced ");
    assert_eq!(std::fs::metadata(&a).unwrap().len(), 7);
    assert_eq!(fs.unsynced_bytes(), 0);

    // An overwrite in place not synced is undone too, a synced one stays.
    let f = OpenOptions::new().write(true).open(&a).unwrap();
    f.write_all_at(b"S", 0).unwrap();
    f.sync_all().unwrap();
    f.write_all_at(b"XXXX", 1).unwrap();
    drop(f);
    fs.power_cut();
    assert_eq!(std::fs::read(&a).unwrap(), b"Synced ");
}

#[test]
fn a_new_file_needs_its_directory_synced() {
    let Some(fs) = mount("a_new_file_needs_its_directory_synced") else {
        return;
    };
    let root = fs.path().to_path_buf();
    std::fs::create_dir(root.join("d")).unwrap();
    let d = root.join("d");
    // Fsynced file, directory not synced: gone (the model is stricter than
    // ext4's journal here, on purpose: crate docs).
    let mut f = File::create(d.join("fsynced-only")).unwrap();
    f.write_all(b"x").unwrap();
    f.sync_all().unwrap();
    drop(f);
    fs.power_cut();
    assert!(!root.join("d").exists(), "mkdir not made durable by syncing the root");

    std::fs::create_dir(&d).unwrap();
    sync_dir(&root);
    let mut f = File::create(d.join("both")).unwrap();
    f.write_all(b"kept").unwrap();
    f.sync_all().unwrap();
    sync_dir(&d);
    // Created after the directory's sync: gone with its data.
    let mut g = File::create(d.join("late")).unwrap();
    g.write_all(b"late").unwrap();
    g.sync_all().unwrap();
    drop((f, g));
    let report = fs.power_cut();
    assert_eq!(report.dirs_reverted, 1, "{report:?}");
    assert_eq!(names(&d), vec!["both"]);
    assert_eq!(std::fs::read(d.join("both")).unwrap(), b"kept");

    // A directory synced with a new entry, the file's data never synced:
    // the name lasts, empty.
    let mut h = File::create(d.join("empty")).unwrap();
    h.write_all(b"lost").unwrap();
    sync_dir(&d);
    drop(h);
    fs.power_cut();
    assert_eq!(names(&d), vec!["both", "empty"]);
    assert_eq!(std::fs::read(d.join("empty")).unwrap(), b"");
}

#[test]
fn a_rename_without_a_directory_sync_is_undone() {
    let Some(fs) = mount("a_rename_without_a_directory_sync_is_undone") else {
        return;
    };
    let root = fs.path().to_path_buf();
    // The checkpoint pattern (participant-sdk's kv.rs): write a temporary
    // file, sync it, rename it over the old one, sync the directory.
    std::fs::write(root.join("ckpt"), b"old").unwrap();
    File::open(root.join("ckpt")).unwrap().sync_all().unwrap();
    sync_dir(&root);
    std::fs::write(root.join("ckpt.tmp"), b"new").unwrap();
    File::open(root.join("ckpt.tmp")).unwrap().sync_all().unwrap();
    std::fs::rename(root.join("ckpt.tmp"), root.join("ckpt")).unwrap();
    assert_eq!(std::fs::read(root.join("ckpt")).unwrap(), b"new");
    fs.power_cut();
    assert_eq!(
        names(&root),
        vec!["ckpt"],
        "neither the temporary name nor the rename lasted"
    );
    assert_eq!(std::fs::read(root.join("ckpt")).unwrap(), b"old");

    // With the directory synced, the rename lasts.
    std::fs::write(root.join("ckpt.tmp"), b"new").unwrap();
    File::open(root.join("ckpt.tmp")).unwrap().sync_all().unwrap();
    std::fs::rename(root.join("ckpt.tmp"), root.join("ckpt")).unwrap();
    sync_dir(&root);
    fs.power_cut();
    assert_eq!(names(&root), vec!["ckpt"]);
    assert_eq!(std::fs::read(root.join("ckpt")).unwrap(), b"new");

    // An unlink not synced comes back, with the file's durable content.
    std::fs::remove_file(root.join("ckpt")).unwrap();
    assert!(names(&root).is_empty());
    fs.power_cut();
    assert_eq!(std::fs::read(root.join("ckpt")).unwrap(), b"new");
}

#[test]
fn a_truncate_not_synced_is_undone() {
    let Some(fs) = mount("a_truncate_not_synced_is_undone") else {
        return;
    };
    let root = fs.path().to_path_buf();
    let p = root.join("t");
    let f = File::create(&p).unwrap();
    sync_dir(&root);
    f.write_all_at(b"0123456789", 0).unwrap();
    f.sync_data().unwrap();
    f.set_len(4).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), b"0123");
    drop(f);
    fs.power_cut();
    assert_eq!(std::fs::read(&p).unwrap(), b"0123456789");

    // Shortened and grown again before a sync: the grown part is zeros.
    let f = OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(2).unwrap();
    f.set_len(6).unwrap();
    f.sync_all().unwrap();
    f.set_len(0).unwrap();
    drop(f);
    fs.power_cut();
    assert_eq!(std::fs::read(&p).unwrap(), b"01\0\0\0\0");

    // O_TRUNC is a truncate like any other.
    drop(File::create(&p).unwrap());
    assert_eq!(std::fs::read(&p).unwrap(), b"");
    fs.power_cut();
    assert_eq!(std::fs::read(&p).unwrap(), b"01\0\0\0\0");
}

#[test]
fn locks_statfs_and_fallocate_work_as_sled_and_the_stores_need() {
    let Some(fs) = mount("locks_statfs_and_fallocate_work_as_sled_and_the_stores_need") else {
        return;
    };
    let p = fs.path().join("db");
    let a = File::create(&p).unwrap();
    let b = File::open(&p).unwrap();
    // flock, as sled (fs2) and the data directory lock take it.
    // SAFETY: flock(2) on descriptors owned by `a` and `b`.
    unsafe {
        assert_eq!(libc::flock(a.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB), 0);
        assert_eq!(libc::flock(b.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB), -1);
        assert_eq!(std::io::Error::last_os_error().raw_os_error(), Some(libc::EWOULDBLOCK));
    }
    drop(a);
    // SAFETY: as above.
    unsafe {
        assert_eq!(libc::flock(b.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB), 0);
    }
    let free = dtx_durable::free_bytes(fs.path()).unwrap();
    assert!(free > 1 << 30, "free {free}");
    // fallocate grows the file (zeros), not durable until synced.
    let f = OpenOptions::new().write(true).open(&p).unwrap();
    // SAFETY: fallocate(2) on a descriptor owned by `f`.
    assert_eq!(unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, 4096) }, 0);
    assert_eq!(std::fs::metadata(&p).unwrap().len(), 4096);
    drop((b, f));
    fs.power_cut();
    assert!(!p.exists(), "the root was never synced");
}

#[test]
fn a_set_capacity_fills_up_with_enospc_and_frees_again() {
    let Some(fs) = mount("a_set_capacity_fills_up_with_enospc_and_frees_again") else {
        return;
    };
    let keep = fs.path().join("keep");
    std::fs::write(&keep, vec![1u8; 10_000]).unwrap();
    let used = fs.used_bytes();
    assert_eq!(used, 4096 + 3 * 4096, "the root and three blocks of data");
    fs.set_capacity(Some(used + (1 << 20)));
    let free = dtx_durable::free_bytes(fs.path()).unwrap();
    assert_eq!(free, 1 << 20, "statfs reports the capacity");
    // A filler takes what is left, then the next write is refused.
    let filler = fs.path().join("filler");
    let mut f = File::create(&filler).unwrap();
    let chunk = vec![0x5au8; 64 << 10];
    let mut written = 0u64;
    let err = loop {
        match f.write_all(&chunk) {
            Ok(()) => written += chunk.len() as u64,
            Err(e) => break e,
        }
    };
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    assert_eq!(written, 1 << 20, "exactly the margin");
    // Overwriting in place needs no room; growing another file does.
    f.write_all_at(b"x", 0).unwrap();
    let e = std::fs::write(fs.path().join("more"), b"y").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
    // Deleting the filler frees its room at once (its node waits for the
    // cut, its blocks do not count), and no capacity is roomy again.
    drop(f);
    std::fs::remove_file(&filler).unwrap();
    std::fs::write(fs.path().join("more"), b"y").unwrap();
    fs.set_capacity(None);
    assert!(dtx_durable::free_bytes(fs.path()).unwrap() > 1 << 30);
    assert_eq!(std::fs::read(&keep).unwrap().len(), 10_000);
}

fn entry(i: u64) -> (u64, Vec<u8>) {
    (i, format!("record {i}").into_bytes())
}

fn read_all(w: &Wal) -> Vec<(u64, Vec<u8>)> {
    match w.range() {
        None => vec![],
        Some((a, b)) => (a..=b).zip(w.read(a, b + 1).unwrap()).collect(),
    }
}

#[test]
fn a_wal_keeps_exactly_its_synced_records() {
    let Some(fs) = mount("a_wal_keeps_exactly_its_synced_records") else {
        return;
    };
    let log = fs.path().join("log");
    let w = Wal::open(&log, "test log", 64 << 20).unwrap();
    w.append(&(1..=5).map(entry).collect::<Vec<_>>()).unwrap();
    w.sync().unwrap();
    w.append(&(6..=8).map(entry).collect::<Vec<_>>()).unwrap();
    assert_eq!(read_all(&w).len(), 8);
    drop(w);
    let report = fs.power_cut();
    assert!(report.bytes_lost > 0, "{report:?}");
    let w = Wal::open(&log, "test log", 64 << 20).unwrap();
    assert_eq!(read_all(&w), (1..=5).map(entry).collect::<Vec<_>>());
    // And it goes on from there.
    w.append(&[entry(6)]).unwrap();
    w.sync().unwrap();
    drop(w);
    fs.power_cut();
    let w = Wal::open(&log, "test log", 64 << 20).unwrap();
    assert_eq!(read_all(&w), (1..=6).map(entry).collect::<Vec<_>>());
}

/// New files and directory syncs: the log starts a new segment every few
/// records. Whatever the log syncs on its own when it starts a segment, what
/// `sync` covered is there after the cut, and the records appended after it
/// into the last segment (never synced) are not.
#[test]
fn a_wal_with_small_segments_keeps_its_synced_records() {
    let Some(fs) = mount("a_wal_with_small_segments_keeps_its_synced_records") else {
        return;
    };
    let log = fs.path().join("log");
    let w = Wal::open(&log, "test log", 64).unwrap();
    for i in 1..=10 {
        w.append(&[entry(i)]).unwrap();
    }
    w.sync().unwrap();
    for i in 11..=20 {
        w.append(&[entry(i)]).unwrap();
    }
    assert!(names(&log).len() > 3, "several segments: {:?}", names(&log));
    drop(w);
    let report = fs.power_cut();
    assert!(report.bytes_lost > 0, "{report:?}");
    let w = Wal::open(&log, "test log", 64).unwrap();
    let got = read_all(&w);
    assert!(got.len() >= 10 && got.len() < 20, "kept {} records", got.len());
    assert_eq!(got, (1..=got.len() as u64).map(entry).collect::<Vec<_>>());
}

/// A cut during writes (ADR 0022's torn tail): the log reopens on every
/// seed, with its synced records and then at most a prefix of the rest.
#[test]
fn a_wal_torn_at_any_point_reopens_on_a_prefix() {
    let Some(fs) = mount("a_wal_torn_at_any_point_reopens_on_a_prefix") else {
        return;
    };
    let mut lengths = std::collections::BTreeSet::new();
    for seed in 0..24u64 {
        let log = fs.path().join(format!("log{seed}"));
        let w = Wal::open(&log, "test log", 64 << 20).unwrap();
        w.append(&(1..=3).map(entry).collect::<Vec<_>>()).unwrap();
        w.sync().unwrap();
        for i in 4..=9 {
            w.append(&[entry(i)]).unwrap();
        }
        drop(w);
        fs.power_cut_torn(seed);
        let w = Wal::open(&log, "test log", 64 << 20)
            .unwrap_or_else(|e| panic!("seed {seed}: the log does not reopen after a torn cut: {e}"));
        let got = read_all(&w);
        assert!(got.len() >= 3, "seed {seed}: synced records lost: {got:?}");
        assert_eq!(
            got,
            (1..=got.len() as u64).map(entry).collect::<Vec<_>>(),
            "seed {seed}"
        );
        lengths.insert(got.len());
        // Appends go on after whatever was kept, and last.
        let next = got.len() as u64 + 1;
        w.append(&[entry(next)]).unwrap();
        w.sync().unwrap();
        drop(w);
        fs.power_cut();
        let w = Wal::open(&log, "test log", 64 << 20).unwrap();
        assert_eq!(read_all(&w).len() as u64, next, "seed {seed}");
    }
    assert!(lengths.len() > 1, "the seeds tore at different points: {lengths:?}");
}
