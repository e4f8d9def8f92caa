//! Fault injection for tests. With the `disk` feature (dev-dependencies
//! only), [`disk::SmallFs`]: a small tmpfs a disk-full test fills.
//!
//! Crash points for fault-injection tests, compiled only with the
//! `failpoints` cargo feature. `DTX_FAILPOINT=<name>` makes the process
//! abort (no flush, no cleanup, like kill -9) when it reaches that point.
//! With `DTX_FAILPOINT_ONCE=<file>` it fires only if the file does not exist
//! yet, creating it first (with the pid of the process that fired), so a
//! restarted process runs on normally.
//!
//! Armed at run time (the fault-injection harness): with
//! `DTX_FAILPOINT_FILE=<file>`, a process reads the point named in that file
//! (re-read at most every 50 ms); the first process to reach that point
//! removes the file (only one can) and aborts. Several processes may share
//! the file: exactly one of them crashes per arming.
//!
//! Refusal points (`refused`): while the file named by
//! `DTX_FAILPOINT_REFUSE` lists a point on a line of its own, the code at
//! that point refuses or skips its work, so a test can hold a window open
//! for as long as it needs and then close it by removing the line.
//!
//! Why hand-written and not the `fail` crate: the points must be armed from
//! outside a running process (a file the harness writes while the cluster
//! runs, shared by several processes of which exactly one may fire), must
//! abort like kill -9 rather than panic or return an error, and must cost
//! nothing at all in a build without the feature. `fail` arms points through
//! its own environment variable at start or through calls inside the
//! process, and has no "first of several processes wins" arming; bending it
//! to that would take as much code as this file.

#[cfg(feature = "disk")]
pub mod disk;

/// Whether this build carries crash points (the `failpoints` feature). One
/// answer for a whole binary: every crate's `failpoints` feature turns on
/// this crate's.
pub const COMPILED: bool = cfg!(feature = "failpoints");

/// What a binary built with crash points says after its version number in
/// `--version`, so that the fault-injection harness can refuse a binary in
/// which its crash points would never fire.
pub const VERSION_MARK: &str = "(with crash points)";

/// Aborts the process here if `DTX_FAILPOINT` names this point (only in
/// builds with the `failpoints` feature of dtx-failpoint, which the coordinator's and the SDK's `failpoints` features turn on).
#[macro_export]
macro_rules! failpoint {
    ($name:expr) => {
        $crate::hit($name)
    };
}

/// Does nothing: this build has no crash points.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &str) {}

#[cfg(feature = "failpoints")]
pub fn hit(name: &str) {
    hit_file(name);
    static ARMED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let armed = ARMED.get_or_init(|| std::env::var("DTX_FAILPOINT").ok());
    if armed.as_deref() != Some(name) {
        return;
    }
    if let Ok(once) = std::env::var("DTX_FAILPOINT_ONCE") {
        let Ok(mut file) = std::fs::OpenOptions::new().write(true).create_new(true).open(&once) else {
            return;
        };
        // Which process fired, for a harness that must know it is gone (a
        // point after a visible effect aborts just after that effect).
        use std::io::Write;
        let _ = write!(file, "{}", std::process::id());
    }
    eprintln!("failpoint {name}: aborting the process");
    std::process::abort();
}

/// True while the file that `DTX_FAILPOINT_REFUSE` names exists and lists
/// `name` on a line of its own (only in builds with the `failpoints`
/// feature; the file is read again at most every 50 ms). The caller then
/// refuses or skips the work at that point, as a fault would make it, until
/// the test removes the line or the file: a window held open for exactly as
/// long as a test needs it.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn refused(_name: &str) -> bool {
    false
}

#[cfg(feature = "failpoints")]
pub fn refused(name: &str) -> bool {
    use std::sync::Mutex;
    use std::time::Duration;
    use std::time::Instant;
    static FILE: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    static CACHE: Mutex<Option<(Instant, Vec<String>)>> = Mutex::new(None);
    let Some(path) = FILE.get_or_init(|| std::env::var_os("DTX_FAILPOINT_REFUSE").map(Into::into)) else {
        return false;
    };
    let mut c = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let stale = c
        .as_ref()
        .is_none_or(|(at, _)| at.elapsed() > Duration::from_millis(50));
    if stale {
        let points = std::fs::read_to_string(path)
            .map(|s| s.lines().map(|l| l.trim().to_string()).collect())
            .unwrap_or_default();
        *c = Some((Instant::now(), points));
    }
    c.as_ref().is_some_and(|(_, points)| points.iter().any(|p| p == name))
}

/// The run-time armed point of `DTX_FAILPOINT_FILE`, if any.
#[cfg(feature = "failpoints")]
fn hit_file(name: &str) {
    use std::sync::Mutex;
    use std::time::Duration;
    use std::time::Instant;
    static FILE: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    static CACHE: Mutex<Option<(Instant, Option<String>)>> = Mutex::new(None);
    let Some(path) = FILE.get_or_init(|| std::env::var_os("DTX_FAILPOINT_FILE").map(Into::into)) else {
        return;
    };
    let armed = {
        let mut c = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        let stale = c
            .as_ref()
            .is_none_or(|(at, _)| at.elapsed() > Duration::from_millis(50));
        if stale {
            let now = std::fs::read_to_string(path).ok().map(|s| s.trim().to_string());
            *c = Some((Instant::now(), now));
        }
        c.as_ref().and_then(|(_, a)| a.clone())
    };
    if armed.as_deref() == Some(name) && std::fs::remove_file(path).is_ok() {
        eprintln!("failpoint {name} (armed in {}): aborting the process", path.display());
        std::process::abort();
    }
}
