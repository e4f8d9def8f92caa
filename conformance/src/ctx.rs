//! What every rule's conversation uses: the rule's context (its session,
//! profile, incarnation and the service it may crash), the checks of each
//! kind of answer, and how a rule's end becomes a verdict. The participant
//! rules (`rules`), the crash rules (`crash`) and the step rules (`steps`)
//! stand on it.

use std::sync::Arc;

use dtx_proto::v1 as pb;
use pb::LocalRecord as Rec;
use pb::Vote;
use tonic::Code;

use crate::profile::Profile;
use crate::profile::Target;
use crate::report::Verdict;
use crate::service::Service;
use crate::wire::broken;
use crate::wire::show_record;
use crate::wire::show_vote;
use crate::wire::Reply;
use crate::wire::Session;
use crate::wire::Step;
use crate::wire::Stop;
use crate::wire::Tx;

/// A term the rules use for ordinary messages.
pub(crate) const T: u64 = 10;
/// How long a failing effect read is tried again.
const EFFECT_RETRY: std::time::Duration = std::time::Duration::from_secs(10);
/// The term cleanup aborts use (above every term a rule sends).
pub(crate) const CLEANUP_TERM: u64 = 1_000_000;
/// A payload no service votes on by itself: what a repeated Prepare
/// carries to show the work is not run again.
pub(crate) const OTHER_PAYLOAD: &[u8] = b"dtx-conformance: a payload that is not this transaction's";

/// What a rule ended with when it did not stop early.
pub(crate) enum Done {
    Passed,
    Skipped(String),
}

/// The verdict and detail of a rule that ended with `result`.
pub(crate) fn verdict(result: Step<Done>) -> (Verdict, String) {
    match result {
        Ok(Done::Passed) => (Verdict::Passed, String::new()),
        Ok(Done::Skipped(why)) => (Verdict::Skipped, why),
        Err(Stop::Broken(why)) => (Verdict::Failed, why),
        Err(Stop::Unknown(why)) => (Verdict::Unknown, why),
    }
}

pub(crate) struct Ctx<'a> {
    pub(crate) s: Session,
    pub(crate) p: &'a Profile,
    pub(crate) target: &'a Target,
    /// The service as a process the kit may kill (with `--start`).
    pub(crate) service: Option<Arc<dyn Service>>,
    pub(crate) incarnation: u64,
    pub(crate) next_txid: u64,
    pub(crate) touched: Vec<Tx>,
}

