//! The small filesystems of the `disk-full` nemesis: a size-limited tmpfs
//! mounted (as root) on a data directory before its process first starts,
//! filled with a filler file until the kernel says ENOSPC, freed again, and
//! unmounted at the end of the run, also when the run fails or panics (on
//! drop). A tmpfs only takes the memory its files use, so it is mounted with
//! a roomy limit ([`ROOMY_BYTES`]); to fill it, the limit is first lowered
//! to what is in use plus [`FILL_MARGIN_BYTES`] (which the filler then
//! takes), and raised again when space is freed.
//!
//! Every mount's source is named `dtx-jepsen-<base port>`, so a run can
//! find and unmount what an earlier run that was killed outright left
//! behind ([`unmount_stale`]).
//!
//! With `power-cut` in the run, every data directory is a lossy FUSE mount
//! instead (`crate::power`), and the two `disk-full` fills are that mount
//! with a capacity ([`SmallFs::on_lossy`]): lowered to what is in use plus
//! the margin to fill, removed to free. The same directory is then both
//! filled and cut.

use std::ffi::CString;
use std::io::Write;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use dtx_lossyfs::LossyFs;

/// The limit while not filled.
pub const ROOMY_BYTES: u64 = 1 << 30;
/// Over the bytes in use when filling: the filler's share.
pub const FILL_MARGIN_BYTES: u64 = 4 << 20;
/// The filler file's name inside the mount.
pub const FILLER: &str = "jepsen-disk-filler";

/// The mount source name of a run's filesystems.
pub fn source_name(base_port: u16) -> String {
    format!("dtx-jepsen-{base_port}")
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd
        .output()
        .map_err(|e| anyhow::anyhow!("cannot run {:?}: {e}", cmd.get_program()))?;
    anyhow::ensure!(
        out.status.success(),
        "{:?} {:?} failed: {}",
        cmd.get_program(),
        cmd.get_args().collect::<Vec<_>>(),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// (bytes in use, bytes free) of the filesystem holding `path`.
pub fn usage(path: &Path) -> std::io::Result<(u64, u64)> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: statvfs(3) writes into the zeroed struct we own; the path is a
    // valid NUL-terminated string that outlives the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let bsize = st.f_frsize as u64;
    let total = st.f_blocks as u64 * bsize;
    let free = st.f_bavail as u64 * bsize;
    Ok((total.saturating_sub(st.f_bfree as u64 * bsize), free))
}

/// Whether an error is the filesystem being full.
pub fn is_enospc(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOSPC) || e.kind() == std::io::ErrorKind::StorageFull
}

/// Checks before a run that tmpfs filesystems can be mounted here (root,
/// `mount`), on a scratch directory under `dir`.
pub fn probe(dir: &Path, base_port: u16) -> anyhow::Result<()> {
    let p = dir.join(format!(".dtx-jepsen-disk-probe-{base_port}"));
    std::fs::create_dir_all(&p)?;
    let r = run(Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m"])
        .arg(source_name(base_port))
        .arg(&p));
    if r.is_ok() {
        let _ = run(Command::new("umount").arg(&p));
    }
    let _ = std::fs::remove_dir(&p);
    r.map_err(|e| anyhow::anyhow!("disk-full needs root and tmpfs mounts: {e}"))
}

/// Unmounts every filesystem a run on `base_port` mounted and did not
/// unmount (a run killed with SIGKILL cannot clean up).
pub fn unmount_stale(base_port: u16) {
    let name = source_name(base_port);
    let Ok(mounts) = std::fs::read_to_string("/proc/mounts") else {
        return;
    };
    for line in mounts.lines() {
        let mut f = line.split_whitespace();
        if let (Some(src), Some(target)) = (f.next(), f.next()) {
            if src == name {
                // /proc/mounts escapes spaces as \040.
                let target = target.replace("\\040", " ");
                eprintln!("jepsen: unmounting {target}, left mounted by an earlier run");
                if run(Command::new("umount").arg(&target)).is_err() {
                    let _ = run(Command::new("umount").arg("-l").arg(&target));
                }
            }
        }
    }
}

