//! The rules, each a short conversation with the participant that checks
//! one row or column of docs/protocol.md's tables. Each rule runs in an
//! incarnation of its own (a random nonzero id), so its txids are new to
//! the participant, its term floor starts at zero, and what one rule
//! leaves behind never decides another. After each rule the kit aborts
//! every transaction it touched (at a high term, outside the transcript),
//! so a failed rule leaves nothing locked for the next one.

use dtx_proto::v1 as pb;
use pb::DecisionOutcome as Outcome;
use pb::LocalRecord as Rec;
use pb::Vote;
use tonic::Code;

use std::sync::Arc;

use crate::ctx::answer;
use crate::ctx::optional;
use crate::ctx::refused;
use crate::ctx::verdict;
use crate::ctx::Ctx;
use crate::ctx::Done;
use crate::ctx::CLEANUP_TERM;
use crate::ctx::OTHER_PAYLOAD;
use crate::ctx::T;
use crate::profile::Profile;
use crate::profile::Target;
use crate::report::RuleReport;
use crate::report::Verdict;
use crate::service::Service;
use crate::wire::broken;
use crate::wire::show_record;
use crate::wire::show_vote;
use crate::wire::Session;
use crate::wire::Step;
use crate::wire::Tx;

/// One rule: its id, what it asks and where protocol.md says so.
pub struct Rule {
    pub id: &'static str,
    pub title: &'static str,
    pub section: &'static str,
}

const LOG: &str = "protocol.md: Participant log (per txid, at each participant)";
const FENCING: &str = "protocol.md: Fencing";
const ONE_PHASE: &str = "protocol.md: One-phase commit";
const GROUPS_TWO: &str = "protocol.md: Phase two in groups";
const GROUPS_ONE: &str = "protocol.md: Prepares in groups";
const CRASH: &str = "protocol.md: Crash points";
const IDENTITY: &str = "protocol.md: Participant log (per txid, at each participant): Transaction identity";

