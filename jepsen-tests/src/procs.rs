//! The network rules that cut a run's processes apart (nftables on their
//! loopback addresses), torn down on drop so a run that fails or panics
//! leaves nothing behind. The processes themselves are
//! `dtx_testkit::cluster::{ProcessCluster, BankProcess}`.

use std::process::Command;
use std::process::Stdio;

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

    /// Drops every TCP packet to and from `port` on `ip`, both directions:
    /// whoever talks to the server there (over loopback, whatever their
    /// own address) is cut off from it.
    pub fn cut_port(&self, ip: &str, port: u16) -> anyhow::Result<()> {
        nft(&format!(
            "add rule ip {t} out ip daddr {ip} tcp dport {port} drop\nadd rule ip {t} out ip saddr {ip} tcp sport {port} drop\n",
            t = self.table
        ))
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
