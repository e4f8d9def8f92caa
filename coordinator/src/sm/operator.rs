//! What an operator does to transaction records, pure like the rest of the
//! state machine:
//! - `DropParticipant`: stop phase two to a participant that is gone for
//!   good. The decision must then be reconciled there by hand, and the
//!   record is kept (the leader loop does not forget it) until an operator
//!   forgets it, or until the participant acks after all.
//! - `ForgetByOperator`: forget a decided transaction now rather than after
//!   the retention, when nothing more can be delivered for it and
//!   forgetting cannot contradict its decision (invariant 10).
//! - `TxTable::list`: the records by ascending txid, filtered and paged.
//!
//! Drops live in a side map of the table (`TxTable::dropped`), persisted and
//! carried in snapshots beside the records, so the encoding of `TxRecord`
//! and `Participant` (existing data directories and snapshots) is unchanged.
//! The API checks the same rules on a linearizable read before it proposes,
//! and the state machine checks them again at apply: the state may change in
//! between.

use std::collections::BTreeMap;
use std::ops::Bound;

use super::check_id;
use super::check_len;
use super::CommandOk;
use super::CommandResult;
use super::Decision;
use super::DecisionSource;
use super::Dropped;
use super::Drops;
use super::Effect;
use super::OperatorRefusal;
use super::Outcome;
use super::Phase;
use super::TxTable;
use super::Txid;
use crate::limits;

/// Only transactions in this phase (`ListTransactions.state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StateFilter {
    Active,
    Preparing,
    Decided,
}

impl StateFilter {
    fn holds(self, phase: &Phase) -> bool {
        matches!(
            (self, phase),
            (StateFilter::Active, Phase::Active)
                | (StateFilter::Preparing, Phase::Preparing)
                | (StateFilter::Decided, Phase::Decided(_))
        )
    }
}

/// Which records `TxTable::list` returns: those meeting every condition set.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListFilter {
    pub state: Option<StateFilter>,
    /// Begun at least this long before `now_ms` (0: any age).
    pub min_age_ms: u64,
    /// The leader's clock, ms since the Unix epoch (ages are against it).
    pub now_ms: u64,
    /// Enlisted this participant id.
    pub participant: Option<String>,
    /// Decided, and still waiting for the ack of a participant that was not
    /// dropped.
    pub unacknowledged: bool,
    /// A dropped participant never acked (`TxTable::needs_reconciliation`).
    pub dropped: bool,
}

/// One page of `TxTable::list`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ListPage {
    /// Matching txids, ascending.
    pub txids: Vec<Txid>,
    /// The txid to list after for the next page, 0 when nothing follows.
    pub next_after: Txid,
}

impl TxTable {
    /// The drops of `txid`, if an operator dropped any of its participants.
    pub fn dropped(&self, txid: Txid) -> Option<&Drops> {
        self.dropped.get(&txid)
    }

    /// The drop of `participant_id` in `txid`, if it was dropped.
    pub fn drop_of(&self, txid: Txid, participant_id: &str) -> Option<&Dropped> {
        self.dropped.get(&txid)?.get(participant_id)
    }

    /// True when an operator dropped `participant_id` from `txid`.
    pub fn is_dropped(&self, txid: Txid, participant_id: &str) -> bool {
        self.drop_of(txid, participant_id).is_some()
    }

    /// Every transaction's drops (for snapshots and persistence).
    pub fn drops(&self) -> &BTreeMap<Txid, Drops> {
        &self.dropped
    }

    /// Adds the persisted drops (at start or from a snapshot); those of
    /// transactions without a record are left out. Re-indexes the
    /// transactions they name (a dropped participant is owed no delivery).
    pub fn with_drops(mut self, drops: impl IntoIterator<Item = (Txid, Drops)>) -> Self {
        for (t, d) in drops {
            if self.txs.contains_key(&t) && !d.is_empty() {
                self.dropped.insert(t, d);
                let before = self.index_key(t);
                self.reindex(t, before);
            }
        }
        self
    }

    /// True when `txid` has a dropped participant that never acked: its
    /// decision must be reconciled at that participant by hand.
    pub fn needs_reconciliation(&self, txid: Txid) -> bool {
        let (Some(r), Some(d)) = (self.txs.get(&txid), self.dropped.get(&txid)) else {
            return false;
        };
        r.participants.iter().any(|p| !p.acked && d.contains_key(&p.id))
    }