/// Every rule, in the order the kit runs them.
pub const RULES: &[Rule] = &[
    Rule { id: "prepare.yes", title: "a Prepare of a new transaction votes YES and the log holds PREPARED_YES at its term", section: LOG },
    Rule { id: "prepare.repeat", title: "a repeated Prepare, with the same or another payload, answers the recorded vote without running the work again", section: LOG },
    Rule { id: "prepare.no", title: "a NO vote is recorded ABORTED; a later Prepare votes NO and a Commit is refused", section: LOG },
    Rule { id: "abort.before-prepare", title: "an Abort before any Prepare leaves a tombstone: a late Prepare votes NO, a one-phase commit does not commit", section: LOG },
    Rule { id: "commit.without-prepare", title: "a Commit of a transaction never prepared is refused (commit-without-prepare) and records nothing", section: LOG },
    Rule { id: "commit.repeat", title: "a repeated Commit is acked each time; an Abort after it is refused (abort-after-commit)", section: LOG },
    Rule { id: "abort.repeat", title: "a repeated Abort is acked each time; a Commit after it is refused (commit-after-abort)", section: LOG },
    Rule { id: "read-only", title: "a READ_ONLY vote is recorded PREPARED_READ_ONLY; Commit and Abort are acked and change nothing", section: LOG },
    Rule { id: "participant-id", title: "a message naming another participant is INVALID_ARGUMENT and records nothing", section: LOG },
    Rule { id: "inquire.reads-only", title: "Inquire of an unseen transaction answers NONE and leaves no tombstone", section: LOG },
    Rule { id: "incarnation.separate", title: "the same txid in another incarnation is another transaction, with its own record", section: IDENTITY },
    Rule { id: "fence.phase-two", title: "a Commit or Abort from a term older than the record's is refused (stale-term) and changes nothing", section: FENCING },
    Rule { id: "fence.raised", title: "an accepted message raises the record's term; older terms are refused from then on", section: FENCING },
    Rule { id: "fence.term-floor", title: "a new transaction's Prepare or one-phase commit below the term floor is refused; its Abort still leaves a tombstone", section: FENCING },
    Rule { id: "one-phase.commit", title: "a one-phase commit of YES work commits; a repeat answers committed; an Abort after it is refused", section: ONE_PHASE },
    Rule { id: "one-phase.no", title: "a one-phase commit of NO work does not commit and is recorded ABORTED", section: ONE_PHASE },
    Rule { id: "one-phase.after-prepare", title: "a one-phase commit of a prepared (in-doubt) transaction commits it", section: ONE_PHASE },
    Rule { id: "one-phase.read-only", title: "a one-phase commit of READ_ONLY work answers committed", section: ONE_PHASE },
    Rule { id: "apply-decisions", title: "ApplyDecisions answers each item as its own Commit or Abort would, in order (or UNIMPLEMENTED)", section: GROUPS_TWO },
    Rule { id: "prepare-many", title: "PrepareMany applies its decisions first, then answers each item as its own Prepare would (or UNIMPLEMENTED)", section: GROUPS_ONE },
    Rule { id: "inspect", title: "Inspect shows each record's state, the in-doubt list and the participant id, and changes nothing (or UNIMPLEMENTED)", section: "protocol.md: Recovery at participants" },
    Rule { id: "effect.commit-once", title: "repeated Prepares and Commits apply the work exactly once", section: LOG },
    Rule { id: "effect.one-phase-once", title: "repeated one-phase commits apply the work exactly once", section: ONE_PHASE },
    Rule { id: "effect.abort-nothing", title: "aborted, tombstoned and refused work changes nothing", section: LOG },
    Rule { id: "effect.stale-nothing", title: "a refused stale-term Commit applies nothing; the current term's Commit applies once", section: FENCING },
    Rule { id: "crash.after-yes", title: "a YES answered before a kill -9 is still PREPARED_YES after the restart, and commits once", section: CRASH },
    Rule { id: "crash.in-prepare", title: "killed while preparing: after the restart the record is NONE or PREPARED_YES (YES if it answered YES), and the transaction still ends once", section: CRASH },
    Rule { id: "crash.after-commit", title: "a Commit acked before a kill -9 is still COMMITTED after the restart; a redelivery acks and applies nothing", section: CRASH },
    Rule { id: "crash.in-commit", title: "killed while committing: a redelivered Commit after the restart acks and the work is applied exactly once", section: CRASH },
    Rule { id: "crash.after-abort", title: "a tombstone and an ABORTED record survive a kill -9: a late Prepare votes NO, a Commit is refused", section: CRASH },
    Rule { id: "crash.floor", title: "the term floor survives a kill -9: a new transaction's Prepare from below it is refused", section: CRASH },
    Rule { id: "crash.in-recovery", title: "killed again right after a restart (during its recovery), an in-doubt YES is still PREPARED_YES and commits once", section: CRASH },
];

/// Runs `rule` against `target` in an incarnation of its own.
pub async fn run_one(rule: &Rule, target: &Target, profile: &Profile, service: Option<Arc<dyn Service>>) -> RuleReport {
    let incarnation = loop {
        let i: u64 = rand::random();
        if i != 0 {
            break i;
        }
    };
    let mut report = RuleReport {
        id: rule.id,
        title: rule.title,
        section: rule.section,
        verdict: Verdict::Unknown,
        detail: String::new(),
        transcript: Vec::new(),
        scope: format!("incarnation {incarnation:016x}"),
    };
    let channel = match crate::wire::connect(target) {
        Ok(c) => c,
        Err(e) => {
            report.detail = format!("cannot reach {}: {e}", target.address);
            return report;
        }
    };
    let mut cx = Ctx {
        s: Session::new(target, channel),
        p: profile,
        target,
        service,
        incarnation,
        next_txid: 0,
        touched: Vec::new(),
    };
    let result = dispatch(rule.id, &mut cx).await;
    report.transcript = std::mem::take(&mut cx.s.rec.transcript);
    (report.verdict, report.detail) = verdict(result);
    // Leave nothing prepared behind (outside the transcript).
    for tx in std::mem::take(&mut cx.touched) {
        let _ = cx.s.abort(tx, CLEANUP_TERM).await;
    }
    report
}

