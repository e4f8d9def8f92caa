//! The processes a run starts (bank participant services; the coordinator
//! nodes come from `coordinator::cluster::ProcessCluster`) and the network
//! rules that cut them apart (nftables on their loopback addresses).
//!
//! Everything here is torn down on drop (processes killed, rules deleted),
//! so a run that fails or panics leaves nothing behind.

use std::path::Path;
use std::path::PathBuf;
use std::process::Child;
use std::process::Command;
use std::process::Stdio;
use std::time::Duration;
use std::time::Instant;

/// One bank participant service: `coordinator bank-serve` on its own
/// loopback address and data directory.
pub struct BankProc {
    pub id: String,
    pub prefix: String,
    pub ip: String,
    pub addr: String,
    pub data_dir: PathBuf,
    pub log_path: PathBuf,
    bin: PathBuf,
    cluster: Vec<String>,
    pub accounts: usize,
    pub initial: i64,
    child: Option<Child>,
}

impl BankProc {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        bin: &Path,
        dir: &Path,
        id: &str,
        prefix: &str,
        ip: &str,
        port: u16,
        cluster: Vec<String>,
        accounts: usize,
        initial: i64,
    ) -> BankProc {
        BankProc {
            id: id.to_string(),
            prefix: prefix.to_string(),
            ip: ip.to_string(),
            addr: format!("{ip}:{port}"),
            data_dir: dir.join(id),
            log_path: dir.join(format!("{id}.log")),
            bin: bin.to_path_buf(),
            cluster,
            accounts,
            initial,
            child: None,
        }
    }

    /// Starts the service (no-op if running) with extra environment.
    pub fn start(&mut self, env: &[(String, String)]) -> std::io::Result<()> {
        if self.is_running() {
            return Ok(());
        }
        use std::os::unix::process::CommandExt;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)?;
        let child = Command::new(&self.bin)
            .process_group(0)
            .args([
                "bank-serve",
                "--id",
                &self.id,
                "--prefix",
                &self.prefix,
                "--listen",
                &self.addr,
            ])
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args(["--cluster", &self.cluster.join(",")])
            .args(["--accounts", &self.accounts.to_string()])
            .args(["--initial", &self.initial.to_string()])
            .env("RUST_LOG", "warn")
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    pub fn is_running(&mut self) -> bool {
        match &mut self.child {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    pub fn signal(&mut self, sig: i32) {
        if let Some(c) = &self.child {
            // SAFETY: kill(2) on a child pid we own; no memory is touched.
            unsafe {
                libc::kill(c.id() as i32, sig);
            }
        }
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGCONT (in case it is paused), SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        self.signal(libc::SIGCONT);
        self.signal(libc::SIGTERM);
        if let Some(mut c) = self.child.take() {
            let until = Instant::now() + grace;
            while Instant::now() < until {
                if let Ok(Some(_)) = c.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Reads the stopped service's store with `coordinator bank-audit
    /// --json`: balances, locks, in-doubt count and apply log.
    pub fn audit(&self) -> anyhow::Result<serde_json::Value> {
        let out = Command::new(&self.bin)
            .args(["bank-audit", "--json", "--data-dir"])
            .arg(&self.data_dir)
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "bank-audit of {} failed: {}",
            self.id,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_slice(&out.stdout)?)
    }
}

impl Drop for BankProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Network faults as nftables rules in a table of our own: drops between
/// chosen address pairs, both directions. Nodes bind their outgoing
/// connections to their own address, so a pair rule cuts exactly one link.
pub struct Net {
    table: String,
    installed: bool,
}

fn nft(script: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot run nft (install the nftables package): {e}"))?;
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow::anyhow!("nft stdin"))?
        .write_all(script.as_bytes())?;
    let out = child.wait_with_output()?;
    anyhow::ensure!(
        out.status.success(),
        "nft refused the rules: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

impl Net {
    /// Checks that nftables works here (root, kernel support) by creating
    /// and deleting our table.
    pub fn new(table: &str) -> anyhow::Result<Net> {
        let mut n = Net {
            table: table.to_string(),
            installed: false,
        };
        n.install()?;
        Ok(n)
    }

    fn install(&mut self) -> anyhow::Result<()> {
        // Deleting first clears rules a crashed earlier run may have left.
        let _ = nft(&format!("delete table ip {}\n", self.table));
        nft(&format!(
            "table ip {t} {{\n  chain out {{ type filter hook output priority 0; policy accept; }}\n}}\n",
            t = self.table
        ))?;
        self.installed = true;
        Ok(())
    }

    /// Drops every packet between `a` and `b`, both directions.
    pub fn cut(&self, pairs: &[(String, String)]) -> anyhow::Result<()> {
        let mut script = String::new();
        for (a, b) in pairs {
            for (s, d) in [(a, b), (b, a)] {
                script.push_str(&format!(
                    "add rule ip {} out ip saddr {s} ip daddr {d} drop\n",
                    self.table
                ));
            }
        }
        nft(&script)
    }

    /// Removes every rule: the network is whole again.
    pub fn heal(&self) -> anyhow::Result<()> {
        nft(&format!("flush chain ip {} out\n", self.table))
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        if self.installed {
            let _ = nft(&format!("delete table ip {}\n", self.table));
        }
    }
}

/// Fails with a clear message when `addr` cannot be bound (in use, or the
/// address does not exist here).
pub fn check_bindable(addr: &str) -> anyhow::Result<()> {
    std::net::TcpListener::bind(addr)
        .map(drop)
        .map_err(|e| anyhow::anyhow!("cannot use {addr}: {e} (another run still going? pick another --base-port)"))
}
