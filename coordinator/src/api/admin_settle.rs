//! `Admin.SettleOther` (ADR 0040): an operator settles a txid ANOTHER
//! incarnation handed out (after a restore, one the old cluster handed out
//! after the backup), so that a participant holding an in-doubt vote for
//! it gets a recorded decision (invariant 5) instead of
//! OUTCOME_OTHER_INCARNATION for ever.
//!
//! Served by the leader (a follower forwards it once):
//! 1. checks the request, and on a linearizable read the state machine's
//!    rules (`Settlements::check`): refused for incarnation 0 and a txid of
//!    this cluster's own history; a settlement that stands is the answer
//!    (write-once), and nothing is asked;
//! 2. asks every participant the operator named what its durable log holds
//!    for (incarnation, txid) (`Inquire`, through the participant gate:
//!    invariant 13) and judges that evidence (`settlement::judge_evidence`);
//! 3. proposes `Command::SettleOther` with the note "operator <name>:
//!    <reason> (evidence: ...)"; the state machine checks its rules again
//!    at apply and keeps the first settlement.
//!
//! With authentication on, the recorded operator is the authenticated
//! caller (invariant 12); only operators (and nodes forwarding for them)
//! may call it (`security`).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use dtx_proto::v1 as pb;
use dtx_proto::v1::admin_client::AdminClient;
use tonic::Request;
use tonic::Response;
use tonic::Status;
use tracing::info;

use super::check_id;
use super::check_len;
use super::coordinator::outcome_pb;
use super::error::ApiError;
use super::serve_or_forward;
use crate::ctx::now_ms;
use crate::driver::truncate_utf8;
use crate::driver::Driver;
use crate::limits;
use crate::sm::settlement::judge_evidence;
use crate::sm::settlement::Held;
use crate::sm::Command;
use crate::sm::CommandOk;
use crate::sm::Settlement;

/// `SettleOther`, served by the leader.
pub(crate) async fn settle_other(
    driver: &Arc<Driver>,
    mut req: Request<pb::SettleOtherRequest>,
) -> Result<Response<pb::SettleOtherResponse>, Status> {
    // With authentication on, the settlement records who proved to be
    // calling, not a name the caller typed.
    if let Some(id) = crate::security::caller(&req) {
        req.get_mut().operator = id.name;
    }
    serve_or_forward(
        &driver.ctx,
        req,
        |r| async move { settle(driver, r).await },
        |ch, r| async move { AdminClient::new(ch).settle_other(r).await },
    )
    .await
}

fn response(s: &Settlement, recorded: bool) -> pb::SettleOtherResponse {
    pb::SettleOtherResponse {
        outcome: outcome_pb(s.outcome) as i32,
        recorded,
        note: s.note.clone(),
        settled_unix_ms: s.settled_ms,
        term: s.term,
    }
}

/// The request's participants, checked: 1..=PARTICIPANTS_MAX, each id an
/// id and named once, each address given.
fn checked_participants(ps: &[pb::SettleParticipant]) -> Result<(), ApiError> {
    if ps.is_empty() {
        return Err(ApiError::InvalidArgument(
            "participants must not be empty: name the participants of the transaction (their records are the \
             evidence)"
                .into(),
        ));
    }
    if ps.len() > limits::PARTICIPANTS_MAX {
        return Err(ApiError::InvalidArgument(format!(
            "{} participants; a transaction has at most {}",
            ps.len(),
            limits::PARTICIPANTS_MAX
        )));
    }
    let mut seen = BTreeSet::new();
    for p in ps {
        check_id("participant_id", &p.participant_id)?;
        if p.address.is_empty() {
            return Err(ApiError::InvalidArgument(format!(
                "participant {:?} has no address: give where its participant service answers (ID=HOST:PORT)",
                p.participant_id
            )));
        }
        check_len("address", p.address.len(), limits::ADDRESS_BYTES_MAX)?;
        if !seen.insert(p.participant_id.as_str()) {
            return Err(ApiError::InvalidArgument(format!(
                "participant {:?} is named twice",
                p.participant_id
            )));
        }
    }
    Ok(())
}