async fn dispatch(id: &str, cx: &mut Ctx<'_>) -> Step<Done> {
    let needs_no = || Done::Skipped("the profile gives no payload the service votes NO on (--no-payload)".into());
    let needs_ro =
        || Done::Skipped("the profile gives no payload the service votes READ_ONLY on (--read-only-payload)".into());
    let needs_effect = || Done::Skipped("the profile gives no effect probe (--effect-command)".into());
    let no = cx.p.no_payload.clone();
    let ro = cx.p.read_only_payload.clone();
    let has_effect = cx.p.effect.is_some();
    match id {
        "prepare.yes" => prepare_yes(cx).await,
        "prepare.repeat" => prepare_repeat(cx).await,
        "prepare.no" => match no {
            Some(no) => prepare_no(cx, &no).await,
            None => Ok(needs_no()),
        },
        "abort.before-prepare" => abort_before_prepare(cx).await,
        "commit.without-prepare" => commit_without_prepare(cx).await,
        "commit.repeat" => commit_repeat(cx).await,
        "abort.repeat" => abort_repeat(cx).await,
        "read-only" => match ro {
            Some(ro) => read_only(cx, &ro).await,
            None => Ok(needs_ro()),
        },
        "participant-id" => participant_id(cx).await,
        "inquire.reads-only" => inquire_reads_only(cx).await,
        "incarnation.separate" => incarnation_separate(cx).await,
        "fence.phase-two" => fence_phase_two(cx).await,
        "fence.raised" => fence_raised(cx).await,
        "fence.term-floor" => fence_term_floor(cx).await,
        "one-phase.commit" => one_phase_commit(cx).await,
        "one-phase.no" => match no {
            Some(no) => one_phase_no(cx, &no).await,
            None => Ok(needs_no()),
        },
        "one-phase.after-prepare" => one_phase_after_prepare(cx).await,
        "one-phase.read-only" => match ro {
            Some(ro) => one_phase_read_only(cx, &ro).await,
            None => Ok(needs_ro()),
        },
        "apply-decisions" => apply_decisions(cx).await,
        "prepare-many" => prepare_many(cx).await,
        "inspect" => inspect(cx).await,
        "effect.commit-once" if has_effect => effect_commit_once(cx).await,
        "effect.one-phase-once" if has_effect => effect_one_phase_once(cx).await,
        "effect.abort-nothing" if has_effect => effect_abort_nothing(cx).await,
        "effect.stale-nothing" if has_effect => effect_stale_nothing(cx).await,
        _ if id.starts_with("effect.") => Ok(needs_effect()),
        _ if id.starts_with("crash.") && cx.service.is_none() => Ok(Done::Skipped(
            "the kit did not start the service (--start): it cannot crash it".into(),
        )),
        _ if id.starts_with("crash.") => crate::crash::dispatch(id, cx).await,
        _ => unreachable!("a rule without a body: {id}"),
    }
}

async fn prepare_yes(cx: &mut Ctx<'_>) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.record(tx, Rec::PreparedYes, Some(T)).await?;
    cx.abort_acked(tx, T).await?;
    cx.record(tx, Rec::Aborted, Some(T)).await?;
    Ok(Done::Passed)
}

async fn prepare_repeat(cx: &mut Ctx<'_>) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.prepare_votes(tx, T, OTHER_PAYLOAD, Vote::Yes).await?;
    cx.record(tx, Rec::PreparedYes, Some(T)).await?;
    cx.commit_acked(tx, T).await?;
    // After the decision the recorded vote still answers.
    cx.prepare_votes(tx, T, OTHER_PAYLOAD, Vote::Yes).await?;
    cx.record(tx, Rec::Committed, Some(T)).await?;
    Ok(Done::Passed)
}

async fn prepare_no(cx: &mut Ctx<'_>, no: &[u8]) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(tx, T, no, Vote::No).await?;
    cx.record(tx, Rec::Aborted, None).await?;
    cx.prepare_votes(tx, T, &yes, Vote::No).await?;
    cx.commit_refused(tx, T, "commit-after-abort").await?;
    cx.abort_acked(tx, T).await?;
    cx.record(tx, Rec::Aborted, None).await?;
    Ok(Done::Passed)
}

