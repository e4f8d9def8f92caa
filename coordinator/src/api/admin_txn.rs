//! The operator's transaction commands of the `Admin` service:
//! `ListTransactions`, `DropParticipant` and `ForgetTransaction`. All three
//! are served by the leader (a follower forwards them once). The rules of
//! dropping and forgetting are the state machine's (`sm::operator`): they
//! are checked here on a linearizable read, so a refused request writes
//! nothing, and again when the command is applied, since the state may
//! change in between.
//!
//! With authentication on, the recorded operator is the authenticated
//! caller, not the name typed (as for `Resolve`); only operators (and nodes
//! forwarding for them) may call these (`security`, invariant 12).

use std::sync::Arc;

use dtx_proto::v1 as pb;
use dtx_proto::v1::admin_client::AdminClient;
use prost::Message;
use tonic::Request;
use tonic::Response;
use tonic::Status;

use super::check_id;
use super::check_len;
use super::coordinator::add_delivery_attempts;
use super::coordinator::status_pb;
use super::coordinator::Audience;
use super::error::ApiError;
use super::serve_or_forward;
use crate::ctx::now_ms;
use crate::driver::Driver;
use crate::limits;
use crate::sm::operator::ListFilter;
use crate::sm::operator::StateFilter;
use crate::sm::Command;
use crate::sm::CommandOk;
use crate::sm::OperatorRefusal;

/// `ListTransactions`, served by the leader.
pub(crate) async fn list_transactions(
    driver: &Arc<Driver>,
    req: Request<pb::ListTransactionsRequest>,
) -> Result<Response<pb::ListTransactionsResponse>, Status> {
    serve_or_forward(
        &driver.ctx,
        req,
        |r| async move { list(driver, r).await },
        |ch, r| async move { AdminClient::new(ch).list_transactions(r).await },
    )
    .await
}

/// `DropParticipant`, served by the leader.
pub(crate) async fn drop_participant(
    driver: &Arc<Driver>,
    mut req: Request<pb::DropParticipantRequest>,
) -> Result<Response<pb::DropParticipantResponse>, Status> {
    // With authentication on, the drop records who proved to be calling.
    if let Some(id) = crate::security::caller(&req) {
        req.get_mut().operator = id.name;
    }
    serve_or_forward(
        &driver.ctx,
        req,
        |r| async move { drop_one(driver, r).await },
        |ch, r| async move { AdminClient::new(ch).drop_participant(r).await },
    )
    .await
}

/// `ForgetTransaction`, served by the leader.
pub(crate) async fn forget_transaction(
    driver: &Arc<Driver>,
    mut req: Request<pb::ForgetTransactionRequest>,
) -> Result<Response<pb::ForgetTransactionResponse>, Status> {
    if let Some(id) = crate::security::caller(&req) {
        req.get_mut().operator = id.name;
    }
    serve_or_forward(
        &driver.ctx,
        req,
        |r| async move { forget(driver, r).await },
        |ch, r| async move { AdminClient::new(ch).forget_transaction(r).await },
    )
    .await
}

/// NOT_FOUND for a transaction or participant that does not exist,
/// FAILED_PRECONDITION for the rest.
fn refused(r: OperatorRefusal) -> ApiError {
    if r.not_found() {
        ApiError::NotFound(r.to_string())
    } else {
        ApiError::FailedPrecondition(r.to_string())
    }
}

fn unexpected(ok: CommandOk) -> ApiError {
    ApiError::Internal(format!("unexpected state-machine result {ok:?}"))
}

/// The recorded note of an operator's action: "operator <name>: <reason>",
/// with the name an id and the reason required.
fn operator_note(operator: &str, reason: &str) -> Result<String, ApiError> {
    check_id("operator", operator)?;
    if reason.is_empty() {
        return Err(ApiError::InvalidArgument(
            "reason must not be empty: say why (it is recorded)".into(),
        ));
    }
    check_len("reason", reason.len(), limits::REASON_BYTES_MAX)?;
    Ok(format!("operator {operator}: {reason}"))
}

