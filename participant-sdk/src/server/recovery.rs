//! Recovery of in-doubt transactions: asking the cluster for their
//! decisions and applying the known ones, once ([`recover_once`] and its
//! variants) or in a loop that also garbage-collects the log and sets the
//! in-doubt gauges ([`spawn_recovery_with`]).

use std::sync::Arc;
use std::time::Duration;

use dtx_client::BranchDecision;
use dtx_client::Client;
use dtx_client::DecisionRead;
use tracing::error;
use tracing::info;
use tracing::warn;

use super::cluster::ask;
use super::cluster::by_incarnation;
use super::cluster::RecoveryOptions;
use super::gc::collect_with;
use super::gc::GcCursor;
use crate::log::GlobalTxid;
use crate::log::LocalState;
use crate::log::LogEntry;
use crate::log::Message;
use crate::log::Vote;
use crate::participant::Participant;

/// Asks the cluster (any node of `endpoints`; reads are linearizable and
/// forwarded to the leader) for the decisions of every in-doubt transaction
/// and applies the known ones. Returns how many were resolved; undecided
/// ones stay in doubt with their locks held (invariant 5). An error means
/// the cluster could not be asked (no quorum): keep waiting and retry.
/// Asks with the [`RecoveryOptions::client_config`] of the default options.
pub async fn recover_once<P: Participant>(store: &P, endpoints: &[String]) -> Result<usize, String> {
    recover_older_than(store, endpoints, Duration::ZERO, None).await
}

/// `recover_once` for the in-doubt transactions whose YES vote is at least
/// `age_min` old (see `ParticipantStore::in_doubt_older_than`), asking from
/// `local_ip` when set.
pub async fn recover_older_than<P: Participant>(
    store: &P,
    endpoints: &[String],
    age_min: Duration,
    local_ip: Option<std::net::IpAddr>,
) -> Result<usize, String> {
    recover_with(store, endpoints, age_min, &RecoveryOptions::with_local_ip(local_ip)).await
}

/// `recover_older_than` asking with `opts`'s client settings (its TLS
/// settings and token included).
pub async fn recover_with<P: Participant>(
    store: &P,
    endpoints: &[String],
    age_min: Duration,
    opts: &RecoveryOptions,
) -> Result<usize, String> {
    let (in_doubt, branches) = list_in_doubt(store, age_min).await.map_err(|e| e.to_string())?;
    if in_doubt.is_empty() && branches.is_empty() {
        return Ok(0);
    }
    let client = opts.client(endpoints)?;
    let settled = resolve_branches(store, &branches, &client).await?;
    Ok(settled + resolve_in_doubt(store, &in_doubt, &client).await?)
}

/// Applies the cluster's recorded decision `msg` (Commit or Abort, in
/// the term the record had when it was listed). A leader's message that
/// raised the record's term since makes that term stale; the decision is
/// the cluster's all the same, so it is applied in the record's term now,
/// once read again. True when it was applied by this call; false when the
/// record was no longer held (phase two got there first: nothing to do).
async fn apply_decided<P: Participant>(
    store: &P,
    txid: GlobalTxid,
    msg: Message,
) -> Result<bool, crate::participant::StoreError> {
    match store.handle(txid, msg, b"").await {
        Ok(_) => Ok(true),
        Err(crate::participant::StoreError::Refused(crate::log::Refusal::StaleTerm { .. })) => {
            let Some(entry) = store.durable_entry(txid).await? else {
                return Ok(false);
            };
            if !matches!(entry.state, LocalState::Prepared { .. }) {
                return Ok(false);
            }
            let again = match msg {
                Message::Commit { .. } => Message::Commit { term: entry.term },
                _ => Message::Abort { term: entry.term },
            };
            store.handle(txid, again, b"").await.map(|_| true)
        }
        Err(e) => Err(e),
    }
}