async fn abort_before_prepare(cx: &mut Ctx<'_>) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.abort_acked(tx, T).await?;
    cx.record(tx, Rec::Tombstone, None).await?;
    cx.prepare_votes(tx, T, &yes, Vote::No).await?;
    cx.one_phase(tx, T, &yes, false).await?;
    cx.commit_refused(tx, T, "commit-after-abort").await?;
    cx.abort_acked(tx, T).await?;
    Ok(Done::Passed)
}

async fn commit_without_prepare(cx: &mut Ctx<'_>) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.commit_refused(tx, T, "commit-without-prepare").await?;
    cx.record(tx, Rec::None, Some(0)).await?;
    // Nothing was recorded: the transaction can still prepare.
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.abort_acked(tx, T).await?;
    Ok(Done::Passed)
}

async fn commit_repeat(cx: &mut Ctx<'_>) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    for _ in 0..3 {
        cx.commit_acked(tx, T).await?;
    }
    cx.record(tx, Rec::Committed, Some(T)).await?;
    cx.abort_refused(tx, T, "abort-after-commit").await?;
    cx.record(tx, Rec::Committed, Some(T)).await?;
    Ok(Done::Passed)
}

async fn abort_repeat(cx: &mut Ctx<'_>) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.abort_acked(tx, T).await?;
    cx.abort_acked(tx, T).await?;
    cx.record(tx, Rec::Aborted, Some(T)).await?;
    cx.prepare_votes(tx, T, &yes, Vote::No).await?;
    cx.commit_refused(tx, T, "commit-after-abort").await?;
    Ok(Done::Passed)
}

async fn read_only(cx: &mut Ctx<'_>, ro: &[u8]) -> Step<Done> {
    let tx = cx.tx();
    cx.prepare_votes(tx, T, ro, Vote::ReadOnly).await?;
    cx.record(tx, Rec::PreparedReadOnly, None).await?;
    cx.prepare_votes(tx, T, ro, Vote::ReadOnly).await?;
    cx.commit_acked(tx, T).await?;
    cx.abort_acked(tx, T).await?;
    cx.record(tx, Rec::PreparedReadOnly, None).await?;
    Ok(Done::Passed)
}

async fn participant_id(cx: &mut Ctx<'_>) -> Step<Done> {
    let tx = cx.tx();
    let other = format!("{}-not-this-one", cx.s.participant_id());
    let msg = pb::PrepareRequest {
        txid: tx.txid,
        term: T,
        participant_id: other.clone(),
        payload: cx.yes(),
        incarnation: tx.incarnation,
    };
    let r = cx.s.prepare_as(msg).await;
    refused(r, Code::InvalidArgument, "", &format!("Prepare addressed to {other:?}"))?;
    cx.record(tx, Rec::None, Some(0)).await?;
    Ok(Done::Passed)
}

async fn inquire_reads_only(cx: &mut Ctx<'_>) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.record(tx, Rec::None, Some(0)).await?;
    cx.record(tx, Rec::None, Some(0)).await?;
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.abort_acked(tx, T).await?;
    Ok(Done::Passed)
}

async fn incarnation_separate(cx: &mut Ctx<'_>) -> Step<Done> {
    let a = cx.tx();
    let b = Tx {
        incarnation: a.incarnation ^ 0x5a5a_5a5a_5a5a_5a5a,
        txid: a.txid,
    };
    cx.touched.push(b);
    let yes = cx.yes();
    cx.prepare_votes(a, T, &yes, Vote::Yes).await?;
    cx.abort_acked(b, T).await?;
    cx.record(b, Rec::Tombstone, None).await?;
    cx.record(a, Rec::PreparedYes, Some(T)).await?;
    cx.prepare_votes(b, T, &yes, Vote::No).await?;
    cx.commit_acked(a, T).await?;
    cx.record(a, Rec::Committed, Some(T)).await?;
    cx.record(b, Rec::Tombstone, None).await?;
    Ok(Done::Passed)
}

