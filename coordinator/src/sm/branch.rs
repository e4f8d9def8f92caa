//! Branches that prepare where they run (docs/adr/0046, docs/protocol.md
//! "Branches"), pure like the rest of the state machine:
//! - `RegisterBranch`: a service that did its work in its own handler and
//!   prepared it joins the ACTIVE transaction with its vote, in one
//!   command. Accepted only while the participant set is open (ACTIVE,
//!   before the deadline, not fenced); write-once per (txid, participant);
//!   a NO decides ABORT in the same command.
//! - `ExcludeBranch`: a branch that prepared and does not know whether its
//!   registration was recorded asks what to do; if it is not a member of
//!   an ACTIVE transaction it is first fenced out, so that no late
//!   registration can make it one.
//! - `TxTable::branch_view`: what a branch does with its prepared work.
//!   Membership is decided where the participant set is frozen: a member
//!   gets the transaction's decision; a branch that is not a member is
//!   told ABORT, even when the transaction committed without it (the
//!   branch's presumed abort, invariant 7).
//!
//! Registrations and fences live in a side map of the table
//! (`TxTable::branches`), persisted and carried in snapshots beside the
//! records and removed with them.

use std::collections::BTreeMap;

use super::check_id;
use super::check_len;
use super::tally::deadline_passed;
use super::BranchRefusal;
use super::BranchView;
use super::BranchVote;
use super::Branches;
use super::CommandError;
use super::CommandOk;
use super::CommandResult;
use super::Decision;
use super::DecisionSource;
use super::DecisionView;
use super::Effect;
use super::Outcome;
use super::Participant;
use super::Phase;
use super::Registration;
use super::TxTable;
use super::Txid;
use crate::limits;

impl TxTable {
    /// The branches of every transaction that has any (for snapshots and
    /// persistence).
    pub fn branches(&self) -> &BTreeMap<Txid, Branches> {
        &self.branches
    }

    /// The branches of `txid`, if it has any.
    pub fn branches_of(&self, txid: Txid) -> Option<&Branches> {
        self.branches.get(&txid)
    }

    /// The recorded vote of `participant_id` in `txid`, if it registered.
    pub fn registered_vote(&self, txid: Txid, participant_id: &str) -> Option<BranchVote> {
        self.branches
            .get(&txid)
            .and_then(|b| b.registered.get(participant_id))
            .map(|r| r.vote)
    }

    /// True when `participant_id` was fenced out of `txid`.
    pub fn is_fenced(&self, txid: Txid, participant_id: &str) -> bool {
        self.branches
            .get(&txid)
            .is_some_and(|b| b.fenced.contains(participant_id))
    }

    /// Adds the persisted branches (at start or from a snapshot); those of
    /// transactions without a record are left out.
    pub fn with_branches(mut self, branches: impl IntoIterator<Item = (Txid, Branches)>) -> Self {
        for (t, b) in branches {
            if self.txs.contains_key(&t) && (!b.registered.is_empty() || !b.fenced.is_empty()) {
                self.branches.insert(t, b);
            }
        }
        self
    }

    /// What the branch `participant_id` does with its work prepared for
    /// `txid`: a member follows the transaction's decision; a branch that
    /// is not a member aborts (after being fenced out of an ACTIVE
    /// transaction). No record (never begun here, or forgotten) is
    /// `Outside`: a forgotten transaction froze its set long ago.
    pub fn branch_view(&self, txid: Txid, participant_id: &str) -> BranchView {
        let Some(r) = self.txs.get(&txid) else {
            return BranchView::Outside;
        };
        if r.participants.iter().any(|p| p.id == participant_id) {
            return BranchView::Member(self.decision_view(txid));
        }
        if r.phase == Phase::Active && !self.is_fenced(txid, participant_id) {
            BranchView::Unfenced
        } else {
            BranchView::Outside
        }
    }

