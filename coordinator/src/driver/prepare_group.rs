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

use dtx_common::trace::TraceContext;
use dtx_proto::v1 as pb;
use tokio::time::Instant;
use tracing::Instrument;

use super::answer::vote_of;
use super::answer::DeliveryError;
use super::book::PrepareItem;
use super::group::Answer;
use super::group::Waiting;
use super::owner::Kind;
use super::owner::Msg;
use super::owner::PrepareBatch;
use super::owner::SenderMark;
use super::Driver;
use crate::sm::tally::Vote;
use crate::sm::Txid;

impl Driver {
    /// `p`'s answer to Prepare (`prepare_one`), through its address's
    /// PrepareMany queue; `None` when the address takes single calls.
    pub(super) async fn prepare_grouped(&self, addr: &str, req: pb::PrepareRequest, timeout: Duration) -> Option<Vote> {
        let item = PrepareItem {
            req,
            deadline: Instant::now() + timeout,
        };
        let addr = addr.to_string();
        let answer = self.mailbox.ask(|reply| Msg::Prepare { addr, item, reply });
        match tokio::time::timeout(timeout, answer).await {
            Err(_) => Some(Vote::Failed(format!("no vote within {} ms", timeout.as_millis()))),
            Ok(Some(Answer::Done(v))) => Some(v),
            Ok(Some(Answer::SendAlone)) => None,
            Ok(None) => Some(Vote::Failed(
                "the message carrying this prepare was dropped before it was answered".into(),
            )),
        }
    }

    /// The sender task of `addr`: sends `batch` at once, then the prepares
    /// queued meanwhile, one message at a time, until none is left.
    pub(super) async fn send_prepare_groups(
        self: Arc<Self>,
        addr: String,
        mut batch: PrepareBatch,
        mut mark: SenderMark,
    ) {
        while !batch.items.is_empty() {
            let PrepareBatch {
                items,
                riders,
                alone,
                traces,
            } = batch;
            let answers = if alone {
                for w in riders {
                    let _ = w.reply.send(Answer::SendAlone);
                }
                items.iter().map(|_| Answer::SendAlone).collect()
            } else {
                let prepares = items.iter().map(|w| w.item.clone()).collect();
                self.send_prepare_group(&addr, prepares, riders, &traces).await
            };
            for (w, a) in items.into_iter().zip(answers) {
                let _ = w.reply.send(a);
            }
            let next = addr.clone();
            batch = match self.mailbox.ask(|reply| Msg::TakePrepares { addr: next, reply }).await {
                Some(b) => b,
                None => return,
            };
        }
        mark.disarm();
    }

    /// Sends `batch` to `addr` in one PrepareMany message: one answer per
    /// item, in order. Decisions waiting for their own ApplyDecisions
    /// message to `addr` ride along (ADR 0030) and are answered from the
    /// same answer.
    async fn send_prepare_group(
        &self,
        addr: &str,
        batch: Vec<PrepareItem>,
        riders: Vec<Waiting<pb::DecisionItem, Result<(), DeliveryError>>>,
        traces: &[(Txid, Option<TraceContext>)],
    ) -> Vec<Answer<Vote>> {
        let decisions: Vec<pb::DecisionItem> = riders.iter().map(|w| w.item.clone()).collect();
        let (votes, ridden) = self.send_prepare_many(addr, batch, decisions, traces).await;
        if !riders.is_empty() {
            metrics::histogram!("dtx_prepare_riding_decisions").record(riders.len() as f64);
        }
        let ridden = match ridden {
            Ridden::Answered(results) => results,
            Ridden::Ignored => {
                // An SDK from before ADR 0030 dropped them unread: they go
                // again, each alone this once; later ones go by
                // ApplyDecisions only.
                self.mailbox.tell(Msg::NoRiders { addr: addr.to_string() });
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
        traces: &[(Txid, Option<TraceContext>)],
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
        // The riding decisions' traces are linked as well.
        super::mark_group_call(&span, traces, &mut req);
        let mut client = self.ctx.participant_over(ch);
        match tokio::time::timeout(timeout, client.prepare_many(req))
            .instrument(span)
            .await
        {
            Err(_) => every(format!("no answer within {} ms", timeout.as_millis())),
            Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {
                self.mailbox.tell(Msg::SingleCalls {
                    kind: Kind::Prepares,
                    addr: addr.to_string(),
                });
                let votes = (0..n).map(|_| Answer::SendAlone).collect();
                (votes, Ridden::Answered((0..d).map(|_| Answer::SendAlone).collect()))
            }
            Ok(Err(s)) => {
                if matches!(DeliveryError::from_status(&s), DeliveryError::Refused { .. }) {
                    // The participant answered (the give-up rule spares it, ADR 0041).
                    self.note_answered(addr);
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
                // The participant answered (the give-up rule spares it, ADR 0041).
                self.note_answered(addr);
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
                            .map(|r| Answer::Done(DeliveryError::of_item(r)))
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
