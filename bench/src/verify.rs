//! The bench's correctness checks, as pure functions over what the bench
//! recorded and what it read back, so they are unit-tested without a
//! cluster:
//!
//! - no lost operation: every put-if-absent etcd acknowledged is there with
//!   the value and creation revision it was acknowledged with
//!   ([`readback_puts`]); every Decide we acknowledged is read back with
//!   that decision ([`readback_decisions`]);
//! - nothing accepted twice: a put-if-absent re-issued on a key already
//!   written is refused ([`reissued_puts`]); a conflicting Decide on a
//!   decided transaction returns the first decision ([`conflicting_decides`]).
//!
//! An operation whose outcome is UNKNOWN (a timeout, a lost reply) is never
//! a violation and never a success: it is counted apart.

use std::collections::HashMap;

use dtx_client::DecisionRead;
use dtx_client::TxOutcome;

use crate::etcd::Seen;

/// Violations kept word for word in a [`Check`]; the rest are only
/// counted.
pub const VIOLATIONS_KEPT: usize = 10;

/// The result of one check.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Check {
    /// What was checked, in words.
    pub name: String,
    /// Operations looked at.
    pub checked: u64,
    /// Of those, how many were as they must be.
    pub ok: u64,
    /// Of those, how many had an UNKNOWN outcome (neither ok nor a
    /// violation).
    pub unknown: u64,
    /// How many broke the rule.
    pub violations: u64,
    /// The first [`VIOLATIONS_KEPT`] violations, described.
    pub examples: Vec<String>,
}

impl Check {
    fn new(name: &str) -> Check {
        Check {
            name: name.to_string(),
            ..Check::default()
        }
    }

    fn pass(&mut self) {
        self.checked += 1;
        self.ok += 1;
    }

    fn unknown(&mut self) {
        self.checked += 1;
        self.unknown += 1;
    }

    fn fail(&mut self, what: String) {
        self.checked += 1;
        self.violations += 1;
        if self.examples.len() < VIOLATIONS_KEPT {
            self.examples.push(what);
        }
    }

    pub fn passed(&self) -> bool {
        self.violations == 0
    }

    /// One line: the name, the counts, and the first violations.
    pub fn summary(&self) -> String {
        let verdict = if self.passed() { "ok" } else { "FAILED" };
        let mut s = format!(
            "{verdict}: {}: {} checked, {} as required, {} UNKNOWN, {} violations",
            self.name, self.checked, self.ok, self.unknown, self.violations
        );
        if !self.examples.is_empty() {
            s.push_str(&format!(" (first: {})", self.examples.join("; ")));
        }
        s
    }
}

/// A put-if-absent etcd acknowledged: `key` was written with `value` at
/// `revision`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AckedPut {
    pub key: Vec<u8>,
    pub value: Vec<u8>,
    pub revision: i64,
}

/// Every acknowledged put must be read back unchanged: present, created at
/// the revision it was acknowledged with, never modified since, with its
/// value.
pub fn readback_puts(acked: &[AckedPut], read: &HashMap<Vec<u8>, Seen>) -> Check {
    let mut c = Check::new("etcd: every acknowledged put-if-absent read back");
    for a in acked {
        let key = String::from_utf8_lossy(&a.key);
        match read.get(&a.key) {
            None => c.fail(format!("{key} acknowledged at revision {} is missing", a.revision)),
            Some(s) if s.create_revision != a.revision => c.fail(format!(
                "{key} acknowledged at revision {} reads back created at {}",
                a.revision, s.create_revision
            )),
            Some(s) if s.mod_revision != s.create_revision => c.fail(format!(
                "{key} was modified after it was written (revision {} -> {})",
                s.create_revision, s.mod_revision
            )),
            Some(s) if s.value != a.value => c.fail(format!("{key} reads back another value")),
            Some(_) => c.pass(),
        }
    }
    c
}

/// What a re-issued put-if-absent on a key already written returned:
/// `Some(true)` accepted, `Some(false)` refused, `None` UNKNOWN.
pub fn reissued_puts(results: &[(Vec<u8>, Option<bool>)]) -> Check {
    let mut c = Check::new("etcd: a put-if-absent re-issued on a written key is refused");
    for (key, r) in results {
        match r {
            Some(false) => c.pass(),
            Some(true) => c.fail(format!("{} was accepted a second time", String::from_utf8_lossy(key))),
            None => c.unknown(),
        }
    }
    c
}

