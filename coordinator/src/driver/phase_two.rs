//! Phase two in groups (ADR 0013): the decisions the leader delivers to one
//! participant address travel together in `ParticipantService.ApplyDecisions`
//! messages, which the participant applies in one durable write, instead of
//! one Commit or Abort call (and one write) per transaction.
//!
//! Each delivery (`Driver::deliver_one`, one per transaction and
//! participant) is unchanged: it takes its turn from the address's health
//! record, makes one attempt, reports what the attempt showed, keeps its own
//! attempts, backoff and refusals, and records its own ack. Only the attempt
//! itself goes through here: its item joins the address's queue, and
//! - with no message to that address in flight, a sender task starts; it
//!   waits up to `txn.delivery_batch_wait_us` for more items, then sends
//!   every queued item (at most `limits::DECISION_DELIVERY_ITEMS_MAX`) in one
//!   message;
//! - while a message is in flight, items queue up and go in the next one,
//!   sent as soon as the answer is in;
//! - the answer's result for each item is that item's attempt: applied, or
//!   refused with the same kinds the single calls carry (a refusal is about
//!   that transaction only); a call that fails as a whole (no answer, a
//!   timeout, the participant failing) is a failed attempt of each of its
//!   items, which then report it to the health record each, as before.
//!
//! So one stuck transaction never holds back the others (invariant 11): a
//! refused item backs off alone, and a message carries only what is queued
//! when it leaves. A participant that answers UNIMPLEMENTED (an SDK from
//! before ApplyDecisions) is remembered per address for
//! `group::SINGLE_CALLS_FOR` and gets one Commit or Abort call per
//! delivery, as before. The per-address queue is `group::Groups`, shared
//! with the prepares (`prepare_group`).
//!
//! Acks are not sent from here: each delivery records its own through the
//! ack queue (ADR 0007), so the acks of one answer reach Raft together.

use std::sync::Arc;
use std::time::Duration;

use dtx_common::trace::TraceContext;
use dtx_proto::v1 as pb;
use tracing::Instrument;

use super::answer::DeliveryError;
use super::group::Answer;
use super::owner::DecisionBatch;
use super::owner::Kind;
use super::owner::Msg;
use super::owner::SenderMark;
use super::Driver;
use crate::sm::Outcome;
use crate::sm::Participant;
use crate::sm::Txid;

impl Driver {
    /// One delivery attempt of `outcome` of `txid` to `p`, grouped with the
    /// other deliveries to its address into one ApplyDecisions message (or a
    /// Commit or Abort call of its own, for a participant that does not
    /// serve ApplyDecisions).
    pub(super) async fn send_decision_grouped(
        &self,
        txid: Txid,
        term: u64,
        outcome: Outcome,
        p: &Participant,
    ) -> Result<(), DeliveryError> {
        let item = pb::DecisionItem {
            txid,
            term,
            participant_id: p.id.clone(),
            outcome: match outcome {
                Outcome::Commit => pb::DecisionOutcome::Commit,
                Outcome::Abort => pb::DecisionOutcome::Abort,
            } as i32,
            incarnation: self.ctx.incarnation_of(txid),
        };
        let addr = p.address.clone();
        match self.mailbox.ask(|reply| Msg::Decision { addr, item, reply }).await {
            Some(Answer::Done(r)) => r,
            Some(Answer::SendAlone) => self.send_decision(txid, term, outcome, p).await,
            None => Err(DeliveryError::NoAnswer(
                "the message carrying this decision was dropped before it was answered".into(),
            )),
        }
    }

    /// The sender task of `addr`: waits `txn.delivery_batch_wait_us`, then
    /// sends its queued items, one message at a time, until none is left.
    pub(super) async fn send_groups(self: Arc<Self>, addr: String, mut mark: SenderMark) {
        let wait = Duration::from_micros(self.ctx.config.txn.delivery_batch_wait_us);
        if !wait.is_zero() {
            tokio::time::sleep(wait).await;
        }
        loop {
            let next = addr.clone();
            let Some(DecisionBatch { items, alone, traces }) =
                self.mailbox.ask(|reply| Msg::TakeDecisions { addr: next, reply }).await
            else {
                return;
            };
            if items.is_empty() {
                mark.disarm();
                return;
            }
            let answers = if alone {
                items.iter().map(|_| Answer::SendAlone).collect()
            } else {
                self.send_group(&addr, items.iter().map(|w| w.item.clone()).collect(), &traces)
                    .await
            };
            for (w, a) in items.into_iter().zip(answers) {
                let _ = w.reply.send(a);
            }
        }
    }

