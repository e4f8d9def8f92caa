//! The service under test as a process the kit starts and kills: with
//! `--start COMMAND` the kit runs the command itself (in a process group of
//! its own), waits until the service answers on its address, and for the
//! crash rules kills it with SIGKILL at the moments that matter and starts
//! it again on the same data.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Mutex;
use std::time::Duration;
use std::time::Instant;

use crate::wire::Step;
use crate::wire::Stop;

/// A future the trait's methods return.
pub type Pending<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A service the kit can crash and start again.
pub trait Service: Send + Sync {
    /// Starts it and waits until it answers on its address (the first
    /// start too).
    fn start(&self) -> Pending<'_, Result<(), String>>;
    /// Kills it at once, as a power-less SIGKILL does: no shutdown code
    /// runs. Returns once it is gone.
    fn kill(&self) -> Pending<'_, Result<(), String>>;
}

/// A service run by a shell command (`sh -c`), its output appended to a
/// log file.
pub struct CommandService {
    command: String,
    address: String,
    log: PathBuf,
    start_timeout: Duration,
    child: Mutex<Option<std::process::Child>>,
}

impl CommandService {
    /// The service `command` runs, listening on `address`; its output goes
    /// to `log`.
    pub fn new(command: String, address: String, log: PathBuf, start_timeout: Duration) -> CommandService {
        CommandService {
            command,
            address,
            log,
            start_timeout,
            child: Mutex::new(None),
        }
    }

    /// Where its output goes.
    pub fn log(&self) -> &std::path::Path {
        &self.log
    }

    fn spawn(&self) -> Result<(), String> {
        use std::os::unix::process::CommandExt;
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .map_err(|e| format!("the service's log {}: {e}", self.log.display()))?;
        let err = out.try_clone().map_err(|e| format!("the service's log: {e}"))?;
        let child = std::process::Command::new("sh")
            .arg("-c")
            .arg(&self.command)
            .stdin(std::process::Stdio::null())
            .stdout(out)
            .stderr(err)
            .process_group(0)
            .spawn()
            .map_err(|e| format!("--start {:?} did not start: {e}", self.command))?;
        *self.child.lock().expect("child") = Some(child);
        Ok(())
    }

    /// Kills the whole process group (the shell and what it started).
    fn kill_now(&self) -> Result<(), String> {
        let Some(mut child) = self.child.lock().expect("child").take() else {
            return Ok(());
        };
        let pgid = child.id() as libc::pid_t;
        // SAFETY: kill(2) on a process group this kit created; no memory
        // is involved.
        unsafe {
            libc::kill(-pgid, libc::SIGKILL);
        }
        child
            .wait()
            .map_err(|e| format!("waiting for the killed service: {e}"))?;
        Ok(())
    }
}

impl Service for CommandService {
    fn start(&self) -> Pending<'_, Result<(), String>> {
        Box::pin(async move {
            self.spawn()?;
            let until = Instant::now() + self.start_timeout;
            loop {
                if tokio::net::TcpStream::connect(&self.address).await.is_ok() {
                    return Ok(());
                }
                let exited = self
                    .child
                    .lock()
                    .expect("child")
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten());
                if let Some(status) = exited {
                    return Err(format!(
                        "the service exited with {status} before listening on {} (its output: {})",
                        self.address,
                        self.log.display()
                    ));
                }
                if Instant::now() > until {
                    return Err(format!(
                        "the service did not listen on {} within {:?} (its output: {})",
                        self.address,
                        self.start_timeout,
                        self.log.display()
                    ));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    }

    fn kill(&self) -> Pending<'_, Result<(), String>> {
        Box::pin(async move { self.kill_now() })
    }
}

impl Drop for CommandService {
    fn drop(&mut self) {
        let _ = self.kill_now();
    }
}

/// Kills `service` with SIGKILL.
pub(crate) async fn kill(service: &dyn Service) -> Step<()> {
    service
        .kill()
        .await
        .map_err(|e| Stop::Unknown(format!("could not kill the service: {e}")))
}

/// Starts `service` again after a kill: a service that cannot start on
/// its own data breaks the rule.
pub(crate) async fn restart(service: &dyn Service) -> Step<()> {
    service
        .start()
        .await
        .map_err(|e| Stop::Broken(format!("the service did not start again after kill -9: {e}")))
}

/// Runs `flight` (a call on a connection of its own) and kills `service`
/// 0 to 3 ms after it left (before, during or after the service's write);
/// what the call ended with, and the delay in microseconds. The service
/// is left dead: the caller notes what happened and restarts it.
pub(crate) async fn kill_during<R: Send + 'static>(
    service: &dyn Service,
    flight: impl Future<Output = R> + Send + 'static,
) -> Step<(R, u64)> {
    let flight = tokio::spawn(flight);
    let delay_us = rand::random::<u64>() % 3_000;
    tokio::time::sleep(Duration::from_micros(delay_us)).await;
    kill(service).await?;
    let ended = flight
        .await
        .map_err(|e| Stop::Unknown(format!("the call in flight was lost: {e}")))?;
    Ok((ended, delay_us))
}
