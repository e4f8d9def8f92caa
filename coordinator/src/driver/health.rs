//! How each participant address is doing, as the leader's deliveries see it.
//! Pure: time and randomness come in as arguments; the caller sleeps, calls
//! and logs.
//!
//! Every phase-two delivery to one address shares one `Peer` record. While a
//! participant answers, deliveries go straight through. Once a call fails
//! for a reason that is about the participant as a whole (no connection, no
//! answer in time, an internal error such as a full disk), the address is
//! *failing*: one call at a time (a probe) may go, no earlier than an
//! exponential backoff with jitter allows, and every other delivery to it
//! waits. A participant gone for good therefore costs one call per backoff
//! interval (at most `delivery_retry_max_ms`), not one per transaction, and
//! its failure is logged once per participant at most every `warn_every`,
//! not once per transaction (issue 8, defect 9). A refusal that is about one
//! transaction (the participant answered) never slows the others down
//! (invariant 11).

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

/// What a call to a participant showed about the participant as a whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seen {
    /// It answered (an ack, or a refusal of this one message).
    Answered,
    /// No answer, or it failed as a whole; the text says how.
    Failed(String),
}

/// May a delivery call this address now?
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Turn {
    /// Yes. `probe`: the address is failing and this call is the one probe
    /// allowed; report its result (or `release`) so the next may go.
    Go { probe: bool },
    /// Not before this long.
    Wait(Duration),
}

/// What the caller should log after a report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The address just started failing.
    StartedFailing { error: String, retry_in: Duration },
    /// Still failing (said at most once per `warn_every`).
    StillFailing {
        for_: Duration,
        failures: u32,
        error: String,
        retry_in: Duration,
    },
    /// It answers again.
    Recovered { after: Duration, failures: u32 },
}

#[derive(Clone, Debug)]
struct Peer {
    /// Failed probes in a row (0 = healthy).
    failures: u32,
    /// No call before this (while failing).
    retry_at: Instant,
    /// A probe is in flight.
    probing: bool,
    failing_since: Instant,
    last_warned: Instant,
    last_error: String,
}

/// The backoff settings and every address's record.
#[derive(Debug)]
pub struct Peers {
    base: Duration,
    max: Duration,
    warn_every: Duration,
    map: HashMap<String, Peer>,
}

impl Peers {
    pub fn new(base: Duration, max: Duration, warn_every: Duration) -> Self {
        Peers {
            base: base.max(Duration::from_millis(1)),
            max: max.max(base),
            warn_every,
            map: HashMap::new(),
        }
    }

    /// The backoff after `failures` failed probes, scaled by `jitter` (in
    /// 0.5..=1.0 for "equal jitter").
    pub fn backoff(&self, failures: u32, jitter: f64) -> Duration {
        let exp = self
            .base
            .saturating_mul(1u32 << failures.saturating_sub(1).min(20))
            .min(self.max);
        exp.mul_f64(jitter.clamp(0.0, 1.0))
    }

    pub fn turn(&mut self, addr: &str, now: Instant) -> Turn {
        let Some(p) = self.map.get_mut(addr) else {
            return Turn::Go { probe: false };
        };
        if p.failures == 0 {
            return Turn::Go { probe: false };
        }
        if p.probing {
            // Look again after the current backoff (not sooner: every
            // delivery to this address is waiting, possibly thousands).
            let failures = p.failures;
            return Turn::Wait(self.backoff(failures, 1.0));
        }
        if now >= p.retry_at {
            p.probing = true;
            return Turn::Go { probe: true };
        }
        Turn::Wait(p.retry_at - now)
    }

    /// Records what a call showed; `probe` as `turn` said. `jitter` in
    /// 0.5..=1.0 spreads the next retry.
    pub fn report(&mut self, addr: &str, probe: bool, seen: Seen, now: Instant, jitter: f64) -> Option<Event> {
        match seen {
            Seen::Answered => {
                let p = self.map.remove(addr)?;
                (p.failures > 0).then(|| Event::Recovered {
                    after: now.saturating_duration_since(p.failing_since),
                    failures: p.failures,
                })
            }
            Seen::Failed(error) => {
                let warn_every = self.warn_every;
                let failures = match self.map.get(addr) {
                    // A call sent while the address still looked healthy
                    // failing after it was marked failing is the same
                    // outage: it does not lengthen the backoff.
                    Some(p) if !probe && p.failures > 0 => p.failures,
                    Some(p) => p.failures.saturating_add(1),
                    None => 1,
                };
                let retry_in = self.backoff(failures, jitter);
                let p = self.map.entry(addr.to_string()).or_insert_with(|| Peer {
                    failures: 0,
                    retry_at: now,
                    probing: false,
                    failing_since: now,
                    last_warned: now,
                    last_error: String::new(),
                });
                let started = p.failures == 0;
                if probe || started {
                    p.retry_at = now + retry_in;
                }
                if probe {
                    p.probing = false;
                }
                p.failures = failures;
                p.last_error = error.clone();
                if started {
                    p.failing_since = now;
                    p.last_warned = now;
                    return Some(Event::StartedFailing { error, retry_in });
                }
                if now.saturating_duration_since(p.last_warned) >= warn_every {
                    p.last_warned = now;
                    return Some(Event::StillFailing {
                        for_: now.saturating_duration_since(p.failing_since),
                        failures,
                        error,
                        retry_in: p.retry_at.saturating_duration_since(now),
                    });
                }
                None
            }
        }
    }

