//! What every rustls config of this crate is built with: the crypto
//! provider and the protocol announced by ALPN.

/// The crypto provider every config here is built with.
pub(crate) fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}

/// HTTP/2 is what gRPC speaks; both sides announce it with ALPN.
pub(crate) const ALPN_H2: &[u8] = b"h2";
