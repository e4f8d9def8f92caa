//! What a server spends on connections before anyone has said who they are
//! (invariant 12: a caller that has not authenticated costs a node bounded
//! memory, connections and log; docs/adr/0036-connection-admission.md).
//!
//! - **Limits.** At most [`AdmissionLimits::connections_max`] connections
//!   in all and [`AdmissionLimits::connections_per_peer_max`] from one IP
//!   address; on a TLS port, at most
//!   [`AdmissionLimits::anonymous_connections_max`] of them without a
//!   client certificate that proves an identity, so callers with one
//!   always find room. A connection over a limit is closed at once,
//!   counted, never handed to the server.
//! - **A deadline for the HTTP/2 preface.** A connection that does not send
//!   the 24 bytes every HTTP/2 client sends first within
//!   [`AdmissionLimits::preface_timeout`] (after its TLS handshake) is
//!   closed: finishing TLS and then saying nothing holds nothing.
//! - **Accept errors back off.** When `accept` fails (the file limit:
//!   EMFILE), the loop waits, doubling from 5 ms up to 1 s, instead of
//!   trying again at once; each failure is counted and the log gets one
//!   line per [`ACCEPT_ERROR_LOG_INTERVAL`] with how many it held back.
//!
//! Pure parts (the counts, the back-off) are plain structs tested here; the
//! accept loop in `server::incoming_with` uses them.

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;
use std::time::Instant;

/// The bytes every HTTP/2 connection starts with (RFC 9113, 3.4).
pub const HTTP2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// At most one log line about failing accepts per this long.
pub const ACCEPT_ERROR_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// The first and the longest wait after a failed accept.
const ACCEPT_BACKOFF_FIRST: Duration = Duration::from_millis(5);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// How many connections a server keeps, and how long a new one may stay
/// silent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Connections open at once, in every state (handshaking included).
    pub connections_max: usize,
    /// Connections open at once from one IP address.
    pub connections_per_peer_max: usize,
    /// Connections open at once on a TLS port whose caller presented no
    /// certificate proving an identity (bearer-token callers among them).
    /// Not applied to plain-text ports, where nobody has one.
    pub anonymous_connections_max: usize,
    /// Longest time from accepting a connection to its HTTP/2 preface
    /// (its TLS handshake has its own limit, `server::HANDSHAKE_TIMEOUT`).
    pub preface_timeout: Duration,
}

impl Default for AdmissionLimits {
    /// 4096 in all, 1024 per address (a benchmark's 256 clients from one
    /// machine fit), 1024 anonymous, 10 s to the preface; never more in all
    /// than three quarters of the process's file limit, so connections
    /// alone never exhaust it.
    fn default() -> Self {
        let files = open_files_limit().unwrap_or(4096);
        let connections_max = (files / 4 * 3).clamp(64, 4096);
        AdmissionLimits {
            connections_max,
            connections_per_peer_max: 1024.min(connections_max),
            anonymous_connections_max: 1024.min(connections_max / 2),
            preface_timeout: Duration::from_secs(10),
        }
    }
}

/// The soft limit on open files of this process (`RLIMIT_NOFILE`), read
/// from /proc (Linux); `None` elsewhere.
fn open_files_limit() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Why a connection was not admitted (the `reason` label of
/// `dtx_connections_refused_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    ConnectionsMax,
    PerPeerMax,
    AnonymousMax,
    NoPreface,
    NotHttp2,
}

impl Refusal {
    pub fn label(self) -> &'static str {
        match self {
            Refusal::ConnectionsMax => "connections_max",
            Refusal::PerPeerMax => "connections_per_peer_max",
            Refusal::AnonymousMax => "anonymous_connections_max",
            Refusal::NoPreface => "no_http2_preface",
            Refusal::NotHttp2 => "not_http2",
        }
    }
}

#[derive(Default, Debug)]
struct Counts {
    total: usize,
    anonymous: usize,
    per_peer: HashMap<IpAddr, usize>,
}

/// The connection counts of one server.
#[derive(Debug)]
pub struct Admission {
    limits: AdmissionLimits,
    counts: Mutex<Counts>,
}

