//! The crash rules: the kit started the service (`--start`), so it can
//! kill it with SIGKILL after an answer, or while a call is in flight (a
//! kill a few milliseconds after the call left, so it lands before,
//! during or after the service's write), then start it again on the same
//! data and check what it answers. A correct participant is right
//! whichever moment the kill hits: every check below accepts each state
//! the protocol allows at that moment and nothing else.

use dtx_proto::v1 as pb;
use pb::LocalRecord as Rec;
use pb::Vote;

use crate::ctx::Ctx;
use crate::ctx::Done;
use crate::ctx::OTHER_PAYLOAD;
use crate::ctx::T;
use crate::service;
use crate::wire::broken;
use crate::wire::show_record;
use crate::wire::Reply;
use crate::wire::Session;
use crate::wire::Step;
use crate::wire::Stop;
use crate::wire::Tx;

impl Ctx<'_> {
    /// Kills the service with SIGKILL, starts it again and reconnects;
    /// both noted in the transcript.
    async fn crash(&mut self, when: &str) -> Step<()> {
        let service = self.service.clone().expect("crash rules run with a service");
        service::kill(service.as_ref()).await?;
        self.s.note(format!("kill -9 ({when})"));
        service::restart(service.as_ref()).await?;
        self.s.note("started again on the same data".into());
        self.reconnect()
    }

    /// A fresh connection (the old one died with the process), keeping
    /// the transcript.
    fn reconnect(&mut self) -> Step<()> {
        let channel = crate::wire::connect(self.target).map_err(Stop::Unknown)?;
        let transcript = std::mem::take(&mut self.s.rec.transcript);
        self.s = Session::new(self.target, channel);
        self.s.rec.transcript = transcript;
        Ok(())
    }

    /// The record's state now (any).
    async fn record_now(&mut self, tx: Tx) -> Step<pb::InquireResponse> {
        let r = self.s.inquire(tx).await;
        crate::ctx::answer(r, "Inquire")
    }

    /// The effect now, when the profile has a probe.
    async fn effect_if_any(&mut self) -> Step<Option<i64>> {
        if self.p.effect.is_none() {
            return Ok(None);
        }
        self.effect().await.map(Some)
    }

    async fn effect_moved_if_any(&mut self, before: Option<i64>, commits: i64) -> Step<()> {
        match before {
            Some(b) => self.effect_moved(b, commits).await,
            None => Ok(()),
        }
    }

    /// Sends `call` on a connection of its own and kills the service a
    /// few milliseconds later, then starts it again; what the call got
    /// (an answer if it beat the kill).
    async fn kill_during<T, F, Fut>(&mut self, what: &str, call: F) -> Step<Reply<T>>
    where
        T: Send + 'static,
        F: FnOnce(Session) -> Fut,
        Fut: std::future::Future<Output = (Session, Reply<T>)> + Send + 'static,
    {
        let channel = crate::wire::connect(self.target).map_err(Stop::Unknown)?;
        let side = Session::new(self.target, channel);
        let service = self.service.clone().expect("crash rules run with a service");
        let ((side, reply), delay_us) = service::kill_during(service.as_ref(), call(side)).await?;
        for line in side.rec.transcript {
            self.s.note(line);
        }
        self.s.note(format!("kill -9 {delay_us} us after {what} left"));
        service::restart(service.as_ref()).await?;
        self.s.note("started again on the same data".into());
        self.reconnect()?;
        Ok(reply)
    }
}

pub(crate) async fn dispatch(id: &str, cx: &mut Ctx<'_>) -> Step<Done> {
    match id {
        "crash.after-yes" => after_yes(cx).await,
        "crash.in-prepare" => in_prepare(cx).await,
        "crash.after-commit" => after_commit(cx).await,
        "crash.in-commit" => in_commit(cx).await,
        "crash.after-abort" => after_abort(cx).await,
        "crash.floor" => floor(cx).await,
        "crash.in-recovery" => in_recovery(cx).await,
        _ => unreachable!("a crash rule without a body: {id}"),
    }
}

async fn after_yes(cx: &mut Ctx<'_>) -> Step<Done> {
    let before = cx.effect_if_any().await?;
    let tx = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.crash("after the YES answer").await?;
    cx.record(tx, Rec::PreparedYes, Some(T)).await?;
    cx.prepare_votes(tx, T, OTHER_PAYLOAD, Vote::Yes).await?;
    cx.commit_acked(tx, T).await?;
    cx.effect_moved_if_any(before, 1).await?;
    Ok(Done::Passed)
}

