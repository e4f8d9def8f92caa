//! Certificates, keys and authorities from PEM files, checked when read:
//! a file that cannot be read, holds nothing usable, has expired, is not
//! yet valid, or a key that does not belong to its certificate is refused
//! with a message that names the file and the problem.

use std::path::Path;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::PrivateKeyDer;
use rustls::sign::CertifiedKey;
use rustls::RootCertStore;

use crate::error::TlsError;

/// Paths of one process's own certificate chain and private key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyPairFiles {
    /// PEM: the process's certificate first, then any intermediates.
    pub cert: PathBuf,
    /// PEM: its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// Every certificate in a PEM file, in order; at least one.
pub fn load_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(what, path)?;
    let certs: Result<Vec<_>, _> = CertificateDer::pem_slice_iter(&bytes).collect();
    let certs = certs.map_err(|e| TlsError::Invalid {
        what,
        path: path.to_path_buf(),
        detail: format!("not a PEM certificate file ({e})"),
    })?;
    if certs.is_empty() {
        return Err(TlsError::Empty {
            what,
            path: path.to_path_buf(),
            expected: "CERTIFICATE block",
            detail: "no -----BEGIN CERTIFICATE----- found".into(),
        });
    }
    Ok(certs)
}

/// The one private key in a PEM file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let what = "private key";
    let bytes = read(what, path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError::Empty {
        what,
        path: path.to_path_buf(),
        expected: "PRIVATE KEY block",
        detail: e.to_string(),
    })
}

/// The validity window and subject of a certificate, as text for messages.
pub struct Validity {
    pub subject: String,
    pub not_before: SystemTime,
    pub not_after: SystemTime,
    pub not_before_text: String,
    pub not_after_text: String,
}

/// Parses the validity window of one DER certificate.
pub fn validity(what: &'static str, path: &Path, der: &CertificateDer<'_>) -> Result<Validity, TlsError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| TlsError::Invalid {
        what,
        path: path.to_path_buf(),
        detail: format!("not a valid X.509 certificate ({e})"),
    })?;
    let v = cert.validity();
    let at = |t: &x509_parser::time::ASN1Time| {
        let secs = t.timestamp();
        if secs >= 0 {
            SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs as u64)
        } else {
            SystemTime::UNIX_EPOCH
        }
    };
    Ok(Validity {
        subject: cert.subject().to_string(),
        not_before: at(&v.not_before),
        not_after: at(&v.not_after),
        not_before_text: v.not_before.to_string(),
        not_after_text: v.not_after.to_string(),
    })
}

/// Refuses a certificate outside its validity window at `now`.
pub fn check_validity(
    what: &'static str,
    path: &Path,
    der: &CertificateDer<'_>,
    now: SystemTime,
) -> Result<Validity, TlsError> {
    let v = validity(what, path, der)?;
    if now > v.not_after {
        return Err(TlsError::Expired {
            path: path.to_path_buf(),
            subject: v.subject,
            not_after: v.not_after_text,
        });
    }
    if now < v.not_before {
        return Err(TlsError::NotYetValid {
            path: path.to_path_buf(),
            subject: v.subject,
            not_before: v.not_before_text,
        });
    }
    Ok(v)
}

/// The process's own certificate chain and key, checked: readable, every
/// certificate of the chain valid now, and the key the one the leaf
/// certificate was issued for.
pub fn load_certified_key(files: &KeyPairFiles) -> Result<Arc<CertifiedKey>, TlsError> {
    load_certified_key_checking(files, true)
}

pub(crate) fn load_certified_key_checking(files: &KeyPairFiles, validity: bool) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = load_certs("certificate", &files.cert)?;
    let now = SystemTime::now();
    for c in chain.iter().filter(|_| validity) {
        check_validity("certificate", &files.cert, c, now)?;
    }
    let key = load_key(&files.key)?;
    let signing = crate::crypto::provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| TlsError::Invalid {
            what: "private key",
            path: files.key.clone(),
            detail: format!("not a usable private key ({e})"),
        })?;
    let ck = CertifiedKey::new(chain, signing);
    match ck.keys_match() {
        Ok(()) => Ok(Arc::new(ck)),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => Err(TlsError::KeyMismatch {
            cert: files.cert.clone(),
            key: files.key.clone(),
        }),
        Err(e) => Err(TlsError::Invalid {
            what: "certificate",
            path: files.cert.clone(),
            detail: format!("cannot check it against its key ({e})"),
        }),
    }
}

