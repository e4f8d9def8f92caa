//! Phase one in groups (ADR 0014): the Prepares the leader sends to one
//! participant address travel together in `ParticipantService.PrepareMany`
//! messages, which the participant prepares in one durable write, instead of
//! one Prepare call (and one store-lock round and write) per transaction.
//!
//! `Driver::prepare_one` queues its item for the address (`group::Groups`):
//! - with no PrepareMany to that address in flight, a sender task starts and
//!   sends at once, with no wait, so a lone prepare goes alone as fast as a
//!   Prepare call did;
//! - while one is in flight, later prepares queue and leave together
//!   (at most `limits::PREPARE_GROUP_ITEMS_MAX`, and at most
//!   `limits::PREPARE_GROUP_PAYLOAD_BYTES_MAX` of payload) as soon as its
//!   answer is in;
//! - each item keeps its own time: its caller stops waiting when its timeout
//!   runs out, and the prepare counts as no vote (as a Prepare call without
//!   an answer did); an item whose caller stopped waiting before its message
//!   left is not sent. The message's own gRPC deadline is the latest of its
//!   items';
//! - an item's result is what its own Prepare would have answered: a vote,
//!   or the failure (code, refusal kind) that counts as no vote; a message
//!   that fails as a whole is a failure of each of its items.
//!
//! A participant that answers UNIMPLEMENTED (an SDK from before PrepareMany)
//! is remembered per address for `group::SINGLE_CALLS_FOR` and gets one
//! Prepare call per prepare, as before.

use std::sync::Arc;
use std::time::Duration;

use dtx_proto::v1 as pb;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::info;
use tracing::Instrument;

use super::group::Answer;
use super::DeliveryError;
use super::Driver;
use crate::sm::tally::Vote;
use crate::sm::Txid;

/// One queued prepare: its message and when its caller stops waiting.
#[derive(Clone)]
pub(super) struct PrepareItem {
    req: pb::PrepareRequest,
    deadline: Instant,
}

/// The prepares waiting for each address's next PrepareMany message.
pub(super) type PrepareGroups = super::group::Groups<PrepareItem, Vote>;

/// A message's payload bytes count against
/// `limits::PREPARE_GROUP_PAYLOAD_BYTES_MAX`.
fn payload_bytes(it: &PrepareItem) -> usize {
    it.req.payload.len()
}

impl Driver {
    /// `p`'s answer to Prepare (`prepare_one`), through its address's
    /// PrepareMany queue; `None` when the address takes single calls.
    pub(super) async fn prepare_grouped(
        self: &Arc<Self>,
        addr: &str,
        req: pb::PrepareRequest,
        timeout: Duration,
    ) -> Option<Vote> {
        let groups = &self.state.prepare_groups;
        if groups.single_calls(addr) {
            return None;
        }
        let item = PrepareItem {
            req,
            deadline: Instant::now() + timeout,
        };
        let (tx, rx) = oneshot::channel();
        if groups.push(addr, item, tx) {
            let driver = self.clone();
            let addr = addr.to_string();
            tokio::spawn(async move { driver.send_prepare_groups(addr).await });
        }
        match tokio::time::timeout(timeout, rx).await {
            Err(_) => Some(Vote::Failed(format!("no vote within {} ms", timeout.as_millis()))),
            Ok(Ok(Answer::Done(v))) => Some(v),
            Ok(Ok(Answer::SendAlone)) => None,
            Ok(Err(_)) => Some(Vote::Failed(
                "the message carrying this prepare was dropped before it was answered".into(),
            )),
        }
    }

    /// The sender task of `addr`: sends its queued prepares at once, one
    /// message at a time, until none is left.
    async fn send_prepare_groups(self: Arc<Self>, addr: String) {
        let limits = (
            dtx_proto::limits::PREPARE_GROUP_ITEMS_MAX,
            dtx_proto::limits::PREPARE_GROUP_PAYLOAD_BYTES_MAX,
            payload_bytes as fn(&PrepareItem) -> usize,
        );
        self.state
            .prepare_groups
            .run_sender(&addr, Duration::ZERO, limits, |items| {
                self.send_prepare_group(&addr, items)
            })
            .await
    }

