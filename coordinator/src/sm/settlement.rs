//! Settlements of another incarnation's transactions
//! (docs/adr/0040-settling-another-incarnations-txid.md).
//!
//! After a restore, a participant may hold an in-doubt YES vote (and its
//! locks) for a txid the OLD cluster handed out after the backup. The
//! restored cluster answers such a read `OUTCOME_OTHER_INCARNATION` and
//! never presumes anything (invariant 10, ADR 0033), so without a recorded
//! decision the vote is held for ever (invariant 5: a participant leaves
//! PREPARED YES only on a recorded decision). An operator settles it:
//! `Command::SettleOther` records (incarnation, txid) -> outcome here,
//! write-once (invariant 1), with who, why, when and the term; the
//! decision read answers a settled pair with its outcome instead of
//! OTHER_INCARNATION, and the participant's recovery applies it.
//!
//! The settlements are a side map beside the transaction table and the
//! incarnations: keyed by (incarnation, txid), never by txid alone (the
//! same number is another transaction in another incarnation). They are
//! never forgotten: a participant may ask again at any time, and the
//! answer must stay the same.
//!
//! Refused: incarnation 0 (a participant asking with 0 is answered from
//! the table, so the settlement would never be read) and a pair this
//! cluster's history holds (`Belonging::Ours`: handed out here, answered
//! from the table). The rule is exactly the decision read's, so what may
//! be settled is exactly what would otherwise read OTHER_INCARNATION.
//!
//! The evidence an operator brings (the participants' own records, asked
//! by the leader with `Inquire`) is judged by `judge_evidence`, pure like
//! the rest: the leader runs it before it proposes. The state machine
//! cannot re-check it (it is not replicated state); it checks the rest
//! again at apply.
//!
//! Pure: no clock, no I/O.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde::Serialize;

use super::check_len;
use super::incarnation::Belonging;
use super::incarnation::Incarnations;
use super::CommandError;
use super::CommandOk;
use super::CommandResult;
use super::Outcome;
use super::Settlement;
use super::SettlementRefusal;
use super::Txid;
use crate::limits;

/// Every settlement, by (incarnation, txid). Part of the state machine,
/// its snapshots and backups.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
pub struct Settlements {
    by_id: BTreeMap<(u64, Txid), Settlement>,
}

impl Settlements {
    /// Rebuilds them from persisted parts (at start).
    pub fn from_parts(parts: impl IntoIterator<Item = ((u64, Txid), Settlement)>) -> Self {
        Settlements {
            by_id: parts.into_iter().collect(),
        }
    }

    /// The settlement of (`incarnation`, `txid`), if an operator recorded
    /// one.
    pub fn get(&self, incarnation: u64, txid: Txid) -> Option<&Settlement> {
        self.by_id.get(&(incarnation, txid))
    }

    /// Every settlement, lowest (incarnation, txid) first.
    pub fn iter(&self) -> impl Iterator<Item = (&(u64, Txid), &Settlement)> {
        self.by_id.iter()
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Whether (`incarnation`, `txid`) may be settled here: `Ok(Some(s))`
    /// when it was settled before (write-once: `s` is the answer),
    /// `Ok(None)` when a settlement would be recorded. The same rules the
    /// state machine applies.
    pub fn check(
        &self,
        incarnations: &Incarnations,
        incarnation: u64,
        txid: Txid,
    ) -> Result<Option<&Settlement>, SettlementRefusal> {
        if incarnation == 0 {
            return Err(SettlementRefusal::IncarnationZero { txid });
        }
        // The decision read's own rule: what it answers from the table is
        // never settled here.
        if incarnations.belonging(incarnation, txid) == Belonging::Ours {
            return Err(SettlementRefusal::OwnTxid { incarnation, txid });
        }
        Ok(self.get(incarnation, txid))
    }

    /// `Command::SettleOther`: records `settlement` for (`incarnation`,
    /// `txid`) unless one stands (write-once, invariant 1: the first is
    /// returned, `recorded` false, whatever this one's outcome). A refusal
    /// is a `CommandError::SettlementRefused`; nothing changes.
    pub fn settle(
        &mut self,
        incarnations: &Incarnations,
        incarnation: u64,
        txid: Txid,
        settlement: Settlement,
    ) -> CommandResult {
        check_len("note", settlement.note.len(), limits::NOTE_BYTES_MAX)?;
        if settlement.note.is_empty() {
            return Err(CommandError::Invalid(
                "a settlement needs a note: who settled it and why".to_string(),
            ));
        }
        match self.check(incarnations, incarnation, txid) {
            Err(r) => Err(CommandError::SettlementRefused(r)),
            Ok(Some(existing)) => Ok(CommandOk::Settled {
                settlement: existing.clone(),
                recorded: false,
            }),
            Ok(None) => {
                self.by_id.insert((incarnation, txid), settlement.clone());
                Ok(CommandOk::Settled {
                    settlement,
                    recorded: true,
                })
            }
        }
    }
}

/// What a participant's durable log holds for (incarnation, txid), as its
/// `Inquire` answered, or why it could not be asked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Held {
    /// No record (never prepared there, or garbage-collected).
    None,
    PreparedYes,
    PreparedReadOnly,
    Committed,
    /// Voted NO, or applied ABORT.
    Aborted,
    /// An Abort came before any Prepare.
    Tombstone,
    /// Not asked successfully: why.
    NoAnswer(String),
}