/// The page size asked for: 0 means the default; above the maximum is
/// refused.
fn page_records(limit: u32) -> Result<usize, ApiError> {
    match limit as usize {
        0 => Ok(limits::LIST_TRANSACTIONS_PAGE_RECORDS_DEFAULT),
        n if n > limits::LIST_TRANSACTIONS_PAGE_RECORDS_MAX => Err(ApiError::InvalidArgument(format!(
            "limit is {n}; the limit is {} records per page",
            limits::LIST_TRANSACTIONS_PAGE_RECORDS_MAX
        ))),
        n => Ok(n),
    }
}

fn state_filter(state: i32) -> Result<Option<StateFilter>, ApiError> {
    match pb::TxState::try_from(state) {
        Ok(pb::TxState::Unspecified) => Ok(None),
        Ok(pb::TxState::Active) => Ok(Some(StateFilter::Active)),
        Ok(pb::TxState::Preparing) => Ok(Some(StateFilter::Preparing)),
        Ok(pb::TxState::Decided) => Ok(Some(StateFilter::Decided)),
        Err(_) => Err(ApiError::InvalidArgument(format!(
            "state {state} is not a transaction state"
        ))),
    }
}

/// Cuts `page` (and moves `next_after` back to its new end) so that the
/// answer stays within `max_bytes`; keeps at least one transaction.
fn cut_to_bytes(page: &mut Vec<pb::StatusResponse>, next_after: &mut u64, max_bytes: usize) {
    let mut bytes = 0usize;
    let keep = page
        .iter()
        .position(|s| {
            bytes += s.encoded_len() + 8;
            bytes > max_bytes
        })
        .map(|i| i.max(1));
    if let Some(keep) = keep.filter(|k| *k < page.len()) {
        page.truncate(keep);
        *next_after = page.last().map(|s| s.txid).unwrap_or(0);
    }
}

async fn list(driver: &Driver, req: pb::ListTransactionsRequest) -> Result<pb::ListTransactionsResponse, ApiError> {
    let limit = page_records(req.limit)?;
    let state = state_filter(req.state)?;
    if !req.participant.is_empty() {
        check_id("participant", &req.participant)?;
    }
    let mut filter = ListFilter {
        state,
        min_age_ms: req.min_age_ms,
        now_ms: 0,
        participant: (!req.participant.is_empty()).then_some(req.participant),
        unacknowledged: req.unacknowledged,
        dropped: req.dropped,
    };
    let after = req.after_txid;
    let (mut transactions, mut next_after_txid, now) = driver
        .ctx
        .read_linearizable(move |st| {
            // The leader's clock, read after it confirmed its leadership.
            filter.now_ms = now_ms();
            // The records in memory and the retained ones (ADR 0050).
            let page = st.list(&filter, after, limit, limits::LIST_TRANSACTIONS_SCAN_RECORDS_MAX)?;
            let mut records: Vec<pb::StatusResponse> = Vec::with_capacity(page.txids.len());
            for t in &page.txids {
                records.extend(st.with_txid(*t, |table| table.get(*t).map(|r| status_pb(table, r)))?);
            }
            Ok::<_, ApiError>((records, page.next_after, filter.now_ms))
        })
        .await??;
    cut_to_bytes(
        &mut transactions,
        &mut next_after_txid,
        limits::LIST_TRANSACTIONS_PAGE_BYTES_MAX,
    );
    add_delivery_attempts(driver, &mut transactions, Audience::Operator).await;
    Ok(pb::ListTransactionsResponse {
        transactions,
        next_after_txid,
        now_unix_ms: now,
    })
}