    /// Sends `batch` to `addr` in one PrepareMany message: one answer per
    /// item, in order. Decisions waiting for their own ApplyDecisions
    /// message to `addr` ride along (ADR 0030) and are answered from the
    /// same answer.
    async fn send_prepare_group(&self, addr: &str, batch: Vec<PrepareItem>) -> Vec<Answer<Vote>> {
        let riders = self
            .state
            .groups
            .take_along(addr, dtx_proto::limits::DECISION_DELIVERY_ITEMS_MAX);
        let decisions: Vec<pb::DecisionItem> = riders.iter().map(|w| w.item.clone()).collect();
        let (votes, ridden) = self.send_prepare_many(addr, batch, decisions).await;
        if !riders.is_empty() {
            metrics::histogram!("dtx_prepare_riding_decisions").record(riders.len() as f64);
        }
        let ridden = match ridden {
            Ridden::Answered(results) => results,
            Ridden::Ignored => {
                // An SDK from before ADR 0030 dropped them unread: they go
                // again, each alone this once; later ones go by
                // ApplyDecisions only.
                if self.state.groups.remember_no_riders(addr) {
                    info!(
                        address = %addr,
                        "participant ignores decisions riding in PrepareMany (an older SDK): they go by ApplyDecisions"
                    );
                }
                riders.iter().map(|_| Answer::SendAlone).collect()
            }
        };
        for (w, a) in riders.into_iter().zip(ridden) {
            let _ = w.reply.send(a);
        }
        votes
    }

    /// The PrepareMany call itself: the prepares' answers and what became
    /// of the `decisions` riding in it.
    async fn send_prepare_many(
        &self,
        addr: &str,
        batch: Vec<PrepareItem>,
        decisions: Vec<pb::DecisionItem>,
    ) -> (Vec<Answer<Vote>>, Ridden) {
        let n = batch.len();
        let d = decisions.len();
        metrics::histogram!("dtx_prepare_batch_items").record(n as f64);
        let every = |why: String| {
            let votes = (0..n).map(|_| Answer::Done(Vote::Failed(why.clone()))).collect();
            let decided = (0..d)
                .map(|_| Answer::Done(Err(DeliveryError::NoAnswer(why.clone()))))
                .collect();
            (votes, Ridden::Answered(decided))
        };
        let ch = match self.ctx.api_channel(addr) {
            Ok(c) => c,
            Err(e) => return every(e.to_string()),
        };
        let deadline = batch.iter().map(|it| it.deadline).max().unwrap_or_else(Instant::now);
        let timeout = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        // The riding decisions' traces are linked as well.
        let txids: Vec<Txid> = batch
            .iter()
            .map(|it| it.req.txid)
            .chain(decisions.iter().map(|it| it.txid))
            .collect();
        let mut req = tonic::Request::new(pb::PrepareManyRequest {
            items: batch.into_iter().map(|it| it.req).collect(),
            decisions,
        });
        req.set_timeout(timeout);
        // Many transactions: the span names the first item's trace and
        // links the others' (each item's txid is in its own prepare
        // round's log lines).
        let span = tracing::info_span!(
            "participant_call",
            rpc = "PrepareMany",
            address = %addr,
            items = n,
            decisions = d,
            trace_id = tracing::field::Empty,
        );
        self.mark_group_call(&span, &txids, &mut req);
        let mut client = self.ctx.participant_over(ch);
        match tokio::time::timeout(timeout, client.prepare_many(req))
            .instrument(span)
            .await
        {
            Err(_) => every(format!("no answer within {} ms", timeout.as_millis())),
            Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {
                if self.state.prepare_groups.remember_single_calls(addr) {
                    info!(
                        address = %addr,
                        "participant does not serve PrepareMany (an older SDK): it gets one Prepare call per prepare"
                    );
                }
                let votes = (0..n).map(|_| Answer::SendAlone).collect();
                (votes, Ridden::Answered((0..d).map(|_| Answer::SendAlone).collect()))
            }
            Ok(Err(s)) => {
                if matches!(DeliveryError::from_status(&s), DeliveryError::Refused { .. }) {
                    // The participant answered (issue 39, item 7).
                    self.state.note_answered(addr);
                }
                // As a failed ApplyDecisions: each decision's attempt failed
                // the way the status says.
                let votes = (0..n)
                    .map(|_| Answer::Done(Vote::Failed(format!("{}: {}", s.code(), s.message()))))
                    .collect();
                let decided = (0..d)
                    .map(|_| Answer::Done(Err(DeliveryError::from_status(&s))))
                    .collect();
                (votes, Ridden::Answered(decided))
            }
            Ok(Ok(r)) => {
                // The participant answered (issue 39, item 7).
                self.state.note_answered(addr);
                let r = r.into_inner();
                if r.results.len() != n || !(r.decision_results.len() == d || r.decision_results.is_empty()) {
                    return every(format!(
                        "malformed PrepareMany answer: {} results for {n} items, {} decision results for {d} decisions",
                        r.results.len(),
                        r.decision_results.len()
                    ));
                }
                let votes = r.results.into_iter().map(|r| Answer::Done(item_vote(r))).collect();
                let ridden = if d > 0 && r.decision_results.is_empty() {
                    Ridden::Ignored
                } else {
                    Ridden::Answered(
                        r.decision_results
                            .into_iter()
                            .map(|r| Answer::Done(super::phase_two::item_result(r)))
                            .collect(),
                    )
                };
                (votes, ridden)
            }
        }
    }
}

