//! Small filesystems for disk-full tests (feature `disk`, for
//! dev-dependencies only): a size-limited tmpfs on a directory, a ballast
//! file that fills it to the last byte, and the free space left. Mounting
//! needs root, as CI runs.

use std::io::Write;
use std::path::Path;
use std::path::PathBuf;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;

/// A size-limited tmpfs mounted on a directory; unmounted on drop (also
/// when the test panics). Keep it alive longer than every process or store
/// that has files on it.
pub struct SmallFs {
    dir: PathBuf,
    // A fresh mount point, removed after the unmount (field order: dropped
    // after `Drop::drop` ran).
    _fresh: Option<tempfile::TempDir>,
}

impl SmallFs {
    /// A `bytes`-byte tmpfs on a fresh temporary directory.
    pub fn new(bytes: u64) -> SmallFs {
        let fresh = tempfile::tempdir().expect("create a mount point");
        let mut fs = SmallFs::mount(fresh.path(), bytes);
        fs._fresh = Some(fresh);
        fs
    }

    /// A `bytes`-byte tmpfs on `dir` (created if missing). Panics, saying
    /// why, if it cannot be mounted (not root, say).
    pub fn mount(dir: &Path, bytes: u64) -> SmallFs {
        std::fs::create_dir_all(dir).expect("create the mount point");
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "could not mount a {bytes}-byte tmpfs on {} (these tests need root): {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
        SmallFs {
            dir: dir.to_path_buf(),
            _fresh: None,
        }
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The ballast file [`fill`](SmallFs::fill) writes.
    pub fn ballast(&self) -> PathBuf {
        self.dir.join("ballast")
    }

    /// Appends to the ballast file until the filesystem has no byte left
    /// (large writes first, then smaller ones down to one byte); returns
    /// its path.
    pub fn fill(&self) -> PathBuf {
        let path = self.ballast();
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .expect("open the ballast file");
        for chunk in [1usize << 20, 1 << 16, 4096, 512, 1] {
            let buf = vec![0xa5u8; chunk];
            loop {
                match f.write(&buf) {
                    Ok(0) => break,
                    Ok(_) => {}
                    Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                    Err(e) => panic!("writing the ballast into {}: {e}", self.dir.display()),
                }
            }
        }
        let _ = f.sync_all();
        path
    }

    /// Removes the ballast file: the filesystem has its room back.
    pub fn free(&self) {
        std::fs::remove_file(self.ballast()).expect("remove the ballast file");
    }

    /// Bytes an unprivileged writer may still use on this filesystem.
    pub fn free_bytes(&self) -> u64 {
        free_bytes(&self.dir)
    }
}

/// Bytes an unprivileged writer may still use on the filesystem of `dir`
/// (statvfs: available blocks times fragment size).
pub fn free_bytes(dir: &Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).expect("a path without NUL");
    // SAFETY: statvfs(3) fills the zeroed struct; the path is a valid C string.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        assert_eq!(libc::statvfs(c.as_ptr(), &mut st), 0, "statvfs {}", dir.display());
        st.f_bavail as u64 * st.f_frsize as u64
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        // A store's own threads may still be closing their files for a
        // moment; then detach it, and the kernel frees it once the last
        // file is closed.
        for _ in 0..40 {
            let unmounted = Command::new("umount")
                .arg(&self.dir)
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if unmounted {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}
