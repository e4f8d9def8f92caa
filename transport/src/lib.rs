//! How dtx processes reach each other over the wire contract
//! ([`dtx_proto`]): what a node, the client, a participant and the tools
//! dial and accept with (docs/adr/0044-crate-lines.md).
//!
//! - [`unary`]: the gRPC client transport that writes each request in one
//!   go (docs/adr/0026-one-write-per-request.md), and [`nothing_sent`], how
//!   a caller tells a call that never left from one that may have arrived.
//! - [`channel`]: lazily connecting channels, plain or TLS, and the
//!   per-address channel cache used by nodes, the client and participants.
//! - [`incoming`]: the accepted-connection stream of a plain-text server
//!   (servers that may run with TLS use [`dtx_tls::incoming`]).
//!
//! Addresses are parsed by the contract's one parser,
//! [`dtx_proto::endpoint::parse`]; TLS settings and identities come from
//! [`dtx_tls`].

pub mod channel;
pub mod unary;

pub use channel::Channel;
pub use unary::nothing_sent;

/// The accepted-connection stream for a gRPC server on `listener`, with
/// `TCP_NODELAY` and keep-alive set on every accepted socket, in plain
/// text (servers that may run with TLS use [`dtx_tls::incoming`]).
///
/// tonic applies `Server::tcp_nodelay` only to listeners it binds itself;
/// with `serve_with_incoming` the accepted sockets keep Nagle's algorithm,
/// and a small reply can then wait for the peer's delayed ACK (about 40 ms
/// on Linux). Every server of ours is built on a listener we bind, so every
/// one goes through here.
pub fn incoming(listener: tokio::net::TcpListener) -> tonic::transport::server::TcpIncoming {
    tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(std::time::Duration::from_secs(30)))
}
