//! The one retry-delay formula: exponential backoff with a cap and jitter.
//!
//! [`Backoff::delay`] is pure (the random draw comes in as an argument), so
//! its bounds are unit-tested; [`Backoff::sample`] draws it. Every retry
//! loop uses it: the `dtx_client::Client`'s calls (and through them
//! self-enlistment and the participant SDK's decision reads) and the
//! coordinator's phase-two delivery.
//!
//! Attempts count from 0: the delay before the first retry is at most
//! `base`, and each further attempt doubles that ceiling up to `max`.
//!
//! ```
//! use std::time::Duration;
//! use dtx_common::backoff::{Backoff, Jitter};
//!
//! let b = Backoff::new(Duration::from_millis(20), Duration::from_millis(500), Jitter::Full);
//! assert_eq!(b.ceiling(0), Duration::from_millis(20));
//! assert_eq!(b.ceiling(3), Duration::from_millis(160));
//! assert_eq!(b.ceiling(1_000_000), Duration::from_millis(500));
//! // Full jitter: anywhere from zero to the ceiling.
//! assert_eq!(b.delay(3, 0.0), Duration::ZERO);
//! assert_eq!(b.delay(3, 1.0), Duration::from_millis(160));
//! assert!(b.sample(3) <= Duration::from_millis(160));
//! ```

use std::time::Duration;

use rand::Rng;

/// How much of the ceiling a delay keeps, given a uniform draw `u` in
/// `0.0..=1.0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Jitter {
    /// Exactly the ceiling (`u` is ignored).
    None,
    /// From zero to the ceiling (`ceiling * u`): callers that retry at the
    /// same time spread out the most. The client's choice.
    Full,
    /// From half the ceiling to the ceiling (`ceiling * (0.5 + u / 2)`):
    /// never much shorter than the exponential step. The coordinator's
    /// phase-two delivery uses this shape.
    Equal,
}

/// Exponential backoff: the ceiling of attempt `n` (from 0) is
/// `base * 2^n`, at most `max` and at least 1 ms; the delay is that
/// ceiling scaled by the [`Jitter`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// Ceiling of the first retry's delay (attempt 0).
    pub base: Duration,
    /// Largest ceiling, whatever the attempt number.
    pub max: Duration,
    /// Where in `0..=ceiling` a delay falls.
    pub jitter: Jitter,
}

/// No delay is shorter than this ceiling, so a zero `base` or `max` never
/// turns a retry loop into a busy loop.
const FLOOR: Duration = Duration::from_millis(1);

impl Backoff {
    /// A backoff from `base` doubling up to `max`, with `jitter`.
    pub const fn new(base: Duration, max: Duration, jitter: Jitter) -> Self {
        Backoff { base, max, jitter }
    }

    /// The largest delay of attempt `attempt` (from 0): `base * 2^attempt`,
    /// at most `max`, at least 1 ms. Never overflows, whatever the attempt
    /// number or durations.
    pub fn ceiling(&self, attempt: u32) -> Duration {
        // In u128 nanoseconds: Duration::MAX is below 2^94 ns, and the
        // multiplication saturates, so nothing here can overflow or panic.
        let exp = self.base.as_nanos().saturating_mul(1u128 << attempt.min(127));
        let capped = exp.min(self.max.as_nanos());
        from_nanos(capped).max(FLOOR)
    }

    /// The delay before retry `attempt` (from 0) for a uniform draw `u` in
    /// `0.0..=1.0` (clamped; NaN counts as 1.0). Pure: the same arguments
    /// give the same delay. Always within
    /// [`delay_range`](Backoff::delay_range).
    pub fn delay(&self, attempt: u32, u: f64) -> Duration {
        let ceiling = self.ceiling(attempt);
        let u = if u.is_nan() { 1.0 } else { u.clamp(0.0, 1.0) };
        let scale = match self.jitter {
            Jitter::None => 1.0,
            Jitter::Full => u,
            Jitter::Equal => 0.5 + u / 2.0,
        };
        let (lo, hi) = self.delay_range(attempt);
        // `as` saturates; the clamp keeps float rounding inside the range.
        let ns = (ceiling.as_nanos() as f64 * scale) as u128;
        from_nanos(ns).clamp(lo, hi)
    }

    /// The shortest and longest delay of retry `attempt`.
    pub fn delay_range(&self, attempt: u32) -> (Duration, Duration) {
        let ceiling = self.ceiling(attempt);
        match self.jitter {
            Jitter::None => (ceiling, ceiling),
            Jitter::Full => (Duration::ZERO, ceiling),
            Jitter::Equal => (ceiling / 2, ceiling),
        }
    }

    /// [`delay`](Backoff::delay) with a fresh random draw.
    pub fn sample(&self, attempt: u32) -> Duration {
        let u: f64 = rand::rng().random_range(0.0..=1.0);
        self.delay(attempt, u)
    }
}

