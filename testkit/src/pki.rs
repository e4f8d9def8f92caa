//! Certificates for a local cluster (`dtx-dev dev --tls`, `demo
//! --tls`, the TLS tests): a throwaway authority ([`dtx_tls::dev::DevCa`])
//! in a folder, and one certificate per node, service and client, each
//! naming its identity and valid for loopback.

use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;

use coordinator::config::Config;
use dtx_tls::args::TlsArgs;
use dtx_tls::dev::DevCa;
use dtx_tls::dev::Host;
use dtx_tls::dev::Lifetime;
use dtx_tls::dev::DEV_LIFETIME;
use dtx_tls::files::KeyPairFiles;
use dtx_tls::ClientTls;
use dtx_tls::Role;

/// An authority and the folder its certificates go to.
pub struct DevPki {
    pub dir: PathBuf,
    /// `dir/ca.pem`.
    pub ca: PathBuf,
    authority: DevCa,
}

/// The hosts every local certificate is valid for.
fn loopback_hosts(extra: &[&str]) -> Vec<Host> {
    let mut v = vec![Host::parse("127.0.0.1"), Host::parse("::1"), Host::parse("localhost")];
    for h in extra {
        let host = h.rsplit_once(':').map(|(h, _)| h).unwrap_or(h);
        v.push(Host::parse(host));
    }
    v
}

impl DevPki {
    /// A new authority named `name`, its certificate in `dir/ca.pem`.
    pub fn create(dir: &Path, name: &str) -> anyhow::Result<DevPki> {
        std::fs::create_dir_all(dir)?;
        let authority = DevCa::new(name)?;
        let ca = authority.write_ca(dir)?;
        Ok(DevPki {
            dir: dir.to_path_buf(),
            ca,
            authority,
        })
    }

    /// A certificate for `role`/`name`, valid for loopback and the hosts
    /// of `addrs` (`ip:port` or `host:port`), in `dir/<role>-<name>.pem`
    /// and `.key`.
    pub fn issue(&self, role: Role, name: &str, addrs: &[&str]) -> anyhow::Result<KeyPairFiles> {
        self.issue_for(role, name, addrs, DEV_LIFETIME)
    }

    /// As [`DevPki::issue`], with a chosen lifetime (tests of expired
    /// certificates).
    pub fn issue_for(&self, role: Role, name: &str, addrs: &[&str], life: Lifetime) -> anyhow::Result<KeyPairFiles> {
        Ok(self.authority.issue_to(
            &self.dir,
            &format!("{role}-{name}"),
            role,
            name,
            &loopback_hosts(addrs),
            life,
        )?)
    }

    /// Sets `c`'s TLS section to a new certificate for its node (valid
    /// for its two listen addresses).
    pub fn apply_node(&self, c: &mut Config) -> anyhow::Result<()> {
        let f = self.issue(Role::Node, &c.node_id.to_string(), &[&c.api_addr, &c.raft_addr])?;
        c.tls.cert = Some(f.cert);
        c.tls.key = Some(f.key);
        c.tls.ca = Some(self.ca.clone());
        Ok(())
    }

    /// The flags of a process using `own` (and this authority).
    pub fn args(&self, own: &KeyPairFiles) -> TlsArgs {
        TlsArgs {
            tls_cert: Some(own.cert.clone()),
            tls_key: Some(own.key.clone()),
            tls_ca: Some(self.ca.clone()),
            token_file: None,
            accept_node_token_sha256: None,
        }
    }

    /// Client TLS settings with `own` as the client certificate.
    pub fn client(&self, own: &KeyPairFiles) -> anyhow::Result<Arc<ClientTls>> {
        Ok(self.args(own).client()?.expect("a CA is set"))
    }
}
