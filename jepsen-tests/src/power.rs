//! The filesystems of the `power-cut` nemesis (ADR 0032): every data
//! directory of a node or bank is a `dtx-lossyfs` mount of its own, served
//! by this process, which at a cut throws away every write its process did
//! not fsync (and every directory entry not synced). kill -9 alone keeps
//! the page cache, so only this shows a missing or late fsync.
//!
//! One mount per data directory rather than one for all: each is served by
//! its own thread (a mount serves its requests one at a time), a cut
//! reports what each process lost, and the `disk-full` node and bank can be
//! given a capacity of their own (`LossyFs::set_capacity`) on the same
//! mount that is cut.
//!
//! Every mount's source is `dtx-jepsen-<base port>`, as for the tmpfs
//! filesystems of `disk-full`, so [`crate::disk::unmount_stale`] finds what
//! a run killed outright left behind (a FUSE mount whose server died
//! answers "Transport endpoint is not connected" until unmounted).

use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;

use dtx_lossyfs::CutReport;
use dtx_lossyfs::LossyFs;

/// Why the lossy filesystem cannot be mounted here, when it cannot: no
/// /dev/fuse, or no right to mount (not root). Tried on a scratch
/// directory under `dir`.
pub fn unavailable(dir: &Path, base_port: u16) -> anyhow::Result<Option<String>> {
    let p = dir.join(format!(".dtx-jepsen-lossyfs-probe-{base_port}"));
    std::fs::create_dir_all(&p)?;
    let r = match LossyFs::mount_named(&p, &crate::disk::source_name(base_port)) {
        Ok(fs) => {
            drop(fs);
            Ok(None)
        }
        Err(e) => match dtx_lossyfs::unavailable_reason(&e) {
            Some(why) => Ok(Some(why)),
            None => Err(anyhow::anyhow!(
                "cannot mount the lossy filesystem on {}: {e}",
                p.display()
            )),
        },
    };
    let _ = std::fs::remove_dir(&p);
    r
}

/// Set to 1 (CI does), `power-cut` must run: a machine without FUSE fails
/// the run instead of leaving the nemesis out of `--nemesis all`.
pub const REQUIRE_ENV: &str = dtx_lossyfs::REQUIRE_ENV;

/// Keeps `power-cut` in `faults` when the lossy filesystem can be mounted
/// here. When it cannot: an error if `power-cut` was named on its own
/// (`explicit`) or [`REQUIRE_ENV`] is 1; otherwise (`--nemesis all`) the
/// fault is left out, with a note saying why.
pub fn check_available(
    faults: Vec<crate::nemesis::Fault>,
    explicit: bool,
    base_port: u16,
) -> anyhow::Result<(Vec<crate::nemesis::Fault>, Option<String>)> {
    use crate::nemesis::Fault;
    if !faults.contains(&Fault::PowerCut) {
        return Ok((faults, None));
    }
    let Some(why) = unavailable(&std::env::temp_dir(), base_port)? else {
        return Ok((faults, None));
    };
    let required = std::env::var(REQUIRE_ENV).as_deref() == Ok("1");
    anyhow::ensure!(
        !explicit && !required,
        "power-cut needs the lossy FUSE filesystem, which cannot be mounted here: {why} (it needs /dev/fuse and \
         root){}",
        if required {
            format!("; {REQUIRE_ENV}=1 makes this an error")
        } else {
            String::new()
        }
    );
    let kept = faults.into_iter().filter(|f| *f != Fault::PowerCut).collect();
    Ok((
        kept,
        Some(format!(
            "power-cut SKIPPED: the lossy FUSE filesystem cannot be mounted here: {why} (it needs /dev/fuse and root; \
             name power-cut in --nemesis, or set {REQUIRE_ENV}=1, to make this an error)"
        )),
    ))
}

/// One mounted data directory.
struct Mount {
    /// The process whose data it holds: `n1`, `bank-a`, ...
    who: String,
    fs: Arc<LossyFs>,
}

