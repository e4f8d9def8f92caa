//! The participant address policy (ADR 0041): which
//! participant addresses an application may enlist, as the operators
//! configure them in `participants.allowed_addresses`. Pure: no I/O, no
//! name resolution.
//!
//! An entry is
//! - a network of IP addresses, `10.0.0.0/8` or `fd00::/8` (host bits
//!   zero), or one address, `10.1.2.3` or `::1`; it matches addresses whose
//!   host is an IP literal (an IPv4-mapped IPv6 literal, `[::ffff:a.b.c.d]`,
//!   counts as the IPv4 address it maps);
//! - or a host-name pattern, `bank-*.svc.internal`: labels compared one to
//!   one, case-insensitively, `*` standing for any characters within one
//!   label (never a dot); its last label must hold a letter, so no pattern
//!   matches an IP literal or a numeric host such as `127.1` or
//!   `0x7f000001` (which resolvers read as IP addresses and which never
//!   match a name pattern).
//!
//! The port is not part of the policy. An empty list allows any address
//! (the behaviour before the policy existed).

use std::net::IpAddr;
use std::net::Ipv4Addr;
use std::net::Ipv6Addr;

/// The configuration key the policy comes from, for messages.
pub const KEY: &str = "participants.allowed_addresses";

#[derive(Clone, Debug, PartialEq, Eq)]
enum Entry {
    V4 {
        net: u32,
        prefix: u8,
    },
    V6 {
        net: u128,
        prefix: u8,
    },
    /// Lower-case labels, each possibly with `*`.
    Name(Vec<String>),
}

/// A parsed, checked policy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddressPolicy {
    entries: Vec<Entry>,
}

/// The most entries a policy may have (each address given is matched
/// against every entry).
pub const ENTRIES_MAX: usize = 1024;

impl AddressPolicy {
    /// Parses and checks `entries`; the error names the entry and says
    /// what is wrong.
    pub fn parse(entries: &[String]) -> Result<AddressPolicy, String> {
        if entries.len() > ENTRIES_MAX {
            return Err(format!(
                "{KEY} has {} entries; the limit is {ENTRIES_MAX} (use networks and patterns)",
                entries.len()
            ));
        }
        let entries = entries
            .iter()
            .map(|e| parse_entry(e).map_err(|why| format!("{KEY}: entry {e:?} {why}")))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(AddressPolicy { entries })
    }

    /// True when every address is allowed (no entries).
    pub fn allows_any(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether the host of a participant address (as `dtx_proto::endpoint`
    /// parses it: an IP literal, `[IPv6]` or a name) is allowed.
    pub fn allows_host(&self, host: &str) -> bool {
        if self.allows_any() {
            return true;
        }
        let bare = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if let Ok(ip) = bare.parse::<IpAddr>() {
            let ip = match ip {
                IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6)),
                v4 => v4,
            };
            return self.entries.iter().any(|e| match (e, ip) {
                (Entry::V4 { net, prefix }, IpAddr::V4(a)) => in_net(u32::from(a) as u128, *net as u128, *prefix, 32),
                (Entry::V6 { net, prefix }, IpAddr::V6(a)) => in_net(u128::from(a), *net, *prefix, 128),
                _ => false,
            });
        }
        if bare.starts_with('[') || numeric_host(bare) {
            return false;
        }
        let name = bare.strip_suffix('.').unwrap_or(bare).to_ascii_lowercase();
        let labels: Vec<&str> = name.split('.').collect();
        self.entries.iter().any(|e| match e {
            Entry::Name(pattern) => {
                pattern.len() == labels.len() && pattern.iter().zip(&labels).all(|(p, l)| glob(p, l))
            }
            _ => false,
        })
    }

    /// Whether the participant address `address` (already checked by
    /// `dtx_transport::channel::check_address`) is allowed. An address that
    /// does not parse is not.
    pub fn allows_address(&self, address: &str) -> bool {
        if self.allows_any() {
            return true;
        }
        match dtx_proto::endpoint::parse(address) {
            Ok(a) => a.endpoint.uri().host().is_some_and(|h| self.allows_host(h)),
            Err(_) => false,
        }
    }
}