async fn drop_one(driver: &Driver, req: pb::DropParticipantRequest) -> Result<pb::DropParticipantResponse, ApiError> {
    check_id("participant_id", &req.participant_id)?;
    let note = operator_note(&req.operator, &req.reason)?;
    let ctx = &driver.ctx;
    let txid = req.txid;
    let pid = req.participant_id;
    let dropped_before = ctx
        .read_linearizable(|st| st.with_txid(txid, |t| t.check_drop(txid, &pid)))
        .await??
        .map_err(refused)?;
    let recorded = if dropped_before {
        // The first drop's note and time stay; nothing to write.
        false
    } else {
        let cmd = Command::DropParticipant {
            txid,
            participant_id: pid,
            note,
            now_ms: now_ms(),
        };
        match ctx.propose(cmd).await? {
            CommandOk::ParticipantDropped { recorded } => recorded,
            CommandOk::OperatorRefused(r) => return Err(refused(r)),
            other => return Err(unexpected(other)),
        }
    };
    // Applied here (the leader) already: the local table shows the record
    // after the drop (none if an operator forgot it meanwhile).
    let transaction = ctx
        .sm
        .state()
        .with_txid(txid, |t| t.get(txid).map(|r| status_pb(t, r)))?;
    let mut transaction = transaction;
    if let Some(s) = &mut transaction {
        add_delivery_attempts(driver, std::slice::from_mut(s), Audience::Operator).await;
    }
    Ok(pb::DropParticipantResponse { recorded, transaction })
}

/// `Resolve` with `participant_lost` (ADR 0039), served by the
/// leader (the caller forwards): the one participant of an undecided
/// one-phase commit is declared lost for good and `req.outcome` recorded
/// as the operator's heuristic decision, the participant dropped with the
/// same note. A decision that stands already is the answer (write-once).
pub(super) async fn declare_lost(driver: &Driver, req: pb::ResolveRequest) -> Result<pb::ResolveResponse, ApiError> {
    let outcome = super::operator_outcome(req.outcome)?;
    if !req.voters.is_empty() {
        return Err(ApiError::InvalidArgument(
            "voters must be empty with participant_lost: the participant never voted; the outcome is the operator's"
                .into(),
        ));
    }
    let note = operator_note(&req.operator, &req.reason)?;
    let note = format!("{note} (participant declared lost; heuristic {outcome}, not the participant's answer)");
    check_len("note", note.len(), limits::NOTE_BYTES_MAX)?;
    let ctx = &driver.ctx;
    let txid = req.txid;
    // The one participant, on a linearizable read (a follower forwards).
    let found = ctx
        .read_linearizable(|st| {
            st.with_txid(txid, |t| {
                let pid = t.get(txid).and_then(|r| r.participants.first()).map(|p| p.id.clone());
                let check = t.check_declare_lost(txid, pid.as_deref().unwrap_or(""));
                (pid, check)
            })
        })
        .await??;
    let (pid, existing) = match found {
        (_, Err(r)) => return Err(refused(r)),
        (_, Ok(Some(d))) => {
            return Ok(pb::ResolveResponse {
                outcome: super::coordinator::outcome_pb(d.outcome) as i32,
                recorded: false,
            })
        }
        (Some(pid), Ok(None)) => (pid, ()),
        (None, Ok(None)) => {
            return Err(ApiError::Internal(format!(
                "one-phase transaction {txid} has no participant"
            )))
        }
    };
    let () = existing;
    let cmd = Command::DeclareLost {
        txid,
        participant_id: pid.clone(),
        outcome,
        term: ctx.current_term(),
        now_ms: now_ms(),
        note,
    };
    match ctx.propose(cmd).await? {
        CommandOk::Decided { decision, recorded } => {
            if recorded {
                driver.declared_lost(txid, &pid, &decision);
            }
            Ok(pb::ResolveResponse {
                outcome: super::coordinator::outcome_pb(decision.outcome) as i32,
                recorded,
            })
        }
        CommandOk::OperatorRefused(r) => Err(refused(r)),
        other => Err(unexpected(other)),
    }
}