/// The in-doubt transactions whose vote is at least `age_min` old, and,
/// apart, the branches whose registration is not known to be recorded.
/// Both leave out every branch that is not known to be a member: those
/// of the second list, and those whose flow still registers them here
/// (in neither list): their transaction's decision is not theirs to apply
/// unless they are members. The in-doubt list is read first, so a flow
/// that starts after it is not in it, and one that ends after it ended
/// as a member or rolled back (an answer then refused, harmlessly).
async fn list_in_doubt<P: Participant>(
    store: &P,
    age_min: Duration,
) -> Result<(Vec<(GlobalTxid, LogEntry)>, Vec<(GlobalTxid, String)>), crate::participant::StoreError> {
    let mut in_doubt = store.in_doubt_older_than(age_min).await?;
    let branches = store.unregistered_branches().await?;
    let mut not_members: std::collections::HashSet<GlobalTxid> = branches.iter().map(|(t, _)| *t).collect();
    not_members.extend(store.branches_in_flight());
    if !not_members.is_empty() {
        in_doubt.retain(|(t, _)| !not_members.contains(t));
    }
    Ok((in_doubt, branches))
}

/// Settles branches that prepared here and whose registration is not
/// known to be recorded, asking the cluster by (txid, participant)
/// (`Client::branch_decision`): a member of a decided transaction applies
/// its decision; a member of an undecided one becomes an ordinary in-doubt
/// vote (its mark goes); a branch that is not a member rolls back, also
/// when the transaction committed without it (the cluster fences it out of
/// an open one first). Another incarnation's txid keeps its work and mark.
/// Returns how many were settled; an error once the others are done if the
/// cluster could not be asked about some.
async fn resolve_branches<P: Participant>(
    store: &P,
    branches: &[(GlobalTxid, String)],
    client: &Client,
) -> Result<usize, String> {
    let mut settled = 0;
    let mut failed = None;
    for (txid, participant_id) in branches {
        // The local record first: a mark whose work is already decided
        // here (phase two reached it before this pass, or the mark's
        // removal was lost in a crash) asks nothing; asking would fence,
        // and an ABORT for a committed record would be refused forever.
        let term = match store.durable_entry(*txid).await {
            Ok(Some(e)) if e.state == LocalState::Prepared { vote: Vote::Yes } => e.term,
            Ok(_) => {
                if let Err(e) = store.unmark_branch(*txid).await {
                    failed = Some(e.to_string());
                }
                continue;
            }
            Err(e) => {
                failed = Some(e.to_string());
                continue;
            }
        };
        let answer = match client
            .branch_decision(txid.txid, participant_id, txid.incarnation)
            .await
        {
            Ok(a) => a,
            Err(e) => {
                failed = Some(format!("branch {participant_id} of {txid}: {e}"));
                continue;
            }
        };
        let msg = match answer {
            BranchDecision::Commit => Message::Commit { term },
            BranchDecision::Abort { member } => {
                if !member {
                    info!(
                        txid = txid.txid,
                        incarnation = txid.incarnation,
                        participant = %dtx_tls::logtext::Clean(participant_id),
                        "branch not in its transaction's participant set: rolling its prepared work back"
                    );
                }
                Message::Abort { term }
            }
            BranchDecision::Pending => {
                // A member: its decision comes in phase two, or from the
                // in-doubt pass.
                if let Err(e) = store.unmark_branch(*txid).await {
                    failed = Some(e.to_string());
                }
                continue;
            }
            BranchDecision::OtherIncarnation => {
                warn!(
                    txid = txid.txid,
                    incarnation = format!("{:016x}", txid.incarnation),
                    "branch of a transaction the cluster did not hand out in this incarnation: its work and locks \
                     are kept; resolve it with the cluster that handed it out"
                );
                continue;
            }
        };
        match apply_decided(store, *txid, msg).await {
            Ok(false) => {
                if let Err(e) = store.unmark_branch(*txid).await {
                    failed = Some(e.to_string());
                }
            }
            Ok(true) => {
                info!(
                    txid = txid.txid,
                    incarnation = txid.incarnation,
                    "branch settled by recovery: {msg:?}"
                );
                settled += 1;
                if let Err(e) = store.unmark_branch(*txid).await {
                    failed = Some(e.to_string());
                }
            }
            Err(e) => warn!(
                txid = txid.txid,
                incarnation = txid.incarnation,
                "recovery could not apply {msg:?} to a branch: {e}"
            ),
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(settled),
    }
}

/// Asks the cluster about `in_doubt` and applies the known decisions:
/// once per incarnation (`Client::decisions_in`), since a txid means a
/// transaction only together with the incarnation that handed it out. A
/// transaction the cluster says another incarnation handed out
/// (`DecisionRead::OtherIncarnation`: another cluster's, or the cluster's
/// from after the backup it was restored from) keeps its record and its
/// locks: nothing is presumed about it; it is logged and counted
/// (`dtx_participant_recovery_lookups_total{outcome="other_incarnation"}`)
/// for an operator. An incarnation the cluster could not be asked about
/// is an error once the others are done.
async fn resolve_in_doubt<P: Participant>(
    store: &P,
    in_doubt: &[(GlobalTxid, LogEntry)],
    client: &Client,
) -> Result<usize, String> {
    let mut resolved = 0;
    let mut failed = None;
    for (incarnation, group) in by_incarnation(in_doubt, |(t, _)| *t) {
        match resolve_group(store, incarnation, &group, client, in_doubt.len(), &mut resolved).await {
            Ok(()) => {}
            Err(e) => failed = Some(e),
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(resolved),
    }
}

/// `resolve_in_doubt` for the transactions of one incarnation.
async fn resolve_group<P: Participant>(
    store: &P,
    incarnation: u64,
    in_doubt: &[(GlobalTxid, LogEntry)],
    client: &Client,
    total: usize,
    resolved: &mut usize,
) -> Result<(), String> {
    let txids: Vec<u64> = in_doubt.iter().map(|(t, _)| t.txid).collect();
    let answers = match ask(client, incarnation, &txids, "").await {
        Ok(a) => a,
        Err(e) => {
            metrics::counter!("dtx_participant_recovery_lookups_total", "outcome" => "error")
                .increment(txids.len() as u64);
            return Err(e);
        }
    };
    let mut other: Vec<u64> = Vec::new();
    for (answer, (txid, entry)) in answers.into_iter().zip(in_doubt) {
        if !answer.settled_by.is_empty() {
            // Another incarnation's txid that an operator of the cluster
            // settled (ADR 0040): a recorded decision all the same
            // (invariant 5), applied below and counted as its outcome;
            // said apart, with who and why.
            warn!(
                txid = txid.txid,
                incarnation = format!("{:016x}", txid.incarnation),
                settled_by = %dtx_tls::logtext::Clean(&answer.settled_by),
                "in-doubt transaction of another incarnation settled by an operator of the cluster: applying {:?}",
                answer.decision
            );
        }
        let (msg, outcome) = match answer.decision {
            Some(DecisionRead::Committed) => (Message::Commit { term: entry.term }, "commit"),
            Some(DecisionRead::Aborted) => (Message::Abort { term: entry.term }, "abort"),
            // The cluster has no record: it never decided COMMIT, and
            // never will (invariant 7), so the transaction is aborted; said
            // apart, since a prepared transaction the cluster does not know
            // is worth an operator's look.
            Some(DecisionRead::UnknownPresumedAbort) => {
                warn!(
                    txid = txid.txid,
                    incarnation = txid.incarnation,
                    "in-doubt transaction unknown to the cluster: presumed abort, rolling it back"
                );
                (Message::Abort { term: entry.term }, "unknown_presumed_abort")
            }
            // Not a transaction of the cluster asked: nothing may be
            // presumed (it may be committed where it was handed out).
            Some(DecisionRead::OtherIncarnation) => {
                metrics::counter!("dtx_participant_recovery_lookups_total", "outcome" => "other_incarnation")
                    .increment(1);
                other.push(txid.txid);
                continue;
            }
            // Still undecided, or an outcome this SDK does not know: keep
            // waiting.
            Some(DecisionRead::Pending) | None => {
                metrics::counter!("dtx_participant_recovery_lookups_total", "outcome" => "pending").increment(1);
                continue;
            }
        };
        metrics::counter!("dtx_participant_recovery_lookups_total", "outcome" => outcome).increment(1);
        match apply_decided(store, *txid, msg).await {
            Ok(false) => {}
            Ok(true) => {
                info!(
                    txid = txid.txid,
                    incarnation = txid.incarnation,
                    "in-doubt transaction resolved by recovery: {msg:?}"
                );
                *resolved += 1;
                if *resolved < total {
                    dtx_failpoint::failpoint!("participant_mid_recovery");
                }
            }
            Err(e) => warn!(
                txid = txid.txid,
                incarnation = txid.incarnation,
                "recovery could not apply {msg:?}: {e}"
            ),
        }
    }
    if !other.is_empty() {
        const SHOWN: usize = 8;
        warn!(
            incarnation = format!("{incarnation:016x}"),
            count = other.len(),
            txids = ?&other[..other.len().min(SHOWN)],
            "in-doubt transactions the cluster did not hand out in this incarnation (another cluster's, or \
             from after the backup this cluster was restored from): nothing is presumed, their records and \
             locks are kept; resolve them with the cluster that handed them out"
        );
    }
    Ok(())
}

/// How often the recovery loop sets the in-doubt gauges
/// (`crate::metrics::report_in_doubt`).
const IN_DOUBT_GAUGES_INTERVAL: Duration = Duration::from_secs(1);

/// `spawn_recovery_with` with the default options, the given interval and
/// this participant's id (as enlisted).
pub fn spawn_recovery<P: Participant>(
    store: Arc<P>,
    endpoints: Vec<String>,
    participant_id: &str,
    interval: Duration,
) -> tokio::task::JoinHandle<()> {
    let opts = RecoveryOptions {
        interval,
        participant_id: participant_id.to_string(),
        ..RecoveryOptions::default()
    };
    spawn_recovery_with(store, endpoints, opts)
}

/// Asks about every in-doubt transaction now, then every `interval` about
/// those older than `prepared_age_min`, logging while the cluster cannot
/// answer (the locks stay held: invariant 5); also garbage-collects decided
/// and READ_ONLY records past `log_retention` (see `collect_decided`). Ends
/// when the returned handle is aborted. Every pass asks through one
/// [`Client`] ([`RecoveryOptions::client_config`]), which keeps its
/// connections and the leader it last heard of.
pub fn spawn_recovery_with<P: Participant>(
    store: Arc<P>,
    endpoints: Vec<String>,
    opts: RecoveryOptions,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let client = opts.client(&endpoints);
        if let Err(e) = &client {
            error!("recovery cannot ask the cluster: {e}");
        }
        let mut age_min = Duration::ZERO;
        let mut next_gc = tokio::time::Instant::now();
        let mut gc_cursor = GcCursor::default();
        let mut next_gauges = tokio::time::Instant::now();
        let mut retention = opts.log_retention;
        if retention.is_some() && opts.participant_id.is_empty() {
            error!(
                "participant log garbage collection is off: RecoveryOptions.participant_id is empty (set it to the id this participant is enlisted with)"
            );
            retention = None;
        }
        loop {
            if let Some(f) = store.stopped_because() {
                // Nothing can be applied any more; the service is expected
                // to stop (`ParticipantStore::stopped`) and be restarted.
                error!("recovery stopped: {f}");
                return;
            }
            if let Some(keep) = retention.filter(|_| tokio::time::Instant::now() >= next_gc) {
                next_gc = tokio::time::Instant::now() + opts.gc_interval;
                let before = crate::store::unix_ms().saturating_sub(keep.as_millis() as u64);
                let gc = collect_with(
                    store.as_ref(),
                    || client.clone(),
                    &opts.participant_id,
                    before,
                    10_000,
                    &mut gc_cursor,
                );
                match gc.await {
                    Ok(0) => {}
                    Ok(n) => info!(forgotten = n, "decided log records garbage-collected"),
                    Err(e) => warn!("log garbage collection waits for the cluster: {e}"),
                }
            }
            if tokio::time::Instant::now() >= next_gauges {
                // At most once a second: a PostgreSQL participant asks its
                // database for these.
                next_gauges = tokio::time::Instant::now() + IN_DOUBT_GAUGES_INTERVAL;
                match store.in_doubt_summary().await {
                    Ok(s) => crate::metrics::report_in_doubt(&opts.participant_id, &s),
                    // The listing below fails too, and says so.
                    Err(e) => tracing::debug!("in-doubt gauges not updated: {e}"),
                }
            }
            let (in_doubt, branches) = match list_in_doubt(store.as_ref(), age_min).await {
                Ok(v) => v,
                Err(e) => {
                    // Never taken as "nothing in doubt": said, counted and
                    // tried again on the next pass.
                    metrics::counter!("dtx_participant_recovery_errors_total").increment(1);
                    error!("recovery pass could not list the in-doubt transactions; trying again: {e}");
                    tokio::time::sleep(opts.interval).await;
                    continue;
                }
            };
            if !branches.is_empty() {
                let pass = match &client {
                    Ok(c) => resolve_branches(store.as_ref(), &branches, c).await,
                    Err(e) => Err(e.clone()),
                };
                match pass {
                    Ok(n) if n > 0 => info!(settled = n, branches = branches.len(), "recovery pass over branches"),
                    Ok(_) => {}
                    Err(e) => warn!(
                        branches = branches.len(),
                        "cluster not answering about branches; holding their work and waiting: {e}"
                    ),
                }
            }
            let doubt = in_doubt.len();
            if doubt > 0 {
                let pass = match &client {
                    Ok(c) => resolve_in_doubt(store.as_ref(), &in_doubt, c).await,
                    Err(e) => Err(e.clone()),
                };
                match pass {
                    Ok(n) if n > 0 => info!(resolved = n, in_doubt = doubt, "recovery pass"),
                    Ok(_) => {}
                    Err(e) => warn!(
                        in_doubt = doubt,
                        "cluster not answering; holding locks and waiting: {e}"
                    ),
                }
            }
            age_min = opts.prepared_age_min;
            tokio::time::sleep(opts.interval).await;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::ParticipantStore;
    use crate::store::Resource;
    use crate::store::Staged;
    use crate::store::View;

    struct Stage;

    impl Resource for Stage {
        fn prepare(&self, _: &View<'_>, txid: GlobalTxid, payload: &[u8], staged: &mut Staged) -> Vote {
            staged.put(format!("staged/{txid}").as_bytes(), payload);
            Vote::Yes
        }
        fn commit(&self, _: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
            staged.delete(format!("staged/{txid}").as_bytes());
            staged.put(format!("applied/{txid}").as_bytes(), b"1");
        }
        fn abort(&self, _: &View<'_>, txid: GlobalTxid, staged: &mut Staged) {
            staged.delete(format!("staged/{txid}").as_bytes());
        }
    }

    /// Invariant 5 and 9: a decision recovery read from the cluster is
    /// applied even when a newer leader's message raised the record's term
    /// after recovery listed it (the listed term is then stale: the
    /// decision goes in the record's term), and is not applied again once
    /// the record is decided (before: a warning on every such race, the
    /// record left for the next pass).
    #[tokio::test]
    async fn a_decision_listed_in_an_older_term_is_applied_in_the_records_term() {
        let d = tempfile::tempdir().unwrap();
        let s = ParticipantStore::open(d.path(), Stage).unwrap();
        let t = GlobalTxid::new(7, 1);
        s.handle(t, Message::Prepare { term: 1 }, b"w").await.unwrap();
        // A newer leader's Prepare again, after recovery listed the record
        // at term 1.
        s.handle(t, Message::Prepare { term: 3 }, b"w").await.unwrap();
        assert_eq!(
            s.handle(t, Message::Commit { term: 1 }, b"")
                .await
                .unwrap_err()
                .to_string(),
            crate::participant::StoreError::Refused(crate::log::Refusal::StaleTerm { got: 1, seen: 3 }).to_string()
        );
        assert!(apply_decided(s.as_ref(), t, Message::Commit { term: 1 }).await.unwrap());
        let e = s.entry(t).unwrap().unwrap();
        assert_eq!((e.state, e.term), (LocalState::Committed, 3));
        assert!(s.view().get(format!("applied/{t}").as_bytes()).unwrap().is_some());
        // Decided here already: nothing to apply, no error.
        assert!(!apply_decided(s.as_ref(), t, Message::Commit { term: 1 }).await.unwrap());
        // A refusal that is not about the term is still an error.
        let fresh = GlobalTxid::new(7, 2);
        assert!(apply_decided(s.as_ref(), fresh, Message::Commit { term: 1 })
            .await
            .is_err());
    }
}