    /// Sends `batch` to `addr` in one ApplyDecisions message: one answer per
    /// item, in order.
    async fn send_group(
        &self,
        addr: &str,
        batch: Vec<pb::DecisionItem>,
        traces: &[(Txid, Option<TraceContext>)],
    ) -> Vec<Answer<Result<(), DeliveryError>>> {
        let n = batch.len();
        metrics::histogram!("dtx_delivery_batch_items").record(n as f64);
        let every = |e: DeliveryError| (0..n).map(|_| Answer::Done(Err(e.clone()))).collect();
        let ch = match self.ctx.api_channel(addr) {
            Ok(c) => c,
            Err(e) => {
                return every(DeliveryError::Refused {
                    message: format!("bad participant address {addr:?}: {e}"),
                    stale_term: false,
                })
            }
        };
        let timeout = Duration::from_millis(self.ctx.config.txn.prepare_timeout_ms);
        let mut req = tonic::Request::new(pb::ApplyDecisionsRequest { items: batch });
        req.set_timeout(timeout);
        // Many transactions: the span names the first item's trace and
        // links the others' (no txid field: each item's is in its own
        // delivery's log lines).
        let span = tracing::info_span!(
            "participant_call",
            rpc = "ApplyDecisions",
            address = %addr,
            items = n,
            trace_id = tracing::field::Empty,
        );
        super::mark_group_call(&span, traces, &mut req);
        let mut client = self.ctx.participant_over(ch);
        match tokio::time::timeout(timeout, client.apply_decisions(req))
            .instrument(span)
            .await
        {
            Err(_) => every(DeliveryError::NoAnswer(format!(
                "no answer within {} ms",
                timeout.as_millis()
            ))),
            Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {
                self.mailbox.tell(Msg::SingleCalls {
                    kind: Kind::Decisions,
                    addr: addr.to_string(),
                });
                (0..n).map(|_| Answer::SendAlone).collect()
            }
            Ok(Err(s)) => every(DeliveryError::from_status(&s)),
            Ok(Ok(r)) => {
                // The participant answered (the give-up rule spares it, ADR 0041).
                self.note_answered(addr);
                let results = r.into_inner().results;
                if results.len() != n {
                    return every(DeliveryError::NoAnswer(format!(
                        "malformed ApplyDecisions answer: {} results for {} items",
                        results.len(),
                        n
                    )));
                }
                results
                    .into_iter()
                    .map(|r| Answer::Done(DeliveryError::of_item(r)))
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item_result(r: pb::DecisionItemResult) -> Result<(), DeliveryError> {
        DeliveryError::of_item(r)
    }

    fn refused(code: tonic::Code, refusal: &str) -> pb::DecisionItemResult {
        pb::DecisionItemResult {
            applied: false,
            code: code as i32,
            refusal: refusal.into(),
            message: "why".into(),
        }
    }

    /// An item's result means what the single call's answer meant: a
    /// stale-term refusal is fencing (known by its kind, not its text), a
    /// protocol refusal is about the transaction, INTERNAL is about the
    /// participant as a whole.
    #[test]
    fn item_results_are_sorted_like_single_call_answers() {
        assert_eq!(
            item_result(pb::DecisionItemResult {
                applied: true,
                ..Default::default()
            }),
            Ok(())
        );
        assert_eq!(
            item_result(refused(tonic::Code::FailedPrecondition, "stale-term")),
            Err(DeliveryError::Refused {
                message: format!("{}: why", tonic::Code::FailedPrecondition),
                stale_term: true
            })
        );
        for kind in ["commit-without-prepare", "commit-after-abort", "abort-after-commit", ""] {
            assert_eq!(
                item_result(refused(tonic::Code::FailedPrecondition, kind)),
                Err(DeliveryError::Refused {
                    message: format!("{}: why", tonic::Code::FailedPrecondition),
                    stale_term: false
                }),
                "{kind:?}"
            );
        }
        assert_eq!(
            item_result(refused(tonic::Code::InvalidArgument, "")),
            Err(DeliveryError::Refused {
                message: format!("{}: why", tonic::Code::InvalidArgument),
                stale_term: false
            })
        );
        assert!(matches!(
            item_result(refused(tonic::Code::Internal, "")),
            Err(DeliveryError::NoAnswer(_))
        ));
        assert!(matches!(
            item_result(refused(tonic::Code::Ok, "")),
            Err(DeliveryError::Refused { stale_term: false, .. })
        ));
    }
}