async fn fence_phase_two(cx: &mut Ctx<'_>) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(tx, 5, &yes, Vote::Yes).await?;
    cx.commit_refused(tx, 4, "stale-term").await?;
    cx.abort_refused(tx, 4, "stale-term").await?;
    cx.record(tx, Rec::PreparedYes, Some(5)).await?;
    cx.commit_acked(tx, 6).await?;
    cx.record(tx, Rec::Committed, Some(6)).await?;
    cx.abort_refused(tx, 5, "stale-term").await?;
    Ok(Done::Passed)
}

async fn fence_raised(cx: &mut Ctx<'_>) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(tx, 5, &yes, Vote::Yes).await?;
    cx.prepare_votes(tx, 7, &yes, Vote::Yes).await?;
    cx.record(tx, Rec::PreparedYes, Some(7)).await?;
    let r = cx.s.prepare(tx, 6, &yes).await;
    refused(
        r,
        Code::FailedPrecondition,
        "stale-term",
        "Prepare at term 6 after term 7",
    )?;
    cx.abort_refused(tx, 6, "stale-term").await?;
    cx.record(tx, Rec::PreparedYes, Some(7)).await?;
    cx.abort_acked(tx, 7).await?;
    cx.record(tx, Rec::Aborted, Some(7)).await?;
    Ok(Done::Passed)
}

async fn fence_term_floor(cx: &mut Ctx<'_>) -> Step<Done> {
    let first = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(first, 9, &yes, Vote::Yes).await?;
    cx.commit_acked(first, 9).await?;
    let late = cx.tx();
    let r = cx.s.prepare(late, 3, &yes).await;
    refused(
        r,
        Code::FailedPrecondition,
        "stale-term",
        "Prepare of a new txid below the term floor (9)",
    )?;
    cx.record(late, Rec::None, Some(0)).await?;
    let r = cx.s.commit_one_phase(late, 3, &yes).await;
    refused(
        r,
        Code::FailedPrecondition,
        "stale-term",
        "CommitOnePhase of a new txid below the term floor (9)",
    )?;
    cx.record(late, Rec::None, Some(0)).await?;
    let gone = cx.tx();
    cx.abort_acked(gone, 3).await?;
    cx.record(gone, Rec::Tombstone, None).await?;
    let never = cx.tx();
    cx.commit_refused(never, 3, "commit-without-prepare").await?;
    // At the floor the new transaction prepares.
    cx.prepare_votes(late, 9, &yes, Vote::Yes).await?;
    cx.abort_acked(late, 9).await?;
    Ok(Done::Passed)
}

async fn one_phase_commit(cx: &mut Ctx<'_>) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.one_phase(tx, T, &yes, true).await?;
    cx.one_phase(tx, T, &yes, true).await?;
    cx.record(tx, Rec::Committed, Some(T)).await?;
    cx.abort_refused(tx, T, "abort-after-commit").await?;
    cx.commit_acked(tx, T).await?;
    Ok(Done::Passed)
}

async fn one_phase_no(cx: &mut Ctx<'_>, no: &[u8]) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.one_phase(tx, T, no, false).await?;
    cx.record(tx, Rec::Aborted, None).await?;
    cx.one_phase(tx, T, &yes, false).await?;
    cx.commit_refused(tx, T, "commit-after-abort").await?;
    Ok(Done::Passed)
}

async fn one_phase_after_prepare(cx: &mut Ctx<'_>) -> Step<Done> {
    let tx = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.one_phase(tx, T, &yes, true).await?;
    cx.record(tx, Rec::Committed, Some(T)).await?;
    Ok(Done::Passed)
}

async fn one_phase_read_only(cx: &mut Ctx<'_>, ro: &[u8]) -> Step<Done> {
    let tx = cx.tx();
    cx.one_phase(tx, T, ro, true).await?;
    cx.one_phase(tx, T, ro, true).await?;
    Ok(Done::Passed)
}