    /// Whether an operator may drop `participant_id` from `txid` now: true
    /// when it was dropped before (nothing to record), false when this drop
    /// would record it. The same rules the state machine applies.
    pub fn check_drop(&self, txid: Txid, participant_id: &str) -> Result<bool, OperatorRefusal> {
        let r = self
            .txs
            .get(&txid)
            .ok_or(OperatorRefusal::UnknownTransaction { txid })?;
        let Some(d) = r.decision() else {
            return Err(OperatorRefusal::NotDecided { txid });
        };
        let Some(p) = r.participants.iter().find(|p| p.id == participant_id) else {
            return Err(OperatorRefusal::NotEnlisted {
                txid,
                participant_id: participant_id.to_string(),
                enlisted: r.participants.iter().map(|p| p.id.clone()).collect(),
            });
        };
        if self.is_dropped(txid, participant_id) {
            return Ok(true);
        }
        if p.acked {
            return Err(OperatorRefusal::AlreadyAcked {
                txid,
                participant_id: participant_id.to_string(),
                outcome: d.outcome,
            });
        }
        Ok(false)
    }

    /// Whether an operator may forget `txid` now: its outcome when it may,
    /// None when there is no record (nothing to forget). The same rules the
    /// state machine applies.
    pub fn check_forget_by_operator(&self, txid: Txid) -> Result<Option<Outcome>, OperatorRefusal> {
        let Some(r) = self.txs.get(&txid) else {
            return Ok(None);
        };
        let Some(d) = r.decision() else {
            return Err(OperatorRefusal::NotDecided { txid });
        };
        let (dropped, pending): (Vec<String>, Vec<String>) = r
            .participants
            .iter()
            .filter(|p| !p.acked)
            .map(|p| p.id.clone())
            .partition(|id| self.is_dropped(txid, id));
        if !pending.is_empty() {
            return Err(OperatorRefusal::StillDelivering { txid, pending });
        }
        // Invariant 10: a forgotten transaction reads "unknown: presumed
        // abort", which only an ABORT agrees with. A participant that never
        // acked a COMMIT may still be prepared and ask.
        if d.outcome == Outcome::Commit && !dropped.is_empty() {
            return Err(OperatorRefusal::CommitWithDroppedUnacked { txid, dropped });
        }
        Ok(Some(d.outcome))
    }

    pub(super) fn drop_participant(
        &mut self,
        txid: Txid,
        participant_id: &str,
        note: &str,
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) -> CommandResult {
        check_id("participant_id", participant_id)?;
        check_len("note", note.len(), limits::NOTE_BYTES_MAX)?;
        match self.check_drop(txid, participant_id) {
            Err(refusal) => Ok(CommandOk::OperatorRefused(refusal)),
            Ok(true) => Ok(CommandOk::ParticipantDropped { recorded: false }),
            Ok(false) => {
                self.dropped.entry(txid).or_default().insert(
                    participant_id.to_string(),
                    Dropped {
                        note: note.to_string(),
                        dropped_ms: now_ms,
                    },
                );
                // The record is unchanged; its drops are persisted with it,
                // and re-indexing takes it out of the delivery index.
                effects.push(Effect::Put(txid));
                Ok(CommandOk::ParticipantDropped { recorded: true })
            }
        }
    }

    /// Whether an operator may declare `participant_id` of `txid` lost
    /// now (`Command::DeclareLost`): `Ok(Some(d))` when a decision stands
    /// already (write-once: it is the answer), `Ok(None)` when this
    /// declaration would record one. The same rules the state machine
    /// applies.
    pub fn check_declare_lost(&self, txid: Txid, participant_id: &str) -> Result<Option<Decision>, OperatorRefusal> {
        let r = self
            .txs
            .get(&txid)
            .ok_or(OperatorRefusal::UnknownTransaction { txid })?;
        if let Some(d) = r.decision() {
            return Ok(Some(d.clone()));
        }
        if !r.one_phase {
            return Err(OperatorRefusal::NotOnePhase { txid });
        }
        if !r.participants.iter().any(|p| p.id == participant_id) {
            return Err(OperatorRefusal::NotEnlisted {
                txid,
                participant_id: participant_id.to_string(),
                enlisted: r.participants.iter().map(|p| p.id.clone()).collect(),
            });
        }
        Ok(None)
    }