/// One small filesystem on a data directory.
pub struct SmallFs {
    pub path: PathBuf,
    source: String,
    mounted: bool,
    filled: bool,
    /// The lossy mount of `power-cut` it is (`on_lossy`), rather than a
    /// tmpfs of its own; mounted and unmounted by `crate::power`.
    lossy: Option<Arc<LossyFs>>,
}

impl SmallFs {
    /// Mounts a tmpfs on `path` (created if missing, and empty).
    pub fn mount(path: &Path, base_port: u16) -> anyhow::Result<SmallFs> {
        std::fs::create_dir_all(path)?;
        let source = source_name(base_port);
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={ROOMY_BYTES},mode=0755")])
            .arg(&source)
            .arg(path))?;
        Ok(SmallFs {
            path: path.to_path_buf(),
            source,
            mounted: true,
            filled: false,
            lossy: None,
        })
    }

    /// The lossy mount `fs` (of `power-cut`) as a filesystem to fill: its
    /// capacity is the limit.
    pub fn on_lossy(fs: Arc<LossyFs>) -> SmallFs {
        SmallFs {
            path: fs.path().to_path_buf(),
            source: "lossy".into(),
            mounted: true,
            filled: false,
            lossy: Some(fs),
        }
    }

    /// Whether it is a lossy mount (`on_lossy`), saved and unmounted with
    /// the others of `crate::power`.
    pub fn is_lossy(&self) -> bool {
        self.lossy.is_some()
    }

    fn set_limit(&self, bytes: u64) -> anyhow::Result<()> {
        if let Some(fs) = &self.lossy {
            fs.set_capacity((bytes != ROOMY_BYTES).then_some(bytes));
            return Ok(());
        }
        run(Command::new("mount")
            .args(["-o", &format!("remount,size={bytes}")])
            .arg(&self.path))
    }

    /// Fills the filesystem: lowers its limit to what is in use plus the
    /// margin, then writes the filler until ENOSPC. Returns the bytes the
    /// filler holds.
    pub fn fill(&mut self) -> anyhow::Result<u64> {
        // The processes keep writing, so the limit may have to be tried
        // again a little higher.
        let mut limited = false;
        for attempt in 0..5u64 {
            let (used, _) = usage(&self.path)?;
            let limit = (used + FILL_MARGIN_BYTES * (attempt + 1)).div_ceil(4096) * 4096;
            if self.set_limit(limit).is_ok() {
                limited = true;
                break;
            }
        }
        anyhow::ensure!(limited, "could not lower the size of {}", self.path.display());
        self.filled = true;
        self.top_up()
    }

    /// Writes more filler until ENOSPC; see [`top_up`].
    pub fn top_up(&self) -> anyhow::Result<u64> {
        top_up(&self.path)
    }

    /// Frees space: deletes the filler and restores the roomy limit.
    pub fn free(&mut self) -> anyhow::Result<()> {
        match std::fs::remove_file(self.path.join(FILLER)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e.into()),
        }
        if self.filled {
            self.set_limit(ROOMY_BYTES)?;
            self.filled = false;
        }
        Ok(())
    }

    /// Copies what the filesystem holds (not the filler) into `to`, for the
    /// results folder; the tmpfs itself goes away with the unmount.
    pub fn save(&self, to: &Path) -> anyhow::Result<()> {
        copy_tree(&self.path, to)
    }

    pub fn is_mounted(&self) -> bool {
        self.mounted
    }

    /// Unmounts (lazily if something still holds it); a lossy mount is
    /// only let go of (`crate::power` unmounts it).
    pub fn unmount(&mut self) {
        if !self.mounted {
            return;
        }
        let _ = self.free();
        if self.lossy.take().is_some() {
            self.mounted = false;
            return;
        }
        if run(Command::new("umount").arg(&self.path)).is_err() {
            if let Err(e) = run(Command::new("umount").arg("-l").arg(&self.path)) {
                eprintln!(
                    "jepsen: could not unmount {} ({}): {e}; run `umount {}`",
                    self.path.display(),
                    self.source,
                    self.path.display()
                );
                return;
            }
        }
        self.mounted = false;
    }
}

