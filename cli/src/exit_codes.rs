//! The exit codes of `coordinator admin` (every subcommand), in one place
//! below the commands that use them.

/// Done (or, for reads, answered).
pub const EXIT_OK: i32 = 0;
/// Another error: an answer this tool cannot read, a local file.
pub const EXIT_ERROR: i32 = 1;
/// The command line is wrong (clap uses it too).
pub const EXIT_USAGE: i32 = 2;
/// Refused: nothing changed (invalid, not found, not allowed now, not
/// authorised, or a decision other than the one asked for already stands).
pub const EXIT_REFUSED: i32 = 3;
/// Outcome unknown: a write may or may not have been applied.
pub const EXIT_UNKNOWN: i32 = 4;
/// Unreachable: no node answered in time.
pub const EXIT_UNREACHABLE: i32 = 5;
/// Answered, but not healthy: `admin status` found no serving leader with
/// a quorum, or the condition of `admin status --check` does not hold.
pub const EXIT_UNHEALTHY: i32 = 6;
