//! The one error type of this crate: what went wrong setting TLS up.

use std::path::PathBuf;

/// Everything that can go wrong setting TLS up; each message names the
/// file and what was wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} {path} holds no PEM {expected} ({detail})")]
    Empty {
        what: &'static str,
        path: PathBuf,
        expected: &'static str,
        detail: String,
    },
    #[error("{what} {path}: {detail}")]
    Invalid {
        what: &'static str,
        path: PathBuf,
        detail: String,
    },
    #[error("certificate {path} ({subject}) expired at {not_after}; renew it (dtx-dev dev --tls makes new ones for development)")]
    Expired {
        path: PathBuf,
        subject: String,
        not_after: String,
    },
    #[error("certificate {path} ({subject}) is not valid before {not_before}; check the clocks or the certificate")]
    NotYetValid {
        path: PathBuf,
        subject: String,
        not_before: String,
    },
    #[error("the private key {key} does not match the certificate {cert}")]
    KeyMismatch { cert: PathBuf, key: PathBuf },
    #[error("TLS settings refused: {0}")]
    Config(String),
    #[error("cannot make development certificates: {0}")]
    Dev(String),
}
