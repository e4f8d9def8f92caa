//! Log garbage collection: which decided records and READ_ONLY votes may
//! go ([`gc_safe`]: the cluster will send nothing more for them), and the
//! passes that remove them ([`collect_decided`], [`GcCursor`]).

use std::sync::Arc;

use dtx_client::Client;
use dtx_client::DecisionAnswer;
use dtx_client::DecisionRead;
use tracing::warn;

use super::cluster::ask;
use super::cluster::by_incarnation;
use super::cluster::RecoveryOptions;
use crate::log::GlobalTxid;
use crate::participant::Participant;

/// Garbage-collects log records (decided ones and READ_ONLY votes) that
/// became so at or before `decided_before_ms`, at most `max`, but only
/// those for which the cluster will send nothing more to `participant_id`
/// (this participant, as enlisted):
/// - COMMIT or ABORT with this participant's ack recorded
///   (`awaiting_ack == false`). While its ack is not recorded the leader
///   keeps delivering the decision, and only the record makes that
///   delivery a repeat (acked) instead of a commit without prepare
///   (refused forever): the case of a decision learned by recovery before
///   the leader's delivery got through;
/// - UNKNOWN_PRESUMED_ABORT: forgotten, which the cluster does only after
///   every participant acked.
///
/// A record whose transaction still reads PENDING is kept: a READ_ONLY vote
/// of an undecided transaction, or a one-phase commit whose answer never
/// reached the coordinator, which keeps re-sending `CommitOnePhase` (only
/// the record turns a re-send into a repeat instead of a second commit).
/// Returns how many were removed; an error means the cluster could not be
/// asked (or `participant_id` is empty), and nothing was removed.
pub async fn collect_decided<P: Participant>(
    store: &P,
    endpoints: &[String],
    participant_id: &str,
    decided_before_ms: u64,
    max: usize,
    local_ip: Option<std::net::IpAddr>,
) -> Result<usize, String> {
    let mut from_the_start = GcCursor::default();
    collect_decided_from(
        store,
        endpoints,
        participant_id,
        decided_before_ms,
        max,
        local_ip,
        &mut from_the_start,
    )
    .await
}

/// Where the next garbage-collection pass goes on from: after the last
/// candidate the previous pass looked at, back to the start once a pass
/// reached the end of what is old enough. Records the cluster still needs
/// are kept at the front of the index; without the cursor, `max` of them
/// would hide every later record from every pass (invariant 11).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GcCursor(Option<(u64, GlobalTxid)>);

impl GcCursor {
    /// Moves on after a pass that looked at `candidates` out of at most `max`.
    pub fn advance(&mut self, candidates: &[(u64, GlobalTxid)], max: usize) {
        self.0 = if candidates.len() < max {
            None
        } else {
            candidates.last().copied()
        };
    }

    /// The candidate the next pass starts after (`None`: from the start).
    pub fn after(&self) -> Option<(u64, GlobalTxid)> {
        self.0
    }
}

/// `collect_decided` for the candidates after `cursor`, which it moves on.
pub async fn collect_decided_from<P: Participant>(
    store: &P,
    endpoints: &[String],
    participant_id: &str,
    decided_before_ms: u64,
    max: usize,
    local_ip: Option<std::net::IpAddr>,
    cursor: &mut GcCursor,
) -> Result<usize, String> {
    let opts = RecoveryOptions::with_local_ip(local_ip);
    collect_with(
        store,
        || opts.client(endpoints),
        participant_id,
        decided_before_ms,
        max,
        cursor,
    )
    .await
}

/// `collect_decided_from`, asking through the client `client()` gives (made
/// only when there is something to ask about).
pub(super) async fn collect_with<P: Participant>(
    store: &P,
    client: impl FnOnce() -> Result<Arc<Client>, String>,
    participant_id: &str,
    decided_before_ms: u64,
    max: usize,
    cursor: &mut GcCursor,
) -> Result<usize, String> {
    if participant_id.is_empty() {
        return Err(
            "log garbage collection needs this participant's id (as enlisted) to ask whether the cluster still awaits its ack".into(),
        );
    }
    let candidates = store
        .gc_candidates_after(cursor.0, decided_before_ms, max)
        .await
        .map_err(|e| e.to_string())?;
    if candidates.is_empty() {
        cursor.advance(&candidates, max);
        return Ok(0);
    }
    let client = client()?;
    let mut safe: Vec<(u64, GlobalTxid)> = Vec::new();
    for (incarnation, group) in by_incarnation(&candidates, |(_, t)| *t) {
        let txids: Vec<u64> = group.iter().map(|(_, t)| t.txid).collect();
        let answers = ask(&client, incarnation, &txids, participant_id).await?;
        safe.extend(group.iter().zip(answers).filter(|(_, a)| gc_safe(a)).map(|(c, _)| *c));
    }
    let kept = candidates.len() - safe.len();
    if kept > 0 {
        warn!(
            kept,
            "decided log records kept past retention: the cluster has not recorded their outcome or this participant's ack yet"
        );
    }
    let removed = store.forget_records(&safe).await.map_err(|e| e.to_string())?;
    cursor.advance(&candidates, max);
    Ok(removed)
}

/// True when the cluster will send nothing more for the transaction to the
/// participant that asked (see `collect_decided`). A transaction the
/// cluster says its incarnation did not hand out
/// (`DecisionRead::OtherIncarnation`) is never safe: the cluster that did
/// may still send to it, and without the record a re-sent message would be
/// taken as the first.
pub fn gc_safe(a: &DecisionAnswer) -> bool {
    match a.decision {
        Some(DecisionRead::Committed | DecisionRead::Aborted) => !a.awaiting_ack,
        Some(DecisionRead::UnknownPresumedAbort) => true,
        Some(DecisionRead::Pending | DecisionRead::OtherIncarnation) | None => false,
    }
}
