//! Repairs of many transactions at once: `txn drop-participant --participant
//! X --all` and `txn forget --participant X --all`, each with `--dry-run`.
//! The selection is a pure function of the listed records; each repair is
//! then the same call as for one txid (recorded with who and why), one after
//! the other, stopping at the first error with how many were done.

use dtx_proto::v1 as pb;
use serde_json::json;

use crate::admin_ctx::emit;
use crate::admin_ctx::list_all;
use crate::admin_ctx::Ctx;
use crate::admin_ctx::Failure;
use crate::admin_ctx::Outcome;

/// Txids printed in a text line before "and N more".
const TXIDS_SHOWN_MAX: usize = 50;

fn is_commit(t: &pb::StatusResponse) -> bool {
    t.decision
        .as_ref()
        .is_some_and(|d| d.outcome == pb::Outcome::Commit as i32)
}

/// The decided transactions of `txs` still waiting for `participant`'s
/// ack (enlisted, not acked, not dropped): what `drop-participant --all`
/// drops.
pub(crate) fn drop_selection(txs: &[pb::StatusResponse], participant: &str) -> Vec<u64> {
    txs.iter()
        .filter(|t| t.decision.is_some())
        .filter(|t| {
            t.participants
                .iter()
                .any(|p| p.id == participant && !p.acked && !p.dropped)
        })
        .map(|t| t.txid)
        .collect()
}

/// Why a decided transaction cannot be forgotten now, if it cannot: a
/// participant that was not dropped has not acked, or it is a COMMIT that
/// a dropped participant never acked (kept for reconciliation).
pub(crate) fn forget_blocker(t: &pb::StatusResponse) -> Option<&'static str> {
    if t.decision.is_none() {
        return Some("not decided");
    }
    if t.participants.iter().any(|p| !p.acked && !p.dropped) {
        return Some("waiting for a participant's ack (drop it first)");
    }
    if is_commit(t) && t.participants.iter().any(|p| p.dropped && !p.acked) {
        return Some("COMMIT with a dropped participant (kept until reconciled by hand)");
    }
    None
}