async fn settle(driver: &Driver, req: pb::SettleOtherRequest) -> Result<pb::SettleOtherResponse, ApiError> {
    let outcome = super::operator_outcome(req.outcome)?;
    check_id("operator", &req.operator)?;
    if req.reason.is_empty() {
        return Err(ApiError::InvalidArgument(
            "reason must not be empty: say why (it is recorded, and participants log it)".into(),
        ));
    }
    check_len("reason", req.reason.len(), limits::REASON_BYTES_MAX)?;
    checked_participants(&req.participants)?;
    let (incarnation, txid) = (req.incarnation, req.txid);
    let ctx = &driver.ctx;
    // The state machine's rules on a linearizable read: refusals and a
    // settlement that stands need no participant asked.
    let standing = ctx
        .read_linearizable(|st| {
            st.settlements
                .check(&st.incarnations, incarnation, txid)
                .map(|s| s.cloned())
        })
        .await?
        .map_err(|r| ApiError::FailedPrecondition(r.to_string()))?;
    if let Some(s) = standing {
        return Ok(response(&s, false));
    }
    // The evidence: what each named participant's durable log holds.
    let timeout = Duration::from_millis(ctx.config.txn.prepare_timeout_ms);
    let held: Vec<(String, Held)> = futures::future::join_all(req.participants.iter().map(|p| async move {
        let h = async {
            let ch = ctx.api_channel(&p.address).map_err(|e| e.to_string())?;
            let mut rq = Request::new(pb::InquireRequest {
                txid,
                participant_id: p.participant_id.clone(),
                incarnation,
            });
            rq.set_timeout(timeout);
            dtx_proto::attach_txid(&mut rq, txid);
            match tokio::time::timeout(timeout, ctx.participant_over(ch).inquire(rq)).await {
                Err(_) => Err(format!("no answer within {} ms", timeout.as_millis())),
                Ok(Err(s)) => Err(format!("{} at {}: {}", s.code(), p.address, s.message())),
                Ok(Ok(r)) => Ok(r.into_inner().record),
            }
        }
        .await;
        let h = match h.map(pb::LocalRecord::try_from) {
            Ok(Ok(pb::LocalRecord::None)) => Held::None,
            Ok(Ok(pb::LocalRecord::PreparedYes)) => Held::PreparedYes,
            Ok(Ok(pb::LocalRecord::PreparedReadOnly)) => Held::PreparedReadOnly,
            Ok(Ok(pb::LocalRecord::Committed)) => Held::Committed,
            Ok(Ok(pb::LocalRecord::Aborted)) => Held::Aborted,
            Ok(Ok(pb::LocalRecord::Tombstone)) => Held::Tombstone,
            Ok(Ok(pb::LocalRecord::Unspecified)) | Ok(Err(_)) => {
                Held::NoAnswer("an answer this node cannot read".to_string())
            }
            Err(e) => Held::NoAnswer(e),
        };
        (p.participant_id.clone(), h)
    }))
    .await;
    let evidence = judge_evidence(outcome, &held).map_err(|why| {
        let mut why = format!("settling txid {txid} of incarnation {incarnation:016x}: {why}");
        truncate_utf8(&mut why, limits::REASON_BYTES_MAX);
        ApiError::FailedPrecondition(why)
    })?;
    let mut note = format!("operator {}: {} (evidence: {evidence})", req.operator, req.reason);
    truncate_utf8(&mut note, limits::NOTE_BYTES_MAX);
    let cmd = Command::SettleOther {
        incarnation,
        txid,
        outcome,
        term: ctx.current_term(),
        now_ms: now_ms(),
        note,
    };
    match ctx.propose(cmd).await? {
        CommandOk::Settled { settlement, recorded } => {
            if recorded {
                info!(
                    incarnation = format!("{incarnation:016x}"),
                    txid,
                    outcome = %settlement.outcome,
                    "settled another incarnation's transaction; participants' recovery applies it"
                );
            }
            Ok(response(&settlement, recorded))
        }
        other => Err(ApiError::Internal(format!("unexpected state-machine result {other:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(id: &str, addr: &str) -> pb::SettleParticipant {
        pb::SettleParticipant {
            participant_id: id.into(),
            address: addr.into(),
        }
    }

    /// Bad input is refused with what was wrong, before anything is asked.
    #[test]
    fn participants_are_checked_with_a_clear_error() {
        assert!(checked_participants(&[p("a", "127.0.0.1:1"), p("b", "127.0.0.1:2")]).is_ok());
        let cases: Vec<(Vec<pb::SettleParticipant>, &str)> = vec![
            (vec![], "must not be empty"),
            (vec![p("", "127.0.0.1:1")], "participant_id"),
            (vec![p("a", "")], "has no address"),
            (vec![p("a", "127.0.0.1:1"), p("a", "127.0.0.1:2")], "named twice"),
            (vec![p("a", &"x".repeat(limits::ADDRESS_BYTES_MAX + 1))], "address"),
            (
                (0..=limits::PARTICIPANTS_MAX)
                    .map(|i| p(&format!("p{i}"), "127.0.0.1:1"))
                    .collect(),
                "at most",
            ),
        ];
        for (ps, want) in cases {
            match checked_participants(&ps) {
                Err(ApiError::InvalidArgument(m)) => assert!(m.contains(want), "{m}"),
                other => panic!("expected INVALID_ARGUMENT with {want:?}, got {other:?}"),
            }
        }
    }
}