impl Ctx<'_> {
    /// A new transaction of this rule.
    pub(crate) fn tx(&mut self) -> Tx {
        self.next_txid += 1;
        let tx = Tx {
            incarnation: self.incarnation,
            txid: self.next_txid,
        };
        self.touched.push(tx);
        tx
    }

    pub(crate) fn yes(&self) -> Vec<u8> {
        self.p.yes_payload.clone()
    }

    pub(crate) async fn prepare_votes(&mut self, tx: Tx, term: u64, payload: &[u8], want: Vote) -> Step<()> {
        let r = self.s.prepare(tx, term, payload).await;
        let a = answer(r, "Prepare")?;
        if a.vote != want as i32 {
            return broken(format!(
                "Prepare of txid {} (term {term}) answered {}, the rule asks {}",
                tx.txid,
                show_vote(a.vote, &a.reason),
                show_vote(want as i32, "")
            ));
        }
        Ok(())
    }

    pub(crate) async fn one_phase(&mut self, tx: Tx, term: u64, payload: &[u8], committed: bool) -> Step<()> {
        let r = self.s.commit_one_phase(tx, term, payload).await;
        let a = answer(r, "CommitOnePhase")?;
        if a.committed != committed {
            return broken(format!(
                "CommitOnePhase of txid {} answered committed = {}, the rule asks committed = {committed}",
                tx.txid, a.committed
            ));
        }
        Ok(())
    }

    pub(crate) async fn commit_acked(&mut self, tx: Tx, term: u64) -> Step<()> {
        let r = self.s.commit(tx, term).await;
        acked(r, "Commit", tx)
    }

    pub(crate) async fn abort_acked(&mut self, tx: Tx, term: u64) -> Step<()> {
        let r = self.s.abort(tx, term).await;
        acked(r, "Abort", tx)
    }

    pub(crate) async fn commit_refused(&mut self, tx: Tx, term: u64, kind: &str) -> Step<()> {
        let r = self.s.commit(tx, term).await;
        refused(
            r,
            Code::FailedPrecondition,
            kind,
            &format!("Commit of txid {} (term {term})", tx.txid),
        )
    }

    pub(crate) async fn abort_refused(&mut self, tx: Tx, term: u64, kind: &str) -> Step<()> {
        let r = self.s.abort(tx, term).await;
        refused(
            r,
            Code::FailedPrecondition,
            kind,
            &format!("Abort of txid {} (term {term})", tx.txid),
        )
    }

    /// Inquire shows `want` (and the term, when given).
    pub(crate) async fn record(&mut self, tx: Tx, want: Rec, term: Option<u64>) -> Step<()> {
        let r = self.s.inquire(tx).await;
        let a = answer(r, "Inquire")?;
        if a.record != want as i32 {
            return broken(format!(
                "Inquire of txid {} answered {}, the rule asks {}",
                tx.txid,
                show_record(a.record),
                show_record(want as i32)
            ));
        }
        if let Some(t) = term {
            if a.term != t {
                return broken(format!(
                    "Inquire of txid {} answered term {}, the rule asks {t} (the highest term accepted for it)",
                    tx.txid, a.term
                ));
            }
        }
        Ok(())
    }

    /// The effect's value now (`None` without a probe).
    pub(crate) async fn effect(&mut self) -> Step<i64> {
        let Some(e) = self.p.effect.clone() else {
            return Err(Stop::Unknown("no effect probe".into()));
        };
        // A service started again may answer its participant port before
        // whatever the probe reads from: a failed read is tried again for
        // a while before the rule's outcome is unknown.
        let until = tokio::time::Instant::now() + EFFECT_RETRY;
        loop {
            match e.read().await {
                Ok(v) => {
                    self.s.note(format!("effect read: {v}"));
                    return Ok(v);
                }
                Err(_) if tokio::time::Instant::now() < until => {
                    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                }
                Err(e) => return Err(Stop::Unknown(format!("the effect could not be read: {e}"))),
            }
        }
    }

    /// The effect moved by `commits` commits since `before`.
    pub(crate) async fn effect_moved(&mut self, before: i64, commits: i64) -> Step<()> {
        let now = self.effect().await?;
        let want = commits * self.p.effect_per_commit;
        if now - before != want {
            return broken(format!(
                "the effect moved by {} (from {before} to {now}); {commits} commit(s) of the YES work move it by {want}",
                now - before
            ));
        }
        Ok(())
    }
}

/// The answer, or the rule stops (a status breaks it, no answer is
/// unknown).
pub(crate) fn answer<T>(r: Reply<T>, what: &str) -> Step<T> {
    match r {
        Reply::Answer(a) => Ok(a),
        Reply::Status { code, refusal, message } => broken(format!(
            "{what} failed with {code:?}{}: {message}; the rule asks for an answer",
            if refusal.is_empty() {
                String::new()
            } else {
                format!(" (refusal {refusal})")
            }
        )),
        Reply::NoAnswer => Err(Stop::Unknown(format!("{what}: no answer in time"))),
    }
}

/// An optional call: `None` when the participant answers UNIMPLEMENTED.
pub(crate) fn optional<T>(r: Reply<T>, what: &str) -> Step<Option<T>> {
    match r {
        Reply::Status {
            code: Code::Unimplemented,
            ..
        } => Ok(None),
        r => answer(r, what).map(Some),
    }
}

pub(crate) fn acked(r: Reply<pb::ParticipantDecisionResponse>, what: &str, tx: Tx) -> Step<()> {
    let a = answer(r, what)?;
    if !a.applied {
        return broken(format!(
            "{what} of txid {} answered applied = false; the rule asks for an ack (applied = true)",
            tx.txid
        ));
    }
    Ok(())
}

/// The call was refused with `code` and, when `kind` is not empty, the
/// refusal kind `kind` under `x-dtx-refusal`.
pub(crate) fn refused<T: std::fmt::Debug>(r: Reply<T>, code: Code, kind: &str, what: &str) -> Step<()> {
    let asked = if kind.is_empty() {
        format!("{code:?}")
    } else {
        format!("{code:?} with refusal {kind:?} under x-dtx-refusal")
    };
    match r {
        Reply::Status { code: c, refusal, .. } if c == code && (kind.is_empty() || refusal == kind) => Ok(()),
        Reply::Status {
            code: c,
            refusal,
            message,
        } => broken(format!(
            "{what} failed with {c:?} (refusal {refusal:?}): {message}; the rule asks {asked}"
        )),
        Reply::Answer(a) => broken(format!("{what} answered {a:?}; the rule asks {asked}")),
        Reply::NoAnswer => Err(Stop::Unknown(format!("{what}: no answer in time"))),
    }
}
