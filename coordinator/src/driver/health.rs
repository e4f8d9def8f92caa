//! How each participant address is doing, as the leader's deliveries see it,
//! and who may call it next. Pure: time and randomness come in as
//! arguments; the caller sleeps, calls, wakes waiters and logs.
//!
//! Every phase-two delivery to one address shares one `Peer` record:
//! - **In flight.** At most `inflight_max` calls to one address at a time;
//!   the rest park until a call ends. A new leader may start thousands of
//!   deliveries at once; they go out at the rate the participant answers.
//! - **Failing.** Once a call fails for a reason that is about the
//!   participant as a whole (no connection, no answer in time, an internal
//!   error such as a full disk), the address is *failing*: one delivery
//!   holds the probe turn and calls again after an exponential backoff with
//!   jitter; every other delivery to it parks, costing nothing, until the
//!   probe gets an answer (then all go) or the probe's holder ends without
//!   one (then the turn passes on). A participant gone for good therefore
//!   costs one call per backoff (at most `delivery_retry_max_ms`) however
//!   many transactions wait for it, and its failure is logged once per
//!   participant at most every `warn_every`. A refusal
//!   (the participant answered) is about one transaction and never slows
//!   the others down (invariant 11).

use std::collections::HashMap;
use std::time::Duration;

use dtx_common::backoff::Backoff;
use dtx_common::backoff::Jitter;
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
    /// Yes: the call is counted in flight; report it (or `abandon` it).
    /// `probe`: the address is failing and this is its probe; the caller
    /// holds the probe turn until it reports an answer or `release`s it.
    Go { probe: bool },
    /// The caller holds the probe turn: ask again after this long.
    Hold(Duration),
    /// Wait until woken (a call ended, the probe turn is free, or the
    /// address answers again), then ask again.
    Park,
}

/// Whom to wake after a change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    Nobody,
    /// One parked delivery (a slot or the probe turn is free).
    One,
    /// Every parked delivery (the address answers again).
    All,
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
    /// Calls in flight.
    inflight: u32,
    /// Failed probes in a row (0 = healthy).
    failures: u32,
    /// No probe before this (while failing).
    retry_at: Instant,
    /// Some delivery holds the probe turn.
    turn_taken: bool,
    failing_since: Instant,
    last_warned: Instant,
    last_error: String,
}

impl Peer {
    fn new(now: Instant) -> Peer {
        Peer {
            inflight: 0,
            failures: 0,
            retry_at: now,
            turn_taken: false,
            failing_since: now,
            last_warned: now,
            last_error: String::new(),
        }
    }
}

/// The settings and every address's record.
#[derive(Debug)]
pub struct Peers {
    base: Duration,
    max: Duration,
    warn_every: Duration,
    inflight_max: u32,
    map: HashMap<String, Peer>,
}

impl Peers {
    pub fn new(base: Duration, max: Duration, warn_every: Duration, inflight_max: u32) -> Self {
        Peers {
            base: base.max(Duration::from_millis(1)),
            max: max.max(base),
            warn_every,
            inflight_max: inflight_max.max(1),
            map: HashMap::new(),
        }
    }

    /// The backoff after `failures` failed probes for the uniform draw `u`
    /// in 0..=1 (equal jitter: from half the step to the whole step).
    pub fn backoff(&self, failures: u32, u: f64) -> Duration {
        backoff(self.base, self.max, failures, u)
    }

    /// `holder`: the caller holds this address's probe turn (it was given
    /// `Go { probe: true }` or `Hold` and has not released it).
    pub fn turn(&mut self, addr: &str, now: Instant, holder: bool) -> Turn {
        let inflight_max = self.inflight_max;
        let p = self.map.entry(addr.to_string()).or_insert_with(|| Peer::new(now));
        if p.failures == 0 {
            if p.inflight < inflight_max {
                p.inflight += 1;
                return Turn::Go { probe: false };
            }
            return Turn::Park;
        }
        if !holder && p.turn_taken {
            return Turn::Park;
        }
        p.turn_taken = true;
        if now >= p.retry_at {
            p.inflight += 1;
            return Turn::Go { probe: true };
        }
        Turn::Hold(p.retry_at - now)
    }

