//! Who a caller is: a role and a name, from a client certificate's URI SAN
//! `dtx://<role>/<name>` or from a bearer token.

use std::fmt;

use rustls::pki_types::CertificateDer;
use sha2::Digest;

/// What a caller may do (see [`crate::auth`] for the method table).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    /// A service that runs transactions: begin, enlist, commit and abort
    /// its own, read decisions.
    Application,
    /// A participant service: read decisions, enlist itself.
    Participant,
    /// A person or tool running the cluster: admin, resolve, membership.
    Operator,
    /// A coordinator node: Raft between nodes, and the decisions it sends
    /// to participants.
    Node,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Application, Role::Participant, Role::Operator, Role::Node];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Application => "application",
            Role::Participant => "participant",
            Role::Operator => "operator",
            Role::Node => "node",
        }
    }

    pub fn parse(s: &str) -> Result<Role, String> {
        Role::ALL.into_iter().find(|r| r.as_str() == s).ok_or_else(|| {
            format!(
                "unknown role {}; expected one of application, participant, operator, node",
                shown(s)
            )
        })
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the caller proved who it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proof {
    Certificate,
    Token,
}

/// An authenticated caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub role: Role,
    /// 1 to 128 bytes of `[A-Za-z0-9._-]`, starting with a letter or a
    /// digit; a node's is its node id ([`check_identity`]).
    pub name: String,
    pub proof: Proof,
}

impl Identity {
    /// The form recorded with decisions and shown in logs:
    /// `<role>/<name>`.
    pub fn label(&self) -> String {
        format!("{}/{}", self.role, self.name)
    }

    /// The URI SAN a certificate for this identity carries.
    pub fn uri(role: Role, name: &str) -> String {
        format!("{URI_SCHEME}://{role}/{name}")
    }
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.role, self.name)
    }
}

/// The URI scheme of identity SANs.
pub const URI_SCHEME: &str = "dtx";
/// Longest identity name, in bytes.
pub const NAME_BYTES_MAX: usize = 128;

/// Checks an identity name: 1 to [`NAME_BYTES_MAX`] bytes of letters,
/// digits, `.`, `_` and `-`, starting with a letter or a digit (so `.`,
/// `..` and option-like `-x` are not names). The error shows the name
/// escaped and cut to [`NAME_SHOWN_MAX`] characters.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > NAME_BYTES_MAX {
        return Err(format!(
            "identity name {} ({} bytes) must be 1 to {NAME_BYTES_MAX} bytes",
            shown(name),
            name.len()
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(format!(
            "identity name {} may hold only letters, digits, '.', '_' and '-'",
            shown(name)
        ));
    }
    if !name.as_bytes()[0].is_ascii_alphanumeric() {
        return Err(format!(
            "identity name {} must start with a letter or a digit",
            shown(name)
        ));
    }
    Ok(())
}

/// Checks the name of an identity of `role`: [`check_name`], and for a
/// node its node id (a decimal number from 1, no leading zeros), since a
/// node is known by its id.
pub fn check_identity(role: Role, name: &str) -> Result<(), String> {
    check_name(name)?;
    if role == Role::Node && node_id_of(name).is_none() {
        return Err(format!(
            "a node's name is its node id (a number from 1, without leading zeros), not {}",
            shown(name)
        ));
    }
    Ok(())
}

/// The node id a node identity's name stands for.
pub fn node_id_of(name: &str) -> Option<u64> {
    if name.starts_with('0') || !name.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    name.parse().ok().filter(|&id| id > 0)
}

/// Characters of a caller-supplied name shown in an error at most.
pub const NAME_SHOWN_MAX: usize = 64;

/// `s` quoted and escaped (`{:?}`), cut to [`NAME_SHOWN_MAX`] characters.
fn shown(s: &str) -> String {
    match s.char_indices().nth(NAME_SHOWN_MAX) {
        Some((at, _)) => format!("{:?}...", &s[..at]),
        None => format!("{s:?}"),
    }
}

/// Parses `dtx://<role>/<name>`.
pub fn parse_uri(uri: &str) -> Result<(Role, String), String> {
    let rest = uri
        .strip_prefix(URI_SCHEME)
        .and_then(|r| r.strip_prefix("://"))
        .ok_or_else(|| format!("{} is not a {URI_SCHEME}://<role>/<name> URI", shown(uri)))?;
    let (role, name) = rest
        .split_once('/')
        .ok_or_else(|| format!("{} has no name after the role", shown(uri)))?;
    let role = Role::parse(role)?;
    check_identity(role, name)?;
    Ok((role, name.to_string()))
}

/// The identity a client certificate names: its one `dtx://` URI SAN.
/// A certificate with none, or with two, names no identity (the error says
/// which).
pub fn identity_of_cert(der: &CertificateDer<'_>) -> Result<Identity, String> {
    let (_, cert) =
        x509_parser::parse_x509_certificate(der).map_err(|e| format!("unreadable client certificate ({e})"))?;
    let mut found = Vec::new();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::URI(u) = n {
                if u.starts_with(&format!("{URI_SCHEME}://")) {
                    found.push(parse_uri(u)?);
                }
            }
        }
    }
    match found.len() {
        1 => {
            let (role, name) = found.remove(0);
            Ok(Identity {
                role,
                name,
                proof: Proof::Certificate,
            })
        }
        0 => Err(format!(
            "the client certificate ({}) has no {URI_SCHEME}://<role>/<name> URI SAN",
            cert.subject()
        )),
        _ => Err(format!(
            "the client certificate ({}) has {} {URI_SCHEME}:// URI SANs; it must have one",
            cert.subject(),
            found.len()
        )),
    }
}