/// One ApplyDecisions item's result is an ack.
fn item_applied(r: &pb::DecisionItemResult, what: &str) -> Step<()> {
    if r.applied && r.code == 0 {
        Ok(())
    } else {
        broken(format!(
            "{what}: answered code {} refusal {:?} ({}); the rule asks applied, as its own call would be",
            r.code, r.refusal, r.message
        ))
    }
}

/// One item's result is the refusal `code`/`kind` its own call would get.
fn item_refused(r: &pb::DecisionItemResult, code: Code, kind: &str, what: &str) -> Step<()> {
    if !r.applied && r.code == code as i32 && (kind.is_empty() || r.refusal == kind) {
        Ok(())
    } else {
        broken(format!(
            "{what}: answered applied = {} code {} refusal {:?} ({}); the rule asks code {} ({code:?}){}",
            r.applied,
            r.code,
            r.refusal,
            r.message,
            code as i32,
            if kind.is_empty() {
                String::new()
            } else {
                format!(" refusal {kind:?}")
            }
        ))
    }
}

fn results_len<T>(got: &[T], want: usize, what: &str) -> Step<()> {
    if got.len() != want {
        return broken(format!(
            "{what}: {} results for {want} items; the rule asks one per item",
            got.len()
        ));
    }
    Ok(())
}

async fn apply_decisions(cx: &mut Ctx<'_>) -> Step<Done> {
    let inc = cx.incarnation;
    // An empty message tells whether the call is served at all.
    let r = cx.s.apply_decisions(inc, &[]).await;
    let Some(empty) = optional(r, "ApplyDecisions (empty)")? else {
        return Ok(Done::Skipped("the participant does not serve ApplyDecisions (UNIMPLEMENTED): the leader sends it Commit and Abort calls instead".into()));
    };
    results_len(&empty.results, 0, "ApplyDecisions of no items")?;
    let yes = cx.yes();
    let (x, y, z, w) = (cx.tx(), cx.tx(), cx.tx(), cx.tx());
    cx.prepare_votes(x, T, &yes, Vote::Yes).await?;
    let items = [
        (x.txid, T, Outcome::Commit),
        (x.txid, T, Outcome::Commit),
        (y.txid, T, Outcome::Abort),
        (z.txid, T, Outcome::Commit),
        (w.txid, T, Outcome::Unspecified),
    ];
    let r = cx.s.apply_decisions(inc, &items).await;
    let a = answer(r, "ApplyDecisions")?;
    results_len(&a.results, items.len(), "ApplyDecisions")?;
    item_applied(&a.results[0], "item 1 (COMMIT of a prepared txid)")?;
    item_applied(&a.results[1], "item 2 (the same COMMIT again)")?;
    item_applied(&a.results[2], "item 3 (ABORT of an unseen txid: a tombstone)")?;
    item_refused(
        &a.results[3],
        Code::FailedPrecondition,
        "commit-without-prepare",
        "item 4 (COMMIT of an unseen txid)",
    )?;
    item_refused(&a.results[4], Code::InvalidArgument, "", "item 5 (no outcome)")?;
    cx.record(x, Rec::Committed, Some(T)).await?;
    cx.record(y, Rec::Tombstone, None).await?;
    cx.record(z, Rec::None, Some(0)).await?;
    // Fencing per item: the stale one is refused, the next applies.
    let v = cx.tx();
    cx.prepare_votes(v, T, &yes, Vote::Yes).await?;
    let items = [(v.txid, T - 1, Outcome::Abort), (v.txid, T, Outcome::Abort)];
    let r = cx.s.apply_decisions(inc, &items).await;
    let a = answer(r, "ApplyDecisions")?;
    results_len(&a.results, items.len(), "ApplyDecisions")?;
    item_refused(
        &a.results[0],
        Code::FailedPrecondition,
        "stale-term",
        "item 1 (ABORT from an older term)",
    )?;
    item_applied(&a.results[1], "item 2 (ABORT at the record's term)")?;
    cx.record(v, Rec::Aborted, Some(T)).await?;
    Ok(Done::Passed)
}