    /// Records what a call (given `Go { probe }`) showed. `u`, a uniform
    /// draw in 0..=1, spreads the next probe (equal jitter, see `backoff`).
    pub fn report(&mut self, addr: &str, probe: bool, seen: Seen, now: Instant, u: f64) -> (Option<Event>, Wake) {
        let warn_every = self.warn_every;
        let Some(p) = self.map.get_mut(addr) else {
            return (None, Wake::Nobody);
        };
        p.inflight = p.inflight.saturating_sub(1);
        match seen {
            Seen::Answered => {
                let event = (p.failures > 0).then(|| Event::Recovered {
                    after: now.saturating_duration_since(p.failing_since),
                    failures: p.failures,
                });
                p.failures = 0;
                p.turn_taken = false;
                if p.inflight == 0 {
                    self.map.remove(addr);
                }
                let wake = if event.is_some() { Wake::All } else { Wake::One };
                (event, wake)
            }
            Seen::Failed(error) => {
                // A call sent while the address still looked healthy that
                // fails after it was marked failing is the same outage: it
                // does not lengthen the backoff.
                let failures = if !probe && p.failures > 0 {
                    p.failures
                } else {
                    p.failures.saturating_add(1)
                };
                let retry_in = backoff(self.base, self.max, failures, u);
                let started = p.failures == 0;
                if probe || started {
                    p.retry_at = now + retry_in;
                }
                p.failures = failures;
                p.last_error = error.clone();
                if started {
                    p.failing_since = now;
                    p.last_warned = now;
                    // Someone must take the probe turn.
                    return (Some(Event::StartedFailing { error, retry_in }), Wake::One);
                }
                if now.saturating_duration_since(p.last_warned) >= warn_every {
                    p.last_warned = now;
                    let event = Event::StillFailing {
                        for_: now.saturating_duration_since(p.failing_since),
                        failures,
                        error,
                        retry_in: p.retry_at.saturating_duration_since(now),
                    };
                    return (Some(event), Wake::Nobody);
                }
                (None, Wake::Nobody)
            }
        }
    }

    /// A call given `Go` ended without a result (its task was cancelled):
    /// its slot, and the probe turn if it was a probe, are free.
    pub fn abandon(&mut self, addr: &str, probe: bool) -> Wake {
        let Some(p) = self.map.get_mut(addr) else {
            return Wake::Nobody;
        };
        p.inflight = p.inflight.saturating_sub(1);
        if probe {
            p.turn_taken = false;
        }
        Wake::One
    }

    /// The holder of the probe turn ends (its transaction was acked, the
    /// leader stepped down): the turn passes on.
    pub fn release(&mut self, addr: &str) -> Wake {
        match self.map.get_mut(addr) {
            Some(p) if p.turn_taken => {
                p.turn_taken = false;
                Wake::One
            }
            _ => Wake::Nobody,
        }
    }

    /// How many addresses are failing now.
    pub fn failing(&self) -> usize {
        self.map.values().filter(|p| p.failures > 0).count()
    }
}

/// What keeps going to a participant address for one transaction, as the
/// give-up rule sees it (ADR 0041).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retried {
    /// Delivering a recorded ABORT.
    AbortDelivery,
    /// Delivering a recorded COMMIT.
    CommitDelivery,
    /// Re-sending the one-phase commit of an undecided transaction.
    OnePhaseCommit,
}