/// One accepted bearer token: who it stands for and the SHA-256 of the
/// token (never the token itself).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenEntry {
    pub role: Role,
    pub name: String,
    pub sha256: [u8; 32],
}

impl TokenEntry {
    /// From the configured hex hash.
    pub fn new(role: Role, name: &str, sha256_hex: &str) -> Result<TokenEntry, String> {
        // Not `check_identity`: a participant's node token stands for the
        // whole cluster ("node/cluster", `--accept-node-token-sha256`).
        check_name(name)?;
        let hex = sha256_hex.trim();
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "token hash for {role}/{name} must be 64 hex digits (the SHA-256 of the token; `dtx-dev dev --tls` prints one), got {} characters",
                hex.len()
            ));
        }
        let mut sha256 = [0u8; 32];
        for (i, b) in sha256.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("checked hex");
        }
        Ok(TokenEntry {
            role,
            name: name.to_string(),
            sha256,
        })
    }
}

/// The SHA-256 of a token, as 64 lowercase hex digits (what the config
/// holds).
pub fn token_sha256_hex(token: &str) -> String {
    sha2::Sha256::digest(token.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A new random token: 32 bytes as 64 hex digits.
pub fn new_token() -> String {
    let bytes: [u8; 32] = rand::random();
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The accepted bearer tokens.
#[derive(Clone, Debug, Default)]
pub struct Tokens {
    entries: Vec<TokenEntry>,
}

impl Tokens {
    pub fn new(entries: Vec<TokenEntry>) -> Tokens {
        Tokens { entries }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The identity `token` stands for. The hash is compared with every
    /// entry in constant time, so the time taken does not tell how much of
    /// a hash matched.
    pub fn check(&self, token: &str) -> Option<Identity> {
        let h = sha2::Sha256::digest(token.as_bytes());
        let mut found = None;
        for e in &self.entries {
            let diff = e.sha256.iter().zip(h.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if diff == 0 && found.is_none() {
                found = Some(Identity {
                    role: e.role,
                    name: e.name.clone(),
                    proof: Proof::Token,
                });
            }
        }
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris_parse_and_refuse_with_reasons() {
        assert_eq!(
            parse_uri("dtx://operator/alice").unwrap(),
            (Role::Operator, "alice".into())
        );
        assert_eq!(parse_uri("dtx://node/1").unwrap(), (Role::Node, "1".into()));
        assert!(parse_uri("dtx://admin/alice").unwrap_err().contains("unknown role"));
        assert!(parse_uri("dtx://operator").unwrap_err().contains("no name"));
        assert!(parse_uri("dtx://operator/a/b").unwrap_err().contains("only letters"));
        assert!(parse_uri("spiffe://x/y").unwrap_err().contains("not a dtx://"));
        assert!(parse_uri("dtx://operator/").unwrap_err().contains("1 to 128"));
    }

    /// Names are 1 to 128 bytes of a documented alphabet starting with a
    /// letter or a digit, a node's name is its node id, and an error shows a
    /// name escaped and cut short.
    #[test]
    fn names_are_bounded_and_dot_dot_is_not_a_name() {
        for bad in [".", "..", "-x", "_x", ".hidden"] {
            let e = parse_uri(&format!("dtx://participant/{bad}")).unwrap_err();
            assert!(e.contains("must start with a letter or a digit"), "{bad}: {e}");
        }
        for ok in ["a", "a..b", "bank-a", "shop_2", "9", "x.y-z"] {
            parse_uri(&format!("dtx://participant/{ok}")).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        let long = "a".repeat(NAME_BYTES_MAX + 1);
        let e = check_name(&long).unwrap_err();
        assert!(e.contains("129 bytes") && e.contains("1 to 128"), "{e}");
        assert!(e.len() < 200, "the error shows the name cut short: {e}");
        let e = check_name("a\nforged line").unwrap_err();
        assert!(e.contains("\\n") && !e.contains('\n'), "escaped: {e}");
        for bad in ["node/0", "node/01", "node/x", "node/-1"] {
            let e = parse_uri(&format!("dtx://{bad}")).unwrap_err();
            assert!(e.contains("node id") || e.contains("start with a letter"), "{bad}: {e}");
        }
        assert_eq!(parse_uri("dtx://node/12").unwrap(), (Role::Node, "12".into()));
        assert_eq!(node_id_of("12"), Some(12));
        let e = Role::parse(&"r".repeat(10_000)).unwrap_err();
        assert!(e.len() < 300, "{e}");
        assert!(TokenEntry::new(Role::Application, "..", &token_sha256_hex("t"))
            .unwrap_err()
            .contains("start with a letter"));
        // A participant's node token stands for the cluster, not one node.
        TokenEntry::new(Role::Node, "cluster", &token_sha256_hex("t")).unwrap();
    }

    #[test]
    fn tokens_match_by_hash_only() {
        let t = new_token();
        let e = TokenEntry::new(Role::Application, "shop", &token_sha256_hex(&t)).unwrap();
        let tokens = Tokens::new(vec![e]);
        let id = tokens.check(&t).unwrap();
        assert_eq!(id.label(), "application/shop");
        assert_eq!(id.proof, Proof::Token);
        assert!(tokens.check(&new_token()).is_none());
        assert!(tokens.check("").is_none());
        assert!(TokenEntry::new(Role::Application, "shop", "abc")
            .unwrap_err()
            .contains("64 hex digits"));
        assert!(TokenEntry::new(Role::Application, "sh op", &token_sha256_hex(&t)).is_err());
    }

    #[test]
    fn the_known_sha256_of_abc() {
        assert_eq!(
            token_sha256_hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