async fn forget(driver: &Driver, req: pb::ForgetTransactionRequest) -> Result<pb::ForgetTransactionResponse, ApiError> {
    let note = operator_note(&req.operator, &req.reason)?;
    let ctx = &driver.ctx;
    let txid = req.txid;
    let found = ctx
        .read_linearizable(|st| st.with_txid(txid, |t| t.check_forget_by_operator(txid)))
        .await??
        .map_err(refused)?;
    if found.is_none() {
        // No record: never begun, or forgotten before. Txids are never
        // reused, so this stays true.
        return Ok(pb::ForgetTransactionResponse { forgotten: false });
    }
    match ctx.propose(Command::ForgetByOperator { txid, note }).await? {
        CommandOk::ForgottenByOperator { outcome } => Ok(pb::ForgetTransactionResponse {
            forgotten: outcome.is_some(),
        }),
        CommandOk::OperatorRefused(r) => Err(refused(r)),
        other => Err(unexpected(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_size_defaults_and_is_bounded() {
        assert_eq!(page_records(0).unwrap(), limits::LIST_TRANSACTIONS_PAGE_RECORDS_DEFAULT);
        assert_eq!(page_records(7).unwrap(), 7);
        let max = limits::LIST_TRANSACTIONS_PAGE_RECORDS_MAX as u32;
        assert_eq!(page_records(max).unwrap(), max as usize);
        match page_records(max + 1) {
            Err(ApiError::InvalidArgument(m)) => assert!(m.contains("1000"), "{m}"),
            other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
        }
    }

    #[test]
    fn operator_note_needs_an_operator_and_a_reason() {
        assert_eq!(
            operator_note("alice", "bank-b is gone").unwrap(),
            "operator alice: bank-b is gone"
        );
        for (op, reason, field) in [
            ("", "why", "operator"),
            ("alice", "", "reason"),
            (&"x".repeat(limits::ID_BYTES_MAX + 1), "why", "operator"),
            ("alice", &"r".repeat(limits::REASON_BYTES_MAX + 1), "reason"),
        ] {
            match operator_note(op, reason) {
                Err(ApiError::InvalidArgument(m)) => assert!(m.contains(field), "{m}"),
                other => panic!("expected INVALID_ARGUMENT naming {field}, got {other:?}"),
            }
        }
        // The longest note fits what the state machine accepts.
        let longest = operator_note(&"x".repeat(limits::ID_BYTES_MAX), &"r".repeat(limits::REASON_BYTES_MAX)).unwrap();
        assert!(longest.len() <= limits::NOTE_BYTES_MAX);
    }

    #[test]
    fn refusals_map_to_not_found_or_failed_precondition() {
        assert!(matches!(
            refused(OperatorRefusal::UnknownTransaction { txid: 1 }),
            ApiError::NotFound(_)
        ));
        assert!(matches!(
            refused(OperatorRefusal::NotEnlisted {
                txid: 1,
                participant_id: "x".into(),
                enlisted: vec!["a".into()]
            }),
            ApiError::NotFound(m) if m.contains("\"a\"")
        ));
        assert!(matches!(
            refused(OperatorRefusal::NotDecided { txid: 4 }),
            ApiError::FailedPrecondition(m) if m == "transaction 4 is not decided; resolve it first (admin txn resolve)"
        ));
    }

    #[test]
    fn a_page_is_cut_to_its_byte_budget_keeping_at_least_one() {
        let rec = |txid| pb::StatusResponse {
            txid,
            participants: vec![pb::ParticipantInfo {
                id: "p".repeat(100),
                ..Default::default()
            }],
            ..Default::default()
        };
        let one = rec(1).encoded_len() + 8;
        let mut page: Vec<_> = (1..=10).map(rec).collect();
        let mut next = 0;
        cut_to_bytes(&mut page, &mut next, one * 3);
        assert_eq!(page.iter().map(|s| s.txid).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(next, 3, "the next page starts after the last one kept");
        let mut page: Vec<_> = (1..=2).map(rec).collect();
        let mut next = 0;
        cut_to_bytes(&mut page, &mut next, 1);
        assert_eq!(page.len(), 1, "one record always goes");
        assert_eq!(next, 1);
        let mut page: Vec<_> = (1..=2).map(rec).collect();
        let mut next = 0;
        cut_to_bytes(&mut page, &mut next, one * 5);
        assert_eq!((page.len(), next), (2, 0), "within the budget: untouched");
    }

    #[test]
    fn states_map_and_unknown_values_are_refused() {
        assert_eq!(state_filter(0).unwrap(), None);
        assert_eq!(state_filter(2).unwrap(), Some(StateFilter::Preparing));
        assert!(matches!(state_filter(9), Err(ApiError::InvalidArgument(_))));
    }
}
