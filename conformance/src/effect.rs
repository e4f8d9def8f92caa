//! Reading what committed work did, for the rules that count applied
//! effects: a number the YES payload's commit changes by a known amount (a
//! balance, a row count). The kit reads it before and after a sequence and
//! compares the difference with the commits it asked for.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

/// Reads the effect's current value.
pub trait Effect: Send + Sync {
    /// The value now, or why it could not be read.
    fn read(&self) -> Pin<Box<dyn Future<Output = Result<i64, String>> + Send + '_>>;
}

/// An effect read by a shell command: the last line of its standard output
/// is the value (an integer). Any language's service can offer one.
pub struct CommandEffect {
    /// Run with `sh -c`.
    pub command: String,
    /// How long the command may take.
    pub timeout: Duration,
}

impl Effect for CommandEffect {
    fn read(&self) -> Pin<Box<dyn Future<Output = Result<i64, String>> + Send + '_>> {
        Box::pin(async move {
            let run = tokio::process::Command::new("sh")
                .arg("-c")
                .arg(&self.command)
                .kill_on_drop(true)
                .output();
            let out = match tokio::time::timeout(self.timeout, run).await {
                Ok(Ok(o)) => o,
                Ok(Err(e)) => return Err(format!("effect command {:?} did not start: {e}", self.command)),
                Err(_) => {
                    return Err(format!(
                        "effect command {:?} took over {:?}",
                        self.command, self.timeout
                    ))
                }
            };
            let stdout = String::from_utf8_lossy(&out.stdout);
            if !out.status.success() {
                return Err(format!(
                    "effect command {:?} exited with {}: {}",
                    self.command,
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
            let last = stdout.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
            last.parse::<i64>().map_err(|_| {
                format!(
                    "effect command {:?}: the last line of its output, {last:?}, is not an integer",
                    self.command
                )
            })
        })
    }
}