impl Drop for SmallFs {
    fn drop(&mut self) {
        self.unmount();
    }
}

/// Writes more filler into the filesystem mounted on `mount` until ENOSPC
/// (space a process freed is taken again). Returns the filler's size.
pub fn top_up(mount: &Path) -> anyhow::Result<u64> {
    let path = mount.join(FILLER);
    let mut f = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
    let big = vec![0x5au8; 1 << 20];
    for chunk in [&big[..], &big[..4096]] {
        loop {
            match f.write_all(chunk) {
                Ok(()) => {}
                Err(e) if is_enospc(&e) => break,
                Err(e) => return Err(e.into()),
            }
        }
    }
    // What a failed write_all did put in stays: the file is as large as the
    // filesystem allowed.
    Ok(file_len(&path))
}

/// Copies the files and directories under `from` (not a `disk-full`
/// filler) into `to`.
pub(crate) fn copy_tree(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        if entry.file_name() == FILLER {
            continue;
        }
        let target = to.join(entry.file_name());
        let kind = entry.file_type()?;
        if kind.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else if kind.is_file() {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// Lines of `log` after byte `from` that say the disk is full: (how many,
/// the first one, cut to 300 bytes).
pub fn disk_full_lines(log: &Path, from: u64) -> (u64, Option<String>) {
    use std::io::Read;
    use std::io::Seek;
    let Ok(mut f) = std::fs::File::open(log) else {
        return (0, None);
    };
    if f.seek(std::io::SeekFrom::Start(from)).is_err() {
        return (0, None);
    }
    let mut buf = Vec::new();
    let _ = f.take(64 << 20).read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf);
    let mut n = 0;
    let mut first = None;
    for line in text.lines() {
        let l = line.to_ascii_lowercase();
        if [
            "no space left",
            "os error 28",
            "disk full",
            "disk is full",
            "enospc",
            "storagefull",
            "storage full",
        ]
        .iter()
        .any(|p| l.contains(p))
        {
            n += 1;
            if first.is_none() {
                first = Some(cut(line));
            }
        }
    }
    (n, first)
}

/// A log line trimmed and cut to 300 bytes.
fn cut(line: &str) -> String {
    let mut s = line.trim().to_string();
    if s.len() > 300 {
        let mut at = 300;
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        s.truncate(at);
    }
    s
}

/// The last non-empty line of `log`, cut to 300 bytes.
pub fn last_line(log: &Path) -> Option<String> {
    use std::io::Read;
    use std::io::Seek;
    let mut f = std::fs::File::open(log).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(std::io::SeekFrom::Start(len.saturating_sub(16 << 10))).ok()?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf);
    text.lines().rev().find(|l| !l.trim().is_empty()).map(cut)
}

/// The size of a file, 0 if it does not exist.
pub fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_full_lines_are_found_after_the_offset() {
        let dir = std::env::temp_dir().join(format!("jepsen-disk-lines-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("x.log");
        std::fs::write(
            &log,
            "old: No space left on device\nok line\nERROR flush: No space left on device (os error 28)\nfine\nWARN disk is full\n",
        )
        .unwrap();
        let from = "old: No space left on device\n".len() as u64;
        let (n, first) = disk_full_lines(&log, from);
        assert_eq!(n, 2);
        assert!(first.unwrap().starts_with("ERROR flush"));
        assert_eq!(disk_full_lines(&dir.join("missing.log"), 0), (0, None));
        assert_eq!(last_line(&log).as_deref(), Some("WARN disk is full"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