    pub(super) fn declare_lost(
        &mut self,
        txid: Txid,
        participant_id: &str,
        decision: Decision,
        effects: &mut Vec<Effect>,
    ) -> CommandResult {
        check_id("participant_id", participant_id)?;
        check_len("note", decision.note.len(), limits::NOTE_BYTES_MAX)?;
        debug_assert_eq!(decision.source, DecisionSource::OperatorHeuristic);
        match self.check_declare_lost(txid, participant_id) {
            Err(refusal) => Ok(CommandOk::OperatorRefused(refusal)),
            Ok(Some(existing)) => Ok(CommandOk::Decided {
                decision: existing,
                recorded: false,
            }),
            Ok(None) => {
                let outcome = decision.outcome;
                self.dropped.entry(txid).or_default().insert(
                    participant_id.to_string(),
                    Dropped {
                        note: decision.note.clone(),
                        dropped_ms: decision.decided_ms,
                    },
                );
                let r = self.txs.get_mut(&txid).expect("checked above");
                // Not acked: the participant never answered; the decision
                // is the operator's.
                r.phase = Phase::Decided(decision.clone());
                effects.push(Effect::Put(txid));
                effects.push(Effect::Decided(txid, outcome));
                Ok(CommandOk::Decided {
                    decision,
                    recorded: true,
                })
            }
        }
    }

    pub(super) fn forget_by_operator(&mut self, txid: Txid, note: &str, effects: &mut Vec<Effect>) -> CommandResult {
        check_len("note", note.len(), limits::NOTE_BYTES_MAX)?;
        match self.check_forget_by_operator(txid) {
            Err(refusal) => Ok(CommandOk::OperatorRefused(refusal)),
            Ok(None) => Ok(CommandOk::ForgottenByOperator { outcome: None }),
            Ok(Some(outcome)) => {
                self.remove_record(txid, effects);
                Ok(CommandOk::ForgottenByOperator { outcome: Some(outcome) })
            }
        }
    }

    /// The records meeting `filter`, by ascending txid above `after`: at
    /// most `limit` (at least 1), looking at no more than `scan_max`
    /// candidates (so a filter few records meet never holds the state for
    /// long; the page may then be short, with `next_after` where the look
    /// stopped). Candidates come from the smallest index the filter allows
    /// (drops, the delivery index, PREPARING), else from the records.
    pub fn list(&self, filter: &ListFilter, after: Txid, limit: usize, scan_max: usize) -> ListPage {
        let from = (Bound::Excluded(after), Bound::Unbounded);
        let candidates: Box<dyn Iterator<Item = Txid> + '_> = if filter.dropped {
            Box::new(self.dropped.range(from).map(|(t, _)| *t))
        } else if filter.unacknowledged {
            Box::new(self.undelivered.range(from).copied())
        } else if filter.state == Some(StateFilter::Preparing) {
            Box::new(self.preparing.range(from).copied())
        } else {
            Box::new(self.txs.range(from).map(|(t, _)| *t))
        };
        let mut candidates = candidates.peekable();
        let (limit, scan_max) = (limit.max(1), scan_max.max(1));
        let mut page = ListPage::default();
        let mut last_seen = after;
        let mut scanned = 0usize;
        for t in candidates.by_ref() {
            scanned += 1;
            last_seen = t;
            if self.meets(t, filter) {
                page.txids.push(t);
                if page.txids.len() >= limit {
                    break;
                }
            }
            if scanned >= scan_max {
                break;
            }
        }
        if candidates.peek().is_some() {
            page.next_after = last_seen;
        }
        page
    }

    /// True when the record of `txid` in this table meets `f`.
    pub fn meets(&self, txid: Txid, f: &ListFilter) -> bool {
        let Some(r) = self.txs.get(&txid) else {
            return false;
        };
        f.state.is_none_or(|s| s.holds(&r.phase))
            && f.now_ms.saturating_sub(r.begun_ms) >= f.min_age_ms
            && f.participant
                .as_deref()
                .is_none_or(|id| r.participants.iter().any(|p| p.id == id))
            && (!f.unacknowledged || self.undelivered.contains(&txid))
            && (!f.dropped || self.needs_reconciliation(txid))
    }
}
