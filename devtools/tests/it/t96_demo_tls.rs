//! The main job with `--tls` as a test; it does not run at the same time as
//! `t90_bank_demo` (`common::DEMO_LOCK`: two demos of five processes each at
//! once would only load the machine).

use crate::common;

/// The same main job with `--tls`: every node, bank and client with a
/// certificate from the demo's throwaway authority, mutual TLS on every
/// link, the leader killed; the audit must pass (`common::run_demo`).
#[test]
fn t96_bank_demo_with_tls_passes_its_audit() {
    let stdout = common::run_demo(&["--tls", "--seconds", "8", "--kill-every-secs", "3", "--clients", "4"]);
    assert!(stdout.contains("mutual TLS on every link"), "{stdout}");
    assert!(stdout.contains("kill -9 leader"), "no leader was killed: {stdout}");
}
