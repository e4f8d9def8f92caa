//! Addresses: the one parser of the addresses that users, configs and
//! Enlist give. Channels to them and the servers' accepted-connection
//! streams are the transport's (`dtx-transport`).

/// What an address may look like, for error messages.
pub const ADDRESS_FORMS: &str =
    "host:port, http://host[:port] (plain-text gRPC) or https://host[:port] (TLS, for a process configured with TLS)";

/// What an address asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// `host:port`: whatever the process is configured for.
    Either,
    /// `http://`: plain text.
    Plain,
    /// `https://`: TLS.
    Tls,
}

/// A parsed address: an endpoint (always with the `http` scheme inside,
/// since TLS is done by our own connector) and what the address asked for.
#[derive(Clone, Debug)]
pub struct Address {
    pub endpoint: tonic::transport::Endpoint,
    pub scheme: Scheme,
}

/// Parses `addr`: `host:port` (an IP, `[IPv6]` or a DNS name, and a port),
/// `http://host[:port]` (port 80 when left out) or `https://host[:port]`
/// (port 443). The one place addresses given by users, configs and Enlist
/// are parsed, so an address that passes here is one a channel can be
/// built for.
///
/// Refused, with a message that says what was wrong and what is accepted:
/// any other scheme, a bare `host` without a port, a path, query or user
/// name, whitespace, and anything that does not parse as a URI authority.
pub fn parse(addr: &str) -> Result<Address, String> {
    let bad = |why: &str| Err(format!("address {addr:?} {why}; expected {ADDRESS_FORMS}"));
    if addr.is_empty() {
        return bad("is empty");
    }
    if addr.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return bad("contains whitespace or a control character");
    }
    let (uri, bare, scheme) = match addr.split_once("://") {
        Some((scheme, _)) if scheme.eq_ignore_ascii_case("http") => (addr.to_string(), false, Scheme::Plain),
        // The URI says http because our connector, not tonic, does TLS.
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("https") => (format!("http://{rest}"), false, Scheme::Tls),
        Some((scheme, _)) => return bad(&format!("has the unsupported scheme {scheme:?}")),
        None => (format!("http://{addr}"), true, Scheme::Either),
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
    if scheme == Scheme::Tls && after_host.is_empty() {
        // https without a port means 443, as the scheme implies.
        let ep = tonic::transport::Endpoint::from_shared(format!("http://{host}:443"))
            .map_err(|e| format!("address {addr:?} is not a valid host and port ({e}); expected {ADDRESS_FORMS}"))?;
        return Ok(Address { endpoint: ep, scheme });
    }
    Ok(Address { endpoint: ep, scheme })
}

/// A plain-text gRPC endpoint for `addr` (see [`parse`]). `https://` is
/// refused here: a caller that connects with this endpoint would speak
/// plain text to it, a silent downgrade; channels with TLS come from
/// `dtx_transport::channel`.
pub fn endpoint(addr: &str) -> Result<tonic::transport::Endpoint, String> {
    let a = parse(addr)?;
    if a.scheme == Scheme::Tls {
        return Err(format!(
            "address {addr:?} asks for TLS (https://), which a plain-text endpoint cannot give; it is refused rather than used as plain text"
        ));
    }
    Ok(a.endpoint)
}

#[cfg(test)]
mod tests {
    use super::endpoint;
    use super::parse;
    use super::Scheme;

    fn refused(addr: &str, why: &str) {
        let e = endpoint(addr).expect_err(addr);
        assert!(e.contains(why), "{addr}: {e}");
        // Every refusal says what is accepted.
        assert!(e.contains("host:port, http://host[:port]"), "{addr}: {e}");
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
    fn https_is_parsed_for_tls_and_refused_as_a_plain_endpoint() {
        for (addr, port) in [
            ("https://10.0.0.7:7000", 7000),
            ("HTTPS://bank-a.internal", 443),
            ("https://[::1]:7000", 7000),
        ] {
            let a = parse(addr).unwrap_or_else(|e| panic!("{addr}: {e}"));
            assert_eq!(a.scheme, Scheme::Tls, "{addr}");
            assert_eq!(a.endpoint.uri().port_u16(), Some(port), "{addr}");
        }
        assert_eq!(parse("10.0.0.7:7000").unwrap().scheme, Scheme::Either);
        assert_eq!(parse("http://10.0.0.7:7000").unwrap().scheme, Scheme::Plain);
        let e = endpoint("https://10.0.0.7:7000").unwrap_err();
        assert!(e.contains("asks for TLS"), "{e}");
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