async fn prepare_many(cx: &mut Ctx<'_>) -> Step<Done> {
    let inc = cx.incarnation;
    let r = cx.s.prepare_many(inc, &[], Vec::new()).await;
    let Some(empty) = optional(r, "PrepareMany (empty)")? else {
        return Ok(Done::Skipped(
            "the participant does not serve PrepareMany (UNIMPLEMENTED): the leader sends it Prepare calls instead"
                .into(),
        ));
    };
    results_len(&empty.results, 0, "PrepareMany of no items")?;
    let yes = cx.yes();
    let (c, a, b) = (cx.tx(), cx.tx(), cx.tx());
    // c holds the YES work; the decision riding in the message releases
    // it before the items prepare the same work again.
    cx.prepare_votes(c, T, &yes, Vote::Yes).await?;
    cx.abort_acked(b, T).await?;
    let decisions = vec![cx.s.decision_item(c, T, Outcome::Commit)];
    let items: [(u64, u64, &[u8]); 3] = [(a.txid, T, &yes), (a.txid, T, OTHER_PAYLOAD), (b.txid, T, &yes)];
    let r = cx.s.prepare_many(inc, &items, decisions).await;
    let m = answer(r, "PrepareMany")?;
    results_len(&m.results, items.len(), "PrepareMany")?;
    results_len(&m.decision_results, 1, "PrepareMany's decisions")?;
    item_applied(&m.decision_results[0], "decision 1 (COMMIT of a prepared txid)")?;
    let want = [
        (
            Vote::Yes,
            "item 1 (a new txid, YES work, after the decision released the same work)",
        ),
        (
            Vote::Yes,
            "item 2 (the same txid again, another payload: the recorded vote)",
        ),
        (Vote::No, "item 3 (a tombstoned txid)"),
    ];
    for (r, (vote, what)) in m.results.iter().zip(want) {
        if r.code != 0 || r.vote != vote as i32 {
            return broken(format!(
                "{what}: answered {} code {} {:?} {}; the rule asks {}",
                show_vote(r.vote, &r.reason),
                r.code,
                r.refusal,
                r.message,
                show_vote(vote as i32, "")
            ));
        }
    }
    cx.record(c, Rec::Committed, Some(T)).await?;
    cx.record(a, Rec::PreparedYes, Some(T)).await?;
    cx.abort_acked(a, T).await?;
    Ok(Done::Passed)
}

async fn inspect(cx: &mut Ctx<'_>) -> Step<Done> {
    let inc = cx.incarnation;
    let yes = cx.yes();
    let (q, r, p, u) = (cx.tx(), cx.tx(), cx.tx(), cx.tx());
    let asked = [p.txid, q.txid, r.txid, u.txid];
    let reply = cx.s.inspect(inc, &[u.txid]).await;
    if optional(reply, "Inspect")?.is_none() {
        return Ok(Done::Skipped(
            "the participant does not serve Inspect (UNIMPLEMENTED)".into(),
        ));
    }
    cx.prepare_votes(q, T, &yes, Vote::Yes).await?;
    cx.commit_acked(q, T).await?;
    cx.abort_acked(r, T).await?;
    cx.prepare_votes(p, T, &yes, Vote::Yes).await?;
    let reply = cx.s.inspect(inc, &asked).await;
    let a = answer(reply, "Inspect")?;
    if a.participant_id != cx.s.participant_id() {
        return broken(format!(
            "Inspect answered participant id {:?}; the kit addressed {:?}",
            a.participant_id,
            cx.s.participant_id()
        ));
    }
    results_len(&a.records, asked.len(), "Inspect's records")?;
    let want = [
        (Rec::PreparedYes, Vote::Yes, true, "the prepared txid"),
        (Rec::Committed, Vote::Yes, false, "the committed txid"),
        (Rec::Tombstone, Vote::Unspecified, false, "the tombstoned txid"),
        (Rec::None, Vote::Unspecified, false, "the unseen txid"),
    ];
    for (i, (rec, (state, vote, in_doubt, what))) in a.records.iter().zip(want).enumerate() {
        if rec.txid != asked[i] || rec.record != state as i32 || rec.vote != vote as i32 || rec.in_doubt != in_doubt {
            return broken(format!(
                "Inspect's record {} ({what}) is txid {} {} vote {} in_doubt {}; the rule asks txid {} {} vote {} in_doubt {in_doubt}",
                i + 1,
                rec.txid,
                show_record(rec.record),
                show_vote(rec.vote, ""),
                rec.in_doubt,
                asked[i],
                show_record(state as i32),
                show_vote(vote as i32, "")
            ));
        }
    }
    if !a.in_doubt.iter().any(|d| d.txid == p.txid && d.incarnation == inc) {
        return broken(format!(
            "Inspect's in-doubt list does not hold txid {} (voted YES, no decision)",
            p.txid
        ));
    }
    if a.in_doubt_count < 1 {
        return broken("Inspect counts no transaction in doubt while one is");
    }
    // Inspect recorded nothing: the unseen txid still prepares.
    cx.abort_acked(p, T).await?;
    cx.prepare_votes(u, T, &yes, Vote::Yes).await?;
    cx.abort_acked(u, T).await?;
    Ok(Done::Passed)
}