fn in_net(addr: u128, net: u128, prefix: u8, bits: u8) -> bool {
    if prefix == 0 {
        return true;
    }
    let shift = bits - prefix;
    (addr >> shift) == (net >> shift)
}

/// A host resolvers would read as an IPv4 address in one of the old forms
/// (`127.1`, `0x7f.1`, `2130706433`): every label decimal or `0x` hex.
fn numeric_host(host: &str) -> bool {
    !host.is_empty()
        && host.split('.').all(|l| {
            let hex = l.strip_prefix("0x").or_else(|| l.strip_prefix("0X"));
            match hex {
                Some(h) => h.bytes().all(|b| b.is_ascii_hexdigit()),
                None => !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()),
            }
        })
}

/// `*` stands for any run of characters (within one label).
fn glob(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if text.len() < first.len() + last.len() || !text.starts_with(first) || !text.ends_with(last) {
        return false;
    }
    let mut rest = &text[first.len()..text.len() - last.len()];
    for mid in &parts[1..parts.len() - 1] {
        match rest.find(mid) {
            Some(i) => rest = &rest[i + mid.len()..],
            None => return false,
        }
    }
    true
}

fn parse_entry(e: &str) -> Result<Entry, String> {
    if e.is_empty() {
        return Err("is empty".into());
    }
    if e.len() > 253 {
        return Err("is longer than 253 bytes".into());
    }
    if let Some((ip, prefix)) = e.split_once('/') {
        let ip: IpAddr = ip.parse().map_err(|_| {
            format!("is not a network: {ip:?} is not an IP address (write e.g. 10.0.0.0/8 or fd00::/8)")
        })?;
        let bits = if ip.is_ipv4() { 32 } else { 128 };
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= bits && prefix.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| format!("has the prefix length {prefix:?}, not a number from 0 to {bits}"))?;
        return network(ip, prefix)
            .map_err(|first| format!("has host bits set after /{prefix}; the network is {first}/{prefix}"));
    }
    if let Ok(ip) = e.parse::<IpAddr>() {
        let bits = if ip.is_ipv4() { 32 } else { 128 };
        return network(ip, bits).map_err(|_| "is not a network".to_string());
    }
    if e.contains(':') || e.contains('[') {
        return Err(
            "is neither an IP network nor a host-name pattern (ports are not part of the policy; write the host only)"
                .into(),
        );
    }
    let name = e.strip_suffix('.').unwrap_or(e).to_ascii_lowercase();
    let labels: Vec<String> = name.split('.').map(str::to_string).collect();
    for l in &labels {
        if l.is_empty() || l.len() > 63 {
            return Err("has an empty label or one longer than 63 bytes".into());
        }
        if !l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'*') {
            return Err(
                "is not a host-name pattern: labels hold letters, digits, '-' and the wildcard '*' only".into(),
            );
        }
    }
    let last = labels.last().map(String::as_str).unwrap_or("");
    if !last.bytes().any(|b| b.is_ascii_alphabetic()) {
        return Err(if labels.iter().all(|l| l == "*") {
            format!("would match any name; to allow any address leave {KEY} empty (or absent)")
        } else {
            "is not a host-name pattern: its last label must hold a letter (for IP addresses write a network such as 10.0.0.0/24)".into()
        });
    }
    Ok(Entry::Name(labels))
}

