//! A throwaway certificate authority for development and tests:
//! `dtx-dev dev --tls` and the TLS tests make one. Never for
//! production: its key lives only in memory while the certificates are
//! issued (it is never written anywhere, so issuing more later means a
//! new authority and new certificates for everyone), and the issued keys
//! are written unencrypted.
//!
//! Every certificate it issues names one identity (URI SAN
//! `dtx://<role>/<name>`), the hosts it serves on (DNS or IP SANs), and
//! may be used by a server and by a client (both extended key usages), so
//! one file pair serves a node's ports and its calls to other nodes and to
//! participants.

use std::net::IpAddr;
use std::path::Path;
use std::path::PathBuf;
use std::time::Duration;

use rcgen::BasicConstraints;
use rcgen::CertificateParams;
use rcgen::DistinguishedName;
use rcgen::DnType;
use rcgen::ExtendedKeyUsagePurpose;
use rcgen::IsCa;
use rcgen::Issuer;
use rcgen::KeyPair;
use rcgen::KeyUsagePurpose;
use rcgen::SanType;
use time::OffsetDateTime;

use crate::error::TlsError;
use crate::files::KeyPairFiles;
use crate::identity::check_identity;
use crate::identity::Identity;
use crate::identity::Role;

fn dev_err(e: impl std::fmt::Display) -> TlsError {
    TlsError::Dev(e.to_string())
}

/// When a certificate is valid.
#[derive(Clone, Copy, Debug)]
pub enum Lifetime {
    /// From an hour ago (clock skew) to this long from now.
    FromNow(Duration),
    /// Ended a day ago (for tests of expired certificates).
    Expired,
}

impl Lifetime {
    fn window(self) -> (OffsetDateTime, OffsetDateTime) {
        let now = OffsetDateTime::now_utc();
        match self {
            Lifetime::FromNow(d) => (now - time::Duration::hours(1), now + d),
            Lifetime::Expired => (now - time::Duration::days(30), now - time::Duration::days(1)),
        }
    }
}

/// A year: what `dtx-dev dev --tls` issues for.
pub const DEV_LIFETIME: Lifetime = Lifetime::FromNow(Duration::from_secs(365 * 24 * 3600));

/// A certificate authority (its certificate and key in memory).
pub struct DevCa {
    issuer: Issuer<'static, KeyPair>,
    cert_pem: String,
}

/// A host a certificate is valid for.
#[derive(Clone, Debug)]
pub enum Host {
    Dns(String),
    Ip(IpAddr),
}

impl Host {
    /// An IP address if `s` parses as one, else a DNS name.
    pub fn parse(s: &str) -> Host {
        let h = s.trim_start_matches('[').trim_end_matches(']');
        match h.parse::<IpAddr>() {
            Ok(ip) => Host::Ip(ip),
            Err(_) => Host::Dns(h.to_string()),
        }
    }
}

