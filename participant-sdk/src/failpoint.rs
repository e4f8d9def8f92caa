//! Crash points for fault-injection tests, compiled only with the
//! `failpoints` cargo feature. `DTX_FAILPOINT=<name>` makes the process
//! abort (no flush, no cleanup, like kill -9) when it reaches that point.
//! With `DTX_FAILPOINT_ONCE=<file>` it fires only if the file does not exist
//! yet, creating it first, so a restarted process runs on normally.

/// Aborts the process here if `DTX_FAILPOINT` names this point (only in
/// builds with the `failpoints` feature of participant-sdk).
#[macro_export]
macro_rules! failpoint {
    ($name:expr) => {
        $crate::failpoint::hit($name)
    };
}

/// Does nothing: this build has no crash points.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub fn hit(_name: &str) {}

#[cfg(feature = "failpoints")]
pub fn hit(name: &str) {
    static ARMED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let armed = ARMED.get_or_init(|| std::env::var("DTX_FAILPOINT").ok());
    if armed.as_deref() != Some(name) {
        return;
    }
    if let Ok(once) = std::env::var("DTX_FAILPOINT_ONCE") {
        let created = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&once)
            .is_ok();
        if !created {
            return;
        }
    }
    eprintln!("failpoint {name}: aborting the process");
    std::process::abort();
}