/// `ns` nanoseconds as a Duration, saturating at `Duration::MAX`.
fn from_nanos(ns: u128) -> Duration {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    match u64::try_from(ns / NANOS_PER_SEC) {
        Ok(secs) => Duration::new(secs, (ns % NANOS_PER_SEC) as u32),
        Err(_) => Duration::MAX,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    const JITTERS: [Jitter; 3] = [Jitter::None, Jitter::Full, Jitter::Equal];

    #[test]
    fn ceiling_doubles_from_base_and_stops_at_max() {
        let b = Backoff::new(ms(20), ms(500), Jitter::Full);
        let got: Vec<Duration> = (0..7).map(|a| b.ceiling(a)).collect();
        assert_eq!(got, [ms(20), ms(40), ms(80), ms(160), ms(320), ms(500), ms(500)]);
    }

    #[test]
    fn ceiling_never_decreases_and_never_passes_max() {
        for (base, max) in [(ms(1), ms(1)), (ms(3), ms(10_000)), (Duration::from_nanos(1), ms(7))] {
            let b = Backoff::new(base, max, Jitter::None);
            let mut prev = Duration::ZERO;
            for a in 0..200 {
                let c = b.ceiling(a);
                assert!(c >= prev, "{base:?}..{max:?}: attempt {a} went down");
                assert!(c <= max.max(FLOOR), "{base:?}..{max:?}: attempt {a} above max");
                prev = c;
            }
            assert_eq!(prev, max.max(FLOOR), "{base:?}..{max:?} reaches max");
        }
    }

    #[test]
    fn huge_attempt_numbers_and_durations_do_not_overflow() {
        let edge = [
            Duration::ZERO,
            Duration::from_nanos(1),
            ms(1),
            Duration::from_secs(u64::MAX / 2),
            Duration::MAX,
        ];
        for base in edge {
            for max in edge {
                for jitter in JITTERS {
                    let b = Backoff::new(base, max, jitter);
                    for a in [0, 1, 31, 32, 63, 64, 127, 128, 1_000, u32::MAX - 1, u32::MAX] {
                        let c = b.ceiling(a);
                        assert!(c >= FLOOR && c <= max.max(FLOOR), "{b:?} attempt {a}: {c:?}");
                        for u in [0.0, 0.5, 1.0] {
                            let d = b.delay(a, u);
                            let (lo, hi) = b.delay_range(a);
                            assert!(lo <= d && d <= hi, "{b:?} attempt {a} u {u}: {d:?}");
                        }
                    }
                }
            }
        }
        assert_eq!(
            Backoff::new(ms(1), Duration::MAX, Jitter::None).ceiling(u32::MAX),
            Duration::MAX
        );
    }

    #[test]
    fn zero_base_or_max_still_waits_a_millisecond() {
        assert_eq!(Backoff::new(Duration::ZERO, ms(500), Jitter::None).ceiling(10), FLOOR);
        assert_eq!(Backoff::new(ms(20), Duration::ZERO, Jitter::None).ceiling(0), FLOOR);
    }

    #[test]
    fn jitter_ranges() {
        let full = Backoff::new(ms(50), ms(2_000), Jitter::Full);
        assert_eq!(full.delay(2, 0.0), Duration::ZERO);
        assert_eq!(full.delay(2, 0.25), ms(50));
        assert_eq!(full.delay(2, 1.0), ms(200));
        assert_eq!(full.delay_range(2), (Duration::ZERO, ms(200)));

        // The coordinator's phase-two shape: half to full of the ceiling.
        let equal = Backoff::new(ms(50), ms(2_000), Jitter::Equal);
        assert_eq!(equal.delay(2, 0.0), ms(100));
        assert_eq!(equal.delay(2, 1.0), ms(200));
        assert_eq!(equal.delay(39, 1.0), ms(2_000), "capped");
        assert_eq!(equal.delay_range(2), (ms(100), ms(200)));

        let none = Backoff::new(ms(50), ms(2_000), Jitter::None);
        assert_eq!(none.delay(2, 0.0), ms(200));
        assert_eq!(none.delay(2, 1.0), ms(200));
    }

    #[test]
    fn draws_outside_the_unit_interval_are_clamped() {
        let b = Backoff::new(ms(50), ms(2_000), Jitter::Full);
        assert_eq!(b.delay(2, -3.0), Duration::ZERO);
        assert_eq!(b.delay(2, 7.0), ms(200));
        assert_eq!(b.delay(2, f64::NAN), ms(200));
        assert_eq!(b.delay(2, f64::INFINITY), ms(200));
        assert_eq!(b.delay(2, f64::NEG_INFINITY), Duration::ZERO);
    }

    #[test]
    fn samples_stay_in_range_and_spread() {
        for jitter in JITTERS {
            let b = Backoff::new(ms(10), ms(80), jitter);
            for a in [0, 2, 5, 50] {
                let (lo, hi) = b.delay_range(a);
                let draws: Vec<Duration> = (0..200).map(|_| b.sample(a)).collect();
                assert!(draws.iter().all(|d| lo <= *d && *d <= hi), "{jitter:?} attempt {a}");
                if jitter != Jitter::None {
                    let distinct: std::collections::HashSet<_> = draws.iter().collect();
                    assert!(distinct.len() > 10, "{jitter:?} attempt {a}: hardly any jitter");
                }
            }
        }
    }

    #[test]
    fn delay_is_monotonic_in_the_draw() {
        for jitter in JITTERS {
            let b = Backoff::new(ms(7), ms(900), jitter);
            let mut prev = Duration::ZERO;
            for i in 0..=100 {
                let d = b.delay(4, i as f64 / 100.0);
                assert!(d >= prev, "{jitter:?} at {i}");
                prev = d;
            }
        }
    }
}