impl DevCa {
    /// A new authority named `common_name`, valid for ten years.
    pub fn new(common_name: &str) -> Result<DevCa, TlsError> {
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(dev_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, common_name);
        dn.push(DnType::OrganizationName, "dtx development (not for production)");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(3650);
        let key = KeyPair::generate().map_err(dev_err)?;
        let cert = params.self_signed(&key).map_err(dev_err)?;
        Ok(DevCa {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// The authority's certificate (PEM), what every process trusts.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// A certificate for `role`/`name`, valid for `hosts`, and its key
    /// (both PEM).
    pub fn issue(
        &self,
        role: Role,
        name: &str,
        hosts: &[Host],
        lifetime: Lifetime,
    ) -> Result<(String, String), TlsError> {
        check_identity(role, name).map_err(TlsError::Dev)?;
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(dev_err)?;
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, format!("{role}/{name}"));
        params.distinguished_name = dn;
        let mut sans = vec![SanType::URI(Identity::uri(role, name).try_into().map_err(dev_err)?)];
        for h in hosts {
            sans.push(match h {
                Host::Ip(ip) => SanType::IpAddress(*ip),
                Host::Dns(d) => SanType::DnsName(d.clone().try_into().map_err(dev_err)?),
            });
        }
        params.subject_alt_names = sans;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let (nb, na) = lifetime.window();
        params.not_before = nb;
        params.not_after = na;
        let key = KeyPair::generate().map_err(dev_err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(dev_err)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A certificate with exactly `params` (no checks), signed by this
    /// authority, and its key (both PEM): for tests of certificates that
    /// [`DevCa::issue`] would never make.
    #[cfg(test)]
    pub(crate) fn issue_raw(&self, params: CertificateParams) -> (String, String) {
        let key = KeyPair::generate().expect("a key");
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        (cert.pem(), key.serialize_pem())
    }

    /// Writes the authority's certificate to `dir/ca.pem` and returns the
    /// path.
    pub fn write_ca(&self, dir: &Path) -> Result<PathBuf, TlsError> {
        let p = dir.join("ca.pem");
        write_file(&p, self.cert_pem.as_bytes(), false)?;
        Ok(p)
    }

    /// Issues (see [`DevCa::issue`]) into `dir/<stem>.pem` and
    /// `dir/<stem>.key` (mode 0600).
    pub fn issue_to(
        &self,
        dir: &Path,
        stem: &str,
        role: Role,
        name: &str,
        hosts: &[Host],
        lifetime: Lifetime,
    ) -> Result<KeyPairFiles, TlsError> {
        let (cert, key) = self.issue(role, name, hosts, lifetime)?;
        let files = KeyPairFiles {
            cert: dir.join(format!("{stem}.pem")),
            key: dir.join(format!("{stem}.key")),
        };
        write_file(&files.cert, cert.as_bytes(), false)?;
        write_file(&files.key, key.as_bytes(), true)?;
        Ok(files)
    }
}

/// Writes a file atomically (a temporary name, then a rename, so a
/// reloading process never reads half of it); keys get mode 0600.
pub fn write_file(path: &Path, bytes: &[u8], secret: bool) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| dev_err(format!("create {}: {e}", dir.display())))?;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(if secret { 0o600 } else { 0o644 })
        .open(&tmp)
        .map_err(|e| dev_err(format!("create {}: {e}", tmp.display())))?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| dev_err(format!("write {}: {e}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(|e| dev_err(format!("rename to {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::files::load_certified_key;
    use crate::files::load_roots;

    #[test]
    fn issued_certificates_load_and_name_their_identity() {
        let dir = tempfile::tempdir().unwrap();
        let ca = DevCa::new("test ca").unwrap();
        let ca_path = ca.write_ca(dir.path()).unwrap();
        load_roots(&ca_path).unwrap();
        let f = ca
            .issue_to(
                dir.path(),
                "node-1",
                Role::Node,
                "1",
                &[Host::parse("127.0.0.1"), Host::parse("localhost")],
                DEV_LIFETIME,
            )
            .unwrap();
        let ck = load_certified_key(&f).unwrap();
        let id = crate::identity::identity_of_cert(&ck.cert[0]).unwrap();
        assert_eq!(id.label(), "node/1");
    }

    #[test]
    fn expired_mismatched_and_missing_files_say_what_is_wrong() {
        let dir = tempfile::tempdir().unwrap();
        let ca = DevCa::new("test ca").unwrap();
        let old = ca
            .issue_to(dir.path(), "old", Role::Operator, "alice", &[], Lifetime::Expired)
            .unwrap();
        let e = load_certified_key(&old).unwrap_err();
        assert!(matches!(e, TlsError::Expired { .. }), "{e}");
        assert!(e.to_string().contains("expired at"), "{e}");

        let a = ca
            .issue_to(dir.path(), "a", Role::Operator, "a", &[], DEV_LIFETIME)
            .unwrap();
        let b = ca
            .issue_to(dir.path(), "b", Role::Operator, "b", &[], DEV_LIFETIME)
            .unwrap();
        let mixed = KeyPairFiles {
            cert: a.cert.clone(),
            key: b.key.clone(),
        };
        let e = load_certified_key(&mixed).unwrap_err();
        assert!(matches!(e, TlsError::KeyMismatch { .. }), "{e}");
        assert!(e.to_string().contains("does not match"), "{e}");

        let missing = KeyPairFiles {
            cert: dir.path().join("nope.pem"),
            key: a.key.clone(),
        };
        let e = load_certified_key(&missing).unwrap_err();
        assert!(
            e.to_string().contains("cannot read certificate") && e.to_string().contains("nope.pem"),
            "{e}"
        );

        let not_pem = KeyPairFiles {
            cert: a.key.clone(),
            key: a.key.clone(),
        };
        let e = load_certified_key(&not_pem).unwrap_err();
        assert!(e.to_string().contains("no PEM CERTIFICATE"), "{e}");
    }
}