async fn effect_commit_once(cx: &mut Ctx<'_>) -> Step<Done> {
    let yes = cx.yes();
    let before = cx.effect().await?;
    let tx = cx.tx();
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.effect_moved(before, 0).await?;
    for _ in 0..3 {
        cx.commit_acked(tx, T).await?;
    }
    cx.effect_moved(before, 1).await?;
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.commit_acked(tx, T + 1).await?;
    cx.effect_moved(before, 1).await?;
    Ok(Done::Passed)
}

async fn effect_one_phase_once(cx: &mut Ctx<'_>) -> Step<Done> {
    let yes = cx.yes();
    let before = cx.effect().await?;
    let tx = cx.tx();
    for _ in 0..3 {
        cx.one_phase(tx, T, &yes, true).await?;
    }
    cx.commit_acked(tx, T).await?;
    cx.effect_moved(before, 1).await?;
    Ok(Done::Passed)
}

async fn effect_abort_nothing(cx: &mut Ctx<'_>) -> Step<Done> {
    let yes = cx.yes();
    let before = cx.effect().await?;
    let aborted = cx.tx();
    cx.prepare_votes(aborted, T, &yes, Vote::Yes).await?;
    cx.abort_acked(aborted, T).await?;
    cx.abort_acked(aborted, T).await?;
    cx.commit_refused(aborted, T, "commit-after-abort").await?;
    let tomb = cx.tx();
    cx.abort_acked(tomb, T).await?;
    cx.prepare_votes(tomb, T, &yes, Vote::No).await?;
    cx.one_phase(tomb, T, &yes, false).await?;
    let never = cx.tx();
    cx.commit_refused(never, T, "commit-without-prepare").await?;
    cx.effect_moved(before, 0).await?;
    Ok(Done::Passed)
}

async fn effect_stale_nothing(cx: &mut Ctx<'_>) -> Step<Done> {
    let yes = cx.yes();
    let before = cx.effect().await?;
    let tx = cx.tx();
    cx.prepare_votes(tx, 5, &yes, Vote::Yes).await?;
    cx.commit_refused(tx, 4, "stale-term").await?;
    cx.effect_moved(before, 0).await?;
    cx.commit_acked(tx, 5).await?;
    cx.commit_refused(tx, 4, "stale-term").await?;
    cx.effect_moved(before, 1).await?;
    Ok(Done::Passed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_rule_has_a_body_and_a_unique_id() {
        let mut ids: Vec<&str> = RULES.iter().map(|r| r.id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), RULES.len(), "rule ids repeat");
        // `dispatch` panics on an id without a body; the names it knows:
        let src = [include_str!("rules.rs"), include_str!("crash.rs")].concat();
        for r in RULES {
            assert!(
                src.contains(&format!("\"{}\" =>", r.id)) || src.contains(&format!("\"{}\" if", r.id)),
                "rule {} has no arm in dispatch",
                r.id
            );
        }
    }
}