/// Every acknowledged Decide (each decided `expected`) must read back with
/// that decision; `read` holds the answers of the decision lookups
/// (`None`: an outcome value this client does not know).
pub fn readback_decisions(acked: &[u64], expected: DecisionRead, read: &[(u64, Option<DecisionRead>)]) -> Check {
    let mut c = Check::new("ours: every acknowledged Decide read back");
    let answers: HashMap<u64, Option<DecisionRead>> = read.iter().copied().collect();
    for t in acked {
        match answers.get(t) {
            None => c.fail(format!("txid {t}: no answer in the decision lookup")),
            Some(Some(d)) if *d == expected => c.pass(),
            Some(Some(DecisionRead::UnknownPresumedAbort)) => c.fail(format!(
                "txid {t}: decided {expected:?} but its record is gone (unknown: presumed abort)"
            )),
            Some(Some(d)) => c.fail(format!("txid {t}: decided {expected:?} but reads back {d:?}")),
            Some(None) => c.fail(format!("txid {t}: an outcome value this client does not know")),
        }
    }
    c
}

/// What a conflicting Decide (the opposite decision) on an already decided
/// transaction returned, for transactions whose first decision was
/// `first`: it must be `first`. [`TxOutcome::Unknown`] (a timeout, no
/// quorum) is UNKNOWN; a definite error (`Err`) instead of the decision is
/// a violation.
pub fn conflicting_decides(first: TxOutcome, results: &[(u64, Result<TxOutcome, String>)]) -> Check {
    let mut c = Check::new("ours: a conflicting Decide on a decided txid returns the first decision");
    for (t, r) in results {
        match r {
            Ok(TxOutcome::Unknown) => c.unknown(),
            Ok(r) if *r == first => c.pass(),
            Ok(r) => c.fail(format!(
                "txid {t}: decided {first:?}, a conflicting Decide returned {r:?}"
            )),
            Err(e) => c.fail(format!(
                "txid {t}: decided {first:?}, a conflicting Decide failed instead of returning it: {e}"
            )),
        }
    }
    c
}

/// A check that could not be made (the read-back itself got no answer):
/// every operation counts as UNKNOWN, none as verified.
pub fn unverified(name: &str, operations: u64) -> Check {
    Check {
        name: name.to_string(),
        checked: operations,
        unknown: operations,
        ..Check::default()
    }
}