/// The network of `ip`/`prefix`, or the network address it should have
/// been written with when host bits are set.
fn network(ip: IpAddr, prefix: u8) -> Result<Entry, IpAddr> {
    match ip {
        IpAddr::V4(a) => {
            let v = u32::from(a);
            let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix) };
            if v & !mask != 0 {
                return Err(IpAddr::V4(Ipv4Addr::from(v & mask)));
            }
            Ok(Entry::V4 { net: v, prefix })
        }
        IpAddr::V6(a) => {
            let v = u128::from(a);
            let mask = if prefix == 0 { 0 } else { u128::MAX << (128 - prefix) };
            if v & !mask != 0 {
                return Err(IpAddr::V6(Ipv6Addr::from(v & mask)));
            }
            Ok(Entry::V6 { net: v, prefix })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(entries: &[&str]) -> AddressPolicy {
        AddressPolicy::parse(&entries.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    fn refused(entry: &str, says: &str) {
        let e = AddressPolicy::parse(&[entry.to_string()]).expect_err(entry);
        assert!(e.contains(KEY) && e.contains(says), "{entry}: {e}");
    }

    /// Networks match IP literals (IPv4-mapped IPv6 as IPv4), patterns match
    /// names label by label, nothing else passes.
    #[test]
    fn networks_match_ip_literals_and_patterns_match_names() {
        let p = policy(&[
            "10.0.0.0/8",
            "127.0.0.1",
            "fd00::/8",
            "bank-*.svc.internal",
            "ledger.example.com",
        ]);
        for ok in [
            "10.1.2.3:7000",
            "http://10.255.0.1:80",
            "127.0.0.1:9",
            "[fd12::1]:7000",
            "[::ffff:10.0.0.9]:7000",
            "bank-a.svc.internal:7000",
            "BANK-Eu1.SVC.internal:7000",
            "bank-.svc.internal:1",
            "https://ledger.example.com",
            "ledger.example.com.:7000",
        ] {
            assert!(p.allows_address(ok), "{ok} should be allowed");
        }
        for no in [
            "11.0.0.1:7000",
            "127.0.0.2:7000",
            "[::1]:7000",
            "[fe80::1]:7000",
            "[::ffff:127.0.0.2]:7000",
            "bank-a.svc.internal.evil.com:7000",
            "x.bank-a.svc.internal:7000",
            "bank.svc.internal:7000",
            "ledger.example.org:7000",
            "localhost:7000",
            "127.1:7000",
            "0x7f000001:7000",
            "2130706433:7000",
            "not an address",
        ] {
            assert!(!p.allows_address(no), "{no} should be refused");
        }
        // Empty: anything goes, as before the policy.
        let any = policy(&[]);
        assert!(any.allows_any());
        assert!(any.allows_address("203.0.113.9:22"));
        // /0 networks allow their whole family only.
        let v4 = policy(&["0.0.0.0/0"]);
        assert!(v4.allows_address("203.0.113.9:22") && !v4.allows_address("[2001:db8::1]:22"));
        assert!(!v4.allows_address("bank-a.internal:22"), "names need a pattern");
    }

    #[test]
    fn wildcards_stay_within_one_label() {
        assert!(glob("bank-*", "bank-a"));
        assert!(glob("*-eu-*", "bank-eu-1"));
        assert!(glob("a*b*c", "abc"));
        assert!(!glob("a*b*c", "acb"));
        assert!(!glob("bank-*", "bank"));
        assert!(glob("*", ""));
        let p = policy(&["*.svc.internal"]);
        assert!(p.allows_host("bank.svc.internal"));
        assert!(!p.allows_host("a.bank.svc.internal"));
    }

    /// Bad entries are refused with what is wrong and how to write it.
    #[test]
    fn bad_entries_say_what_is_wrong() {
        refused("", "is empty");
        refused("10.0.0.1/8", "the network is 10.0.0.0/8");
        refused("10.0.0.0/33", "not a number from 0 to 32");
        refused("10.0.0.0/x", "not a number from 0 to 32");
        refused("fd00::1/8", "the network is fd00::/8");
        refused("10.0.0.*", "write a network such as 10.0.0.0/24");
        refused("10.0.0.0.0/8", "is not an IP address");
        refused("*", "leave participants.allowed_addresses empty");
        refused("*.*", "leave participants.allowed_addresses empty");
        refused("bank.internal:7000", "ports are not part of the policy");
        refused("bank_a.internal", "letters, digits, '-'");
        refused("bank..internal", "empty label");
        let many: Vec<String> = (0..=ENTRIES_MAX).map(|i| format!("h{i}.internal")).collect();
        assert!(AddressPolicy::parse(&many).unwrap_err().contains("the limit is 1024"));
    }
}
