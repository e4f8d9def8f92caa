//! TLS and mutual TLS for every dtx link, the identities of callers, and a
//! throwaway certificate authority for development (ADR 0016).
//!
//! - [`files`]: reading certificates, keys and authorities from PEM files,
//!   with errors that name the file and say what is wrong (unreadable, no
//!   certificate, expired, not yet valid, a key that does not match).
//! - [`identity`]: who a caller is ([`Identity`]: a [`Role`] and a name),
//!   read from the URI SAN `dtx://<role>/<name>` of its client certificate
//!   or from a bearer token checked against configured SHA-256 hashes.
//! - [`server`]: [`ServerTls`] (reloadable) and [`incoming`], the accepted
//!   connections of a gRPC server, plain or TLS, each carrying a
//!   [`PeerInfo`] that handlers and layers read from request extensions.
//! - [`client`]: [`ClientTls`] (reloadable) and [`Connector`], which a
//!   tonic `Endpoint` uses to open TLS connections (with a client
//!   certificate for mutual TLS).
//! - [`edge`]: a tower layer that authenticates every call (certificate or
//!   token), checks the role the called method needs, refuses with
//!   `UNAUTHENTICATED` or `PERMISSION_DENIED` (logged and counted), limits
//!   each identity's rate, answers undecodable requests `INVALID_ARGUMENT`,
//!   and hands the [`Identity`] to the handler.
//! - [`logtext`]: caller-chosen text escaped and bounded for logs and
//!   errors, and log lines summed up per key (ADR 0038).
//! - [`dev`]: `dtx-dev dev --tls`'s certificate authority (rcgen).
//! - `args` (feature `cli`): the `--tls-cert`, `--tls-key`, `--tls-ca`
//!   and `--token-file` flags of every command.
//!
//! rustls runs on the ring provider; nothing here uses the platform's
//! certificate store: every peer is checked against the configured
//! authority only.

pub mod admission;
#[cfg(feature = "cli")]
pub mod args;
pub mod client;
mod crypto;
pub mod described;
pub mod dev;
pub mod edge;
mod error;
pub mod files;
pub mod identity;
pub mod logtext;
pub mod server;

pub use admission::AdmissionLimits;
pub use client::ClientTls;
pub use client::Connector;
pub use edge::Access;
pub use edge::AuthPolicy;
pub use edge::EdgeLayer;
pub use edge::NodeCheck;
pub use edge::RateLimit;
pub use error::TlsError;
pub use identity::Identity;
pub use identity::Role;
pub use identity::TokenEntry;
pub use identity::Tokens;
pub use server::incoming;
pub use server::incoming_with;
pub use server::ClientAuth;
pub use server::PeerInfo;
pub use server::ServerTls;