/// Whether the leader stops calling an address for one transaction: only
/// when `bound` is set (not zero), the address has never answered any call
/// from this node process (`answered_once` false), the work is not a
/// COMMIT delivery, and it has been tried for `bound` already.
///
/// - A COMMIT is never given up: every participant of a recorded COMMIT
///   voted YES (or, one-phase, committed and answered), to this leader or
///   an earlier one, and must end committed (invariant 4). That this
///   leader never heard from it says nothing about what it told another.
/// - An ABORT may be: not delivering it decides nothing and sends nothing
///   (invariants 1 to 5 hold); a participant that holds a YES vote keeps
///   its locks and learns the ABORT by asking (its SDK asks on start and
///   periodically), and the record stays, unacked, for an operator.
/// - A one-phase commit may be: not re-sending it decides nothing (the
///   transaction stays PREPARING; only its participant's answer or an
///   operator decides it).
pub fn gives_up(what: Retried, answered_once: bool, trying_for: Duration, bound: Duration) -> bool {
    if bound.is_zero() || answered_once {
        return false;
    }
    match what {
        Retried::CommitDelivery => false,
        Retried::AbortDelivery | Retried::OnePhaseCommit => trying_for >= bound,
    }
}

/// Phase two's backoff after `failures` failures (from 1): the project's one
/// backoff formula, `dtx_common::backoff::Backoff`, with equal jitter:
/// `base * 2^(failures - 1)` (at least 1 ms), at most `max`, times
/// `0.5 + u / 2` for the uniform draw `u` in 0..=1.
pub(crate) fn backoff(base: Duration, max: Duration, failures: u32, u: f64) -> Duration {
    Backoff::new(base, max, Jitter::Equal).delay(failures.saturating_sub(1), u)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    fn peers() -> Peers {
        Peers::new(ms(50), ms(2_000), Duration::from_secs(30), 4)
    }

    #[test]
    fn healthy_addresses_go_straight_through_up_to_the_in_flight_limit() {
        let mut p = peers();
        let now = Instant::now();
        for _ in 0..4 {
            assert_eq!(p.turn("a", now, false), Turn::Go { probe: false });
        }
        assert_eq!(p.turn("a", now, false), Turn::Park, "the fifth call waits");
        assert_eq!(p.turn("b", now, false), Turn::Go { probe: false }, "per address");
        assert_eq!(p.report("a", false, Seen::Answered, now, 1.0), (None, Wake::One));
        assert_eq!(p.turn("a", now, false), Turn::Go { probe: false });
        assert_eq!(p.failing(), 0);
    }

    /// Invariant 11: a failing address has one probe turn; its
    /// holder calls after a backoff that doubles per failed probe up to the
    /// max, everyone else parks; the failure is announced once, then at
    /// most every `warn_every`; an answer wakes everyone.
    #[test]
    fn a_failing_address_has_one_probe_turn_with_backoff_and_logs_once() {
        let mut p = peers();
        let t0 = Instant::now();
        for _ in 0..4 {
            assert_eq!(p.turn("a", t0, false), Turn::Go { probe: false });
        }
        // All four fail: one event, one failure counted, one waiter woken
        // to take the probe turn.
        let (first, wake) = p.report("a", false, Seen::Failed("refused".into()), t0, 1.0);
        assert_eq!(
            first,
            Some(Event::StartedFailing {
                error: "refused".into(),
                retry_in: ms(50)
            })
        );
        assert_eq!(wake, Wake::One);
        for _ in 0..3 {
            assert_eq!(
                p.report("a", false, Seen::Failed("refused".into()), t0, 1.0),
                (None, Wake::Nobody)
            );
        }
        assert_eq!(p.failing(), 1);
        // The first to ask takes the turn and holds it until the retry
        // time; everyone else parks.
        assert_eq!(p.turn("a", t0, false), Turn::Hold(ms(50)));
        assert_eq!(p.turn("a", t0, false), Turn::Park);
        assert_eq!(
            p.turn("b", t0, false),
            Turn::Go { probe: false },
            "other addresses unaffected"
        );
        let t1 = t0 + ms(50);
        assert_eq!(p.turn("a", t1, false), Turn::Park, "not the holder");
        assert_eq!(p.turn("a", t1, true), Turn::Go { probe: true });
        // Each failed probe doubles the backoff, capped at 2 s; the holder
        // keeps the turn.
        let mut now = t1;
        let mut waits = Vec::new();
        for _ in 0..8 {
            assert_eq!(
                p.report("a", true, Seen::Failed("refused".into()), now, 1.0).1,
                Wake::Nobody
            );
            match p.turn("a", now, true) {
                Turn::Hold(w) => {
                    waits.push(w.as_millis() as u64);
                    now += w;
                }
                other => panic!("{other:?}"),
            }
            assert_eq!(p.turn("a", now, false), Turn::Park);
            assert_eq!(p.turn("a", now, true), Turn::Go { probe: true });
        }
        assert_eq!(waits, vec![100, 200, 400, 800, 1600, 2000, 2000, 2000]);
        // 30 s after it started: a reminder, with how long it has failed.
        let later = t0 + Duration::from_secs(31);
        match p.report("a", true, Seen::Failed("still".into()), later, 1.0).0 {
            Some(Event::StillFailing { for_, error, .. }) => {
                assert_eq!(for_, Duration::from_secs(31));
                assert_eq!(error, "still");
            }
            other => panic!("{other:?}"),
        }
        // It answers: recovered, everyone woken, healthy again.
        let back = later + ms(2_000);
        assert_eq!(p.turn("a", back, true), Turn::Go { probe: true });
        match p.report("a", true, Seen::Answered, back, 1.0) {
            (Some(Event::Recovered { failures, .. }), Wake::All) => assert_eq!(failures, 10),
            other => panic!("{other:?}"),
        }
        assert_eq!(p.turn("a", back, false), Turn::Go { probe: false });
        assert_eq!(p.failing(), 0);
    }

    #[test]
    fn the_probe_turn_passes_on_when_its_holder_ends() {
        let mut p = peers();
        let t0 = Instant::now();
        assert_eq!(p.turn("a", t0, false), Turn::Go { probe: false });
        p.report("a", false, Seen::Failed("x".into()), t0, 1.0);
        assert_eq!(p.turn("a", t0, false), Turn::Hold(ms(50)));
        assert_eq!(p.turn("a", t0, false), Turn::Park);
        // The holder's transaction was acked elsewhere: the turn is free.
        assert_eq!(p.release("a"), Wake::One);
        assert_eq!(p.turn("a", t0 + ms(60), false), Turn::Go { probe: true });
        // A probe cancelled mid-call frees its slot and the turn.
        assert_eq!(p.abandon("a", true), Wake::One);
        assert_eq!(p.turn("a", t0 + ms(60), false), Turn::Go { probe: true });
        // Releasing without holding wakes nobody.
        let mut q = peers();
        assert_eq!(q.release("a"), Wake::Nobody);
    }

    /// ADR 0041: only an address that never answered this node is
    /// given up, only after the bound, never for a COMMIT, and never with
    /// the bound at 0.
    #[test]
    fn only_never_answered_addresses_are_given_up_and_never_a_commit() {
        let bound = ms(600_000);
        for what in [Retried::AbortDelivery, Retried::OnePhaseCommit] {
            assert!(!gives_up(what, false, ms(599_999), bound), "{what:?} before the bound");
            assert!(gives_up(what, false, bound, bound), "{what:?} at the bound");
            assert!(gives_up(what, false, ms(10_000_000), bound), "{what:?} past the bound");
            assert!(
                !gives_up(what, true, ms(10_000_000), bound),
                "{what:?}: it answered once"
            );
            assert!(
                !gives_up(what, false, ms(10_000_000), Duration::ZERO),
                "{what:?}: 0 = never"
            );
        }
        for (answered, tried) in [(false, ms(10_000_000)), (true, ms(10_000_000)), (false, bound)] {
            assert!(
                !gives_up(Retried::CommitDelivery, answered, tried, bound),
                "a COMMIT is never given up"
            );
        }
    }

    #[test]
    fn jitter_spreads_the_backoff_within_half_to_full() {
        let p = peers();
        assert_eq!(p.backoff(3, 0.0), ms(100));
        assert_eq!(p.backoff(3, 0.5), ms(150));
        assert_eq!(p.backoff(3, 1.0), ms(200));
        assert_eq!(p.backoff(40, 1.0), ms(2_000), "capped");
    }
}
