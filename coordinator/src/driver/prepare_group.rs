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
    /// item, in order.
    async fn send_prepare_group(&self, addr: &str, batch: Vec<PrepareItem>) -> Vec<Answer<Vote>> {
        let n = batch.len();
        metrics::histogram!("dtx_prepare_batch_items").record(n as f64);
        let every = |why: String| (0..n).map(|_| Answer::Done(Vote::Failed(why.clone()))).collect();
        let ch = match self.ctx.api_channel(addr) {
            Ok(c) => c,
            Err(e) => return every(e.to_string()),
        };
        let deadline = batch.iter().map(|it| it.deadline).max().unwrap_or_else(Instant::now);
        let timeout = deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        let txids: Vec<Txid> = batch.iter().map(|it| it.req.txid).collect();
        let mut req = tonic::Request::new(pb::PrepareManyRequest {
            items: batch.into_iter().map(|it| it.req).collect(),
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
            trace_id = tracing::field::Empty,
        );
        self.mark_group_call(&span, &txids, &mut req);
        let mut client = self.ctx.participant_over(ch);
        match tokio::time::timeout(timeout, client.prepare_many(req))
            .instrument(span)
            .await
        {
            Err(_) => every(format!("no vote within {} ms", timeout.as_millis())),
            Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {
                if self.state.prepare_groups.remember_single_calls(addr) {
                    info!(
                        address = %addr,
                        "participant does not serve PrepareMany (an older SDK): it gets one Prepare call per prepare"
                    );
                }
                (0..n).map(|_| Answer::SendAlone).collect()
            }
            Ok(Err(s)) => every(format!("{}: {}", s.code(), s.message())),
            Ok(Ok(r)) => {
                let results = r.into_inner().results;
                if results.len() != n {
                    return every(format!(
                        "malformed PrepareMany answer: {} results for {n} items",
                        results.len()
                    ));
                }
                results.into_iter().map(|r| Answer::Done(item_vote(r))).collect()
            }
        }
    }
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