/// One admitted connection's place in the counts, given back when dropped
/// (when the server drops the connection).
#[derive(Debug)]
pub struct Ticket {
    admission: Arc<Admission>,
    peer: IpAddr,
    anonymous: bool,
}

impl Admission {
    pub fn new(limits: AdmissionLimits) -> Arc<Admission> {
        Arc::new(Admission {
            limits,
            counts: Mutex::new(Counts::default()),
        })
    }

    pub fn limits(&self) -> AdmissionLimits {
        self.limits
    }

    /// A place for a new connection from `peer`, or why there is none.
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<Ticket, Refusal> {
        let mut c = self.counts.lock().expect("admission counts");
        if c.total >= self.limits.connections_max {
            return Err(Refusal::ConnectionsMax);
        }
        let from_peer = c.per_peer.get(&peer).copied().unwrap_or(0);
        if from_peer >= self.limits.connections_per_peer_max {
            return Err(Refusal::PerPeerMax);
        }
        c.total += 1;
        *c.per_peer.entry(peer).or_default() += 1;
        Ok(Ticket {
            admission: self.clone(),
            peer,
            anonymous: false,
        })
    }

    /// Counts `ticket`'s connection as anonymous (a TLS caller without an
    /// identity), or refuses it when there are too many already.
    pub fn count_anonymous(&self, ticket: &mut Ticket) -> Result<(), Refusal> {
        if ticket.anonymous {
            return Ok(());
        }
        let mut c = self.counts.lock().expect("admission counts");
        if c.anonymous >= self.limits.anonymous_connections_max {
            return Err(Refusal::AnonymousMax);
        }
        c.anonymous += 1;
        ticket.anonymous = true;
        Ok(())
    }

    /// Connections open now: (all, anonymous).
    pub fn open(&self) -> (usize, usize) {
        let c = self.counts.lock().expect("admission counts");
        (c.total, c.anonymous)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut c = self.admission.counts.lock().expect("admission counts");
        c.total -= 1;
        if self.anonymous {
            c.anonymous -= 1;
        }
        if let Some(n) = c.per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                c.per_peer.remove(&self.peer);
            }
        }
    }
}

/// The accept loop's answer to failing accepts: how long to wait, and
/// whether (and what) to log.
#[derive(Debug, Default)]
pub struct AcceptBackoff {
    next_wait: Option<Duration>,
    last_logged: Option<Instant>,
    held_back: u64,
}

impl AcceptBackoff {
    /// An accept succeeded: the next failure waits the shortest time again.
    pub fn accepted(&mut self) {
        self.next_wait = None;
    }

    /// An accept failed with `e` at `now`: how long to wait before the
    /// next, and the line to log, if one is due (with how many failures
    /// were not logged since the last line).
    pub fn failed(&mut self, e: &io::Error, now: Instant) -> (Duration, Option<String>) {
        let wait = self.next_wait.unwrap_or(ACCEPT_BACKOFF_FIRST);
        self.next_wait = Some((wait * 2).min(ACCEPT_BACKOFF_MAX));
        let due = self
            .last_logged
            .is_none_or(|at| now.duration_since(at) >= ACCEPT_ERROR_LOG_INTERVAL);
        if !due {
            self.held_back += 1;
            return (wait, None);
        }
        let line = if self.held_back == 0 {
            format!("accepting a connection failed: {e}; waiting {wait:?} before the next accept")
        } else {
            format!(
                "accepting a connection failed: {e}; waiting {wait:?} before the next accept \
                 ({} more failures since the last line)",
                self.held_back
            )
        };
        self.last_logged = Some(now);
        self.held_back = 0;
        (wait, Some(line))
    }
}

