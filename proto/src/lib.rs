//! The versioned gRPC API of the coordinator (`dtx.v1`).
//!
//! The `.proto` files under `proto/dtx/v1/` are the source of truth and
//! document every field; this crate only compiles them.
pub mod v1 {
    tonic::include_proto!("dtx.v1");
}

/// gRPC metadata key that carries a transaction id from a client to the
/// services it calls, so a service can do its work under that transaction
/// and enlist itself (see `participant_sdk::enlist`).
pub const TXID_METADATA_KEY: &str = "x-dtx-txid";

/// Puts `txid` into a request's metadata.
pub fn attach_txid<T>(req: &mut tonic::Request<T>, txid: u64) {
    req.metadata_mut().insert(TXID_METADATA_KEY, txid.into());
}

/// The transaction id a request carries, if any (and if well-formed).
pub fn txid_of<T>(req: &tonic::Request<T>) -> Option<u64> {
    req.metadata()
        .get(TXID_METADATA_KEY)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.parse().ok())
}

/// A gRPC endpoint for `addr` (`host:port`, or a full `http://` / `https://`
/// URI); the one place addresses given by users and configs are parsed.
pub fn endpoint(addr: &str) -> Result<tonic::transport::Endpoint, String> {
    let uri = if addr.starts_with("http://") || addr.starts_with("https://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    tonic::transport::Endpoint::from_shared(uri.clone()).map_err(|e| format!("bad address {uri:?}: {e}"))
}

/// The accepted-connection stream for a gRPC server on `listener`, with
/// `TCP_NODELAY` and keep-alive set on every accepted socket.
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
