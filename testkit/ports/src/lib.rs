//! Free TCP ports for the local processes that tests, demos and benches
//! start (coordinator nodes, bank services, PostgreSQL, etcd).
//!
//! The port must be chosen before the child process exists, because a
//! node's address goes into its peers' configuration. The usual trick (bind
//! port 0, read the port, release it) hands back a port from the kernel's
//! ephemeral range (`net.ipv4.ip_local_port_range`, 32768–60999 by
//! default), which is also where the kernel takes the local port of every
//! outgoing connection. Between the release and the child's own bind, any
//! connection made on the machine (a node that started a moment earlier
//! dialling its peers, a supervisor polling them) may take that port as its
//! local end, and the child then fails with "address in use". In CI that
//! left a demo cluster without the node that bootstraps it, and so without
//! a leader.
//!
//! [`free_port`] therefore picks ports below the ephemeral range (or above
//! it when nothing is below), which the kernel never hands out by itself,
//! and checks each by binding it. Within one process a shared cursor walks
//! the range, so two calls never return the same port; separate processes
//! start at different places (seeded by pid and clock), and a port another
//! process already listens on fails the bind check and is skipped.

use std::io;
use std::net::TcpListener;
use std::ops::Range;
use std::sync::atomic::AtomicU32;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

/// The lowest port handed out: below are the well-known and registered
/// ports that services on a developer's machine often use.
const LOWEST_PORT: u32 = 15_000;

/// Linux's default ephemeral range, assumed when the kernel's cannot be read.
const DEFAULT_EPHEMERAL: (u32, u32) = (32_768, 60_999);

/// A TCP port on `ip` that nothing listens on now and that the kernel does
/// not give to outgoing connections. Falls back to a kernel-chosen port
/// (bind to port 0) only when the ephemeral range leaves no room at all.
pub fn free_port(ip: &str) -> io::Result<u16> {
    match outside(ephemeral_range()) {
        Some(range) => pick(ip, range, cursor()),
        None => {
            let l = TcpListener::bind((ip, 0))?;
            Ok(l.local_addr()?.port())
        }
    }
}

/// The kernel's ephemeral range, inclusive at both ends.
fn ephemeral_range() -> (u32, u32) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| parse_range(&s))
        .unwrap_or(DEFAULT_EPHEMERAL)
}

fn parse_range(s: &str) -> Option<(u32, u32)> {
    let mut it = s.split_whitespace().map(str::parse::<u32>);
    match (it.next(), it.next()) {
        (Some(Ok(lo)), Some(Ok(hi))) if lo <= hi && hi <= 65_535 => Some((lo, hi)),
        _ => None,
    }
}

/// The ports to pick from, given the ephemeral range (inclusive): those
/// between [`LOWEST_PORT`] and the range's start, or else those above its
/// end, when there are at least a thousand.
fn outside((lo, hi): (u32, u32)) -> Option<Range<u32>> {
    const ENOUGH: u32 = 1_000;
    if lo >= LOWEST_PORT + ENOUGH {
        Some(LOWEST_PORT..lo)
    } else if hi + ENOUGH <= 65_535 {
        Some(hi + 1..65_536)
    } else {
        None
    }
}

/// This process's place in the range, seeded once from pid and clock so
/// that processes picking at the same time start far apart.
fn cursor() -> &'static AtomicU32 {
    static CURSOR: OnceLock<AtomicU32> = OnceLock::new();
    CURSOR.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        AtomicU32::new(std::process::id().wrapping_mul(7_919) ^ nanos)
    })
}

/// The next port of `range`, from `cursor` on, that `ip` can bind; an
/// error once every port of the range was tried.
fn pick(ip: &str, range: Range<u32>, cursor: &AtomicU32) -> io::Result<u16> {
    let len = range.end - range.start;
    let mut last_error = None;
    for _ in 0..len {
        let port = range.start + cursor.fetch_add(1, Ordering::Relaxed) % len;
        let port = u16::try_from(port).map_err(io::Error::other)?;
        match TcpListener::bind((ip, port)) {
            Ok(_) => return Ok(port),
            Err(e) => last_error = Some(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AddrInUse,
        format!(
            "no free TCP port on {ip} in {}..{} (the last bind said: {})",
            range.start,
            range.end,
            last_error.map_or_else(|| "nothing".to_string(), |e| e.to_string())
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernels_range_is_read_and_bad_text_is_refused() {
        assert_eq!(parse_range("32768\t60999\n"), Some((32_768, 60_999)));
        assert_eq!(parse_range("1024 65535"), Some((1_024, 65_535)));
        assert_eq!(parse_range("60999 32768"), None);
        assert_eq!(parse_range("32768"), None);
        assert_eq!(parse_range("a b"), None);
        assert_eq!(parse_range("1 70000"), None);
    }

    #[test]
    fn ports_come_from_below_the_ephemeral_range_else_above_it() {
        assert_eq!(outside((32_768, 60_999)), Some(15_000..32_768));
        assert_eq!(outside((10_000, 60_000)), Some(60_001..65_536));
        assert_eq!(outside((1_024, 65_535)), None);
        assert_eq!(outside((15_500, 65_000)), None);
    }

    #[test]
    fn successive_ports_differ_lie_outside_the_ephemeral_range_and_can_be_bound() {
        let (lo, hi) = ephemeral_range();
        let mut seen = std::collections::HashSet::new();
        for _ in 0..200 {
            let p = free_port("127.0.0.1").unwrap();
            assert!(seen.insert(p), "port {p} handed out twice");
            if outside((lo, hi)).is_some() {
                assert!(
                    !(lo..=hi).contains(&u32::from(p)),
                    "{p} is in the ephemeral range {lo}-{hi}"
                );
            }
            TcpListener::bind(("127.0.0.1", p)).expect("a handed-out port can be bound");
        }
    }

    #[test]
    fn a_port_something_listens_on_is_skipped() {
        // A listener the kernel placed (in the ephemeral range, which this
        // test uses as its own little range).
        let held = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = u32::from(held.local_addr().unwrap().port());
        let cursor = AtomicU32::new(0);
        let got = pick("127.0.0.1", p..p + 2, &cursor);
        match got {
            Ok(q) => assert_eq!(u32::from(q), p + 1, "the held port {p} was handed out"),
            // p + 1 may be busy on a shared machine: then nothing is free.
            Err(e) => assert_eq!(e.kind(), io::ErrorKind::AddrInUse),
        }
    }

    #[test]
    fn a_range_with_nothing_free_is_a_clear_error() {
        let held = TcpListener::bind("127.0.0.1:0").unwrap();
        let p = u32::from(held.local_addr().unwrap().port());
        let e = pick("127.0.0.1", p..p + 1, &AtomicU32::new(0)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::AddrInUse);
        assert!(
            e.to_string()
                .contains(&format!("no free TCP port on 127.0.0.1 in {p}..{}", p + 1)),
            "{e}"
        );
    }
}