async fn in_prepare(cx: &mut Ctx<'_>) -> Step<Done> {
    let before = cx.effect_if_any().await?;
    let tx = cx.tx();
    let yes = cx.yes();
    let payload = yes.clone();
    let reply = cx
        .kill_during("Prepare", move |mut s| async move {
            let r = s.prepare(tx, T, &payload).await;
            (s, r)
        })
        .await?;
    let answered_yes = matches!(&reply, Reply::Answer(a) if a.vote == Vote::Yes as i32);
    let now = cx.record_now(tx).await?;
    let allowed = if answered_yes {
        now.record == Rec::PreparedYes as i32
    } else {
        now.record == Rec::PreparedYes as i32 || now.record == Rec::None as i32
    };
    if !allowed {
        return broken(format!(
            "after the restart Inquire answers {}; {} (the call {})",
            show_record(now.record),
            if answered_yes {
                "the participant had answered YES, so its vote must be durable: PREPARED_YES"
            } else {
                "a Prepare cut short leaves NONE or PREPARED_YES"
            },
            if answered_yes {
                "was answered YES"
            } else {
                "got no answer"
            }
        ));
    }
    // Whatever the kill left, the transaction still prepares and ends once.
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.commit_acked(tx, T).await?;
    cx.record(tx, Rec::Committed, Some(T)).await?;
    cx.effect_moved_if_any(before, 1).await?;
    Ok(Done::Passed)
}

async fn after_commit(cx: &mut Ctx<'_>) -> Step<Done> {
    let before = cx.effect_if_any().await?;
    let tx = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.commit_acked(tx, T).await?;
    cx.crash("after the Commit's ack").await?;
    cx.record(tx, Rec::Committed, Some(T)).await?;
    cx.commit_acked(tx, T).await?;
    cx.effect_moved_if_any(before, 1).await?;
    Ok(Done::Passed)
}

async fn in_commit(cx: &mut Ctx<'_>) -> Step<Done> {
    let before = cx.effect_if_any().await?;
    let tx = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    let reply = cx
        .kill_during("Commit", move |mut s| async move {
            let r = s.commit(tx, T).await;
            (s, r)
        })
        .await?;
    let acked = matches!(&reply, Reply::Answer(a) if a.applied);
    let now = cx.record_now(tx).await?;
    let allowed = if acked {
        now.record == Rec::Committed as i32
    } else {
        now.record == Rec::Committed as i32 || now.record == Rec::PreparedYes as i32
    };
    if !allowed {
        return broken(format!(
            "after the restart Inquire answers {}; {}",
            show_record(now.record),
            if acked {
                "the Commit had been acked, so it must be COMMITTED"
            } else {
                "a Commit cut short leaves PREPARED_YES or COMMITTED"
            }
        ));
    }
    cx.commit_acked(tx, T).await?;
    cx.record(tx, Rec::Committed, Some(T)).await?;
    cx.effect_moved_if_any(before, 1).await?;
    Ok(Done::Passed)
}

async fn after_abort(cx: &mut Ctx<'_>) -> Step<Done> {
    let before = cx.effect_if_any().await?;
    let yes = cx.yes();
    let tomb = cx.tx();
    cx.abort_acked(tomb, T).await?;
    let aborted = cx.tx();
    cx.prepare_votes(aborted, T, &yes, Vote::Yes).await?;
    cx.abort_acked(aborted, T).await?;
    cx.crash("after the Aborts' acks").await?;
    cx.record(tomb, Rec::Tombstone, None).await?;
    cx.prepare_votes(tomb, T, &yes, Vote::No).await?;
    cx.record(aborted, Rec::Aborted, None).await?;
    cx.commit_refused(aborted, T, "commit-after-abort").await?;
    cx.effect_moved_if_any(before, 0).await?;
    Ok(Done::Passed)
}

async fn floor(cx: &mut Ctx<'_>) -> Step<Done> {
    let yes = cx.yes();
    let first = cx.tx();
    cx.prepare_votes(first, 9, &yes, Vote::Yes).await?;
    cx.commit_acked(first, 9).await?;
    cx.crash("after a commit at term 9").await?;
    let late = cx.tx();
    let r = cx.s.prepare(late, 3, &yes).await;
    crate::ctx::refused(
        r,
        tonic::Code::FailedPrecondition,
        "stale-term",
        "Prepare of a new txid below the term floor (9) after the restart",
    )?;
    cx.record(late, Rec::None, Some(0)).await?;
    Ok(Done::Passed)
}

async fn in_recovery(cx: &mut Ctx<'_>) -> Step<Done> {
    let before = cx.effect_if_any().await?;
    let tx = cx.tx();
    let yes = cx.yes();
    cx.prepare_votes(tx, T, &yes, Vote::Yes).await?;
    cx.crash("with a YES in doubt").await?;
    // Killed again as soon as it answers: its recovery has just begun.
    cx.crash("right after the restart, during recovery").await?;
    cx.record(tx, Rec::PreparedYes, Some(T)).await?;
    cx.commit_acked(tx, T).await?;
    cx.record(tx, Rec::Committed, Some(T)).await?;
    cx.effect_moved_if_any(before, 1).await?;
    Ok(Done::Passed)
}
