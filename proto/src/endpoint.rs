//! Addresses: the one parser of the addresses that users, configs and
//! Enlist give, and the accepted-connection stream of our servers.

/// What an address may look like, for error messages.
pub const ADDRESS_FORMS: &str = "host:port or http://host[:port] (plain-text gRPC; TLS is not supported yet)";

/// A gRPC endpoint for `addr`: `host:port` (an IP, `[IPv6]` or a DNS name,
/// and a port), or `http://host[:port]` (port 80 when left out). The one place
/// addresses given by users, configs and Enlist are parsed, so an address
/// that passes here is one a channel can be built for.
///
/// Refused, with a message that says what was wrong and what is accepted:
/// `https://` (there is no TLS yet, and using it as plain text would be a
/// silent downgrade), any other scheme, a bare `host` without a port, a
/// path, query or user name, whitespace, and anything that does not parse
/// as a URI authority.
pub fn endpoint(addr: &str) -> Result<tonic::transport::Endpoint, String> {
    let bad = |why: &str| Err(format!("address {addr:?} {why}; expected {ADDRESS_FORMS}"));
    if addr.is_empty() {
        return bad("is empty");
    }
    if addr.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return bad("contains whitespace or a control character");
    }
    let (uri, bare) = match addr.split_once("://") {
        Some((scheme, _)) if scheme.eq_ignore_ascii_case("http") => (addr.to_string(), false),
        Some((scheme, _)) if scheme.eq_ignore_ascii_case("https") => {
            return bad("asks for TLS (https://), which this build does not support; it is refused rather than used as plain text");
        }
        Some((scheme, _)) => return bad(&format!("has the unsupported scheme {scheme:?}")),
        None => (format!("http://{addr}"), true),
    };
    let ep = match tonic::transport::Endpoint::from_shared(uri) {
        Ok(ep) => ep,
        Err(e) => return bad(&format!("is not a valid host and port ({e})")),
    };
    let u = ep.uri();
    let authority = u.authority().map(|a| a.as_str()).unwrap_or("");
    if u.host().unwrap_or("").is_empty() {
        return bad("has no host");
    }
    if authority.contains('@') {
        return bad("has a user name (user@host), which is not supported");
    }
    // The URI parser keeps any text after the host's ':' as the port, so
    // check it ourselves: digits that fit in 16 bits, not 0.
    let host = u.host().unwrap_or("");
    let after_host = authority.get(host.len()..).unwrap_or("");
    match after_host.strip_prefix(':') {
        None if after_host.is_empty() && bare => return bad("has no port"),
        None if after_host.is_empty() => {}
        None => return bad("is not a valid host and port"),
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 && p.bytes().all(|b| b.is_ascii_digit()) => {}
            _ => return bad(&format!("has the port {p:?}, not a number from 1 to 65535")),
        },
    }
    if u.query().is_some() || !matches!(u.path(), "" | "/") || (bare && addr.ends_with('/')) {
        return bad("has a path or query, which gRPC does not use");
    }
    Ok(ep)
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

#[cfg(test)]
mod tests {
    use super::endpoint;

    fn refused(addr: &str, why: &str) {
        let e = endpoint(addr).expect_err(addr);
        assert!(e.contains(why), "{addr}: {e}");
        // Every refusal says what is accepted.
        assert!(e.contains("host:port or http://host[:port]"), "{addr}: {e}");
    }

    #[test]
    fn accepted_forms_keep_host_and_port() {
        for (addr, host, port) in [
            ("127.0.0.1:7000", "127.0.0.1", Some(7000)),
            ("bank-a.internal:7000", "bank-a.internal", Some(7000)),
            ("[::1]:7000", "[::1]", Some(7000)),
            ("http://10.0.0.7:7000", "10.0.0.7", Some(7000)),
            ("HTTP://10.0.0.7:7000/", "10.0.0.7", Some(7000)),
            ("http://bank-a.internal", "bank-a.internal", None),
        ] {
            let ep = endpoint(addr).unwrap_or_else(|e| panic!("{addr}: {e}"));
            assert_eq!(ep.uri().host(), Some(host), "{addr}");
            assert_eq!(ep.uri().port_u16(), port, "{addr}");
            assert_eq!(ep.uri().scheme_str(), Some("http"), "{addr}");
        }
    }

    #[test]
    fn https_is_refused_never_downgraded() {
        refused("https://10.0.0.7:7000", "TLS");
        refused("HTTPS://10.0.0.7:7000", "https://");
    }

    #[test]
    fn malformed_addresses_say_what_is_wrong() {
        refused("", "is empty");
        refused("grpc://10.0.0.7:7000", "unsupported scheme \"grpc\"");
        refused("unix:///tmp/p.sock", "unsupported scheme");
        refused("bank-a", "no port");
        refused("10.0.0.7", "no port");
        refused("10.0.0.7:port", "not a number from 1 to 65535");
        refused("10.0.0.7:99999", "not a number from 1 to 65535");
        refused("10.0.0.7:0", "not a number from 1 to 65535");
        refused("10.0.0.7:", "not a number from 1 to 65535");
        refused("10.0.0.7:7000:1", "");
        refused(" 10.0.0.7:7000", "whitespace");
        refused("10.0.0.7:7000/x", "path");
        refused("http://10.0.0.7:7000/dtx", "path");
        refused("http://10.0.0.7:7000?x=1", "query");
        refused("http://user@10.0.0.7:7000", "user name");
        refused("http://:7000", "host");
        refused("http://", "");
    }
}
