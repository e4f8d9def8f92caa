//! Client-side channels: lazily connecting, multiplexed HTTP/2 channels with
//! the settings every caller of ours uses, plain or TLS, and a cache of one
//! per address. Each request leaves in one write ([`crate::unary`]).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use dtx_proto::endpoint::Address;
use dtx_proto::endpoint::Scheme;
use dtx_tls::ClientTls;

/// The channel every caller of ours uses: one HTTP/2 connection per
/// address, each request written in one go ([`crate::unary`]).
pub type Channel = crate::unary::UnaryChannel;

/// A lazily connecting plain-text channel to `addr` (see
/// [`dtx_proto::endpoint::parse`] for the accepted forms; `https://` is
/// refused, there being no TLS settings), with `TCP_NODELAY`, HTTP/2
/// keep-alive ([`crate::unary::KEEP_ALIVE_INTERVAL`]), the request's own
/// deadline enforced on this side too, the given connect timeout and, when
/// `local_ip` is set, that
/// source address (so firewall rules and test proxies can tell processes
/// apart by source address).
pub fn channel(addr: &str, local_ip: Option<IpAddr>, connect_timeout: Duration) -> Result<Channel, String> {
    channel_with(addr, local_ip, connect_timeout, None)
}

/// As [`channel`], over TLS when `tls` is set. An address must agree with
/// the process's settings: `https://` needs TLS settings, and `http://` is
/// refused when the process has them (a silent downgrade to plain text
/// would defeat them); `host:port` follows the settings.
pub fn channel_with(
    addr: &str,
    local_ip: Option<IpAddr>,
    connect_timeout: Duration,
    tls: Option<&Arc<ClientTls>>,
) -> Result<Channel, String> {
    let a = check_address(addr, tls.is_some())?;
    Channel::new(a.endpoint.uri().clone(), local_ip, connect_timeout, tls.cloned())
}

/// Parses `addr` (see [`dtx_proto::endpoint::parse`]) and checks that it
/// agrees with a process that uses TLS (`tls`) or not: what
/// [`channel_with`] would refuse is refused here, with the same message.
pub fn check_address(addr: &str, tls: bool) -> Result<Address, String> {
    let a = dtx_proto::endpoint::parse(addr)?;
    match (a.scheme, tls) {
        (Scheme::Tls, false) => {
            return Err(format!(
                "address {addr:?} asks for TLS (https://) but this process has no TLS settings; it is refused rather than used as plain text; expected {}",
                dtx_proto::ADDRESS_FORMS
            ))
        }
        (Scheme::Plain, true) => {
            return Err(format!(
                "address {addr:?} asks for plain text (http://) but this process uses TLS; give host:port or https://host[:port]"
            ))
        }
        _ => {}
    }
    Ok(a)
}

/// One lazily connecting, multiplexed channel per address, built with the
/// same source IP, connect timeout and TLS settings. Used by the Raft
/// network, a node's forwarding and driver, the client and the participant
/// SDK.
pub struct ChannelCache {
    local_ip: Option<IpAddr>,
    connect_timeout: Duration,
    tls: Option<Arc<ClientTls>>,
    map: Mutex<HashMap<String, Channel>>,
}

impl ChannelCache {
    /// Plain-text channels.
    pub fn new(local_ip: Option<IpAddr>, connect_timeout: Duration) -> Self {
        ChannelCache {
            local_ip,
            connect_timeout,
            tls: None,
            map: Default::default(),
        }
    }

    /// Channels over TLS when `tls` is set (see [`channel_with`]).
    pub fn with_tls(mut self, tls: Option<Arc<ClientTls>>) -> Self {
        self.tls = tls;
        self
    }

    /// The TLS settings channels are built with.
    pub fn tls(&self) -> Option<&Arc<ClientTls>> {
        self.tls.as_ref()
    }

    /// The cached channel to `addr`, built on first use.
    pub fn get(&self, addr: &str) -> Result<Channel, String> {
        let mut map = self.map.lock().expect("channel cache lock");
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let c = channel_with(addr, self.local_ip, self.connect_timeout, self.tls.as_ref())?;
        map.insert(addr.to_string(), c.clone());
        Ok(c)
    }
}