    /// `RegisterBranch` (see the command).
    pub(super) fn register_branch(
        &mut self,
        entry_term: u64,
        txid: Txid,
        (participant_id, address): (&str, &str),
        (vote, reason): (BranchVote, &str),
        now_ms: u64,
        effects: &mut Vec<Effect>,
    ) -> CommandResult {
        check_id("participant_id", participant_id)?;
        check_len("address", address.len(), limits::ADDRESS_BYTES_MAX)?;
        check_len("reason", reason.len(), limits::REASON_BYTES_MAX)?;
        let refused = |r: BranchRefusal| Ok(CommandOk::BranchRefused(r));
        let pid = participant_id.to_string();
        let Some(r) = self.txs.get(&txid) else {
            if txid == 0 || txid >= self.next_txid {
                return Err(CommandError::NotFound { txid });
            }
            return refused(BranchRefusal::Forgotten {
                txid,
                participant_id: pid,
            });
        };
        let deadline_ms = r.deadline_ms;
        let enlisted: Option<String> = r
            .participants
            .iter()
            .find(|p| p.id == participant_id)
            .map(|p| p.address.clone());
        // A repeat reads the recorded registration back, whatever the
        // phase now (idempotent: the same answer).
        if let Some(reg) = self.branches.get(&txid).and_then(|b| b.registered.get(participant_id)) {
            if reg.vote != vote {
                return refused(BranchRefusal::VoteConflict {
                    txid,
                    participant_id: pid,
                    recorded: reg.vote,
                });
            }
            let recorded = enlisted.unwrap_or_default();
            if recorded != address {
                return refused(BranchRefusal::AddressConflict {
                    txid,
                    participant_id: pid,
                    recorded,
                    asked: address.to_string(),
                });
            }
            return Ok(CommandOk::BranchRegistered {
                term: reg.term,
                existing: true,
                deadline_ms,
                participant_count: r.participants.len() as u32,
                decision: r.decision().cloned(),
            });
        }
        if self.is_fenced(txid, participant_id) {
            return refused(BranchRefusal::Fenced {
                txid,
                participant_id: pid,
            });
        }
        if r.phase != Phase::Active {
            return refused(BranchRefusal::TooLate {
                txid,
                participant_id: pid,
                phase: r.phase.name().to_string(),
            });
        }
        if deadline_passed(deadline_ms, now_ms) {
            return refused(BranchRefusal::PastDeadline {
                txid,
                participant_id: pid,
                deadline_ms,
                now_ms,
            });
        }
        if let Some(recorded) = &enlisted {
            // Enlisted by its client already: the same participant only at
            // the same address.
            if recorded != address {
                return refused(BranchRefusal::AddressConflict {
                    txid,
                    participant_id: pid,
                    recorded: recorded.clone(),
                    asked: address.to_string(),
                });
            }
        } else if r.participants.len() >= limits::PARTICIPANTS_MAX {
            return Err(CommandError::TooManyParticipants {
                txid,
                limit: limits::PARTICIPANTS_MAX,
            });
        }
        // Everything is checked: record.
        let r = self.txs.get_mut(&txid).ok_or(CommandError::NotFound { txid })?;
        if enlisted.is_none() {
            r.participants.push(Participant {
                id: pid.clone(),
                address: address.to_string(),
                payload: Vec::new(),
                acked: false,
            });
        }
        let mut decision = None;
        if vote == BranchVote::No {
            // The branch rolled its work back: nothing can commit. The
            // other branches' locks are released without waiting for the
            // client (write-once: the record was undecided, checked above).
            // The note fits: an id and a reason within their limits, and
            // NOTE_BYTES_MAX leaves 64 bytes for the words.
            let mut note = format!("participant {participant_id} registered NO");
            if !reason.is_empty() {
                note.push_str(": ");
                note.push_str(reason);
            }
            let d = Decision {
                outcome: Outcome::Abort,
                source: DecisionSource::Driver,
                term: entry_term,
                decided_ms: now_ms,
                note,
            };
            r.phase = Phase::Decided(d.clone());
            decision = Some(d);
        }
        let participant_count = r.participants.len() as u32;
        self.branches.entry(txid).or_default().registered.insert(
            pid,
            Registration {
                vote,
                term: entry_term,
                registered_ms: now_ms,
            },
        );
        effects.push(Effect::Put(txid));
        if decision.is_some() {
            effects.push(Effect::Decided(txid, Outcome::Abort));
        }
        Ok(CommandOk::BranchRegistered {
            term: entry_term,
            existing: false,
            deadline_ms,
            participant_count,
            decision,
        })
    }

    /// `ExcludeBranch` (see the command).
    pub(super) fn exclude_branch(
        &mut self,
        txid: Txid,
        participant_id: &str,
        effects: &mut Vec<Effect>,
    ) -> CommandResult {
        check_id("participant_id", participant_id)?;
        let mut fenced_now = false;
        if self.branch_view(txid, participant_id) == BranchView::Unfenced {
            self.branches
                .entry(txid)
                .or_default()
                .fenced
                .insert(participant_id.to_string());
            effects.push(Effect::Put(txid));
            fenced_now = true;
        }
        let (member, decided) = match self.branch_view(txid, participant_id) {
            BranchView::Member(DecisionView::Decided(o)) => (true, Some(o)),
            BranchView::Member(_) => (true, None),
            BranchView::Unfenced | BranchView::Outside => (false, Some(Outcome::Abort)),
        };
        Ok(CommandOk::BranchExcluded {
            member,
            decided,
            fenced_now,
        })
    }
}