impl Held {
    fn name(&self) -> String {
        match self {
            Held::None => "NONE".into(),
            Held::PreparedYes => "PREPARED_YES".into(),
            Held::PreparedReadOnly => "PREPARED_READ_ONLY".into(),
            Held::Committed => "COMMITTED".into(),
            Held::Aborted => "ABORTED".into(),
            Held::Tombstone => "TOMBSTONE".into(),
            Held::NoAnswer(why) => format!("no answer ({why})"),
        }
    }
}

/// Judges the evidence for settling another incarnation's txid with
/// `outcome`, from what each participant the operator named holds for it.
/// Returns the evidence (recorded in the note) or why it is refused.
///
/// - COMMIT: some named participant holds it COMMITTED (only a recorded
///   COMMIT makes a participant commit, so the old cluster decided it), or
///   every named participant holds a YES (or READ_ONLY) vote: then the
///   operator vouches that they are all of its participants (the cluster
///   has no record of the set), as invariant 2 asks. Refused when a named
///   participant holds it COMMITTED and another ABORTED or TOMBSTONE: the
///   participants contradict each other, and only a person can reconcile
///   them.
/// - ABORT: refused when a named participant holds it COMMITTED (the old
///   cluster decided COMMIT: invariant 3), or could not be asked (it may).
pub fn judge_evidence(outcome: Outcome, held: &[(String, Held)]) -> Result<String, String> {
    if held.is_empty() {
        return Err("name at least one participant of the transaction (--participant ID=ADDR)".to_string());
    }
    let list = |f: &dyn Fn(&Held) -> bool| -> Vec<&str> {
        held.iter().filter(|(_, h)| f(h)).map(|(id, _)| id.as_str()).collect()
    };
    let all = held
        .iter()
        .map(|(id, h)| format!("{id}={}", h.name()))
        .collect::<Vec<_>>()
        .join(", ");
    let committed = list(&|h| *h == Held::Committed);
    let contrary = list(&|h| matches!(h, Held::Aborted | Held::Tombstone));
    match outcome {
        Outcome::Commit => {
            if !committed.is_empty() && !contrary.is_empty() {
                return Err(format!(
                    "COMMIT refused: the participants contradict each other ({all}): {committed:?} committed it and \
                     {contrary:?} aborted it or never prepared; only a person can reconcile that, nothing was \
                     recorded"
                ));
            }
            if !committed.is_empty() {
                return Ok(format!(
                    "{committed:?} hold it COMMITTED, so the old cluster decided COMMIT; asked: {all}"
                ));
            }
            let not_yes = list(&|h| !matches!(h, Held::PreparedYes | Held::PreparedReadOnly));
            if not_yes.is_empty() {
                return Ok(format!(
                    "every named participant holds a YES vote, and the operator names them as all of its \
                     participants: {all}"
                ));
            }
            Err(format!(
                "COMMIT refused: no named participant holds it COMMITTED, and {not_yes:?} hold no YES vote \
                 ({all}); COMMIT needs a participant that committed it, or a YES vote from every participant \
                 (invariant 2)"
            ))
        }
        Outcome::Abort => {
            if !committed.is_empty() {
                return Err(format!(
                    "ABORT refused: {committed:?} hold it COMMITTED, so the old cluster decided COMMIT and an ABORT \
                     would split the transaction (invariant 3); settle it with --commit ({all})"
                ));
            }
            let unasked = list(&|h| matches!(h, Held::NoAnswer(_)));
            if !unasked.is_empty() {
                return Err(format!(
                    "ABORT refused: {unasked:?} could not be asked, and may hold it COMMITTED; bring them back and \
                     retry ({all})"
                ));
            }
            Ok(format!("no named participant holds it COMMITTED: {all}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A restored cluster's history: incarnation 0xa1 handed out txids 1..
    /// until the backup (next txid 10), the restored cluster opened 0xc3
    /// from there.
    fn restored() -> Incarnations {
        let mut h = Incarnations::default();
        h.open(0xa1, 1, 1).unwrap();
        h.close(10, 1);
        h.open(0xc3, 10, 1).unwrap();
        h
    }

    fn settlement(outcome: Outcome, note: &str) -> Settlement {
        Settlement {
            outcome,
            note: note.into(),
            settled_ms: 7,
            term: 3,
        }
    }

    /// Invariant 1 for settlements: the first one recorded stays; a repeat
    /// reads it back, and so does a conflicting one (never overwritten).
    #[test]
    fn invariant_1_a_settlement_is_write_once() {
        let h = restored();
        let mut s = Settlements::default();
        let first = settlement(Outcome::Abort, "operator o: first");
        assert_eq!(
            s.settle(&h, 0xa1, 12, first.clone()),
            Ok(CommandOk::Settled {
                settlement: first.clone(),
                recorded: true
            })
        );
        assert_eq!(
            s.settle(&h, 0xa1, 12, settlement(Outcome::Abort, "operator o: again")),
            Ok(CommandOk::Settled {
                settlement: first.clone(),
                recorded: false
            }),
            "a repeat reads the first back, note and all"
        );
        assert_eq!(
            s.settle(&h, 0xa1, 12, settlement(Outcome::Commit, "operator p: conflicting")),
            Ok(CommandOk::Settled {
                settlement: first.clone(),
                recorded: false
            }),
            "a conflicting settlement never overwrites the first"
        );
        assert_eq!(s.get(0xa1, 12), Some(&first));
        assert_eq!(s.check(&h, 0xa1, 12), Ok(Some(&first)));
        // Keyed by (incarnation, txid): the same number of another
        // incarnation is another transaction.
        assert_eq!(s.get(0xbb, 12), None);
        let other = settlement(Outcome::Commit, "operator o: another cluster's 12");
        assert!(matches!(
            s.settle(&h, 0xbb, 12, other.clone()),
            Ok(CommandOk::Settled { recorded: true, .. })
        ));
        assert_eq!(s.get(0xbb, 12), Some(&other));
        assert_eq!(s.len(), 2);
    }

    /// Invariant 10: what this cluster handed out is answered from its
    /// table, so it is never settled here; nor is incarnation 0 (read from
    /// the table too); the old cluster's txids after the backup, and
    /// another cluster's, may be.
    #[test]
    fn invariant_10_own_txids_and_incarnation_zero_are_refused() {
        let h = restored();
        let mut s = Settlements::default();
        let refused = |s: &mut Settlements, inc: u64, txid: Txid| {
            let before = s.clone();
            let r = s.settle(&h, inc, txid, settlement(Outcome::Commit, "operator o: try"));
            assert_eq!(*s, before, "a refusal changes nothing");
            match r {
                Err(CommandError::SettlementRefused(r)) => r,
                other => panic!("({inc:x}, {txid}) not refused: {other:?}"),
            }
        };
        assert_eq!(refused(&mut s, 0, 12), SettlementRefusal::IncarnationZero { txid: 12 });
        // In the backup: 0xa1's own era.
        assert!(matches!(
            refused(&mut s, 0xa1, 5),
            SettlementRefusal::OwnTxid {
                incarnation: 0xa1,
                txid: 5
            }
        ));
        // The restored cluster's own, handed out or still to come.
        assert!(matches!(refused(&mut s, 0xc3, 12), SettlementRefusal::OwnTxid { .. }));
        assert!(matches!(
            refused(&mut s, 0xc3, 1_000),
            SettlementRefusal::OwnTxid { .. }
        ));
        let msg = SettlementRefusal::OwnTxid {
            incarnation: 0xc3,
            txid: 12,
        }
        .to_string();
        assert!(msg.contains("00000000000000c3") && msg.contains("txn show 12"), "{msg}");
        assert!(SettlementRefusal::IncarnationZero { txid: 1 }
            .to_string()
            .contains("admin participant"));
        // Allowed: the old cluster's after the backup (10 and on, where the
        // restored cluster's own numbers are 0xc3's), and another cluster's.
        for (inc, txid) in [(0xa1, 10), (0xa1, 500), (0xdd, 5)] {
            assert_eq!(s.check(&h, inc, txid), Ok(None), "({inc:x}, {txid})");
        }
        // Empty and oversized notes are refused before anything.
        assert!(matches!(
            s.settle(&h, 0xa1, 10, settlement(Outcome::Abort, "")),
            Err(CommandError::Invalid(_))
        ));
        let long = "x".repeat(limits::NOTE_BYTES_MAX + 1);
        assert!(matches!(
            s.settle(&h, 0xa1, 10, settlement(Outcome::Abort, &long)),
            Err(CommandError::Invalid(_))
        ));
        assert!(s.is_empty());
    }

    /// A restored cluster that has not opened its own incarnation yet may
    /// settle the old cluster's later txids (they are not its own), and
    /// they stay settled once it opens one.
    #[test]
    fn invariant_10_settlements_stay_other_after_the_next_incarnation_opens() {
        let mut h = Incarnations::default();
        h.open(0xa1, 1, 1).unwrap();
        h.close(10, 1);
        let mut s = Settlements::default();
        assert!(matches!(
            s.settle(
                &h,
                0xa1,
                11,
                settlement(Outcome::Commit, "operator o: bank-a committed")
            ),
            Ok(CommandOk::Settled { recorded: true, .. })
        ));
        h.open(0xc3, 10, 1).unwrap();
        assert_eq!(
            s.check(&h, 0xa1, 11).map(|x| x.map(|x| x.outcome)),
            Ok(Some(Outcome::Commit))
        );
    }

    fn held(pairs: &[(&str, Held)]) -> Vec<(String, Held)> {
        pairs.iter().map(|(id, h)| (id.to_string(), h.clone())).collect()
    }

    /// Invariant 5 (a participant leaves PREPARED YES only on a recorded
    /// decision) with invariants 2 and 3: the settlement recorded for it
    /// must agree with what the old cluster may have decided. COMMIT needs
    /// a participant that committed, or a YES from every named one; ABORT
    /// is refused when one committed, or could not be asked.
    #[test]
    fn invariant_5_a_settlement_needs_evidence_that_agrees_with_the_old_cluster() {
        use Held::*;
        let no = NoAnswer("no answer within 2000 ms".into());
        // COMMIT.
        let ok = judge_evidence(
            Outcome::Commit,
            &held(&[("a", Committed), ("b", PreparedYes), ("c", None), ("d", no.clone())]),
        )
        .unwrap();
        assert!(
            ok.contains("[\"a\"] hold it COMMITTED") && ok.contains("d=no answer"),
            "{ok}"
        );
        let ok = judge_evidence(Outcome::Commit, &held(&[("a", PreparedYes), ("b", PreparedReadOnly)])).unwrap();
        assert!(ok.contains("all of its participants"), "{ok}");
        for bad in [
            held(&[("a", PreparedYes), ("b", None)]),
            held(&[("a", PreparedYes), ("b", no.clone())]),
            held(&[("a", PreparedYes), ("b", Aborted)]),
            held(&[("a", Tombstone)]),
        ] {
            let e = judge_evidence(Outcome::Commit, &bad).unwrap_err();
            assert!(e.starts_with("COMMIT refused: no named participant"), "{e}");
        }
        let e = judge_evidence(Outcome::Commit, &held(&[("a", Committed), ("b", Aborted)])).unwrap_err();
        assert!(e.contains("contradict"), "{e}");
        // ABORT.
        let ok = judge_evidence(Outcome::Abort, &held(&[("a", PreparedYes), ("b", None)])).unwrap();
        assert!(ok.contains("a=PREPARED_YES, b=NONE"), "{ok}");
        assert!(judge_evidence(Outcome::Abort, &held(&[("a", PreparedYes), ("b", PreparedYes)])).is_ok());
        let e = judge_evidence(Outcome::Abort, &held(&[("a", PreparedYes), ("b", Committed)])).unwrap_err();
        assert!(e.contains("[\"b\"] hold it COMMITTED") && e.contains("--commit"), "{e}");
        let e = judge_evidence(Outcome::Abort, &held(&[("a", PreparedYes), ("b", no)])).unwrap_err();
        assert!(e.contains("could not be asked"), "{e}");
        // Nothing named: nothing judged.
        assert!(judge_evidence(Outcome::Abort, &[]).is_err());
        assert!(judge_evidence(Outcome::Commit, &[]).is_err());
    }
}