/// What became of the decisions riding in one PrepareMany message.
enum Ridden {
    /// One answer per decision, in order.
    Answered(Vec<Answer<Result<(), DeliveryError>>>),
    /// The participant answered the prepares and no decision: it does not
    /// know the field (an SDK from before ADR 0030).
    Ignored,
}

/// What a Prepare call's answer means as a vote (anything but a vote counts
/// as no vote).
pub(super) fn vote_of(vote: i32, reason: String) -> Vote {
    match pb::Vote::try_from(vote) {
        Ok(pb::Vote::Yes) => Vote::Yes,
        Ok(pb::Vote::ReadOnly) => Vote::ReadOnly,
        Ok(pb::Vote::No) => Vote::No(reason),
        _ => Vote::Failed(format!("malformed vote value {vote}")),
    }
}

/// One item's result as the vote its own Prepare would have given: its
/// vote, or, for a failed item, the failure its status would have been.
fn item_vote(r: pb::PrepareItemResult) -> Vote {
    let code = tonic::Code::from_i32(r.code);
    if code != tonic::Code::Ok {
        let refusal = if r.refusal.is_empty() {
            String::new()
        } else {
            format!(" ({})", r.refusal)
        };
        return Vote::Failed(format!("{code}: {}{refusal}", r.message));
    }
    vote_of(r.vote, r.reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An item's result means what the single Prepare's answer meant: a
    /// vote, or a failure (refusals included) that counts as no vote.
    #[test]
    fn item_results_are_read_like_single_prepare_answers() {
        let res = |vote: pb::Vote, reason: &str, code: tonic::Code, refusal: &str| pb::PrepareItemResult {
            vote: vote as i32,
            reason: reason.into(),
            code: code as i32,
            refusal: refusal.into(),
            message: "why".into(),
        };
        use tonic::Code;
        assert_eq!(item_vote(res(pb::Vote::Yes, "", Code::Ok, "")), Vote::Yes);
        assert_eq!(item_vote(res(pb::Vote::ReadOnly, "", Code::Ok, "")), Vote::ReadOnly);
        assert_eq!(
            item_vote(res(pb::Vote::No, "the resource refused", Code::Ok, "")),
            Vote::No("the resource refused".into())
        );
        assert!(matches!(
            item_vote(res(pb::Vote::Unspecified, "", Code::Ok, "")),
            Vote::Failed(_)
        ));
        match item_vote(res(pb::Vote::Unspecified, "", Code::FailedPrecondition, "stale-term")) {
            Vote::Failed(why) => assert!(why.contains("stale-term"), "{why}"),
            other => panic!("{other:?}"),
        }
        // A failed item never counts as a vote, whatever its vote field says.
        assert!(matches!(
            item_vote(res(pb::Vote::Yes, "", Code::Internal, "")),
            Vote::Failed(_)
        ));
    }
}
