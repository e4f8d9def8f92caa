//! The TLS and token flags every command of ours takes (feature `cli`):
//! `--tls-cert`, `--tls-key`, `--tls-ca` and `--token-file`.

use std::path::PathBuf;
use std::sync::Arc;

use crate::client::ClientTls;
use crate::client::ClientTlsFiles;
use crate::error::TlsError;
use crate::files::KeyPairFiles;
use crate::server::ClientAuth;
use crate::server::ServerTls;
use crate::server::ServerTlsFiles;

/// TLS settings from the command line. With `--tls-ca`, calls go over TLS
/// to servers certified by that authority; with `--tls-cert` and
/// `--tls-key` too, this process proves who it is with that certificate
/// (mutual TLS) and, where it serves, serves TLS with it.
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Eq)]
pub struct TlsArgs {
    /// PEM certificate of this process (its identity: dtx://<role>/<name>).
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM certificate authority that servers (and, where this process
    /// serves, callers) must be certified by. Turns TLS on.
    #[arg(long)]
    pub tls_ca: Option<PathBuf>,
    /// A file holding a bearer token to send with every call to the
    /// cluster (for clusters that accept tokens where mutual TLS is off).
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Where this process serves without mutual TLS (a participant): accept
    /// calls from nodes that present the token with this SHA-256 (64 hex
    /// digits; the nodes' `auth.participant_token_file`).
    #[arg(long)]
    pub accept_node_token_sha256: Option<String>,
}

impl TlsArgs {
    fn own(&self) -> Option<KeyPairFiles> {
        Some(KeyPairFiles {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
        })
    }

    /// TLS for this process's calls, when `--tls-ca` is given.
    pub fn client(&self) -> Result<Option<Arc<ClientTls>>, TlsError> {
        let Some(ca) = &self.tls_ca else { return Ok(None) };
        ClientTls::load(ClientTlsFiles {
            ca: ca.clone(),
            own: self.own(),
            server_name: None,
        })
        .map(Some)
    }

    /// TLS for the server this process runs (mutual TLS: callers must
    /// present a certificate), when `--tls-cert`, `--tls-key` and
    /// `--tls-ca` are given; refused when only `--tls-ca` is.
    pub fn server(&self) -> Result<Option<Arc<ServerTls>>, TlsError> {
        let Some(ca) = &self.tls_ca else { return Ok(None) };
        let Some(own) = self.own() else {
            return Err(TlsError::Config(
                "a TLS server needs --tls-cert and --tls-key beside --tls-ca".into(),
            ));
        };
        ServerTls::load(ServerTlsFiles {
            own,
            ca: ca.clone(),
            client_auth: ClientAuth::Required,
        })
        .map(Some)
    }

    /// The bearer token of `--token-file` (surrounding whitespace removed).
    pub fn token(&self) -> Result<Option<String>, TlsError> {
        let Some(p) = &self.token_file else { return Ok(None) };
        let text = std::fs::read_to_string(p).map_err(|source| TlsError::Read {
            what: "token file",
            path: p.clone(),
            source,
        })?;
        let t = text.trim();
        if t.is_empty() {
            return Err(TlsError::Invalid {
                what: "token file",
                path: p.clone(),
                detail: "is empty".into(),
            });
        }
        Ok(Some(t.to_string()))
    }

    /// The node tokens of `--accept-node-token-sha256` (empty without it).
    pub fn node_tokens(&self) -> Result<crate::identity::Tokens, TlsError> {
        match &self.accept_node_token_sha256 {
            None => Ok(crate::identity::Tokens::default()),
            Some(h) => crate::identity::TokenEntry::new(crate::identity::Role::Node, "cluster", h)
                .map(|e| crate::identity::Tokens::new(vec![e]))
                .map_err(|e| TlsError::Config(format!("--accept-node-token-sha256: {e}"))),
        }
    }

    /// The flags again, for starting a child process with the same
    /// settings.
    pub fn to_flags(&self) -> Vec<String> {
        let mut v = Vec::new();
        for (flag, p) in [
            ("--tls-cert", &self.tls_cert),
            ("--tls-key", &self.tls_key),
            ("--tls-ca", &self.tls_ca),
            ("--token-file", &self.token_file),
        ] {
            if let Some(p) = p {
                v.push(flag.to_string());
                v.push(p.display().to_string());
            }
        }
        if let Some(h) = &self.accept_node_token_sha256 {
            v.push("--accept-node-token-sha256".into());
            v.push(h.clone());
        }
        v
    }
}
