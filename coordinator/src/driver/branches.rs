//! Commits with branches that prepared where they ran (ADR 0046).
//!
//! A branch registered its vote with `RegisterBranch` while the
//! transaction was ACTIVE, so the driver sends it no Prepare: its recorded
//! vote counts in the tally like an answer to one. When every participant
//! registered, the transaction is decided in one Raft write, without
//! RequestCommit: the Decide freezes the participant set (docs/protocol.md,
//! "Transaction life"). A registration or an Enlist applied between the
//! driver's read and that write makes the voters differ from the enlisted
//! set; the state machine then refuses the Decide (invariant 2) and the
//! usual path runs, which prepares whoever has no recorded vote.

use std::sync::Arc;

use tracing::info;

use super::Driver;
use crate::ctx::now_ms;
use crate::ctx::ApiError;
use crate::sm::tally;
use crate::sm::tally::Tally;
use crate::sm::tally::Vote;
use crate::sm::BranchVote;
use crate::sm::Decision;
use crate::sm::DecisionSource;
use crate::sm::Outcome;
use crate::sm::Participant;
use crate::sm::Phase;
use crate::sm::TxTable;
use crate::sm::Txid;

/// The votes `participants` of `txid` registered as branches, as the
/// tally counts them (a NO already decided the transaction ABORT).
pub(super) fn registered_votes(table: &TxTable, txid: Txid, participants: &[Participant]) -> Vec<(String, Vote)> {
    participants
        .iter()
        .filter_map(|p| {
            let vote = match table.registered_vote(txid, &p.id)? {
                BranchVote::Yes => Vote::Yes,
                BranchVote::ReadOnly => Vote::ReadOnly,
                BranchVote::No => Vote::No("registered NO as a branch".to_string()),
            };
            Some((p.id.clone(), vote))
        })
        .collect()
}

impl Driver {
    /// Decides `txid` COMMIT in one Raft write when every participant of
    /// the ACTIVE transaction registered a YES or READ_ONLY as a branch
    /// and the deadline has not passed. `None` when the usual path must
    /// run (not every participant registered, past the deadline, or the
    /// set changed before the write).
    pub(super) async fn commit_registered(self: &Arc<Self>, txid: Txid) -> Result<Option<Decision>, ApiError> {
        let (votes, deadline_ms) = {
            let st = self.ctx.sm.state();
            let Some(r) = st.table.get(txid) else {
                return Ok(None);
            };
            if r.phase != Phase::Active || r.participants.is_empty() {
                return Ok(None);
            }
            let votes = registered_votes(&st.table, txid, &r.participants);
            if votes.len() != r.participants.len() {
                return Ok(None);
            }
            (votes, r.deadline_ms)
        };
        let voters: Vec<&str> = votes.iter().map(|(id, _)| id.as_str()).collect();
        let counted: Vec<(&str, Vote)> = votes.iter().map(|(id, v)| (id.as_str(), v.clone())).collect();
        let Tally::Commit {
            voters,
            read_only_voters,
        } = tally::tally(&voters, &counted, deadline_ms, now_ms())
        else {
            return Ok(None);
        };
        match self
            .decide_with_acks(
                txid,
                Outcome::Commit,
                voters,
                DecisionSource::Driver,
                String::new(),
                &read_only_voters,
            )
            .await
        {
            Ok((d, recorded)) => {
                if recorded {
                    metrics::counter!("dtx_branch_commits_in_one_write_total").increment(1);
                    info!(txid, outcome = %d.outcome, "decision recorded from the branches' registered votes");
                }
                self.spawn_delivery(txid);
                Ok(Some(d))
            }
            // The set changed between the read and the write (a branch
            // registered, a participant enlisted): nothing was recorded.
            Err(ApiError::FailedPrecondition(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }
}