/// Up to `k` indexes into `0..len`, spread evenly from the first to the
/// last (all of them when `len <= k`).
pub fn sample_evenly(len: usize, k: usize) -> Vec<usize> {
    if len <= k {
        return (0..len).collect();
    }
    if k == 0 {
        return Vec::new();
    }
    if k == 1 {
        return vec![0];
    }
    (0..k).map(|j| j * (len - 1) / (k - 1)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(key: &str, rev: i64) -> AckedPut {
        AckedPut {
            key: key.as_bytes().to_vec(),
            value: format!("v-{key}").into_bytes(),
            revision: rev,
        }
    }

    fn seen(a: &AckedPut) -> Seen {
        Seen {
            create_revision: a.revision,
            mod_revision: a.revision,
            value: a.value.clone(),
        }
    }

    #[test]
    fn readback_of_puts_finds_lost_moved_overwritten_and_changed_keys() {
        let acked: Vec<AckedPut> = (1..=6).map(|i| put(&format!("k{i}"), 10 + i)).collect();
        let mut read: HashMap<Vec<u8>, Seen> = acked.iter().map(|a| (a.key.clone(), seen(a))).collect();
        let all_there = readback_puts(&acked, &read);
        assert!(all_there.passed(), "{}", all_there.summary());
        assert_eq!((all_there.checked, all_there.ok), (6, 6));

        read.remove(b"k1".as_slice()); // lost
        read.get_mut(b"k2".as_slice()).unwrap().create_revision = 99; // another write created it
        read.get_mut(b"k3".as_slice()).unwrap().mod_revision = 99; // written over later
        read.get_mut(b"k4".as_slice()).unwrap().value = b"other".to_vec(); // another value
                                                                           // A key nobody acknowledged (an UNKNOWN put that did land) is fine.
        read.insert(b"k9".to_vec(), seen(&put("k9", 50)));
        let c = readback_puts(&acked, &read);
        assert!(!c.passed());
        assert_eq!((c.checked, c.ok, c.violations, c.unknown), (6, 2, 4, 0));
        assert!(
            c.examples[0].contains("k1") && c.examples[0].contains("missing"),
            "{:?}",
            c.examples
        );
        assert!(c.summary().starts_with("FAILED"), "{}", c.summary());
    }

    #[test]
    fn reissued_put_accepted_is_a_violation_and_unknown_is_neither() {
        let results = vec![
            (b"a".to_vec(), Some(false)),
            (b"b".to_vec(), None),
            (b"c".to_vec(), Some(false)),
        ];
        let c = reissued_puts(&results);
        assert!(c.passed());
        assert_eq!((c.checked, c.ok, c.unknown, c.violations), (3, 2, 1, 0));

        let mut twice = results.clone();
        twice.push((b"d".to_vec(), Some(true)));
        let c = reissued_puts(&twice);
        assert!(!c.passed());
        assert_eq!(c.violations, 1);
        assert!(
            c.examples[0].contains("d was accepted a second time"),
            "{:?}",
            c.examples
        );
    }

    #[test]
    fn readback_of_decisions_needs_the_acknowledged_decision() {
        let acked = [1, 2, 3, 4, 5];
        let read = vec![
            (1, Some(DecisionRead::Aborted)),
            (2, Some(DecisionRead::Committed)),
            (3, Some(DecisionRead::UnknownPresumedAbort)),
            (4, None),
            // 5: no answer at all.
        ];
        let c = readback_decisions(&acked, DecisionRead::Aborted, &read);
        assert_eq!((c.checked, c.ok, c.violations), (5, 1, 4));
        assert!(c
            .examples
            .iter()
            .any(|e| e.contains("txid 3") && e.contains("record is gone")));
        assert!(c
            .examples
            .iter()
            .any(|e| e.contains("txid 5") && e.contains("no answer")));

        let good: Vec<_> = acked.iter().map(|t| (*t, Some(DecisionRead::Aborted))).collect();
        assert!(readback_decisions(&acked, DecisionRead::Aborted, &good).passed());
    }

    #[test]
    fn conflicting_decide_must_return_the_first_decision() {
        let ok = [(1, Ok(TxOutcome::Aborted)), (2, Ok(TxOutcome::Unknown))];
        let c = conflicting_decides(TxOutcome::Aborted, &ok);
        assert!(c.passed());
        assert_eq!((c.ok, c.unknown), (1, 1));
        let bad = [
            (1, Ok(TxOutcome::Aborted)),
            (7, Ok(TxOutcome::Committed)),
            (8, Err("failed precondition".to_string())),
        ];
        let c = conflicting_decides(TxOutcome::Aborted, &bad);
        assert!(!c.passed());
        assert_eq!(c.violations, 2);
        assert!(c.examples[0].contains("txid 7"), "{:?}", c.examples);
        assert!(
            c.examples[1].contains("txid 8") && c.examples[1].contains("failed"),
            "{:?}",
            c.examples
        );
        let none = unverified("x", 5);
        assert!(none.passed());
        assert_eq!((none.checked, none.unknown, none.ok), (5, 5, 0));
    }

    #[test]
    fn violations_beyond_the_kept_examples_are_still_counted() {
        let results: Vec<_> = (0..25).map(|i| (vec![i as u8], Some(true))).collect();
        let c = reissued_puts(&results);
        assert_eq!(c.violations, 25);
        assert_eq!(c.examples.len(), VIOLATIONS_KEPT);
    }

    #[test]
    fn samples_spread_from_first_to_last() {
        assert_eq!(sample_evenly(3, 5), vec![0, 1, 2]);
        assert_eq!(sample_evenly(100, 0), Vec::<usize>::new());
        assert_eq!(sample_evenly(100, 1), vec![0]);
        assert_eq!(sample_evenly(101, 5), vec![0, 25, 50, 75, 100]);
        let s = sample_evenly(1000, 7);
        assert_eq!((s.len(), s[0], s[6]), (7, 0, 999));
        assert!(s.windows(2).all(|w| w[0] < w[1]));
    }
}