/// The `kind` label of `dtx_accept_errors_total` for an accept error.
pub fn accept_error_kind(e: &io::Error) -> &'static str {
    // EMFILE (24) and ENFILE (23): out of file descriptors.
    match e.raw_os_error() {
        Some(24) | Some(23) => "too_many_open_files",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(total: usize, per_peer: usize, anonymous: usize) -> AdmissionLimits {
        AdmissionLimits {
            connections_max: total,
            connections_per_peer_max: per_peer,
            anonymous_connections_max: anonymous,
            preface_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn inv12_connections_are_bounded_per_peer_and_in_all_and_given_back_when_dropped() {
        let a = Admission::new(limits(5, 3, 2));
        let (p, q, r): (IpAddr, IpAddr, IpAddr) = (
            "127.0.0.2".parse().unwrap(),
            "127.0.0.3".parse().unwrap(),
            "::1".parse().unwrap(),
        );
        let mut from_p: Vec<Ticket> = (0..3).map(|_| a.admit(p).unwrap()).collect();
        assert_eq!(a.admit(p).unwrap_err(), Refusal::PerPeerMax);
        let from_q: Vec<Ticket> = (0..2).map(|_| a.admit(q).unwrap()).collect();
        assert_eq!(a.admit(r).unwrap_err(), Refusal::ConnectionsMax, "5 in all");
        assert_eq!(a.open(), (5, 0));
        from_p.pop();
        assert_eq!(a.open(), (4, 0));
        let r1 = a.admit(r).expect("a place was given back");
        assert_eq!(a.admit(p).unwrap_err(), Refusal::ConnectionsMax);
        drop(from_q);
        drop(r1);
        // p is back under its own limit once places are free.
        let mut p3 = a.admit(p).unwrap();
        // Anonymous: at most 2, the third refused, its place given back.
        a.count_anonymous(&mut from_p[0]).unwrap();
        a.count_anonymous(&mut from_p[1]).unwrap();
        a.count_anonymous(&mut from_p[1]).unwrap();
        assert_eq!(a.open(), (3, 2), "counting one twice counts it once");
        assert_eq!(a.count_anonymous(&mut p3).unwrap_err(), Refusal::AnonymousMax);
        drop(p3);
        drop(from_p);
        assert_eq!(a.open(), (0, 0));
        assert!(
            a.counts.lock().unwrap().per_peer.is_empty(),
            "no address is kept once its last connection is gone"
        );
    }

    #[test]
    fn inv12_failed_accepts_back_off_and_log_once_per_interval() {
        let mut b = AcceptBackoff::default();
        let emfile = io::Error::from_raw_os_error(24);
        assert_eq!(accept_error_kind(&emfile), "too_many_open_files");
        assert_eq!(accept_error_kind(&io::Error::other("x")), "other");
        let t0 = Instant::now();
        let (w, line) = b.failed(&emfile, t0);
        assert_eq!(w, ACCEPT_BACKOFF_FIRST);
        assert!(line.unwrap().contains("waiting 5ms"));
        let mut waits = vec![w];
        for i in 1..20 {
            let (w, line) = b.failed(&emfile, t0 + Duration::from_millis(i));
            assert!(line.is_none(), "logged again {i} ms later");
            waits.push(w);
        }
        assert_eq!(waits[1], ACCEPT_BACKOFF_FIRST * 2);
        assert_eq!(*waits.last().unwrap(), ACCEPT_BACKOFF_MAX, "{waits:?}");
        assert!(waits.windows(2).all(|w| w[0] <= w[1]));
        let (_, line) = b.failed(&emfile, t0 + ACCEPT_ERROR_LOG_INTERVAL);
        assert!(line.unwrap().contains("(19 more failures since the last line)"));
        b.accepted();
        let (w, _) = b.failed(&emfile, t0 + ACCEPT_ERROR_LOG_INTERVAL * 3);
        assert_eq!(w, ACCEPT_BACKOFF_FIRST, "a success starts the waits over");
    }

    #[test]
    fn default_limits_leave_room_for_the_rest_of_the_process() {
        let l = AdmissionLimits::default();
        if let Some(files) = open_files_limit() {
            assert!(l.connections_max <= (files / 4 * 3).max(64), "{l:?} with {files} files");
        }
        assert!(l.connections_per_peer_max <= l.connections_max);
        assert!(l.anonymous_connections_max < l.connections_max, "{l:?}");
    }
}