/// The run's lossy mounts, in the order they were mounted.
#[derive(Default)]
pub struct PowerMounts {
    mounts: Vec<Mount>,
    base_port: u16,
}

/// What one cut did to one process's data directory.
#[derive(Clone, Debug)]
pub struct CutSeen {
    pub who: String,
    /// Bytes written and not yet synced a moment before the processes were
    /// killed.
    pub unsynced_before_kill: u64,
    pub report: CutReport,
}

impl PowerMounts {
    pub fn new(base_port: u16) -> PowerMounts {
        PowerMounts {
            mounts: Vec::new(),
            base_port,
        }
    }

    /// Mounts an empty lossy filesystem on `path` (created, and empty) for
    /// process `who`'s data. The mount's root is durable from the start, so
    /// the process needs no directory of its own made durable first.
    pub fn mount(&mut self, who: &str, path: &Path) -> anyhow::Result<Arc<LossyFs>> {
        std::fs::create_dir_all(path)?;
        let fs = LossyFs::mount_named(path, &crate::disk::source_name(self.base_port))
            .map_err(|e| anyhow::anyhow!("cannot mount the lossy filesystem on {}: {e}", path.display()))?;
        let fs = Arc::new(fs);
        self.mounts.push(Mount {
            who: who.to_string(),
            fs: fs.clone(),
        });
        Ok(fs)
    }

    pub fn is_empty(&self) -> bool {
        self.mounts.is_empty()
    }

    /// Whose data is on a mount.
    pub fn holders(&self) -> Vec<String> {
        self.mounts.iter().map(|m| m.who.clone()).collect()
    }

    /// Bytes not yet synced, per mount.
    pub fn unsynced(&self) -> Vec<u64> {
        self.mounts.iter().map(|m| m.fs.unsynced_bytes()).collect()
    }

    /// The cut, on every mount: everything not durable is thrown away
    /// (`torn`: each file keeps a prefix, chosen from the seed, of what was
    /// written since its last sync; every mount gets its own seed drawn
    /// from it). Call it only once every process using the mounts is dead.
    pub fn cut(&self, torn: Option<u64>, unsynced_before_kill: &[u64]) -> Vec<CutSeen> {
        self.mounts
            .iter()
            .enumerate()
            .map(|(i, m)| CutSeen {
                who: m.who.clone(),
                unsynced_before_kill: unsynced_before_kill.get(i).copied().unwrap_or(0),
                report: match torn {
                    Some(seed) => {
                        m.fs.power_cut_torn(seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
                    }
                    None => m.fs.power_cut(),
                },
            })
            .collect()
    }

    /// Copies what every mount holds into `<mount path>.saved`, unmounts
    /// it, and puts the copy where the mount was (the results folder keeps
    /// the data directories). The processes must be stopped first.
    pub fn save_and_unmount(&mut self) {
        for m in self.mounts.drain(..) {
            let path: PathBuf = m.fs.path().to_path_buf();
            let saved = path.with_extension("saved");
            let r = crate::disk::copy_tree(&path, &saved);
            drop(m.fs);
            match r {
                Ok(()) => {
                    let _ = std::fs::remove_dir(&path);
                    let _ = std::fs::rename(&saved, &path);
                }
                Err(e) => eprintln!("jepsen: could not save {}: {e:#}", path.display()),
            }
        }
    }
}

/// A line of what a cut did, for the history and the console: per process,
/// the bytes lost and the files and directories that went back.
pub fn describe(cut: &[CutSeen]) -> String {
    let parts: Vec<String> = cut
        .iter()
        .map(|c| {
            format!(
                "{} lost {} B ({} unsynced just before the kill; {} file(s), {} dir(s) back)",
                c.who, c.report.bytes_lost, c.unsynced_before_kill, c.report.files_reverted, c.report.dirs_reverted
            )
        })
        .collect();
    parts.join(", ")
}
