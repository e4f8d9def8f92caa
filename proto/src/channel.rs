//! Client-side channels: lazily connecting, multiplexed HTTP/2 channels with
//! the settings every caller of ours uses, and a cache of one per address.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

use tonic::transport::Channel;

/// A lazily connecting channel to `addr` (see [`crate::endpoint`] for the
/// accepted forms), with `TCP_NODELAY`, HTTP/2 keep-alive, the given connect
/// timeout and, when `local_ip` is set, that source address (so firewall
/// rules and test proxies can tell processes apart by source address).
pub fn channel(addr: &str, local_ip: Option<IpAddr>, connect_timeout: Duration) -> Result<Channel, String> {
    let ep = crate::endpoint(addr)?;
    Ok(ep
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5))
        .local_address(local_ip)
        .connect_lazy())
}

/// One lazily connecting, multiplexed channel per address, built with the
/// same source IP and connect timeout. Used by the Raft network, a node's
/// forwarding and driver, the client and the participant SDK.
pub struct ChannelCache {
    local_ip: Option<IpAddr>,
    connect_timeout: Duration,
    map: Mutex<HashMap<String, Channel>>,
}

impl ChannelCache {
    pub fn new(local_ip: Option<IpAddr>, connect_timeout: Duration) -> Self {
        ChannelCache {
            local_ip,
            connect_timeout,
            map: Default::default(),
        }
    }

    /// The cached channel to `addr`, built on first use.
    pub fn get(&self, addr: &str) -> Result<Channel, String> {
        let mut map = self.map.lock().expect("channel cache lock");
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let c = channel(addr, self.local_ip, self.connect_timeout)?;
        map.insert(addr.to_string(), c.clone());
        Ok(c)
    }
}
