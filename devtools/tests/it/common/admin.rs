//! Running `coordinator admin` against a test cluster and reading what it
//! printed, as an operator's script would.

use std::process::Output;

use serde_json::Value;

use super::TestCluster;

/// `coordinator admin --addr <every node> <args>` as operator `user`, with
/// backtraces asked for (an operator's error must still be one line
/// without one).
pub fn admin_as(c: &TestCluster, user: &str, args: &[&str]) -> Output {
    std::process::Command::new(super::bin())
        .args(["admin", "--addr", &c.procs.api_addrs().join(",")])
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env("USER", user)
        .output()
        .expect("run coordinator admin")
}

/// Exit 0: its standard output.
pub fn ok(o: &Output) -> String {
    assert_eq!(o.status.code(), Some(0), "{}", super::output_text(o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Exit 0 and JSON on standard output.
pub fn json(o: &Output) -> Value {
    serde_json::from_str(&ok(o)).unwrap_or_else(|e| panic!("not JSON ({e}): {}", super::output_text(o)))
}

/// Refused: exit 3, one line on stderr that contains `why`, no backtrace.
pub fn refused(o: &Output, why: &str) {
    assert_eq!(o.status.code(), Some(3), "{}", super::output_text(o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(why), "expected {why:?}: {}", super::output_text(o));
    assert_eq!(err.trim_end().lines().count(), 1, "one line, no backtrace: {err}");
}