/// The decided transactions of `txs` that enlisted `participant` and may
/// be forgotten now; and the others with why not.
pub(crate) fn forget_selection(txs: &[pb::StatusResponse], participant: &str) -> (Vec<u64>, Vec<(u64, &'static str)>) {
    let mut take = Vec::new();
    let mut kept = Vec::new();
    for t in txs
        .iter()
        .filter(|t| t.participants.iter().any(|p| p.id == participant))
    {
        match forget_blocker(t) {
            None => take.push(t.txid),
            Some(why) => kept.push((t.txid, why)),
        }
    }
    (take, kept)
}

fn txid_list(txids: &[u64]) -> String {
    let shown: Vec<String> = txids.iter().take(TXIDS_SHOWN_MAX).map(u64::to_string).collect();
    let more = txids.len().saturating_sub(TXIDS_SHOWN_MAX);
    if more > 0 {
        format!("{} and {more} more", shown.join(", "))
    } else {
        shown.join(", ")
    }
}

/// Every decided transaction that enlisted `participant`.
async fn decided_with(ctx: &Ctx, participant: &str) -> Result<Vec<pb::StatusResponse>, Failure> {
    let (txs, _) = list_all(
        ctx,
        pb::ListTransactionsRequest {
            state: pb::TxState::Decided as i32,
            participant: participant.to_string(),
            limit: 1000,
            ..Default::default()
        },
    )
    .await?;
    Ok(txs)
}

/// A failure part-way: how many were done before it.
fn stopped(mut f: Failure, what: &str, done: usize, of: usize, txid: u64) -> Failure {
    f.message = format!(
        "{what} stopped at transaction {txid} after {done} of {of} (the rest are unchanged; run the same command \
         again to go on): {}",
        f.message
    );
    f
}

/// `txn drop-participant --participant X --all [--dry-run]`.
pub(crate) async fn drop_all(ctx: &Ctx, participant: &str, dry_run: bool, operator: &str, reason: &str) -> Outcome {
    let txs = decided_with(ctx, participant).await?;
    let selected = drop_selection(&txs, participant);
    if dry_run {
        emit(
            ctx,
            json!({"participant": participant, "dry_run": true, "count": selected.len(), "txids": selected}),
            || {
                format!(
                    "dry run: would drop {participant} from {} decided transaction(s) waiting for its ack{}{}; \
                     nothing changed",
                    selected.len(),
                    if selected.is_empty() { "" } else { ": " },
                    txid_list(&selected)
                )
            },
        );
        return Ok(());
    }
    let mut before = 0usize;
    for (i, txid) in selected.iter().enumerate() {
        let r = ctx
            .client
            .drop_participant(*txid, participant, operator, reason)
            .await
            .map_err(|e| stopped(Failure::from(e), "drop-participant --all", i, selected.len(), *txid))?;
        if !r.recorded {
            before += 1;
        }
    }
    emit(
        ctx,
        json!({"participant": participant, "dry_run": false, "count": selected.len(), "txids": selected,
            "dropped_before": before}),
        || {
            format!(
                "dropped {participant} from phase two of {} transaction(s){}{}{}; the decision must be applied there \
                 by hand (txn list --dropped)",
                selected.len(),
                if selected.is_empty() { "" } else { ": " },
                txid_list(&selected),
                if before > 0 {
                    format!(" ({before} of them were dropped before)")
                } else {
                    String::new()
                }
            )
        },
    );
    Ok(())
}

/// `txn forget --participant X --all [--dry-run]`.
pub(crate) async fn forget_all(ctx: &Ctx, participant: &str, dry_run: bool, operator: &str, reason: &str) -> Outcome {
    let txs = decided_with(ctx, participant).await?;
    let (selected, kept) = forget_selection(&txs, participant);
    let kept_json: Vec<serde_json::Value> = kept.iter().map(|(t, why)| json!({"txid": t, "why": why})).collect();
    let kept_line = || {
        if kept.is_empty() {
            String::new()
        } else {
            let txids: Vec<u64> = kept.iter().map(|(t, _)| *t).collect();
            format!(
                "\nkept {} transaction(s) that may not be forgotten yet ({}): {}",
                kept.len(),
                kept.iter()
                    .map(|(_, w)| *w)
                    .collect::<std::collections::BTreeSet<_>>()
                    .into_iter()
                    .collect::<Vec<_>>()
                    .join("; "),
                txid_list(&txids)
            )
        }
    };
    if dry_run {
        emit(
            ctx,
            json!({"participant": participant, "dry_run": true, "count": selected.len(), "txids": selected,
                "kept": kept_json}),
            || {
                format!(
                    "dry run: would forget {} decided transaction(s) of {participant}{}{}; nothing changed{}",
                    selected.len(),
                    if selected.is_empty() { "" } else { ": " },
                    txid_list(&selected),
                    kept_line()
                )
            },
        );
        return Ok(());
    }
    let mut gone_before = 0usize;
    for (i, txid) in selected.iter().enumerate() {
        let forgotten = ctx
            .client
            .forget_transaction(*txid, operator, reason)
            .await
            .map_err(|e| stopped(Failure::from(e), "forget --all", i, selected.len(), *txid))?;
        if !forgotten {
            gone_before += 1;
        }
    }
    emit(
        ctx,
        json!({"participant": participant, "dry_run": false, "count": selected.len(), "txids": selected,
            "forgotten_before": gone_before, "kept": kept_json}),
        || {
            format!(
                "forgot {} transaction(s) of {participant}{}{}{}",
                selected.len(),
                if selected.is_empty() { "" } else { ": " },
                txid_list(&selected),
                kept_line()
            )
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tx(txid: u64, outcome: Option<pb::Outcome>, parts: &[(&str, bool, bool)]) -> pb::StatusResponse {
        pb::StatusResponse {
            txid,
            decision: outcome.map(|o| pb::Decision {
                outcome: o as i32,
                ..Default::default()
            }),
            participants: parts
                .iter()
                .map(|(id, acked, dropped)| pb::ParticipantInfo {
                    id: id.to_string(),
                    acked: *acked,
                    dropped: *dropped,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn drop_all_selects_decided_transactions_still_waiting_for_that_participant() {
        use pb::Outcome::*;
        let txs = vec![
            tx(1, Some(Abort), &[("a", true, false), ("b", false, false)]),
            tx(2, Some(Commit), &[("a", true, false), ("b", true, false)]),
            tx(3, Some(Abort), &[("a", true, false), ("b", false, true)]),
            tx(4, None, &[("b", false, false)]),
            tx(5, Some(Abort), &[("a", false, false)]),
        ];
        assert_eq!(drop_selection(&txs, "b"), vec![1]);
        assert_eq!(drop_selection(&txs, "a"), vec![5]);
    }

    #[test]
    fn forget_all_takes_what_may_be_forgotten_and_says_why_it_keeps_the_rest() {
        use pb::Outcome::*;
        let txs = vec![
            tx(1, Some(Abort), &[("a", true, false), ("b", false, true)]),
            tx(2, Some(Commit), &[("a", true, false), ("b", false, true)]),
            tx(3, Some(Abort), &[("a", false, false), ("b", false, true)]),
            tx(4, Some(Commit), &[("a", true, false), ("b", true, false)]),
            tx(5, Some(Abort), &[("a", true, false)]),
        ];
        let (take, kept) = forget_selection(&txs, "b");
        assert_eq!(take, vec![1, 4]);
        assert_eq!(kept.iter().map(|k| k.0).collect::<Vec<_>>(), vec![2, 3]);
        assert!(kept[0].1.contains("COMMIT with a dropped participant"));
        assert!(kept[1].1.contains("waiting"));
    }
}