/// The certificate authorities in a PEM file, each valid now.
pub fn load_roots(path: &Path) -> Result<Arc<RootCertStore>, TlsError> {
    let what = "certificate authority";
    let certs = load_certs(what, path)?;
    let now = SystemTime::now();
    let mut roots = RootCertStore::empty();
    for c in certs {
        check_validity(what, path, &c, now)?;
        roots.add(c).map_err(|e| TlsError::Invalid {
            what,
            path: path.to_path_buf(),
            detail: format!("not usable as a trust anchor ({e})"),
        })?;
    }
    Ok(Arc::new(roots))
}

/// What a reload compares: the SHA-256 of each file's content (a missing
/// or unreadable file counts as a change too, and the reload then reports
/// it). Content, not modification times, so a rewrite within one tick of a
/// coarse file-system clock is still seen.
pub(crate) type Stamp = Vec<Option<[u8; 32]>>;

pub(crate) fn stamp(paths: &[&Path]) -> Stamp {
    use sha2::Digest;
    paths
        .iter()
        .map(|p| std::fs::read(p).ok().map(|b| sha2::Sha256::digest(&b).into()))
        .collect()
}

/// Settings built from files, and what the files held when they were
/// built: the part of [`crate::ServerTls`] and [`crate::ClientTls`] that
/// reloads.
pub(crate) struct Reloading<T> {
    current: std::sync::RwLock<Arc<T>>,
    stamp: std::sync::Mutex<Stamp>,
}

impl<T> Reloading<T> {
    /// Settings built from `paths` now. The stamp is taken before
    /// building: a file that changes meanwhile is read again at the next
    /// check (a stamp taken after would miss it for good).
    pub(crate) fn build(
        paths: &[&Path],
        build: impl FnOnce() -> Result<T, TlsError>,
    ) -> Result<Reloading<T>, TlsError> {
        let before = stamp(paths);
        Ok(Reloading {
            current: std::sync::RwLock::new(Arc::new(build()?)),
            stamp: std::sync::Mutex::new(before),
        })
    }

    pub(crate) fn current(&self) -> Arc<T> {
        self.current.read().expect("tls settings lock").clone()
    }

    /// Builds anew when a file of `paths` changed: Ok(true) when taken,
    /// Ok(false) when nothing changed, the error (settings kept) when the
    /// new files cannot be used.
    pub(crate) fn reload_if_changed(
        &self,
        paths: &[&Path],
        build: impl FnOnce() -> Result<T, TlsError>,
    ) -> Result<bool, TlsError> {
        let now = stamp(paths);
        let mut last = self.stamp.lock().expect("tls stamp lock");
        if *last == now {
            return Ok(false);
        }
        let built = build()?;
        *self.current.write().expect("tls settings lock") = Arc::new(built);
        *last = now;
        Ok(true)
    }
}

/// Every `interval`, `reload(settings)` while the settings are alive: a
/// change taken is logged at info and counted
/// (`dtx_tls_reloads_total{side}`); changed files that cannot be used are
/// counted at every check (`dtx_tls_reload_failures_total{side}`) and
/// logged once until a reload succeeds.
pub(crate) fn spawn_reload_loop<T: Send + Sync + 'static>(
    settings: std::sync::Weak<T>,
    interval: std::time::Duration,
    what: &'static str,
    side: &'static str,
    reload: fn(&T) -> Result<bool, TlsError>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut failing = false;
        loop {
            tokio::time::sleep(interval).await;
            let Some(me) = settings.upgrade() else { return };
            match reload(&me) {
                Ok(true) => {
                    failing = false;
                    metrics::counter!("dtx_tls_reloads_total", "side" => side).increment(1);
                    tracing::info!(what, side, "TLS files changed; new connections use them");
                }
                Ok(false) => {}
                Err(e) => {
                    metrics::counter!("dtx_tls_reload_failures_total", "side" => side).increment(1);
                    if !failing {
                        tracing::warn!(
                            what,
                            side,
                            "TLS files changed but cannot be used, keeping the previous ones: {e}"
                        );
                    }
                    failing = true;
                }
            }
        }
    })
}