    /// A probe ended without a result (its task was cancelled or the
    /// leader stepped down): let the next one go.
    pub fn release(&mut self, addr: &str) {
        if let Some(p) = self.map.get_mut(addr) {
            p.probing = false;
        }
    }

    /// How many addresses are failing now.
    pub fn failing(&self) -> usize {
        self.map.values().filter(|p| p.failures > 0).count()
    }

    /// The last error of a failing address.
    pub fn last_error(&self, addr: &str) -> Option<&str> {
        self.map.get(addr).map(|p| p.last_error.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn peers() -> Peers {
        Peers::new(ms(50), ms(2_000), Duration::from_secs(30))
    }

    #[test]
    fn healthy_addresses_go_straight_through() {
        let mut p = peers();
        let now = Instant::now();
        assert_eq!(p.turn("a", now), Turn::Go { probe: false });
        assert_eq!(p.report("a", false, Seen::Answered, now, 1.0), None);
        assert_eq!(p.failing(), 0);
    }

    /// Defect 9 / invariant 11: a failing address admits one probe at a
    /// time, after a backoff that doubles per failed probe up to the max;
    /// the failure is announced once, then at most every `warn_every`.
    #[test]
    fn a_failing_address_admits_one_probe_per_backoff_and_logs_once() {
        let mut p = peers();
        let t0 = Instant::now();
        // Many deliveries sent while it looked healthy all fail: one event,
        // one failure counted.
        let first = p.report("a", false, Seen::Failed("refused".into()), t0, 1.0);
        assert_eq!(
            first,
            Some(Event::StartedFailing {
                error: "refused".into(),
                retry_in: ms(50)
            })
        );
        for _ in 0..100 {
            assert_eq!(p.report("a", false, Seen::Failed("refused".into()), t0, 1.0), None);
        }
        assert_eq!(p.failing(), 1);
        assert_eq!(p.turn("a", t0), Turn::Wait(ms(50)));
        assert_eq!(p.turn("b", t0), Turn::Go { probe: false }, "other addresses unaffected");
        // At retry time exactly one probe goes; the rest wait.
        let t1 = t0 + ms(50);
        assert_eq!(p.turn("a", t1), Turn::Go { probe: true });
        assert_eq!(p.turn("a", t1), Turn::Wait(ms(50)), "one probe at a time");
        // Each failed probe doubles the backoff, capped at 2 s.
        let mut now = t1;
        let mut waits = Vec::new();
        for _ in 0..8 {
            assert_eq!(p.report("a", true, Seen::Failed("refused".into()), now, 1.0), None);
            match p.turn("a", now) {
                Turn::Wait(w) => {
                    waits.push(w.as_millis() as u64);
                    now += w;
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(p.turn("a", now), Turn::Go { probe: true });
        }
        assert_eq!(waits, vec![100, 200, 400, 800, 1600, 2000, 2000, 2000]);
        // 30 s later a reminder, with how long it has been failing.
        let later = t0 + Duration::from_secs(31);
        match p.report("a", true, Seen::Failed("still".into()), later, 1.0) {
            Some(Event::StillFailing { for_, error, .. }) => {
                assert_eq!(for_, Duration::from_secs(31));
                assert_eq!(error, "still");
            }
            other => panic!("{other:?}"),
        }
        // It answers: recovered, healthy again.
        assert_eq!(p.turn("a", later + ms(2_000)), Turn::Go { probe: true });
        match p.report("a", true, Seen::Answered, later + ms(2_000), 1.0) {
            Some(Event::Recovered { failures, .. }) => assert_eq!(failures, 10),
            other => panic!("{other:?}"),
        }
        assert_eq!(p.turn("a", later), Turn::Go { probe: false });
        assert_eq!(p.failing(), 0);
    }

    #[test]
    fn a_released_probe_lets_the_next_one_go() {
        let mut p = peers();
        let t0 = Instant::now();
        p.report("a", false, Seen::Failed("x".into()), t0, 1.0);
        let t1 = t0 + ms(60);
        assert_eq!(p.turn("a", t1), Turn::Go { probe: true });
        p.release("a");
        assert_eq!(p.turn("a", t1), Turn::Go { probe: true });
    }

    #[test]
    fn jitter_spreads_the_backoff_within_half_to_full() {
        let p = peers();
        assert_eq!(p.backoff(3, 0.5), ms(100));
        assert_eq!(p.backoff(3, 1.0), ms(200));
        assert_eq!(p.backoff(40, 1.0), ms(2_000), "capped");
    }
}
